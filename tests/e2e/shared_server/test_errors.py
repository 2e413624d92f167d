"""Errors and limits of a running `spur serve`: bad inputs get their 4xx with
OpenAI's error body and the server keeps serving; a full queue answers 429 (or
503) with Retry-After; a client that disconnects mid-stream gets its request
aborted and every KV block back in the pool."""

from __future__ import annotations

import asyncio
import re
import time
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HI = [{"role": "user", "content": "hi"}]
LONG_TEXT = "hello " * 3000  # ~3,000 tokens: beyond the tiny lanes' max_model_len of 2,048
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def comp(**fields: Any) -> dict[str, Any]:
    """A /v1/completions body for lane "tiny" with `fields` added."""
    return {"model": "tiny", "prompt": "hi", **fields}


def chat(**fields: Any) -> dict[str, Any]:
    """A /v1/chat/completions body for lane "tiny" with `fields` added."""
    return {"model": "tiny", "messages": HI, **fields}


# id -> (path, body (bytes are sent raw), expected status, expected error.param)
BAD_INPUTS: dict[str, tuple[str, Any, int, str | None]] = {
    "malformed-json": (CHAT, b'{"model": "tiny", "messages": [', 400, None),
    "body-not-an-object": (COMPLETIONS, [1, 2], 400, None),
    "missing-messages": (CHAT, {"model": "tiny"}, 400, "messages"),
    "temperature-hot": (COMPLETIONS, comp(temperature="hot"), 400, "temperature"),
    "top-p-1.5": (COMPLETIONS, comp(top_p=1.5), 400, "top_p"),
    "n-0": (COMPLETIONS, comp(n=0), 400, "n"),
    "max-tokens--1": (COMPLETIONS, comp(max_tokens=-1), 400, "max_tokens"),
    "chat-max-tokens--1": (CHAT, chat(max_tokens=-1), 400, "max_tokens"),
    "unknown-model": (COMPLETIONS, comp(model="no-such-model"), 404, "model"),
    "prompt-too-long": (COMPLETIONS, comp(prompt=LONG_TEXT), 400, "prompt"),
    "max-tokens-beyond-the-room": (COMPLETIONS, comp(max_tokens=2048), 400, "max_tokens"),
    "chat-max-tokens-beyond-the-room": (
        CHAT,
        chat(max_completion_tokens=4000),
        400,
        "max_completion_tokens",
    ),
    "prompt-too-long-stream": (COMPLETIONS, comp(prompt=LONG_TEXT, stream=True), 400, "prompt"),
    "tools": (CHAT, chat(tools=TOOLS), 400, "tools"),
    "echo": (COMPLETIONS, comp(echo=True), 400, "echo"),
    "stream-options-without-stream": (
        COMPLETIONS,
        comp(stream_options={"include_usage": True}),
        400,
        "stream_options",
    ),
}


def post(http: httpx.Client, path: str, body: Any) -> httpx.Response:
    if isinstance(body, bytes):
        return http.post(path, content=body, headers={"Content-Type": "application/json"})
    return http.post(path, json=body)


def check_error_body(r: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param, error
    assert "Traceback" not in error["message"]
    return error


@pytest.mark.parametrize(
    ("path", "body", "status", "param"), list(BAD_INPUTS.values()), ids=list(BAD_INPUTS)
)
def test_bad_input_gets_its_4xx(
    http: Any, path: str, body: Any, status: int, param: str | None
) -> None:
    error = check_error_body(post(http, path, body), status, param)
    if param == "prompt":  # too long: the message names both numbers
        count = http.post("/tokenize", json={"model": "tiny", "prompt": LONG_TEXT}).json()
        numbers = {int(n.replace(",", "")) for n in re.findall(r"\d[\d,]*", error["message"])}
        assert {count["count"], count["max_model_len"]} <= numbers, error["message"]


def test_a_prompt_of_megabytes_is_a_400_not_a_500(http: Any) -> None:
    """Under the body limit (4 MiB) but far beyond max_model_len: refused by the ingress,
    not sent to an engine (its ids and block hashes outgrew Serve's 4 MiB gRPC messages:
    a 500 RESOURCE_EXHAUSTED)."""
    prompt = "7" * 4_100_000  # a token per digit: 4.1 million token ids, 4.1 MB of body
    error = check_error_body(post(http, COMPLETIONS, {"model": "tiny", "prompt": prompt}), 400,
                             "prompt")  # fmt: skip
    assert error["code"] == "context_length_exceeded" and "max_model_len is" in error["message"]


def test_chat_prompt_too_long_names_messages(http: Any) -> None:
    r = post(http, CHAT, {"model": "tiny", "messages": [{"role": "user", "content": LONG_TEXT}]})
    error = check_error_body(r, 400, "messages")
    assert error["code"] == "context_length_exceeded"


def test_server_still_answers_after_bad_inputs(http: Any, openai_client: Any) -> None:
    for path, body, _, _ in BAD_INPUTS.values():  # again, all of them, then a normal request
        assert post(http, path, body).status_code < 500
    out = openai_client.completions.create(model="tiny", prompt="Still there?", max_tokens=4)
    assert out.choices[0].finish_reason in ("length", "stop")
    assert http.get("/health").status_code == 200


# -- queue full ----------------------------------------------------------------------------
async def _burst(url: str, num: int) -> list[httpx.Response]:
    body = {
        "model": "busy",
        "prompt": "Count to a thousand:",
        "max_tokens": 200,
        "ignore_eos": True,
    }
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(90.0)) as client:
        return await asyncio.gather(*(client.post(COMPLETIONS, json=body) for _ in range(num)))


def test_queue_full_is_429_with_retry_after(spur_server: Any, http: Any) -> None:
    warm = post(http, COMPLETIONS, {"model": "busy", "prompt": "warm up", "max_tokens": 2})
    assert warm.status_code == 200, warm.text
    # lane "busy": max_ongoing_requests 1, max_queued_requests 1
    responses = asyncio.run(asyncio.wait_for(_burst(spur_server.url, 10), timeout=180))
    statuses = [r.status_code for r in responses]
    assert set(statuses) <= {200, 429, 503}, [r.text for r in responses]
    rejected = [r for r in responses if r.status_code != 200]
    assert rejected and 200 in statuses, statuses
    for r in rejected:
        assert int(r.headers["Retry-After"]) >= 1
        error = r.json()["error"]
        assert error["type"] in ("rate_limit_error", "service_unavailable_error")
    for r in responses:
        if r.status_code == 200:
            assert r.json()["usage"]["completion_tokens"] == 200
    after = post(http, COMPLETIONS, {"model": "busy", "prompt": "after", "max_tokens": 4})
    assert after.status_code == 200, after.text


# -- client disconnect ---------------------------------------------------------------------
def _engine(http: Any, lane: str) -> dict[str, Any]:
    stats = http.get("/admin/engines").json()[lane]
    assert "error" not in stats, stats
    return stats


def _wait_idle(http: Any, lane: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """Poll the lane's engine until it runs nothing and every block is free."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = _engine(http, lane)
        if stats["num_running"] == 0 and stats["num_free_blocks"] == stats["num_blocks"] - 1:
            return stats
        assert time.monotonic() < deadline, f"{lane}: blocks not free after {timeout_s} s: {stats}"
        time.sleep(0.2)


def test_disconnect_mid_stream_frees_every_block(http: Any, spur_server: Any) -> None:
    before = _wait_idle(http, "tiny")
    # Nearly max_model_len (2,048) of output: the tiny model makes a few hundred
    # tokens a second, so the request is surely still running when we hang up.
    max_tokens = 2000
    body = {
        "model": "tiny",
        "prompt": "Write a very long story:",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    # a client of its own: leaving the block closes the connection, stream unread
    client = httpx.Client(base_url=spur_server.url, timeout=60.0)
    with client, client.stream("POST", COMPLETIONS, json=body) as r:
        assert r.status_code == 200
        # Hold the line iterator: a dropped one is finalized at once, and httpcore
        # then closes the connection before the checks below.
        lines = r.iter_lines()
        events = []
        for line in lines:
            if line.startswith("data: "):
                events.append(line)
            if len(events) == 5:
                break
        assert len(events) == 5 and all('"text"' in e for e in events), events
        during = _engine(http, "tiny")
        assert during["num_running"] == 1, during
        assert during["num_free_blocks"] < during["num_blocks"] - 1, during
    after = _wait_idle(http, "tiny")
    assert after["num_waiting"] == 0 and after.get("kv_leak_violations", 0) == 0
    # Aborted, not run to its end: the request was the lane's only one and makes
    # one token per step, so finishing would have taken max_tokens steps.
    assert after["num_steps"] - before["num_steps"] < max_tokens, (before, after)


# -- a prompt the engine cannot embed ------------------------------------------------------
def test_token_id_outside_vocabulary_is_400_and_the_lane_survives(http: Any) -> None:
    # Lane "busy" takes the hit: no later test needs it.
    r = post(http, COMPLETIONS, {"model": "busy", "prompt": [10**9], "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] in ("prompt", "prompt[0]")
    after = post(http, COMPLETIONS, {"model": "busy", "prompt": "fine", "max_tokens": 2})
    assert after.status_code == 200, after.text
