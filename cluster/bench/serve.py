"""`spur bench serve --json --url URL`: the HTTP path against the offline engine.

A seeded workload (text prompts of 32 to 256 tokens, 32 to 128 output tokens,
greedy, ignore_eos) is sent to a running server's /v1/completions at
concurrency 1, 8 and 32 (streaming, so time to first token and inter-token
latency are measured per request). Then, in this process, the same prompts go
through the offline engine (`LLM`, built from the server's own lane config,
max_num_seqs = the concurrency) so the cost of the Serve path is a ratio:
serve tokens/s over offline tokens/s at the same concurrency. The server's
prefix cache is reset before each serve arm and each offline arm starts cold, so
a repeated arm does not hit the prompts of the last one; both arms get one
untimed warm-up. Run the server and this bench on the same machine, one after
the other (never both busy), so both arms get the same cores.

A shared machine's speed drifts by more than the Serve path costs (the offline
arm alone moved between 72 and 96 tokens/s over a day here), so with `rounds`
> 1 (default 3) each level runs the arms in alternating order (serve, offline, offline,
serve, ...): each round's ratio compares two arms that ran back to back, and the
level reports the median round. Each arm records what the whole host did meanwhile
(`host_cpu`: busy and stolen CPU share, bench/cpu.py), and one the hypervisor took
CPU from is named on stderr. With `progress`, a bar per arm and level goes to
stderr; `plot` (cluster/bench/plot.py) draws the result.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import statistics
import time
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

from spur.cluster.auth import is_loopback
from spur.cluster.bench.cpu import (
    ClientLag,
    cpu_info,
    cpu_times,
    host_share,
    warn_client_lag,
    warn_steal,
)
from spur.cluster.bench.stats import percentile

TEXT = (
    "the river starts high in the mountains where snow melts each spring and runs down "
    "through pine forests into a narrow valley farmers built small stone channels to "
    "water their fields and every village keeps a record of who may open the gates "
    "cities grew on its banks because boats could carry grain and cloth to the sea"
)
WORDS = TEXT.split()


def make_workload(n: int, seed: int) -> list[tuple[str, int]]:
    """n (prompt text, max_tokens) pairs; about 1.3 tokens per word."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = rng.randint(25, 200)
        text = " ".join(rng.choice(WORDS) for _ in range(words))
        out.append((text, rng.randint(32, 128)))
    return out


def percentile_ms(values: list[float], q: float) -> float | None:
    """The q-th percentile of `values` (seconds) in milliseconds, interpolated as
    `stats.percentile`; None when empty."""
    p = percentile(values, q)
    return None if p is None else round(p * 1000, 2)


KEYS: dict[str, str | None] = {"api": None, "admin": None}
"""The keys `run` sends: "api" on /v1/*, "admin" on /admin/* (None: no header)."""


def auth_headers(admin: bool = False) -> dict[str, str]:
    """The Authorization header for an API (or admin) call, if a key is set."""
    key = KEYS["admin" if admin else "api"]
    return {"authorization": f"Bearer {key}"} if key else {}


def sse_json(line: str) -> dict[str, Any] | None:
    """The JSON chunk on one line of a streamed OpenAI response; None for any other line
    and for the closing `data: [DONE]`."""
    if line.startswith("data: ") and line != "data: [DONE]":
        return json.loads(line[6:])
    return None


async def sse_chunks(resp: Any) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of a streamed OpenAI response (an httpx response), in order."""
    async for line in resp.aiter_lines():
        if (chunk := sse_json(line)) is not None:
            yield chunk


async def _one(client: Any, url: str, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    first = None
    stamps: list[float] = []
    tokens = 0
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                return {"error": f"HTTP {resp.status_code}: {resp.text[:200]}"}
            async for chunk in sse_chunks(resp):
                if "error" in chunk:
                    return {"error": chunk["error"]["message"]}
                now = time.perf_counter()
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices"):
                    if first is None:
                        first = now
                    stamps.append(now)
    except Exception as exc:  # counted, not raised: the bench reports errors
        return {"error": f"{type(exc).__name__}: {exc}"}
    end = time.perf_counter()
    itl = [b - a for a, b in itertools.pairwise(stamps)]
    return {"ttft": (first or end) - start, "itl": itl, "tokens": tokens, "latency": end - start}


async def _http_level(
    url: str,
    model: str,
    work: list[tuple[str, int]],
    concurrency: int,
    advance: Any = None,
) -> dict[str, Any]:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits, headers=auth_headers()) as client:

        async def run(p: str, m: int) -> dict[str, Any]:
            async with sem:
                result = await _one(client, url, model, p, m)
            if advance is not None:
                advance()  # one request done: the progress bar (stderr)
            return result

        ticks = cpu_times()
        start = time.perf_counter()
        async with ClientLag() as lag:
            results = await asyncio.gather(*(run(p, m) for p, m in work))
        elapsed = time.perf_counter() - start
        host = host_share(ticks, cpu_times())
    ok = [r for r in results if "error" not in r]
    tokens = sum(r["tokens"] for r in ok)
    itl = [x for r in ok for x in r["itl"]]
    return {
        "concurrency": concurrency,
        "requests": len(work),
        "errors": len(results) - len(ok),
        "error_samples": [r["error"] for r in results if "error" in r][:3],
        "generated_tokens": tokens,
        "elapsed_s": round(elapsed, 3),
        "tokens_per_s": round(tokens / elapsed, 2) if elapsed else None,
        "ttft_ms_p50": percentile_ms([r["ttft"] for r in ok], 50),
        "ttft_ms_p99": percentile_ms([r["ttft"] for r in ok], 99),
        "itl_ms_p50": percentile_ms(itl, 50),
        "itl_ms_p99": percentile_ms(itl, 99),
        **tpot_ms(ok),
        "host_cpu": host,
        "client": lag.summary(),  # how late this client woke (cpu.ClientLag)
    }


def tpot_ms(ok: list[dict[str, Any]]) -> dict[str, float | None]:
    """vLLM's TPOT, p50 and p99 over requests: (latency - TTFT) / (tokens - 1), the time
    per output token after the first. `itl_ms_*` are the gaps between streamed chunks
    (vLLM's ITL), which hold several tokens each under stream_interval > 1 or a
    client that fell behind; TPOT stays per token."""
    per = [(r["latency"] - r["ttft"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    return {"tpot_ms_p50": percentile_ms(per, 50), "tpot_ms_p99": percentile_ms(per, 99)}


def _offline_level(
    engine_args: dict[str, Any], work: list[tuple[str, int]], concurrency: int
) -> dict[str, Any]:
    from spur.actors.llm import LLM
    from spur.actors.step import SamplingParams

    args = {**engine_args, "max_num_seqs": concurrency}
    model = args.pop("model")
    llm = LLM(model, **args)
    try:
        params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for _, m in work]
        # Warm-up, not timed, on a prompt of its own (no prefix hit for the run).
        llm.generate("warm up the engine", SamplingParams(max_tokens=4, temperature=0))
        ticks = cpu_times()
        start = time.perf_counter()
        outs = llm.generate([p for p, _ in work], params)
        elapsed = time.perf_counter() - start
        host = host_share(ticks, cpu_times())
    finally:
        llm.shutdown()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "concurrency": concurrency,
        "generated_tokens": tokens,
        "elapsed_s": round(elapsed, 3),
        "tokens_per_s": round(tokens / elapsed, 2),
        "host_cpu": host,
    }


def _reset_prefix_cache(url: str, lane: str) -> None:
    """Empty the lane's prefix caches, so that a level does not hit blocks an
    earlier run of the same seeded prompts left (the offline arm starts cold)."""
    req = urllib.request.Request(
        f"{url}/admin/reset_prefix_cache",
        data=json.dumps({"lane": lane}).encode(),
        headers={"content-type": "application/json", **auth_headers(admin=True)},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        resp.read()
    time.sleep(2.5)  # engines take admin commands with their next heartbeat


def _live_lane(url: str, model: str | None) -> tuple[str, str, dict[str, Any]]:
    req = urllib.request.Request(f"{url}/admin/config", headers=auth_headers(admin=True))
    with urllib.request.urlopen(req, timeout=10) as resp:
        config = json.loads(resp.read())
    from spur.cluster.app import engine_args
    from spur.configs.loader import parse_config

    cfg = parse_config(config, source=f"{url}/admin/config")
    lane = cfg.lane_for_model(model) if model else cfg.lanes[0]
    if lane is None:
        raise ValueError(f"no lane serves model {model!r}: use one of {cfg.model_names}")
    return lane.served_model_names[0], lane.name, engine_args(lane.engine)


def _ratio(http: dict[str, Any], offline: dict[str, Any]) -> float | None:
    if http["tokens_per_s"] and offline["tokens_per_s"]:
        return round(http["tokens_per_s"] / offline["tokens_per_s"], 3)
    return None


def _level(
    url: str,
    served: str,
    lane: str,
    args: dict[str, Any],
    work: list[tuple[str, int]],
    concurrency: int,
    rounds: int,
    baseline_url: str | None = None,
    bar: Any = None,
) -> dict[str, Any]:
    """`rounds` paired runs of both arms, the order alternating between rounds.
    With `baseline_url`, the second arm is that server over HTTP (same lane and
    workload) instead of the offline engine: e.g. metrics on vs off."""
    pairs = []
    for r in range(rounds):
        arms: dict[str, dict[str, Any]] = {}
        for arm in ("serve", "offline") if r % 2 == 0 else ("offline", "serve"):
            label = "baseline" if arm == "offline" and baseline_url else arm
            advance = bar.arm(f"c={concurrency} round {r + 1} {label}") if bar else None
            if arm == "serve":
                _reset_prefix_cache(url, lane)
                arms[arm] = asyncio.run(_http_level(url, served, work, concurrency, advance))
            elif baseline_url is not None:
                _reset_prefix_cache(baseline_url, lane)
                arms[arm] = asyncio.run(
                    _http_level(baseline_url, served, work, concurrency, advance)
                )
            else:
                arms[arm] = _offline_level(args, work, concurrency)
                for _ in work if advance else ():
                    advance()  # the offline engine reports at the end of its batch
            warn_steal(arms[arm]["host_cpu"], f"c={concurrency} round {r + 1} {label}")
            warn_client_lag(arms[arm].get("client"), f"c={concurrency} round {r + 1} {label}")
        pairs.append({**arms, "serve_over_offline": _ratio(arms["serve"], arms["offline"])})
    ratios = [p["serve_over_offline"] for p in pairs]
    known = [x for x in ratios if x is not None]
    # The level's arms are those of its median round (the lower one of an even count).
    median = sorted(known)[(len(known) - 1) // 2] if known else None
    chosen = pairs[ratios.index(median)] if median is not None else pairs[0]
    level = {"serve": chosen["serve"], "offline": chosen["offline"], "serve_over_offline": median}
    # Every round's failed requests: an arm that drops its slowest requests looks faster
    # in TTFT and slower in tokens/s, so no goal is met over errors.
    level["errors"] = {a: sum(p[a].get("errors", 0) for p in pairs) for a in ("serve", "offline")}
    if rounds > 1:
        level["rounds"] = pairs
        level["round_ratios"] = ratios
    return level


def _is_local(url: str) -> bool:
    """True when `url`'s host is this machine's loopback name or address."""
    return is_loopback(urllib.parse.urlsplit(url).hostname or "")


def run(
    *,
    url: str,
    model: str | None = None,
    concurrencies: tuple[int, ...] = (1, 8, 32),
    seed: int = 0,
    requests_per_level: int | None = None,
    rounds: int = 3,
    baseline_url: str | None = None,
    api_key: str | None = None,
    admin_key: str | None = None,
    progress: bool = False,
) -> dict[str, Any]:
    """With `baseline_url` the "offline" arm is that server (its numbers are under
    "offline" and the ratios are url over baseline_url). `api_key` / `admin_key`:
    sent as Bearer keys on /v1/* and /admin/* (a server with API keys; see
    server.auth), stripped; ValueError (naming the argument, never the key) when one
    holds whitespace or a control character inside."""
    from spur.configs.env import checked_client_key

    api_key = checked_client_key(api_key, "api_key")
    admin_key = checked_client_key(admin_key, "admin_key")
    KEYS.update(api=api_key, admin=admin_key or api_key)
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    url = url.rstrip("/")
    served, lane, args = _live_lane(url, model)
    # Warm-up, not timed, as the offline arm has one: a server's first requests
    # pay one-off costs (first calls into torch, Serve's routing) that are not
    # the Serve path's steady cost.
    asyncio.run(_http_level(url, served, [("warm up the engine", 4)] * 2, 2))
    if baseline_url is not None:
        baseline_url = baseline_url.rstrip("/")
        asyncio.run(_http_level(baseline_url, served, [("warm up the engine", 4)] * 2, 2))
    from spur.cluster.bench.progress import progress_bars

    levels = []
    with progress_bars(progress) as bar:
        for c in concurrencies:
            n = requests_per_level or max(8, 2 * c)
            work = make_workload(n, seed + c)
            bar.per_arm = n
            levels.append(_level(url, served, lane, args, work, c, rounds, baseline_url, bar))
    result: dict[str, Any] = {
        "bench": "serve",
        "url": url,
        "model": served,
        "seed": seed,
        "rounds": rounds,
        "baseline_url": baseline_url,
        # The bench's own host; it is the servers' too when their URLs are local.
        "cpu": cpu_info(),
        "servers_on_this_host": all(_is_local(u) for u in (url, baseline_url) if u),
        "levels": levels,
    }
    at32 = [lv for lv in levels if lv["serve"]["concurrency"] == 32]
    if at32:
        ratio, errors = at32[0]["serve_over_offline"], sum(at32[0]["errors"].values())
        result["goal_serve_over_offline_at_32"] = 0.9
        result["met"] = bool(ratio is not None and ratio >= 0.9 and not errors)
        if errors:
            result["not_met_because"] = f"{errors} request(s) failed at 32 streams"
    result["median_ratio"] = statistics.median(
        [lv["serve_over_offline"] for lv in levels if lv["serve_over_offline"] is not None] or [0]
    )
    return result
