"""Grafana dashboards and Prometheus alert rules, declared once, here.

    DASHBOARDS   three dashboards of panels; each panel is a title, a unit and its
                 PromQL targets (with the `$lane` / `$model` variables)
    ALERTS       Prometheus alerting rules over the same series

`spur dashboards export DIR` writes the Grafana JSON (`dashboard_json`) and
`alerts.yaml`; the Helm chart ships the same files (helm/spur/files/, kept equal
by a freshness test); `spur dashboards push` sends them to a Grafana with
grafana-client (`spur.cluster.grafana`). Every expression is evaluated against a
real Prometheus scraping a live server in tests/observability.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

DATASOURCE_UID = "spur-prometheus"
"""The data source `spur dashboards push` creates; the dashboards' `datasource` variable picks it
by default and offers every other Prometheus (a Helm install whose Grafana has its
own, e.g. kube-prometheus-stack's: the sidecar provisions no data source)."""
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
FOLDER_TITLE = "spur"
FOLDER_UID = "spur"
SEL = '{lane=~"$lane", model_name=~"$model"}'
"""The variables' selector of engine series. A request's series (tokens, finishes,
latencies) carry the lane it came for, wherever it ran (a spare's too, with that
lane's model_name); an engine's own (running, waiting, KV, capacity) its replica's
lane (a spare's: the spare's name)."""
RI = "$__rate_interval"
HTTP_5XX_WINDOW = "5m"
HTTP_5XX_SHARE = 0.05
"""SpurHTTP5xx: the share of a route's answers that are 5xx, over HTTP_5XX_WINDOW,
above which (for as long again) it fires."""


def _q(metric: str, quantile: float) -> str:
    """Quantile `quantile` of histogram `metric` per lane (lanes are never blended)."""
    return f"histogram_quantile({quantile}, sum by (lane, le) (rate({metric}_bucket{SEL}[{RI}])))"


def _quantiles(metric: str) -> tuple[tuple[str, str], ...]:
    return tuple((_q(metric, q), f"p{int(q * 100)} {{{{lane}}}}") for q in (0.5, 0.9, 0.99))


def http_5xx_share(window: str) -> str:
    """Per route, the share of its answers over `window` that are 5xx, not counting
    the 503 `shutting_down` of a deployment that drains (every rolling upgrade's) nor
    the readiness / liveness probes' routes. The error counter carries the code; the
    503 / 500 series of every route exist at 0 from the start (`IngressCounters`)."""
    errors = 'spur:http_errors_total{status=~"5..", code!="shutting_down", route!~"/health.*"}'
    answers = 'spur:http_requests_total{route!~"/health.*"}'
    return (
        f"sum by (route) (rate({errors}[{window}])) / "
        f"(sum by (route) (rate({answers}[{window}])) > 0)"
    )


@dataclass(frozen=True)
class Panel:
    title: str
    targets: tuple[tuple[str, str], ...]
    """(PromQL, legend) pairs."""
    unit: str = "short"
    kind: str = "timeseries"
    description: str = ""


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    panels: tuple[Panel, ...] = field(default_factory=tuple)


OVERVIEW = Dashboard(
    "spur-overview",
    "spur / Overview",
    "Traffic, latency, queues and KV usage of every lane (vLLM's metric names).",
    (
        Panel(
            "Requests/s",
            ((f"sum by (lane) (rate(vllm:request_success_total{SEL}[{RI}]))", "{{lane}}"),),
            "reqps",
        ),
        Panel(
            "Tokens/s",
            (
                (f"sum by (lane) (rate(vllm:prompt_tokens_total{SEL}[{RI}]))", "prompt {{lane}}"),
                (
                    f"sum by (lane) (rate(vllm:generation_tokens_total{SEL}[{RI}]))",
                    "generation {{lane}}",
                ),
            ),
        ),
        Panel("Time to first token", _quantiles("vllm:time_to_first_token_seconds"), "s"),
        Panel("Inter-token latency", _quantiles("vllm:inter_token_latency_seconds"), "s"),
        Panel("End-to-end latency", _quantiles("vllm:e2e_request_latency_seconds"), "s"),
        Panel(
            "Running and waiting",
            (
                (f"sum by (lane) (vllm:num_requests_running{SEL})", "running {{lane}}"),
                (f"sum by (lane) (vllm:num_requests_waiting{SEL})", "waiting {{lane}}"),
            ),
        ),
        Panel(
            "KV cache usage",
            ((f"max by (lane, engine) (vllm:kv_cache_usage_perc{SEL})", "{{lane}} {{engine}}"),),
            "percentunit",
        ),
        Panel(
            "Prefix cache hit rate",
            (
                (
                    # no queries: no point (not 0, and not a rate cut by a floor of 1/s)
                    f"sum by (lane) (rate(vllm:prefix_cache_hits_total{SEL}[{RI}])) / "
                    f"(sum by (lane) (rate(vllm:prefix_cache_queries_total{SEL}[{RI}])) > 0)",
                    "{{lane}}",
                ),
            ),
            "percentunit",
        ),
        Panel(
            "Preemptions/s",
            ((f"sum by (lane) (rate(vllm:num_preemptions_total{SEL}[{RI}]))", "{{lane}}"),),
        ),
        Panel(
            "Finish reasons",
            (
                (
                    f"sum by (finished_reason) (rate(vllm:request_success_total{SEL}[{RI}]))",
                    "{{finished_reason}}",
                ),
            ),
            "reqps",
        ),
        Panel(
            "HTTP errors by code",
            (
                (
                    f"sum by (route, status, code) (rate(spur:http_errors_total[{RI}]))",
                    "{{status}} {{code}} {{route}}",
                ),
            ),
            "reqps",
        ),
        Panel(
            "5xx share of answers",
            ((http_5xx_share(RI), "{{route}}"),),
            "percentunit",
            description=(
                "Per route, the share of answers that were 5xx (a drain's 503 "
                "shutting_down and the /health probes not counted): what the SpurHTTP5xx "
                f"alert watches over {HTTP_5XX_WINDOW} (above {HTTP_5XX_SHARE:.0%} for "
                f"{HTTP_5XX_WINDOW})."
            ),
        ),
    ),
)

CAPACITY = Dashboard(
    "spur-capacity",
    "spur / Capacity truth",
    "Blocks held by running requests against the capacity formula, per KV group: a "
    "ratio above 1 is a leak (the start-up claim overstates capacity).",
    (
        Panel(
            "Blocks held vs geometry",
            (
                (
                    f"sum by (lane, group, kind) (spur:kv_blocks_held{SEL})",
                    "held {{lane}} g{{group}}",
                ),
                (
                    f"sum by (lane, group, kind) (spur:kv_blocks_geometry{SEL})",
                    "geometry {{lane}} g{{group}}",
                ),
            ),
        ),
        Panel(
            "Held / geometry",
            (
                (
                    f"max by (lane, engine, group, kind) (spur:kv_held_over_geometry{SEL})",
                    "{{lane}} {{engine}} g{{group}} {{kind}}",
                ),
                (
                    f"max by (lane, group) (spur:kv_request_held_over_geometry_max{SEL})",
                    "worst request {{lane}} g{{group}}",
                ),
                (
                    f"max by (lane, group) (spur:kv_held_over_geometry_peak{SEL})",
                    "peak {{lane}} g{{group}}",
                ),
            ),
        ),
        Panel(
            "Leak detector violations (last 10 min)",
            (
                (
                    f"sum by (lane, engine) (increase(spur:kv_leak_violations_total{SEL}[10m]))",
                    "{{lane}} {{engine}}",
                ),
            ),
            description=(
                "Requests the leak detector saw holding more blocks than the capacity "
                "formula allows, in the 10 minutes before each point (the window of the "
                "SpurKVLeakViolations alert): anything above 0 is a leak."
            ),
        ),
        Panel(
            "Claimed capacity vs KV in use (max-length requests)",
            (
                (f"sum by (lane) (spur:capacity_claimed_max_concurrency{SEL})", "claimed {{lane}}"),
                (
                    f"sum by (lane) (vllm:kv_cache_usage_perc{SEL} * "
                    f"spur:capacity_claimed_max_concurrency{SEL})",
                    "KV in use {{lane}}",
                ),
                (
                    f"sum by (lane) (vllm:num_requests_running{SEL})",
                    "running, any length {{lane}}",
                ),
            ),
            description=(
                "claimed: the requests of max_model_len the replicas' KV pools hold "
                "together (the start-up claim). KV in use: the blocks in use, counted in "
                "such requests (KV usage x claimed, per replica): when it reaches the "
                "claim, the pools are full. running: the requests running now, of any "
                "length; short requests can run many more than the claim, so running "
                "above claimed is no overcommit and running below it no spare room."
            ),
        ),
        Panel(
            "KV pool tokens",
            ((f"sum by (lane) (spur:capacity_pool_tokens{SEL})", "{{lane}}"),),
            description=(
                "Per lane, the sum over its replicas of the longest context one request "
                "holds with a replica's KV pool to itself: blocks x block size for a plain "
                "model, less for a hybrid one (each request's state blocks come off it)."
            ),
        ),
    ),
)

LANES = Dashboard(
    "spur-lanes",
    "spur / Lanes and routing",
    "Where each lane's traffic goes (primaries or spare) and why, failovers, retries, "
    "stream continuations, per-replica load, routing decisions and KV-index lag.",
    (
        Panel(
            "Lane target (1 = on spare)",
            (
                (
                    'max by (lane, spare) (spur:lane_on_spare{lane=~"$lane"})',
                    "{{lane}} -> {{spare}}",
                ),
            ),
            description="When did which lane run on its spare; the reason is on spur:lane_target.",
        ),
        Panel(
            "Lane target by deployment and reason",
            (
                (
                    "max by (lane, target, deployment, reason) "
                    '(spur:lane_target{lane=~"$lane"}) == 1',
                    "{{lane}}: {{target}} ({{reason}})",
                ),
            ),
        ),
        Panel(
            "Failovers (last 10 min)",
            (
                (
                    "sum by (lane, from, to, reason) "
                    '(increase(spur:lane_failovers_total{lane=~"$lane"}[10m]))',
                    "{{lane}} {{from}} -> {{to}} ({{reason}})",
                ),
            ),
            description="Lane target switches in the 10 minutes before each point.",
        ),
        Panel(
            "Retries, continuations, replica failures",
            (
                (f"sum by (lane) (rate(spur:retries_total[{RI}]))", "retries {{lane}}"),
                (
                    f"sum by (lane) (rate(spur:stream_continuations_total[{RI}]))",
                    "continuations {{lane}}",
                ),
                (f"sum by (lane) (rate(spur:replica_failures_total[{RI}]))", "failures {{lane}}"),
                (f"sum by (lane) (rate(spur:spare_fallbacks_total[{RI}]))", "fallbacks {{lane}}"),
            ),
        ),
        Panel(
            "Per-replica load",
            (
                (
                    f"sum by (lane, engine) (vllm:num_requests_running{SEL} + "
                    f"vllm:num_requests_waiting{SEL})",
                    "{{lane}} {{engine}}",
                ),
            ),
        ),
        Panel(
            "Per-replica KV usage",
            ((f"max by (lane, engine) (vllm:kv_cache_usage_perc{SEL})", "{{lane}} {{engine}}"),),
            "percentunit",
        ),
        Panel(
            "Replica health",
            ((f"max by (lane, engine, node) (spur:replica_healthy{SEL})", "{{lane}} {{engine}}"),),
        ),
        Panel(
            "Unhealthy replicas",
            ((f"sum by (lane) (1 - spur:replica_healthy{SEL})", "{{lane}}"),),
            description=(
                "Replicas the KV index lists but holds unhealthy (failed, stuck, silent "
                "past the heartbeat timeout, or on a node in a restart loop): no request "
                "is routed to them. A gone replica is listed until a new one starts on its "
                "node or it has been silent for 10 minutes."
            ),
        ),
        Panel(
            "Engine stats age",
            (
                (
                    f"max by (lane, engine) (spur:engine_stats_age_seconds{SEL}) "
                    f"and on (lane, engine) max by (lane, engine) (spur:replica_healthy{SEL})",
                    "{{lane}} {{engine}}",
                ),
            ),
            "s",
            description=(
                "Seconds since each listed replica's statistics last reached the KV index "
                "(they come about every second, with its heartbeat): a replica whose age "
                "grows past a few seconds is not reporting, and its counters in every "
                "other panel are stale (drained replicas, which left the index, not shown)."
            ),
        ),
        Panel(
            "Routing decisions by reason",
            (
                (
                    f"sum by (lane, reason) (rate(spur:routing_decisions_total[{RI}]))",
                    "{{lane}} {{reason}}",
                ),
            ),
        ),
        Panel(
            "Matched blocks per decision (p50, p90)",
            tuple(
                (
                    f"histogram_quantile({q}, sum by (lane, le) "
                    f"(rate(spur:routing_matched_blocks_bucket[{RI}])))",
                    f"p{int(q * 100)} {{{{lane}}}}",
                )
                for q in (0.5, 0.9)
            ),
        ),
        Panel(
            "KV index event lag",
            (("max(spur:kv_index_event_lag_seconds)", "lag"),),
            "s",
        ),
        Panel(
            "Start failures and restart loops",
            (
                ("sum by (lane, node) (spur:replica_start_failures_total)", "failures {{lane}}"),
                ("max by (lane, node) (spur:restart_loop)", "loop {{lane}} {{node}}"),
                ("sum by (lane, node) (spur:replica_restarts_total)", "restarts {{lane}}"),
            ),
        ),
        Panel(
            "Config identity",
            (
                (
                    "count by (config_hash, version) (spur:config_info)",
                    "{{config_hash}} v{{version}}",
                ),
            ),
            kind="table",
        ),
    ),
)

DASHBOARDS = (OVERVIEW, CAPACITY, LANES)


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str
    for_: str
    severity: str
    summary: str


ALERTS = (
    Alert(
        "SpurLaneOnSpare",
        "max by (lane, spare) (spur:lane_on_spare) == 1",
        "10m",
        "warning",
        "Lane {{ $labels.lane }} has run on its spare {{ $labels.spare }} for 10 minutes.",
    ),
    Alert(
        "SpurKVLeakViolations",
        "sum by (lane, engine) (increase(spur:kv_leak_violations_total[10m])) > 0",
        "0m",
        "critical",
        "A request on engine {{ $labels.engine }} ({{ $labels.lane }}) held more KV blocks "
        "than the capacity formula allows in the last 10 minutes: the claimed capacity is "
        "overstated.",
    ),
    Alert(
        "SpurHeldOverGeometry",
        "max by (lane, engine, group, kind) (spur:kv_request_held_over_geometry_max) > 1.2",
        "2m",
        "critical",
        "A request on {{ $labels.engine }} holds {{ $value }}x the blocks of KV group "
        "{{ $labels.group }} its geometry needs.",
    ),
    Alert(
        "SpurRestartLoop",
        # failures in the last 10 minutes; a node's series starts at its first
        # failure (1), which increase() would not count: absent 10 minutes ago is 0
        "max by (lane, node) (spur:restart_loop) == 1 or "
        "sum by (lane, node) (spur:replica_start_failures_total) - ("
        "sum by (lane, node) (spur:replica_start_failures_total offset 10m) or "
        "0 * sum by (lane, node) (spur:replica_start_failures_total)) >= 3",
        "0m",
        "critical",
        "Replicas of lane {{ $labels.lane }} keep failing to start on {{ $labels.node }}.",
    ),
    Alert(
        "SpurKVFullWhileWaiting",
        "max by (lane, engine) (vllm:kv_cache_usage_perc) > 0.95 and on (lane, engine) "
        "max by (lane, engine) (vllm:num_requests_waiting) > 0",
        "5m",
        "warning",
        "Engine {{ $labels.engine }} ({{ $labels.lane }}) is out of KV blocks while requests wait.",
    ),
    Alert(
        "SpurHTTP5xx",
        # A share, for as long again as its window: one 5xx (or a few in a busy
        # minute) is not a page; a drain's 503 shutting_down (every rolling upgrade's)
        # and a readiness probe's 503 (starting, draining) are answers, not errors.
        f"{http_5xx_share(HTTP_5XX_WINDOW)} > {HTTP_5XX_SHARE}",
        HTTP_5XX_WINDOW,
        "warning",
        f"More than {HTTP_5XX_SHARE:.0%} of the answers on {{{{ $labels.route }}}} have been "
        f"5xx for {HTTP_5XX_WINDOW} (a drain's 503 shutting_down not counted).",
    ),
    Alert(
        "SpurReplicaUnhealthy",
        # A gone replica stays listed (unhealthy) until a new one starts on its node
        # or for 10 minutes of silence: 15 minutes means one that still reports.
        "max by (lane, engine, node) (spur:replica_healthy) == 0",
        "15m",
        "warning",
        "Replica {{ $labels.engine }} of lane {{ $labels.lane }} on {{ $labels.node }} has "
        "been unhealthy for 15 minutes: no request is routed to it.",
    ),
)


# -- rendering --------------------------------------------------------------------------
def _panel_json(panel: Panel, pid: int, x: int, y: int) -> dict[str, Any]:
    return {
        "id": pid,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": dict(DATASOURCE),
        "gridPos": {"h": 8, "w": 12, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
        "targets": [
            {
                "refId": chr(ord("A") + i),
                "datasource": dict(DATASOURCE),
                "expr": expr,
                "legendFormat": legend,
                **({"format": "table", "instant": True} if panel.kind == "table" else {}),
            }
            for i, (expr, legend) in enumerate(panel.targets)
        ],
    }


def _variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": dict(DATASOURCE),
        "query": {"query": query, "refId": f"{name}-var"},
        "definition": query,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "refresh": 2,
    }


def dashboard_json(d: Dashboard) -> dict[str, Any]:
    """Grafana dashboard model (schemaVersion 39) of `d`: two panels a row."""
    return {
        "uid": d.uid,
        "title": d.title,
        "description": d.description,
        "tags": ["spur", "vllm"],
        "timezone": "browser",
        "schemaVersion": 39,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {"text": "spur", "value": DATASOURCE_UID},
                    "refresh": 1,
                    "hide": 0,
                },
                _variable("lane", "lane", "label_values(vllm:num_requests_running, lane)"),
                _variable("model", "model", "label_values(vllm:num_requests_running, model_name)"),
            ]
        },
        "panels": [
            _panel_json(p, i + 1, 12 * (i % 2), 8 * (i // 2)) for i, p in enumerate(d.panels)
        ],
    }


def alert_rules() -> dict[str, Any]:
    """The Prometheus rule file (`groups:`) of ALERTS."""
    return {
        "groups": [
            {
                "name": "spur",
                "rules": [
                    {
                        "alert": a.name,
                        "expr": a.expr,
                        "for": a.for_,
                        "labels": {"severity": a.severity},
                        "annotations": {"summary": a.summary},
                    }
                    for a in ALERTS
                ],
            }
        ]
    }


def file_name(d: Dashboard) -> str:
    return f"{d.uid}.json"


def export(out: Path) -> list[Path]:
    """Write every dashboard's JSON and alerts.yaml into `out`; returns the paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for d in DASHBOARDS:
        path = out / file_name(d)
        path.write_text(json.dumps(dashboard_json(d), indent=2, sort_keys=True) + "\n")
        paths.append(path)
    alerts = out / "alerts.yaml"
    alerts.write_text(
        "# Generated by `spur dashboards export` from spur/cluster/dashboards.py: edit there.\n"
        + yaml.safe_dump(alert_rules(), sort_keys=False, width=1000)
    )
    paths.append(alerts)
    return paths


def write_chart_files(chart: Path) -> None:
    """The chart's copies: files/dashboards/*.json and files/alerts.yaml."""
    for path in export(chart / "files" / "dashboards"):
        if path.name == "alerts.yaml":
            path.replace(chart / "files" / "alerts.yaml")


def concrete(expr: str, rate_interval: str = "1m") -> str:
    """`expr` with Grafana's variables replaced, for evaluation by Prometheus."""
    expr = expr.replace("$__rate_interval", rate_interval)
    return re.sub(r"\$(lane|model)\b", ".*", expr)


def all_queries() -> list[tuple[str, str, str]]:
    """(dashboard uid, panel title, PromQL) of every target."""
    return [(d.uid, p.title, e) for d in DASHBOARDS for p in d.panels for e, _ in p.targets]


if __name__ == "__main__":  # python -m spur.cluster.dashboards: refresh the chart's files
    write_chart_files(Path(__file__).resolve().parent.parent / "helm" / "spur")
