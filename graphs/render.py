"""`maru-dynamo graph render GRAPH --image IMG`: a graph file as Kubernetes manifests.

The Helm chart in deploy/k8s is the single source of the objects: this module only turns a
graph file (graphs/spec.py) into values for that chart and has the real Helm engine render it
(graphs/helm.py). So `graph render agg --image IMG` and `helm template maru-agg deploy/k8s
--set image=IMG` print the same objects, and there is nothing to keep in step. The objects:

* a ConfigMap with the environment every Maru process shares (pool address and name, NATS,
  PYTHONHASHSEED=0, the NATS event plane, optionally the pool tier weight);
* a DaemonSet running the pool service on every pool node: the KV pool is one shared-memory
  region per host, so it cannot be a Dynamo component (the operator runs those as Deployments);
* a DynamoGraphDeployment (nvidia.com/v1beta1) with the frontend and the Maru workers, which
  mount the pool's region and socket directory and are scheduled next to a pool pod;
* optionally a metrics Service and ServiceMonitor for the pool (chart value
  metrics.serviceMonitor.enabled, e.g. from --values);
* with a `mooncake:` section, the pools' second tier: every pool is a Mooncake Store client
  (`--mooncake-master`), and with no `mooncake.master` a mooncake_master Deployment + Service.
  Each node's pool is one domain, so a graph's `domains` (a local notion: several pools on one
  machine) render as the one pool DaemonSet.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from maru_dynamo.graphs import helm
from maru_dynamo.graphs.spec import GraphSpec, GraphSpecError

DEFAULT_NAMESPACE = "default"  # as `helm template` without --namespace
_SIZE_UNITS = (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10))
_WORKER_TYPE = {"agg": "worker", "prefill": "prefill", "decode": "decode"}  # graph role -> DGD type


@dataclasses.dataclass(frozen=True)
class RenderOptions:
    image: str
    namespace: str = DEFAULT_NAMESPACE
    model: str | None = None
    nats_url: str | None = None
    # Chart values layered over the graph's, in order (like `helm template -f A -f B`).
    values: tuple[Mapping[str, Any], ...] = ()


def size_text(nbytes: int) -> str:
    """Bytes as the pool's --size syntax, e.g. 34359738368 -> '32G' (exact units only)."""
    for suffix, unit in _SIZE_UNITS:
        if nbytes % unit == 0:
            return f"{nbytes // unit}{suffix}"
    return str(nbytes)


def _model(spec: GraphSpec, opts: RenderOptions) -> str:
    from maru_vllm.fixtures.models import SPECS

    model = opts.model or spec.kubernetes.model or spec.model
    if model in SPECS:
        raise GraphSpecError(
            f"{spec.source}: model {model!r} is an offline test fixture built on the local machine; a cluster needs "
            "a model every pod can load: set kubernetes.model in the graph or pass --model (HF id or path in the image)"
        )
    return model


def merge_values(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Helm's rule for several values files: maps merge key by key, anything else is replaced."""
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge_values(out[key], value)
        else:
            out[key] = value
    return out


def chart_values(spec: GraphSpec, opts: RenderOptions) -> dict[str, Any]:
    """The chart values that describe `spec` (deploy/k8s/values.yaml documents each key)."""
    if not opts.image:
        raise GraphSpecError("--image: missing; use the container image built from deploy/Dockerfile")
    for i, w in enumerate(spec.workers):
        if w.engine != "maru":
            raise GraphSpecError(
                f"{spec.source}: workers[{i}].engine: {w.engine!r} runs locally only; the chart runs 'maru'"
            )
    k8s = spec.kubernetes
    backend = k8s.pool_backend or spec.pool.backend
    path = k8s.pool_path or (spec.pool.path if backend == spec.pool.backend else None)
    weight = spec.frontend.pool_tier_weight
    values: dict[str, Any] = {
        "image": opts.image,
        "model": _model(spec, opts),
        "pool": {
            "name": spec.pool.name,
            "size": size_text(k8s.pool_size or spec.pool.size),
            "backend": backend,
            "path": path or "",
            "socketDir": k8s.socket_dir,
            "chunkTokens": spec.pool.chunk_tokens,
        },
        "frontend": {
            "replicas": spec.frontend.replicas,
            "routerMode": spec.frontend.router_mode,
            "httpPort": k8s.http_port,
            "poolTierWeight": "" if weight is None else weight,
            "args": list(spec.frontend.args),
        },
        "graph": spec.mode,
        "workers": {
            spec.mode: [
                {
                    "name": w.name,
                    "type": _WORKER_TYPE[w.role],
                    "replicas": w.replicas,
                    "tensorParallelSize": w.tensor_parallel_size,
                    "gpus": w.tensor_parallel_size * k8s.gpus_per_rank,
                    "args": list(w.args),
                    "env": dict(w.env),
                }
                for w in spec.workers
            ]
        },
    }
    if spec.mooncake is not None:
        values["mooncake"] = {
            "enabled": spec.mooncake.master is None,
            "master": spec.mooncake.master or "",
            "metadata": spec.mooncake.metadata or "",
            "protocol": spec.mooncake.protocol,
            "segmentSize": size_text(spec.mooncake.segment_size),
        }
    nats_url = opts.nats_url or spec.nats.url
    if nats_url:
        values["nats"] = {"url": nats_url}
    for extra in opts.values:
        values = merge_values(values, extra)
    return values


def render_yaml(spec: GraphSpec, opts: RenderOptions) -> str:
    """The manifests of `spec`, as `helm template <graph name> deploy/k8s` prints them."""
    manifest = helm.template(chart_values(spec, opts), release=spec.name, namespace=opts.namespace)
    header = (
        f"# Rendered by `maru-dynamo graph render` from {spec.source} with the chart deploy/k8s "
        f"(Helm {helm.engine_version()}); apply in this order.\n"
    )
    return header + manifest.lstrip("\n")
