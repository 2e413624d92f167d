"""spur's autoscaling policy: the pure decision, and the same function under Serve's own
wrapper (delays, bounds) with a real AutoscalingContext. No Ray cluster runs here."""

from __future__ import annotations

from typing import Any

import pytest

from spur.cluster.autoscaling import (
    Decision,
    ReplicaLoad,
    Targets,
    decide_from_metrics,
    desired_replicas,
    policy,
    target_metrics,
)

T = Targets(min_replicas=1, max_replicas=4, target_ongoing_requests=8)


def idle(n: int) -> list[ReplicaLoad]:
    return [ReplicaLoad(waiting=0, running=0, kv_usage=0.0) for _ in range(n)]


def test_demand_sets_the_replica_count() -> None:
    loads = [ReplicaLoad(waiting=10, running=8, kv_usage=0.4)]
    d = desired_replicas(loads, current=1, spare_demand=0, targets=T)
    assert d == Decision(3, "demand", 18.0)


def test_spare_traffic_counts_as_the_lanes_demand() -> None:
    # The primaries look calm because the overflow went to the spare.
    loads = [ReplicaLoad(waiting=0, running=6, kv_usage=0.3)]
    assert desired_replicas(loads, current=1, spare_demand=0, targets=T).replicas == 1
    d = desired_replicas(loads, current=1, spare_demand=12, targets=T)
    assert (d.replicas, d.reason, d.demand) == (3, "demand", 18.0)


def test_waiting_queue_and_kv_pressure_add_one_replica() -> None:
    wide = Targets(max_replicas=4, target_ongoing_requests=100, waiting_per_replica_high=2)
    queued = [ReplicaLoad(waiting=3, running=4, kv_usage=0.2)]
    assert desired_replicas(queued, current=1, spare_demand=0, targets=wide).reason == "waiting"
    full = [ReplicaLoad(waiting=0, running=4, kv_usage=0.95)]
    d = desired_replicas(full, current=1, spare_demand=0, targets=wide)
    assert (d.replicas, d.reason) == (2, "kv_pressure")


def test_scale_down_only_when_quiet_and_one_at_a_time() -> None:
    d = desired_replicas(idle(3), current=3, spare_demand=0, targets=T)
    assert (d.replicas, d.reason) == (2, "idle")
    # Low demand but something waits, sits on the spare, or the pool is busy: hold.
    waiting = [ReplicaLoad(waiting=1, running=0), *idle(2)]
    assert desired_replicas(waiting, current=3, spare_demand=0, targets=T).reason == "hold"
    assert desired_replicas(idle(3), current=3, spare_demand=1, targets=T).reason == "hold"
    busy_kv = [ReplicaLoad(waiting=0, running=1, kv_usage=0.7) for _ in range(3)]
    assert desired_replicas(busy_kv, current=3, spare_demand=0, targets=T).reason == "hold"


def test_kv_pressure_is_not_undone_by_the_next_quiet_tick() -> None:
    """KV pressure (0.95 of one replica's pool, long requests) adds a replica; the two
    then read 0.475, under the low mark, and the lane went back to one, whose pool was
    at 0.95 again: 1 <-> 2 every ~100 s with the default marks, each scale-down draining
    live long requests. A scale-down now needs the KV to fit one replica fewer."""
    defaults = Targets(min_replicas=1, max_replicas=4, target_ongoing_requests=16)
    one = [ReplicaLoad(waiting=0, running=8, kv_usage=0.95)]
    up = desired_replicas(one, current=1, spare_demand=0, targets=defaults)
    assert (up.replicas, up.reason) == (2, "kv_pressure")
    spread = [ReplicaLoad(waiting=0, running=4, kv_usage=0.475) for _ in range(2)]
    d = desired_replicas(spread, current=2, spare_demand=0, targets=defaults)
    assert (d.replicas, d.reason) == (2, "hold")
    # Little enough KV to fit one replica under the high mark: down it goes.
    light = [ReplicaLoad(waiting=0, running=1, kv_usage=0.3) for _ in range(2)]
    d = desired_replicas(light, current=2, spare_demand=0, targets=defaults)
    assert (d.replicas, d.reason) == (1, "idle")


def test_bounds() -> None:
    flood = [ReplicaLoad(waiting=100, running=16, kv_usage=0.99)]
    d = desired_replicas(flood, current=1, spare_demand=50, targets=T)
    assert (d.replicas, d.reason) == (4, "bounds")
    two = Targets(min_replicas=2, max_replicas=4)
    assert desired_replicas(idle(2), current=2, spare_demand=0, targets=two).replicas == 2
    # Nothing reported yet (replicas starting): hold at the floor, do not crash.
    assert desired_replicas([], current=0, spare_demand=0, targets=two).replicas == 2


def test_no_report_at_all_is_not_idleness() -> None:
    """A metrics outage (no replica reported in the window) holds the lane; it used to
    count every silent replica as idle and shrink the lane one replica at a time."""
    d = decide_from_metrics({}, current=3, min_replicas=1, max_replicas=5)
    assert (d.replicas, d.reason) == (3, "no_metrics")
    only_gone = {"waiting": {"gone": 40.0}, "running": {"gone": 8.0}}
    d = decide_from_metrics(only_gone, current=3, min_replicas=1, max_replicas=5, running=["r1"])
    assert (d.replicas, d.reason) == (3, "no_metrics")
    # one silent replica among reporting ones still counts as idle (a new one, say)
    some = {"waiting": {"r1": 0.0}, "running": {"r1": 0.0}, "kv_usage": {"r1": 0.0}}
    d = decide_from_metrics(some, current=3, min_replicas=1, max_replicas=5)
    assert (d.replicas, d.reason) == (2, "idle")


def test_decide_from_metrics_reads_serve_layout_and_targets() -> None:
    metrics = {
        "waiting": {"r1": 4.0, "r2": 4.0, "gone": 100.0},
        "running": {"r1": 2.0, "r2": 2.0, "gone": 100.0},
        "kv_usage": {"r1": 0.1, "r2": 0.1},
        "spare_demand": {"r1": 3.0, "r2": 3.0},
        "target_target_ongoing_requests": {"r1": 5.0, "r2": 5.0},
    }
    d = decide_from_metrics(
        metrics, current=2, min_replicas=1, max_replicas=8, running=["r1", "r2"]
    )
    # (4+2)*2 + 3 (spare, counted once) = 15 requests at 5 per replica.
    assert (d.replicas, d.demand) == (3, 15.0)


def test_target_metrics() -> None:
    cfg = {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 8, "kv_usage_low": 0.3}
    assert target_metrics(cfg) == {
        "target_target_ongoing_requests": 8.0,
        "target_kv_usage_low": 0.3,
    }
    assert target_metrics(None) == {}


# -- under Serve's wrapper ----------------------------------------------------------------
def _context(config: Any, metrics: dict[str, dict[str, float]], *, current: int, target: int,
             state: dict[str, Any], now: float, queued: float = 0.0) -> Any:  # fmt: skip
    from ray.serve._private.common import DeploymentID
    from ray.serve.config import AutoscalingContext

    return AutoscalingContext(
        deployment_id=DeploymentID(name="engine-chat", app_name="spur"),
        deployment_name="engine-chat",
        app_name="spur",
        current_num_replicas=current,
        target_num_replicas=target,
        running_replicas=[f"r{i}" for i in range(current)],
        total_num_requests=queued,
        total_queued_requests=queued,
        aggregated_metrics=metrics,
        raw_metrics={},
        capacity_adjusted_min_replicas=config.min_replicas,
        capacity_adjusted_max_replicas=config.max_replicas,
        policy_state=state,
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=now,
        config=config,
    )


def _under_serve(
    monkeypatch: pytest.MonkeyPatch, *, max_replicas: int, target: float
) -> tuple[Any, Any, Any, list[float]]:
    """(spur's autoscaling config, Serve's, spur's policy wrapped by Serve's real delay
    and bounds logic, the clock that logic reads: set clock[0] to move it)."""
    import ray.serve.autoscaling_policy as sap
    from ray.serve.config import AutoscalingConfig, AutoscalingPolicy

    from spur.cluster.app import serve_autoscaling_config
    from spur.configs.schema import AutoscalingConfig as SpurAutoscaling

    spur_cfg = SpurAutoscaling(
        min_replicas=1, max_replicas=max_replicas, upscale_delay_s=5, downscale_delay_s=20,
        target_ongoing_requests=target,
    )  # fmt: skip
    options = serve_autoscaling_config(spur_cfg)
    assert options["policy"]["policy_function"] == "spur.cluster.autoscaling:policy"
    config = AutoscalingConfig(
        **{k: v for k, v in options.items() if k != "policy"},
        policy=AutoscalingPolicy(**options["policy"]),
    )
    wrapped = sap._apply_autoscaling_config(config.policy.get_policy())
    clock = [1000.0]
    monkeypatch.setattr(sap.time, "time", lambda: clock[0])
    return spur_cfg, config, wrapped, clock


def test_serve_applies_spurs_delays_to_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    spur_cfg, config, wrapped, clock = _under_serve(monkeypatch, max_replicas=3, target=4)
    busy = {"waiting": {"r0": 6.0}, "running": {"r0": 4.0}, **_targets(spur_cfg, ["r0"])}
    state: dict[str, Any] = {}
    replicas, target = [], 1
    for _ in range(7):  # one decision per second
        ctx = _context(config, busy, current=1, target=target, state=state, now=clock[0])
        n, state = wrapped(ctx)
        replicas.append(target := n)
        clock[0] += 1.0
    assert replicas == [1, 1, 1, 1, 1, 3, 3], "up only after upscale_delay_s of asking"
    assert state["spur"]["reason"] == "demand"
    quiet = {"waiting": {"r0": 0.0, "r1": 0.0, "r2": 0.0}, **_targets(spur_cfg, ["r0", "r1", "r2"])}
    state, downs = {}, []
    for _ in range(22):
        n, state = wrapped(_context(config, quiet, current=3, target=3, state=state, now=clock[0]))
        downs.append(n)
        clock[0] += 1.0
    assert downs[:20] == [3] * 20 and downs[20] == 2, "down one replica after downscale_delay_s"
    # A burst in the middle of the wait restarts it (no flapping).
    state = {}
    for i in range(15):
        metrics = busy if i == 7 else quiet
        cur = 3
        n, state = wrapped(
            _context(config, metrics, current=cur, target=cur, state=state, now=clock[0])
        )
        assert n == 3
        clock[0] += 1.0


def test_a_replica_still_starting_is_not_cancelled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Serve compares the policy's number with its target (running + starting), and
    its context's current_num_replicas counts running replicas only. Returning the
    running count to hold asked to cancel a starting replica once downscale_delay_s
    passed (a model loading longer than that never came up), and with every replica
    restarting (none running, no reports) the lane dropped at once to min_replicas."""
    spur_cfg, config, wrapped, clock = _under_serve(monkeypatch, max_replicas=4, target=8)
    one_waiting = {"waiting": {"r0": 1.0}, "running": {"r0": 3.0}, **_targets(spur_cfg, ["r0"])}
    for metrics, current, target in ((one_waiting, 1, 2), ({}, 2, 3)):
        state: dict[str, Any] = {}
        for _ in range(30):  # longer than downscale_delay_s
            ctx = _context(
                config, metrics, current=current, target=target, state=state, now=clock[0]
            )
            n, state = wrapped(ctx)
            assert n == target, (metrics, current, target, state["spur"])
            clock[0] += 1.0
    clock[0] += 100
    n, state = wrapped(_context(config, {}, current=0, target=3, state={}, now=clock[0]))
    assert (n, state["spur"]["reason"]) == (3, "no_metrics")
    # Once the starting replica runs and the lane is quiet, it scales down as before.
    assert desired_replicas(
        idle(2), current=2, spare_demand=0, targets=Targets(1, 4), target=2
    ) == (Decision(1, "idle", 0.0))


def test_a_replica_that_never_starts_does_not_pin_a_quiet_lane(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While Serve's target exceeded the running replicas, a quiet lane held the target
    forever: a replica that can never be placed (no node left in the pool, a start that
    fails every time) kept the lane at its peak, its running replicas idle. A quiet
    lane now asks for what its demand needs, never fewer than run now; Serve cancels
    the start after downscale_delay_s of that. Under pressure it still holds."""
    assert desired_replicas(
        idle(1), current=1, spare_demand=0, targets=Targets(1, 4), target=2
    ) == (Decision(1, "idle", 0.0))
    spur_cfg, config, wrapped, clock = _under_serve(monkeypatch, max_replicas=4, target=8)
    running = ["r0", "r1", "r2"]
    quiet = {"waiting": dict.fromkeys(running, 0.0), **_targets(spur_cfg, running)}
    state: dict[str, Any] = {}
    seen = []
    for _ in range(21):  # downscale_delay_s is 20
        n, state = wrapped(_context(config, quiet, current=3, target=4, state=state, now=clock[0]))
        seen.append(n)
        clock[0] += 1.0
    assert seen == [4] * 20 + [3], seen


def test_requests_queued_in_serve_are_demand() -> None:
    """Requests Serve holds at the handles (every replica at max_ongoing_requests) were
    not read: with max_ongoing_requests at the engines' batch size, running + waiting
    never passed the target and 400 queued requests left the lane at one replica."""
    full = [ReplicaLoad(waiting=0, running=16, kv_usage=0.6)]
    targets = Targets(1, 4, target_ongoing_requests=16)
    blind = desired_replicas(full, current=1, spare_demand=0, targets=targets)
    assert (blind.replicas, blind.reason) == (1, "hold")
    seen = desired_replicas(full, current=1, spare_demand=0, targets=targets, queued=400)
    assert (seen.replicas, seen.demand) == (4, 416.0)
    # A few queued requests keep a lane from scaling down, as waiting ones do.
    two = [ReplicaLoad(waiting=0, running=1), ReplicaLoad(waiting=0, running=1)]
    assert desired_replicas(two, current=2, spare_demand=0, targets=targets).reason == "idle"
    held = desired_replicas(two, current=2, spare_demand=0, targets=targets, queued=1)
    assert (held.replicas, held.reason) == (2, "hold")
    # Through Serve's context: total_queued_requests reaches the decision.
    from ray.serve.config import AutoscalingConfig

    config = AutoscalingConfig(min_replicas=1, max_replicas=4)
    metrics = {
        "running": {"r0": 16.0},
        "waiting": {"r0": 0.0},
        "target_target_ongoing_requests": {"r0": 16.0},
    }
    ctx = _context(config, metrics, current=1, target=1, state={}, now=0.0, queued=400.0)
    assert policy(ctx)[0] == 4


def _targets(cfg: Any, replicas: list[str]) -> dict[str, dict[str, float]]:
    return {k: dict.fromkeys(replicas, v) for k, v in target_metrics(cfg.model_dump()).items()}


def test_policy_state_reports_the_decision() -> None:
    from ray.serve.config import AutoscalingConfig

    config = AutoscalingConfig(min_replicas=1, max_replicas=2)
    ctx = _context(config, {"waiting": {"r0": 0.0}}, current=1, target=1, state={}, now=0.0)
    n, state = policy(ctx)
    assert n == 1 and state["spur"]["reason"] in ("hold", "bounds")


@pytest.mark.parametrize(("look_back", "interval"), [(12.0, 1.0), (2.0, 1.0), (1.5, 0.75)])
def test_replicas_push_their_stats_every_second(look_back: float, interval: float) -> None:
    """Serve's default push interval is 10 s (the policy then sees stats 6 s old on
    average, up to 11 s; BENCHMARKS.md, "Autoscaling"), and Ray 2.60 reads no
    environment variable for it: the lane's config must carry it, below the window."""
    from ray.serve.config import AutoscalingConfig

    from spur.cluster.app import serve_autoscaling_config
    from spur.configs.schema import AutoscalingConfig as LaneAutoscaling

    lane = LaneAutoscaling(min_replicas=1, max_replicas=2, look_back_period_s=look_back)
    with pytest.warns(DeprecationWarning, match="metrics_interval_s"):
        serve = AutoscalingConfig(**serve_autoscaling_config(lane))
    assert serve.metrics_interval_s == interval < serve.look_back_period_s
