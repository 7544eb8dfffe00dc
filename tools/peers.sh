#!/bin/sh
# Usage: tools/peers.sh [--python PYTHON] [pytriton] [kserve]        (both when none is named)
# Makes the environments the peers of `python -m bench.peers` run in, never in the project's .venv (the peers pin
# their own numpy, protobuf and FastAPI). Once per machine, not per clone: each is made in a cache outside the
# checkout, one folder per stamp (pins, interpreter path and version),
#     ${SERVERBENCH_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/serverbench}/peers/NAME-KEY   (KEY: cksum of the stamp)
# and this checkout's .tools/peers/NAME is a symlink to it (a later clone only makes the symlink):
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
# Idempotent: an environment whose stamp matches its pins and interpreter is left as it is (a second call, or the
# first in another clone, takes a second). Two calls making the same environment at once: the second waits for the
# first (flock) and takes its environment; one is used only once stamped, so never half-made.
# On failure it exits 1 with one line on stderr saying what could not be made and why; a bad flag exits 2.
set -eu
ME=tools/peers.sh
TOOLS=${SERVERBENCH_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/serverbench}
# Absolute: the symlinks in .tools/ must not depend on the folder they sit in.
case $TOOLS in /*) ;; *) TOOLS=$PWD/$TOOLS ;; esac
CACHE=$TOOLS/peers
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

# env_ready DIR STAMP_TEXT: DIR is a whole environment made for STAMP_TEXT (the stamp is written last).
env_ready() {
    [ -f "$1/.stamp" ] && [ "$(cat "$1/.stamp")" = "$2" ] && [ -x "$1/bin/python" ]
}

# link_to TARGET LINK: LINK becomes a symlink to TARGET; one to another folder (other pins), a dangling one or a
# folder of the checkout's own (made per clone before the cache) is replaced.
link_to() {
    if [ -L "$2" ] && [ "$(readlink "$2")" = "$1" ]; then
        return 0
    fi
    { mkdir -p "$(dirname "$2")" && rm -rf "$2" && ln -s "$1" "$2"; } 2>/dev/null || fail "cannot link $2 to $1"
}

# build_env DIR PYTHON PINS STAMP_TEXT: a venv at DIR made by PYTHON with PINS installed, stamped last.
build_env() {
    env=$1 python=$2 pins=$3 stamp_text=$4
    rm -rf "$env"
    log=$env.log
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
}

# make_env NAME PYTHON PINS: the cached venv for PYTHON and PINS (made when missing), linked from $PEERS/NAME.
make_env() {
    name=$1 python=$2 pins=$3
    real=$(command -v "$python" 2>/dev/null || printf '%s' "$python")
    stamp_text="$pins @ $real $(version_of "$python")"
    # One folder per stamp: other pins or another interpreter get a folder of their own, never a changed one.
    env=$CACHE/$name-$(printf '%s\n' "$stamp_text" | cksum | cut -d' ' -f1)
    if ! env_ready "$env" "$stamp_text"; then
        mkdir -p "$CACHE" 2>/dev/null || fail "cannot make the cache folder $CACHE (SERVERBENCH_TOOLS names another)"
        # A venv cannot be moved once made (its scripts name its path): it is made in place, under a lock that
        # a second clone making the same one waits on; then that clone finds it stamped.
        if command -v flock >/dev/null 2>&1; then
            exec 9>"$env.lock"
            if ! flock -n 9; then
                printf '%s: waiting for another tools/peers.sh making %s\n' "$ME" "$env"
                # bounded: a first call that hangs (a stalled download) fails this one in a line, never forever
                flock -w 1800 9 || fail "another tools/peers.sh has held $env.lock for 30 minutes; is it stuck?"
            fi
        fi
        env_ready "$env" "$stamp_text" || build_env "$env" "$python" "$pins" "$stamp_text"
        exec 9>&-
    fi
    link_to "$env" "$PEERS/$name"
    printf '%s ready: %s (%s; in %s)\n' "$name" "$PEERS/$name/bin/python" "$stamp_text" "$env"
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
            [ $# -ge 2 ] && [ -n "$2" ] || usage "--python needs an interpreter"
            TRITON_PYTHON=$2
            shift 2
            ;;
        --python=*)
            TRITON_PYTHON=${1#--python=}
            [ -n "$TRITON_PYTHON" ] || usage "--python= needs an interpreter"
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
