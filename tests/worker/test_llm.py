"""The offline engine end to end on tiny random models: scheduler + KV manager +
model runner + paged attention + sampler, against transformers' own forward.

The oracle is teacher forcing: every token we generate greedily must be the
argmax of transformers' logits at that position given the tokens before it.
(transformers' `generate` with a KV cache drifts from its own full forward on
these tiny random models with llama3 RoPE; the full forward is the reference.)
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from spur.actors.engine.sampling_params import SamplingParams
from spur.actors.llm import LLM

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
CONFIGS = {
    "one batch": {},
    "chunked prefill": {"max_num_batched_tokens": 16},
    "tiny pool (preemption)": {"num_kv_blocks": 24, "block_size": 4, "max_num_batched_tokens": 32},
}


def make_prompts(n: int = 6, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(3, 56))] for _ in range(n)]


def teacher_forced_argmax(
    hf_logits: Callable, name: str, prompt: list[int], out: list[int]
) -> list[int]:
    logits = hf_logits(name, prompt + out)  # [len, vocab]
    return logits[len(prompt) - 1 : -1].argmax(-1).tolist()


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Callable[[str], Path]) -> dict:
    """Each tiny model through each engine configuration, every prompt twice
    (the second copy hits the prefix cache)."""
    torch.set_num_threads(1)
    prompts = make_prompts()
    results = {}
    for name in ("llama", "qwen3"):
        for label, kwargs in CONFIGS.items():
            llm = LLM(str(tiny_model_dir(name)), **kwargs)
            try:
                outs = llm.generate(prompts + prompts, GREEDY)
                stats = dict(llm.last_run_stats)
                stats["prefix_hits"] = llm.scheduler.kv.prefix_stats.total_hits
                llm.scheduler.check_integrity()
                free = llm.scheduler.kv.num_free_blocks
                total = llm.scheduler.kv.pool.num_blocks - 1
            finally:
                llm.shutdown()
            results[name, label] = ([o.outputs[0].token_ids for o in outs], stats, free, total)
    return {"prompts": prompts, "results": results}


@pytest.mark.parametrize("name", ["llama", "qwen3"])
@pytest.mark.parametrize("label", list(CONFIGS))
def test_greedy_tokens_match_transformers(runs, hf_logits, name, label):
    prompts = runs["prompts"] * 2
    outs, _, free, total = runs["results"][name, label]
    for prompt, out in zip(prompts, outs, strict=True):
        assert len(out) == 16
        assert out == teacher_forced_argmax(hf_logits, name, prompt, out)
    assert free == total  # every block back in the pool


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_configurations_agree_and_exercise_the_core(runs, name):
    res = runs["results"]
    base = res[name, "one batch"][0]
    assert base[:6] == base[6:]  # the prefix-cached copies give the same text
    for label in CONFIGS:
        assert res[name, label][0] == base, label
    # Blocks are cached once computed: copies admitted in a later step hit.
    assert res[name, "chunked prefill"][1]["prefix_hits"] > 0
    assert res[name, "tiny pool (preemption)"][1]["num_preemptions"] > 0
    assert res[name, "chunked prefill"][1]["steps"] > res[name, "one batch"][1]["steps"]


def test_parallel_sampling_and_seeds(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), block_size=4)
    try:
        prompt = make_prompts(1, seed=5)[0]
        params = SamplingParams(max_tokens=8, temperature=1.0, seed=11, n=3, ignore_eos=True)
        (first,) = llm.generate([prompt], params)
        assert [c.index for c in first.outputs] == [0, 1, 2]
        texts = [tuple(c.token_ids) for c in first.outputs]
        assert len(set(texts)) > 1  # forks get seed + index
        # The same seed gives the same tokens whatever else is in the batch.
        others = make_prompts(4, seed=9)
        batch = llm.generate([*others, prompt], [GREEDY] * 4 + [params])
        assert [tuple(c.token_ids) for c in batch[-1].outputs] == texts
        llm.scheduler.check_integrity()
        assert llm.scheduler.kv.num_free_blocks == llm.scheduler.kv.pool.num_blocks - 1
    finally:
        llm.shutdown()


def test_bad_input_is_rejected_before_anything_runs(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=20, block_size=4)
    try:
        with pytest.raises(ValueError, match="max_model_len is 76"):
            llm.generate([[1, 2, 3], list(range(200))], GREEDY)
        assert not llm.scheduler.has_unfinished_requests()
        with pytest.raises(ValueError, match="has no tokenizer"):
            llm.generate("text needs a tokenizer", GREEDY)
        # The engine still serves afterwards.
        (out,) = llm.generate([[1, 2, 3]], GREEDY)
        assert len(out.outputs[0].token_ids) == 16
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_tensor_parallel_2_equals_1(tiny_model_dir):
    prompts = make_prompts(4, seed=2)
    results = []
    for tp in (1, 2):
        llm = LLM(str(tiny_model_dir("llama")), tensor_parallel_size=tp, num_threads=1)
        try:
            results.append([o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)])
        finally:
            llm.shutdown()
    assert results[0] == results[1]
