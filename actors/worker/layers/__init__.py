"""Shared building blocks of the models, tensor-parallel where they hold weights.

- parallel_state: `TPGroup`, the explicit tensor-parallel handle.
- linear: Column / MergedColumn / QKV / Row parallel linear layers.
- embedding: vocabulary-parallel embedding and LM head.
- attention: q/k/v projection, RoPE, paged KV store + attention, o_proj.
- rotary, norm, activation: RoPE tables, RMSNorm, gated activations.

Every parameter carries `weight_loader(param, full_checkpoint_tensor[, shard_id])`.
"""
