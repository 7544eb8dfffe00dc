"""first_failure: the one rule by which the server, the instances and a torchrun job name the cause of a failure."""

from __future__ import annotations

from serverbench.schema.messages import BackendReport, FrontendReport, first_failure


def test_a_death_comes_first_then_the_first_failure_and_aborted_last() -> None:
    timeout = FrontendReport(status="timeout", error="no response for 3 s")
    oom = BackendReport(status="oom", error="OutOfMemoryError")
    died = BackendReport(role="backend instance 1", status="backend_died", error="killed by SIGKILL")
    aborted = BackendReport(status="aborted", error="rank 1 failed")
    # The death explains the timeout the frontend saw afterwards, whichever report arrived first.
    assert first_failure([timeout, oom, died]) is died
    assert first_failure([oom, timeout]) is oom and first_failure([timeout, oom]) is timeout  # order given
    assert first_failure([aborted, timeout]) is timeout  # stopped because of another: the other is the cause
    assert first_failure([aborted]) is aborted


def test_ok_and_stopped_are_not_failures() -> None:
    assert first_failure([FrontendReport(), BackendReport(status="stopped")]) is None
    assert first_failure([]) is None


def test_a_run_with_a_report_missing_is_an_error_never_ok() -> None:
    import server
    from serverbench.schema.messages import RunResult

    result = RunResult(status="ok")
    server._merge_reports(result, FrontendReport(), None, None)
    assert (result.status, result.error) == ("error", "no report from backend")
    result = RunResult(status="ok")
    server._merge_reports(result, FrontendReport(status="frontend_died", error="gone"), BackendReport(), None)
    assert (result.status, result.error, result.frontend) == ("frontend_died", "gone", None)
