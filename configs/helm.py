"""The Helm chart's generated files, derived from this package's config tree.

    helm/spur/values.schema.json        the chart's values schema: `spur:` is SpurConfig's
                                        JSON Schema (pydantic's), so `helm install` rejects
                                        what spur's loader rejects (where JSON Schema can
                                        say it; the chart's templates and the application
                                        builder check the cross-field rules)
    helm/spur/examples/<preset>.yaml    one values file per shipped preset, the preset's
                                        text (comments and anchors kept) under `spur:`

Regenerate after changing configs/schema.py or a preset:

    python -m spur.configs.helm            # write the files
    python -m spur.configs.helm --check    # exit 1 when a file is stale (what CI runs)

Nothing here imports torch or Ray.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, get_args

from spur.configs.loader import PRESETS, preset_path
from spur.configs.schema import (
    _RAY_BUILTIN_RESOURCES,
    ALL_MODELS,
    CONFIG_VERSION,
    Resources,
    SpurConfig,
    is_size_field,
)

CHART_DIR = Path(__file__).resolve().parents[1] / "helm" / "spur"
"""The chart in a checkout (an editable install points here too)."""

SIZE_STRING_PATTERN = (
    r"^\s*([0-9][0-9_]*(\.[0-9_]*)?|\.[0-9][0-9_]*)\s*([kKmMgGtT][iI]?[bB]?|[bB])?\s*$"
)
"""What `schema.parse_size` accepts as a string ("2GiB", "512 MiB", "1_000_000"), as a
JSON Schema pattern (Go's RE2 and Python's re read it alike)."""

_BOUNDS = {"ge": "minimum", "gt": "exclusiveMinimum", "le": "maximum", "lt": "exclusiveMaximum"}


def _fix_bounds(node: Any) -> None:
    """Pydantic leaves the bounds of an Annotated type with a BeforeValidator (ByteSize)
    as pydantic keywords ("ge"); turn them into JSON Schema's. Mutates `node`."""
    if isinstance(node, dict):
        if node.get("type") in ("integer", "number"):
            for short, long in _BOUNDS.items():
                if short in node:
                    node[long] = node.pop(short)
        for value in node.values():
            _fix_bounds(value)
    elif isinstance(node, list):
        for value in node:
            _fix_bounds(value)


def _accept_size_strings(defs: dict[str, Any]) -> None:
    """Size fields (ByteSize) take an integer or a string such as "1GiB": add the string
    form next to the integer one. Mutates `defs`."""
    for model in ALL_MODELS:
        props = defs.get(model.__name__, {}).get("properties", {})
        for name, field in model.model_fields.items():
            if name not in props or not is_size_field(field):
                continue
            prop = props[name]
            branches = prop.get("anyOf", [prop])
            for i, branch in enumerate(branches):
                if branch.get("type") == "integer":
                    size = {"type": "string", "pattern": SIZE_STRING_PATTERN}
                    branches[i : i + 1] = [dict(branch), size]
                    break
            if "anyOf" not in prop:
                keep = {k: v for k, v in prop.items() if k in ("default", "description", "title")}
                prop.clear()
                prop.update(keep, anyOf=branches)


def _resource_fields() -> list[tuple[str, str]]:
    """(model name, field name) of every `Resources` field (Ray custom resources)."""
    marks = get_args(Resources)[1:]
    return [
        (model.__name__, name)
        for model in ALL_MODELS
        for name, field in model.model_fields.items()
        if any(mark in marks for mark in field.metadata)
    ]


def _validator_rules(defs: dict[str, Any]) -> None:
    """The rules of the config's validators that JSON Schema can state, so that
    `helm install` refuses what the application would refuse only once the cluster is
    up. Mutates `defs`. What stays for the loader: cross-field rules (kv_usage_low below
    kv_usage_high, a spare named like a lane: the chart's templates check that one)."""
    defs["SpurConfig"]["properties"]["version"]["const"] = CONFIG_VERSION
    lane = defs["LaneConfig"]["properties"]
    lane["served_model_names"]["uniqueItems"] = True
    # A spare runs on one device. Draft 7 ignores keywords beside "$ref": use allOf.
    engine = defs["SpareConfig"]["properties"]["engine"]
    single = {"properties": {"tensor_parallel_size": {"const": 1}}}
    engine["allOf"] = [{"$ref": engine.pop("$ref")}, {"properties": {"parallelism": single}}]
    # Ray sets its built-in resources from num_cpus / num_gpus (the value is the
    # message: Helm reports a failed `const` with its path and value, a failed
    # propertyNames `not` with neither), and refuses a fractional amount above 1.
    builtin = {
        name: {
            "const": f"remove {name}: a built-in Ray resource, which spur derives from "
            "engine.parallelism; use a custom name such as lane-chat"
        }
        for name in _RAY_BUILTIN_RESOURCES
    }
    for model, field in _resource_fields():
        resources = defs[model]["properties"][field]
        resources["properties"] = dict(builtin)
        for amount in resources["patternProperties"].values():
            amount["anyOf"] = [{"maximum": 1}, {"multipleOf": 1}]


def _cross_field_rules(defs: dict[str, Any]) -> None:
    """The cross-field rules JSON Schema can state. Mutates `defs`."""
    # Mutually exclusive replicas / autoscaling. Helm's validator reports a failed `not`
    # without detail, a failed `const` with its value: the value is the message.
    lane = defs["LaneConfig"]
    lane["if"] = {
        "required": ["autoscaling"],
        "properties": {"autoscaling": {"type": "object"}},
    }
    lane["then"] = {
        "properties": {
            "replicas": {"const": "remove replicas: it and autoscaling are mutually exclusive"}
        }
    }


def config_schema() -> dict[str, Any]:
    """SpurConfig's JSON Schema (validation mode) with size strings accepted and the
    cross-field rules that JSON Schema can express. The root model is `$defs.SpurConfig`."""
    schema = SpurConfig.model_json_schema(ref_template="#/$defs/{model}")
    defs = schema.pop("$defs")
    defs["SpurConfig"] = schema
    _fix_bounds(defs)
    _accept_size_strings(defs)
    _validator_rules(defs)
    _cross_field_rules(defs)
    return defs


def _object(description: str, properties: dict[str, Any] | None = None) -> dict[str, Any]:
    """An object schema; with `properties`, other keys are refused (a typo fails the
    install instead of being ignored)."""
    node: dict[str, Any] = {"type": "object", "description": description}
    if properties is not None:
        node["properties"] = properties
        node["additionalProperties"] = False
    return node


_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}

REMOVED_SERVE_SETTINGS = ("deploymentUnhealthySecondThreshold", "serviceUnhealthySecondThreshold")
"""`serve.*` values of earlier charts that KubeRay >= 1.1 ignores: refused by the schema."""
_LIST = {"type": "array"}

_STORAGE = _object(
    "Where the model folders come from, mounted read-only at mountPath in every pod of "
    "the group (the chart-level one in the head pod too; the API copies a tokenizer it "
    "cannot read there from the lane's engines): a pvc must let pods on several nodes "
    "mount it (ReadOnlyMany or ReadWriteMany).",
    {
        "type": {"enum": ["none", "pvc", "hostPath"]},
        "claimName": {"type": "string"},
        "hostPath": {"type": "string"},
        "mountPath": {"type": "string", "pattern": "^/"},
    },
)

_POD = {
    "resources": _object("Kubernetes requests and limits of the Ray container."),
    "nodeSelector": _STRING_MAP,
    "tolerations": _LIST,
    "affinity": {"type": "object"},
    "rayStartParams": _STRING_MAP,
    "annotations": _STRING_MAP,
    "labels": _STRING_MAP,
}

_GROUP = _object(
    "Per worker group (a lane's name or the spare's) overrides of `workers`.",
    {
        **_POD,
        "gpus": {"type": "integer", "minimum": 0, "maximum": 64},
        "modelStorage": _STORAGE,
        "idleTimeoutSeconds": {"type": "integer", "minimum": 0},
    },
)


def chart_properties() -> dict[str, Any]:
    """The schema of the chart's own values (everything but `spur`); values.yaml
    documents each of them."""
    toggle = {"type": "boolean"}
    return {
        "spurConfigYaml": {
            "type": "string",
            "description": "A whole spur config file as text (--set-file "
            "spurConfigYaml=configs/gpu-h200-tp2.yaml); replaces `spur` when set, and is "
            "validated when the application starts.",
        },
        "global": {
            "type": "object",
            "description": "Helm's values shared with a parent chart (unused by this chart).",
        },
        "nameOverride": {"type": "string"},
        "fullnameOverride": {"type": "string", "maxLength": 40},
        "rayVersion": {"type": "string"},
        "image": _object(
            "The serving image (helm/Dockerfile).",
            {
                "repository": {"type": "string", "minLength": 1},
                "tag": {"type": "string", "minLength": 1},
                "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
            },
        ),
        "imagePullSecrets": _LIST,
        "env": {**_LIST, "description": "Extra environment of every Ray container."},
        "serve": _object(
            "RayService settings.",
            {
                "autoscalingPolicy": {"type": "string"},
                # Removed settings: KubeRay 1.1 and later ignore these RayService fields
                # (kuberay#1656). Refused with a message rather than silently dropped; the
                # value is the message (see _cross_field_rules).
                **{
                    name: {
                        "description": "Removed: KubeRay >= 1.1 ignores it.",
                        "const": f"remove serve.{name}: KubeRay 1.1 and later ignore it and "
                        "never recreate the cluster for a slow or unhealthy application",
                    }
                    for name in REMOVED_SERVE_SETTINGS
                },
            },
        ),
        "rayAuth": _object(
            "Ray token authentication.", {"enabled": toggle, "secretName": {"type": "string"}}
        ),
        "apiKeys": _object(
            "A Secret holding the API keys.",
            {"secretName": {"type": "string"}, "key": {"type": "string", "minLength": 1}},
        ),
        "modelStorage": _STORAGE,
        "head": _object("The head pod: Ray's GCS, the Serve controller, the API.", _POD),
        "workers": _object(
            "Defaults of every worker group (one per lane, one for the spare).",
            {
                **_POD,
                "gpuNodeSelector": _STRING_MAP,
                "gpuTolerations": _LIST,
                "idleTimeoutSeconds": {"type": "integer", "minimum": 0},
            },
        ),
        "groups": {
            "type": "object",
            "description": _GROUP["description"],
            "additionalProperties": _GROUP,
        },
        "drain": _object(
            "Pod termination.",
            {
                "extraGraceSeconds": {"type": "integer", "minimum": 0, "maximum": 3600},
                "preStop": toggle,
            },
        ),
        "podDisruptionBudget": _object(
            "One PodDisruptionBudget per worker group.",
            {"enabled": toggle, "maxUnavailable": {"type": "integer", "minimum": 0}},
        ),
        "metrics": _object(
            "Observability hooks (Prometheus Operator, Grafana sidecar).",
            {
                "serviceMonitor": _object(
                    "",
                    {
                        "enabled": toggle,
                        "path": {"type": "string"},
                        "interval": {"type": "string"},
                        "labels": _STRING_MAP,
                    },
                ),
                "dashboards": _object("", {"enabled": toggle, "labels": _STRING_MAP}),
                "alerts": _object("", {"enabled": toggle, "labels": _STRING_MAP}),
            },
        ),
    }


def values_schema() -> dict[str, Any]:
    """The chart's values.schema.json as data."""
    defs = config_schema()
    properties = {
        "spur": {
            "$ref": "#/$defs/SpurConfig",
            "description": "The spur config tree (configs/schema.py), the same as a "
            "config file's content.",
        },
        **chart_properties(),
    }
    # No "$schema": Helm 3 before 3.18 validates with a draft-7 library, later Helm with
    # draft 2020-12; the keywords used here mean the same in both ("$defs" is only
    # reached through "$ref" JSON pointers).
    return {
        "title": "spur Helm chart values (generated by python -m spur.configs.helm)",
        "type": "object",
        "properties": properties,
        "additionalProperties": False,
        "$defs": defs,
    }


def schema_text() -> str:
    """values.schema.json's exact content."""
    return json.dumps(values_schema(), indent=2, sort_keys=False) + "\n"


def example_values_text(preset: str) -> str:
    """The example values file of a shipped preset: the preset's text under `spur:`."""
    source = preset_path(preset).read_text(encoding="utf-8")
    body = "".join(f"  {line}" if line.strip() else line for line in source.splitlines(True))
    return (
        f"# Values for `helm install spur helm/spur -f helm/spur/examples/{preset}.yaml`:\n"
        f"# the preset configs/{preset}.yaml as the chart's `spur:` tree.\n"
        "# Generated by `python -m spur.configs.helm`; edit the preset, not this file.\n"
        "spur:\n" + body
    )


def generated_files(chart: Path = CHART_DIR) -> dict[Path, str]:
    """Every generated file of the chart and its expected content."""
    files = {chart / "values.schema.json": schema_text()}
    for preset in PRESETS:
        files[chart / "examples" / f"{preset}.yaml"] = example_values_text(preset)
    return files


def stale_files(chart: Path = CHART_DIR) -> list[Path]:
    """Generated files whose content differs from what would be generated now."""
    stale = []
    for path, text in generated_files(chart).items():
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            stale.append(path)
    return stale


def main(argv: list[str] | None = None) -> int:
    """Write (or with --check, verify) the chart's generated files."""
    parser = argparse.ArgumentParser(prog="python -m spur.configs.helm", description=__doc__)
    parser.add_argument("--chart", type=Path, default=CHART_DIR, help="the chart folder")
    parser.add_argument("--check", action="store_true", help="exit 1 if a file is stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files(args.chart)
        for path in stale:
            print(f"stale: {path} (run python -m spur.configs.helm)", file=sys.stderr)
        return 1 if stale else 0
    for path, text in generated_files(args.chart).items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
