"""Where a run's child processes put their temporary files: a folder of the run's own, removed once they have ended,
however they ended. Every child leaves with os._exit (or is killed), which skips the destructors and exit handlers
that would remove what it made under TMPDIR: an AOTInductor package's extracted copy (its shared library and
weights: tens to hundreds of MB per process that loaded one), multiprocessing's folders for passing descriptors."""

from __future__ import annotations

import contextlib
import getpass
import os
import re
import shutil
import tempfile
from collections.abc import Iterator

INDUCTOR_CACHE_VARIABLE = "TORCHINDUCTOR_CACHE_DIR"


def inductor_cache_dir() -> str:
    """The inductor cache the children use: TORCHINDUCTOR_CACHE_DIR when set, else torch's default under the
    temporary folder (torch._inductor.runtime.cache_dir_utils.default_cache_dir, which this process cannot call: the
    server never imports torch). Pinned for the children, since their TMPDIR is the run's folder: a cache under it
    would be thrown away with it, and every --compile run would compile from nothing."""
    given = os.environ.get(INDUCTOR_CACHE_VARIABLE)
    if given:
        return os.path.abspath(given)
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))


@contextlib.contextmanager
def children_temp_folder() -> Iterator[dict[str, str]]:
    """A folder made for the children of one run (or one check), under this process's temporary folder; yields the
    environment they take (TMPDIR there, the inductor cache where it always is), and removes the folder with all
    it holds at the end. Leave the block only once every child has ended."""
    # A short name: multiprocessing puts unix sockets in folders under it, whose paths have at most 107 bytes.
    folder = tempfile.mkdtemp(prefix="sb-run-")
    try:
        yield {"TMPDIR": folder, INDUCTOR_CACHE_VARIABLE: inductor_cache_dir()}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def take_environment(environment: dict[str, str]) -> None:
    """A child's first step: the environment its server chose for it (children_temp_folder's), before it imports
    anything that reads it; tempfile's cached folder forgotten, so that it is read again from TMPDIR."""
    os.environ.update(environment)
    tempfile.tempdir = None
