"""`maru-dynamo pool serve|status`: run the pool service or inspect a running one."""

from __future__ import annotations

import argparse
import asyncio
import grp
import json
import logging
import sys
from collections.abc import Callable
from typing import Any

from maru_vllm.pool.address import parse_address
from maru_vllm.pool.auth import read_token_file
from maru_vllm.pool.errors import PoolError
from maru_vllm.pool.index import DEFAULT_MAX_OBJECTS, DEFAULT_METADATA_BUDGET
from maru_vllm.pool.region import BACKENDS, RegionError, parse_size, validate_pool_name
from maru_vllm.pool.snapshot_pages import DEFAULT_MAX_PAGES
from maru_vllm.pool.tier2 import cli as tier2_cli

logger = logging.getLogger(__name__)

EVENT_LOOPS = ("auto", "uvloop", "asyncio")


def event_loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The loop the service runs on: uvloop's (libuv streams, fewer Python hops per request:
    `benchmarks/profile_load.py` times the acquire and release round trips) when installed and
    not turned off, else asyncio's own (None)."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise PoolError(
                "--event-loop uvloop: uvloop is not installed (pip install uvloop, or use asyncio)"
            ) from None
        return None
    return uvloop.new_event_loop


def _arg_type(fn: Any, what: str) -> Any:
    def convert(text: str) -> Any:
        try:
            return fn(text)
        except (ValueError, PoolError) as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    convert.__name__ = what
    return convert


def _name(text: str) -> str:
    return validate_pool_name(text)


def _port(text: str) -> int:
    if not text.isdigit() or not 0 <= int(text) <= 65535:
        raise ValueError(f"invalid port {text!r}: use an integer 0-65535 (0 picks a free port)")
    return int(text)


def _nats_url(text: str) -> str:
    if not text.startswith(("nats://", "tls://", "ws://", "wss://")):
        raise ValueError(f"invalid NATS URL {text!r}: use nats://host:port (or tls://, ws://, wss://)")
    return text


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"invalid duration {text!r}: use a number of seconds > 0")
    return value


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"invalid count {text!r}: use an integer >= 1")
    return int(text)


def _limit(text: str) -> int:
    return parse_size(text, minimum=1)


def _group(text: str) -> int:
    if text.isdigit():
        return int(text)
    try:
        return grp.getgrnam(text).gr_gid
    except KeyError as exc:
        raise ValueError(f"invalid group {text!r}: no such group (use a group name or a numeric gid)") from exc


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"invalid count {text!r}: use an integer >= 1")
    return int(text)


def _non_negative_int(text: str) -> int:
    if not text.isdigit():
        raise ValueError(f"invalid count {text!r}: use an integer >= 0")
    return int(text)


def _presence_buckets(text: str) -> int:
    n = int(text) if text.isdigit() else -1
    if n < 0 or n & (n - 1):
        raise ValueError(f"invalid bucket count {text!r}: use 0 (no table) or a power of two such as 65536")
    return n


def _address(text: str) -> str:
    parse_address(text)
    return text


def register(subparsers: Any) -> None:
    pool = subparsers.add_parser("pool", help="run or inspect the shared KV-cache pool (Maru)")
    psub = pool.add_subparsers(dest="pool_command", metavar="POOL_COMMAND")
    pool.set_defaults(func=lambda args: _help(pool))

    serve = psub.add_parser("serve", help="run a pool service in the foreground")
    serve.add_argument("--name", required=True, type=_arg_type(_name, "pool name"), help="pool name")
    serve.add_argument("--size", required=True, type=_arg_type(parse_size, "size"), help="region size: bytes, 512M, 4G")
    serve.add_argument("--backend", choices=BACKENDS, default="shm", help="where the region lives (default shm)")
    serve.add_argument(
        "--path",
        help="region path: /dev/shm/<file> (shm), /dev/daxX.Y (dax), a file on a DAX or hugetlbfs mount (file)",
    )
    serve.add_argument(
        "--listen",
        action="append",
        type=_arg_type(_address, "address"),
        default=[],
        help="unix:///path.sock (default under $XDG_RUNTIME_DIR or /tmp) or tcp://host:port; repeatable",
    )
    serve.add_argument(
        "--nats", type=_arg_type(_nats_url, "NATS URL"), help="publish stored/removed events to this NATS server"
    )
    serve.add_argument("--metrics-port", type=_arg_type(_port, "port"), help="serve Prometheus metrics on this port")
    serve.add_argument("--metrics-host", default="127.0.0.1", help="metrics bind address (default 127.0.0.1)")
    serve.add_argument(
        "--token-file", help="file holding the shared-secret token clients must present (required for tcp)"
    )
    serve.add_argument(
        "--keep-region",
        action="store_true",
        help="leave the region file in place at exit (marked stopped cleanly: the next start recovers it)",
    )
    recover = serve.add_mutually_exclusive_group()
    recover.add_argument(
        "--recover",
        dest="recover",
        action="store_const",
        const="require",
        help="recover the objects of the region left at the path, or refuse to start (default: recover "
        "when it is this pool's region of the same size and layout, else start an empty one)",
    )
    recover.add_argument(
        "--no-recover",
        dest="recover",
        action="store_const",
        const="never",
        help="always start with an empty region (a region left at the path is replaced)",
    )
    serve.set_defaults(recover="auto")
    serve.add_argument(
        "--lease-seconds",
        type=_arg_type(_seconds, "seconds"),
        default=30.0,
        help="release a silent client's reservations and pins after this long (default 30)",
    )
    serve.add_argument(
        "--group", type=_arg_type(_group, "group"), help="make the region and socket group-accessible (0660)"
    )
    serve.add_argument(
        "--max-objects",
        type=_arg_type(_positive_int, "object count"),
        default=DEFAULT_MAX_OBJECTS,
        help="most objects the pool indexes; beyond it LRU objects are evicted, and a store is "
        f"skipped when none can be (default {DEFAULT_MAX_OBJECTS})",
    )
    serve.add_argument(
        "--metadata-budget",
        type=_arg_type(parse_size, "size"),
        default=DEFAULT_METADATA_BUDGET,
        help="bytes of object metadata the pool keeps (keys and part keys in service memory, each "
        "object's meta JSON or binary chunk metadata in the region beside the payloads): bytes, 512M, "
        "1G; beyond it LRU objects are evicted, and a store is skipped when none can be (default 1G)",
    )
    serve.add_argument(
        "--presence-buckets",
        type=_arg_type(_presence_buckets, "bucket count"),
        default=None,
        help="size of the presence table that lets clients look keys up in the region without a "
        "round trip (8 keys per 64-byte bucket); 0 for none (default: one slot per 4 KiB of region, "
        "at most 16 per --max-objects)",
    )
    serve.add_argument(
        "--shared-snapshot-pages",
        type=_arg_type(_non_negative_int, "count"),
        default=DEFAULT_MAX_PAGES,
        help="snapshot pages kept encoded for the next reader of the unchanged pool (the relays of "
        "workers that start together read the same pages); 0 encodes every page for every reader "
        f"(default {DEFAULT_MAX_PAGES}, at most 64 MiB)",
    )
    serve.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    serve.add_argument(
        "--force", action="store_true", help="replace a file at the region path even if it is not a Maru region"
    )
    serve.add_argument(
        "--hello-timeout",
        type=_arg_type(_seconds, "seconds"),
        default=10.0,
        help="close a connection that has not completed hello within this long (default 10)",
    )
    serve.add_argument(
        "--max-connections",
        type=_arg_type(_count, "count"),
        help="most client connections at once; half may be waiting for hello "
        "(default: 1024, or fewer if the open-file limit is lower)",
    )
    serve.add_argument(
        "--session-reserve-limit",
        type=_arg_type(_limit, "size"),
        help="most bytes one session may hold in uncommitted reservations (default: half the region)",
    )
    serve.add_argument(
        "--session-pin-limit",
        type=_arg_type(_limit, "size"),
        help="most bytes of objects one session may pin at once (default: half the region)",
    )
    serve.add_argument(
        "--event-loop",
        choices=EVENT_LOOPS,
        default="auto",
        help="asyncio's loop implementation: uvloop (lower per-request latency), asyncio, or auto "
        "(uvloop when installed; the default)",
    )
    serve.add_argument(
        "--max-pins-per-object",
        type=_arg_type(_count, "count"),
        default=1024,
        help="most concurrent pins on one object, over all sessions (default 1024)",
    )
    tier2_cli.add_arguments(serve)
    serve.set_defaults(func=cmd_serve)

    status = psub.add_parser("status", help="show a running pool's capacity, usage and counters")
    status.add_argument("--address", required=True, type=_arg_type(_address, "address"), help="the pool's address")
    status.add_argument("--token-file", help="token file (tcp pools)")
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.add_argument("--timeout", type=_arg_type(_seconds, "seconds"), default=5.0)
    status.set_defaults(func=cmd_status)

    clear = psub.add_parser("clear", help="remove every object of one namespace (or all namespaces) from a pool")
    clear.add_argument("--address", required=True, type=_arg_type(_address, "address"), help="the pool's address")
    clear.add_argument("--token-file", help="token file (tcp pools)")
    target = clear.add_mutually_exclusive_group(required=True)
    target.add_argument("--namespace", help="the namespace to clear (see `pool status --json` / snapshot)")
    target.add_argument("--all", action="store_true", help="clear every namespace")
    clear.add_argument("--timeout", type=_arg_type(_seconds, "seconds"), default=5.0)
    clear.set_defaults(func=cmd_clear)


def _help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _read_token(path: str | None) -> str | None:
    return None if path is None else read_token_file(path)


def cmd_serve(args: argparse.Namespace) -> int:
    from maru_vllm.pool.service import ServiceConfig, serve

    logging.basicConfig(
        level=args.log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        tier2 = tier2_cli.settings_from(args)
    except ValueError as exc:
        print(f"maru-dynamo pool serve: error: {exc}", file=sys.stderr, flush=True)
        return 2
    try:
        cfg = ServiceConfig(
            name=args.name,
            size=args.size,
            backend=args.backend,
            path=args.path,
            listen=args.listen,
            nats=args.nats,
            metrics_port=args.metrics_port,
            metrics_host=args.metrics_host,
            token=_read_token(args.token_file),
            keep_region=args.keep_region,
            lease_s=args.lease_seconds,
            group=args.group,
            force=args.force,
            hello_timeout_s=args.hello_timeout,
            max_connections=args.max_connections,
            session_reserve_limit=args.session_reserve_limit,
            session_pin_limit=args.session_pin_limit,
            max_pins_per_object=args.max_pins_per_object,
            max_objects=args.max_objects,
            metadata_budget=args.metadata_budget,
            presence_buckets=args.presence_buckets,
            shared_snapshot_pages=args.shared_snapshot_pages,
            tier2=tier2,
            recover=args.recover,
        )
        with asyncio.Runner(loop_factory=event_loop_factory(args.event_loop)) as runner:
            return runner.run(serve(cfg))
    except (RegionError, PoolError, OSError) as exc:
        print(f"maru-dynamo pool serve: error: {exc}", file=sys.stderr, flush=True)
        return 1


def cmd_status(args: argparse.Namespace) -> int:
    from maru_vllm.pool.client import PoolClient

    try:
        with PoolClient.connect(args.address, _read_token(args.token_file), timeout=args.timeout, heartbeat=False) as c:
            st = c.stats()
    except PoolError as exc:
        print(f"maru-dynamo pool status: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(st, indent=2, sort_keys=True))
    else:
        print(format_status(st))
    return 0


def cmd_clear(args: argparse.Namespace) -> int:
    """Remove objects; subscribers see `removed` events exactly as for evictions."""
    from maru_vllm.pool.client import PoolClient

    try:
        with PoolClient.connect(args.address, _read_token(args.token_file), timeout=args.timeout, heartbeat=False) as c:
            namespaces = (
                [args.namespace]
                if not args.all
                else sorted({o.namespace for page in c.snapshot_pages() for o in page.objects})
            )
            removed = sum(c.remove(None, namespace=ns) for ns in namespaces)
    except PoolError as exc:
        print(f"maru-dynamo pool clear: error: {exc}", file=sys.stderr)
        return 1
    print(f"removed {removed} objects from {len(namespaces)} namespace(s)")
    return 0


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _start_line(st: dict[str, Any]) -> str:
    """How this service started: on a new region, or recovering the one a previous service left."""
    if st.get("last_stop") is None:
        return "new region"
    return (
        f"recovered {st.get('recovered_objects', 0)} objects in {st.get('recovery_seconds') or 0:.2f} s"
        f" ({st.get('recovery_dropped', 0)} dropped); the last service stopped "
        + ("cleanly" if st.get("last_stop") == "clean" else "uncleanly")
    )


def format_status(st: dict[str, Any]) -> str:
    cap = st.get("capacity_bytes", 0) or 1
    lookups = st.get("hits", 0) + st.get("misses", 0)
    rows = [
        ("pool", st.get("pool")),
        ("incarnation", st.get("incarnation")),
        ("region", f"{st.get('region_path')} ({st.get('backend')})"),
        ("capacity", _human(st.get("capacity_bytes", 0))),
        ("allocated", f"{_human(st.get('allocated_bytes', 0))} ({100 * st.get('allocated_bytes', 0) / cap:.1f}%)"),
        (
            "objects",
            f"{st.get('objects', 0)} ({_human(st.get('object_bytes', 0))}), at most {st.get('max_objects', 0)}",
        ),
        ("metadata", f"{_human(st.get('metadata_bytes', 0))} of {_human(st.get('metadata_budget_bytes', 0))}"),
        (
            "presence table",
            f"{st.get('presence_entries', 0)} keys in {st.get('presence_slots', 0)} slots"
            f" ({st.get('presence_spilled', 0)} answered by the service only)"
            if st.get("presence_slots")
            else "none (every lookup asks the service)",
        ),
        (
            "catalog",
            f"{st.get('catalog_used', 0)} of {st.get('catalog_slots', 0)} slots"
            f" ({st.get('catalog_full', 0)} objects found it full: not recoverable)",
        ),
        ("this start", _start_line(st)),
        ("reserved", f"{st.get('reserved', 0)} ({_human(st.get('reserved_bytes', 0))})"),
        ("pinned", st.get("pinned", 0)),
        ("sessions", st.get("sessions", 0)),
        (
            "connections",
            f"{st.get('connections', 0)} of at most {st.get('max_connections', '?')}"
            f" ({st.get('connections_waiting_for_hello', 0)} waiting for hello)",
        ),
        ("quota refusals", st.get("quota_refusals", 0)),
        ("failed logins", st.get("auth_failures", 0)),
        (
            "hits / misses",
            f"{st.get('hits', 0)} / {st.get('misses', 0)}"
            + (f" ({100 * st.get('hits', 0) / lookups:.1f}% hit)" if lookups else ""),
        ),
        ("stores", st.get("stores", 0)),
        ("evictions", st.get("evictions", 0)),
        ("duplicate commits", st.get("duplicate_commits", 0)),
        ("corrupt reads", st.get("corrupt_reads", 0)),
        (
            "events",
            f"seq {st.get('event_seq', 0)}, nats {st.get('nats') or 'off'}"
            + (" (connected)" if st.get("nats_connected") else ""),
        ),
        *tier2_cli.status_rows(st),
        ("uptime", f"{st.get('uptime_s', 0):.0f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
