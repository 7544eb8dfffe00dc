"""The machine's own speed, now: a fixed compute kernel and a fixed memory copy, timed on this process's cores.

A VM's speed drifts between invocations in ways its steal and run-queue figures do not show (the host's clock,
memory bandwidth shared with other guests): the same command gave 458 to 523 samples/s on a quiet 2-core VM. The
backend runs this probe just before its measured phase and again just after (machine_speed_before/_after), so that
two invocations can be told apart by the machine they ran on, and a throughput can be divided by it.

One probe round is one float32 matmul of PROBE_MATMUL_SIDE square matrices (on one thread) plus one copy of
PROBE_COPY_BYTES (twice that through memory); the figure is rounds per second at each part's best time over as many
rounds as fit in the budget (at least PROBE_MIN_ROUNDS): an interruption only adds time, so the best is what the
machine itself can do now (the median of the copies moved by 30 % within one process here; their best by 3 %).
"""

from __future__ import annotations

import time

import torch

PROBE_MATMUL_SIDE = 256  # 34 MFLOP: about 1 ms on one core of this VM
PROBE_COPY_BYTES = 8 << 20  # beyond the caches of a small VM's cores, so that memory bandwidth counts
PROBE_MIN_ROUNDS = 5
PROBE_BUDGET_S = 0.05  # per probe: twice per run, within the about 100 ms a run may spend on it


def machine_speed(budget_s: float = PROBE_BUDGET_S) -> float:
    """Probe rounds per second at the best times (see the module's docstring); higher is a faster machine. On one
    intra-op thread (put back after): with two, one core taken by another process (a frontend still generating its
    requests) made every round slow, and the probe read a third of the machine's speed."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _best_rounds_per_s(budget_s)
    finally:
        torch.set_num_threads(threads)


def _best_rounds_per_s(budget_s: float) -> float:
    left = torch.rand(PROBE_MATMUL_SIDE, PROBE_MATMUL_SIDE)
    right = torch.rand(PROBE_MATMUL_SIDE, PROBE_MATMUL_SIDE)
    product = torch.empty(PROBE_MATMUL_SIDE, PROBE_MATMUL_SIDE)
    source = torch.ones(PROBE_COPY_BYTES // 4)
    target = torch.empty_like(source)
    target.copy_(source)  # first touch: the pages are mapped before the timed rounds
    torch.mm(left, right, out=product)
    best_matmul_s = best_copy_s = float("inf")
    rounds = 0
    deadline_s = time.perf_counter() + budget_s
    while rounds < PROBE_MIN_ROUNDS or time.perf_counter() < deadline_s:
        start_s = time.perf_counter()
        torch.mm(left, right, out=product)
        copy_start_s = time.perf_counter()
        target.copy_(source)
        end_s = time.perf_counter()
        best_matmul_s = min(best_matmul_s, copy_start_s - start_s)
        best_copy_s = min(best_copy_s, end_s - copy_start_s)
        rounds += 1
    return 1.0 / (best_matmul_s + best_copy_s)
