"""LaneSelector: primary-or-spare with hysteresis (fake clock)."""

from __future__ import annotations

import pytest

from spur.cluster.lanes import LaneSelector, LaneView

UP = LaneView(healthy=2, waiting=(0, 1))
DOWN = LaneView(healthy=0)


@pytest.fixture
def t() -> list[float]:
    return [0.0]


def selector(t: list[float]) -> LaneSelector:
    return LaneSelector(
        ["chat", "batch"],
        spare_of={"chat": "chat-spare"},
        saturation={"chat": 4, "batch": 4},
        healthy_after_s=5.0,
        clock=lambda: t[0],
    )


def test_down_moves_to_spare(t):
    s = selector(t)
    assert s.update({"chat": UP}) == []
    assert s.target("chat") == "chat"
    assert s.update({"chat": DOWN}) == [("chat", "down")]
    assert s.target("chat") == "chat-spare"
    assert s.update({"chat": DOWN}) == []  # already there


def test_saturated_only_when_every_healthy_replica_is():
    s = LaneSelector(["chat"], spare_of={"chat": "sp"}, saturation={"chat": 4}, healthy_after_s=5)
    assert s.usable("chat", LaneView(2, (4, 9))) == (True, "primary")  # 4 is not > 4
    assert s.update({"chat": LaneView(2, (5, 1))}) == []
    assert s.update({"chat": LaneView(2, (5, 9))}) == [("chat", "saturated")]
    assert s.target("chat") == "sp"


def test_saturated_primaries_stay_while_the_spare_has_no_healthy_replica(t):
    """The selector looked at the primaries only: a saturated lane moved to a spare
    with no healthy replica, where each request waited for one until it gave up (15 s
    an attempt, then a 503), while the primaries could have queued it."""
    s = selector(t)
    busy = (5, 9)
    assert s.update({"chat": LaneView(2, busy, spare_healthy=0)}) == []
    assert s.target("chat") == "chat" and s.report("chat")["reason"] == "primary"
    assert s.update({"chat": LaneView(2, busy, spare_healthy=1)}) == [("chat", "saturated")]
    assert s.target("chat") == "chat-spare"
    # The spare loses its last replica while the lane is on it: back at once.
    assert s.update({"chat": LaneView(2, busy, spare_healthy=0)}) == [("chat", "primary")]
    assert s.target("chat") == "chat"
    # Primaries down: the spare is the only hope, healthy or not (it may be starting).
    assert s.update({"chat": LaneView(0, (), spare_healthy=0)}) == [("chat", "down")]


def test_a_saturated_lane_whose_primaries_die_says_down(t):
    """The reason is what holds now, not what moved the lane: requests waiting on a
    lane whose primaries are gone are released at once only when it says "down"."""
    s = selector(t)
    assert s.update({"chat": LaneView(2, (5, 9))}) == [("chat", "saturated")]
    assert s.update({"chat": DOWN}) == []  # no second switch
    assert s.report("chat")["reason"] == "down" and s.report("chat")["switches"] == 1


def test_comes_back_after_healthy_after_s(t):
    s = selector(t)
    s.update({"chat": DOWN})
    t[0] = 1.0
    assert s.update({"chat": UP}) == []  # usable from t=1
    t[0] = 5.9
    assert s.update({"chat": UP}) == []
    assert s.target("chat") == "chat-spare"
    t[0] = 6.0
    assert s.update({"chat": UP}) == [("chat", "primary")]
    assert s.target("chat") == "chat"
    assert s.report("chat")["switches"] == 2


def test_flap_resets_the_timer(t):
    s = selector(t)
    s.update({"chat": DOWN})
    t[0] = 1.0
    s.update({"chat": UP})
    t[0] = 4.0
    assert s.update({"chat": DOWN}) == []  # still on spare, timer reset
    t[0] = 5.0
    s.update({"chat": UP})
    t[0] = 9.0  # 8 s after the first usable poll, only 4 after the flap
    assert s.update({"chat": UP}) == []
    assert s.target("chat") == "chat-spare"
    t[0] = 10.0
    assert s.update({"chat": UP}) == [("chat", "primary")]


def test_fail_over_now(t):
    s = selector(t)
    assert s.fail_over_now("chat") is True
    assert s.target("chat") == "chat-spare"
    assert s.report("chat")["reason"] == "down"
    assert s.fail_over_now("chat") is False  # already on spare
    assert s.fail_over_now("batch") is False  # no spare
    assert s.fail_over_now("nope") is False
    assert s.target("batch") == "batch"
    # needs the full hysteresis window to come back
    t[0] = 1.0
    s.update({"chat": UP})
    t[0] = 5.0
    assert s.update({"chat": UP}) == []
    t[0] = 6.0
    assert s.update({"chat": UP}) == [("chat", "primary")]


def test_lane_without_spare_always_targets_itself(t):
    s = selector(t)
    assert s.update({"batch": DOWN, "unknown": DOWN}) == []
    assert s.target("batch") == "batch"
    assert s.report("batch") == {
        "target": "batch",
        "reason": "down",
        "spare": None,
        "switches": 0,
        "spare_disabled": None,
    }
    s.update({"batch": UP})
    assert s.report("batch")["reason"] == "primary"


def test_report_fields(t):
    s = selector(t)
    assert s.report("chat") == {
        "target": "chat",
        "reason": "primary",
        "spare": "chat-spare",
        "switches": 0,
        "spare_disabled": None,
    }
    s.update({"chat": LaneView(1, (9,))})
    assert s.report("chat") == {
        "target": "chat-spare",
        "reason": "saturated",
        "spare": "chat-spare",
        "switches": 1,
        "spare_disabled": None,
    }
    assert s.state["chat"].history == [(0.0, "saturated")]


def test_disabled_spare_stops_the_fallback_and_says_why(t):
    s = selector(t)
    s.update({"chat": DOWN})
    assert s.target("chat") == "chat-spare"
    s.disable_spare("chat", "another vocabulary")
    assert s.target("chat") == "chat"
    assert s.update({"chat": DOWN}) == []
    assert s.report("chat")["spare_disabled"] == "another vocabulary"
    assert not s.fail_over_now("chat")
