"""The lent GPU machine's Python, simulated: the packages it lacks (the network door's, LoadGen, the linters:
tests/gpu_image/sitecustomize.py) cannot be imported by any process of these runs. What must still work there: every
design over shm and queues, sweep.py and report.py on their rows, the `cuda` tests' collection, and a network run
refused in one line before anything starts. So the lease-readiness cannot regress unseen."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest
from conftest import ROOT, TINY, read_rows, run_command

from serverbench.config.flags import ConfigError
from serverbench.launch.preflight import check_installed
from tests.helpers import Background, start_first

GPU_IMAGE = ROOT / "tests" / "gpu_image"
DESIGNS = ("serial", "threaded", "pipelined")


def gpu_image_env() -> dict[str, str]:
    """This environment with the blocker first on PYTHONPATH (inherited by every child of a run)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(GPU_IMAGE), str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def in_gpu_image(
    args: list[str], timeout_s: float, cwd: Path = ROOT, also_missing: str = ""
) -> subprocess.CompletedProcess:
    env = gpu_image_env() | {"GPU_IMAGE_ALSO_MISSING": also_missing}
    return run_command([sys.executable, *args], timeout_s, cwd=cwd, env=env)


def test_the_simulated_machine_lacks_the_door_packages_and_keeps_the_core_ones() -> None:
    probe = "import importlib.util as u; print([m for m in {!r} if u.find_spec(m) is None])"
    missing = ("uvicorn", "h11", "httptools", "orjson", "tritonclient", "mlperf_loadgen")
    present = ("torch", "torchvision", "numpy", "pandas", "scipy", "pynvml", "grpc")
    gone = in_gpu_image(["-c", probe.format(missing)], 60)
    kept = in_gpu_image(["-c", probe.format(present)], 60)
    assert gone.stdout.strip() == repr(list(missing)), gone.stderr
    assert kept.stdout.strip() == "[]", kept.stderr
    # importlib.metadata too (pytest finds its plugins there; a row records the packages' versions from it)
    names = "import importlib.metadata as m; print(sorted({d.metadata['Name'].lower() for d in m.distributions()}))"
    listed = in_gpu_image(["-c", names], 60)
    distributions = set(ast.literal_eval(listed.stdout))
    assert {"torch", "pluggy", "pytest"} <= distributions and not {"orjson", "uvicorn"} & distributions


@pytest.fixture(scope="module")
def background() -> Iterator[Background]:
    """The module's two long commands, each on one core, side by side from the module's start: the sweep (its
    cells one after another) and the `cuda` tests' collection."""
    runs = Background("gpu-image", threads=2)
    yield runs
    runs.stop()


@pytest.fixture(scope="module")
def sweep(background: Background, tmp_path_factory) -> tuple[Future, Path]:
    """One sweep on the simulated machine: the three designs over shm and over queues, then its report: a future
    of (its CompletedProcess, its folder)."""
    out = tmp_path_factory.mktemp("gpu_image_sweep")
    queue_cells = [f"--experiment={design}_queue=--design {design} --transport queue" for design in DESIGNS]
    args = ["sweep.py", "--designs", *DESIGNS, "--workers", "2", "--batch_sizes", "2", "--compile", "false"]
    args += ["--repeats", "1", *queue_cells, "--out", str(out), "--plots_dir", str(out / "plots")]
    batch_at = TINY.index("--batch_size")  # the sweep's axis sets it (given after -- too, it is refused)
    args += ["--", *TINY[:batch_at], *TINY[batch_at + 2 :]]
    return background.command([sys.executable, *args], 240, env=gpu_image_env()), out


@pytest.fixture(scope="module")
def cuda_collected(background: Background) -> Future:
    """pytest run on the simulated machine over every module that holds `cuda` tests."""
    modules = sorted(
        str(path.relative_to(ROOT)) for path in (ROOT / "tests").glob("test_*.py") if "mark.cuda" in path.read_text()
    )
    pytest_args = ["-m", "pytest", "-p", "no:cacheprovider", "-q", "-m", "cuda", *modules]
    return background.command([sys.executable, *pytest_args], 280, env=gpu_image_env())


@pytest.fixture(scope="module", autouse=True)
def _background_runs_start_first(request: pytest.FixtureRequest) -> None:
    start_first(request, ("sweep", "cuda_collected"))


def test_every_design_runs_over_shm_and_queues_without_the_door_packages(sweep) -> None:
    started, out = sweep
    done = started.result()
    assert done.returncode == 0, done.stderr[-3000:]
    rows = read_rows(out / "runs.csv")
    cells = {(row["experiment"], row["transport"]): row["status"] for row in rows}
    expected = {("serial", "shm"), ("threaded", "shm"), ("pipelined_2w", "shm")}
    expected |= {(f"{design}_queue", "queue") for design in DESIGNS}
    assert set(cells) == expected
    assert set(cells.values()) == {"ok"}, cells


def test_report_reads_the_rows_on_the_simulated_machine(sweep, tmp_path) -> None:
    started, out = sweep
    done = started.result()
    assert "report in" in done.stdout + done.stderr  # the sweep's own report ran there
    again = in_gpu_image(
        ["report.py", str(out / "runs.csv"), "--out_dir", str(tmp_path), "--plots_dir", str(tmp_path)], 120
    )
    assert again.returncode == 0, again.stderr[-3000:]
    summary = (tmp_path / "summary.md").read_text()
    assert "pipelined_queue" in summary and "serial_queue" in summary
    assert sorted(p.name for p in tmp_path.glob("*.png"))


def test_the_cuda_tests_collect_there(cuda_collected: Future) -> None:
    """Every module that holds `cuda` tests imports without the door's packages; without a GPU each test skips."""
    done = cuda_collected.result()
    assert done.returncode == 0, done.stdout[-3000:]
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|skipped|failed|error)", done.stdout)}
    assert counts.get("failed", 0) == counts.get("error", 0) == 0, done.stdout[-3000:]
    assert counts.get("passed", 0) + counts.get("skipped", 0) >= 13, done.stdout[-3000:]


@pytest.mark.parametrize(
    "flags, feature",
    [
        (["--transport", "http"], "--transport http"),
        (["--transport", "grpc", "--serve_only"], "--serve_only"),
        (["--target", "grpc://127.0.0.1:9"], "--target"),
    ],
)
def test_a_network_run_is_refused_in_one_line_before_anything_starts(flags, feature, tmp_path) -> None:
    results = tmp_path / "results"
    base = list(TINY)
    if "--target" in flags:  # the model-alone ceiling is our backend's: --target refuses --ceiling_s
        del base[base.index("--ceiling_s") : base.index("--ceiling_s") + 2]
    done = in_gpu_image(["server.py", *base, *flags, "--results_dir", str(results)], 60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"server.py: error: {feature} needs uvicorn, which is not installed: pip install -e '.[door]' "
        "(./venv.sh installs it), or choose --transport shm or queue"
    ]
    assert not results.exists()


@pytest.mark.parametrize("missing, model", [("torch", "identity"), ("tqdm", "identity"), ("torchvision", "resnet18")])
def test_a_python_without_a_core_package_is_refused_before_anything_starts(missing, model, tmp_path) -> None:
    """A bare python3 in place of the project's environment started the run's processes, which died one after
    another (backend_died), or the server itself at its end (pandas, for the detail files)."""
    results = tmp_path / "results"
    done = in_gpu_image(["server.py", *TINY, "--model", model, "--results_dir", str(results)], 60, also_missing=missing)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"server.py: error: this Python ({sys.executable}) has no {missing}, which every run needs: run it with the "
        "project's environment (./venv.sh python server.py ...), or pip install -e ."
    ]
    assert not results.exists()


def test_check_installed_names_the_first_missing_package_and_its_extra() -> None:
    check_installed("--x", "door", {"os": "os", "json": "json"})  # all there: silent
    with pytest.raises(ConfigError, match=r"^--x needs not-a-pkg, which is not installed: pip install -e '\.\[door\]'"):
        check_installed("--x", "door", {"os": "os", "no_such_module_here": "not-a-pkg", "also_missing": "b"})
