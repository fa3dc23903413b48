"""`maru-dynamo graph render GRAPH --image IMG`: the graph as Kubernetes manifests.

Three objects, in the order to apply them:

* a ConfigMap with the environment every Maru process shares (pool address and name, NATS,
  PYTHONHASHSEED=0, the NATS event plane, optionally the pool tier weight);
* a DaemonSet running the pool service on every node: the KV pool is per host (one shared
  memory region), so it cannot be a Dynamo component, which the operator runs as Deployments;
* a DynamoGraphDeployment (nvidia.com/v1alpha1) with the frontend and the Maru workers. The
  workers mount the same host paths as the pool: the region (host /dev/shm, a DAX device or a
  DAX/hugetlbfs directory) and the directory of its unix socket.

deploy/k8s/ holds the same objects as a Helm chart; tests/graphs/test_render.py keeps the two
in step.
"""

from __future__ import annotations

import dataclasses
import posixpath
from typing import Any

import yaml

from maru_dynamo.graphs.spec import GraphSpec, GraphSpecError, WorkerSpec

API_VERSION = "nvidia.com/v1alpha1"
DEFAULT_NATS_URL = "nats://dynamo-platform-nats:4222"  # the Dynamo platform chart's NATS service
POOL_METRICS_PORT = 9400
_SIZE_UNITS = (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10))


@dataclasses.dataclass(frozen=True)
class RenderOptions:
    image: str
    namespace: str | None = None
    model: str | None = None
    nats_url: str | None = None


def size_text(nbytes: int) -> str:
    """Bytes as the pool's --size syntax, e.g. 34359738368 -> '32G' (exact units only)."""
    for suffix, unit in _SIZE_UNITS:
        if nbytes % unit == 0:
            return f"{nbytes // unit}{suffix}"
    return str(nbytes)


def service_name(worker: WorkerSpec) -> str:
    """DGD service name of a worker: 'worker' -> MaruWorker, 'prefill' -> MaruPrefillWorker."""
    camel = "".join(part.capitalize() for part in worker.name.split("-"))
    return f"Maru{camel}" if camel.endswith("Worker") else f"Maru{camel}Worker"


@dataclasses.dataclass(frozen=True)
class _Pool:
    name: str
    size: str
    backend: str
    path: str
    socket_dir: str

    @property
    def address(self) -> str:
        return f"unix://{self.socket_dir}/{self.name}.sock"

    def volumes(self) -> list[dict[str, Any]]:
        if self.backend == "shm":
            region = {"path": "/dev/shm", "type": "Directory"}
        elif self.backend == "dax":
            region = {"path": self.path, "type": "CharDevice"}
        else:
            region = {"path": posixpath.dirname(self.path), "type": "Directory"}
        return [{"name": "maru-region", "hostPath": region},
                {"name": "maru-socket", "hostPath": {"path": self.socket_dir, "type": "DirectoryOrCreate"}}]

    def mounts(self) -> list[dict[str, Any]]:
        return [{"name": v["name"], "mountPath": v["hostPath"]["path"]} for v in self.volumes()]


def _pool(spec: GraphSpec) -> _Pool:
    k8s = spec.kubernetes
    backend = k8s.pool_backend or spec.pool.backend
    path = k8s.pool_path or (spec.pool.path if backend == spec.pool.backend else None)
    if path is None:
        if backend != "shm":
            raise GraphSpecError(f"{spec.source}: kubernetes.pool_path: missing; backend {backend!r} needs the "
                                 "device or file path on the nodes")
        path = f"/dev/shm/maru-{spec.pool.name}"
    return _Pool(spec.pool.name, size_text(k8s.pool_size or spec.pool.size), backend, path, k8s.socket_dir)


def _labels(spec: GraphSpec, component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": "maru-dynamo", "app.kubernetes.io/instance": spec.name,
            "app.kubernetes.io/component": component}


def _meta(name: str, opts: RenderOptions, labels: dict[str, str]) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if opts.namespace:
        meta["namespace"] = opts.namespace
    meta["labels"] = labels
    return meta


def _model(spec: GraphSpec, opts: RenderOptions) -> str:
    from maru_vllm.models import SPECS

    model = opts.model or spec.kubernetes.model or spec.model
    if model in SPECS:
        raise GraphSpecError(
            f"{spec.source}: model {model!r} is an offline test fixture built on the local machine; a cluster needs "
            "a model every pod can load: set kubernetes.model in the graph or pass --model (HF id or path in the image)")
    return model


def render(spec: GraphSpec, opts: RenderOptions) -> list[dict[str, Any]]:
    """The ConfigMap, the pool DaemonSet and the DynamoGraphDeployment of `spec`."""
    if not opts.image:
        raise GraphSpecError("--image: missing; use the container image with maru-dynamo, Dynamo and vLLM")
    pool = _pool(spec)
    model = _model(spec, opts)
    config_name = f"{spec.name}-config"
    env_from = [{"configMapRef": {"name": config_name}}]
    privileged = {"securityContext": {"privileged": True}} if pool.backend == "dax" else {}

    data = {"MARU_POOL_ADDRESS": pool.address, "MARU_POOL_NAME": pool.name,
            "NATS_SERVER": opts.nats_url or spec.nats.url or DEFAULT_NATS_URL,
            "DYN_EVENT_PLANE": "nats", "PYTHONHASHSEED": "0"}
    if spec.frontend.pool_tier_weight is not None:
        data["MARU_POOL_TIER_WEIGHT"] = repr(spec.frontend.pool_tier_weight)
    config_map = {"apiVersion": "v1", "kind": "ConfigMap",
                  "metadata": _meta(config_name, opts, _labels(spec, "config")), "data": data}

    pool_labels = _labels(spec, "pool")
    pool_container = {
        "name": "pool", "image": opts.image,
        "command": ["python3", "-m", "maru_dynamo.components.pool"],
        "args": ["--name", pool.name, "--size", pool.size, "--backend", pool.backend, "--path", pool.path,
                 "--listen", pool.address, "--nats", data["NATS_SERVER"],
                 "--metrics-port", str(POOL_METRICS_PORT), "--metrics-host", "0.0.0.0"],
        "envFrom": env_from,
        "ports": [{"name": "metrics", "containerPort": POOL_METRICS_PORT}],
        "readinessProbe": {"exec": {"command": ["python3", "-m", "maru_vllm.pool", "status",
                                                "--address", pool.address]},
                           "periodSeconds": 10},
        "volumeMounts": pool.mounts(),
        **privileged,
    }
    daemon_set = {
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": _meta(f"{spec.name}-pool", opts, pool_labels),
        "spec": {"selector": {"matchLabels": pool_labels},
                 "template": {"metadata": {"labels": pool_labels},
                              "spec": {"containers": [pool_container], "volumes": pool.volumes()}}},
    }

    services: dict[str, Any] = {
        "Frontend": {
            "componentType": "frontend",
            "replicas": spec.frontend.replicas,
            "extraPodSpec": {"mainContainer": {
                "image": opts.image,
                "command": ["python3", "-m", "maru_dynamo.components.frontend"],
                "args": ["--http-port", str(spec.kubernetes.http_port), "--router-mode", spec.frontend.router_mode,
                         *spec.frontend.args],
                "envFrom": env_from,
            }},
        }
    }
    for worker in spec.workers:
        svc: dict[str, Any] = {"componentType": "worker"}
        if worker.role != "agg":
            svc["subComponentType"] = worker.role
        svc["replicas"] = worker.replicas
        if spec.kubernetes.gpus_per_worker:
            svc["resources"] = {"limits": {"gpu": str(spec.kubernetes.gpus_per_worker)}}
        if pool.backend == "shm":
            # The region lives in the host's /dev/shm, mounted below; no private tmpfs over it.
            svc["sharedMemory"] = {"disabled": True}
        if worker.env:
            svc["envs"] = [{"name": k, "value": v} for k, v in sorted(worker.env.items())]
        svc["extraPodSpec"] = {
            "volumes": pool.volumes(),
            "mainContainer": {
                "image": opts.image,
                "command": ["python3", "-m", "maru_dynamo.components.maru_worker"],
                "args": ["--model", model, "--maru-pool-address", pool.address, "--maru-pool-name", pool.name,
                         "--maru-chunk-tokens", str(spec.pool.chunk_tokens), "--disaggregation-mode", worker.role,
                         *worker.args],
                "envFrom": env_from,
                "volumeMounts": pool.mounts(),
                **privileged,
            },
        }
        services[service_name(worker)] = svc
    dgd = {"apiVersion": API_VERSION, "kind": "DynamoGraphDeployment",
           "metadata": _meta(spec.name, opts, _labels(spec, "graph")),
           "spec": {"backendFramework": "vllm", "services": services}}
    return [config_map, daemon_set, dgd]


class _PlainDumper(yaml.SafeDumper):
    """No `&id001` anchors for repeated lists: the output is read by people and kubectl alike."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def render_yaml(spec: GraphSpec, opts: RenderOptions) -> str:
    header = f"# Rendered by `maru-dynamo graph render` from {spec.source}; apply in this order.\n"
    return header + yaml.dump_all(render(spec, opts), Dumper=_PlainDumper, sort_keys=False, default_flow_style=False)
