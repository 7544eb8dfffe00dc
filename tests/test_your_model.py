"""The user's own model (docs/your-model.md): every form of --model served end to end on the CPU, several inputs through
dynamic batching, outputs of any structure verified leaf by leaf, and every bad source or input refused in one line
before anything is written. --input's parsing and the transports' several inputs: test_inputs.py."""

from __future__ import annotations

import io
import logging
import re
import sys
import textwrap
import warnings
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import torch._inductor
from conftest import ServerRun, communicate_or_fail, read_rows, run_server, start_server

import server
from examples import export_tiny_encoder
from serverbench.backend.sources import compile_aoti
from serverbench.load.verify import leaf_errors
from tests.helpers import QUICK, Background, exit_code, ok_row, serve, start_first

# Small and quick: a few requests, no ceiling (it would time each model again).
ENCODER = ["--model", "examples.tiny_encoder:make_model", "--model_kwargs", '{"depth": 1}']
TOKENS = ["--input", "ids:int64:8:0-999", "--input", "mask:int64:8:1-1"]
TOKENS_SERVED = "ids:int64:8:0-999 mask:int64:8:1-1"


def encoder_request_bytes(batch: int) -> int:
    return batch * 2 * 8 * 8  # ids and mask, 8 int64 tokens each


def encoder_response_bytes(batch: int) -> int:
    return batch * (64 + 8 * 1000) * 4  # pooled [B, 64] and logits [B, 8, 1000], float32


# Factories for the tests, imported by the server from its current folder (the tests run it there).
FACTORIES = '''
import torch
from torch import nn

NOT_CALLABLE = 3


class Nested(nn.Module):
    """A dict holding a tuple: leaves a (float32), b[0] (int64), b[1] (float16, returned as float32)."""

    def __init__(self, drift: bool = False):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(3.0))
        self.drift = drift
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        index = x.argmax(1)
        if self.drift:  # a different integer answer at every forward: the reference and the served ones differ
            index = index + self.calls
        return {"b": (index, (x[:, :3] * self.scale).half()), "a": torch.tanh(x)}


def nested(drift: bool = False):
    return Nested(drift)


class Sum(nn.Module):
    def forward(self, x):
        return x.sum()


def scalar():
    return Sum()


class WithInt(nn.Module):
    def forward(self, x):
        return (x, 3)


def not_a_tensor():
    return WithInt()


def raises(width: int = 4):
    raise RuntimeError(f"width {width} is too narrow")


def not_a_module():
    return lambda x: x


class FailsOnThirdCall(nn.Module):
    calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("the third forward fails")
        return x * 2

'''


@pytest.fixture(scope="module")
def factories(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("factories")
    (folder / "factories.py").write_text(textwrap.dedent(FACTORIES))
    (folder / "broken_import.py").write_text("import no_such_module_for_this_test\n")
    return folder


class AotiRuns:
    """Two --aoti runs into one results folder, so one cache: the tiny encoder (a dynamic batch, as dynamic
    batching compiles it) compiled at the first run and loaded at the second (another design, another number of
    runners); other models: test_each_model_and_its_weights_get_a_package_of_their_own. The package then serves
    the tests of a package given as --model: AOTInductor compiles C++ for tens of seconds a package, so this file
    compiles no other. In the background: the compile takes one core, and the module's other runs go on."""

    def __init__(self, results: Path) -> None:
        self.cache = results / "aoti_cache"
        self.runs = Background("aoti-runs")
        aoti = [*QUICK, "--aoti", "--verify"]
        encoder = [*aoti, *ENCODER, *TOKENS, "--max_batch_size", "4", "--max_inflight", "1"]

        def checked(rows: int) -> Callable[[ServerRun], tuple[dict[str, str], list[Path]]]:
            """The run's row (the rows-th in the folder's output.csv) and the packages in the cache after it."""
            return lambda run: (ok_row(run, rows=rows), sorted(self.cache.glob("*.pt2")))

        self.first = self.runs.submit([*encoder, "--design", "serial"], results, after=checked(1)).result
        pipelined = [*encoder, "--design", "pipelined", "--num_workers", "3"]
        self.second = self.runs.submit(pipelined, results, after=checked(2)).result

    def package(self) -> Path:
        """The tiny encoder's package, compiled by the first run (a batch of 1 to 4, 8 tokens)."""
        (package,) = self.first()[1]
        return package

    def stop(self) -> None:
        self.runs.stop()


@pytest.fixture(scope="module")
def aoti_runs(tmp_path_factory) -> Iterator[AotiRuns]:
    runs = AotiRuns(tmp_path_factory.mktemp("aoti"))
    yield runs
    runs.stop()


@pytest.fixture(scope="module", autouse=True)
def _background_runs_start_first(request: pytest.FixtureRequest) -> None:
    """The --aoti runs and the refusals run as processes, from the module's start."""
    start_first(request, ("aoti_runs", "process_refusals"))


@dataclass(frozen=True)
class ExampleExport:
    folder: Path
    compiled: list[tuple[torch.export.ExportedProgram, str]]  # what aoti_compile_and_package was given


@pytest.fixture(scope="module")
def example_export(tmp_path_factory) -> ExampleExport:
    """examples.export_tiny_encoder (8 tokens, depth 1, a batch of 1 to 16) run in this process, AOTInductor's
    compiler recorded instead of run: the program is written, and the call that would package it is kept (the
    compile itself is --aoti's, whose package serves the tests of a package given as --model)."""
    folder = tmp_path_factory.mktemp("exported")
    compiled: list[tuple[torch.export.ExportedProgram, str]] = []

    def record(program: torch.export.ExportedProgram, package_path: str) -> None:
        compiled.append((program, package_path))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch._inductor, "aoti_compile_and_package", record)
        argv = ["--out", str(folder), "--tokens", "8", "--depth", "1", "--max_batch", "16"]
        assert export_tiny_encoder.main(argv) == 0
    return ExampleExport(folder, compiled)


@pytest.fixture(scope="module")
def exported(example_export: ExampleExport) -> dict[str, Path]:
    """The example's exported program (dynamic batch 1 to 16); a static-batch program; and two .pt2 files that are
    neither. The package is AotiRuns.package()."""
    folder = example_export.folder
    static = folder / "static.pt2"
    torch.export.save(torch.export.export(torch.nn.Linear(4, 2), (torch.randn(2, 4),)), static)
    garbage = folder / "garbage.pt2"
    garbage.write_bytes(b"not a zip archive at all\n")
    not_program = folder / "not_program.pt2"
    with zipfile.ZipFile(not_program, "w") as archive:
        archive.writestr("notes/readme.txt", "a zip, but no program in it")
    return {
        "program": folder / "tiny_encoder.pt2",
        "static": static,
        "garbage": garbage,
        "not_program": not_program,
    }


# ------------------------------------------------------------------------------------------------ each --model form


def test_a_factory_is_served_with_its_kwargs_and_every_input_through_dynamic_batching(tmp_path: Path) -> None:
    args = [*QUICK, *ENCODER, *TOKENS, "--verify", "--design", "pipelined", "--max_batch_size", "8"]
    row = ok_row(serve([*args, "--max_queue_delay_ms", "20"], tmp_path))
    assert (row["model"], row["model_kwargs"], row["compile_path"]) == (ENCODER[1], '{"depth": 1}', "eager")
    assert row["aoti_runners"] == row["aoti_compiled_now"] == ""  # not AOTInductor: empty, not 0 or False
    assert row["inputs"] == TOKENS_SERVED
    # Requests of 2 were batched together (both inputs concatenated), and every response held its own rows of both
    # output leaves, right (the tolerance is 1e-4 with dynamic batching).
    assert row["max_batch_size"] == "8" and float(row["mean_formed_batch"]) > 2
    assert int(row["request_bytes"]) == encoder_request_bytes(2)
    assert int(row["response_bytes"]) == encoder_response_bytes(2)


def test_an_exported_program_is_served_with_the_inputs_read_from_it(tmp_path: Path, exported) -> None:
    row = ok_row(serve([*QUICK, "--model", str(exported["program"]), "--batch_size", "3", "--verify"], tmp_path))
    assert row["compile_path"] == "eager" and row["model_kwargs"] == "" and row["aoti_runners"] == ""
    assert row["inputs"] == "ids:int64:8 mask:int64:8"  # names, dtypes and shapes from the program itself
    assert int(row["request_bytes"]) == encoder_request_bytes(3)
    assert int(row["response_bytes"]) == encoder_response_bytes(3)


def test_the_example_packages_the_program_it_exports(example_export: ExampleExport) -> None:
    """The example hands AOTInductor the very program it wrote, for tiny_encoder_aoti.pt2: both inputs a batch of
    1 to 16 rows of 8 tokens."""
    ((program, package_path),) = example_export.compiled
    assert package_path == str(example_export.folder / "tiny_encoder_aoti.pt2")
    assert program.graph_module.code == torch.export.load(example_export.folder / "tiny_encoder.pt2").graph_module.code
    inputs = {node.name: node.meta["val"].shape for node in program.graph.nodes if node.op == "placeholder"}
    (batch,) = program.range_constraints  # the one dynamic dimension
    assert (program.range_constraints[batch].lower, program.range_constraints[batch].upper) == (1, 16)
    assert [tuple(map(str, inputs[name])) for name in ("ids", "mask")] == [(str(batch), "8")] * 2


def _entries(archive: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(archive)) as opened:
        return {name: opened.read(name) for name in opened.namelist()}


@pytest.fixture
def stand_in_compiler(monkeypatch) -> list[str]:
    """AOTInductor's compiler replaced by one writing a small package (a real one: AotiRuns): the packages it wrote."""
    compiled: list[str] = []

    def fake_compile(program, package_path: str) -> None:
        compiled.append(package_path)
        with zipfile.ZipFile(package_path, "w") as archive:
            archive.writestr("model/data/aotinductor/model/model.wrapper.so", bytes(range(256)) * 64)

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", fake_compile)
    return compiled


def test_a_damaged_cached_aoti_package_is_compiled_again_and_the_log_says_so(tmp_path, stand_in_compiler, caplog):
    """A package cut short in the cache (a full disk, a copy stopped half-way) is not served from it for ever."""
    args = (torch.nn.Linear(4, 2), (torch.randn(2, 4),), None, tmp_path, "a linear layer", 10)
    package, now = compile_aoti(*args)
    assert now and compile_aoti(*args) == (package, False)  # whole: served from the cache
    whole = Path(package).read_bytes()
    Path(package).write_bytes(whole[: len(whole) // 2])
    with caplog.at_level(logging.WARNING, logger="backend"):
        assert compile_aoti(*args) == (package, True)
    assert f"{package} is damaged" in caplog.text and "compiling it again" in caplog.text
    # The same archive written again (its entries' times may differ: zip stamps each entry's write time).
    assert _entries(Path(package).read_bytes()) == _entries(whole) and compile_aoti(*args) == (package, False)


def test_each_model_and_its_weights_get_a_package_of_their_own(tmp_path: Path, stand_in_compiler) -> None:
    """One --aoti cache serves several models: another model, or the same one with other weights (a retrained
    checkpoint), is compiled anew into a package of its own, and each is served again from the cache."""
    torch.manual_seed(0)
    models = {"linear": torch.nn.Linear(4, 2), "wider": torch.nn.Linear(4, 3), "retrained": torch.nn.Linear(4, 2)}
    example = (torch.randn(2, 4),)
    packages = {name: compile_aoti(model, example, None, tmp_path, "cpu", 10) for name, model in models.items()}
    assert all(now for _, now in packages.values()) and len(stand_in_compiler) == 3
    assert sorted(tmp_path.glob("*.pt2")) == sorted(Path(path) for path, _ in packages.values())  # three
    for name, model in models.items():
        assert compile_aoti(model, example, None, tmp_path, "cpu", 10) == (packages[name][0], False)
    assert len(stand_in_compiler) == 3


# ------------------------------------------------------------------------------------------------ outputs and --verify


def serve_at_once(runs: dict[str, list[str]], folder: Path, cwd: Path) -> dict[str, ServerRun]:
    """server.py with each of `runs`' args, all at once, each into folder/<its name>, as serve() runs it: for runs
    that assert on no time (most of each is a process importing torch, on one core)."""
    started = {name: start_server(args, folder / name, "output.csv", cwd=cwd) for name, args in runs.items()}
    served = {}
    for name, proc in started.items():
        stdout, stderr = communicate_or_fail(proc, 240, f"server.py ({name})")
        served[name] = ServerRun(proc.returncode, stdout, stderr, read_rows(folder / name / "output.csv"), proc.pid)
    return served


def test_nested_outputs_travel_whole_and_every_leaf_is_verified(tmp_path: Path, factories: Path) -> None:
    """The same model twice, the second with an integer leaf that drifts at every forward: the served answers
    differ from the reference in that leaf alone (the last in pytree order), and --verify says so."""
    args = [*QUICK, "--model", "factories:nested", "--input", "x:float32:4", "--verify", "--num_workers", "2"]
    runs = serve_at_once({"good": args, "drift": [*args, "--model_kwargs", '{"drift": true}']}, tmp_path, factories)
    row = ok_row(runs["good"])
    assert (row["inputs"], row["compile_path"], row["model_kwargs"]) == ("x:float32:4", "eager", "")
    # a [B, 4] float32, b[0] [B] int64 (kept an integer), b[1] [B, 3] float16 (returned as float32)
    assert int(row["response_bytes"]) == 2 * (4 * 4 + 8 + 3 * 4)
    assert row["max_abs_error"] == "0.0"

    row = runs["drift"].row
    assert row["status"] == "wrong_output", row["error"]
    # every measured response (and the warm-up's, which is verified too)
    assert int(row["wrong_outputs"]) in (10, 11) and float(row["max_abs_error"]) >= 1


LOG_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [\w ]+\[\d+\] [A-Z]+ ")  # a process's log line


def test_a_model_error_while_serving_is_one_line_on_stderr_and_its_traceback_in_the_file_the_row_names(
    tmp_path: Path, factories: Path
) -> None:
    """The forward raises at its third call (the first measured request): stderr says so in one line besides the
    log lines, without a traceback, which is kept in the file the row names."""
    args = [*QUICK, "--model", "factories:FailsOnThirdCall", "--input", "x:float32:4", "--design", "serial"]
    run = serve(args, tmp_path, cwd=factories, timeout_s=120)
    assert run.returncode == 1, run.stderr[-3000:]
    row = run.row
    assert (row["status"], row["error"]) == ("error", "RuntimeError: the third forward fails")
    assert "Traceback" not in run.stderr + run.stdout
    traceback_file = tmp_path / row["traceback_file"]
    said = [line for line in run.stderr.splitlines() if not LOG_LINE.match(line)]
    assert said == [
        f"server.py: run failed (error): RuntimeError: the third forward fails (traceback: {traceback_file})"
    ]
    kept = traceback_file.read_text()
    assert kept.startswith("Traceback (most recent call last):") and 'raise RuntimeError("the third forward' in kept


def test_leaf_errors_compare_floats_within_tolerance_and_everything_else_exactly() -> None:
    floats = np.array([[0.5, -1.0], [2.0, 3.0]], dtype=np.float32)
    ints = np.array([7, 3], dtype=np.int64)
    expected = (floats, ints)
    assert leaf_errors((floats.copy(), ints.copy()), expected, 0.0) == (0.0, False)

    near = floats + np.float32(1e-3)
    error, wrong = leaf_errors((near, ints.copy()), expected, 1e-2)
    assert not wrong and error == pytest.approx(1e-3, rel=1e-3)  # within the tolerance
    assert leaf_errors((near, ints.copy()), expected, 1e-4)[1]  # beyond it

    off_by_one = ints.copy()
    off_by_one[1] += 1
    error, wrong = leaf_errors((floats.copy(), off_by_one), expected, 10.0)
    assert wrong and error == 1.0  # an integer leaf is exact, whatever the float tolerance

    assert leaf_errors((floats.copy(), ints[:1].copy()), expected, 10.0) == (float("inf"), True)  # another shape
    assert leaf_errors((floats.copy(),), expected, 10.0) == (float("inf"), True)  # a leaf missing
    with_nan = floats.copy()
    with_nan[0, 1] = np.nan
    assert leaf_errors((with_nan, ints.copy()), expected, 10.0)[1]  # NaN is never within any tolerance
    mask = np.array([True, False])
    assert leaf_errors((~mask,), (mask,), 10.0)[1]  # bool leaves exactly too
    # A float64 leaf near its type's top: its scale must not overflow (0 x inf was NaN, and every answer wrong).
    huge = np.array([[1e300, -1e300, 1.0]])
    assert leaf_errors((huge.copy(),), (huge,), 0.0) == (0.0, False)
    assert leaf_errors((huge * 1.01,), (huge,), 0.0)[1]  # and a real difference still counts
    # An infinity the serial answer has too is the same answer (inf - inf is NaN, and was counted wrong); one of
    # the other sign is not.
    overflowed = np.array([[np.inf, -np.inf, 1.0]], dtype=np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nor a RuntimeWarning on the server's stderr
        assert leaf_errors((overflowed.copy(),), (overflowed,), 0.0) == (0.0, False)
    assert leaf_errors((-overflowed,), (overflowed,), 10.0)[1]


# ------------------------------------------------------------------------------------------------ refused up front

TOKENS_NO_RANGE = ["--input", "ids:int64:8", "--input", "mask:int64:8"]
PROCESS = "process"  # the case runs server.py as a process: what it does can take the process down, or print
# more than Python's stderr (the AOTInductor runtime's C++, torch's import-time warnings)
BAD_USER_MODELS = [
    (["--model", "broken_import:make"], "cannot import broken_import (ModuleNotFoundError"),
    (["--model", "broken_import:make"], "cannot import broken_import (ModuleNotFoundError", PROCESS),
    (["--model", "factories:missing"], "--model factories:missing: factories has no attribute missing"),
    (["--model", "factories:NOT_CALLABLE"], "NOT_CALLABLE is a int, not callable"),
    (["--model", "factories:raises", "--model_kwargs", '{"width": 3}'], "raised RuntimeError: width 3 is too narrow"),
    (["--model", "factories:raises", "--model_kwargs", '{"depth": 3}'], "raised TypeError"),
    (["--model", "factories:not_a_module"], "not_a_module returned a function, not an nn.Module"),
    (["--model", "factories:", "--input", "x:float32:4"], "expected package.module:factory"),
    (["--model", "factories:nested", "--model_kwargs", "{drift: 1}"], "not JSON"),
    (["--model", "factories:nested", "--model_kwargs", "[1, 2]"], "expected a JSON object"),
    (["--model", "identity", "--model_kwargs", "{}"], "--model_kwargs applies to a package.module:factory --model"),
    (["--model", "{program}", "--model_kwargs", "{}"], "--model_kwargs applies to a package.module:factory --model"),
    (["--model", "{garbage}"], "not a .pt2 archive"),
    pytest.param(
        ["--model", "{not_program}"],
        "not a torch.export program (RuntimeError: ",  # the cause, not "see the warnings above"
        "in",
        id="--model {not_program}",
    ),
    (["--model", "{missing}"], "no such file"),
    (
        ["--model", "{program}", "--input", "ids:int32:8", "--input", "mask:int64:8"],
        "--input ids:int32:8: the program's input ids is int64 8 per sample",
    ),
    (
        ["--model", "{program}", "--input", "ids:int64:9", "--input", "mask:int64:8"],
        "--input ids:int64:9: the program's input ids is int64 8 per sample",
    ),
    (["--model", "{program}", "--input", "ids:int64:8"], "takes 2 input(s) (ids int64 8, mask int64 8), --input gives"),
    (["--model", "{program}", "--max_batch_size", "32"], "its batch dimension takes 1 to 16; this run needs 2 to 32"),
    (["--model", "{static}", "--batch_size", "3"], "exported with a static batch of 2; serve it with --batch_size 2"),
    (["--model", "{static}", "--max_batch_size", "4"], "--max_batch_size cannot form larger batches"),
    (["--model", "{program}", "--precision", "bf16"], "--precision bf16: a .pt2 --model's dtypes and layout"),
    (["--model", "{program}", "--channels_last"], "--channels_last: a .pt2 --model's dtypes and layout were fixed"),
    (["--model", "{program}", "--checkpoint", "{static}"], "a .pt2 --model holds its own weights"),
    (["--model", "identity", "--aoti", "--compile"], "--aoti and --compile are two compile paths"),
    (["--model", "identity", "--input", "x:float32:4"], "the built-in model identity takes the image of --image_size"),
    (["--model", "resnet18", "--input", "x:float32:4"], "the built-in model resnet18 takes the image of --image_size"),
    ([*ENCODER, *TOKENS, "--wire_dtype", "uint8"], "--wire_dtype uint8 sends raw pixels of one float32 [3, H, W]"),
    (["--model", "{program}", "--wire_dtype", "uint8"], "this model's inputs are ids:int64:8, mask:int64:8"),
    ([*ENCODER, "--input", "x:float32:4", "--input", "x:float32:4"], "--input names must differ: x given more"),
    ([*ENCODER, "--input", "ids:int8:4:0-300"], "outside what int8 holds"),
    (
        [*ENCODER, "--input", "ids:int64:8:0-999"],
        "its forward fails on the generated inputs (ids int64 [2, 8]): TypeError",
    ),
    (
        [*ENCODER, "--input", "ids:int64:8:0-5000", "--input", "mask:int64:8:1-1"],
        "its forward fails on the generated inputs (ids int64 [2, 8], mask int64 [2, 8]): IndexError",
    ),
    (["--model", "factories:scalar", "--input", "x:float32:4"], "has no batch dimension of 2 first"),
    (["--model", "factories:not_a_tensor", "--input", "x:float32:4"], "holds a int; every leaf must be a tensor"),
    # The package --aoti compiled: last, so that the first --aoti run has had the time of the cases above.
    (["--model", "{package}"], "is an AOTInductor package, which does not say what its inputs are"),
    (["--model", "{package}"], "is an AOTInductor package, which does not say what its inputs are", PROCESS),
    (["--model", "{package}", *TOKENS_NO_RANGE, "--compile"], "--compile: --model {package} is an AOTInductor package"),
    (["--model", "{package}", *TOKENS_NO_RANGE, "--aoti"], "--aoti: --model {package} is an AOTInductor package"),
    # An AOTInductor package whose --input does not fit it: its forward is tried in a real process.
    pytest.param(
        ["--model", "{package}", "--input", "ids:int64:8"],
        "its forward fails on the generated inputs (ids int64 [2, 8]): RuntimeError",
        PROCESS,
        id="package with one input of two",
    ),
    pytest.param(
        ["--model", "{package}", "--input", "ids:int64:8:0-5000", "--input", "mask:int64:8:1-1"],
        "its forward fails on the generated inputs (ids int64 [2, 8], mask int64 [2, 8]): the process ended "
        "(signal 6): index out of bounds",
        PROCESS,
        id="package with token ids beyond its vocabulary",
    ),
    pytest.param(
        ["--model", "{package}", "--input", "ids:int64:9", "--input", "mask:int64:9"],
        "unmatched dim value at 1, expected: 8, but got: 9",
        PROCESS,
        id="package with inputs of another shape",
    ),
]


def _bad_cases() -> list:
    cases = []
    for case in BAD_USER_MODELS:
        if not hasattr(case, "marks"):  # a plain tuple, not a pytest.param already
            argv, fragment, *how = case
            how = how[0] if how else "in"
            case = pytest.param(argv, fragment, how, id=" ".join(argv) + (" (process)" if how == PROCESS else ""))
        cases.append(case)
    return cases


def _refused_argv(argv: list[str], paths: dict[str, str]) -> list[str]:
    """A case's command line: its {name}s replaced, and a short benchmark around it (a refusal that does not come
    would run 2 requests, not the default 100 and the ceiling)."""
    argv = [paths[arg[1:-1]] if re.fullmatch(r"\{\w+\}", arg) else arg for arg in argv]
    return [
        "--device",
        "cpu",
        "--image_size",
        "8",
        "--batch_size",
        "2",
        *argv,
        "--num_iters",
        "2",
        "--warmup_iters",
        "1",
        "--no-ceiling",
    ]


@pytest.fixture(scope="module")
def process_refusals(tmp_path_factory, factories: Path, aoti_runs: AotiRuns) -> Iterator[dict[tuple, tuple]]:
    """The table's PROCESS cases, run as a user runs server.py, in the background from the module's start (each
    is two torch imports of waiting: the server's check of the model, in a child): (its template, fragment) -> (the
    run's future, its results folder). Those of the package wait for the first --aoti run's."""
    folder = tmp_path_factory.mktemp("refusals")
    runs = Background("refusals")
    started = {}
    for number, (argv, fragment, how) in enumerate(case.values for case in _bad_cases()):
        if how != PROCESS:
            continue
        results = folder / str(number) / "results"

        def args(argv: list[str] = argv) -> list[str]:
            paths = {"package": str(aoti_runs.package())} if "{package}" in argv else {}
            return _refused_argv(argv, paths)

        started[(tuple(argv), fragment)] = (runs.submit(args, results, cwd=factories), results)
    yield started
    runs.stop()


@pytest.mark.parametrize("argv,fragment,how", _bad_cases())
def test_a_bad_model_source_or_input_is_one_line_and_exit_2(
    argv: list[str],
    fragment: str,
    how: str,
    tmp_path: Path,
    factories: Path,
    exported: dict[str, Path],
    aoti_runs: AotiRuns,
    process_refusals: dict[tuple, tuple],
    capfd,
    monkeypatch,
) -> None:
    """Refused before any process starts: exit status 2, one line naming what is wrong, nothing written. Most cases
    run server.main in this process (a subprocess each would cost seconds of torch import); those marked PROCESS
    run server.py as a user does."""
    paths = {name: str(path) for name, path in exported.items()}
    if "{package}" in " ".join([*argv, fragment]):
        paths["package"] = str(aoti_runs.package())  # waits for the first --aoti run
    paths["missing"] = str(tmp_path / "missing.pt2")
    results = tmp_path / "results"
    if how == PROCESS:
        ran, results = process_refusals[(tuple(argv), fragment)]
        run = ran.result(timeout=240)
        returncode, stderr, stdout = run.returncode, run.stderr, run.stdout
    else:
        argv = _refused_argv(argv, paths)
        started = []
        monkeypatch.setattr(server, "run_benchmark", lambda cfg: started.append(cfg))
        monkeypatch.chdir(factories)  # a factory is imported from the current folder
        monkeypatch.setattr(sys, "path", list(sys.path))  # which the import puts first
        try:
            returncode = exit_code([*argv, "--results_dir", str(results)])
        finally:
            for name in ("factories", "broken_import"):
                sys.modules.pop(name, None)
        stdout, stderr = capfd.readouterr()
        assert started == []
    assert returncode == 2, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if "server[" not in line]
    assert len(lines) == 1, lines
    assert lines[0].startswith("server.py: error: ")
    assert re.sub(r"\{(\w+)\}", lambda m: paths[m.group(1)], fragment) in lines[0]
    assert not results.exists()  # nothing written: no results folder, no CSV, no AOTInductor cache
    assert stdout == ""


# ------------------------------------------------------------------------------------------------ AOTInductor runs
# Last in the file: the runs AotiRuns started at the module's start have had the time of the tests above.


def test_an_aoti_package_is_served_with_a_runner_per_request_held(tmp_path: Path, aoti_runs: AotiRuns) -> None:
    """...and the copies the probe and the backend extracted from it are gone with the run: each process leaves
    with os._exit, which skips the loader's destructor that removes its copy (tens of MB for a real model)."""
    args = [*QUICK, "--model", str(aoti_runs.package()), *TOKENS, "--verify", "--design", "pipelined"]
    temp = tmp_path / "tmp"
    temp.mkdir()
    run = run_server(
        [*args, "--num_workers", "2", "--max_inflight", "4"],
        tmp_path,
        output_file="output.csv",
        env={"TMPDIR": str(temp)},
    )
    row = ok_row(run)
    assert [entry.name for entry in temp.iterdir() if not entry.name.startswith("torchinductor_")] == []
    assert (row["compile_path"], row["aoti_runners"], row["num_workers"]) == ("aoti", "4", "2")
    assert row["aoti_compiled_now"] == ""  # compiled by whoever packaged it, not by this run
    assert row["inputs"] == TOKENS_SERVED
    assert int(row["request_bytes"]) == encoder_request_bytes(2)
    assert int(row["response_bytes"]) == encoder_response_bytes(2)
    assert not (tmp_path / "aoti_cache").exists()


def test_aoti_compiles_once_per_model_and_serves_every_design_from_the_cache(aoti_runs: AotiRuns) -> None:
    """Runners: one per request the backend may hold (--max_inflight), at least one per prediction thread."""
    (first, after_first), (second, after_second) = aoti_runs.first(), aoti_runs.second()
    assert (first["compile_path"], first["aoti_runners"], first["aoti_compiled_now"]) == ("aoti", "1", "True")
    assert first["inputs"] == TOKENS_SERVED and int(first["response_bytes"]) == encoder_response_bytes(2)
    assert len(after_first) == 1

    assert (second["compile_path"], second["aoti_runners"], second["aoti_compiled_now"]) == ("aoti", "3", "False")
    assert second["num_workers"] == "3" and float(second["m_compile_time"]) < float(first["m_compile_time"])
    assert after_second == after_first  # that package, not another
