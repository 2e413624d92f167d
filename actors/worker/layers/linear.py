"""Tensor-parallel linear layers, each with a `weight_loader` on its parameters.

Megatron-style splitting; `T` is the TP size, `r` this rank:

```
ColumnParallelLinear   W [out, in]  -> rank r keeps rows  [r*out/T, (r+1)*out/T)
                       y_r = x @ W_r^T + b_r           # [n, out/T], no communication
RowParallelLinear      W [out, in]  -> rank r keeps cols  [r*in/T, (r+1)*in/T)
                       y = all_reduce(x_r @ W_r^T) + b # [n, out], x_r is the rank's input slice
```

A column layer followed by a row layer (qkv -> o, gate_up -> down) needs one
all-reduce per pair.

Loading: every parameter carries `param.weight_loader(param, loaded_weight,
shard_id=None)`, which takes the FULL checkpoint tensor, checks its shape
(raising `ValueError` naming both shapes), and copies this rank's slice into
`param`. Fused parameters (qkv, gate_up) also carry `param.shard_ids`, the
shards the checkpoint must provide for the parameter to be complete.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from spur.actors.worker.layers.parallel_state import SINGLE, TPGroup
from spur.kernels import native

WeightLoader = Callable[..., None]


def set_weight_attrs(param: nn.Parameter, **attrs: Any) -> None:
    """Attach loading metadata (`weight_loader`, `shard_ids`) to a parameter."""
    for key, value in attrs.items():
        setattr(param, key, value)


def check_shape(loaded: torch.Tensor, expected: Sequence[int]) -> None:
    """Raise ValueError unless `loaded` has exactly the full checkpoint shape `expected`."""
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(
            f"checkpoint tensor has shape {tuple(loaded.shape)}, the model expects "
            f"{tuple(expected)}: the checkpoint does not match config.json"
        )


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard_id: Any = None) -> None:
    """Copy an unsplit tensor (norm weights, row-parallel bias) into `param`."""
    if shard_id is not None:
        raise ValueError(f"parameter is not fused, got shard id {shard_id!r}")
    check_shape(loaded, param.shape)
    param.data.copy_(loaded)


def _new_param(*shape: int, dtype: torch.dtype | None) -> nn.Parameter:
    # Device comes from the ambient default (the loader builds under `meta`).
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


_packing = {"generation": 0}


def packing_generation() -> int:
    """A number that changes whenever a layer's weight is packed, adopted from a tied
    layer, or unpacked / restored (`unpacked_linears`): what callers that cache the
    panels of a model (`llama_stack`) key their caches on."""
    return _packing["generation"]


class PackedWeight:
    """A layer whose weight can be packed once, after loading, into the panels
    `native.linear_panels` reads (`native.pack_linear`: float32 on CPUs where spur's
    float32 linear serves, not MKL's; bfloat16 on CPUs with AVX-512 BF16 and no AMX).
    The packed copy replaces the weight: `weight`
    becomes an empty [0, in_features] parameter (memory is not doubled) and every row
    count runs on the panels. `unpacked_linears` restores the [N, K] weights for a
    while (benches timing torch's own path).

    `packs_itself` False (token embeddings): the layer is packed only when it shares
    its weight with one that packs (an LM head tied to it), and then reads its rows
    from the shared panels."""

    weight: nn.Parameter
    weight_panels: torch.Tensor | None = None
    packed_out_features = 0
    packs_itself = True

    def pack_weight(self) -> int:
        """Pack the weight if the native op serves it; returns the packed bytes (0: not packed)."""
        if self.weight_panels is not None:
            return 0
        panels = native.pack_linear(self.weight)
        if panels is None:
            return 0
        n, k = self.weight.shape
        self._adopt(nn.Parameter(self.weight.new_empty(0, k), requires_grad=False), panels, n)
        return panels.numel() * panels.element_size()

    def _adopt(self, weight: nn.Parameter, panels: torch.Tensor, out_features: int) -> None:
        self.weight, self.weight_panels, self.packed_out_features = weight, panels, out_features
        _packing["generation"] += 1

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in] -> x W^T + bias [..., out] on this rank's weight."""
        if self.weight_panels is not None:
            return native.linear_panels(x, self.weight_panels, bias, self.packed_out_features)
        y = native.small_linear(x, self.weight, bias)  # decode row counts (native.py)
        return F.linear(x, self.weight, bias) if y is None else y


def pack_linears(model: nn.Module) -> tuple[int, int]:
    """Pack every layer weight that `native.linear_panels` serves
    (`PackedWeight.pack_weight`): the linear layers, the LM head, and the token
    embedding tied to it (one packed copy for both). Returns (weights packed, bytes).
    Call once, after loading and after any dtype change."""
    layers = [m for m in model.modules() if isinstance(m, PackedWeight)]
    done: dict[int, tuple[nn.Parameter, torch.Tensor, int]] = {}  # id(old weight) ->
    alive = []  # the old weights, so that no id is reused while `done` is read
    count = nbytes = 0
    for m in (m for m in layers if m.packs_itself):
        old = m.weight
        if id(old) in done:  # tied to a layer packed already
            m._adopt(*done[id(old)])
            continue
        b = m.pack_weight()
        if b:
            alive.append(old)
            done[id(old)] = (m.weight, m.weight_panels, m.packed_out_features)
            count, nbytes = count + 1, nbytes + b
    for m in (m for m in layers if not m.packs_itself and id(m.weight) in done):
        m._adopt(*done[id(m.weight)])
    return count, nbytes


@contextmanager
def unpacked_linears(model: nn.Module) -> Iterator[None]:
    """Within it the packed layers of `model` hold their [N, K] weights again and
    compute with them (torch's path; memory for both meanwhile, tied weights unpacked
    once each). For benches."""
    packed = [
        m for m in model.modules() if isinstance(m, PackedWeight) and m.weight_panels is not None
    ]
    saved = [(m.weight, m.weight_panels) for m in packed]
    for m in packed:
        m.weight = nn.Parameter(
            native.unpack_linear(m.weight_panels, m.packed_out_features), requires_grad=False
        )
        m.weight_panels = None
    _packing["generation"] += 1
    try:
        yield
    finally:
        for m, (weight, panels) in zip(packed, saved, strict=True):
            m.weight, m.weight_panels = weight, panels
        _packing["generation"] += 1


class ColumnParallelLinear(PackedWeight, nn.Module):
    """`y = x W^T + b` with W's output features split across TP ranks.

    Args:
        input_size: in-features (not split).
        output_size: total out-features over all ranks; must divide by TP size.
        bias: whether the layer has a bias (split like the output).
        gather_output: all-gather the output so each rank gets all features.
        tp: the tensor-parallel group.
        params_dtype: parameter dtype; default `torch.get_default_dtype()`.

    forward: `x [..., input_size] -> [..., output_size / T]` (or `output_size`
    with gather_output).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = True,
        gather_output: bool = False,
        tp: TPGroup = SINGLE,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.input_size = input_size
        self.output_size = output_size
        self.output_size_per_rank = self._per_rank_output()
        self.gather_output = gather_output
        self.weight = _new_param(self.output_size_per_rank, input_size, dtype=params_dtype)
        set_weight_attrs(self.weight, weight_loader=self.weight_loader)
        if bias:
            self.bias: nn.Parameter | None = _new_param(
                self.output_size_per_rank, dtype=params_dtype
            )
            set_weight_attrs(self.bias, weight_loader=self.weight_loader)
        else:
            self.register_parameter("bias", None)

    def _per_rank_output(self) -> int:
        return self.tp.split(self.output_size, "output_size")

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None
    ) -> None:
        """Copy this rank's rows of the full `[output_size, input_size]` (or bias) tensor."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} is not fused, got shard id {shard_id!r}")
        check_shape(loaded, (self.output_size, *param.shape[1:]))
        n = self.output_size_per_rank
        param.data.copy_(loaded.narrow(0, self.tp.rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._linear(x, self.bias)  # [..., out/T]
        return self.tp.all_gather(y, dim=-1) if self.gather_output else y

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, out={self.output_size_per_rank} "
            f"(of {self.output_size}), bias={self.bias is not None}, tp={self.tp.size}"
        )


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul.

    Used for `gate_up_proj` = [gate_proj; up_proj]. Each rank's weight is the
    concatenation of its slice of every part:

    ```
    rank r rows:  | gate[r*I/T : (r+1)*I/T] | up[r*I/T : (r+1)*I/T] |
    ```

    `shard_id` is the part's index in `output_sizes` (checkpoint `gate_proj` ->
    0, `up_proj` -> 1); `None` means an already fused checkpoint tensor.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        *,
        bias: bool = True,
        tp: TPGroup = SINGLE,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(
            input_size, sum(self.output_sizes), bias=bias, tp=tp, params_dtype=params_dtype
        )
        shard_ids = tuple(range(len(self.output_sizes)))
        set_weight_attrs(self.weight, shard_ids=shard_ids)
        if self.bias is not None:
            set_weight_attrs(self.bias, shard_ids=shard_ids)

    def _per_rank_output(self) -> int:
        return sum(self.tp.split(s, "output_sizes[i]") for s in self.output_sizes)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None
    ) -> None:
        """Copy this rank's slice of part `shard_id` (full checkpoint tensor) into `param`."""
        if shard_id is None:  # fused in the checkpoint: split and load each part
            check_shape(loaded, (self.output_size, *param.shape[1:]))
            for i, part in enumerate(torch.split(loaded, self.output_sizes, dim=0)):
                self.weight_loader(param, part, i)
            return
        size = self.output_sizes[shard_id]
        check_shape(loaded, (size, *param.shape[1:]))
        n = size // self.tp.size
        offset = sum(s // self.tp.size for s in self.output_sizes[:shard_id])
        param.data.narrow(0, offset, n).copy_(loaded.narrow(0, self.tp.rank * n, n))


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection, split by attention head across TP ranks.

    Each rank gets `num_heads / T` query heads and `max(1, num_kv_heads / T)`
    KV heads. With fewer KV heads than ranks (GQA with large TP) each KV head is
    replicated on `T / num_kv_heads` consecutive ranks: rank r holds KV head
    `r // (T / num_kv_heads)`.

    ```
    rank r rows: | q heads (H/T * d) | k heads (Hkv_r * d) | v heads (Hkv_r * d) |
    ```

    forward: `x [n, hidden] -> [n, (H/T + 2 * Hkv_r) * head_dim]`; split with
    `q_size`, `kv_size`. `shard_id` is "q", "k" or "v" (None: fused checkpoint).
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        *,
        bias: bool = True,
        tp: TPGroup = SINGLE,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        self.head_dim = head_dim
        self.total_num_heads = num_heads
        self.total_num_kv_heads = num_kv_heads
        self.num_heads = tp.split(num_heads, "num_attention_heads")
        if num_kv_heads >= tp.size:
            self.num_kv_heads = tp.split(num_kv_heads, "num_key_value_heads")
            self.kv_head_start = tp.rank * self.num_kv_heads
        else:
            if tp.size % num_kv_heads:
                raise ValueError(
                    f"tensor parallel size {tp.size} must be a multiple of "
                    f"num_key_value_heads={num_kv_heads} to replicate KV heads"
                )
            self.num_kv_heads = 1
            self.kv_head_start = tp.rank // (tp.size // num_kv_heads)
        self.q_size = self.num_heads * head_dim  # per rank
        self.kv_size = self.num_kv_heads * head_dim  # per rank
        super().__init__(
            hidden_size,
            (num_heads + 2 * num_kv_heads) * head_dim,
            bias=bias,
            tp=tp,
            params_dtype=params_dtype,
        )
        for p in (self.weight, self.bias):
            if p is not None:
                set_weight_attrs(p, shard_ids=("q", "k", "v"))

    def _per_rank_output(self) -> int:
        return self.q_size + 2 * self.kv_size

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None
    ) -> None:
        """Copy this rank's heads of the full q, k or v checkpoint tensor into `param`."""
        d = self.head_dim
        full_q, full_kv = self.total_num_heads * d, self.total_num_kv_heads * d
        rest = tuple(param.shape[1:])
        if shard_id is None:
            check_shape(loaded, (full_q + 2 * full_kv, *rest))
            q, k, v = torch.split(loaded, [full_q, full_kv, full_kv], dim=0)
            for sid, part in (("q", q), ("k", k), ("v", v)):
                self.weight_loader(param, part, sid)
            return
        if shard_id == "q":
            check_shape(loaded, (full_q, *rest))
            src = loaded.narrow(0, self.tp.rank * self.q_size, self.q_size)
            dst = param.data.narrow(0, 0, self.q_size)
        elif shard_id in ("k", "v"):
            check_shape(loaded, (full_kv, *rest))
            src = loaded.narrow(0, self.kv_head_start * d, self.kv_size)
            offset = self.q_size + (0 if shard_id == "k" else self.kv_size)
            dst = param.data.narrow(0, offset, self.kv_size)
        else:
            raise ValueError(
                f"QKVParallelLinear shard id must be 'q', 'k' or 'v', got {shard_id!r}"
            )
        dst.copy_(src)


class RowParallelLinear(PackedWeight, nn.Module):
    """`y = x W^T + b` with W's input features split across TP ranks.

    Each rank multiplies its slice of the input (`input_is_parallel`, the
    output of a column-parallel layer) by its column block of W; partial sums
    are all-reduced. The bias is added once, after the reduction.

    forward: `x [..., input_size / T] -> [..., output_size]` (identical on all
    ranks when `reduce_results`).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        bias: bool = True,
        reduce_results: bool = True,
        tp: TPGroup = SINGLE,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.input_size = input_size
        self.output_size = output_size
        self.input_size_per_rank = tp.split(input_size, "input_size")
        self.reduce_results = reduce_results
        self.weight = _new_param(output_size, self.input_size_per_rank, dtype=params_dtype)
        set_weight_attrs(self.weight, weight_loader=self.weight_loader)
        if bias:
            self.bias: nn.Parameter | None = _new_param(output_size, dtype=params_dtype)
            set_weight_attrs(self.bias, weight_loader=default_weight_loader)
        else:
            self.register_parameter("bias", None)

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None
    ) -> None:
        """Copy this rank's column block of the full `[output_size, input_size]` weight."""
        if shard_id is not None:
            raise ValueError(f"RowParallelLinear is not fused, got shard id {shard_id!r}")
        check_shape(loaded, (self.output_size, self.input_size))
        n = self.input_size_per_rank
        param.data.copy_(loaded.narrow(1, self.tp.rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._linear(x, None)  # [..., out], partial sum on this rank
        if self.reduce_results:
            y = self.tp.all_reduce(y)
        # Without the reduction the caller sums the partials: add the bias on one rank only.
        if self.bias is not None and (self.reduce_results or self.tp.rank == 0):
            y = y + self.bias
        return y

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size_per_rank} (of {self.input_size}), out={self.output_size}, "
            f"bias={self.bias is not None}, tp={self.tp.size}"
        )
