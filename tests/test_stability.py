"""bench.stability's verdicts, from hand-made rows: the CV over invocations and every row's efficiency against the
targets, and a failed run never counted as a pass."""

from __future__ import annotations

import pandas as pd

from bench.stability import SUITES, evaluate

RESNET = next(s for s in SUITES if s.name == "resnet18")


def _rows(
    experiment: str, throughputs: list[float], efficiencies: list[float], status: str = "ok", speeds: list | None = None
) -> list[dict]:
    speeds = speeds or [None] * len(throughputs)
    return [
        {
            "experiment": experiment,
            "repeat": i,
            "status": status,
            "device": "cpu",
            "throughput": t,
            "efficiency": e,
            "ceiling_throughput": t / e,
            "windows": 3,
            "stable": True,
            "machine_speed_before": s,
            "machine_speed_after": s,
        }
        for i, (t, e, s) in enumerate(zip(throughputs, efficiencies, speeds))
    ]


def test_targets_are_met_only_when_the_cv_and_every_efficiency_are_within_them() -> None:
    runs = pd.DataFrame(
        _rows("serial", [100, 101, 99, 100, 100], [0.9, 0.95, 0.9, 1.0, 0.92])
        + _rows("pipelined_2w", [100, 120, 80, 100, 100], [0.9, 1.1, 0.9, 0.9, 0.9], speeds=[50, 60, 40, 50, 50])
    )
    lines, verdicts = evaluate(runs, RESNET)
    met = {v.text.split(":")[0] + ":" + v.text.split(":")[1].split()[0]: v.met for v in verdicts}
    assert met == {
        "pipelined_2w:throughput": False,
        "pipelined_2w:efficiency": False,
        "serial:throughput": True,
        "serial:efficiency": True,
    }
    serial = next(line for line in lines if line.startswith("| serial "))
    assert "| 100.0, 101.0, 99.0, 100.0, 100.0 | 100.0 | 0.7 % | n/a | 0.900-1.000 | 3, 3, 3, 3, 3 | 5/5 |" in serial
    # pipelined_2w's throughput moved with the machine's speed: divided by it, nothing is left
    pipelined = next(line for line in lines if line.startswith("| pipelined_2w "))
    assert "| 100.0 | 14.1 % | 0.0 % |" in pipelined


def test_a_failed_invocation_is_a_verdict_of_its_own() -> None:
    runs = pd.DataFrame(
        _rows("serial", [100, 100], [0.9, 0.9])
        + [
            {
                "experiment": "serial",
                "repeat": 2,
                "status": "timeout",
                "throughput": None,
                "efficiency": None,
                "ceiling_throughput": None,
                "windows": None,
                "stable": None,
            }
        ]
    )
    _, verdicts = evaluate(runs, RESNET)
    assert any(not v.met and "1 of 3 runs failed" in v.text for v in verdicts)


def test_each_invocation_says_whether_the_machine_was_quiet_and_no_bare_efficiency_above_1_05() -> None:
    from bench.stability import efficiency_verdicts, noise_table

    rows = pd.DataFrame(_rows("serial", [100, 110, 90], [0.97, 1.10, 1.08]))
    rows["efficiency_low"] = [0.93, 0.98, 1.02]  # the second holds 1: within noise; the third does not
    rows["efficiency_high"] = [1.01, 1.20, 1.12]
    rows["noise_warning"] = ["", "", "the host took 4.0 % of the CPUs (steal)"]
    rows["noisy_windows"] = [0, 2, 0]
    table = noise_table(rows)
    assert table[2].endswith("| yes |") and "0.970 (0.930-1.010)" in table[2]
    assert table[3].endswith("| no: noisy windows |") and table[4].endswith("(steal) |")
    [verdict] = efficiency_verdicts(rows)
    assert not verdict.met and verdict.text.startswith("1 row(s) with efficiency above 1.05")
    [verdict] = efficiency_verdicts(rows.iloc[:2])
    assert verdict.met
