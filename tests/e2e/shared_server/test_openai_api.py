"""The OpenAI API of a running `spur serve`, through the official `openai` client.

All requests go to lane "tiny" (a random 2-layer Llama with SmolLM2's tokenizer):
its text is gibberish, but deterministic under greedy decoding or a seed, which
is what these tests rely on.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from e2e.conftest import wait_for

pytestmark = pytest.mark.slow

MODEL = "tiny"
IGNORE_EOS = {"ignore_eos": True}  # a random model may sample EOS at any step


def tokenize(http: Any, **body: Any) -> dict[str, Any]:
    r = http.post("/tokenize", json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return r.json()


def complete(client: Any, prompt: str, **kwargs: Any) -> Any:
    kwargs.setdefault("max_tokens", 12)
    kwargs.setdefault("temperature", 0)
    extra_body = {**IGNORE_EOS, **kwargs.pop("extra_body", {})}
    return client.completions.create(model=MODEL, prompt=prompt, extra_body=extra_body, **kwargs)


def chat(client: Any, content: str, **kwargs: Any) -> Any:
    kwargs.setdefault("max_tokens", 12)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        extra_body=IGNORE_EOS,
        **kwargs,
    )


# -- plain endpoints -----------------------------------------------------------------------
def test_models_health_version(openai_client: Any, http: Any, spur_server: Any) -> None:
    served = [m for lane in spur_server.config["lanes"] for m in lane["served_model_names"]]
    assert [m.id for m in openai_client.models.list().data] == served
    limits = {m["id"]: m["max_model_len"] for m in http.get("/v1/models").json()["data"]}
    for name, limit in limits.items():  # vLLM's field: the lane's, as /tokenize says
        assert limit == tokenize(http, model=name, prompt="x")["max_model_len"] > 0, name
    assert http.get("/health").json() == {"status": "ok"}
    assert http.get("/version").json()["version"]
    # OpenAI's retrieve: one card per served name (it was "no such route"), 404 otherwise
    for name in served:
        card = openai_client.models.retrieve(name)
        assert (card.id, card.object, card.max_model_len) == (name, "model", limits[name])
    missing = http.get("/v1/models/no-such-model")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_tokenize_detokenize_round_trip(http: Any) -> None:
    out = tokenize(http, prompt="Hello, world!")
    assert out["count"] == len(out["tokens"]) > 0 and out["max_model_len"] == 2048
    r = http.post("/detokenize", json={"model": MODEL, "tokens": out["tokens"]})
    assert r.status_code == 200 and r.json()["prompt"] == "Hello, world!"


# -- completions and chat, streamed and not --------------------------------------------------
def test_completion_streamed_equals_non_streamed(openai_client: Any, http: Any) -> None:
    prompt = "The quick brown fox"
    full = complete(openai_client, prompt)
    assert full.object == "text_completion" and full.model == MODEL
    (choice,) = full.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    assert full.usage.completion_tokens == 12
    assert full.usage.prompt_tokens == tokenize(http, prompt=prompt)["count"]
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12

    chunks = list(complete(openai_client, prompt, stream=True))
    assert len(chunks) > 1 and all(c.id == chunks[0].id for c in chunks)
    assert all(c.object == "text_completion" for c in chunks)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert text == choice.text
    assert finishes[-1] == "length" and set(finishes[:-1]) <= {None}


def test_chat_streamed_equals_non_streamed(openai_client: Any) -> None:
    full = chat(openai_client, "Tell me something.")
    assert full.object == "chat.completion"
    (choice,) = full.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length" and full.usage.completion_tokens == 12

    chunks = list(chat(openai_client, "Tell me something.", stream=True))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_2_gives_two_choices(openai_client: Any) -> None:
    out = complete(openai_client, "Once upon a time", n=2, temperature=1.0, max_tokens=8)
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert all(c.finish_reason == "length" and c.text for c in out.choices)
    assert out.usage.completion_tokens == 16

    out = chat(openai_client, "Hi!", n=2, temperature=1.0, max_tokens=8)
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert all(c.message.content for c in out.choices) and out.usage.completion_tokens == 16

    texts = {0: "", 1: ""}
    finished = {}
    for chunk in complete(openai_client, "Once upon a time", n=2, temperature=1.0, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason is not None:
                finished[c.index] = c.finish_reason
    assert finished == {0: "length", 1: "length"} and all(texts.values())


def _stop_string(text: str) -> str:
    """4 printable ASCII characters from the second half of `text` (so that the
    stopped output is usually a non-empty prefix)."""
    for start in range(len(text) // 2, len(text) - 3):
        window = text[start : start + 4]
        if window.isascii() and window.isprintable() and window.strip() == window:
            return window
    raise AssertionError(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_stop_string_ends_the_text_before_it(openai_client: Any, stream: bool) -> None:
    prompt = "A list of words:"
    full = complete(openai_client, prompt, max_tokens=24).choices[0].text
    stop = _stop_string(full)
    expected = full[: full.index(stop)]
    if stream:
        chunks = list(complete(openai_client, prompt, max_tokens=24, stop=[stop], stream=True))
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        finish = chunks[-1].choices[0].finish_reason
    else:
        choice = complete(openai_client, prompt, max_tokens=24, stop=[stop]).choices[0]
        text, finish = choice.text, choice.finish_reason
        assert (choice.model_extra or {}).get("stop_reason") == stop
    assert text == expected and stop not in text
    assert finish == "stop"
    # vLLM's include_stop_str_in_output reaches the engine: the text ends with the stop
    kept = complete(
        openai_client,
        prompt,
        max_tokens=24,
        stop=[stop],
        extra_body={"include_stop_str_in_output": True},
    ).choices[0]
    assert kept.text == expected + stop and kept.finish_reason == "stop"


def test_seed_reproducible_and_seeds_differ(openai_client: Any) -> None:
    def sample(seed: int) -> str:
        out = complete(openai_client, "Random words:", temperature=1.0, seed=seed, max_tokens=10)
        return out.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    others = [sample(seed) for seed in (1, 2, 3)]
    assert any(text != first for text in others), (first, others)
    # chat goes through the same sampler path
    a = chat(openai_client, "Pick a word.", temperature=1.0, seed=7, max_tokens=10)
    b = chat(openai_client, "Pick a word.", temperature=1.0, seed=7, max_tokens=10)
    assert a.choices[0].message.content == b.choices[0].message.content


# -- logprobs ------------------------------------------------------------------------------
def test_completion_logprobs(openai_client: Any) -> None:
    out = complete(openai_client, "Numbers:", logprobs=2, max_tokens=8)
    (choice,) = out.choices
    lp = choice.logprobs
    n = out.usage.completion_tokens
    assert n == 8
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0 and math.isfinite(logprob)
        # 2 alternatives, plus the sampled token if it is not among them
        assert 1 <= len(top) <= 3 and token in top
        # greedy: the sampled token is the most likely one
        assert math.isclose(logprob, max(top.values()), abs_tol=1e-4)
        assert all(v <= 0 for v in top.values())


def test_chat_logprobs_and_top_logprobs(openai_client: Any) -> None:
    out = chat(openai_client, "Count.", logprobs=True, top_logprobs=2, max_tokens=8)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 8
    for item in content:
        assert item.logprob <= 0
        if "\ufffd" not in item.token:  # else the token holds part of a character
            assert item.bytes == list(item.token.encode("utf-8"))
        tops = [t.logprob for t in item.top_logprobs]
        assert len(tops) == 2 and tops == sorted(tops, reverse=True)
        assert math.isclose(item.logprob, tops[0], abs_tol=1e-4)  # greedy
    # the tokens' bytes join into the text (OpenAI: "must be combined to generate the
    # correct text representation"), unless a special token (not in the text) came
    if not any(i.token.startswith("<|") and i.token.endswith("|>") for i in content):
        joined = bytes(b for i in content for b in i.bytes).decode("utf-8", "replace")
        assert joined == out.choices[0].message.content
    # logprobs without top_logprobs: the sampled token only
    out = chat(openai_client, "Count.", logprobs=True, max_tokens=4)
    assert [len(i.top_logprobs) for i in out.choices[0].logprobs.content] == [0] * 4
    assert chat(openai_client, "Count.", max_tokens=4).choices[0].logprobs is None


# -- usage in streams ----------------------------------------------------------------------
def test_stream_include_usage(openai_client: Any, http: Any) -> None:
    messages = [{"role": "user", "content": "How many tokens?"}]
    chunks = list(
        openai_client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=IGNORE_EOS,
        )
    )
    *body, last = chunks
    assert last.choices == [] and last.usage is not None
    assert all(c.usage is None for c in body) and body[-1].choices[0].finish_reason == "length"
    prompt_tokens = tokenize(http, messages=messages)["count"]
    assert last.usage.prompt_tokens == prompt_tokens
    assert last.usage.completion_tokens == 6
    assert last.usage.total_tokens == prompt_tokens + 6

    chunks = list(
        complete(
            openai_client,
            "Usage:",
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    # without include_usage no chunk carries usage
    chunks = list(complete(openai_client, "Usage:", max_tokens=5, stream=True))
    assert all(c.usage is None for c in chunks)


# -- prefix cache --------------------------------------------------------------------------
def _routing(http: Any) -> tuple[int, int]:
    """Lane tiny's routing decisions so far, and their matched blocks in all."""
    r = http.get("/admin/routing").json()
    decisions = sum(d["count"] for d in r["decisions"] if d["lane"] == MODEL)
    return decisions, int(r["matched_blocks_sum"].get(MODEL, 0))


def test_repeated_prompt_is_served_from_the_prefix_cache(openai_client: Any, http: Any) -> None:
    prompt = "In a land far away, " * 8  # several full 16-token blocks
    num_prompt = tokenize(http, prompt=prompt)["count"]
    assert num_prompt >= 32
    hits_before = http.get("/admin/engines").json()[MODEL]["prefix_hits_total"]
    decisions_before, matched_before = _routing(http)
    first = complete(openai_client, prompt, max_tokens=2)
    second = complete(openai_client, prompt, max_tokens=2)
    assert second.choices[0].text == first.choices[0].text
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < num_prompt and cached % 16 == 0
    assert http.get("/admin/engines").json()[MODEL]["prefix_hits_total"] > hits_before

    # The lane has one replica, so the router does not wait for the index's ranking;
    # the index still counts both decisions and recorded the first request's chain
    # at the replica, so that the second matched at least its full blocks.
    def counted() -> tuple[int, int] | None:
        decisions, matched = _routing(http)
        return (decisions, matched) if decisions >= decisions_before + 2 else None

    _, matched = wait_for("both decisions in /admin/routing", counted, 30)
    assert matched - matched_before >= num_prompt // 16


# -- several prompts in one request ----------------------------------------------------------
def test_multi_prompt_completion(openai_client: Any, spur_server: Any) -> None:
    """Prompts of one request are opened concurrently (each its own engine request,
    none waiting for another's first token) and each answer equals the prompt's
    own. Every call has a deadline: Serve 2.60 used to leave the second of two
    concurrent handle calls of one HTTP request unrouted forever (they shared an
    internal request id), which hung such a request."""
    import asyncio

    import httpx

    prompts = ["One two three", "Alpha beta", "The quick brown fox", "Hello there"]
    both = complete(openai_client, prompts, max_tokens=8, timeout=60)
    alone = [complete(openai_client, p, max_tokens=8, timeout=60).choices[0].text for p in prompts]
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == alone
    assert both.usage is not None and both.usage.completion_tokens == 4 * 8
    streamed = complete(openai_client, prompts, max_tokens=8, stream=True, timeout=60)
    texts = ["", "", "", ""]
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == alone

    async def busy(num_prompts: int) -> httpx.Response:
        body = {
            "model": "busy",
            "prompt": [f"Count with me {i}:" for i in range(num_prompts)],
            "max_tokens": 50,
            "ignore_eos": True,
        }
        async with httpx.AsyncClient(base_url=spur_server.url, timeout=60.0) as client:
            return await client.post("/v1/completions", json=body)

    # lane "busy" runs one request and queues one: three prompts cannot all be
    # admitted, and the request is refused as a whole (429), promptly
    r = asyncio.run(asyncio.wait_for(busy(3), timeout=60.0))
    assert r.status_code == 429, r.text
    assert r.json()["error"]["code"] == "queue_full" and int(r.headers["Retry-After"]) >= 1
    r = asyncio.run(asyncio.wait_for(busy(1), timeout=60.0))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 50, r.text


def test_null_max_tokens_is_each_prompts_own_room(http: Any) -> None:
    """vLLM: max_tokens null runs each prompt up to max_model_len (per engine prompt);
    it used to give every prompt the room the longest one leaves."""
    limit = tokenize(http, prompt="x")["max_model_len"]
    prompts = [[100 + i % 50 for i in range(limit - 40)], [100 + i % 50 for i in range(limit - 8)]]
    body = {"model": MODEL, "prompt": prompts, "max_tokens": None, **IGNORE_EOS}
    r = http.post("/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["finish_reason"] for c in choices] == ["length", "length"]
    assert r.json()["usage"]["completion_tokens"] == 40 + 8


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(http: Any) -> None:
    """vLLM's truncate_prompt_tokens: the last k tokens of each prompt (for chat, of the
    templated one); -1 keeps max_model_len's worth, which leaves no room for output."""
    ids = [100 + i for i in range(20)]
    body = {"model": MODEL, "max_tokens": 2, **IGNORE_EOS, "truncate_prompt_tokens": 5}
    r = http.post("/v1/completions", json={**body, "prompt": [ids, ids[:3]]})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 5 + 3, r.text
    chat = {**body, "messages": [{"role": "user", "content": "Say something long. " * 5}]}
    r = http.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 5, r.text
    limit = tokenize(http, prompt="x")["max_model_len"]
    long = {**body, "truncate_prompt_tokens": -1, "prompt": [100] * (limit + 10)}
    r = http.post("/v1/completions", json=long)
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert f"prompt has {limit:,} tokens" in r.json()["error"]["message"]


def test_unknown_routes_and_methods_answer_in_openai_errors(http: Any) -> None:
    """Starlette's own 404 / 405 said {"detail": ...}: they now carry OpenAI's error
    body with a code, as every other answer does."""
    r = http.get("/v1/nonexistent")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text
    assert "GET /v1/nonexistent" in r.json()["error"]["message"]
    r = http.get("/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed", r.text
    assert "POST" in r.headers.get("allow", "")
    assert "x-spur-error-code" not in r.headers


def test_request_bounds(http: Any) -> None:
    """server.requests: more prompts than max_prompts is a 400; a body beyond
    max_body_bytes a 413; both with OpenAI's error body."""
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": ["x"] * 65})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    big = b'{"model": "tiny", "prompt": "' + b"a" * (5 * 1024 * 1024) + b'"}'
    r = http.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text[:300]
    assert r.json()["error"]["code"] == "request_too_large"


# -- chat template options ------------------------------------------------------------------
def test_chat_template_options_are_applied(openai_client: Any, http: Any) -> None:
    """add_generation_prompt and continue_final_message change what the model sees,
    in /tokenize and in /v1/chat/completions alike (one templating function)."""
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello wor"}]
    first = msgs[:1]
    with_prompt = tokenize(http, messages=first)["tokens"]
    without = tokenize(http, messages=first, add_generation_prompt=False)["tokens"]
    assert with_prompt[: len(without)] == without and len(with_prompt) > len(without)
    cont = tokenize(http, messages=msgs, add_generation_prompt=False, continue_final_message=True)
    text = http.post("/detokenize", json={"model": MODEL, "tokens": cont["tokens"]}).json()
    assert text["prompt"].endswith("Hello wor")
    # chat completions: usage counts the templated prompt, so each option shows there
    counts = {}
    for name, extra in {
        "gen": {},
        "no-gen": {"add_generation_prompt": False},
    }.items():
        out = openai_client.chat.completions.create(
            model=MODEL, messages=first, max_tokens=2, extra_body={**IGNORE_EOS, **extra}
        )
        counts[name] = out.usage.prompt_tokens
    assert counts == {"gen": len(with_prompt), "no-gen": len(without)}
    out = openai_client.chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=2,
        extra_body={**IGNORE_EOS, "add_generation_prompt": False, "continue_final_message": True},
    )
    assert out.usage.prompt_tokens == cont["count"]
    # any role's last message can be left open, as in vLLM; both options at once cannot
    opened = tokenize(
        http, messages=first, add_generation_prompt=False, continue_final_message=True
    )
    text = http.post("/detokenize", json={"model": MODEL, "tokens": opened["tokens"]}).json()
    assert text["prompt"].endswith("Hi")
    r = http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": first, "continue_final_message": True},
    )  # add_generation_prompt defaults to true
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
