"""The frontends' reports made one: every rank's under torchrun (serverbench/launch/ranks.py and job.py, each rank
on its own clock), and every load generator's of one run (--generators, serverbench/config/generators.py: one
machine, one clock). Records are pooled and counters summed, so the row's figures are computed once, over all of
them, as for a single frontend.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from serverbench.load.noise import merged_noise
from serverbench.schema.messages import ChildReport, FrontendReport, combined_status
from serverbench.schema.records import LoadSample


def generator_roles(count: int) -> list[str]:
    """The frontend processes' names, as statuses and errors give them: 'frontend' alone (as before generators
    existed), else 'frontend 0', 'frontend 1', ..."""
    return ["frontend"] if count == 1 else [f"frontend {index}" for index in range(count)]


def shifted(item: Any, offset_ns: int) -> Any:
    """A copy of a record or sample (a frozen dataclass) with every *_ns timestamp moved by offset_ns."""
    if offset_ns == 0:
        return item
    changes = {
        f.name: getattr(item, f.name) + offset_ns
        for f in dataclasses.fields(item)
        if f.name.endswith("_ns") and getattr(item, f.name) is not None
    }
    return dataclasses.replace(item, **changes)


def merged_report(reports: Sequence[Any], offsets_ns: Sequence[int]) -> Any:
    """One messages.FrontendReport holding every report's records and samples, each moved by its offset onto the
    first's clock (rank 0's under torchrun; the generators of a run share one), its counters summed: what they sent
    and received together."""
    merged = FrontendReport()
    errors = [r.max_abs_error for r in reports if r is not None and r.max_abs_error is not None]
    for report, offset in zip(reports, offsets_ns):
        if report is None:
            continue
        merged.records += [shifted(r, offset) for r in report.records]
        merged.gpu_samples += [shifted(s, offset) for s in report.gpu_samples]
        merged.load_samples += [shifted(s, offset) for s in report.load_samples]
        merged.requests_sent += report.requests_sent
        merged.responses_duplicated += report.responses_duplicated
        merged.responses_unexpected += report.responses_unexpected
        merged.wrong_outputs += report.wrong_outputs
        merged.backend_ready = merged.backend_ready or report.backend_ready
        merged.gpu_util_note = merged.gpu_util_note or report.gpu_util_note
    merged.max_abs_error = max(errors) if errors else None
    return merged


def summed_load_samples(per_generator: Sequence[Sequence[LoadSample]]) -> list[LoadSample]:
    """The generators' samples of requests in flight, added up at every moment one of them sampled: each counts
    with its latest sample then, and with none before its first or after its last (its measured phase had not begun,
    or had ended with everything answered). Queue depths add up where every generator could tell one."""
    if len(per_generator) == 1:
        return list(per_generator[0])
    times = [[sample.t_ns for sample in samples] for samples in per_generator]
    summed = []
    for t_ns in sorted({t for generator_times in times for t in generator_times}):
        latest = []
        for samples, generator_times in zip(per_generator, times):
            index = bisect.bisect_right(generator_times, t_ns) - 1
            if index >= 0 and t_ns <= generator_times[-1]:
                latest.append(samples[index])
        depths = [sample.queue_depth for sample in latest]
        depth = None if None in depths else sum(depths)  # type: ignore[arg-type]
        summed.append(LoadSample(t_ns, sum(sample.inflight for sample in latest), depth))
    return summed


def surviving_generators(reports: Mapping[str, ChildReport], roles: Sequence[str]) -> list[str]:
    """Of several generators (keyed by role), those that sent a report of their own: their records and counters
    stand for what they sent, whoever else died. [] with one generator: a dead frontend's stand-in has none."""
    if len(roles) == 1:
        return []
    return [
        role
        for role in roles
        if isinstance(reports.get(role), FrontendReport) and not reports[role].status.endswith("_died")
    ]


def combine_frontend_reports(reports: Mapping[str, ChildReport], roles: Sequence[str]) -> FrontendReport | None:
    """One frontend report for the run from its generators' (keyed by role); None when none reported. One
    generator: its report as it is. Several: merged_report's pooled records and summed counters on the one clock;
    first_failure among them gives the status (the first that died, else the first that failed, its error prefixed
    with its role; a death's error names the survivors whose requests the row counts), a missing one makes it an
    error; in-flight samples summed over the generators, the GPU's
    samples of the first (each sampled the same device), the machine's noise the worst each saw."""
    if len(roles) == 1:
        report = reports.get(roles[0])
        return report if isinstance(report, FrontendReport) else None
    present = [(role, reports[role]) for role in roles if isinstance(reports.get(role), FrontendReport)]
    if not present:
        return None
    in_order = [report for _, report in present]
    merged = merged_report(in_order, [0] * len(in_order))
    missing = [role for role in roles if role not in reports]
    merged.status, merged.error, merged.traceback = combined_status(present, missing)
    survivors = surviving_generators(reports, roles)
    if merged.status.endswith("_died") and survivors:  # the row keeps the survivors' requests: it says so
        merged.error += f"; the row counts the requests of {', '.join(survivors)} only"
    merged.load_samples = summed_load_samples([report.load_samples for report in in_order])
    merged.gpu_samples = next((report.gpu_samples for report in in_order if report.gpu_samples), [])
    merged.noise = merged_noise([report.noise for report in in_order])
    merged.instances_ready = next((report.instances_ready for report in in_order if report.instances_ready), [])
    merged.response_bytes = next((r.response_bytes for r in in_order if r.response_bytes is not None), None)
    return merged
