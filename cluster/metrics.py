"""The cluster-wide metrics view: one store, every ingress renders all of it.

    engine replica ──publish(..., metrics=snapshot)──┐
    engine replica ──publish(..., metrics=snapshot)──┤   KV index actor
    ingress replica ──push_ingress(counters, lanes)──┤   (MetricsStore inside)
                                                     │
    GET /metrics on any ingress ──metrics_view()─────┘──> render() -> Prometheus text

A Serve handle reaches one replica, so no ingress can ask every engine; each
source instead pushes its *cumulative* values (counters, histogram buckets) and
its current gauges to the one KV index actor, which already receives every
engine's heartbeat. The store keeps the latest snapshot per source, so a lost
or repeated push changes nothing, and every ingress (or the Service in front of
them) answers the same complete view: no series is counted twice, none goes
backwards. Ingress replicas that went away keep their last totals (summed into
the HTTP counters forever; lane switches, which every ingress replica observes,
are the most any one of them counted); engine replicas that went away keep their series
for `retain_s` (Prometheus sees a new `engine` label for their successor).

Names: vLLM's exactly (`vllm:*`, with `model_name`, `engine` and spur's `lane`
label), spur's own under `spur:`. A request's series carry the lane it came for (a
spare's requests: the lane of each, as the engine reports them apart); an engine's
own series its replica's lane. Rendering uses prometheus_client's metric
families (no hand-written exposition format). Pure Python apart from
prometheus_client; no Ray, no torch.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from spur.actors.engine.shell.metrics import FINISH_REASONS, HISTOGRAMS, STEP_HISTOGRAMS
from spur.cluster.errors import ERROR_CODE_HEADER

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

COUNTER_HELP = {
    "vllm:prompt_tokens": "Number of prefill tokens processed.",
    "vllm:generation_tokens": "Number of generation tokens processed.",
    "vllm:num_preemptions": "Cumulative number of preemption from the engine.",
    "vllm:prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens.",
    "vllm:prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
    "spur:kv_leak_violations": "Requests the leak detector saw holding more blocks than the "
    "capacity formula allows.",
    "vllm:spec_decode_num_drafts": "Number of spec decoding drafts.",
    "vllm:spec_decode_num_draft_tokens": "Number of draft tokens.",
    "vllm:spec_decode_num_accepted_tokens": "Number of accepted tokens.",
}
GAUGE_HELP = {
    "vllm:num_requests_running": "Number of requests in model execution batches.",
    "vllm:num_requests_waiting": "Number of requests waiting to be processed.",
    "vllm:kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
}
INDEX_EVENTS = {
    "retry": ("spur:retries", "Request attempts retried before a first token."),
    "failover": ("spur:stream_continuations", "Streams continued on another replica."),
    "replica_failed": ("spur:replica_failures", "Replicas seen failing by a request."),
    "fallback": ("spur:spare_fallbacks", "Requests of a lane sent to its spare."),
}


def config_hash(config: dict[str, Any]) -> str:
    """A short stable hash of a config dict (canonical JSON)."""
    text = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# -- the ingress side -------------------------------------------------------------------
ROUTES = frozenset(
    {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/health",
        "/health/live",
        "/version",
        "/metrics",
        "/tokenize",
        "/detokenize",
    }
)
"""The route labels of the API's own paths (`route_of`)."""
API_ROUTES = ("/v1/completions", "/v1/chat/completions")
SEEDED_ERRORS = (("500", "internal_error"), ("503", "service_unavailable"))
"""(status, code) of the error series of every route in ROUTES that exist at 0 from
the start; the API routes' also (429, queue_full)."""


class IngressCounters:
    """One ingress replica's cumulative HTTP and failover counters (its process
    owns one; the middleware and the lane monitor write, the pusher reads)."""

    def __init__(self) -> None:
        self.enabled = True
        self.requests: Counter[tuple[str, str]] = Counter()
        self.errors: Counter[tuple[str, str, str]] = Counter()
        self.failovers: Counter[tuple[str, str, str, str]] = Counter()
        # The error series alerts and panels watch exist at 0 from the start:
        # Prometheus's rate() sees no increase in a series whose first sample is 1.
        for route in sorted(ROUTES):
            seeded = (
                (*SEEDED_ERRORS, ("429", "queue_full")) if route in API_ROUTES else SEEDED_ERRORS
            )
            for status, code in seeded:
                self.requests[(route, status)] += 0
                self.errors[(route, status, code)] += 0

    def observe(self, route: str, status: int) -> None:
        self.requests[(route, str(status))] += 1

    def error(self, route: str, status: int, code: str | None) -> None:
        self.errors[(route, str(status), code or "")] += 1

    def failover(self, lane: str, src: str, dst: str, reason: str) -> None:
        self.failovers[(lane, src, dst, reason)] += 1

    def snapshot(self) -> dict[str, Any]:
        return {
            "requests": [[*k, n] for k, n in self.requests.items()],
            "errors": [[*k, n] for k, n in self.errors.items()],
            "failovers": [[*k, n] for k, n in self.failovers.items()],
        }


HTTP = IngressCounters()
"""This process's counters (an ingress replica's; empty elsewhere)."""


ADMIN_ROUTES = frozenset(
    {
        "/admin/config",
        "/admin/lanes",
        "/admin/reset_prefix_cache",
        "/admin/routing",
        "/admin/engines",
    }
)


def route_of(path: str) -> str:
    """The route label of a request path, one of a fixed set: ROUTES, ADMIN_ROUTES,
    "/admin/other" or "other". A path's own text never becomes a label (the counter
    counts before authentication, so any client could add series without end)."""
    if path in ROUTES or path in ADMIN_ROUTES:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    if path.startswith("/admin/"):
        return "/admin/other"
    return "other"


class CountingMiddleware:
    """Pure ASGI middleware (no per-chunk cost on streams): counts every HTTP
    answer by route and status, and error answers by their OpenAI code, into
    `HTTP`; counting is off while `HTTP.enabled` is False (server.metrics: false).
    Either way it removes the internal error-code header (`ERROR_CODE_HEADER`), which
    never reaches a client."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route = route_of(scope.get("path", ""))
        counting = HTTP.enabled

        async def counting_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers = message.get("headers") or []
                code = next((v for k, v in headers if k == ERROR_CODE_HEADER), None)
                if code is not None:
                    message = {
                        **message,
                        "headers": [h for h in headers if h[0] != ERROR_CODE_HEADER],
                    }
                if counting:
                    HTTP.observe(route, status)
                    if status >= 400:
                        HTTP.error(route, status, code.decode() if code else None)
            await send(message)

        await self.app(scope, receive, counting_send)


def ingress_id() -> str:
    """This ingress replica's id (Serve's replica id; the pid outside Serve)."""
    import os

    try:
        from ray import serve

        return str(serve.get_replica_context().replica_id.unique_id)
    except Exception:  # outside a Serve replica (tests)
        return f"ingress-{os.getpid()}"


def lane_states(selector: Any, primaries: list[str]) -> dict[str, dict[str, Any]]:
    """Per primary lane of a LaneSelector: target, reason, spare, on_spare."""
    out = {}
    for lane in primaries:
        report = selector.report(lane)
        out[lane] = {
            "target": report["target"],
            "reason": report["reason"],
            "spare": report["spare"] or "",
            "on_spare": report["target"] != lane,
        }
    return out


def count_switch(counters: IngressCounters, selector: Any, lane: str, reason: str) -> None:
    """Count one lane switch (the selector already moved: its target is the new one)."""
    spare = selector.spare_of.get(lane, "")
    if reason == "primary":
        counters.failover(lane, spare, lane, reason)
    else:
        counters.failover(lane, lane, spare, reason)


# -- the store (inside the KV index actor) ----------------------------------------------
class MetricsStore:
    """Latest cumulative snapshot per source. Not thread-safe (the actor runs one
    call at a time)."""

    def __init__(self, *, retain_s: float = 600.0, clock: Callable[[], float] = time.monotonic):
        self.retain_s = retain_s
        self.clock = clock
        self.engines: dict[str, dict[str, Any]] = {}
        self.ingress: dict[str, dict[str, Any]] = {}
        self.lanes: dict[str, dict[str, Any]] = {}

    def update_engine(self, replica_id: str, lane: str, snapshot: dict[str, Any]) -> None:
        self.engines[replica_id] = {"lane": lane, "at": self.clock(), "snapshot": snapshot}

    def update_ingress(
        self, ingress_id: str, counters: dict[str, Any], lanes: dict[str, Any] | None = None
    ) -> None:
        """An ingress replica's counters (cumulative) and its lane states
        ({lane: {"target", "reason", "spare", "on_spare"}}); the newest lane report wins."""
        self.ingress[ingress_id] = {"at": self.clock(), "counters": counters}
        for lane, state in (lanes or {}).items():
            self.lanes[lane] = {**state, "at": self.clock()}

    def view(self) -> dict[str, Any]:
        """JSON-safe: engines (recent ones), HTTP totals over every ingress ever
        seen, lane states."""
        now = self.clock()
        for rid in [r for r, e in self.engines.items() if now - e["at"] > self.retain_s]:
            del self.engines[rid]
        requests: Counter[tuple[str, ...]] = Counter()
        errors: Counter[tuple[str, ...]] = Counter()
        failovers: Counter[tuple[str, ...]] = Counter()
        for entry in self.ingress.values():
            c = entry["counters"]
            for *k, n in c.get("requests", ()):
                requests[tuple(k)] += n
            for *k, n in c.get("errors", ()):
                errors[tuple(k)] += n
            for *k, n in c.get("failovers", ()):
                # Every ingress replica's selector sees the same switches: the
                # most any one counted is the count (a sum would double it).
                failovers[tuple(k)] = max(failovers[tuple(k)], n)
        return {
            "engines": {
                rid: {**e, "age_s": round(now - e["at"], 3)} for rid, e in self.engines.items()
            },
            "http": {
                "requests": [[*k, n] for k, n in sorted(requests.items())],
                "errors": [[*k, n] for k, n in sorted(errors.items())],
                "failovers": [[*k, n] for k, n in sorted(failovers.items())],
            },
            "lanes": {lane: dict(s) for lane, s in self.lanes.items()},
        }


# -- rendering --------------------------------------------------------------------------
def lane_models(config: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """lane (or spare) name -> (model_name label, serves label): a lane's first
    served name; for the spare, the first served name of the first lane it serves."""
    out: dict[str, tuple[str, str]] = {}
    for lane in config["lanes"]:
        out[lane["name"]] = (lane["served_model_names"][0], lane["name"])
    spare = config.get("spare")
    if spare:
        served = spare["serves_lanes"]
        model = out.get(served[0], (spare["engine"]["model"]["path"], ""))[0]
        out[spare["name"]] = (model, ",".join(served))
    return out


class _Collector:
    def __init__(self, view: dict[str, Any], config: dict[str, Any]) -> None:
        self.view = view
        self.config = config

    def collect(self) -> Iterator[Metric]:
        yield from _engine_families(self.view, self.config)
        yield from _cluster_families(self.view, self.config)


def render(view: dict[str, Any], config: dict[str, Any]) -> bytes:
    """The Prometheus text exposition of `view` (from the index actor's
    `metrics_view`) for a deployment running `config` (a SpurConfig dict)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(view, config))
    return generate_latest(registry)


ENGINE_LABELS = ["model_name", "engine", "lane", "serves"]


def _engine_families(view: dict[str, Any], config: dict[str, Any]) -> Iterator[Metric]:
    models = lane_models(config)
    engines = view.get("store", {}).get("engines", {})
    health = {
        r["replica_id"]: (lane, r)
        for lane, report in view.get("lanes", {}).items()
        for r in report.get("replicas", ())
    }
    counters = {n: CounterMetricFamily(n, h, labels=ENGINE_LABELS) for n, h in COUNTER_HELP.items()}
    gauges = {n: GaugeMetricFamily(n, h, labels=ENGINE_LABELS) for n, h in GAUGE_HELP.items()}
    success = CounterMetricFamily(
        "vllm:request_success",
        "Count of successfully processed requests.",
        labels=[*ENGINE_LABELS, "finished_reason"],
    )
    hists = {
        n: HistogramMetricFamily(n, h, labels=ENGINE_LABELS) for n, (_, h) in HISTOGRAMS.items()
    }
    group_labels = [*ENGINE_LABELS, "group", "kind"]
    held = GaugeMetricFamily(
        "spur:kv_blocks_held",
        "Blocks the running requests hold, per KV group.",
        labels=group_labels,
    )
    geometry = GaugeMetricFamily(
        "spur:kv_blocks_geometry",
        "Blocks the capacity formula gives the running requests, per KV group.",
        labels=group_labels,
    )
    ratio = GaugeMetricFamily(
        "spur:kv_held_over_geometry",
        "Blocks held / blocks by geometry (1 when correct; above 1: a leak).",
        labels=group_labels,
    )
    worst = GaugeMetricFamily(
        "spur:kv_request_held_over_geometry_max",
        "The highest held/geometry of any one running request since the engine's last "
        "report (about a second): over its capacity samples (every 0.25 s) and, above 1, "
        "over every step (the leak detector); "
        "spur:kv_held_over_geometry_peak keeps the worst since start.",
        labels=group_labels,
    )
    peak = GaugeMetricFamily(
        "spur:kv_held_over_geometry_peak",
        "Highest per-request held/geometry seen since the engine started (above 1: at "
        "any step, from the leak detector).",
        labels=group_labels,
    )
    claimed = GaugeMetricFamily(
        "spur:capacity_claimed_max_concurrency",
        "Requests of max_model_len the pool holds, as claimed at start-up.",
        labels=ENGINE_LABELS,
    )
    pool = GaugeMetricFamily(
        "spur:capacity_pool_tokens",
        "The longest context one request can hold with the KV pool to itself, in tokens "
        "(at most usable blocks x block size).",
        labels=ENGINE_LABELS,
    )
    age = GaugeMetricFamily(
        "spur:engine_stats_age_seconds",
        "Seconds since the engine's statistics last reached the KV index (they come about "
        "every second; a counter's rate over a window is exact from one report to another).",
        labels=ENGINE_LABELS,
    )
    cache_info: GaugeMetricFamily | None = None
    healthy = GaugeMetricFamily(
        "spur:replica_healthy",
        "1 while the KV index holds the replica healthy.",
        labels=[*ENGINE_LABELS, "node"],
    )
    spare_cfg = config.get("spare") or {}
    for rid, entry in sorted(engines.items()):
        lane = entry["lane"]
        model, serves = models.get(lane, (lane, lane))
        labels = [model, rid, lane, serves]
        snap = entry["snapshot"]
        # A spare's requests count on the lane they came for (the engine keeps them
        # apart: "lanes", lanes the ingress named from its config, at most
        # MAX_TAGGED_LANES). Every lane it reports is a label, whatever this
        # ingress's config says (two ingress replicas of different configs render the
        # same series); the lanes a spare serves exist at 0 before its first request
        # (rate() misses a series whose first sample is already > 0).
        served = set(spare_cfg.get("serves_lanes", ())) if lane == spare_cfg.get("name") else set()
        own, others = _request_parts(snap, lane, served - {lane})
        # Counters and histograms of a replica that left or failed stay (their totals
        # happened); its gauges (running, waiting, KV usage, blocks held) do not: the
        # last report of a dead replica is not what it runs now.
        # With no lane reports at all (a store read on its own) every engine counts as
        # live; with reports, only the replicas they list healthy (none listed: none).
        live = "lanes" not in view or (rid in health and bool(health[rid][1].get("healthy")))
        if "age_s" in entry:
            age.add_metric(labels, entry["age_s"])
        for name, value in snap.get("gauges", {}).items():
            if name in gauges and live:
                gauges[name].add_metric(labels, value)
        for part_labels, part in [
            (labels, own),
            *(([models.get(o, (o,))[0], rid, o, serves], p) for o, p in sorted(others.items())),
        ]:
            for name, value in part.get("counters", {}).items():
                if name in counters:
                    counters[name].add_metric(part_labels, value)
            for reason, n in sorted(part.get("request_success", {}).items()):
                success.add_metric([*part_labels, reason], n)
            for name, h in part.get("histograms", {}).items():
                if name not in hists:
                    continue
                bounds = [floatToGoString(b) for b in h["buckets"]] + ["+Inf"]
                hists[name].add_metric(
                    part_labels, list(zip(bounds, h["cumulative"], strict=True)), h["sum"]
                )
        for g in snap.get("capacity", ()) if live else ():
            gl = [*labels, str(g["group"]), g["kind"]]
            held.add_metric(gl, g["held"])
            geometry.add_metric(gl, g["geometry"])
            ratio.add_metric(gl, g["ratio"])
            worst.add_metric(gl, g.get("worst_ratio", g["ratio"]))
            peak.add_metric(gl, g["peak_ratio"])
        info = snap.get("info", {}) if live else {}  # a departed replica claims nothing
        if "claimed_max_concurrency" in info:
            claimed.add_metric(labels, info["claimed_max_concurrency"])
            pool.add_metric(labels, info["pool_tokens"])
        cache = info.get("cache_config")
        if cache:
            keys = sorted(cache)
            if cache_info is None:
                cache_info = GaugeMetricFamily(
                    "vllm:cache_config_info",
                    "Information of the LLMEngine CacheConfig",
                    labels=[*keys, *ENGINE_LABELS],
                )
            cache_info.add_metric([str(cache[k]) for k in keys] + labels, 1)
        if rid in health:
            r = health[rid][1]
            healthy.add_metric([*labels, str(r.get("node", ""))], 1 if r.get("healthy") else 0)
    yield from counters.values()
    yield from gauges.values()
    yield success
    yield from hists.values()
    yield from (held, geometry, ratio, worst, peak, claimed, pool, age, healthy)
    if cache_info is not None:
        yield cache_info


def _request_parts(
    snap: dict[str, Any], lane: str, seeded: set[str]
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """An engine snapshot split by the lane its requests came for: (the part of its
    own lane `lane`: the snapshot's counters, request_success and histograms, {other
    lane: its part} for every other lane it reported), with a part of zeros for each
    lane of `seeded` it has not reported yet."""
    own = {
        "counters": dict(snap.get("counters", {})),
        "request_success": dict(snap.get("request_success", {})),
        "histograms": dict(snap.get("histograms", {})),
    }
    others = {name: part for name, part in snap.get("lanes", {}).items() if name != lane}
    for name in seeded - set(others):
        others[name] = {
            "counters": {"vllm:prompt_tokens": 0, "vllm:generation_tokens": 0},
            "request_success": dict.fromkeys(FINISH_REASONS, 0),
            "histograms": {
                hist: {
                    "buckets": h["buckets"],
                    "cumulative": [0] * len(h["cumulative"]),
                    "sum": 0.0,
                    "count": 0,
                }
                for hist, h in own["histograms"].items()
                if hist not in STEP_HISTOGRAMS
            },
        }
    return own, others


def _cluster_families(view: dict[str, Any], config: dict[str, Any]) -> Iterator[Metric]:
    routing = view.get("routing", {})
    decisions = CounterMetricFamily(
        "spur:routing_decisions", "Routing decisions by lane and reason.", labels=["lane", "reason"]
    )
    for d in routing.get("decisions", ()):
        decisions.add_metric([d["lane"], d["reason"]], d["count"])
    yield decisions
    matched = HistogramMetricFamily(
        "spur:routing_matched_blocks",
        "Prompt blocks already cached at the chosen replica, per routing decision.",
        labels=["lane"],
    )
    per_lane: dict[str, dict[int, int]] = {}
    for m in routing.get("matched_blocks", ()):
        per_lane.setdefault(m["lane"], {})[m["le"]] = m["count"]
    sums = routing.get("matched_blocks_sum", {})
    from spur.cluster.routing.index_actor import MATCHED_BUCKETS

    for lane, counts in sorted(per_lane.items()):
        buckets, total = [], 0
        for b in MATCHED_BUCKETS:
            total += counts.get(b, 0)
            buckets.append((floatToGoString(b), total))
        total += counts.get(-1, 0)
        buckets.append(("+Inf", total))
        matched.add_metric([lane], buckets, sums.get(lane, 0))
    yield matched
    events = {
        name: CounterMetricFamily(metric, h, labels=["lane"])
        for name, (metric, h) in INDEX_EVENTS.items()
    }
    seen = {(e["lane"], e["name"]): e["count"] for e in routing.get("events", ())}
    lanes = [lane["name"] for lane in config["lanes"]]
    for name, family in events.items():  # every lane's series, zero until it happens
        for lane in sorted({*lanes, *(k[0] for k in seen)}):
            family.add_metric([lane], seen.get((lane, name), 0))
    yield from events.values()
    index = routing.get("index", {})
    lag = GaugeMetricFamily(
        "spur:kv_index_event_lag_seconds", "Age of the last KV event batch when applied."
    )
    lag.add_metric([], index.get("event_lag_s", 0.0))
    yield lag
    gaps = CounterMetricFamily("spur:kv_index_sequence_gaps", "KV event sequence gaps (resyncs).")
    gaps.add_metric([], index.get("sequence_gaps", 0))
    yield gaps

    # lanes: target, failovers, start failures, restart loops
    store = view.get("store", {})
    target = GaugeMetricFamily(
        "spur:lane_target",
        "1 for the deployment that takes a lane's traffic now (target primary or spare).",
        labels=["lane", "target", "deployment", "reason"],
    )
    on_spare = GaugeMetricFamily(
        "spur:lane_on_spare",
        "1 while a lane's traffic goes to its spare.",
        labels=["lane", "spare"],
    )
    spare_cfg = config.get("spare") or {}
    for lane in config["lanes"]:
        name = lane["name"]
        state = store.get("lanes", {}).get(name, {})
        configured = spare_cfg.get("name", "") if name in spare_cfg.get("serves_lanes", ()) else ""
        spare = state.get("spare", configured) or ""
        spare_now = bool(state.get("on_spare"))
        reason = str(state.get("reason", "primary"))
        target.add_metric([name, "primary", name, reason], 0 if spare_now else 1)
        if spare:
            target.add_metric([name, "spare", spare, reason], 1 if spare_now else 0)
        on_spare.add_metric([name, spare], 1 if spare_now else 0)
    yield target
    yield on_spare
    failovers = CounterMetricFamily(
        "spur:lane_failovers",
        "Lane target switches by lane, from, to and reason.",
        labels=["lane", "from", "to", "reason"],
    )
    counted = {tuple(k): n for *k, n in store.get("http", {}).get("failovers", ())}
    for lane in spare_cfg.get("serves_lanes", ()):  # zero until the first switch
        counted.setdefault((lane, lane, spare_cfg["name"], "down"), 0)
        counted.setdefault((lane, spare_cfg["name"], lane, "primary"), 0)
    for (lane, src, dst, reason), n in sorted(counted.items()):
        failovers.add_metric([lane, src, dst, reason], n)
    yield failovers
    starts = CounterMetricFamily(
        "spur:replica_start_failures",
        "Engine replicas that failed in their constructor, per lane and node.",
        labels=["lane", "node"],
    )
    restarts = CounterMetricFamily(
        "spur:replica_restarts", "Engine replicas started again on a node.", labels=["lane", "node"]
    )
    loop = GaugeMetricFamily(
        "spur:restart_loop",
        "1 while a lane's slot on a node is down for repeated start failures.",
        labels=["lane", "node"],
    )
    for s in view.get("slots", ()):
        starts.add_metric([s["lane"], s["node"]], s["start_failures"])
        restarts.add_metric([s["lane"], s["node"]], s["restarts"])
        loop.add_metric([s["lane"], s["node"]], 1 if s["down"] else 0)
    yield from (starts, restarts, loop)

    # HTTP
    http = store.get("http", {})
    requests = CounterMetricFamily(
        "spur:http_requests", "HTTP requests by route and status code.", labels=["route", "status"]
    )
    for route, status, n in http.get("requests", ()):
        requests.add_metric([route, status], n)
    yield requests
    errors = CounterMetricFamily(
        "spur:http_errors",
        "HTTP error answers by route, status and OpenAI error code.",
        labels=["route", "status", "code"],
    )
    queue_full = CounterMetricFamily(
        "spur:http_queue_full", "Requests answered 429 queue_full.", labels=["route"]
    )
    full: Counter[str] = Counter()
    for route, status, code, n in http.get("errors", ()):
        errors.add_metric([route, status, code], n)
        if code == "queue_full":
            full[route] += n
    for route, n in sorted(full.items()):
        queue_full.add_metric([route], n)
    yield errors
    yield queue_full
    info = GaugeMetricFamily(
        "spur:config_info",
        "The running config's identity (hash of its resolved form) and version.",
        labels=["config_hash", "version"],
    )
    info.add_metric([config_hash(config), str(config.get("version", ""))], 1)
    yield info
