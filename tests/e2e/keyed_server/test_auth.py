"""API keys, tenants and per-key limits on a real `spur serve` with keys
(conftest's `keyed_server`: one tiny lane, keys in SPUR_API_KEYS as the Helm
chart exports them; the keys are listed there)."""

from __future__ import annotations

import json
import socket
import time
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest

from e2e.keyed_server.conftest import CORS_ORIGIN, KEYS, KeyedServer

pytestmark = pytest.mark.slow


def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def raw_completion(server: KeyedServer, who: str, body: dict[str, Any], *headers: str) -> bytes:
    """A POST /v1/completions as bytes, to send on a socket the test then closes."""
    data = json.dumps(body).encode()
    host = urlsplit(server.url).netloc
    extra = "".join(f"{h}\r\n" for h in headers)
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: Bearer {KEYS[who]}\r\nContent-Type: application/json\r\n"
        f"{extra}Content-Length: {len(data)}\r\n\r\n"
    ).encode() + data


def engine_when(ops: httpx.Client, ready: Any, timeout: float = 60) -> dict[str, Any]:
    """The tiny lane's engine stats (/admin/engines) once `ready(stats)` holds."""
    deadline = time.monotonic() + timeout
    while True:
        stats = ops.get("/admin/engines").json()["tiny"]
        if ready(stats):
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)


def test_routes_need_a_key_of_the_right_role(keyed_server: KeyedServer) -> None:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    with (
        keyed_server.client(None) as anon,
        keyed_server.client("alice") as alice,
        keyed_server.client("ops") as ops,
    ):
        for method, path, payload in (
            ("POST", "/v1/completions", body),
            ("POST", "/v1/chat/completions", {"model": "tiny", "messages": []}),
            ("GET", "/v1/models", None),
            ("POST", "/tokenize", {"model": "tiny", "prompt": "hi"}),
            ("POST", "/detokenize", {"model": "tiny", "tokens": [1]}),
            ("GET", "/admin/config", None),
            ("POST", "/admin/reset_prefix_cache", {}),
        ):
            r = anon.request(method, path, json=payload)
            error = error_of(r, 401)
            assert error["code"] == "missing_api_key", (path, error)
            assert r.headers["WWW-Authenticate"] == 'Bearer realm="spur"'  # RFC 6750: no error
        wrong = anon.post("/v1/completions", json=body, headers={"Authorization": "Bearer sk-x"})
        assert error_of(wrong, 401)["code"] == "invalid_api_key"
        assert wrong.headers["WWW-Authenticate"] == 'Bearer realm="spur", error="invalid_token"'
        assert "sk-x" not in wrong.text
        # open: health (and /metrics, when served) never ask for a key
        assert anon.get("/health").status_code == 200
        assert anon.get("/metrics").status_code != 401
        # roles
        assert alice.post("/v1/completions", json=body).status_code == 200
        refused = alice.get("/admin/config")
        assert error_of(refused, 403)["code"] == "admin_key_required"
        challenge = refused.headers["WWW-Authenticate"]
        assert challenge == 'Bearer realm="spur", error="insufficient_scope"'
        assert error_of(ops.post("/v1/completions", json=body), 403)["code"] == "api_key_required"
        config = ops.get("/admin/config")
        assert config.status_code == 200
        assert config.json()["server"]["auth"]["keys_env"] == "SPUR_API_KEYS"
        assert not any(key in config.text for key in KEYS.values())


def test_official_client_with_a_key_and_cached_tokens_always_present(
    keyed_server: KeyedServer,
) -> None:
    from openai import AuthenticationError, OpenAI

    base = f"{keyed_server.url}/v1"
    client = OpenAI(base_url=base, api_key=KEYS["bob"], max_retries=0, timeout=120.0)
    out = client.completions.create(model="tiny", prompt="A fresh prompt 9041", max_tokens=3)
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    assert out.usage.prompt_tokens_details.cached_tokens == 0  # present, 0 included
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hey 9042"}], max_tokens=3
    )
    assert chat.usage is not None and chat.usage.prompt_tokens_details is not None
    stream = client.completions.create(
        model="tiny",
        prompt="Another fresh prompt 9043",
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [c.usage for c in stream if c.usage is not None]
    assert usage and usage[-1].prompt_tokens_details.cached_tokens == 0
    bad = OpenAI(base_url=base, api_key="sk-not-a-key", max_retries=0)
    with pytest.raises(AuthenticationError):
        bad.models.list()


def _cached(client: httpx.Client, prompt: list[int], **extra: Any) -> int:
    r = client.post(
        "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1, **extra}
    )
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_tenants_never_share_prefix_cache_blocks(keyed_server: KeyedServer) -> None:
    """The same 2k-token prompt: a second tenant gets no hit, the same tenant
    (another key of it included) does; cache_salt still separates within a tenant."""
    prompt = [(7 * i) % 40000 + 100 for i in range(2000)]
    with (
        keyed_server.client("alice") as alice,
        keyed_server.client("alice2") as alice2,
        keyed_server.client("bob") as bob,
    ):
        assert _cached(alice, prompt) == 0
        assert _cached(bob, prompt) == 0  # another tenant: no hit, no timing side channel
        hit = _cached(alice2, prompt)  # the same tenant, another key: shares
        assert hit >= 2000 - 16, hit
        assert _cached(bob, prompt) >= 2000 - 16  # bob's own earlier request
        assert _cached(alice, prompt, cache_salt="private") == 0
        assert _cached(alice2, prompt, cache_salt="private") >= 2000 - 16


def test_max_concurrent_requests_per_key_is_429_with_retry_after(keyed_server: KeyedServer) -> None:
    long = {
        "model": "tiny",
        "prompt": "Count:",
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    with keyed_server.client("solo") as solo, keyed_server.client("bob") as bob:
        with solo.stream("POST", "/v1/completions", json=long) as first:
            assert first.status_code == 200
            lines = first.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            second = solo.post("/v1/completions", json={"model": "tiny", "prompt": "hi"})
            error = error_of(second, 429)
            assert error["code"] == "concurrency_limit_exceeded"
            assert int(second.headers["Retry-After"]) >= 1
            # other keys are not limited by solo's lease
            assert bob.post("/v1/completions", json={"model": "tiny", "prompt": "hi"}).is_success
        # the first stream is closed (client went away): its lease comes back
        deadline = time.monotonic() + 30
        while True:
            r = solo.post("/v1/completions", json={"model": "tiny", "prompt": "hi"})
            if r.status_code == 200:
                break
            assert r.status_code == 429 and time.monotonic() < deadline, r.text
            time.sleep(0.2)


def test_a_client_gone_before_its_first_token_frees_its_lease_and_its_request(
    keyed_server: KeyedServer,
) -> None:
    """The client sends a streamed request and hangs up before anything comes back.
    `x-request-disconnect-disabled: ?1` (a Serve header any client may send) keeps Serve
    from cancelling the handler, so the ingress answers a response whose client is gone:
    Starlette then cancels it before its body starts. The key's lease must come back and
    the engine must abort the request, not run it to max_tokens."""
    max_tokens = 2000
    body = {
        "model": "tiny",
        "prompt": "Count:",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    request = raw_completion(keyed_server, "solo", body, "x-request-disconnect-disabled: ?1")
    url = urlsplit(keyed_server.url)
    with keyed_server.client("ops") as ops, keyed_server.client("solo") as solo:
        before = engine_when(ops, lambda st: st["num_running"] == 0 and st["num_waiting"] == 0)
        with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
            sock.sendall(request)
        # Nothing else runs on this server now: a step means the request was admitted.
        engine_when(ops, lambda st: st["num_steps"] > before["num_steps"])
        deadline = time.monotonic() + 30
        while True:  # the lease comes back (it used to stay for lease_ttl_s, an hour)
            r = solo.post(
                "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 1}
            )
            if r.status_code == 200:
                break
            assert r.status_code == 429 and time.monotonic() < deadline, r.text
            time.sleep(0.2)
        after = engine_when(ops, lambda st: st["num_running"] == 0 and st["num_waiting"] == 0)
    assert after["num_steps"] - before["num_steps"] < max_tokens, (before, after)


def test_tokens_per_minute_per_key(keyed_server: KeyedServer) -> None:
    prompt = list(range(1000, 1200))  # 200 tokens
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 100, "ignore_eos": True}
    with keyed_server.client("meter") as meter:
        first = meter.post("/v1/completions", json=body)  # 300 of 600
        assert first.status_code == 200, first.text
        second = meter.post("/v1/completions", json=body)  # 600 of 600
        assert second.status_code == 200, second.text
        third = meter.post("/v1/completions", json=body)
        error = error_of(third, 429)
        assert error["code"] == "tokens_per_minute_exceeded"
        assert 1 <= int(third.headers["Retry-After"]) <= 60
        too_big = meter.post("/v1/completions", json={**body, "prompt": list(range(700))})
        assert error_of(too_big, 400)["code"] == "tokens_per_minute_exceeded"


def test_a_request_in_flight_holds_its_completions_maximum(keyed_server: KeyedServer) -> None:
    """burst: 500 a minute. A stream of 2 prompt tokens and max_tokens 400 in flight
    holds 402 of them, so a second such request is refused at once: charging the
    prompt alone let any number in before the first was billed."""
    body = {"model": "tiny", "prompt": [1000, 1001], "max_tokens": 400, "ignore_eos": True}
    with (
        keyed_server.client("burst") as burst,
        burst.stream("POST", "/v1/completions", json={**body, "stream": True}) as first,
    ):
        assert first.status_code == 200
        lines = first.iter_lines()  # kept: a dropped iterator closes the stream
        next(lines)  # admitted and running
        second = burst.post("/v1/completions", json={**body, "max_tokens": 200})
        assert error_of(second, 429)["code"] == "tokens_per_minute_exceeded"
        assert sum(1 for line in lines if line.startswith("data: {")) > 0


def test_a_non_streamed_request_left_by_its_client_is_billed_what_it_generated(
    keyed_server: KeyedServer,
) -> None:
    """tokens_per_minute counts output too: a client that hangs up on a long
    non-streamed request must not get its tokens for free (quota: 400 a minute; max_tokens
    null: all the budget leaves after the prompt)."""
    body = {"model": "tiny", "prompt": "Count:", "max_tokens": None, "ignore_eos": True}
    request = raw_completion(keyed_server, "quota", body)
    url = urlsplit(keyed_server.url)
    with keyed_server.client("ops") as ops, keyed_server.client("quota") as quota:
        before = engine_when(ops, lambda st: st["num_running"] == 0 and st["num_waiting"] == 0)
        with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
            sock.sendall(request)
            # alone on the server: one step, one token of this request
            engine_when(ops, lambda st: st["num_steps"] >= before["num_steps"] + 200)
        engine_when(ops, lambda st: st["num_running"] == 0 and st["num_waiting"] == 0)
        # a few tokens of prompt plus about 200 generated, then 250 more: over 400
        r = quota.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": list(range(1000, 1250)), "max_tokens": 1},
        )
        assert error_of(r, 429)["code"] == "tokens_per_minute_exceeded"


def test_a_default_max_tokens_is_cut_to_what_the_key_may_use(keyed_server: KeyedServer) -> None:
    """cap: 300 a minute. A request that leaves max_tokens to the server (null: the
    room left in the context, thousands of tokens) was admitted with a reservation of
    what the budget left, then generated to the end of the context, billed only when it
    ended: a key could take many times its budget a minute. It now generates at most
    that reservation. A request that names more than the budget can ever hold is
    refused, as OpenAI refuses one, naming max_tokens."""
    prompt = list(range(1000, 1010))  # 10 tokens
    body = {"model": "tiny", "prompt": prompt, "ignore_eos": True}
    with keyed_server.client("cap") as cap:
        asked = cap.post("/v1/completions", json={**body, "max_tokens": 291})
        error = error_of(asked, 400)
        assert (error["param"], error["code"]) == ("max_tokens", "tokens_per_minute_exceeded")
        assert "lower max_tokens" in error["message"]
        r = cap.post("/v1/completions", json={**body, "max_tokens": None})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (10, 290)
        assert r.json()["choices"][0]["finish_reason"] == "length"
        spent = cap.post("/v1/completions", json={**body, "max_tokens": 1})
        assert error_of(spent, 429)["code"] == "tokens_per_minute_exceeded"


def test_a_request_refused_before_its_first_token_is_not_billed(keyed_server: KeyedServer) -> None:
    """refund: 300 a minute. A prompt the engine refuses (a token id outside the
    vocabulary: the engine's 400, after the limits admitted it) kept its 260 tokens
    charged, so the client's next try was a 429 for a minute. It is refunded whole."""
    prompt = list(range(1000, 1250))
    with keyed_server.client("refund") as refund:
        for _ in range(3):
            bad = {"model": "tiny", "prompt": [*prompt[:-1], 10**9], "max_tokens": 10}
            error_of(refund.post("/v1/completions", json=bad), 400)
        ok = refund.post(
            "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 10}
        )
        assert ok.status_code == 200, ok.text


def test_keys_never_appear_in_answers(keyed_server: KeyedServer) -> None:
    with keyed_server.client("ops") as ops:
        for path in ("/admin/config", "/admin/lanes", "/admin/engines", "/admin/routing"):
            r = ops.get(path)
            assert r.status_code == 200, (path, r.text)
            assert not any(key in r.text for key in KEYS.values()), path
        dumped = json.dumps(ops.get("/admin/config").json())
        assert "SPUR_API_KEYS" in dumped


def test_browsers_of_the_allowed_origin_may_call_the_api(keyed_server: KeyedServer) -> None:
    """server.requests.cors_allowed_origins: a preflight (no key: browsers send none
    with it) is answered for the listed origin and refused for another; answers carry
    the origin, refusals included, so the page can read the error and Retry-After."""
    preflight = {
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    with keyed_server.client(None) as anon, keyed_server.client("alice") as alice:
        ok = anon.options("/v1/chat/completions", headers={"Origin": CORS_ORIGIN, **preflight})
        assert ok.status_code == 200, ok.text
        assert ok.headers["access-control-allow-origin"] == CORS_ORIGIN
        assert "POST" in ok.headers["access-control-allow-methods"]
        assert "authorization" in ok.headers["access-control-allow-headers"].lower()
        other = anon.options("/v1/models", headers={"Origin": "http://evil.example", **preflight})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        refused = anon.get("/v1/models", headers={"Origin": CORS_ORIGIN})
        error_of(refused, 401)  # the key is still checked
        assert refused.headers["access-control-allow-origin"] == CORS_ORIGIN
        models = alice.get("/v1/models", headers={"Origin": CORS_ORIGIN})
        assert models.status_code == 200
        assert models.headers["access-control-allow-origin"] == CORS_ORIGIN
        assert "retry-after" in models.headers["access-control-expose-headers"].lower()
        plain = alice.get("/v1/models")  # no Origin: a server-side client, no CORS headers
        assert "access-control-allow-origin" not in plain.headers
