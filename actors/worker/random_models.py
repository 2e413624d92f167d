"""Random-weight hybrid checkpoints (Qwen3.5 / Qwen3-Next), built from a fixed seed.

For tests, benchmarks and the `hybrid-tiny` preset: a real `save_pretrained`
folder (config.json + model.safetensors), identical on every node that builds it
(same preset, same seed, same torch), so that a cluster of engines serves the
same model without shipping weights. The models speak nonsense.

Weights are redrawn with a spread that keeps logits far from ties (so that
greedy token ids are a sharp test) and every kind of tensor non-trivial: norm
weights around their identity, GDN decays varied per head.

    path = ensure_random_model("hybrid-tiny")        # cached under SPUR_CACHE_DIR
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from spur.configs import cache, env

logger = logging.getLogger(__name__)

_GDN = dict(
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)

PRESETS: dict[str, dict[str, Any]] = {
    # Tests: 2 GDN layers per attention layer, 6 layers, head dims of 16.
    "qwen3_5-test": dict(
        arch="Qwen3_5ForCausalLM",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        max_position_embeddings=65536,
        full_attention_interval=3,
        rms_norm_eps=1e-5,
        **_GDN,
    ),
    "qwen3_next-test": dict(
        arch="Qwen3NextForCausalLM",
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        max_position_embeddings=65536,
        full_attention_interval=3,
        rms_norm_eps=1e-5,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        mlp_only_layers=[1],  # one dense MLP among the sparse ones
        **_GDN,
    ),
    # The served demo: SmolLM2's vocabulary (49,152) so its tokenizer fits.
    "hybrid-tiny": dict(
        arch="Qwen3_5ForCausalLM",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=49152,
        max_position_embeddings=65536,
        full_attention_interval=4,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=32,
        linear_value_head_dim=32,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    ),
    # The benchmark: ~100M parameters, Qwen3.5's shape scaled down.
    "hybrid-bench": dict(
        arch="Qwen3_5ForCausalLM",
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=32768,
        max_position_embeddings=65536,
        full_attention_interval=4,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
    ),
}


def hf_config(preset: str, **overrides: Any) -> Any:
    """The transformers config of a preset (overrides replace its fields)."""
    from transformers import Qwen3_5TextConfig, Qwen3NextConfig

    try:
        fields = {**PRESETS[preset], **overrides}
    except KeyError:
        raise ValueError(f"unknown random model {preset!r}; known: {sorted(PRESETS)}") from None
    arch = fields.pop("arch")
    cls = Qwen3NextConfig if arch == "Qwen3NextForCausalLM" else Qwen3_5TextConfig
    config = cls(**fields)
    config.architectures = [arch]
    return config


def build_random_model(
    preset: str, out: str | os.PathLike[str], *, seed: int = 0, **overrides: Any
) -> Path:
    """Create the random checkpoint `preset` in `out` (overwritten); returns `out`."""
    from transformers import AutoModelForCausalLM

    config = hf_config(preset, **overrides)
    with _seeded(seed):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(_draw(name, p, gen))
    out = Path(out)
    model.save_pretrained(out)
    return out


@contextlib.contextmanager
def _seeded(seed: int) -> Any:
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.random.set_rng_state(state)


def _draw(name: str, p: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    def normal(mean: float, std: float) -> torch.Tensor:
        return torch.randn(p.shape, generator=gen) * std + mean

    if name.endswith("linear_attn.norm.weight"):  # plain weight (identity = 1)
        return normal(1.0, 0.2)
    if "norm" in name:  # zero-centred weights (identity = 0)
        return normal(0.0, 0.2)
    if name.endswith("A_log"):
        return torch.rand(p.shape, generator=gen) * 2.0 - 1.5  # decays exp(A) in [0.2, 1.6]
    if name.endswith("dt_bias"):
        return normal(0.0, 0.5)
    if "embed_tokens" in name or "lm_head" in name:
        return normal(0.0, 0.5)
    fan_in = p.shape[-1] if p.dim() > 1 else 1
    return normal(0.0, max(0.05, 1.0 / fan_in**0.5))


BUILD_VERSION = 1
"""Bumped when `build_random_model` or `_draw` changes what a preset's weights are, so
that a cache built by an older spur is not reused."""


def _build_key(preset: str, tokenizer: str | None) -> str:
    """A short digest of what a cached random model is made of: the preset's fields,
    the build code's version, and the tokenizer source."""
    if preset not in PRESETS:
        raise ValueError(f"unknown random model {preset!r}; known: {sorted(PRESETS)}")
    what = json.dumps([PRESETS[preset], BUILD_VERSION, tokenizer], sort_keys=True, default=str)
    return hashlib.sha256(what.encode()).hexdigest()[:10]


def ensure_random_model(
    preset: str, *, seed: int = 0, tokenizer: str | None = None, root: Path | None = None
) -> Path:
    """The cached folder of `preset` (built once, atomically, under a lock).

    `tokenizer`: a model folder or demo name whose tokenizer files are copied in
    (the hybrid-tiny preset uses SmolLM2's, whose vocabulary it matches).
    """
    name = f"random-{preset}-seed{seed}-{_build_key(preset, tokenizer)}"
    models = (root or env.cache_dir()) / "models"
    target = models / name
    if (target / "config.json").is_file():
        return target
    models.mkdir(parents=True, exist_ok=True)
    with cache.lock(models / f".{name}.lock"):
        if (target / "config.json").is_file():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=models))
        try:
            logger.info("building random model %s (seed %d) in %s", preset, seed, target)
            build_random_model(preset, tmp, seed=seed)
            if tokenizer:
                _copy_tokenizer(tokenizer, tmp)
            os.chmod(tmp, 0o755)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def _copy_tokenizer(source: str, out: Path) -> None:
    from spur.actors.worker.loader import resolve_model_dir

    src = resolve_model_dir(source)
    copied = 0
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")) or f.name in (
            "vocab.json",
            "merges.txt",
        ):
            shutil.copy2(f, out / f.name)
            copied += 1
    if not copied:
        raise ValueError(f"{src} has no tokenizer files to copy")
    # The model's own ids must agree with the tokenizer's.
    gen_cfg = src / "generation_config.json"
    cfg = json.loads((out / "config.json").read_text())
    src_cfg = json.loads((src / "config.json").read_text())
    for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
        if src_cfg.get(key) is not None:
            cfg[key] = src_cfg[key]
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    if gen_cfg.is_file():
        shutil.copy2(gen_cfg, out / gen_cfg.name)
