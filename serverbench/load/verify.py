"""--verify: every response compared, leaf by leaf, with the serial answer the backend computed for its pool entry
before serving (BackendReady.reference_outputs); a run with any wrong response ends `wrong_output`.

A response carries its output's leaves alone (pytree order), not their keys: the leaves are compared by position,
shape and dtype here, and the output's structure (a dict's keys) is the backend's to check, on every forward."""

from __future__ import annotations

import numpy as np

from serverbench.schema.messages import FrontendReport, Response


def leaf_errors(got: tuple[np.ndarray, ...], expected: tuple[np.ndarray, ...], tolerance: float) -> tuple[float, bool]:
    """--verify of one response: the largest absolute difference over every output leaf from the serial answer,
    and whether any leaf is wrong. Float leaves within `tolerance`; integer and bool leaves (indices, masks) exact;
    a leaf of another shape or dtype (an index that became a float of the same value), a missing leaf or NaN is
    wrong."""
    if len(got) != len(expected):
        return float("inf"), True
    largest = 0.0
    wrong = False
    for leaf, answer in zip(got, expected):
        if leaf.shape != answer.shape or leaf.dtype != answer.dtype:
            return float("inf"), True
        error = float(np.max(np.abs(leaf.astype(np.float64) - answer), initial=0.0))
        allowed = tolerance if np.issubdtype(answer.dtype, np.floating) else 0.0
        wrong = wrong or not error <= allowed  # NaN counts as wrong
        largest = error if not error <= largest else largest
    return largest, wrong


class Verifier:
    """Counts the wrong responses and the largest error into the frontend's report (the receiver's thread only)."""

    def __init__(self, tolerance: float) -> None:
        self.tolerance = tolerance

    def check(self, report: FrontendReport, response: Response) -> None:
        ready = report.backend_ready
        if ready is None or ready.reference_outputs is None:
            raise RuntimeError("--verify: the backend sent no reference answers")
        expected = ready.reference_outputs[response.request_id % len(ready.reference_outputs)]
        error, wrong = leaf_errors(response.outputs, expected, self.tolerance)
        if wrong:
            report.wrong_outputs += 1
        if report.max_abs_error is None or not error <= report.max_abs_error:
            report.max_abs_error = error

    def judge(self, report: FrontendReport) -> None:
        """A run that went well otherwise ends `wrong_output` when any response was wrong."""
        if report.wrong_outputs and report.status == "ok":
            report.status = "wrong_output"
            report.error = (
                f"{report.wrong_outputs} response(s) differ from the serial reference "
                f"(max abs error {report.max_abs_error:.3g}, tolerance {self.tolerance:g})"
            )
