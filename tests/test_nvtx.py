"""--nvtx: each request's steps in NVTX ranges named with the step and the request id, on the thread that runs them;
every push has its pop on every path, a failing step's included; nothing is pushed without the flag."""

from __future__ import annotations

import collections
import os
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import TINY, child_pids, run_server

from serverbench.backend.planted import InjectedFault
from serverbench.backend.stages import Aborted, Failure, Stages
from serverbench.device.layer import NO_CONTEXT, DeviceLayer
from tests.helpers import CollectResponses, FakeRequests, design_stages, run_design, worker_config


class NvtxRecorder:
    """Stands in for torch.cuda.nvtx's range_push/range_pop: a stack per thread, every push and pop noted."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.stacks: dict[int, list[str]] = collections.defaultdict(list)
        self.pushed: list[tuple[str, str]] = []  # (thread name, range name)
        self.unmatched_pops = 0

    def push(self, name: str) -> None:
        with self._lock:
            self.stacks[threading.get_ident()].append(name)
            self.pushed.append((threading.current_thread().name, name))

    def pop(self) -> None:
        with self._lock:
            stack = self.stacks[threading.get_ident()]
            if stack:
                stack.pop()
            else:
                self.unmatched_pops += 1

    def open_ranges(self) -> list[str]:
        return [name for stack in self.stacks.values() for name in stack]


def recorded_layer(nvtx: bool) -> tuple[DeviceLayer, NvtxRecorder]:
    layer = DeviceLayer(torch.device("cpu"), nvtx=nvtx)
    recorder = NvtxRecorder()
    layer.nvtx_push, layer.nvtx_pop = recorder.push, recorder.pop  # as torch.cuda.nvtx's on a GPU
    return layer, recorder


def serve(cfg, layer: DeviceLayer, requests: int = 6) -> tuple[CollectResponses, Failure]:
    responses = CollectResponses()
    failure = Failure(threading.Event())
    stages = design_stages(cfg, layer, torch.nn.Identity(), responses)
    run_design(cfg, stages, failure, FakeRequests([torch.randn(3, 3, 8, 8) for _ in range(requests)]))
    return responses, failure


DESIGNS = [("serial", 1), ("threaded", 1), ("pipelined", 2)]
STEPS = ("form", "h2d", "forward", "d2h", "respond")


@pytest.mark.parametrize("design,workers", DESIGNS)
@pytest.mark.parametrize("batching", [False, True], ids=["single", "batched"])
def test_every_step_of_every_request_is_one_balanced_range_on_its_thread(
    tmp_path: Path, design: str, workers: int, batching: bool
) -> None:
    overrides = dict(ceiling=False, nvtx=True)
    if batching:
        overrides.update(max_batch_size=6)  # two requests of 3 images per formed batch
    cfg = replace(worker_config(tmp_path, design, workers), **overrides)
    layer, recorder = recorded_layer(nvtx=True)
    responses, failure = serve(cfg, layer)
    assert failure.exception is None and len(responses.messages) == 6
    assert recorder.open_ranges() == [] and recorder.unmatched_pops == 0
    names = [name for _, name in recorder.pushed]
    assert {name.split(" #")[0] for name in names} == set(STEPS)
    forwards = [name for name in names if name.startswith("forward #")]
    if not batching:  # one forward per request, named with its id
        assert sorted(forwards) == sorted(f"forward #{i}" for i in range(6))
        assert sorted(n for n in names if n.startswith("h2d #")) == sorted(f"h2d #{i}" for i in range(6))
    if design == "pipelined":  # each step on the thread that runs it
        threads = {
            name.split(" #")[0]: {t for t, n in recorder.pushed if n.startswith(name.split(" #")[0])} for name in names
        }
        assert threads["h2d"] == {"h2d"} and threads["d2h"] == {"d2h"} and threads["respond"] == {"d2h"}
        assert threads["forward"] <= {"predict-0", "predict-1"}


@pytest.mark.parametrize("design,workers", DESIGNS)
@pytest.mark.parametrize("stage", ["h2d", "predict", "d2h"])
def test_a_step_that_raises_still_pops_its_range(tmp_path: Path, design: str, workers: int, stage: str) -> None:
    cfg = replace(worker_config(tmp_path, design, workers), ceiling=False, nvtx=True, inject_fault=stage)
    layer, recorder = recorded_layer(nvtx=True)
    with pytest.raises((InjectedFault, Aborted)):
        _, failure = serve(cfg, layer)
        failure.check()
    step = "forward" if stage == "predict" else stage
    assert f"{step} #{cfg.warmup_iters}" in [name for _, name in recorder.pushed]  # the failing step was ranged
    assert recorder.open_ranges() == [] and recorder.unmatched_pops == 0


def test_without_the_flag_nothing_is_wrapped_or_pushed(tmp_path: Path) -> None:
    cfg = replace(worker_config(tmp_path, "pipelined", 2), ceiling=False)
    assert cfg.nvtx is False
    layer, recorder = recorded_layer(nvtx=False)
    stages = Stages(cfg, layer, torch.nn.Identity(), CollectResponses())
    for step in ("form", "h2d", "predict", "d2h", "respond"):
        assert getattr(stages, step).__func__ is getattr(Stages, step)  # the method itself: no cost per request
    assert layer.nvtx_range("ceiling before serving") is NO_CONTEXT
    serve(cfg, layer)
    assert recorder.pushed == []


def test_a_range_pops_when_its_block_raises() -> None:
    layer, recorder = recorded_layer(nvtx=True)
    with pytest.raises(RuntimeError), layer.nvtx_range("ceiling before serving"):
        raise RuntimeError("a ceiling loop failed")
    assert recorder.pushed == [("MainThread", "ceiling before serving")] and recorder.open_ranges() == []


def test_the_cpu_layer_never_calls_nvtx(monkeypatch) -> None:
    """On the CPU the layer's calls are no-ops: torch.cuda.nvtx is not touched, flag or not."""

    def refuse(*args) -> None:
        raise AssertionError("torch.cuda.nvtx called on the CPU")

    monkeypatch.setattr(torch.cuda.nvtx, "range_push", refuse)
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", refuse)
    layer = DeviceLayer(torch.device("cpu"), nvtx=True)
    with layer.nvtx_range("model build and warm-up"):
        pass
    layer.nvtx_step("h2d", lambda item: item, lambda item: 0)("item")


# Put first on the server's and its children's sys.path, this sitecustomize replaces the CPU layer's no-op NVTX
# calls, as serverbench.device.layer is imported, with ones that note each push and pop in a file: one line each,
# written whole (O_APPEND), so that a process ending by any path leaves every line it wrote.
NVTX_COUNTER = """
import importlib.abc, importlib.util, os, sys, threading

LOG = os.environ["NVTX_TEST_LOG"]


def note(kind, name=""):
    line = "\\t".join([str(os.getpid()), str(threading.get_ident()), kind, name]) + "\\n"
    fd = os.open(LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


class CountNvtx(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "serverbench.device.layer":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_and_count(module):
            exec_module(module)
            module._no_push = lambda name: note("push", name)
            module._no_pop = lambda: note("pop")

        spec.loader.exec_module = exec_and_count
        return spec


sys.meta_path.insert(0, CountNvtx())
"""


def test_a_run_with_nvtx_on_the_cpu_pushes_and_pops_every_range(tmp_path: Path) -> None:
    """End to end on the CPU, with the layer's no-op push and pop counted: the backend pushed the model build's
    and both ceilings' ranges once and each step of each request (the warm-up's and the 6 measured) once, and
    popped every one on the thread that pushed it; the run is an ordinary run."""
    hook, log = tmp_path / "hook", tmp_path / "nvtx.log"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(NVTX_COUNTER)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(hook), os.environ.get("PYTHONPATH")]))}
    run = run_server([*TINY, "--nvtx"], tmp_path / "results", env={**env, "NVTX_TEST_LOG": str(log)})
    assert run.returncode == 0, run.stderr
    assert run.row["status"] == "ok"
    lines = [line.split("\t") for line in log.read_text().splitlines()]
    assert {pid for pid, *_ in lines} == {str(child_pids(run.stderr)["backend"])}  # the backend alone
    stacks: dict[str, list[str]] = collections.defaultdict(list)
    pushed = []
    for _, thread, kind, name in lines:
        if kind == "push":
            stacks[thread].append(name)
            pushed.append(name)
        else:
            assert stacks[thread], f"a pop with nothing pushed on thread {thread}"
            stacks[thread].pop()
    assert all(not stack for stack in stacks.values()), dict(stacks)
    requests = range(int(run.row["warmup_iters"]) + 6)
    expected = ["model build and warm-up", "ceiling before serving", "ceiling after serving"]
    expected += [f"{step} #{i}" for step in STEPS for i in requests]
    assert sorted(pushed) == sorted(expected)
