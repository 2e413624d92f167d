"""API keys and the middleware's decisions (cluster/auth.py), without a server."""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Any

import pytest

from spur.actors.engine.core.hashing import BlockHasher, tenant_salt
from spur.cluster.auth import (
    AuthConfigError,
    AuthGuard,
    AuthMiddleware,
    KeyStore,
    Principal,
    bearer_token,
    install_guard,
    is_loopback,
    load_keys,
    parse_keys,
    request_salt,
)
from spur.cluster.errors import ProtocolError, classify

KEYS = """
keys:
  - {key: sk-alice-0123456789, name: alice, tenant: acme, tokens_per_minute: 1000}
  - {key: sk-bob-0123456789, name: bob, tenant: globex, max_concurrent_requests: 2}
  - {key: sk-ops-0123456789, name: ops, admin: true}
"""


def guard(**kwargs: Any) -> AuthGuard:
    return AuthGuard(KeyStore(parse_keys(KEYS, "test")), **kwargs)


def test_keys_are_kept_as_digests_only() -> None:
    entries = parse_keys(KEYS, "test")
    assert [e.name for e in entries] == ["alice", "bob", "ops"]
    assert [e.tenant for e in entries] == ["acme", "globex", "ops"]  # default: the name
    for e in entries:
        assert b"sk-" not in repr(e).encode() and "sk-" not in repr(e)
    assert entries[0].key_digest == hashlib.sha256(b"sk-alice-0123456789").digest()
    hexed = f"keys: [{{key_sha256: {hashlib.sha256(b'sk-hashed-key-1').hexdigest()}}}]"
    store = KeyStore(parse_keys(hexed, "test"))
    assert store.lookup("sk-hashed-key-1") is not None
    assert store.lookup("sk-hashed-key-2") is None


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("", "holds no keys"),
        ("keys: []", "holds no keys"),
        ("keys: [{key: short}]", "at least 8 printable ASCII characters"),
        # a header arrives as bytes decoded latin-1: such a key could never match
        ('keys: [{key: "sk-clé-secrète-1"}]', "at least 8 printable ASCII characters"),
        ("keys: [{key: sk-aaaaaaaa, key_sha256: ab}]", "exactly one of"),
        ("keys: [{key: sk-aaaaaaaa, tenantt: x}]", "'tenantt' (did you mean 'tenant'?)"),
        # keys written as field names: counted, never quoted
        ("{sk-aaaaaaaa: alice}", "1 unknown field name(s), not shown"),
        ("keys: [{sk-aaaaaaaa: {name: alice}}]", "1 unknown field name(s), not shown"),
        ("keys: [sk-aaaaaaaa, sk-aaaaaaaa]", "the same key as keys[0]"),
        ("keys: [{key: sk-aaaaaaaa, admin: yes-please}]", "admin: must be true or false"),
        ("keys: [{key: sk-aaaaaaaa, tokens_per_minute: 0}]", "tokens_per_minute: must be"),
        ("keys: [{key_sha256: zz}]", "64 hex digits"),
        ("{keys: [", "not valid YAML or JSON"),
    ],
)
def test_bad_keys_name_the_problem_and_never_the_key(text: str, needle: str) -> None:
    with pytest.raises(AuthConfigError) as info:
        parse_keys(text, "SPUR_API_KEYS")
    assert needle in str(info.value)
    assert "SPUR_API_KEYS" in str(info.value)
    assert "sk-aaaaaaaa" not in str(info.value)


def test_load_keys_from_the_variable_and_the_file(tmp_path: Any) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text("- sk-from-file-1")
    auth = {"keys_env": "SPUR_API_KEYS", "keys_file": str(path)}
    store = load_keys(auth, {"SPUR_API_KEYS": '["sk-from-env-1"]'})
    assert len(store) == 2 and store.lookup("sk-from-env-1") and store.lookup("sk-from-file-1")
    assert not load_keys({"keys_env": "SPUR_API_KEYS"}, {})  # unset: auth off
    assert not load_keys({"keys_env": "SPUR_API_KEYS"}, {"SPUR_API_KEYS": "  "})
    with pytest.raises(AuthConfigError, match="cannot be read"):
        load_keys({"keys_file": str(tmp_path / "missing")}, {})
    with pytest.raises(AuthConfigError, match="configured twice"):
        load_keys(auth, {"SPUR_API_KEYS": '["sk-from-file-1"]'})


def test_require_keys_fails_closed_where_no_keys_are_found() -> None:
    """An ingress replica placed where the keys are not exported must not serve an
    open API when the deployment has keys (the Helm chart turns require_keys on)."""
    auth = {"keys_env": "SPUR_API_KEYS", "keys_file": None, "require_keys": True}
    with pytest.raises(AuthConfigError, match="require_keys is on but no API keys") as info:
        AuthGuard.from_config(auth, {})
    assert "export the keys on every node" in str(info.value)
    assert AuthGuard.from_config(auth, {"SPUR_API_KEYS": "[sk-from-env-1]"}).enabled
    assert not AuthGuard.from_config({**auth, "require_keys": False}, {}).enabled


# WWW-Authenticate as RFC 6750 words it: an error code only when a bearer token was sent
CHALLENGE = 'Bearer realm="spur"'
INVALID = 'Bearer realm="spur", error="invalid_token"'
SCOPE = 'Bearer realm="spur", error="insufficient_scope"'  # a 403's


def test_guard_routes() -> None:
    g = guard()
    # open paths need nothing
    for path in ("/health", "/health/live", "/metrics"):
        assert g.check(path, None) is None
    # missing, malformed, wrong: 401 with OpenAI's body fields
    for header, code, challenge in (
        (None, "missing_api_key", CHALLENGE),
        ("Basic abc", "missing_api_key", CHALLENGE),
        ("Bearer sk-nope-0123456789", "invalid_api_key", INVALID),
    ):  # fmt: skip
        with pytest.raises(ProtocolError) as info:
            g.check("/v1/completions", header)
        assert info.value.status == 401 and info.value.code == code
        assert info.value.headers["WWW-Authenticate"] == challenge
    alice = g.check("/v1/chat/completions", "Bearer sk-alice-0123456789")
    assert alice is not None and alice.tenant == "acme" and alice.tokens_per_minute == 1000
    assert g.check("/tokenize", "bearer  sk-bob-0123456789 ") is not None
    # roles: API keys never reach /admin, admin keys only /admin
    with pytest.raises(ProtocolError) as info:
        g.check("/admin/config", "Bearer sk-alice-0123456789")
    assert info.value.status == 403
    assert info.value.headers["WWW-Authenticate"] == SCOPE
    assert g.check("/admin/config", "Bearer sk-ops-0123456789") is not None
    with pytest.raises(ProtocolError) as info:
        g.check("/v1/completions", "Bearer sk-ops-0123456789")
    assert info.value.status == 403
    assert info.value.headers["WWW-Authenticate"] == SCOPE
    # an unknown route is closed too (default deny), the docs included
    with pytest.raises(ProtocolError):
        g.check("/openapi.json", None)


def test_no_keys_means_everything_open() -> None:
    g = AuthGuard(KeyStore())
    assert not g.enabled
    assert g.check("/admin/reset_prefix_cache", None) is None
    assert g.check("/v1/completions", "Bearer whatever") is None


def test_default_limits_apply_where_a_key_sets_none() -> None:
    g = guard(default_max_concurrent_requests=5, default_tokens_per_minute=77)
    alice = g.check("/v1/completions", "Bearer sk-alice-0123456789")
    bob = g.check("/v1/completions", "Bearer sk-bob-0123456789")
    assert alice is not None and bob is not None
    assert (alice.max_concurrent_requests, alice.tokens_per_minute) == (5, 1000)
    assert (bob.max_concurrent_requests, bob.tokens_per_minute) == (2, 77)
    assert alice.key_id != bob.key_id and "sk-" not in alice.key_id


def test_bearer_token() -> None:
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer abc ") == "abc"
    assert bearer_token("Bearer ") is None
    assert bearer_token("Token abc") is None
    assert bearer_token(None) is None


def test_middleware_answers_401_before_the_route_and_passes_the_principal() -> None:
    seen: list[Any] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.append(scope["state"]["principal"])
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def call(path: str, headers: list[tuple[bytes, bytes]]) -> list[dict[str, Any]]:
        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b""}

        scope = {"type": "http", "path": path, "headers": headers}
        await AuthMiddleware(app)(scope, receive, send)
        return sent

    install_guard(guard())
    try:
        sent = asyncio.run(call("/v1/completions", []))
        assert sent[0]["status"] == 401 and not seen
        body = json.loads(sent[1]["body"])
        assert set(body["error"]) == {"message", "type", "param", "code"}
        sent = asyncio.run(call("/v1/models", [(b"authorization", b"Bearer sk-bob-0123456789")]))
        assert sent[0]["status"] == 200 and seen[-1].name == "bob"
        sent = asyncio.run(call("/health", []))
        assert sent[0]["status"] == 200 and seen[-1] is None
    finally:
        install_guard(None)


def test_the_guard_judges_the_path_the_router_matches_under_a_root_path() -> None:
    """From a review of auth: under Serve, scope["path"] carries the root_path (Serve's
    http_options.root_path, a route_prefix other than "/"), which Starlette's router
    strips. The guard judged the raw path: with root_path "/spur" an API key reached
    /admin/* ("/spur/admin/config" is no admin path) and /health needed a key."""
    from fastapi import FastAPI
    from starlette.testclient import TestClient

    app = FastAPI()
    app.add_middleware(AuthMiddleware)

    @app.get("/admin/config")
    async def admin_config() -> dict[str, bool]:
        return {"config": True}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    alice = {"Authorization": "Bearer sk-alice-0123456789"}
    ops = {"Authorization": "Bearer sk-ops-0123456789"}
    install_guard(guard())
    try:
        for root in ("", "/spur", "/a/b"):
            client = TestClient(app, root_path=root)
            refused = client.get(f"{root}/admin/config", headers=alice)
            assert refused.status_code == 403, (root, refused.text)
            assert refused.json()["error"]["code"] == "admin_key_required"
            assert client.get(f"{root}/admin/config", headers=ops).status_code == 200
            assert client.get(f"{root}/admin/config").status_code == 401
            assert client.get(f"{root}/health").status_code == 200, root
    finally:
        install_guard(None)


def test_open_paths_must_open_health() -> None:
    """From a review of auth: `spur serve` polls /health without a key before it
    announces the server; with /health closed it never did (a "not ready yet" every
    30 s instead). The config refuses it, naming the fix."""
    from spur.configs.loader import ConfigError, parse_config

    def auth(open_paths: list[str]) -> dict[str, Any]:
        return {"lanes": [{"name": "chat"}], "server": {"auth": {"open_paths": open_paths}}}

    for paths in (["/health/live"], [], ["/metrics", "/healthz"], ["/health/"]):
        with pytest.raises(ConfigError) as info:
            parse_config(auth(paths))
        assert "server.auth.open_paths: must include /health" in str(info.value)
        assert "add /health to the list" in str(info.value)
    for paths in (["/health"], ["/"], ["/metrics", "/health", "/v1/models"]):
        assert parse_config(auth(paths)).server.auth.open_paths == paths


def test_client_keys_are_stripped_and_never_quoted(monkeypatch: pytest.MonkeyPatch) -> None:
    """spur's clients read keys from flags and SPUR_API_KEY / SPUR_ADMIN_KEY, often with
    a file's newline; http.client refuses such a header with an error quoting it."""
    from spur.configs.env import checked_client_key, client_api_key

    monkeypatch.delenv("SPUR_API_KEY", raising=False)
    monkeypatch.delenv("SPUR_ADMIN_KEY", raising=False)
    assert client_api_key() is None and client_api_key(admin=True) is None
    monkeypatch.setenv("SPUR_API_KEY", "sk-api-0123456789\r\n")
    assert client_api_key() == client_api_key(admin=True) == "sk-api-0123456789"
    monkeypatch.setenv("SPUR_ADMIN_KEY", " sk-ops-0123456789\n")
    assert client_api_key(admin=True) == "sk-ops-0123456789"
    assert client_api_key(given="sk-flag-0123456789\n") == "sk-flag-0123456789"
    monkeypatch.setenv("SPUR_ADMIN_KEY", "\n")  # nothing left: the API key
    assert client_api_key(admin=True) == "sk-api-0123456789"
    assert checked_client_key(" \r\n", "--api-key") is None
    for bad in ("sk-ops\n0123456789", "sk-ops 0123456789", "sk-ops\x000123", "sk-clé-0123"):
        with pytest.raises(ValueError) as info:
            checked_client_key(bad, "--api-key")
        assert str(info.value).startswith("--api-key holds whitespace, a control character")
        assert "sk-" not in str(info.value)
    monkeypatch.setenv("SPUR_ADMIN_KEY", "sk-ops\x070123456789")
    with pytest.raises(ValueError, match=r"^SPUR_ADMIN_KEY holds"):
        client_api_key(admin=True)


def test_a_keyless_answer_on_admin_is_caught_after_start() -> None:
    """`spur serve` with require_keys checks, once /health is ready, that /admin/config
    refuses a request without a key (an ingress ignoring require_keys, older code on a
    joined cluster's nodes, must not be announced)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from spur.cluster.server import serves_without_a_key

    status = {"code": 401}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status["code"] if self.path == "/admin/config" else 404)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        assert not serves_without_a_key(url)
        status["code"] = 200
        assert serves_without_a_key(url)
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert not serves_without_a_key(url)  # nobody answers: cannot tell


def test_serve_never_announces_an_api_open_despite_require_keys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An ingress that ignored require_keys and found no keys (older spur code on a
    joined cluster's nodes) answers /admin/config without one: `spur serve` stops,
    exit 1, instead of announcing it."""
    from spur.cluster import server
    from spur.configs.loader import parse_config

    calls: list[str] = []
    monkeypatch.setattr(server, "start", lambda cfg, on_ray_started=None: "http://spur")
    monkeypatch.setattr(server, "wait_ready", lambda url, stop_event: True)
    monkeypatch.setattr(server, "serves_without_a_key", lambda url: True)
    monkeypatch.setattr(server, "stop", lambda cfg, wait=True: calls.append("stopped"))
    closed = parse_config({"lanes": [{"name": "chat"}], "server": {"auth": {"require_keys": True}}})
    assert server.run_server(closed, announce=lambda url: calls.append("announced")) == 1
    assert calls == ["stopped"]


def test_a_refused_key_is_counted_with_its_error_code() -> None:
    """The counting middleware (outermost, as in the ingress) reads the answer's error
    code from a header it removes: auth refusals carry theirs too (they were counted
    with code "")."""
    from spur.cluster import metrics as M

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def call(headers: list[tuple[bytes, bytes]]) -> list[dict[str, Any]]:
        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b""}

        scope = {"type": "http", "path": "/v1/completions", "headers": headers}
        await M.CountingMiddleware(AuthMiddleware(app))(scope, receive, send)
        return sent

    saved = M.HTTP
    M.HTTP = M.IngressCounters()
    install_guard(guard())
    try:
        sent = asyncio.run(call([]))
        sent += asyncio.run(call([(b"authorization", b"Bearer sk-nobody-000000000")]))
        errors = {k: n for k, n in M.HTTP.errors.items() if n}
        M.HTTP.enabled = False  # server.metrics: false counts nothing, still strips it
        sent += asyncio.run(call([]))
        assert sum(M.HTTP.errors.values()) == 2
    finally:
        install_guard(None)
        M.HTTP = saved
    assert errors == {
        ("/v1/completions", "401", "missing_api_key"): 1,
        ("/v1/completions", "401", "invalid_api_key"): 1,
    }
    starts = [m for m in sent if m["type"] == "http.response.start"]
    assert len(starts) == 3
    assert all(M.ERROR_CODE_HEADER not in dict(m["headers"]) for m in starts)


def test_tenant_salt_separates_tenants_and_keeps_one_tenant_together() -> None:
    hasher = BlockHasher(4)
    ids = list(range(32))
    acme = hasher.chain(ids, cache_salt=tenant_salt("acme", None))
    assert acme == hasher.chain(ids, cache_salt=tenant_salt("acme", None))
    assert not set(acme) & set(hasher.chain(ids, cache_salt=tenant_salt("globex", None)))
    # a client's cache_salt cannot forge another tenant's scope
    assert tenant_salt("a", "b") != tenant_salt("a:b", None)
    assert tenant_salt("ab", None) != tenant_salt("a", "b")
    assert tenant_salt(None, "x") == "x" and tenant_salt(None, None) is None


def test_one_error_classifier() -> None:
    class BackPressureError(Exception):
        pass

    class RayActorError(Exception):
        pass

    assert classify(BackPressureError()).status == 429
    assert classify(BackPressureError()).headers["Retry-After"] == "1"
    assert classify(RayActorError()).status == 503
    err = classify(KeyError("secret detail"))
    assert err.status == 500 and "secret" not in err.message
    same = ProtocolError(400, "x")
    assert classify(same) is same


def test_is_loopback() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.1.2.3")


def test_a_request_without_a_key_never_gets_a_tenants_scope() -> None:
    """With keys on, a request on an open path (no principal) cannot spell a tenant's
    scope in its cache_salt and share that tenant's cached blocks."""
    acme = Principal("k", "alice", "acme", False, None, None)
    scope = request_salt(acme, True, None)
    assert scope == tenant_salt("acme", None) == "t4:acme"
    assert request_salt(None, True, "t4:acme") != scope
    assert request_salt(None, True, None) != scope
    assert request_salt(None, False, "x") == "x"  # keys off: no tenants, salt unchanged
