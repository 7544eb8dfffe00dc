"""Every command refuses bad input the same way: one line on stderr naming the argument, exit status 2, before any
work, nothing written. One table of command lines, one test; the next round extends the table.

Each case runs the command's main() in this process (the same code path as the command line, without a second
torch import per case). `{tmp}` is the test's own folder, which holds only the files the cases read (FILES) before
and after each case: a refused command made no folder and wrote no file.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import socket
import sys
import threading
from pathlib import Path

import pytest

import report
import server
import sweep
from bench import (
    batch_latency,
    commits,
    compare,
    gpu_check,
    loadgen_agreement,
    resolution,
    search,
    serving,
    stability,
    your_model,
)

B = ["--device", "cpu", "--model", "identity", "--image_size", "32", "--batch_size", "1", "--no-ceiling"]
SERVER = [*B, "--num_iters", "2", "--results_dir", "{tmp}/out"]
SWEEP = ["--designs", "serial", "--batch_sizes", "1", "--compile", "false"]
TINY_SWEEP = ["--", "--device", "cpu", "--model", "identity", "--num_iters", "2"]
LONG = "x" * 300
FACTORY = [*SERVER, "--model", "no_such_module:make", "--input", "x:float32:4"]  # refused before any import
DEEP_JSON = '{"a": ' + "[" * 50_000 + "]" * 50_000 + "}"
HUGE_INT_JSON = '{"a": ' + "9" * 5_000 + "}"
RUN_CSV = "batch_size,compile,throughput,status,experiment,repeat,model\n1,False,10.0,ok,serial,0,identity\n"
FILES = {  # what the cases read: made before each case
    "afile": "not a folder\n",
    "peak.csv": "experiment,batch_size,compile,peak_rate_rps,status\nserial,1,False,5.0,ok\n",
    "runs.csv": RUN_CSV,
    "gc/checks.json": "{garbled",
    "garbled/runs.csv": "\x00\x01garbage\n",  # a study's rows that no run could be appended to
    "empty/runs.csv": "",  # a study's rows cut to nothing
    "headed/runs.csv": "batch_size,compile,throughput,status,experiment,repeat\n",  # a header, no row
    # a figure that is not a number (a traceback from the averaging), a row cut short yet ended (read as missing)
    "worded/runs.csv": "batch_size,compile,throughput,status,experiment,repeat\n2,False,fast,ok,serial,0\n",
    "short/runs.csv": "batch_size,compile,throughput,status,experiment,repeat\n2,False,9.5,ok,serial,0\n2,False\n",
    "made/runs.csv": RUN_CSV,  # a study's rows, made with other server flags than the case's
    # a study's rows and the study flags they were made with (--batch_sizes 1 4 at 5 req/s, SLO 100 ms)
    "flagged/runs.csv": RUN_CSV,
    "flagged/study_args.json": '{"batch_sizes": [1, 4], "rates": [5.0], "compile": false, "slo_ms": 100.0}\n',
    "made/server_flags.json": '["--device", "cpu", "--model", "identity", "--image_size", "16"]\n',
    # a factory (imported from the current folder, the test's own) whose buffer is on the meta device: no data
    "bad_input_models.py": "import torch\n\n\ndef meta_buffer():\n    module = torch.nn.Linear(4, 4)\n"
    '    module.register_buffer("table", torch.empty(4, device="meta"))\n    return module\n',
}

# (command, its main, argv, the fragment its one line must hold)
CASES = [
    # server.py: paths and names that make files
    ("server", server.main, [*SERVER, "--output_file", LONG], "--output_file xxx"),
    ("server", server.main, [*SERVER, "--output_file", "requests"], "a run may make the folder"),
    ("server", server.main, [*SERVER, "--output_file", "aoti_cache"], "a run may make the folder"),
    ("server", server.main, [*B, "--results_dir", "/dev/null/x"], "/dev/null is a file, not a folder"),
    ("server", server.main, [*B, "--results_dir", "{tmp}/afile/x"], "afile is a file, not a folder"),
    ("server", server.main, [*SERVER, "--experiment", LONG, "--save_requests", "--trace"], "--experiment xxx"),
    ("server", server.main, [*SERVER, "--repeat", "10000"], "--repeat 10000: must be at most 9999"),
    # a name the system refuses to look up at all (a traceback in the disk-space check); a count whose Poisson
    # schedule, drawn up front, failed after the processes started
    ("server", server.main, [*B, "--results_dir", "{tmp}/" + LONG], "xxx... has 300 bytes, more than the 255"),
    ("server", server.main, [*SERVER, "--load", "poisson", "--rate", "9", "--num_iters", "1e20"], "--num_iters"),
    ("server", server.main, [*B, "--num_iters", "3000000000"], "--num_iters 3000000000: must be at most 10000000"),
    # --model_kwargs that json cannot read: too deep for its recursion, an integer past Python's digit limit
    # (the value shown cut short, with its length)
    ("server", server.main, [*FACTORY, "--model_kwargs", DEEP_JSON], "[[[...' (100007 characters): nested too deeply"),
    (
        "server",
        server.main,
        [*FACTORY, "--model_kwargs", HUGE_INT_JSON],
        "999...' (5007 characters): cannot be read as JSON (ValueError: Exceeds the limit (4300 digits)",
    ),
    (
        "server",
        server.main,
        [*SERVER, "--model", "bad_input_models:meta_buffer", "--input", "x:float32:4"],
        "--model bad_input_models:meta_buffer: buffer table is on the meta device (a shape without data)",
    ),
    # combinations that mean nothing
    (
        "server",
        server.main,
        [*SERVER, "--max_queue_delay_ms", "10000", "--load", "closed", "--concurrency", "1", "--timeout_s", "3"],
        "--max_queue_delay_ms applies with --max_batch_size only",
    ),
    (
        "server",
        server.main,
        [*SERVER, "--max_batch_size", "4", "--max_queue_delay_ms", "10000", "--timeout_s", "3"],
        "--timeout_s 3 s declares the run hung",
    ),
    # sweep.py
    ("sweep", sweep.main, [*SWEEP, "--out", "{tmp}/afile", *TINY_SWEEP], "--out {tmp}/afile: a file, not a folder"),
    ("sweep", sweep.main, [*SWEEP, "--out", "/dev/null/x", *TINY_SWEEP], "/dev/null is a file, not a folder"),
    (
        "sweep",
        sweep.main,
        [*SWEEP, "--out", "{tmp}/o", "--python", "/nonexistent/python", *TINY_SWEEP],
        "--python /nonexistent/python: no such program",
    ),
    ("sweep", sweep.main, [*SWEEP, "--out", "{tmp}/o", "--repeats", "1000000000", *TINY_SWEEP], "at most 10000"),
    ("sweep", sweep.main, [*SWEEP, "--out", "{tmp}/o", "--cell_timeout_s", "-1", *TINY_SWEEP], "--cell_timeout_s -1"),
    ("sweep", sweep.main, [*SWEEP, "--out", "{tmp}/o", "--baseline", "nosuch", *TINY_SWEEP], "--baseline nosuch"),
    (  # the runner gives each run's --output_file after the experiment's: it was overridden without a word
        "sweep",
        sweep.main,
        [*SWEEP, "--out", "{tmp}/o", "--experiment", "b=--output_file x.csv", *TINY_SWEEP],
        "experiment b gives --output_file, which the grid sets in each of its runs",
    ),
    # A flag after -- that each run sets itself (its axis) was overridden silently
    ("sweep", sweep.main, [*SWEEP, "--out", "{tmp}/o", *TINY_SWEEP, "--compile"], "--compile: every run of experiment"),
    # an experiment's flag that the grid's axis sets: the axis won, and the row said batch 1 of an experiment asked at 8
    (
        "sweep",
        sweep.main,
        [*SWEEP, "--out", "{tmp}/o", "--experiment=big=--batch_size 8", *TINY_SWEEP],
        "gives --batch",
    ),
    # report.py: what it was given, names not in the rows, output folders
    ("report", report.main, ["{tmp}/peak.csv", "--plots_dir", "{tmp}/p"], "is a peak CSV"),
    ("report", report.main, ["{tmp}", "--plots_dir", "{tmp}/p"], "is a folder"),
    ("report", report.main, ["{tmp}/" + LONG + ".csv"], "has 304 bytes, more than the 255"),
    # a header alone: its folders were made, then a traceback where the first row was read
    ("report", report.main, ["{tmp}/headed/runs.csv", "--out_dir", "{tmp}/r", "--plots_dir", "{tmp}/p"], "no rows"),
    ("report", report.main, ["{tmp}/worded/runs.csv", "--plots_dir", "{tmp}/p"], "row 2: throughput 'fast' is not a"),
    (
        "report",
        report.main,
        ["{tmp}/short/runs.csv", "--plots_dir", "{tmp}/p"],
        "row 3 has 2 fields under a header of 6",
    ),
    ("sweep", sweep.main, [*SWEEP, "--out", "{tmp}/worded", *TINY_SWEEP], "throughput 'fast' is not a number"),
    ("batch_latency", batch_latency.main, ["--report_only", "--out", "{tmp}/worded"], "'fast' is not a number"),
    ("report", report.main, ["{tmp}/runs.csv", "--plots_dir", "{tmp}/p", "--baseline", "nosuch"], "--baseline nosuch"),
    (
        "report",
        report.main,
        ["{tmp}/runs.csv", "--plots_dir", "{tmp}/p", "--detail_batch_size", "999"],
        "--detail_batch_size 999: no ok run",
    ),
    ("report", report.main, ["{tmp}/runs.csv", "--plots_dir", "{tmp}/p", "--out_dir", "/dev/null/x"], "--out_dir"),
    # bench.compare
    ("compare", compare.main, ["--repeats", "0", "--out", "{tmp}/o"], "--repeats: 0: must be between 1"),
    ("compare", compare.main, ["--repeats", "1000000000", "--out", "{tmp}/o"], "must be between 1 and 10000"),
    ("compare", compare.main, ["--models", "nosuchmodel", "--out", "{tmp}/o"], "--models nosuchmodel"),
    ("compare", compare.main, ["--batch_size", "0", "--out", "{tmp}/o"], "--batch_size: 0"),
    ("compare", compare.main, ["--device", "tpu", "--out", "{tmp}/o"], "--device: 'tpu'"),
    ("compare", compare.main, ["--out", "{tmp}/afile"], "a file, not a folder"),
    # a configuration server.py would refuse: before any run, measurement or folder (it ran first, then failed)
    ("compare", compare.main, ["--fastest", "--design nope", "--out", "{tmp}/o"], "server.py would refuse a run"),
    ("compare", compare.main, ["--fastest", "--design 'serial", "--out", "{tmp}/o"], "No closing quotation"),
    ("compare", compare.main, ["--out", "{tmp}/o", "--", "--rate", "5"], "--rate applies to --load poisson only"),
    ("compare", compare.main, ["--out", "{tmp}/o", "--", "--batch_size", "0"], "--batch_size: every run of"),
    ("compare", compare.main, ["--out", "{tmp}/o", "--", "--transport", "queue"], "--transport: every run of"),
    # bench.commits: a runs.csv it cannot read, refused before its rows were read (a traceback)
    ("commits", commits.main, ["--base", "HEAD", "--out", "{tmp}/empty", *TINY_SWEEP], "empty; remove it or choose"),
    # bench.serving
    ("serving", serving.main, ["--repeats", "0", "--out", "{tmp}/o"], "--repeats: 0"),
    ("serving", serving.main, ["--rates", "-5", "--out", "{tmp}/o"], "--rates: -5"),
    ("serving", serving.main, ["--curve_repeats", "0", "--out", "{tmp}/o"], "--curve_repeats: 0"),
    ("serving", serving.main, ["--out", "{tmp}/o", "--", "--load", "poisson"], "--load: each part sets its own load"),
    # ... abbreviated, as argparse reads it (--conc is --concurrency): the check looked for the full name only
    ("serving", serving.main, ["--out", "{tmp}/o", "--", "--conc", "4"], "--concurrency: each part sets its own"),
    ("serving", serving.main, ["--report_only", "--out", "{tmp}/o"], "no such folder"),
    # bench.stability
    ("stability", stability.main, ["--stability_pct", "0", "--out", "{tmp}/o"], "--stability_pct: 0"),
    ("stability", stability.main, ["--stability_pct", "nan", "--out", "{tmp}/o"], "--stability_pct: nan"),
    ("stability", stability.main, ["--repeats", "0", "--out", "{tmp}/o"], "--repeats: 0"),
    ("stability", stability.main, ["--report_only", "--out", "{tmp}/o"], "no such folder"),
    # bench.your_model, bench.loadgen_agreement
    ("your_model", your_model.main, ["--repeats", "0", "--out", "{tmp}/o"], "--repeats: 0"),
    ("your_model", your_model.main, ["--rate_fraction", "1.5", "--out", "{tmp}/o"], "--rate_fraction: 1.5"),
    ("your_model", your_model.main, ["--out", "{tmp}/afile"], "afile: a file, not a folder"),
    ("your_model", your_model.main, ["--report_only", "--out", "{tmp}/o"], "no such folder"),
    ("your_model", your_model.main, ["--report_only", "--out", "{tmp}/gc"], "holds no runs.csv"),
    ("your_model", your_model.main, ["--out", "{tmp}/o", "--", "--design", "nope"], "server.py would refuse a run"),
    # bench.batch_latency: a study on the harness (bench/study.py), its flags and the harness's
    ("batch_latency", batch_latency.main, ["--batch_sizes", "0", "--out", "{tmp}/o"], "--batch_sizes: 0"),
    ("batch_latency", batch_latency.main, ["--rates", "-5", "--out", "{tmp}/o"], "--rates: -5"),
    ("batch_latency", batch_latency.main, ["--cell_timeout_s", "0", "--out", "{tmp}/o"], "--cell_timeout_s: 0"),
    ("batch_latency", batch_latency.main, ["--out", "{tmp}/o", "--", "--model", "nosuch"], "'nosuch': not a"),
    ("batch_latency", batch_latency.main, ["--report_only", "--out", "{tmp}/gc"], "holds no runs.csv"),
    # ... a flag each run sets itself, abbreviated (argparse reads --batch as --batch_size): it was overridden
    ("batch_latency", batch_latency.main, ["--out", "{tmp}/o", *TINY_SWEEP, "--batch", "4"], "--batch_size: every"),
    # ... rows made with other flags counted as done, under a header naming these; rows no run could append to
    ("batch_latency", batch_latency.main, ["--out", "{tmp}/made", *TINY_SWEEP], "holds runs made with the server"),
    ("batch_latency", batch_latency.main, ["--out", "{tmp}/garbled", *TINY_SWEEP], "remove it or choose another"),
    ("batch_latency", batch_latency.main, ["--report_only", "--out", "{tmp}/garbled"], "not a results CSV"),
    ("batch_latency", batch_latency.main, ["--report_only", "--out", "{tmp}/headed"], "holds no rows; measure first"),
    # ... a resume with another study flag: the rows made at --batch_sizes 1 4 counted as done under a report of these
    (
        "batch_latency",
        batch_latency.main,
        ["--out", "{tmp}/flagged", "--batch_sizes", "1", "8", "--rates", "5", *TINY_SWEEP],
        "holds runs made with --batch_sizes 1 4; this command gives --batch_sizes 1 8: give the same",
    ),
    # ... a --report_only given such a flag: the measured one replaced it silently (the report's own --slo_ms is taken)
    (
        "batch_latency",
        batch_latency.main,
        ["--report_only", "--out", "{tmp}/flagged", "--rates", "10", "--slo_ms", "50"],
        "--rates 10.0: the runs in {tmp}/flagged were made with --rates 5.0; --report_only reports them as made",
    ),
    # a token after -- went into every run's log, server_flags.json and the report's command line
    ("batch_latency", batch_latency.main, ["--out", "{tmp}/o", *TINY_SWEEP, "--auth_token", "s3cret.token"], "$SERVER"),
    ("sweep", sweep.main, [*SWEEP, "--out", "{tmp}/made", *TINY_SWEEP], "holds runs made with the server flags"),
    ("sweep", sweep.main, [*SWEEP, "--out", "{tmp}/garbled", *TINY_SWEEP], "remove it or choose another --out"),
    ("loadgen", loadgen_agreement.main, ["--fractions", "0", "0.5", "2", "--out", "{tmp}/o"], "--fractions: 0"),
    ("loadgen", loadgen_agreement.main, ["--duration_s", "-1", "--out", "{tmp}/o"], "--duration_s: -1"),
    ("loadgen", loadgen_agreement.main, ["--batch_size", "0", "--out", "{tmp}/o"], "--batch_size: 0"),
    ("loadgen", loadgen_agreement.main, ["--out", "{tmp}/o", "--", "--batch_size", "2"], "sets it itself"),
    ("loadgen", loadgen_agreement.main, ["--out", "/dev/null/x"], "/dev/null is a file, not a folder"),
    ("loadgen", loadgen_agreement.main, ["--report_only", "--out", "{tmp}/o"], "no such folder"),
    ("loadgen", loadgen_agreement.main, ["--report_only", "--out", "{tmp}/gc"], "holds no runs.csv"),
    # bench.resolution: what a planted run would refuse, before a calibration (it calibrated for a minute first),
    # and a --report_only with nothing to report (exit 1 with no line before)
    ("resolution", resolution.main, ["--out", "{tmp}/o", "--", "--design", "threaded"], "--planted_delay_us applies"),
    ("resolution", resolution.main, ["--report_only", "--out", "{tmp}/gc"], "holds no runs.csv"),
    (
        "loadgen",
        loadgen_agreement.main,
        ["--out", "{tmp}/o", "--", "--image_size", "0"],
        "--image_size 0: must be at least 1",
    ),
    # bench.search: the budget, the rounds, a space whose runs server.py would refuse, the objective's own flags
    ("search", search.main, ["--budget_min", "0.1", "--out", "{tmp}/o"], "--budget_min: 0.1"),
    # --report_only of a search that never ran: it reported "measured 0 (0%) in 13 rounds ... converged"
    ("search", search.main, ["--report_only", "--out", "{tmp}/headed"], "holds no rows; measure first"),
    ("search", search.main, ["--min_rounds", "5", "--max_rounds", "3", "--out", "{tmp}/o"], "is more than --max_"),
    ("search", search.main, ["--workers", "0", "--out", "{tmp}/o"], "--workers: 0"),
    ("search", search.main, ["--out", "{tmp}/o", "--", "--model", "nosuch"], "server.py would refuse a run"),
    ("search", search.main, ["--out", "{tmp}/o", *TINY_SWEEP, "--design", "serial"], "--design: every run"),
    ("search", search.main, ["--objective", "p99", "--rate", "0", "--out", "{tmp}/o"], "--rate: 0"),
    # a load after -- that the objective's own replaced in every run, silently
    (
        "search",
        search.main,
        ["--objective", "throughput", "--out", "{tmp}/o", *TINY_SWEEP, "--load", "poisson"],
        "--load after",
    ),
    ("search", search.main, ["--report_only", "--out", "{tmp}/o"], "no such folder"),
    # a space of one configuration (serial reads no --workers): it measured nothing and blamed runs never made
    (
        "search",
        search.main,
        ["--designs", "serial", "--max_batch_sizes", "0", "--instances", "1", "--out", "{tmp}/o", *TINY_SWEEP],
        "the space holds one configuration (serial_mb0_i1_shm_float32_default_eager_bs1): nothing to choose",
    ),
    # a grid to check the pick against that is none: the whole search ran, then the report said nothing to check
    ("search", search.main, ["--check_against", "{tmp}/none", "--out", "{tmp}/o", *TINY_SWEEP], "--check_against"),
    # bench.gpu_check
    ("gpu_check", gpu_check.main, ["--dry_run", "--only", "verify", "--out", "{tmp}/gc"], "cannot be merged into"),
    ("gpu_check", gpu_check.main, ["--dry_run", "--out", "/dev/null/x"], "/dev/null is a file, not a folder"),
    # the network front door (docs/door.md): what applies with what, the --target URL, a port in use is in test_door
    ("server", server.main, [*SERVER, "--door", "inline"], "--door inline applies with --transport http or grpc only"),
    ("server", server.main, [*SERVER, "--serve_only"], "--serve_only applies with --transport http or grpc only"),
    ("server", server.main, [*SERVER, "--transport", "http", "--port", "70000"], "--port 70000: must be at most 65535"),
    # A door beyond loopback served anyone with a warning only: it needs a token, or --open_to_anyone said
    ("server", server.main, [*SERVER, "--transport", "http", "--host", "0.0.0.0"], "--host 0.0.0.0: a door beyond"),
    ("server", server.main, [*SERVER, "--transport", "grpc", "--auth_token", "short"], "--auth_token: 8 to 256"),
    ("server", server.main, [*SERVER, "--auth_token", "long.enough"], "--auth_token applies with --transport http"),
    ("server", server.main, [*SERVER, "--open_to_anyone"], "--open_to_anyone applies with --transport http"),
    ("server", server.main, [*SERVER, "--target", "http://127.0.0.1:1", "--open_to_anyone"], "--open_to_anyone with"),
    (
        "server",
        server.main,
        [*SERVER, "--transport", "grpc", "--door", "inline", "--instances", "2"],
        "an inline door lives in one backend process",
    ),
    ("server", server.main, [*SERVER, "--transport", "http", "--serve_only", "--verify"], "--verify with --serve_only"),
    ("server", server.main, [*SERVER, "--target", "https://x:1"], "TLS is not supported"),
    ("server", server.main, [*SERVER, "--target", "http://x:1/v2"], "give only http://host:port"),
    ("server", server.main, [*SERVER, "--target", "http://x:port"], "the port is not a number"),
    ("server", server.main, [*SERVER, "--target", "http://[::1:8000"], "not a URL"),
    ("server", server.main, [*SERVER, "--target", "http://[zz]:8000"], "not a URL"),
    ("server", server.main, [*SERVER, "--target", "grpc://x:1", "--transport", "http"], "speaks grpc"),
    ("server", server.main, [*SERVER, "--target", "http://x:1", "--verify"], "--verify with --target"),
    ("server", server.main, [*SERVER, "--target", "http://x:1", "--wire_dtype", "uint8"], "--wire_dtype uint8 with"),
    # what only our backend acts on: refused with --target rather than recorded as if applied
    *[
        ("server", server.main, [*SERVER, "--target", "http://x:1", *flags], f"{flags[0]} with --target")
        for flags in (
            ["--design", "threaded"],
            ["--num_workers", "3"],
            ["--precision", "fp16"],
            ["--channels_last"],
            ["--spin_wait"],
            ["--ring_slots", "4"],
            ["--ceiling_s", "5"],
        )
    ],
    ("server", server.main, [*SERVER, "--load", "poisson", "--rate", "1e-300"], "--rate 1e-300: must be at least"),
    # the door's values it could not serve with: refused before anything starts, not found out as a failed run
    *[
        ("server", server.main, [*SERVER, "--transport", "http", *flags], fragment)
        for flags, fragment in (
            (["--max_body_mb", "0"], "--max_body_mb 0: must be positive"),
            (["--max_body_mb", "-1"], "--max_body_mb -1: must be positive"),
            (["--max_body_mb", "1e-9"], "--max_body_mb 1e-09: below one request's"),
            (["--host", ""], "--host '': give the interface"),
            (["--model_name", "a b"], "--model_name 'a b': letters, digits"),
            (["--model_name", "modèle"], "--model_name 'modèle': letters, digits"),
            (["--model_name", "a/b"], "--model_name 'a/b': letters, digits"),
        )
    ],
    (
        "server",
        server.main,
        [*SERVER, "--transport", "http", "--serve_only", "--load", "closed", "--concurrency", "2"],
        "--load closed with --serve_only: there is no frontend of ours",
    ),
    # --generators N: what several load generators cannot do
    ("server", server.main, [*SERVER, "--generators", "2"], "--generators > 1 needs --transport http|grpc or --target"),
    ("server", server.main, [*SERVER, "--generators", "0"], "--generators 0: must be at least 1"),
    ("server", server.main, [*SERVER, "--generators", "65"], "--generators 65: must be at most 64"),
    (
        "server",
        server.main,
        [*SERVER, "--generators", "2", "--transport", "http", "--load", "loadgen", "--scenario", "SingleStream"],
        "LoadGen issues every query from one process",
    ),
    (
        "server",
        server.main,
        [*SERVER, "--generators", "2", "--transport", "grpc", "--stability_pct", "5"],
        "--stability_pct with --generators 2: each generator would end its measured phase on its own windows",
    ),
    (
        "server",
        server.main,
        [*SERVER, "--generators", "3", "--transport", "http", "--load", "closed", "--concurrency", "2"],
        "--concurrency 2 with --generators 3: each generator needs at least one request outstanding",
    ),
    (  # concurrency 3 as places 1 + 2: --num_iters 2 in proportion to them would leave generator 0 none
        "server",
        server.main,
        [*SERVER, "--generators", "2", "--transport", "http", "--load", "closed", "--concurrency", "3"],
        "--num_iters 2 with --generators 2 --concurrency 3: --num_iters goes to each in proportion to its places "
        "(1, 2), and each generator needs at least one measured request (generator 0 would get none); give "
        "--num_iters 3 or more",
    ),
    (
        "server",
        server.main,
        [*SERVER, "--generators", "3", "--target", "http://x:1"],
        "--num_iters 2 with --generators 3: each generator needs at least one measured request",
    ),
    (
        "server",
        server.main,
        [*SERVER, "--generators", "2", "--transport", "http", "--serve_only"],
        "--generators 2 with --serve_only: no load generator of ours runs",
    ),
    # nothing listens on port 1: refused before any process starts, as a port in use is
    ("server", server.main, [*SERVER, "--target", "http://127.0.0.1:1"], "cannot read model 'identity'"),
]


def _tree(root: Path) -> set[str]:
    return {str(path.relative_to(root)) for path in root.rglob("*")}


@pytest.mark.parametrize("command,main,argv,expected", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_bad_input_is_one_line_and_exit_2_with_nothing_written(
    tmp_path: Path, capsys, monkeypatch, command: str, main, argv: list[str], expected: str
) -> None:
    for name, text in FILES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    before = _tree(tmp_path)
    argv = [arg.replace("{tmp}", str(tmp_path)) for arg in argv]
    monkeypatch.chdir(tmp_path)  # where a factory is imported from; nothing may be written here either
    monkeypatch.setattr(sys, "path", list(sys.path))  # which the import puts first
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # an import writes no __pycache__ (nor a child's:)
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    monkeypatch.delenv("SERVERBENCH_AUTH_TOKEN", raising=False)  # --auth_token's default
    try:
        status = main(argv)
    except SystemExit as exc:  # argparse's refusal
        status = exc.code
    finally:
        sys.modules.pop("bad_input_models", None)
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2, err
    assert len(err) == 1 and expected.replace("{tmp}", str(tmp_path)) in err[0], err
    assert err[0].startswith(("server.py: error:", "sweep.py: error:", "report.py: error:", "python -m bench."))
    assert _tree(tmp_path) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root enters and writes any folder: nothing to refuse")
def test_a_results_folder_under_one_that_cannot_be_entered_is_refused(tmp_path: Path, capsys) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o000)
    try:
        assert server.main([*B, "--num_iters", "2", "--results_dir", str(locked / "out")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "cannot be entered or written" in err[0], err
    finally:
        locked.chmod(0o700)


class _Metadata(http.server.BaseHTTPRequestHandler):
    """An OIP server's metadata endpoint, answering what the test puts in `answer`."""

    answer: dict = {}

    def do_GET(self) -> None:
        body = json.dumps(self.answer).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        return None


@pytest.mark.parametrize(
    "shape,expected",
    [
        ([-1, 3.5], "shape [-1, 3.5] is not a list of whole numbers"),  # read as 3 before
        ([-1, 100_000, 100_000], "of memory available now"),  # failed mid-run at a 40 GB allocation, a traceback
        ("garbage", "not HTTP"),
    ],
)
def test_a_targets_metadata_that_cannot_be_served_is_one_line_and_exit_2(
    tmp_path: Path, capsys, shape: object, expected: str
) -> None:
    """--target: what the server says of its model is checked before the run, and a port that does not speak HTTP
    is said so, each in one line (each was a traceback or a failed run)."""
    if shape == "garbage":  # a port that answers something other than HTTP (a gRPC port, say)
        listener = socket.create_server(("127.0.0.1", 0))
        port = listener.getsockname()[1]

        def answer_garbage() -> None:
            with contextlib.suppress(OSError):
                conn, _ = listener.accept()
                conn.recv(65536)
                conn.sendall(b"\x00\x00\x18\x04\x00\x00\x00\x00\x00not HTTP at all\r\n\r\n")
                conn.close()

        threading.Thread(target=answer_garbage, daemon=True).start()
        expected = "cannot read model 'm''s metadata"
    else:
        handler = type(
            "Metadata", (_Metadata,), {"answer": {"inputs": [{"name": "x", "datatype": "FP32", "shape": shape}]}}
        )
        listener = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        port = listener.server_address[1]
        threading.Thread(target=listener.serve_forever, daemon=True).start()
    try:
        argv = ["--target", f"http://127.0.0.1:{port}", "--model_name", "m", "--results_dir", str(tmp_path / "out")]
        status = server.main(argv)
    finally:
        if isinstance(listener, http.server.HTTPServer):
            listener.shutdown()
            listener.server_close()
        else:
            listener.close()
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and err[0].startswith("server.py: error: "), err
    assert expected in err[0], err
    assert not (tmp_path / "out").exists()


def test_an_output_file_that_is_a_pipe_is_refused_before_the_run(tmp_path: Path, capsys) -> None:
    """A FIFO as the row's file would block the row's write for ever, after the whole run."""
    folder = tmp_path / "out"
    folder.mkdir()
    os.mkfifo(folder / "output.csv")
    assert server.main([*B, "--num_iters", "2", "--results_dir", str(folder), "--output_file", "output.csv"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a regular file" in err, err
    assert [p.name for p in folder.iterdir()] == ["output.csv"]
