"""Replica choice: cost formula, tie-breaks, hot-spot guard, affinity (hand-computed)."""

from __future__ import annotations

import pytest

from spur.cluster.routing.policy import Candidate, Weights, choose, cost

W = Weights(load_weight=1.0, kv_usage_weight=8.0, hot_spot_margin=8.0)


def cand(rid: str, matched: int = 0, load: int = 0, kv: float = 0.0) -> Candidate:
    return Candidate(rid, matched, load, kv)


def test_cost_formula():
    c = cand("r", matched=3, load=2, kv=0.5)
    # (10 - 3) + 1.0 * 2 + 8.0 * 0.5
    assert cost(c, 10, W) == 13.0
    assert cost(c, 10, Weights(load_weight=2.0, kv_usage_weight=0.0)) == 11.0


def test_longest_match_wins_at_equal_load():
    d = choose([cand("a", 1, 2), cand("b", 4, 2), cand("c", 0, 2)], 6, W)
    assert d.ranked == ["b", "a", "c"]
    assert d.reason == "prefix"
    assert d.matched_blocks == 4


def test_big_load_difference_beats_small_match_difference():
    a, b = cand("a", matched=5, load=6), cand("b", matched=3, load=1)
    # a: (8 - 5) + 6 = 9; b: (8 - 3) + 1 = 6 -> b, and b still holds 3 blocks.
    assert cost(a, 8, W) == 9.0
    assert cost(b, 8, W) == 6.0
    d = choose([a, b], 8, W)
    assert d.ranked == ["b", "a"]
    assert d.reason == "prefix"
    assert d.matched_blocks == 3


def test_no_match_least_loaded_wins():
    d = choose([cand("a", load=3), cand("b", load=1), cand("c", load=2)], 4, W)
    assert d.ranked == ["b", "c", "a"]
    assert d.reason == "load"
    assert d.matched_blocks == 0


def test_kv_usage_breaks_ties():
    d = choose([cand("a", 2, 1, kv=0.9), cand("b", 2, 1, kv=0.1)], 4, W)
    assert d.ranked == ["b", "a"]


def test_equal_cost_fewer_requests_then_order():
    # a: 4 - 0 + 2 = 6; b: 4 - 2 + 4 = 6; c same as b -> a (fewer requests), then b, c
    d = choose([cand("b", 2, 4), cand("c", 2, 4), cand("a", 0, 2)], 4, W)
    assert d.ranked == ["a", "b", "c"]


def test_hot_spot_guard_sends_to_least_loaded():
    hot = cand("hot", matched=20, load=10)  # cost 0 + 10 = 10
    idle = cand("idle", matched=0, load=1)  # cost 20 + 1 = 21
    assert cost(hot, 20, W) < cost(idle, 20, W)
    d = choose([hot, idle], 20, W)  # 10 - 1 = 9 > 8
    assert d.ranked == ["idle", "hot"]
    assert d.reason == "load"
    assert d.matched_blocks == 0
    # exactly at the margin: no guard
    d = choose([cand("hot", 20, 9), idle], 20, W)
    assert d.ranked[0] == "hot"
    assert d.reason == "prefix"


def test_affinity_wins_unless_hot_spot():
    a, b = cand("a", matched=4, load=1), cand("b", matched=0, load=3)
    d = choose([a, b], 4, W, affinity="b")
    assert d.ranked == ["b", "a"]
    assert d.reason == "affinity"
    assert d.matched_blocks == 0
    hot = cand("b", matched=0, load=10)  # 10 - 1 = 9 > 8
    d = choose([a, hot], 4, W, affinity="b")
    assert d.ranked == ["a", "b"]
    assert d.reason == "prefix"


def test_affinity_to_unknown_replica_is_ignored():
    d = choose([cand("a", 2, 1), cand("b", 0, 1)], 4, W, affinity="gone")
    assert d.ranked == ["a", "b"]
    assert d.reason == "prefix"


def test_ranking_holds_every_candidate_once():
    cs = [cand(f"r{i}", matched=i % 3, load=(7 * i) % 11, kv=i / 10) for i in range(8)]
    for aff in (None, "r3", "r7"):
        d = choose(cs, 5, W, affinity=aff)
        assert sorted(d.ranked) == sorted(c.replica_id for c in cs)
        assert len(d.ranked) == len(cs)


def test_empty_candidates_raise():
    with pytest.raises(ValueError):
        choose([], 3, W)
