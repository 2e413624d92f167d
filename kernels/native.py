"""Native CPU ops: a torch C++ extension built on first use, run in torch's thread pool.

`cpu_ops.cpp` (one translation unit; the ops' families in `cpu/*.h`, included there)
holds the ops of the CPU serving path that torch composes from many small kernels (see
its header): paged decode attention reading K/V in place through
the block tables, RMSNorm with the residual add fused, SiLU-and-mul, RoPE fused
with the KV store, and linears: on weights packed once at load, bf16 on CPUs with
AVX-512 BF16 and no AMX (`linear_bf16_panels`: pairs for vdpbf16ps) and float32 on
AVX2 or AVX-512 CPUs other than Intel's (`linear_f32_panels`), at any row count; on [N, K]
weights, a bf16 linear for decode steps of up to 16 rows (`small_linear`: AVX-512
BF16 dot products, each weight row read once; torch's bf16 matmul reads its weights at
half the memory's rate at these sizes) and a float32 one for any number of rows on
CPUs other than Intel's (`linear_f32`, AVX2 or AVX-512: there MKL's sgemm is slow,
most at decode's row counts).
They are registered as `torch.ops.spur_cpu.*`
(TORCH_LIBRARY, no pybind) and parallelised with `at::parallel_for`, i.e. on torch's
own OpenMP team:
the build passes `-fopenmp` (ATen's parallel_for is a pragma in its headers: without
the flag it compiles to a loop on the calling thread), and the GOMP symbols bind at
load time to the libgomp torch has already loaded.

The extension is compiled once per machine with `torch.utils.cpp_extension.load`
(the C++ compiler `$CXX`, else `c++`; ninja, a pyproject dependency) into `native/`
under spur's cache directory (`configs/env.py`), keyed by the source, the flags, the
compiler, the torch version and the CPU's feature flags (the build uses -march=native, or
the x86-64 level SPUR_CPU_TARGET names: configs/cpu.py); a cached
build loads in well under a second, a fresh one takes 20 to 60 s. Builders of one folder
take turns under an flock, and one killed mid-build leaves nothing that blocks the next
(`_folder_lock`). Without a compiler
or ninja, or with SPUR_NATIVE_KERNELS=0 (read once per process: `enabled`), `ops()`
returns None and every caller takes
its pure-torch path (SDPA for attention); a failed build is logged once, with the
compiler's message.

Before this extension the decode kernel was C called through ctypes, on the calling
thread: splitting it over Python threads was slower, because torch's OpenMP workers
keep spinning after each op and take the second core. Inside torch's own team that
core does the work.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from spur.configs import cache, cpu, env

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_ops.cpp")
PARTS = Path(__file__).with_name("cpu")  # the ops' families, `#include`d by SOURCE
FLAGS = ["-O3", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp"]  # + cpu.march_flags
DTYPES = (torch.float32, torch.bfloat16)  # activation and cache dtypes the ops take

_lock = threading.Lock()
_state: dict[str, Any] = {}


def source_bytes() -> bytes:
    """The build's source text: SOURCE and every part it includes (`cpu/*.h`, by name),
    so that a change to any of them is a new build (the cache key hashes this)."""
    parts = sorted(PARTS.glob("*.h"))
    return SOURCE.read_bytes() + b"".join(p.name.encode() + p.read_bytes() for p in parts)


def _cpu_flags() -> str:
    """This CPU's flags as spur sees them (narrowed to SPUR_CPU_TARGET), one string."""
    return " ".join(sorted(cpu.here().flags)) or platform.processor()


def _cflags() -> list[str]:
    """FLAGS with the -march of SPUR_CPU_TARGET (native: this CPU's own)."""
    return [*FLAGS, *cpu.march_flags(cpu.here().target)]


def _key(cxx: str) -> str:
    """The build's cache key: the source, flags, torch, CPU, machine and compiler."""
    return hashlib.sha256(
        source_bytes()
        + " ".join(_cflags()).encode()
        + torch.__version__.encode()
        + _cpu_flags().encode()
        + platform.machine().encode()
        + cxx.encode()
    ).hexdigest()[:16]


def build(cxx: str | None = None) -> Any:
    """Compile (unless cached) and load the extension; returns `torch.ops.spur_cpu`.

    Raises RuntimeError naming the cause: no C++ compiler, no ninja, the compiler's
    error, or another build already loaded in this process. Building the loaded one
    again returns its ops without touching cpp_extension: a second `load` of a name
    whose earlier build failed gets a new file (`_v1`, `_v2`: torch's versioner), and
    loading a second library that registers `spur_cpu` aborts the process.
    """
    from torch.utils import cpp_extension

    cxx = cxx or env.cxx_compiler() or "c++"
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler {cxx!r} on PATH: install g++ or set CXX")
    if not cpp_extension.is_ninja_available():
        _put_pip_ninja_on_path()
    if not cpp_extension.is_ninja_available():
        raise RuntimeError("ninja is not on PATH: `pip install ninja` (a spur dependency)")
    key = _key(cxx)
    loaded = _state.get("loaded")
    if loaded == key:
        return torch.ops.spur_cpu
    if loaded is not None:
        raise RuntimeError(
            f"spur's native ops are loaded in this process already (build {loaded}); another "
            f"build ({key}: a changed source, compiler or flags) cannot be loaded beside it, "
            "as both register torch.ops.spur_cpu: restart the process to use it"
        )
    out = _folder(key)
    out.mkdir(parents=True, exist_ok=True)
    old = os.environ.get("CXX")
    os.environ["CXX"] = cxx  # cpp_extension reads the compiler from the environment
    try:
        with _folder_lock(out):
            cpp_extension.load(
                name=f"spur_cpu_{key}",
                sources=[str(SOURCE)],
                extra_cflags=_cflags(),
                build_directory=str(out),
                is_python_module=False,
                verbose=False,
            )
    except (RuntimeError, OSError, ImportError, subprocess.CalledProcessError) as exc:
        raise RuntimeError(
            f"building {SOURCE.name} with {cxx} failed:\n{str(exc)[-2000:]}"
        ) from exc
    finally:
        if old is None:
            os.environ.pop("CXX", None)
        else:
            os.environ["CXX"] = old
    _state["loaded"] = key
    return torch.ops.spur_cpu


@contextmanager
def _folder_lock(out: Path) -> Iterator[None]:
    """Hold `out`'s build lock across processes (`cache.lock` on `out/build.flock`: the
    kernel releases it when its holder exits, however it exits).

    torch's `cpp_extension.load` serialises builders of a folder with a lock file
    (`out/lock`) that only a builder that finishes removes; one killed mid-build (a
    stopped CI job, an OOM kill, Ctrl-C in a container) leaves it, and every later load
    of that folder, even of an up-to-date library, waits for it forever. Under the flock
    no other spur builder is in the folder, so a `lock` file found there is such a
    leftover: it is removed (and logged) before torch looks.
    """
    with cache.lock(out / "build.flock"):
        stale = out / "lock"
        if stale.exists():
            logger.warning(
                "native kernels: removing %s, left by a build that did not finish", stale
            )
            stale.unlink(missing_ok=True)
        yield


def build_folder() -> Path | None:
    """The folder `build()` compiles into and loads from for this source, compiler and CPU
    (the key of its name covers them all); None without a compiler."""
    cxx = env.cxx_compiler() or "c++"
    if shutil.which(cxx) is None:
        return None
    return _folder(_key(cxx))


def _folder(key: str) -> Path:
    return env.cache_dir() / "native" / f"cpu_ops-{key}"


def _put_pip_ninja_on_path() -> None:
    """The `ninja` wheel (a dependency) puts its binary in the venv's bin folder, which is
    not on PATH when the venv's python runs without activation (`.venv/bin/python -m
    pytest` on CI): cpp_extension finds ninja only through PATH."""
    try:
        import ninja  # type: ignore[import-untyped]
    except ImportError:
        return
    bin_dir = getattr(ninja, "BIN_DIR", None)
    if bin_dir and bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def enabled() -> bool:
    """`SPUR_NATIVE_KERNELS` (configs/env.py), read once per process: this is asked
    before every native op, where reading the environment cost ~1 us each time (about
    360 times a step of a 30-layer model). `reread_switch()` reads it again."""
    on = _state.get("enabled")
    if on is None:
        on = _state["enabled"] = env.native_kernels_enabled()
    return on


def reread_switch() -> None:
    """Read `SPUR_NATIVE_KERNELS` again at the next op: for in-process A/Bs of the native
    and torch paths (kernels/bench_native.py, tests) that change the variable."""
    _state.pop("enabled", None)


def ops() -> Any | None:
    """`torch.ops.spur_cpu`, building it on first call; None where the torch path
    serves (SPUR_NATIVE_KERNELS=0 as `enabled` read it, or the build failed: logged
    once)."""
    if not enabled():
        return None
    lib = _state.get("ops", False)
    if lib is not False:
        return lib
    with _lock:
        if "ops" not in _state:
            try:
                _state["ops"] = build()
            except RuntimeError as exc:
                logger.warning("native CPU ops unavailable, using the torch path: %s", exc)
                _state["ops"] = None
        return _state["ops"]


def usable(*tensors: torch.Tensor) -> Any | None:
    """The ops when every tensor is on CPU in float32 / bfloat16, else None."""
    for t in tensors:
        if not t.is_cpu or t.dtype not in DTYPES:
            return None
    return ops()


@dataclass(frozen=True)
class DecodePlan:
    """A step's decode requests, as the kernel reads them (the same in every layer)."""

    rows: torch.Tensor  # [N] int32, query / output row of each decode
    firsts: torch.Tensor  # [N] int32, first position of its window
    lens: torch.Tensor  # [N] int32, context length (the window ends there)
    tables: torch.Tensor  # [N, max_blocks] int32, contiguous block-table rows


def plan_decodes(
    block_tables: torch.Tensor,
    reqs: list[int],
    rows: list[int],
    firsts: list[int],
    lens: list[int],
    *,
    num_blocks: int,
    block_size: int,
) -> DecodePlan:
    """Index arrays for decode requests `reqs`: their query rows and windows [first, len).

    Raises ValueError if a table could make the kernel read outside the cache (it has
    no bounds checks): a block id outside [0, num_blocks) or a context longer than
    its table row covers.
    """
    i32 = torch.int32
    return DecodePlan(
        rows=torch.tensor(rows, dtype=i32),
        firsts=torch.tensor(firsts, dtype=i32),
        lens=torch.tensor(lens, dtype=i32),
        tables=_table_rows(block_tables, reqs, max(lens), num_blocks, block_size),
    )


def _table_rows(
    block_tables: torch.Tensor, reqs: list[int], longest: int, num_blocks: int, block_size: int
) -> torch.Tensor:
    """The block-table rows of `reqs`, int32 and contiguous, checked as the kernels need
    (they have no bounds checks): rows covering `longest`, ids in [0, num_blocks). Only
    the blocks `longest` tokens use are kept: the per-token prefill entries repeat a
    row per token, and tables sized for max_model_len are mostly unused."""
    width = -(-longest // block_size)
    if width > block_tables.shape[1]:
        raise ValueError(
            f"a context of {longest} tokens needs more than the table's "
            f"{block_tables.shape[1]} blocks of {block_size}: the block table is truncated"
        )
    tables = block_tables[torch.tensor(reqs), :width].to(torch.int32).contiguous()
    if tables.numel() and (int(tables.min()) < 0 or int(tables.max()) >= num_blocks):
        raise ValueError(
            f"block table holds ids outside [0, {num_blocks}): the metadata does not "
            "belong to this KV cache"
        )
    return tables


@dataclass(frozen=True)
class PrefillPlan:
    """A step's prefill chunks, as prefill_attention reads them (the same in every layer)."""

    chunks: torch.Tensor  # [C, 4] int32: first query row, query tokens, context, window (0: none)
    tables: torch.Tensor  # [C, max_blocks] int32, contiguous block-table rows


def prefill_tiles(lib: Any, query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether `prefill_attention` serves prefill chunks of these tensors: a build with
    AVX-512 BF16, bfloat16 query and cache, head_dim 64 or 128, at most 16 query heads a
    KV head (kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim])."""
    return (
        lib is not None
        and _built(lib, "prefill_tiles")
        and query.dtype == kv_cache.dtype == torch.bfloat16
        and query.shape[-1] in (64, 128)
        and query.shape[1] // kv_cache.shape[3] <= 16
    )


def plan_prefills(
    block_tables: torch.Tensor,
    chunks: list[tuple[int, int, int, int]],
    sliding_window: int | None,
    *,
    num_blocks: int,
    block_size: int,
) -> PrefillPlan:
    """Index arrays of prefill chunks (request, first query row, query tokens, context
    length); query token i of a chunk sits at position context - tokens + i. Raises
    ValueError as plan_decodes does, and for a chunk of no tokens or more tokens than
    its context (the kernel would index before its buffers)."""
    bad = [c for c in chunks if not 1 <= c[2] <= c[3]]
    if bad:
        raise ValueError(
            f"prefill chunk (request, row, tokens, context) {bad[0]}: a chunk needs 1 to "
            "context tokens; the metadata's query_start_loc and seq_lens disagree"
        )
    window = sliding_window or 0
    return PrefillPlan(
        chunks=torch.tensor(
            [(row, q_len, seq_len, window) for _, row, q_len, seq_len in chunks],
            dtype=torch.int32,
        ).view(-1, 4),
        tables=_table_rows(
            block_tables,
            [r for r, *_ in chunks],
            max(c[3] for c in chunks),
            num_blocks,
            block_size,
        ),
    )


def prefill_attention(
    lib: Any,
    query: torch.Tensor,
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: PrefillPlan,
    scale: float,
) -> None:
    """Causal attention of the plan's prefill chunks over the paged cache in place, in
    tiles of 16 query tokens (kernels/cpu/prefill_attention.h); writes their rows of out,
    nothing else. Shapes as in decode_attention; see prefill_tiles for what it serves."""
    q = _attention_query(query, out, k_cache, v_cache)
    lib.prefill_attention(q, out, k_cache, v_cache, plan.tables, plan.chunks, scale)


def decode_kernel(query: torch.Tensor, kv_cache: torch.Tensor) -> Any | None:
    """The ops, or None where the SDPA path serves: not on CPU, a query or cache dtype
    without a kernel (float16, fp8), an inner stride other than 1, or no extension
    (SPUR_NATIVE_KERNELS=0, or the build failed)."""
    if kv_cache.stride(-1) != 1:
        return None
    return usable(query, kv_cache)


def decode_attention(
    lib: Any,
    query: torch.Tensor,
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: DecodePlan,
    scale: float,
    lanes: int = 0,
) -> None:
    """Attention of the plan's decodes; writes out[plan.rows], nothing else.

    query, out: [num_tokens, num_heads, head_dim] in one dtype; k_cache, v_cache:
    [num_blocks, block_size, num_kv_heads, head_dim] views of one layer's cache.
    lanes: the kernel's path, one of decode_lanes(lib); 0 (serving) is the widest.
    """
    q = _attention_query(query, out, k_cache, v_cache)
    lib.decode_attention(
        q, out, k_cache, v_cache, plan.tables, plan.rows, plan.firsts, plan.lens, scale, lanes
    )


def _attention_query(
    query: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> torch.Tensor:
    """query with rows contiguous in [num_heads, head_dim], as both attention ops read
    it; ValueError for K/V views of different layouts or an out they cannot write."""
    if k_cache.stride() != v_cache.stride():
        raise ValueError("K and V views of the cache must share one layout")
    if out.stride(1) != out.shape[2] or out.stride(2) != 1:
        raise ValueError("out must be contiguous in [num_heads, head_dim]")
    return query if query.stride(1) == query.shape[2] else query.contiguous()


def decode_lanes(lib: Any) -> list[int]:
    """The decode kernel's paths in this build, widest first: 16 (AVX-512), 8 (AVX2 +
    FMA), 1 (the plain loop, every CPU; head sizes other than 64 and 128 take it on
    any path). Each is the same math; only float32 summation order differs."""
    return [int(x) for x in lib.decode_lanes()]


# Rows of x up to which `small_linear` serves a bf16 linear, by CPU (`bf16_linear_rows`).
# Without AMX (AVX-512 BF16 only: Zen 4 / 5) oneDNN's bf16 brgemm is slow at decode's
# row counts and the op's units are faster up to 16 rows (BENCHMARKS.md, fourteenth
# round, SmolLM2's shapes: 1.2-2.5x at 1-16 rows, 0.6-1.35x at 32-64, where its dot
# products run out of vdpbf16ps throughput). With AMX, oneDNN's tiles serve batches
# past 4 rows (the bound the Xeon rounds used). The op itself takes 1 to
# SMALL_LINEAR_OP_ROWS (cpu/linear_bf16.h, kSmallLinearMaxRows: change both together).
SMALL_LINEAR_MAX_ROWS = 16
SMALL_LINEAR_AMX_ROWS = 4
SMALL_LINEAR_OP_ROWS = 64
# Rows of x up to which `linear_f32` runs its decode path (units of weight rows read
# once for every row of x; more rows: a register-blocked GEMM over packed panels, for
# prefill chunks). `small_linear` sends it float32 linears of any row count on a CPU
# where `linear_f32_serves`: there MKL's sgemm is slow (BENCHMARKS.md, SmolLM2's
# shapes, quiet: eleventh round, AVX2-only EPYC: 1.4-2.3x at one row, 2.6-4.8x at 2-4,
# 1.6-3.2x at 8-16, 1.1-2.0x at 32; twelfth round, EPYC with AVX-512: 1.5-4.7x up to
# 64 rows, 1.1-1.6x at 65, 2.2x at 2048). Within 1 to 64 rows a row's sums run the
# same FMAs whatever the batch, so decode is batch-invariant up to 64 requests. The
# op's own constant (cpu/linear_f32.h, kLinearF32UnitRows): change both together.
LINEAR_F32_UNIT_ROWS = 64

# Panel widths (native.pack_linear_f32) of the builds whose float32 linears are packed
# at load: 32, AVX-512 builds (1.07-1.65x linear_f32 on [N, K] at 1-64 rows, 2 x 16
# lanes a panel: BENCHMARKS.md, fifteenth round); 16, AVX2 builds (2 x 8 lanes, tiles
# of at most 6 rows): 1.06-1.68x at 1-64 rows of SmolLM2's decode step, built as
# x86-64-v3, znver2 or znver3 (BENCHMARKS.md, twenty-first round; the fifteenth
# round's 0.73-1.18x at 1-16 rows was an earlier version of the tiles).
PACKED_PANEL_WIDTHS = (32, 16)

# MKL is Intel's library: on Intel CPUs it takes its tuned kernels (the Xeon rounds
# measured its float32 linear there), on others generic ones, slow at decode's sizes.
MKL_TUNED_VENDORS = ("GenuineIntel",)


def cpu_vendor(cpuinfo: str | None = None) -> str:
    """The CPU's vendor_id from the given /proc/cpuinfo text, else this machine's; ""
    if unknown."""
    return (cpu.here() if cpuinfo is None else cpu.parse(cpuinfo)).vendor


def linear_f32_serves(vendor: str) -> bool:
    """Whether `small_linear` sends float32 linears to `linear_f32` (where the build
    has it) on a CPU of this vendor: every vendor but those MKL is tuned for, whose
    sgemm keeps them."""
    return vendor not in MKL_TUNED_VENDORS


def small_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """`F.linear(x, weight, bias)` on CPU for decode's row counts through a native op,
    or None where torch's matmul serves:

    - bfloat16, 1 to `bf16_linear_rows()` rows of x, in-features a multiple of 32, on
      builds with AVX-512 BF16 (`small_linear`: bf16 dot products, one rounding);
    - float32, any number of rows, in-features a multiple of 8, on builds with AVX2
      or AVX-512, on a CPU where `linear_f32_serves` (`linear_f32`).

    Otherwise (other dtypes, devices or row counts, strided inputs, another CPU, no
    extension) None. x: [..., K]; weight: [N, K]; bias: [N] or None, all of x's
    dtype -> [..., N].
    """
    if x.device.type != "cpu" or weight.dtype != x.dtype or _state.get("torch_linears"):
        return None
    if x.dtype == torch.bfloat16:
        op, (lo, hi), multiple = "small_linear", (1, bf16_linear_rows()), 32
    elif x.dtype == torch.float32 and _linear_f32_here():
        op, (lo, hi), multiple = "linear_f32", (1, math.inf), 8
    else:
        return None
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if not lo <= rows <= hi or k % multiple or weight.stride(-1) != 1:
        return None
    if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous()):
        return None
    lib = ops()
    if lib is None or not _built(lib, op):
        return None
    x2 = x.reshape(rows, k)
    if x2.stride(-1) != 1:
        return None
    return getattr(lib, op)(x2, weight, bias).view(*x.shape[:-1], weight.shape[0])


def pack_linear_f32(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight [N, K]` float32 as `linear_f32_panels` reads it, packed once at load,
    or None where that op does not serve it (not a CPU float32 weight, K not a
    multiple of 8, a CPU where MKL's sgemm serves float32 linears, no such build, a
    build whose panels do not pay: PACKED_PANEL_WIDTHS).

    The layout: panels [ceil(N / PW), K, PW] of PW = `linear_f32_panel_width()`
    output features (32 on AVX-512 builds, 16 on AVX2), k-major, zeros past N. Every
    row count reads it (decode's tiles, prefill's GEMM): 1.1-1.65x `linear_f32` on
    the [N, K] weight at 1-64 rows (BENCHMARKS.md, fifteenth round), which had to sum
    each dot product across a vector's lanes and re-read x from L2 per unit."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2:
        return None
    n, k = weight.shape
    if n == 0 or k == 0 or k % 8 or not _linear_f32_here():
        return None
    lib = ops()
    if lib is None or not _built(lib, "linear_f32"):
        return None
    pw = int(lib.linear_f32_panel_width())
    if pw not in PACKED_PANEL_WIDTHS:
        return None
    if n % pw:  # zeros past N in the last panel
        padded = weight.new_zeros((n + pw - 1) // pw * pw, k)
        padded[:n] = weight
        weight = padded
    return weight.reshape(-1, pw, k).transpose(1, 2).contiguous()  # [P, K, PW]


def unpack_linear_f32(panels: torch.Tensor, n: int) -> torch.Tensor:
    """The [n, K] weight `pack_linear_f32` packed into `panels` (a new tensor)."""
    p, k, pw = panels.shape
    return panels.transpose(1, 2).reshape(p * pw, k)[:n].contiguous()


def linear_f32_panels(
    x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, n: int
) -> torch.Tensor:
    """`F.linear(x, W, bias)` for the float32 weight W [n, K] that `pack_linear_f32`
    packed into `panels`, at any row count. x: [..., K] float32 -> [..., n]. Under
    `torch_linears` (benches: transformers' path) it unpacks W and runs `F.linear`."""
    return _on_panels("linear_f32_panels", x, panels, bias, n)


def _on_panels(
    op: str,
    x: torch.Tensor,
    panels: torch.Tensor,
    bias: torch.Tensor | None,
    n: int,
    **options: Any,
) -> torch.Tensor:
    """x [..., K] as rows [M, K] with a unit inner stride through the panels op `op`
    (with `options`) -> [..., n]; `F.linear` on the unpacked weight under `torch_linears`."""
    if _state.get("torch_linears"):
        y = torch.nn.functional.linear(x, unpack_linear(panels, n), bias)
        return y.float() if options.get("float_out") else y
    if x.dim() == 2 and x.stride(-1) == 1 and x.numel():  # the layers' case: no reshapes
        return getattr(ops(), op)(x, panels, bias, n, **options)
    k = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    if rows == 0:
        dtype = torch.float32 if options.get("float_out") else x.dtype
        return x.new_empty(*x.shape[:-1], n, dtype=dtype)
    # K = 0 goes on to the op, which names the mismatch: no packed weight has K = 0
    x2 = x.reshape(rows, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return getattr(ops(), op)(x2, panels, bias, n, **options).view(*x.shape[:-1], n)


def bf16_panels_serve(flags: Iterable[str]) -> bool:
    """Whether bf16 weights are packed (`pack_linear_bf16`) on a CPU with these flags, on
    a build with AVX-512 BF16: not where it has AMX (`bf16_panels_here`)."""
    return "amx_bf16" not in set(flags)


def bf16_panels_here() -> bool:
    """Whether bf16 linear weights are packed at load on this machine (`pack_linear_bf16`):
    builds with AVX-512 BF16 on CPUs without AMX. There the panels beat both small_linear
    and oneDNN's brgemm at every row count measured (BENCHMARKS.md, sixteenth round,
    SmolLM2's shapes at 1-512 rows: 0.99-2.11x the better of the two, 1.64-2.11x at 32
    rows). With AMX, oneDNN's tiles serve batches
    past SMALL_LINEAR_AMX_ROWS, and the weights stay [N, K]."""
    here = _state.get("bf16_panels_here")
    if here is None:
        lib = ops()
        here = lib is not None and _built(lib, "small_linear")
        here = _state["bf16_panels_here"] = here and bf16_panels_serve(_cpu_flags().split())
    return here


def pack_linear_bf16(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight [N, K]` bfloat16 as `linear_bf16_panels` reads it, packed once at load, or
    None where that op does not serve it (not a CPU bf16 weight, K odd, a CPU with AMX
    or without AVX-512 BF16: `bf16_panels_here`).

    The layout: panels [ceil(N / 32), K / 2, 32, 2]: 32 output features a panel, each
    holding K's consecutive pairs side by side (the operand layout of AVX-512 BF16's
    dot product of pairs), zeros past N."""
    if weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2:
        return None
    n, k = weight.shape
    if n == 0 or k == 0 or k % 2 or not bf16_panels_here():
        return None
    if n % 32:  # zeros past N in the last panel
        padded = weight.new_zeros(-(-n // 32) * 32, k)
        padded[:n] = weight
        weight = padded
    return weight.reshape(-1, 32, k // 2, 2).transpose(1, 2).contiguous()  # [P, K/2, 32, 2]


def pack_linear(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight packed for `linear_panels` (`pack_linear_f32` for float32,
    `pack_linear_bf16` for bfloat16), or None where no panels op serves it here."""
    if weight.dtype == torch.bfloat16:
        return pack_linear_bf16(weight)
    return pack_linear_f32(weight)


def unpack_linear(panels: torch.Tensor, n: int) -> torch.Tensor:
    """The [n, K] weight `pack_linear` packed into `panels` (a new tensor)."""
    if panels.dim() == 4:  # bf16: [P, K / 2, 32, 2]
        p, half, pw, _ = panels.shape
        return panels.transpose(1, 2).reshape(p * pw, 2 * half)[:n].contiguous()
    return unpack_linear_f32(panels, n)


def linear_panel_rows(panels: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids [n]` (int64, each in [0, N)) of the weight `pack_linear` packed into
    `panels` -> [n, K]: an embedding lookup on a tied LM head's packed weight, by the
    native `panel_rows` (panels exist only where the extension is built, as for
    `linear_panels`; ids past N read the zero padding, ids past it raise)."""
    rows = ops().panel_rows(panels, ids.reshape(-1).to(torch.int64).contiguous())
    return rows.view(*ids.shape, rows.shape[-1])


def linear_panels(
    x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, n: int
) -> torch.Tensor:
    """`F.linear(x, W, bias)` for the weight W [n, K] that `pack_linear` packed into
    `panels`, at any row count, in W's dtype. x: [..., K] -> [..., n]. Under
    `torch_linears` (benches: transformers' path) it unpacks W and runs `F.linear`."""
    op = "linear_bf16_panels" if panels.dim() == 4 else "linear_f32_panels"
    return _on_panels(op, x, panels, bias, n)


def linear_panels_float(
    x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, n: int
) -> torch.Tensor:
    """`linear_panels(x, panels, bias, n).float()` in one pass: bf16 panels write the
    bf16-rounded outputs as float32 directly (the LM head's logits: no second pass over
    [rows, vocab] to widen them); float32 panels are float32 already."""
    if panels.dim() == 4:
        return _on_panels("linear_bf16_panels", x, panels, bias, n, float_out=True)
    return _on_panels("linear_f32_panels", x, panels, bias, n)


def panels_argmax(x: torch.Tensor, panels: torch.Tensor, n: int) -> torch.Tensor | None:
    """`linear_panels_float(x, panels, None, n).argmax(-1)` without the logits: x [m, K]
    -> [m] int64, the index of each row's first maximal output (NaN the largest, a row
    of -inf 0), exactly `argmax_rows` of the logits (a greedy LM head; tests check it).
    None where this build has no `panels_argmax` (AVX-512 builds have it) and under
    `torch_linears`: the caller then computes the logits."""
    lib = ops()
    if lib is None or _state.get("torch_linears") or not _built(lib, "panels_argmax"):
        return None
    if x.dim() != 2 or x.stride(-1) != 1:
        x = x.reshape(-1, x.shape[-1]).contiguous()
    if x.shape[0] == 0:
        return torch.empty(0, dtype=torch.int64)
    return lib.panels_argmax(x, panels, n)


@contextmanager
def torch_linears() -> Iterator[None]:
    """Within it `small_linear` returns None in this process: every linear layer runs
    torch's `F.linear`, the path transformers computes with (`spur bench engine
    --matmul-floor` times its ceiling so). Not thread-safe: for benchmarks."""
    before = _state.get("torch_linears", False)
    _state["torch_linears"] = True
    try:
        yield
    finally:
        _state["torch_linears"] = before


def linears_unpacked() -> bool:
    """Whether this process is within `torch_linears`: packed weights are unpacked for
    `F.linear` at every call (`linear_panels`), not read from their panels."""
    return bool(_state.get("torch_linears"))


def bf16_linear_rows(flags: Iterable[str] | None = None) -> int:
    """Rows of x up to which `small_linear` sends bf16 linears to the native op on a CPU
    with these flags (default: this machine's, read once): SMALL_LINEAR_AMX_ROWS where
    it has AMX, SMALL_LINEAR_MAX_ROWS elsewhere."""
    if flags is None:
        rows = _state.get("bf16_linear_rows")
        if rows is None:
            rows = _state["bf16_linear_rows"] = bf16_linear_rows(_cpu_flags().split())
        return rows
    return SMALL_LINEAR_AMX_ROWS if "amx_bf16" in set(flags) else SMALL_LINEAR_MAX_ROWS


def _linear_f32_here() -> bool:
    """linear_f32_serves for this machine's CPU, read once and logged."""
    here = _state.get("linear_f32_here")
    if here is None:
        vendor = cpu_vendor()
        here = _state["linear_f32_here"] = linear_f32_serves(vendor)
        logger.info(
            "float32 linears: %s (CPU vendor %s)",
            "spur's linear_f32 where built" if here else "MKL's sgemm",
            vendor or "unknown",
        )
    return here


def _built(lib: Any, op: str) -> bool:
    """Whether this build has `op` (small_linear / linear_f32 / prefill_tiles /
    panels_argmax: each for one CPU class)."""
    built = _state.get(op)
    if built is None:
        built = _state[op] = bool(getattr(lib, f"{op}_supported")())
    return built
