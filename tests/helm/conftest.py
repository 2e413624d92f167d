"""Render the Helm chart offline (helm-python-sdk: Helm's Go SDK, no helm binary, no
cluster) and validate what it renders against the schemas a cluster would apply.

    render(values)            -> {kind: [manifest, ...]}
    validate_crd(doc, schema) -> None (raises): jsonschema against a CRD's
                                 openAPIV3Schema, after applying its defaults
    crd_schema(kind)          -> the openAPIV3Schema of RayService, RayCluster (the
                                 shared KubeRay v1.7 CRDs), ServiceMonitor,
                                 PrometheusRule (vendored in tests/helm/crds)
"""

from __future__ import annotations

import copy
import functools
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

helm = pytest.importorskip("helm_python")

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "spur"
# shared/ lies beside the checkout (CI's clone, the main checkout); a worktree one level
# deeper finds it one level up.
KUBERAY_DIRS = [
    REPO.parent / "shared" / "schemas" / "kuberay",
    REPO.parents[1] / "shared" / "schemas" / "kuberay",
]
VENDORED = Path(__file__).resolve().parent / "crds"
KUBE_VERSION = "1.33.0"
"""Kubernetes version the built-in kinds are validated for (kubernetes-validate)."""


def _load_yaml(path: Path) -> Any:
    """YAML through libyaml: the KubeRay CRDs take seconds in pure Python."""
    return yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


@functools.cache
def _kuberay_schema(file: str) -> dict[str, Any]:
    found = [d / file for d in KUBERAY_DIRS if (d / file).is_file()]
    if not found:
        raise FileNotFoundError(
            f"KubeRay CRD {file} not found in {', '.join(map(str, KUBERAY_DIRS))}: "
            "the chart tests need shared/schemas/kuberay beside the checkout"
        )
    crd = _load_yaml(found[0])
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return version["schema"]["openAPIV3Schema"]


@functools.cache
def crd_schema(kind: str) -> dict[str, Any]:
    """The openAPIV3Schema of a custom resource kind the chart renders."""
    if kind == "RayService":
        return _kuberay_schema("ray.io_rayservices.yaml")
    if kind == "RayCluster":
        return _kuberay_schema("ray.io_rayclusters.yaml")
    files = {
        "ServiceMonitor": "monitoring.coreos.com_servicemonitors.yaml",
        "PrometheusRule": "monitoring.coreos.com_prometheusrules.yaml",
    }
    return _load_yaml(VENDORED / files[kind])["openAPIV3Schema"]


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """A copy of `value` with the schema's defaults filled in, as the API server does
    before validating (structural schemas: properties, items, additionalProperties)."""
    value = copy.deepcopy(value)
    _fill(schema, value)
    return value


def _fill(schema: dict[str, Any], value: Any) -> None:
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                _fill(sub, value[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in set(value) - set(schema.get("properties", {})):
                _fill(extra, value[key])
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            _fill(schema["items"], item)


def validate_crd(doc: dict[str, Any], schema: dict[str, Any]) -> None:
    """Validate like the API server would (defaults first). Raises jsonschema's
    ValidationError with the failing path."""
    jsonschema.Draft7Validator(schema).validate(apply_defaults(schema, doc))


@pytest.fixture(scope="session")
def chart() -> Iterator[Any]:
    with helm.Chart.load(str(CHART)) as loaded:
        yield loaded


def render_with(chart: Any, values: dict[str, Any] | None) -> dict[str, list[dict[str, Any]]]:
    """Render as `helm install spur` would (schema validation included); manifests by kind."""
    out: dict[str, list[dict[str, Any]]] = {}
    for name, text in chart.render(values or {}, name="spur", namespace="llm").items():
        if name.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                out.setdefault(doc["kind"], []).append(doc)
    return out


@pytest.fixture
def render(chart: Any) -> Any:
    return lambda values=None: render_with(chart, values)


@pytest.fixture
def chart_copy(tmp_path: Path) -> Path:
    """A copy of the chart to add files to (dashboards, alerts)."""
    target = tmp_path / "spur"
    shutil.copytree(CHART, target)
    return target
