"""The Llama decoder's layers as one loop over the native CPU ops, decided once a step.

On CPU a decoder layer is nine native ops (two norms with the residual add fused, four
linears, RoPE fused with the KV store, attention over the paged cache, SiLU-and-mul).
Layer by layer, each op goes through its module's checks first: dtypes, strides, the
attention backend, the attention's argument checks and its layout lookup. That is about
100 us of Python a layer, 3 ms of a 30-layer step, whose arithmetic at 16 decode streams
takes 35-45 ms on two cores. `forward` takes every one of those decisions once for the
whole stack, before any op runs, then calls the ops the modules would have called, in
their order and with their arguments: the same results bit for bit
(tests/worker/test_llama_stack.py).

It serves a step when every layer would run natively: activations and KV cache on CPU
in float32 / bfloat16, the torch attention backend, no q/k norm (Qwen3), no sliding
window, SiLU gating, no tensor parallelism, and an attention layout with no SDPA part
(prefill chunks of contexts up to `reference.NATIVE_PREFILL_MAX_CONTEXT` are in the
native plan). Otherwise it returns None and the model runs layer by layer. Where every
linear reads packed panels (`PackedWeight`) of one kind and o_proj / down_proj have no
bias, the whole loop is one native call (`decoder_stack`, kernels/cpu/stack.h): no
Python between the ops, and the GIL released once a step instead of at every op.
Otherwise the loop runs here, op by op; unpacked weights, or the benches'
`native.torch_linears`, go through the layer's own `_linear` as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from spur import kernels
from spur.actors.worker.layers.linear import PackedWeight, packing_generation
from spur.actors.worker.layers.norm import RMSNorm
from spur.kernels import AttentionMetadata, native, reference

_state: dict[str, bool] = {"off": False}


@contextmanager
def layer_by_layer() -> Iterator[None]:
    """Within it `forward` declines every step, so models run layer by layer: for
    in-process A/Bs (tests, scratch benches). Not thread-safe."""
    before = _state["off"]
    _state["off"] = True
    try:
        yield
    finally:
        _state["off"] = before


def serves_structure(model: Any) -> bool:
    """Whether `model` (a `LlamaModel`) is built so that its layers can run as one native
    loop: decided by its architecture, once (cached on the model)."""
    ok = getattr(model, "_native_stack", None)
    if ok is None:
        ok = model._native_stack = _structure(model)
    return ok


def _structure(model: Any) -> bool:
    from spur.actors.worker.models.llama import LlamaDecoderLayer

    for layer in model.layers:
        if type(layer) is not LlamaDecoderLayer:
            return False
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if any(type(n) is not RMSNorm for n in norms):
            return False
        if attn.q_norm is not None or attn.attn.sliding_window is not None:
            return False
        if mlp.act_fn.hidden_act not in ("silu", "swish"):
            return False
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        if any(m.tp.size != 1 or getattr(m, "gather_output", False) for m in linears):
            return False
    return True


def forward(
    model: Any,
    hidden: torch.Tensor,
    positions: torch.Tensor,
    kv_caches: list[torch.Tensor],
    metadata: AttentionMetadata | None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Every decoder layer of `model` (a `LlamaModel`) over the embedded step:
    `hidden [n, hidden]` at `positions [n]` -> `(last block's output before its residual
    add, residual)`, both `[n, hidden]`, as the layer loop returns them; writes each
    layer's K/V into `kv_caches` (one `[2, num_blocks, block_size, kv_heads, head_dim]`
    per layer). None, with nothing run or written, where a layer would leave the native
    ops (see the module docstring): the caller runs the layers one by one.

    Raises ValueError, before any op runs, for metadata the attention would refuse.
    """
    if _state["off"] or not isinstance(metadata, AttentionMetadata) or not kv_caches:
        return None
    layers = model.layers
    if len(kv_caches) != len(layers) or not serves_structure(model):
        return None
    n = hidden.shape[0]
    kv0 = kv_caches[0]
    lib = native.usable(hidden, kv0)
    if lib is None or hidden.dim() != 2 or not hidden.is_contiguous() or n == 0:
        return None
    if positions.dtype != torch.int64 or not positions.is_contiguous():
        return None
    if metadata.slot_mapping.dtype != torch.int64:
        return None
    attn0 = layers[0].self_attn
    if (attn0.attn.backend or kernels.select_backend("auto", hidden.device)) != "torch":
        return None
    for kv in kv_caches:
        if kv.shape != kv0.shape or kv.dtype != kv0.dtype or kv.stride() != kv0.stride():
            return None
    ok, weights = _modules(model, hidden.dtype)
    if not ok:
        return None
    query = hidden.new_empty(n, attn0.num_heads, attn0.head_dim)  # what each layer's q is
    reference.check_attention_args(query, kv0, metadata, None, None)
    kernel, (sdpa_prefills, groups, plan, tiles) = reference.step_layout(query, kv0, metadata, None)
    if kernel is None or sdpa_prefills or groups:
        return None
    return _run(lib, model, hidden, positions, kv_caches, metadata, plan, tiles, weights)


def _modules(model: Any, dtype: torch.dtype) -> tuple[bool, Any]:
    """(ok, weights): whether every layer's attention backend is the first's and its
    norms' weights are in `dtype`, and `decoder_stack`'s weights (`_stack_weights`;
    None: the Python loop). ~0.5 ms of module attribute reads a step on SmolLM2's 30
    layers, so cached on the model. The key holds `packing_generation()` (packing,
    unpacking and `native.torch_linears` change which weights a step reads) and the
    dtype; modules are not rebuilt after load, and a dtype change is followed by
    `pack_linears`, which bumps the generation."""
    panels = not native.linears_unpacked()
    key = (packing_generation(), dtype, panels)
    cached = getattr(model, "_stack_modules", None)
    if cached is not None and cached[0] == key:
        return cached[1:]
    layers = model.layers
    backend = layers[0].self_attn.attn.backend
    ok = all(
        layer.self_attn.attn.backend == backend
        and layer.input_layernorm.weight.dtype == dtype
        and layer.post_attention_layernorm.weight.dtype == dtype
        for layer in layers
    )
    weights = _stack_weights(layers) if ok and panels else None
    model._stack_modules = (key, ok, weights)
    return ok, weights


def _run(
    lib: Any,
    model: Any,
    hidden: torch.Tensor,
    positions: torch.Tensor,
    kv_caches: list[torch.Tensor],
    metadata: AttentionMetadata,
    plan: native.DecodePlan | None,
    tiles: native.PrefillPlan | None,
    weights: tuple[list, list, list[int], list, list[float]] | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The layers' ops, in the order `LlamaDecoderLayer.forward` calls them: in one
    native call (`decoder_stack`) when every linear reads packed panels of one kind and
    o_proj / down_proj have no bias, else from Python, op by op."""
    n = hidden.shape[0]
    pad = metadata.num_actual_tokens  # rows from here on are padding: attention zeroes them
    rotary = model.rotary
    cos_sin = rotary.cos_sin_cache(hidden.device)
    slots = metadata.slot_mapping
    panels = not native.linears_unpacked()
    if weights is not None:
        attn = model.layers[0].self_attn
        return lib.decoder_stack(
            hidden,
            positions,
            cos_sin,
            kv_caches,
            slots,
            *weights,
            *((plan.tables, plan.rows, plan.firsts, plan.lens) if plan else (None,) * 4),
            *((tiles.tables, tiles.chunks) if tiles else (None, None)),
            pad,
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            rotary.rotary_dim,
            attn.attn.scale,
        )
    residual = None
    for layer, kv in zip(model.layers, kv_caches, strict=True):
        attn, mlp = layer.self_attn, layer.mlp
        norm = layer.input_layernorm
        if residual is None:
            residual = hidden
            x = lib.rms_norm(hidden, norm.weight, norm.eps)
        else:
            x, residual = lib.fused_add_rms_norm(hidden, residual, norm.weight, norm.eps)
        qkv = _column(lib, attn.qkv_proj, x, panels)  # [n, (Hq + 2 Hkv) d]
        q = lib.rope_store_kv(
            qkv,
            positions,
            cos_sin,
            kv,
            slots,
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            rotary.rotary_dim,
        )  # [n, Hq, d]; this step's K/V now in kv
        out = torch.empty_like(q)
        if pad < n:
            out[pad:].zero_()
        k_cache, v_cache = kv.unbind(0)
        scale = attn.attn.scale
        if tiles is not None:
            native.prefill_attention(lib, q, out, k_cache, v_cache, tiles, scale)
        if plan is not None:
            native.decode_attention(lib, q, out, k_cache, v_cache, plan, scale)
        hidden = _row(lib, attn.o_proj, out.view(n, attn.q_size), panels)  # [n, hidden]
        norm = layer.post_attention_layernorm
        x, residual = lib.fused_add_rms_norm(hidden, residual, norm.weight, norm.eps)
        gate_up = _column(lib, mlp.gate_up_proj, x, panels)  # [n, 2 * intermediate]
        hidden = _row(lib, mlp.down_proj, lib.silu_and_mul(gate_up), panels)
    assert residual is not None
    return hidden, residual


def _stack_weights(layers: Any) -> tuple[list, list, list[int], list, list[float]] | None:
    """`decoder_stack`'s per-layer weights (norms, panels, out_features, biases, eps),
    or None where a linear is not packed, the panels are of two kinds, or o_proj /
    down_proj has a bias (added after the op, as `_row` does)."""
    norms, panels, outs, biases, eps = [], [], [], [], []
    for layer in layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        for m in linears:
            if m.weight_panels is None:
                return None
            panels.append(m.weight_panels)
            outs.append(m.packed_out_features)
        if attn.o_proj.bias is not None or mlp.down_proj.bias is not None:
            return None
        biases += [attn.qkv_proj.bias, None, mlp.gate_up_proj.bias, None]
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norms.append(norm.weight)
            eps.append(norm.eps)
    if len({p.dim() for p in panels}) != 1:
        return None
    return norms, panels, outs, biases, eps


def _project(lib: Any, m: PackedWeight, x: torch.Tensor, bias: Any, panels: bool) -> torch.Tensor:
    """`m._linear(x, bias)`, straight to the panels op when the weight is packed."""
    if panels and m.weight_panels is not None:
        op = lib.linear_bf16_panels if m.weight_panels.dim() == 4 else lib.linear_f32_panels
        return op(x, m.weight_panels, bias, m.packed_out_features)
    return m._linear(x, bias)


def _column(lib: Any, m: Any, x: torch.Tensor, panels: bool) -> torch.Tensor:
    """A column-parallel layer on one rank: the bias goes into the op."""
    return _project(lib, m, x, m.bias, panels)


def _row(lib: Any, m: Any, x: torch.Tensor, panels: bool) -> torch.Tensor:
    """A row-parallel layer on one rank: the bias is added after, as its forward does."""
    y = _project(lib, m, x, None, panels)
    return y if m.bias is None else y + m.bias
