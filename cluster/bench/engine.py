"""`spur bench engine`: continuous batching (spur) vs static batching (transformers).

Workload (seeded): `num_requests` requests (64), prompts of 32 to 512 tokens,
outputs of 16 to 256 tokens, lengths uniform and independent. Prompts are real
English: the paragraph below, tokenized with the model's tokenizer, read as an
endless loop from a distinct offset per request (so no two prompts share a first
KV block and prefix caching plays no part); a model folder without a tokenizer
gets seeded random ids from its vocabulary instead. Every request asks for
exactly its output length (ignore_eos, greedy).

For each dtype, in one process, one arm after the other (the order alternates
between dtypes, so neither arm always runs on a warmer or a more fragmented
process):

- spur: `LLM.generate` with `SamplingParams(max_tokens=k, ignore_eos=True,
  temperature=0)`, all requests at once (continuous batching, paged KV).
- hf: `hf_reference.hf_static_batches`, batches of 16 in arrival order,
  left-padded, each decoding until its longest request is done.

Throughput is useful generated tokens (sum of requested outputs) per second of
generation; model loading and a tiny warm-up are outside the timed region. The
headline is the ratio spur / hf, measured side by side (docs/architecture.md,
"Facts the code relies on": absolute times on a shared 2-core machine are
noise). In fp32 the two arms' token ids are compared as well (greedy fp32 is batch-invariant there).

This module imports no torch (cluster/ never does): everything that touches
tensors lives in `spur.actors.worker.hf_reference` and `spur.actors.llm`, imported
inside `run`.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

from spur.cluster.bench.cpu import cpu_info

# Written for this benchmark; any English prose of a few hundred tokens would do.
TEXT = (
    "The harbour town woke slowly on the first cold morning of autumn. Fishing boats that "
    "had sat idle all summer were dragged down the shingle, their hulls scraped and painted, "
    "and the old men who mended nets along the sea wall argued about the weather as they had "
    "for forty years. A baker opened her shutters and set trays of bread in the window, and "
    "the smell drifted up the narrow streets to the school, where children pressed their "
    "faces to the glass and waited for the bell. Down at the quay a ferry sounded its horn "
    "twice, the signal that the crossing to the island would run despite the wind. Travellers "
    "with rucksacks and paper cups of coffee hurried aboard, followed by a van full of "
    "crates of apples and a farmer leading two reluctant goats. The harbour master, a patient "
    "woman who had learned the tides before she learned to read, checked her watch, wrote the "
    "time in a ledger, and waved the ferry off. Beyond the breakwater the water turned from "
    "green to grey, and gulls followed the wake in long untidy loops. On the island, the "
    "lighthouse keeper had been awake since four. He climbed the spiral stair each morning to "
    "wipe salt from the great lens, a habit kept long after the light was automated, because "
    "he believed that a machine watched over by nobody would one day simply stop. His "
    "daughter, home from the city for a week, thought this was sentimental, and told him so "
    "over breakfast, but she climbed the stair with him all the same and stood on the gallery "
    "while the sun came up behind the clouds. From there they could see the ferry, small as a "
    "toy, pushing through the swell, and further off the dark line of the mainland hills. "
    "They talked about the cost of repairs to the jetty, about a neighbour who had sold his "
    "cottage to a painter, about whether the school on the island would stay open another "
    "year with only nine pupils. Neither of them said what both were thinking: that the island "
    "was emptying, one family at a time, and that the light would go on turning long after "
    "the last keeper had gone. In the afternoon the wind dropped and the sea lay flat and "
    "bright. The painter set up an easel on the headland and worked until her fingers were too "
    "cold to hold the brush, trying to catch the exact colour of the water where it met the "
    "rocks, a colour that changed every time a cloud crossed the sun. Children from the school "
    "came to watch, asked her why the sky in her picture was yellow, and ran off before she "
    "could explain. By evening the ferry had made its last crossing, the bakery had sold out, "
    "and the lights of the town came on one by one along the curve of the bay."
)

HF_BATCH_SIZE = 16

logger = logging.getLogger(__name__)


def _lengths(rng: random.Random, n: int, lo: int, hi: int) -> list[int]:
    return [rng.randint(lo, hi) for _ in range(n)]


def make_workload(
    model_dir: Path, *, num_requests: int, seed: int, quick: bool
) -> tuple[list[list[int]], list[int], str]:
    """Seeded `(prompts, output_lengths, source)`; source is "text" or "random".

    Full: prompts 32-512 tokens, outputs 16-256. Quick: prompts 16-48, outputs 4-16.
    """
    rng = random.Random(seed)
    p_lo, p_hi, o_lo, o_hi = (16, 48, 4, 16) if quick else (32, 512, 16, 256)
    prompt_lens = _lengths(rng, num_requests, p_lo, p_hi)
    output_lens = _lengths(rng, num_requests, o_lo, o_hi)
    tok_file = model_dir / "tokenizer.json"
    if tok_file.exists():
        from tokenizers import Tokenizer

        stream = Tokenizer.from_file(str(tok_file)).encode(TEXT, add_special_tokens=False).ids
        source = "text"
    else:
        vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
        stream = [rng.randrange(3, vocab) for _ in range(4096)]  # ids 0-2: usually special
        source = "random"
    period = len(stream)
    if period >= num_requests:
        offsets = rng.sample(range(period), num_requests)
    else:
        offsets = [rng.randrange(period) for _ in range(num_requests)]
    prompts = [
        [stream[(off + j) % period] for j in range(n)]
        for off, n in zip(offsets, prompt_lens, strict=True)
    ]
    return prompts, output_lens, source


def _summary(values: list[int]) -> dict[str, Any]:
    return {
        "min": min(values),
        "max": max(values),
        "mean": round(sum(values) / len(values), 1),
        "total": sum(values),
    }


def _token_match(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """How far two runs' token ids agree: exact requests, mean common-prefix fraction."""
    exact = 0
    prefix_frac = 0.0
    first_diff = []
    for x, y in zip(a, b, strict=True):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        exact += x == y
        prefix_frac += n / max(len(x), len(y), 1)
        if x != y:
            first_diff.append(n)
    return {
        "exact_requests": exact,
        "requests": len(a),
        "mean_common_prefix_fraction": round(prefix_frac / max(len(a), 1), 4),
        "first_divergence_positions": sorted(first_diff)[:16],
    }


def _jsonable(stats: Any) -> dict[str, Any]:
    if not isinstance(stats, dict):
        return {}
    return {k: v for k, v in stats.items() if isinstance(v, int | float | str | bool | None)}


def run_spur_arm(
    model: str,
    prompts: list[list[int]],
    output_lens: list[int],
    *,
    dtype: str,
    seed: int,
    llm_kwargs: dict[str, Any],
    matmul_floor: bool = False,
    share_rounds: int = 1,
) -> dict[str, Any]:
    """Load `LLM`, warm it up, time one `generate` of every request; shut it down.

    With `matmul_floor`, the timed run's step shapes are replayed through the
    model's linear layers and LM head alone (`ModelRunner.time_matmuls`) before
    shutting down: `matmul_s` is what the run would take if attention, norms,
    sampling and scheduling cost nothing, its matmuls computed on torch's path as
    transformers computes them (the ceiling: spur's own kernels cannot move it);
    `spur_matmul_s` replays them on spur's path (native linears at decode's row
    counts where the CPU has them), which the profile splits the forward by.
    Decode attention is not free, though: it must read each context's K/V rows once
    per step, a memory-bound cost that no kernel removes. So the arm also measures
    the device's read rate (`ModelRunner.memory_read_rate`) and reports
    `kv_read_floor_s`, the workload's decode K/V bytes at that rate (see `_kv_floor`).

    `share_rounds` > 1 (with `matmul_floor`) pairs the share's two times again: the
    run and its torch-path replay are measured `share_rounds` times in all, each extra
    round on an emptied prefix cache, alternating which of the two goes first, and
    `share_rounds` lists each round's `matmul_s / elapsed`, `matmul_share_median` their
    median. One run and one replay minutes apart each carry the machine's drift of the
    moment (10-20% within an hour on a shared 2-core VM); a round's two times are
    taken back to back. A round whose steps differ from the first's is marked.
    `matmul_share_at_fastest_replay` is the rounds' median share against the fastest
    replay of them all (`matmul_s_fastest`): the ceiling at its best, as each shape's
    time already is. It is the steadier figure where the torch path swings more than
    spur's run does (bf16 through oneDNN on a Zen 5 VM: replays 9.9-12.8 s back to back
    while spur's own matmul replay held 7.9-8.3 s, BENCHMARKS.md twenty-sixth round),
    and never above the median.
    """
    from spur.actors.llm import LLM
    from spur.actors.step import SamplingParams
    from spur.actors.worker.hf_reference import PeakRss

    # The engine settings are the schema's (engine.* of a config file) but for these.
    kwargs: dict[str, Any] = {"seed": seed, **llm_kwargs}
    with PeakRss() as whole:
        t0 = time.perf_counter()
        llm = LLM(model=model, dtype=dtype, **kwargs)
        load_s = time.perf_counter() - t0
        try:
            warm = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0)
            llm.generate([prompts[0][:8]], warm)
            params = [
                SamplingParams(max_tokens=k, ignore_eos=True, temperature=0) for k in output_lens
            ]
            before_times = llm.executor.collective_rpc("step_times")[0]
            before = before_times["shapes"]
            with PeakRss() as during:
                t1 = time.perf_counter()
                outs = llm.generate(prompts, params)
                elapsed = time.perf_counter() - t1
            after_times = llm.executor.collective_rpc("step_times")[0]
            stats = getattr(llm, "last_run_stats", None)
            block_bytes = llm.info.kv_bytes_per_block
            compute_dtype = llm.info.compute_dtype
            floor: dict[str, Any] = {}
            matmul_s = None
            spur_matmul_s = None
            if matmul_floor:
                shapes = _shape_delta(before, after_times["shapes"])
                # The ceiling: the run's matmuls on torch's path, as transformers computes
                # them; the profile: on spur's own (native linears at decode's row counts).
                matmul_s = max(llm.executor.collective_rpc("time_matmuls", (shapes, True)))
                spur_matmul_s = max(llm.executor.collective_rpc("time_matmuls", (shapes, False)))
                floor = _floor(shapes, matmul_s, elapsed)
                floor["spur_matmul_s"] = round(spur_matmul_s, 3)
                rate = min(llm.executor.collective_rpc("memory_read_rate"))
                kv_bytes = decode_kv_positions(prompts, output_lens) * (
                    block_bytes // llm.scheduler.block_size
                )
                floor.update(_kv_floor(kv_bytes, rate, matmul_s, elapsed))
                if share_rounds > 1:
                    floor.update(
                        _share_rounds(
                            llm, prompts, params, shapes, share_rounds, matmul_s, elapsed, rate
                        )
                    )
            profile = step_profile(before_times, after_times, elapsed, spur_matmul_s)
        finally:
            llm.shutdown()
    token_ids = [list(o.outputs[0].token_ids) for o in outs]
    useful = sum(len(t) for t in token_ids)
    stats = stats if isinstance(stats, dict) else {}
    held = stats.get("kv_tokens_held_peak")
    slots = stats.get("kv_slots_allocated_peak")
    return {
        "token_ids": token_ids,
        "useful_tokens": useful,
        "requested_tokens": sum(output_lens),
        "finish_reasons": sorted({str(o.outputs[0].finish_reason) for o in outs}),
        "elapsed_s": round(elapsed, 3),
        "tokens_per_s": round(useful / elapsed, 2) if elapsed > 0 else None,
        "load_s": round(load_s, 3),
        "compute_dtype": compute_dtype,
        "kv_slots_allocated_peak": slots,
        "kv_tokens_held_peak": held,
        "kv_utilization": round(held / slots, 4) if held is not None and slots else None,
        **_pool_bytes(stats, block_bytes),
        "steps": stats.get("steps"),
        "num_preemptions": stats.get("num_preemptions"),
        "last_run_stats": _jsonable(stats),
        "peak_rss_delta_bytes": during.delta_bytes,
        "peak_rss_delta_with_load_bytes": whole.delta_bytes,
        "engine_kwargs": kwargs,
        "profile": profile,
        **floor,
    }


PHASES = ("prepare", "forward", "logits", "sample")


def step_profile(
    before: dict[str, Any], after: dict[str, Any], elapsed: float, matmul_s: float | None
) -> dict[str, Any]:
    """Where the timed run's seconds went (rank 0's runner, `StepTimes`): preparing
    the step's inputs, the forward, the LM head, sampling, and `engine_s`: the rest
    of `generate` (scheduling, block bookkeeping, output processing, Python between
    steps). With the matmul floor, `forward` and `logits` split into `matmuls_s` and
    `outside_matmuls_s` (attention, norms, RoPE, activations, the KV store, dispatch)."""
    out = {f"{p}_s": round(after[f"{p}_s"] - before[f"{p}_s"], 3) for p in PHASES}
    out["engine_s"] = round(elapsed - sum(out.values()), 3)
    out["steps"] = after["steps"] - before["steps"]
    if matmul_s is not None:
        model_s = out["forward_s"] + out["logits_s"]
        out["matmuls_s"] = round(matmul_s, 3)
        out["outside_matmuls_s"] = round(max(0.0, model_s - matmul_s), 3)
    return out


def _pool_bytes(stats: dict[str, Any], block_bytes: int) -> dict[str, Any]:
    """Bytes of the blocks in use at the peak (attention pages and, for hybrid
    models, state pages) and per request running then (rank 0's share)."""
    blocks, running = stats.get("kv_blocks_used_peak"), stats.get("running_at_kv_peak")
    if not blocks:
        return {}
    total = blocks * block_bytes
    return {
        "kv_bytes_peak": total,
        "kv_bytes_per_request_at_peak": total // running if running else None,
    }


def prefix_hit_speedup(
    model: str, *, prefix_tokens: int, dtype: str, seed: int, rounds: int = 3
) -> dict[str, Any]:
    """Prefill time of a request whose `prefix_tokens`-token prefix is cached against
    a cold one of the same length, in one engine, interleaved. Per round: a first
    request of a fresh prefix alone (a conversation's first turn: its state at the
    prefix's end is kept), then, timed, the prefix plus a 16-token tail (the hit)
    and another fresh prefix plus a tail (cold). Medians of `rounds`; one output
    token each. (States are cached where a prefill chunk ends on a block boundary,
    so a hit starts from the longest such point inside the shared prefix.)"""
    import statistics

    from spur.actors.llm import LLM
    from spur.actors.step import SamplingParams
    from spur.actors.worker.loader import load_config, resolve_model_dir

    vocab = int(load_config(resolve_model_dir(model)).get_text_config().vocab_size)
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    one = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)
    llm = LLM(
        model=model,
        dtype=dtype,
        max_model_len=prefix_tokens + 64,
        seed=seed,
    )
    cold, hit, cached = [], [], []
    try:
        llm.generate([ids(32)], one)  # warm-up
        for _ in range(rounds):
            prefix = ids(prefix_tokens)
            llm.generate([prefix], one)
            t0 = time.perf_counter()
            (out,) = llm.generate([prefix + ids(16)], one)
            t1 = time.perf_counter()
            llm.generate([ids(prefix_tokens + 16)], one)
            t2 = time.perf_counter()
            hit.append(t1 - t0)
            cold.append(t2 - t1)
            cached.append(out.num_cached_tokens)
    finally:
        llm.shutdown()
    c, h = statistics.median(cold), statistics.median(hit)
    return {
        "prefix_tokens": prefix_tokens,
        "cold_s": round(c, 4),
        "hit_s": round(h, 4),
        "speedup": round(c / h, 2) if h > 0 else None,
        "cached_tokens": cached,
    }


def _share_rounds(
    llm: Any,
    prompts: list[list[int]],
    params: list[Any],
    shapes: list[tuple[int, int, int]],
    rounds: int,
    matmul_s: float,
    elapsed: float,
    rate: float,
) -> dict[str, Any]:
    """`rounds` paired (run, torch-path replay) measurements, the first given (with the
    read rate measured after it); see `run_spur_arm`. Odd rounds replay first, even
    ones run first. Each round's `memory_read_gbps` is the device's read rate measured
    right after its pair, so the memory's state is on record beside each share: the
    run streams the K/V of every decode step, the replay only the weights, and a
    neighbour's load on a shared VM moved the rate between 46 and 83 GB/s within
    minutes (BENCHMARKS.md, forty-first round)."""
    gbps = round(rate / 1e9, 2)
    out = [
        {"elapsed_s": round(elapsed, 3), "matmul_s": round(matmul_s, 3), "memory_read_gbps": gbps}
    ]
    for r in range(1, rounds):
        llm.scheduler.kv.reset_prefix_cache()
        replay = None
        if r % 2:
            replay = max(llm.executor.collective_rpc("time_matmuls", (shapes, True)))
        before = llm.executor.collective_rpc("step_times")[0]["shapes"]
        t0 = time.perf_counter()
        llm.generate(prompts, params)
        run_s = time.perf_counter() - t0
        steps = _shape_delta(before, llm.executor.collective_rpc("step_times")[0]["shapes"])
        if replay is None:
            replay = max(llm.executor.collective_rpc("time_matmuls", (shapes, True)))
        rate = min(llm.executor.collective_rpc("memory_read_rate"))
        out.append(
            {
                "elapsed_s": round(run_s, 3),
                "matmul_s": round(replay, 3),
                "memory_read_gbps": round(rate / 1e9, 2),
                "order": "replay, run" if r % 2 else "run, replay",
                "same_steps": sorted(steps) == sorted(shapes),
            }
        )
    for o in out:
        o["share"] = round(o["matmul_s"] / o["elapsed_s"], 3)
    median = statistics.median(o["share"] for o in out)
    fastest = min(o["matmul_s"] for o in out)
    at_fastest = statistics.median(fastest / o["elapsed_s"] for o in out)
    return {
        "share_rounds": out,
        "matmul_share_median": round(median, 3),
        "matmul_s_fastest": round(fastest, 3),
        "matmul_share_at_fastest_replay": round(at_fastest, 3),
    }


def _shape_delta(before: list[list[int]], after: list[list[int]]) -> list[tuple[int, int, int]]:
    """Step shapes (tokens, logits rows, count) counted between two snapshots."""
    old = {(n, m): c for n, m, c in before}
    delta = [(n, m, c - old.get((n, m), 0)) for n, m, c in after]
    return [d for d in delta if d[2] > 0]


def _floor(shapes: list[tuple[int, int, int]], matmul_s: float, elapsed: float) -> dict[str, Any]:
    """The matmul replay's figures; every sampled row made one useful token."""
    sampled = sum(m * c for _, m, c in shapes)
    return {
        "matmul_steps": sum(c for _, _, c in shapes),
        "matmul_tokens": sum(n * c for n, _, c in shapes),
        "matmul_logit_rows": sampled,
        "matmul_s": round(matmul_s, 3),
        "matmul_share": round(matmul_s / elapsed, 3) if elapsed > 0 else None,
        "matmul_ceiling_tokens_per_s": round(sampled / matmul_s, 2) if matmul_s > 0 else None,
    }


def decode_kv_positions(prompts: list[list[int]], output_lens: list[int]) -> int:
    """K/V positions the workload's decode steps read, each a K and a V row in every
    layer: output token i (i >= 1; token 0 comes from the prefill) attends to the
    prompt and the i tokens before it, P + i positions. Exact for this bench's runs
    (greedy, ignore_eos, no speculation); a preemption re-prefills, no decode reads."""
    return sum(
        (k - 1) * len(p) + k * (k - 1) // 2
        for p, k in zip(prompts, output_lens, strict=True)
        if k > 0
    )


def _kv_floor(kv_bytes: int, rate: float, matmul_s: float, elapsed: float) -> dict[str, Any]:
    """The memory-bound part of the floor: decode K/V bytes at the device's read rate.

    `floor_s` = matmuls + K/V reads: what the run would take if nothing else cost
    time; `floor_share` = floor_s / elapsed. `matmul_share_bound` = matmul_s / floor_s
    is the highest `matmul_share` (hence throughput_ratio / matmul_ceiling_ratio) any
    engine could reach on this machine, workload and KV dtype.
    """
    kv_s = kv_bytes / rate if rate > 0 else 0.0
    floor_s = matmul_s + kv_s
    return {
        "kv_read_bytes": kv_bytes,
        "memory_read_gbps": round(rate / 1e9, 2),
        "kv_read_floor_s": round(kv_s, 3),
        "floor_s": round(floor_s, 3),
        "floor_share": round(floor_s / elapsed, 3) if elapsed > 0 else None,
        "matmul_share_bound": round(matmul_s / floor_s, 3) if floor_s > 0 else None,
    }


def run_hf_arm(
    model_dir: Path,
    prompts: list[list[int]],
    output_lens: list[int],
    *,
    dtype: str,
    batch_size: int,
) -> dict[str, Any]:
    """Load the transformers model (fresh), run `hf_static_batches`, drop the model."""
    from spur.actors.worker import hf_reference as hf

    hf.clear_cache()
    with hf.PeakRss() as whole:
        t0 = time.perf_counter()
        hf.load_model(model_dir, dtype)
        load_s = time.perf_counter() - t0
        out = hf.hf_static_batches(
            model_dir, prompts, output_lens, batch_size=batch_size, dtype=dtype
        )
    hf.clear_cache()
    out["load_s"] = round(load_s, 3)
    out["peak_rss_delta_with_load_bytes"] = whole.delta_bytes
    return out


def run(
    *,
    num_requests: int | None = None,
    seed: int = 0,
    dtypes: tuple[str, ...] = ("float32", "bfloat16"),
    model: str = "SmolLM2-135M-Instruct",
    quick: bool = False,
    arms: tuple[str, ...] = ("spur", "hf"),
    hf_batch_size: int | None = None,
    llm_kwargs: dict[str, Any] | None = None,
    matmul_floor: bool = False,
    share_rounds: int = 1,
    prefix_hit_tokens: int = 0,
) -> dict[str, Any]:
    """Run the engine benchmark; returns a JSON-ready dict (see the module docstring).

    Args:
        num_requests: default 64 (8 with `quick`).
        quick: 8 requests, prompts 16-48 and outputs 4-16 tokens, HF batches of 4,
            for a CI test well under a minute.
        arms: which of "spur" and "hf" to run ("hf" alone works without `spur.actors.llm`).
        hf_batch_size: static batch size of the hf arm (16; 4 with `quick`).
        llm_kwargs: extra keyword arguments for `LLM(...)` (override the schema's
            engine defaults: spur.configs.schema.EngineConfig, flattened).
        matmul_floor: also time the spur run's matmuls alone (see `run_spur_arm`)
            and report `matmul_ceiling_ratio`: the ratio spur would reach if only
            its matmuls cost time (each step shape timed 3 times, the fastest kept).
            Adds about the spur arm's own time.
        share_rounds: with `matmul_floor`, measure the share's run and replay this
            many times in pairs (`run_spur_arm`); `ceiling_share_median` is their
            median, `ceiling_share_at_fastest_replay` the same against the fastest
            replay. Each extra round adds about twice the spur arm's time.
        prefix_hit_tokens: when > 0, also time a prefill whose prefix of that many
            tokens is cached against a cold one, per dtype (`prefix_hit_speedup`).

    Raises:
        ValueError: an unknown arm or an empty dtype list.
        ImportError: "spur" requested while `spur.actors.llm` cannot be imported.
    """
    from spur.actors.worker import hf_reference as hf
    from spur.actors.worker.loader import resolve_model_dir

    unknown = set(arms) - {"spur", "hf"}
    if unknown or not arms:
        raise ValueError(f"arms {arms!r}: choose from 'spur' and 'hf'")
    if not dtypes:
        raise ValueError("dtypes is empty: give at least one of 'float32', 'bfloat16'")
    if share_rounds < 1 or (share_rounds > 1 and not matmul_floor):
        raise ValueError(
            f"share_rounds {share_rounds}: give 1, or more together with matmul_floor "
            "(the rounds pair the run with its matmul replay)"
        )
    n = num_requests if num_requests is not None else (8 if quick else 64)
    batch_size = hf_batch_size or (4 if quick else HF_BATCH_SIZE)
    model_dir = resolve_model_dir(model)
    prompts, output_lens, source = make_workload(model_dir, num_requests=n, seed=seed, quick=quick)
    from spur.actors.worker.onednn import matmul_path

    # Which library and kernel this CPU's matmuls take per dtype (oneDNN's AMX /
    # AVX-512 BF16 brgemm, or not oneDNN at all), as the JSON's `matmul_paths`.
    paths = [matmul_path(d) for d in dtypes]

    results: dict[str, Any] = {}
    for i, dtype in enumerate(dtypes):
        order = list(arms) if i % 2 == 0 else list(reversed(arms))
        entry: dict[str, Any] = {"order": order}
        for arm in order:
            gc.collect()
            if arm == "spur":
                entry["spur"] = run_spur_arm(
                    model,
                    prompts,
                    output_lens,
                    dtype=dtype,
                    seed=seed,
                    llm_kwargs=llm_kwargs or {},
                    matmul_floor=matmul_floor,
                    share_rounds=share_rounds,
                )
            else:
                entry["hf"] = run_hf_arm(
                    model_dir, prompts, output_lens, dtype=dtype, batch_size=batch_size
                )
            logger.info(
                "%s %s: %s tok/s in %s s",
                dtype,
                arm,
                entry[arm]["tokens_per_s"],
                entry[arm]["elapsed_s"],
            )
        if "spur" in entry and "hf" in entry:
            s, h = entry["spur"], entry["hf"]
            if s["tokens_per_s"] and h["tokens_per_s"]:
                entry["throughput_ratio"] = round(s["tokens_per_s"] / h["tokens_per_s"], 3)
                if s.get("matmul_ceiling_tokens_per_s"):
                    entry["matmul_ceiling_ratio"] = round(
                        s["matmul_ceiling_tokens_per_s"] / h["tokens_per_s"], 3
                    )
                    # the goal figure: spur's share of the way to the ceiling
                    entry["ceiling_share"] = round(
                        entry["throughput_ratio"] / entry["matmul_ceiling_ratio"], 3
                    )
                    if "matmul_share_median" in s:
                        # ceiling_share = spur tok/s / ceiling tok/s = matmul_s / elapsed
                        # (every sampled row is one useful token): the rounds' median
                        entry["ceiling_share_median"] = s["matmul_share_median"]
                        entry["ceiling_share_at_fastest_replay"] = s[
                            "matmul_share_at_fastest_replay"
                        ]
            entry["token_match"] = _token_match(s["token_ids"], h["token_ids"])
            if s["kv_slots_allocated_peak"] and h["kv_slots_allocated_peak"]:
                entry["kv_slots_peak_ratio"] = round(
                    s["kv_slots_allocated_peak"] / h["kv_slots_allocated_peak"], 3
                )
        for arm in ("spur", "hf"):
            if arm in entry:
                entry[arm].pop("token_ids")
        if prefix_hit_tokens and "spur" in arms:
            entry["prefix_hit"] = prefix_hit_speedup(
                model, prefix_tokens=prefix_hit_tokens, dtype=dtype, seed=seed
            )
        results[dtype] = entry

    return {
        "bench": "engine",
        "model": model,
        "model_dir": str(model_dir),
        "seed": seed,
        "quick": quick,
        "num_requests": n,
        "workload": {
            "prompt_source": source,
            "prompt_tokens": _summary([len(p) for p in prompts]),
            "output_tokens": _summary(output_lens),
            "ignore_eos": True,
            "temperature": 0,
        },
        "hf_batch_size": batch_size,
        "torch_num_threads": hf.torch_num_threads(),
        "cpu_count": os.cpu_count(),
        "cpu": cpu_info(),
        "matmul_paths": paths,
        "results": results,
        "process_max_rss_bytes": hf.max_rss_bytes(),
    }
