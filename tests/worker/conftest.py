"""Fixtures for model / loader tests: tiny random Hugging Face checkpoints.

Each tiny model is a real `save_pretrained` folder (config.json +
model.safetensors) built once per session from a fixed seed. Weights are
re-drawn with a larger spread than HF's init (and norm weights around 1, biases
non-zero) so that a wrongly loaded tensor changes the logits visibly.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,  # puts head_dim-16 bands in all three regimes
}


def tiny_config(name: str) -> Any:
    """The Hugging Face config of tiny model `name` (see TINY_MODELS)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    if name == "llama":  # untied head, llama3 RoPE scaling
        return LlamaConfig(**TINY, tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE)
    if name == "llama_tied":  # tied head, biases everywhere, linear RoPE scaling
        rope = {"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0}
        return LlamaConfig(
            **TINY,
            tie_word_embeddings=True,
            attention_bias=True,
            mlp_bias=True,
            rope_parameters=rope,
        )
    if name == "qwen2":
        return Qwen2Config(**TINY, tie_word_embeddings=False)
    if name == "qwen2_sliding":  # layer 1 uses a 5-token sliding window
        return Qwen2Config(
            **TINY,
            tie_word_embeddings=True,
            use_sliding_window=True,
            sliding_window=5,
            max_window_layers=1,
        )
    if name == "qwen3":  # head_dim != hidden / heads, as in real Qwen3
        return Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=True)
    if name == "qwen3_tp":  # 1 KV head (replicated under TP) and an odd vocab (padded)
        cfg = {**TINY, "num_key_value_heads": 1, "vocab_size": 250}
        return Qwen3Config(**cfg, head_dim=16, tie_word_embeddings=False)
    raise KeyError(name)


TINY_MODELS = ("llama", "llama_tied", "qwen2", "qwen2_sliding", "qwen3", "qwen3_tp")


def build_tiny_model(name: str, out: Path) -> Path:
    """Create the random HF model `name` and save it (safetensors) into `out`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    config = tiny_config(name)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if "norm" in pname:
                p.normal_(1.0, 0.2)
            elif pname.endswith("bias"):
                p.normal_(0.0, 0.2)
            else:
                p.normal_(0.0, 0.1)
    hf.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`tiny_model_dir(name) -> Path` of a saved tiny model; built once per session."""
    made: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("tiny_models")

    def get(name: str) -> Path:
        if name not in made:
            made[name] = build_tiny_model(name, root / name)
        return made[name]

    return get


@pytest.fixture(scope="session")
def hf_logits(tiny_model_dir: Callable[[str], Path]) -> Callable[[str, list[int]], torch.Tensor]:
    """`hf_logits(name, token_ids) -> [len, vocab]` fp32 logits of transformers' own model."""
    from transformers import AutoModelForCausalLM

    models: dict[str, Any] = {}

    def run(name: str, ids: list[int]) -> torch.Tensor:
        if name not in models:
            models[name] = AutoModelForCausalLM.from_pretrained(
                tiny_model_dir(name), dtype=torch.float32
            ).eval()
        with torch.no_grad():
            return models[name](torch.tensor([ids])).logits[0].float()

    return run


@pytest.fixture
def panels_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """pack_linear_f32 serving on this machine whatever its vendor and panel width (the
    rules: tests/kernels/test_native.py)."""
    from spur.kernels import native

    lib = native.build()
    if not lib.linear_f32_supported():
        pytest.skip("linear_f32 needs AVX2 + FMA or AVX-512; this CPU has neither")
    monkeypatch.setitem(native._state, "linear_f32_here", True)
    monkeypatch.setattr(native, "PACKED_PANEL_WIDTHS", (lib.linear_f32_panel_width(),))


@pytest.fixture
def bf16_panels(monkeypatch: pytest.MonkeyPatch) -> None:
    """pack_linear_bf16 serving on this machine whatever its AMX (the rule:
    tests/kernels/test_native.py)."""
    from spur.kernels import native

    lib = native.build()
    if not lib.small_linear_supported():
        pytest.skip("bf16 panels need AVX-512 BF16; this CPU has none")
    monkeypatch.setitem(native._state, "bf16_panels_here", True)


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def paged_steps(
    model: torch.nn.Module,
    seqs: list[list[int]],
    steps: list[list[tuple[int, int]]],
    *,
    block_size: int = 4,
    num_blocks: int = 64,
    pad: int = 0,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Iterator[tuple[list[tuple[int, int]], torch.Tensor, int, list[torch.Tensor]]]:
    """Run token sequences through the paged KV path in flattened mixed steps.

    `steps[s]` lists `(request, num_tokens)`: that request's next tokens go in
    step s (all requests in one flattened batch, in the listed order). Each
    request gets blocks in a shuffled order, so block tables are non-trivial;
    `pad` extra padding rows (slot -1) are appended to every step. The KV caches
    are `dtype`, one per layer.

    Yields per step `(step, hidden [n + pad, hidden], n, kv_caches)`: the model's
    output, its `n` real rows first, and the caches as that step left them.
    """
    from spur.kernels import build_attention_metadata

    shape = model.kv_cache_shape(num_blocks, block_size)
    kv_caches = [torch.zeros(shape, dtype=dtype) for _ in range(model.num_attention_layers)]
    free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = []
    for seq in seqs:
        n = -(-len(seq) // block_size)
        tables.append(free[:n])
        free = free[n:]
    computed = [0] * len(seqs)
    for step in steps:
        reqs = [r for r, _ in step]
        nums = [n for _, n in step]
        ids = [t for r, n in step for t in seqs[r][computed[r] : computed[r] + n]]
        pos = [p for r, n in step for p in range(computed[r], computed[r] + n)]
        md = build_attention_metadata(
            [computed[r] for r in reqs],
            nums,
            [tables[r] for r in reqs],
            block_size,
            num_padded_tokens=len(ids) + pad,
        )
        input_ids = torch.tensor(ids + [0] * pad)  # [n + pad]
        positions = torch.tensor(pos + [0] * pad)  # [n + pad]
        with torch.inference_mode():
            hidden = model(input_ids, positions, kv_caches, md)  # [n + pad, hidden]
        for r, n in step:
            computed[r] += n
        yield step, hidden, len(ids), kv_caches


def run_steps(
    model: torch.nn.Module, seqs: list[list[int]], steps: list[list[tuple[int, int]]], **kw: Any
) -> list[torch.Tensor]:
    """`paged_steps` (same arguments), returning per request its logits
    `[num_computed, vocab]` (rows in position order)."""
    out: list[list[torch.Tensor]] = [[] for _ in seqs]
    for step, hidden, n, _ in paged_steps(model, seqs, steps, **kw):
        with torch.inference_mode():
            logits = model.compute_logits(hidden[:n])  # [n, vocab]
        for (r, _), chunk in zip(step, logits.split([k for _, k in step]), strict=True):
            out[r].append(chunk)
    return [torch.cat(o) for o in out]


@pytest.fixture(scope="session")
def paged_stepper() -> Callable[..., Iterator[Any]]:
    """`paged_steps` (see its docstring) as a fixture, for test modules."""
    return paged_steps


@pytest.fixture(scope="session")
def paged_runner() -> Callable[..., list[torch.Tensor]]:
    """`run_steps` (see its docstring) as a fixture, for test modules."""
    return run_steps


def greedy_decode(
    model: torch.nn.Module, prompt: list[int], max_new_tokens: int, *, block_size: int = 4
) -> list[int]:
    """Prompt + greedily generated tokens: one prefill, then one paged decode step per token."""
    from spur.kernels import build_attention_metadata

    num_blocks = -(-(len(prompt) + max_new_tokens) // block_size)
    shape = model.kv_cache_shape(num_blocks + 3, block_size)
    kv_caches = [torch.zeros(shape) for _ in range(model.num_attention_layers)]
    table = list(range(num_blocks + 3))[::-1][:num_blocks]  # non-identity block order
    seq, computed = list(prompt), 0
    for _ in range(max_new_tokens):
        new = seq[computed:]
        md = build_attention_metadata([computed], [len(new)], [table], block_size)
        with torch.inference_mode():
            hidden = model(torch.tensor(new), torch.arange(computed, len(seq)), kv_caches, md)
            seq.append(int(model.compute_logits(hidden[-1:]).argmax(-1)))
        computed += len(new)
    return seq


@pytest.fixture(scope="session")
def greedy() -> Callable[..., list[int]]:
    """`greedy_decode` (see its docstring) as a fixture."""
    return greedy_decode
