"""`spur bench routing --json`: replica choice on a shared-prefix multi-turn workload.

A lane of `replicas` engines (one per node: a `ray.cluster_utils.Cluster` on this
machine, or `--address` of a real cluster whose nodes carry {"bench-lane": 1})
serves the seeded workload of `workload.py` (groups of users sharing a system
prompt, each user's history growing over rounds; users arrive as a Poisson
process, each waits for an answer before its next turn). Each engine's pool is
sized so that the workload's working set exceeds one replica's KV and fits in
the lane's. Arms, one after the other in this process, each on a fresh
deployment (empty caches): round robin, Serve's default power of two choices,
spur's prefix router.

Per arm: the prefix-cache hit rate measured by the engines (cached tokens each
engine reports for the request it served, over prompt tokens), TTFT p50/p90,
generated tokens per second over the arm's wall time. Plus the oracle hit rate
(every request at the replica holding its chain, nothing evicted) and the
ratios the goals are stated in: hit / oracle, TTFT p50 / round robin's,
throughput / round robin's.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import statistics
import tempfile
import time
import urllib.request
import warnings
from dataclasses import asdict, replace
from typing import Any

from spur.actors.ports import free_port
from spur.cluster.bench.cpu import cpu_info
from spur.cluster.bench.serve import percentile_ms, sse_chunks
from spur.cluster.bench.workload import (
    UserScript,
    WorkloadSpec,
    build_workload,
    describe,
)

ARMS = ("round_robin", "power_of_two", "prefix")
LANE = "bench"


def pool_blocks(working_set_blocks: int, max_prompt_blocks: int, replicas: int) -> int:
    """Blocks per engine: half again the lane's share of the working set, and at
    least two of the longest prompts; always fewer than the working set."""
    blocks = max(math.ceil(1.5 * working_set_blocks / replicas), 2 * max_prompt_blocks)
    if blocks >= working_set_blocks:
        raise ValueError(
            f"the working set ({working_set_blocks} blocks) fits in one replica's pool "
            f"({blocks} blocks): grow the workload (groups, users, system prompt) so that "
            "routing matters"
        )
    return blocks


def _config(arm: str, model: str, replicas: int, blocks: int, block_size: int, port: int) -> Any:
    from spur.configs.loader import parse_config

    return parse_config(
        {
            "version": 1,
            "lanes": [
                {
                    "name": LANE,
                    "replicas": replicas,
                    "resources": {"bench-lane": 1},
                    "engine": {
                        "model": {"path": model, "dtype": "float32"},
                        "cache": {"block_size": block_size, "num_kv_blocks": blocks},
                        "scheduler": {"max_num_seqs": 32, "max_num_batched_tokens": 2048},
                        "parallelism": {"device": "cpu"},
                        "runtime": {"num_threads": 1},
                    },
                    "max_ongoing_requests": 64,
                    "max_queued_requests": 4096,
                }
            ],
            "router": {"policy": arm, "stats_period_s": 0.5},
            "server": {"host": "127.0.0.1", "port": port, "ingress_resources": {"head": 1}},
        }
    )


def local_cluster(
    nodes: dict[str, dict[str, float]], *, object_store_bytes: int = 100 * 1024**2
) -> tuple[Any, dict[str, Any]]:
    """A multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`): a head
    with {"head": 4} (the ingress, the KV index) and one 1-CPU node per entry of
    `nodes` (name -> custom resources). Returns the cluster and its nodes by name;
    the caller shuts it down."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "resources": {"head": 4},
            "object_store_memory": object_store_bytes,
            "include_dashboard": False,
        },
    )
    added = {
        name: cluster.add_node(
            num_cpus=1, resources=dict(res), object_store_memory=object_store_bytes
        )
        for name, res in nodes.items()
    }
    return cluster, added


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return json.loads(resp.read())


def _post(url: str, body: dict[str, Any]) -> Any:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


async def _turn(client: Any, url: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    body = {
        "model": LANE,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    out: dict[str, Any] = {"prompt_tokens": len(prompt)}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:300]}")
        async for chunk in sse_chunks(resp):
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                usage = chunk["usage"]
                out["tokens"] = usage["completion_tokens"]
                details = usage.get("prompt_tokens_details") or {}
                out["cached"] = details.get("cached_tokens", 0)
            elif "ttft" not in out and chunk["choices"] and chunk["choices"][0]["text"]:
                out["ttft"] = time.perf_counter() - start
    return out


async def _drive(url: str, scripts: list[UserScript]) -> tuple[list[dict[str, Any]], float]:
    import httpx

    results: list[dict[str, Any]] = []
    t0 = time.perf_counter()

    async def user(script: UserScript, client: Any) -> None:
        await asyncio.sleep(max(0.0, script.start_s - (time.perf_counter() - t0)))
        for turn in script.turns:
            results.append(await _turn(client, url, list(turn.prompt_token_ids), turn.max_tokens))

    limits = httpx.Limits(max_connections=len(scripts) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await asyncio.gather(*(user(s, client) for s in scripts))
    return results, time.perf_counter() - t0


def _wait_healthy(url: str, replicas: int, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            lanes = _get(f"{url}/admin/lanes")
            if sum(1 for r in lanes[LANE]["replicas"] if r["healthy"]) >= replicas:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the lane's {replicas} replicas did not all come up in {timeout:.0f}s")


def _arm(
    arm: str,
    scripts: list[UserScript],
    *,
    model: str,
    replicas: int,
    blocks: int,
    block_size: int,
    port: int,
) -> dict[str, Any]:
    from ray import serve

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from spur.cluster.app import build_app
    from spur.cluster.routing.index_actor import kill_index

    url = f"http://127.0.0.1:{port}"
    serve.run(
        build_app(_config(arm, model, replicas, blocks, block_size, port)),
        name="spur-bench",
        route_prefix="/",
    )
    try:
        _wait_healthy(url, replicas)
        # Warm every replica up (first-call costs), then forget what that cached.
        for i in range(2 * replicas):
            _post(f"{url}/v1/completions", {"model": LANE, "prompt": [50 + i] * 8, "max_tokens": 2})
        _post(f"{url}/admin/reset_prefix_cache", {"lane": LANE})
        time.sleep(1.5)
        results, wall = asyncio.run(_drive(url, scripts))
        time.sleep(1.0)  # one more heartbeat: the engines' counters below are final
        lanes = _get(f"{url}/admin/lanes")[LANE]["replicas"]
        routing = _get(f"{url}/admin/routing")
    finally:
        serve.delete("spur-bench")
        kill_index()
    prompt = sum(r["prompt_tokens"] for r in results)
    cached = sum(r.get("cached", 0) for r in results)
    tokens = sum(r.get("tokens", 0) for r in results)
    ttfts = [r["ttft"] for r in results if "ttft" in r]
    return {
        "arm": arm,
        "requests": len(results),
        "hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "ttft_ms_p50": percentile_ms(ttfts, 50),
        "ttft_ms_p90": percentile_ms(ttfts, 90),
        "ttft_ms_mean": round(statistics.fmean(ttfts) * 1000, 1) if ttfts else None,
        "tokens_per_s": round(tokens / wall, 2),
        "wall_s": round(wall, 2),
        "engines": [
            {
                "queries": r["prefix_queries_total"],
                "hits": r["prefix_hits_total"],
                "kv_usage": r["kv_usage"],
            }
            for r in lanes
        ],
        "decisions": {d["reason"]: d["count"] for d in routing["decisions"]},
    }


def run(
    *,
    model: str = "SmolLM2-135M-Instruct",
    replicas: int = 4,
    block_size: int = 16,
    spec: WorkloadSpec | None = None,
    arms: tuple[str, ...] = ARMS,
    address: str | None = None,
    quick: bool = False,
) -> dict[str, Any]:
    """Run the arms; returns a JSON-safe dict (see the module docstring)."""
    import ray
    from ray import serve

    spec = spec or WorkloadSpec()
    if quick:
        spec = replace(spec, groups=2, users_per_group=2, rounds=2, system_prompt_tokens=128)
    bad = [a for a in arms if a not in ARMS]
    if bad:
        raise ValueError(f"unknown arms {bad}; choose from {', '.join(ARMS)}")
    scripts = build_workload(spec)
    shape = describe(spec, block_size)
    blocks = pool_blocks(
        shape["working_set_blocks"],
        math.ceil(shape["max_prompt_tokens"] / block_size) + 2,
        replicas,
    )
    cluster = None
    if address is None:
        os.environ.setdefault("RAY_TMPDIR", tempfile.mkdtemp(prefix="spur-bench-", dir="/tmp"))
        cluster, _ = local_cluster({f"n{i}": {"bench-lane": 1} for i in range(replicas)})
        address = cluster.address
    port = free_port()
    ray.init(address=address, log_to_driver=False)
    out_arms = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        for arm in arms:
            out_arms.append(
                _arm(
                    arm,
                    scripts,
                    model=model,
                    replicas=replicas,
                    blocks=blocks,
                    block_size=block_size,
                    port=port,
                )
            )
    finally:
        serve.shutdown()
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
    by = {a["arm"]: a for a in out_arms}
    oracle = shape["oracle_hit_rate"]
    ratios: dict[str, Any] = {}
    rr = by.get("round_robin")
    for a in out_arms:
        r: dict[str, Any] = {"hit_vs_oracle": round(a["hit_rate"] / oracle, 3) if oracle else None}
        if rr is not None and a is not rr:
            if rr["ttft_ms_p50"] and a["ttft_ms_p50"] is not None:
                r["ttft_p50_vs_round_robin"] = round(a["ttft_ms_p50"] / rr["ttft_ms_p50"], 3)
            r["throughput_vs_round_robin"] = round(a["tokens_per_s"] / rr["tokens_per_s"], 3)
        ratios[a["arm"]] = r
    prefix = ratios.get("prefix", {})
    goals = {
        "hit_rate_at_least_0.9_of_oracle": (prefix.get("hit_vs_oracle") or 0) >= 0.9,
        "ttft_p50_at_most_half_of_round_robin": (prefix.get("ttft_p50_vs_round_robin") or 9) <= 0.5,
        "throughput_at_least_1.3x_round_robin": (prefix.get("throughput_vs_round_robin") or 0)
        >= 1.3,
    }
    return {
        "bench": "routing",
        "model": model,
        "cpu": cpu_info(),
        "replicas": replicas,
        "blocks_per_replica": blocks,
        "workload": {**asdict(spec), **shape},
        "oracle_hit_rate": round(oracle, 4),
        "arms": out_arms,
        "ratios": ratios,
        "goals": goals,
    }
