"""A real Prometheus scrapes a live `spur serve` every 0.25 s while the official
`openai` client sends a known workload. The tests run in order (one server, one
Prometheus): counts, a preemption storm, the leaky lane, failover, a restart
loop, then every dashboard panel and alert expression, then `spur top`.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import sys
import time
from typing import Any

import httpx
import pytest

from spur.cluster.dashboards import ALERTS, all_queries, concrete, http_5xx_share

from .conftest import Prometheus, Server

pytestmark = pytest.mark.slow

CHAT = '{lane="chat"}'
ENGINE_METRICS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
    "spur:kv_blocks_held",
    "spur:kv_blocks_geometry",
    "spur:kv_held_over_geometry",
    "spur:kv_request_held_over_geometry_max",
    "spur:kv_leak_violations_total",
    "spur:capacity_claimed_max_concurrency",
    "spur:capacity_pool_tokens",
    "spur:replica_healthy",
    *(
        f"{h}_bucket"
        for h in (
            "vllm:time_to_first_token_seconds",
            "vllm:inter_token_latency_seconds",
            "vllm:request_time_per_output_token_seconds",
            "vllm:e2e_request_latency_seconds",
            "vllm:request_queue_time_seconds",
            "vllm:request_inference_time_seconds",
            "vllm:request_prefill_time_seconds",
            "vllm:request_decode_time_seconds",
            "vllm:request_prompt_tokens",
            "vllm:request_generation_tokens",
            "vllm:iteration_tokens_total",
        )
    ),
)
CLUSTER_METRICS = (
    "spur:routing_decisions_total",
    "spur:routing_matched_blocks_bucket",
    "spur:kv_index_event_lag_seconds",
    "spur:lane_target",
    "spur:lane_on_spare",
    "spur:lane_failovers_total",
    "spur:retries_total",
    "spur:stream_continuations_total",
    "spur:replica_restarts_total",
    "spur:http_requests_total",
    "spur:http_errors_total",
    "spur:config_info",
)
# Queries from vLLM's published Grafana dashboard
# (examples/online_serving/prometheus_grafana/grafana.json), with $model_name set.
VLLM_DASHBOARD = (
    'histogram_quantile(0.99, sum by(le) (rate(vllm:e2e_request_latency_seconds_bucket{model_name="chat"}[1m])))',  # noqa: E501
    'rate(vllm:prompt_tokens_total{model_name="chat"}[1m])',
    'rate(vllm:generation_tokens_total{model_name="chat"}[1m])',
    'vllm:num_requests_running{model_name="chat"}',
    'vllm:num_requests_waiting{model_name="chat"}',
    'histogram_quantile(0.9, sum by(le) (rate(vllm:time_to_first_token_seconds_bucket{model_name="chat"}[1m])))',  # noqa: E501
    'sum by(finished_reason) (increase(vllm:request_success_total{model_name="chat"}[1m]))',
    'rate(vllm:request_prefill_time_seconds_sum{model_name="chat"}[1m])',
    'rate(vllm:request_decode_time_seconds_sum{model_name="chat"}[1m])',
    'sum by(le) (increase(vllm:request_prompt_tokens_bucket{model_name="chat"}[1m]))',
    'vllm:kv_cache_usage_perc{model_name="chat"}',
)  # fmt: skip


def client(server: Server) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120.0)


def alert(name: str) -> str:
    return next(a.expr for a in ALERTS if a.name == name)


def test_counts_equal_the_clients_own(obs_server: Server, prom: Prometheus) -> None:
    oai = client(obs_server)
    prompt_tokens = completion_tokens = requests = 0
    extra = {"ignore_eos": True}
    for i in range(4):
        r = oai.chat.completions.create(
            model="chat",
            messages=[{"role": "user", "content": f"Say something about rivers, number {i}."}],
            max_tokens=8 + i,
            extra_body=extra,
        )
        prompt_tokens += r.usage.prompt_tokens
        completion_tokens += r.usage.completion_tokens
        requests += 1
    for i in range(3):
        stream = oai.completions.create(
            model="chat",
            prompt=f"The mountains beyond the valley {i}",
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
        )
        for chunk in stream:
            if chunk.usage is not None:
                prompt_tokens += chunk.usage.prompt_tokens
                completion_tokens += chunk.usage.completion_tokens
        requests += 1
    # Errors are counted by code: an unknown model (404) and a bad value (400).
    with httpx.Client(base_url=obs_server.url, timeout=60) as http:
        assert (
            http.post("/v1/completions", json={"model": "nope", "prompt": "x"}).status_code == 404
        )
        bad = {"model": "chat", "prompt": "x", "temperature": -1}
        assert http.post("/v1/completions", json=bad).status_code == 400

    # The spare serves only chat's traffic: chat's requests are counted on one of them.
    both = '{lane=~"chat|spare"}'

    def counted() -> tuple[float | None, ...]:
        return (
            prom.value(f"sum(vllm:prompt_tokens_total{both})"),
            prom.value(f"sum(vllm:generation_tokens_total{both})"),
            prom.value(f"sum(vllm:request_success_total{both})"),
            prom.value(f"sum(vllm:time_to_first_token_seconds_count{both})"),
        )

    want = (float(prompt_tokens), float(completion_tokens), float(requests), float(requests))
    prom.wait("Prometheus has the client's counts", lambda: counted() == want or None)
    for name in ENGINE_METRICS:
        series = prom.query(f'{name}{{lane="chat"}}')
        assert series, f"{name} missing for lane chat"
        labels = series[0]["metric"]
        assert labels["model_name"] == "chat" and labels["engine"], labels
    spare = prom.query('vllm:num_requests_running{lane="spare"}')
    assert spare and spare[0]["metric"]["serves"] == "chat"
    info = prom.query('vllm:cache_config_info{lane="chat"}')[0]["metric"]
    assert info["block_size"] == "16" and info["num_gpu_blocks"] == "96", info
    assert info["enable_prefix_caching"] == "True" and info["cache_dtype"] == "auto"
    for name in CLUSTER_METRICS:
        assert prom.query(name), f"{name} missing"
    prom.wait(
        "errors counted by code",
        lambda: (
            prom.query('spur:http_errors_total{status="404",code="model_not_found"} > 0')
            and prom.query('spur:http_errors_total{status="400"} > 0')
        ),
    )
    assert prom.value(
        'sum(spur:http_requests_total{route="/v1/chat/completions",status="200"})'
    ) == float(4)
    # The capacity claim of the chat engine: 95 usable blocks / 32 per 512-token request.
    assert prom.value(f"max(spur:capacity_claimed_max_concurrency{CHAT})") == 95 // 32
    assert prom.value(f"max(spur:kv_held_over_geometry_peak{CHAT})") == 1.0


def _burst(server: Server, model: str, n: int, max_tokens: int) -> list[int]:
    def one(i: int) -> int:
        body = {
            "model": model,
            "prompt": f"storm {i} " + "word " * 40,
            "max_tokens": max_tokens,
            "ignore_eos": True,
        }
        with httpx.Client(base_url=server.url, timeout=300) as http:
            return http.post("/v1/completions", json=body).status_code

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def _while_running(
    prom: Prometheus, work: Any, alerts: tuple[str, ...]
) -> tuple[list[int], dict[str, bool]]:
    """Run `work()`; then report which `alerts` had an expression returning a series
    at some scrape while it ran (a range query over its interval)."""
    start = time.time()
    result = work()
    end = time.time() + 2.0
    # The interval's last engine push (every 0.25 s) reaches a scrape after `end`.
    prom.wait(
        "a scrape after the interval",
        lambda: (prom.value("max(timestamp(spur:config_info))") or 0) > end,
        timeout_s=30,
    )
    return result, {name: prom.held_between(alert(name), start, end) for name in alerts}


def test_preemption_storm(obs_server: Server, prom: Prometheus) -> None:
    """16 long requests on the chat engine's 96-block pool: preemptions rise, and a
    correct engine stays truthful under pressure (held == geometry, no leak). Each
    request grows to 22 blocks (44 prompt + 300 output tokens), so any 5 running at
    once overflow the pool: with 100 output tokens (9 blocks) it took 11, and on a
    busy machine the tiny model finished the first requests before the last arrived."""
    before = prom.value(f"sum(vllm:num_preemptions_total{CHAT})") or 0.0
    assert _burst(obs_server, "chat", 16, 300) == [200] * 16
    prom.wait(
        "num_preemptions rose",
        lambda: (prom.value(f"sum(vllm:num_preemptions_total{CHAT})") or 0) > before,
    )
    assert prom.value(f"max(spur:kv_held_over_geometry_peak{CHAT})") == 1.0
    assert prom.value(f"sum(spur:kv_leak_violations_total{CHAT})") == 0.0


def test_the_leak_shows(obs_server: Server, prom: Prometheus) -> None:
    """The leaky lane's broken retirement keeps an extra block per step (up to just
    over twice what a request needs): held/geometry exceeds 2 within one request,
    the leak detector counts the requests, and the leaked blocks fill the pool
    while requests wait. Each of those alerts' expressions holds.

    Sizes: 44-token prompts and 200 tokens out (3 to 16 blocks of 16), 2 running
    at a time in 48 blocks: both requests stay at 2n + 1 blocks (over 2x) until n
    reaches 11 (about 140 steps, several of the engine's 0.25 s capacity samples
    even on a fast machine); from there the pool is full while the rest wait, until
    a preemption frees one request's blocks: a few steps per pair of requests. So
    12 requests (6 such moments), and the engines report and Prometheus scrapes every
    0.25 s here (conftest): with 6 requests and 1 s scrapes the tiny model ran
    through them between two scrapes once the engine got faster."""
    leaky = '{lane="leaky"}'
    statuses, seen = _while_running(
        prom,
        lambda: _burst(obs_server, "leaky", 12, 200),
        ("SpurHeldOverGeometry", "SpurKVFullWhileWaiting"),
    )
    assert statuses == [200] * 12
    prom.wait(
        "the leak counter rose",
        lambda: (prom.value(f"sum(spur:kv_leak_violations_total{leaky})") or 0) >= 1,
    )
    assert (prom.value(f"max(spur:kv_held_over_geometry_peak{leaky})") or 0) > 2.0
    worst = f"max_over_time(max(spur:kv_request_held_over_geometry_max{leaky})[5m:250ms])"
    assert (prom.value(worst) or 0) > 2.0
    assert seen["SpurHeldOverGeometry"], "held/geometry > 1.2 never seen while it ran"
    assert seen["SpurKVFullWhileWaiting"], "KV usage > 0.95 with requests waiting never seen"
    assert prom.query(alert("SpurKVLeakViolations"))


def test_failover_flips_the_lane_target_and_back(obs_server: Server, prom: Prometheus) -> None:
    """Stop (SIGSTOP) the chat lane's only primary and the leaky lane's engine:
    chat's target gauge flips to the spare and the lane-on-spare alert expression
    holds; a leaky request answers 503 (no replica, no spare: a 5xx share);
    after SIGCONT the chat lane returns to its primary."""
    engines = obs_server.get("/admin/engines")
    pids = [int(engines[lane]["pid"]) for lane in ("chat", "leaky")]
    on_spare = 'spur:lane_target{lane="chat",target="spare"}'
    try:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        prom.wait("chat moved to the spare", lambda: prom.value(on_spare) == 1.0, timeout_s=30)
        assert prom.query(alert("SpurLaneOnSpare"))
        oai = client(obs_server)
        r = oai.completions.create(model="chat", prompt="still served", max_tokens=4)
        assert r.usage.completion_tokens == 4
        with httpx.Client(base_url=obs_server.url, timeout=120) as http:
            lost = http.post("/v1/completions", json={"model": "leaky", "prompt": "x"})
        assert lost.status_code == 503, lost.text
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    prom.wait("chat back on its primary", lambda: prom.value(on_spare) == 0.0, timeout_s=60)
    prom.wait(
        "failovers counted",
        # at least this one (a heartbeat late under load may have moved it before)
        lambda: (prom.value('sum(spur:lane_failovers_total{lane="chat",to="spare"})') or 0) >= 1.0,
    )
    # The 503 counts in the share of 5xx answers the 5xx alert watches (one among the
    # many answers of this module does not page: test_rules.py).
    share = http_5xx_share("5m")
    prom.wait("the 503 in the 5xx share", lambda: prom.query(f"{share} > 0"), timeout_s=20)
    assert prom.query('spur:http_errors_total{status="503",code="service_unavailable"} > 0')


def test_restart_loop_shows(obs_server: Server, prom: Prometheus) -> None:
    """Three start failures of the leaky lane on one node within the window (reported
    to the KV index exactly as a failing replica constructor reports them) mark that
    slot down: spur:restart_loop and the restart-loop alert expression hold."""
    obs_server.ray_call(
        "from spur.cluster.routing.index_actor import INDEX_NAME\n"
        "index = ray.get_actor(INDEX_NAME, namespace='spur')\n"
        "for i in range(3):\n"
        "    ray.get(index.start_failed.remote('leaky', 'node-x', f'OSError: boom {i}'))\n"
    )
    loop = 'spur:restart_loop{lane="leaky",node="node-x"}'
    prom.wait("the restart loop gauge", lambda: prom.value(loop) == 1.0, timeout_s=30)
    assert prom.value('spur:replica_start_failures_total{lane="leaky",node="node-x"}') == 3.0
    assert prom.query(alert("SpurRestartLoop"))
    lanes = obs_server.get("/admin/lanes")
    assert [s["node"] for s in lanes["leaky"]["down_slots"]] == ["node-x"]


def test_every_panel_and_alert_evaluates(prom: Prometheus) -> None:
    empty = []
    for uid, title, expr in all_queries():
        if not prom.query(concrete(expr)):
            empty.append(f"{uid} / {title}: {expr}")
    assert not empty, "panels without data:\n" + "\n".join(empty)
    for a in ALERTS:
        prom.query(a.expr)  # valid PromQL over existing series (raises otherwise)
    for expr in VLLM_DASHBOARD:
        assert prom.query(expr), f"vLLM dashboard query without data: {expr}"


def test_spur_top_once_prints_every_lane_and_replica(obs_server: Server) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "spur.cluster.cli", "top", "--url", obs_server.url, "--once"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert res.returncode == 0, res.stderr
    lanes = obs_server.get("/admin/lanes")
    for lane, report in lanes.items():
        assert lane in res.stdout
        for replica in report["replicas"]:
            assert replica["replica_id"][:12] in res.stdout, res.stdout
    assert "chat" in res.stdout and "spare" in res.stdout
