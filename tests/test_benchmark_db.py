"""PyTorch OSS benchmark database records: every record has the oss_ci_benchmark_v3 fields with their types, a run
writes them beside its CSV when asked (flag or vLLM's environment variable), and report.py converts old CSVs."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from conftest import ROOT, TINY, run_server
from helpers import exit_code

import report
import server
from serverbench.records.benchmark_db import records_from_row, save_records, wants_records
from serverbench.schema.messages import RunResult

# The fields an uploaded record carries, with their types, as pytorch/test-infra's oss_ci_benchmark_v3 table
# declares them (clickhouse_db_schema/oss_ci_benchmark_v3/schema.sql): String -> str, UInt32 -> int,
# Float32 -> float, Array -> list, Map(String, String) -> dict of str. The uploader adds the CI fields.
STRING_MAP = "map of strings"
SCHEMA = {
    "benchmark": {"name": str, "mode": str, "dtype": str, "extra_info": STRING_MAP},
    "model": {"name": str, "type": str, "backend": str, "origins": [str], "extra_info": STRING_MAP},
    "metric": {"name": str, "benchmark_values": [float], "target_value": float, "extra_info": STRING_MAP},
    "runners": [
        {
            "name": str,
            "type": str,
            "cpu_info": str,
            "cpu_count": int,
            "mem_info": str,
            "avail_mem_in_gb": int,
            "gpu_info": str,
            "gpu_count": int,
            "gpu_mem_info": str,
            "avail_gpu_mem_in_gb": int,
            "extra_info": STRING_MAP,
        }
    ],
    "dependencies": {
        "*": {"repo": str, "branch": str, "sha": str, "version": str, "extra_info": STRING_MAP},
    },
}


def schema_problems(value: object, spec: object, where: str = "record") -> list[str]:
    """Every place where `value` does not have the shape and types of `spec`."""
    if spec == STRING_MAP:
        if not isinstance(value, dict):
            return [f"{where}: not a map"]
        return [f"{where}[{k!r}]: {v!r} is not a string" for k, v in value.items() if not isinstance(v, str)]
    if isinstance(spec, list):
        if not isinstance(value, list):
            return [f"{where}: not a list"]
        return [problem for i, item in enumerate(value) for problem in schema_problems(item, spec[0], f"{where}[{i}]")]
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            return [f"{where}: not an object"]
        if set(spec) == {"*"}:  # a map of name -> object
            return [p for name, item in value.items() for p in schema_problems(item, spec["*"], f"{where}.{name}")]
        problems = [f"{where}: missing {key}" for key in spec if key not in value]
        problems += [f"{where}: unknown {key}" for key in value if key not in spec]
        return problems + [p for key in spec if key in value for p in schema_problems(value[key], spec[key], key)]
    if spec is float:
        ok = isinstance(value, float)
    else:
        ok = isinstance(value, spec) and not isinstance(value, bool)
    return [] if ok else [f"{where}: {value!r} is not {spec.__name__}"]


def test_the_schema_check_itself_finds_what_is_wrong() -> None:
    good = records_from_row({"throughput": 10.0, "model": "identity", "device": "cpu"})[0]
    assert schema_problems(good, SCHEMA) == []
    bad = json.loads(json.dumps(good))
    bad["metric"]["benchmark_values"] = 10.0
    bad["benchmark"]["extra_info"]["batch_size"] = 32
    del bad["model"]["origins"]
    bad["runners"][0]["cpu_count"] = "2"
    problems = schema_problems(bad, SCHEMA)
    assert len(problems) == 4, problems


def test_a_typed_row_gives_one_valid_record_per_headline_metric() -> None:
    row = {
        "throughput": 773.2,
        "p50_latency_s": 0.268,
        "p99_latency_s": 0.499,
        "warmup_latency": 1.189,
        "efficiency": 0.917,
        "gpu_util": None,  # no GPU: no record
        "slo_ms": 500.0,
        "model": "resnet18",
        "compile": True,
        "compile_mode": "max-autotune",
        "precision": "bf16",
        "batch_size": 8,
        "design": "pipelined",
        "device": "cuda:0",
        "device_name": "NVIDIA H200",
        "host": "gpu1",
        "torch_version": "2.9.0",
        "cuda_version": "12.6",
        "torchvision_version": None,
    }
    records = records_from_row(row)
    assert [r["metric"]["name"] for r in records] == [
        "throughput",
        "p50_latency_s",
        "p99_latency_s",
        "warmup_latency",
        "efficiency",
    ]
    for record in records:
        assert schema_problems(record, SCHEMA) == []
    p99 = records[2]
    assert p99["metric"]["benchmark_values"] == [0.499] and p99["metric"]["target_value"] == pytest.approx(0.5)
    assert records[0]["metric"]["target_value"] == 0.0
    assert p99["benchmark"]["mode"] == "inference" and p99["benchmark"]["dtype"] == "bf16"
    assert p99["benchmark"]["extra_info"]["compile"] == "true" and p99["benchmark"]["extra_info"]["batch_size"] == "8"
    assert p99["model"]["backend"] == "torch.compile (max-autotune)" and p99["model"]["origins"] == ["torchvision"]
    assert p99["runners"][0]["gpu_info"] == "NVIDIA H200" and p99["runners"][0]["gpu_count"] == 1
    assert set(p99["dependencies"]) == {"torch", "cuda"}  # torchvision's version unknown: left out


def test_the_model_record_says_which_compile_path_served_and_where_the_model_came_from() -> None:
    base = {"throughput": 500.0, "device": "cpu", "precision": "default"}
    aoti = records_from_row(
        {
            **base,
            "model": "examples.tiny_encoder:make_model",
            "model_kwargs": '{"depth": 2}',
            "compile": False,  # --aoti is not --compile: the compile path says what served
            "compile_path": "aoti",
            "aoti_runners": 2,
            "inputs": "ids:int64:16:0-999 mask:int64:16:1-1",
        }
    )[0]
    assert schema_problems(aoti, SCHEMA) == []
    model = aoti["model"]
    assert model["backend"] == "AOTInductor (2 runners)" and model["type"] == "custom"
    assert model["origins"] == ["user factory"]
    assert model["extra_info"]["inputs"] == "ids:int64:16:0-999 mask:int64:16:1-1"
    assert model["extra_info"]["model_kwargs"] == '{"depth": 2}'
    assert aoti["benchmark"]["extra_info"]["compile_path"] == "aoti"
    assert aoti["benchmark"]["extra_info"]["compile"] == "true"
    program = records_from_row({**base, "model": "out/encoder.pt2", "compile_path": "inductor"})[0]
    assert program["model"]["backend"] == "torch.compile (default)" and program["model"]["origins"] == ["torch.export"]
    # A row written before the compile_path column: its compile flag decides.
    old = records_from_row({**base, "model": "resnet18", "compile": "True", "compile_mode": "reduce-overhead"})[0]
    assert old["model"]["backend"] == "torch.compile (reduce-overhead)"
    assert records_from_row({**base, "model": "identity", "compile": "False"})[0]["model"]["backend"] == "eager"


def test_the_committed_your_model_rows_convert_with_their_three_compile_paths(tmp_path: Path) -> None:
    source = ROOT / "results" / "your_model" / "runs.csv"
    assert report.main([str(source), "--pytorch_benchmark", str(tmp_path)]) == 0
    records = json.loads((tmp_path / "runs.pytorch.json").read_text())
    assert all(schema_problems(record, SCHEMA) == [] for record in records)
    backends = {record["model"]["backend"].split(" (")[0] for record in records}
    assert backends == {"eager", "torch.compile", "AOTInductor"}
    assert {record["model"]["type"] for record in records} == {"custom"}


def test_report_converts_a_committed_results_csv(tmp_path: Path) -> None:
    source = ROOT / "results" / "sweep_cpu" / "runs.csv"
    with open(source, newline="") as f:
        rows = list(csv.DictReader(f))
    assert report.main([str(source), "--pytorch_benchmark", str(tmp_path)]) == 0
    records = json.loads((tmp_path / "runs.pytorch.json").read_text())
    throughputs = [float(row["throughput"]) for row in rows if row["throughput"]]
    assert len(records) >= len(throughputs) >= 1
    for record in records:
        assert schema_problems(record, SCHEMA) == []
    got = [r["metric"]["benchmark_values"][0] for r in records if r["metric"]["name"] == "throughput"]
    assert got == pytest.approx(throughputs)
    assert {r["model"]["name"] for r in records} == {row["model"] for row in rows}
    assert not (tmp_path / "runs.md").exists()  # the conversion alone, no report


NOT_RECORDS = {  # what a .pytorch.json may hold that is not this tool's list of records: never replaced or added to
    "a list of other things": '[1, 2, "x"]\n',
    "an object": '{"records": []}\n',
    "not JSON": "{garbled\n",
    "deep nesting": "[" * 50_000 + "]" * 50_000,
}


@pytest.mark.parametrize("content", NOT_RECORDS.values(), ids=NOT_RECORDS.keys())
def test_a_records_file_holding_anything_else_is_left_as_it_is(tmp_path: Path, capsys, content: str) -> None:
    source = ROOT / "results" / "sweep_cpu" / "runs.csv"
    target = tmp_path / "runs.pytorch.json"
    target.write_text(content)
    assert report.main([str(source), "--pytorch_benchmark", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"report.py: error: {target}: not ") and "left as it is" in err[0]
    # A run's --save_pytorch_benchmark says the same and leaves it too (the run's row stands in its CSV).
    save_records(tmp_path / "runs.csv", [{"model": "identity", "throughput": 5.0}])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "could not write the PyTorch benchmark records" in err[0] and str(target) in err[0]
    assert target.read_text() == content
    assert {p.name for p in tmp_path.iterdir()} <= {target.name, f".{target.name}.lock"}  # the lock of every run


def test_a_run_writes_its_records_beside_the_csv_with_the_flag_or_vllms_variable(tmp_path: Path, monkeypatch) -> None:
    argv = [*TINY, "--batch_size", "1", "--slo_ms", "1000"]
    monkeypatch.delenv("SAVE_TO_PYTORCH_BENCHMARK_FORMAT", raising=False)
    assert run_server([*argv, "--save_pytorch_benchmark"], tmp_path, output_file="runs.csv").returncode == 0
    monkeypatch.setenv("SAVE_TO_PYTORCH_BENCHMARK_FORMAT", "1")  # the server's process inherits it
    second = run_server(argv, tmp_path, output_file="runs.csv")
    monkeypatch.delenv("SAVE_TO_PYTORCH_BENCHMARK_FORMAT")
    assert second.returncode == 0, second.stderr
    records = json.loads((tmp_path / "runs.pytorch.json").read_text())
    run_ids = {record["benchmark"]["extra_info"]["run_id"] for record in records}
    assert len(run_ids) == 2 and {row["run_id"] for row in second.rows} == run_ids
    for record in records:
        assert schema_problems(record, SCHEMA) == []
    assert {"throughput", "p99_latency_s", "goodput_samples_per_s"} <= {r["metric"]["name"] for r in records}
    # Neither: no records. server.py's own main, in this process, its processes' run stood in for by a result (what
    # the run's children measure decides nothing here: the flag and the environment do, read by the server alone).
    monkeypatch.setattr(server, "run_benchmark", lambda cfg: RunResult(status="ok"))
    plain = [*argv, "--results_dir", str(tmp_path)]
    assert exit_code([*plain, "--output_file", "plain.csv"]) == 0 and (tmp_path / "plain.csv").exists()
    assert not (tmp_path / "plain.pytorch.json").exists()
    # The same stand-in with the flag does write them: their absence above is the switch's doing.
    assert exit_code([*plain, "--output_file", "flagged.csv", "--save_pytorch_benchmark"]) == 0
    assert (tmp_path / "flagged.pytorch.json").exists()


def test_only_a_non_empty_variable_switches_the_records_on() -> None:
    assert wants_records(False, {"SAVE_TO_PYTORCH_BENCHMARK_FORMAT": "1"})
    assert not wants_records(False, {"SAVE_TO_PYTORCH_BENCHMARK_FORMAT": ""})
    assert not wants_records(False, {})
    assert wants_records(True, {})
