"""spur's model implementations, looked up by Hugging Face architecture name.

All models follow one forward contract (see models/llama.py):
`model(input_ids, positions, kv_caches, attn_metadata) -> hidden_states`,
`model.compute_logits(hidden_states) -> logits`, and
`model.greedy_ids(hidden_states) -> ids | None` (the logits' argmax without the
logits, where the LM head can: the model runner's greedy steps). Use `registry.get_model_class`
(or `spur.actors.worker.loader.load_model`) rather than importing classes.
"""

from spur.actors.worker.models.registry import get_model_class, supported_architectures

__all__ = ["get_model_class", "supported_architectures"]
