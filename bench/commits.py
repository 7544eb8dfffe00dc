"""The same server command at two commits, interleaved: did a change cost the server anything?

    python -m bench.commits --base 803a616 --repeats 7 --out results/commits/noise -- \\
        --device cpu --model identity --image_size 16 --batch_size 1 --num_iters 2000 --load burst --no-ceiling

Each commit is checked out once into a scratch git worktree and run with this environment's python; the runs
alternate base, head, base, head... so that whatever the machine does meanwhile falls on both. Prints, and writes to
<out>/commits.md, each repeat's figure for both, then the A/B verdict (serverbench/schema/ab.py, as report.py --baseline
and bench.compare print it): repeat i of base and of head form a pair, and the verdict says "head is x % slower"
only when the ratio's 95 % interval is all on one side of 1; otherwise how many repeats would resolve the
difference seen. Run nothing else on the machine meanwhile. The commits, --out, --column and the server flags
(as this checkout's server.py takes them) are checked before anything runs; Ctrl-C or SIGTERM stops the run in
flight, removes the scratch worktrees and exits 130.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from bench.launch import check_server_flags, interruptible, run_server
from serverbench.config.flags import ConfigError, OneLineErrorParser, bounded
from serverbench.config.limits import AB_DEFAULT_REPEATS, MAX_REPEATS, MAX_SECONDS
from serverbench.config.paths import check_output_folder
from serverbench.records.comparison import better_when_higher, compare_rows
from serverbench.records.markdown import table_head
from serverbench.schema.columns import COLUMNS
from serverbench.system.process import one_line
from sweep import split_server_flags

ROOT = Path(__file__).resolve().parent.parent
PROG = "python -m bench.commits"
GIT_TIMEOUT_S = 300.0  # a worktree of this repository is checked out in seconds; a slow disk gets minutes
NOT_FIGURES = {"text", "bool", "path", "JSON", "CPU ids", "UTC ISO time"}  # units of columns that hold no number
EXIT_REFUSED = 2


def build_parser() -> OneLineErrorParser:
    parser = OneLineErrorParser(prog=PROG, description=__doc__.split("\n\n")[0], epilog="The server flags go after --.")
    parser.add_argument("--base", required=True, help="the commit before the change")
    parser.add_argument("--head", default="HEAD", help="the commit with the change (default HEAD)")
    parser.add_argument(
        "--repeats",
        type=bounded(int, 1, MAX_REPEATS),
        default=AB_DEFAULT_REPEATS,
        help=f"runs of each commit, interleaved, 1 to {MAX_REPEATS} (default {AB_DEFAULT_REPEATS})",
    )
    parser.add_argument(
        "--column",
        default="throughput",
        help="the row's figure to compare (default throughput: on the CPU divided by each run's machine-speed probe, "
        "the figure the A/B method was calibrated on; achieved_rate_rps stays raw)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "commits", help="rows and commits.md")
    parser.add_argument(
        "--timeout_s",
        type=bounded(float, 1.0, MAX_SECONDS),
        default=600.0,
        help=f"per server run, 1 to {MAX_SECONDS:g} (default 600)",
    )
    return parser


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Ctrl-C and SIGTERM held until the block is done, then delivered: git must not be stopped half-way through
    adding or removing a worktree of the user's repository, nor the clean-up half-way."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def git(*args: str) -> subprocess.CompletedProcess:
    """git in this checkout's repository, its output captured, within GIT_TIMEOUT_S."""
    with signals_held():  # the child inherits the held signals: a Ctrl-C to the process group waits for it too
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=GIT_TIMEOUT_S)


def resolve_commit(flag: str, given: str) -> str:
    """The full hash of the commit `given` names in this checkout's repository; ConfigError when it names none."""
    try:
        found = git("rev-parse", "--verify", "--quiet", "--end-of-options", f"{given}^{{commit}}")
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"{flag} {given}: git could not be asked ({one_line(exc)})") from None
    if found.returncode != 0:
        raise ConfigError(f"{flag} {given}: no such commit in the repository of {ROOT}")
    return found.stdout.strip()


def check_column(name: str) -> None:
    """--column: a column of server.py's row that holds a figure; ConfigError otherwise."""
    column = next((c for c in COLUMNS if c.name == name), None)
    if column is None:
        raise ConfigError(
            f"--column {name}: not a column of server.py's row; e.g. achieved_rate_rps, throughput, p99_latency_s "
            "(docs/columns.md)"
        )
    if column.unit in NOT_FIGURES:
        raise ConfigError(f"--column {name}: {column.unit}, not a figure to compare")
    if better_when_higher(name) is None:
        raise ConfigError(
            f"--column {name}: {column.unit}, neither a rate nor a time, so neither commit is slower; "
            "e.g. achieved_rate_rps, throughput, p99_latency_s"
        )


@dataclass(frozen=True)
class Checked:
    out: Path
    commits: dict[str, str]  # base, head -> full hash


def check_arguments(args: argparse.Namespace, flags: Sequence[str]) -> Checked:
    """Every argument before any worktree, folder or run: ConfigError with the line to print."""
    out = check_output_folder("--out", args.out)
    check_column(args.column)
    commits = {"base": resolve_commit("--base", args.base), "head": resolve_commit("--head", args.head)}
    if not flags:
        raise ConfigError("give the server.py flags after --, e.g. -- --device cpu --model identity --num_iters 2000")
    check_server_flags([flags])
    return Checked(out.resolve(), commits)


class Worktrees:
    """Scratch worktrees of the commits, in a temporary folder; all removed, and unregistered from the repository,
    when the block ends, however it ends."""

    def __init__(self, scratch: Path) -> None:
        self.scratch = scratch
        self.folders: list[Path] = []

    def add(self, name: str, commit: str) -> Path:
        folder = self.scratch / name
        self.folders.append(folder)  # before git makes it: a failed add is cleaned up too
        made = git("worktree", "add", "--detach", str(folder), commit)
        if made.returncode != 0:
            raise WorktreeError(f"git worktree add {commit[:12]}: {one_line(made.stderr) or made.returncode}")
        return folder


class WorktreeError(RuntimeError):
    """git could not check a commit out (a full disk, a broken repository); the message is one line."""


@contextlib.contextmanager
def scratch_worktrees() -> Iterator[Worktrees]:
    trees = Worktrees(Path(tempfile.mkdtemp(prefix="bench-commits-")))
    try:
        yield trees
    finally:
        with signals_held():
            for folder in trees.folders:
                with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                    git("worktree", "remove", "--force", str(folder))
            shutil.rmtree(trees.scratch, ignore_errors=True)


def _new_row(path: Path, rows_before: int, column: str) -> pd.Series | None:
    """The row a run appended to `path`; None when it wrote none, failed, or left the column empty."""
    try:
        rows = pd.read_csv(path) if path.exists() else pd.DataFrame()
    except (OSError, ValueError):  # a row cut by a crash: no figure
        return None
    if len(rows) <= rows_before or column not in rows:
        return None
    row = rows.iloc[-1]
    if row.get("status", "ok") != "ok":
        return None
    value = pd.to_numeric(pd.Series([row[column]]), errors="coerce").iloc[0]
    return None if pd.isna(value) else row


def _figure(row: pd.Series | None, column: str) -> float | None:
    return None if row is None else float(row[column])


def _rows_in(path: Path) -> int:
    try:
        return len(pd.read_csv(path)) if path.exists() else 0
    except (OSError, ValueError):
        return 0


def run_interleaved(args: argparse.Namespace, flags: Sequence[str], checked: Checked) -> int:
    """The runs, base and head in turn; then the table. Exit status 0 when every run gave its figure."""
    figures: dict[str, list[pd.Series | None]] = {"base": [], "head": []}
    failed: list[str] = []
    with scratch_worktrees() as trees:
        try:
            checkouts = {name: trees.add(name, commit) for name, commit in checked.commits.items()}
        except (WorktreeError, OSError, subprocess.TimeoutExpired) as exc:
            print(f"{PROG}: error: {one_line(exc)}", file=sys.stderr)
            return 1
        for repeat in range(args.repeats):
            for name, checkout in checkouts.items():
                path = checked.out / f"{name}.csv"
                before = _rows_in(path)
                ran = run_server(
                    flags, checked.out, path.name, checkout=checkout, timeout_s=args.timeout_s, capture_output=True
                )
                code = f"exit {ran.returncode}" + (f", timed out after {args.timeout_s:g} s" if ran.timed_out else "")
                print(f"repeat {repeat} {name}: {code}", file=sys.stderr, flush=True)
                if ran.returncode == EXIT_REFUSED:  # every other run of this commit would be refused the same way
                    said = ran.stderr.strip().splitlines()
                    where = f"{name} ({checked.commits[name][:12]})"
                    print(f"{PROG}: error: server.py at {where} refused the flags: {said[-1] if said else '?'}",
                          file=sys.stderr)  # fmt: skip
                    return EXIT_REFUSED
                figures[name].append(_new_row(path, before, args.column))
                if ran.returncode != 0 or ran.timed_out or figures[name][-1] is None:
                    failed.append(f"repeat {repeat} {name} ({code})")
    lines = table(args, flags, checked, figures, failed)
    (checked.out / "commits.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if not failed else 1


def table(
    args: argparse.Namespace,
    flags: Sequence[str],
    checked: Checked,
    figures: dict[str, list[pd.Series | None]],
    failed: list[str],
) -> list[str]:
    """Each repeat's figures (a run without its figure: failed), the A/B verdict over the repeats both ran (pairs
    by repeat: serverbench/schema/ab.py), and the runs that failed."""
    pairs = list(zip(figures["base"], figures["head"]))

    def shown(row: pd.Series | None) -> str:
        return "failed" if row is None else f"{_figure(row, args.column):,.4g}"

    rows = [f"| {i} | {shown(b)} | {shown(h)} |" for i, (b, h) in enumerate(pairs)]
    base, head = (
        f"{given} ({checked.commits[name][:12]})" for name, given in (("base", args.base), ("head", args.head))
    )
    by_side = {
        name: pd.DataFrame([{**row.to_dict(), "repeat": i} for i, row in enumerate(side) if row is not None])
        for name, side in figures.items()
    }
    found = (
        compare_rows(by_side["base"], by_side["head"], args.column, base, head)
        if all(not frame.empty for frame in by_side.values())
        else None
    )
    return [
        f"# {args.column}: {head} against {base}, {args.repeats} interleaved repeats",
        "",
        f"    {PROG} --base {args.base} --head {args.head} --repeats {args.repeats} "
        f"--column {args.column} -- " + shlex.join(flags),
        "",
        *table_head(["repeat", "base", "head"]),
        *rows,
        "",
        found.text if found is not None else "no verdict: fewer than 2 repeats where both runs gave their figure",
        *([f"failed: {', '.join(failed)}"] if failed else []),
    ]


def main(argv: Sequence[str] | None = None) -> int:
    argv, flags = split_server_flags(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        checked = check_arguments(args, flags)
    except ConfigError as exc:
        parser.error(str(exc))
    checked.out.mkdir(parents=True, exist_ok=True)
    for name in ("base", "head"):  # this invocation's rows only
        (checked.out / f"{name}.csv").unlink(missing_ok=True)
    kept = f"; its scratch worktrees removed, the rows so far in {checked.out}"
    return interruptible(PROG, lambda: run_interleaved(args, flags, checked), kept)


if __name__ == "__main__":
    sys.exit(main())
