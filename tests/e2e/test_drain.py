"""Graceful drain: SIGTERM to `spur serve` while streams run on two lanes.

    patient  drain_timeout_s 120: its 16 streams finish with every token
    hasty    drain_timeout_s 1:   its long streams end with the documented error
                                  (an SSE error event naming drain_timeout_s, not a
                                  reset connection), and nothing leaks

Both in one shutdown: exit status 0, every engine reports its pool's
check_integrity() as ok after the drain, /health says "draining" meanwhile.
"""

from __future__ import annotations

import ast
import json
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from .conftest import tiny_lane

pytestmark = pytest.mark.slow

STREAMS = 16
PATIENT_TOKENS = 800
HASTY_TOKENS = 1900


def _stream(url: str, model: str, i: int, max_tokens: int, out: dict[str, Any]) -> None:
    """One streaming completion; records tokens, the error event (if any), and how it
    ended. The first content chunk sets out["started"]."""
    body = {
        "model": model,
        "prompt": f"stream {i}",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    out.update(tokens=0, error=None, done=False, usage=None, exc=None)
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300.0) as resp:
            out["status"] = resp.status_code
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: ") :]
                if data == "[DONE]":
                    out["done"] = True
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    out["error"] = chunk["error"]
                    continue
                if chunk.get("usage"):
                    out["usage"] = chunk["usage"]
                for choice in chunk.get("choices", ()):
                    if choice.get("text"):
                        out["tokens"] += 1
                        out["started"].set()
    except httpx.HTTPError as exc:  # a reset connection: what must not happen
        out["exc"] = f"{type(exc).__name__}: {exc}"
    finally:
        out["started"].set()


def test_sigterm_drains_streams(launch_server: Any, tiny_model_dir: Path) -> None:
    lanes = [
        tiny_lane(tiny_model_dir, "patient", drain_timeout_s=120),
        tiny_lane(tiny_model_dir, "hasty", drain_timeout_s=1),
    ]
    for lane in lanes:  # room for every stream's whole length
        lane["engine"]["cache"]["num_kv_blocks"] = 2048
    srv = launch_server(lanes)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        assert srv.proc.poll() is None, srv.log()[-4000:]
        try:
            if httpx.get(f"{srv.url}/health", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    else:
        pytest.fail("not ready:\n" + srv.log()[-4000:])

    results: dict[str, list[dict[str, Any]]] = {"patient": [], "hasty": []}
    threads = []

    def start(lane: str, count: int, n_tokens: int) -> None:
        for i in range(count):
            out: dict[str, Any] = {"started": threading.Event()}
            results[lane].append(out)
            t = threading.Thread(target=_stream, args=(srv.url, lane, i, n_tokens, out))
            t.start()
            threads.append(t)
        for out in results[lane]:
            assert out["started"].wait(120), f"a stream of lane {lane} never started"

    # The hasty streams start last, right before SIGTERM. Started first, they ran on
    # while the patient lane's 16 streams got going, and on a fast machine they could
    # then finish within the 1 s drain (a CI run saw all four finish).
    start("patient", STREAMS, PATIENT_TOKENS)
    start("hasty", 4, HASTY_TOKENS)
    running = sum(o["tokens"] < PATIENT_TOKENS for o in results["patient"])
    assert running >= STREAMS // 2, f"only {running} streams still ran at SIGTERM: make them longer"

    srv.proc.send_signal(signal.SIGTERM)
    # Draining: new requests are refused with a 503 that says so, /health is 503.
    health, seen = None, []
    deadline = time.monotonic() + 30
    while health is None and time.monotonic() < deadline:
        try:
            resp = httpx.get(f"{srv.url}/health", timeout=10)
        except httpx.HTTPError as exc:
            seen.append(repr(exc))
            continue
        seen.append(resp.status_code)
        if resp.status_code == 503:
            health = resp.json()
        time.sleep(0.1)
    assert health is not None and health["status"] == "draining", seen
    late = httpx.post(
        f"{srv.url}/v1/completions",
        json={"model": "patient", "prompt": "late", "max_tokens": 2},
        timeout=30,
    )
    assert late.status_code == 503, late.text

    for t in threads:
        t.join(200)
    assert srv.proc.wait(200) == 0, srv.log()[-4000:]

    for out in results["patient"]:
        assert out["exc"] is None and out["error"] is None, out
        assert out["done"] and out["usage"]["completion_tokens"] == PATIENT_TOKENS, out
    hasty_errors = [o for o in results["hasty"] if o["error"] is not None]
    assert hasty_errors, "the 1 s drain let every long stream finish: make them longer"
    for out in results["hasty"]:
        assert out["exc"] is None, f"a stream was cut instead of ended: {out}"
        if out["error"] is not None:
            assert "drain_timeout_s" in out["error"]["message"], out["error"]
            assert out["done"], "the error event is followed by [DONE]"

    log = srv.log()
    reports = [ast.literal_eval(m) for m in re.findall(r"spur drain: (\{.*?\})", log)]
    by_lane = {r["replica_id"]: r for r in reports}
    assert len(by_lane) == 2, log[-4000:]
    for report in by_lane.values():
        assert report["integrity"] == "ok" and report["num_requests"] == 0, report
    assert sum(r["aborted"] for r in by_lane.values()) == len(hasty_errors), by_lane
