"""--generators N: the load generator in N frontend processes, each a full client of the network door (or of
--target) with its share of the load. Pure, as build.py: the checks on the flags, and each generator's own config
derived from the run's (serverbench/launch/children.py starts them, serverbench/launch/frontends.py merges their
reports).

    closed    --concurrency split as evenly as possible, --num_iters in proportion to it
    poisson   --rate/N each, on a schedule of its own: independent Poisson processes add up to one at --rate
    burst     --num_iters split; every generator sends its share at once
    trace     arrivals g, g+N, g+2N, ... to generator g (serverbench/config/trace_load.py)

Every generator warms up, then all start the measured phase together (the server's start gate). Each gives its
requests ids from a block of its own, so that the merged records never share an id.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

from serverbench.config.door_options import NETWORK_TRANSPORTS
from serverbench.config.flags import ConfigError
from serverbench.config.load_kind import Pacing
from serverbench.config.loads import load_kind
from serverbench.config.options import BenchConfig, RankInfo

# Generator g's request ids start at g * this: more requests than any run sends, so no two generators' ids meet.
GENERATOR_ID_BLOCK = 10**12


def split_shares(total: int, weights: Sequence[int]) -> list[int]:
    """`total` shared out in proportion to `weights`, as evenly as whole numbers allow; the shares add up to total
    exactly (each share is the difference of two rounded-down cumulative bounds)."""
    whole = sum(weights)
    bounds = [total * sum(weights[:index]) // whole for index in range(len(weights) + 1)]
    return [upper - lower for lower, upper in zip(bounds, bounds[1:])]


@dataclasses.dataclass(frozen=True)
class Share:
    """One generator's share of the load: its measured requests, its places (closed), its rate (poisson)."""

    num_iters: int
    concurrency: int | None = None
    rate_rps: float | None = None


def load_shares(load: str, count: int, concurrency: int | None, num_iters: int, rate_rps: float | None) -> list[Share]:
    """Each of `count` generators' share, as generator_config gives it and check_generators checks it: the closed
    loop's places split evenly and the measured requests in proportion to them (they end together), else the
    requests split evenly; a Poisson rate split evenly. A share may come out 0 here: check_generators refuses that."""
    kind = load_kind(load)
    closed = kind.pacing is Pacing.PLACES and concurrency is not None
    places = split_shares(concurrency, [1] * count) if closed else [1] * count
    rate = rate_rps / count if "rate_rps" in kind.owns and rate_rps is not None else None
    return [
        Share(num_iters=iters, concurrency=place if closed else None, rate_rps=rate)
        for iters, place in zip(split_shares(num_iters, places), places)
    ]


def check_generators(args: argparse.Namespace, rank: RankInfo | None) -> None:
    """What N > 1 generators cannot do, each refused in one line before any process starts."""
    count = args.generators
    if count == 1:
        return
    refusal = load_kind(args.load).generators_refusal(count)
    if refusal is not None:
        raise ConfigError(refusal)
    if args.transport not in NETWORK_TRANSPORTS and args.target is None:
        raise ConfigError(
            f"--generators > 1 needs --transport http|grpc or --target: the {args.transport} transport is one "
            "channel written by one frontend, where each generator is its own client of the door"
        )
    if args.serve_only:
        raise ConfigError(f"--generators {count} with --serve_only: no load generator of ours runs")
    if rank is not None:
        raise ConfigError(
            f"--generators {count} under torchrun: each rank already runs a frontend of its own; add ranks instead"
        )
    if args.stability_pct is not None:
        raise ConfigError(
            f"--stability_pct with --generators {count}: each generator would end its measured phase on its own "
            "windows, at different times; use --num_iters or --duration_s"
        )
    _check_shares(args, count)


def _check_shares(args: argparse.Namespace, count: int) -> None:
    """Every generator's share computed as it will be given, and refused where one would be 0: no place in the
    closed loop, no measured request, no rate."""
    shares = load_shares(args.load, count, args.concurrency, args.num_iters, args.rate_rps)
    if any(share.concurrency is not None and share.concurrency < 1 for share in shares):
        raise ConfigError(
            f"--concurrency {args.concurrency} with --generators {count}: each generator needs at least one "
            f"request outstanding; give --concurrency {count} or more"
        )
    empty = [index for index, share in enumerate(shares) if share.num_iters < 1]
    if empty:
        closed = shares[0].concurrency is not None
        how = (
            f" --concurrency {args.concurrency}: --num_iters goes to each in proportion to its places "
            f"({', '.join(str(share.concurrency) for share in shares)}), and"
            if closed
            else ":"
        )
        raise ConfigError(
            f"--num_iters {args.num_iters} with --generators {count}{how} each generator needs at least one "
            f"measured request (generator {empty[0]} would get none); give --num_iters "
            f"{args.concurrency if closed else count} or more"
        )
    if any(share.rate_rps is not None and not share.rate_rps > 0 for share in shares):
        raise ConfigError(f"--rate {args.rate_rps:g} with --generators {count}: a generator's share would be 0 rps")


def generator_config(cfg: BenchConfig, index: int) -> BenchConfig:
    """The config of generator `index`: its share of the concurrency, the rate and the measured requests. With one
    generator, the run's config as it is."""
    count = cfg.generators
    if count == 1:
        return cfg
    share = load_shares(cfg.load, count, cfg.concurrency, cfg.num_iters, cfg.rate_rps)[index]
    changes: dict[str, object] = {"generator": index, "num_iters": share.num_iters}
    if share.concurrency is not None:
        changes["concurrency"] = share.concurrency
    if share.rate_rps is not None:
        changes["rate_rps"] = share.rate_rps
    changes.update(load_kind(cfg.load).generator_changes(cfg, index, count))
    return dataclasses.replace(cfg, **changes)


def first_request_id(cfg: BenchConfig) -> int:
    """The first (warm-up) request id of this config's generator: its block of ids."""
    return cfg.generator * GENERATOR_ID_BLOCK
