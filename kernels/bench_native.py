"""Micro-benchmark of the native CPU ops against the torch path they replace.

`python -m spur.kernels.bench_native`: one attention layer of SmolLM2's geometry
(9 heads, 3 KV heads, head_dim 64, blocks of 16), 32 decodes with seeded contexts of
300 to 700 tokens, attended through the SDPA path, the native kernel on one thread
and on torch's two, and the kernel's narrower paths on two (`lanes-8`: AVX2 on an
AVX-512 build; `lanes-1`: the plain loop); then RMSNorm + residual add and
SiLU-and-mul at 64 rows (hidden 576, intermediate 1536), native vs torch. Medians
of interleaved rounds in one process (timings on a shared machine are only
comparable within a run). Prints one line per measurement; BENCHMARKS.md (seventh
round) quotes it.

`python -m spur.kernels.bench_native --linear [ROWS,...]`: the linear layers of
SmolLM2 (qkv, o, gate_up, down, LM head) at decode's row counts, torch's `F.linear`
beside the native op `native.small_linear` dispatches to for the dtype (`linear_f32`
for float32 on AVX2 or AVX-512 builds, `small_linear` for bf16 on AVX-512 BF16),
called directly, so that it is measured also where float32 stays on MKL
(native.linear_f32_serves; the first line names the CPU's vendor). The
weights are cycled through ~600 MB of copies so they come from memory, as in a
decode step; best of 5 passes, the arms interleaved. One line per shape and row count
(BENCHMARKS.md, tenth round).

"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from spur.kernels import build_attention_metadata, native, paged_attention_ref
from spur.kernels.metadata import random_block_tables


def main(rounds: int = 15) -> None:
    torch.set_num_threads(2)
    gen = torch.Generator().manual_seed(0)
    bs, heads, kv_heads, dim = 16, 9, 3, 64
    lens = [int(x) for x in torch.randint(300, 700, (32,), generator=gen)]
    tables, num_blocks = random_block_tables(lens, bs, 1, gen)
    meta = build_attention_metadata([n - 1 for n in lens], [1] * len(lens), tables, bs)
    lib0 = native.ops()
    lanes = native.decode_lanes(lib0) if lib0 is not None else []
    # native-*: the widest path, as served; lanes-<n>: the path of n lanes (1: the plain
    # loop every CPU runs) on two threads, for the SIMD path's own A/B.
    modes = ("sdpa", "native-1t", "native-2t", *(f"lanes-{n}" for n in lanes[1:]))
    plan = native.plan_decodes(
        meta.block_tables,
        list(range(len(lens))),
        list(range(len(lens))),
        [0] * len(lens),
        lens,
        num_blocks=num_blocks,
        block_size=bs,
    )
    for dtype in (torch.float32, torch.bfloat16):
        cache = torch.randn(2, num_blocks, bs, kv_heads, dim, generator=gen).to(dtype)
        q = torch.randn(len(lens), heads, dim, generator=gen).to(dtype)

        def attend(mode: str, q: torch.Tensor = q, cache: torch.Tensor = cache) -> float:
            os.environ["SPUR_NATIVE_KERNELS"] = "0" if mode == "sdpa" else "1"
            native.reread_switch()
            torch.set_num_threads(1 if mode == "native-1t" else 2)
            meta.memo.clear()
            if mode.startswith("lanes-"):
                out = torch.empty_like(q)
                k, v = cache.unbind(0)
                t = time.perf_counter()
                native.decode_attention(lib0, q, out, k, v, plan, dim**-0.5, int(mode[6:]))
                return time.perf_counter() - t
            t = time.perf_counter()
            paged_attention_ref(q, cache, meta, scale=dim**-0.5)
            return time.perf_counter() - t

        times: dict[str, list[float]] = {m: [] for m in modes}
        for m in modes:
            attend(m)  # warm-up (and the first build)
        for _ in range(rounds):
            for m in modes:
                times[m].append(attend(m))
        ms = {m: round(statistics.median(v) * 1e3, 2) for m, v in times.items()}
        print(f"{dtype}: one layer, 32 decodes, contexts 300-700: {ms} ms")
    torch.set_num_threads(2)
    lib = native.ops()
    if lib is None:
        print("native ops unavailable: nothing more to compare")
        return
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.ones(576, dtype=dtype)
        x, r = torch.randn(64, 576).to(dtype), torch.randn(64, 576).to(dtype)
        y = torch.randn(64, 2 * 1536).to(dtype)

        def torch_path(x=x, r=r, w=w, y=y) -> None:  # layers/norm.py, layers/activation.py
            s = x + r
            xf = s.float()
            xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + 1e-5)
            _ = w * xf.to(x.dtype)
            gate, up = y.chunk(2, dim=-1)
            _ = F.silu(gate) * up

        def native_path(x=x, r=r, w=w, y=y) -> None:
            lib.fused_add_rms_norm(x, r, w, 1e-5)
            lib.silu_and_mul(y)

        def timed(fn) -> float:
            t = time.perf_counter()
            for _ in range(30):
                fn()
            return (time.perf_counter() - t) / 30

        timed(native_path)
        timed(torch_path)
        native_t, torch_t = [], []
        for _ in range(7):
            native_t.append(timed(native_path))
            torch_t.append(timed(torch_path))
        a, b = statistics.median(native_t) * 1e6, statistics.median(torch_t) * 1e6
        label = "RMSNorm + residual and SiLU-and-mul at 64 rows"
        print(f"{dtype}: {label}: native {a:.0f} us, torch {b:.0f} us")


# SmolLM2-135M's linear layers: [out_features, in_features]
LINEAR_SHAPES = {
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}


def linear(rows: list[int], dtypes: tuple[torch.dtype, ...] = native.DTYPES) -> None:
    """Torch's F.linear vs the native op per shape and row count (see the docstring)."""
    torch.set_num_threads(2)
    lib = native.ops()
    ops = {torch.float32: "linear_f32", torch.bfloat16: "small_linear"}
    vendor = native.cpu_vendor()
    print(
        f"CPU vendor {vendor or 'unknown'}: float32 linears "
        f"served by {'linear_f32' if native.linear_f32_serves(vendor) else 'MKL'}",
        flush=True,
    )
    for dtype in dtypes:
        op = ops[dtype]
        if lib is None or not native._built(lib, op):
            print(f"{dtype}: this CPU or build has no native {op}: torch serves every row count")
            continue
        kernel = getattr(lib, op)
        for name, (n, k) in LINEAR_SHAPES.items():
            copies = max(2, int(600e6 // (n * k * dtype.itemsize)))
            ws = [torch.randn(n, k).to(dtype) for _ in range(copies)]
            for m in rows:
                x = torch.randn(m, k).to(dtype)
                diff = (F.linear(x, ws[0]).float() - kernel(x, ws[0], None).float()).abs().max()
                arms = {
                    "torch": lambda w, x=x: F.linear(x, w),
                    "native": lambda w, x=x, kernel=kernel: kernel(x, w, None),
                }
                best = {a: float("inf") for a in arms}
                for _ in range(5):
                    for a, fn in arms.items():
                        t = time.perf_counter()
                        for w in ws:
                            fn(w)
                        best[a] = min(best[a], (time.perf_counter() - t) / len(ws))
                gb_s = n * k * dtype.itemsize / best["native"] / 1e9
                print(
                    f"{dtype} {name} [{n}, {k}] {m} rows: torch {best['torch'] * 1e3:.3f} ms, "
                    f"{op} {best['native'] * 1e3:.3f} ms ({best['torch'] / best['native']:.2f}x, "
                    f"weights at {gb_s:.1f} GB/s), max |diff| {float(diff):.1e}",
                    flush=True,
                )
            del ws


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--linear":
        linear([int(r) for r in (sys.argv[2] if len(sys.argv) > 2 else "1,2,4,8,16").split(",")])
    else:
        main()
