"""Load with disconnects on the keyed server (conftest): 1,000 streamed requests
at concurrency 64 through the official `openai` client, a tenth of the clients
hanging up mid-stream. No 5xx, every other stream complete, every KV block back
in the pool, and no memory growth per request: the ingress's and the engine's
RSS after the run stay within 10% of their level after the first 100 requests.

SPUR_LOAD_REQUESTS overrides the 1,000 (the first 100 are the baseline)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from e2e.keyed_server.conftest import KEYS, KeyedServer

pytestmark = pytest.mark.slow

REQUESTS = int(os.environ.get("SPUR_LOAD_REQUESTS", "1000"))
WARM = 100
CONCURRENCY = 64
MAX_TOKENS = 12
RSS_GROWTH_LIMIT = 0.10


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def server_rss(keyed: KeyedServer) -> dict[str, int]:
    """RSS of the ingress replica and the engine replica (by Serve's process titles)."""
    out = {}
    for pid, cmd in keyed.processes().items():
        if "ServeReplica:spur:ingress" in cmd:
            out["ingress"] = rss_bytes(pid)
        elif "ServeReplica:spur:engine-tiny" in cmd:
            out["engine"] = rss_bytes(pid)
    assert set(out) == {"ingress", "engine"}, keyed.processes()
    return out


def wait_idle(keyed: KeyedServer, timeout_s: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    with keyed.client("ops") as ops:
        while True:
            stats = ops.get("/admin/engines").json()["tiny"]
            if (
                stats.get("num_running") == 0
                and stats.get("num_waiting") == 0
                and stats["num_free_blocks"] == stats["num_blocks"] - 1
            ):
                return stats
            assert time.monotonic() < deadline, f"not idle after {timeout_s} s: {stats}"
            time.sleep(0.25)


async def one(client: Any, i: int, disconnect: bool) -> dict[str, Any]:
    from openai import APIStatusError

    try:
        stream = await client.completions.create(
            model="tiny",
            prompt=f"Request {i}: tell me a long story about the number {i * 7919 % 1000}",
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    except APIStatusError as exc:
        return {"status": exc.status_code, "error": str(exc)[:200]}
    tokens, finish = 0, None
    async for chunk in stream:
        for choice in chunk.choices:
            tokens += 1 if choice.text else 0
            finish = choice.finish_reason or finish
        if disconnect and tokens >= 2:
            await stream.close()  # hang up mid-stream
            return {"status": 200, "disconnected": True}
    return {"status": 200, "finish": finish, "chunks": tokens}


async def run_batch(url: str, indices: range) -> list[dict[str, Any]]:
    import httpx
    from openai import AsyncOpenAI

    limits = httpx.Limits(max_connections=CONCURRENCY + 8, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(limits=limits, timeout=120.0) as http:
        client = AsyncOpenAI(
            base_url=f"{url}/v1", api_key=KEYS["bob"], max_retries=0, http_client=http
        )
        sem = asyncio.Semaphore(CONCURRENCY)

        async def guarded(i: int) -> dict[str, Any]:
            async with sem:
                return await one(client, i, disconnect=i % 10 == 3)

        return await asyncio.gather(*(guarded(i) for i in indices))


def check(results: list[dict[str, Any]]) -> None:
    bad = [r for r in results if r["status"] != 200]
    assert not bad, bad[:5]
    for r in results:
        if not r.get("disconnected"):
            assert r["finish"] == "length", r


def test_load_with_disconnects_leaks_nothing(keyed_server: KeyedServer) -> None:
    started = time.monotonic()
    first = asyncio.run(asyncio.wait_for(run_batch(keyed_server.url, range(WARM)), 600))
    check(first)
    wait_idle(keyed_server)
    base = server_rss(keyed_server)
    rest = asyncio.run(asyncio.wait_for(run_batch(keyed_server.url, range(WARM, REQUESTS)), 1800))
    check(rest)
    stats = wait_idle(keyed_server)
    after = server_rss(keyed_server)
    elapsed = time.monotonic() - started
    assert stats.get("kv_leak_violations", 0) == 0, stats
    results = first + rest
    summary = {
        "requests": len(results),
        "disconnected": sum(1 for r in results if r.get("disconnected")),
        "seconds": round(elapsed, 1),
        "rss_mib_after_100": {k: round(v / 2**20, 1) for k, v in base.items()},
        "rss_mib_after_all": {k: round(v / 2**20, 1) for k, v in after.items()},
    }
    print("load summary:", json.dumps(summary))
    for name in ("ingress", "engine"):
        growth = after[name] / base[name] - 1
        assert growth <= RSS_GROWTH_LIMIT, f"{name} RSS grew {growth:.1%}: {summary}"
