"""A hybrid model (Gated DeltaNet + attention) served by `spur serve` with the
configs/hybrid-tiny.yaml preset: chat answers over the OpenAI API, the served
text equals the offline engine's, and a repeated prompt hits the state cache."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.slow

MODEL = "hybrid-tiny"


def test_chat_answers_stream_and_in_one(openai_client: Any, spur_server: Any) -> None:
    spur_server.require_lane("hybrid")
    messages = [{"role": "user", "content": "Say something about state caching."}]
    whole = openai_client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0
    )
    (choice,) = whole.choices
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("length", "stop")
    assert whole.usage.completion_tokens >= 1
    stream = openai_client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == choice.message.content  # greedy: the stream says the same


def test_served_text_equals_offline_and_repeats_hit_the_cache(
    openai_client: Any, spur_server: Any
) -> None:
    import torch

    from spur.actors.llm import LLM
    from spur.actors.step import SamplingParams

    spur_server.require_lane("hybrid")
    prompt = "The quick brown fox jumps over the lazy dog. " * 8  # > 4 blocks of 16
    served = []
    for _ in range(2):
        out = openai_client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=10,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        served.append(out)
    assert served[0].choices[0].text == served[1].choices[0].text
    details = served[1].usage.prompt_tokens_details
    assert details is not None and details.cached_tokens > 0  # the state prefix hit
    torch.set_num_threads(1)
    llm = LLM(MODEL, num_kv_blocks=256)
    try:
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        (ref,) = llm.generate([prompt], params)
    finally:
        llm.shutdown()
    assert served[0].choices[0].text == ref.outputs[0].text
