"""The one check of every path a command is given, before any work: an output folder that can be made and written
(not a file, not under a file, not on a kernel filesystem, names within the filesystem's limits), an input that is
there and of the right kind. Each refusal is a ConfigError of one line: the argument, what is wrong, what would
work. Nothing here creates anything: a refused command leaves no folder behind.

Every command calls it: server.py (through preflight), sweep.py, report.py and the bench tools.
"""

from __future__ import annotations

import argparse
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from serverbench.config.flags import ConfigError

NAME_MAX_BYTES = 255  # a file name's limit on Linux filesystems, where pathconf cannot tell
PATH_MAX_BYTES = 4096
MAX_OUTPUT_FILE_BYTES = 96  # --output_file: room for the side files named after it (.lock, .continued, .unwritten-RUN)
MAX_EXPERIMENT_CHARS = 96  # --experiment: it names detail files (with the time, batch, repeat and pid) and logs


def name_max_bytes(folder: Path) -> int:
    """The longest file name the filesystem of `folder` (or of its nearest existing parent) takes."""
    try:
        return os.pathconf(_nearest_existing(folder), "PC_NAME_MAX")
    except (OSError, ValueError):
        return NAME_MAX_BYTES


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _is_kernel_filesystem(folder: Path) -> bool:
    """A filesystem with no blocks at all (/proc, /sys): nothing can be written there."""
    try:
        return os.statvfs(folder).f_blocks == 0
    except OSError:
        return False


def check_path_names(flag: str, text: str, what: str = "a folder") -> Path:
    """`text` as an absolute path once its length and each of its names are within the filesystem's limits (the
    system refuses to look a longer one up at all); ConfigError otherwise (`what` it should name, when empty)."""
    if not text:
        raise ConfigError(f"{flag} '': give {what}")
    folder = Path(text).expanduser().absolute()
    if len(os.fsencode(str(folder))) >= PATH_MAX_BYTES:
        raise ConfigError(f"{flag} {text[:60]}...: a path of {len(str(folder))} characters; give a shorter one")
    longest = name_max_bytes(folder)
    for part in folder.parts:
        if len(os.fsencode(part)) > longest:
            raise ConfigError(
                f"{flag} {text[:60]}...: the name {part[:40]}... has {len(os.fsencode(part))} bytes, more than "
                f"the {longest} a file name may have here; give a shorter one"
            )
    return folder


def check_output_folder(flag: str, given: str | os.PathLike) -> Path:
    """The folder `given` for `flag` as an absolute path, once it is sure that it can be made (if need be) and
    written; ConfigError otherwise. Creates nothing."""
    text = os.fspath(given)
    folder = check_path_names(flag, text)
    existing = _nearest_existing(folder)
    if not existing.is_dir():
        what = "" if existing == folder else f" {existing} is"
        raise ConfigError(f"{flag} {text}:{what} a file, not a folder; give a folder (or a path to make one)")
    if _is_kernel_filesystem(existing):
        raise ConfigError(f"{flag} {text}: {existing} is on a kernel filesystem (/proc, /sys); give a folder on a disk")
    # The kernel's own answer for this user (root passes permissions, but not a read-only filesystem).
    if not os.access(existing, os.W_OK | os.X_OK):
        why = "cannot be entered or written" if existing != folder else "is not writable"
        raise ConfigError(
            f"{flag} {text}: {existing} {why} by this user; give a folder you can write, or change its permissions"
        )
    return folder


def check_file_name(flag: str, name: str, most_bytes: int) -> None:
    """A name the command makes files from (with suffixes of its own): at most `most_bytes`, so that every file
    named after it fits the filesystem's limit."""
    size = len(name.encode(errors="surrogateescape"))
    if size > most_bytes:
        raise ConfigError(
            f"{flag} {name[:40]}...: {size} bytes long; at most {most_bytes}, so that the files named after it fit "
            f"the filesystem's {NAME_MAX_BYTES}-byte limit on a name"
        )


def check_input_file(flag: str, given: str | os.PathLike) -> Path:
    """A file the command reads, there and regular (a folder, a pipe or a device is named as what it is: a pipe
    would block the read); ConfigError otherwise."""
    path = check_path_names(flag, os.fspath(given), "a file")
    if not path.is_file():
        state = "a folder, not a file" if path.is_dir() else "not a regular file (a pipe, a device?)"
        raise ConfigError(f"{flag} {given}: {state if path.exists() else 'no such file'}")
    return path


def check_input_folder(flag: str, given: str | os.PathLike, what: str) -> Path:
    """A folder the command reads (`what`: what it should hold, for the message); ConfigError when it is not one."""
    path = Path(given).expanduser()
    if not path.is_dir():
        state = "a file, not a folder" if path.exists() else "no such folder"
        raise ConfigError(f"{flag} {given}: {state}; give the folder that holds {what}")
    return path


def check_executable(flag: str, given: str) -> str:
    """A program to run: a path to an executable file, or a name found on PATH."""
    found = shutil.which(given)
    if found is None:
        state = "not executable" if Path(given).is_file() else "no such program"
        raise ConfigError(f"{flag} {given}: {state}; give the path of a Python interpreter")
    return found


def check_bench_out(out: Path, report_only: bool, tool: str, needed: str | None = None) -> Path:
    """A bench tool's --out, before any run: with --report_only, a folder that holds an earlier run's rows (and the
    file `needed`, when named); always one that can be made and written. ConfigError otherwise."""
    if report_only:
        check_input_folder("--out", out, f"the rows of an earlier {tool} run")
        if needed is not None and not (Path(out) / needed).is_file():
            raise ConfigError(f"--out {out}: holds no {needed}; measure first")
    return check_output_folder("--out", out)


def parse_bench_args(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None, tool: str, needed: str | None = None
) -> argparse.Namespace:
    """A bench tool's command line, its --out checked before any run (check_bench_out); a refusal is the parser's
    one line and exit 2."""
    args = parser.parse_args(argv)
    try:
        check_bench_out(args.out, args.report_only, tool, needed)
    except ConfigError as exc:
        parser.error(str(exc))
    return args
