"""The frontends' reports made one: every rank's under torchrun (serverbench/launch/ranks.py and job.py, each rank
on its own clock). Records are pooled and counters summed, so the row's figures are computed once, over all of
them, as for a single frontend.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from serverbench.schema.messages import FrontendReport


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
