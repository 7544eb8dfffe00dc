"""The model as each forward thread calls it, and torch.compile with one compiled copy per thread.

Dynamo keeps a function's compiled entries, and the guards that choose among them, on the function's code object.
Evaluating one set of guards from two threads at once is not safe: a relational guard (the one that checks that no
two tensor arguments alias, present as soon as a forward takes two tensors, its parameters included) keeps state
while it runs, and a thread switch in the middle makes a guard fail that holds. The call then recompiles, which
--compile makes an error while serving ("Unexpected recompilation: runtime guards failed even though they passed
during recompilation-reason analysis"). On the CPU (torch 2.15) it happened in 3 of 15 pipelined runs of a
two-input model beside a busy process, and in every run of two threads calling one compiled Linear 3000 times each.
So each prediction thread (and each thread of the ceiling) calls a compiled copy of its own: a wrapper with its own
code object, hence its own entries and guards. The copies after the first hit inductor's caches, so each costs
dynamo's tracing, not a second inductor compile.

A graph break inside the model undoes that: dynamo then compiles the model's own forward as a frame of its own (and
what follows the break in a function made once per break), and those frames, their guards included, are shared by
every copy. So a model with graph breaks, served by several threads, runs its forwards one at a time (a lock), and
the row says how many breaks it had (compile_graph_breaks); a model that compiles into one graph shares nothing.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ForwardModels:
    """The callables the forward threads run, by thread index (the prediction thread's, the ceiling's): one that
    every thread shares (eager, AOTInductor's runners), or one per thread (torch.compile)."""

    copies: tuple[Callable[..., object], ...]

    @classmethod
    def of(cls, model: Callable[..., object] | ForwardModels) -> ForwardModels:
        return model if isinstance(model, ForwardModels) else cls((model,))

    def for_thread(self, index: int) -> Callable[..., object]:
        return self.copies[0] if len(self.copies) == 1 else self.copies[index]


def _forward_with_own_code(model: Callable[..., object], index: int) -> Callable[..., object]:
    """A function that calls `model`, with a code object no other function has."""

    def forward(*inputs: torch.Tensor) -> object:
        return model(*inputs)

    code = forward.__code__.replace(co_name=f"forward_thread_{index}")
    return types.FunctionType(code, forward.__globals__, code.co_name, None, forward.__closure__)


def compile_per_thread(model: Callable[..., object], threads: int, mode: str | None) -> ForwardModels:
    """torch.compile(model) once per forward thread, each with its own compiled entries and guards (see the module's
    note); lazily, as torch.compile is: each copy compiles at its first call."""
    if threads == 1:
        return ForwardModels((torch.compile(model, dynamic=False, mode=mode),))
    return ForwardModels(
        tuple(torch.compile(_forward_with_own_code(model, index), dynamic=False, mode=mode) for index in range(threads))
    )


def graph_break_count() -> int:
    """Graph breaks dynamo has met in this process so far."""
    # Imported here, not at the top: torch._dynamo costs a second to import, and eager runs never need it.
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def one_at_a_time(models: ForwardModels, timeout_s: float) -> ForwardModels:
    """The same copies, each forward holding one lock: for a compiled model whose frames the copies share (graph
    breaks), so that no two threads evaluate their guards at once. A forward waiting longer than timeout_s for the
    lock fails in words (the run's own deadline would end it anyway)."""
    lock = threading.Lock()

    def locked(copy: Callable[..., object]) -> Callable[..., object]:
        def forward(*inputs: torch.Tensor) -> object:
            if not lock.acquire(timeout=timeout_s):
                raise TimeoutError(f"another thread's forward held the compiled model for over {timeout_s} s")
            try:
                return copy(*inputs)
            finally:
                lock.release()

        return forward

    return ForwardModels(tuple(locked(copy) for copy in models.copies))
