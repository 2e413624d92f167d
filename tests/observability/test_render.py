"""The metrics store and the exposition, without a cluster: two ingress replicas'
counters sum (lane switches do not double), gone sources keep their totals,
the text parses back with vLLM's names, labels and cumulative buckets."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from spur.actors.engine.shell.metrics import EngineMetrics
from spur.cluster.metrics import (
    ADMIN_ROUTES,
    IngressCounters,
    MetricsStore,
    config_hash,
    render,
    route_of,
)
from spur.configs.loader import config_to_dict, parse_config

CONFIG = config_to_dict(
    parse_config(
        {
            "version": 1,
            "lanes": [{"name": "chat", "served_model_names": ["smol", "chat"]}],
            "spare": {"name": "spare", "serves_lanes": ["chat"]},
        }
    )
)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def engine_snapshot(tokens: int) -> dict[str, Any]:
    m = EngineMetrics(max_model_len=128)
    m.prompt_tokens = tokens
    m.histograms["vllm:time_to_first_token_seconds"].observe(0.03)
    m.histograms["vllm:time_to_first_token_seconds"].observe(7.0)
    return m.snapshot()


def test_store_sums_ingress_counters_and_keeps_gone_ones() -> None:
    clock = Clock()
    store = MetricsStore(retain_s=60, clock=clock)
    a, b = IngressCounters(), IngressCounters()
    for c in (a, b):
        c.observe("/v1/completions", 200)
        c.error("/v1/completions", 429, "queue_full")
        c.failover("chat", "chat", "spare", "down")
    store.update_ingress("a", a.snapshot())
    store.update_ingress("b", b.snapshot())
    store.update_engine("r1", "chat", engine_snapshot(10))
    clock.now = 120  # r1 silent past retain_s; ingress "a" gone too
    store.update_engine("r2", "spare", engine_snapshot(5))
    view = store.view()
    assert list(view["engines"]) == ["r2"]
    assert [r for r in view["http"]["requests"] if r[-1]] == [["/v1/completions", "200", 2]]
    # 5xx series exist at 0 before the first one (rate() then sees the first error).
    assert ["/v1/chat/completions", "503", 0] in view["http"]["requests"]
    assert view["http"]["failovers"] == [["chat", "chat", "spare", "down", 1]]
    text = render({"store": view}, CONFIG).decode()
    got = samples(text)
    full = {lab["route"]: v for lab, v in got["spur:http_queue_full_total"]}
    assert full == {"/v1/completions": 2.0, "/v1/chat/completions": 0.0}
    # The spare's own series; the lane it serves (chat) has its own, at 0 until a
    # request of chat runs on it.
    prompt = {lab["lane"]: (lab, v) for lab, v in got["vllm:prompt_tokens_total"]}
    assert set(prompt) == {"spare", "chat"} and prompt["chat"][1] == 0.0
    labels, value = prompt["spare"]
    assert labels == {"model_name": "smol", "engine": "r2", "lane": "spare", "serves": "chat"}
    assert value == 5.0
    ttft = got["vllm:time_to_first_token_seconds_bucket"]
    buckets = {lab["le"]: v for lab, v in ttft if lab["lane"] == "spare"}
    assert buckets["0.04"] == 1.0 and buckets["5.0"] == 1.0 and buckets["+Inf"] == 2.0
    assert all(v == 0.0 for lab, v in ttft if lab["lane"] == "chat")
    counts = {lab["lane"]: v for lab, v in got["vllm:time_to_first_token_seconds_count"]}
    assert counts == {"spare": 2.0, "chat": 0.0}
    # Zero-valued series exist before anything happens (panels and alerts have data).
    assert ({"lane": "chat"}, 0.0) in got["spur:retries_total"]
    assert got["spur:lane_on_spare"] == [({"lane": "chat", "spare": "spare"}, 0.0)]
    ((info, _),) = got["spur:config_info"]
    assert info == {"config_hash": config_hash(CONFIG), "version": "1"}


def test_routes_are_bounded() -> None:
    """The counters count before authentication: "/admin/<anything>" was its own label,
    so any client could add series without end. Only the served routes are labels."""
    assert route_of("/v1/completions") == "/v1/completions"
    assert route_of("/admin/lanes") == "/admin/lanes"
    assert route_of("/admin/a/b") == "/admin/other"
    assert route_of("/wp-login.php") == "other"
    probes = {route_of(f"/admin/probe-{i}") for i in range(100)}
    assert probes == {"/admin/other"}
    assert {route_of(r) for r in ADMIN_ROUTES} == ADMIN_ROUTES
    ingress = (Path(__file__).parents[2] / "cluster" / "ingress.py").read_text()
    served = set(re.findall(r'@app\.(?:get|post)\(\s*"(/admin/[^"]+)"', ingress))
    assert served == ADMIN_ROUTES  # every admin route of the ingress, and no other


def test_gauges_of_the_last_replica_to_leave_are_not_shown_live() -> None:
    """A lane's only replica drained away (the index lists none): its last snapshot stays
    in the store for retain_s, and every engine counted as live when no replica was
    listed, so the dead engine's 7 running requests and 0.97 KV usage were shown."""
    store = MetricsStore(retain_s=600, clock=Clock())
    m = EngineMetrics(max_model_len=128)
    m.prompt_tokens, m.num_running, m.kv_usage = 10, 7, 0.97
    store.update_engine("dead-1", "chat", m.snapshot())
    got = samples(
        render({"store": store.view(), "lanes": {"chat": {"replicas": []}}}, CONFIG).decode()
    )
    assert "dead-1" not in {lab["engine"] for lab, _ in got.get("vllm:num_requests_running", [])}
    assert "dead-1" not in {lab["engine"] for lab, _ in got.get("vllm:kv_cache_usage_perc", [])}
    assert {lab["engine"]: v for lab, v in got["vllm:prompt_tokens_total"]} == {"dead-1": 10.0}


def test_a_failed_or_departed_replica_keeps_its_totals_but_not_its_gauges() -> None:
    """r1 died running 7 requests, r2 replaced it idle, r3 drained away (no longer in
    the index): the sum of vllm:num_requests_running over engines is r2's 0, not 7,
    and the lane claims r2's capacity only (the capacity dashboard sums it by lane)."""
    store = MetricsStore(retain_s=600, clock=Clock())
    for rid, running in (("r1", 7), ("r2", 0), ("r3", 2)):
        info = {"claimed_max_concurrency": 8, "pool_tokens": 1024}
        m = EngineMetrics(max_model_len=128, info=info)
        m.prompt_tokens, m.num_running = 10, running
        store.update_engine(rid, "chat", m.snapshot())
    replicas = [
        {"replica_id": "r1", "healthy": False, "node": "n1"},
        {"replica_id": "r2", "healthy": True, "node": "n1"},
    ]
    view = {"store": store.view(), "lanes": {"chat": {"replicas": replicas}}}
    got = samples(render(view, CONFIG).decode())
    running = {lab["engine"]: v for lab, v in got["vllm:num_requests_running"]}
    assert running == {"r2": 0.0}
    prompt = {lab["engine"]: v for lab, v in got["vllm:prompt_tokens_total"]}
    assert prompt == {"r1": 10.0, "r2": 10.0, "r3": 10.0}  # totals stay
    for name, value in (
        ("spur:capacity_claimed_max_concurrency", 8.0),
        ("spur:capacity_pool_tokens", 1024.0),
    ):
        assert {lab["engine"]: v for lab, v in got[name]} == {"r2": value}, name


def test_a_drained_replicas_last_snapshot_reaches_the_store() -> None:
    """A draining replica leaves the index and stops publishing when the drain begins;
    the requests it finishes meanwhile reach /metrics with its drain report."""
    from spur.cluster.routing.index_actor import KVIndexActor

    actor = KVIndexActor(heartbeat_timeout_s=3.0)
    actor.register("r1", "chat", "n1")
    actor.leave("r1")
    actor.record_drain({"replica_id": "r1", "lane": "chat", "finished": 3}, engine_snapshot(42))
    engines = actor.store.view()["engines"]
    assert engines["r1"]["snapshot"]["counters"]["vllm:prompt_tokens"] == 42


def test_spur_top_rates_count_from_one_engine_report_to_another() -> None:
    """Engines report about every second; `spur top` reads whenever it likes. Rates
    over the readings' own times alias (a 0.9 s gap holding one second of tokens
    reads 11% high; a gap with no report reads 0): they run from report to report,
    which spur:engine_stats_age_seconds dates."""
    from spur.cluster.top import Reading, rates

    store = MetricsStore(retain_s=600, clock=Clock())
    store.clock.now = 10.0  # the engine reports 100 tokens at t = 10.0
    m = EngineMetrics(max_model_len=128)
    m.generation_tokens = 100
    store.update_engine("r1", "chat", m.snapshot())

    def reading(at: float) -> Reading:
        store.clock.now = at
        got = samples(render({"store": store.view(), "lanes": {}}, CONFIG).decode())
        return Reading(at, got)

    first = reading(10.4)
    assert rates(reading(10.9), first, "vllm:generation_tokens_total") == {}  # no new report
    store.clock.now = 11.05  # 121 tokens at t = 11.05: 21 in 1.05 s
    m.generation_tokens = 121
    store.update_engine("r1", "chat", m.snapshot())
    got = rates(reading(11.3), first, "vllm:generation_tokens_total")
    assert got == {"r1": pytest.approx(20.0, abs=0.05)}


def test_spur_top_says_what_is_wrong_with_a_server_that_is_not_spur() -> None:
    """A URL whose /metrics is not Prometheus text, or whose /admin/lanes is not JSON
    (another server on the port): one line naming it, not a traceback."""
    import http.server
    import threading

    from spur.cluster.top import TopError, read

    answers = {"/metrics": b"<html>hello</html>", "/admin/lanes": b"<html>lanes</html>"}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = answers[self.path]
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(TopError, match=r"/metrics is not Prometheus text"):
            read(url)
        answers["/metrics"] = b"vllm:num_requests_running 0\n"
        with pytest.raises(TopError, match=r"/admin/lanes is not JSON"):
            read(url)
    finally:
        server.shutdown()
        server.server_close()
