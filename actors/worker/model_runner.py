"""The model runner: SchedulerOutput -> flat inputs -> forward -> sample -> ModelRunnerOutput.

One per worker (per tensor-parallel rank). It owns the paged KV cache tensors
(one per attention layer) and the sampler's per-request state. Every rank runs
the same forward and the same (seeded) sampling, so every rank returns the same
tokens; the executor reads rank 0's.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from spur.actors.step import Logprobs, ModelRunnerOutput, SchedulerOutput
from spur.actors.worker.cache_layout import (
    CacheLayout,
    HybridMetadata,
    attention_metadata_for,
    is_hybrid,
)
from spur.actors.worker.graph_runner import DecodeGraphs, build_decode_graphs
from spur.actors.worker.input_batch import RequestStates
from spur.actors.worker.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    unpacked_linears,
)
from spur.actors.worker.sampler import Sampler
from spur.actors.worker.sampling_metadata import SamplerState
from spur.kernels import AttentionMetadata, native

logger = logging.getLogger(__name__)

KV_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp8": torch.uint8,  # e4m3 bits, written and read through a view (CPU lacks fp8 ops)
}


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """Storage dtype of the KV cache: "auto" follows the model."""
    if name == "auto":
        return model_dtype
    try:
        return KV_DTYPES[name]
    except KeyError:
        raise ValueError(
            f"kv_cache_dtype {name!r} is unknown: use auto, {', '.join(KV_DTYPES)}"
        ) from None


@dataclass
class StepTimes:
    """Seconds spent per phase, summed over steps (for the engine profile)."""

    prepare: float = 0.0
    forward: float = 0.0
    logits: float = 0.0
    sample: float = 0.0
    steps: int = 0
    extra: dict[str, float] = field(default_factory=dict)
    # (tokens in the step, rows sent to the LM head) -> number of such steps. Bounded
    # by the token budget times max_num_seqs; in practice a few hundred keys.
    shapes: Counter[tuple[int, int]] = field(default_factory=Counter)


class ModelRunner:
    """Runs one rank's share of the model on a paged KV cache. Not thread-safe."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        block_size: int,
        max_num_batched_tokens: int,
        device: torch.device,
        kv_dtype: torch.dtype,
        vocab_size: int,
        seed: int = 0,
        state_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.kv_dtype = kv_dtype
        # Hybrid models (attention + recurrent-state layers) share one pool laid
        # out by CacheLayout; plain attention models keep one tensor per layer.
        self.layout: CacheLayout | None = (
            CacheLayout.for_model(model, block_size, kv_dtype, state_dtype)
            if is_hybrid(model)
            else None
        )
        self.requests = RequestStates(block_size, max_num_batched_tokens)
        self.sampler = Sampler()
        self.sampler_state = SamplerState(vocab_size, device=device, seed=seed)
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0
        self.times = StepTimes()
        self.graphs: DecodeGraphs | None = None  # decode CUDA graphs, once captured

    # -- KV cache ---------------------------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        """Bytes one block takes across all this rank's attention layers (hybrid
        models: one page per layer of a group, pages padded to the largest kind)."""
        if self.layout is not None:
            return self.layout.block_bytes
        shape = self.model.kv_cache_shape(1, self.block_size)
        per_layer = 1
        for d in shape:
            per_layer *= d
        return (
            per_layer
            * self.model.num_attention_layers
            * torch.empty((), dtype=self.kv_dtype).element_size()
        )

    def initialize_cache(self, num_blocks: int) -> None:
        """Allocate every layer's cache: [2, num_blocks, block_size, kv_heads, head_dim]
        (hybrid models: the views of `CacheLayout.allocate`)."""
        if self.layout is not None:
            self.kv_caches = self.layout.allocate(num_blocks, self.device)
            self.num_blocks = num_blocks
            logger.info(
                "KV + state pool: %d blocks x %d tokens, %d groups of %d layers, %.1f MiB; "
                "pages: %s",
                num_blocks,
                self.block_size,
                len(self.layout.groups),
                self.layout.group_size,
                num_blocks * self.layout.block_bytes / 2**20,
                self.layout.padding_report(),
            )
            return
        shape = self.model.kv_cache_shape(num_blocks, self.block_size)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
            for _ in range(self.model.num_attention_layers)
        ]
        self.num_blocks = num_blocks
        logger.info(
            "KV cache: %d blocks x %d tokens, %d layers, %.1f MiB",
            num_blocks,
            self.block_size,
            len(self.kv_caches),
            num_blocks * self.kv_bytes_per_block() / 2**20,
        )

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: copy block src to dst in every layer (before the forward)."""
        if not copies:
            return
        if self.layout is not None:
            self.layout.copy_blocks([s for s, _ in copies], [d for _, d in copies])
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for cache in self.kv_caches:
            cache[:, dst] = cache[:, src]

    # -- the step ---------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        added = self.requests.update(out)
        state = self.sampler_state
        for rid in out.finished_req_ids:
            state.remove(rid)
        for rid in added:
            if rid not in state:  # a preempted request keeps its sampler state
                req = self.requests.states[rid]
                state.add_request(
                    rid,
                    req.sampling_params,
                    req.token_ids[: req.num_prompt_tokens],
                    req.eos_token_id,
                    output_token_ids=req.token_ids[req.num_prompt_tokens :],
                    resumed=req.num_resumed,
                )
        self.copy_blocks(out.blocks_to_copy)
        if out.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(sampled_token_ids={})

        inputs = self.requests.prepare(out)
        dev = self.device
        n = inputs.num_tokens
        graph_size = self.graphs.size_for(inputs) if self.graphs is not None else None
        if self.graphs is not None and graph_size is not None:  # decode step: padded replay
            self.graphs.load(inputs, graph_size)
            t1 = time.perf_counter()
            hidden = self.graphs.replay(graph_size)  # [graph_size, hidden]; rows >= n: padding
        else:
            input_ids, positions, step_meta = self._step_tensors(out, inputs)
            t1 = time.perf_counter()
            hidden = self.model(input_ids, positions, self.kv_caches, step_meta)  # [n, hidden]
        t2 = time.perf_counter()
        sampled: dict[str, list[int]] = {rid: [] for rid in inputs.req_ids}
        logprobs_out: dict[str, list[Logprobs]] | None = None
        if inputs.sampling_req_ids:
            idx = torch.from_numpy(inputs.logits_indices).to(dev)
            meta_s = None if inputs.drafts else state.build(inputs.sampling_req_ids)
            greedy = None
            if meta_s is not None and not meta_s.needs_processing and meta_s.logprobs is None:
                # a plain argmax of the raw logits: the LM head picks without writing them
                greedy = self.model.greedy_ids(hidden[idx])  # [num_sampling] int64 | None
            if greedy is not None:
                t3 = time.perf_counter()
                tokens = greedy.tolist()
                state.append_sampled(inputs.sampling_req_ids, tokens)
                per_req = [[t] for t in tokens]
                row_lps = [None] * len(tokens)
            else:
                logits = self.model.compute_logits(hidden[idx])  # [num_sampling, vocab] fp32
                t3 = time.perf_counter()
                if meta_s is None:
                    per_req, row_lps = self._verify(logits, inputs.sampling_req_ids, inputs.drafts)
                else:
                    result = self.sampler(logits, meta_s)
                    tokens = result.sampled_token_ids.tolist()
                    state.append_sampled(inputs.sampling_req_ids, tokens)
                    per_req = [[t] for t in tokens]
                    row_lps = result.logprobs
            for rid, toks, lp in zip(inputs.sampling_req_ids, per_req, row_lps, strict=True):
                sampled[rid] = toks
                if lp is not None:
                    if logprobs_out is None:
                        logprobs_out = {}
                    logprobs_out[rid] = [Logprobs(lp.logprob, list(lp.top), lp.rank)]
            t4 = time.perf_counter()
        else:
            t3 = t4 = t2
        times = self.times
        times.prepare += t1 - t0
        times.forward += t2 - t1
        times.logits += t3 - t2
        times.sample += t4 - t3
        times.steps += 1
        times.shapes[(n, len(inputs.sampling_req_ids))] += 1
        return ModelRunnerOutput(sampled_token_ids=sampled, logprobs=logprobs_out)

    def _step_tensors(
        self, out: SchedulerOutput, inputs: Any
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata | HybridMetadata]:
        """An eager step's device inputs: input_ids [n], positions [n], and its metadata."""
        dev = self.device
        qsl_cpu = torch.from_numpy(inputs.query_start_loc)
        seq_cpu = torch.from_numpy(inputs.seq_lens)
        meta = AttentionMetadata(
            num_reqs=len(inputs.req_ids),
            num_actual_tokens=inputs.num_tokens,
            max_query_len=inputs.max_query_len,
            max_seq_len=inputs.max_seq_len,
            query_start_loc=qsl_cpu.to(dev),
            seq_lens=seq_cpu.to(dev),
            block_tables=torch.from_numpy(inputs.block_table).to(dev),
            slot_mapping=torch.from_numpy(inputs.slot_mapping).to(dev),
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_cpu,
        )
        step_meta: AttentionMetadata | HybridMetadata = meta
        if self.layout is not None:
            step_meta = self._hybrid_metadata(out, inputs, meta)
        input_ids = torch.from_numpy(inputs.input_ids).to(dev)
        positions = torch.from_numpy(inputs.positions).to(dev)
        return input_ids, positions, step_meta

    # -- CUDA graphs (graph_runner.py) ---------------------------------------------------
    def capture_decode_graphs(
        self,
        max_model_len: int,
        max_num_seqs: int,
        sizes: list[int] | None = None,
        *,
        capture: bool | None = None,
    ) -> dict[str, Any]:
        """Set up decode steps through padded persistent buffers, captured as CUDA graphs
        on CUDA (after `initialize_cache`). Returns the report of
        `graph_runner.build_decode_graphs` (capture=False: emulated, for tests)."""
        self.graphs, report = build_decode_graphs(
            self.model,
            self.kv_caches,
            self.device,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            block_size=self.block_size,
            sizes=sizes,
            capture=capture,
            hybrid=self.layout is not None,
        )
        return report

    def _verify(
        self, logits: torch.Tensor, req_ids: list[str], drafts: dict[str, list[int]]
    ) -> tuple[list[list[int]], list[Any]]:
        """Sample a step that verifies drafts. `logits` [rows, vocab]: each request
        of `req_ids` owns 1 + len(its drafts) consecutive rows. Returns per request
        its new tokens and the logprobs of its single row (drafting requests none)."""
        per_req_drafts = [drafts.get(rid, []) for rid in req_ids]
        rows = [
            rid for rid, d in zip(req_ids, per_req_drafts, strict=True) for _ in range(1 + len(d))
        ]
        state = self.sampler_state
        tokens, lps = self.sampler.verify(logits, state.build(rows), per_req_drafts)
        for rid, toks in zip(req_ids, tokens, strict=True):
            state.append_tokens(rid, toks)
        return tokens, lps

    def _hybrid_metadata(
        self, out: SchedulerOutput, inputs: Any, base: AttentionMetadata
    ) -> HybridMetadata:
        """Every group's metadata for this step (attention: block tables and slots
        of that group; state: where each request's state is read and written)."""
        layout = self.layout
        assert layout is not None
        states = self.requests.states
        reqs = [states[rid] for rid in inputs.req_ids]
        computed = [r.num_computed_tokens for r in reqs]
        scheduled = [out.num_scheduled_tokens[rid] for rid in inputs.req_ids]
        groups: list[Any] = []
        for g, group in enumerate(layout.groups):
            tables = [r.group_block_ids[g] if r.group_block_ids else r.block_ids for r in reqs]
            if group.spec.kind == "state":
                groups.append(
                    layout.state_metadata(
                        tables, computed, scheduled, base.query_start_loc_cpu, self.device
                    )
                )
            elif g == 0:
                groups.append(base)
            else:
                groups.append(
                    attention_metadata_for(
                        base, tables, inputs.positions, self.block_size, self.device
                    )
                )
        return HybridMetadata(groups, layout.layer_group)

    # -- profiling ----------------------------------------------------------------------
    @torch.inference_mode()
    def time_matmuls(
        self, shapes: list[tuple[int, int, int]], repeats: int = 3, *, torch_path: bool = False
    ) -> float:
        """Seconds this rank's linear layers and LM head take for a run of steps.

        `shapes`: (tokens in the step, rows sent to the LM head, number of such
        steps), as counted in `times.shapes`. Each shape runs `repeats` times on
        random inputs through the decoder's column- and row-parallel layers (all of
        them, on every token) and `compute_logits`; its fastest time is weighted by
        its count (one slow sample of a shape that makes 200 steps would otherwise
        count 200 times, and a floor is what the matmuls take at best). Attention, norms,
        RoPE, activations, sampling and bookkeeping are left out: this is what a
        step would cost if only its matmuls were left, a floor for this machine.
        Under tensor parallelism every rank must be called together (the row-parallel
        layers all-reduce, which counts as part of the floor). `torch_path`: the
        layers compute with torch's `F.linear` only (`native.torch_linears`), as
        transformers does, instead of the native linears serving decode's row counts.
        """
        linears = [
            m
            for m in self.model.model.modules()
            if isinstance(m, ColumnParallelLinear | RowParallelLinear)
        ]
        hidden = self.model.config.hidden_size
        tp = getattr(self.model, "tp", None)
        dtype = next(self.model.parameters()).dtype
        dev = self.device

        def one(tokens: int, logits: int) -> float:
            inputs = {
                w: torch.randn(tokens, w, dtype=dtype, device=dev)
                for w in {m.weight.shape[1] for m in linears}
            }
            h = torch.randn(logits, hidden, dtype=dtype, device=dev)
            _sync(dev)
            if tp is not None and tp.size > 1:  # start together: no rank times a wait
                tp.all_reduce(torch.zeros(1, device=dev))
            t0 = time.perf_counter()
            for m in linears:
                m(inputs[m.weight.shape[1]])
            if logits:
                self.model.compute_logits(h)
            _sync(dev)
            return time.perf_counter() - t0

        path = contextlib.ExitStack()
        if torch_path:  # transformers' path: F.linear on [N, K] weights
            path.enter_context(unpacked_linears(self.model))
            path.enter_context(native.torch_linears())
        with path:
            one(8, 8)  # warm-up: first calls pay one-time costs
            return sum(
                count * min(one(tokens, logits) for _ in range(max(1, repeats)))
                for tokens, logits, count in shapes
            )

    def memory_read_rate(self, buffer_bytes: int = 1 << 30, repeats: int = 3) -> float:
        """Bytes per second this rank's device streams from its memory: the fastest of
        `repeats` sums over a float32 buffer of `buffer_bytes` (1 GiB by default: more
        than the last-level cache of the CPUs measured here, e.g. 480 MiB of L3, so the
        sum reads DRAM; on CUDA, HBM). The floor of memory-bound work: decode attention
        must read every K/V row of its context once per step, at best at this rate.
        The buffer is freed before returning.
        """
        buf = torch.ones(buffer_bytes // 4, dtype=torch.float32, device=self.device)
        buf.sum()  # first touch: page faults are not reads
        _sync(self.device)
        best = float("inf")
        for _ in range(max(1, repeats)):
            t0 = time.perf_counter()
            buf.sum()
            _sync(self.device)
            best = min(best, time.perf_counter() - t0)
        del buf
        return buffer_bytes / best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
