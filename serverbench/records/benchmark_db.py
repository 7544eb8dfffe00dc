"""A run's row as records of the PyTorch OSS benchmark database (pytorch/test-infra, schema oss_ci_benchmark_v3),
one record per headline metric, as vLLM writes them with SAVE_TO_PYTORCH_BENCHMARK_FORMAT.

`records_from_row` is pure: it takes a row as server.py builds it or as a results CSV holds it (every value a
string), so old results convert too (`report.py --pytorch_benchmark DIR`). The uploader adds what a CI job knows
(repo, commit, workflow, timestamp); a record here carries benchmark, model, metric, runners and dependencies.
Every `extra_info` map holds strings, `benchmark_values` is a list, counts are integers.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from serverbench.config.inputs import model_source
from serverbench.records.csv_store import _FileLock
from serverbench.schema.columns import COLUMNS, Column, Use, used_by
from serverbench.system.process import one_line

BENCHMARK_NAME = "inference-server-bench"  # this tool, as its package is named
JSON_SUFFIX = ".pytorch.json"  # <output_file stem>.pytorch.json beside the CSV
ENV_SWITCH = "SAVE_TO_PYTORCH_BENCHMARK_FORMAT"  # vLLM's: set to anything non-empty, the records are written


def metric_units(columns: Sequence[Column]) -> dict[str, str]:
    """The headline metrics, in their declared rank: column -> its declared unit."""
    metrics = sorted((c for c in columns if c.metric_rank is not None), key=lambda c: c.metric_rank or 0)
    return {column.name: column.unit for column in metrics}


# The headline metrics, one record each when the row has a value: column -> unit.
METRICS = metric_units(COLUMNS)
# The row's columns that define the configuration (benchmark.extra_info), and the model's details (model.extra_info).
CONFIGURATION = used_by(COLUMNS, Use.DB_CONFIG)
MODEL_DETAILS = used_by(COLUMNS, Use.DB_MODEL)
# --model's form -> model.type and model.origins: where the network came from.
MODEL_TYPES = {
    "identity": ("server-only", []),
    "torchvision": ("image-classification", ["torchvision"]),
    "factory": ("custom", ["user factory"]),
    "pt2": ("custom", ["torch.export"]),
}


def wants_records(flag: bool, environ: Mapping[str, str]) -> bool:
    """--save_pytorch_benchmark, or the environment variable vLLM reads (any non-empty value)."""
    return flag or bool(environ.get(ENV_SWITCH))


def _text(value: object) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return str(value)


def _number(value: object) -> float | None:
    """A metric's value from a typed row or a CSV's text; None when empty or not a finite number."""
    if value is None or isinstance(value, bool) or value == "":
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _is_true(value: object) -> bool:
    return value is True or str(value).lower() == "true"


def runner(row: Mapping[str, object]) -> dict[str, object]:
    """The machine, from the row's host and device facts; what the row does not know is empty or 0."""
    cuda = _text(row.get("device")).startswith("cuda")
    device_name = _text(row.get("device_name"))
    backend_cpus = [cpu for cpu in _text(row.get("backend_cpus")).split(";") if cpu]
    return {
        "name": _text(row.get("host")),
        "type": "cuda" if cuda else "cpu",
        "cpu_info": "" if cuda else device_name,
        "cpu_count": len(backend_cpus),
        "mem_info": "",
        "avail_mem_in_gb": 0,
        "gpu_info": device_name if cuda else "",
        "gpu_count": 1 if cuda else 0,
        "gpu_mem_info": "",
        "avail_gpu_mem_in_gb": 0,
        "extra_info": {
            "device": _text(row.get("device")),
            "intra_op_threads": _text(row.get("intra_op_threads")),
            "mps": _text(row.get("mps")),
        },
    }


def dependencies(row: Mapping[str, object]) -> dict[str, dict[str, object]]:
    """torch, torchvision and CUDA as the row recorded them (CUDA only where torch had it)."""
    found = {
        "torch": ("pytorch/pytorch", row.get("torch_version")),
        "torchvision": ("pytorch/vision", row.get("torchvision_version")),
        "cuda": ("", row.get("cuda_version")),
    }
    return {
        name: {"repo": repo, "branch": "", "sha": "", "version": _text(version), "extra_info": {}}
        for name, (repo, version) in found.items()
        if _text(version)
    }


def model_backend(row: Mapping[str, object]) -> str:
    """How the model was run: the row's compile_path (eager, inductor, aoti), or for rows written before that column
    its compile flag."""
    path = _text(row.get("compile_path")) or ("inductor" if _is_true(row.get("compile")) else "eager")
    if path == "inductor":
        return f"torch.compile ({_text(row.get('compile_mode')) or 'default'})"
    if path == "aoti":
        runners = _text(row.get("aoti_runners"))
        return f"AOTInductor ({runners} runners)" if runners else "AOTInductor"
    return path


def records_from_row(row: Mapping[str, object]) -> list[dict[str, object]]:
    """One oss_ci_benchmark_v3 record per headline metric the row has a value for."""
    compiled = _is_true(row.get("compile")) or _text(row.get("compile_path")) in ("inductor", "aoti")
    model_type, origins = MODEL_TYPES[model_source(_text(row.get("model")))]
    benchmark = {
        "name": BENCHMARK_NAME,
        "mode": "inference",
        "dtype": _text(row.get("precision")),
        "extra_info": {
            **{column: _text(row.get(column)) for column in CONFIGURATION},
            "compile": "true" if compiled else "false",  # the dashboard's own key
        },
    }
    model = {
        "name": _text(row.get("model")),
        "type": model_type,
        "backend": model_backend(row),
        "origins": origins,
        "extra_info": {column: _text(row.get(column)) for column in MODEL_DETAILS},
    }
    slo_s = _number(row.get("slo_ms"))
    records = []
    for column, unit in METRICS.items():
        value = _number(row.get(column))
        if value is None:
            continue
        target = slo_s / 1e3 if column == "p99_latency_s" and slo_s is not None else 0.0
        records.append(
            {
                "benchmark": benchmark,
                "model": model,
                "metric": {
                    "name": column,
                    "benchmark_values": [value],
                    "target_value": target,
                    "extra_info": {"unit": unit},
                },
                "runners": [runner(row)],
                "dependencies": dependencies(row),
            }
        )
    return records


def save_records(csv_path: Path, rows: Sequence[Mapping[str, object]]) -> None:
    """--save_pytorch_benchmark: the rows' records beside the CSV, said on the terminal; a failure to write them is
    said too, and the run stands (its rows are already in the CSV)."""
    try:
        path = append_records(json_path(csv_path), [record for row in rows for record in records_from_row(row)])
        print(f"  PyTorch benchmark records appended to {path}")
    except (OSError, TimeoutError, ValueError) as exc:
        print(f"server.py: could not write the PyTorch benchmark records: {one_line(exc)}", file=sys.stderr)


def json_path(csv_path: Path) -> Path:
    """<stem>.pytorch.json beside the CSV."""
    return csv_path.with_name(csv_path.stem + JSON_SUFFIX)


def append_records(path: Path, records: Sequence[dict[str, object]], lock_timeout_s: float = 60.0) -> Path:
    """Adds the records to the JSON list at `path` (made when missing), under the same kind of lock as the CSV:
    runs that share a results file share its records file. Written to a side file, then renamed. ValueError when
    the file holds anything but records (check_records_file): it is left as it is."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with _FileLock(path.with_name(f".{path.name}.lock"), lock_timeout_s):
        _write(path, [*check_records_file(path), *records])
    return path


RECORD_KEYS = ("benchmark", "model", "metric")  # what every record of records_from_row has


def check_records_file(path: Path) -> list[dict[str, object]]:
    """The records already at `path` ([] when there is no file); ValueError (one line) when it holds anything else,
    which is never this tool's to add to or replace; OSError when it cannot be read."""
    if not path.exists():
        return []
    try:
        found = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, or nested past the parser's depth
        raise ValueError(f"{path}: not JSON ({one_line(exc)[:80]}); left as it is") from None
    if not isinstance(found, list) or not all(isinstance(r, dict) and all(k in r for k in RECORD_KEYS) for r in found):
        raise ValueError(f"{path}: not a JSON list of benchmark records; left as it is")
    return found


def _write(path: Path, records: Sequence[dict[str, object]]) -> None:
    side = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    side.write_text(json.dumps(list(records), indent=1) + "\n", encoding="utf-8")
    side.replace(path)


def write_records(path: Path, rows: Sequence[Mapping[str, object]]) -> int:
    """Every row's records, in the file at `path` (made, or replaced when it holds records: check_records_file
    first); how many."""
    records = [record for row in rows for record in records_from_row(row)]
    path.parent.mkdir(parents=True, exist_ok=True)
    _write(path, records)
    return len(records)
