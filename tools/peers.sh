#!/bin/sh
# Usage: tools/peers.sh [--python PYTHON] [pytriton] [kserve]        (both when none is named)
# Makes the environments the peers of `python -m bench.peers` run in, under .tools/peers/ of this checkout, never in
# the project's .venv (the peers pin their own numpy, protobuf and FastAPI):
#     .tools/peers/pytriton   nvidia-pytriton 0.7.0 (Triton Inference Server 2.51 and its Python-backend stubs),
#                             torch and torchvision; under Python 3.12 or 3.13 with a shared libpython (Triton's
#                             stub links it; under 3.11 the stub fails at model load)
#     .tools/peers/kserve     kserve 0.21.0 (its Python model server: FastAPI under uvicorn), torch and torchvision;
#                             under python3 (3.10 to 3.13)
# Both serve the same model code as server.py (serverbench/backend/models.py, imported from this checkout) on the
# CPU: torch comes from the package index as for .venv (its CUDA build runs on the CPU).
# The interpreter for PyTriton: --python PYTHON (or PYTRITON_PYTHON), else the first of python3.12 and python3.13
# that starts, on PATH or among pyenv's versions; 3.12 first because numpy < 2 (PyTriton's pin) has wheels for
# it, where under 3.13 it is compiled (about 3 minutes on 2 cores).
# Idempotent: an environment whose stamp matches its pins and interpreter is left as it is (a second call takes a
# second). On failure it exits 1 with one line on stderr saying what could not be made and why; a bad flag exits 2.
set -eu
ME=tools/peers.sh
cd "$(dirname "$0")/.."
ROOT=$PWD
PEERS=.tools/peers
PYTRITON_PINS="nvidia-pytriton==0.7.0 torch>=2.5 torchvision>=0.20"
KSERVE_PINS="kserve==0.21.0 torch>=2.5 torchvision>=0.20"
TRITON_PYTHON=${PYTRITON_PYTHON:-}
KSERVE_PYTHON=${KSERVE_PYTHON:-python3}

fail() {
    printf '%s: %s\n' "$ME" "$(printf '%s' "$*" | tr '\n' ' ')" >&2
    exit 1
}

usage() {
    printf '%s: %s (usage: tools/peers.sh [--python PYTHON] [pytriton] [kserve])\n' "$ME" "$*" >&2
    exit 2
}

# The reason in pip's log: its last ERROR line, else its last line.
reason() {
    line=$(grep -E '^ERROR: |Error|error:' "$1" | grep -v '^WARNING' | tail -n 1 | sed -E 's/^ERROR: //')
    [ -n "$line" ] || line=$(grep -v '^[[:space:]]*$' "$1" | tail -n 1)
    printf '%s' "${line:-no message}"
}

# Prints the interpreter's version as major.minor when it starts; nothing (status 1) when it does not (a pyenv
# shim of a version not selected prints an error and exits 127).
version_of() {
    "$1" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null
}

# The shared libpython Triton's stub loads (found by bench/peer_servers through sysconfig's LIBDIR); nothing when
# the interpreter was built without --enable-shared.
shared_libpython() {
    "$1" -c 'import os, sysconfig as s
if s.get_config_var("Py_ENABLE_SHARED"):
    path = os.path.join(s.get_config_var("LIBDIR"), s.get_config_var("LDLIBRARY"))
    print(path if os.path.exists(path) else "")' 2>/dev/null
}

find_triton_python() {
    if [ -n "$TRITON_PYTHON" ]; then
        printf '%s' "$TRITON_PYTHON"
        return
    fi
    pyenv_root=$(pyenv root 2>/dev/null || true)
    for candidate in python3.12 python3.13 ${pyenv_root:+"$pyenv_root"/versions/3.12*/bin/python3.12} \
        ${pyenv_root:+"$pyenv_root"/versions/3.13*/bin/python3.13}; do
        if version_of "$candidate" >/dev/null; then
            printf '%s' "$candidate"
            return
        fi
    done
}

# make_env NAME PYTHON PINS: a venv at $PEERS/NAME made by PYTHON with PINS installed; kept when its stamp matches.
make_env() {
    name=$1 python=$2 pins=$3
    env=$PEERS/$name
    real=$(command -v "$python" 2>/dev/null || printf '%s' "$python")
    stamp_text="$pins @ $real $(version_of "$python")"
    if [ -f "$env/.stamp" ] && [ "$(cat "$env/.stamp")" = "$stamp_text" ] && [ -x "$env/bin/python" ]; then
        printf '%s ready: %s (%s)\n' "$name" "$env/bin/python" "$stamp_text"
        return 0
    fi
    rm -rf "$env"
    mkdir -p "$PEERS"
    log=$PEERS/$name.log
    "$python" -m venv "$env" >"$log" 2>&1 || fail "cannot make $env with $python: $(reason "$log")"
    printf '%s: installing %s into %s (minutes the first time)\n' "$ME" "$pins" "$env"
    # PIP_FIND_LINKS is emptied as in venv.sh: torchvision from the index needs the index's torch build.
    # shellcheck disable=SC2086  # the pins are words
    if ! PIP_FIND_LINKS= "$env/bin/python" -m pip install --quiet --disable-pip-version-check $pins >>"$log" 2>&1; then
        fail "cannot install $pins into $env: $(reason "$log") (log: $log)"
    fi
    # The model code is this checkout's: the environment must import it as server.py's backend does.
    if ! (cd "$ROOT" && "$env/bin/python" -c 'import bench.peer_servers.model' >>"$log" 2>&1); then
        fail "$env cannot import bench.peer_servers.model: $(reason "$log") (log: $log)"
    fi
    printf '%s\n' "$stamp_text" >"$env/.stamp"
    printf '%s ready: %s (%s)\n' "$name" "$env/bin/python" "$stamp_text"
}

make_pytriton() {
    python=$(find_triton_python)
    [ -n "$python" ] || fail "no Python 3.12 or 3.13 for PyTriton: none of python3.12, python3.13 starts (on PATH or" \
        "among pyenv's versions); name one with --python PYTHON"
    version=$(version_of "$python") || fail "PyTriton's interpreter $python does not start"
    case $version in
        3.12 | 3.13) ;;
        *) fail "PyTriton needs Python 3.12 or 3.13 (its stub fails at model load under 3.11), not $python ($version)" ;;
    esac
    [ -n "$(shared_libpython "$python")" ] || fail "$python ($version) has no shared libpython, which Triton's" \
        "Python-backend stub loads; use an interpreter built with --enable-shared"
    make_env pytriton "$python" "$PYTRITON_PINS"
}

make_kserve() {
    version=$(version_of "$KSERVE_PYTHON") || fail "KServe's interpreter $KSERVE_PYTHON does not start"
    case $version in
        3.10 | 3.11 | 3.12 | 3.13) ;;
        *) fail "kserve 0.21.0 needs Python 3.10 to 3.13, not $KSERVE_PYTHON ($version); set KSERVE_PYTHON" ;;
    esac
    make_env kserve "$KSERVE_PYTHON" "$KSERVE_PINS"
}

wanted=""
while [ $# -gt 0 ]; do
    case $1 in
        --python)
            [ $# -ge 2 ] || usage "--python needs an interpreter"
            TRITON_PYTHON=$2
            shift 2
            ;;
        --python=*)
            TRITON_PYTHON=${1#--python=}
            shift
            ;;
        pytriton | kserve)
            wanted="$wanted $1"
            shift
            ;;
        *) usage "unknown argument '$1'" ;;
    esac
done
[ -n "$wanted" ] || wanted="pytriton kserve"
for peer in $wanted; do
    "make_$peer"
done
