"""torch.compile with several forward threads: each thread calls a compiled copy of its own, so that dynamo's guards
are never evaluated by two threads at once (serverbench.backend.compiled)."""

from __future__ import annotations

import threading
from pathlib import Path

import torch
from test_worker import CollectResponses, FakeRequests, _cfg

from serverbench.backend.ceiling import measure_ceiling
from serverbench.backend.compiled import ForwardModels, compile_per_thread
from serverbench.backend.stages import Failure, RequestSource, Stages
from serverbench.device.layer import make_device_layer
from worker import PipelinedServer

SIZES = (4, 8, 12)


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
    with torch.inference_mode():
        for copy in models.copies:  # warmed at every size on this thread, as the backend does before serving
            for rows in SIZES:
                copy(*inputs[rows])
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
    """A callable that notes the threads that called it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.threads: set[str] = set()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.threads.add(threading.current_thread().name)
        return x.sum(dim=(1, 2, 3)).unsqueeze(1)


def test_each_prediction_thread_and_each_ceiling_thread_calls_its_own_copy(tmp_path: Path) -> None:
    copies = (Recorder("a"), Recorder("b"))
    models = ForwardModels(copies)
    cfg = _cfg(tmp_path, "pipelined", workers=2)
    responses = CollectResponses()
    failure = Failure(threading.Event())
    stages = Stages(cfg, make_device_layer("cpu"), models, responses)
    PipelinedServer(stages, cfg, failure).serve(
        RequestSource(FakeRequests([torch.randn(3, 3, 8, 8) for _ in range(40)]), failure, stages)
    )
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
