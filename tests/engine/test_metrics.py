"""Engine-side metrics on the real core with the fake executor (pure Python):
token counters equal what the requests produced, histogram counts equal the
requests, capacity truth is 1 for a correct engine and far above 1 (with the
leak counter rising) for the test-only broken retirement."""

from __future__ import annotations

import itertools

from spur.actors.engine.shell.metrics import (
    EngineMetrics,
    Histogram,
    break_retirement,
    build_1_2_5_buckets,
    capacity_view,
    engine_info,
)
from spur.actors.step import SamplingParams

from .helpers import FULL, SLIDING, STATE, make_engine, prompts


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        self.now += 0.01
        return self.now


def drive(core, sched, metrics, token_lists, max_tokens=8, check=True):  # type: ignore[no-untyped-def]
    """Add every prompt (fed to `metrics` as the AsyncEngine does) and step to the end."""
    for i, p in enumerate(token_lists):
        rid = f"r{i}"
        core.add_request(sched.make_request(rid, p, SamplingParams(max_tokens=max_tokens)))
        metrics.on_add(rid, len(p))
    produced: dict[str, int] = {}
    ratios = []
    while core.has_unfinished_requests():
        outputs, stats = core.step()
        metrics.on_step(outputs, stats, sched)
        ratios.extend(g.ratio for g in metrics.capacity)
        for o in outputs:
            produced[o.req_id] = produced.get(o.req_id, 0) + len(o.new_token_ids)
        if check:
            sched.check_integrity()
    return produced, ratios


def test_histogram_buckets_are_cumulative() -> None:
    h = Histogram((1.0, 2.0))
    for v in (0.5, 1.0, 1.5, 3.0):
        h.observe(v)
    d = h.to_dict()
    assert d["cumulative"] == [2, 3, 4] and d["count"] == 4 and d["sum"] == 6.0
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)


def test_counters_and_histograms_match_the_workload() -> None:
    core, sched, _ = make_engine(num_blocks=128, budget=16)
    metrics = EngineMetrics(max_model_len=256, capacity_period_s=0.0, clock=Clock())
    work = prompts(6, 20, shared=8)
    produced, ratios = drive(core, sched, metrics, work, max_tokens=5)
    snap = metrics.snapshot()
    assert snap["counters"]["vllm:prompt_tokens"] == sum(len(p) for p in work)
    assert snap["counters"]["vllm:generation_tokens"] == sum(produced.values()) == 30
    assert snap["request_success"]["length"] == 6
    hist = snap["histograms"]
    for name in (
        "vllm:time_to_first_token_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
        "vllm:request_inference_time_seconds",
        "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens",
        "vllm:request_time_per_output_token_seconds",
    ):
        assert hist[name]["count"] == 6, name
    assert hist["vllm:inter_token_latency_seconds"]["count"] == 6 * 4
    assert hist["vllm:request_generation_tokens"]["sum"] == 30
    assert (
        hist["vllm:iteration_tokens_total"]["sum"]
        == 6 * 20 + 30 - 6 - snap["counters"]["vllm:prefix_cache_hits"]
    )
    assert snap["counters"]["vllm:prefix_cache_queries"] == 6 * 20
    assert snap["counters"]["vllm:prefix_cache_hits"] > 0  # the shared 8-token prefix
    # A correct engine holds exactly what the formula says.
    assert ratios and all(r == 1.0 for r in ratios)
    assert snap["counters"]["spur:kv_leak_violations"] == 0


def test_preemptions_are_counted() -> None:
    core, sched, _ = make_engine(num_blocks=12, budget=64, block_size=4)
    metrics = EngineMetrics(max_model_len=40, clock=Clock())
    drive(core, sched, metrics, prompts(4, 12), max_tokens=16)
    assert metrics.num_preemptions == sched.total_preemptions > 0
    assert metrics.request_success["length"] == 4


def test_sliding_window_ratio_stays_at_most_one() -> None:
    core, sched, _ = make_engine(groups=(SLIDING,), num_blocks=64, budget=8)
    metrics = EngineMetrics(max_model_len=200, capacity_period_s=0.0, clock=Clock())
    _, ratios = drive(core, sched, metrics, prompts(2, 40), max_tokens=20)
    assert ratios and max(ratios) <= 1.0


def test_broken_retirement_shows_as_ratio_and_leak_counter() -> None:
    core, sched, _ = make_engine(num_blocks=256, budget=64, block_size=4)
    break_retirement(sched.kv, 1)
    metrics = EngineMetrics(max_model_len=256, capacity_period_s=0.0, clock=Clock())
    # check=False: the deliberately broken manager still keeps the pool consistent,
    # which check_integrity confirms once at the end.
    _, ratios = drive(core, sched, metrics, prompts(2, 8), max_tokens=24, check=False)
    sched.check_integrity()
    assert max(ratios) > 2.0
    assert max(metrics.peak_ratio) >= max(ratios)  # the worst single request
    assert metrics.leak_violations == 2  # each request flagged once
    assert sched.kv.pool.num_free_blocks == 255  # everything came back


def test_a_short_leak_reaches_the_next_report() -> None:
    """`worst_ratio` is the worst request's ratio over every capacity sample since the
    last snapshot: a leak that is over before the report still shows in it (the
    latest sample alone would miss it), and the next report starts a new window."""
    core, sched, _ = make_engine(num_blocks=256, budget=64, block_size=4)
    break_retirement(sched.kv, 1)
    metrics = EngineMetrics(max_model_len=256, capacity_period_s=0.0, clock=Clock())
    _, ratios = drive(core, sched, metrics, prompts(2, 8), max_tokens=24, check=False)
    assert max(ratios) > 2.0 and not sched.running  # over: the latest sample is idle
    # worst_ratio and peak_ratio follow the worst single request, `ratios` the group
    (g,) = metrics.snapshot()["capacity"]
    assert g["worst_ratio"] == g["peak_ratio"] >= max(ratios) > 2.0
    lost = metrics.snapshot()  # a new window, with no sample in it
    (g,) = lost["capacity"]
    assert g["worst_ratio"] == metrics.capacity[0].worst < 2.0
    assert g["peak_ratio"] > 2.0  # the peak stays
    # a report that did not arrive gives its window back to the next one
    first = {"capacity": [{"worst_ratio": 2.5}]}
    metrics.restore_window(first)
    (g,) = metrics.snapshot()["capacity"]
    assert g["worst_ratio"] == 2.5


def test_a_leak_between_two_capacity_samples_reaches_the_peak() -> None:
    """The capacity view is sampled (every 0.25 s served): a leak that begins and ends
    between two samples still reaches the peak and the report's worst ratio, from the
    leak detector, which checks every scheduled request at every step. Here the only
    samples are the first step's and the idle end's, both under 2."""
    core, sched, _ = make_engine(num_blocks=256, budget=64, block_size=4)
    break_retirement(sched.kv, 1)
    metrics = EngineMetrics(max_model_len=256, capacity_period_s=1e9, clock=Clock())
    _, ratios = drive(core, sched, metrics, prompts(2, 8), max_tokens=24, check=False)
    assert ratios and max(ratios) < 2.0  # what the samples saw
    (g,) = metrics.snapshot()["capacity"]
    assert g["peak_ratio"] > 2.0 and g["worst_ratio"] > 2.0
    assert metrics.leak_violations == 2
    (g,) = metrics.snapshot()["capacity"]  # a new window: no step since
    assert g["worst_ratio"] < 2.0 and g["peak_ratio"] > 2.0


def test_capacity_view_and_info() -> None:
    core, sched, _ = make_engine(num_blocks=65, block_size=4, max_model_len=64)
    req = sched.make_request("a", list(range(10)), SamplingParams(max_tokens=4))
    core.add_request(req)
    core.step()
    (g,) = capacity_view(sched.kv, sched.running)
    assert (g.kind, g.held, g.geometry) == ("full", 3, 3)
    info = engine_info(sched.kv.config, sched.config, None)
    assert info["claimed_max_concurrency"] == 64 // 16
    assert info["pool_tokens"] == 64 * 4
    assert info["cache_config"]["num_gpu_blocks"] == "65"
    assert set(info["cache_config"]) >= {"block_size", "cache_dtype", "enable_prefix_caching"}
    assert list(itertools.islice(info["groups"], 1)) == ["full"]


def test_state_groups_are_reported_per_group() -> None:
    """A hybrid pool (full attention + state): one gauge set per group, and the
    state group holds at most its 2 blocks per request (ratio <= 1) even with
    chunked prefill over several blocks."""
    core, sched, _ = make_engine(groups=(FULL, STATE), num_blocks=256, budget=8, block_size=4)
    metrics = EngineMetrics(max_model_len=128, capacity_period_s=0.0, clock=Clock())
    _, _ = drive(core, sched, metrics, prompts(3, 30), max_tokens=12)
    snap = metrics.snapshot()
    assert [g["kind"] for g in snap["capacity"]] == ["full", "state"]
    assert all(g["peak_ratio"] <= 1.0 for g in snap["capacity"])
    assert metrics.leak_violations == 0
    # the pool's tokens: one request alone keeps 2 state blocks, 253 hold its context
    info = engine_info(sched.kv.config, sched.config, None)
    assert info["pool_tokens"] == (255 - 2) * 4


# -- request phases and counts as vLLM defines them ------------------------------------------
class StepClock:
    """A clock that only the forward moves: each forward takes `step_s`."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_timed(core, sched, fake, metrics, clock, step_s=0.5):  # type: ignore[no-untyped-def]
    """Step to the end as the AsyncEngine does (the clock read before each step)."""
    forward = fake.execute_model

    def slow(out):  # type: ignore[no-untyped-def]
        clock.now += step_s
        return forward(out)

    fake.execute_model = slow
    while core.has_unfinished_requests():
        started = clock()
        outs, stats = core.step()
        metrics.on_step(outs, stats, sched, started=started)


def test_prefill_is_the_first_forward_and_not_queue_time():
    clock = StepClock()
    core, sched, fake = make_engine(num_blocks=128, budget=64)
    metrics = EngineMetrics(max_model_len=256, clock=clock)
    core.add_request(sched.make_request("a", list(range(20)), SamplingParams(max_tokens=4)))
    metrics.on_add("a", 20, arrival=0.0)
    run_timed(core, sched, fake, metrics, clock)
    h = metrics.snapshot()["histograms"]
    sums = {k.split(":")[1]: h[k]["sum"] for k in h if h[k]["count"]}
    assert sums["request_queue_time_seconds"] == 0.0  # scheduled at once
    assert sums["request_prefill_time_seconds"] == 0.5  # its one prefill forward
    assert sums["time_to_first_token_seconds"] == 0.5
    assert sums["request_decode_time_seconds"] == 1.5
    assert sums["request_inference_time_seconds"] == sums["e2e_request_latency_seconds"] == 2.0


def test_a_request_that_ends_at_its_first_token_spent_its_step_in_prefill():
    """max_tokens 1: scheduled and finished in one step, it is never seen running after
    a step, and its prefill forward was counted as queue time (0.5 s queued, 0 s of
    prefill). vLLM stamps it scheduled when it is scheduled: queue 0, prefill 0.5 s."""
    clock = StepClock()
    core, sched, fake = make_engine(num_blocks=128, budget=64)
    metrics = EngineMetrics(max_model_len=256, clock=clock)
    core.add_request(sched.make_request("a", list(range(20)), SamplingParams(max_tokens=1)))
    metrics.on_add("a", 20, arrival=0.0)
    run_timed(core, sched, fake, metrics, clock)
    h = metrics.snapshot()["histograms"]
    assert h["vllm:request_queue_time_seconds"]["sum"] == 0.0
    assert h["vllm:request_prefill_time_seconds"]["sum"] == 0.5
    assert h["vllm:request_prefill_time_seconds"]["count"] == 1
    # No decode: its time per output token is observed as 0, as vLLM observes it.
    tpot = h["vllm:request_time_per_output_token_seconds"]
    assert tpot["count"] == 1 and tpot["sum"] == 0.0


def test_the_completions_of_an_n_request_share_its_prefill_not_queue():
    """n = 3, a 40-token prompt and a budget of 8: the parent prefills over five steps,
    then forks, and its completions run the last step with it. They were stamped
    scheduled when first seen running, so the parent's 2.5 s of prefill showed as their
    queue time; vLLM schedules the three together (queue 0, prefill 3.0 s each)."""
    clock = StepClock()
    core, sched, fake = make_engine(num_blocks=128, budget=8)
    metrics = EngineMetrics(max_model_len=256, clock=clock)
    params = SamplingParams(max_tokens=3, n=3, ignore_eos=True)
    core.add_request(sched.make_request("a", list(range(40)), params))
    metrics.on_add("a", 40, n=3, arrival=0.0)
    run_timed(core, sched, fake, metrics, clock)
    h = metrics.snapshot()["histograms"]
    assert h["vllm:request_queue_time_seconds"]["count"] == 3
    assert h["vllm:request_queue_time_seconds"]["sum"] == 0.0
    assert h["vllm:request_prefill_time_seconds"]["sum"] == 3 * 3.0


def test_a_completion_that_waited_for_a_seat_was_queued():
    """max_num_seqs 1: completion 1 cannot be seated when its parent forks; it waits
    until the parent ends (1.5 s: the parent's prefill of 16 tokens, then its last
    prompt token with its first token, then its second token), and that wait is its
    queue time (the parent's own is 0)."""
    clock = StepClock()
    core, sched, fake = make_engine(num_blocks=128, budget=64, max_num_seqs=1)
    params = SamplingParams(max_tokens=2, n=2, ignore_eos=True)
    core.add_request(sched.make_request("a", list(range(17)), params))
    metrics = EngineMetrics(max_model_len=256, clock=clock)
    metrics.on_add("a", 17, n=2, arrival=0.0)
    run_timed(core, sched, fake, metrics, clock)
    h = metrics.snapshot()["histograms"]
    assert h["vllm:request_queue_time_seconds"]["count"] == 2
    assert h["vllm:request_queue_time_seconds"]["sum"] == 1.5


def test_each_completion_of_an_n_request_is_a_request():
    clock = StepClock()
    core, sched, fake = make_engine(num_blocks=128, budget=64)
    metrics = EngineMetrics(max_model_len=256, clock=clock)
    params = SamplingParams(max_tokens=5, n=3, ignore_eos=True)
    core.add_request(sched.make_request("a", list(range(20)), params))
    metrics.on_add("a", 20, n=3, arrival=0.0)
    run_timed(core, sched, fake, metrics, clock)
    snap = metrics.snapshot()
    h = snap["histograms"]
    assert snap["request_success"]["length"] == 3
    assert h["vllm:request_generation_tokens"]["sum"] == snap["counters"]["vllm:generation_tokens"]
    assert h["vllm:time_to_first_token_seconds"]["count"] == 3
    assert h["vllm:e2e_request_latency_seconds"]["count"] == 3
    assert metrics._requests == {} and metrics._open == {}


def test_an_abort_ends_every_completion_of_the_request():
    core, sched, _fake = make_engine(num_blocks=128, budget=64)
    metrics = EngineMetrics(max_model_len=256, clock=Clock())
    params = SamplingParams(max_tokens=50, n=2, ignore_eos=True)
    core.add_request(sched.make_request("a", list(range(20)), params))
    metrics.on_add("a", 20, n=2)
    for _ in range(3):
        outs, stats = core.step()
        metrics.on_step(outs, stats, sched)
    sched.abort_requests("a")
    metrics.on_abort("a")
    metrics.refresh_gauges(sched)
    snap = metrics.snapshot()
    assert snap["request_success"]["abort"] == 2
    assert snap["gauges"]["vllm:num_requests_running"] == 0  # no step follows an abort
    assert snap["gauges"]["vllm:kv_cache_usage_perc"] == 0.0
    assert metrics._requests == {} and metrics._open == {}


def test_inter_token_latency_is_one_observation_per_step():
    """Accepted drafts bring several tokens in one step: vLLM records one ITL, the
    step's, not one share per token (which would look several times faster)."""
    clock = StepClock()
    core, sched, fake = make_engine(num_blocks=128, budget=64)
    metrics = EngineMetrics(max_model_len=256, clock=clock)
    core.add_request(sched.make_request("a", list(range(20)), SamplingParams(max_tokens=10)))
    metrics.on_add("a", 20, arrival=0.0)
    forward = fake.execute_model

    def two_tokens_a_step(out):  # type: ignore[no-untyped-def]
        res = forward(out)
        for rid, toks in res.sampled_token_ids.items():
            if toks and sched.requests[rid].num_output_tokens:
                res.sampled_token_ids[rid] = [*toks, 5]  # as if a draft was accepted
        return res

    fake.execute_model = two_tokens_a_step
    run_timed(core, sched, fake, metrics, clock)
    itl = metrics.snapshot()["histograms"]["vllm:inter_token_latency_seconds"]
    assert itl["count"] >= 1 and itl["sum"] == 0.5 * itl["count"]


def test_prefix_lookups_count_once_per_request():
    """A request that waits at the head of the queue for blocks, or comes back after a
    preemption, is one query of its prompt (vllm:prefix_cache_queries)."""
    core, sched, _fake = make_engine(num_blocks=10, block_size=4, budget=64, max_model_len=36)
    metrics = EngineMetrics(max_model_len=36, clock=Clock())
    ps = prompts(4, 12, seed=3)
    for i, p in enumerate(ps):
        params = SamplingParams(max_tokens=20, ignore_eos=True)
        core.add_request(sched.make_request(f"r{i}", p, params))
        metrics.on_add(f"r{i}", len(p))
    while core.has_unfinished_requests():
        outs, stats = core.step()
        metrics.on_step(outs, stats, sched)
    counters = metrics.snapshot()["counters"]
    assert counters["vllm:num_preemptions"] > 0  # the pool was tight
    assert counters["vllm:prefix_cache_queries"] == sum(len(p) for p in ps)
