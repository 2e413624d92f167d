"""The metrics store and the exposition, without a cluster: two ingress replicas'
counters sum (lane switches do not double), gone sources keep their totals,
the text parses back with vLLM's names, labels and cumulative buckets."""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from spur.actors.engine.shell.metrics import EngineMetrics
from spur.cluster.metrics import IngressCounters, MetricsStore, config_hash, render, route_of
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
    (labels, value), *_ = got["vllm:prompt_tokens_total"]
    assert labels == {"model_name": "smol", "engine": "r2", "lane": "spare", "serves": "chat"}
    assert value == 5.0
    buckets = {lab["le"]: v for lab, v in got["vllm:time_to_first_token_seconds_bucket"]}
    assert buckets["0.04"] == 1.0 and buckets["5.0"] == 1.0 and buckets["+Inf"] == 2.0
    assert got["vllm:time_to_first_token_seconds_count"][0][1] == 2.0
    # Zero-valued series exist before anything happens (panels and alerts have data).
    assert ({"lane": "chat"}, 0.0) in got["spur:retries_total"]
    assert got["spur:lane_on_spare"] == [({"lane": "chat", "spare": "spare"}, 0.0)]
    ((info, _),) = got["spur:config_info"]
    assert info == {"config_hash": config_hash(CONFIG), "version": "1"}


def test_routes_are_bounded() -> None:
    assert route_of("/v1/completions") == "/v1/completions"
    assert route_of("/admin/lanes") == "/admin/lanes"
    assert route_of("/admin/a/b") == "/admin/other"
    assert route_of("/wp-login.php") == "other"
