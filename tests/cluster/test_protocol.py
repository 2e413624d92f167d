"""The OpenAI protocol layer: request parsing, sampling mapping, response shapes.

The strongest checks run the official `openai` client against a fake transport
whose handler is built only from `spur.cluster.api_requests` and
`spur.cluster.api_responses`: the client serialises its requests exactly as it
does for api.openai.com, our parser reads them, our builders answer, and the
client (plus `model_validate` of its response types) reads the answers back. No
HTTP server, no Ray, no model.
"""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import openai
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from spur.actors.engine.core.outputs import CompletionOutput, RequestOutput
from spur.actors.engine.core.scheduler import RequestRejected
from spur.actors.engine.shell.output_processor import Delta
from spur.actors.step import Logprobs, SamplingParams
from spur.cluster import api_requests as rq
from spur.cluster import api_responses as rs
from spur.cluster.errors import (
    ProtocolError,
    error_body,
    from_request_rejected,
    internal_error,
    malformed_json,
    model_not_found,
    queue_full,
    service_unavailable,
)

MODEL = "tiny"
PROMPT_IDS = [5, 6, 7]


def token_str(tid: int) -> str:
    return f"t{tid} " if tid != 99 else "é"


def fake_output(n: int = 1, n_tokens: int = 3, top: int = 2, rid: str = "r") -> RequestOutput:
    """A finished RequestOutput: completion i has ids 10*i+1.., each with logprobs."""
    outs = []
    for i in range(n):
        ids = [10 * i + k + 1 for k in range(n_tokens)]
        lps = [Logprobs(-0.5 * k, [(t, -0.1 * j) for j, t in enumerate(ids[:top])]) for k in ids]
        outs.append(
            CompletionOutput(
                index=i,
                text="".join(token_str(t) for t in ids),
                token_ids=ids,
                finish_reason="length" if i == 0 else "stop",
                stop_reason=None if i == 0 else "\n",
                logprobs=lps,
            )
        )
    return RequestOutput(rid, "hello", list(PROMPT_IDS), outs, num_cached_tokens=2)


# -- the openai client, end to end through a fake transport ---------------------------------
class FakeServer:
    """An httpx handler that answers like the ingress will, from protocol functions."""

    def __init__(self) -> None:
        self.requests: list[Any] = []
        self.sampling: list[SamplingParams] = []

    def __call__(self, http: httpx.Request) -> httpx.Response:
        try:
            return self._handle(http)
        except ProtocolError as exc:
            return httpx.Response(exc.status, json=error_body(exc), headers=exc.headers)

    def _handle(self, http: httpx.Request) -> httpx.Response:
        path = http.url.path
        if path.endswith("/models"):
            return httpx.Response(200, json=rs.models_response([MODEL], max_model_len=64))
        chat = path.endswith("/chat/completions")
        cls = rq.ChatCompletionRequest if chat else rq.CompletionRequest
        req = rq.parse_request(cls, http.content)
        model = rq.resolve_model(req.model, [MODEL])
        params = req.to_sampling_params(default_max_tokens=32)
        self.requests.append(req)
        self.sampling.append(params)
        num_prompts = 1 if chat else len(req.prompts())
        outputs = [fake_output(req.num_choices, rid=f"r{i}") for i in range(num_prompts)]
        rid = rs.make_id("chatcmpl" if chat else "cmpl")
        created = rs.now()
        prompt_tokens = len(PROMPT_IDS) * num_prompts
        if not req.stream:
            if chat:
                body = rs.chat_response(
                    rid,
                    model,
                    created,
                    outputs[0],
                    token_str=token_str,
                    num_top_logprobs=req.num_top_logprobs,
                )
            else:
                body = rs.completion_response(
                    rid,
                    model,
                    created,
                    outputs,
                    token_str=token_str,
                    num_top_logprobs=req.num_top_logprobs,
                )
            return httpx.Response(200, content=rs.json_bytes(body))
        stream = rs.ChunkStream.for_request(
            req,
            request_id=rid,
            model=model,
            created=created,
            prompt_tokens=prompt_tokens,
            token_str=token_str,
            prompt_lens=[len(PROMPT_IDS)] * num_prompts,
        )
        events = [rs.sse(c) for c in stream.start()]
        for pi, out in enumerate(outputs):
            for delta, lps in _deltas(out):
                events += [rs.sse(c) for c in stream.update(delta, lps, prompt_index=pi)]
        events += [rs.sse(c) for c in stream.finish(cached_tokens=2)]
        events.append(rs.sse_done())
        return httpx.Response(
            200, content=b"".join(events), headers={"content-type": "text/event-stream"}
        )


def _deltas(out: RequestOutput) -> list[tuple[Delta, list[Logprobs]]]:
    """One Delta per token, interleaving the completions as the engine does."""
    steps = []
    width = max(len(c.token_ids) for c in out.outputs)
    for k in range(width):
        for c in out.outputs:
            if k < len(c.token_ids):
                last = k == len(c.token_ids) - 1
                steps.append(
                    (
                        Delta(
                            out.request_id,
                            c.index,
                            token_str(c.token_ids[k]),
                            [c.token_ids[k]],
                            c.finish_reason if last else None,
                            c.stop_reason if last else None,
                        ),
                        [c.logprobs[k]] if c.logprobs else [],
                    )
                )
    return steps


@pytest.fixture
def server() -> FakeServer:
    return FakeServer()


@pytest.fixture
def client(server: FakeServer) -> openai.OpenAI:
    http = httpx.Client(transport=httpx.MockTransport(server))
    return openai.OpenAI(base_url="http://spur.test/v1", api_key="x", http_client=http)


def test_client_completion_round_trip(client: openai.OpenAI, server: FakeServer) -> None:
    resp = client.completions.create(
        model=MODEL,
        prompt=["a", "b"],
        n=2,
        max_tokens=7,
        logprobs=2,
        stop=["\n"],
        seed=3,
        temperature=0.5,
        extra_body={"top_k": 5, "ignore_eos": True},
    )
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-")
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]  # prompt_index * n + i
    assert resp.usage is not None and resp.usage.prompt_tokens == 6
    assert resp.usage.completion_tokens == 12 and resp.usage.total_tokens == 18
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.tokens == ["t1 ", "t2 ", "t3 "]
    assert lp.text_offset == [0, 3, 6]
    assert lp.top_logprobs is not None and set(lp.top_logprobs[0]) == {"t1 ", "t2 "}
    params = server.sampling[-1]
    assert (params.n, params.max_tokens, params.logprobs, params.seed) == (2, 7, 2, 3)
    assert (params.stop, params.top_k, params.ignore_eos, params.temperature) == (
        ("\n",),
        5,
        True,
        0.5,
    )


def test_client_chat_round_trip(client: openai.OpenAI, server: FakeServer) -> None:
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "developer", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        ],
        n=2,
        logprobs=True,
        top_logprobs=1,
        max_completion_tokens=9,
        max_tokens=4,
    )
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    assert [c.message.role for c in resp.choices] == ["assistant", "assistant"]
    assert [c.finish_reason for c in resp.choices] == ["length", "stop"]
    content = resp.choices[1].logprobs.content  # type: ignore[union-attr]
    assert content is not None and content[0].token == "t11 "
    assert content[0].bytes == list(b"t11 ") and len(content[0].top_logprobs) == 1
    assert resp.usage is not None and resp.usage.prompt_tokens_details is not None
    assert resp.usage.prompt_tokens_details.cached_tokens == 2
    req = server.requests[-1]
    assert req.chat_messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
    ]
    assert server.sampling[-1].max_tokens == 9  # max_completion_tokens wins
    assert server.sampling[-1].logprobs == 1


def test_client_chat_stream_n2_with_usage(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "hi"}],
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    for c in chunks:  # the client does not validate; do it strictly
        ChatCompletionChunk.model_validate(c.model_dump())
    assert len({c.id for c in chunks}) == 1
    body, last = chunks[:-1], chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (3, 6)
    assert all(c.usage is None for c in body)
    for index in (0, 1):
        mine = [c.choices[0] for c in body if c.choices[0].index == index]
        assert mine[0].delta.role == "assistant" and mine[0].delta.content == ""
        assert all(ch.delta.role is None for ch in mine[1:])
        assert [ch.finish_reason for ch in mine[:-1]] == [None] * (len(mine) - 1)
        assert mine[-1].finish_reason == ("length" if index == 0 else "stop")
        text = "".join(ch.delta.content or "" for ch in mine)
        assert text == "".join(token_str(10 * index + k) for k in (1, 2, 3))


def test_client_completion_stream_with_usage_and_logprobs(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=["a", "b"],
            n=2,
            stream=True,
            logprobs=0,
            stream_options={"include_usage": True},
        )
    )
    for c in chunks:
        # openai's Completion type (shared by both modes) requires a finish_reason,
        # yet OpenAI's own streams send null until a choice ends: fill it in to
        # validate everything else.
        body = c.model_dump()
        for choice in body["choices"]:
            choice["finish_reason"] = choice["finish_reason"] or "stop"
        Completion.model_validate(body)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (6, 12)
    assert {c.choices[0].index for c in chunks[:-1]} == {0, 1, 2, 3}  # prompt_index * n + i
    zero = [c.choices[0] for c in chunks[:-1] if c.choices[0].index == 0]
    offsets = [ch.logprobs.text_offset[0] for ch in zero]  # type: ignore[index, union-attr]
    assert offsets == [0, 3, 6]  # continue across chunks
    assert zero[0].logprobs.top_logprobs == [{"t1 ": -0.5}]  # logprobs=0: the sampled one  # type: ignore[union-attr]


@pytest.mark.parametrize("chat", [False, True])
def test_client_stream_with_continuous_usage(client: openai.OpenAI, chat: bool) -> None:
    """vLLM's continuous_usage_stats: every chunk carries its choice's usage so far
    (its own prompt's tokens, its own tokens), the last one the request's total."""
    options: Any = {"include_usage": True, "continuous_usage_stats": True}
    if chat:
        messages: Any = [{"role": "user", "content": "x"}]
        stream: Any = client.chat.completions.create(
            model=MODEL, messages=messages, n=2, stream=True, stream_options=options
        )
    else:
        stream = client.completions.create(
            model=MODEL, prompt=["a", "b"], n=2, stream=True, stream_options=options
        )
    chunks = list(stream)
    per_choice: dict[int, list[int]] = {}
    for c in chunks[:-1]:
        (choice,) = c.choices
        assert c.usage is not None and c.usage.prompt_tokens == len(PROMPT_IDS)
        assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
        per_choice.setdefault(choice.index, []).append(c.usage.completion_tokens)
    assert set(per_choice) == ({0, 1} if chat else {0, 1, 2, 3})
    for counts in per_choice.values():  # 3 tokens a choice, one a chunk
        assert counts[-3:] == [1, 2, 3] and counts == sorted(counts)
    total = chunks[-1].usage
    assert chunks[-1].choices == [] and total is not None
    assert total.completion_tokens == 3 * len(per_choice)


def test_client_models_and_errors(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    assert nf.value.code == "model_not_found" and "'tiny'" in nf.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=150
        )
    assert bad.value.param == "temperature"  # type: ignore[attr-defined]
    assert "temperature=150" in bad.value.message


# -- response shapes checked against openai's types ------------------------------------------
def test_non_streaming_bodies_match_openai_types() -> None:
    out = fake_output(n=2)
    body = rs.completion_response("cmpl-1", MODEL, 1, out, token_str=token_str, num_top_logprobs=1)
    parsed = Completion.model_validate(body)
    assert parsed.choices[1].text == "t11 t12 t13 " and parsed.usage.total_tokens == 9  # type: ignore[union-attr]
    assert body["choices"][1]["stop_reason"] == "\n"  # vLLM's extra field
    chat = rs.chat_response("chatcmpl-1", MODEL, 1, out, token_str=token_str, num_top_logprobs=2)
    parsed_chat = ChatCompletion.model_validate(chat)
    assert parsed_chat.choices[0].message.content == "t1 t2 t3 "
    # no token_str -> no logprobs, still valid
    plain = rs.chat_response("chatcmpl-2", MODEL, 1, out, prompt_tokens=11)
    assert ChatCompletion.model_validate(plain).usage.prompt_tokens == 11  # type: ignore[union-attr]
    assert plain["choices"][0]["logprobs"] is None
    models = rs.models_response([MODEL, rs.ModelCard(id="other", owned_by="me")])
    assert [Model.model_validate(m).id for m in models["data"]] == [MODEL, "other"]


def test_logprob_formats_and_non_finite_values() -> None:
    lps = [Logprobs(-math.inf, [(99, -math.inf), (3, -1.0)]), Logprobs(-0.25, [(3, -0.25)])]
    offsets = rs.TextOffsets()
    offsets.take(b"abcd")  # a stream's earlier chunk: 4 characters
    comp = rs.completion_logprobs([99, 3], lps, token_str, offsets=offsets, num_top=1)
    assert comp == {
        "tokens": ["é", "t3 "],
        "token_logprobs": [rs.MIN_LOGPROB, -0.25],
        "top_logprobs": [{"é": rs.MIN_LOGPROB}, {"t3 ": -0.25}],
        "text_offset": [4, 5],
    }
    chat = rs.chat_logprobs([99], lps[:1], token_str)
    assert chat["content"][0]["bytes"] == [0xC3, 0xA9]
    assert [t["token"] for t in chat["content"][0]["top_logprobs"]] == ["é", "t3 "]
    json.loads(rs.json_bytes(chat))  # finite, valid JSON
    with pytest.raises(ValueError):
        rs.chat_logprobs([1, 2], lps[:1], token_str)
    # with the tokens' own bytes: a token holding the first byte of "é" says so
    halves = rs.TokenStrings(lambda t: "\ufffd", lambda t: bytes([0xC3 if t == 99 else 0xA9]))
    content = rs.chat_logprobs([99, 3], lps, halves, num_top=2)["content"]
    assert [c["bytes"] for c in content] == [[0xC3], [0xA9]]
    assert bytes(b for c in content for b in c["bytes"]).decode() == "é"
    assert content[0]["token"] == "\ufffd" and content[0]["top_logprobs"][0]["bytes"] == [0xC3]


def test_text_offsets_index_the_text_of_split_characters_and_held_back_streams() -> None:
    """OpenAI's text_offset[i] is where token i starts in the choice's text. Counted on
    the tokens' bytes: the halves of a split character start where it starts and the
    next token after it. A stream counts the same, though the text it sent so far is
    shorter (held back for a stop string): the same offsets as the plain answer."""
    pieces = {1: b"a", 2: b" \xf0\x9f", 3: b"\x98\x80", 4: b" c", 5: b" d"}
    strs = rs.TokenStrings(lambda t: pieces[t].decode(errors="replace"), pieces.__getitem__)
    lps = [Logprobs(-1.0, []) for _ in pieces]
    plain = rs.completion_logprobs(list(pieces), lps, strs, num_top=0)
    assert b"".join(pieces.values()).decode() == "a \U0001f600 c d"
    assert plain["text_offset"] == [0, 1, 2, 3, 5]
    stream = rs.ChunkStream(
        chat=False, request_id="c", model=MODEL, created=1, n=1, token_str=strs, num_top_logprobs=0
    )
    got = []
    for ids, text in [([1, 2], "a"), ([3], ""), ([4], " \U0001f600 c"), ([5], " d")]:
        for chunk in stream.update(Delta("r", 0, text, ids, None), lps[: len(ids)]):
            got += chunk["choices"][0]["logprobs"]["text_offset"]
    assert got == plain["text_offset"]


def test_the_sampled_token_keeps_its_own_logprob_among_same_spelled_ones() -> None:
    """Two ids that spell the same string (two halves of characters both read
    U+FFFD): the sampled one's logprob is the one its top entry shows."""
    strs = rs.TokenStrings(lambda t: "\ufffd", lambda t: bytes([0xC3 if t == 7 else 0xA9]))
    comp = rs.completion_logprobs([8], [Logprobs(-0.1, [(7, -0.05), (8, -0.1)])], strs)
    assert comp["top_logprobs"] == [{"\ufffd": -0.1}] and comp["token_logprobs"] == [-0.1]


def test_chunk_stream_skips_empty_deltas_and_finished_choices() -> None:
    s = rs.ChunkStream(chat=True, request_id="c", model=MODEL, created=1, n=1)
    assert s.update(Delta("r", 0, "", [4], None)) == []  # text held back: nothing yet
    first = s.update(Delta("r", 0, "ab", [5], None))
    assert [c["choices"][0]["delta"] for c in first] == [
        {"role": "assistant", "content": ""},
        {"content": "ab"},
    ]
    last = s.update(Delta("r", 0, "", [], "stop", 7))
    assert last[0]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "stop",
        "stop_reason": 7,
    }
    assert s.finished and s.update(Delta("r", 0, "late", [1], None)) == []
    assert s.finish() == [] and s.completion_tokens == 2
    assert "usage" not in last[0]  # only with include_usage


def test_sse_framing() -> None:
    assert rs.sse({"a": "é", "b": [1]}) == 'data: {"a":"é","b":[1]}\n\n'.encode()
    assert rs.sse("x\ny") == b"data: x\ndata: y\n\n"
    assert rs.sse_done() == b"data: [DONE]\n\n"
    err = ProtocolError(400, "bad", param="n")
    assert rs.sse(error_body(err)).startswith(b'data: {"error":{"message":"bad"')
    # cached_tokens is always reported, 0 included (clients read it unconditionally)
    assert rs.usage(3, 4) == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


# -- request parsing -------------------------------------------------------------------------
def chat_body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields}


def test_every_completion_field_maps_to_sampling_params() -> None:
    req = rq.parse_request(
        rq.CompletionRequest,
        {
            "prompt": [1, 2],
            "n": 3,
            "best_of": 3,
            "max_tokens": 20,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 40,
            "min_p": 0.05,
            "seed": 11,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "repetition_penalty": 1.1,
            "min_tokens": 2,
            "stop": "END",
            "stop_token_ids": [0, 2],
            "ignore_eos": True,
            "skip_special_tokens": False,
            "logprobs": 4,
            "user": "u1",
            "priority": -1,
            "cache_salt": "s",
            "echo": False,
            "suffix": None,
        },
    )
    p = req.to_sampling_params(default_max_tokens=99)
    assert p == SamplingParams(
        n=3,
        max_tokens=20,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=11,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        min_tokens=2,
        stop=("END",),
        stop_token_ids=(0, 2),
        ignore_eos=True,
        skip_special_tokens=False,
        logprobs=4,
    )
    assert p.extra == {"user": "u1", "priority": -1, "cache_salt": "s"}
    assert req.prompts() == [[1, 2]] and req.unknown_fields == []


def test_chat_fields_and_defaults() -> None:
    req = rq.parse_request(
        rq.ChatCompletionRequest,
        chat_body(
            max_tokens=5,
            logprobs=True,
            top_logprobs=3,
            stop=["a", "b"],
            seed=1,
            response_format={"type": "text"},
            tool_choice="none",
            parallel_tool_calls=False,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
        ),
    )
    p = req.to_sampling_params(default_max_tokens=50)
    assert (p.max_tokens, p.logprobs, p.stop, p.seed) == (5, 3, ("a", "b"), 1)
    assert req.include_usage and req.num_top_logprobs == 3
    bare = rq.parse_request(rq.ChatCompletionRequest, chat_body())
    p = bare.to_sampling_params(default_max_tokens=50)
    assert (p.max_tokens, p.logprobs, p.n, p.temperature) == (50, None, 1, 1.0)
    assert not bare.include_usage and bare.num_top_logprobs is None
    # completions: OpenAI's default of 16, null -> the server default
    assert rq.CompletionRequest(prompt="x").to_sampling_params(50).max_tokens == 16
    assert rq.CompletionRequest(prompt="x", max_tokens=None).to_sampling_params(50).max_tokens == 50


def test_model_sampling_defaults_fill_what_the_request_leaves_out() -> None:
    """A lane's sampling defaults (the model's generation_config, as vLLM applies them):
    they fill omitted fields, a request's own values win, the model's max_new_tokens
    replaces the server's fallback, and an override's cap bounds every request."""
    from spur.actors.generation_config import SamplingDefaults

    model = SamplingDefaults({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 7})
    bare = rq.parse_request(rq.ChatCompletionRequest, chat_body())
    p = bare.to_sampling_params(default_max_tokens=50, defaults=model)
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (0.6, 0.95, 20, 0.0, 7)
    own = rq.parse_request(
        rq.ChatCompletionRequest, chat_body(temperature=0, top_k=-1, max_completion_tokens=30)
    )
    p = own.to_sampling_params(default_max_tokens=50, defaults=model)
    assert (p.temperature, p.top_p, p.top_k, p.max_tokens) == (0.0, 0.95, 0, 30)
    # completions: OpenAI's default of 16 is the request's own; null takes the model's
    assert rq.CompletionRequest(prompt="x").to_sampling_params(50, model).max_tokens == 16
    null = rq.CompletionRequest(prompt="x", max_tokens=None)
    assert null.to_sampling_params(50, model).max_tokens == 7
    # an override's max_new_tokens caps explicit values too (vLLM's rule)
    capped = SamplingDefaults({"max_tokens": 7}, max_tokens_cap=7)
    assert own.to_sampling_params(50, capped).max_tokens == 7
    assert rq.CompletionRequest(prompt="x").to_sampling_params(50, capped).max_tokens == 7
    # a request's min_tokens above the capped max_tokens is the request's error, named
    over = rq.parse_request(rq.ChatCompletionRequest, chat_body(min_tokens=9))
    with pytest.raises(ProtocolError) as info:
        over.to_sampling_params(50, capped)
    assert info.value.param == "min_tokens" and "max_tokens=7" in info.value.message
    # no defaults: what it was
    assert bare.to_sampling_params(50).temperature == 1.0


def test_prompt_shapes() -> None:
    def prompts(p: Any) -> list[Any]:
        return rq.parse_request(rq.CompletionRequest, {"prompt": p}).prompts()

    assert prompts("hi") == ["hi"]
    assert prompts(["a", "b"]) == ["a", "b"]
    assert prompts([1, 2]) == [[1, 2]]
    assert prompts([[1], [2, 3]]) == [[1], [2, 3]]


def test_unknown_fields_are_ignored_and_recorded() -> None:
    body = chat_body(metadata={"k": "v"}, store=False, reasoning_effort="low", top_k=3)
    body["messages"][0]["extra_thing"] = 1  # nested unknowns are ignored silently
    req = rq.parse_request(rq.ChatCompletionRequest, json.dumps(body).encode())
    assert req.unknown_fields == ["metadata", "reasoning_effort", "store"]
    assert req.to_sampling_params(8).top_k == 3


def test_chat_messages_for_the_template() -> None:
    req = rq.parse_request(
        rq.ChatCompletionRequest,
        {
            "messages": [
                {"role": "system", "content": "s"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {"role": "assistant", "content": None},
                {"role": "tool", "content": "r", "tool_call_id": "1"},
            ]
        },
    )
    assert req.chat_messages() == [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""},
        {"role": "tool", "content": "r", "tool_call_id": "1"},  # the template's to use
    ]
    assert req.model is None and rq.resolve_model(req.model, [MODEL, "b"]) == MODEL


BAD_REQUESTS = [
    # (endpoint, body, param, words in the message)
    ("completions", b'{"prompt": "x",', None, "not valid JSON"),
    ("completions", b'{"prompt": "x", "temperature": NaN}', None, "NaN"),
    ("completions", b"[1, 2]", None, "JSON object"),
    ("completions", b"{}", "prompt", "field required"),
    ("completions", {"prompt": ""}, "prompt", "empty"),
    ("completions", {"prompt": []}, "prompt", "empty"),
    ("completions", {"prompt": 3}, "prompt", "token ids"),
    ("completions", {"prompt": [1, -1]}, "prompt[1]", "in [0, 2147483647]"),
    # past 32 bits the prompt's block hashes could not be made: a 400, not a 500
    ("completions", {"prompt": [[1], [2, 2**32]]}, "prompt[1][1]", "in [0, 2147483647]"),
    ("completions", {"prompt": [[1], []]}, "prompt[1]", "empty"),
    ("completions", {"prompt": [1, True]}, "prompt", "must be a string"),
    ("completions", {"prompt": "x", "echo": True}, "echo", "not supported"),
    ("completions", {"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "-1"),
    ("chat", chat_body(truncate_prompt_tokens=-2), "truncate_prompt_tokens", "-1"),
    ("completions", {"prompt": "x", "suffix": "y"}, "suffix", "not supported"),
    ("completions", {"prompt": "x", "best_of": 2}, "best_of", "equal to n"),
    ("completions", {"prompt": "x", "logprobs": 6}, "logprobs", "5"),
    ("completions", {"prompt": "x", "max_tokens": "9"}, "max_tokens", "integer"),
    ("completions", {"prompt": "x", "n": 1.5}, "n", "integer"),
    ("completions", {"prompt": "x", "stream": "yes"}, "stream", "boolean"),
    ("completions", {"prompt": "x", "stop": ["a"] * 5}, "stop", "at most 4"),
    ("completions", {"prompt": "x", "stop": [1]}, "stop", "strings"),
    ("completions", {"prompt": "x", "stop": "a" * 1025}, "stop", "more than 1,024"),
    ("chat", chat_body(stop=["a", "\u2603" * 1025]), "stop", "1,025 characters"),
    ("completions", {"prompt": "x", "logit_bias": {"1": 2.0}}, "logit_bias", "not supported"),
    ("chat", {"messages": []}, "messages", "at least one"),
    ("chat", {"messages": "hi"}, "messages", "a JSON array"),
    ("chat", chat_body(stream=True, stream_options=1), "stream_options", "a JSON object"),
    ("chat", chat_body(model=5), "model", "string"),
    ("chat", {"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role", "'user'"),
    ("chat", {"messages": [{"content": "x"}]}, "messages[0].role", "required"),
    ("chat", {"messages": [{"role": "user"}]}, "messages[0].content", "needs its content"),
    ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "string"),
    (
        "chat",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content[0].type",
        "text only",
    ),
    (
        "chat",
        {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}]},
        "messages[0].tool_calls",
        "not supported",
    ),
    ("chat", chat_body(top_logprobs=2), "top_logprobs", "logprobs=true"),
    ("chat", chat_body(logprobs=True, top_logprobs=21), "top_logprobs", "20"),
    ("chat", chat_body(tools=[{"type": "function"}]), "tools", "not supported"),
    ("chat", chat_body(tool_choice="required"), "tool_choice", "not supported"),
    (
        "chat",
        chat_body(response_format={"type": "json_schema", "json_schema": {}}),
        "response_format.type",
        "structured output",
    ),
    ("chat", chat_body(stream_options={"include_usage": True}), "stream_options", "stream=true"),
    ("completions", {"prompt": "x", "prompt_logprobs": 1}, "prompt_logprobs", "not supported"),
    # vLLM's and OpenAI's fields that would change the output: refused, never ignored
    ("completions", {"prompt": "x", "guided_choice": ["a"]}, "guided_choice", "structured"),
    ("chat", chat_body(structured_outputs={"json": {}}), "structured_outputs", "structured"),
    ("chat", chat_body(guided_json={"type": "object"}), "guided_json", "structured"),
    ("completions", {"prompt": "x", "allowed_token_ids": [5]}, "allowed_token_ids", "remove"),
    ("completions", {"prompt": "x", "bad_words": ["no"]}, "bad_words", "not supported"),
    ("completions", {"prompt": "x", "use_beam_search": True}, "use_beam_search", "beam"),
    ("chat", chat_body(echo=True), "echo", "not supported"),
    ("chat", chat_body(modalities=["text", "audio"]), "modalities", '["text"]'),
    ("chat", chat_body(continue_final_message=True), "continue_final_message", "add_generation"),
]


def test_refused_fields_are_accepted_when_unset() -> None:
    """null, false, empty and a text-only modalities ask for nothing this server lacks."""
    body = chat_body(
        guided_json=None, use_beam_search=False, bad_words=[], echo=False, modalities=["text"]
    )
    req = rq.parse_request(rq.ChatCompletionRequest, body)
    assert "use_beam_search" in req.unknown_fields


@pytest.mark.parametrize(("endpoint", "body", "param", "words"), BAD_REQUESTS)
def test_bad_requests_name_the_field(endpoint: str, body: Any, param: Any, words: str) -> None:
    cls = rq.ChatCompletionRequest if endpoint == "chat" else rq.CompletionRequest
    with pytest.raises(ProtocolError) as info:
        rq.parse_request(cls, body)
    exc = info.value
    assert exc.status == 400 and exc.param == param
    assert words in exc.message
    if param:
        assert exc.message.startswith(param + ":")
    assert error_body(exc)["error"]["type"] == "invalid_request_error"


SAMPLING_ERRORS = [
    # engine-side ranges, reported with the request's field names
    ("completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "x", "n": 0}, "n"),
    ("completions", {"prompt": "x", "seed": 2**63}, "seed"),  # beyond a signed 64-bit
    ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "x", "min_tokens": 50}, "min_tokens"),
    ("completions", {"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    ("completions", {"prompt": "x", "stop": ["", "a"]}, "stop"),
    ("completions", {"prompt": "x", "stop_token_ids": [-3]}, "stop_token_ids"),
    ("chat", chat_body(max_completion_tokens=0, max_tokens=3), "max_completion_tokens"),
    ("chat", chat_body(max_tokens=0), "max_tokens"),
    ("chat", chat_body(repetition_penalty=0.0), "repetition_penalty"),
    ("chat", chat_body(repetition_penalty=float("inf")), "repetition_penalty"),
    ("chat", chat_body(min_p=1.5), "min_p"),
]


@pytest.mark.parametrize(("endpoint", "body", "param"), SAMPLING_ERRORS)
def test_sampling_range_errors_name_the_openai_field(endpoint: str, body: Any, param: str) -> None:
    cls = rq.ChatCompletionRequest if endpoint == "chat" else rq.CompletionRequest
    req = rq.parse_request(cls, body)
    with pytest.raises(ProtocolError) as info:
        req.to_sampling_params(default_max_tokens=16)
    assert info.value.status == 400 and info.value.param == param
    assert param in info.value.message


def test_tokenize_and_detokenize() -> None:
    t = rq.parse_request(rq.TokenizeRequest, {"model": MODEL, "prompt": "hi", "x": 1})
    assert not t.is_chat and t.special_tokens and t.unknown_fields == ["x"]
    c = rq.parse_request(
        rq.TokenizeRequest,
        {"messages": [{"role": "developer", "content": "x"}], "add_generation_prompt": False},
    )
    assert c.is_chat and not c.special_tokens and not c.add_generation_prompt
    assert c.chat_messages() == [{"role": "system", "content": "x"}]
    for body in ({}, {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}):
        with pytest.raises(ProtocolError, match="exactly one of prompt or messages"):
            rq.parse_request(rq.TokenizeRequest, body)
    assert rs.tokenize_response([1, 2], 64) == {
        "count": 2,
        "max_model_len": 64,
        "tokens": [1, 2],
        "token_strs": None,  # vLLM's model dump carries it, null unless asked for
    }
    d = rq.parse_request(rq.DetokenizeRequest, {"tokens": [1, 2]})
    assert d.tokens == [1, 2] and rs.detokenize_response("ab") == {"prompt": "ab"}
    with pytest.raises(ProtocolError) as info:
        rq.parse_request(rq.DetokenizeRequest, {"tokens": [1, -2]})
    assert info.value.param == "tokens[1]"


# -- errors ----------------------------------------------------------------------------------
def test_error_constructors() -> None:
    nf = model_not_found("gpt-9", ["tiny", "big"])
    assert nf.status == 404 and nf.param == "model" and "'tiny', 'big'" in nf.message
    assert error_body(nf) == {
        "error": {
            "message": nf.message,
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }
    with pytest.raises(ProtocolError) as info:
        rq.resolve_model("gpt-9", ["tiny"])
    assert info.value.status == 404
    qf = queue_full(2.2)
    assert qf.status == 429 and qf.headers == {"Retry-After": "3"}
    assert queue_full(0.01).headers["Retry-After"] == "1"
    su = service_unavailable("all engines are down", retry_after_s=5)
    assert su.status == 503 and su.headers["Retry-After"] == "5"
    assert malformed_json("Expecting value").code == "invalid_json"
    rejected = RequestRejected("prompt has 9,312 tokens, max_model_len is 8,192: shorten it")
    rr = from_request_rejected(rejected, param="messages")
    assert rr.status == 400 and rr.param == "messages" and "9,312" in rr.message
    assert rr.code == "context_length_exceeded"
    ie = internal_error(KeyError("secret"))
    assert ie.status == 500 and "secret" not in ie.message
    with pytest.raises(ValueError):
        ProtocolError(200, "ok")


def test_every_published_request_example_is_accepted():
    """/openapi.json shows one example per request body (REQUEST_EXAMPLES): each must
    parse as its route's request, with any served model narrowed in."""
    schemas = rq.request_schemas(["tiny"])
    assert set(rq.REQUEST_EXAMPLES) == set(rq.REQUEST_MODELS)
    for path, cls in rq.REQUEST_MODELS.items():
        (example,) = schemas[cls.__name__]["examples"]
        assert example == rq.REQUEST_EXAMPLES[path]
        rq.parse_request(cls, example)


def test_vllm_extras_include_stop_str_and_a_negative_seed() -> None:
    """include_stop_str_in_output reaches SamplingParams (it used to be dropped as an
    unknown field); a negative seed is valid (vLLM takes any signed 64-bit seed)."""
    body = {"prompt": "x", "include_stop_str_in_output": True, "seed": -(2**63), "n": 2}
    req = rq.parse_request(rq.CompletionRequest, body)
    assert req.unknown_fields == []
    params = req.to_sampling_params(default_max_tokens=16)
    assert params.include_stop_str_in_output is True and params.seed == -(2**63)
    # any positive repetition_penalty, as vLLM (it used to stop at 2)
    body = {"prompt": "x", "repetition_penalty": 3.5}
    assert (
        rq.parse_request(rq.CompletionRequest, body)
        .to_sampling_params(default_max_tokens=16)
        .repetition_penalty
        == 3.5
    )
    assert (
        rq.parse_request(rq.CompletionRequest, {"prompt": "x"})
        .to_sampling_params(default_max_tokens=16)
        .include_stop_str_in_output
        is False
    )


def test_max_tokens_must_fit_the_room_and_null_means_the_room() -> None:
    """vLLM: a request's own max tokens beyond max_model_len minus the prompt is a 400;
    a completion's explicit null max_tokens is the room (absent: OpenAI's 16)."""
    chat = rq.parse_request(rq.ChatCompletionRequest, chat_body(max_completion_tokens=100))
    with pytest.raises(ProtocolError) as info:
        chat.check_room(150, 200)
    assert (info.value.status, info.value.param) == (400, "max_completion_tokens")
    assert info.value.code == "context_length_exceeded" and "100 > 200 - 150" in info.value.message
    chat.check_room(100, 200)  # fits exactly
    with pytest.raises(ProtocolError) as info:  # no room at all: refused before any engine
        chat.check_room(250, 200)
    assert (info.value.param, info.value.code) == ("messages", "context_length_exceeded")
    assert "prompt has 250 tokens, max_model_len is 200" in info.value.message
    rq.parse_request(rq.ChatCompletionRequest, chat_body()).check_room(199, 200)  # no own value
    null = rq.parse_request(rq.CompletionRequest, {"prompt": "x", "max_tokens": None})
    null.check_room(199, 200)
    assert null.to_sampling_params(default_max_tokens=40).max_tokens == 40
    absent = rq.parse_request(rq.CompletionRequest, {"prompt": "x"})
    assert absent.to_sampling_params(default_max_tokens=40).max_tokens == 16


def test_chat_template_options_of_vllm() -> None:
    body = chat_body(
        messages=[{"role": "user", "content": "hi", "name": "bob"}],
        chat_template_kwargs={"enable_thinking": False},
        add_special_tokens=True,
    )
    req = rq.parse_request(rq.ChatCompletionRequest, body)
    assert req.unknown_fields == []
    assert req.chat_messages() == [{"role": "user", "content": "hi", "name": "bob"}]
    assert req.chat_template_kwargs == {"enable_thinking": False} and req.add_special_tokens
    assert not rq.parse_request(rq.ChatCompletionRequest, chat_body()).add_special_tokens
    raw = {"prompt": "x", "add_special_tokens": False}
    completion = rq.parse_request(rq.CompletionRequest, raw)
    assert completion.unknown_fields == [] and completion.add_special_tokens is False
    with pytest.raises(ProtocolError) as info:
        rq.parse_request(
            rq.ChatCompletionRequest, chat_body(chat_template_kwargs={"tokenize": True})
        )
    assert info.value.status == 400 and "chat_template_kwargs" in (info.value.param or "")


@pytest.mark.parametrize(
    ("cls", "body", "param"),
    [
        (rq.CompletionRequest, '{"prompt": "Hi \\ud800"}', "prompt"),
        (rq.CompletionRequest, '{"prompt": "ok", "stop": ["\\udc00"]}', "stop[0]"),
        (
            rq.ChatCompletionRequest,
            '{"messages": [{"role": "user", "content": "a\\udc00"}]}',
            "messages[0].content",
        ),
        (rq.TokenizeRequest, '{"prompt": "x\\ud800"}', "prompt"),
    ],
)
def test_a_lone_surrogate_is_a_400_naming_the_field(cls: Any, body: str, param: str) -> None:
    """Valid JSON can spell a lone UTF-16 surrogate, which no tokenizer takes (it
    raised TypeError: a 500); a surrogate pair is one character and passes."""
    with pytest.raises(ProtocolError) as info:
        rq.parse_request(cls, body)
    assert (info.value.status, info.value.param) == (400, param)
    assert "lone surrogate" in info.value.message
    ok = rq.parse_request(rq.CompletionRequest, '{"prompt": "smile \\ud83d\\ude00"}')
    assert ok.prompt == "smile \U0001f600"


@pytest.mark.parametrize("top", [0, 3])
def test_top_logprobs_needs_logprobs_even_at_zero(top: int) -> None:
    """vLLM's check: top_logprobs set (0 included) without logprobs=true is a 400."""
    with pytest.raises(ProtocolError) as info:
        rq.parse_request(rq.ChatCompletionRequest, chat_body(top_logprobs=top))
    assert (info.value.status, info.value.param) == (400, "top_logprobs")
    body = chat_body(top_logprobs=top, logprobs=True)
    assert rq.parse_request(rq.ChatCompletionRequest, body).top_logprobs == top
    assert (
        rq.parse_request(rq.ChatCompletionRequest, chat_body(top_logprobs=None)).logprobs is False
    )
