"""The same server command at two commits, interleaved: did a change cost the server anything?

    python -m bench.commits --base 803a616 --repeats 7 --out results/commits/noise -- \\
        --device cpu --model identity --image_size 16 --batch_size 1 --num_iters 2000 --load burst --no-ceiling

Each commit is checked out once into a scratch git worktree and run with this environment's python; the runs
alternate base, head, base, head... so that whatever the machine does meanwhile falls on both. Prints, and writes to
<out>/commits.md, each repeat's figure for both and their ratio (head over base), then the median ratio and the range
of the repeats' ratios. Run nothing else on the machine meanwhile.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from bench.launch import run_server

ROOT = Path(__file__).resolve().parent.parent


def worktree(commit: str, folder: Path) -> Path:
    """`commit` checked out (detached) into `folder`, made once per invocation."""
    subprocess.run(["git", "worktree", "add", "--detach", str(folder), commit], cwd=ROOT, check=True,
                   capture_output=True, timeout=120)  # fmt: skip
    return folder


def _figures(path: Path, column: str) -> list[float | None]:
    """Each run's figure in file order, None for a run that failed or left the column empty."""
    if not path.exists():
        return []
    rows = pd.read_csv(path)
    if column not in rows:
        return [None] * len(rows)
    ok = rows["status"] == "ok" if "status" in rows else pd.Series(True, index=rows.index)
    return [float(v) if good and pd.notna(v) else None for v, good in zip(rows[column], ok)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.commits", description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the commit before the change")
    parser.add_argument("--head", default="HEAD", help="the commit with the change (default HEAD)")
    parser.add_argument("--repeats", type=int, default=7, help="runs of each commit, interleaved (default 7)")
    parser.add_argument("--column", default="achieved_rate_rps", help="the row's figure to compare")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "commits", help="rows and commits.md")
    parser.add_argument("--timeout_s", type=float, default=600.0, help="per server run (default 600)")
    parser.add_argument("server_flags", nargs=argparse.REMAINDER, help="after --: the server.py flags")
    args = parser.parse_args(argv)
    flags = [flag for flag in args.server_flags if flag != "--"]
    if args.repeats < 1 or not flags:
        parser.error("give --repeats >= 1 and the server flags after --")
    args.out = args.out.resolve()  # the runs start in their worktrees
    args.out.mkdir(parents=True, exist_ok=True)
    for name in ("base", "head"):  # this invocation's rows only: a repeat that wrote none must not pair an old one
        (args.out / f"{name}.csv").unlink(missing_ok=True)
    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-commits-") as scratch:
        checkouts: dict[str, Path] = {}
        try:
            for name, commit in (("base", args.base), ("head", args.head)):
                checkouts[name] = worktree(commit, Path(scratch) / name)
            for repeat in range(args.repeats):
                for name, checkout in checkouts.items():
                    ran = run_server(
                        flags, args.out, f"{name}.csv", checkout=checkout, timeout_s=args.timeout_s, capture_output=True
                    )
                    timed_out = f", timed out after {args.timeout_s:g} s" if ran.timed_out else ""
                    code = f"exit {ran.returncode}{timed_out}"
                    print(f"repeat {repeat} {name}: {code}", file=sys.stderr)
                    if ran.returncode != 0 or ran.timed_out:
                        failed.append(f"repeat {repeat} {name} ({code})")
        finally:
            for checkout in checkouts.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(checkout)], cwd=ROOT,
                               capture_output=True, timeout=120)  # fmt: skip
    figures = {name: _figures(args.out / f"{name}.csv", args.column) for name in ("base", "head")}
    # Pairs by repeat; a repeat whose run failed, or whose figure is empty, has no ratio.
    pairs = list(zip(figures["base"], figures["head"]))
    ratios = [h / b for b, h in pairs if b is not None and h is not None and b > 0]
    lines = [
        f"# {args.column}: {args.head} against {args.base}, {args.repeats} interleaved repeats",
        "",
        f"    python -m bench.commits --base {args.base} --head {args.head} --repeats {args.repeats} "
        f"--column {args.column} -- " + shlex.join(flags),
        "",
        "| repeat | base | head | head / base |",
        "| --- | --- | --- | --- |",
        *(
            f"| {i} | {b:,.4g} | {h:,.4g} | {h / b:.3f} |"
            for i, (b, h) in enumerate(zip(figures["base"], figures["head"]))
        ),
        "",
        f"median ratio {statistics.median(ratios):.3f}, repeats {min(ratios):.3f} to {max(ratios):.3f}"
        if ratios
        else "no ratio: a run failed (see the CSVs)",
        *([f"failed: {', '.join(failed)}"] if failed else []),
    ]
    (args.out / "commits.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if ratios and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
