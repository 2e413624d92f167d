"""Hugging Face transformers as spur's reference: correctness oracle and static-batch baseline.

This module runs transformers' own modeling code and `generate` (never spur's
model, kernels or scheduler). It serves two purposes:

- `hf_greedy`: the token-level oracle. Greedy decoding in fp32 on the demo
  model is batch-invariant (docs/architecture.md, "Facts the code relies on"),
  so its token ids are what spur's fp32 greedy output must equal, request for
  request.
- `hf_static_batches`: the "before continuous batching" baseline. Requests go
  in arrival order into fixed batches (16 by default), left-padded to the
  batch's longest prompt; each batch decodes until its longest request is done,
  so short requests hold their row (compute and KV) until the batch ends:

      batch of 4, P = prompt, D = decode step that counts, x = wasted step
      row 0  ..PPPPPPDDDDDDDDDDDD        <- the longest output sets the steps
      row 1  PPPPPPPPDDDDxxxxxxxx
      row 2  ....PPPPDDxxxxxxxxxx        (. = left padding, also held in KV)
      row 3  ......PPDDDDDDxxxxxx

Both follow vLLM's `ignore_eos` meaning when they do not stop at EOS: EOS may be
generated and decoding goes on (it is not suppressed, unlike `min_tokens`).

Loaded models are cached per (folder, dtype) for the process; `clear_cache()`
drops them. Functions set no global torch state (thread count, seeds).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import resource
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

_MODELS: dict[tuple[str, torch.dtype], Any] = {}


def _as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[dtype.lower()]
    except KeyError:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(_DTYPES)}") from None


def load_model(model_dir: str | os.PathLike[str], dtype: torch.dtype | str = torch.float32) -> Any:
    """The transformers causal LM in `model_dir` (a HF folder), eval mode, cached per process.

    A `...ForConditionalGeneration` checkpoint (multimodal, served text-only by spur)
    loads as that class, not as AutoModelForCausalLM's text model: only the former
    reads the checkpoint as written (e.g. Qwen3.5's top-level tie_word_embeddings,
    which the text model ignores, leaving a random LM head).

    The same object is returned for the same (resolved folder, dtype); callers must
    not mutate it. Raises whatever `from_pretrained` raises for a bad folder.
    """
    dt = _as_dtype(dtype)
    key = (str(Path(model_dir).resolve()), dt)
    model = _MODELS.get(key)
    if model is None:
        t0 = time.perf_counter()
        # transformers 5 spells the old `torch_dtype=` argument `dtype=`.
        model = _model_class(Path(key[0])).from_pretrained(key[0], dtype=dt).eval()
        logger.info("loaded %s (%s) in %.2f s", key[0], dt, time.perf_counter() - t0)
        _MODELS[key] = model
    return model


def _model_class(model_dir: Path) -> Any:
    """The transformers class that loads `model_dir`: its config.json's architecture
    when that is a `...ForConditionalGeneration` class transformers has, else
    AutoModelForCausalLM."""
    import transformers

    try:
        archs = json.loads((model_dir / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        archs = []  # from_pretrained reports the folder's problem
    arch = archs[0] if archs else ""
    if arch.endswith("ForConditionalGeneration") and hasattr(transformers, arch):
        return getattr(transformers, arch)
    return transformers.AutoModelForCausalLM


def _text_config(model: Any) -> Any:
    """The model's (decoder) text config: the config itself for a causal LM, its
    text_config for a multimodal model."""
    return model.config.get_text_config(decoder=True)


def clear_cache() -> None:
    """Drop every cached model (frees its memory once no caller holds it)."""
    _MODELS.clear()
    gc.collect()


def torch_num_threads() -> int:
    """torch's intra-op thread count in this process (reported by benchmarks)."""
    return torch.get_num_threads()


def _eos_ids(model: Any) -> set[int]:
    eos = model.generation_config.eos_token_id
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        eos = getattr(_text_config(model), "eos_token_id", None)
    if eos is None:
        return set()
    return {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}


def _pad_id(model: Any) -> int:
    text = _text_config(model)
    for value in (
        model.generation_config.pad_token_id,
        getattr(model.config, "pad_token_id", None),
        getattr(text, "pad_token_id", None),
    ):
        if isinstance(value, int):
            return value
    return min(_eos_ids(model), default=0)


def _check(prompts: Sequence[Sequence[int]], max_new: Sequence[int]) -> None:
    if len(max_new) != len(prompts):
        raise ValueError(
            f"{len(max_new)} max_new_tokens values for {len(prompts)} prompts: give one "
            "per prompt or a single int"
        )
    for i, (p, n) in enumerate(zip(prompts, max_new, strict=True)):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        if n < 0:
            raise ValueError(f"max_new_tokens[{i}] is {n}: it must be >= 0")


def _generate_batch(
    model: Any, prompts: Sequence[Sequence[int]], steps: int, *, stop_at_eos: bool
) -> list[list[int]]:
    """Greedy `generate` on one left-padded batch; returns `steps` new ids per row.

    Rows that stop at EOS early are filled by transformers with the pad id after
    it (the caller truncates). The attention mask is always explicit: without
    it, transformers infers one from the pad id and would mask real prompt
    tokens equal to it (SmolLM2's pad id is its EOS id, which chat prompts hold).
    """
    pad = _pad_id(model)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)  # [B, width]
    mask = torch.zeros((len(prompts), width), dtype=torch.long)  # [B, width]
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(list(p), dtype=torch.long)
        mask[row, width - len(p) :] = 1
    eos = sorted(_eos_ids(model)) if stop_at_eos else None
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=steps,
            do_sample=False,
            eos_token_id=eos,  # None: never stop early (EOS is not suppressed)
            pad_token_id=pad,
        )  # [B, width + <= steps]
    return out[:, width:].tolist()


def _truncate(tokens: list[int], limit: int, eos: set[int] | None) -> list[int]:
    tokens = tokens[:limit]
    if eos:
        for i, t in enumerate(tokens):
            if t in eos:
                return tokens[: i + 1]
    return tokens


def hf_greedy(
    model_dir: str | os.PathLike[str],
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int | Sequence[int],
    *,
    dtype: torch.dtype | str = torch.float32,
    batch_size: int | None = None,
    stop_at_eos: bool = True,
) -> list[list[int]]:
    """Greedy generated token ids of each prompt, by transformers' `generate`.

    Args:
        model_dir: a Hugging Face folder (config.json + safetensors).
        prompts: token ids per prompt (each non-empty).
        max_new_tokens: one limit for all, or one per prompt (>= 0).
        dtype: model dtype (torch dtype or "float32" / "bfloat16" / "float16").
        batch_size: prompts per `generate` call, in input order (None: all in
            one). Batches are left-padded with an explicit attention mask.
        stop_at_eos: True: a row ends after its first EOS (the EOS id is kept,
            as vLLM keeps it in `token_ids`). False: exactly `max_new_tokens`
            ids per prompt, EOS included wherever greedy picks it (ignore_eos).

    Returns:
        `out[i]`: the new ids of prompt i (prompt not included), in input order;
        `len(out[i]) == max_new_tokens[i]` unless it ended at EOS.

    Batch-invariant in fp32 on the demo model (tested); not in bf16.
    """
    n = len(prompts)
    limits = [max_new_tokens] * n if isinstance(max_new_tokens, int) else list(max_new_tokens)
    _check(prompts, limits)
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size is {batch_size}: it must be >= 1 or None")
    model = load_model(model_dir, dtype)
    eos = _eos_ids(model) if stop_at_eos else None
    size = batch_size or max(n, 1)
    results: list[list[int]] = []
    for start in range(0, n, size):
        batch = prompts[start : start + size]
        lims = limits[start : start + size]
        steps = max(lims)
        if steps == 0:
            results.extend([] for _ in batch)
            continue
        rows = _generate_batch(model, batch, steps, stop_at_eos=stop_at_eos)
        results.extend(_truncate(r, lim, eos) for r, lim in zip(rows, lims, strict=True))
    return results


def current_rss_bytes() -> int:
    """Resident set size of this process now (Linux /proc; ru_maxrss elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return max_rss_bytes()


def max_rss_bytes() -> int:
    """Peak resident set size of this process's whole life (getrusage ru_maxrss)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if os.uname().sysname == "Darwin" else rss * 1024  # macOS: bytes; Linux: KiB


class PeakRss:
    """Context manager: the peak RSS growth over the block, sampled every `interval_s`.

    A daemon thread reads /proc every `interval_s` (default 20 ms; cheap, and
    torch ops release the GIL). After the block, `start_bytes`, `peak_bytes` and
    `delta_bytes` (peak - start, >= 0) are set; `samples` counts the reads the
    thread has taken. A peak shorter than one interval can be missed.
    """

    def __init__(self, interval_s: float = 0.02) -> None:
        self.interval_s = interval_s
        self.start_bytes = 0
        self.peak_bytes = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def delta_bytes(self) -> int:
        return max(0, self.peak_bytes - self.start_bytes)

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak_bytes = max(self.peak_bytes, current_rss_bytes())
            self.samples += 1

    def __enter__(self) -> PeakRss:
        gc.collect()
        self.start_bytes = self.peak_bytes = current_rss_bytes()
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, name="peak-rss", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak_bytes = max(self.peak_bytes, current_rss_bytes())


def kv_bytes_per_token(model: Any) -> int:
    """Bytes of K and V for one token over all attention layers, in the model's dtype
    (hybrid models: their full-attention layers only)."""
    cfg = _text_config(model)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    itemsize = next(model.parameters()).element_size()
    types = getattr(cfg, "layer_types", None)
    layers = types.count("full_attention") if types else cfg.num_hidden_layers
    return 2 * layers * kv_heads * head_dim * itemsize


def state_bytes_per_sequence(model: Any) -> int:
    """Bytes of the fixed-size states transformers keeps per sequence (Gated DeltaNet
    layers: conv state [conv_dim, K] in the model's dtype, recurrent state [Hv, dk,
    dv] in float32 as its delta rule returns it); 0 for attention-only models."""
    cfg = _text_config(model)
    types = getattr(cfg, "layer_types", None) or []
    num = types.count("linear_attention")
    if not num:
        return 0
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    conv = (2 * hk * dk + hv * dv) * cfg.linear_conv_kernel_dim
    itemsize = next(model.parameters()).element_size()
    return num * (conv * itemsize + hv * dk * dv * 4)


def hf_static_batches(
    model_dir: str | os.PathLike[str],
    prompts: Sequence[Sequence[int]],
    max_new_tokens: Sequence[int],
    *,
    batch_size: int = 16,
    dtype: torch.dtype | str = torch.float32,
    warmup: bool = True,
) -> dict[str, Any]:
    """Static batching baseline: `generate` on fixed batches in arrival order, ignore_eos.

    Batch b holds prompts `[b * batch_size, (b + 1) * batch_size)`, left-padded
    to its longest prompt, and decodes `max(max_new_tokens of its rows)` steps
    without stopping at EOS; request i's first `max_new_tokens[i]` ids are its
    useful output, the rest of its row is waste. The model load (cached) and a
    tiny warm-up `generate` are outside the timed region.

    Returns a dict (JSON-ready except "token_ids"):
        token_ids: list[list[int]], request i's useful ids (len max_new_tokens[i]);
        useful_tokens: sum(max_new_tokens); decoded_row_tokens: rows x steps summed
            over batches (the work done, waste included);
        elapsed_s, tokens_per_s (useful / elapsed), num_batches, batch_size, dtype;
        kv_slots_allocated_peak / kv_tokens_held_peak: at the end of the batch with
            the most slots, rows x (padded prompt + steps) vs sum(prompt_i + new_i);
        kv_utilization: sum over batches of tokens held / slots allocated, at
            each batch's end (what DynamicCache holds then);
        kv_bytes_per_token, kv_bytes_peak: the KV cache size those slots take (plus
            the rows' fixed states for hybrid models, `state_bytes_per_sequence`),
            and per row of that batch (`kv_bytes_per_request_at_peak`);
        peak_rss_delta_bytes: sampled RSS growth during the timed region;
        torch_num_threads.
    """
    limits = list(max_new_tokens)
    _check(prompts, limits)
    if batch_size < 1:
        raise ValueError(f"batch_size is {batch_size}: it must be >= 1")
    model = load_model(model_dir, dtype)
    if warmup and prompts:
        _generate_batch(model, [list(prompts[0][:8])], 2, stop_at_eos=False)
    token_ids: list[list[int]] = []
    decoded = slots_total = held_total = 0
    slots_peak = held_at_peak = rows_at_peak = 0
    batches = 0
    with PeakRss() as rss:
        t0 = time.perf_counter()
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start : start + batch_size]
            lims = limits[start : start + batch_size]
            steps = max(lims)
            batches += 1
            if steps == 0:
                token_ids.extend([] for _ in batch)
                continue
            rows = _generate_batch(model, batch, steps, stop_at_eos=False)
            token_ids.extend(r[:lim] for r, lim in zip(rows, lims, strict=True))
            decoded += len(batch) * steps
            slots = len(batch) * (max(len(p) for p in batch) + steps)
            held = sum(len(p) + lim for p, lim in zip(batch, lims, strict=True))
            slots_total += slots
            held_total += held
            if slots > slots_peak:
                slots_peak, held_at_peak, rows_at_peak = slots, held, len(batch)
        elapsed = time.perf_counter() - t0
    useful = sum(len(t) for t in token_ids)
    assert useful == sum(limits), (useful, sum(limits))
    per_token = kv_bytes_per_token(model)
    per_seq = state_bytes_per_sequence(model)
    kv_bytes_peak = slots_peak * per_token + rows_at_peak * per_seq
    return {
        "token_ids": token_ids,
        "useful_tokens": useful,
        "decoded_row_tokens": decoded,
        "elapsed_s": round(elapsed, 3),
        "tokens_per_s": round(useful / elapsed, 2) if elapsed > 0 else None,
        "num_batches": batches,
        "batch_size": batch_size,
        "dtype": str(_as_dtype(dtype)).removeprefix("torch."),
        "kv_slots_allocated_peak": slots_peak,
        "kv_tokens_held_peak": held_at_peak,
        "kv_utilization": round(held_total / slots_total, 4) if slots_total else None,
        "kv_bytes_per_token": per_token,
        "state_bytes_per_sequence": per_seq,
        "kv_bytes_peak": kv_bytes_peak,
        "kv_bytes_per_request_at_peak": kv_bytes_peak // rows_at_peak if rows_at_peak else None,
        "peak_rss_delta_bytes": rss.delta_bytes,
        "torch_num_threads": torch.get_num_threads(),
    }
