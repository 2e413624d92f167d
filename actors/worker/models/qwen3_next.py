"""Hybrid decoders: Qwen3.5 (dense MLP) and Qwen3-Next (sparse MoE MLP).

Both interleave Gated DeltaNet layers (linear attention with a fixed-size state,
`layers/gdn.py`) and gated full-attention layers (`config.layer_types`, e.g.
three linear layers then one full one). Details that decide exactness against
transformers 5.24:

- every RMSNorm of the decoder (input, post-attention, final, q/k norms) is
  zero-centred: `x / rms(x) * (1 + w)` in float32 (`ZeroCenteredRMSNorm`);
- attention: `q_proj` gives per head `[query | gate]`; the output is multiplied
  by `sigmoid(gate)` before `o_proj`; q/k RMS-normed per head; partial RoPE
  (`partial_rotary_factor`, 0.25 in released models, rotate-half on the first
  quarter of each head). Qwen3.5's multimodal RoPE reduces to this one for text
  (its three position streams are equal);
- GDN: see `layers/gdn.py`; Qwen3-Next's projections are grouped per key head.

Forward contract: as `models/llama.py`, except that `kv_caches` holds per layer
either an attention cache `[2, num_blocks, block_size, kv_heads, head_dim]` or a
GDN state pair `(conv [num_blocks, K-1, C], ssm [num_blocks, Hv, dk, dv])`, and
`attn_metadata` is a `HybridMetadata` (`actors/worker/cache_layout.py`) that
gives each layer the metadata of its cache group.

`Qwen3_5ForConditionalGeneration` checkpoints are served text-only: their
`model.language_model.*` tensors load, the vision tower's are skipped.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from spur.actors.worker.layers.attention import PagedAttention
from spur.actors.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from spur.actors.worker.layers.gdn import GatedDeltaNet, GDNShape
from spur.actors.worker.layers.linear import QKVParallelLinear, RowParallelLinear
from spur.actors.worker.layers.moe import SparseMoeBlock
from spur.actors.worker.layers.norm import ZeroCenteredRMSNorm
from spur.actors.worker.layers.parallel_state import SINGLE, TPGroup
from spur.actors.worker.layers.rotary import RotaryEmbedding, rope_parameters
from spur.actors.worker.models.llama import LlamaMLP, head_dim_of


class GatedAttention(nn.Module):
    """Full attention with an output gate: `o_proj(attn(q, k, v) * sigmoid(gate))`.

    q_proj's rows are per head `[query (d) | gate (d)]`, so they load as a q
    part of `2 * num_heads` half-heads: a rank's slice is whole heads.
    """

    def __init__(
        self, config: Any, rotary: RotaryEmbedding, tp: TPGroup, backend: str | None
    ) -> None:
        super().__init__()
        hidden = config.hidden_size
        heads = config.num_attention_heads
        kv_heads = config.num_key_value_heads
        d = head_dim_of(config)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(hidden, d, 2 * heads, kv_heads, bias=bias, tp=tp)
        self.num_heads = self.qkv_proj.num_heads // 2  # per rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = d
        self.o_proj = RowParallelLinear(heads * d, hidden, bias=bias, tp=tp)
        self.q_norm = ZeroCenteredRMSNorm(d, config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(d, config.rms_norm_eps)
        self.rotary = rotary
        self.attn = PagedAttention(
            self.num_heads, self.num_kv_heads, d, scale=d**-0.5, backend=backend
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        kv_cache: torch.Tensor | None,
        attn_metadata: Any,
    ) -> torch.Tensor:
        n = hidden_states.shape[0]
        h, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(hidden_states)
        qg, k, v = qkv.split([2 * h * d, hk * d, hk * d], dim=-1)
        q, gate = qg.view(n, h, 2 * d).chunk(2, dim=-1)  # [n, H, d] each
        q = self.q_norm(q)
        k = self.k_norm(k.view(n, hk, d))
        q, k = self.rotary(positions, q, k)
        out = self.attn(q.contiguous(), k, v.view(n, hk, d), kv_cache, attn_metadata)
        out = out.reshape(n, h * d) * torch.sigmoid(gate.reshape(n, h * d))
        return self.o_proj(out)  # [n, hidden]


class HybridDecoderLayer(nn.Module):
    """Pre-norm block whose mixer is GDN or gated attention, and whose MLP is
    dense or sparse."""

    def __init__(
        self,
        config: Any,
        layer_idx: int,
        rotary: RotaryEmbedding,
        tp: TPGroup,
        backend: str | None,
        *,
        layout: str,
    ) -> None:
        super().__init__()
        self.kind = config.layer_types[layer_idx]
        if self.kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(config, layout=layout, tp=tp, backend=backend)
        elif self.kind == "full_attention":
            self.self_attn = GatedAttention(config, rotary, tp, backend)
        else:
            raise ValueError(
                f"layer {layer_idx} has type {self.kind!r}: Qwen3.5 / Qwen3-Next layers are "
                "linear_attention or full_attention"
            )
        if _is_sparse(config, layer_idx):
            self.mlp: nn.Module = SparseMoeBlock(config, tp)
        else:
            act = getattr(config, "hidden_act", "silu")
            self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, act, False, tp)
        eps = config.rms_norm_eps
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        residual: torch.Tensor | None,
        cache: Any,
        meta: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        if self.kind == "linear_attention":
            hidden_states = self.linear_attn(hidden_states, cache, meta)
        else:
            hidden_states = self.self_attn(positions, hidden_states, cache, meta)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


def _is_sparse(config: Any, layer_idx: int) -> bool:
    experts = int(getattr(config, "num_experts", 0) or 0)
    if not experts:
        return False
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    only_mlp = getattr(config, "mlp_only_layers", None) or []
    return layer_idx not in only_mlp and (layer_idx + 1) % step == 0


class HybridModel(nn.Module):
    def __init__(self, config: Any, tp: TPGroup, backend: str | None, layout: str) -> None:
        super().__init__()
        d = head_dim_of(config)
        params = rope_parameters(config)
        factor = float(
            params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        )
        self.rotary = RotaryEmbedding(d, int(d * factor), config.max_position_embeddings, params)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp=tp)
        self.layers = nn.ModuleList(
            HybridDecoderLayer(config, i, self.rotary, tp, backend, layout=layout)
            for i in range(config.num_hidden_layers)
        )
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[Any],
        attn_metadata: Any,
    ) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [n, hidden]
        residual = None
        for i, layer in enumerate(self.layers):
            cache = kv_caches[i] if kv_caches else None
            meta = attn_metadata.for_layer(i) if attn_metadata is not None else None
            hidden_states, residual = layer(positions, hidden_states, residual, cache, meta)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class Qwen3_5ForCausalLM(nn.Module):
    """Qwen3.5 text model (`qwen3_5_text`): GDN + gated attention, dense MLP.

    Besides the `LlamaForCausalLM` interface it describes its caches per layer
    (`layer_cache_kinds`, `gdn_shape`), which the runner's cache layout uses
    to place attention pages and GDN states in one pool.
    """

    layout = "qwen3_5"
    packed_modules_mapping: ClassVar[dict[str, tuple[str, str | int]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # Checkpoint name prefixes rewritten before loading (multimodal checkpoints).
    checkpoint_prefixes: ClassVar[dict[str, str]] = {}
    skipped_prefixes: ClassVar[tuple[str, ...]] = ("mtp.",)

    # Activations the GDN short convolution and the MoE experts compute (both silu,
    # layers/gdn.py and layers/moe.py); transformers uses config.hidden_act there.
    supported_hidden_acts: ClassVar[tuple[str, ...]] = ("silu", "swish")

    @classmethod
    def check_config(cls, config: Any) -> None:
        """Raise ValueError for a config this class cannot compute as transformers does:
        no layer_types, or a `hidden_act` other than silu (transformers applies it in
        the GDN convolution and the experts, where spur's layers compute silu)."""
        text = getattr(config, "text_config", None) or config
        if not getattr(text, "layer_types", None):
            raise ValueError("config has no layer_types: not a Qwen3.5 / Qwen3-Next config")
        act = getattr(text, "hidden_act", "silu")
        if act not in cls.supported_hidden_acts:
            raise ValueError(
                f"hidden_act is {act!r}: {cls.__name__} supports only hidden_act 'silu' (its "
                "Gated DeltaNet convolution and MoE experts compute silu); this checkpoint "
                "was not trained for spur's model: use a silu checkpoint"
            )

    @classmethod
    def ties_word_embeddings(cls, config: Any) -> bool:
        """Whether the LM head is the embedding matrix, as transformers decides it: the
        causal LM reads its text config's `tie_word_embeddings` (AutoModelForCausalLM
        builds it from `text_config`)."""
        text = getattr(config, "text_config", None) or config
        return bool(getattr(text, "tie_word_embeddings", False))

    def __init__(
        self, config: Any, *, tp: TPGroup = SINGLE, attn_backend: str | None = None
    ) -> None:
        super().__init__()
        self.check_config(config)
        self.tie_word_embeddings = self.ties_word_embeddings(config)
        config = getattr(config, "text_config", None) or config
        self.config = config
        self.tp = tp
        self.model = HybridModel(config, tp, attn_backend, self.layout)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp=tp)
        if self.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)
        self._attn = [m.self_attn for m in self.model.layers if m.kind == "full_attention"]
        if not self._attn:
            raise ValueError("the model has no full_attention layer")
        self.gdn_shape = GDNShape.of(config, tp)

    # ---- cache geometry, for the model runner ----
    @property
    def layer_cache_kinds(self) -> list[str]:
        """Per layer: "full_attention" or "linear_attention"."""
        return [m.kind for m in self.model.layers]

    @property
    def num_attention_layers(self) -> int:
        return len(self._attn)

    @property
    def num_kv_heads_per_rank(self) -> int:
        return self._attn[0].num_kv_heads

    @property
    def head_dim(self) -> int:
        return self._attn[0].head_dim

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, self.num_kv_heads_per_rank, self.head_dim)

    # ---- loading ----
    def rename_checkpoint_tensor(self, name: str) -> str:
        for old, new in self.checkpoint_prefixes.items():
            if name.startswith(old):
                return new + name[len(old) :]
        return name

    def skip_checkpoint_tensor(self, name: str) -> bool:
        if "rotary_emb.inv_freq" in name or name.startswith(self.skipped_prefixes):
            return True
        return self.tie_word_embeddings and name == "lm_head.weight"

    # ---- compute ----
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[Any],
        attn_metadata: Any,
    ) -> torch.Tensor:
        """`input_ids [n]`, `positions [n]` -> `hidden_states [n, hidden_size]`;
        writes K/V and GDN states into `kv_caches` (see the module docstring)."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)

    def greedy_ids(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """`compute_logits(hidden_states).argmax(-1)` ([m] int64) without the logits, or
        None where the LM head cannot (see `ParallelLMHead.greedy_ids`)."""
        return self.lm_head.greedy_ids(hidden_states)


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """A multimodal Qwen3.5 checkpoint served as text only."""

    checkpoint_prefixes: ClassVar[dict[str, str]] = {"model.language_model.": "model."}
    skipped_prefixes: ClassVar[tuple[str, ...]] = ("mtp.", "model.visual.", "visual.")

    @classmethod
    def ties_word_embeddings(cls, config: Any) -> bool:
        """The outer (multimodal) config's `tie_word_embeddings`, as transformers'
        Qwen3_5ForConditionalGeneration reads it (text_config's flag does not count)."""
        if getattr(config, "text_config", None) is None:
            return super().ties_word_embeddings(config)
        return bool(getattr(config, "tie_word_embeddings", False))


class Qwen3NextForCausalLM(Qwen3_5ForCausalLM):
    """Qwen3-Next: the same mixers (projections grouped per key head) and a
    sparse MoE MLP with a sigmoid-gated shared expert."""

    layout = "qwen3_next"
