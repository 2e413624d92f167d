"""spur's models against transformers' own, on tiny random checkpoints.

Logits must match in float32 both for one full prefill and for the same
sequences fed in chunks through the paged KV cache (mixed prefill chunks and
decodes of several requests in one flattened batch, shuffled block tables).
"""

from __future__ import annotations

import pytest
import torch

from spur.actors.worker.loader import load_model

ATOL = 1e-4


def _prompt(n: int, seed: int, vocab: int = 256) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", ["llama", "llama_tied", "qwen2", "qwen2_sliding", "qwen3"])
def test_full_prefill_matches_transformers(name, tiny_model_dir, hf_logits, paged_runner):
    model = load_model(tiny_model_dir(name), dtype=torch.float32, device="cpu").model
    seq = _prompt(23, seed=1)
    (ours,) = paged_runner(model, [seq], [[(0, len(seq))]])
    torch.testing.assert_close(ours, hf_logits(name, seq), atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("name", ["llama", "llama_tied", "qwen2", "qwen2_sliding", "qwen3"])
def test_chunked_paged_batch_matches_transformers(name, tiny_model_dir, hf_logits, paged_runner):
    """Three requests: chunked prefills interleaved with decodes, plus padding rows."""
    model = load_model(tiny_model_dir(name), dtype="float32", device="cpu").model
    seqs = [_prompt(14, seed=2), _prompt(6, seed=3), _prompt(19, seed=4)]
    steps = [
        [(0, 6), (1, 5), (2, 9)],  # prefill chunks (request 1 whole prompt but one)
        [(1, 1), (0, 7), (2, 1)],  # decode, rest of a prefill, a one-token chunk
        [(2, 5), (0, 1)],
        [(0, 0), (2, 4)],  # a zero-token entry must be harmless
    ]
    outs = paged_runner(model, seqs, steps, pad=3)
    for r, seq in enumerate(seqs):
        ref = hf_logits(name, seq)[: outs[r].shape[0]]
        torch.testing.assert_close(outs[r], ref, atol=ATOL, rtol=1e-4, msg=f"request {r}")


def test_greedy_decode_matches_transformers_generate(tiny_model_dir, greedy):
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir("qwen3")
    model = load_model(path, dtype=torch.float32, device="cpu").model
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = _prompt(7, seed=5)
    expected = hf.generate(
        torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0
    )[0].tolist()

    assert greedy(model, prompt, 8) == expected


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close_to_float32(dtype, tiny_model_dir, paged_runner):
    path = tiny_model_dir("llama")
    ref_model = load_model(path, dtype=torch.float32, device="cpu").model
    model = load_model(path, dtype=dtype, device="cpu").model
    assert all(p.dtype == dtype for p in model.parameters())
    seqs = [_prompt(9, seed=6)]
    steps = [[(0, 5)], [(0, 4)]]
    (ref,) = paged_runner(ref_model, seqs, steps)
    (ours,) = paged_runner(model, seqs, steps, dtype=dtype)
    assert ours.dtype == torch.float32
    # Loose: only proves the reduced-precision path runs end to end and is sane.
    assert (ours - ref).abs().max() < 0.1 * ref.abs().max()


def test_dummy_run_without_kv_cache(tiny_model_dir):
    """kv_caches=[] and attn_metadata=None: a warm-up/profiling run touching no cache."""
    model = load_model(tiny_model_dir("llama"), dtype=torch.float32, device="cpu").model
    with torch.inference_mode():
        hidden = model(torch.zeros(5, dtype=torch.long), torch.arange(5), [], None)
    assert hidden.shape == (5, 64)
    assert model.compute_logits(hidden).shape == (5, 256)


def test_kv_cache_geometry(tiny_model_dir):
    model = load_model(tiny_model_dir("qwen3"), dtype=torch.float32, device="cpu").model
    assert model.num_attention_layers == 2
    assert model.kv_cache_shape(10, 16) == (2, 10, 16, 2, 32)


def test_rope_types_and_errors():
    from spur.actors.worker.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(16, 16, 64, {"rope_type": "default", "rope_theta": 10000.0})
    q = torch.randn(3, 2, 16)
    # Position 0 is the identity rotation; rotation preserves norms.
    q0, _ = rope(torch.zeros(3, dtype=torch.long), q, q)
    torch.testing.assert_close(q0, q)
    q5, _ = rope(torch.full((3,), 5), q, q)
    torch.testing.assert_close(q5.norm(dim=-1), q.norm(dim=-1))
    with pytest.raises(ValueError, match=r"yarn.*supported"):
        RotaryEmbedding(16, 16, 64, {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0})
