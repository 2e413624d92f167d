"""The Helm chart (helm/spur): every preset renders a RayService that KubeRay's CRD,
Ray Serve's schema and Kubernetes' own schemas accept, derived from the spur config
without a second copy of it; bad values fail at install time with a message.

Rendering is offline (helm-python-sdk: Helm's Go SDK, no helm binary, no cluster).
Custom resources validate with jsonschema against their CRD's openAPIV3Schema after
its defaults are applied (KubeRay v1.7 RayService / RayCluster from shared/; the
Prometheus Operator's ServiceMonitor / PrometheusRule vendored in tests/helm/crds),
built-in kinds with kubernetes-validate.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from ray._common.utils import import_attr
from ray.serve import Application
from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
from ray.serve.schema import DeploymentSchema, ServeApplicationSchema, ServeDeploySchema

from spur.cluster.app import DRAIN_MARGIN_S
from spur.configs import helm as chart_files
from spur.configs.loader import PRESETS, load_config, parse_config, preset_path
from spur.configs.schema import LaneConfig, SpareConfig, SpurConfig

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


def unknown_fields(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """Fields the schema does not declare. The API server drops them from a custom
    resource (structural pruning) instead of refusing it, so a misspelt field would
    vanish; `kubectl apply --validate=strict` reports them."""
    found: list[str] = []
    if isinstance(value, dict):
        props = schema.get("properties")
        extra = schema.get("additionalProperties")
        for key, sub in value.items():
            if props is not None and key in props:
                found += unknown_fields(props[key], sub, f"{path}.{key}")
            elif isinstance(extra, dict):
                found += unknown_fields(extra, sub, f"{path}.{key}")
            elif props is not None and not schema.get("x-kubernetes-preserve-unknown-fields"):
                found.append(f"{path}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            found += unknown_fields(schema["items"], item, f"{path}[{i}]")
    return found


def validate_crd(doc: dict[str, Any], schema: dict[str, Any]) -> None:
    """Validate like the API server would (defaults first), and refuse undeclared fields
    as strict field validation does. Raises jsonschema's ValidationError."""
    jsonschema.Draft7Validator(schema).validate(apply_defaults(schema, doc))
    unknown = unknown_fields(schema, doc)
    if unknown:
        raise jsonschema.ValidationError(f"unknown fields: {', '.join(unknown)}")


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


EXTRA_GRACE = 30  # values.yaml: drain.extraGraceSeconds


def example_values(preset: str) -> dict[str, Any]:
    """The chart's example values file of a preset, parsed as Helm parses `-f` files."""
    return helm.values_from_yaml((CHART / "examples" / f"{preset}.yaml").read_text())


def the(docs: dict[str, list[dict[str, Any]]], kind: str) -> dict[str, Any]:
    (doc,) = docs[kind]
    return doc


def serve_config(rayservice: dict[str, Any]) -> dict[str, Any]:
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"])


def embedded_config(rayservice: dict[str, Any]) -> SpurConfig:
    """The config the application builder will get, parsed with spur's own code."""
    from spur.cluster.entry import config_from_args

    (app,) = serve_config(rayservice)["applications"]
    return config_from_args(app["args"])


def validate_serve_config(serve: dict[str, Any]) -> None:
    """ServeDeploySchema, plus what it lets through: Serve's schemas ignore unknown keys,
    so a misspelt option would be dropped silently."""
    ServeDeploySchema.model_validate(serve)
    assert set(serve) <= set(ServeDeploySchema.model_fields)
    for app in serve["applications"]:
        assert set(app) <= set(ServeApplicationSchema.model_fields), app.keys()
        for deployment in app.get("deployments", []):
            assert set(deployment) <= set(DeploymentSchema.model_fields), deployment.keys()


def validate_everything(docs: dict[str, list[dict[str, Any]]]) -> None:
    """Every manifest against the schema a cluster would check it with."""
    for kind, manifests in docs.items():
        for doc in manifests:
            if kind == "RayService":
                validate_crd(doc, crd_schema("RayService"))
                cluster = {
                    "apiVersion": "ray.io/v1",
                    "kind": "RayCluster",
                    "metadata": {"name": doc["metadata"]["name"]},
                    "spec": doc["spec"]["rayClusterConfig"],
                }
                validate_crd(cluster, crd_schema("RayCluster"))
                validate_serve_config(serve_config(doc))
            elif kind in ("ServiceMonitor", "PrometheusRule"):
                validate_crd(doc, crd_schema(kind))
            else:
                kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def check_groups(rayservice: dict[str, Any], cfg: SpurConfig) -> None:
    """Worker groups, Serve deployments and pod settings follow the config."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    sources: list[LaneConfig | SpareConfig] = list(cfg.lanes)
    if cfg.spare is not None:
        sources.append(cfg.spare)
    assert list(groups) == [s.name for s in sources]
    deployments = {d["name"]: d for d in serve_config(rayservice)["applications"][0]["deployments"]}
    assert deployments["ingress"]["num_replicas"] == cfg.server.ingress_replicas
    for source in sources:
        group = groups[source.name]
        scaling = getattr(source, "autoscaling", None)
        fixed = getattr(source, "replicas", 1)
        low, high = (scaling.min_replicas, scaling.max_replicas) if scaling else (fixed, fixed)
        assert (group["minReplicas"], group["maxReplicas"], group["replicas"]) == (low, high, low)
        # What the config asks for, nothing more: a resource only the group had would
        # pin nothing (the app's replicas do not ask for it).
        want_resources = {k: str(int(v) if v == int(v) else v) for k, v in source.resources.items()}
        assert group.get("resources", {}) == want_resources
        pod = group["template"]["spec"]
        (container,) = pod["containers"]
        gpus = source.engine.parallelism.num_gpus_per_replica
        limits = container["resources"]["limits"]
        assert limits.get("nvidia.com/gpu", 0) == gpus
        assert pod["terminationGracePeriodSeconds"] == math.ceil(source.drain_timeout_s) + (
            EXTRA_GRACE
        )
        assert "readinessProbe" not in container and "livenessProbe" not in container
        # KubeRay's injected readiness probe finds the Serve proxy by the port's name
        assert {"name": "serve", "containerPort": cfg.server.port} in container["ports"]
        # the proxy's hop follows server.data_plane (the image's ENV says 1)
        grpc = "1" if cfg.server.data_plane == "grpc" else "0"
        assert {"name": "RAY_SERVE_PROXY_USE_GRPC", "value": grpc} in container["env"]
        options = deployments[f"engine-{source.name}"]
        assert options["max_ongoing_requests"] == source.max_ongoing_requests
        assert options["max_queued_requests"] == source.max_queued_requests
        # Serve's grace is the app's: drain_timeout_s plus its margin
        assert options["graceful_shutdown_timeout_s"] == source.drain_timeout_s + DRAIN_MARGIN_S
        if scaling:
            bounds = options["autoscaling_config"]
            assert (bounds["min_replicas"], bounds["max_replicas"]) == (low, high)
            assert "num_replicas" not in options
        else:
            assert options["num_replicas"] == fixed
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    (head_container,) = head["template"]["spec"]["containers"]
    assert "nvidia.com/gpu" not in head_container["resources"].get("limits", {})
    assert "readinessProbe" not in head_container
    assert cluster["enableInTreeAutoscaling"] is True
    http = serve_config(rayservice)["http_options"]
    assert http == {"host": "0.0.0.0", "port": cfg.server.port}


def _cpus(quantity: str | int | float) -> float:
    text = str(quantity)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def check_one_replica_fits_each_pod(rayservice: dict[str, Any], app: Application) -> None:
    """Ray resources of one engine replica (as build_app asks for them: actor options, or
    the placement-group bundles of a TP>1 replica) fit in one pod of its worker group,
    so the autoscaler has a node type to launch; and in no head pod."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    groups = {g["groupName"]: g for g in cluster["workerGroupSpecs"]}
    engines = app._bound_deployment.init_args[0]
    for name, bound in engines.items():
        deployment = bound._bound_deployment
        bundles = deployment._replica_config.placement_group_bundles
        if not bundles:
            options = deployment.ray_actor_options
            bundles = [
                {
                    "CPU": options.get("num_cpus", 1),
                    "GPU": options.get("num_gpus", 0),
                    **options.get("resources", {}),
                }
            ]
        demand: dict[str, float] = {}
        for bundle in bundles:
            for key, amount in bundle.items():
                demand[key] = demand.get(key, 0) + amount
        group = groups[name]
        (container,) = group["template"]["spec"]["containers"]
        limits = container["resources"]["limits"]
        supply = {
            "CPU": _cpus(group["rayStartParams"].get("num-cpus", limits["cpu"])),
            "GPU": float(limits.get("nvidia.com/gpu", 0)),
            **{k: float(v) for k, v in group.get("resources", {}).items()},
        }
        for key, amount in demand.items():
            assert amount <= supply.get(key, 0), (name, key, amount, supply)
        assert demand.get("CPU", 0) > float(cluster["headGroupSpec"]["rayStartParams"]["num-cpus"])


def test_generated_files_are_fresh() -> None:
    stale = chart_files.stale_files(CHART)
    assert not stale, f"stale {stale}: run `python -m spur.configs.helm`"


def test_values_schema_is_the_config_schema() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["properties"]["spur"]["$ref"] == "#/$defs/SpurConfig"
    lane = schema["$defs"]["LaneConfig"]["properties"]
    assert lane["replicas"]["minimum"] == LaneConfig.model_fields["replicas"].metadata[0].ge


@pytest.mark.parametrize("validator", [jsonschema.Draft7Validator, jsonschema.Draft202012Validator])
def test_values_schema_reads_the_same_in_draft_7_and_2020_12(validator: Any) -> None:
    """Helm 3 before 3.18 validates with draft 7, later Helm with 2020-12."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    check = validator(schema)
    for preset in PRESETS:
        check.validate(example_values(preset))
    check.validate(yaml.safe_load((CHART / "values.yaml").read_text()))
    bad = {"spur": {"lanes": [{"name": "chat", "replicas": 2, "autoscaling": {"max_replicas": 3}}]}}
    assert [e.json_path for e in check.iter_errors(bad)] == ["$.spur.lanes[0].replicas"]
    # Every size field takes "8MiB" as the loader does, the bounded plain ones too.
    sizes = {
        "lanes": [{"name": "chat"}],
        "server": {"requests": {"max_body_bytes": "8MiB"}, "object_store_memory": "1GiB"},
    }
    check.validate({"spur": sizes})
    assert parse_config(sizes).server.requests.max_body_bytes == 8 * 1024**2


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_renders_validates_and_round_trips(chart: Any, preset: str) -> None:
    values = example_values(preset)
    docs = render_with(chart, values)
    validate_everything(docs)
    rayservice = the(docs, "RayService")
    expected = load_config(preset)
    assert embedded_config(rayservice) == expected
    # What Serve does with the application entry when KubeRay submits serveConfigV2.
    (app,) = serve_config(rayservice)["applications"]
    built = call_user_app_builder_with_args_if_necessary(
        import_attr(app["import_path"]), app["args"]
    )
    assert isinstance(built, Application)
    names = {built._bound_deployment.name} | {
        bound._bound_deployment.name for bound in built._bound_deployment.init_args[0].values()
    }
    assert names == {d["name"] for d in app["deployments"]}
    check_one_replica_fits_each_pod(rayservice, built)
    check_groups(rayservice, expected)
    assert len(docs["PodDisruptionBudget"]) == len(expected.lanes) + (expected.spare is not None)
    lint = helm.lint(str(CHART), values, strict=False)
    assert not lint["errors"], lint


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_passed_whole_as_text(render: Any, preset: str) -> None:
    text = preset_path(preset).read_text()
    docs = render({"spurConfigYaml": text})
    validate_everything(docs)
    rayservice = the(docs, "RayService")
    (app,) = serve_config(rayservice)["applications"]
    assert app["args"] == {"config_yaml": text}
    cfg = load_config(preset)
    assert embedded_config(rayservice) == cfg
    check_groups(rayservice, cfg)
    if preset != "gpu-h200-tp2":
        return
    # GPU groups: GPUs = tensor-parallel size, GPU node tolerations.
    chat, spare = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert chat["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert spare["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert chat["template"]["spec"]["tolerations"][0]["key"] == "nvidia.com/gpu"


@pytest.mark.parametrize("preset", ["two-lanes", "gpu-h200-tp2"])
def test_exported_keys_make_the_embedded_config_require_them(render: Any, preset: str) -> None:
    """With apiKeys, the app gets the preset's config with server.auth.require_keys on,
    unless the config sets it itself; everything else arrives unchanged."""
    text = preset_path(preset).read_text()
    keys = {"apiKeys": {"secretName": "spur-keys", "key": "keys"}}
    rayservice = the(render({"spurConfigYaml": text, **keys}), "RayService")
    want = load_config(preset)
    want.server.auth.require_keys = True
    assert embedded_config(rayservice) == want
    tree = yaml.safe_load(text)
    tree.setdefault("server", {}).setdefault("auth", {})["require_keys"] = False
    rayservice = the(render({"spurConfigYaml": yaml.safe_dump(tree), **keys}), "RayService")
    assert embedded_config(rayservice).server.auth.require_keys is False


def test_defaults_of_the_templates_match_the_schema(render: Any) -> None:
    """A config that leaves everything to its defaults derives what pydantic derives."""
    tree = {
        "lanes": [
            {"name": "chat"},
            {
                "name": "code",
                "engine": {"parallelism": {"tensor_parallel_size": 4, "device": "cuda"}},
            },
        ],
        "spare": {"serves_lanes": ["chat"]},
    }
    docs = render({"spur": tree})
    validate_everything(docs)
    rayservice = the(docs, "RayService")
    check_groups(rayservice, parse_config(tree))
    from spur.cluster.entry import app_builder

    check_one_replica_fits_each_pod(rayservice, app_builder({"config": tree}))


def test_autoscaling_lane_gets_group_and_serve_bounds(render: Any) -> None:
    tree = {
        "lanes": [
            {
                "name": "chat",
                "autoscaling": {"min_replicas": 2, "max_replicas": 6},
                "drain_timeout_s": 90.5,
                "resources": {"lane-chat": 1},
                "engine": {"parallelism": {"device": "cuda", "tensor_parallel_size": 2}},
            }
        ]
    }
    # Any importable policy function: Serve imports it when it validates the config.
    policy = "ray.serve.autoscaling_policy:default_autoscaling_policy"
    docs = render({"spur": tree, "serve": {"autoscalingPolicy": policy}})
    validate_everything(docs)
    rayservice = the(docs, "RayService")
    check_groups(rayservice, parse_config(tree))
    deployments = serve_config(rayservice)["applications"][0]["deployments"]
    assert deployments[1]["autoscaling_config"]["policy"] == {"policy_function": policy}
    group = rayservice["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]
    hook = group["template"]["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert "--deadline-remaining-seconds 91" in hook[-1]
    syntax = subprocess.run(["bash", "-n", "-c", hook[-1]], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    # The loop greps every command line for "[S]erveReplica:"; the hook's own (the whole
    # script) must not hold the title it looks for, or it waits its full deadline.
    assert "ServeReplica:" not in hook[-1].replace("[S]erveReplica:", "")


def test_storage_secrets_and_placement(render: Any) -> None:
    values = {
        "modelStorage": {"type": "pvc", "claimName": "models", "mountPath": "/srv/models"},
        "groups": {
            "chat": {
                "modelStorage": {"type": "hostPath", "hostPath": "/mnt/models"},
                "nodeSelector": {"pool": "h200"},
            }
        },
        "rayAuth": {"enabled": True, "secretName": "ray-token"},
        "apiKeys": {"secretName": "spur-keys", "key": "keys"},
    }
    docs = render(values)
    validate_everything(docs)
    spec = the(docs, "RayService")["spec"]["rayClusterConfig"]
    assert spec["authOptions"] == {"mode": "token", "secretName": "ray-token"}
    head = spec["headGroupSpec"]["template"]["spec"]
    assert head["volumes"][1] == {
        "name": "models",
        "persistentVolumeClaim": {"claimName": "models", "readOnly": True},
    }
    mount = head["containers"][0]["volumeMounts"][1]
    assert mount == {"name": "models", "mountPath": "/srv/models", "readOnly": True}
    keys = [e for e in head["containers"][0]["env"] if e["name"] == "SPUR_API_KEYS"]
    assert keys[0]["valueFrom"]["secretKeyRef"] == {"name": "spur-keys", "key": "keys"}
    chat = spec["workerGroupSpecs"][0]["template"]["spec"]
    # every pod: an ingress replica reads the keys wherever Ray places it
    keys = [e for e in chat["containers"][0]["env"] if e["name"] == "SPUR_API_KEYS"]
    assert keys[0]["valueFrom"]["secretKeyRef"] == {"name": "spur-keys", "key": "keys"}
    # and a replica that finds none fails to start rather than serve an open API
    args = serve_config(the(docs, "RayService"))["applications"][0]["args"]
    assert parse_config(args["config"]).server.auth.require_keys is True
    assert chat["volumes"][1]["hostPath"]["path"] == "/mnt/models"
    assert chat["containers"][0]["volumeMounts"][0]["mountPath"] == "/dev/shm"
    # a group's modelStorage overrides what it names; the rest (mountPath) is the chart's
    assert chat["containers"][0]["volumeMounts"][1] == mount
    assert chat["nodeSelector"] == {"pool": "h200"}


def test_observability_toggles_render_nothing_without_files(chart_copy: Path) -> None:
    shutil.rmtree(chart_copy / "files" / "dashboards")
    (chart_copy / "files" / "alerts.yaml").unlink()
    on = {"enabled": True}
    with helm.Chart.load(str(chart_copy)) as copy:
        docs = render_with(
            copy, {"metrics": {"serviceMonitor": on, "dashboards": on, "alerts": on}}
        )
    validate_everything(docs)
    assert "ConfigMap" not in docs and "PrometheusRule" not in docs
    monitor = the(docs, "ServiceMonitor")
    # A Service of the head pod alone: a ServiceMonitor scrapes every endpoint of its
    # Service, and every Serve proxy answers the whole view (the API Service would
    # count each series once per pod).
    service = the(docs, "Service")
    wanted = monitor["spec"]["selector"]["matchLabels"]
    assert wanted.items() <= service["metadata"]["labels"].items()
    head = the(docs, "RayService")["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]
    assert service["spec"]["selector"].items() <= head["metadata"]["labels"].items()
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "head"
    (port,) = service["spec"]["ports"]
    assert monitor["spec"]["endpoints"][0]["port"] == port["name"] == "serve"
    assert port["targetPort"] == 8000


def test_observability_files_become_configmap_and_rule(chart_copy: Path) -> None:
    dashboards = chart_copy / "files" / "dashboards"
    shutil.rmtree(dashboards, ignore_errors=True)  # only this test's file
    dashboards.mkdir(parents=True)
    (dashboards / "spur.json").write_text(json.dumps({"title": "spur", "panels": []}))
    rules = {
        "groups": [
            {
                "name": "spur",
                "rules": [{"alert": "SpurDown", "expr": "up == 0", "for": "5m"}],
            }
        ]
    }
    (chart_copy / "files" / "alerts.yaml").write_text(yaml.safe_dump(rules))
    on = {"enabled": True}
    with helm.Chart.load(str(chart_copy)) as copy:
        docs = render_with(copy, {"metrics": {"dashboards": on, "alerts": on}})
    validate_everything(docs)
    configmap = the(docs, "ConfigMap")
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(configmap["data"]["spur.json"])["title"] == "spur"
    assert the(docs, "PrometheusRule")["spec"] == rules


def test_the_shipped_dashboards_and_alerts_render(render: Any) -> None:
    """helm/spur/files holds spur's three dashboards and its alert rules
    (generated by spur.cluster.dashboards; tests/observability checks they are fresh)."""
    on = {"enabled": True}
    docs = render({"metrics": {"dashboards": on, "alerts": on}})
    validate_everything(docs)
    data = the(docs, "ConfigMap")["data"]
    assert sorted(data) == ["spur-capacity.json", "spur-lanes.json", "spur-overview.json"]
    alerts = [r["alert"] for r in the(docs, "PrometheusRule")["spec"]["groups"][0]["rules"]]
    assert "SpurLaneOnSpare" in alerts and "SpurHTTP5xx" in alerts


def test_the_validators_reject_broken_manifests(render: Any) -> None:
    """The schema checks above are not vacuous: each refuses a broken copy."""
    import copy as copying

    import pydantic

    on = {"enabled": True}
    docs = render({"metrics": {"serviceMonitor": on}})
    rayservice = the(docs, "RayService")
    broken = copying.deepcopy(rayservice)
    broken["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["minReplicas"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        validate_crd(broken, crd_schema("RayService"))
    broken = copying.deepcopy(rayservice)
    broken["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["idleTimeoutSecond"] = 60
    with pytest.raises(jsonschema.ValidationError, match="idleTimeoutSecond"):
        validate_crd(broken, crd_schema("RayService"))
    serve = serve_config(rayservice)
    serve["applications"][0]["deployments"][1]["num_replicas"] = "lots"
    with pytest.raises(pydantic.ValidationError):
        validate_serve_config(serve)
    serve = serve_config(rayservice)
    serve["applications"][0]["deployments"][1]["num_replicaz"] = 2
    with pytest.raises(AssertionError):
        validate_serve_config(serve)
    pdb = copying.deepcopy(docs["PodDisruptionBudget"][0])
    pdb["spec"]["minAvailable"] = [1]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(pdb, KUBE_VERSION, strict=True)
    monitor = copying.deepcopy(the(docs, "ServiceMonitor"))
    del monitor["spec"]["selector"]
    with pytest.raises(jsonschema.ValidationError):
        validate_crd(monitor, crd_schema("ServiceMonitor"))
    rule = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "spec": {"groups": [{"name": "g", "rules": [{"alert": "A"}]}]}}  # fmt: skip
    with pytest.raises(jsonschema.ValidationError):
        validate_crd(rule, crd_schema("PrometheusRule"))


BAD_VALUES = [
    pytest.param(
        {"spur": {"lanes": [{"name": "chat", "replicas": -1}]}},
        ["/spur/lanes/0/replicas", "minimum"],
        id="negative-replicas",
    ),
    pytest.param(
        {"spur": {"lanes": [{"name": "chat"}], "spare": {"serves_lanes": ["caht"]}}},
        ["spur.spare.serves_lanes[0]", 'no lane is named "caht"'],
        id="unknown-spare-lane",
    ),
    pytest.param(
        {
            "spur": {
                "lanes": [
                    {
                        "name": "chat",
                        "engine": {"parallelism": {"device": "cuda", "tensor_parallel_size": 4}},
                    }
                ]
            },
            "groups": {"chat": {"gpus": 2}},
        },
        ["groups.chat.gpus is 2", "tensor_parallel_size is 4", "at least 4 GPUs"],
        id="tp-larger-than-gpus",
    ),
    pytest.param(
        {"spur": {"lanes": [{"name": "chat", "replicas": 2, "autoscaling": {"max_replicas": 4}}]}},
        ["/spur/lanes/0/replicas", "mutually exclusive"],
        id="replicas-and-autoscaling",
    ),
    pytest.param(
        {
            "spur": {
                "lanes": [{"name": "chat", "autoscaling": {"min_replicas": 3, "max_replicas": 2}}]
            }
        },
        ["max_replicas (2) is below min_replicas (3)"],
        id="autoscaling-bounds",
    ),
    pytest.param(
        {"spur": {"lanes": [{"name": "chat", "replica": 2}]}},
        ["/spur/lanes/0", "replica"],
        id="unknown-key",
    ),
    pytest.param(
        {"spur": {"lanes": [{"name": "chat", "engine": {"cache": {"kv_cache_bytes": "1 GB!"}}}]}},
        ["/spur/lanes/0/engine/cache/kv_cache_bytes"],
        id="not-a-size",
    ),
    pytest.param(
        {"workers": {"nodeSelektor": {"pool": "gpu"}}},
        ["/workers", "'nodeSelektor' not allowed"],
        id="chart-values-typo",
    ),
    pytest.param(
        {"spurConfigYaml": "lanes: [unclosed"},
        ["spurConfigYaml is not a YAML mapping"],
        id="config-text-not-yaml",
    ),
    # Names spur's schema accepts (local mode) but Kubernetes does not: the name becomes
    # the worker group's (KubeRay's pod names, the ray.io/group label) and the PDB's.
    pytest.param(
        {"spur": {"lanes": [{"name": "long_ctx"}]}},
        ["spur.lanes[0].name", '"long_ctx" is not a DNS-1123 label', 'for example "long-ctx"'],
        id="lane-name-underscore",
    ),
    pytest.param(
        {"spur": {"lanes": [{"name": "chat-"}]}},
        ["spur.lanes[0].name", '"chat-" is not a DNS-1123 label', 'for example "chat"'],
        id="lane-name-trailing-dash",
    ),
    pytest.param(
        {
            "spur": {
                "lanes": [{"name": "chat"}],
                "spare": {"name": "spare_1", "serves_lanes": ["chat"]},
            }
        },
        ["spur.spare.name", '"spare_1" is not a DNS-1123 label', 'for example "spare-1"'],
        id="spare-name-underscore",
    ),
    pytest.param(
        {"spurConfigYaml": "lanes: [{name: Chat}]"},  # text: not checked by the schema
        ["spur.lanes[0].name", '"Chat" is not a DNS-1123 label', 'for example "chat"'],
        id="config-text-lane-name-uppercase",
    ),
    # A replica's CPUs must fit in one pod of its group (spur.cluster.app reserves
    # num_threads for TP=1, 0.5 + 1 per cuda rank for TP>1), as its GPUs must.
    pytest.param(
        {"spur": {"lanes": [{"name": "chat", "engine": {"runtime": {"num_threads": 16}}}]}},
        [
            "spur.lanes[0]: one engine replica reserves 16 CPUs",
            "worker group chat offers 8",
            "groups.chat.resources.limits.cpu",
            "lower engine.runtime.num_threads",
        ],
        id="cpu-num-threads-over-limit",
    ),
    pytest.param(
        {
            "spur": {
                "lanes": [
                    {
                        "name": "chat",
                        "engine": {"parallelism": {"device": "cuda", "tensor_parallel_size": 8}},
                    }
                ]
            },
            "groups": {"chat": {"resources": {"limits": {"cpu": "8", "memory": "64Gi"}}}},
        },
        [
            "reserves 8.5 CPUs",
            "tensor_parallel_size 8 on cuda",
            "offers 8",
            "lower engine.parallelism.tensor_parallel_size",
        ],
        id="cpu-tensor-parallel-over-limit",
    ),
    pytest.param(
        {
            "spur": {"lanes": [{"name": "chat", "engine": {"runtime": {"num_threads": 4}}}]},
            "workers": {"rayStartParams": {"num-cpus": "2"}},
        },
        ["reserves 4 CPUs", "offers 2 (its rayStartParams num-cpus)"],
        id="cpu-num-cpus-param",
    ),
    pytest.param(
        {
            "spur": {"lanes": [{"name": "chat", "engine": {"runtime": {"num_threads": 3}}}]},
            "groups": {"chat": {"resources": {"limits": {"cpu": "1500m"}}}},
        },
        ["reserves 3 CPUs", "offers 2 (its CPU limit 1500m)"],
        id="cpu-millicores",
    ),
    pytest.param(
        {
            "spur": {
                "lanes": [{"name": "chat"}],
                "spare": {"name": "chat", "serves_lanes": ["chat"]},
            }
        },
        ["spur.spare.name", '"chat" is also a lane\'s name', "give the spare its own name"],
        id="spare-named-like-a-lane",
    ),
    pytest.param(
        {"spur": {"lanes": [{"name": "chat", "resources": {"GPU": 1}}]}},
        ["/spur/lanes/0/resources/GPU", "remove GPU: a built-in Ray resource"],
        id="builtin-ray-resource",
    ),
    pytest.param(
        {"serve": {"deploymentUnhealthySecondThreshold": 900}},
        [
            "/serve/deploymentUnhealthySecondThreshold",
            "remove serve.deploymentUnhealthySecondThreshold",
            "KubeRay 1.1 and later ignore it",
        ],
        id="removed-deployment-threshold",
    ),
    pytest.param(
        {"serve": {"serviceUnhealthySecondThreshold": 900}},
        ["/serve/serviceUnhealthySecondThreshold", "remove serve.serviceUnhealthySecondThreshold"],
        id="removed-service-threshold",
    ),
]


@pytest.mark.parametrize(("values", "words"), BAD_VALUES)
def test_bad_values_fail_at_install_with_a_message(
    chart: Any, values: dict[str, Any], words: list[str]
) -> None:
    with pytest.raises(helm.HelmError) as failure:
        chart.render(values, name="spur", namespace="llm")
    for word in words:
        assert word in str(failure.value)


def test_size_strings_follow_the_loader() -> None:
    """The schema's size pattern accepts exactly what parse_size accepts (on a sample)."""
    import re

    from spur.configs.schema import parse_size

    for text in ["1GiB", "512 MiB", "1.5GB", "1_000_000", "2gib", "7b", "3Ki", "x", "1 GB!", "1PB"]:
        try:
            parse_size(text)
            accepted = True
        except ValueError:
            accepted = False
        assert bool(re.match(chart_files.SIZE_STRING_PATTERN, text)) == accepted, text


@pytest.mark.parametrize(
    "autoscaling",
    [
        {"min_replicas": 1, "max_replicas": 3},
        {"min_replicas": 2, "max_replicas": 4, "upscale_delay_s": 3, "downscale_delay_s": 45.5},
        {"min_replicas": 1, "max_replicas": 2, "look_back_period_s": 4},
        {"min_replicas": 1, "max_replicas": 2, "look_back_period_s": 1.5},
    ],
)
def test_serve_autoscaling_config_is_the_apps(render: Any, autoscaling: dict[str, Any]) -> None:
    """serveConfigV2 replaces the application's autoscaling_config: it must be the one
    spur.cluster.app builds (spur's policy, the lane's delays, schema defaults)."""
    from spur.cluster.app import serve_autoscaling_config

    tree = {"lanes": [{"name": "chat", "autoscaling": autoscaling}]}
    docs = render({"spur": tree})
    rayservice = the(docs, "RayService")
    deployments = serve_config(rayservice)["applications"][0]["deployments"]
    lane = parse_config(tree).lanes[0]
    assert lane.autoscaling is not None
    assert deployments[1]["autoscaling_config"] == serve_autoscaling_config(lane.autoscaling)


def test_disruption_budgets_use_an_integer_min_available(render: Any) -> None:
    """Pods owned by a RayCluster (no scale subresource): Kubernetes refuses every
    eviction under a maxUnavailable or percentage budget, so each group's budget is an
    integer minAvailable, its minimum replicas minus maxUnavailable."""
    tree = {
        "lanes": [
            {"name": "chat", "replicas": 3},
            {"name": "code", "autoscaling": {"min_replicas": 2, "max_replicas": 5}},
        ],
        "spare": {"serves_lanes": ["chat"]},
    }
    docs = render({"spur": tree})
    budgets = {
        d["metadata"]["name"].rsplit("-", 1)[-1]: d["spec"] for d in docs["PodDisruptionBudget"]
    }
    assert {k: v.get("minAvailable") for k, v in budgets.items()} == {
        "chat": 2, "code": 1, "spare": 0
    }  # fmt: skip
    assert not any("maxUnavailable" in v for v in budgets.values())


def test_group_overrides_must_name_a_group_and_keep_a_zero(render: Any) -> None:
    tree = {"lanes": [{"name": "chat"}]}
    with pytest.raises(Exception, match=r"groups\.chta: no lane or spare is named"):
        render({"spur": tree, "groups": {"chta": {"gpus": 4}}})
    docs = render({"spur": tree, "groups": {"chat": {"idleTimeoutSeconds": 0}}})
    (group,) = the(docs, "RayService")["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    assert group["idleTimeoutSeconds"] == 0


@pytest.mark.parametrize("port", [6379, 8265, 10001])
def test_the_api_port_cannot_be_one_of_rays_in_the_head_pod(render: Any, port: int) -> None:
    tree = {"lanes": [{"name": "chat"}], "server": {"port": port}}
    with pytest.raises(Exception, match=f"spur.server.port {port} is one of Ray's ports"):
        render({"spur": tree})
    render({"spur": {**tree, "server": {"port": 8001}}})


def test_the_head_mounts_no_model_storage_when_the_chart_sets_none(render: Any) -> None:
    head = the(render(), "RayService")["spec"]["rayClusterConfig"]["headGroupSpec"]
    assert [v["name"] for v in head["template"]["spec"]["volumes"]] == ["shm"]


DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
"""k8s.io/apimachinery's IsDNS1123Label / IsDNS1123Subdomain (63 / 253 characters)."""


@pytest.mark.parametrize("preset", PRESETS)
def test_rendered_names_are_kubernetes_names(chart: Any, preset: str) -> None:
    """kubernetes-validate does not check names: check every metadata.name, the worker
    groups' names (KubeRay's pod names and ray.io/group label) and volume names."""
    docs = render_with(chart, example_values(preset))
    for manifests in docs.values():
        for doc in manifests:
            name = doc["metadata"]["name"]
            assert DNS1123_SUBDOMAIN.match(name) and len(name) <= 253, name
    cluster = the(docs, "RayService")["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]["template"]["spec"]]
    for group in cluster["workerGroupSpecs"]:
        assert DNS1123_LABEL.match(group["groupName"]) and len(group["groupName"]) <= 63
        pods.append(group["template"]["spec"])
    for pod in pods:
        for volume in pod["volumes"]:
            assert DNS1123_LABEL.match(volume["name"]), volume


def test_a_replica_that_just_fits_its_pod_renders(render: Any) -> None:
    """The CPU check's boundaries: equal is enough, a CPU limit counts rounded up."""
    threads = {"name": "chat", "engine": {"runtime": {"num_threads": 8}}}
    render({"spur": {"lanes": [threads]}})  # workers.resources.limits.cpu is 8
    small = {"resources": {"limits": {"cpu": "2500m"}}}
    threads["engine"]["runtime"]["num_threads"] = 3
    render({"spur": {"lanes": [threads]}, "groups": {"chat": small}})
    tp = {"name": "chat", "engine": {"parallelism": {"device": "cpu", "tensor_parallel_size": 4}}}
    render({"spur": {"lanes": [tp]}, "groups": {"chat": small}})  # 0.5 + 4 * 0.5 = 2.5


SCHEMA_REFUSES = [
    pytest.param({"lanes": [{"name": "chat", "served_model_names": ["x", "x"]}]},
                 "$.spur.lanes[0].served_model_names", id="served-names-twice"),
    pytest.param({"version": 2, "lanes": [{"name": "chat"}]}, "$.spur.version", id="version"),
    pytest.param({"lanes": [{"name": "chat"}],
                  "spare": {"serves_lanes": ["chat"],
                            "engine": {"parallelism": {"tensor_parallel_size": 2}}}},
                 "$.spur.spare.engine.parallelism.tensor_parallel_size", id="spare-tp"),
    pytest.param({"lanes": [{"name": "chat", "resources": {"CPU": 1}}]},
                 "$.spur.lanes[0].resources.CPU", id="builtin-resource"),
    pytest.param({"lanes": [{"name": "chat"}], "server": {"ingress_resources": {"GPU": 1}}},
                 "$.spur.server.ingress_resources.GPU", id="builtin-ingress-resource"),
    pytest.param({"lanes": [{"name": "chat"}],
                  "spare": {"serves_lanes": ["chat"], "resources": {"spare": 1.5}}},
                 "$.spur.spare.resources.spare", id="fractional-resource-above-1"),
]  # fmt: skip


@pytest.mark.parametrize(("tree", "where"), SCHEMA_REFUSES)
@pytest.mark.parametrize("validator", [jsonschema.Draft7Validator, jsonschema.Draft202012Validator])
def test_values_schema_refuses_what_the_loader_refuses(
    chart: Any, validator: Any, tree: dict[str, Any], where: str
) -> None:
    """Rules of the config's validators that JSON Schema can state fail `helm install`,
    not the application once the cluster is up."""
    from spur.configs.loader import ConfigError

    with pytest.raises(ConfigError):
        parse_config(tree)
    schema = json.loads((CHART / "values.schema.json").read_text())
    errors = list(validator(schema).iter_errors({"spur": tree}))
    assert len(errors) == 1, [e.message for e in errors]
    # the path of the refused value (inside an anyOf, such as spare's `| null`, among
    # the branches' errors)
    leaves, todo = set(), list(errors)
    while todo:
        error = todo.pop()
        todo += error.context or []
        leaves.add(error.json_path)
    assert where in leaves, leaves
    with pytest.raises(helm.HelmError, match="values don't meet the specifications") as failure:
        chart.render({"spur": tree}, name="spur", namespace="llm")
    at = re.sub(r"\[(\d+)\]", r".\1", where).removeprefix("$").replace(".", "/")
    assert f"at '{at}'" in str(failure.value)


def test_values_schema_keeps_what_the_loader_accepts() -> None:
    """The added rules refuse nothing the loader accepts (neighbours of each case)."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    tree = {
        "version": 1,
        "lanes": [{"name": "chat", "served_model_names": ["x", "y"], "resources": {"cpu": 1}}],
        "spare": {
            "serves_lanes": ["chat"],
            "resources": {"spare": 0.5, "pool": 2.0},
            "engine": {"parallelism": {"tensor_parallel_size": 1}},
        },
        "server": {"ingress_resources": {"head": 1}},
    }
    parse_config(tree)
    for validator in (jsonschema.Draft7Validator, jsonschema.Draft202012Validator):
        validator(schema).validate({"spur": tree})


def test_removed_kuberay_thresholds_are_not_rendered(render: Any) -> None:
    """KubeRay >= 1.1 ignores them: the RayService does not pretend otherwise."""
    spec = the(render(), "RayService")["spec"]
    assert not [key for key in spec if "Unhealthy" in key]


@pytest.mark.parametrize("target", [32, None])
def test_serves_default_policy_gets_the_lanes_target(render: Any, target: int | None) -> None:
    """With serve.autoscalingPolicy "" Serve's request-count policy scales the lane: it
    must aim for the lane's autoscaling.target_ongoing_requests (its default included),
    not Serve's own default."""
    from ray.serve.config import AutoscalingConfig

    auto: dict[str, Any] = {"max_replicas": 4}
    if target is not None:
        auto["target_ongoing_requests"] = target
    tree = {"lanes": [{"name": "chat", "autoscaling": auto}]}
    docs = render({"spur": tree, "serve": {"autoscalingPolicy": ""}})
    validate_everything(docs)
    options = serve_config(the(docs, "RayService"))["applications"][0]["deployments"][1]
    lane = parse_config(tree).lanes[0]
    assert lane.autoscaling is not None
    want = lane.autoscaling.target_ongoing_requests
    assert "policy" not in options["autoscaling_config"]
    assert AutoscalingConfig(**options["autoscaling_config"]).target_ongoing_requests == want


@pytest.mark.parametrize(("plane", "flag"), [("grpc", "1"), ("object_ref", "0"), (None, "1")])
@pytest.mark.parametrize("as_text", [False, True])
def test_the_proxy_hop_follows_the_data_plane(
    render: Any, plane: str | None, flag: str, as_text: bool
) -> None:
    """RAY_SERVE_PROXY_USE_GRPC in every pod follows server.data_plane, as `spur serve`
    sets it; always set, since the image's ENV says 1."""
    tree: dict[str, Any] = {"lanes": [{"name": "chat"}, {"name": "code"}]}
    if plane is not None:
        tree["server"] = {"data_plane": plane}
    values = {"spurConfigYaml": yaml.safe_dump(tree)} if as_text else {"spur": tree}
    cluster = the(render(values), "RayService")["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
    for pod in pods:
        (container,) = pod["template"]["spec"]["containers"]
        env = [e for e in container["env"] if e["name"] == "RAY_SERVE_PROXY_USE_GRPC"]
        assert env == [{"name": "RAY_SERVE_PROXY_USE_GRPC", "value": flag}]
