"""The GPU check: one script a CUDA machine runs as it is, with a JSON summary on stdout.

    python3 actors/gpu_check.py [--out FILE] [--budget-s 420] [--skip engine]   # one GPU
    python3 actors/gpu_check.py --dry-run                                      # CPU, tiny
    spur bench gpu [--dry-run]                                  # the same, from the CLI

It needs torch, triton, transformers (config parsing), safetensors and numpy:
no Ray, no pydantic (`EngineArgs.of` reads the schema's defaults from
configs/engine_defaults.json then), no network, no install (it makes `spur.*`
importable from the checkout it lives in). Logs go to stderr, the summary to
stdout (and --out).

Sections, each timed and recorded (`ok`, `error` with its traceback); a failure
in one does not stop the others:

1. kernels: every Triton kernel against its torch reference on the device:
   store_kv (bitwise), paged attention (unified kernel on a mixed batch; decode
   kernel with 1, 4 and automatic splits; sliding windows) for fp32, fp16 and
   bf16 queries on caches of their dtype and on fp8 (e4m3 + scales), and the
   Gated DeltaNet conv and delta-rule kernels in fp32, fp16 and bf16.
2. bandwidth: the decode kernel's achieved HBM bandwidth (bytes of K/V it must
   read, plus queries and outputs, over its median time in CUDA events) as a
   fraction of the device's peak (H200: 4.8 TB/s; --peak-tbs overrides), next to
   a device-to-device copy as the practical ceiling.
3. engine: the offline engine (`LLM`) on a random-weight Llama of Llama-3.2-1B's
   shape in bf16, a decode-heavy workload at several batch sizes, eager against
   CUDA graphs (the same engine, graphs detached for the eager arm), tokens/s and
   how many requests produced the same tokens.

--dry-run runs every section on CPU with tiny sizes (the Triton kernels in the
interpreter, fp32 / fp16 / fp8 only; the engine's "graph" arm through the padded
buffers without capture, which must give the eager tokens exactly): the CI test
of this script, with `ray` and `pydantic` imports blocked.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import platform
import random
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger("spur.gpu_check")

ROOT = Path(__file__).resolve().parents[1]

# Peak HBM bandwidth by device name (TB/s, vendor figures).
PEAK_TBS = {"H200": 4.8, "H100 SXM": 3.35, "H100 PCIe": 2.0, "H100": 3.35, "A100": 2.0}

# The 1B model: Llama-3.2-1B's shape (vocabulary, widths, heads), plain RoPE.
LLAMA_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=64,
    vocab_size=128256,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=True,
)
LLAMA_TINY = dict(
    LLAMA_1B,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=256,
    max_position_embeddings=512,
)


def bootstrap() -> str:
    """Make `spur.*` this checkout's code, installed or not; returns how ("installed"
    or "checkout").

    When the importable `spur.actors` is not this checkout's (nothing installed, as
    on a device machine, or another copy), the checkout's `spur/__init__.py` is
    loaded as `spur` with the checkout's root among its package folders, so
    `spur.kernels` is `<root>/kernels` and so on. The root itself never goes on
    sys.path (its `kernels/` would shadow a package that transformers probes for),
    and neither does this file's folder."""
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    try:
        spec = importlib.util.find_spec("spur.actors")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin and Path(spec.origin).resolve().parent == Path(here):
        return "installed"
    for name in [m for m in sys.modules if m == "spur" or m.startswith("spur.")]:
        del sys.modules[name]
    spec = importlib.util.spec_from_file_location(
        "spur",
        ROOT / "spur" / "__init__.py",
        submodule_search_locations=[str(ROOT / "spur"), str(ROOT)],
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["spur"] = module
    spec.loader.exec_module(module)
    return "checkout"


# --------------------------------------------------------------------------- helpers


def _section(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    logger.info("== %s", name)
    start = time.perf_counter()
    try:
        result = {"ok": True, **fn()}
    except Exception as exc:  # recorded; the next section still runs
        logger.error("%s failed: %s", name, exc)
        result = {"ok": False, "error": traceback.format_exc()}
    result["seconds"] = round(time.perf_counter() - start, 2)
    logger.info("%s: %s in %.1f s", name, "ok" if result["ok"] else "FAILED", result["seconds"])
    return result


def _sync(device: Any) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------- 1. kernels


def _attention_case(
    reqs: list[tuple[int, int]],
    *,
    dtype: Any,
    cache: str,
    device: Any,
    kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    seed: int,
) -> dict[str, Any]:
    """A random paged batch: per request (cached tokens, new tokens), shuffled block
    tables, the whole context stored by the torch reference."""
    import torch

    from spur.kernels import build_attention_metadata, fp8
    from spur.kernels.metadata import random_block_tables
    from spur.kernels.reference import store_kv_ref

    gen = torch.Generator().manual_seed(seed)
    seq = [c + n for c, n in reqs]
    tables, num_blocks = random_block_tables(seq, block_size, 2, gen)
    storage = {"fp8": fp8.FP8_DTYPE if device.type == "cuda" else torch.uint8}.get(cache, dtype)
    kv = torch.zeros((2, num_blocks, block_size, kv_heads, head_dim), dtype=storage)
    scales = (0.05, 0.03) if cache == "fp8" else (1.0, 1.0)
    whole = build_attention_metadata([0] * len(reqs), seq, tables, block_size)
    k = torch.randn((sum(seq), kv_heads, head_dim), generator=gen)
    v = torch.randn((sum(seq), kv_heads, head_dim), generator=gen)
    store_kv_ref(k, v, kv, whole.slot_mapping, *scales)
    meta = build_attention_metadata(
        [c for c, _ in reqs],
        [n for _, n in reqs],
        tables,
        block_size,
        device=device,
        num_padded_tokens=sum(n for _, n in reqs) + 3,
    )
    query = torch.randn((meta.slot_mapping.shape[0], kv_heads * group, head_dim), generator=gen)
    return {
        "query": query.to(dtype).to(device),
        "kv_cache": kv.to(device),
        "metadata": meta,
        "scale": head_dim**-0.5,
        "k_scale": scales[0],
        "v_scale": scales[1],
    }


def _check_attention(case: dict[str, Any], atol: float, **kw: Any) -> float:
    """Max abs difference Triton vs reference; raises AssertionError past atol."""
    import torch

    from spur.kernels.paged_attention import paged_attention_triton
    from spur.kernels.reference import paged_attention_ref

    args = (case["query"], case["kv_cache"], case["metadata"])
    common = dict(scale=case["scale"], k_scale=case["k_scale"], v_scale=case["v_scale"])
    want = paged_attention_ref(*args, sliding_window=kw.get("sliding_window"), **common)
    got = paged_attention_triton(*args, **common, **kw)
    assert not got.isnan().any(), "NaN in the Triton output"
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=atol)
    return float((got.float() - want.float()).abs().max())


def _check_store(dtype: Any, cache: str, device: Any, tokens: int, seed: int) -> None:
    import torch

    from spur.kernels import fp8
    from spur.kernels.reference import store_kv_ref
    from spur.kernels.store_kv import store_kv_triton

    gen = torch.Generator().manual_seed(seed)
    storage = {"fp8": fp8.FP8_DTYPE if device.type == "cuda" else torch.uint8}.get(cache, dtype)
    key = (torch.randn((tokens, 4, 32), generator=gen) * 8).to(dtype)
    value = (torch.randn((tokens, 4, 32), generator=gen) * 8).to(dtype)
    blocks = -(-2 * tokens // 16)
    slots = torch.randperm(blocks * 16, generator=gen)[:tokens]
    slots[::5] = -1
    want = torch.zeros((2, blocks, 16, 4, 32), dtype=storage, device=device)
    got = want.clone()
    k, v, s = key.to(device), value.to(device), slots.to(device)
    store_kv_ref(k, v, want, s, 0.05, 0.1)
    store_kv_triton(k, v, got, s, 0.05, 0.1)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), "store_kv bits differ"


def _check_gdn(dtype: Any, device: Any, dry: bool, atol: float) -> float:
    """Conv and delta-rule kernels vs reference; returns the delta rule's max abs diff."""
    import torch

    from spur.kernels.gdn_conv_triton import causal_conv1d_varlen_triton
    from spur.kernels.gdn_reference import (
        build_gdn_metadata,
        causal_conv1d_varlen_ref,
        gated_delta_rule_varlen_ref,
    )
    from spur.kernels.gdn_triton import gated_delta_rule_varlen_triton

    gen = torch.Generator().manual_seed(5)
    lens = [7, 1, 20, 1, 3] if dry else [300, 1, 77, 1, 1, 1024, 5]
    slots = len(lens) * 2
    meta = build_gdn_metadata(
        lens,
        list(range(len(lens))),
        [i % 2 == 1 for i in range(len(lens))],
        list(range(len(lens), 2 * len(lens))),
        device=device,
    )
    n = sum(lens) + 2
    hk, hv, dk, dv = (1, 2, 16, 16) if dry else (4, 8, 128, 128)
    conv_dim, width = (24, 4) if dry else (2 * hk * dk + hv * dv, 4)

    def rnd(*shape: int, dt: Any = dtype) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(dt).to(device)

    x, w, b = rnd(n, conv_dim), rnd(conv_dim, width), rnd(conv_dim)
    state = rnd(slots, width - 1, conv_dim, dt=torch.float32)
    want_pool, pool = state.clone(), state.clone()
    want = causal_conv1d_varlen_ref(x, w, b, want_pool, meta, "silu")
    got = causal_conv1d_varlen_triton(x, w, b, pool, meta, "silu")
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=atol)
    assert torch.equal(pool, want_pool), "conv state differs"

    q, k = rnd(n, hk, dk), rnd(n, hk, dk)
    v = rnd(n, hv, dv)
    g = (-torch.rand((n, hv), generator=gen) * 2).to(device)
    beta = torch.rand((n, hv), generator=gen).to(device)
    ssm = rnd(slots, hv, dk, dv, dt=torch.float32) * 0.1
    want_pool, pool = ssm.clone(), ssm.clone()
    chunk = 16 if dry else 64
    want = gated_delta_rule_varlen_ref(q, k, v, g, beta, want_pool, meta, chunk_size=chunk)
    got = gated_delta_rule_varlen_triton(q, k, v, g, beta, pool, meta, chunk_size=chunk)
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=atol)
    torch.testing.assert_close(pool, want_pool, atol=atol, rtol=atol)
    return float((got.float() - want.float()).abs().max())


def check_kernels(device: Any, dry: bool) -> dict[str, Any]:
    """Every Triton kernel against its reference; one record per (kernel, dtype) case."""
    import torch

    cases: dict[str, Any] = {}
    # (label, query dtype, cache, tolerance). The interpreter (dry run) gets tl.dot wrong
    # on bf16 (triton issue 11584), so bf16 runs on the GPU only.
    dtypes = [
        ("fp32", torch.float32, "same", 1e-4),
        ("fp16", torch.float16, "same", 3e-3),
        ("bf16", torch.bfloat16, "same", 2e-2),
        ("fp16-fp8", torch.float16, "fp8", 2e-2),
        ("bf16-fp8", torch.bfloat16, "fp8", 3e-2),
    ]
    splits_list: tuple[int | None, ...] = (1, 4, None)
    if dry:  # kept short: the CI test runs this on 2 cores
        dtypes = [d for d in dtypes if d[0] in ("fp32", "fp16")]
        dtypes.append(("fp32-fp8", torch.float32, "fp8", 1e-4))
        splits_list = (1, 3)
    shape = (
        dict(kv_heads=2, group=2, head_dim=16, block_size=4)
        if dry
        else dict(kv_heads=8, group=4, head_dim=128, block_size=16)
    )
    mixed = [(0, 9), (13, 1), (5, 4), (0, 1)] if dry else [(0, 300), (700, 1), (37, 90), (0, 1)]
    decodes = [(n, 1) for n in ((3, 40, 17) if dry else (1, 64, 999, 4096, 3))]

    def run(label: str, fn: Callable[[], Any]) -> None:
        start = time.perf_counter()
        try:
            detail = fn()
            cases[label] = {"ok": True, "max_abs_diff": detail}
        except Exception:
            cases[label] = {"ok": False, "error": traceback.format_exc(limit=4)}
        cases[label]["seconds"] = round(time.perf_counter() - start, 2)
        logger.info("  %-32s %s", label, "ok" if cases[label]["ok"] else "FAILED")

    def attention(
        batch: list[tuple[int, int]], dtype: Any, cache: str, atol: float, seed: int, **kw: Any
    ) -> float:
        case = _attention_case(batch, dtype=dtype, cache=cache, device=device, seed=seed, **shape)
        return _check_attention(case, atol, **kw)

    for label, dtype, cache, atol in dtypes:
        args = (dtype, cache, atol)
        run(f"attention-unified-{label}", lambda a=args: attention(mixed, *a, 1))
        run(
            f"attention-unified-sliding-{label}",
            lambda a=args: attention(mixed, *a, 2, sliding_window=7),
        )
        for splits in splits_list:
            run(
                f"attention-decode-splits{splits or 'auto'}-{label}",
                lambda a=args, s=splits: attention(decodes, *a, 3, num_splits=s),
            )
        if cache == "same" or not dry:  # the interpreter rounds fp32 -> e4m3 wrongly on ties
            run(f"store_kv-{label}", lambda a=args: _check_store(a[0], a[1], device, 37, 4))
    for label, dtype, atol in (
        # On the GPU the sequences are long (up to 1,024 tokens in chunks of 64): the
        # chunked forms' rounding grows with them, hence the looser fp32 / fp16 bounds.
        ("fp32", torch.float32, 1e-4 if dry else 1e-3),
        ("fp16", torch.float16, 5e-3 if dry else 1e-2),
        ("bf16", torch.bfloat16, 3e-2),
    ):
        if dry and dtype == torch.bfloat16:
            continue
        run(
            f"gdn-conv-and-delta-rule-{label}",
            lambda d=dtype, a=atol: _check_gdn(d, device, dry, a),
        )
    failed = sorted(k for k, v in cases.items() if not v["ok"])
    if failed:  # the passing cases' figures stay in the summary
        logger.error("%d kernel case(s) failed: %s", len(failed), failed)
    return {"ok": not failed, "failed": failed, "cases": cases, "num_cases": len(cases)}


# --------------------------------------------------------------------------- 2. bandwidth


def _time_cuda(fn: Callable[[], Any], iters: int, reps: int = 10) -> float:
    """Median seconds of one `fn` (CUDA events around `reps` back-to-back calls, so the
    host's launch work overlaps the kernels), over `iters` samples after 3 warm-ups."""
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / reps)
    return sorted(times)[len(times) // 2]


def _time_host(fn: Callable[[], Any], iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def decode_bandwidth(device: Any, dry: bool, peak_tbs: float | None) -> dict[str, Any]:
    """Achieved bytes/s of the decode kernel on long contexts (shuffled block tables)."""
    import torch

    from spur.kernels import fp8

    cuda = device.type == "cuda"
    timer = _time_cuda if cuda else _time_host
    iters = 20 if cuda else 2
    geometry = (8, 4, 128, 16) if cuda else (2, 2, 16, 4)
    shape = dict(zip(("kv_heads", "group", "head_dim", "bs"), geometry, strict=True))
    # (label, requests, context tokens each, cache dtype)
    shapes = (
        [
            ("b64-ctx4096-bf16", 64, 4096, torch.bfloat16),
            ("b256-ctx1024-bf16", 256, 1024, torch.bfloat16),
            ("b8-ctx32768-bf16-splits", 8, 32768, torch.bfloat16),
            ("b64-ctx4096-fp8", 64, 4096, fp8.FP8_DTYPE),
        ]
        if cuda
        else [("b4-ctx64-fp32", 4, 64, torch.float32)]
    )
    results: dict[str, Any] = {}
    gen = torch.Generator(device=device).manual_seed(0)
    for label, reqs, ctx, cache_dtype in shapes:
        try:  # one shape failing leaves the others' figures
            results[label] = _decode_shape(
                device, timer, iters, peak_tbs, gen, reqs, ctx, cache_dtype, shape
            )
            logger.info("  %-28s %.3f TB/s", label, results[label]["achieved_tbs"])
        except Exception as exc:
            logger.error("  %-28s FAILED: %s", label, exc)
            results[label] = {"error": traceback.format_exc(limit=4)}
    copy: dict[str, Any] = {}
    if cuda:  # the practical ceiling: a plain device-to-device copy, bytes read + written
        try:
            copy = _device_copy(device, timer, peak_tbs)
        except Exception:
            copy = {"error": traceback.format_exc(limit=4)}
    ok = all("error" not in r for r in (*results.values(), copy))
    return {"ok": ok, "peak_tbs": peak_tbs, "decode": results, "device_copy": copy}


def _decode_shape(
    device: Any,
    timer: Callable[[Callable[[], Any], int], float],
    iters: int,
    peak_tbs: float | None,
    gen: Any,
    reqs: int,
    ctx: int,
    cache_dtype: Any,
    shape: dict[str, int],
) -> dict[str, Any]:
    """One decode shape's achieved bandwidth (see `decode_bandwidth`)."""
    import torch

    from spur.kernels import build_attention_metadata, fp8
    from spur.kernels.paged_attention import paged_attention_triton

    cuda = torch.device(device).type == "cuda"
    kv_heads, group, head_dim, bs = (shape[k] for k in ("kv_heads", "group", "head_dim", "bs"))
    blocks_per = ctx // bs
    num_blocks = reqs * blocks_per + 1
    cache = torch.empty((2, num_blocks, bs, kv_heads, head_dim), dtype=cache_dtype, device=device)
    if cache_dtype == fp8.FP8_DTYPE:
        cache.view(torch.uint8).copy_(
            torch.randint(0, 0x70, cache.shape, dtype=torch.uint8, device=device, generator=gen)
        )  # finite e4m3 bit patterns
    else:
        cache.normal_(generator=gen)
    perm = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(1)) + 1
    tables = perm.view(reqs, blocks_per).tolist()
    meta = build_attention_metadata([ctx - 1] * reqs, [1] * reqs, tables, bs, device=device)
    q_dtype = torch.bfloat16 if cuda else torch.float32
    query = torch.randn((reqs, kv_heads * group, head_dim), dtype=q_dtype, device=device)
    out = torch.empty_like(query)
    scale = head_dim**-0.5

    seconds = timer(
        lambda q=query, c=cache, m=meta, o=out, s=scale: paged_attention_triton(
            q, c, m, scale=s, out=o
        ),
        iters,
    )
    kv_bytes = 2 * reqs * ctx * kv_heads * head_dim * cache.element_size()
    moved = kv_bytes + 2 * query.numel() * query.element_size() + meta.block_tables.numel() * 4
    tbs = moved / seconds / 1e12
    del cache
    return {
        "seconds": seconds,
        "bytes": moved,
        "achieved_tbs": round(tbs, 3),
        "fraction_of_peak": round(tbs / peak_tbs, 3) if peak_tbs else None,
    }


def _device_copy(
    device: Any, timer: Callable[[Callable[[], Any], int], float], peak_tbs: float | None
) -> dict[str, Any]:
    """A plain device-to-device copy of 2 GiB: bytes read + written per second."""
    import torch

    src = torch.empty(2 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = timer(lambda: dst.copy_(src), 10)
    tbs = 2 * src.numel() / seconds / 1e12
    return {
        "achieved_tbs": round(tbs, 3),
        "fraction_of_peak": round(tbs / peak_tbs, 3) if peak_tbs else None,
    }


# --------------------------------------------------------------------------- 3. engine


def _engine_level(
    llm: Any,
    runner: Any,
    graphs: Any,
    rng: random.Random,
    vocab: int,
    prompt_len: int,
    level: int,
    params: Any,
    device: Any,
    i: int,
    dry: bool,
) -> dict[str, Any]:
    """One batch size through both arms (eager alone when no graphs were captured),
    the order alternating with `i`, so neither always meets new shapes first."""
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(level)]
    arms: dict[str, Any] = {}
    tokens: dict[str, list[list[int]]] = {}
    order = ("eager", "graphs") if i % 2 == 0 else ("graphs", "eager")
    for arm in order if graphs is not None else ("eager",):
        runner.graphs = graphs if arm == "graphs" else None
        before = sum(graphs.steps_by_size.values()) if graphs is not None else 0
        _sync(device)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - t0
        tokens[arm] = [list(o.outputs[0].token_ids) for o in outs]
        made = sum(len(t) for t in tokens[arm])
        arms[arm] = {
            "elapsed_s": round(elapsed, 3),
            "tokens_per_s": round(made / elapsed, 1),
            "graph_steps": sum(graphs.steps_by_size.values()) - before if graphs else 0,
        }
    runner.graphs = graphs
    if graphs is None:
        logger.info("  batch %d: eager %.1f tok/s", level, arms["eager"]["tokens_per_s"])
        return arms
    same = sum(a == b for a, b in zip(tokens["eager"], tokens["graphs"], strict=True))
    e, g = arms["eager"]["tokens_per_s"], arms["graphs"]["tokens_per_s"]
    logger.info("  batch %d: eager %.1f tok/s, graphs %.1f tok/s", level, e, g)
    if dry and same != level:  # fp32 on CPU through the same kernels: exact
        raise AssertionError(f"batch {level}: padded path changed tokens ({same}/{level})")
    return {
        **arms,
        "speedup": round(g / e, 3) if e else None,
        "same_tokens_requests": f"{same}/{level}",
    }


def write_random_llama(
    out: Path, config: dict[str, Any], *, seed: int = 0, device: Any = "cpu"
) -> Path:
    """A random-weight Llama checkpoint (config.json + model.safetensors, bf16) in `out`.

    Weights are normal with std 0.02 (embeddings 1.0, so logits are not flat), norm
    weights 1: the model speaks nonsense at the speed of a real one. Drawn on
    `device` (a GPU draws 1.2B numbers in well under a second), saved from the CPU.
    """
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    c = config
    h, inter, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape: int, std: float = 0.02) -> torch.Tensor:
        w = torch.randn(shape, generator=gen, device=device, dtype=torch.bfloat16)
        return w.mul_(std).cpu()

    tensors = {"model.embed_tokens.weight": rnd(c["vocab_size"], h, std=1.0)}
    tensors["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": rnd(q, h),
            p + "self_attn.k_proj.weight": rnd(kv, h),
            p + "self_attn.v_proj.weight": rnd(kv, h),
            p + "self_attn.o_proj.weight": rnd(h, q),
            p + "mlp.gate_proj.weight": rnd(inter, h),
            p + "mlp.up_proj.weight": rnd(inter, h),
            p + "mlp.down_proj.weight": rnd(h, inter),
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        }
    save_file(tensors, str(out / "model.safetensors"))
    meta = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16"}
    (out / "config.json").write_text(json.dumps({**meta, **config}, indent=1))
    return out


def engine_graphs(device: Any, dry: bool, budget_left: Callable[[], float]) -> dict[str, Any]:
    """Tokens/s of the engine with decode graphs off and on, at several batch sizes."""

    from spur import SamplingParams
    from spur.actors.llm import LLM

    config = LLAMA_TINY if dry else LLAMA_1B
    dtype = "float32" if dry else "bfloat16"
    levels = (1, 4) if dry else (1, 16, 64)
    prompt_len, out_len = (12, 8) if dry else (128, 256)
    tmp = tempfile.mkdtemp(prefix="spur-gpu-check-")
    start = time.perf_counter()
    path = write_random_llama(Path(tmp) / "llama", config, device=device)
    write_s = time.perf_counter() - start
    max_model_len = prompt_len + out_len + 16
    llm = LLM(
        str(path),
        dtype=dtype,
        device=device.type,
        cuda_graphs=False,  # attached below, so both arms share one engine
        enable_prefix_caching=False,  # both arms prefill the same prompts
        max_num_seqs=max(levels),
        max_num_batched_tokens=max(2048, prompt_len),
        max_model_len=max_model_len,
        **({"kv_cache_bytes": 8 << 30} if device.type == "cuda" else {"num_kv_blocks": 256}),
    )
    results: dict[str, Any] = {}
    try:
        runner = llm.executor.worker.runner
        rng = random.Random(0)
        vocab = config["vocab_size"]
        warm = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        llm.generate([[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(2)], warm)
        try:  # a capture that fails leaves the eager arm's figures
            report = runner.capture_decode_graphs(
                max_model_len, max(levels), capture=None if device.type == "cuda" else False
            )
        except Exception:
            report = {"enabled": False, "error": traceback.format_exc(limit=6)}
            runner.graphs = None
        graphs = runner.graphs
        results["capture"] = report
        if graphs is None:
            results["errors"] = [f"no decode graphs: {report.get('reason') or 'capture failed'}"]
        params = SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True)
        for i, level in enumerate(levels):
            if budget_left() < 30:
                results[f"batch{level}"] = {"skipped": "time budget"}
                continue
            try:  # a level that fails leaves the others'
                results[f"batch{level}"] = _engine_level(
                    llm, runner, graphs, rng, vocab, prompt_len, level, params, device, i, dry
                )
            except Exception:
                results[f"batch{level}"] = {"error": traceback.format_exc(limit=6)}
                results.setdefault("errors", []).append(f"batch {level} failed")
        runner.graphs = graphs
    finally:
        llm.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)  # the 1B checkpoint is 2.5 GB
    return {
        "model": "random Llama, Llama-3.2-1B shape" if not dry else "random tiny Llama",
        "config": config,
        "dtype": dtype,
        "prompt_tokens": prompt_len,
        "output_tokens": out_len,
        "checkpoint_write_s": round(write_s, 2),
        **results,
        "ok": not results.get("errors"),
    }


# --------------------------------------------------------------------------- main


def environment(device: Any) -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": str(device),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError as exc:
        info["triton"] = f"missing: {exc}"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info |= {
            "gpu": props.name,
            "sms": props.multi_processor_count,
            "memory_gib": round(props.total_memory / 2**30, 1),
            "cuda": torch.version.cuda,
            "capability": f"{props.major}.{props.minor}",
        }
    return info


def peak_for(name: str) -> float | None:
    for key, tbs in PEAK_TBS.items():
        if key in name:
            return tbs
    return None


def run(
    *,
    dry_run: bool = False,
    skip: tuple[str, ...] = (),
    budget_s: float = 420.0,
    peak_tbs: float | None = None,
    out: Path | None = None,
) -> dict[str, Any]:
    """Run the sections (see the module docstring) and return the JSON-ready summary.
    With `out`, the summary so far is written there after every section (`"partial":
    true` until the last), so a run cut short still leaves its figures.

    Raises RuntimeError when no CUDA device is there and `dry_run` is off.
    """
    import torch

    if dry_run:
        device = torch.device("cpu")
        torch.set_num_threads(1)
    elif torch.cuda.is_available():
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
    else:
        raise RuntimeError(
            "no CUDA device: run this on a GPU machine, or pass --dry-run for the tiny CPU run"
        )
    start = time.perf_counter()
    env = environment(device)
    peak = peak_tbs or (peak_for(env.get("gpu", "")) if device.type == "cuda" else None)

    def left() -> float:
        return budget_s - (time.perf_counter() - start)

    summary: dict[str, Any] = {"bench": "gpu", "dry_run": dry_run, "environment": env}
    sections: dict[str, Callable[[], dict[str, Any]]] = {
        "kernels": lambda: check_kernels(device, dry_run),
        "bandwidth": lambda: decode_bandwidth(device, dry_run, peak),
        "engine": lambda: engine_graphs(device, dry_run, left),
    }
    for name, fn in sections.items():
        if name in skip:
            summary[name] = {"ok": True, "skipped": "--skip"}
        elif left() < 20:
            summary[name] = {"ok": False, "skipped": "time budget spent"}
        else:
            summary[name] = _section(name, fn)
        if out is not None:
            _write(out, {**summary, "partial": True})
    summary["ok"] = all(summary[n].get("ok") for n in sections)
    summary["seconds"] = round(time.perf_counter() - start, 1)
    return summary


def _write(path: Path, summary: dict[str, Any]) -> None:
    path.write_text(json.dumps(summary, indent=1, default=str) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU")
    parser.add_argument(
        "--skip", default="", help="comma-separated sections to skip: kernels,bandwidth,engine"
    )
    parser.add_argument("--budget-s", type=float, default=420.0, help="stop starting work after")
    parser.add_argument("--peak-tbs", type=float, default=None, help="HBM peak (TB/s)")
    parser.add_argument("--out", default=None, help="also write the JSON summary here")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s: %(message)s"
    )
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.dry_run:
        if "triton" in sys.modules and not os.environ.get("TRITON_INTERPRET"):
            parser.error("triton was imported before TRITON_INTERPRET=1 could be set")
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated
    how = bootstrap()
    logger.info("spur from the %s (%s)", how, ROOT)
    skip = tuple(s for s in args.skip.split(",") if s)
    try:
        summary = run(
            dry_run=args.dry_run,
            skip=skip,
            budget_s=args.budget_s,
            peak_tbs=args.peak_tbs,
            out=Path(args.out) if args.out else None,
        )
    except RuntimeError as exc:
        sys.stderr.write(f"gpu_check: {exc}\n")
        return 2
    print(json.dumps(summary, indent=1, default=str))
    if args.out:
        _write(Path(args.out), summary)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
