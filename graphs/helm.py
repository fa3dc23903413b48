"""The real Helm engine on the bundled chart: `helm template` and `helm lint`, without a helm binary.

The chart in deploy/k8s is the one description of the Kubernetes objects of a Maru graph
(`graph render` only turns a graph file into chart values), so rendering it must be Helm
itself, not a look-alike. Helm is not packaged for Debian or shipped as a binary on PyPI;
`helm-python-sdk` bundles Helm v4's Go SDK as a C library, and its client-side dry-run install
is exactly what `helm template` runs (render, order by kind, no cluster contacted). (PyPI's
`helm-sdkpy` also bundles Helm v4, but needs Python >= 3.12 and offers `lint` and cluster
installs only, no client-side render; helm-python-sdk runs on this project's Python 3.11.)
"""

from __future__ import annotations

from importlib import util
from pathlib import Path
from typing import Any


class HelmUnavailable(RuntimeError):
    """The Helm engine (helm-python-sdk) is not installed."""


class ChartError(ValueError):
    """Helm refused the chart or the values; the message is Helm's own."""


def _helm() -> Any:
    try:
        import helm_python
    except ImportError as exc:
        raise HelmUnavailable(
            "the Helm engine is not installed: pip install 'maru-dynamo[k8s]' "
            "(helm-python-sdk, Helm v4's SDK as a library)"
        ) from exc
    return helm_python


def chart_dir() -> Path:
    """deploy/k8s, installed with the package as `maru_dynamo.chart` (a data-only namespace package)."""
    spec = util.find_spec("maru_dynamo.chart")
    for location in (spec.submodule_search_locations or []) if spec else []:
        if (Path(location) / "Chart.yaml").is_file():
            return Path(location)
    raise HelmUnavailable("the chart maru_dynamo.chart (deploy/k8s) is not installed with this package")


def engine_version() -> str:
    return str(_helm().helm_sdk_version())


def template(values: dict[str, Any], *, release: str, namespace: str, chart: Path | None = None) -> str:
    """What `helm template RELEASE CHART --namespace NS -f values` prints."""
    helm = _helm()
    try:
        with helm.Config(namespace=namespace, storage_driver="memory") as cfg:
            result = cfg.install(str(chart or chart_dir()), release, values, namespace=namespace, dry_run="client")
    except helm.HelmError as exc:
        raise ChartError(str(exc).strip()) from exc
    return str(result["manifest"])


def lint(values: dict[str, Any] | None = None, *, chart: Path | None = None, strict: bool = True) -> list[str]:
    """`helm lint --strict`: the findings that are warnings or errors, as 'SEVERITY path: message'."""
    report = _helm().lint(str(chart or chart_dir()), values, strict=strict)
    names = {2: "WARNING", 3: "ERROR"}
    found = [
        f"{names[m['severity']]} {m['path']}: {m['error']}"
        for m in report.get("messages", [])
        if m.get("severity") in names
    ]
    return found + [f"ERROR {e}" for e in report.get("errors", []) if not any(e in f for f in found)]
