#!/bin/sh
# The reference's experiment table in one command: every design x batch size x compile value, repeated,
# then the markdown summaries and plots. Axes come from the environment (defaults: the reference's runner.sh);
# any flag given here goes to sweep.py, and flags after -- go to every server.py run.
#
#   ./sweep.sh
#   BATCH_SIZES="1 32" COMPILE=false REPEATS=3 OUT=results/sweep_quick ./sweep.sh -- --image_size 64
#   RATES="5 10 20 40" BATCH_SIZES=32 ./sweep.sh -- --slo_ms 200 --duration_s 30   # the latency-throughput curve
#
# RATES (open loop, requests/s) or CONCURRENCY (closed loop) adds a load axis; both are empty by default.
# Re-running the same command resumes the sweep where it stopped.
set -eu
cd "$(dirname "$0")"
: "${BATCH_SIZES:=1 32 64 128 256}"
: "${COMPILE:=true false}"
: "${DESIGNS:=serial threaded pipelined}"
: "${WORKERS:=1 2 4}"
: "${REPEATS:=10}"
: "${SEED:=0}"
: "${RATES:=}"
: "${CONCURRENCY:=}"
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
# Unquoted on purpose: each axis is a space-separated list.
# shellcheck disable=SC2086
set -- --repeats "$REPEATS" --seed "$SEED" ${OUT:+--out "$OUT"} ${RATES:+--rates $RATES} \
    ${CONCURRENCY:+--concurrency $CONCURRENCY} "$@"
# shellcheck disable=SC2086
exec "$PYTHON" sweep.py --batch_sizes $BATCH_SIZES --compile $COMPILE --designs $DESIGNS --workers $WORKERS "$@"
