"""How a configuration field becomes a command-line flag: its Flag (group, help, default, argparse options and the
bounds its value is checked against alone), the argparse groups in --help's order, the parser that makes them from
a config dataclass, and the two parsers that turn a usage error into one line or a ConfigError."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


class ConfigError(ValueError):
    """An invalid flag value or combination; the message is one line for the user."""


# The argparse groups, in the order --help shows them: key -> (title, description).
GROUPS: dict[str, tuple[str, str | None]] = {
    "ref": ("reference flags (pytorch/pytorch benchmarks/inference)", None),
    "run": ("what to run", None),
    "out": ("labels and detail outputs", None),
    "load": (
        "load",
        "burst answers 'how fast can it go' (the reference: every request at once); closed and poisson "
        "answer 'what latency at this traffic'",
    ),
    "check": ("correctness", None),
    "perf": (
        "transport and model-side options",
        "what the server moves and how the model runs; the reference's way "
        "is --transport queue --wire_dtype float32 --precision default",
    ),
    "batch": (
        "dynamic batching",
        "Triton's dynamic batcher, TorchServe's batch_size and max_batch_delay: the backend "
        "gathers requests into one forward, in every design",
    ),
    "door": (
        "network front door (Open Inference Protocol)",
        "--transport http|grpc: clients reach the server over HTTP or gRPC as Triton's and KServe's do; "
        "see docs/door.md",
    ),
    "tune": ("measurement and limits", None),
}
FLAG = "flag"  # the metadata key of a field's Flag


@dataclass(frozen=True)
class Flag:
    """How one BenchConfig field is given on the command line, and the bounds its value is checked against alone."""

    group: str  # a key of GROUPS
    help: str  # argparse.SUPPRESS hides a test-only flag
    default: Any = None
    name: str | None = None  # the flag's name where it is not the field's: --rate fills rate_rps
    type: Callable[[str], Any] | None = None
    choices: Sequence[str] | None = None
    action: Any = None  # "store_true" or argparse.BooleanOptionalAction
    metavar: str | None = None
    at_least: float | None = None
    at_most: float | None = None
    why: str = ""  # what the upper bound protects, shown with it

    def flag_name(self, field_name: str) -> str:
        return self.name or field_name


def flag(group: str, help: str, **spec: Any) -> Any:
    """A BenchConfig field that is a command-line flag; no dataclass default, so a config names every field."""
    return dataclasses.field(metadata={FLAG: Flag(group, help, **spec)})


def flag_of(field: dataclasses.Field) -> Flag | None:
    return field.metadata.get(FLAG)


def count_or_auto(value: str) -> int | None:
    """--intra_op_threads: a count, or auto (None)."""
    if value == "auto":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a whole number of threads, or auto; not {value!r}") from None


def bounded(kind: Callable[[str], Any], low: float, high: float) -> Callable[[str], Any]:
    """An argparse type for the bench tools' counts and rates: a number of `kind` (int or float) within
    [low, high], NaN refused; argparse names the flag in its one-line error."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{text}: must be between {low:g} and {high:g}")
        return value

    return parse


def device_name(text: str) -> str:
    """An argparse type: auto, cpu, cuda or cuda:N, as server.py's --device takes."""
    if text in ("auto", "cpu", "cuda") or (text.startswith("cuda:") and text[5:].isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: expected auto, cpu, cuda or cuda:N")


def add_flags(parser: argparse.ArgumentParser, config_type: type) -> None:
    """The flags of a config dataclass's fields, each in its group: the groups in GROUPS' order (a config may
    gather its fields from several base classes), the flags of a group in field order."""
    flagged = [(field, spec) for field in dataclasses.fields(config_type) if (spec := flag_of(field)) is not None]
    groups = {
        key: parser.add_argument_group(*GROUPS[key]) for key in GROUPS if any(spec.group == key for _, spec in flagged)
    }
    for field, spec in sorted(flagged, key=lambda item: list(GROUPS).index(item[1].group)):
        options = {
            key: value for key in ("type", "choices", "action", "metavar") if (value := getattr(spec, key)) is not None
        }
        groups[spec.group].add_argument(
            f"--{spec.flag_name(field.name)}", dest=field.name, default=spec.default, help=spec.help, **options
        )


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (and exit status 2), like every other invalid value."""

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class RaisingParser(argparse.ArgumentParser):
    """argparse that raises ConfigError for a usage error instead of printing and exiting: for checking another
    program's flags (a sweep's cells) without running it."""

    def error(self, message: str) -> None:
        raise ConfigError(message)
