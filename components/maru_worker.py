"""`python -m maru_dynamo.components.maru_worker [--maru-* options] [dynamo.vllm args]`.

A `dynamo.vllm` worker on the Maru pool: it fills in MaruKVConnector's `--kv-transfer-config`
and a `--kv-events-config` (free port) unless given, makes the KV events it publishes carry
the pool's blocks (`maru_vllm.events.publisher_relay`), registers MaruKVConnector as
a cache-mediated PD connector (`maru_dynamo.components.dynamo_pd`), makes the worker serve
warm-up requests before it registers with Dynamo (`maru_vllm.launch.warmup`: registered means
warm), makes a stopping worker drain before it migrates (`maru_vllm.launch.lifecycle`), makes a
prefill or decode worker stand in for the other role while no worker of that role is live
(`maru_dynamo.components.disagg`), and runs `dynamo.vllm` in this process with every other
argument unchanged. Every hook into `dynamo.vllm` goes in through one module,
`maru_dynamo.components.dynamo_hooks`, which refuses a Dynamo whose seams moved in one line.

Options of its own (all others go to dynamo.vllm):
  --maru-pool-address ADDR   pool service address (unix:///path.sock or tcp://host:port)
  --maru-pool-name NAME      pool name (its NATS subjects maru.<NAME>.*); NATS from $NATS_SERVER.
                             Default: asked from the pool service (its stats); when given, it
                             must match the pool's own name
  --maru-pool-token-file F   file holding the token of a TCP pool (`pool serve --token-file`); mode
                             600. The connector, the name lookup and the event relay present it
  --maru-event-medium M      tier the router credits pool blocks at (default CPU_PINNED)
  --maru-announce-max-chunks N
                             announce at most N pool chunks to the router, the pool's most
                             recently used (default: every chunk of this worker's model)
  --maru-tier2-credit         also announce the cluster's tier-2 chunks (other domains' prompts in the
                             Mooncake Store under the pools) to the router at the disk tier, weighed
                             by --router-disk-cache-hit-weight (default off; $MARU_TIER2_CREDIT=1 turns
                             it on). What it changes: docs/whatif.md, "Beyond one domain"
  --maru-tier2-credit-max-chunks N
                             with it, credit at most N tier-2 chunks (default 16384; the least
                             recently announced are withdrawn first)
  --maru-chunk-tokens N      tokens per pool object (default: the connector's default); with a
                             --kv-transfer-config of your own, that configuration's value counts
  --no-maru-pool-events      keep the pool connector but do not announce the pool's blocks to the
                             router (it then sees vLLM's own events only; for comparisons)
  --no-maru-warmup           register with Dynamo as soon as the engine is up, without first
                             serving the warm-up requests (`maru_vllm.launch.warmup`): the first
                             requests then pay for what vLLM compiles lazily
  --no-maru-standby          a prefill or decode worker does not stand in for the other role when
                             no worker of that role is live (`maru_dynamo.components.disagg`);
                             without it, a disaggregated graph that loses a role fails requests
                             until one is back

On SIGTERM (a rolling restart, a Kubernetes pod stop) the worker leaves discovery at once, lets
its running requests finish for up to DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS (Dynamo's variable;
0 to 30, default 20 here; it ends as soon as nothing runs), hands what is left to the frontend's
request migration, commits its queued pool stores and exits 0. MARU_WORKER_INSTANCE_FILE=PATH:
it writes its Dynamo instance id there as it registers (the local graph runner's supervision).

PYTHONHASHSEED must be unset (then 0 is used) or "0", the graph's value. On a CPU install with
no KV cache size given it sets VLLM_CPU_KVCACHE_SPACE itself (`maru_vllm.launch.cpu_kv`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from maru_dynamo.components.vllm_worker import engine_args, start_worker_process
from maru_vllm.events.types import DEFAULT_MEDIUM, DEFAULT_TIER2_CREDIT_CHUNKS, POOL_MEDIUMS
from maru_vllm.launch.argv import flag_value, has_flag, kv_events_args
from maru_vllm.launch.handoff import run_module_then_exit
from maru_vllm.launch.ports import free_port
from maru_vllm.launch.warmup import WarmupOptions
from maru_vllm.pool.chunk_codec import DEFAULT_CHUNK_TOKENS

if TYPE_CHECKING:
    from maru_dynamo.components.dynamo_hooks import WorkerHooks
    from maru_vllm.launch.lifecycle import WorkerLifecycle

# Disaggregation modes the worker component knows (Dynamo's `--disaggregation-mode`). Every
# mode's connector loads and stores (`kv_both`): a prefill worker reuses prompts any worker stored,
# and a worker that stands in for the other role (`maru_dynamo.components.disagg`) serves whole
# requests. A prefill worker stores inline: its response is what sends the decode worker to the pool.
DISAGG_MODES = ("prefill", "decode")

logger = logging.getLogger(__name__)

TIER2_CREDIT_ENV = "MARU_TIER2_CREDIT"  # "1": --maru-tier2-credit unless --no-maru-tier2-credit


@dataclasses.dataclass(frozen=True)
class WorkerOptions:
    """The worker's own options, parsed once (`build`). What it hands vLLM (the connector's
    `--kv-transfer-config`), the pool event relay and the warm-up all derive from these."""

    maru_pool_address: str
    maru_pool_name: str | None
    maru_pool_token_file: str | None
    maru_event_medium: str
    maru_announce_max_chunks: int | None
    maru_tier2_credit: bool
    maru_tier2_credit_max_chunks: int
    # Tokens per pool object, as the connector takes them: the user's own --kv-transfer-config's
    # when one is given, else --maru-chunk-tokens.
    maru_chunk_tokens: int
    maru_pool_events: bool
    maru_warmup: bool
    maru_standby: bool
    mode: str | None  # --disaggregation-mode (or Dynamo's DYN_VLLM_DISAGGREGATION_MODE)

    def kv_transfer_config(self) -> dict[str, Any]:
        """MaruKVConnector's `--kv-transfer-config`: every role loads and stores; prefill stores inline."""
        extra: dict[str, Any] = {
            "maru_pool_address": self.maru_pool_address,
            "maru_kv_chunk_tokens": self.maru_chunk_tokens,
        }
        if self.mode == "prefill":
            extra["maru_store_inline"] = True
        if self.maru_pool_token_file:
            extra["maru_pool_token_file"] = self.maru_pool_token_file
        return {
            "kv_connector": "MaruKVConnector",
            "kv_connector_module_path": "maru_vllm.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }

    def relay(self, pool_name: str, token: str | None) -> dict[str, Any] | None:
        """The pool event relay's options (`relay_options` keywords); None without pool events."""
        if not self.maru_pool_events:
            return None
        return {
            "pool_name": pool_name,
            "pool_address": self.maru_pool_address,
            "pool_token": token,
            "medium": self.maru_event_medium,
            "max_announced_chunks": self.maru_announce_max_chunks,
            "tier2_credit_max_chunks": self.maru_tier2_credit_max_chunks if self.maru_tier2_credit else None,
        }

    def warmup(self) -> WarmupOptions | None:
        """Shorter than one pool chunk: warm-up prompts are never stored in the pool."""
        return WarmupOptions(max_prompt_tokens=self.maru_chunk_tokens - 1) if self.maru_warmup else None

    def hooks(self, lifecycle: WorkerLifecycle, relay: dict[str, Any] | None) -> WorkerHooks:
        """The hooks into `dynamo.vllm` these options ask for (`dynamo_hooks`)."""
        from maru_dynamo.components.dynamo_hooks import WorkerHooks

        return WorkerHooks(
            relay=relay,
            lifecycle=lifecycle,
            warmup=self.warmup(),
            standby=self.maru_standby and self.mode in DISAGG_MODES,
        )


def build(argv: list[str]) -> tuple[WorkerOptions, list[str]]:
    """(our options, the dynamo.vllm argv with connector and KV-event configs filled in)."""
    p = argparse.ArgumentParser(prog="maru_worker", add_help=False)
    p.add_argument("--maru-pool-address", required=True)
    p.add_argument("--maru-pool-name", default=None)
    p.add_argument("--maru-pool-token-file", default=None)
    p.add_argument("--maru-event-medium", default=DEFAULT_MEDIUM, choices=POOL_MEDIUMS)
    p.add_argument("--maru-announce-max-chunks", type=int, default=None, metavar="N")
    p.add_argument(
        "--maru-tier2-credit",
        action=argparse.BooleanOptionalAction,
        default=os.environ.get(TIER2_CREDIT_ENV, "").lower() in ("1", "true", "yes", "on"),
    )
    p.add_argument("--maru-tier2-credit-max-chunks", type=int, default=DEFAULT_TIER2_CREDIT_CHUNKS, metavar="N")
    p.add_argument("--maru-chunk-tokens", type=int, default=DEFAULT_CHUNK_TOKENS)
    p.add_argument("--maru-pool-events", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--maru-warmup", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--maru-standby", action=argparse.BooleanOptionalAction, default=True)
    ns, rest = p.parse_known_args(argv)
    if ns.maru_announce_max_chunks is not None and ns.maru_announce_max_chunks < 1:
        raise SystemExit(
            f"maru_worker: --maru-announce-max-chunks {ns.maru_announce_max_chunks}: must be a number of "
            "chunks >= 1 (leave it out to announce every chunk)"
        )
    if ns.maru_tier2_credit_max_chunks < 1:
        raise SystemExit(
            f"maru_worker: --maru-tier2-credit-max-chunks {ns.maru_tier2_credit_max_chunks}: must be a "
            "number of chunks >= 1"
        )
    rest = list(rest)
    theirs = _given_kv_transfer_config(rest)
    if theirs is not None:  # the connector runs with the user's own configuration: so does the warm-up
        ns.maru_chunk_tokens = _chunk_tokens_of(theirs, ns.maru_chunk_tokens)
    ours = WorkerOptions(**vars(ns), mode=disaggregation_mode(rest))
    if theirs is None:
        rest += ["--kv-transfer-config", json.dumps(ours.kv_transfer_config())]
    if not has_flag(rest, "--kv-events-config", "--kv_events_config"):
        rest += kv_events_args(free_port())
    return ours, rest


def _given_kv_transfer_config(argv: list[str]) -> str | None:
    if not has_flag(argv, "--kv-transfer-config", "--kv_transfer_config"):
        return None
    return flag_value(argv, "--kv-transfer-config") or flag_value(argv, "--kv_transfer_config") or ""


def _chunk_tokens_of(config: str, given: int) -> int:
    """The chunk size the connector takes from a user's `--kv-transfer-config` (its default where
    the configuration names none); `given` where it is not one of MaruKVConnector's."""
    try:
        parsed = json.loads(config)
    except ValueError:
        return given  # vLLM refuses it itself
    if not isinstance(parsed, dict) or parsed.get("kv_connector") != "MaruKVConnector":
        return given
    extra = parsed.get("kv_connector_extra_config") or {}
    value = extra.get("maru_kv_chunk_tokens", DEFAULT_CHUNK_TOKENS) if isinstance(extra, dict) else None
    return value if isinstance(value, int) and value > 0 else given


def disaggregation_mode(argv: list[str]) -> str | None:
    """The worker's `--disaggregation-mode` (or Dynamo's `DYN_VLLM_DISAGGREGATION_MODE`)."""
    return flag_value(argv, "--disaggregation-mode") or os.environ.get("DYN_VLLM_DISAGGREGATION_MODE")


def pool_token(token_file: str | None) -> str | None:
    """The token in `token_file` (None without one); SystemExit with one line when it is unusable."""
    if token_file is None:
        return None
    from maru_vllm.pool.auth import read_token_file
    from maru_vllm.pool.errors import PoolError

    try:
        return read_token_file(token_file)
    except PoolError as exc:
        raise SystemExit(f"maru_worker: --maru-pool-token-file: {exc}") from None


def resolve_pool_name(address: str, given: str | None, *, token: str | None = None, wait_s: float = 30.0) -> str:
    """The pool's name as its service reports it (stats); `given`, when set, must match it.

    Without `given` the pool must answer (within `wait_s`: a pool started just before its
    workers may still be starting). With `given` an unreachable pool is no error: the worker
    serves without it and the event relay catches up once it is there. Raises SystemExit with
    one line otherwise.
    """
    from maru_vllm.pool import PoolClient
    from maru_vllm.pool.errors import PoolError, PoolProtocolError

    deadline = time.monotonic() + (0.0 if given else wait_s)
    while True:
        try:
            with PoolClient.connect(address, token, timeout=5.0, heartbeat=False, populate=False) as client:
                actual = str(client.stats()["pool"])
            break
        except PoolProtocolError as exc:  # it answered and refused us (a wrong or missing token)
            raise SystemExit(f"maru_worker: the pool at {address} refused this worker: {exc}") from None
        except (PoolError, OSError, ValueError) as exc:
            if given:
                logger.warning(
                    "maru_worker: pool at %s not reachable (%s); using --maru-pool-name %s unchecked",
                    address,
                    exc,
                    given,
                )
                return given
            if time.monotonic() >= deadline:
                raise SystemExit(
                    f"maru_worker: cannot ask the pool at {address} for its name ({exc}); "
                    "start the pool first, or pass --maru-pool-name NAME"
                ) from None
            time.sleep(0.5)
    if given and given != actual:
        raise SystemExit(
            f"maru_worker: --maru-pool-name {given!r} does not match the pool at {address}, "
            f"which is named {actual!r}; pass --maru-pool-name {actual} or leave it out"
        )
    return actual


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    start_worker_process()  # before anything imports vLLM / Dynamo (`vllm_worker`'s start-up)
    from maru_vllm.launch.hash_seed import GRAPH_HASH_SEED, check_hash_seed

    try:
        check_hash_seed()
    except RuntimeError as exc:
        sys.exit(f"maru_worker: {exc}")
    os.environ["PYTHONHASHSEED"] = GRAPH_HASH_SEED
    ours, rest = build(argv)
    from maru_vllm.launch.lifecycle import INSTANCE_FILE_ENV, WorkerLifecycle, grace_seconds

    try:
        lifecycle = WorkerLifecycle(grace_seconds(), instance_file=_path_or_none(os.environ.get(INSTANCE_FILE_ENV)))
    except ValueError as exc:
        sys.exit(f"maru_worker: {exc}")
    rest = engine_args("maru_worker", rest)
    relay = None
    if ours.maru_pool_events:
        token = pool_token(ours.maru_pool_token_file)
        relay = ours.relay(resolve_pool_name(ours.maru_pool_address, ours.maru_pool_name, token=token), token)
    from maru_dynamo.components.dynamo_pd import DynamoPdApiError, register_maru_pd_protocol

    try:
        register_maru_pd_protocol()  # dynamo.vllm's PD handlers accept only registered connectors
    except DynamoPdApiError as exc:
        sys.exit(f"maru_worker: {exc}")
    from maru_dynamo.components.dynamo_hooks import DynamoSeamError, install_worker_hooks

    try:
        install_worker_hooks(ours.hooks(lifecycle, relay))  # every hook into dynamo.vllm, checked, in order
    except (DynamoSeamError, ValueError) as exc:
        sys.exit(f"maru_worker: {exc}")
    run_module_then_exit("dynamo.vllm", rest)


def _path_or_none(text: str | None) -> Path | None:
    return Path(text) if text else None


if __name__ == "__main__":
    main()
