"""What the served models say: the Serve path equals the offline engine, TP=2
(Ray worker actors on CPU) equals TP=1, a lane's sampling defaults apply to the
requests that leave them out, and SmolLM2 knows the capital of France."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "def fibonacci(n):"]


def greedy(client: Any, model: str, prompt: str, max_tokens: int = 16) -> Any:
    out = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    return out


def test_completions_equal_offline_llm_generate(openai_client: Any, spur_server: Any) -> None:
    import torch

    from spur.actors.llm import LLM
    from spur.actors.step import SamplingParams

    served = [greedy(openai_client, "tiny", p) for p in PROMPTS]
    torch.set_num_threads(1)
    llm = LLM(str(spur_server.model_dir), num_kv_blocks=512)
    try:
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        offline = llm.generate(PROMPTS, params)
    finally:
        llm.shutdown()
    for prompt, out, ref in zip(PROMPTS, served, offline, strict=True):
        (choice,) = out.choices
        (comp,) = ref.outputs
        assert choice.text == comp.text, prompt
        assert out.usage.completion_tokens == len(comp.token_ids) == 16
        assert out.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_tp2_equals_tp1(openai_client: Any, spur_server: Any) -> None:
    spur_server.require_lane("tiny-tp2")
    for prompt in PROMPTS:
        tp1 = greedy(openai_client, "tiny", prompt).choices[0].text
        tp2 = greedy(openai_client, "tiny-tp2", prompt).choices[0].text
        assert tp2 == tp1, prompt


def test_sampling_defaults_reach_the_served_lane(openai_client: Any, spur_server: Any) -> None:
    """Lane tiny-tp2 sets engine.model.override_generation_config {temperature 0,
    max_new_tokens 20}: a chat request that leaves temperature and max tokens out is
    greedy and stops at 20 tokens, as lane tiny with both explicit; an explicit
    max_tokens above the override's cap is cut to it."""
    spur_server.require_lane("tiny-tp2")
    messages = [{"role": "user", "content": "Count with me"}]
    eos = {"ignore_eos": True}
    implicit = openai_client.chat.completions.create(
        model="tiny-tp2", messages=messages, extra_body=eos
    )
    explicit = openai_client.chat.completions.create(
        model="tiny", messages=messages, temperature=0, max_tokens=20, extra_body=eos
    )
    assert implicit.usage.completion_tokens == 20
    assert implicit.choices[0].finish_reason == "length"
    assert implicit.choices[0].message.content == explicit.choices[0].message.content
    capped = openai_client.chat.completions.create(
        model="tiny-tp2", messages=messages, max_tokens=40, temperature=0, extra_body=eos
    )
    assert capped.usage.completion_tokens == 20
    assert capped.choices[0].message.content == explicit.choices[0].message.content


def test_smollm2_knows_paris(openai_client: Any) -> None:
    stream = openai_client.chat.completions.create(
        model="smol",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=32,
        temperature=0,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert "Paris" in text, text
