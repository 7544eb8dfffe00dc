"""--verify: every response compared, leaf by leaf, with the serial answer the backend computed for its pool entry
before serving (BackendReady.reference_outputs); a run with any wrong response ends `wrong_output`.

A response carries its output's leaves alone (pytree order), not their keys: the leaves are compared by position,
shape and dtype here, and the output's structure (a dict's keys) is the backend's to check, on every forward."""

from __future__ import annotations

import numpy as np

from serverbench.schema.messages import FrontendReport, Response


def allowed_error(answer: np.ndarray, tolerance: float) -> float:
    """The largest absolute difference from a float leaf's serial answer that still counts as right: `tolerance`
    relative to the leaf's scale, its root mean square (at least 1, so that small outputs keep the absolute
    tolerance). Reduced-precision arithmetic (TF32, bf16) errs in proportion to the values it adds up: resnet18's
    random logits reach ~8 (an absolute 1e-2 leaves them about 1e-3 of room), and a formed batch of 32-128 rows
    runs other kernels than the 32-row reference did. The root mean square, not the largest magnitude: the
    rounding error is about the same over a leaf's values, and a request answered with another's rows differs from
    its own by less than the largest magnitude (random-weight resnet18 at 224x224 on the CPU: largest 6.1, root
    mean square 1.6, bf16's error 0.03, another request's rows 0.23 to 0.33 away)."""
    finite = np.abs(answer[np.isfinite(answer)].astype(np.float64))
    largest = float(finite.max()) if finite.size else 0.0
    # Scaled by the largest first: a float64 leaf of 1e300 squared overflows, and 0 x inf is NaN, which fails.
    scale = largest * float(np.sqrt(np.mean(np.square(finite / largest)))) if largest > 0 else 0.0
    return tolerance * max(1.0, scale)


def leaf_errors(got: tuple[np.ndarray, ...], expected: tuple[np.ndarray, ...], tolerance: float) -> tuple[float, bool]:
    """--verify of one response: the largest absolute difference over every output leaf from the serial answer,
    and whether any leaf is wrong. Float leaves within `tolerance` of their scale (allowed_error); integer and bool
    leaves (indices, masks) exact; a leaf of another shape or dtype (an index that became a float of the same
    value), a missing leaf or NaN is wrong."""
    if len(got) != len(expected):
        return float("inf"), True
    largest = 0.0
    wrong = False
    for leaf, answer in zip(got, expected):
        if leaf.shape != answer.shape or leaf.dtype != answer.dtype:
            return float("inf"), True
        with np.errstate(invalid="ignore"):  # inf - inf is NaN; the same infinity as the answer's is no error
            difference = np.where(leaf == answer, 0.0, np.abs(leaf.astype(np.float64) - answer))
        error = float(np.max(difference, initial=0.0))
        allowed = allowed_error(answer, tolerance) if np.issubdtype(answer.dtype, np.floating) else 0.0
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
                f"(max abs error {report.max_abs_error:.3g}; allowed: {self.tolerance:g} x each float leaf's root "
                "mean square, at least 1)"
            )
