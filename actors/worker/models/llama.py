"""Llama-family decoder (Llama 2/3, SmolLM2) over the shared parallel layers.

The same decoder serves Qwen2 and Qwen3 (see qwen3.py), which differ only in
biases and per-head q/k norms; `DecoderOptions` carries those differences.

Forward contract (shared by every model in the registry):

```
model(input_ids [n] int64, positions [n] int64, kv_caches: list of
      [2, num_blocks, block_size, num_kv_heads_per_rank, head_dim] (one per layer),
      attn_metadata) -> hidden_states [n, hidden_size]
model.compute_logits(hidden_states [m, hidden_size]) -> logits [m, vocab_size] float32
model.greedy_ids(hidden_states [m, hidden_size]) -> [m] int64 argmax of those logits,
      or None where the LM head cannot pick without them
```

The batch is flattened (requests' tokens laid end to end, no batch dim); the
metadata tells attention where each request's tokens and cached context are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from spur.actors.worker.layers.activation import GatedActivation
from spur.actors.worker.layers.attention import CausalSelfAttention
from spur.actors.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from spur.actors.worker.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from spur.actors.worker.layers.norm import RMSNorm
from spur.actors.worker.layers.parallel_state import SINGLE, TPGroup
from spur.actors.worker.layers.rotary import RotaryEmbedding, rope_parameters
from spur.actors.worker.models import llama_stack
from spur.kernels import AttentionMetadata


@dataclass(frozen=True)
class DecoderOptions:
    """Architecture switches that distinguish Llama, Qwen2 and Qwen3."""

    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False


def head_dim_of(config: Any) -> int:
    """`config.head_dim` when set, else hidden_size / num_attention_heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def sliding_window_of(config: Any, layer_idx: int) -> int | None:
    """Sliding window of layer `layer_idx` (None = full attention), from `layer_types`.

    Only Qwen2 / Qwen3 configs get here with sliding layers: `LlamaForCausalLM.check_config`
    refuses them for Llama, whose transformers modeling ignores `layer_types`."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types and layer_types[layer_idx] == "sliding_attention":
        return getattr(config, "sliding_window", None)
    return None


class LlamaMLP(nn.Module):
    """`down(act(gate(x)) * up(x))`: `[n, hidden] -> [n, hidden]`, intermediate split over TP."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool, tp: TPGroup
    ) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], bias=bias, tp=tp
        )
        self.act_fn = GatedActivation(hidden_act)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [n, 2 * intermediate / T]
        return self.down_proj(self.act_fn(gate_up))  # [n, hidden]


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: `h = x + attn(norm(x)); out = h + mlp(norm(h))`.

    The residual stream is carried separately (`residual`) so each norm can
    fuse the preceding add.
    """

    def __init__(
        self,
        config: Any,
        layer_idx: int,
        rotary: RotaryEmbedding,
        options: DecoderOptions,
        tp: TPGroup,
        backend: str | None,
    ) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = CausalSelfAttention(
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=head_dim_of(config),
            rotary=rotary,
            qkv_bias=options.qkv_bias,
            o_bias=options.o_bias,
            qk_norm_eps=eps if options.qk_norm else None,
            sliding_window=sliding_window_of(config, layer_idx),
            backend=backend,
            tp=tp,
        )
        self.mlp = LlamaMLP(
            config.hidden_size,
            config.intermediate_size,
            getattr(config, "hidden_act", "silu"),
            options.mlp_bias,
            tp,
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor | None,
        attn_metadata: AttentionMetadata | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns `(block output before its residual add, residual)`, both `[n, hidden]`."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, kv_cache, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (`model.*` in checkpoints).

    On CPU, a step whose every layer would run on the native ops runs the layers as one
    loop decided once (`llama_stack.forward`: the same ops, the same results); any
    other step runs them one by one.
    """

    def __init__(
        self, config: Any, options: DecoderOptions, tp: TPGroup, backend: str | None
    ) -> None:
        super().__init__()
        head_dim = head_dim_of(config)
        rotary_dim = int(head_dim * getattr(config, "partial_rotary_factor", 1.0))
        self.rotary = RotaryEmbedding(
            head_dim, rotary_dim, config.max_position_embeddings, rope_parameters(config)
        )
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, self.rotary, options, tp, backend)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata | None,
    ) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [n, hidden]
        stack = llama_stack.forward(self, hidden_states, positions, kv_caches, attn_metadata)
        if stack is not None:  # every layer on the native CPU ops, decided once
            hidden_states, residual = stack
        else:
            residual = None
            for i, layer in enumerate(self.layers):
                kv_cache = kv_caches[i] if kv_caches else None
                hidden_states, residual = layer(
                    positions, hidden_states, residual, kv_cache, attn_metadata
                )
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """Causal LM: `LlamaModel` plus a (possibly tied) vocabulary-parallel LM head.

    Args:
        config: the Hugging Face config (a `PretrainedConfig` or anything with
            the same attributes).
        tp: tensor-parallel group; heads, MLP width and vocabulary are split
            across it.
        attn_backend: resolved attention backend ("torch" | "triton"), or None
            to let the kernels choose by device.

    Build under `torch.device("meta")` and load with `spur.actors.worker.loader`.
    """

    # checkpoint module name -> (our fused module name, shard id in it)
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    # Whether transformers' modeling of this architecture reads `config.layer_types`
    # (sliding-window layers). Llama's does not: its attention is full on every layer.
    reads_layer_types: ClassVar[bool] = False

    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderOptions(
            qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(config, "mlp_bias", False))
        )

    @classmethod
    def check_config(cls, config: Any) -> None:
        """Raise ValueError for a config this class would compute differently from
        transformers: sliding-window layers in `layer_types` for an architecture whose
        transformers modeling ignores them (Llama)."""
        if cls.reads_layer_types:
            return
        layer_types = getattr(config, "layer_types", None) or []
        sliding = [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]
        if sliding:
            raise ValueError(
                f"config.json's layer_types makes layers {sliding} sliding_attention, but "
                f"transformers' {cls.__name__} has no sliding-window attention and ignores "
                "layer_types: remove layer_types (and sliding_window) from config.json to serve "
                "the model as transformers does, or fix architectures / model_type if it is "
                "a sliding-window model"
            )

    def __init__(
        self, config: Any, *, tp: TPGroup = SINGLE, attn_backend: str | None = None
    ) -> None:
        super().__init__()
        self.check_config(config)
        self.config = config
        self.tp = tp
        self.model = LlamaModel(config, self.decoder_options(config), tp, attn_backend)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp=tp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)

    # ---- KV cache geometry, for the model runner ----
    @property
    def num_attention_layers(self) -> int:
        return len(self.model.layers)

    @property
    def num_kv_heads_per_rank(self) -> int:
        return self.model.layers[0].self_attn.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.model.layers[0].self_attn.head_dim

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """One layer's cache shape: `(2, num_blocks, block_size, kv_heads_per_rank, head_dim)`."""
        return (2, num_blocks, block_size, self.num_kv_heads_per_rank, self.head_dim)

    # ---- loading ----
    def skip_checkpoint_tensor(self, name: str) -> bool:
        """True for checkpoint tensors the model does not use (ignored silently)."""
        if "rotary_emb.inv_freq" in name:
            return True
        return self.tie_word_embeddings and name == "lm_head.weight"

    # ---- compute ----
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata | None,
    ) -> torch.Tensor:
        """`input_ids [n]`, `positions [n]` -> `hidden_states [n, hidden_size]`.

        Writes this step's K/V into `kv_caches` (one per layer, mutated). Pass
        `kv_caches=[]` and `attn_metadata=None` for a dummy run (no cache
        access, attention output zero).
        """
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """`hidden_states [m, hidden]` -> logits `[m, vocab_size]` fp32, full vocab on all ranks."""
        return self.lm_head(hidden_states)

    def greedy_ids(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """`compute_logits(hidden_states).argmax(-1)` ([m] int64) without the logits, or
        None where the LM head cannot (see `ParallelLMHead.greedy_ids`)."""
        return self.lm_head.greedy_ids(hidden_states)
