#!/bin/sh
# Usage: ./venv.sh COMMAND [ARGS...]
# Creates .venv and installs the project with its extras (the network door, LoadGen, the tests) when needed, then
# runs COMMAND inside it.
#
# TORCH_INDEX_URL picks the wheel index torch and torchvision come from, for a GPU whose driver is older than
# the CUDA that the package index's default build needs (server.py names the index to use when that happens):
#     TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 ./venv.sh python server.py
# Changing it reinstalls torch and torchvision from the new index at the next call.
set -eu
cd "$(dirname "$0")"
VENV="${VENV:-.venv}"
TORCH_INDEX_URL="${TORCH_INDEX_URL:-}"
stamp="$VENV/.installed-$( (cat pyproject.toml; printf '%s\n' "$TORCH_INDEX_URL") | cksum | cut -d' ' -f1)"
if [ ! -f "$stamp" ]; then
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
    # PIP_FIND_LINKS is emptied so that a CPU-only torch wheel left on the machine is never picked:
    # torchvision from the index needs the index's torch build.
    PIP_FIND_LINKS= "$VENV/bin/python" -m pip install --quiet --upgrade pip
    if [ -n "$TORCH_INDEX_URL" ]; then
        # Both from that index alone (it also serves their dependencies), so that no newer build from the
        # default index can win; --force-reinstall replaces a build installed from another index.
        PIP_FIND_LINKS= "$VENV/bin/python" -m pip install --quiet --force-reinstall --index-url "$TORCH_INDEX_URL" \
            'torch>=2.5' 'torchvision>=0.20'
    fi
    # torch and torchvision, when installed above, already satisfy the project's ranges and stay as they are.
    PIP_FIND_LINKS= "$VENV/bin/python" -m pip install --quiet -e '.[door,loadgen,test]'
    rm -f "$VENV"/.installed-*
    touch "$stamp"
fi
case "$VENV" in
    /*) PATH="$VENV/bin:$PATH" ;;
    *) PATH="$PWD/$VENV/bin:$PATH" ;;
esac
export PATH
exec "$@"
