"""The designs --design offers, declared once each: what the configuration, the sweep and the report need to know
of a design (its workers, whether it serves on one thread, its experiment label). How each one serves is its class
in serverbench/backend/designs.py, keyed by these names. Adding a design: its declaration here, its line in
DESIGN_KINDS, its class there (docs/architecture.md: "Adding a design")."""

from __future__ import annotations

from dataclasses import dataclass

from serverbench.config.flags import ConfigError


@dataclass(frozen=True)
class DesignKind:
    name: str
    help: str  # its clause of --design's help
    many_workers: bool = False  # takes --num_workers N (prediction threads); else exactly one
    default_workers: int = 1
    one_thread: bool = False  # every step on one thread: a planted busy-wait slows nothing else

    def forwards_at_once(self, num_workers: int) -> int:
        """Forwards one backend runs at once: its prediction workers, or one."""
        return num_workers if self.many_workers else 1

    def label(self, num_workers: int) -> str:
        """Its experiment label: pipelined_2w for a design of several workers, else its name."""
        return f"{self.name}_{num_workers}w" if self.many_workers else self.name

    def labels_it(self, experiment: str) -> bool:
        """Whether `experiment` is a label this design gives itself."""
        if not self.many_workers:
            return experiment == self.name
        prefix, _, workers = experiment.rpartition("_")
        return prefix == self.name and workers.endswith("w") and workers[:-1].isdigit()


SERIAL = DesignKind("serial", "serial: one loop does get, H2D, forward, D2H, put", one_thread=True)
THREADED = DesignKind(
    "threaded", "threaded: a one-worker thread pool runs H2D, forward and respond while the loop keeps polling"
)
PIPELINED = DesignKind(
    "pipelined",
    "pipelined: an H2D thread, --num_workers prediction threads and a D2H thread, each on its own stream",
    many_workers=True,
    default_workers=2,
)
DESIGN_KINDS: tuple[DesignKind, ...] = (SERIAL, THREADED, PIPELINED)
DESIGNS = tuple(kind.name for kind in DESIGN_KINDS)
DEFAULT_DESIGN = PIPELINED
BASELINE_DESIGN = SERIAL  # report.py's default baseline: the simplest server


def help_text() -> str:
    return "; ".join(kind.help for kind in DESIGN_KINDS) + f" (default {DEFAULT_DESIGN.name})"


def design_kind(name: str) -> DesignKind:
    for kind in DESIGN_KINDS:
        if kind.name == name:
            return kind
    raise ConfigError(f"--design {name!r}: expected one of {', '.join(DESIGNS)}")


def experiment_label(design: str, num_workers: int) -> str:
    """The one place an experiment is named after its design: serial, threaded, pipelined_2w."""
    return design_kind(design).label(num_workers)


def is_design_label(experiment: str) -> bool:
    """Whether an experiment's name is one a design gives itself (not a user's own)."""
    return any(kind.labels_it(experiment) for kind in DESIGN_KINDS)
