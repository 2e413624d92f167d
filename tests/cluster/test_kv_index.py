"""KVIndex (pure Python): event ordering, prefix match, load, health, restart loops."""

from __future__ import annotations

from typing import Any

import pytest

from spur.cluster.routing.kv_index import KVIndex

A, B, C, D = b"a", b"b", b"c", b"d"


@pytest.fixture
def t() -> list[float]:
    return [100.0]


def make(t: list[float], **kw: Any) -> KVIndex:
    return KVIndex(clock=lambda: t[0], **kw)


def synced(t: list[float], rid: str = "r1", lane: str = "L", node: str = "n1") -> KVIndex:
    idx = make(t)
    idx.register(rid, lane, node)
    idx.resync(rid, 0, [A])
    return idx


# -- events ----------------------------------------------------------------------------


def test_publish_before_snapshot_asks_for_one(t):
    idx = make(t)
    idx.register("r1", "L", "n1")
    assert idx.publish("r1", 0, stored=[A]) is True
    assert idx.match("r1", [A]) == 0  # ignored until resync


def test_publish_for_unknown_replica_asks_for_snapshot(t):
    assert make(t).publish("ghost", 0, stored=[A]) is True


def test_in_order_batches_apply_after_resync(t):
    idx = synced(t)
    assert idx.stats()["snapshots"] == 1
    assert idx.publish("r1", 1, stored=[B, C]) is False
    assert idx.match("r1", [A, B, C]) == 3
    assert idx.publish("r1", 2, removed=[C]) is False
    assert idx.match("r1", [A, B, C]) == 2
    # cleared applies first, then stored
    assert idx.publish("r1", 3, stored=[D], cleared=True) is False
    assert idx.replicas["r1"].hashes == {D}
    assert idx.stats()["events_applied"] == 2 + 1 + 2


def test_a_state_model_matches_up_to_a_block_whose_state_is_held(t):
    """A hybrid engine serves a hit of n blocks only with the attention blocks 0..n-1
    and the state saved at n - 1 (saved where prefill chunks ended: sparse). The
    router counted attention alone: phantom hits that outweighed load."""
    idx = make(t)
    idx.register("h", "L", "n1")
    idx.resync("h", 0, [A, B, C, D], states=[B])
    assert idx.match("h", [A, B, C, D]) == 2  # the state after B, none after C or D
    assert idx.match("h", [A]) == 0  # no state after A: a cold start there
    assert idx.publish("h", 1, state_stored=[D], state_removed=[B]) is False
    assert idx.match("h", [A, B, C, D]) == 4 and idx.match("h", [A, B, C]) == 0
    assert idx.publish("h", 2, stored=[], state_stored=[], cleared=True) is False
    assert idx.match("h", [A, B]) == 0 and idx.replicas["h"].states == set()
    # a router's speculation: the chain's blocks and the state of its last one
    idx.record("h", [A, B, C])
    assert idx.match("h", [A, B, C]) == 3 and idx.match("h", [A, B]) == 0
    t[0] += idx.speculative_ttl_s + 1
    assert idx.match("h", [A, B, C]) == 0
    # a model without state layers keeps the attention rule
    plain = synced(t)
    plain.publish("r1", 1, stored=[B])
    assert plain.replicas["r1"].states is None and plain.match("r1", [A, B]) == 2


def test_gap_unsyncs_until_resync(t):
    idx = synced(t)
    assert idx.publish("r1", 2, stored=[B]) is True  # seq 1 lost
    assert idx.num_gaps == 1
    assert idx.publish("r1", 3, stored=[C]) is True  # ignored while unsynced
    assert idx.match("r1", [A, B]) == 1
    assert idx.replicas["r1"].hashes == {A}
    idx.resync("r1", 3, [A, B, C])
    assert idx.publish("r1", 4, stored=[D]) is False
    assert idx.match("r1", [A, B, C, D]) == 4
    assert idx.stats()["sequence_gaps"] == 1


def test_duplicates_are_ignored(t):
    idx = synced(t)
    assert idx.publish("r1", 1, stored=[B]) is False
    assert idx.publish("r1", 1, removed=[B]) is False
    assert idx.publish("r1", 0, removed=[A]) is False
    assert idx.match("r1", [A, B]) == 2


def test_match_counts_only_leading_run(t):
    idx = make(t)
    idx.register("r1", "L", "n1")
    idx.resync("r1", 0, [A, C])
    assert idx.match("r1", [A, B, C]) == 1
    assert idx.match("r1", [B, A]) == 0
    assert idx.match("nobody", [A]) == 0


def test_record_is_speculative_load_reset_by_heartbeat(t):
    idx = synced(t)
    idx.record("r1", [A, B, C])
    idx.record("r1", [A, B])
    r = idx.replicas["r1"]
    assert idx.match("r1", [A, B, C]) == 3
    assert set(r.speculative) == {B, C}  # A was already held
    assert r.routed_since_heartbeat == 2
    assert r.load == 2
    idx.publish("r1", 1, stats={"num_running": 3, "num_waiting": 1})
    assert r.routed_since_heartbeat == 0
    assert r.load == 4


def test_a_request_routed_with_its_engine_id_is_load_until_the_engine_has_it(t):
    """A report does not forget a request still on its way (or queued behind the
    engine's step): it was load until the engine lists it as arrived, then its own
    counts hold it. One that never arrives stops counting after a heartbeat timeout."""
    idx = synced(t)
    r = idx.replicas["r1"]
    idx.record("r1", [A, B], "q1")
    idx.record("r1", [A, C], "q2")
    idx.record("r1", [A, D], "q3")
    assert r.load == 3
    # The engine reports before any of them reached it: all three still count.
    idx.publish("r1", 1, stats={"num_running": 1, "num_waiting": 0, "arrived": []})
    assert r.load == 4
    # Queued behind the engine's step is load as well.
    idx.publish("r1", 1, stats={"num_running": 1, "num_waiting": 0, "num_queued": 2})
    assert r.load == 6
    idx.publish("r1", 1, stats={"num_running": 1, "num_waiting": 0, "arrived": []})
    # q1 and q2 arrived: its counts hold them now (one finished meanwhile, one runs).
    idx.publish("r1", 2, stats={"num_running": 2, "num_waiting": 0, "arrived": ["q1", "q2"]})
    assert sorted(r.in_flight) == ["q3"]
    assert r.load == 3
    # Ids the engine lists that were routed by no one (a spare's fallback) change nothing.
    idx.publish("r1", 3, stats={"num_running": 2, "num_waiting": 0, "arrived": ["other"]})
    assert r.load == 3
    # A router's record that lands after the engine reported the request arrived (Serve's
    # choice reported late) adds nothing: its engine has it.
    idx.record("r1", [A], "q2")
    assert list(r.in_flight) == ["q3"]
    # q3 never arrives (its client left while Serve held it): it expires, also while
    # the replica reports its engine dead.
    t[0] += idx.heartbeat_timeout_s + 0.1
    idx.publish("r1", 4, stats={"num_running": 2, "num_waiting": 0, "alive": False})
    assert r.in_flight == {} and r.arrived == {}
    idx.publish("r1", 5, stats={"num_running": 2, "num_waiting": 0, "arrived": []})
    assert r.load == 2
    # Taken back (Serve sent it elsewhere): by its id; an id it no longer has is a no-op.
    idx.record("r1", [A], "q4")
    idx.record("r1", [A])
    idx.unrecord("r1", "q4")
    idx.unrecord("r1", "gone")
    assert (r.in_flight, r.routed_since_heartbeat) == ({}, 1)
    idx.unrecord("r1")
    assert r.load == 2


# -- health ----------------------------------------------------------------------------


def test_heartbeat_timeout(t):
    idx = make(t, heartbeat_timeout_s=3.0)
    idx.register("r1", "L", "n1")
    assert idx.healthy("r1")
    t[0] += 3.0
    assert idx.healthy("r1")
    t[0] += 0.5
    assert not idx.healthy("r1")
    idx.publish("r1", 0)
    assert idx.healthy("r1")


def test_report_failure_until_next_publish(t):
    idx = make(t)
    idx.register("r1", "L", "n1")
    idx.report_failure("r1")
    assert not idx.healthy("r1")
    idx.publish("r1", 0)
    assert idx.healthy("r1")


def test_drop_forgets(t):
    idx = synced(t)
    idx.drop("r1")
    assert not idx.healthy("r1")
    assert idx.match("r1", [A]) == 0
    assert idx.publish("r1", 1) is True
    assert idx.stats()["replicas"] == 0


def test_new_replica_on_same_slot_replaces_old_and_counts_restart(t):
    idx = synced(t)
    idx.register("r1", "L", "n1")  # same id: no-op
    assert idx.replicas["r1"].synced
    assert idx.lane_report("L")["replicas"][0]["restarts"] == 0
    idx.register("r2", "L", "n1")  # r1 still heartbeats: a second live replica there:
    assert set(idx.replicas) == {"r1", "r2"}
    assert {r["restarts"] for r in idx.lane_report("L")["replicas"]} == {0}  # no restart
    idx.drop("r2")
    t[0] += idx.heartbeat_timeout_s + 1  # r1 went silent: the next one replaces it
    idx.register("r3", "L", "n1")
    assert set(idx.replicas) == {"r3"}
    [rep] = idx.lane_report("L")["replicas"]
    assert rep["replica_id"] == "r3"
    assert rep["restarts"] == 1  # two gone, one replacement
    idx.register("r4", "L", "n1")  # the second gone one's replacement
    assert {r["restarts"] for r in idx.lane_report("L")["replicas"]} == {2}
    idx.register("r5", "L", "n1")  # nothing left to replace: a scale-up
    assert {r["restarts"] for r in idx.lane_report("L")["replicas"]} == {2}
    idx.register("r6", "L", "n2")  # other node: no replacement
    assert set(idx.replicas) == {"r3", "r4", "r5", "r6"}


def test_restart_loop_marks_slot_down(t):
    idx = make(t, restart_loop_threshold=3, restart_window_s=60.0)
    for _ in range(2):
        idx.start_failed("L", "n1", "boom")
        t[0] += 1
    assert not idx.slot_down("L", "n1")
    idx.start_failed("L", "n1", "boom3")
    assert idx.slot_down("L", "n1")
    assert not idx.slot_down("L", "n2")
    assert not idx.slot_down("other", "n1")
    [down] = idx.lane_report("L")["down_slots"]
    assert down["node"] == "n1"
    assert down["recent_start_failures"] == 3
    assert down["last_error"] == "boom3"
    assert down["restarts"] == 3


def test_restart_loop_window_expires(t):
    idx = make(t, restart_loop_threshold=3, restart_window_s=60.0)
    idx.start_failed("L", "n1", "e")
    t[0] += 30
    idx.start_failed("L", "n1", "e")
    idx.start_failed("L", "n1", "e")
    assert idx.slot_down("L", "n1")
    t[0] += 30.5  # the first failure is now older than the window
    assert not idx.slot_down("L", "n1")


def test_restart_loop_cleared_by_replica_healthy_long_enough(t):
    idx = make(t, restart_loop_threshold=2, healthy_after_s=5.0, heartbeat_timeout_s=3.0)
    idx.start_failed("L", "n1", "e")
    idx.start_failed("L", "n1", "e")
    t[0] += 1
    idx.register("r1", "L", "n1")
    assert not idx.healthy("r1")  # alive, but its slot is down
    assert idx.healthy_replicas("L") == []
    for _ in range(4):
        t[0] += 1
        idx.publish("r1", 0)
        assert idx.slot_down("L", "n1")
    t[0] += 1  # 5 s healthy since registering
    idx.publish("r1", 0)
    assert not idx.slot_down("L", "n1")
    assert idx.healthy("r1")
    assert idx.lane_report("L")["down_slots"] == []


def test_restart_loop_not_cleared_by_replica_that_missed_heartbeats(t):
    idx = make(t, restart_loop_threshold=2, healthy_after_s=5.0, heartbeat_timeout_s=3.0)
    idx.start_failed("L", "n1", "e")
    idx.start_failed("L", "n1", "e")
    t[0] += 1
    idx.register("r1", "L", "n1")
    t[0] += 4  # heartbeat missed
    idx.publish("r1", 0)  # healthy again from now
    t[0] += 2
    idx.publish("r1", 0)
    assert idx.slot_down("L", "n1")  # 6 s since registering, only 2 since healthy
    t[0] += 3
    idx.publish("r1", 0)
    assert not idx.slot_down("L", "n1")


# -- reports ---------------------------------------------------------------------------


def test_lane_report_and_stats_fields(t):
    idx = synced(t)
    idx.publish(
        "r1",
        1,
        stored=[B],
        stats={
            "num_waiting": 2,
            "num_running": 1,
            "kv_usage": 0.25,
            "num_blocks": 100,
            "num_free_blocks": 60,
            "unknown_key": 1,
        },
    )
    idx.register("x", "other", "n1")
    report = idx.lane_report("L")
    assert set(report) == {"replicas", "down_slots"}
    [rep] = report["replicas"]
    assert rep["replica_id"] == "r1"
    assert rep["healthy"] is True
    assert rep["queue"] == 2
    assert rep["running"] == 1
    assert rep["kv_usage"] == 0.25
    assert rep["blocks_held"] == 100 - 60 - 1
    assert rep["cached_hashes"] == 2
    assert rep["synced"] is True
    assert rep["restarts"] == 0
    assert set(idx.stats()) == {
        "replicas",
        "hashes",
        "events_applied",
        "sequence_gaps",
        "snapshots",
        "event_lag_s",
        "heartbeat_timeout_s",
        "healthy_after_s",
    }
    assert idx.stats()["replicas"] == 2
    assert idx.stats()["hashes"] == 2


def test_healthy_replicas_filters_by_lane(t):
    idx = make(t, heartbeat_timeout_s=3.0)
    idx.register("a1", "A", "n1")
    idx.register("b1", "B", "n1")
    t[0] += 2
    idx.register("a2", "A", "n2")
    assert [r.replica_id for r in idx.healthy_replicas("A")] == ["a1", "a2"]
    assert [r.replica_id for r in idx.healthy_replicas("B")] == ["b1"]
    t[0] += 2  # a1 timed out, a2 not
    assert [r.replica_id for r in idx.healthy_replicas("A")] == ["a2"]


def test_restart_counted_when_replacement_follows_drop(t):
    idx = synced(t)
    idx.drop("r1")  # the router saw the actor die
    idx.register("r2", "L", "n1")  # Serve's replacement on the same node
    assert idx.lane_report("L")["replicas"][0]["restarts"] == 1


def test_prune_forgets_replicas_silent_for_long() -> None:
    t = [0.0]
    index = KVIndex(clock=lambda: t[0])
    index.register("old", "chat", "n1")
    t[0] = 500.0
    index.register("new", "chat", "n2")
    t[0] = 700.0
    assert index.prune(600.0) == ["old"]
    assert set(index.replicas) == {"new"}


def test_a_replica_whose_engine_died_is_unhealthy_while_it_still_heartbeats(t):
    idx = synced(t)
    assert idx.healthy("r1")
    idx.publish("r1", 1, stats={"alive": False, "num_running": 0})
    assert not idx.healthy("r1")
    t[0] += 1
    idx.publish("r1", 2, stats={"alive": False})
    assert not idx.healthy("r1")


def test_speculative_hashes_expire_unless_the_engine_confirms_them(t):
    idx = synced(t)  # r1 holds A for real
    idx.record("r1", [A, B, C])
    assert idx.match("r1", [A, B, C]) == 3
    idx.publish("r1", 1, stored=[B])  # the engine computed B: now real
    t[0] += idx.speculative_ttl_s + 1
    assert idx.match("r1", [A, B, C]) == 2  # C never landed: expired
    assert idx.lane_report("L")["replicas"][0]["speculative_hashes"] == 0
    idx.record("r1", [A, B, C])
    idx.publish("r1", 2, cleared=True)  # a reset forgets speculation too
    assert idx.match("r1", [A, B, C]) == 0


def test_planned_leave_drops_hashes_and_is_no_restart(t):
    idx = synced(t)
    assert idx.leave("r1") is True
    assert idx.match("r1", [A]) == 0 and "r1" not in idx.replicas
    assert idx.leave("r1") is False
    idx.register("r2", "L", "n1")  # a later replica on the same node: not a restart
    [rep] = idx.lane_report("L")["replicas"]
    assert rep["restarts"] == 0


def test_a_burst_to_replicas_the_index_does_not_know_spreads() -> None:
    """Right after the index restarts it knows no replica until each publishes (up to
    stats_period_s): every unknown one counted as load 0 and record() ignored it, so a
    burst of 12 requests all went to the first. What it routed there is now their load."""
    from collections import Counter

    from spur.cluster.routing.index_actor import KVIndexActor

    weights = {"load_weight": 1.0, "kv_usage_weight": 8.0, "hot_spot_margin": 8.0}
    ids = ["r0", "r1", "r2"]
    actor = KVIndexActor()
    chains = [[bytes([i, j]) for j in range(4)] for i in range(12)]
    got = Counter(actor.route("chat", ids, chain, weights)[0] for chain in chains)
    assert got == {"r0": 4, "r1": 4, "r2": 4}
    actor.register("r0", "chat", "node-r0")  # once known, its own reports count
    actor.route("chat", ids, [b"x"], weights)
    assert "r0" not in actor.unknown_routed


def test_serve_retrying_one_request_counts_it_once() -> None:
    """Serve asks the router again for a request no replica took (both full, backoff
    25 ms to 0.5 s). Each ask counted a decision, a matched-blocks observation and a
    unit of load at the top replica, and from the second ask the request matched the
    chain its own first ask recorded ("prefix", full-chain hits that never happened)."""
    from spur.cluster.routing.index_actor import KVIndexActor

    t = [100.0]
    actor = KVIndexActor(clock=lambda: t[0])
    for rid in ("A", "B"):
        actor.register(rid, "chat", rid)
        actor.resync(rid, -1, [])
        actor.publish(rid, [], {"num_running": 4, "num_waiting": 0})
    chain = [bytes([i]) * 32 for i in range(8)]
    weights = {"load_weight": 1.0, "kv_usage_weight": 8.0, "hot_spot_margin": 8.0}
    first = actor.route("chat", ["A", "B"], chain, weights, request_id="req-1")[0]
    for _ in range(5):  # the same request, asked again
        actor.route("chat", ["A", "B"], chain, weights, request_id="req-1")
    m = actor.metrics()
    assert m["decisions"] == [{"lane": "chat", "reason": "load", "count": 1}]
    assert sum(x["count"] for x in m["matched_blocks"]) == 1
    loads = {r: actor.index.replicas[r].routed_since_heartbeat for r in "AB"}
    assert loads == {first: 1, ({"A", "B"} - {first}).pop(): 0}
    # Serve took it elsewhere at last: the unit of load moves there.
    other = ({"A", "B"} - {first}).pop()
    actor.routed_elsewhere(other, chain, "req-1")
    loads = {r: actor.index.replicas[r].routed_since_heartbeat for r in "AB"}
    assert loads == {first: 0, other: 1}
    # Another request is another decision.
    actor.route("chat", ["A", "B"], chain, weights, request_id="req-2")
    assert sum(d["count"] for d in actor.metrics()["decisions"]) == 2
    # With the engine's id, the unit is that request's until its engine has it, and
    # it moves with the request.
    first = actor.route("chat", ["A", "B"], chain, weights, "s", "req-3", "eng-3")[0]
    second = ({"A", "B"} - {first}).pop()
    assert list(actor.index.replicas[first].in_flight) == ["eng-3"]
    actor.routed_elsewhere(second, chain, "req-3", "eng-3")  # as the router sends it
    in_flight = {r: list(actor.index.replicas[r].in_flight) for r in "AB"}
    assert in_flight == {first: [], second: ["eng-3"]}
