"""The one KV index of a spur deployment: a named, detached Ray actor on the head
node, shared by every engine (writers) and every router (readers).

Routers in different processes (the ingress replicas, a driver's handle) stay
consistent because they all ask this actor, which answers one call at a time:
choosing a replica and recording the chain there speculatively is one atomic
call (`route`). Engines push their KV events and load here (`publish`) every
few tens of milliseconds. The actor restarts if it dies; its state then comes
back from the engines' snapshots (every replica is unknown to the new instance,
so its next `publish` asks for one).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Any

import ray

from spur.cluster.metrics import MetricsStore
from spur.cluster.routing.kv_index import BlockHash, KVIndex
from spur.cluster.routing.policy import Candidate, Weights, choose

INDEX_NAME = "spur-kv-index"
INDEX_NAMESPACE = "spur"
MAX_SESSIONS = 100_000
MAX_ROUTING = 10_000  # requests remembered between Serve's retries of their routing
MATCHED_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class KVIndexActor:
    """Ray actor around KVIndex, plus the routing decision and its counters."""

    def __init__(self, **index_kwargs: Any) -> None:
        self.index = KVIndex(**index_kwargs)
        self.sessions: OrderedDict[str, str] = OrderedDict()
        self.rr: Counter[str] = Counter()
        self.decisions: Counter[tuple[str, str]] = Counter()
        self.matched_hist: Counter[tuple[str, int]] = Counter()
        self.matched_sum: Counter[str] = Counter()
        self.counters: Counter[tuple[str, str]] = Counter()
        self.unknown_routed: Counter[str] = Counter()
        """Requests routed to replicas the index does not know yet (it restarted, or a
        replica has not published): their load until they do, so that a burst spreads."""
        self.routing: OrderedDict[str, str] = OrderedDict()
        """Request id -> the replica its routing charged (load, recorded chain), so that
        Serve's retries of one request (no replica took it) count once."""

        self.commands: dict[str, list[str]] = {}
        self.started = self.index.clock()
        self.store = MetricsStore()
        self.draining: str | None = None
        self.drain_reports: list[dict[str, Any]] = []
        self.draining_ids: set[str] = set()
        self.spare_loads: dict[str, tuple[float, dict[str, int]]] = {}

    # -- engines ----------------------------------------------------------------------------
    def register(
        self, replica_id: str, lane: str, node: str, stats: dict[str, Any] | None = None
    ) -> None:
        self.index.register(replica_id, lane, node, stats)

    def start_failed(self, lane: str, node: str, error: str) -> None:
        self.index.start_failed(lane, node, error)

    def publish(
        self,
        replica_id: str,
        batches: list[dict[str, Any]],
        stats: dict[str, Any],
        metrics: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Apply a replica's batches in order (and its heartbeat; `metrics`, when
        given, is its cumulative metrics snapshot for /metrics). Answers
        {"resync": the replica must send a snapshot, "commands": admin commands
        queued for it, e.g. "reset_prefix_cache"}."""
        need = False
        state = self.index.replicas.get(replica_id)
        if metrics is not None and state is not None:
            self.store.update_engine(replica_id, state.lane, metrics)
        if not batches:
            need = self.index.publish(replica_id, -1, stats=stats)
        for b in batches:
            need = self.index.publish(
                replica_id,
                b["seq"],
                stored=b.get("stored", ()),
                removed=b.get("removed", ()),
                cleared=b.get("cleared", False),
                stats=stats,
                sent_at=b.get("time"),
                state_stored=b.get("state_stored"),
                state_removed=b.get("state_removed", ()),
            )
            if need:
                break
        state = self.index.replicas.get(replica_id)
        return {
            "resync": need,
            "commands": self.commands.pop(replica_id, []),
            "spare_demand": self.spare_demand(state.lane) if state is not None else 0,
            "draining": self.draining,
        }

    def leave(self, replica_id: str) -> bool:
        """A planned removal (drain): the replica and its hashes leave the index now;
        not a failure (see KVIndex.leave)."""
        state = self.index.replicas.get(replica_id)
        left = self.index.leave(replica_id)
        if state is not None:
            self.counters[(state.lane, "planned_leave")] += 1
        return left

    # -- drain and spare demand (ingress side) ----------------------------------------------
    def set_draining(self, reason: str | None) -> None:
        """The deployment is shutting down (`spur serve` got SIGTERM / Ctrl-C): every
        ingress answers /health with 503 and refuses new requests, and every engine
        replica drains (it learns this from its next publish). None: clear."""
        self.draining = reason
        self.draining_ids = set(self.index.replicas) if reason is not None else set()

    def record_drain(self, report: dict[str, Any], metrics: dict[str, Any] | None = None) -> None:
        """A replica finished its drain (EngineReplica.drain's report, with its last
        metrics snapshot: it has left the index, and its publish loop has stopped)."""
        self.drain_reports = [*self.drain_reports[-999:], dict(report)]
        if metrics is not None and report.get("replica_id") and report.get("lane"):
            self.store.update_engine(report["replica_id"], report["lane"], metrics)

    def drained(self) -> list[dict[str, Any]]:
        """The drain reports so far (`spur serve` logs them before it exits)."""
        return list(self.drain_reports)

    def drain_status(self) -> dict[str, Any]:
        """{"remaining": replicas known when the drain began that have not reported
        their drain yet (a replica leaves the index when its drain starts, and reports
        when it ends), "reports": n}."""
        done = {r.get("replica_id") for r in self.drain_reports}
        return {
            "remaining": len(self.draining_ids - done),
            "reports": len(self.drain_reports),
        }

    def report_spare_load(self, ingress_id: str, loads: dict[str, int]) -> str | None:
        """An ingress's requests in flight on the spare, per lane they belong to (the
        autoscaling policy counts them as that lane's demand). Answers the drain
        reason (None while serving), so that the ingress polls both in one call."""
        self.spare_loads[ingress_id] = (self.index.clock(), dict(loads))
        return self.draining

    def spare_demand(self, lane: str, fresh_s: float = 10.0) -> int:
        """The lane's requests in flight on its spare, over the ingresses that reported
        within `fresh_s`."""
        now = self.index.clock()
        return sum(
            loads.get(lane, 0) for at, loads in self.spare_loads.values() if now - at <= fresh_s
        )

    def queue_command(self, command: str, lane: str | None, replica_id: str | None) -> list[str]:
        """Queue an admin command for the replicas of `lane` (all lanes: None), or one
        replica; each runs it within one publish period. Returns their ids."""
        ids = [
            rid
            for rid, r in self.index.replicas.items()
            if (lane is None or r.lane == lane) and (replica_id is None or rid == replica_id)
        ]
        for rid in ids:
            self.commands.setdefault(rid, []).append(command)
        return ids

    def resync(
        self,
        replica_id: str,
        seq: int,
        hashes: list[BlockHash],
        states: list[BlockHash] | None = None,
    ) -> None:
        self.index.resync(replica_id, seq, hashes, states)

    # -- routers ----------------------------------------------------------------------------
    def route(
        self,
        lane: str,
        replica_ids: list[str],
        chain: list[BlockHash],
        weights: dict[str, float],
        session: str | None = None,
        request_id: str | None = None,
        engine_request_id: str | None = None,
    ) -> list[str]:
        """Rank `replica_ids` (Serve's current replicas of the lane) for a request
        with `chain`, and record the chain at the first one. Replicas the index
        holds unhealthy go last; unknown ones count as empty, loaded with the requests
        this actor routed to them since it has known nothing of them.

        Serve asks again for a request no replica took (all full); with `request_id`,
        a repeat only ranks: the decision, its matched blocks and the session count
        once, and the request's one unit of load moves if the first replica changed
        (its own recorded chain counts as held, as the first ask left it).
        `engine_request_id`: the id the engine will report when the request reaches it;
        the request counts as the replica's load until then (`KVIndex.record`)."""
        now = self.index.clock()
        healthy, sick = [], []
        for rid in replica_ids:
            state = self.index.replicas.get(rid)
            if state is not None:
                if self.unknown_routed:  # once known, its own reports count
                    self.unknown_routed.pop(rid, None)
                if not self.index.healthy(rid, now):
                    sick.append(rid)
                    continue
            healthy.append(
                Candidate(
                    rid,
                    self.index.match(rid, chain),
                    state.load if state else self.unknown_routed[rid],
                    state.stats.kv_usage if state else 0.0,
                )
            )
        if not healthy:
            self.decisions[(lane, "unhealthy")] += 1
            return sick
        affinity = self.sessions.get(session) if session else None
        decision = choose(healthy, len(chain), Weights(**weights), affinity=affinity)
        best = decision.ranked[0]
        charged = self.routing.get(request_id) if request_id is not None else None
        if charged is not None:  # a retry: count nothing again
            if charged != best:
                self._uncharge(charged, engine_request_id)
                self._record(best, chain, engine_request_id)
                self.routing[request_id] = best  # type: ignore[index]
            elif engine_request_id is not None and best in self.index.replicas:
                # Still on its way there (every replica was full): its unit of load
                # counts from now, not from its first ask.
                self.index.record(best, chain, engine_request_id)
            return decision.ranked + sick
        self._record(best, chain, engine_request_id)
        if request_id is not None:
            self.routing[request_id] = best
            while len(self.routing) > MAX_ROUTING:
                self.routing.popitem(last=False)
        if session:
            self.sessions[session] = best
            self.sessions.move_to_end(session)
            while len(self.sessions) > MAX_SESSIONS:
                self.sessions.popitem(last=False)
        self.decisions[(lane, decision.reason)] += 1
        self.matched_sum[lane] += decision.matched_blocks
        bucket = next((b for b in MATCHED_BUCKETS if decision.matched_blocks <= b), -1)
        self.matched_hist[(lane, bucket)] += 1
        return decision.ranked + sick

    def routed_elsewhere(
        self,
        replica_id: str,
        chain: list[BlockHash],
        request_id: str | None = None,
        engine_request_id: str | None = None,
    ) -> None:
        """Serve sent the request to another replica than the first ranked one: the
        chain and the unit of load go there (taken back from the one first charged;
        `engine_request_id` as given to `route`)."""
        charged = self.routing.pop(request_id, None) if request_id is not None else None
        if charged is not None:
            self._uncharge(charged, engine_request_id)
        self._record(replica_id, chain, engine_request_id)

    def _uncharge(self, replica_id: str, engine_request_id: str | None = None) -> None:
        """Take back the unit of load a routing charged to `replica_id` (its recorded
        chain expires on its own)."""
        if replica_id in self.index.replicas:
            self.index.unrecord(replica_id, engine_request_id)
        elif self.unknown_routed[replica_id] > 1:
            self.unknown_routed[replica_id] -= 1
        else:
            self.unknown_routed.pop(replica_id, None)

    def _record(
        self, replica_id: str, chain: list[BlockHash], engine_request_id: str | None = None
    ) -> None:
        if replica_id in self.index.replicas:
            self.index.record(replica_id, chain, engine_request_id)
        else:
            self.unknown_routed[replica_id] += 1

    def round_robin(self, lane: str, replica_ids: list[str]) -> list[str]:
        """Baseline policy: healthy replicas in turn (shared by every router)."""
        now = self.index.clock()
        ok = [r for r in replica_ids if r not in self.index.replicas or self.index.healthy(r, now)]
        ids = sorted(ok or replica_ids)
        i = self.rr[lane] % len(ids)
        self.rr[lane] += 1
        self.decisions[(lane, "round_robin")] += 1
        return ids[i:] + ids[:i]

    def report_failure(self, replica_id: str) -> None:
        self.index.report_failure(replica_id)

    def drop(self, replica_id: str) -> None:
        self.index.drop(replica_id)
        self.unknown_routed.pop(replica_id, None)

    def count(self, lane: str, name: str, n: int = 1) -> None:
        """Ingress-side events: failovers, retries, spare fallbacks (a fallback is
        also a routing decision of the lane, reason "fallback")."""
        self.counters[(lane, name)] += n
        if name == "fallback":
            self.decisions[(lane, "fallback")] += n

    # -- reading ----------------------------------------------------------------------------
    def healthy_counts(self, lanes: list[str]) -> dict[str, dict[str, Any]]:
        """Per lane: healthy replicas and their queued requests (the ingress polls this).
        Empty while the index is younger than one heartbeat timeout: a restarted
        index has not heard from the engines yet, which does not make them down."""
        if self.index.clock() - self.started < self.index.heartbeat_timeout_s:
            return {}
        self.index.prune()
        out = {}
        for lane in lanes:
            reps = self.index.healthy_replicas(lane)
            out[lane] = {
                "healthy": len(reps),
                "waiting": [r.stats.num_waiting for r in reps],
            }
        return out

    def lanes(self, lanes: list[str]) -> dict[str, Any]:
        return {lane: self.index.lane_report(lane) for lane in lanes}

    # -- metrics ----------------------------------------------------------------------------
    def push_ingress(
        self, ingress_id: str, counters: dict[str, Any], lanes: dict[str, Any] | None = None
    ) -> None:
        """An ingress replica's cumulative HTTP / failover counters and lane states."""
        self.store.update_ingress(ingress_id, counters, lanes)

    def metrics_view(
        self,
        lanes: list[str],
        ingress_id: str | None = None,
        counters: dict[str, Any] | None = None,
        lane_states: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Everything /metrics renders (spur.cluster.metrics.render), after taking
        the caller's own latest counters: engines' snapshots, HTTP totals, lane
        states, routing counters, replica health and start-failure slots."""
        if ingress_id is not None and counters is not None:
            self.store.update_ingress(ingress_id, counters, lane_states)
        now = self.index.clock()
        slots = [
            {
                "lane": lane,
                "node": node,
                "start_failures": slot.start_failures,
                "restarts": slot.restarts,
                "down": self.index.slot_down(lane, node, now),
            }
            for (lane, node), slot in sorted(self.index.slots.items())
        ]
        return {
            "store": self.store.view(),
            "routing": self.metrics(),
            "lanes": self.lanes(lanes),
            "slots": slots,
        }

    def metrics(self) -> dict[str, Any]:
        """Routing metrics, JSON-safe (exported as Prometheus metrics later)."""
        return {
            "decisions": [
                {"lane": lane, "reason": reason, "count": n}
                for (lane, reason), n in sorted(self.decisions.items())
            ],
            "matched_blocks": [
                {"lane": lane, "le": b, "count": n}
                for (lane, b), n in sorted(self.matched_hist.items())
            ],
            "matched_blocks_sum": dict(self.matched_sum),
            "events": [
                {"lane": lane, "name": name, "count": n}
                for (lane, name), n in sorted(self.counters.items())
            ],
            "index": self.index.stats(),
        }

    def configure(self, **index_kwargs: Any) -> None:
        """Apply a deployment's KVIndex settings (`index_kwargs_of`) to the running
        index: the actor is detached and found by name, so a redeploy with new router
        settings gets the actor the first deployment created."""
        for name, value in index_kwargs.items():
            if name not in CONFIGURABLE:
                raise ValueError(f"KVIndex setting {name!r} is unknown: use {CONFIGURABLE}")
            setattr(self.index, name, float(value))

    def holders(self, lane: str, chain: list[BlockHash]) -> dict[str, int]:
        """Matched blocks of `chain` per replica of `lane` (for tests and debugging)."""
        return {
            rid: self.index.match(rid, chain)
            for rid, r in self.index.replicas.items()
            if r.lane == lane
        }


CONFIGURABLE = ("heartbeat_timeout_s", "healthy_after_s")
"""The KVIndex settings a deployment's router config sets (`index_kwargs_of`)."""


def get_index(index_kwargs: dict[str, Any] | None = None) -> Any:
    """The deployment's index actor, created on first use (on the head node, so that
    losing a worker node does not lose it). Non-empty `index_kwargs` are applied to an
    actor that already runs (a redeploy with changed router settings), before any
    later call of this caller's."""
    remote = ray.remote(KVIndexActor)
    actor = remote.options(  # type: ignore[attr-defined]
        name=INDEX_NAME,
        namespace=INDEX_NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
        num_cpus=0,
        max_restarts=-1,
        # Calls in flight while it restarts are retried on the new instance
        # (publish is idempotent by sequence number; a doubled count is harmless).
        max_task_retries=3,
        max_concurrency=1,
        resources={"node:__internal_head__": 0.001},
    ).remote(**(index_kwargs or {}))
    if index_kwargs:
        actor.configure.remote(**index_kwargs)
    return actor


def kill_index() -> None:
    """Stop the index actor if it runs (on `spur serve` shutdown and in tests)."""
    try:
        actor = ray.get_actor(INDEX_NAME, namespace=INDEX_NAMESPACE)
    except ValueError:
        return
    ray.kill(actor, no_restart=True)


def index_kwargs_of(router: dict[str, Any]) -> dict[str, Any]:
    """KVIndex settings from a RouterConfig dict."""
    return {
        "heartbeat_timeout_s": max(1.0, 3 * router["stats_period_s"]),
        "healthy_after_s": router["failover_healthy_after_s"],
    }
