"""The cluster's view of which engine replica holds which KV blocks, and how loaded
and healthy each one is (pure Python; the Ray actor in `index_actor.py` wraps it).

Engines publish batches of KV events, each with a sequence number per replica:

    publish(replica, seq, stored=[h...], removed=[h...], cleared=False, stats)

Batches must arrive in order (seq = last + 1). A gap (a lost batch, a restarted
index) makes the replica "unsynced": `publish` answers `need_snapshot=True`, its
events are ignored, and the engine sends `resync(replica, seq, hashes)` with every
hash it holds as of batch `seq`; later batches apply on top. Routers read through
`match` (longest consecutive prefix of a chain that a replica holds; for a model
with recurrent-state layers, one that ends where it also holds the state) and write
speculatively through `record` (a chain just routed there, so a burst with one
prefix does not spread before real events land). Speculative hashes are kept apart
and expire after `speculative_ttl_s`: the engine's own "stored" event makes one
real, and one that never lands (the request went elsewhere, was rejected or
aborted before its prefill) stops attracting traffic.

Load: a replica's running, waiting and queued requests as it last reported them, plus the
requests routed to it that it had not reported as arrived (`stats["arrived"]`, the
engine request ids that reached it since its previous report): a report does not
forget a request still in transit or queued behind the engine's step.

Health: a replica is healthy while it heartbeats (every publish is one) within
`heartbeat_timeout_s` and no caller reported it failed since its last heartbeat.
Start failures are counted per (lane, node); `restart_loop_threshold` of them
within `restart_window_s` mark that slot down until a replica there has been
healthy for `healthy_after_s`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

BlockHash = bytes


@dataclass
class ReplicaStats:
    """Load as last reported by the engine."""

    num_running: int = 0
    num_waiting: int = 0
    num_queued: int = 0
    """Requests handed to the engine thread, not yet in its scheduler (behind a step)."""
    kv_usage: float = 0.0
    num_blocks: int = 0
    num_free_blocks: int = 0
    prefix_hits_total: int = 0
    prefix_queries_total: int = 0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ReplicaStats:
        names = cls.__dataclass_fields__
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass
class ReplicaState:
    """What the index knows of one engine replica."""

    replica_id: str
    lane: str
    node: str
    hashes: set[BlockHash] = field(default_factory=set)
    last_seq: int = -1
    synced: bool = False
    stats: ReplicaStats = field(default_factory=ReplicaStats)
    registered_at: float = 0.0
    last_heartbeat: float = 0.0
    healthy_since: float = 0.0
    failed_at: float | None = None
    routed_since_heartbeat: int = 0
    """Requests routed here without an engine request id since its last report."""
    in_flight: dict[str, float] = field(default_factory=dict)
    """Engine request id -> expiry: routed here, not yet reported by the engine as
    arrived (`stats["arrived"]`). Its running and waiting counts cannot hold them yet,
    and a report does not clear them: a request in transit, or queued behind a step,
    when the engine reports is still load. One that never arrives (its client left
    while Serve held it) stops counting at its expiry."""
    arrived: dict[str, float] = field(default_factory=dict)
    """Engine request id -> expiry: reported arrived within the last heartbeat timeout.
    A router's late `record` of one (Serve's choice reported after the engine had the
    request) is not load any more."""
    speculative: dict[BlockHash, float] = field(default_factory=dict)
    """Hashes recorded by routers, not yet confirmed by the engine -> expiry time."""
    states: set[BlockHash] | None = None
    """For a model with recurrent-state layers: the block hashes whose prefix state the
    engine holds (a sparse subset: states are kept where a prefill chunk ended); None
    for a model without. A prefix hit of n blocks needs the attention blocks 0..n-1
    and the state at n-1, as the engine's own `longest_hit` does."""
    speculative_states: dict[BlockHash, float] = field(default_factory=dict)

    @property
    def load(self) -> int:
        """Running, waiting and queued requests as last reported, plus those routed
        here that had not arrived by then."""
        return (
            self.stats.num_running
            + self.stats.num_waiting
            + self.stats.num_queued
            + len(self.in_flight)
            + self.routed_since_heartbeat
        )


@dataclass
class _Slot:
    """Start history of one lane on one node (replicas come and go; the slot stays)."""

    failures: deque[float] = field(default_factory=deque)
    restarts: int = 0
    start_failures: int = 0
    """Every start failure ever (a counter for metrics; `failures` is the window)."""
    members: set[str] = field(default_factory=set)
    """Replicas that started here and have not left (live, or gone without a word)."""
    last_error: str | None = None


class KVIndex:
    """Per lane, per replica: held block hashes, load, health. Not thread-safe
    (the actor runs one call at a time)."""

    def __init__(
        self,
        *,
        heartbeat_timeout_s: float = 3.0,
        healthy_after_s: float = 5.0,
        restart_loop_threshold: int = 3,
        restart_window_s: float = 120.0,
        speculative_ttl_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.speculative_ttl_s = speculative_ttl_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.healthy_after_s = healthy_after_s
        self.restart_loop_threshold = restart_loop_threshold
        self.restart_window_s = restart_window_s
        self.clock = clock
        self.replicas: dict[str, ReplicaState] = {}
        self.slots: dict[tuple[str, str], _Slot] = {}
        self.num_events = 0
        self.num_gaps = 0
        self.num_snapshots = 0
        self.last_event_lag_s = 0.0

    # -- engine side ----------------------------------------------------------------------
    def register(
        self, replica_id: str, lane: str, node: str, stats: dict[str, Any] | None = None
    ) -> None:
        """A replica finished starting on `node`; `stats` is its load so far, if any.
        It counts as a restart of the slot when it replaces one that ran there and is
        gone without leaving (dropped, silent or failed); a second live replica of the
        lane on the node (a scale-up, two TP replicas on one node) is no restart."""
        if replica_id in self.replicas:  # re-registering after an index restart
            return
        now = self.clock()
        slot = self.slots.setdefault((lane, node), _Slot())
        gone = sorted(
            m
            for m in slot.members
            if m != replica_id
            and (m not in self.replicas or not self._alive(self.replicas[m], now))
        )
        if gone:  # one replacement per restart: each new replica takes one gone one's place
            slot.restarts += 1
            slot.members.discard(gone[0])
        slot.members.add(replica_id)
        # A new replica on a node replaces an earlier one of the lane there that is
        # gone (TP>1 lanes may run several live replicas on one node: those stay).
        stale = [
            r.replica_id
            for r in self.replicas.values()
            if (r.lane, r.node) == (lane, node) and not self._alive(r, now)
        ]
        for rid in stale:
            del self.replicas[rid]
        self.replicas[replica_id] = ReplicaState(
            replica_id, lane, node, registered_at=now, last_heartbeat=now, healthy_since=now
        )
        if stats is not None:
            self.replicas[replica_id].stats = ReplicaStats.from_dict(stats)

    def start_failed(self, lane: str, node: str, error: str) -> None:
        """A replica of `lane` failed in its constructor on `node`."""
        now = self.clock()
        slot = self.slots.setdefault((lane, node), _Slot())
        slot.failures.append(now)
        slot.restarts += 1
        slot.start_failures += 1
        slot.last_error = error[-500:]
        while slot.failures and slot.failures[0] < now - self.restart_window_s:
            slot.failures.popleft()

    def publish(
        self,
        replica_id: str,
        seq: int,
        *,
        stored: Sequence[BlockHash] = (),
        removed: Sequence[BlockHash] = (),
        cleared: bool = False,
        stats: dict[str, Any] | None = None,
        sent_at: float | None = None,
        state_stored: Sequence[BlockHash] | None = None,
        state_removed: Sequence[BlockHash] = (),
    ) -> bool:
        """Apply one batch (and heartbeat). Returns True when the replica must send a
        snapshot (`resync`): unknown replica, never synced, or a sequence gap.
        `state_stored` / `state_removed`: the state group's changes, for a model with
        recurrent-state layers (None: a model without)."""
        state = self.replicas.get(replica_id)
        if state is None:
            return True
        self._heartbeat(state, stats)
        if sent_at is not None:
            self.last_event_lag_s = max(0.0, time.time() - sent_at)
        if not state.synced:
            return True
        if seq <= state.last_seq:  # a duplicate, or already covered by a snapshot
            return False
        if seq != state.last_seq + 1:
            self.num_gaps += 1
            state.synced = False
            return True
        state.last_seq = seq
        if cleared:
            state.hashes.clear()
            state.speculative.clear()
            state.speculative_states.clear()
            if state.states is not None:
                state.states.clear()
        _apply(state.hashes, state.speculative, stored, removed)
        if state_stored is not None:
            if state.states is None:
                state.states = set()
            _apply(state.states, state.speculative_states, state_stored, state_removed)
        self.num_events += len(stored) + len(removed) + int(cleared)
        return False

    def resync(
        self,
        replica_id: str,
        seq: int,
        hashes: Iterable[BlockHash],
        states: Iterable[BlockHash] | None = None,
    ) -> None:
        """Replace a replica's hashes (and, for a model with state layers, its state
        hashes) with a snapshot taken after batch `seq`."""
        state = self.replicas.get(replica_id)
        if state is None:
            return
        state.hashes = set(hashes)
        state.states = None if states is None else set(states)
        state.last_seq = seq
        state.synced = True
        self.num_snapshots += 1

    def _heartbeat(self, state: ReplicaState, stats: dict[str, Any] | None) -> None:
        now = self.clock()
        for table in (state.in_flight, state.arrived):
            if table:
                for request_id in [r for r, t in table.items() if t <= now]:
                    del table[request_id]
        if stats is not None and stats.get("alive") is False:
            # The process answers but its engine died: failed until Serve replaces it.
            state.last_heartbeat = now
            state.failed_at = state.failed_at or now
            return
        if not self._alive(state, now):
            state.healthy_since = now
        state.last_heartbeat = now
        state.failed_at = None
        state.routed_since_heartbeat = 0
        if stats is not None:
            state.stats = ReplicaStats.from_dict(stats)
            arrived = stats.get("arrived")
            if arrived:
                expiry = now + self.heartbeat_timeout_s
                for request_id in arrived:
                    state.in_flight.pop(request_id, None)
                    state.arrived[request_id] = expiry

    # -- router side ----------------------------------------------------------------------
    def match(self, replica_id: str, chain: Sequence[BlockHash]) -> int:
        """Leading blocks of `chain` the replica can serve from its cache: held
        consecutively from 0 and, for a model with state layers, ending at a block
        whose prefix state it holds (the engine's own rule)."""
        state = self.replicas.get(replica_id)
        if state is None:
            return 0
        held, spec = state.hashes, state.speculative
        now = self.clock() if spec or state.speculative_states else 0.0
        n = 0
        for h in chain:
            if h not in held and spec.get(h, 0.0) <= now:
                break
            n += 1
        states = state.states
        if states is not None:
            spec_states = state.speculative_states
            while n and chain[n - 1] not in states and spec_states.get(chain[n - 1], 0.0) <= now:
                n -= 1
        return n

    def record(
        self, replica_id: str, chain: Sequence[BlockHash], request_id: str | None = None
    ) -> None:
        """A request with `chain` was just routed to the replica: count it as load and
        its blocks as held until the engine's events say otherwise. With the engine's
        `request_id`, it counts until the engine reports it arrived (or for one
        heartbeat timeout); without, until the replica's next report."""
        state = self.replicas.get(replica_id)
        if state is None:
            return
        now = self.clock()
        if request_id is None:
            state.routed_since_heartbeat += 1
        elif state.arrived.get(request_id, 0.0) <= now:  # else its engine has it already
            state.in_flight[request_id] = now + self.heartbeat_timeout_s
        expiry = self.clock() + self.speculative_ttl_s
        spec = state.speculative
        for h in chain:
            if h not in state.hashes:
                spec[h] = expiry
        if state.states is not None and chain and chain[-1] not in state.states:
            # Its prefill ends on its last full block: the engine keeps that state.
            state.speculative_states[chain[-1]] = expiry
        for table in (spec, state.speculative_states):
            if len(table) > 4 * len(chain) + 1024:  # drop the expired ones now and then
                now = self.clock()
                for h in [h for h, t in table.items() if t <= now]:
                    del table[h]

    def unrecord(self, replica_id: str, request_id: str | None = None) -> None:
        """Take back the unit of load `record` charged (the request went elsewhere);
        its recorded chain expires on its own."""
        state = self.replicas.get(replica_id)
        if state is None:
            return
        if request_id is not None:  # nothing to take back once it arrived there
            state.in_flight.pop(request_id, None)
        else:
            state.routed_since_heartbeat = max(0, state.routed_since_heartbeat - 1)

    def report_failure(self, replica_id: str) -> None:
        """A caller saw the replica fail (its actor died mid-request)."""
        state = self.replicas.get(replica_id)
        if state is not None:
            state.failed_at = self.clock()

    def prune(self, silent_for_s: float = 600.0) -> list[str]:
        """Forget replicas that have not reported for `silent_for_s` (gone without a
        router noticing, e.g. after a restart of the whole deployment)."""
        now = self.clock()
        gone = [rid for rid, r in self.replicas.items() if now - r.last_heartbeat > silent_for_s]
        for rid in gone:
            del self.replicas[rid]
        return gone

    def drop(self, replica_id: str) -> None:
        """Forget a replica (its actor is gone): its events and hashes go with it."""
        self.replicas.pop(replica_id, None)

    def leave(self, replica_id: str) -> bool:
        """A planned removal (scale-down, shutdown): forget the replica and its hashes
        at once (no request is routed to it for a prefix any more), and free its slot
        so that a later replica on the same node is not counted as a restart. Returns
        False for an unknown replica."""
        state = self.replicas.pop(replica_id, None)
        if state is None:
            return False
        slot = self.slots.get((state.lane, state.node))
        if slot is not None:
            slot.members.discard(replica_id)
        return True

    # -- health ---------------------------------------------------------------------------
    def _alive(self, state: ReplicaState, now: float) -> bool:
        return state.failed_at is None and now - state.last_heartbeat <= self.heartbeat_timeout_s

    def slot_down(self, lane: str, node: str, now: float | None = None) -> bool:
        """A restart loop on (lane, node): too many start failures in the window, and
        no replica there healthy for `healthy_after_s` since."""
        now = self.clock() if now is None else now
        slot = self.slots.get((lane, node))
        if slot is None:
            return False
        while slot.failures and slot.failures[0] < now - self.restart_window_s:
            slot.failures.popleft()
        if len(slot.failures) < self.restart_loop_threshold:
            return False
        for r in self.replicas.values():
            recovered = (
                (r.lane, r.node) == (lane, node)
                and self._alive(r, now)
                and r.healthy_since >= slot.failures[-1]
                and now - r.healthy_since >= self.healthy_after_s
            )
            if recovered:
                slot.failures.clear()
                return False
        return True

    def healthy(self, replica_id: str, now: float | None = None) -> bool:
        now = self.clock() if now is None else now
        state = self.replicas.get(replica_id)
        if state is None or not self._alive(state, now):
            return False
        return not self.slot_down(state.lane, state.node, now)

    def healthy_replicas(self, lane: str) -> list[ReplicaState]:
        now = self.clock()
        return [
            r for r in self.replicas.values() if r.lane == lane and self.healthy(r.replica_id, now)
        ]

    def lane_report(self, lane: str) -> dict[str, Any]:
        """Per replica and per slot (JSON-safe): what `GET /admin/lanes` shows."""
        now = self.clock()
        replicas = []
        for r in self.replicas.values():
            if r.lane != lane:
                continue
            slot = self.slots.get((lane, r.node), _Slot())
            replicas.append(
                {
                    "replica_id": r.replica_id,
                    "node": r.node,
                    "healthy": self.healthy(r.replica_id, now),
                    "seconds_since_heartbeat": round(now - r.last_heartbeat, 3),
                    "queue": r.stats.num_waiting,
                    "running": r.stats.num_running,
                    "kv_usage": r.stats.kv_usage,
                    "blocks_held": r.stats.num_blocks - r.stats.num_free_blocks - 1
                    if r.stats.num_blocks
                    else 0,
                    "cached_hashes": len(r.hashes),
                    "speculative_hashes": sum(1 for t in r.speculative.values() if t > now),
                    "prefix_hits_total": r.stats.prefix_hits_total,
                    "prefix_queries_total": r.stats.prefix_queries_total,
                    "synced": r.synced,
                    "restarts": slot.restarts,
                }
            )
        down = []
        for (slot_lane, node), slot in self.slots.items():
            if slot_lane == lane and self.slot_down(lane, node, now):
                down.append(
                    {
                        "node": node,
                        "restarts": slot.restarts,
                        "recent_start_failures": len(slot.failures),
                        "last_error": slot.last_error,
                    }
                )
        return {"replicas": replicas, "down_slots": down}

    def stats(self) -> dict[str, Any]:
        return {
            "replicas": len(self.replicas),
            "hashes": sum(len(r.hashes) for r in self.replicas.values()),
            "events_applied": self.num_events,
            "sequence_gaps": self.num_gaps,
            "snapshots": self.num_snapshots,
            "event_lag_s": self.last_event_lag_s,
            "heartbeat_timeout_s": self.heartbeat_timeout_s,
            "healthy_after_s": self.healthy_after_s,
        }


def _apply(
    held: set[BlockHash],
    spec: dict[BlockHash, float],
    stored: Sequence[BlockHash],
    removed: Sequence[BlockHash],
) -> None:
    """One batch's net changes to a set of held hashes; the engine's word replaces a
    router's speculation either way."""
    held.update(stored)
    held.difference_update(removed)
    if spec:
        for h in stored:
            spec.pop(h, None)
        for h in removed:
            spec.pop(h, None)
