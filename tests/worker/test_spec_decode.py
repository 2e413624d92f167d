"""Speculative decoding on the worker: the sampler's verification rule, and
SmolLM2 through the whole offline engine with and without n-gram drafts."""

from __future__ import annotations

import pytest
import torch

from spur.actors.step import SamplingParams
from spur.actors.worker.sampler import Sampler
from spur.actors.worker.sampling_metadata import SamplerState

VOCAB = 6


def _state(params: dict[str, SamplingParams], seed: int = 0) -> SamplerState:
    state = SamplerState(VOCAB, seed=seed)
    for rid, p in params.items():
        state.add_request(rid, p, [0], eos_token_id=None)
    return state


def test_greedy_verify_keeps_the_matching_prefix_then_the_models_token():
    # Rows: after the last known token the model picks 3, after draft 1 it picks 4,
    # after draft 2 it picks 1.
    picks = [3, 4, 1]
    logits = torch.full((3, VOCAB), -1.0)
    logits[torch.arange(3), torch.tensor(picks)] = 5.0
    greedy = SamplingParams(temperature=0)
    sampler = Sampler()
    for drafts, want in [([3, 4], [3, 4, 1]), ([3, 5], [3, 4]), ([2, 4], [3])]:
        state = _state({"a": greedy})
        tokens, lps = sampler.verify(logits.clone(), state.build(["a"] * 3), [drafts])
        assert tokens == [want] and lps == [None]
    # A request without drafts in the same batch owns one row and keeps its logprobs.
    state = _state({"a": greedy, "b": SamplingParams(temperature=0, logprobs=1)})
    both = torch.cat([logits, logits[2:]])
    tokens, lps = sampler.verify(both, state.build(["a"] * 3 + ["b"]), [[3, 4], []])
    assert tokens == [[3, 4, 1], [1]]
    assert lps[0] is None and lps[1] is not None and lps[1].top[0][0] == 1
    with pytest.raises(ValueError, match="expected"):
        sampler.verify(logits.clone(), state.build(["a"] * 3), [[3]])


def test_rejection_rule_keeps_the_target_distribution():
    """With one-hot drafts, each emitted token must be distributed as the processed
    target distribution p: the first token's marginal is p (row 0), and after an
    accepted draft the next one is distributed as row 1's p. Checked on 20,000
    requests in one batch (seeded: deterministic), within 4 standard errors."""
    torch.manual_seed(0)
    n = 20_000
    row_logits = torch.tensor(
        [[2.0, 1.0, 0.5, 0.0, -1.0, -3.0], [0.0, 1.5, -0.5, 1.0, 0.2, -9.0], [0.0] * 6]
    )
    params = SamplingParams(temperature=0.8, top_k=5)

    def processed(row: torch.Tensor) -> torch.Tensor:
        x = row / 0.8
        x[x < x.topk(5).values[-1]] = float("-inf")
        return x.softmax(-1)

    p0, p1 = processed(row_logits[0]), processed(row_logits[1])
    drafts = [[1, 3]] * n  # a likely-ish first draft and a second one
    ids = [f"r{i}" for i in range(n)]
    state = _state(dict.fromkeys(ids, params), seed=123)
    rows = [rid for rid in ids for _ in range(3)]
    logits = row_logits.repeat(n, 1)  # [3n, vocab]
    tokens, _ = Sampler().verify(logits, state.build(rows), drafts)
    first = torch.bincount(torch.tensor([t[0] for t in tokens]), minlength=VOCAB) / n
    se = (p0 * (1 - p0) / n).sqrt()
    assert ((first - p0).abs() <= 4 * se + 1e-4).all(), (first, p0)
    after = [t[1] for t in tokens if t[0] == 1]
    m = len(after)
    assert m > 0.1 * n  # about p0[1] of the requests accepted the first draft
    second = torch.bincount(torch.tensor(after), minlength=VOCAB) / m
    assert ((second - p1).abs() <= 4 * (p1 * (1 - p1) / m).sqrt() + 1e-4).all(), (second, p1)
    assert first[5] == 0  # top-k removed it: never emitted, not even as a correction


def test_a_seeded_request_samples_the_same_tokens_with_and_without_drafts():
    """Verification samples each row as a plain step would, with the same seeded draws,
    and gives back the draws of rows it did not emit from: given the same logits, a
    seeded request's tokens do not depend on its drafts (right, wrong or none), so
    neither on the batch that turns drafting off nor on a failover's replay count."""
    vocab = 40
    torch.manual_seed(0)
    table = torch.randn(vocab, vocab) * 2  # the "model": logits of the token after t

    def logits_after(tokens: list[int]) -> torch.Tensor:
        return table[tokens[-1]].clone()

    params = SamplingParams(temperature=1.0, top_k=30, seed=77)

    def plain(n: int) -> list[int]:
        state = _state({"s": params})
        tokens = [0]
        for _ in range(n):
            meta = state.build(["s"])
            (t,) = Sampler()(logits_after(tokens).unsqueeze(0), meta).sampled_token_ids.tolist()
            state.append_sampled(["s"], [t])
            tokens.append(t)
        return tokens[1:]

    reference = plain(60)
    state = _state({"s": params})
    tokens = [0]
    drafted = accepted = 0
    step = 0
    while len(tokens) - 1 < 60:
        step += 1
        # Drafts of 0-3 tokens: the reference's own next tokens (accepted) with some
        # replaced by a wrong guess (rejected there).
        pos = len(tokens) - 1
        k = step % 4
        draft = [
            reference[pos + i] if (step + i) % 3 else (reference[pos + i] + 1) % vocab
            for i in range(k)
            if pos + i < len(reference)
        ]
        rows = [logits_after(tokens + draft[:j]) for j in range(len(draft) + 1)]
        out, _ = Sampler().verify(torch.stack(rows), state.build(["s"] * len(rows)), [draft])
        state.append_tokens("s", out[0])
        tokens += out[0]
        drafted += len(draft)
        accepted += len(out[0]) - 1  # the drafts it kept (then one of its own)
    assert tokens[1:61] == reference
    assert 0 < accepted < drafted  # both accepted and rejected drafts were exercised


# -- SmolLM2 end to end ------------------------------------------------------------------
PASSAGE = (
    "The river starts high in the mountains, where snow melts each spring and runs down "
    "through pine forests into a narrow valley. Farmers there have built small stone "
    "channels to water their fields, and every village keeps a record of who may open "
    "the gates and when. In dry years the records matter more than the law."
)


@pytest.mark.slow
def test_smollm2_greedy_is_identical_with_and_without_speculation():
    """A batch mixing requests that draft a lot (asked to repeat a passage) with one
    that drafts nothing (logprobs: no drafts) and an ordinary question. fp32;
    block_size 4 so that rejected drafts often free a block (the worker's tables
    are cut to match), and a pool small enough to preempt in the second config."""
    from spur.actors.llm import LLM

    torch.set_num_threads(1)
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    no_drafts = greedy.with_changes(logprobs=0)
    outs = {}
    # "plain" runs on the first engine with its proposer taken away: no request
    # drafts, so every step is an ordinary one (and one model load is saved).
    for label, kwargs in [
        ("speculative", {}),
        ("plain", {}),
        ("speculative, small pool", {"num_kv_blocks": 70}),
    ]:
        if label != "plain":
            llm = LLM(
                "SmolLM2-135M-Instruct",
                dtype="float32",
                block_size=4,
                num_speculative_tokens=4,
                **kwargs,
            )
        proposer = llm.scheduler.proposer
        try:
            if label == "plain":
                llm.scheduler.proposer = None
            repeat = llm.chat_prompt(
                [{"role": "user", "content": f"Repeat this text exactly:\n\n{PASSAGE}"}]
            )
            question = llm.chat_prompt([{"role": "user", "content": "What is a river delta?"}])
            prompts = [repeat, question, repeat[:-3] + repeat[-2:], repeat]
            params = [greedy, greedy, greedy, no_drafts]
            got = llm.generate(prompts, params)
            llm.scheduler.check_integrity()
            kv = llm.scheduler.kv
            assert kv.num_free_blocks == kv.pool.num_blocks - 1
            assert kv.leaks.num_violations == 0
            if label == "speculative, small pool":
                assert llm.last_run_stats["num_preemptions"] > 0
        finally:
            llm.scheduler.proposer = proposer
            if label != "speculative":
                llm.shutdown()
        outs[label] = [o.outputs[0] for o in got]
    want = [c.token_ids for c in outs["plain"]]
    for label in ("speculative", "speculative, small pool"):
        comps = outs[label]
        assert [c.token_ids for c in comps] == want, label
        assert comps[0].num_accepted_tokens >= 20, label  # the repeat drafts a lot
        assert comps[0].num_draft_tokens >= comps[0].num_accepted_tokens
        assert comps[3].num_draft_tokens == 0  # logprobs: never drafts
        assert [c.logprobs is not None for c in comps] == [False, False, False, True]
    assert all(c.num_draft_tokens == 0 for c in outs["plain"])


@pytest.mark.slow
def test_generated_tokens_metrics_leave_out_drafts_past_a_stop_string():
    """A stop string completed inside a step's accepted drafts: the client gets the ids
    up to it, but vllm:generation_tokens and the per-request histograms counted the
    step's ids past it too (11 where the client got 10)."""
    import asyncio

    from spur.actors.engine.shell.async_engine import AsyncEngine
    from spur.actors.engine.shell.metrics import EngineMetrics
    from spur.actors.engine.shell.output_processor import Delta
    from spur.actors.llm import LLM

    torch.set_num_threads(1)
    llm = LLM("SmolLM2-135M-Instruct", dtype="float32", block_size=4, num_speculative_tokens=4)
    repeat = llm.chat_prompt(
        [{"role": "user", "content": f"Repeat this text exactly:\n\n{PASSAGE}"}]
    )
    ids = llm.encode(repeat)
    params = SamplingParams(max_tokens=40, temperature=0, stop=("where snow",))

    async def main() -> tuple[list[int], EngineMetrics]:
        metrics = EngineMetrics(max_model_len=llm.scheduler.config.max_model_len)
        engine = AsyncEngine(
            llm.engine, llm.tokenizer, eos_token_id=llm.eos_token_ids[0], metrics=metrics
        )
        final = None
        try:
            async for item in engine.generate("r", ids, params):
                if not isinstance(item, Delta):
                    final = item
        finally:
            await engine.shutdown()
        assert final is not None and final.outputs[0].finish_reason == "stop"
        return final.outputs[0].token_ids, metrics

    try:
        got, metrics = asyncio.run(main())
        llm.scheduler.check_integrity()
    finally:
        llm.shutdown()
    assert metrics.spec_accepted_tokens > 0
    assert metrics.generation_tokens == len(got)
    assert metrics.histograms["vllm:request_generation_tokens"].sum == len(got)


def test_sampled_requests_verify_drafts_on_a_tiny_model(tiny_model_dir):
    """Random (seeded) and greedy requests drafting side by side in one batch on
    the real worker: every request gets its full length, drafts were verified
    (some kept, some rejected), and the pool and sampler state end clean."""
    from spur.actors.llm import LLM

    llm = LLM(str(tiny_model_dir("llama")), block_size=4, num_speculative_tokens=3)
    try:
        cycle = [5, 17, 42, 9, 33, 71, 8, 21]
        prompts = [cycle * 6, cycle[::-1] * 5, [3, 4] * 10]
        params = [
            SamplingParams(max_tokens=30, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True),
            SamplingParams(max_tokens=30, temperature=1.3, top_k=20, ignore_eos=True),
            SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
        ]
        outs = llm.generate(prompts, params)
        llm.scheduler.check_integrity()
        kv = llm.scheduler.kv
        assert kv.num_free_blocks == kv.pool.num_blocks - 1
        assert kv.leaks.num_violations == 0
        llm.executor.worker.runner.sampler_state.check_integrity()  # one in-process worker
    finally:
        llm.shutdown()
    comps = [o.outputs[0] for o in outs]
    assert [len(c.token_ids) for c in comps] == [30, 30, 30]
    stats = llm.scheduler.spec_stats
    assert stats.num_draft_tokens > 0
    assert sum(c.num_draft_tokens for c in comps) == stats.num_draft_tokens


def test_speculation_on_a_hybrid_model_is_refused_before_its_pool_is_allocated(caplog):
    """The scheduler refused it, but only after the whole KV + state pool was allocated
    (on a GPU, ~90% of its memory before the error, again at every Serve retry)."""
    import logging

    from spur.actors.llm import LLM

    with caplog.at_level(logging.INFO), pytest.raises(ValueError, match="cannot be rolled back"):
        LLM("hybrid-tiny", num_speculative_tokens=2, kv_cache_bytes=64 * 2**20)
    assert "loaded" in caplog.text  # the model was loaded ...
    assert "state pool" not in caplog.text  # ... and no pool allocated
