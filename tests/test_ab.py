"""The one A/B method (serverbench/schema/ab.py) on synthetic runs whose answer the test plants itself: a drift of
the machine shared by the two runs of a round, noise of their own, and B a known share slower."""

from __future__ import annotations

import math
import re

import numpy as np
import pandas as pd
import pytest

from bench.resolution_report import INTERVAL_METHODS
from serverbench.records.comparison import better_when_higher, compare_rows, figures_by_round
from serverbench.schema.ab import compare_ab, repeats_to_resolve

DRIFT_SD = 0.08  # between invocations: the VM's 8 % CV (the identity server at batch 64)
PAIR_SD = 0.02  # within a round, each run's own noise


def rounds(rng: np.random.Generator, n: int, slowdown_pct: float) -> tuple[np.ndarray, np.ndarray]:
    """n rounds of throughputs: A, and B taking `slowdown_pct` % longer per sample, both moved by the round's drift."""
    drift = np.exp(rng.normal(0, DRIFT_SD, n))
    a = 1000 * drift * np.exp(rng.normal(0, PAIR_SD, n))
    b = 1000 * drift * np.exp(rng.normal(0, PAIR_SD, n)) / (1 + slowdown_pct / 100)
    return a, b


def test_a_planted_slowdown_is_named_with_its_interval_holding_the_planted_ratio() -> None:
    a, b = rounds(np.random.default_rng(3), 7, 10.0)
    found = compare_ab(a, b, higher_is_better=True, a_name="base", b_name="head")
    assert found.verdict == "slower"
    assert found.low < 1 / 1.10 < found.high  # the planted ratio is inside the interval
    assert re.fullmatch(
        r"head is \d+\.\d % slower than base \(throughput head/base 0\.\d{3}, 95 % interval 0\.\d{3} to 0\.\d{3}, "
        r"7 pairs\)",
        found.text,
    ), found.text


def test_pairing_by_round_removes_the_drift_that_hides_the_difference_from_unpaired_runs() -> None:
    """The same runs, once paired by round and once with B's rounds shuffled: only the pairing sees 5 %."""
    rng = np.random.default_rng(11)
    a, b = rounds(rng, 7, 5.0)
    assert compare_ab(a, b, True).verdict == "slower"
    assert compare_ab(a, rng.permutation(b), True).verdict == "cannot tell"


@pytest.mark.parametrize("method", sorted(INTERVAL_METHODS))
def test_false_positives_at_no_difference_and_detection_of_five_percent(method: str) -> None:
    """400 trials of 7 rounds each: with nothing planted a call in at most 8 % (nominal 5 %); with 5 % planted
    (4 % of pair noise: sd 2.8 % of a ratio) 'slower' in at least 80 %."""
    rng = np.random.default_rng(5)
    called = sum(
        compare_ab(*rounds(rng, 7, 0.0), True, method=INTERVAL_METHODS[method]).verdict != "cannot tell"
        for _ in range(400)
    )
    detected = sum(
        compare_ab(*rounds(rng, 7, 5.0), True, method=INTERVAL_METHODS[method]).verdict == "slower" for _ in range(400)
    )
    if method == "bootstrap":  # resampling 7 pairs gives too narrow an interval: bench.resolution's reason not to
        assert called / 400 > 0.08
    else:
        assert called / 400 <= 0.08
    assert detected / 400 >= 0.80


def test_cannot_tell_says_how_many_repeats_would_and_that_many_do() -> None:
    """The advice's repeats, run: they detect the difference in about 80 % of trials."""
    rng = np.random.default_rng(8)
    a, b = rounds(rng, 5, 1.0)
    found = compare_ab(a, b, True, "A", "B")
    assert found.verdict == "cannot tell"
    match = re.search(r"about (\d+) repeats would resolve a (\d+\.\d) % difference", found.text)
    assert match, found.text
    assert "95 % interval" in found.text and found.text.startswith("cannot tell B and A apart at this noise")
    needed = repeats_to_resolve(PAIR_SD * math.sqrt(2), 3.0)
    hits = sum(compare_ab(*rounds(rng, needed, 3.0), True).verdict == "slower" for _ in range(300))
    assert 0.70 <= hits / 300 <= 0.92, (needed, hits)


def test_a_difference_past_100_percent_gets_advice_it_can_take_and_identical_figures_no_advice() -> None:
    """A rate 3.9 times another's over two noisy pairs cannot be told apart yet, and a few more pairs would (not
    "more than 10000"); figures equal in every pair are the same, not "about 2 repeats would resolve 1 %"."""
    wild = compare_ab([100.0, 100.0], [120.0, 1200.0], True, "A", "B")
    assert wild.verdict == "cannot tell" and wild.ratio > 3, wild.text
    match = re.search(r"about (\d+) repeats would resolve a (\d+\.\d) % difference", wild.text)
    assert match and int(match.group(1)) <= 20, wild.text  # 14 here
    same = compare_ab([50.0] * 5, [50.0] * 5, True, "A", "B")
    assert same.text == "B and A gave the same throughput in each of 5 pairs: no difference", same.text
    assert "repeats" not in same.short and "the same in every pair" in same.short


def test_latency_is_better_lower_and_the_rank_interval_needs_six_pairs() -> None:
    slower = compare_ab([1.0, 1.1, 0.9, 1.0], [1.2, 1.32, 1.08, 1.2], higher_is_better=False, column="p99_latency_s")
    assert slower.verdict == "slower" and slower.difference_pct == pytest.approx(20.0)
    rank = INTERVAL_METHODS["signed_rank"]  # bench.resolution's alternative
    few = compare_ab([1.0] * 5, [2.0, 2.1, 1.9, 2.0, 2.05], True, method=rank)
    assert few.verdict == "cannot tell" and "unbounded with so few pairs" in few.text
    assert compare_ab([1.0] * 6, [2.0, 2.1, 1.9, 2.0, 2.05, 2.2], True, method=rank).verdict == "faster"
    assert compare_ab([1.0], [2.0], True) is None  # one pair: no interval at all


def test_rows_pair_by_repeat_whatever_their_order_and_only_rounds_both_ran_ok() -> None:
    base = pd.DataFrame({"repeat": [0, 1, 2, 3], "status": ["ok"] * 4, "throughput": [100.0, 200.0, 300.0, 50.0]})
    other = pd.DataFrame(
        {"repeat": [2, 0, 1, 3], "status": ["ok", "ok", "ok", "oom"], "throughput": [270.0, 90.0, 180.0, 1.0]}
    )
    found = compare_rows(base, other, "throughput", "base", "other")
    assert found.pairs == 3 and found.ratio == pytest.approx(0.9) and found.verdict == "slower"
    # plain server.py runs all write repeat 0: their rows pair by order instead of collapsing into one
    plain = compare_rows(base.assign(repeat=0), other.sort_values("repeat").assign(repeat=0), "throughput", "a", "b")
    assert plain.pairs == 3 and plain.ratio == pytest.approx(0.9)
    # a round run twice (repeat 1 again, last) counts once, by its last run: by row order it paired round 1's
    # rerun with base's round 3 and shifted the rest, silently
    rerun = pd.concat([other.iloc[:3], pd.DataFrame({"repeat": [1], "status": ["ok"], "throughput": [180.0]})])
    rerun.iloc[2, rerun.columns.get_loc("throughput")] = 999.0  # the first run of round 1, replaced by the rerun
    again = compare_rows(base, rerun, "throughput", "base", "other")
    assert again.pairs == 3 and again.ratio == pytest.approx(0.9)


def test_which_side_is_better_comes_from_the_columns_unit() -> None:
    assert better_when_higher("throughput") and better_when_higher("goodput_samples_per_s")
    assert better_when_higher("efficiency") and better_when_higher("achieved_rate_rps")
    assert better_when_higher("p99_latency_s") is False and better_when_higher("average_latency") is False
    assert better_when_higher("padding_pct") is None and better_when_higher("wrong_outputs") is None
    with pytest.raises(ValueError, match="neither a rate nor a time"):
        compare_rows(
            pd.DataFrame({"padding_pct": [1.0]}), pd.DataFrame({"padding_pct": [2.0]}), "padding_pct", "a", "b"
        )


def test_normalising_divides_throughput_by_the_machine_speed_and_leaves_the_rest() -> None:
    rows = pd.DataFrame(
        {
            "repeat": [0, 1],
            "status": ["ok", "ok"],
            "device": ["cpu", "cpu"],
            "throughput": [100.0, 90.0],
            "p99_latency_s": [1.0, 1.1],
            "machine_speed_before": [10.0, 9.0],
            "machine_speed_after": [10.0, 9.0],
        }
    )
    assert list(figures_by_round(rows, "throughput", normalise=True)) == pytest.approx([10.0, 10.0])
    # a latency under queueing does not follow the machine's speed: measured for throughput only
    assert list(figures_by_round(rows, "p99_latency_s", normalise=True)) == [1.0, 1.1]
    assert list(figures_by_round(rows, "throughput", normalise=False)) == [100.0, 90.0]
    on_gpu = rows.assign(device="cuda:0")  # the probe times the host, which a GPU row's figure does not follow
    assert list(figures_by_round(on_gpu, "throughput", normalise=True)) == [100.0, 90.0]


def test_both_sides_are_normalised_or_neither() -> None:
    """A base commit's rows from before the probe have no speed: then the head's are compared raw too."""
    head = pd.DataFrame(
        {
            "repeat": [0, 1, 2],
            "status": ["ok"] * 3,
            "device": ["cpu"] * 3,
            "throughput": [90.0, 99.0, 81.0],
            "machine_speed_before": [1.0, 1.1, 0.9],
            "machine_speed_after": [1.0, 1.1, 0.9],
        }
    )
    old_base = head[["repeat", "status", "device"]].assign(throughput=[100.0, 110.0, 90.0])
    raw = compare_rows(old_base, head, "throughput", "base", "head")
    assert raw.column == "throughput" and raw.ratio == pytest.approx(0.9)
    base = old_base.assign(machine_speed_before=[1.0, 1.1, 0.9], machine_speed_after=[1.0, 1.1, 0.9])
    both = compare_rows(base, head, "throughput", "base", "head")
    assert (
        both.column == "throughput per machine speed (each run's over its speed probe)"
        and both.ratio == pytest.approx(0.9)
    )
    # probed beside another instance's probe: another machine, so both stay raw
    other_instances = compare_rows(base.assign(instances=1), head.assign(instances=2), "throughput", "a", "b")
    assert other_instances.column == "throughput"
    # A probe of 0, below 0 or infinite is no speed: both sides stay raw and every round still pairs (it dropped
    # them all before: "needs 2+ rounds with both ok").
    for broken in (0.0, -1.0, float("inf")):
        bad = head.assign(machine_speed_before=[1.0, broken, 0.9])
        found = compare_rows(base, bad, "throughput", "base", "head")
        assert found is not None and found.column == "throughput" and found.pairs == 3, broken


def test_a_rounds_order_is_the_seeds_and_the_keys_alone() -> None:
    """One shuffle for every study and sweep: the same seed and key give the same order, rounds differ, and a repeat
    number as the key keeps the orders earlier sweeps ran in (resumed sweeps and reruns meet the same order)."""
    import random

    from serverbench.schema.ab import shuffled

    items = list(range(20))
    assert shuffled(items, 7, 3) == shuffled(items, 7, 3) and items == list(range(20))  # the input is left alone
    historical = list(range(20))
    random.Random(7 * 1_000_003 + 3).shuffle(historical)
    assert shuffled(items, 7, 3) == historical
    assert shuffled(items, 7, 3) != shuffled(items, 7, 4) and sorted(shuffled(items, 7, "http", 3)) == items
    assert shuffled(items, 7, "http", 3) != shuffled(items, 7, "grpc", 3)
