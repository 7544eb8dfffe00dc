"""--load loadgen: MLPerf LoadGen (the mlcommons-loadgen package) drives the transport from the frontend process.

LoadGen runs its test (`--scenario`) on a thread of its own and calls `issue` with query samples; each sample
becomes one request (its index picks the pool entry) that the frontend's sender writes into the same transport as
every other load, in the order LoadGen issued them. The receiver completes a sample (QuerySamplesComplete) the
moment it stamps the response's arrival, so LoadGen's latencies and ours come from the same requests. After the
test, LoadGen's detail log gives its verdict and statistics (`parse_detail_log`), which go into the row beside
ours (`loadgen_columns`).

A run that fails (a backend that dies, a timeout, a stop) must not leave LoadGen waiting for completions that
will never come: every sample outstanding then, and every one LoadGen issues afterwards, is completed at once
without an answer (an empty response), and the row counts them. LoadGen's verdict on such a run judges empty
responses, not the server: the row then holds no verdict, and its note says why.

The driver takes the request pool and a send function as arguments: it knows nothing of what a request holds.
"""

from __future__ import annotations

import importlib
import json
import logging
import queue
import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from serverbench.config.limits import LOADGEN_MODULE, POLL_S
from serverbench.schema.columns import LOADGEN_COLUMNS
from serverbench.schema.records import LoadGenResult

log = logging.getLogger("frontend")

# After a failure, how long the sender waits for LoadGen to run out its schedule: less than the frontend waits for
# the sender (5 s), so that a test that ends in time still gets its verdict into the report.
AFTER_STOP_WAIT_S = 3.0
P99_AGREEMENT = (0.95, 1.05)  # our p99 over LoadGen's outside this: one measures what the other does not
DETAIL_LOG = "mlperf_log_detail.txt"
LOG_FOLDER = "loadgen"  # under --results_dir: loadgen/<run_id>/ holds LoadGen's own logs


def loadgen_settings(cfg) -> dict[str, object]:
    """LoadGen's TestSettings from our flags, as attribute -> value (the scenario and mode by name). Everything
    not named here keeps LoadGen's default (docs/field-formats.md lists the ones that apply)."""
    settings: dict[str, object] = {
        "scenario": cfg.scenario,
        "mode": "PerformanceOnly",
        "min_duration_ms": round(cfg.duration_s * 1000),
        "min_query_count": cfg.num_iters,
    }
    if cfg.scenario == "Server":
        settings["server_target_qps"] = float(cfg.rate_rps)
        if cfg.slo_ms is not None:
            settings["server_target_latency_ns"] = round(cfg.slo_ms * 1e6)
    elif cfg.scenario == "Offline" and cfg.rate_rps is not None:
        settings["offline_expected_qps"] = float(cfg.rate_rps)
    elif cfg.scenario == "MultiStream" and cfg.concurrency is not None:
        settings["multi_stream_samples_per_query"] = cfg.concurrency
    return settings


class LoadGenDriver:
    """One LoadGen test, run from the frontend's sender thread by `run`; `complete` is the receiver's call.

    `send(request_id, payload, issued_ns)` sends one measured request whose latency counts from issued_ns (when
    LoadGen issued its sample); `should_stop()` says that the run is failing or stopping."""

    def __init__(
        self,
        cfg,
        pool: Sequence[object],
        send: Callable[[int, object, int], None],
        first_request_id: int,
        should_stop: Callable[[], bool],
        log_dir: Path,
    ) -> None:
        self.cfg = cfg
        self.pool = pool
        self.send = send
        self.should_stop = should_stop
        self.log_dir = log_dir
        self.result = LoadGenResult(cfg.scenario, str(log_dir))
        self._lg = None  # the mlperf_loadgen module, once run() imported it
        self._lock = threading.Lock()  # guards the ids, the outstanding samples and the stop flag
        self._next_id = first_request_id
        self._outstanding: dict[int, int] = {}  # our request id -> LoadGen's sample id, until completed
        self._stopping = False
        self._issued: queue.SimpleQueue = queue.SimpleQueue()  # (request id, pool index, issued_ns); None: the end

    # -------------------------------------------------------------------------------- LoadGen's callbacks

    def _issue(self, samples) -> None:
        """LoadGen's issue callback, on its own thread: hands the samples to the sender, in order, at once (a
        slow callback would delay LoadGen's schedule); after a failure, completes them unanswered."""
        issued_ns = time.perf_counter_ns()
        refused: list[int] = []
        with self._lock:
            for sample in samples:
                if self._stopping:
                    refused.append(sample.id)
                    continue
                request_id = self._next_id
                self._next_id += 1
                self._outstanding[request_id] = sample.id
                self._issued.put((request_id, sample.index, issued_ns))
            self.result.unanswered += len(refused)
        self._complete_ids(refused)

    def _complete_ids(self, sample_ids: list[int]) -> None:
        if sample_ids:
            lg = self._lg
            lg.QuerySamplesComplete([lg.QuerySampleResponse(sample_id, 0, 0) for sample_id in sample_ids])

    def complete(self, request_id: int) -> None:
        """The receiver stamped this request's response: LoadGen's sample is complete now. Any other id (a
        warm-up request, a duplicate, one completed unanswered) is ignored."""
        with self._lock:
            sample_id = self._outstanding.pop(request_id, None)
        if sample_id is not None:
            self._complete_ids([sample_id])

    def _give_up(self) -> None:
        """The run is failing: every outstanding sample completes now, unanswered, and so will every later one."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            pending = list(self._outstanding.values())
            self._outstanding.clear()
            self.result.unanswered += len(pending)
        self._complete_ids(pending)

    # -------------------------------------------------------------------------------- the test

    def _settings(self):
        lg = self._lg
        settings = lg.TestSettings()
        for name, value in loadgen_settings(self.cfg).items():
            if name == "scenario":
                value = getattr(lg.TestScenario, value)
            elif name == "mode":
                value = getattr(lg.TestMode, value)
            setattr(settings, name, value)
        log_settings = lg.LogSettings()
        log_settings.log_output.outdir = str(self.log_dir)
        log_settings.log_output.copy_summary_to_stdout = False
        log_settings.enable_trace = False  # its trace file would only repeat our records
        return settings, log_settings

    def run(self) -> LoadGenResult:
        """Runs the test: LoadGen on a thread of its own, the sends on the calling thread, until LoadGen is done.
        Returns its result (with the detail log's figures when the test ended)."""
        # Imported here: only --load loadgen needs it, and preflight refused a machine without it.
        self._lg = lg = importlib.import_module(LOADGEN_MODULE)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        settings, log_settings = self._settings()
        sut = lg.ConstructSUT(self._issue, lambda: None)
        # The pool is in memory already: nothing to load or unload. Its size is LoadGen's sample count.
        qsl = lg.ConstructQSL(len(self.pool), len(self.pool), lambda indices: None, lambda indices: None)
        tester = threading.Thread(
            target=self._test, args=(sut, qsl, settings, log_settings), name="loadgen", daemon=True
        )
        tester.start()
        try:
            ended = self._send_until_done()
        except BaseException:
            self._give_up()  # a send that raised (the run is stopping): LoadGen must not wait for its samples
            raise
        if ended:
            tester.join(timeout=POLL_S * 10)
            lg.DestroyQSL(qsl)
            lg.DestroySUT(sut)
            self._read_log()
        else:
            # Its schedule runs on past the failure: the process ends it; LoadGen waits for nothing from us.
            self._note(f"its test was still running {AFTER_STOP_WAIT_S:g} s later")
        return self.result

    def _note(self, error: str) -> None:
        """Adds to the result's error (what went wrong with the test, for the row's note)."""
        with self._lock:  # LoadGen's thread notes its own failure
            self.result.error = f"{self.result.error}; {error}" if self.result.error else error

    def _test(self, sut, qsl, settings, log_settings) -> None:
        try:
            self._lg.StartTestWithLogSettings(sut, qsl, settings, log_settings, "")
        except BaseException as exc:  # noqa: BLE001 - reported in the row; the sender must still wake up
            self._note(f"LoadGen's test failed: {type(exc).__name__}: {exc}")
            self._give_up()
        finally:
            self._issued.put(None)

    def _send_until_done(self) -> bool:
        """Sends each issued sample in turn until LoadGen's test ends (True). Once the run is failing, completes
        the rest unanswered and waits at most AFTER_STOP_WAIT_S more for the test to end (False if it did not)."""
        deadline: float | None = None
        while True:
            if deadline is None and self.should_stop():
                # Even with no sample outstanding (none unanswered), the test was cut short: no verdict stands.
                self._note("the run failed or was stopped during LoadGen's test")
                self._give_up()
                deadline = time.monotonic() + AFTER_STOP_WAIT_S
            if deadline is not None and time.monotonic() > deadline:
                return False
            try:
                item = self._issued.get(timeout=POLL_S)
            except queue.Empty:
                continue
            if item is None:
                return True
            request_id, index, issued_ns = item
            with self._lock:
                skip = request_id not in self._outstanding  # completed unanswered meanwhile
            if not skip:
                self.send(request_id, self.pool[index % len(self.pool)], issued_ns)

    def _read_log(self) -> None:
        try:
            self.result.results = parse_detail_log((self.log_dir / DETAIL_LOG).read_text(encoding="utf-8"))
        except OSError as exc:
            self._note(f"LoadGen's detail log could not be read: {exc.strerror}")


KEPT_SETTINGS = ("effective_samples_per_query",)  # what the figures need of the settings LoadGen ran with


def parse_detail_log(text: str) -> dict[str, object]:
    """The result keys of LoadGen's detail log (`:::MLLOG {json}` lines): result_validity, result_*_latency_ns,
    result_scheduled_samples_per_sec, early_stopping_met..., and the KEPT_SETTINGS."""
    results: dict[str, object] = {}
    for line in text.splitlines():
        if not line.startswith(":::MLLOG "):
            continue
        try:
            entry = json.loads(line[len(":::MLLOG ") :])
        except json.JSONDecodeError:
            continue
        key = entry.get("key", "")
        if key.startswith("result_") or key == "early_stopping_met" or key in KEPT_SETTINGS:
            results[key] = entry.get("value")
    return results


def _seconds(results: Mapping[str, object], key: str) -> float | None:
    value = results.get(key)
    return None if value is None else float(value) / 1e9


# Samples per second as LoadGen words it in each scenario (one of our requests is one of its samples). MultiStream
# logs no rate: see completed_rps.
COMPLETED_RATE_KEYS = {
    "Server": "result_completed_samples_per_sec",
    "Offline": "result_samples_per_second",
    "SingleStream": "result_qps_with_loadgen_overhead",
}


def completed_rps(scenario: str, results: Mapping[str, object]) -> float | None:
    """Completed samples per second. MultiStream issues its queries one at a time, each once the last completed:
    its samples per query over its mean query latency (as SingleStream's rate without LoadGen's overhead)."""
    if scenario == "MultiStream":
        samples, mean_s = results.get("effective_samples_per_query"), _seconds(results, "result_mean_query_latency_ns")
        return float(samples) / mean_s if samples is not None and mean_s else None
    value = results.get(COMPLETED_RATE_KEYS.get(scenario, ""))
    return None if value is None else float(value)


def loadgen_columns(result: LoadGenResult | None, our_p99_s: float | None, run_status: str = "ok") -> dict[str, object]:
    """The row's LoadGen columns: its verdict and figures, and our p99 over its p99 from the same requests. A run
    that failed (`run_status`, samples completed unanswered, a test cut short) has no verdict: LoadGen judged
    empty responses, not the server; the note says why."""
    columns: dict[str, object] = dict.fromkeys(LOADGEN_COLUMNS)
    if result is None:
        return columns
    results = result.results
    failed = bool(no_verdict_reasons(result, run_status))
    validity = None if failed else results.get("result_validity")
    p99_s = _seconds(results, "result_99.00_percentile_latency_ns")
    ratio = None
    if our_p99_s is not None and p99_s and not failed:
        ratio = our_p99_s / p99_s
    columns.update(
        loadgen_scenario=result.scenario,
        loadgen_valid=None if validity is None else validity == "VALID",
        loadgen_invalid_reason=invalid_reason(results) if validity == "INVALID" else None,
        loadgen_early_stopping_met=results.get("early_stopping_met"),
        loadgen_queries=results.get("result_query_count"),
        loadgen_scheduled_rps=results.get("result_scheduled_samples_per_sec"),
        loadgen_completed_rps=completed_rps(result.scenario, results),
        loadgen_mean_latency_s=_seconds(results, "result_mean_latency_ns"),
        loadgen_p50_latency_s=_seconds(results, "result_50.00_percentile_latency_ns"),
        loadgen_p90_latency_s=_seconds(results, "result_90.00_percentile_latency_ns"),
        loadgen_p99_latency_s=p99_s,
        loadgen_p99_ratio=ratio,
        loadgen_unanswered=result.unanswered,
        loadgen_note=loadgen_note(result, ratio, run_status) or None,
    )
    return columns


# LoadGen's checks behind an INVALID verdict: the detail log's key -> what failing it means.
VALIDITY_CHECKS = {
    "result_min_duration_met": "min duration not met",
    "result_min_queries_met": "min query count not met",
    "result_perf_constraints_met": "latency target not met",
    "early_stopping_met": "early stopping not met (too few queries for its percentile estimate)",
}


def invalid_reason(results: Mapping[str, object]) -> str:
    """Why LoadGen said INVALID: each of its checks that failed, then its own recommendation."""
    reasons = [why for key, why in VALIDITY_CHECKS.items() if results.get(key) is False]
    advice = " ".join(str(results.get("result_invalid_reason") or "").split())
    return "; ".join([*reasons, *([advice] if advice else [])]) or "INVALID (no reason logged)"


def no_verdict_reasons(result: LoadGenResult, run_status: str) -> list[str]:
    """Why LoadGen's verdict does not stand: the run's failure, samples it never got answers for, its test cut
    short or failing, its log unread. Empty: the verdict stands."""
    reasons = [f"the run ended {run_status}"] if run_status != "ok" else []
    if result.error:
        reasons.append(result.error)
    if result.unanswered:
        reasons.append(f"{result.unanswered} sample(s) LoadGen issued were completed without an answer")
    return reasons


def loadgen_note(result: LoadGenResult, ratio: float | None, run_status: str = "ok") -> str:
    """Why LoadGen's figures and ours may not be read together: why it has no verdict (the run failed), or p99s
    that disagree by more than P99_AGREEMENT allows."""
    notes = []
    reasons = no_verdict_reasons(result, run_status)
    if reasons:
        notes.append(f"no verdict: {'; '.join(reasons)}; its figures do not describe the server")
    low, high = P99_AGREEMENT
    if ratio is not None and not low <= ratio <= high:
        notes.append(
            f"our p99 is {ratio:.3f} x LoadGen's (outside {low:g}-{high:g}): one of the two measures something "
            "the other does not"
        )
    return "; ".join(notes)


def keep_logs(log_dir: str, results_dir: Path, run_id: str) -> str | None:
    """Moves LoadGen's logs from the frontend's folder to loadgen/<run_id>/ under the results folder; returns
    that path relative to the results folder (the frontend's own when the move failed; None when it wrote none)."""
    source = Path(log_dir)
    if not source.is_dir():
        return None
    target = Path(results_dir) / LOG_FOLDER / run_id
    try:
        shutil.move(str(source), str(target))
    except OSError as exc:
        log.warning("LoadGen's logs stay in %s: %s", source, exc.strerror)
        target = source
    try:
        return str(target.relative_to(Path(results_dir)))
    except ValueError:
        return str(target)


def pending_log_dir(results_dir: str, pid: int) -> Path:
    """Where the frontend's LoadGen writes before the run has its id (the server names the run)."""
    return Path(results_dir) / LOG_FOLDER / f"frontend-{pid}"
