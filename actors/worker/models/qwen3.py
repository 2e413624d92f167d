"""Qwen2 and Qwen3 decoders: the Llama decoder with different biases and norms.

- Qwen2: q/k/v projections have biases, o_proj and the MLP do not.
- Qwen3: biases follow `config.attention_bias` (False in released models), and
  each q and k head is RMS-normalised over head_dim before RoPE.

Both may use a sliding window on some layers (`config.layer_types`).
"""

from __future__ import annotations

from typing import Any, ClassVar

from spur.actors.worker.models.llama import DecoderOptions, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5 causal LM (same forward contract as `LlamaForCausalLM`)."""

    reads_layer_types: ClassVar[bool] = True  # transformers applies its sliding windows

    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        return DecoderOptions(qkv_bias=True, o_bias=False, mlp_bias=False)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense causal LM (same forward contract as `LlamaForCausalLM`)."""

    reads_layer_types: ClassVar[bool] = True  # transformers applies its sliding windows

    @classmethod
    def decoder_options(cls, config: Any) -> DecoderOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return DecoderOptions(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True)
