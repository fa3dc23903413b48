"""The tier's `pool serve` options, their settings, and its rows of `pool status`."""

from __future__ import annotations

import argparse
from typing import Any

from maru_vllm.pool.region import parse_size
from maru_vllm.pool.tier2 import Tier2Settings
from maru_vllm.pool.tier2.mooncake import (
    DEFAULT_PROTOCOL,
    DEFAULT_SEGMENT_SIZE,
    PROTOCOLS,
    MooncakeConfig,
    validate_master,
    validate_metadata,
)
from maru_vllm.pool.tier2.tier import Tier2Config

_DEFAULTS = Tier2Config(tier="")
_DEPENDENT = (
    "mooncake_metadata",
    "mooncake_protocol",
    "mooncake_segment_size",
    "mooncake_host",
    "tier2_put_budget",
    "tier2_queue",
)


def _typed(fn: Any, what: str) -> Any:
    def convert(text: str) -> Any:
        try:
            return fn(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    convert.__name__ = what
    return convert


def _segment(text: str) -> int:
    size = parse_size(text, minimum=1 << 20)
    return size


def _budget(text: str) -> int:
    return parse_size(text.removesuffix("/s"), minimum=1 << 20)


def _queue(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"invalid queue length {text!r}: use an integer >= 1")
    return int(text)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("second tier (Mooncake Store; off without --mooncake-master)")
    g.add_argument(
        "--mooncake-master",
        type=_typed(validate_master, "HOST:PORT"),
        help="the Mooncake master's HOST:PORT (its --rpc_port): write every object through to the cluster's "
        "Mooncake Store and fetch other domains' objects from it",
    )
    g.add_argument(
        "--mooncake-metadata",
        type=_typed(validate_metadata, "URL"),
        help="the transfer engine's metadata service (default: http://MASTER_HOST:8080/metadata, the master's "
        "built-in server)",
    )
    g.add_argument("--mooncake-protocol", choices=PROTOCOLS, help=f"transfer protocol (default {DEFAULT_PROTOCOL})")
    g.add_argument(
        "--mooncake-segment-size",
        type=_typed(_segment, "size"),
        help=f"memory this pool contributes to the Mooncake Store (default {DEFAULT_SEGMENT_SIZE >> 30}G)",
    )
    g.add_argument(
        "--mooncake-host",
        help="the address other Mooncake clients reach this pool at (default: this host's address towards the master)",
    )
    g.add_argument(
        "--tier2-put-budget",
        type=_typed(_budget, "bytes per second"),
        help=f"most bytes per second written through to the tier (default {_DEFAULTS.put_budget >> 20}M)",
    )
    g.add_argument(
        "--tier2-queue",
        type=_typed(_queue, "count"),
        help=f"most objects waiting for write-through; more are skipped (default {_DEFAULTS.queue_max})",
    )


def settings_from(args: argparse.Namespace) -> Tier2Settings | None:
    """The tier `args` ask for, or None; ValueError naming an option given without --mooncake-master."""
    if args.mooncake_master is None:
        for name in _DEPENDENT:
            if getattr(args, name, None) is not None:
                raise ValueError(f"--{name.replace('_', '-')} needs --mooncake-master (the tier is off without it)")
        return None
    store = MooncakeConfig(
        master=args.mooncake_master,
        metadata=args.mooncake_metadata,
        protocol=args.mooncake_protocol or DEFAULT_PROTOCOL,
        segment_size=args.mooncake_segment_size or DEFAULT_SEGMENT_SIZE,
        host=args.mooncake_host,
    )
    options = Tier2Config(
        tier=args.mooncake_master,
        put_budget=args.tier2_put_budget or _DEFAULTS.put_budget,
        queue_max=args.tier2_queue or _DEFAULTS.queue_max,
    )
    return Tier2Settings(store, options)


def status_rows(st: dict[str, Any]) -> list[tuple[str, Any]]:
    """`pool status` rows of the tier (none when the pool has none)."""
    if "tier2" not in st:
        return [("tier 2", "off")]
    return [
        ("tier 2", f"{st['tier2']} ({st.get('tier2_state')}), {st.get('tier2_keys', 0)} keys known"),
        (
            "tier-2 puts",
            f"{st.get('tier2_puts', 0)} ({st.get('tier2_put_bytes', 0) / (1 << 20):.1f} MiB),"
            f" {st.get('tier2_put_failures', 0)} failed, {st.get('tier2_put_skipped', 0)} skipped,"
            f" {st.get('tier2_queue', 0)} queued",
        ),
        (
            "tier-2 gets",
            f"{st.get('tier2_gets', 0)}: {st.get('tier2_hits', 0)} hits"
            f" ({st.get('tier2_get_bytes', 0) / (1 << 20):.1f} MiB), {st.get('tier2_misses', 0)} misses,"
            f" {st.get('tier2_corrupt', 0)} corrupt, {st.get('tier2_late', 0)} late,"
            f" {st.get('tier2_get_failures', 0)} failed",
        ),
        ("tier-2 outages", st.get("tier2_trips", 0)),
    ]
