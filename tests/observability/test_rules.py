"""`promtool test rules` on the chart's rule file and on the dashboards' panel
queries, with synthetic series: the 5xx alert pages on a sustained share of
server errors, not on one error nor on a drain's 503 shutting_down; a replica
held unhealthy pages; latency and token panels keep lanes apart; the capacity,
leak, failover, health and stats-age panels read what their titles say."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from spur.cluster import dashboards as D
from spur.cluster.metrics import IngressCounters, route_of

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "helm" / "spur" / "files" / "alerts.yaml"
API = "/v1/completions"


def _promtool() -> str:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("no `promtool`: install Debian's prometheus package (.ci/run does)")
    return promtool


def run_promtool(tmp_path: Path, tests: list[dict[str, Any]]) -> None:
    path = tmp_path / "rules_test.yaml"
    body = {"rule_files": [str(RULES)], "evaluation_interval": "15s", "tests": tests}
    path.write_text(json.dumps(body))  # JSON is YAML
    res = subprocess.run(
        [_promtool(), "test", "rules", str(path)], capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stdout + res.stderr


def fired(name: str, **labels: str) -> dict[str, Any]:
    """promtool's expectation of alert `name` firing with `labels` (its summary filled)."""
    alert = next(a for a in D.ALERTS if a.name == name)
    summary = alert.summary
    for key, value in labels.items():
        summary = summary.replace(f"{{{{ $labels.{key} }}}}", value)
    return {
        "exp_labels": {"severity": alert.severity, **labels},
        "exp_annotations": {"summary": summary},
    }


def silent(name: str, *minutes: int) -> list[dict[str, Any]]:
    return [{"eval_time": f"{m}m", "alertname": name, "exp_alerts": []} for m in minutes]


def panel(title: str, legend: str = "") -> str:
    """The query of a panel's target whose legend starts with `legend`, with the
    dashboard variables set to match everything and a 5-minute rate window."""
    p = next(p for d in D.DASHBOARDS for p in d.panels if p.title == title)
    expr = next(e for e, leg in p.targets if leg.startswith(legend))
    return D.concrete(expr, "5m")


def http(route: str, status: str, values: str, code: str | None = None) -> list[dict[str, str]]:
    """A route's answers of `status` (and, for an error, its error counter with `code`)."""
    out = [
        {
            "series": f'spur:http_requests_total{{route="{route}",status="{status}"}}',
            "values": values,
        }
    ]
    if code is not None:
        labels = f'route="{route}",status="{status}",code="{code}"'
        out.append({"series": f"spur:http_errors_total{{{labels}}}", "values": values})
    return out


def test_5xx_alert_pages_on_a_sustained_share_only(tmp_path: Path) -> None:
    run_promtool(
        tmp_path,
        [
            {  # 6 of every 66 answers are 500 from minute 11: past 5% of the 5-minute
                # window from about minute 13, it pages 5 minutes later
                "name": "sustained_500s",
                "interval": "1m",
                "input_series": [
                    *http(API, "200", "0+60x30"),
                    *http(API, "500", "0x10 6+6x20", code="internal_error"),
                ],
                "alert_rule_test": [
                    *silent("SpurHTTP5xx", 9, 14),
                    {
                        "eval_time": "20m",
                        "alertname": "SpurHTTP5xx",
                        "exp_alerts": [fired("SpurHTTP5xx", route=API)],
                    },
                ],
            },
            {  # one 500 on a quiet route (a sixth of its answers for 4 minutes): no page
                "name": "one_500",
                "interval": "1m",
                "input_series": [
                    *http(API, "200", "0+1x20"),
                    *http(API, "500", "0x5 1x15", code="internal_error"),
                ],
                "alert_rule_test": silent("SpurHTTP5xx", 6, 8, 9, 10, 11, 12),
            },
            {  # a rolling upgrade: every new request answered 503 shutting_down for 10
                # minutes, /health 503 draining: no page
                "name": "drain",
                "interval": "1m",
                "input_series": [
                    *http(API, "200", "0+60x10 600x10"),
                    *http(API, "503", "0x10 120+120x10", code="shutting_down"),
                    *http("/health", "503", "0x10 10+10x10", code=""),
                ],
                "alert_rule_test": silent("SpurHTTP5xx", 11, 13, 16, 18, 20),
            },
            {  # a first 500 on /tokenize counts: its series exists at 0 from the start
                "name": "first_500_on_a_seeded_route",
                "interval": "1m",
                "input_series": [
                    *http("/tokenize", "200", "0+10x30"),
                    *http("/tokenize", "500", "0x10 5+5x20", code="internal_error"),
                ],
                "alert_rule_test": [
                    {
                        "eval_time": "20m",
                        "alertname": "SpurHTTP5xx",
                        "exp_alerts": [fired("SpurHTTP5xx", route="/tokenize")],
                    },
                ],
            },
        ],
    )


def test_every_route_has_its_5xx_series_from_the_start() -> None:
    """rate() sees no increase in a series born at 1: the 500 and 503 series of every
    route exist at 0 before the first one (only two routes' did); /health/live has
    its own route label (it was "other")."""
    assert route_of("/health/live") == "/health/live"
    snap = IngressCounters().snapshot()
    for route in ("/tokenize", "/detokenize", "/v1/models", "/version", "/health/live", API):
        assert [route, "500", 0] in snap["requests"], route
        assert [route, "503", 0] in snap["requests"], route
        assert [route, "500", "internal_error", 0] in snap["errors"], route
    assert [API, "429", "queue_full", 0] in snap["errors"]


def test_a_replica_held_unhealthy_pages(tmp_path: Path) -> None:
    engine = 'lane="chat",engine="{}",model_name="smol",serves="chat",node="n1"'
    run_promtool(
        tmp_path,
        [
            {
                "name": "unhealthy_replica",
                "interval": "1m",
                "input_series": [
                    {  # still reporting, held unhealthy from minute 5
                        "series": "spur:replica_healthy{" + engine.format("r1") + "}",
                        "values": "1x5 0x30",
                    },
                    {  # gone: listed unhealthy until the index forgets it (10 minutes)
                        "series": "spur:replica_healthy{" + engine.format("r2") + "}",
                        "values": "1x5 0x9 _x20",
                    },
                ],
                "alert_rule_test": [
                    *silent("SpurReplicaUnhealthy", 15, 19),
                    {
                        "eval_time": "21m",
                        "alertname": "SpurReplicaUnhealthy",
                        "exp_alerts": [
                            fired("SpurReplicaUnhealthy", lane="chat", engine="r1", node="n1")
                        ],
                    },
                ],
            },
        ],
    )


def _engine(lane: str, engine: str) -> str:
    return f'lane="{lane}",engine="{engine}",model_name="m",serves="{lane}"'


def _histogram(metric: str, lane: str, engine: str, counts: dict[str, str]) -> list[dict[str, str]]:
    return [
        {"series": f'{metric}_bucket{{{_engine(lane, engine)},le="{le}"}}', "values": values}
        for le, values in counts.items()
    ]


def test_latency_and_token_panels_keep_lanes_apart(tmp_path: Path) -> None:
    """With every lane selected, a fast lane and a slow one are two lines each, not
    one blended quantile (chat's requests on the spare count as chat's)."""
    fast = {"0.5": "0+10x10", "1": "0+10x10", "3": "0+10x10", "+Inf": "0+10x10"}
    slow = {"0.5": "0x10", "1": "0x10", "3": "0+10x10", "+Inf": "0+10x10"}
    series = []
    for name in (
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
    ):
        series += _histogram(name, "chat", "c1", fast)
        series += _histogram(name, "chat", "spare1", fast)
        series += _histogram(name, "reasoning", "r1", slow)
    series += [
        {"series": f"vllm:prompt_tokens_total{{{_engine('chat', 'c1')}}}", "values": "0+600x10"},
        {
            "series": f"vllm:prompt_tokens_total{{{_engine('chat', 'spare1')}}}",
            "values": "0+600x10",
        },
        {
            "series": f"vllm:prompt_tokens_total{{{_engine('reasoning', 'r1')}}}",
            "values": "0+60x10",
        },
    ]
    by_lane = [
        {"labels": '{lane="chat"}', "value": 0.25},
        {"labels": '{lane="reasoning"}', "value": 2},
    ]
    checks = [
        {"expr": panel(title, "p50"), "eval_time": "8m", "exp_samples": by_lane}
        for title in ("Time to first token", "Inter-token latency", "End-to-end latency")
    ]
    checks.append(
        {
            "expr": panel("Tokens/s", "prompt"),
            "eval_time": "8m",
            "exp_samples": [
                {"labels": '{lane="chat"}', "value": 20},
                {"labels": '{lane="reasoning"}', "value": 1},
            ],
        }
    )
    run_promtool(
        tmp_path,
        [{"name": "lanes", "interval": "1m", "input_series": series, "promql_expr_test": checks}],
    )
    for title in ("Tokens/s", "Time to first token", "Inter-token latency", "End-to-end latency"):
        p = next(p for p in D.OVERVIEW.panels if p.title == title)
        assert all("{{lane}}" in legend for _, legend in p.targets), title


def test_capacity_leak_failover_and_health_panels(tmp_path: Path) -> None:
    c1, c2 = _engine("chat", "c1"), _engine("chat", "c2")
    series = [
        # two chat replicas, each claiming 2 max-length requests, half and a quarter full
        {"series": f"spur:capacity_claimed_max_concurrency{{{c1}}}", "values": "2x30"},
        {"series": f"spur:capacity_claimed_max_concurrency{{{c2}}}", "values": "2x30"},
        {"series": f"vllm:kv_cache_usage_perc{{{c1}}}", "values": "0.5x30"},
        {"series": f"vllm:kv_cache_usage_perc{{{c2}}}", "values": "0.25x30"},
        # three violations at minute 2, none since
        {"series": f"spur:kv_leak_violations_total{{{c1}}}", "values": "0 0 3x30"},
        # one failover at minute 2
        {
            "series": 'spur:lane_failovers_total{lane="chat",from="chat",to="spare",reason="down"}',
            "values": "0 0 1x30",
        },
        # c1 healthy and reporting; c2 listed unhealthy; c3 drained (no longer listed)
        {"series": f'spur:replica_healthy{{{c1},node="n1"}}', "values": "1x30"},
        {"series": f'spur:replica_healthy{{{c2},node="n2"}}', "values": "0x30"},
        {"series": f"spur:engine_stats_age_seconds{{{c1}}}", "values": "0.5x30"},
        {"series": f"spur:engine_stats_age_seconds{{{c2}}}", "values": "0+60x30"},
        {
            "series": f"spur:engine_stats_age_seconds{{{_engine('chat', 'c3')}}}",
            "values": "0+60x30",
        },
    ]
    concurrency = "Claimed capacity vs KV in use (max-length requests)"
    chat = '{lane="chat"}'
    checks = [
        {
            "expr": panel(concurrency, "KV in use"),
            "eval_time": "5m",
            "exp_samples": [{"labels": chat, "value": 1.5}],  # of the claimed 4
        },
        {
            "expr": panel(concurrency, "claimed"),
            "eval_time": "5m",
            "exp_samples": [{"labels": chat, "value": 4}],
        },
        {
            "expr": panel("Leak detector violations (last 10 min)"),
            "eval_time": "20m",  # the raw counter would still read 3
            "exp_samples": [{"labels": '{lane="chat",engine="c1"}', "value": 0}],
        },
        {
            "expr": panel("Failovers (last 10 min)"),
            "eval_time": "25m",
            "exp_samples": [
                {"labels": '{lane="chat",from="chat",to="spare",reason="down"}', "value": 0}
            ],
        },
        {
            "expr": panel("Unhealthy replicas"),
            "eval_time": "5m",
            "exp_samples": [{"labels": chat, "value": 1}],
        },
        {
            "expr": panel("Engine stats age"),
            "eval_time": "5m",
            "exp_samples": [
                {"labels": '{lane="chat",engine="c1"}', "value": 0.5},
                {"labels": '{lane="chat",engine="c2"}', "value": 300},
            ],
        },
    ]
    run_promtool(
        tmp_path,
        [{"name": "panels", "interval": "1m", "input_series": series, "promql_expr_test": checks}],
    )
    description = next(p for p in D.CAPACITY.panels if p.title == concurrency).description
    assert "any length" in description
