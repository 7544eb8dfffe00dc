"""The load shapes --load offers, one class each, and their registry. Adding one: a class (here, or a module of its
own as trace_load.py is), its line in LOAD_KINDS, its fields in load_options.py where it owns flags, and its
clause in docs (docs/architecture.md: "Adding a load shape")."""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterator
from typing import Any

from serverbench.config.flags import ConfigError
from serverbench.config.limits import LOADGEN_RATE_SCENARIOS, LOADGEN_SAMPLES_PER_QUERY, MAX_SCHEDULED_REQUESTS
from serverbench.config.load_kind import LoadKind, LoadSettings, Pacing, SweepAxis, given
from serverbench.config.schedules import arrival_offsets_s
from serverbench.config.trace_load import TraceReplay


class Burst(LoadKind):
    name = "burst"
    help = "burst: all requests at once after the warm-up"
    saturating = True


class Closed(LoadKind):
    name = "closed"
    help = "closed: at most --concurrency outstanding, a new one sent as each response arrives"
    owns = {"concurrency": ("--concurrency", None)}
    pacing = Pacing.PLACES
    saturating = True
    littles_law = True
    sweep_axis = SweepAxis(
        "--concurrency", "--concurrency", "concurrency", "requests outstanding", "conc", plural="concurrencies"
    )

    def most_in_flight(self, settings: LoadSettings) -> tuple[int, str] | None:
        return (settings.concurrency, "--concurrency") if settings.concurrency else None

    def check(self, args: argparse.Namespace) -> None:
        if args.concurrency is None:
            raise ConfigError("--load closed needs --concurrency N")

    def offered(self, settings: LoadSettings) -> str:
        return f"concurrency {settings.concurrency}, "

    def value_text(self, value: float) -> str:
        return f"{value:.0f}"


class Poisson(LoadKind):
    name = "poisson"
    help = "poisson: open loop at --rate, latency measured from each request's intended send time"
    owns = {"rate_rps": ("--rate", None), "burstiness": ("--burstiness", 1.0)}
    pacing = Pacing.SCHEDULE
    littles_law = True
    sweep_axis = SweepAxis(
        "--rates", "--rate", "offered_rate_rps", "req/s", "rate", label_unit=" req/s", plural="rates"
    )
    row_columns = ("offered_rate_rps", "burstiness")

    def check(self, args: argparse.Namespace) -> None:
        if args.rate_rps is None and not args.find_peak:
            raise ConfigError("--load poisson needs --rate R (requests per second)")
        scheduled = (args.duration_s or 0.0) * (args.rate_rps or 0.0)  # the schedule is drawn whole, up front
        if args.stability_pct is None and scheduled > MAX_SCHEDULED_REQUESTS:
            raise ConfigError(
                f"--rate {args.rate_rps:g} for --duration_s {args.duration_s:g}: {scheduled:.3g} requests to schedule, "
                f"more than {MAX_SCHEDULED_REQUESTS:,}; lower one"
            )

    def offsets_s(self, settings: LoadSettings) -> Iterator[float]:
        """As many as the count or the duration needs, whichever is more (an endless schedule under stability
        windows). Its seed (seed()): --seed alone with one generator (earlier runs' schedules stay as they were),
        else (seed, generator), an independent stream for each; the images' seed stays --seed for all."""
        windowed = settings.stability_pct is not None
        expected = 0 if windowed else max(settings.num_iters, math.ceil(settings.duration_s * settings.rate_rps))
        return arrival_offsets_s(settings.rate_rps, settings.burstiness, self.seed(settings), count=expected)

    def seed(self, settings: LoadSettings) -> int | tuple[int, int]:
        return settings.seed if settings.generators == 1 else (settings.seed, settings.generator)

    def offered(self, settings: LoadSettings) -> str:
        return f"offered {settings.rate_rps:.4g}, " if settings.rate_rps else ""

    def row_facts(self, settings: LoadSettings) -> dict[str, object]:
        return {"offered_rate_rps": settings.rate_rps, "burstiness": settings.burstiness}


class LoadGen(LoadKind):
    name = "loadgen"
    help = (
        "loadgen: MLPerf LoadGen's --scenario decides what is sent and when, and the row gets its verdict beside ours"
    )
    owns = {"scenario": ("--scenario", None)}
    pacing = Pacing.DRIVER
    row_columns = ("offered_rate_rps",)

    def applies(self, field: str, args: argparse.Namespace) -> bool:
        # LoadGen reads --concurrency and --rate in some of its scenarios, as its own settings.
        if field == "concurrency":
            return args.scenario == "MultiStream"
        if field == "rate_rps":
            return args.scenario in LOADGEN_RATE_SCENARIOS
        return super().applies(field, args)

    def hint(self, field: str) -> str:
        return {
            "concurrency": " (with --load loadgen: to --scenario MultiStream, its samples per query)",
            "rate_rps": " (with --load loadgen: to --scenario Server or Offline)",
        }.get(field, "")

    def check(self, args: argparse.Namespace) -> None:
        """A scenario, the setting it cannot do without, and none of our own ways of ending the measured phase
        (LoadGen decides when its test is done)."""
        if args.scenario is None:
            raise ConfigError("--load loadgen needs --scenario (SingleStream, MultiStream, Server or Offline)")
        if args.scenario == "Server" and args.rate_rps is None:
            raise ConfigError("--scenario Server needs --rate R: LoadGen's target queries per second")
        if args.find_peak:
            raise ConfigError("--find_peak searches with its own Poisson runs: drop --load loadgen")
        if args.stability_pct is not None:
            raise ConfigError("--stability_pct with --load loadgen: LoadGen decides when its test ends; drop one")
        # LoadGen lays out every sample of its test before it issues the first (minutes and gigabytes for 1e8,
        # before any request that a timeout watches): as many as a Poisson schedule may hold, at most.
        if args.scenario == "MultiStream":
            per_query = args.concurrency or LOADGEN_SAMPLES_PER_QUERY
            samples, flags = per_query * args.num_iters, "--concurrency (samples per query) x --num_iters (queries)"
        elif args.scenario in LOADGEN_RATE_SCENARIOS:
            samples, flags = (
                max(args.num_iters, (args.rate_rps or 0.0) * (args.duration_s or 0.0)),
                "--rate x --duration_s",
            )
        else:
            samples, flags = 0, ""
        if samples > MAX_SCHEDULED_REQUESTS:
            raise ConfigError(
                f"--scenario {args.scenario}: {samples:.3g} samples to issue ({flags}), more than "
                f"{MAX_SCHEDULED_REQUESTS:,}; lower one"
            )

    def torchrun_refusal(self) -> str:
        return "--load loadgen under torchrun: each rank would run a LoadGen test of its own; run LoadGen on one GPU"

    def generators_refusal(self, count: int) -> str:
        return (
            f"--generators {count} with --load loadgen: LoadGen issues every query from one process (its test "
            "calls one system under test); run it with one generator"
        )

    def offered(self, settings: LoadSettings) -> str:
        return f"{settings.scenario}, " + (f"offered {settings.rate_rps:.4g}, " if settings.rate_rps else "")

    def row_facts(self, settings: LoadSettings) -> dict[str, object]:
        # Server and Offline: --rate, LoadGen's target queries per second (what it scheduled is its own column)
        return {"offered_rate_rps": settings.rate_rps}


BURST, CLOSED, POISSON = Burst(), Closed(), Poisson()
LOAD_KINDS: tuple[LoadKind, ...] = (BURST, CLOSED, POISSON, LoadGen(), TraceReplay())
LOADS = tuple(kind.name for kind in LOAD_KINDS)
DEFAULT_LOAD = BURST  # what --serve_only leaves to the clients that come, and --find_peak's offline step
PEAK_SEARCH_LOAD = POISSON  # --find_peak's runs: open loops at the rates it tries
SWEEP_LOADS = tuple(kind for kind in LOAD_KINDS if kind.sweep_axis is not None)
LOAD_ROW_COLUMNS = tuple(dict.fromkeys(column for kind in LOAD_KINDS for column in kind.row_columns))


def load_kind(name: str) -> LoadKind:
    for kind in LOAD_KINDS:
        if kind.name == name:
            return kind
    raise ConfigError(f"--load {name!r}: expected one of {', '.join(LOADS)}")


def sweep_kind(column: str) -> LoadKind:
    """The load whose sweep axis is this row column."""
    for kind in SWEEP_LOADS:
        if kind.sweep_axis.column == column:
            return kind
    raise KeyError(column)


def check_load_flags(args: argparse.Namespace) -> None:
    """Flags that some load owns, given to a run where they apply to nothing: one line each. --find_peak runs
    Poisson loads itself, so the Poisson flags apply with it."""
    kind = load_kind(args.load)
    for owner in LOAD_KINDS:
        for field, (typed, default) in owner.owns.items():
            if not given(args, field, default) or kind.applies(field, args):
                continue
            if args.find_peak and PEAK_SEARCH_LOAD.applies(field, args):
                continue
            hint = kind.hint(field)
            raise ConfigError(
                f"{typed} applies to --load {owner.name} only" + (hint or f" (this run is --load {args.load})")
            )


def help_text() -> str:
    return "; ".join(kind.help for kind in LOAD_KINDS) + f" (default {DEFAULT_LOAD.name})"


def resolve_load(args: argparse.Namespace) -> dict[str, Any]:
    """The load's checks, then the fields that follow from its flags."""
    kind = load_kind(args.load)
    kind.check(args)
    return kind.resolve(args)
