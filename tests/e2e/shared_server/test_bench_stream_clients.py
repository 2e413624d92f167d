"""The bench clients' reading of a streamed OpenAI response (`serve.sse_json`, and
`sse_chunks` over it), and the autoscale bench's load client against a real
`spur serve`: its tokens counted from the usage chunk, its first token timed."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from spur.cluster.bench.autoscale import LoadDriver
from spur.cluster.bench.serve import sse_json


def test_sse_json_reads_data_lines_only() -> None:
    assert sse_json('data: {"choices": [{"text": "a"}]}') == {"choices": [{"text": "a"}]}
    assert sse_json("data: [DONE]") is None
    assert sse_json("") is None  # the blank line between events
    assert sse_json(": keep-alive comment") is None


@pytest.mark.slow
def test_autoscale_load_client_against_spur_serve(spur_server: Any) -> None:
    driver = LoadDriver(url=spur_server.url, model="smol", max_tokens=8)
    with httpx.Client(timeout=120.0) as client:
        out = driver._one(client, "Tell me about the sea.")
        assert out.ok and out.error is None, out
        assert out.tokens == 8  # ignore_eos: the usage chunk's completion_tokens
        assert out.ttft_s is not None and out.ttft_s > 0
        bad = LoadDriver(url=spur_server.url, model="no-such-model", max_tokens=8)._one(client, "x")
        assert not bad.ok and bad.error is not None and bad.error.startswith("404"), bad
