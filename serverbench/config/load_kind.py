"""What a load shape is: one class per kind (serverbench/config/loads.py lists them, in the order of --help), each
saying in one place the flags that apply to it alone and what it needs of them, how its requests are paced, which
summary facts hold for it, its console line and its row's facts. Nothing else compares a load's name.

The kinds sit below the configuration they describe (load_options.py reads their names for --load's choices), so
they read a run's settings through `LoadSettings`, the few fields of BenchConfig they use."""

from __future__ import annotations

import argparse
import enum
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol


class Pacing(enum.Enum):
    """How the sender lets each measured request go."""

    AT_ONCE = "at once"  # as fast as the transport takes them
    PLACES = "places"  # when a place is free: each response frees one (a closed loop)
    SCHEDULE = "schedule"  # at its intended time, its latency counted from that time (an open loop)
    DRIVER = "driver"  # an outside driver issues them (MLPerf LoadGen)


@dataclass(frozen=True)
class SweepAxis:
    """A load's axis in a sweep: the values sweep.py takes, the flag server.py takes each with, the row's column."""

    sweep_flag: str  # sweep.py's flag listing the values
    server_flag: str  # server.py's flag taking one
    column: str  # the row's column holding it
    unit: str  # for tables and plots
    tag: str  # in file names: rate20, conc4
    label_unit: str = ""  # after the value in a cell's label (rate=20 req/s; concurrency=4)
    plural: str = ""  # the values, in the sweep's plan line: "3 rates"

    @property
    def name(self) -> str:
        return self.server_flag.lstrip("-")


class LoadSettings(Protocol):
    """The settings a load kind reads: BenchConfig has them all."""

    load: str
    num_iters: int
    duration_s: float
    concurrency: int | None
    rate_rps: float | None
    burstiness: float
    scenario: str | None
    seed: int
    generators: int
    generator: int
    stability_pct: float | None
    trace_file: str | None
    trace_offsets_s: tuple[float, ...]


class LoadKind:
    """The base of every load shape. A kind overrides what differs from it: a burst is all defaults."""

    name: ClassVar[str]
    help: ClassVar[str]  # its clause of --load's help
    # The flags that apply to this load alone: their field, how they are typed, and their default (not given).
    owns: ClassVar[dict[str, tuple[str, Any]]] = {}
    pacing: ClassVar[Pacing] = Pacing.AT_ONCE
    saturating: ClassVar[bool] = False  # keeps the server busy: efficiency against the model alone applies
    littles_law: ClassVar[bool] = False  # the load sampler sees its whole in-flight count: Little's law checks it
    sweep_axis: ClassVar[SweepAxis | None] = None  # its axis in a sweep, if it has one
    row_columns: ClassVar[tuple[str, ...]] = ()  # the row's columns its row_facts fill (empty for other loads)

    def applies(self, field: str, args: argparse.Namespace) -> bool:
        """Whether a flag that some load owns applies to this run of this load."""
        return field in self.owns

    def hint(self, field: str) -> str:
        """Words added where a flag another load owns was given to this one."""
        return ""

    def check(self, args: argparse.Namespace) -> None:
        """What this load needs of the flags (ConfigError), once the flags given where they apply to nothing are
        refused."""

    def resolve(self, args: argparse.Namespace) -> dict[str, Any]:
        """Config fields that follow from this load's flags (a trace's arrivals, the count they make)."""
        return {}

    def torchrun_refusal(self) -> str | None:
        """Why each rank of a torchrun job cannot run this load, or None."""
        return None

    def generators_refusal(self, count: int) -> str | None:
        """Why `count` generators cannot share this load, or None."""
        return None

    def generator_changes(self, settings: LoadSettings, index: int, count: int) -> dict[str, Any]:
        """Fields of generator `index`'s config beyond its share of --num_iters, --concurrency and --rate."""
        return {}

    def offsets_s(self, settings: LoadSettings) -> Iterator[float]:
        """The intended send times, in seconds after the measured phase begins: a kind paced by Pacing.SCHEDULE
        gives them (Poisson, trace); the sender asks no other kind, so this guard only catches a kind declared
        SCHEDULE without them."""
        raise TypeError(f"--load {self.name} is paced {self.pacing.value}, not by a schedule: it has no send times")

    def most_in_flight(self, settings: LoadSettings) -> tuple[int, str] | None:
        """The most requests this load has out at once and the flag that sets it, where the load fixes it; None
        where the pace of sending against answering decides (a burst, an open loop, LoadGen)."""
        return None

    def offered(self, settings: LoadSettings) -> str | None:
        """The console's load line, before "achieved": None for a load that offers nothing but all at once."""
        return None

    def row_facts(self, settings: LoadSettings) -> dict[str, object]:
        """The row's columns that say what this load offered."""
        return {}

    def value_text(self, value: float) -> str:
        """A value of its sweep axis as server.py's flag takes it."""
        return f"{value:.12g}"


def given(args: argparse.Namespace, field: str, default: Any) -> bool:
    return getattr(args, field, default) != default
