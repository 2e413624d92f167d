"""`spur bench serve --peer llama-cpp`: `spur serve` side by side with llama.cpp's server.

The same OpenAI streaming workload goes to both servers: seeded chat prompts of
about 50 tokens, 128 output tokens (greedy, ignore_eos), `requests` per level, at
each concurrency (default 1, 4, 16). The bench starts both servers itself, one
pair per dtype pairing, on free ports, with the same CPU threads:

- `spur serve` from `configs/local.yaml` with `model.dtype` = float32 or bfloat16
  and `runtime.num_threads` = threads;
- llama.cpp's `llama-server -t T -tb T -np 16 -fa on` (continuous batching over 16
  slots), built by `llama_build.ensure_built()` from the llama-cpp-python sdist.

Like with like: the demo's Q4_1 GGUF is requantized (llama-quantize
`--allow-requantize`) to F32 and BF16, so llama.cpp computes on exactly the
dequantized weights spur loads (spur dequantizes the same file to fp32 and casts
to model.dtype; llama.cpp keeps 1-D norm weights in F32 in a BF16 file). Pairings:
spur float32 with llama.cpp F32, spur bfloat16 with llama.cpp BF16.

Within a pairing, each level runs `rounds` rounds whose arm order alternates
(spur, llama.cpp / llama.cpp, spur), so drift on a shared machine hits both;
each round sends fresh prompts (its own seed) to both servers, so no round hits a
prefix cached by an earlier one. A level reports each arm's median over rounds
and the median of the per-round ratios spur / llama.cpp (tokens/s: higher is
better for spur above 1; TTFT and ITL: spur's time over llama.cpp's, lower is
better for spur below 1). Both servers get an untimed warm-up first. Each arm
records the host's busy and stolen CPU share (`host_cpu`), each level each arm's
worst steal (`steal_pct_max`): a contended host lowers both servers' figures.

The client shares the cores with the servers it times. Each server runs in its own
session at autogroup nice 10 (`cpu.favour_client`), so the client gets a CPU as
soon as a token arrives instead of waiting its turn behind two busy server threads;
each arm records how late the client's loop woke (`client`, and `client_lag_ms_max`
a level), and a warning names an arm whose client waited more than 50 ms.

Progress goes to stderr (a rich progress bar per arm and level); the result is
one JSON document (the CLI keeps stdout for it). `plot(result, path)` draws
tokens/s and TTFT p50/p99 against concurrency, both servers side by side.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spur.actors.ports import free_port
from spur.cluster.bench.cpu import (
    ClientLag,
    cpu_info,
    cpu_times,
    favour_client,
    host_share,
    warn_client_lag,
    warn_steal,
)
from spur.cluster.bench.progress import progress_bars
from spur.cluster.bench.serve import WORDS, percentile_ms, sse_chunks, tpot_ms

logger = logging.getLogger(__name__)

PEERS = ("llama-cpp",)
GGUF_TYPES = {"float32": "F32", "bfloat16": "BF16"}
"""spur's model.dtype -> the llama.cpp weight type it is paired with."""
START_TIMEOUT_S = 600.0
MODEL = "SmolLM2-135M-Instruct"

TOPICS = (
    "rivers", "bridges", "bread", "glaciers", "libraries", "bees", "trains", "lighthouses",
    "volcanoes", "clocks", "forests", "harbors", "paper", "salt", "windmills", "comets",
)  # fmt: skip


def chat_workload(n: int, seed: int) -> list[list[dict[str, str]]]:
    """n seeded chat conversations (one user message each), about 50 prompt tokens
    with SmolLM2's chat template: a short question over 5 to 11 words of context."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        context = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 11)))
        topic = rng.choice(TOPICS)
        text = f"Here are some notes: {context}. Now write a long story about {topic}."
        out.append([{"role": "user", "content": text}])
    return out


def demo_gguf() -> Path:
    """The demo package's Q4_1 GGUF (the file `spur serve` dequantizes)."""
    from spur.actors.worker.loader import _demo_gguf

    return _demo_gguf(MODEL)


def requantize(quantize_bin: Path, src: Path, gguf_type: str, cache: Path) -> Path:
    """`src` rewritten with every tensor in `gguf_type` (F32 / BF16), cached in `cache`.

    Raises RuntimeError with llama-quantize's output when it fails."""
    stat = src.stat()
    out = cache / f"{src.stem}-{stat.st_size}-{stat.st_mtime_ns}.{gguf_type}.gguf"
    if out.exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".part")
    cmd = [str(quantize_bin), "--allow-requantize", str(src), str(tmp), gguf_type]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not tmp.exists():
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    os.replace(tmp, out)
    return out


def llama_server_cmd(
    server_bin: Path, gguf: Path, port: int, threads: int, parallel: int, ctx_per_slot: int
) -> list[str]:
    """llama-server with continuous batching over `parallel` slots and flash attention."""
    return [
        str(server_bin),
        "-m", str(gguf),
        "--host", "127.0.0.1",
        "--port", str(port),
        "-t", str(threads),
        "-tb", str(threads),
        "-np", str(parallel),
        "-c", str(parallel * ctx_per_slot),
        "-fa", "on",
        "--cont-batching",
        "--no-webui",
        "--alias", MODEL,
    ]  # fmt: skip


def spur_config(
    dtype: str, port: int, threads: int, base: str = "local", stream_interval: int | None = None
) -> dict[str, Any]:
    """`configs/<base>.yaml` (one lane) with model.dtype, threads and port set, and
    engine.runtime.stream_interval when given (else the base's)."""
    import yaml

    from spur.configs.loader import resolve_path

    data = yaml.safe_load(resolve_path(base).read_text())
    lane = data["lanes"][0]
    lane["engine"].setdefault("model", {})["dtype"] = dtype
    lane["engine"].setdefault("runtime", {})["num_threads"] = threads
    if stream_interval is not None:
        lane["engine"]["runtime"]["stream_interval"] = stream_interval
    lane["replicas"] = 1
    data["lanes"] = [lane]
    data.setdefault("server", {}).update(host="127.0.0.1", port=port)
    return data


@dataclass
class Server:
    """A server process the bench started (its own session, so stop() ends all of it)."""

    name: str
    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    cleanup: list[Path] = field(default_factory=list)
    autogroup_nice: int | None = None  # what `favour_client` gave its session

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""

    def wait_ready(self, timeout_s: float) -> None:
        """Until GET /v1/models answers 200; raises RuntimeError with the log's tail
        when the process exits or the deadline passes."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=5) as resp:
                    if resp.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGINT (spur shuts Ray down on it), then SIGKILL to the whole session."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("%s ignored SIGINT for %.0f s: killing it", self.name, timeout_s)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        for path in self.cleanup:
            shutil.rmtree(path, ignore_errors=True)


def _spawn(name: str, cmd: list[str], log: Path, env: dict[str, str], port: int) -> Server:
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=log.parent,
            start_new_session=True,
        )
    # Its own session, at a lower autogroup weight than the bench's: the client
    # must get a CPU when a token arrives, or it times its own waits (cpu.favour_client).
    nice = favour_client(proc.pid)
    return Server(name, f"http://127.0.0.1:{port}", proc, log, autogroup_nice=nice)


@contextlib.contextmanager
def spur_server(
    dtype: str, threads: int, work: Path, base: str = "local", stream_interval: int | None = None
) -> Iterator[Server]:
    """`spur serve` in a subprocess with its own embedded Ray (own RAY_TMPDIR)."""
    import yaml

    port = free_port()
    config = work / f"spur-{dtype}.yaml"
    data = spur_config(dtype, port, threads, base, stream_interval)
    config.write_text(yaml.safe_dump(data, sort_keys=False))
    ray_tmp = Path(tempfile.mkdtemp(prefix="spur-peer-", dir="/tmp"))  # short socket paths
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_ADDRESS")}
    env.update(
        RAY_TMPDIR=str(ray_tmp),
        RAY_AUTH_MODE="disabled",
        RAY_USAGE_STATS_ENABLED="0",
        HF_HUB_OFFLINE="1",
        PYTHONUNBUFFERED="1",
    )
    cmd = [sys.executable, "-m", "spur.cluster.cli", "serve", str(config)]
    server = _spawn(f"spur serve ({dtype})", cmd, work / f"spur-{dtype}.log", env, port)
    server.cleanup.append(ray_tmp)
    try:
        server.wait_ready(START_TIMEOUT_S)
        yield server
    finally:
        server.stop()


@contextlib.contextmanager
def llama_server(
    server_bin: Path, gguf: Path, threads: int, parallel: int, work: Path, ctx_per_slot: int = 512
) -> Iterator[Server]:
    port = free_port()
    cmd = llama_server_cmd(server_bin, gguf, port, threads, parallel, ctx_per_slot)
    log = work / f"llama-server-{gguf.stem.rsplit('.', 1)[-1]}.log"
    server = _spawn(f"llama-server ({gguf.name})", cmd, log, dict(os.environ), port)
    try:
        server.wait_ready(START_TIMEOUT_S)
        yield server
    finally:
        server.stop(timeout_s=20)


async def _one(
    client: Any, url: str, messages: list[dict[str, str]], max_tokens: int, model: str = MODEL
) -> dict[str, Any]:
    """One streamed chat completion: TTFT, the gaps between content chunks, tokens.

    A connection the server closes before any response ("Server disconnected
    without sending a response": llama-server does it to 14-20 of 192 requests a
    pairing at 16 streams, BENCHMARKS.md) is retried once on a new connection and
    counted in `retried`; the TTFT still counts from the first attempt. Anything
    else, and a second such close, is the request's `error`."""
    import httpx

    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = None
    stamps: list[float] = []
    tokens = None
    retried = 0
    while True:
        answered = False
        try:
            async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
                answered = True
                if resp.status_code != 200:
                    await resp.aread()
                    return {"error": f"HTTP {resp.status_code}: {resp.text[:200]}"}
                async for chunk in sse_chunks(resp):
                    if "error" in chunk:
                        return {"error": str(chunk["error"])[:200]}
                    now = time.perf_counter()
                    if chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
                    for choice in chunk.get("choices") or ():
                        if (choice.get("delta") or {}).get("content"):
                            first = first or now
                            stamps.append(now)
                            break
            break
        except httpx.RemoteProtocolError as exc:
            if answered or retried:
                return {"error": f"{type(exc).__name__}: {exc}", "retried": retried}
            retried += 1  # closed before any response: nothing was streamed
        except Exception as exc:  # counted, not raised: the bench reports errors
            return {"error": f"{type(exc).__name__}: {exc}", "retried": retried}
    end = time.perf_counter()
    itl = [b - a for a, b in itertools.pairwise(stamps)]
    return {
        "ttft": (first or end) - start,
        "itl": itl,
        "latency": end - start,
        "tokens": tokens if tokens is not None else len(stamps),
        "usage": tokens is not None,
        "retried": retried,
    }


async def _arm(
    url: str,
    work: list[list[dict[str, str]]],
    max_tokens: int,
    concurrency: int,
    advance: Callable[[], None] = lambda: None,
    model: str = MODEL,
) -> dict[str, Any]:
    """Send `work` with at most `concurrency` streams in flight; the arm's summary,
    with `host_cpu`: what the whole machine did meanwhile (`cpu.host_share`), and
    `client`: how late the client's own event loop woke (`cpu.ClientLag`)."""
    import httpx

    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:

        async def run(messages: list[dict[str, str]]) -> dict[str, Any]:
            async with sem:
                result = await _one(client, url, messages, max_tokens, model)
            advance()
            return result

        ticks = cpu_times()
        start = time.perf_counter()
        async with ClientLag() as lag:
            results = await asyncio.gather(*(run(m) for m in work))
        elapsed = time.perf_counter() - start
        host = host_share(ticks, cpu_times())
    return summarize(results, elapsed, concurrency) | {"host_cpu": host, "client": lag.summary()}


def summarize(results: list[dict[str, Any]], elapsed: float, concurrency: int) -> dict[str, Any]:
    """One arm's figures from its per-request results (errors counted, not timed)."""
    ok = [r for r in results if "error" not in r]
    tokens = sum(r["tokens"] for r in ok)
    itl = [x for r in ok for x in r["itl"]]
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "error_samples": [r["error"] for r in results if "error" in r][:3],
        # Requests sent again after the server closed their connection unanswered.
        "retried": sum(r.get("retried", 0) for r in results),
        "generated_tokens": tokens,
        "tokens_from_usage": all(r.get("usage") for r in ok),
        "elapsed_s": round(elapsed, 3),
        "tokens_per_s": round(tokens / elapsed, 2) if elapsed and ok else None,
        "ttft_ms_p50": percentile_ms([r["ttft"] for r in ok], 50),
        "ttft_ms_p99": percentile_ms([r["ttft"] for r in ok], 99),
        "itl_ms_p50": percentile_ms(itl, 50),
        "itl_ms_p99": percentile_ms(itl, 99),
        **tpot_ms(ok),
    }


METRICS = ("tokens_per_s", "ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99")


def combine(concurrency: int, rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """A level from its rounds ({"spur": arm, "llama_cpp": arm} each): each arm's
    median per metric over rounds, its errors, the most CPU time the hypervisor took
    in any of its rounds (`steal_pct_max`, None where unread), the latest the client's
    loop woke in any of them (`client_lag_ms_max`, None where unread), and per metric the
    median of the per-round ratios spur / llama.cpp (None where a round lacks the
    figure)."""
    level: dict[str, Any] = {"concurrency": concurrency}
    for arm in ("spur", "llama_cpp"):
        steal = [(r[arm].get("host_cpu") or {}).get("steal_pct") for r in rounds]
        known = [v for v in steal if v is not None]
        lag = [(r[arm].get("client") or {}).get("loop_lag_ms_max") for r in rounds]
        lag_known = [v for v in lag if v is not None]
        level[arm] = {m: _median([r[arm][m] for r in rounds]) for m in METRICS} | {
            "errors": sum(r[arm]["errors"] for r in rounds),
            "retried": sum(r[arm].get("retried", 0) for r in rounds),
            "steal_pct_max": max(known) if known else None,
            "client_lag_ms_max": max(lag_known) if lag_known else None,
        }
    ratios = {}
    for m in METRICS:
        per_round = [
            round(r["spur"][m] / r["llama_cpp"][m], 3)
            if r["spur"][m] and r["llama_cpp"][m]
            else None
            for r in rounds
        ]
        ratios[m] = {"median": _median(per_round), "rounds": per_round}
    level["spur_over_llama_cpp"] = ratios
    level["rounds"] = rounds
    return level


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(statistics.median(known), 3) if known else None


def run(
    *,
    dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    concurrencies: tuple[int, ...] = (1, 4, 16),
    requests_per_level: int = 64,
    max_tokens: int = 128,
    rounds: int = 2,
    seed: int = 0,
    threads: int = 2,
    parallel: int = 16,
    config: str = "local",
    stream_interval: int | None = None,
    sdist: Path | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Build (once) and start the peer, run every pairing, stop everything.

    Raises ValueError for a dtype without a pairing, RuntimeError when the build,
    a requantization or a server start fails (the message names the cause)."""
    from spur.cluster.bench import llama_build
    from spur.configs import env

    for d in dtypes:
        if d not in GGUF_TYPES:
            raise ValueError(f"dtype {d!r} has no llama.cpp pairing: use {list(GGUF_TYPES)}")
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    bin_dir = llama_build.ensure_built(sdist=sdist)
    src = demo_gguf()
    models = env.cache_dir() / "llama_cpp" / "models"
    result: dict[str, Any] = {
        "bench": "serve",
        "peer": "llama-cpp",
        "llama_cpp_source": f"llama-cpp-python {llama_build.VERSION} sdist (vendor/llama.cpp)",
        "cpu": cpu_info(),
        "model": MODEL,
        "gguf": src.name,
        "threads": threads,
        "llama_server": f"-t {threads} -tb {threads} -np {parallel} -fa on --cont-batching",
        "requests_per_level": requests_per_level,
        "max_tokens": max_tokens,
        "rounds": rounds,
        "seed": seed,
        "spur_config": config,
        # Tokens per streamed chunk after the first: llama-server streams every token.
        "spur_stream_interval": _stream_interval(config, stream_interval),
        "pairings": [],
    }
    total = len(dtypes) * len(concurrencies) * rounds * 2
    with progress_bars(progress, requests_per_level) as bar:
        bar.status(f"{total} arms of {requests_per_level} requests")
        for dtype in dtypes:
            gguf = requantize(bin_dir / "llama-quantize", src, GGUF_TYPES[dtype], models)
            with tempfile.TemporaryDirectory(prefix="spur-peer-bench-") as tmp:
                work = Path(tmp)
                bar.status(f"{dtype}: starting spur serve and llama-server")
                with (
                    spur_server(dtype, threads, work, config, stream_interval) as spur,
                    llama_server(bin_dir / "llama-server", gguf, threads, parallel, work) as peer,
                ):
                    urls = {"spur": spur.url, "llama_cpp": peer.url}
                    warm = chat_workload(2, seed - 1)
                    for url in urls.values():
                        asyncio.run(_arm(url, warm, 8, 2))
                    levels = []
                    for c in concurrencies:
                        per_round = []
                        for r in range(rounds):
                            work_r = chat_workload(requests_per_level, seed + 1000 * r + c)
                            order = ("spur", "llama_cpp") if r % 2 == 0 else ("llama_cpp", "spur")
                            arms = {}
                            for arm in order:
                                advance = bar.arm(f"{dtype} c={c} round {r + 1} {arm}")
                                arms[arm] = asyncio.run(
                                    _arm(urls[arm], work_r, max_tokens, c, advance)
                                )
                                name = f"{dtype} c={c} round {r + 1} {arm}"
                                warn_steal(arms[arm]["host_cpu"], name)
                                warn_client_lag(arms[arm]["client"], name)
                            per_round.append(arms)
                        levels.append(combine(c, per_round))
                    # None: the kernel does not schedule by autogroup (see `client`).
                    nices = {"spur": spur.autogroup_nice, "llama_cpp": peer.autogroup_nice}
            result["pairings"].append(
                {
                    "spur_dtype": dtype,
                    "llama_cpp_weights": GGUF_TYPES[dtype],
                    "server_autogroup_nice": nices,
                    "levels": levels,
                }
            )
    result["goals"] = goals(result)
    return result


def _stream_interval(config: str, override: int | None) -> int:
    """The stream interval spur serves with: the config `spur_server` writes, validated."""
    from spur.configs.loader import parse_config

    (lane,) = parse_config(spur_config("float32", 8000, 1, config, override)).lanes
    return lane.engine.runtime.stream_interval


def goals(result: dict[str, Any]) -> dict[str, Any]:
    """Issue 14's goal at the highest concurrency: spur >= 1.0x llama.cpp's tokens/s
    and TTFT p99 no worse, in every pairing, with no failed request in either arm (an
    arm's figures leave its failed requests out: dropping its slowest ones would lower
    its TTFT p99)."""
    out = {}
    for p in result["pairings"]:
        top = max(p["levels"], key=lambda lv: lv["concurrency"])
        r = top["spur_over_llama_cpp"]
        tps, ttft = r["tokens_per_s"]["median"], r["ttft_ms_p99"]["median"]
        errors = {a: sum(rd[a]["errors"] for rd in top["rounds"]) for a in ("spur", "llama_cpp")}
        out[p["spur_dtype"]] = {
            "concurrency": top["concurrency"],
            "tokens_per_s_ratio": tps,
            "ttft_p99_ratio": ttft,
            "errors": errors,
            "met": bool(
                tps is not None
                and tps >= 1.0
                and ttft is not None
                and ttft <= 1.0
                and not any(errors.values())
            ),
        }
    return out


def plot(result: dict[str, Any], path: str | Path) -> Path:
    """Draw tokens/s and TTFT p50/p99 against concurrency, spur and llama.cpp side
    by side, one row per dtype pairing, into a PNG at `path` (needs matplotlib:
    the `bench` extra). Returns the path."""
    from spur.cluster.bench.plot import pyplot, save

    plt = pyplot()

    pairings = result["pairings"]
    fig, axes = plt.subplots(len(pairings), 2, figsize=(11, 3.6 * len(pairings)), squeeze=False)
    colors = {"spur": "tab:blue", "llama_cpp": "tab:orange"}
    names = {"spur": "spur serve", "llama_cpp": "llama.cpp server"}
    for row, p in zip(axes, pairings, strict=True):
        cs = [lv["concurrency"] for lv in p["levels"]]
        title = f"spur {p['spur_dtype']} vs llama.cpp {p['llama_cpp_weights']}"
        for arm in ("spur", "llama_cpp"):
            tps = [lv[arm]["tokens_per_s"] for lv in p["levels"]]
            row[0].plot(cs, tps, "o-", color=colors[arm], label=names[arm])
            for q, style in (("p50", "o-"), ("p99", "s--")):
                ttft = [lv[arm][f"ttft_ms_{q}"] for lv in p["levels"]]
                row[1].plot(cs, ttft, style, color=colors[arm], label=f"{names[arm]} {q}")
        row[0].set(title=f"{title}: output tokens/s", xlabel="concurrency", ylabel="tokens/s")
        row[0].set_ylim(bottom=0)  # from zero: a 2% gap must not fill the panel
        row[1].set(title=f"{title}: TTFT", xlabel="concurrency", ylabel="ms", yscale="log")
        for ax in row:
            ax.set_xscale("log", base=2)
            ax.set_xticks(cs, [str(c) for c in cs])
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    cpu = result.get("cpu", {})
    fig.suptitle(
        f"{result.get('model', '')}, {result.get('threads', '?')} threads, "
        f"{result.get('requests_per_level', '?')} requests x {result.get('max_tokens', '?')} "
        f"tokens per level; {cpu.get('model', '')}",
        fontsize=9,
    )
    fig.tight_layout()
    return save(plt, fig, path)
