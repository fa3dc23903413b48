"""The graph description: which services a Maru deployment runs, validated from YAML.

One small schema serves both the local runner (`graphs/run.py`) and the Kubernetes renderer
(`graphs/render.py`), so a graph is written once. Every error names the file, the field (as a
path like ``workers[1].role``), the bad value and what is allowed; unknown fields are errors
too, because a misspelt option that is silently ignored is worse than a refusal.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import yaml

from maru_vllm.pool.chunk_codec import DEFAULT_CHUNK_TOKENS
from maru_vllm.pool.errors import PoolError
from maru_vllm.pool.region import BACKENDS, parse_size, validate_pool_name
from maru_vllm.pool.tier2.mooncake import PROTOCOLS, validate_master, validate_metadata
from maru_vllm.routing import validate_weight

ROLES = ("agg", "prefill", "decode")
# maru: MaruKVConnector on the graph's pool (maru_worker); vllm: a plain dynamo.vllm worker (no pool).
ENGINES = ("maru", "vllm")
ROUTER_MODES = ("kv", "round-robin", "random", "power-of-two", "least-loaded", "direct", "device-aware-weighted")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
# Set by the graph itself; a copy in `args` would contradict it: flag -> the field that sets it.
_RESERVED_WORKER_ARGS = {
    "--disaggregation-mode": "role (agg, prefill, decode)",
    "--maru-pool-address": "the pool section",
    "--maru-pool-name": "the pool section",
    "--maru-chunk-tokens": "pool.chunk_tokens",
    "--tensor-parallel-size": "tensor_parallel_size",
    "-tp": "tensor_parallel_size",
}
MAX_TENSOR_PARALLEL_SIZE = 64

T = TypeVar("T")


class GraphSpecError(ValueError):
    """A graph file that cannot be used; the message says where and what is allowed."""


@dataclasses.dataclass(frozen=True)
class NatsSpec:
    url: str | None = None  # None: the local runner starts a nats-server; Kubernetes: the platform's


@dataclasses.dataclass(frozen=True)
class PoolSpec:
    name: str = "kv"
    size: int = 1 << 30
    backend: str = "shm"
    path: str | None = None
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS


@dataclasses.dataclass(frozen=True)
class MooncakeSpec:
    """The pools' second tier: a Mooncake Store. `master` None: the graph runs its own master."""

    master: str | None = None
    metadata: str | None = None
    protocol: str = "tcp"
    segment_size: int = 256 << 20  # what each pool contributes to the store


@dataclasses.dataclass(frozen=True)
class FrontendSpec:
    router_mode: str = "kv"
    pool_tier_weight: float | None = None  # None: maru_vllm.routing decides
    replicas: int = 1
    args: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    name: str
    role: str = "agg"
    replicas: int = 1
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    engine: str = "maru"
    domain: str | None = None  # the domain (pool) it uses, in a graph with `domains`
    tensor_parallel_size: int = 1  # its engine's ranks: cores locally, GPUs on Kubernetes


@dataclasses.dataclass(frozen=True)
class KubernetesSpec:
    """Settings that only a cluster deployment uses (a real model, GPUs, a bigger pool)."""

    model: str | None = None
    pool_size: int | None = None
    pool_backend: str | None = None
    pool_path: str | None = None
    gpus_per_rank: int = 1  # a worker gets tensor_parallel_size x this many GPUs; 0: CPU nodes
    http_port: int = 8000
    socket_dir: str = "/run/maru"


@dataclasses.dataclass(frozen=True)
class GraphSpec:
    name: str
    model: str
    workers: tuple[WorkerSpec, ...]
    nats: NatsSpec = NatsSpec()
    pool: PoolSpec = PoolSpec()
    frontend: FrontendSpec = FrontendSpec()
    kubernetes: KubernetesSpec = KubernetesSpec()
    source: str = "<graph>"
    mooncake: MooncakeSpec | None = None  # None: no second tier
    domains: tuple[str, ...] = ()  # one pool each ("<pool.name>-<domain>"); (): one pool

    def pool_name_of(self, domain: str | None) -> str:
        """The name of a domain's pool (the graph's one pool without domains)."""
        return self.pool.name if domain is None else f"{self.pool.name}-{domain}"

    @property
    def mode(self) -> str:
        """'disagg' when the graph has prefill/decode workers, else 'agg'."""
        return "disagg" if any(w.role != "agg" for w in self.workers) else "agg"


class _Fields:
    """Reads one mapping of the YAML, remembering its path for error messages."""

    def __init__(self, data: object, where: str, source: str, allowed: tuple[str, ...]) -> None:
        self.source, self.where = source, where
        if data is None:
            data = {}
        if not isinstance(data, dict):
            self.fail(where, data, "a mapping of " + ", ".join(allowed))
        unknown = sorted(str(k) for k in data if k not in allowed)
        if unknown:
            raise GraphSpecError(
                f"{source}: {self.path(unknown[0])}: unknown field; allowed fields: {', '.join(allowed)}"
            )
        self.data: dict[str, Any] = data

    def path(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def fail(self, path: str, value: object, allowed: str) -> NoReturn:
        raise GraphSpecError(f"{self.source}: {path or '<top level>'}: invalid value {value!r}: use {allowed}")

    def get(self, key: str, default: T, convert: Callable[[Any], T], allowed: str, required: bool = False) -> T:
        if key not in self.data or self.data[key] is None:
            if required:
                raise GraphSpecError(f"{self.source}: {self.path(key)}: missing; use {allowed}")
            return default
        value = self.data[key]
        try:
            return convert(value)
        except (ValueError, TypeError, PoolError):
            self.fail(self.path(key), value, allowed)
            raise AssertionError("unreachable") from None


def _text(value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError
    return value


def _dns_label(value: Any) -> str:
    if not isinstance(value, str) or not _DNS_LABEL.match(value):
        raise ValueError
    return value


def _choice(options: tuple[str, ...]) -> Callable[[Any], str]:
    def convert(value: Any) -> str:
        if value not in options:
            raise ValueError
        return str(value)

    return convert


def _int_in(lo: int, hi: int) -> Callable[[Any], int]:
    def convert(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ValueError
        return value

    return convert


def _size(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError
    size = parse_size(value if isinstance(value, int) else str(value))
    if size <= 0:
        raise ValueError
    return size


def _args(value: Any) -> tuple[str, ...]:
    """A list of command-line words; numbers are accepted (YAML reads `4096` as an int)."""
    if not isinstance(value, list) or not all(
        isinstance(a, (str, int, float)) and not isinstance(a, bool) for a in value
    ):
        raise ValueError
    return tuple(str(a) for a in value)


def _env(value: Any) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", k) and isinstance(v, (str, int, float))
        for k, v in value.items()
    ):
        raise ValueError
    return {k: str(v) for k, v in value.items()}


def _abs_path(value: Any) -> str:
    if not isinstance(value, str) or not value.startswith("/"):
        raise ValueError
    return value


def _nats_url(value: Any) -> str:
    if not isinstance(value, str) or not value.startswith(("nats://", "tls://", "ws://", "wss://")):
        raise ValueError
    return value


def _worker(data: object, where: str, source: str) -> WorkerSpec:
    f = _Fields(
        data, where, source, ("name", "role", "replicas", "args", "env", "engine", "domain", "tensor_parallel_size")
    )
    w = WorkerSpec(
        name=f.get("name", "", _dns_label, "a lowercase DNS label (a-z, 0-9, '-')", required=True),
        role=f.get("role", "agg", _choice(ROLES), "one of " + ", ".join(ROLES)),
        replicas=f.get("replicas", 1, _int_in(1, 64), "an integer from 1 to 64"),
        args=f.get("args", (), _args, "a list of command-line words for dynamo.vllm"),
        env=f.get("env", {}, _env, "a mapping of environment variable names to strings"),
        engine=f.get("engine", "maru", _choice(ENGINES), "one of " + ", ".join(ENGINES)),
        domain=f.get("domain", None, _dns_label, "a domain named in `domains`"),
        tensor_parallel_size=f.get(
            "tensor_parallel_size",
            1,
            _int_in(1, MAX_TENSOR_PARALLEL_SIZE),
            f"an integer from 1 to {MAX_TENSOR_PARALLEL_SIZE} (the engine's tensor-parallel ranks)",
        ),
    )
    if w.engine == "vllm" and w.role != "agg":
        raise GraphSpecError(f"{source}: {where}.engine: 'vllm' workers are agg only (role {w.role!r})")
    for arg in w.args:
        field = _RESERVED_WORKER_ARGS.get(arg.split("=", 1)[0])
        if field is not None:
            raise GraphSpecError(f"{source}: {where}.args: {arg!r} is set by the graph; use {field} instead")
    return w


def _mooncake(data: object, source: str) -> MooncakeSpec:
    f = _Fields(data, "mooncake", source, ("master", "metadata", "protocol", "segment_size"))
    return MooncakeSpec(
        master=f.get("master", None, validate_master, "HOST:PORT of a running mooncake_master (leave out to run one)"),
        metadata=f.get("metadata", None, validate_metadata, "http://HOST:PORT/metadata, etcd://..., P2PHANDSHAKE"),
        protocol=f.get("protocol", "tcp", _choice(PROTOCOLS), "one of " + ", ".join(PROTOCOLS)),
        segment_size=f.get("segment_size", 256 << 20, _size, "bytes or a size like 256M, 4G"),
    )


def _domains(value: Any) -> tuple[str, ...]:
    if not isinstance(value, list) or not value or len(set(value)) != len(value):
        raise ValueError
    return tuple(_dns_label(v) for v in value)


def _check_domains(spec: GraphSpec) -> None:
    source = spec.source
    for i, w in enumerate(spec.workers):
        if spec.domains and w.domain not in spec.domains:
            got = "none" if w.domain is None else repr(w.domain)
            raise GraphSpecError(
                f"{source}: workers[{i}].domain: {got} is not a domain of this graph; "
                f"use one of {', '.join(spec.domains)}"
            )
        if not spec.domains and w.domain is not None:
            raise GraphSpecError(f"{source}: workers[{i}].domain: the graph has no `domains`; leave it out")
    if spec.domains and spec.mode == "disagg":
        raise GraphSpecError(f"{source}: domains: a graph with domains has agg workers only")


def parse_graph(data: object, source: str = "<graph>") -> GraphSpec:
    """Validate a loaded YAML document into a `GraphSpec` (raises `GraphSpecError`)."""
    top = _Fields(
        data, "", source, ("name", "model", "nats", "pool", "frontend", "workers", "kubernetes", "mooncake", "domains")
    )
    nats = _Fields(top.data.get("nats"), "nats", source, ("url",))
    pool = _Fields(top.data.get("pool"), "pool", source, ("name", "size", "backend", "path", "chunk_tokens"))
    fe = _Fields(top.data.get("frontend"), "frontend", source, ("router_mode", "pool_tier_weight", "replicas", "args"))
    k8s = _Fields(
        top.data.get("kubernetes"),
        "kubernetes",
        source,
        ("model", "pool_size", "pool_backend", "pool_path", "gpus_per_rank", "http_port", "socket_dir"),
    )
    raw_workers = top.data.get("workers")
    if not isinstance(raw_workers, list) or not raw_workers:
        top.fail("workers", raw_workers, "a non-empty list of workers (name, role, replicas, args, env)")
    workers = tuple(_worker(w, f"workers[{i}]", source) for i, w in enumerate(raw_workers))
    names = [w.name for w in workers]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise GraphSpecError(f"{source}: workers[{i}].name: duplicate worker name {name!r}; names must be unique")
    roles = {w.role for w in workers}
    if roles & {"prefill", "decode"} and roles != {"prefill", "decode"}:
        raise GraphSpecError(
            f"{source}: workers: roles {sorted(roles)} do not make a graph: use only 'agg' workers, or at least "
            "one 'prefill' and one 'decode' worker (and no 'agg')"
        )
    weight_text = "a number from 0.0 to 1.0"
    spec = GraphSpec(
        name=top.get("name", "", _dns_label, "a lowercase DNS label (a-z, 0-9, '-'), e.g. maru-agg", required=True),
        model=top.get("model", "tiny", _text, "a fixture name (tiny, bench), a model directory or a Hugging Face id"),
        workers=workers,
        nats=NatsSpec(url=nats.get("url", None, _nats_url, "nats://host:port (or tls://, ws://, wss://)")),
        pool=PoolSpec(
            name=pool.get("name", "kv", validate_pool_name, "1-63 letters, digits, '.', '_', '-'"),
            size=pool.get("size", 1 << 30, _size, "bytes or a size like 512M, 4G"),
            backend=pool.get("backend", "shm", _choice(BACKENDS), "one of " + ", ".join(BACKENDS)),
            path=pool.get("path", None, _abs_path, "an absolute path (see docs/pool.md)"),
            chunk_tokens=pool.get("chunk_tokens", DEFAULT_CHUNK_TOKENS, _int_in(1, 1 << 20), "a positive integer"),
        ),
        frontend=FrontendSpec(
            router_mode=fe.get("router_mode", "kv", _choice(ROUTER_MODES), "one of " + ", ".join(ROUTER_MODES)),
            pool_tier_weight=fe.get("pool_tier_weight", None, lambda v: validate_weight(v, "weight"), weight_text),
            replicas=fe.get("replicas", 1, _int_in(1, 64), "an integer from 1 to 64"),
            args=fe.get("args", (), _args, "a list of command-line words for dynamo.frontend"),
        ),
        kubernetes=KubernetesSpec(
            model=k8s.get("model", None, _text, "a Hugging Face id or a path inside the image"),
            pool_size=k8s.get("pool_size", None, _size, "bytes or a size like 512M, 64G"),
            pool_backend=k8s.get("pool_backend", None, _choice(BACKENDS), "one of " + ", ".join(BACKENDS)),
            pool_path=k8s.get("pool_path", None, _abs_path, "an absolute path (/dev/shm/NAME or /dev/daxX.Y)"),
            gpus_per_rank=k8s.get(
                "gpus_per_rank", 1, _int_in(0, 1), "1 (one GPU per tensor-parallel rank) or 0 (CPU nodes)"
            ),
            http_port=k8s.get("http_port", 8000, _int_in(1, 65535), "a port from 1 to 65535"),
            socket_dir=k8s.get("socket_dir", "/run/maru", _abs_path, "an absolute directory path"),
        ),
        source=source,
        mooncake=_mooncake(top.data["mooncake"] or {}, source) if "mooncake" in top.data else None,
        domains=top.get("domains", (), _domains, "a list of distinct lowercase DNS labels, one per pool"),
    )
    _check_domains(spec)
    if spec.pool.backend != "shm" and spec.pool.path is None:
        raise GraphSpecError(
            f"{source}: pool.path: missing; backend {spec.pool.backend!r} needs a path "
            "(a /dev/daxX.Y device or a file on a DAX or hugetlbfs mount)"
        )
    return spec


def load_graph(path: str | Path) -> GraphSpec:
    """Read and validate a graph file (raises `GraphSpecError` with the file name)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise GraphSpecError(f"{p}: cannot read the graph file: {exc.strerror or exc}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise GraphSpecError(f"{p}: not valid YAML: {exc}") from exc
    return parse_graph(data, str(p))


def resolve_graph_path(name: str) -> Path:
    """A graph file path, or the name of a bundled graph (`agg`, `disagg`, `agg.yaml`)."""
    p = Path(name)
    if p.exists():
        return p
    bundled = Path(__file__).resolve().parent / (name if name.endswith(".yaml") else f"{name}.yaml")
    if "/" not in name and bundled.exists():
        return bundled
    available = sorted(x.stem for x in Path(__file__).resolve().parent.glob("*.yaml"))
    raise GraphSpecError(f"{name}: no such graph file (bundled graphs: {', '.join(available)})")
