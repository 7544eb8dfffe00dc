#!/bin/sh
# Usage: tools/gpu_wheels.sh [FOLDER]          (default: wheels/ at the checkout's root, gitignored)
# Downloads, here (it needs the network), the wheels of the network door's packages for a lent GPU machine that has
# no network and none of them: Python 3.12, manylinux x86-64. bench.gpu_check --part 2 installs them there without
# the network (pip --no-index --no-deps into a folder of its run, put on the servers' PYTHONPATH; where pip is
# absent, it unzips them) for its HTTP door check, and skips that check ("wheels not carried") without the folder.
# Carry the folder with the checkout (about 4 MB).
#     uvicorn, h11, httptools, orjson, tritonclient[grpc], and what they need that the GPU machine lacks
#     (protobuf, python-rapidjson, urllib3, click, packaging, typing_extensions)
# Left out: numpy, grpcio and ml_dtypes, which the GPU machine has (and torch's typing_extensions wins where it is
# already installed: bench.gpu_check installs only the wheels of the packages it cannot import).
# PYTHON names the interpreter whose pip downloads (default: .venv's, else python3); PYTHON_VERSION the target
# (default 3.12). On failure it exits 1 with pip's last line on stderr, and FOLDER is left as it was.
set -eu
cd "$(dirname "$0")/.."
DEST=${1:-wheels}
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
VERSION=${PYTHON_VERSION:-3.12}
ABI=cp$(echo "$VERSION" | tr -d .)
TMP=$DEST.partial
rm -rf "$TMP"
mkdir -p "$TMP"
# The same lower bounds as pyproject.toml's door extra. PIP_FIND_LINKS emptied: only the index's wheels, for Linux.
if ! PIP_FIND_LINKS= "$PYTHON" -m pip download --quiet --disable-pip-version-check --dest "$TMP" \
    --only-binary=:all: --python-version "$VERSION" --implementation cp --abi "$ABI" --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform any \
    'uvicorn>=0.30' h11 'httptools>=0.6' 'orjson>=3.10' 'tritonclient[grpc]>=2.40' 2>"$TMP.log"; then
    echo "tools/gpu_wheels.sh: pip download failed: $(grep -v '^WARNING' "$TMP.log" | tail -n 1)" >&2
    rm -rf "$TMP" "$TMP.log"
    exit 1
fi
rm -f "$TMP.log" "$TMP"/numpy-* "$TMP"/grpcio-* "$TMP"/ml_dtypes-*
rm -rf "$DEST"
mv "$TMP" "$DEST"
echo "$(ls "$DEST" | wc -l) wheels in $DEST ($(du -sh "$DEST" | cut -f1)):"
ls "$DEST"
