"""Which library and kernel torch's CPU matmuls take, per dtype (issue 14: report
which path oneDNN takes for bf16, AMX / AVX-512 BF16 or an emulation).

`matmul_path(dtype)` runs one linear of SmolLM2's MLP shape ([64, 576] x [576,
1536]) with oneDNN's verbose mode on and reads what oneDNN printed: the primitive's
implementation (for example `brg_matmul:avx10_1_512_amx`: brgemm kernels on AMX
tiles) and the ISA oneDNN detected. A dtype whose linear prints nothing did not go
through oneDNN (torch's float32 GEMM goes to MKL / its own BLAS on x86).

oneDNN writes its verbose lines with C stdio on file descriptor 1, so the call
redirects fd 1 to a temporary file for its duration (stdout of a bench stays JSON).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import tempfile
from typing import Any

import torch
import torch.nn.functional as F

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@contextlib.contextmanager
def _captured_fd1() -> Any:
    """Everything written to file descriptor 1 inside the block, as a list of one str."""
    out: list[str] = []
    libc = ctypes.CDLL(None)
    sys.stdout.flush()
    libc.fflush(None)
    saved = os.dup(1)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 1)
        try:
            yield out
        finally:
            libc.fflush(None)
            os.dup2(saved, 1)
            os.close(saved)
            tmp.seek(0)
            out.append(tmp.read().decode(errors="replace"))


def parse_verbose(text: str) -> dict[str, Any]:
    """The matmul implementation and ISA from oneDNN verbose lines (v1 format)."""
    impl = isa = None
    for line in text.splitlines():
        parts = line.split(",")
        if parts[:2] != ["onednn_verbose", "v1"]:
            continue
        if parts[2:4] == ["info", "cpu"] and len(parts) > 4 and parts[4].startswith("isa:"):
            isa = parts[4][4:]
        elif parts[2:4] == ["primitive", "exec"] and len(parts) > 6 and parts[5] == "matmul":
            impl = parts[6]
    if impl is None:
        return {"library": "not oneDNN", "implementation": None, "isa": isa}
    return {"library": "oneDNN", "implementation": impl, "isa": isa}


def matmul_path(dtype: str) -> dict[str, Any]:
    """{"dtype", "library", "implementation", "isa"} for a CPU linear in `dtype`."""
    dt = _DTYPES[dtype]
    x = torch.randn(64, 576).to(dt)
    w = torch.randn(1536, 576).to(dt)
    F.linear(x, w)  # first call: primitive creation outside the verbose window
    with _captured_fd1() as out, torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
        F.linear(x, w)
    return {"dtype": dtype, **parse_verbose(out[0] if out else "")}
