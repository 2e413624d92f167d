"""Process faults on a real `spur serve`: kill -9 a lane's engine replica while
16 streams run; every stream ends complete (those without a token yet are
retried, the others continue on the spare from the tokens they had), and the
server keeps answering. Its own server: lane "tiny" (one replica) and a spare
that serves it, both the tiny model."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
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
    _tiny_engine,
    free_port,
    server_config,
    server_env,
    stop_server,
    wait_ready,
)

pytestmark = pytest.mark.slow

STREAMS = 16
MAX_TOKENS = 150


@pytest.fixture(scope="module")
def spare_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    work = tmp_path_factory.mktemp("e2e-faults")
    data = server_config(tiny_model_dir, free_port())
    data["lanes"] = [lane for lane in data["lanes"] if lane["name"] == "tiny"]
    data["spare"] = {
        "name": "spare",
        "serves_lanes": ["tiny"],
        "engine": _tiny_engine(tiny_model_dir),
    }
    data["server"]["num_cpus"] = 4
    config_path = work / "spur-faults.yaml"
    config_path.write_text(yaml.safe_dump(data, sort_keys=False))
    log_path = work / "serve.log"
    ray_tmpdir = Path(tempfile.mkdtemp(prefix="spur-faults-", dir="/tmp"))
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "spur.cluster.cli", "serve", str(config_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=server_env(ray_tmpdir),
            cwd=work,
            start_new_session=True,
        )
    try:
        yield wait_ready(proc, log_path, START_TIMEOUT_S)
    finally:
        problems = stop_server(proc, ray_tmpdir)
        shutil.rmtree(ray_tmpdir, ignore_errors=True)
    assert not problems, "\n".join(problems)


async def streams_through_a_kill(url: str) -> list[dict[str, Any]]:
    from openai import AsyncOpenAI

    async with httpx.AsyncClient(timeout=180.0) as http:
        stats = (await http.get(f"{url}/admin/engines")).json()
        victim = int(stats["tiny"]["pid"])
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, http_client=http)
        started = [asyncio.Event() for _ in range(STREAMS)]

        async def one(i: int) -> dict[str, Any]:
            stream = await client.completions.create(
                model="tiny",
                prompt=f"Stream {i} tells a story:",
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            finish, usage = None, None
            async for chunk in stream:
                for choice in chunk.choices:
                    if choice.text:
                        started[i].set()
                    finish = choice.finish_reason or finish
                usage = chunk.usage or usage
            return {"finish": finish, "tokens": usage.completion_tokens if usage else None}

        tasks = [asyncio.create_task(one(i)) for i in range(STREAMS)]
        # kill once half the streams have tokens: both paths (retry, continuation) run
        while sum(e.is_set() for e in started) < STREAMS // 2:
            done = [t for t in tasks if t.done()]
            assert not done or all(not t.exception() for t in done)
            await asyncio.sleep(0.02)
        os.kill(victim, signal.SIGKILL)
        return list(await asyncio.gather(*tasks))


def test_kill_9_of_an_engine_replica_loses_no_stream(spare_server: str) -> None:
    url = spare_server
    with httpx.Client(base_url=url, timeout=60.0) as http:
        for model_name in ("tiny",):  # warm the lane
            r = http.post("/v1/completions", json={"model": model_name, "prompt": "hi"})
            assert r.status_code == 200, r.text
    results = asyncio.run(asyncio.wait_for(streams_through_a_kill(url), 300))
    assert results == [{"finish": "length", "tokens": MAX_TOKENS}] * STREAMS, results
    with httpx.Client(base_url=url, timeout=60.0) as http:
        # the server keeps answering (from the spare, or the restarted replica)
        deadline = time.monotonic() + 60
        while True:
            r = http.post("/v1/completions", json={"model": "tiny", "prompt": "after"})
            if r.status_code == 200:
                break
            assert r.status_code in (429, 503) and time.monotonic() < deadline, r.text
            time.sleep(0.5)
        lanes = http.get("/admin/lanes").json()
        assert "tiny" in lanes and "spare" in lanes
