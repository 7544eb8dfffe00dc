#!/bin/sh
# Usage: tools/perf_analyzer.sh
# Brings Triton's C++ load generator perf_analyzer (tritonclient 2.40.0), with nothing installed system-wide, then runs
# `perf_analyzer --version` to show that it starts. Once per machine, not per clone: the files go into a cache outside
# the checkout, one folder per set of pins,
#     ${SERVERBENCH_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/serverbench}/perf_analyzer-KEY   (KEY: cksum of the pins)
# and this checkout's .tools/perf_analyzer is a symlink to it (a later clone only makes the symlink):
#     .tools/perf_analyzer/bin/perf_analyzer    from the tritonclient 2.40.0 manylinux wheel (PyPI)
#     .tools/perf_analyzer/lib/libb64.so.0d      from Debian's package libb64-0d (apt-get download, else the pool)
#     .tools/perf_analyzer/lib/libcudart.so.12   from the nvidia-cuda-runtime-cu12 wheel (PyPI); no GPU is needed
# Run it as: LD_LIBRARY_PATH=.tools/perf_analyzer/lib .tools/perf_analyzer/bin/perf_analyzer ...
# (bench/perf_analyzer.py does that). A second call with everything in place only runs --version (milliseconds).
# Two calls bringing it at once: the second waits for the first (flock) and takes what it brought.
# On failure it exits 1 with one line on stderr saying what could not be brought and why.
# PYTHON names the interpreter whose pip downloads the wheels (default: python3 on PATH).
set -eu
ME=tools/perf_analyzer.sh
# It takes no arguments: --help prints the usage above; anything else is refused before anything is brought.
case ${1-} in
    -h | --help)
        sed -n '2,/^set -eu/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
        exit 0
        ;;
    "") ;;
    *)
        printf '%s: takes no arguments (got %s); --help says what it does\n' "$ME" "$1" >&2
        exit 2
        ;;
esac
TOOLS=${SERVERBENCH_TOOLS:-${XDG_CACHE_HOME:-$HOME/.cache}/serverbench}
# Absolute: the symlink in .tools/ must not depend on the folder it sits in.
case $TOOLS in /*) ;; *) TOOLS=$PWD/$TOOLS ;; esac
cd "$(dirname "$0")/.."
ROOT=$PWD
LINK=.tools/perf_analyzer
BIN=$LINK/bin/perf_analyzer
LIB=$LINK/lib
TRITONCLIENT=2.40.0
# The CUDA 12.3 runtime of the Triton 23.11 release that tritonclient 2.40.0 comes from (pinned: same bytes everywhere).
CUDART=12.3.101
# Used only when apt cannot name the package (no package lists, or no apt): Debian bookworm's build, checked by hash.
LIBB64_DEB_URL=http://deb.debian.org/debian/pool/main/libb/libb64/libb64-0d_1.2-5%2bb1_amd64.deb
LIBB64_DEB_SHA256=b0e1d6fde8bdccc18c3884144aede064dc82464dd4777275fa80e74c05583e82
PINS="tritonclient==$TRITONCLIENT nvidia-cuda-runtime-cu12==$CUDART libb64-0d"
# One folder per set of pins: other pins get a folder of their own, never a changed one.
CACHE=$TOOLS/perf_analyzer-$(printf '%s\n' "$PINS" | cksum | cut -d' ' -f1)
STAMP=$CACHE/.stamp
PYTHON=${PYTHON:-python3}

fail() {
    printf '%s: %s\n' "$ME" "$(printf '%s' "$*" | tr '\n' ' ')" >&2
    exit 1
}

# The reason in a tool's log: its last error line (pip's ERROR:, apt's E:, a Python exception), else its last line.
reason() {
    line=$(grep -E '^(ERROR|E): |^[A-Za-z.]*(Error|Exception)|^SystemExit' "$1" | tail -n 1 | sed -E 's/^(ERROR|E): //')
    [ -n "$line" ] || line=$(grep -v '^[[:space:]]*$' "$1" | tail -n 1)
    printf '%s' "${line:-no message}"
}

# The indexes pip looked in: "No matching distribution" alone does not say that the index could not be reached.
indexes() {
    found=$(sed -n 's/^Looking in indexes: //p' "$1" | head -n 1)
    [ -z "$found" ] || printf ' (%s)' "$found"
}

# Exits 1 with the reason when the binary does not start with the cached libraries: ldd names what is missing.
check_starts() {
    if version=$(LD_LIBRARY_PATH="$ROOT/$LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$BIN" --version 2>&1); then
        printf 'perf_analyzer ready: %s (%s); run it with LD_LIBRARY_PATH=%s\n' "$BIN" "$version" "$LIB"
        return 0
    fi
    missing=$(LD_LIBRARY_PATH="$ROOT/$LIB" ldd "$BIN" 2>/dev/null | awk '/not found/ {printf "%s ", $1}')
    if [ -n "$missing" ]; then
        fail "perf_analyzer $TRITONCLIENT does not start: shared libraries not found: $missing(see ldd $BIN)"
    fi
    fail "perf_analyzer $TRITONCLIENT does not start: $(printf '%s' "$version" | tail -n 1)"
}

# The cache's folder holds everything, stamped last (after the binary started).
cache_ready() {
    [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$PINS" ] && [ -x "$CACHE/bin/perf_analyzer" ] &&
        [ -f "$CACHE/lib/libb64.so.0d" ] && [ -f "$CACHE/lib/libcudart.so.12" ]
}

# The checkout's .tools/perf_analyzer: a symlink to the cache's folder; one to another folder (other pins), a dangling
# one or a folder of the checkout's own (brought per clone before the cache) is replaced.
link_cache() {
    if [ -L "$LINK" ] && [ "$(readlink "$LINK")" = "$CACHE" ]; then
        return 0
    fi
    { mkdir -p "$(dirname "$LINK")" && rm -rf "$LINK" && ln -s "$CACHE" "$LINK"; } 2>/dev/null ||
        fail "cannot link $LINK to $CACHE"
}

if cache_ready; then
    link_cache
    check_starts
    exit 0
fi

[ "$(uname -s)/$(uname -m)" = Linux/x86_64 ] ||
    fail "cannot bring perf_analyzer: tritonclient $TRITONCLIENT ships it for Linux x86_64 only, this is $(uname -sm)"
"$PYTHON" -m pip --version >/dev/null 2>&1 ||
    fail "cannot download tritonclient $TRITONCLIENT: '$PYTHON -m pip' does not run (set PYTHON to a Python with pip)"

mkdir -p "$CACHE/bin" "$CACHE/lib" 2>/dev/null ||
    fail "cannot make the cache folder $CACHE (SERVERBENCH_TOOLS names another)"
# A second bring of the same folder waits for the first, then finds it stamped.
if command -v flock >/dev/null 2>&1; then
    exec 9>"$CACHE.lock"
    if ! flock -n 9; then
        printf '%s: waiting for another tools/perf_analyzer.sh bringing %s\n' "$ME" "$CACHE"
        # bounded: a first call that hangs (a stalled download) fails this one in a line, never forever
        flock -w 900 9 || fail "another tools/perf_analyzer.sh has held the lock for 15 minutes; is it stuck?"
    fi
    if cache_ready; then
        link_cache
        check_starts
        exit 0
    fi
fi
printf '%s: bringing perf_analyzer %s into %s (a minute the first time)\n' "$ME" "$TRITONCLIENT" "$CACHE"
rm -f "$STAMP"
# What a killed bring left (an hour old: a bring running next to this one without flock keeps its own).
find "$CACHE" -maxdepth 1 -name '.tmp.*' -mmin +60 -exec rm -rf {} +
TMP=$(mktemp -d "$CACHE/.tmp.XXXXXX")
trap 'rm -rf "$TMP"' EXIT
trap 'exit 130' INT TERM HUP
LOG=$TMP/log

# One wheel without its dependencies, for this platform whatever the local Python is; PIP_FIND_LINKS is emptied as in
# venv.sh so that a wheel folder on the machine cannot stand in for the index's file; --no-cache-dir: the cache here
# is the one copy.
pip_download() {
    PIP_FIND_LINKS='' "$PYTHON" -m pip download --no-deps --no-cache-dir --disable-pip-version-check \
        --only-binary=:all: --platform manylinux1_x86_64 --platform manylinux2014_x86_64 \
        --platform manylinux_2_17_x86_64 -d "$TMP/wheels" "$1" >"$LOG" 2>&1
}

# Copies one member of a zip (a wheel) to a file.
unzip_member() {
    "$PYTHON" - "$@" >"$LOG" 2>&1 <<'EOF'
import shutil, sys, zipfile
wheel, member, dest = sys.argv[1:]
with zipfile.ZipFile(wheel) as archive, archive.open(member) as src, open(dest, "wb") as out:
    shutil.copyfileobj(src, out)
EOF
}

# Puts a file in place by renaming within the cache, so that an interrupted bring never leaves half a file.
place() {
    chmod "$3" "$1" && mv -f "$1" "$2"
}

# libb64-0d's .deb into $TMP/deb/: apt-get download needs no root; without package lists (or apt), the Debian pool.
fetch_libb64_deb() {
    mkdir "$TMP/deb"
    if command -v apt-get >/dev/null 2>&1 && (cd "$TMP/deb" && apt-get download libb64-0d) >"$LOG" 2>&1; then
        return 0
    fi
    rm -f "$TMP"/deb/*
    uris=$(cd "$TMP" && apt-get download --print-uris libb64-0d 2>/dev/null) || uris=
    DEB_URL=$(printf '%s\n' "$uris" | sed -n "s/^'\([^']*\)'.*/\1/p" | head -n 1)
    sha=$(printf '%s\n' "$uris" | sed -n 's/.* SHA256:\([0-9a-f]*\)$/\1/p' | head -n 1)
    [ -n "$DEB_URL" ] && [ -n "$sha" ] || { DEB_URL=$LIBB64_DEB_URL; sha=$LIBB64_DEB_SHA256; }
    "$PYTHON" - "$DEB_URL" "$sha" "$TMP/deb/libb64-0d.deb" >>"$LOG" 2>&1 <<'EOF'
import hashlib, sys, urllib.request
url, sha256, dest = sys.argv[1:]
data = urllib.request.urlopen(url, timeout=60).read()
if hashlib.sha256(data).hexdigest() != sha256:
    raise SystemExit(f"SystemExit: {url}: SHA256 differs from {sha256}")
with open(dest, "wb") as out:
    out.write(data)
EOF
}

# The library out of the .deb: dpkg-deb -x where there is one (no root needed), else Python reads the ar archive.
extract_libb64() {
    if command -v dpkg-deb >/dev/null 2>&1; then
        dpkg-deb -x "$1" "$TMP/root" >"$LOG" 2>&1 && cp "$TMP/root/usr/lib/x86_64-linux-gnu/libb64.so.0d" "$2"
        return
    fi
    "$PYTHON" - "$1" "$2" >"$LOG" 2>&1 <<'EOF'
import io, sys, tarfile
deb, dest = sys.argv[1:]
data = open(deb, "rb").read()
if data[:8] != b"!<arch>\n":
    raise SystemExit(f"SystemExit: {deb} is not a .deb")
pos = 8
while pos + 60 <= len(data):  # ar members: 60-byte header (name 16, ..., size at 48:58), body padded to even
    name, size = data[pos : pos + 16].decode().strip().rstrip("/"), int(data[pos + 48 : pos + 58])
    if name.startswith("data.tar"):
        with tarfile.open(fileobj=io.BytesIO(data[pos + 60 : pos + 60 + size])) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith("/libb64.so.0d"))
            with open(dest, "wb") as out:
                out.write(tar.extractfile(member).read())
        break
    pos += 60 + size + size % 2
else:
    raise SystemExit(f"SystemExit: no data.tar in {deb}")
EOF
}

pip_download "tritonclient==$TRITONCLIENT" ||
    fail "cannot download tritonclient $TRITONCLIENT from the package index$(indexes "$LOG"): $(reason "$LOG")"
set -- "$TMP"/wheels/tritonclient-"$TRITONCLIENT"-*.whl
unzip_member "$1" "tritonclient-$TRITONCLIENT.data/data/bin/perf_analyzer" "$TMP/perf_analyzer" ||
    fail "cannot take bin/perf_analyzer out of $(basename "$1"): $(reason "$LOG")"
rm -rf "$TMP/wheels"

pip_download "nvidia-cuda-runtime-cu12==$CUDART" ||
    fail "cannot download nvidia-cuda-runtime-cu12 $CUDART (libcudart.so.12) from the package" \
        "index$(indexes "$LOG"): $(reason "$LOG")"
set -- "$TMP"/wheels/nvidia_cuda_runtime_cu12-"$CUDART"-*.whl
unzip_member "$1" nvidia/cuda_runtime/lib/libcudart.so.12 "$TMP/libcudart.so.12" ||
    fail "cannot take libcudart.so.12 out of $(basename "$1"): $(reason "$LOG")"

DEB_URL=$LIBB64_DEB_URL
fetch_libb64_deb || fail "cannot download Debian's libb64-0d (libb64.so.0d) with apt-get download nor from $DEB_URL:" \
    "$(reason "$LOG")"
set -- "$TMP"/deb/libb64-0d*.deb
extract_libb64 "$1" "$TMP/libb64.so.0d" || fail "cannot take libb64.so.0d out of $(basename "$1"): $(reason "$LOG")"

place "$TMP/perf_analyzer" "$CACHE/bin/perf_analyzer" 755
place "$TMP/libcudart.so.12" "$CACHE/lib/libcudart.so.12" 644
place "$TMP/libb64.so.0d" "$CACHE/lib/libb64.so.0d" 644
link_cache
check_starts
printf '%s\n' "$PINS" >"$STAMP"
