"""The peer bench's HTTP client (`bench serve --peer llama-cpp`) against a real
`spur serve`: streamed chat completions counted from the usage chunk, TTFT and ITL
measured, the workload sent at the asked concurrency, the host's CPU and the client's
own wake-up lag read around it.
The llama.cpp side of the same client runs in tests/cluster/test_bench_peer.py
(opt-in: it builds llama.cpp)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from spur.cluster.bench import peer

pytestmark = pytest.mark.slow


def test_peer_arm_against_spur_serve(spur_server: Any) -> None:
    work = peer.chat_workload(4, seed=0)
    seen: list[int] = []
    summary = asyncio.run(
        peer._arm(spur_server.url, work, 12, 2, advance=lambda: seen.append(1), model="smol")
    )
    assert summary["errors"] == 0, summary["error_samples"]
    assert summary["generated_tokens"] == 4 * 12  # ignore_eos, counted from usage
    assert summary["tokens_from_usage"] is True
    assert len(seen) == 4  # the progress callback ran once per request
    assert 0 < summary["ttft_ms_p50"] <= summary["ttft_ms_p99"]
    assert 0 < summary["itl_ms_p50"] <= summary["itl_ms_p99"]
    assert 0 < summary["tpot_ms_p50"] <= summary["tpot_ms_p99"]
    assert summary["tokens_per_s"] > 0
    # The machine worked while the server generated (the server, this client).
    host = summary["host_cpu"]
    assert 0 < host["busy_pct"] <= 100 and 0 <= host["steal_pct"] <= host["busy_pct"]
    # How late the client's own loop woke meanwhile (cpu.ClientLag), read on Linux.
    lag = summary["client"]
    assert lag["loop_lag_ms_max"] is not None and lag["cpu_wait_s"] is not None, lag
    assert 0 <= lag["loop_lag_ms_p99"] <= lag["loop_lag_ms_max"]
