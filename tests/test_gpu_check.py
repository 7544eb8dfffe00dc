"""bench.gpu_check: without a GPU it refuses in one line; --dry_run runs each part's plan on the CPU within its
budget (at most 300 s, so that each part fits one command of a lent GPU machine), writes few files, and leaves
what the budget did not reach as "not run (budget)"; the parent process never touches CUDA. Both dry runs run
their children (the probe, pytest, server.py) on the lent machine's packages (tests/gpu_image): what that machine
lacks (the HTTP door's packages) refuses the door's check with the reason instead of failing it."""

from __future__ import annotations

import ast
import importlib.util
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

import pandas as pd
import pytest
import torch
from conftest import run_command

from bench import gpu_check, gpu_checks, gpu_probe, gpu_runs
from bench.gpu_checks import CHECKS
from bench.gpu_runs import BUDGET, Context, Runner
from serverbench.launch.study_checks import check_server_flags

ROOT = Path(__file__).resolve().parent.parent
GPU_IMAGE = ROOT / "tests" / "gpu_image"  # the lent machine's packages: tests/test_gpu_image.py
DOOR_MODULES = ("uvicorn", "h11", "httptools", "orjson", "tritonclient")
TIMING = re.compile(r"gpu_check (\w+): (\d+) checks in ([\d.]+) s of a ([\d.]+) s budget")
PART_1 = ["probe", "cuda_tests", "verify", "race", "bandwidth", "overlap", "compare", "gpu_util"]
PART_2 = ["probe", "compile", "aoti", "your_model", "instances", "door", "table"]
# Besides torch.cuda: what makes a CUDA context or page-locks host memory.
CUDA_NAMES = ("make_device_layer", "pin_memory", "cudnn", "register_host", "unregister_host")


def _gpu_check(*args: str, timeout_s: float = 240) -> tuple[subprocess.CompletedProcess, float]:
    """bench.gpu_check to its end in a session of its own (killed at the test's end), and its wall time."""
    started = time.monotonic()
    run = run_command([sys.executable, "-m", "bench.gpu_check", *args], timeout_s=timeout_s)
    return run, time.monotonic() - started


def _timing(stdout: str) -> tuple[str, float, float]:
    """The last line's (label, seconds the plan took, its budget)."""
    found = TIMING.findall(stdout)
    assert found, stdout[-3000:]
    label, _count, took_s, budget_s = found[-1]
    return label, float(took_s), float(budget_s)


def _bundle(out: Path, label: str) -> dict[str, bytes]:
    with tarfile.open(out / f"{label}.tar.gz") as tar:
        return {m.name.split("/", 1)[1]: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def _rows(files: dict[str, bytes], folder: str) -> pd.DataFrame:
    return pd.read_csv(io.BytesIO(files[f"{folder}/runs.csv"]))


@pytest.fixture
def cuda_calls(monkeypatch) -> list[str]:
    """Every call of torch.cuda this process makes (each one fails): the parent must leave CUDA to its children."""
    calls: list[str] = []

    def refuse(name: str):
        def call(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"the parent called torch.cuda.{name}")

        return call

    for name in ("is_available", "device_count", "init", "_lazy_init", "get_device_name", "get_device_properties"):
        monkeypatch.setattr(torch.cuda, name, refuse(name))
    for name in ("current_device", "set_device", "synchronize", "mem_get_info", "empty_cache", "current_stream"):
        monkeypatch.setattr(torch.cuda, name, refuse(name))
    monkeypatch.setattr(torch._C, "_cuda_init", refuse("_C._cuda_init"), raising=False)
    return calls


class ChildSpy(subprocess.Popen):
    """subprocess.Popen (subprocess.run's too), recording each child's command and the PYTHONPATH it gets."""

    children: list[tuple[str, str]] = []

    def __init__(self, args, *rest, **kwargs) -> None:
        env = kwargs.get("env")
        path = (os.environ if env is None else env).get("PYTHONPATH", "")
        ChildSpy.children.append((" ".join(map(str, args)), path))
        super().__init__(args, *rest, **kwargs)


def _dry_run_in_process(out: Path, part: str, capsys, monkeypatch) -> tuple[int, str, float, list[tuple[str, str]]]:
    """main() of the dry run in this process, its children (processes of their own) on the lent machine's packages:
    its exit status, stdout, wall time, and each child's command and PYTHONPATH."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(GPU_IMAGE), str(ROOT)]))
    monkeypatch.setattr(ChildSpy, "children", [])
    monkeypatch.setattr(subprocess, "Popen", ChildSpy)
    started = time.monotonic()
    code = gpu_check.main(["--part", part, "--dry_run", "--out", str(out)])
    wall_s = time.monotonic() - started
    return code, capsys.readouterr().out, wall_s, ChildSpy.children


def _assert_in_the_image(children: list[tuple[str, str]], out: Path, kinds: tuple[str, ...]) -> None:
    """Every child got the lent machine's packages first on its path, and it took: the probe, a child, found the
    door's packages missing (they are installed here)."""
    assert all(importlib.util.find_spec(m) for m in DOOR_MODULES)  # here they are: the image hides them
    for kind in kinds:
        assert any(kind in cmd for cmd, _ in children), (kind, [cmd[:120] for cmd, _ in children])
    assert all(path.split(os.pathsep)[-2:] == [str(GPU_IMAGE), str(ROOT)] for _, path in children), children
    assert all(path.split(os.pathsep)[0] == str(GPU_IMAGE) for cmd, path in children if "door_site" not in path)
    summary = (out / "summary.md").read_text()
    missing = re.search(r"\| door packages missing \| (.*) \|", summary)
    assert missing and set(DOOR_MODULES) <= set(missing.group(1).split(", ")), summary


def test_without_a_gpu_it_exits_2_at_once_with_one_line(tmp_path: Path) -> None:
    run, _ = _gpu_check("--out", str(tmp_path / "gpu"), timeout_s=120)
    assert run.returncode == 2, run.stdout + run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu_check: ") and "--dry_run" in lines[0]
    assert not (tmp_path / "gpu").exists()


def test_part_1_dry_run_runs_every_check_within_its_budget_and_never_touches_cuda(
    tmp_path: Path, capsys, monkeypatch, cuda_calls: list[str]
) -> None:
    out = tmp_path / "gpu1"
    code, stdout, wall_s, children = _dry_run_in_process(out, "1", capsys, monkeypatch)
    assert code == 0, stdout[-4000:]
    assert cuda_calls == []
    _assert_in_the_image(children, out, ("bench.gpu_probe probe", "bench.gpu_probe h2d", "-m pytest", "server.py"))
    label, took_s, budget_s = _timing(stdout)
    assert label == "part1" and budget_s == gpu_check.DEFAULT_BUDGET_S <= 300
    assert took_s <= budget_s and wall_s <= budget_s
    assert sorted(p.name for p in out.iterdir()) == ["checks.json", "part1.tar.gz", "summary.md"]  # few files

    checks = json.loads((out / "checks.json").read_text())
    assert list(checks) == PART_1
    assert {name: c["status"] for name, c in checks.items()} == {
        "probe": "info",
        "cuda_tests": "info",  # collected and skipped without a GPU; on the GPU none may be
        "verify": "pass",
        "race": "pass",
        "bandwidth": "info",
        "overlap": "info",
        "compare": "pass",
        "gpu_util": "info",
    }
    # The cuda tests: the modules that hold the marker, as grep finds them.
    marked = [p for p in sorted((ROOT / "tests").glob("test_*.py")) if "\n@pytest.mark.cuda\n" in p.read_text()]
    assert gpu_checks.cuda_test_modules() == marked and len(marked) >= 6
    assert ", ".join(p.stem for p in marked) in checks["cuda_tests"]["detail"]

    files = _bundle(out, "part1")
    # Every design, the transports in turn (the GPU plan: each design over both), every answer the serial one's.
    verify = _rows(files, "verify")
    assert set(verify["status"]) == {"ok"} and verify["wrong_outputs"].eq(0).all()
    assert sorted(zip(verify["design"], verify["transport"])) == [
        ("pipelined", "shm"),
        ("serial", "shm"),
        ("threaded", "queue"),
    ]
    race = _rows(files, "race")  # the planted buffer race, caught by --verify
    assert list(race["status"]) == ["wrong_output"] and race["wrong_outputs"].gt(0).all()
    compare = _rows(files, "compare")  # the reference-like server and the fastest at bf16, one run each
    assert sorted(compare["experiment"]) == ["fastest_float32_bf16", "fastest_uint8_bf16", "reference_like"]
    assert set(compare["status"]) == {"ok"} and set(compare["batch_size"]) == {gpu_check.DRY_PLAN.compare_batch_size}
    assert "cuda_tests/junit.xml" in files and "bandwidth/h2d.json" in files

    summary = (out / "summary.md").read_text()
    assert "| verify | **pass** | 3/3 runs gave the serial answers" in summary
    assert "## compare" in summary and f"of a {budget_s:g} s budget" in summary


def test_part_2_dry_run_runs_every_check_within_its_budget_and_never_touches_cuda(
    tmp_path: Path, capsys, monkeypatch, cuda_calls: list[str]
) -> None:
    out = tmp_path / "gpu2"
    code, stdout, wall_s, children = _dry_run_in_process(out, "2", capsys, monkeypatch)
    assert code == 0, stdout[-4000:]
    assert cuda_calls == []
    _assert_in_the_image(children, out, ("bench.gpu_probe probe", "server.py"))
    label, took_s, budget_s = _timing(stdout)
    assert label == "part2" and budget_s <= 300 and took_s <= budget_s and wall_s <= budget_s
    assert sorted(p.name for p in out.iterdir()) == ["checks.json", "part2.tar.gz", "summary.md"]

    checks = json.loads((out / "checks.json").read_text())
    assert list(checks) == PART_2
    statuses = {name: c["status"] for name, c in checks.items()}
    assert statuses == {"probe": "info"} | dict.fromkeys(PART_2[1:], "pass") | {"door": "refused"}
    # The lent machine lacks the door's packages: with no wheels carried, wheels pip refuses (another Python's), or
    # wheels it still cannot import (here the image hides them), the door is refused with the packages it lacks,
    # and no server runs it.
    door = checks["door"]["detail"]
    assert door.startswith(("wheels not carried", "pip install from wheels/ failed")) or "still unimportable" in door
    assert "missing: " in door and "uvicorn" in door
    files = _bundle(out, "part2")
    compiled = _rows(files, "compile")  # compiled copies on 2 threads (reduce-overhead: the GPU plan only)
    assert list(compiled["experiment"]) == ["pipelined_2w"] and compiled["compile"].all()
    # The example model (two int64 inputs, a dict of two outputs): batched, and AOTInductor, every leaf right.
    example = _rows(files, "your_model")
    assert sorted(zip(example["experiment"], example["compile_path"])) == [
        ("pipelined_2w_aoti", "aoti"),
        ("pipelined_2w_batching", "eager"),
    ]
    assert example["wrong_outputs"].eq(0).all() and example["aoti_runners"].max() >= 2
    assert _rows(files, "instances")["instances"].eq(2).all()
    assert not any(name.startswith("door/") for name in files)
    table = _rows(files, "table")
    assert sorted(table["experiment"]) == ["pipelined_2w", "serial"]
    assert "## table" in (out / "summary.md").read_text()


def test_a_tiny_budget_leaves_the_later_checks_not_run_and_keeps_the_other_parts_results(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """The probe answers at once (faked: on a loaded machine it alone can take longer than this budget)."""
    facts = GOOD | {"cuda": False, "facts": {}, "has": {"pytest": True, "pip": True}, "door_missing": []}
    monkeypatch.setattr(gpu_check, "run_child", lambda args, timeout_s: (facts, ""))
    out = tmp_path / "gpu"
    out.mkdir()
    earlier = {"table": {"name": "table", "status": "pass", "detail": "8/8 runs ok", "where": ""}}  # part 2's
    (out / "checks.json").write_text(json.dumps(earlier))
    started = time.monotonic()
    assert gpu_check.main(["--part", "1", "--dry_run", "--budget_s", "5", "--out", str(out)]) == 0
    wall_s = time.monotonic() - started
    _label, took_s, budget_s = _timing(capsys.readouterr().out)
    assert budget_s == 5 and took_s <= 5 and wall_s <= 5
    checks = json.loads((out / "checks.json").read_text())
    assert list(checks) == [*PART_1, "table"] and checks["table"]["detail"] == "8/8 runs ok"  # every check listed
    # No server run can start: each needs its least time and the stop grace left.
    cut = ("cuda_tests", "verify", "race", "overlap", "compare")
    assert {name: checks[name]["status"] for name in cut} == dict.fromkeys(cut, BUDGET)
    assert checks["bandwidth"]["status"] in (BUDGET, "info")  # one child of seconds may still fit
    assert checks["gpu_util"]["status"] in (BUDGET, "not run")  # no serving run to read
    assert "**not run (budget)**" in (out / "summary.md").read_text()


def test_checks_kept_from_another_machine_are_refused_not_merged(tmp_path: Path, monkeypatch, capsys) -> None:
    """A dry run (or another GPU, driver or torch) into a folder of the H200's checks would replace its verdicts
    with the CPU's; the same machine's part 2 after its part 1 merges."""
    here = {"torch": "2.11.0+cu130", "NVIDIA driver": "580.159.04", "GPUs visible": "1: NVIDIA H200"}
    facts = GOOD | {"cuda": False, "facts": here, "has": {"pytest": True, "pip": True}, "door_missing": []}
    monkeypatch.setattr(gpu_check, "run_child", lambda args, timeout_s: (facts, ""))
    out = tmp_path / "gpu"
    out.mkdir()
    h200 = "torch 2.11.0+cu130; NVIDIA driver 580.159.04; GPUs visible 1: NVIDIA H200; compute mode default"
    for detail, code in [(h200.replace("H200", "H100"), 2), (h200.replace("2.11.0", "2.12.0"), 2), (h200, 0)]:
        kept = {"probe": {"name": "probe", "status": "info", "detail": detail, "where": ""}}
        (out / "checks.json").write_text(json.dumps(kept))
        assert gpu_check.main(["--part", "2", "--dry_run", "--budget_s", "5", "--out", str(out)]) == code
        err = capsys.readouterr().err
        if code == 2:
            assert len(err.strip().splitlines()) == 1 and "another machine's checks" in err, err
            assert json.loads((out / "checks.json").read_text()) == kept and not (out / "summary.md").exists()
    assert "torch 2.11.0+cu130" in json.loads((out / "checks.json").read_text())["probe"]["detail"]


def test_a_ctrl_c_or_sigterm_is_one_line_and_130_and_keeps_what_was_recorded(
    tmp_path: Path, capsys, monkeypatch
) -> None:
    """SIGTERM from what bounds a lease, or Ctrl-C: a traceback, and the scratch folder left behind (SIGTERM skipped
    the clean-up); a background run, SIGINT ignored, did not stop at all."""
    monkeypatch.setattr(gpu_check, "run_child", lambda argv, timeout_s: ({"cuda": False, "facts": {"cpu": "x"}}, ""))

    def interrupted(*args: object) -> None:
        raise KeyboardInterrupt  # what interruptible makes of SIGINT and SIGTERM

    monkeypatch.setattr(gpu_check, "run_checks", interrupted)
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    out = tmp_path / "gc"
    assert gpu_check.main(["--dry_run", "--out", str(out)]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"gpu_check: interrupted; the checks done so far are in {out / 'summary.md'}"], err
    assert list(json.loads((out / "checks.json").read_text())) == ["probe"] and list(scratch.iterdir()) == []


def test_only_takes_the_named_checks_of_either_part_in_the_order_of_their_value() -> None:
    assert [s.name for s in gpu_check.plan_for(1, ["table", "verify", "compile"])] == ["verify", "compile", "table"]
    assert [s.name for s in gpu_check.plan_for(2, None)] == PART_2[1:]
    assert [s.name for s in gpu_check.plan_for(1, None)] == PART_1[1:]


def test_the_parent_touches_cuda_only_in_the_child_functions() -> None:
    """torch.cuda, the device layer and page-locking appear only in the functions `python -m bench.gpu_probe`
    runs in a child; the parent's modules (gpu_check, gpu_checks, gpu_runs) have none."""
    for path, allowed in (
        (ROOT / "bench" / "gpu_probe.py", gpu_probe.CHILD_FUNCTIONS),
        (ROOT / "bench" / "gpu_runs.py", ()),
        (ROOT / "bench" / "gpu_checks.py", ()),
        (ROOT / "bench" / "gpu_check.py", ()),
    ):
        tree = ast.parse(path.read_text())
        for top in tree.body:
            for node in ast.walk(top):
                text = ast.unparse(node) if isinstance(node, ast.Attribute | ast.Name) else ""
                name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")
                touches = text.startswith("torch.cuda") or name in CUDA_NAMES
                if touches:
                    where = getattr(top, "name", type(top).__name__)
                    assert where in allowed, f"{path.name}: {text} in {where}, which runs in the parent"


def _ctx(facts: dict, cuda: bool = True) -> Context:
    plan = gpu_check.GPU_PLAN if cuda else gpu_check.DRY_PLAN
    return Context(plan, facts, Path("/nonexistent"), Runner(plan), cuda)


def _refusals(facts: dict, cuda: bool = True) -> dict[str, str | None]:
    return {spec.name: spec.refused(_ctx(facts, cuda)) for spec in CHECKS}


GOOD = {"cc": "/usr/bin/gcc", "python_h": "/usr/include/python3.12/Python.h", "shm_free_bytes": 64 * 2**30}


def test_the_probe_refuses_what_this_machine_cannot_run_with_the_reason() -> None:
    assert not any(_refusals(GOOD).values())
    exclusive = _refusals(GOOD | {"compute_mode": "exclusive process"})
    assert {name for name, why in exclusive.items() if why} == {"cuda_tests", "instances"}
    assert "exclusive-process compute mode" in exclusive["instances"]
    no_gcc = _refusals(GOOD | {"cc": None})
    assert {name for name, why in no_gcc.items() if why} == {"compile", "aoti"} and "C compiler" in no_gcc["compile"]
    assert "Python.h" in _refusals(GOOD | {"python_h": None})["compile"]
    no_toolkit = _refusals(GOOD | {"cuda_headers_problem": "the CUDA toolkit's headers are missing"})
    assert {name for name, why in no_toolkit.items() if why} == {"aoti"}
    # Docker's default /dev/shm (64 MiB) holds neither the ring at batch 32 of 224x224 nor the bandwidth's buffer.
    small = _refusals(GOOD | {"shm_free_bytes": 64 * 2**20})
    assert small["verify"] and "MiB of /dev/shm" in small["verify"] and small["compare"] and small["bandwidth"]


def _wheel(folder: Path, name: str) -> Path:
    """A pure-Python wheel of one module that says its name."""
    path = folder / f"{name}-1.0-py3-none-any.whl"
    info = f"{name}-1.0.dist-info"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name}/__init__.py", f"NAME = {name!r}\n")
        archive.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        archive.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        archive.writestr(
            f"{info}/RECORD", f"{name}/__init__.py,,\n{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n"
        )
    return path


@pytest.mark.parametrize("pip", [True, False])
def test_the_door_packages_come_from_the_carried_wheels_without_the_network(
    tmp_path: Path, monkeypatch, pip: bool
) -> None:
    ctx = Context(
        gpu_check.DRY_PLAN, {"door_missing": ["gpucheck_fake_door"], "has": {"pip": pip}}, tmp_path, None, False
    )
    monkeypatch.setattr(gpu_checks, "WHEELS", tmp_path / "wheels")
    env, how = gpu_checks.door_environment(ctx, time.monotonic() + 60)
    assert env is None and how.startswith("wheels not carried") and "gpucheck_fake_door" in how
    (tmp_path / "wheels").mkdir()
    _wheel(tmp_path / "wheels", "gpucheck_fake_door")
    env, how = gpu_checks.door_environment(ctx, time.monotonic() + 60)
    assert env is not None and str(tmp_path / "door_site") in env["PYTHONPATH"], how
    assert ("pip --no-index" in how) if pip else ("pip is absent" in how)
    assert (tmp_path / "door_site" / "gpucheck_fake_door" / "__init__.py").exists()


@pytest.mark.parametrize("plan", [gpu_check.GPU_PLAN, gpu_check.DRY_PLAN], ids=["gpu", "dry_run"])
def test_every_planned_run_is_one_server_py_takes(plan: gpu_runs.Plan) -> None:
    """The GPU plan's runs cannot be tried here: their flags are checked as server.py checks them, on the CPU."""
    commands = [flags for spec in CHECKS for flags in spec.server_commands(plan)]
    assert len(commands) == (30 if plan.device == "cuda" else 16)
    check_server_flags(commands)


def test_on_a_gpu_the_checks_the_probe_refuses_are_listed_with_the_reason(tmp_path: Path, monkeypatch) -> None:
    """The GPU plan's path through main(), its probe faked: an exclusive-process GPU without a C compiler."""
    facts = GOOD | {"cuda": True, "gpu_name": "NVIDIA H100 80GB HBM3", "compute_mode": "exclusive process"}
    monkeypatch.setattr(gpu_check, "run_child", lambda args, timeout_s: (facts | {"cc": None, "facts": {}}, ""))
    out = tmp_path / "gpu"
    assert gpu_check.main(["--out", str(out), "--only", "cuda_tests", "compile", "instances", "gpu_util"]) == 0
    checks = json.loads((out / "checks.json").read_text())
    assert {name: c["status"] for name, c in checks.items()} == {
        "probe": "info",
        "cuda_tests": "refused",
        "compile": "refused",
        "instances": "refused",
        "gpu_util": "not run",
    }
    assert "exclusive-process compute mode" in checks["cuda_tests"]["detail"]
    assert "no C compiler" in checks["compile"]["detail"]


def test_a_plan_run_that_server_py_refuses_or_the_budget_cannot_fit_is_named_so(tmp_path: Path) -> None:
    """The plan's server runs go through the study runner: a refused run (exit 2) is a row saying why, not a crash
    of the check; one with too little time left is not started and counts as cut by the budget."""
    runner = Runner(gpu_check.DRY_PLAN)
    flags = gpu_check.DRY_PLAN.server_flags(ceiling=False)
    refused = gpu_runs.RunSpec("bad", ("--num_workers", "0"), 2)
    (result,) = runner.run_all(tmp_path, [refused], time.monotonic() + 120, timed=False, ceiling=False)
    assert (result.status, result.cut) == ("refused", False)
    assert "--num_workers" in str(result.row["error"])
    assert pd.read_csv(tmp_path / "runs.csv")["status"].tolist() == ["refused"]
    failed = gpu_runs.verdict("bad", [result], lambda r: r.status == "ok", "runs ok", "bad/")
    assert failed.detail == f"0/1 runs ok; bad: refused {result.row['error']}"  # the row's words, no "str: "
    late = runner.run(tmp_path, gpu_runs.RunSpec("late", (), 2), flags, time.monotonic() + 1, None)
    assert (late.status, late.cut) == (gpu_runs.SKIPPED_STATUS, True)
    assert len(pd.read_csv(tmp_path / "runs.csv")) == 1  # nothing started, nothing written
