"""n-gram speculative decoding in the engine core (pure Python, fake executor).

The fake executor verifies drafts greedily against its own model and writes the
drafts' KV into its simulated cache, so a rollback that went wrong (a rejected
draft's slot read as if it were computed) raises KVCorruption.
"""

from __future__ import annotations

import pytest

from spur.actors.cache_spec import cdiv
from spur.actors.engine.core.engine_core import EngineCore
from spur.actors.engine.core.fake_executor import FakeExecutor
from spur.actors.engine.core.kv_cache_manager import KVCacheConfig
from spur.actors.engine.core.scheduler import Scheduler, SchedulerConfig
from spur.actors.engine.core.spec_decode import (
    NgramIndex,
    NgramProposer,
    SpeculativeConfig,
    accepted_prefix,
    can_draft,
)
from spur.actors.step import SamplingParams
from tests.engine.helpers import FULL, SLIDING, STATE, assert_all_free

K = 4


# -- the proposer ------------------------------------------------------------------------
def test_ngram_takes_the_longest_suffix_then_the_latest_occurrence():
    index = NgramIndex(1, 3)
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 1, 5, 6, 8, 2, 5, 6]
    # "5 6" ends at 2 and 6; the latest (6) wins: drafts follow it.
    assert index.propose(tokens, 3) == [8, 2, 5]
    tokens = [1, 2, 3, 9, 2, 3, 7, 0, 1, 2, 3]
    # "1 2 3" (n=3) recurs at 3 and beats the later "2 3" (n=2, end 6).
    assert NgramIndex(1, 3).propose(tokens, 2) == [9, 2]


def test_ngram_drafts_continue_a_repeat_and_never_match_the_suffix_itself():
    """An occurrence ending less than k tokens before the end is a repeat: the draft
    goes on with its period, k tokens (vLLM's earliest match gives k there too)."""
    index = NgramIndex(2, 2)
    assert index.propose([1, 2, 3], 4) == []  # "2 3" occurs only as the suffix
    tokens = [1, 2, 1, 2]
    assert index.propose(tokens, 5) == [1, 2, 1, 2, 1]  # follows the end at 2: period 2
    tokens += [1]  # the index grows incrementally
    assert index.propose(tokens, 5) == [2, 1, 2, 1, 2]
    assert NgramIndex(3, 4).propose([1, 2, 1, 2], 5) == []  # below min_n
    assert NgramIndex(1, 3).propose([4] + [7] * 9, 4) == [7, 7, 7, 7]  # a one-token loop


def test_who_may_draft():
    assert can_draft(SamplingParams(temperature=0.7, top_p=0.9), 0)
    assert not can_draft(SamplingParams(repetition_penalty=1.1), 5)
    assert not can_draft(SamplingParams(presence_penalty=0.5), 5)
    assert not can_draft(SamplingParams(logprobs=0), 5)
    assert not can_draft(SamplingParams(min_tokens=3), 2)
    assert can_draft(SamplingParams(min_tokens=3), 3)
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1))
    tokens = [1, 2, 3, 4, 5, 1]
    assert proposer.propose("a", tokens, SamplingParams(), 0, max_new=10) == [2, 3, 4]
    assert proposer.propose("a", tokens, SamplingParams(), 0, max_new=3) == [2, 3]
    assert proposer.propose("b", tokens, SamplingParams(), 0, max_new=1) == []
    assert len(proposer) == 1
    proposer.drop("a")
    assert len(proposer) == 0
    assert accepted_prefix([4, 5, 6], [4, 5, 7, 8]) == 2
    assert accepted_prefix([4], [3, 1]) == 0


def test_config_errors_name_the_fix():
    with pytest.raises(ValueError, match="must be >= 1"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="min <= max"):
        SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=4, prompt_lookup_max=3)
    with pytest.raises(ValueError, match="unknown"):
        SpeculativeConfig(num_speculative_tokens=2, method="eagle")
    with pytest.raises(ValueError, match="None: draft at any batch size"):
        SpeculativeConfig(num_speculative_tokens=2, disable_by_batch_size=0)


def test_state_group_models_refuse_speculation():
    kv = KVCacheConfig(block_size=4, num_blocks=64, groups=(FULL, STATE))
    with pytest.raises(ValueError, match=r"cannot be rolled back.*unset engine.speculative"):
        Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=2048,
                max_num_seqs=16,
                max_model_len=64,
                long_prefill_token_threshold=0,
                policy="fcfs",
                check_kv_bounds=True,
                speculative=SpeculativeConfig(K),
            ),
            kv,
        )


# -- the engine loop ---------------------------------------------------------------------
CYCLE = 40


def model(tokens: list[int]) -> int:
    """Prompts starting with 0 continue a 40-token cycle (every draft of a
    repeating cycle is right); others follow a rule that depends on the length,
    so n-gram drafts from their history are often wrong."""
    if tokens[0] == 0:
        return (tokens[-1] + 1) % CYCLE
    return (tokens[-1] * 7 + tokens[-2] + len(tokens) // 3) % 97 + 100


def make(
    spec: bool,
    *,
    num_blocks: int = 128,
    groups=(FULL,),
    budget: int = 64,
    max_len: int = 160,
    disable_by_batch_size: int | None = None,
) -> tuple[EngineCore, Scheduler]:
    kv = KVCacheConfig(block_size=4, num_blocks=num_blocks, groups=groups)
    sched = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=16,
            max_model_len=max_len,
            long_prefill_token_threshold=0,
            policy="fcfs",
            check_kv_bounds=True,
            speculative=SpeculativeConfig(
                K,
                prompt_lookup_min=1,
                prompt_lookup_max=3,
                disable_by_batch_size=disable_by_batch_size,
            )
            if spec
            else None,
        ),
        kv,
    )
    return EngineCore(sched, FakeExecutor(kv, vocab_size=1000, model=model)), sched


PROMPTS = [
    list(range(CYCLE)) + list(range(10)),  # heavy drafter: all drafts right
    [0, *range(20, 30)],  # cycles only after 40 tokens: drafts start late
    [5, 9, 100, 101, 102, 100, 101],  # drafts, mostly wrong
    [7, 3],  # next to no history
]


def run(core: EngineCore, sched: Scheduler, max_tokens: int = 60) -> tuple[dict, dict, dict]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    for i, p in enumerate(PROMPTS):
        core.add_request(sched.make_request(f"r{i}", p, params))
    out: dict[str, list[int]] = {}
    counts: dict[str, tuple[int, int]] = {}
    steps: dict[str, int] = {}  # steps that gave the request tokens
    while core.has_unfinished_requests():
        outputs, _ = core.step()
        sched.check_integrity()
        for req in sched.running:  # held blocks never exceed tokens + drafts
            bound = cdiv(req.num_tokens + K, sched.block_size)
            assert sum(sched.kv.num_held(req.request_id)) <= bound * len(sched.kv.managers)
        for o in outputs:
            out.setdefault(o.req_id, []).extend(o.new_token_ids)
            counts[o.req_id] = (o.num_draft_tokens, o.num_accepted_tokens)
            steps[o.req_id] = steps.get(o.req_id, 0) + 1
    assert_all_free(sched)
    assert sched.kv.leaks.num_violations == 0
    return out, counts, steps


@pytest.mark.parametrize(
    ("label", "kwargs"),
    [
        ("roomy", {}),
        ("small budget cuts drafts", {"budget": 6}),
        ("preemption", {"num_blocks": 31, "max_len": 120}),
        ("sliding window", {"groups": (FULL, SLIDING)}),
    ],
)
def test_greedy_output_is_identical_and_rollback_leaves_no_leak(label, kwargs):
    plain, counts0, steps0 = run(*make(False, **kwargs))
    core, sched = make(True, **kwargs)
    spec, counts, steps = run(core, sched)
    assert spec == plain
    assert all(len(v) == 60 for v in spec.values())
    assert counts0 == {f"r{i}": (0, 0) for i in range(4)}
    drafted, accepted = counts["r0"]
    assert drafted > 0 and accepted >= 0.9 * drafted  # the cycle: nearly all kept
    assert counts["r2"][0] > counts["r2"][1]  # some drafts rejected: rollback ran
    stats = sched.spec_stats
    assert stats.num_draft_tokens == sum(d for d, _ in counts.values())
    assert stats.num_accepted_tokens == sum(a for _, a in counts.values())
    if label == "preemption":
        assert sched.total_preemptions > 0
    if label == "roomy":  # the cycle needs far fewer steps; the one without history not
        assert steps["r0"] < steps0["r0"] * 0.4
        assert steps["r3"] == steps0["r3"] == 60


def test_no_drafts_while_the_batch_is_at_disable_by_batch_size():
    """Four requests run together until the shortest ends: with the limit at 4 nobody
    drafts then; once fewer run, the heavy drafter drafts again. Output unchanged."""
    plain, _, _ = run(*make(False, budget=128))
    core, sched = make(True, budget=128, disable_by_batch_size=4)  # all four prefill at once
    params = [SamplingParams(max_tokens=n, temperature=0) for n in (60, 60, 60, 10)]
    for i, (p, sp) in enumerate(zip(PROMPTS, params, strict=True)):
        core.add_request(sched.make_request(f"r{i}", p, sp))
    drafts_at: dict[int, int] = {}  # running requests at a step -> drafts verified in it
    out: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        n = len(sched.running) + len(sched.waiting)
        outputs, stats = core.step()
        sched.check_integrity()
        drafts_at[n] = drafts_at.get(n, 0) + stats.spec_num_draft_tokens
        for o in outputs:
            out.setdefault(o.req_id, []).extend(o.new_token_ids)
    assert drafts_at[4] == 0, drafts_at  # four running: no drafts verified
    assert sum(v for k, v in drafts_at.items() if k < 4) > 0  # fewer: drafting again
    assert all(out[f"r{i}"] == plain[f"r{i}"] for i in range(3))
    assert out["r3"] == plain["r3"][:10]
    assert_all_free(sched)


def test_step_stats_count_each_verify_step_once():
    core, sched = make(True)
    params = SamplingParams(max_tokens=30, temperature=0)
    core.add_request(sched.make_request("a", PROMPTS[0], params))
    totals = [0, 0, 0]
    while core.has_unfinished_requests():
        _, stats = core.step()
        totals[0] += stats.spec_num_drafts
        totals[1] += stats.spec_num_draft_tokens
        totals[2] += stats.spec_num_accepted_tokens
    s = sched.spec_stats
    assert totals == [s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens]
    assert s.num_drafts > 0 and s.accepted_per_pos[0] == s.num_drafts
    # Never drafts past max_tokens: every verify step could be kept in full.
    assert s.num_accepted_tokens + s.num_drafts <= 30


def test_metrics_count_drafts_and_render_under_vllms_names():
    from prometheus_client.parser import text_string_to_metric_families

    from spur.actors.engine.shell.metrics import EngineMetrics
    from spur.cluster.metrics import MetricsStore, render
    from spur.configs.loader import config_to_dict, parse_config

    core, sched = make(True)
    metrics = EngineMetrics(max_model_len=160)
    params = SamplingParams(max_tokens=40, temperature=0)
    for i, p in enumerate(PROMPTS):
        core.add_request(sched.make_request(f"r{i}", p, params))
        metrics.on_add(f"r{i}", len(p))
    generated = 0
    while core.has_unfinished_requests():
        outputs, stats = core.step()
        metrics.on_step(outputs, stats, sched)
        generated += sum(len(o.new_token_ids) for o in outputs)
    s = sched.spec_stats
    counters = metrics.snapshot()["counters"]
    assert counters["vllm:spec_decode_num_drafts"] == s.num_drafts > 0
    assert counters["vllm:spec_decode_num_draft_tokens"] == s.num_draft_tokens
    assert counters["vllm:spec_decode_num_accepted_tokens"] == s.num_accepted_tokens > 0
    assert counters["vllm:generation_tokens"] == generated == 4 * 40

    config = config_to_dict(parse_config({"version": 1, "lanes": [{"name": "chat"}]}))
    store = MetricsStore()
    store.update_engine("r1", "chat", metrics.snapshot())
    text = render({"store": store.view()}, config).decode()
    found = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    assert found["vllm:spec_decode_num_draft_tokens_total"] == s.num_draft_tokens
    assert found["vllm:spec_decode_num_accepted_tokens_total"] == s.num_accepted_tokens
    assert found["vllm:spec_decode_num_drafts_total"] == s.num_drafts


def test_drafts_never_preempt_a_request_whose_real_token_fits():
    """A request's drafts took slots like real tokens: with the pool full, a request
    whose next real token fitted its block preempted the last admitted one (here one
    token from its end) to make room for drafts that were then all rejected. It now
    runs without its drafts when only they do not fit."""

    def rejecting(tokens: list[int]) -> int:
        if tokens[:3] == [1, 2, 3] and len(tokens) == 9:
            return 1  # A continues its pattern: drafts 2 3 1 2 follow ...
        return 90 + len(tokens) % 7  # ... and are all rejected

    results = []
    for spec in (False, True):
        kv = KVCacheConfig(block_size=4, num_blocks=6, groups=(FULL,))  # 5 usable blocks
        spec_cfg = SpeculativeConfig(4, prompt_lookup_min=1, prompt_lookup_max=3)
        sched = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=64,
                max_num_seqs=4,
                max_model_len=20,
                long_prefill_token_threshold=0,
                policy="fcfs",
                check_kv_bounds=True,
                speculative=spec_cfg if spec else None,
            ),
            kv,
        )
        core = EngineCore(sched, FakeExecutor(kv, vocab_size=1000, model=rejecting))
        greedy = SamplingParams(max_tokens=8, temperature=0)
        core.add_request(sched.make_request("A", [1, 2, 3] * 3, greedy))
        core.add_request(
            sched.make_request(
                "B", list(range(11, 18)), SamplingParams(max_tokens=2, temperature=0)
            )
        )
        out: dict[str, list[int]] = {}
        while core.has_unfinished_requests():
            for o in core.step()[0]:
                out.setdefault(o.req_id, []).extend(o.new_token_ids)
            sched.check_integrity()
        assert_all_free(sched)
        results.append((out, sched.total_preemptions))
    assert results[1] == results[0] and results[1][1] == 0


def test_drafts_leave_one_token_of_the_budget_for_every_later_running_request():
    """Running requests are served in admission order, each taking 1 + k tokens: under
    a small budget the first ones' drafts used it all, and the last running request got
    no token for ten steps in a row. Drafts now leave one token for each request after."""
    core, sched = make(True, budget=8)
    params = SamplingParams(max_tokens=40, temperature=0)
    for i in range(3):  # three heavy drafters (the cycle: every draft right)
        core.add_request(sched.make_request(f"r{i}", [*range(CYCLE), i], params))
    while len(sched.running) < 3 or any(r.num_computed_tokens == 0 for r in sched.running):
        core.step()
    idle = dict.fromkeys(("r0", "r1", "r2"), 0)
    worst = 0
    while core.has_unfinished_requests():
        outputs, _ = core.step()
        served = {o.req_id for o in outputs if o.new_token_ids}
        for rid in idle:
            if any(r.request_id == rid for r in sched.running) or rid in served:
                idle[rid] = 0 if rid in served else idle[rid] + 1
                worst = max(worst, idle[rid])
        sched.check_integrity()
    assert worst == 0, idle
    assert sched.spec_stats.num_accepted_tokens > 0  # drafting went on
    assert_all_free(sched)


def test_one_requests_drafts_never_preempt_another_request():
    """A's drafts took the pool's last free block (its own allocation succeeded), so B's
    real decode token no longer fitted and B was preempted, a full recompute for drafts
    that are optional work. Real tokens are now all placed before any draft."""
    results = []
    for spec in (False, True):
        kv = KVCacheConfig(block_size=4, num_blocks=6, groups=(FULL,))  # 5 usable blocks
        spec_cfg = SpeculativeConfig(
            3, prompt_lookup_min=1, prompt_lookup_max=2, disable_by_batch_size=None
        )
        sched = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=32,
                max_num_seqs=4,
                max_model_len=20,
                long_prefill_token_threshold=0,
                policy="fcfs",
                check_kv_bounds=True,
                speculative=spec_cfg if spec else None,
            ),
            kv,
        )
        core = EngineCore(sched, FakeExecutor(kv, vocab_size=100, model=lambda t: 5))
        # Without drafts B (8 + 2 tokens) takes the last free block at its first decode
        # and ends before A (5 + 5 tokens) needs a third block: nobody is preempted.
        a_params = SamplingParams(max_tokens=5, ignore_eos=True)
        b_params = SamplingParams(max_tokens=2, ignore_eos=True)
        core.add_request(sched.make_request("A", [5] * 5, a_params))  # drafts 5 5 5
        core.add_request(sched.make_request("B", list(range(10, 18)), b_params))
        out: dict[str, list[int]] = {}
        while core.has_unfinished_requests():
            for o in core.step()[0]:
                out.setdefault(o.req_id, []).extend(o.new_token_ids)
            sched.check_integrity()
        assert_all_free(sched)
        results.append((out, sched.total_preemptions))
    assert results[1] == results[0] and results[1][1] == 0
