#!/bin/sh
# Usage: ./venv.sh COMMAND [ARGS...]
# Creates .venv and installs the project with its test extra when needed, then runs COMMAND inside it.
set -eu
cd "$(dirname "$0")"
VENV="${VENV:-.venv}"
stamp="$VENV/.installed-$(cksum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ]; then
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
    # PIP_FIND_LINKS is emptied so that a CPU-only torch wheel left on the machine is never picked:
    # torchvision from the index needs the index's torch build.
    PIP_FIND_LINKS= "$VENV/bin/python" -m pip install --quiet --upgrade pip
    PIP_FIND_LINKS= "$VENV/bin/python" -m pip install --quiet -e '.[test]'
    rm -f "$VENV"/.installed-*
    touch "$stamp"
fi
PATH="$PWD/$VENV/bin:$PATH"
export PATH
exec "$@"
