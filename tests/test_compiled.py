"""torch.compile with several forward threads: each thread calls a compiled copy of its own, so that dynamo's guards
are never evaluated by two threads at once (serverbench.backend.compiled)."""

from __future__ import annotations

import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import ServedMeanwhile
from torch import nn
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from serverbench.backend.ceiling import measure_ceiling
from serverbench.backend.compiled import ForwardModels, compile_per_thread, graph_break_count, one_at_a_time
from serverbench.backend.sources import program_digest
from serverbench.backend.stages import Failure
from serverbench.config.inputs import padding_value, parse_input
from serverbench.device.layer import make_device_layer
from serverbench.system.scratch import inductor_cache_dir
from tests.helpers import (
    QUICK,
    CollectResponses,
    FakeRequests,
    design_stages,
    ok_row,
    run_design,
    worker_config,
)

SIZES = (4, 8, 12)

# The model of the end-to-end run, imported by the server from the folder it runs in.
COMPILE_FACTORIES = '''
import torch
from torch import nn


class PositionsThenBreak(nn.Module):
    """Positions counted from 1, as some models take them: a 0 would index the table at -1. Then a graph break:
    dynamo compiles the rest of this forward as a frame of its own, which every thread's copy shares."""

    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(8, 4)

    def forward(self, x, pos):
        looked_up = x + self.table(pos - 1).sum(1)
        torch._dynamo.graph_break()
        return looked_up * 2 + pos.float().sum(1, keepdim=True)


def positions_then_break():
    return PositionsThenBreak()
'''


@pytest.fixture(scope="module")
def compile_factories(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("compile_factories")
    (folder / "factories.py").write_text(textwrap.dedent(COMPILE_FACTORIES))
    return folder


class TwoInputs(torch.nn.Module):
    """Two tensor arguments and parameters: dynamo guards that none of them alias (a guard that keeps state while it
    runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + y


def test_two_threads_call_their_own_compiled_copies_without_a_recompile() -> None:
    torch.manual_seed(0)
    model = TwoInputs()
    models = compile_per_thread(model, 2, mode=None)
    assert len(models.copies) == 2
    codes = {copy._torchdynamo_orig_callable.__code__ for copy in models.copies}
    assert len(codes) == 2  # each copy's entries and guards live on a code object of its own
    inputs = {rows: (torch.randn(rows, 4), torch.randn(rows, 4)) for rows in SIZES}
    breaks_before = graph_break_count()
    with torch.inference_mode():
        for copy in models.copies:  # warmed at every size on this thread, as the backend does before serving
            for rows in SIZES:
                copy(*inputs[rows])
    # One graph per size and copy: a copy's own code object breaks nothing (a break would make the backend run the
    # forwards one at a time: the end-to-end run below has one, and the row counts it).
    assert graph_break_count() == breaks_before
    errors: list[BaseException] = []

    def serve(thread: int) -> None:
        try:
            with torch.inference_mode():
                for k in range(2000):  # one shared compiled model failed within this many calls in every run
                    rows = SIZES[k % len(SIZES)]
                    out = models.for_thread(thread)(*inputs[rows])
                    assert out.shape == (rows, 4)
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            errors.append(exc)

    with torch.compiler.set_stance("fail_on_recompile"):
        threads = [threading.Thread(target=serve, args=(i,)) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    assert errors == []
    with torch.inference_mode():  # the copies are the model: the same answer as the eager module
        torch.testing.assert_close(models.for_thread(1)(*inputs[8]), model(*inputs[8]))


class Recorder:
    """A callable that notes the threads that called it. Its first call waits (at most 10 s) until the other copy's
    first call has come too: each prediction thread gets a request, however the machine schedules them (on a
    loaded one, predict-0 alone once took all 40)."""

    def __init__(self, name: str, meet: threading.Barrier) -> None:
        self.name = name
        self.meet: threading.Barrier | None = meet
        self.threads: set[str] = set()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.meet is not None:
            meet, self.meet = self.meet, None
            meet.wait(timeout=10)
        self.threads.add(threading.current_thread().name)
        return x.sum(dim=(1, 2, 3)).unsqueeze(1)


def test_each_prediction_thread_and_each_ceiling_thread_calls_its_own_copy(tmp_path: Path) -> None:
    both = threading.Barrier(2)
    copies = (Recorder("a", both), Recorder("b", both))
    models = ForwardModels(copies)
    cfg = worker_config(tmp_path, "pipelined", workers=2)
    responses = CollectResponses()
    failure = Failure(threading.Event())
    stages = design_stages(cfg, make_device_layer("cpu"), models, responses)
    run_design(cfg, stages, failure, FakeRequests([torch.randn(3, 3, 8, 8) for _ in range(40)]))
    failure.check()
    assert copies[0].threads == {"predict-0"} and copies[1].threads == {"predict-1"}
    for copy in copies:
        copy.threads.clear()
    example = (torch.randn(3, 3, 8, 8),)
    measure_ceiling(models, example, make_device_layer("cpu"), 3, concurrencies=[1, 2], total_s=0.05, loops=2)
    # c = 1 runs thread 0's copy on the calling thread; c = 2 each of the two threads its own.
    assert copies[0].threads == {threading.current_thread().name, "ceiling-0"}
    assert copies[1].threads == {"ceiling-1"}


def test_a_model_every_thread_shares_is_one_callable() -> None:
    model = torch.nn.Identity()
    assert ForwardModels.of(model).for_thread(0) is model and ForwardModels.of(model).for_thread(3) is model
    models = ForwardModels((model, model))
    assert ForwardModels.of(models) is models


class Overlap:
    """A callable that notes how many threads were inside it at once (the sleep lets another thread in)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active = self.max_active = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        with self.lock:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
        time.sleep(0.005)
        with self.lock:
            self.active -= 1
        return x


def test_one_at_a_time_lets_one_forward_in_at_once_and_gives_up_in_words() -> None:
    shared = Overlap()
    models = one_at_a_time(ForwardModels((shared, shared)), timeout_s=30)
    threads = [
        threading.Thread(target=lambda i=i: [models.for_thread(i)(torch.zeros(1)) for _ in range(20)]) for i in range(2)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert shared.max_active == 1
    free = Overlap()  # without the lock the same two threads do overlap: the check above can fail
    threads = [threading.Thread(target=lambda: [free(torch.zeros(1)) for _ in range(20)]) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert free.max_active == 2
    gate = threading.Event()
    held = one_at_a_time(ForwardModels((lambda x: gate.wait(30) and x, lambda x: x)), timeout_s=0.2)
    holder = threading.Thread(target=held.for_thread(0), args=(torch.zeros(1),))
    holder.start()
    time.sleep(0.05)  # the holder is inside its forward (it waits on the gate)
    with pytest.raises(TimeoutError, match="held the compiled model"):
        held.for_thread(1)(torch.zeros(1))
    gate.set()
    holder.join(timeout=30)


# ------------------------------------------------------------------ end to end: padding and graph breaks


@pytest.fixture(scope="module")
def compiled_run(tmp_path_factory, compile_factories: Path) -> Iterator[ServedMeanwhile]:
    """positions_then_break served end to end with --compile and --verify by two prediction threads (pipelined), with
    dynamic batching: requests of 3, at most 8 images, so formed batches padded to the compiled sizes 4 or 6. Poisson
    arrivals far apart with no delay: mostly lone requests, each padded to 4. One run answers the padding's tests and
    the graph break's."""
    args = [*QUICK, "--model", "factories:positions_then_break", "--input", "x:float32:4"]
    args += ["--input", "pos:int64:3:1-8", "--batch_size", "3", "--max_batch_size", "8", "--compile", "--verify"]
    args += ["--design", "pipelined", "--num_workers", "2", "--load", "poisson", "--rate", "50"]
    served = ServedMeanwhile(args, tmp_path_factory.mktemp("compiled"), cwd=compile_factories)
    yield served
    served.stop()


@pytest.fixture(scope="module", autouse=True)
def _compiled_run_starts_first(request: pytest.FixtureRequest) -> None:
    """Starts the end-to-end run before this module's first test, where it is selected (its tests are last)."""
    here = [item for item in request.session.items if getattr(item, "module", None) is request.module]
    if any("compiled_run" in item.fixturenames for item in here):
        request.getfixturevalue("compiled_run")


def test_compiled_formed_batches_are_padded_within_each_inputs_range_and_never_recompile(
    compiled_run: ServedMeanwhile,
) -> None:
    """The padding row's positions are the range's low end (1), not 0, which the model would turn into the index -1
    (inductor stops on it). A recompile while serving would fail the run (torch.compile's fail_on_recompile stance).
    That a model without a graph break counts none, copies and all: the two threads' test above."""
    row = ok_row(compiled_run.run())
    assert float(row["padding_pct"]) > 0 and row["wrong_outputs"] == "0"


def test_a_compiled_model_with_a_graph_break_runs_its_forwards_one_at_a_time(compiled_run: ServedMeanwhile) -> None:
    run = compiled_run.run()
    row = ok_row(run)
    assert int(row["compile_graph_breaks"]) >= 1 and row["wrong_outputs"] == "0"
    assert "forwards one at a time" in run.stdout and "run their forwards one at a time" in run.stderr


def test_padding_is_zero_unless_the_inputs_range_leaves_zero_out() -> None:
    assert padding_value(parse_input("pos:int64:3:1-8"), "float32") == 1
    assert padding_value(parse_input("ids:int64:3:0-999"), "float32") == 0
    assert padding_value(parse_input("offset:int32:2:-9--2"), "float32") == -9
    assert padding_value(parse_input("scale:float32:2:0.5-2"), "float32") == 0.5
    assert padding_value(parse_input("noise:float32:2"), "float32") == 0  # standard normal: 0 is its centre
    image = parse_input("image:float32:3x8x8:0.5-1")
    assert padding_value(image, "uint8") == 0 and padding_value(image, "float32") == 0.5  # raw pixels pad with 0


# ------------------------------------------------------------------------------ the compile paths' caches


def test_the_children_keep_the_inductor_cache_where_torch_keeps_it(monkeypatch) -> None:
    """Their TMPDIR is the run's own folder, thrown away at its end: the compile cache must not follow it there."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)  # torch sets it once it has used its cache
    assert inductor_cache_dir() == default_cache_dir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "relative/cache")
    assert inductor_cache_dir() == str(Path("relative/cache").absolute())


def test_the_aoti_cache_key_reads_a_batchnorm_models_every_buffer() -> None:
    """BatchNorm's num_batches_tracked is a 0-dim int64 buffer, which --aoti of any torchvision ResNet hashes: its
    bytes count in the package's key like any other buffer's."""
    module = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)).eval()
    example = (torch.randn(2, 3, 4, 4),)
    key = program_digest(torch.export.export(module, example), "described")
    module[1].num_batches_tracked.fill_(7)
    assert program_digest(torch.export.export(module, example), "described") != key
