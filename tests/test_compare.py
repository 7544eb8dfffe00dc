"""bench.compare's plan and table, on hand-made rows: every configuration interleaved per round, ratios against
the reference-like runs of the same model, and the targets checked on what was measured."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd

from bench import compare
from bench.compare import (
    COMPILE,
    FASTEST,
    REFERENCE_LIKE,
    CopyBandwidth,
    cells,
    configs,
    measure_copy_bandwidth,
    summarise,
)
from bench.study import build_parser


def test_configurations_and_their_interleaved_order() -> None:
    found = configs(["identity", "resnet18"], ["fp32", "bf16"], FASTEST["cpu"], COMPILE["cpu"])
    names = [c.experiment for c in found]
    assert names[:5] == [
        "identity.reference_like",
        "identity.fastest_float32_fp32",
        "identity.fastest_uint8_fp32",
        "identity.fastest_float32_bf16",
        "identity.fastest_uint8_bf16",
    ]
    reference = found[0]
    assert reference.flags[: len(REFERENCE_LIKE)] == REFERENCE_LIKE and not reference.compile
    assert ("--transport", "shm") == tuple(found[1].flags[2:4]) and found[2].flags.count("uint8") == 1
    # On the CPU the identity model runs eager (inductor's mean is slower) and resnet18 compiled.
    compiled = {c.experiment: c.compile for c in found if c.name != "reference_like"}
    assert not compiled["identity.fastest_uint8_fp32"] and compiled["resnet18.fastest_uint8_fp32"]
    assert "--compile_decode" in found[2].flags and "--design" in found[2].flags
    args = build_parser(compare.STUDY).parse_args(["--repeats", "3", "--device", "cpu", "--precisions", "fp32", "bf16"])
    bandwidth, *order = cells(args, None)
    assert bandwidth.experiment.name == compare.BANDWIDTH and bandwidth.experiment.measure is not None  # first
    assert len(order) == 3 * len(found)
    for repeat in range(3):  # each round holds every configuration once, in its own shuffled order
        round_cells = order[repeat * len(found) : (repeat + 1) * len(found)]
        assert sorted(cell.experiment.name for cell in round_cells) == sorted(names)
        assert {cell.repeat for cell in round_cells} == {repeat}
    assert [c.experiment.name for c in order[: len(found)]] != names  # shuffled
    assert cells(args, None)[1:] == order  # reproducibly: a resumed comparison runs what is left
    iters = {c.experiment.name: c.experiment.flags[-1] for c in order if c.experiment.flags[-2] == "--num_iters"}
    assert iters["identity.reference_like"] == "200" and iters["resnet18.reference_like"] == "24"


def _rows() -> pd.DataFrame:
    rows = []
    for repeat in range(3):
        for name, throughput, efficiency in (
            ("reference_like", 1000 + 10 * repeat, 0.02),
            ("fastest_float32_fp32", 7000 + 10 * repeat, 0.1),
            ("fastest_uint8_fp32", 9000 + 10 * repeat, 0.2),
        ):
            rows.append(
                {
                    "experiment": f"identity.{name}",
                    "status": "ok",
                    "throughput": throughput,
                    "p50_latency_s": 0.03,
                    "p99_latency_s": 0.05,
                    "efficiency": efficiency,
                }
            )
        rows.append(
            {
                "experiment": "resnet18.fastest_float32_fp32",
                "status": "ok",
                "throughput": 50,
                "p50_latency_s": 1.0,
                "p99_latency_s": 2.0,
                "efficiency": 0.95,
            }
        )
    rows.append(
        {
            "experiment": "resnet18.reference_like",
            "status": "error",
            "throughput": None,
            "p50_latency_s": None,
            "p99_latency_s": None,
            "efficiency": None,
        }
    )
    return pd.DataFrame(rows)


def test_table_ratios_and_target_checks() -> None:
    found = [
        c
        for c in configs(["identity", "resnet18"], ["fp32"], FASTEST["cpu"], COMPILE["cpu"])
        if c.name != "fastest_uint8_fp32" or c.model == "identity"
    ]
    bandwidth = CopyBandwidth(request_bytes=64 * 3 * 250 * 250 * 4, two_copies_s=0.005, threads=2)
    table, checks = summarise(_rows(), found, bandwidth, batch_size=64, device_kind="cpu")
    rows = [line for line in table.splitlines()[2:] if line.startswith("|")]
    lines = {line.split("|")[1].strip() + "." + line.split("|")[2].strip(): line for line in rows}
    verdicts = [line for line in table.splitlines() if line.startswith("- ")]
    assert (
        verdicts[0].startswith("- identity.fastest_float32_fp32 is ")
        and "% faster than identity.reference_like (" in (verdicts[0])
    )
    assert "| 3/3 | 1010.0 ± 10.0 |" in lines["identity.reference_like"]
    assert re.search(
        r"\| 6\.9\d{2} \[\d\.\d{3}, \d\.\d{3}\]: \d+\.\d % faster \|", lines["identity.fastest_float32_fp32"]
    )
    assert "| 0/1 |" in lines["resnet18.reference_like"]  # a failed run is counted, not averaged
    assert "n/a (needs 2+ rounds with both ok)" in lines["resnet18.fastest_float32_fp32"]
    assert bandwidth.samples_per_s(64) == 64 / 0.005
    assert any(c.startswith("- met: identity fastest_float32_fp32: 6.94x") for c in checks)
    assert any(c.startswith("- met:") and "= 55% of the two-copy ceiling" in c for c in checks)  # 7010 / 12800
    assert any(c.startswith("- NOT met: identity fastest_uint8_fp32: 8.92x") for c in checks)
    assert any(c.startswith("- met: resnet18 fastest_float32_fp32: efficiency 0.950") for c in checks)
    # An efficiency above every timed loop of the model alone is a slowed ceiling: not judged, and said why.
    busy = _rows().assign(efficiency_low=lambda rows: rows["efficiency"] * 0.98)
    busy.loc[busy["experiment"] == "resnet18.fastest_float32_fp32", ["efficiency", "efficiency_low"]] = (1.8, 1.5)
    _, checks = summarise(busy, found, bandwidth, batch_size=64, device_kind="cpu")
    [judged] = [c for c in checks if "resnet18 fastest_float32_fp32: efficiency" in c]
    assert judged.startswith("- not judged: resnet18 fastest_float32_fp32: efficiency 1.800: 3 of 3 runs above")
    assert "timing was slowed" in judged and "met" not in judged


def test_copy_bandwidth_is_measured() -> None:
    bandwidth = measure_copy_bandwidth(4 * 2**20, repeats=5)
    assert bandwidth.two_copies_s > 0 and 0.1 < bandwidth.gb_per_s < 1000


def test_the_report_says_the_fastest_configuration_was_fixed_not_searched(tmp_path: Path) -> None:
    """A user's model may be fastest in another design: the report says where 'fastest' came from; the copy
    ceiling comes from the bandwidth's own row, and the device from the one it ran on."""
    bandwidth = {"experiment": compare.BANDWIDTH, "status": "ok", "request_bytes": 64 * 3 * 250 * 250 * 4}
    bandwidth |= {"two_copies_s": 0.005, "threads": 2, "device": "cpu"}
    rows = pd.concat([_rows().assign(device_name="cpu"), pd.DataFrame([bandwidth])], ignore_index=True)
    for given, said in ((None, "fixed: bench/compare.py's FASTEST for cpu"), ("--design serial", "given by --fastest")):
        argv = ["--models", "identity", "resnet18", "--device", "cuda"] + (["--fastest", given] if given else [])
        args = build_parser(compare.STUDY).parse_args(argv)
        text = "\n".join(compare.report(args, rows, tmp_path))
        assert said in text and "- device: cpu;" in text  # where it ran, not the --device of this command
        assert "= at most 12800 samples/s" in text and "| 3/3 | 1010.0 ± 10.0 |" in text


def test_report_only_judges_the_rows_by_the_arguments_that_measured_them(tmp_path: Path, capsys) -> None:
    """--report_only alone renders a batch-4 comparison as batch 4 (its ceiling, its title), from study_args.json."""
    bandwidth = {"experiment": compare.BANDWIDTH, "status": "ok", "request_bytes": 4 * 3 * 16 * 16 * 4}
    bandwidth |= {"two_copies_s": 0.001, "threads": 2, "device": "cpu"}
    rows = pd.concat([_rows(), pd.DataFrame([bandwidth])], ignore_index=True).assign(batch_size=4, repeat=0)
    rows.assign(compile=False).to_csv(tmp_path / "runs.csv", index=False)
    measured = build_parser(compare.STUDY).parse_args(
        ["--batch_size", "4", "--image_size", "16", "--models", "identity"]
    )
    recorded = {k: v for k, v in vars(measured).items() if k != "out"}
    (tmp_path / "study_args.json").write_text(json.dumps(recorded, default=str))
    compare.main(["--out", str(tmp_path), "--report_only"])
    text = (tmp_path / "compare.md").read_text()
    assert "# Performance comparison: batch 4, 16x16" in text and "= at most 4000 samples/s" in text
    assert "resnet18" not in text.split("| --- |")[1]  # the models it measured, not this command's defaults
