"""Scheduler: budgets, chunking, prefix hits, preemption, finish reasons, outputs."""

from __future__ import annotations

from typing import Any

import pytest

from spur.actors.engine.core.kv_cache_manager import KVCacheConfig
from spur.actors.engine.core.request import RequestStatus
from spur.actors.engine.core.scheduler import RequestRejected, Scheduler, SchedulerConfig
from spur.actors.step import ModelRunnerOutput, SamplingParams

from .helpers import FULL, SLIDING, STATE, assert_all_free, make_engine, prompts, run_all


def add(sched: Scheduler, rid: str, tokens: list[int], **params) -> None:
    sched.add_request(sched.make_request(rid, tokens, SamplingParams(**params)))


def fake_output(out, token: int = 7) -> ModelRunnerOutput:
    """A hand-built runner output: one token for each request whose scheduled
    tokens reach the end of what it knows."""
    return ModelRunnerOutput({rid: [token] for rid in out.num_scheduled_tokens})


def test_budget_chunks_prefill_and_running_go_first():
    _, sched, _ = make_engine(budget=10, block_size=4)
    add(sched, "a", list(range(25)), max_tokens=3)
    add(sched, "b", list(range(100, 104)), max_tokens=3)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 10}  # b waits: budget spent
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 10}
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"a": 5, "b": 4}
    assert [r.request_id for r in sched.running] == ["a", "b"]


def test_long_prefill_threshold_and_max_num_seqs():
    _, sched, _ = make_engine(budget=64, threshold=6, max_num_seqs=2, block_size=4)
    for i in range(3):
        add(sched, f"r{i}", list(range(i * 50, i * 50 + 20)))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"r0": 6, "r1": 6}  # r2: max_num_seqs
    assert len(sched.waiting) == 1


def test_prefix_hit_skips_computed_tokens():
    core, sched, _ = make_engine(budget=64, block_size=4)
    shared = list(range(16))
    add(sched, "a", [*shared, 50, 51], max_tokens=1)
    core.step()
    add(sched, "b", [*shared, 60, 61, 62], max_tokens=1)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"b": 3}
    (new,) = out.scheduled_new_reqs
    assert new.num_computed_tokens == 16
    assert sched.requests["b"].num_cached_tokens == 16


def test_outputs_send_new_requests_in_full_then_diffs():
    _, sched, fake = make_engine(budget=6, block_size=4)
    add(sched, "a", list(range(10)), max_tokens=5)
    out1 = sched.schedule()
    assert [n.req_id for n in out1.scheduled_new_reqs] == ["a"]
    assert out1.scheduled_new_reqs[0].block_ids == [[1, 2]]
    sched.update_from_output(out1, fake.execute_model(out1))
    out2 = sched.schedule()  # the rest of the prompt: 4 tokens, one new block
    assert not out2.scheduled_new_reqs
    cached = out2.scheduled_cached_reqs
    assert cached.req_ids == ["a"] and cached.new_block_ids == [[[3]]]
    assert cached.num_computed_tokens == [6] and cached.new_token_ids == [[]]
    res = fake.execute_model(out2)
    (o,) = sched.update_from_output(out2, res)
    out3 = sched.schedule()
    assert out3.scheduled_cached_reqs.new_token_ids == [o.new_token_ids]
    assert out3.scheduled_cached_reqs.new_block_ids == [None]


def test_finish_reasons_stop_length_and_stop_token():
    _, sched, _ = make_engine()
    add(sched, "eos", [1, 2, 3], max_tokens=5)
    sched.requests["eos"].eos_token_id = 7
    add(sched, "len", [4, 5, 6], max_tokens=2)
    add(sched, "tok", [7, 8, 9], max_tokens=5, stop_token_ids=[7])
    add(sched, "min", [1, 1, 1], max_tokens=5, min_tokens=2, stop_token_ids=[7])
    finished = {}
    for _ in range(5):
        out = sched.schedule()
        for o in sched.update_from_output(out, fake_output(out)):
            if o.finished:
                finished[o.req_id] = (o.finish_reason, o.stop_reason, len(o.new_token_ids))
    assert finished["eos"] == ("stop", None, 1)
    assert finished["tok"] == ("stop", 7, 1)
    assert finished["len"][0] == "length"
    assert finished["min"][0] == "stop"  # only once 2 tokens exist
    assert_all_free(sched)


def test_abort_frees_blocks_at_once_and_tells_the_worker():
    _, sched, fake = make_engine(block_size=4)
    add(sched, "a", list(range(12)), max_tokens=50)
    out = sched.schedule()
    sched.update_from_output(out, fake.execute_model(out))
    assert sched.kv.num_free_blocks < 63
    (final,) = sched.abort_requests("a")
    assert final.finish_reason == "abort"
    assert sched.kv.num_free_blocks == 63
    assert sched.schedule().finished_req_ids == {"a"}
    assert sched.abort_requests(["a", "nope"]) == []  # unknown ids are ignored
    assert_all_free(sched)


def test_rejects_prompts_that_can_never_run():
    _, sched, _ = make_engine(max_model_len=64)
    with pytest.raises(RequestRejected, match="prompt has 64 tokens, max_model_len is 64"):
        add(sched, "a", list(range(64)))
    with pytest.raises(ValueError, match="needs 64"):
        Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=2048,
                max_num_seqs=16,
                max_model_len=256,
                long_prefill_token_threshold=0,
                policy="fcfs",
                check_kv_bounds=True,
            ),
            KVCacheConfig(block_size=4, num_blocks=10),
        )
    add(sched, "ok", list(range(10)))
    with pytest.raises(RequestRejected, match="already in use"):
        add(sched, "ok", list(range(10)))
    # "a#1" is the id a fork of an n > 1 request "a" takes: it would be overwritten.
    with pytest.raises(RequestRejected, match="contains '#'"):
        add(sched, "a#1", list(range(10)))


def test_fcfs_preempts_the_most_recently_admitted():
    _, sched, fake = make_engine(num_blocks=9, block_size=4, budget=64)  # 8 usable
    add(sched, "old", list(range(12)), max_tokens=20)  # 3 blocks, then grows
    add(sched, "new", list(range(100, 116)), max_tokens=20)  # 4 blocks (+1 at decode)
    out = sched.schedule()
    sched.update_from_output(out, fake.execute_model(out))
    preempted = None
    for _ in range(10):
        out = sched.schedule()
        if out.preempted_req_ids or sched.total_preemptions:
            preempted = sched.waiting.peek()
            break
        sched.update_from_output(out, fake.execute_model(out))
    assert preempted is not None and preempted.request_id == "new"
    assert preempted.status == RequestStatus.PREEMPTED and preempted.num_computed_tokens == 0
    assert sched.kv.num_held("new") == [0]
    sched.check_integrity()


def test_priority_policy_preempts_the_lowest_priority():
    _, sched, fake = make_engine(num_blocks=9, block_size=4, budget=64, policy="priority")
    sched.add_request(
        sched.make_request("low", list(range(12)), SamplingParams(max_tokens=20), priority=5)
    )
    sched.add_request(
        sched.make_request("high", list(range(50, 66)), SamplingParams(max_tokens=20), priority=0)
    )
    out = sched.schedule()
    assert set(out.num_scheduled_tokens) == {"low", "high"}
    sched.update_from_output(out, fake.execute_model(out))
    for _ in range(10):
        out = sched.schedule()
        if sched.total_preemptions:
            break
        sched.update_from_output(out, fake.execute_model(out))
    assert sched.waiting.peek().request_id == "low"
    sched.check_integrity()


def test_preemption_storm_makes_progress_and_counts():
    ps = prompts(12, 30, shared=8)
    core, sched, _ = make_engine(num_blocks=24, block_size=4, budget=48, max_num_seqs=12)
    out = run_all(core, sched, ps, max_tokens=24, ignore_eos=True)
    assert all(len(out[f"r{i}"]) == 24 for i in range(12))
    assert sched.total_preemptions > 0
    # The same text as with a pool that never preempts (the fake model's
    # tokens depend on every KV entry it reads back).
    core2, sched2, _ = make_engine(num_blocks=400, block_size=4, budget=48, max_num_seqs=12)
    assert run_all(core2, sched2, ps, max_tokens=24, ignore_eos=True) == out
    assert sched2.total_preemptions == 0


@pytest.mark.parametrize("groups", [(FULL,), (FULL, SLIDING), (FULL, STATE, STATE)])
def test_chunking_caching_and_preemption_never_change_the_text(groups):
    ps = prompts(10, 37, shared=20, seed=3) + prompts(4, 9, seed=4)
    ref_core, ref_sched, _ = make_engine(
        num_blocks=1000, block_size=4, budget=4096, groups=groups, caching=False
    )
    reference = run_all(ref_core, ref_sched, ps, max_tokens=12, ignore_eos=True)
    for num_blocks, budget in ((1000, 13), (60, 24), (45, 64)):
        core, sched, _fake = make_engine(
            num_blocks=num_blocks, block_size=4, budget=budget, groups=groups
        )
        assert run_all(core, sched, ps, max_tokens=12, ignore_eos=True) == reference
        assert sched.kv.leaks.num_violations == 0


def test_parallel_sampling_forks_share_the_prompt():
    core, sched, fake = make_engine(block_size=4, budget=64)
    add(sched, "p", list(range(10)), max_tokens=4, n=3, ignore_eos=True)
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"p": 9}  # all but the last prompt token
    sched.update_from_output(out, fake.execute_model(out))
    out = sched.schedule()  # fork, then each computes the last prompt token
    assert out.num_scheduled_tokens == {"p": 1, "p#1": 1, "p#2": 1}
    assert len(out.blocks_to_copy) == 2  # the partly filled block, per child
    p_ids = sched.kv.block_ids("p")[0]
    assert sched.kv.block_ids("p#1")[0][:2] == p_ids[:2]
    assert sched.kv.pool.blocks[p_ids[0]].ref_cnt == 3
    sched.update_from_output(out, fake.execute_model(out))
    sched.check_integrity()
    result = core.run_until_done()
    assert set(result) == {"p", "p#1", "p#2"}
    assert sched.requests == {}
    assert_all_free(sched)


def test_abort_of_a_parent_aborts_its_forks():
    core, sched, _fake = make_engine(block_size=4, budget=64)
    add(sched, "p", list(range(10)), max_tokens=40, n=2)
    core.step()
    core.step()
    assert "p#1" in sched.requests
    outs = sched.abort_requests("p")
    assert {o.req_id for o in outs} == {"p", "p#1"}
    assert_all_free(sched)


def test_stats_per_step():
    core, sched, _ = make_engine(block_size=4, budget=64)
    add(sched, "a", list(range(20)), max_tokens=2)
    _, stats = core.step()
    assert stats.num_running == 1 and stats.num_scheduled_tokens == 20
    assert stats.prefix_queries == 20 and stats.prefix_hits == 0
    add(sched, "b", list(range(20)), max_tokens=2)
    _, stats = core.step()
    assert stats.prefix_queries == 20 and stats.prefix_hits == 16
    assert 0 < stats.kv_usage < 1


# -- parallel sampling (n > 1) under stop strings, tight pools and priorities ---------------
def _step_to_end(core, sched, max_steps: int = 2000) -> dict[str, list[int]]:
    """Step until nothing is left (failing after `max_steps`: no progress is a hang),
    checking integrity each step; returns each request's generated tokens."""
    out: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not core.has_unfinished_requests():
            return out
        outputs, _ = core.step()
        sched.check_integrity()
        for o in outputs:
            out.setdefault(o.req_id, []).extend(o.new_token_ids)
    raise AssertionError(f"still running after {max_steps} steps: {list(sched.requests)}")


def test_a_stop_string_in_completion_0_leaves_its_forks_running():
    core, sched, _fake = make_engine(block_size=4, budget=64)
    add(sched, "p", list(range(10)), max_tokens=6, n=3, ignore_eos=True)
    core.step()
    core.step()  # forked; every completion has its first token
    assert {"p#1", "p#2"} <= set(sched.requests)
    # the detokenizer matched a stop string in completion 0 (id "p")
    outs = sched.finish_requests("p", RequestStatus.FINISHED_STOPPED)
    assert [(o.req_id, o.finish_reason) for o in outs] == [("p", "stop")]
    tokens = _step_to_end(core, sched)
    assert len(tokens["p#1"]) == len(tokens["p#2"]) == 6 - 1  # the rest of max_tokens
    assert sched._children == {}
    assert_all_free(sched)


def test_an_abort_after_completion_0_ended_still_ends_its_forks():
    core, sched, _fake = make_engine(block_size=4, budget=64)
    add(sched, "p", list(range(10)), max_tokens=40, n=2, ignore_eos=True)
    core.step()
    core.step()
    sched.finish_requests("p", RequestStatus.FINISHED_STOPPED)
    outs = sched.abort_requests("p")  # the client went away
    assert [(o.req_id, o.finish_reason) for o in outs] == [("p#1", "abort")]
    assert sched.requests == {} and sched._children == {}
    assert_all_free(sched)


def test_a_fork_without_room_waits_instead_of_holding_its_parent_forever():
    # 4 usable blocks of 4 tokens: the parent's 14-token prompt leaves no block for the
    # copy of its partly filled last block, and nothing else runs to preempt.
    core, sched, _fake = make_engine(block_size=4, num_blocks=5, max_model_len=16, budget=32)
    add(sched, "p", list(range(1, 15)), max_tokens=2, n=2, ignore_eos=True)
    add(sched, "other", [1, 2, 3], max_tokens=2, ignore_eos=True)
    tokens = _step_to_end(core, sched, max_steps=50)
    assert {rid: len(t) for rid, t in tokens.items()} == {"p": 2, "p#1": 2, "other": 2}
    assert_all_free(sched)


def test_forks_respect_max_num_seqs():
    core, sched, _fake = make_engine(block_size=4, budget=64, max_num_seqs=2)
    add(sched, "p", list(range(10)), max_tokens=4, n=4, ignore_eos=True)
    peak = 0
    for _ in range(200):
        if not core.has_unfinished_requests():
            break
        core.step()
        sched.check_integrity()
        peak = max(peak, len(sched.running))
    assert not core.has_unfinished_requests() and peak == 2
    assert_all_free(sched)


def test_a_fork_that_waits_for_a_seat_reports_its_prefix_hit():
    """max_num_seqs 1: completion 1 of a 17-token prompt waits, then is admitted with
    its parent's 16 tokens of full blocks as a prefix hit. It reported 0 cached tokens:
    the fork set the count to 0, where admission records a hit only over -1."""
    core, sched, _fake = make_engine(block_size=4, budget=64, max_num_seqs=1)
    add(sched, "a", list(range(100, 117)), max_tokens=2, n=2, ignore_eos=True)
    cached = {}
    for _ in range(50):
        if not core.has_unfinished_requests():
            break
        outputs, _stats = core.step()
        cached.update({o.req_id: o.num_cached_tokens for o in outputs})
    assert cached == {"a": 0, "a#1": 16}
    assert_all_free(sched)


def test_check_integrity_sees_a_freed_live_block_a_wrong_hit_and_stale_bookkeeping():
    """Three broken states `check_integrity` let pass: a running request whose blocks
    a buggy rollback freed, a request reading another prompt's cached block, and the
    worker's bookkeeping for a request that is gone."""

    def two_running() -> tuple[Scheduler, Any]:
        core, sched, _fake = make_engine(block_size=4)
        add(sched, "a", list(range(13)), max_tokens=5)
        add(sched, "b", list(range(100, 113)), max_tokens=5)
        core.step()
        sched.check_integrity()
        return sched, sched.kv.managers[0]

    sched, m = two_running()
    m.truncate("a", 0)
    with pytest.raises(AssertionError, match="a: 0 blocks, 13 tokens"):
        sched.check_integrity()

    sched, m = two_running()
    a0, b0 = m.tables["a"][0], m.tables["b"][0]
    m.tables["b"][0] = a0
    sched.kv.pool.touch([a0])
    sched.kv.pool.free_blocks([b0])
    with pytest.raises(AssertionError, match=r"b reads block \d+ at 0: not its hash"):
        sched.check_integrity()

    for name in ("_known", "_cuts"):
        sched, _m = two_running()
        getattr(sched, name)["ghost"] = [1]
        with pytest.raises(AssertionError, match=f"{name} names"):
            sched.check_integrity()
    sched, _m = two_running()
    sched.kv._slots["ghost"] = 4
    with pytest.raises(AssertionError, match="slots of requests without blocks"):
        sched.check_integrity()


def test_check_integrity_sees_missing_copy_on_write_and_lost_live_blocks():
    """Broken states an earlier `check_integrity` let pass (ref counts all agreed):
    a fork writing its parent's partly filled block, one block at two positions of a
    table (caching off, so no hash gives it away), a pending copy into a freed block,
    bookkeeping of a request without a table, a hybrid request whose current state
    block is gone, and a null block inside a sliding window."""

    def forked(groups=(FULL,)) -> Scheduler:
        core, sched, _fake = make_engine(block_size=4, num_blocks=32, groups=groups)
        add(sched, "p", list(range(1, 11)), max_tokens=5, n=2)
        core.step()
        core.step()  # prefill, then the fork copies the partly filled block 2
        sched.check_integrity()
        return sched

    def swap(sched: Scheduler, table: list, i: int, block) -> None:
        """Put `block` at table[i] with consistent ref counts."""
        pool = sched.kv.pool
        if block is not pool.null_block:
            pool.touch([block])
        if table[i] is not pool.null_block:
            pool.free_blocks([table[i]])
        table[i] = block

    sched = forked()
    m = sched.kv.managers[0]
    swap(sched, m.tables["p#1"], 2, m.tables["p"][2])
    with pytest.raises(AssertionError, match=r"p writes block .* shared .* copy-on-write"):
        sched.check_integrity()

    core, sched, _fake = make_engine(block_size=4, num_blocks=32, caching=False)
    add(sched, "a", list(range(1, 11)), max_tokens=5)
    core.step()
    table = sched.kv.managers[0].tables["a"]
    swap(sched, table, 1, table[0])
    with pytest.raises(AssertionError, match=r"a: block .* twice in group 0's table"):
        sched.check_integrity()

    sched = forked()
    free_id = next(b.block_id for b in sched.kv.pool.blocks[1:] if b.ref_cnt == 0)
    sched.kv._copies.append((1, free_id))
    with pytest.raises(AssertionError, match=f"pending copy 1 -> {free_id} writes into"):
        sched.check_integrity()

    sched = forked()
    sched.kv.managers[0].retired["ghost"] = 0
    with pytest.raises(AssertionError, match=r"retired names \['ghost'\]"):
        sched.check_integrity()

    sched = forked(groups=(FULL, STATE))
    state = sched.kv.managers[1]
    table = state.tables["p"]
    current = max(i for i, b in enumerate(table) if b is not state.null)
    swap(sched, table, current, state.null)
    with pytest.raises(AssertionError, match=r"p: group 1 \(state\) holds no block at"):
        sched.check_integrity()

    core, sched, _fake = make_engine(block_size=4, groups=(FULL, SLIDING))
    add(sched, "w", list(range(1, 21)), max_tokens=5)
    core.step()  # 20 tokens computed: the window (10) needs positions 2 to 4
    sched.check_integrity()
    window = sched.kv.managers[1]
    swap(sched, window.tables["w"], 3, window.null)
    with pytest.raises(AssertionError, match=r"w: group 1 \(sliding\) holds no block"):
        sched.check_integrity()


def test_priority_ties_among_forks_do_not_livelock():
    """Forks share their parent's (priority, arrival): a tie must go to the one
    admitted last, else each fork in turn preempts the one that just got ahead."""
    core, sched, _fake = make_engine(
        policy="priority",
        block_size=1,
        num_blocks=14,
        max_model_len=40,
        budget=2,
        threshold=1,
        groups=(SLIDING,),
    )
    add(sched, "p", list(range(1, 10)), max_tokens=31, n=2, ignore_eos=True)
    tokens = _step_to_end(core, sched, max_steps=500)
    assert len(tokens["p"]) == len(tokens["p#1"]) == 31


def test_a_fork_never_preempts_a_request_of_higher_priority():
    """The parent of lower priority is the policy's victim: its fork waits rather
    than preempting `hi`, which runs undisturbed to its end."""
    core, sched, _fake = make_engine(
        policy="priority", block_size=4, num_blocks=9, budget=64, max_model_len=32
    )
    hi = SamplingParams(max_tokens=8, ignore_eos=True)
    hi_req = sched.make_request("hi", list(range(15)), hi, priority=0, arrival_time=0.0)
    sched.add_request(hi_req)
    core.step()  # hi holds 4 of the 8 usable blocks
    lo = SamplingParams(n=2, max_tokens=2, ignore_eos=True)
    sched.add_request(
        sched.make_request("lo", list(range(100, 114)), lo, priority=5, arrival_time=1.0)
    )
    tokens = _step_to_end(core, sched, max_steps=200)
    assert sched.requests == {} and len(tokens["lo#1"]) == 2
    assert len(tokens["hi"]) == 8 - 1  # its first came in the step above
    assert hi_req.num_preemptions == 0


@pytest.mark.parametrize("knob", ["budget", "threshold"])
def test_state_models_refuse_a_chunk_limit_below_one_block(knob):
    kwargs = {"budget": 4} if knob == "budget" else {"threshold": 4}
    with pytest.raises(ValueError, match="below block_size=8") as info:
        make_engine(block_size=8, num_blocks=200, groups=(FULL, STATE), **kwargs)
    name = "max_num_batched_tokens" if knob == "budget" else "long_prefill_token_threshold"
    assert f"raise {name} to at least 8" in str(info.value)


def test_state_models_warn_when_decodes_can_hold_back_every_prefill(caplog):
    """Decodes take the step's budget first; a state model's prefill chunk is whole
    blocks, so past budget - block_size + 1 decodes no prefill runs until one ends."""
    with caplog.at_level("WARNING", logger="spur.actors.engine.core.scheduler"):
        make_engine(block_size=8, num_blocks=200, groups=(FULL, STATE), budget=16)
    assert "while more than 8 requests decode" in caplog.text
    assert "raise max_num_batched_tokens to at least 23" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="spur.actors.engine.core.scheduler"):
        make_engine(block_size=8, num_blocks=200, groups=(FULL, STATE), budget=23)
        make_engine(block_size=8, num_blocks=200, groups=(FULL,), budget=16)
    assert "requests decode" not in caplog.text


def test_a_request_finished_while_preempted_is_reported_to_the_worker():
    """The worker keeps a preempted request's sampler state (seeded generator, penalty
    counts) for its return; if it ends while waiting (abort, stop string), the next
    step must name it in finished_req_ids, or the worker keeps that state for good."""
    _core, sched, fake = make_engine(block_size=4, budget=64)
    add(sched, "p", list(range(10)), max_tokens=20, ignore_eos=True)
    out = sched.schedule()
    sched.update_from_output(out, fake.execute_model(out))
    sched._preempt(sched.requests["p"])
    out = sched.schedule()  # re-admits it at once: preempt again before it finishes
    assert "p" in out.preempted_req_ids
    sched.update_from_output(out, fake.execute_model(out))
    sched._preempt(sched.requests["p"])
    sched.abort_requests("p")
    out = sched.schedule()
    assert "p" in out.finished_req_ids
    assert "p" not in sched.schedule().finished_req_ids  # told once


def test_a_fork_preempted_in_its_step_leaves_no_block_copy_behind():
    """p0's fork is made, then preempted for p1's in the same schedule(): its pending
    copy must go with it, or its freed block (now p1#1's) gets two copies at once
    (undefined order on a GPU)."""
    _core, sched, fake = make_engine(block_size=4, num_blocks=6, budget=32, max_model_len=12,
                                     caching=False)  # fmt: skip
    for i in range(2):
        add(sched, f"p{i}", [10 + i * 10 + j for j in range(7)], max_tokens=2, n=2)
    out = sched.schedule()
    sched.update_from_output(out, fake.execute_model(out))
    out = sched.schedule()
    assert sched.total_preemptions == 1
    dsts = [dst for _, dst in out.blocks_to_copy]
    assert len(dsts) == len(set(dsts)), out.blocks_to_copy
    held = {b for rid in out.num_scheduled_tokens for b in sched.kv.block_ids(rid)[0]}
    assert set(dsts) <= held  # every copy lands in a block a scheduled request holds
    sched.check_integrity()


def test_an_id_is_not_reused_while_completions_of_it_run():
    """An n = 2 request ended by completion 0's stop string while its fork 'a#1' still
    ran: a new 'a' was accepted and its own fork took over the live 'a#1' (the
    worker's KV no longer matched the scheduler's). The id is refused until all end."""
    core, sched, _ = make_engine(block_size=4, num_blocks=64, budget=32)
    core.add_request(
        sched.make_request("a", list(range(1, 11)), SamplingParams(max_tokens=20, n=2))
    )
    core.step()
    core.step()
    sched.finish_requests("a", RequestStatus.FINISHED_STOPPED)
    assert "a#1" in sched.requests
    with pytest.raises(RequestRejected, match="'a' is already in use"):
        core.add_request(sched.make_request("a", list(range(50, 60)), SamplingParams(n=2)))
    while core.has_unfinished_requests():
        core.step()
        sched.check_integrity()
    core.add_request(sched.make_request("a", list(range(50, 60)), SamplingParams(max_tokens=2)))
    while core.has_unfinished_requests():
        core.step()
    assert_all_free(sched)
