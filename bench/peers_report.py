"""bench.peers' report from its rows: per model, every peer's requests/s, p50 and p99 under each load and client
(medians over repeats, min-max), our generator's capacity beside them (a figure above half of it is marked
generator-bound), perf_analyzer's figures against ours for the same peer and load, the door's own time per request,
the targets with their verdicts, every failure (runs and served peers); and the latency-throughput plot, one curve
per peer (our generator's runs)."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from pathlib import Path

import pandas as pd

from bench.door_stats import DOOR_STAGES
from serverbench.config.loads import CLOSED, POISSON
from serverbench.launch.study import read_csv
from serverbench.load.noise import LATE_SENDER_WARN_FRACTION
from serverbench.records.markdown import figure, table, table_head, table_row
from serverbench.records.plots import pyplot, save_figure

PLOT_PNG = "latency_throughput.png"
OURS_CSV = "ours.csv"  # our generator's own rows
SERVED_CSV = "served.csv"  # our --serve_only servers' own rows: the door's records of every request
SERVERS_CSV = "servers.csv"  # a line per served peer: did it start and stop cleanly
BOUND_SHARE = 0.5  # a client figure above this share of its capacity may be the client's limit, not the server's
AGREE_WITHIN = 0.10  # perf_analyzer's and our figures for the same peer and load (throughput and p99)
PA_LATE_PCT = 1.0  # perf_analyzer's requests sent behind a Poisson schedule, in % of them, before it is marked late
P99_BUDGET_S = 0.100  # resnet18's target: the peak rate within this p99
P99_PAIR_RATIO = (0.9, 1.1)  # our door's p99 as our generator and as perf_analyzer measure it, at these concurrencies
P99_PAIR_CONCURRENCIES = (1, 4)
NOT_COMPARABLE = """## What is not comparable

- KServe has no dynamic batcher in its Python server (batching is a separate agent in a Kubernetes deployment): it
  runs one forward per request; and no Triton `/config` or `/stats`, so perf_analyzer cannot drive it.
- PyTriton runs the model in a Python process of its own behind Triton's C++ front end: every request crosses a
  shared-memory hop to the callable and back ("compute infer" in perf_analyzer's server figures).
- Our server's dynamic batching (`--max_batch_size`, `--max_queue_delay_ms`) and Triton's (`max_batch_size`,
  `max_queue_delay_microseconds`) are given the same rows and delay; their policies differ in detail (ours forms a
  batch when it is full or the oldest request has waited the delay).
- perf_analyzer's latency is its client library's blocking call (synchronous: a thread and a client per request in
  flight, the request built inside the call); ours counts from our sender thread's start of a request to our network
  thread's parsed answer: one hand-off between Python threads more, on the cores the server uses too. Over gRPC
  perf_analyzer shares one channel among all its clients (TRITON_CLIENT_GRPC_CHANNEL_MAX_SHARE_COUNT in
  `grpc_channel_share`), as ours sends every request on one.
- The door's figures (ours and Triton's statistics, read before and after every run) are per request: `door whole`
  from arrival to the answer written (Triton's `success`), queue to the formed batch, compute input / infer / output
  (H2D, predict, D2H); our warm-up requests included.
- The capacity beside our figures is our generator against a bare echo endpoint; perf_analyzer's own capacity is
  not measured (the echo has no Triton /config).
- Our door against the echo: our generator asks our door for the backend's stamps (a small JSON parameter each way)
  and not the echo; identity answers a per-sample sum, the echo every byte it got. Against shm: the same server and
  generator code, its frontend process handing requests over the shm ring instead of a socket and a door.
"""


def ok_runs(runs: pd.DataFrame) -> pd.DataFrame:
    return runs[runs["ok"].astype(str) == "True"] if len(runs) else runs


def level_of(row: pd.Series) -> str:
    """The load a run shares with the other clients' and repeats': a closed loop's concurrency, a Poisson run's
    fraction of the peer's closed-loop peak (each repeat asks its own peak's fraction; a runs.csv without fractions
    falls back to the asked rate)."""
    if row["load"] == CLOSED.name:
        return f"closed c{int(row['concurrency'])}"
    fraction = row.get("rate_fraction")
    if fraction is not None and pd.notna(fraction):
        return f"poisson {float(fraction):.0%}"
    return f"poisson {float(row['rate_rps']):,.0f}/s"


def pa_late(runs: pd.DataFrame) -> pd.Series:
    """perf_analyzer's runs that sent more than PA_LATE_PCT % of their requests behind the schedule."""
    if "pa_delayed_pct" not in runs:
        return pd.Series(False, index=runs.index)
    return (runs["client"] == "perf_analyzer") & (runs["pa_delayed_pct"].astype(float) > PA_LATE_PCT)


def capacities(runs: pd.DataFrame) -> dict[tuple[str, str, str, str, int | None], float]:
    """Our generator's median requests/s against the echo: per model, protocol and wire, closed at each concurrency
    ((model, protocol, wire, "closed", c)) and on a Poisson schedule ((..., "poisson", None): what it achieved when
    asked for more)."""
    echo = ok_runs(runs[runs["kind"] == "echo"])
    found: dict[tuple[str, str, str, str, int | None], float] = {}
    by = ["model", "protocol", "wire", "load", echo["concurrency"].fillna(-1)]
    for (model, protocol, wire, load, concurrency), group in echo.groupby(by):
        key = (model, protocol, wire, load, int(concurrency) if load == CLOSED.name else None)
        found[key] = float(group["throughput_rps"].median())
    return found


def with_capacity(runs: pd.DataFrame) -> pd.DataFrame:
    """Our runs with our generator's capacity under the same load (closed: at the same concurrency) and whether
    the run asked for more than half of it: for a closed loop its achieved rate, for Poisson its asked rate."""
    found = capacities(runs)

    def capacity(row: pd.Series) -> float | None:
        if row["client"] != "ours" or row["kind"] in ("echo", "shm"):
            return None
        if row["load"] == CLOSED.name:
            return found.get((row["model"], row["protocol"], row["wire"], CLOSED.name, int(row["concurrency"])))
        return found.get((row["model"], row["protocol"], row["wire"], POISSON.name, None))

    runs = runs.copy()
    runs["capacity_rps"] = runs.apply(capacity, axis=1) if len(runs) else []
    demand = runs["throughput_rps"].where(runs["load"] == CLOSED.name, runs["rate_rps"]).astype(float)
    share = demand / runs["capacity_rps"].astype(float)
    # An unmeasured capacity (a failed echo run) clears nothing: such a run of ours counts as bound. A run over shm
    # has its generator inside the server: no echo measures it.
    ours = (runs["client"] == "ours") & ~runs["kind"].isin(["echo", "shm"])
    runs["generator_bound"] = ours & ~(share <= BOUND_SHARE)
    return runs


def with_lateness(runs: pd.DataFrame, ours: pd.DataFrame) -> pd.DataFrame:
    """Our runs with their sender's lateness from their rows (ours.csv, by run_id) and whether it was late by a
    visible part of the latency (server.py's own warning: p99 lateness above LATE_SENDER_WARN_FRACTION of the p50
    latency): our generator did not keep the schedule, so its latency holds its own delay."""
    if ours.empty or "sender_late_p99_ms" not in ours:
        return runs.assign(sender_late_p99_ms=float("nan"), sender_late=False)
    late = ours.set_index("run_id")["sender_late_p99_ms"]
    runs = runs.assign(sender_late_p99_ms=runs["detail"].map(late).astype(float))
    limit_ms = LATE_SENDER_WARN_FRACTION * runs["p50_latency_s"].astype(float) * 1e3
    return runs.assign(sender_late=(runs["client"] == "ours") & (runs["sender_late_p99_ms"] > limit_ms))


MODEL_TABLE_FIGURES = (
    *("ours req/s", "ours p50 ms", "ours p99 ms", "capacity req/s", "pa req/s", "pa p50 ms", "pa p99 ms"),
    *("ours/pa req/s", "ours/pa p99"),
)


def model_table(runs: pd.DataFrame, model: str) -> list[str]:
    """One line per peer and load: both clients' figures and their ratio."""
    lines = [
        f"### {model}",
        "",
        *table_head(["peer", "load", *MODEL_TABLE_FIGURES], right=len(MODEL_TABLE_FIGURES)),
    ]
    served = ok_runs(runs[(runs["model"] == model) & (runs["kind"] != "echo")])
    if served.empty:
        return [*lines, "", "(no run succeeded)", ""]
    served = served.assign(level=served.apply(level_of, axis=1))
    order = served.sort_values(["peer", "load", "concurrency", "rate_rps"])[["peer", "level"]].drop_duplicates()
    for peer, level in order.itertuples(index=False):
        group = served[(served["peer"] == peer) & (served["level"] == level)]
        ours, theirs = group[group["client"] == "ours"], group[group["client"] == "perf_analyzer"]
        bound = " (generator-bound)" if ours["generator_bound"].any() else ""
        bound += " (sender late)" if ours["sender_late"].any() else ""
        late = f" (late {theirs['pa_delayed_pct'].max():.0f} %)" if pa_late(theirs).any() else ""
        shown = level + (f" ({group['rate_rps'].median():,.0f}/s)" if level.endswith("%") else "")
        cells = [peer, shown, spread(ours["throughput_rps"]) + bound, spread(ours["p50_latency_s"], 1e3, 2)]
        cells += [spread(ours["p99_latency_s"], 1e3, 2), spread(ours["capacity_rps"])]
        cells += [spread(theirs["throughput_rps"]) + late, spread(theirs["p50_latency_s"], 1e3, 2)]
        cells += [spread(theirs["p99_latency_s"], 1e3, 2)]
        cells += [figure(ratio_of(ours, theirs, column), ".2f") for column in ("throughput_rps", "p99_latency_s")]
        lines.append(table_row(cells))
    return [*lines, ""]


def ratio_of(ours: pd.DataFrame, theirs: pd.DataFrame, column: str) -> float | None:
    mine, other = ours[column].dropna().astype(float), theirs[column].dropna().astype(float)
    if mine.empty or other.empty or other.median() <= 0:
        return None
    return float(mine.median() / other.median())


CLIENT_NAMES = {"ours": "our generator", "perf_analyzer": "perf_analyzer"}


def best_of(
    runs: pd.DataFrame, model: str, kinds: Sequence[str], client: str, batching: bool | None = None
) -> pd.DataFrame:
    found = ok_runs(runs[(runs["model"] == model) & runs["kind"].isin(kinds) & (runs["client"] == client)])
    if batching is not None:
        found = found[found["batching"].astype(str) == str(batching)]
    return found


def target_lines(runs: pd.DataFrame) -> list[str]:
    """The issue's targets, each with what was measured and a verdict, as each client measured it."""
    lines = ["## Targets", ""]
    lines += [line for client in CLIENT_NAMES for line in _identity_target(runs, client)]
    lines += [line for client in CLIENT_NAMES for line in _resnet_target(runs, client)]
    lines += _agreement_target(runs)
    return [*lines, ""]


def _identity_target(runs: pd.DataFrame, client: str) -> list[str]:
    def at_c4(kind: str) -> pd.DataFrame:
        found = best_of(runs, "identity", [kind], client)
        return found[(found["load"] == CLOSED.name) & (found["concurrency"].astype(float) == 4)]

    ours, triton = at_c4("ours"), at_c4("pytriton")
    head = f"- identity, concurrency 4, {CLIENT_NAMES[client]}:"
    if ours.empty or triton.empty:
        return [f"{head} not measured (ours or PyTriton missing)"]
    by_peer = ours.groupby("peer")[["throughput_rps", "p99_latency_s"]].median()
    best = by_peer["throughput_rps"].idxmax()
    rps, p99 = by_peer.loc[best, "throughput_rps"], by_peer.loc[best, "p99_latency_s"]
    t_rps, t_p99 = triton["throughput_rps"].median(), triton["p99_latency_s"].median()
    met = rps >= t_rps and p99 <= t_p99
    bound = " (generator-bound: a lower bound)" if ours[ours["peer"] == best]["generator_bound"].any() else ""
    return [
        f"{head} fastest of ours, {best}, {rps:,.0f} req/s{bound} at p99 {p99 * 1e3:.2f} ms; PyTriton "
        f"{t_rps:,.0f} req/s at p99 {t_p99 * 1e3:.2f} ms (ours/PyTriton: {rps / t_rps:.2f} req/s, "
        f"{p99 / t_p99:.2f} p99). Target: at least as many req/s at no higher p99: **{'met' if met else 'not met'}**"
    ]


def peak_within(runs: pd.DataFrame, budget_s: float) -> pd.Series:
    """Per peer: the highest median req/s of a load whose median p99 is within the budget."""
    runs = runs.assign(level=runs.apply(level_of, axis=1)) if len(runs) else runs.assign(level=[])
    medians = runs.groupby(["peer", "level"])[["throughput_rps", "p99_latency_s"]].median()
    within = medians[medians["p99_latency_s"] <= budget_s]
    return within.groupby(level="peer")["throughput_rps"].max()


def _resnet_target(runs: pd.DataFrame, client: str) -> list[str]:
    ours = peak_within(best_of(runs, "resnet18", ["ours"], client, batching=True), P99_BUDGET_S)
    triton = peak_within(best_of(runs, "resnet18", ["pytriton"], client), P99_BUDGET_S)
    kserve = peak_within(best_of(runs, "resnet18", ["kserve"], client), P99_BUDGET_S)
    head = f"- resnet18, dynamic batching, peak req/s within a 100 ms p99 ({CLIENT_NAMES[client]}, closed and Poisson):"
    if ours.empty or triton.empty:
        return [f"{head} not measured (ours or PyTriton missing)"]
    best = ours.idxmax()
    met = ours.max() >= triton.max()
    others = f"; KServe (no batcher) {kserve.max():,.0f}" if not kserve.empty else ""
    return [
        f"{head} best of ours, {best}, {ours.max():,.0f}; PyTriton {triton.max():,.0f}{others} (ours/PyTriton "
        f"{ours.max() / triton.max():.2f}). Target: at least PyTriton's: **{'met' if met else 'not met'}**"
    ]


def agreement(runs: pd.DataFrame) -> pd.DataFrame:
    """Per model, peer and load measured by both clients: ours over perf_analyzer's median throughput and p99, and
    whether our figure is generator-bound."""
    served = ok_runs(runs[(runs["kind"] != "echo")])
    if served.empty:
        return pd.DataFrame()
    served = served.assign(level=served.apply(level_of, axis=1))
    found = []
    for (model, peer, level), group in served.groupby(["model", "peer", "level"]):
        ours, theirs = group[group["client"] == "ours"], group[group["client"] == "perf_analyzer"]
        if ours.empty or theirs.empty:
            continue
        found.append(
            {
                "model": model,
                "peer": peer,
                "kind": group["kind"].iloc[0],
                "protocol": group["protocol"].iloc[0],
                "level": level,
                "throughput": ratio_of(ours, theirs, "throughput_rps"),
                "p99": ratio_of(ours, theirs, "p99_latency_s"),
                "bound": bool(ours["generator_bound"].any()),
                "late": bool(ours["sender_late"].any() or pa_late(theirs).any()),
            }
        )
    return pd.DataFrame(found)


def _agreement_target(runs: pd.DataFrame) -> list[str]:
    found = agreement(runs)
    if found.empty:
        return ["- perf_analyzer against our generator: no load measured by both"]
    free = found[~found["bound"]]
    within = (free["throughput"] - 1).abs().le(AGREE_WITHIN) & (free["p99"] - 1).abs().le(AGREE_WITHIN)
    lines = [
        f"- perf_analyzer and our generator, same peer and load, where ours is not generator-bound: "
        f"{int(within.sum())} of {len(free)} agree within 10 % on both req/s and p99 "
        f"({len(found) - len(free)} generator-bound left out). Target: all: "
        f"**{'met' if len(free) and within.all() else 'not met'}**"
    ]
    kept = free[~free["late"]]
    kept_within = (kept["throughput"] - 1).abs().le(AGREE_WITHIN) & (kept["p99"] - 1).abs().le(AGREE_WITHIN)
    lines.append(
        f"  - of those, where both clients also kept their schedule (our sender's p99 lateness within "
        f"{LATE_SENDER_WARN_FRACTION:.0%} of the p50 latency, perf_analyzer's requests delayed at most "
        f"{PA_LATE_PCT:g} %): {int(kept_within.sum())} of {len(kept)} agree"
    )
    for model, group in free.assign(within=within).groupby("model"):
        p99 = group["p99"].dropna()
        lines.append(
            f"  - {model}: {int(group['within'].sum())} of {len(group)} agree; ours/perf_analyzer p99 median "
            f"{p99.median():.2f} (min {p99.min():.2f}, max {p99.max():.2f}), req/s median "
            f"{group['throughput'].median():.2f} (min {group['throughput'].min():.2f})"
        )
    # At low concurrency the two clients' own time is most of a request's: our door's p99 as each measures it
    door = found[(found["kind"] == "ours") & found["level"].isin([f"closed c{c}" for c in P99_PAIR_CONCURRENCIES])]
    for protocol, group in door.groupby("protocol"):
        met = group["p99"].between(*P99_PAIR_RATIO)
        lines.append(
            f"- our door over {protocol.upper()} at concurrency 1 and 4: our p99 / perf_analyzer's "
            f"{spread(list(group['p99'].dropna()), digits=2)} over {len(group)} design(s) and load(s); within "
            f"{P99_PAIR_RATIO[0]:g}-{P99_PAIR_RATIO[1]:g}: {int(met.sum())} of {len(group)}. Target: all: "
            f"**{'met' if met.all() else 'not met'}**"
        )
    return lines


def door_cost_table(runs: pd.DataFrame) -> list[str]:
    """What our door costs, closed loops, our generator (medians over repeats): each door's requests/s over the
    echo's of its protocol and wire (the least a Python server on that framework costs), and over shm's, the same
    server without a door (same design and batching), with the p50 it adds to shm's."""
    closed = ok_runs(runs[(runs["client"] == "ours") & (runs["load"] == CLOSED.name)])
    by = ["model", "batch_size", "kind", "peer", "design", "batching", "protocol", "wire", "concurrency"]
    medians = closed.groupby(by)[["throughput_rps", "p50_latency_s"]].median().reset_index()
    doors = medians[medians["kind"] == "ours"]
    found = []
    for door in doors.to_dict("records"):
        same = (medians["model"] == door["model"]) & (medians["concurrency"] == door["concurrency"])
        same &= medians["batch_size"] == door["batch_size"]
        echo = medians[same & (medians["kind"] == "echo") & (medians["protocol"] == door["protocol"])]
        echo = echo[echo["wire"] == door["wire"]]
        shm = medians[same & (medians["kind"] == "shm") & (medians["design"] == door["design"])]
        shm = shm[shm["batching"].astype(str) == str(door["batching"])]
        if echo.empty and shm.empty:
            continue
        over_shm = door["throughput_rps"] / shm["throughput_rps"].iloc[0] if len(shm) else None
        added_ms = (door["p50_latency_s"] - shm["p50_latency_s"].iloc[0]) * 1e3 if len(shm) else None
        found.append(
            [
                f"{door['model']}, {door['batch_size']:g} image{'s' if door['batch_size'] > 1 else ''}",
                door["peer"],
                f"c{int(door['concurrency'])}",
                f"{door['throughput_rps']:,.{0 if door['throughput_rps'] >= 100 else 1}f}",  # batch 32's tens
                "n/a" if echo.empty else f"{door['throughput_rps'] / echo['throughput_rps'].iloc[0]:.2f}",
                figure(over_shm, ".3f"),
                figure(None if over_shm is None else 1 - over_shm, ".1f", 100, unit=" %"),
                figure(added_ms, ".3f"),
            ]
        )
    if not found:
        return []
    head = "| model, a request | door | load | req/s | over the echo's | over shm's | the door costs | p50 added ms |"
    return ["## What the door costs (closed loops, our generator)", "", *table(head, found), ""]


def latest_servers(servers: pd.DataFrame) -> pd.DataFrame:
    """Each served peer's latest line: one that failed to start and started on a --retry_failed is no failure."""
    return servers.groupby("server", sort=False).tail(1) if len(servers) else servers


def failure_lines(runs: pd.DataFrame, servers: pd.DataFrame) -> list[str]:
    """Every failed run, and every served peer that did not start or stop cleanly (its latest time)."""
    lines = [
        f"- {r['model']} r{r['repeat']} {r['peer']} {level_of(r)} {r['client']}: {r['error']}"
        for r in runs[~runs["ok"]].to_dict("records")
    ]
    servers = latest_servers(servers)
    failed = servers[servers["status"] != "ok"].to_dict("records") if len(servers) else []
    lines += [f"- {r['model']} r{r['repeat']} {r['peer']} (served, {r['log']}): {r['error']}" for r in failed]
    return ["## Failures", "", *(lines or ["None."]), ""]


def plot(runs: pd.DataFrame, models: Sequence[str], path: Path) -> None:
    """Per model, p99 against requests/s of our generator's runs: a curve per peer through its Poisson points (by
    rate), its closed-loop points as open markers of the same colour."""
    served = ok_runs(runs[(runs["client"] == "ours") & (runs["kind"] != "echo")])
    fig, axes = pyplot().subplots(1, len(models), figsize=(7 * len(models), 5), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = served[served["model"] == model]
        for index, (peer, group) in enumerate(mine.groupby("peer")):
            color = f"C{index % 10}"
            poisson = group[group["load"] == POISSON.name].assign(level=lambda g: g.apply(level_of, axis=1))
            poisson = poisson.groupby("level")
            curve = poisson[["rate_rps", "throughput_rps", "p99_latency_s"]].median().sort_values("rate_rps")
            ax.plot(curve["throughput_rps"], curve["p99_latency_s"] * 1e3, "o-", color=color, label=peer)
            closed = group[group["load"] == CLOSED.name].groupby("concurrency")
            points = closed[["throughput_rps", "p99_latency_s"]].median()
            ax.plot(points["throughput_rps"], points["p99_latency_s"] * 1e3, "s", color=color, mfc="none")
        ax.set_yscale("log")
        ax.set_xlabel("requests/s (our generator)")
        ax.set_ylabel("p99 latency, ms")
        ax.set_title(f"{model}: Poisson curve (o-), closed loop c1/c4/c16 (open squares)")
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    save_figure(fig, path)


def spread(values: Sequence[float], scale: float = 1.0, digits: int = 0) -> str:
    """Median (min-max) of the values there are (NaN: none), or the one value, or n/a."""
    shown = [v * scale for v in values if pd.notna(v)]
    if not shown:
        return "n/a"
    median = f"{statistics.median(shown):,.{digits}f}"
    low, high = f"{min(shown):,.{digits}f}", f"{max(shown):,.{digits}f}"
    return median if low == high else f"{median} ({low}-{high})"


def door_table(runs: pd.DataFrame) -> list[str]:
    """The door's own time per request during each client's runs (µs, medians over repeats), with
    perf_analyzer's view of the same counters and its client-side split."""
    if "door_success_s" not in runs:
        return []
    measured = ok_runs(runs[runs["door_success_s"].notna()])
    if measured.empty:
        return []
    lines = [
        "## The door's time per request (µs; ours and Triton's statistics)",
        "",
        *table_head(
            "| model | peer | load | client | door requests per run | door whole | queue | compute input | "
            "compute infer | compute output | PA: client send / network+server / client recv |"
        ),
    ]
    measured = measured.assign(level=measured.apply(level_of, axis=1), point=measured["concurrency"].fillna(0))
    by = ["model", "peer", "load", "point", "rate_fraction", "level", "client"]
    for (model, peer, *_, level, client), group in measured.groupby(by, sort=True, dropna=False):
        stages = [spread(group[f"door_{stage}_s"], 1e6) for stage in DOOR_STAGES]
        split = ""
        if client == "perf_analyzer" and "client_send_s" in group:
            split = " / ".join(
                spread(group[name], 1e6) for name in ("client_send_s", "network_server_s", "client_recv_s")
            )
        lines.append(table_row([model, peer, level, client, spread(group["door_requests"]), *stages, split]))
    return [*lines, ""]


def served_table(served: pd.DataFrame) -> list[str]:
    """Each of our served peers' own row: the door's records of every request it answered, both clients'."""
    if served.empty:
        return []
    lines = [
        "## Our served peers' own rows (`served.csv`)",
        "",
        *table_head(
            "| server | status | requests | door p50 ms | door p99 ms | queue ms | predict ms | answered | "
            "error answers |"
        ),
    ]
    for row in served.to_dict("records"):
        figures = [spread([row.get("p50_latency_s")], 1e3, 3), spread([row.get("p99_latency_s")], 1e3, 3)]
        figures += [spread([row.get(f"mean_{name}_ms")], 1.0, 3) for name in ("request_queue", "predict")]
        counts = [str(row.get(name, "")) for name in ("door_answered", "door_errors")]
        lines.append(table_row([row["experiment"], row["status"], row.get("requests_sent", ""), *figures, *counts]))
    return [*lines, ""]


def report(args: argparse.Namespace, runs: pd.DataFrame, out: Path) -> list[str]:
    """The report's lines (its title first) from the study's rows as bench.peers describes them (model, peer, kind,
    design, batching, protocol, client, ok, rate_rps, rate_fraction); the plot drawn into `out`."""
    runs = with_lateness(with_capacity(runs), read_csv(out / OURS_CSV))
    models = [model for model in dict.fromkeys(args.models) if (runs["model"] == model).any()]
    environments = sorted({str(v) for v in runs.get("peer_environment", pd.Series()).dropna() if str(v)})
    versions = sorted({str(v) for v in runs.get("pa_version", pd.Series()).dropna()})
    lines = ["# Peers side by side", ""]
    lines += [f"- perf_analyzer: {', '.join(versions) or 'not used'}"]
    lines += [f"- peer environment: {stamp}" for stamp in environments]
    lines += [f"- served with: max batch {args.max_batch_size} rows, delay {args.max_queue_delay_ms:g} ms", ""]
    lines += target_lines(runs)
    lines += ["## Every peer, load and client", ""]
    for model in models:
        lines += model_table(runs, model)
    plot(runs, models, out / PLOT_PNG)
    lines += [f"![latency against throughput]({PLOT_PNG})", ""]
    lines += [*door_cost_table(runs), *door_table(runs), *served_table(read_csv(out / SERVED_CSV))]
    return [*lines, NOT_COMPARABLE, *failure_lines(runs, read_csv(out / SERVERS_CSV))]


def target_met(args: argparse.Namespace, rows: pd.DataFrame) -> bool:
    """The exit status' part beyond the runs: every served peer started and stopped cleanly (the speed targets are
    reported, not enforced)."""
    servers = latest_servers(read_csv(args.out / SERVERS_CSV))
    return servers.empty or bool((servers["status"] == "ok").all())
