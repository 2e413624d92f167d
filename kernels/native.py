"""Native CPU kernels: built from C on first use, loaded with ctypes.

`cpu_decode_attention.c` attends a step's decode requests on a float32 or bfloat16
paged cache, reading K/V in place through the block tables (the SDPA path gathers
them into a padded copy first). It is compiled once per machine with the system C
compiler (`$CC`, else `cc` or `gcc`) into `native/` under spur's cache directory
(`configs/env.py`), keyed by the source, the flags and the CPU's feature flags
(the build uses -march=native). Without a compiler, or with SPUR_NATIVE_KERNELS=0,
`decode_kernel` returns None and the SDPA path serves; a failed build is logged
once, with the compiler's message.

The kernel runs on the calling thread. Splitting it over Python threads (ctypes
releases the GIL) was measured slower inside the engine: torch's OpenMP workers
keep spinning for a while after each op and take the second core (SmolLM2 fp32,
24 requests, time in attention, first version of the kernel: 1 thread 3.3 to 3.4
s, 2 threads 4.2 to 4.4 s).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from spur.configs import env

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode_attention.c")
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fPIC", "-shared", "-std=c11"]
SYMBOLS = {torch.float32: "spur_decode_attention_f32", torch.bfloat16: "spur_decode_attention_bf16"}

_lock = threading.Lock()
_library: dict[str, ctypes.CDLL | None] = {}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def build(cc: str | None = None) -> ctypes.CDLL:
    """Compile (unless cached) and load the library.

    Raises RuntimeError naming the cause: no compiler, or the compiler's error.
    """
    cc = cc or env.c_compiler() or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH: install gcc or set CC")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(
        source + " ".join(FLAGS).encode() + _cpu_flags().encode() + platform.machine().encode()
    ).hexdigest()[:16]
    out = env.cache_dir() / "native" / f"cpu_decode_attention-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
            tmp_out = Path(tmp) / out.name
            cmd = [cc, *FLAGS, str(SOURCE), "-o", str(tmp_out), "-lm"]
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            except OSError as exc:
                raise RuntimeError(f"cannot run the C compiler {cc!r}: {exc}") from exc
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()[-2000:]}")
            os.replace(tmp_out, out)  # atomic: a concurrent builder never loads half a file
    lib = ctypes.CDLL(str(out))
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
    for name in SYMBOLS.values():
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, ptr, i64, ptr, ptr, ptr, i64]
        fn.argtypes += [i32, i32, i32, i32, ctypes.c_float]
    return lib


def _load() -> ctypes.CDLL | None:
    with _lock:
        if "lib" not in _library:
            try:
                _library["lib"] = build()
            except (RuntimeError, OSError) as exc:
                logger.warning("native CPU decode attention unavailable, using SDPA: %s", exc)
                _library["lib"] = None
        return _library["lib"]


@dataclass(frozen=True)
class DecodePlan:
    """A step's decode requests, as the C kernel reads them (the same in every layer)."""

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

    Raises ValueError if a table could make the kernel read outside the cache (C has
    no bounds checks): a block id outside [0, num_blocks) or a context longer than
    its table row covers.
    """
    tables = block_tables[torch.tensor(reqs)].to(torch.int32).contiguous()
    if tables.numel() and (int(tables.min()) < 0 or int(tables.max()) >= num_blocks):
        raise ValueError(
            f"block table holds ids outside [0, {num_blocks}): the metadata does not "
            "belong to this KV cache"
        )
    if max(lens) > tables.shape[1] * block_size:
        raise ValueError(
            f"a context of {max(lens)} tokens needs more than the table's "
            f"{tables.shape[1]} blocks of {block_size}: the block table is truncated"
        )
    i32 = torch.int32
    return DecodePlan(
        rows=torch.tensor(rows, dtype=i32),
        firsts=torch.tensor(firsts, dtype=i32),
        lens=torch.tensor(lens, dtype=i32),
        tables=tables,
    )


def decode_kernel(query: torch.Tensor, kv_cache: torch.Tensor) -> Any | None:
    """The C function, or None where the SDPA path serves: not on CPU, a cache dtype
    without a kernel (float16, fp8), an inner stride other than 1, or no library
    (SPUR_NATIVE_KERNELS=0, or the build failed)."""
    if query.device.type != "cpu" or kv_cache.dtype not in SYMBOLS:
        return None
    if not env.native_kernels_enabled():
        return None
    if kv_cache.stride(-1) != 1:
        return None
    lib = _load()
    return None if lib is None else getattr(lib, SYMBOLS[kv_cache.dtype])


def decode_attention(
    fn: Any,
    query: torch.Tensor,
    out: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: DecodePlan,
    scale: float,
) -> None:
    """Attention of the plan's decodes; writes out[plan.rows], nothing else.

    query, out: [num_tokens, num_heads, head_dim]; k_cache, v_cache: [num_blocks,
    block_size, num_kv_heads, head_dim] views of one layer's cache, in fn's dtype.
    """
    if k_cache.stride() != v_cache.stride():
        raise ValueError("K and V views of the cache must share one layout")
    num_heads, head_dim = query.shape[1], query.shape[2]
    q = query.float().contiguous()  # no copy for a contiguous fp32 query
    direct = out.dtype == torch.float32 and out.is_contiguous()
    dst = out if direct else torch.empty_like(q)
    rc = fn(
        q.data_ptr(),
        q.stride(0),
        dst.data_ptr(),
        dst.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        plan.tables.data_ptr(),
        plan.tables.stride(0),
        plan.rows.data_ptr(),
        plan.firsts.data_ptr(),
        plan.lens.data_ptr(),
        plan.rows.shape[0],
        k_cache.shape[1],
        num_heads,
        k_cache.shape[2],
        head_dim,
        scale,
    )
    if rc != 0:
        raise MemoryError("native decode attention could not allocate its scratch buffers")
    if not direct:
        rows = plan.rows.long()
        out[rows] = dst[rows].to(out.dtype)
