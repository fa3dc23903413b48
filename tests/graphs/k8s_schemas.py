"""Real schemas for rendered manifests: the upstream DynamoGraphDeployment CRD and Kubernetes' OpenAPI.

* DynamoGraphDeployment: the v1beta1 `openAPIV3Schema` of the operator's CRD
  (../shared/k8s-schemas/, see its README), checked with `jsonschema`. The API server prunes
  unknown fields instead of refusing them, and the CRD sets no `additionalProperties: false`,
  so every object schema that lists its properties is closed here: a misspelt key fails
  instead of vanishing. Subtrees the CRD marks `x-kubernetes-preserve-unknown-fields` stay open;
  CEL rules (`x-kubernetes-validations`) are the API server's and are not evaluated.
* Core objects (ConfigMap, DaemonSet, Service) and each DGD component's podTemplate (as a
  v1 PodTemplate): `kubernetes-validate` in strict mode (closed objects) for the oldest
  Kubernetes the chart supports and the newest the package knows.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

ROOT = Path(__file__).resolve().parents[2]
DGD_CRD = ROOT.parent / "shared" / "k8s-schemas" / "dynamographdeployments.nvidia.com.yaml"
KUBE_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())
_OPEN = "x-kubernetes-preserve-unknown-fields"


class ManifestError(AssertionError):
    """A rendered object that its schema refuses; the message names the object and the field."""


def _close(schema: Any) -> Any:
    """Every object schema with `properties` gets `additionalProperties: false` (unless kept open)."""
    if isinstance(schema, dict):
        if "properties" in schema and "additionalProperties" not in schema and not schema.get(_OPEN):
            schema["additionalProperties"] = False
        for key, value in schema.items():
            if key != "enum":
                _close(value)
    elif isinstance(schema, list):
        for item in schema:
            _close(item)
    return schema


@functools.cache
def dgd_validator(version: str = "v1beta1") -> jsonschema.protocols.Validator:
    if not DGD_CRD.is_file():
        raise FileNotFoundError(f"{DGD_CRD}: the upstream DynamoGraphDeployment CRD (shared/k8s-schemas) is missing")
    crd = yaml.load(DGD_CRD.read_text(encoding="utf-8"), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    (entry,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = _close(copy.deepcopy(entry["schema"]["openAPIV3Schema"]))
    # OpenAPI 3.0 schema objects follow draft 4 (boolean exclusiveMinimum and friends).
    return jsonschema.Draft4Validator(schema)


def _where(error: jsonschema.ValidationError) -> str:
    return "/".join(str(p) for p in error.absolute_path) or "<root>"


def validate_dgd(doc: dict[str, Any]) -> None:
    """Raise ManifestError when the CRD's (closed) v1beta1 schema refuses `doc`."""
    version = doc.get("apiVersion", "").rpartition("/")[2]
    errors = sorted(dgd_validator(version).iter_errors(doc), key=lambda e: list(e.absolute_path))
    if errors:
        raise ManifestError(
            "DynamoGraphDeployment {}: {}".format(
                doc.get("metadata", {}).get("name"), "; ".join(f"{_where(e)}: {e.message}" for e in errors[:5])
            )
        )


def validate_core(doc: dict[str, Any]) -> None:
    """Raise ManifestError when Kubernetes' strict OpenAPI schema refuses `doc` (every KUBE_VERSIONS)."""
    for version in KUBE_VERSIONS:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            # It is a jsonschema.ValidationError carrying the failing path and message.
            raise ManifestError(
                f"{doc['kind']} {doc['metadata'].get('name')} (Kubernetes {version}): {_where(exc)}: {exc.message}"
            ) from exc


def validate_manifest(doc: dict[str, Any]) -> None:
    """The right real schema for each kind this chart renders."""
    if doc["kind"] == "DynamoGraphDeployment":
        validate_dgd(doc)
        for component in doc["spec"]["components"]:
            validate_core(
                {
                    "apiVersion": "v1",
                    "kind": "PodTemplate",
                    "metadata": {"name": f"{doc['metadata']['name']}-{component['name'].lower()}"},
                    "template": component["podTemplate"],
                }
            )
    elif doc["kind"] == "ServiceMonitor":
        # prometheus-operator's CRD is not available here; its shape is asserted by the tests.
        return
    elif doc["kind"] == "PrometheusRule":
        from tests.graphs.prom_rules import validate_prometheus_rule  # it imports ManifestError from here

        validate_prometheus_rule(doc)
    else:
        validate_core(doc)
