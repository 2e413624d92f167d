"""`spur bench serve --peer llama-cpp`: the pure pieces, the plot, and (opt-in) the real peer.

The real llama.cpp build takes 10 to 60 minutes on two loaded cores, too long for
CI even once: `test_real_llama_server` runs only with SPUR_TEST_LLAMA_CPP=1 (it
builds, or reuses the cached build of, llama-server and llama-quantize). The HTTP
client the bench uses is checked against a real `spur serve` in
tests/e2e/shared_server/test_bench_peer_client.py.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from spur.cluster.bench import llama_build, peer


def _arm(tps: float, ttft: float, itl: float, errors: int = 0) -> dict[str, object]:
    return {
        "tokens_per_s": tps,
        "ttft_ms_p50": ttft,
        "ttft_ms_p99": 2 * ttft,
        "itl_ms_p50": itl,
        "itl_ms_p99": 3 * itl,
        "errors": errors,
    }


def test_workload_is_seeded_short_chat() -> None:
    a, b = peer.chat_workload(8, seed=3), peer.chat_workload(8, seed=3)
    assert a == b and a != peer.chat_workload(8, seed=4)
    for messages in a:
        assert [m["role"] for m in messages] == ["user"]
        # ~50 tokens with SmolLM2's template (its default system prompt is ~20 of them)
        assert 16 <= len(messages[0]["content"].split()) <= 22


def test_combine_takes_medians_and_per_round_ratios() -> None:
    rounds = [
        {"spur": _arm(80, 100, 10), "llama_cpp": _arm(100, 50, 8)},
        {"spur": _arm(90, 120, 12), "llama_cpp": _arm(100, 60, 8, errors=1)},
        {"spur": _arm(60, 80, 9), "llama_cpp": _arm(50, 40, 9)},
    ]
    level = peer.combine(16, rounds)
    assert level["concurrency"] == 16
    assert level["spur"]["tokens_per_s"] == 80 and level["llama_cpp"]["tokens_per_s"] == 100
    assert level["llama_cpp"]["errors"] == 1
    ratios = level["spur_over_llama_cpp"]
    assert ratios["tokens_per_s"]["rounds"] == [0.8, 0.9, 1.2]
    assert ratios["tokens_per_s"]["median"] == 0.9  # of the rounds, not of the medians
    assert ratios["ttft_ms_p99"]["rounds"] == [2.0, 2.0, 2.0]
    assert level["spur"]["steal_pct_max"] is None  # these arms read no host CPU
    rounds[1]["spur"]["host_cpu"] = {"busy_pct": 99.0, "steal_pct": 4.5}
    rounds[2]["spur"]["host_cpu"] = {"busy_pct": 98.0, "steal_pct": 0.5}
    assert peer.combine(16, rounds)["spur"]["steal_pct_max"] == 4.5
    assert level["spur"]["client_lag_ms_max"] is None  # nor the client's loop
    rounds[0]["spur"]["client"] = {"loop_lag_ms_p99": 3.0, "loop_lag_ms_max": 390.5}
    rounds[2]["spur"]["client"] = {"loop_lag_ms_p99": 1.0, "loop_lag_ms_max": 20.0}
    assert peer.combine(16, rounds)["spur"]["client_lag_ms_max"] == 390.5
    # A round that lacks a figure gives no ratio and is left out of the median.
    rounds[0]["spur"]["itl_ms_p50"] = None
    assert peer.combine(16, rounds)["spur_over_llama_cpp"]["itl_ms_p50"]["rounds"][0] is None


def test_goals_at_the_highest_concurrency() -> None:
    def pairing(dtype: str, top: tuple[float, float], peer_errors: int = 0) -> dict[str, object]:
        low = peer.combine(1, [{"spur": _arm(10, 10, 1), "llama_cpp": _arm(99, 1, 1)}])
        arms = {"spur": _arm(top[0], top[1], 1), "llama_cpp": _arm(100, 100, 1, peer_errors)}
        return {"spur_dtype": dtype, "levels": [peer.combine(16, [arms]), low]}

    goals = peer.goals(
        {"pairings": [pairing("float32", (120, 90)), pairing("bfloat16", (120, 110))]}
    )
    assert goals["float32"] == {
        "concurrency": 16,
        "tokens_per_s_ratio": 1.2,
        "ttft_p99_ratio": 0.9,
        "errors": {"spur": 0, "llama_cpp": 0},
        "met": True,
    }
    assert goals["bfloat16"]["met"] is False  # TTFT p99 worse than llama.cpp's
    # Failed requests leave an arm's figures (its slowest ones gone): no goal over them.
    dropped = peer.goals({"pairings": [pairing("float32", (120, 90), peer_errors=2)]})
    assert dropped["float32"]["errors"] == {"spur": 0, "llama_cpp": 2}
    assert dropped["float32"]["met"] is False


def test_summarize_counts_errors_and_falls_back_to_chunks() -> None:
    results = [
        {"ttft": 0.1, "itl": [0.01, 0.03], "latency": 0.14, "tokens": 3, "usage": True},
        {"ttft": 0.3, "itl": [0.02], "latency": 0.32, "tokens": 2, "usage": False},
        {"error": "HTTP 503: busy"},
    ]
    s = peer.summarize(results, elapsed=0.5, concurrency=2)
    assert (s["requests"], s["errors"], s["generated_tokens"]) == (3, 1, 5)
    assert s["tokens_per_s"] == 10.0 and s["tokens_from_usage"] is False
    # interpolated: the median of two is their mean; p99 of 10, 20, 30 ms is 29.8
    assert s["ttft_ms_p50"] == 200.0 and s["itl_ms_p99"] == 29.8
    assert s["error_samples"] == ["HTTP 503: busy"]
    # TPOT per request: (latency - ttft) / (tokens - 1): 20 ms and 20 ms
    assert s["tpot_ms_p50"] == s["tpot_ms_p99"] == pytest.approx(20.0)
    assert s["retried"] == 0
    results[0]["retried"] = 1
    assert peer.summarize(results, elapsed=0.5, concurrency=2)["retried"] == 1


async def _closing_server(close_first: int) -> tuple[asyncio.Server, str, list[int]]:
    """A real HTTP/1.1 server on a free port: its first `close_first` connections are
    closed once their request is read, without a response (a kept-alive connection
    the server had closed); later ones stream two content chunks and the usage."""
    seen: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        await reader.readexactly(length)
        seen.append(len(seen))
        if len(seen) <= close_first:
            writer.close()
            return
        events = [
            {"choices": [{"delta": {"content": "a"}}]},
            {"choices": [{"delta": {"content": "b"}}]},
            {"choices": [], "usage": {"completion_tokens": 2}},
        ]
        body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n"
            + f"content-length: {len(body)}\r\n\r\n{body}".encode()
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}", seen


@pytest.mark.parametrize("close_first", [0, 1, 2])
def test_a_connection_closed_unanswered_is_retried_once(close_first: int) -> None:
    import httpx

    async def one() -> tuple[dict[str, object], list[int]]:
        server, url, seen = await _closing_server(close_first)
        async with server, httpx.AsyncClient(timeout=10) as client:
            messages = [{"role": "user", "content": "hi"}]
            return await peer._one(client, url, messages, 2), seen

    result, seen = asyncio.run(one())
    if close_first < 2:  # answered on the first or the second connection
        assert "error" not in result, result
        assert result["tokens"] == 2 and result["retried"] == close_first
        assert len(seen) == close_first + 1
    else:  # a second close is the request's error: no third try
        assert result["retried"] == 1 and len(seen) == 2
        assert "RemoteProtocolError" in str(result["error"])


def test_llama_server_command_line() -> None:
    cmd = peer.llama_server_cmd(Path("/b/llama-server"), Path("/m/x.F32.gguf"), 9, 2, 16, 512)
    joined = " ".join(cmd)
    for part in ("-t 2", "-tb 2", "-np 16", "-c 8192", "-fa on", "--port 9", "--cont-batching"):
        assert part in joined


def test_spur_config_sets_dtype_threads_and_port() -> None:
    from spur.configs.loader import parse_config

    data = peer.spur_config("bfloat16", port=8123, threads=2)
    cfg = parse_config(data)  # the generated file is a valid config
    (lane,) = cfg.lanes
    assert lane.engine.model.dtype == "bfloat16"
    assert lane.engine.runtime.num_threads == 2
    assert cfg.server.port == 8123
    assert lane.engine.runtime.stream_interval == 1  # the base's (local.yaml: the default)
    chunked = parse_config(peer.spur_config("float32", 8123, 2, stream_interval=4))
    assert chunked.lanes[0].engine.runtime.stream_interval == 4
    assert peer._stream_interval("local", None) == 1
    assert peer._stream_interval("local", 4) == 4


def test_build_dir_is_keyed_and_missing_tools_name_the_fix(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SPUR_CACHE_DIR", str(tmp_path))
    assert llama_build.build_dir().parent == tmp_path / "llama_cpp"
    assert llama_build.build_dir("0.0.1") != llama_build.build_dir()
    assert llama_build.binaries() is None
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(RuntimeError, match="cmake"):
        llama_build.ensure_built()


def test_an_x86_level_builds_llama_cpp_for_that_level(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Under SPUR_CPU_TARGET the peer is built for the same level as spur's ops (ggml's
    native detection off, AVX-512 off for v3), in a folder of its own."""
    from spur.configs import cpu

    assert "-DGGML_NATIVE=ON" in llama_build.cmake_flags("native")
    v3 = llama_build.cmake_flags("x86-64-v3")
    assert "-DGGML_NATIVE=OFF" in v3 and "-DGGML_NATIVE=ON" not in v3
    assert {"-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_AVX512=OFF"} <= set(v3)
    assert "-DGGML_AVX512=ON" in llama_build.cmake_flags("x86-64-v4")
    if "avx2" not in cpu.here().native_flags:
        return
    monkeypatch.setenv("SPUR_CACHE_DIR", str(tmp_path))
    native = llama_build.build_dir()
    monkeypatch.setenv("SPUR_CPU_TARGET", "x86-64-v3")
    cpu.here.cache_clear()
    try:
        assert llama_build.build_dir() != native
    finally:
        monkeypatch.undo()
        cpu.here.cache_clear()


def test_an_interrupted_build_is_found_to_resume(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("SPUR_CACHE_DIR", str(tmp_path))
    out = llama_build.build_dir()
    assert llama_build._interrupted(out) is None
    other = out.parent / f"{llama_build.VERSION}-0123456789ab.x1"  # another CPU's or flags' build
    other.mkdir(parents=True)
    (other / "key").write_text(other.name.split(".x1")[0])
    assert llama_build._interrupted(out) is None
    mine = out.parent / f"{out.name}.abc"
    mine.mkdir()
    (mine / "key").write_text(out.name)
    assert llama_build._interrupted(out) == mine


def test_plot_draws_both_servers(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the bench extra (and the test extra) has it")
    levels = [
        peer.combine(c, [{"spur": _arm(20 * c, 50, 9), "llama_cpp": _arm(25 * c, 40, 8)}])
        for c in (1, 4, 16)
    ]
    result = {
        "model": peer.MODEL,
        "threads": 2,
        "cpu": peer.cpu_info(),
        "pairings": [
            {"spur_dtype": "float32", "llama_cpp_weights": "F32", "levels": levels},
            {"spur_dtype": "bfloat16", "llama_cpp_weights": "BF16", "levels": levels},
        ],
    }
    out = peer.plot(result, tmp_path / "sub" / "peer.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(out).shape
    assert width > 1000 and height > 700  # two rows of two panels


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("SPUR_TEST_LLAMA_CPP") != "1",
    reason="builds llama.cpp (10-60 min on 2 cores): opt in with SPUR_TEST_LLAMA_CPP=1",
)
def test_real_llama_server(tmp_path: Path) -> None:
    """The real peer: requantized F32 weights equal the Q4_1 file's dequantized values
    (what spur loads), and llama-server streams the bench's workload in full."""
    import gguf
    import numpy as np

    from spur.configs import env

    bin_dir = llama_build.ensure_built()
    src = peer.demo_gguf()
    f32 = peer.requantize(
        bin_dir / "llama-quantize", src, "F32", env.cache_dir() / "llama_cpp" / "models"
    )
    q_reader, f_reader = gguf.GGUFReader(src), gguf.GGUFReader(f32)
    f_tensors = {t.name: t for t in f_reader.tensors}
    name = "blk.0.attn_q.weight"
    q = next(t for t in q_reader.tensors if t.name == name)
    assert q.tensor_type.name == "Q4_1" and f_tensors[name].tensor_type.name == "F32"
    want = gguf.quants.dequantize(q.data, q.tensor_type)
    np.testing.assert_array_equal(np.asarray(f_tensors[name].data).reshape(want.shape), want)

    with peer.llama_server(bin_dir / "llama-server", f32, 2, 4, tmp_path) as server:
        work = peer.chat_workload(4, seed=0)
        summary = asyncio.run(peer._arm(server.url, work, 16, 2))
    assert summary["errors"] == 0, summary["error_samples"]
    assert summary["generated_tokens"] == 4 * 16  # ignore_eos holds on llama-server too
    assert summary["ttft_ms_p50"] is not None and summary["itl_ms_p50"] is not None
    assert server.proc.poll() is not None  # stopped with its context


def test_cli_misuse_is_a_usage_error() -> None:
    import subprocess
    import sys

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "spur.cluster.cli", "bench", "serve", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300)

    res = run("--json")
    assert res.returncode == 2 and "give --url" in res.stderr
    res = run("--peer", "llama-cpp", "--url", "http://127.0.0.1:1")
    assert res.returncode == 2 and "drop --url" in res.stderr
    # Checked before anything is built or started.
    res = run("--peer", "llama-cpp", "--dtypes", "float16", "--json")
    assert res.returncode == 2 and "no llama.cpp pairing" in res.stderr
    assert res.stdout == "" and "Traceback" not in res.stderr


def test_plot_draws_a_plain_serve_result(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the bench extra (and the test extra) has it")
    from spur.cluster.bench import plot

    levels = [
        {
            "serve": {"concurrency": c, "tokens_per_s": 9.0 * c, "ttft_ms_p50": 50.0 * c,
                      "ttft_ms_p99": 90.0 * c},
            "offline": {"concurrency": c, "tokens_per_s": 10.0 * c},
            "serve_over_offline": 0.9,
        }
        for c in (1, 8, 32)
    ]  # fmt: skip
    out = plot.draw({"bench": "serve", "model": "chat", "levels": levels}, tmp_path / "s.png")
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_progress_bars_count_requests_and_stay_off_stdout(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from spur.cluster.bench.progress import progress_bars

    with progress_bars(True, per_arm=3) as bars:
        advance = bars.arm("c=1 round 1 spur")
        for _ in range(3):
            advance()
        task = bars._progress.tasks[0]
        assert (task.completed, task.total) == (3, 3)
    assert capsys.readouterr().out == ""
    with progress_bars(False) as bars:
        bars.arm("nothing")()  # disabled: callable, does nothing


def test_percentiles_interpolate_as_numpy_does() -> None:
    """The rounded-index percentile took the p99 of 64 requests from the second slowest
    (one slow outlier vanished from a TTFT p99 goal), and the p50 of an even count from
    one of the middle two."""
    import random

    import numpy as np

    from spur.cluster.bench.stats import percentile

    ttfts = [0.1] * 62 + [0.2, 0.9]
    assert percentile(ttfts, 99) == pytest.approx(float(np.percentile(ttfts, 99)))
    assert percentile(ttfts, 99) == pytest.approx(0.459)
    assert percentile([1, 2, 3, 4], 50) == 2.5 and percentile([4, 1, 3], 50) == 3
    rng = random.Random(0)
    for n in (1, 2, 5, 64, 100):
        xs = [rng.random() for _ in range(n)]
        for q in (0, 50, 90, 95, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q))), (n, q)
    assert percentile([], 50) is None
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        percentile([1.0], 101)
