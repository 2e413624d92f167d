"""API keys, tenants and per-key limits on a real `spur serve` (its own server:
one tiny lane, keys given in SPUR_API_KEYS as the Helm chart exports them).

    alice, alice2   tenant acme       (alice2: a second key of the same tenant)
    bob             tenant globex
    solo            tenant solo, max_concurrent_requests 1
    meter           tenant meter, tokens_per_minute 600
    ops             admin key
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from e2e.conftest import (
    START_TIMEOUT_S,
    free_port,
    server_config,
    server_env,
    stop_server,
    wait_ready,
)

pytestmark = pytest.mark.slow

KEYS = {
    "alice": "sk-alice-8c1f0e2a",
    "alice2": "sk-alice2-77d3b0aa",
    "bob": "sk-bob-4b9d61e0",
    "solo": "sk-solo-0a6e2f19",
    "meter": "sk-meter-5e80c3d4",
    "ops": "sk-ops-d2c48a11",
}
KEYS_TEXT = yaml.safe_dump(
    {
        "keys": [
            {"key": KEYS["alice"], "name": "alice", "tenant": "acme"},
            {"key": KEYS["alice2"], "name": "alice2", "tenant": "acme"},
            {"key": KEYS["bob"], "name": "bob", "tenant": "globex"},
            {"key": KEYS["solo"], "name": "solo", "max_concurrent_requests": 1},
            {"key": KEYS["meter"], "name": "meter", "tokens_per_minute": 600},
            {"key": KEYS["ops"], "name": "ops", "admin": True},
        ]
    }
)


class KeyedServer:
    def __init__(self, url: str, log_path: Path) -> None:
        self.url = url
        self.log_path = log_path

    def client(self, who: str | None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {KEYS[who]}"} if who else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=120.0)


@pytest.fixture(scope="module")
def keyed(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[KeyedServer]:
    work = tmp_path_factory.mktemp("e2e-auth")
    data = server_config(tiny_model_dir, free_port())
    data["lanes"] = [lane for lane in data["lanes"] if lane["name"] == "tiny"]
    data["server"]["num_cpus"] = 4
    config_path = work / "spur-auth.yaml"
    config_path.write_text(yaml.safe_dump(data, sort_keys=False))
    log_path = work / "serve.log"
    ray_tmpdir = Path(tempfile.mkdtemp(prefix="spur-auth-", dir="/tmp"))
    env = {**server_env(ray_tmpdir), "SPUR_API_KEYS": KEYS_TEXT}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "spur.cluster.cli", "serve", str(config_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=work,
            start_new_session=True,
        )
    try:
        url = wait_ready(proc, log_path, START_TIMEOUT_S)
        yield KeyedServer(url, log_path)
    finally:
        problems = stop_server(proc, ray_tmpdir)
        shutil.rmtree(ray_tmpdir, ignore_errors=True)
    log_text = log_path.read_text(errors="replace")
    leaked = [name for name, key in KEYS.items() if key in log_text]
    assert not leaked, f"keys of {leaked} appear in the server's log"
    assert not problems, "\n".join(problems)


def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_routes_need_a_key_of_the_right_role(keyed: KeyedServer) -> None:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    with keyed.client(None) as anon, keyed.client("alice") as alice, keyed.client("ops") as ops:
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
            assert r.headers["WWW-Authenticate"].startswith("Bearer")
        wrong = anon.post("/v1/completions", json=body, headers={"Authorization": "Bearer sk-x"})
        assert error_of(wrong, 401)["code"] == "invalid_api_key"
        assert "sk-x" not in wrong.text
        # open: health (and /metrics, when served) never ask for a key
        assert anon.get("/health").status_code == 200
        assert anon.get("/metrics").status_code != 401
        # roles
        assert alice.post("/v1/completions", json=body).status_code == 200
        assert error_of(alice.get("/admin/config"), 403)["code"] == "admin_key_required"
        assert error_of(ops.post("/v1/completions", json=body), 403)["code"] == "api_key_required"
        config = ops.get("/admin/config")
        assert config.status_code == 200
        assert config.json()["server"]["auth"]["keys_env"] == "SPUR_API_KEYS"
        assert not any(key in config.text for key in KEYS.values())


def test_official_client_with_a_key_and_cached_tokens_always_present(
    keyed: KeyedServer,
) -> None:
    from openai import AuthenticationError, OpenAI

    base = f"{keyed.url}/v1"
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


def test_tenants_never_share_prefix_cache_blocks(keyed: KeyedServer) -> None:
    """The same 2k-token prompt: a second tenant gets no hit, the same tenant
    (another key of it included) does; cache_salt still separates within a tenant."""
    prompt = [(7 * i) % 40000 + 100 for i in range(2000)]
    with (
        keyed.client("alice") as alice,
        keyed.client("alice2") as alice2,
        keyed.client("bob") as bob,
    ):
        assert _cached(alice, prompt) == 0
        assert _cached(bob, prompt) == 0  # another tenant: no hit, no timing side channel
        hit = _cached(alice2, prompt)  # the same tenant, another key: shares
        assert hit >= 2000 - 16, hit
        assert _cached(bob, prompt) >= 2000 - 16  # bob's own earlier request
        assert _cached(alice, prompt, cache_salt="private") == 0
        assert _cached(alice2, prompt, cache_salt="private") >= 2000 - 16


def test_max_concurrent_requests_per_key_is_429_with_retry_after(keyed: KeyedServer) -> None:
    long = {
        "model": "tiny",
        "prompt": "Count:",
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    with keyed.client("solo") as solo, keyed.client("bob") as bob:
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


def test_tokens_per_minute_per_key(keyed: KeyedServer) -> None:
    prompt = list(range(1000, 1200))  # 200 tokens
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 100, "ignore_eos": True}
    with keyed.client("meter") as meter:
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


def test_keys_never_appear_in_answers(keyed: KeyedServer) -> None:
    with keyed.client("ops") as ops:
        for path in ("/admin/config", "/admin/lanes", "/admin/engines", "/admin/routing"):
            r = ops.get(path)
            assert r.status_code == 200, (path, r.text)
            assert not any(key in r.text for key in KEYS.values()), path
        dumped = json.dumps(ops.get("/admin/config").json())
        assert "SPUR_API_KEYS" in dumped
