"""Attention kernels: paged KV store and paged attention, Triton or torch.

KV cache of one attention layer: one tensor

```
kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim]   (index 0 = K, 1 = V)
```

in float32, bfloat16, float16, or fp8 e4m3 (stored as uint8 on CPU, uint8 or
float8_e4m3fn on CUDA) with per-tensor scales k_scale / v_scale (stored = real /
scale). Each step the model calls `store_kv` for the new tokens, then
`paged_attention`, which reads all K/V through the block tables.

Backends: "torch" (kernels/reference.py, runs anywhere, the CPU serving path; on
CPU its fp32 / bf16 decodes use a small C kernel, kernels/native.py, when a C
compiler is there) and
"triton" (kernels/store_kv.py, kernels/paged_attention.py; CUDA, or the CPU
interpreter with TRITON_INTERPRET=1, which Triton reads when this package is
first imported: set it before start-up).

The Triton modules are imported here, eagerly, before the public functions are
defined: importing a submodule binds its name on the package, so a lazy
`import spur.kernels.paged_attention` would later replace the function
`spur.kernels.paged_attention` with the module. Importing triton costs ~0.2 s
and needs no GPU; if it fails the torch backend still works.
"""

from __future__ import annotations

import torch

from spur.configs import env
from spur.kernels.fp8 import Scale
from spur.kernels.metadata import AttentionMetadata, build_attention_metadata
from spur.kernels.reference import paged_attention_ref, store_kv_ref

try:
    from spur.kernels.paged_attention import paged_attention_triton
    from spur.kernels.store_kv import store_kv_triton

    _TRITON_ERROR: str | None = None
except ImportError as exc:  # triton missing or broken: the torch backend still serves
    _TRITON_ERROR = f"{type(exc).__name__}: {exc}"

__all__ = [
    "BACKENDS",
    "AttentionMetadata",
    "build_attention_metadata",
    "paged_attention",
    "paged_attention_ref",
    "select_backend",
    "store_kv",
    "store_kv_ref",
]

BACKENDS = ("torch", "triton")


def select_backend(requested: str, device: torch.device | str) -> str:
    """Resolve the attention backend for a device: "torch" or "triton".

    `requested` is "auto" | "torch" | "triton"; SPUR_ATTENTION_BACKEND, when
    set, overrides it. "auto" means triton on CUDA and torch elsewhere. Raises
    ValueError for an unknown name, or for triton on a non-CUDA device unless
    Triton's CPU interpreter is on (TRITON_INTERPRET=1, slow: tests only).
    """
    override = env.attention_backend_override()
    choice = (override or requested).lower()
    source = "SPUR_ATTENTION_BACKEND" if override else "attention backend"
    if choice not in ("auto", *BACKENDS):
        raise ValueError(f"{source} {choice!r} is unknown: use one of auto, torch, triton")
    device_type = torch.device(device).type
    if choice == "auto":
        return "triton" if device_type == "cuda" else "torch"
    if choice == "triton" and device_type != "cuda" and not env.triton_interpret():
        raise ValueError(
            f"{source} 'triton' needs a CUDA device but the model runs on {device_type}: use "
            "'torch' (or 'auto'), or set TRITON_INTERPRET=1 before start-up to run the Triton "
            "kernels in the (slow) CPU interpreter"
        )
    if choice == "triton" and _TRITON_ERROR is not None:
        raise ValueError(
            f"{source} 'triton' is unavailable ({_TRITON_ERROR}): install triton==3.7.1 or "
            "use 'torch'"
        )
    return choice


def _resolve(backend: str | None, device: torch.device) -> str:
    if backend is None:
        # Cheap (two environment lookups), and not cached so env changes are honoured.
        return select_backend("auto", device)
    if backend not in BACKENDS:
        raise ValueError(
            f"backend {backend!r} is not resolved: pass 'torch' or 'triton' "
            "(call select_backend first)"
        )
    if backend == "triton" and _TRITON_ERROR is not None:
        raise ValueError(f"the triton backend is unavailable ({_TRITON_ERROR}): use 'torch'")
    return backend


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: Scale = 1.0,
    v_scale: Scale = 1.0,
    *,
    backend: str | None = None,
) -> None:
    """Write K/V of this step's tokens into kv_cache in place (fp8 caches quantize).

    key, value: [num_tokens, num_kv_heads, head_dim]; slot_mapping: [num_tokens]
    int64, -1 = skip. `backend` is a resolved name ("torch" | "triton", see
    select_backend); None picks the default for the tensors' device.
    """
    if _resolve(backend, kv_cache.device) == "triton":
        store_kv_triton(key, value, kv_cache, slot_mapping, k_scale, v_scale)
    else:
        store_kv_ref(key, value, kv_cache, slot_mapping, k_scale, v_scale)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    metadata: AttentionMetadata,
    *,
    scale: float,
    k_scale: Scale = 1.0,
    v_scale: Scale = 1.0,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its paged context.

    query: [num_tokens, num_heads, head_dim]; returns out [num_tokens, num_heads,
    head_dim] in query's dtype (allocated when None). See paged_attention_ref for
    the full contract; both backends follow it.
    """
    if _resolve(backend, query.device) == "triton":
        return paged_attention_triton(
            query,
            kv_cache,
            metadata,
            scale=scale,
            k_scale=k_scale,
            v_scale=v_scale,
            sliding_window=sliding_window,
            out=out,
        )
    return paged_attention_ref(
        query,
        kv_cache,
        metadata,
        scale=scale,
        k_scale=k_scale,
        v_scale=v_scale,
        sliding_window=sliding_window,
        out=out,
    )


# --------------------------------------------------------------------------- Gated DeltaNet
# Ops of GDN layers (Qwen3.5 / Qwen3-Next): kernels/gdn_reference.py holds the
# contract (shapes, state pool layout, GDNMetadata); these pick the backend.

from spur.kernels.gdn_reference import (  # noqa: E402
    GDNMetadata,
    build_gdn_metadata,
    causal_conv1d_varlen_ref,
    gated_delta_rule_varlen_ref,
)

if _TRITON_ERROR is None:
    from spur.kernels.gdn_conv_triton import causal_conv1d_varlen_triton
    from spur.kernels.gdn_triton import gated_delta_rule_varlen_triton

__all__ += [
    "GDNMetadata",
    "build_gdn_metadata",
    "causal_conv1d_varlen",
    "gated_delta_rule_varlen",
]


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    metadata: GDNMetadata,
    activation: str | None = "silu",
    *,
    out: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Causal conv1d (+ SiLU) of one step's flattened batch through the conv state pool.

    x: [num_tokens, conv_dim]; weight: [conv_dim, K]; conv_state: [num_slots, K-1,
    conv_dim], mutated. Returns out [num_tokens, conv_dim]. Full contract:
    gdn_reference.causal_conv1d_varlen_ref; `backend` as for paged_attention.
    """
    if _resolve(backend, x.device) == "triton":
        fn = causal_conv1d_varlen_triton
    else:
        fn = causal_conv1d_varlen_ref
    return fn(x, weight, bias, conv_state, metadata, activation, out=out)


def gated_delta_rule_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    metadata: GDNMetadata,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
    out: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Gated delta rule of one step's flattened batch through the recurrent state pool.

    q, k: [num_tokens, num_k_heads, k_head_dim]; v: [num_tokens, num_v_heads,
    v_head_dim]; g, beta: [num_tokens, num_v_heads]; ssm_state: [num_slots,
    num_v_heads, k_head_dim, v_head_dim], mutated. Returns out [num_tokens,
    num_v_heads, v_head_dim]. Full contract: gdn_reference.gated_delta_rule_varlen_ref.
    chunk_size (16, 32 or 64 for triton) is the prefill chunk of the chunked form.
    """
    if _resolve(backend, q.device) == "triton":
        fn = gated_delta_rule_varlen_triton
    else:
        fn = gated_delta_rule_varlen_ref
    return fn(
        q,
        k,
        v,
        g,
        beta,
        ssm_state,
        metadata,
        scale=scale,
        use_qk_l2norm=use_qk_l2norm,
        chunk_size=chunk_size,
        out=out,
    )
