"""SmolLM2-135M-Instruct (the demo model) through the whole offline engine:
identical greedy token ids to transformers' `generate` in fp32, for 8 prompts of
10 to 600 tokens generated together, and again with chunked prefill, prefix-cache
hits and a pool small enough to preempt."""

from __future__ import annotations

import pytest
import torch

from spur.actors.llm import LLM
from spur.actors.step import SamplingParams

pytestmark = pytest.mark.slow

LENGTHS = [10, 37, 80, 150, 240, 330, 450, 600]
NEW_TOKENS = 24
TEXT = (
    "The river starts high in the mountains, where snow melts each spring and runs down "
    "through pine forests into a narrow valley. Farmers there have built small stone "
    "channels to water their fields, and every village keeps a record of who may open "
    "the gates and when. In dry years the records matter more than the law. Travellers "
    "who follow the river reach the plain after three days, where it widens, slows, and "
    "turns brown with silt. Cities grew on its banks because boats could carry grain and "
    "cloth to the sea, and merchants paid well for the right to build warehouses near the "
    "docks. Today the boats are gone, but the warehouses remain, turned into libraries, "
    "schools and markets where people still trade stories about the floods of old. "
)


@pytest.fixture(scope="module")
def setup():
    from transformers import AutoTokenizer

    from spur.actors.worker.loader import resolve_model_dir

    torch.set_num_threads(2)
    model_dir = resolve_model_dir("SmolLM2-135M-Instruct")
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(TEXT * 8, add_special_tokens=False)["input_ids"]
    prompts = [ids[i * 7 : i * 7 + n] for i, n in enumerate(LENGTHS)]
    return model_dir, prompts


@pytest.fixture(scope="module")
def reference(setup):
    from spur.actors.worker.hf_reference import clear_cache, hf_greedy

    model_dir, prompts = setup
    out = hf_greedy(model_dir, prompts, NEW_TOKENS, stop_at_eos=False)
    clear_cache()
    return out


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


@pytest.mark.parametrize(
    ("label", "kwargs", "twice"),
    [
        ("one batch", {}, False),
        ("chunked prefill", {"max_num_batched_tokens": 64}, False),
        ("every prompt twice", {"max_num_batched_tokens": 512}, True),
        ("preemption", {"num_kv_blocks": 60, "max_num_batched_tokens": 256}, False),
    ],
)
def test_smollm2_matches_transformers(setup, reference, label, kwargs, twice):
    model_dir, prompts = setup
    batch = prompts + prompts if twice else prompts
    llm = LLM(str(model_dir), dtype="float32", **kwargs)
    try:
        outs = llm.generate(batch, GREEDY)
        stats = llm.last_run_stats
        hits = llm.scheduler.kv.prefix_stats.total_hits
        llm.scheduler.check_integrity()
        assert llm.scheduler.kv.num_free_blocks == llm.scheduler.kv.pool.num_blocks - 1
    finally:
        llm.shutdown()
    got = [o.outputs[0].token_ids for o in outs]
    expected = reference + reference if twice else reference
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g == e, f"{label}: prompt {i} ({len(batch[i])} tokens) differs"
    if twice:
        # Blocks are cached once computed, so a copy admitted in the same step
        # as its original computes its prompt again; the later ones hit.
        assert hits >= sum(n // 16 for n in LENGTHS) * 16 // 2
    if label == "preemption":
        assert stats["num_preemptions"] > 0
    if label == "chunked prefill":
        assert stats["steps"] > NEW_TOKENS + sum(LENGTHS) // 64 - 1


def test_smollm2_generates_coherent_text():
    with LLM("SmolLM2-135M-Instruct") as llm:
        prompt = llm.chat_prompt([{"role": "user", "content": "What is the capital of France?"}])
        (out,) = llm.generate([prompt], SamplingParams(max_tokens=20, temperature=0))
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason in ("stop", "length")
