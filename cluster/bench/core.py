"""`spur bench core`: the engine core's bookkeeping on a fixed trace.

Trace: 2,000 requests of 1,024 prompt tokens whose first 512 tokens are shared
within 8 groups (request i is in group i % 8), 64 decode steps each, in batches
of 64, block size 16, a pool of 20,000 blocks (small enough that cached blocks
are evicted). Two arms over the same requests:

- manager: the KVCacheManager alone, op by op (hash the prompt, look up the
  prefix, allocate the prefill, 64 x append one token + allocate, free), each
  op timed; requests/s = requests / total bookkeeping time. This is the trace
  on which vLLM 0.33's KVCacheManager does about 1,400 requests/s on this
  machine class (docs/architecture.md, "Reference figures").
- scheduler: the same requests through Scheduler + FakeExecutor (no KV
  simulation): whole engine steps, so it adds scheduling and output building.

In the same process, a baseline hash arm hashes the same prompts the way vLLM
does (SHA-256 over a pickled (parent, tokens, extras) tuple) so the hashing
ratio is measured side by side, not against a remembered number.
"""

from __future__ import annotations

import gc
import hashlib
import pickle
import random
import time
from typing import Any

from spur.actors.engine.core.engine_core import EngineCore
from spur.actors.engine.core.fake_executor import FakeExecutor
from spur.actors.engine.core.kv_cache_manager import KVCacheConfig, KVCacheManager
from spur.actors.engine.core.request import Request
from spur.actors.engine.core.scheduler import Scheduler, SchedulerConfig
from spur.actors.step import SamplingParams
from spur.cluster.bench.cpu import cpu_info

VLLM_REFERENCE_RPS = 1400.0


def make_prompts(
    num_requests: int, prompt_len: int, shared_len: int, num_groups: int, seed: int
) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(50_000) for _ in range(shared_len)] for _ in range(num_groups)]
    return [
        prefixes[i % num_groups] + [rng.randrange(50_000) for _ in range(prompt_len - shared_len)]
        for i in range(num_requests)
    ]


def _vllm_style_chain(tokens: list[int], block_size: int) -> list[bytes]:
    parent = b"\x00" * 32
    out = []
    for i in range(len(tokens) // block_size):
        blk = tuple(tokens[i * block_size : (i + 1) * block_size])
        parent = hashlib.sha256(pickle.dumps((parent, blk, None), protocol=5)).digest()
        out.append(parent)
    return out


def run_manager_arm(
    prompts: list[list[int]], *, block_size: int, num_blocks: int, batch: int, decode: int
) -> dict[str, Any]:
    kv = KVCacheManager(
        KVCacheConfig(block_size=block_size, num_blocks=num_blocks), max_chunk=1 << 20
    )
    params = SamplingParams(max_tokens=decode, ignore_eos=True)
    t_hash = t_lookup = t_prefill = t_decode = t_free = 0
    n_decode_ops = 0
    clock = time.perf_counter_ns
    for start in range(0, len(prompts), batch):
        reqs = []
        for i in range(start, min(start + batch, len(prompts))):
            t0 = clock()
            req = Request(f"r{i}", prompts[i], params, block_hasher=kv.hasher)
            t1 = clock()
            hits, num_hit = kv.get_computed_blocks(req)
            t2 = clock()
            blocks = kv.allocate_slots(req, req.num_tokens - num_hit, 0, hits, num_hit)
            if blocks is None:
                raise RuntimeError("the trace's pool is too small for one batch")
            req.num_computed_tokens = req.num_tokens
            # vLLM's allocate_slots caches the new full blocks itself: timed with it
            kv.cache_blocks(req)
            t3 = clock()
            t_hash += t1 - t0
            t_lookup += t2 - t1
            t_prefill += t3 - t2
            reqs.append(req)
        for step in range(decode):
            token = 1000 + step
            t0 = clock()
            for req in reqs:
                req.append_output_token_ids((token,))
                if kv.allocate_slots(req, 1) is None:
                    raise RuntimeError("the trace's pool is too small for one batch")
                req.num_computed_tokens += 1
                kv.cache_blocks(req)
            t_decode += clock() - t0
            n_decode_ops += len(reqs)
        t0 = clock()
        for req in reqs:
            kv.free(req)
        t_free += clock() - t0
    kv.check_integrity()
    n = len(prompts)
    total_s = (t_hash + t_lookup + t_prefill + t_decode + t_free) / 1e9
    stats = kv.prefix_stats
    return {
        "requests_per_s": round(n / total_s, 1),
        "us_per_op": {
            "hash_prompt": round(t_hash / n / 1e3, 2),
            "prefix_lookup": round(t_lookup / n / 1e3, 2),
            "allocate_prefill": round(t_prefill / n / 1e3, 2),
            "allocate_decode": round(t_decode / n_decode_ops / 1e3, 3),
            "free": round(t_free / n / 1e3, 2),
        },
        "prefix_hit_rate": round(stats.hits / stats.queries, 4),
        "evictions": kv.pool.stats.num_evictions,
        "total_s": round(total_s, 3),
    }


def run_scheduler_arm(
    prompts: list[list[int]], *, block_size: int, num_blocks: int, batch: int, decode: int
) -> dict[str, Any]:
    kv_config = KVCacheConfig(block_size=block_size, num_blocks=num_blocks)
    prompt_len = len(prompts[0])
    sched = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=batch * prompt_len,
            max_num_seqs=batch,
            max_model_len=prompt_len + decode + 1,
            long_prefill_token_threshold=0,
            policy="fcfs",
            check_kv_bounds=True,
        ),
        kv_config,
    )
    core = EngineCore(sched, FakeExecutor(kv_config, simulate_kv=False))
    params = SamplingParams(max_tokens=decode, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        core.add_request(sched.make_request(f"r{i}", p, params))
    steps = 0
    while core.has_unfinished_requests():
        core.step()
        steps += 1
    elapsed = time.perf_counter() - t0
    sched.check_integrity()
    return {
        "requests_per_s": round(len(prompts) / elapsed, 1),
        "steps": steps,
        "us_per_step": round(elapsed / steps * 1e6, 1),
        "evictions": sched.kv.pool.stats.num_evictions,
        "total_s": round(elapsed, 3),
    }


def run_hash_arms(prompts: list[list[int]], block_size: int) -> dict[str, Any]:
    """Ours vs the vLLM-style pickle hash, interleaved, same prompts."""
    from spur.actors.engine.core.hashing import BlockHasher

    hasher = BlockHasher(block_size)
    ours = base = 0.0
    sample = prompts[:256]
    for _ in range(3):
        t0 = time.perf_counter()
        for p in sample:
            hasher.chain(p)
        t1 = time.perf_counter()
        for p in sample:
            _vllm_style_chain(p, block_size)
        t2 = time.perf_counter()
        ours += t1 - t0
        base += t2 - t1
    n = 3 * len(sample)
    return {
        "us_per_prompt_spur": round(ours / n * 1e6, 2),
        "us_per_prompt_vllm_style": round(base / n * 1e6, 2),
        "speedup": round(base / ours, 2),
    }


def run(
    *,
    num_requests: int = 2000,
    prompt_len: int = 1024,
    shared_len: int = 512,
    num_groups: int = 8,
    decode: int = 64,
    batch: int = 64,
    block_size: int = 16,
    num_blocks: int = 20_000,
    seed: int = 0,
) -> dict[str, Any]:
    prompts = make_prompts(num_requests, prompt_len, shared_len, num_groups, seed)
    kw = {"block_size": block_size, "num_blocks": num_blocks, "batch": batch, "decode": decode}
    gc.collect()
    manager = run_manager_arm(prompts, **kw)
    gc.collect()
    scheduler = run_scheduler_arm(prompts, **kw)
    hashing = run_hash_arms(prompts, block_size)
    return {
        "bench": "core",
        "cpu": cpu_info(),
        "trace": {
            "requests": num_requests,
            "prompt_tokens": prompt_len,
            "shared_prefix_tokens": shared_len,
            "prefix_groups": num_groups,
            "decode_steps": decode,
            "batch": batch,
            "block_size": block_size,
            "num_blocks": num_blocks,
            "seed": seed,
        },
        "manager": manager,
        "scheduler": scheduler,
        "hashing": hashing,
        "vllm_reference_requests_per_s": VLLM_REFERENCE_RPS,
        "manager_vs_vllm_reference": round(manager["requests_per_s"] / VLLM_REFERENCE_RPS, 2),
    }
