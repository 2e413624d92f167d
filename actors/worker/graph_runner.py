"""Decode steps through persistent, padded buffers, replayed as CUDA graphs.

The torch side of `cuda_graphs` (which holds the plan: sizes, padding). One
`DecodeGraphs` per model runner owns:

```
host   pinned CPU tensors [max_size] (block table [max_size, max_blocks]); numpy views: HostBuffers
device the same buffers on the GPU (on CPU: the host tensors themselves)
graphs size -> (CUDAGraph, static output [size, hidden])   captured largest first, one memory pool
```

A step: `load` fills `host[:size]` (`cuda_graphs.fill_padded`) and copies it to
`device[:size]`; `replay` replays the graph of that size and returns its static
output (rows past the step's requests are padding). The output is a view of
graph memory that the next replay of any size may overwrite: use it (logits)
before the next step.

With `capture=False` (a CPU device: tests and dry runs) the same buffers and
padding feed an eager forward instead of a replay, so everything except the
capture itself runs, and its tokens can be compared with the ordinary eager path.

Capture needs a forward that never syncs with the host: the Triton attention
backend on CUDA, a model without recurrent-state layers, one tensor-parallel
rank. `build_decode_graphs` checks those and says why it runs eagerly otherwise.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from spur.actors.worker.cuda_graphs import GraphPlan, HostBuffers, fill_padded, fill_padding
from spur.actors.worker.input_batch import StepInputs
from spur.actors.worker.layers.attention import PagedAttention
from spur.kernels import AttentionMetadata

logger = logging.getLogger(__name__)

_BUFFERS: dict[str, torch.dtype] = {
    "input_ids": torch.int64,
    "positions": torch.int64,
    "slot_mapping": torch.int64,
    "query_start_loc": torch.int32,
    "seq_lens": torch.int32,
    "block_table": torch.int32,
}


class DecodeGraphs:
    """Persistent decode inputs and, with `capture()`, one CUDA graph per plan size.

    Args:
        model: the runner's model (forward contract of models/llama.py).
        kv_caches: the runner's per-layer caches (already allocated; captured by
            reference, so they must not be reallocated afterwards).
        plan: sizes and block-table width.
        device: the model's device.
        max_model_len: the longest context a request may have; graphs are
            captured with it as `max_seq_len`, so the decode kernel's split count
            (chosen on the host at capture time) suits any step.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        plan: GraphPlan,
        device: torch.device,
        *,
        max_model_len: int,
    ) -> None:
        if not plan.sizes:
            raise ValueError("the graph plan has no sizes: nothing to capture")
        self.model = model
        self.kv_caches = kv_caches
        self.plan = plan
        self.device = device
        self.max_model_len = max_model_len
        m, w = plan.max_size, plan.max_blocks_per_req
        shapes: dict[str, tuple[int, ...]] = {name: (m,) for name in _BUFFERS}
        shapes["query_start_loc"] = (m + 1,)
        shapes["block_table"] = (m, w)
        pin = device.type == "cuda"
        self._host = {
            name: torch.zeros(shapes[name], dtype=dt, pin_memory=pin)
            for name, dt in _BUFFERS.items()
        }
        self.host = HostBuffers(**{name: t.numpy() for name, t in self._host.items()})
        self._dev = (
            self._host
            if device.type == "cpu"
            else {name: t.to(device) for name, t in self._host.items()}
        )
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._copied: Any = None  # a CUDA event after the last load's copies
        self._width = 1  # block-table columns of the loaded step
        self._max_seq_len = 1
        # Decode steps served through the buffers (replayed or emulated), per size.
        self.steps_by_size: Counter[int] = Counter()

    def size_for(self, inputs: StepInputs) -> int | None:
        """See `GraphPlan.size_for`."""
        return self.plan.size_for(inputs)

    # -- a step ---------------------------------------------------------------------------
    def load(self, inputs: StepInputs, size: int) -> None:
        """Write a decode step (padded to `size`) into the host and device buffers.

        The host-to-device copies are asynchronous (pinned memory): the host buffers
        must not be rewritten before they are done. A step that samples reads its
        tokens on the host, which waits for them, but one that samples nothing (every
        request a non-final one-token chunk) does not: the next load waits for the
        event recorded after the copies."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        width = fill_padded(self.host, inputs, size)
        self._width = width
        self._max_seq_len = inputs.max_seq_len
        if self._dev is self._host:
            return
        h, d = self._host, self._dev
        for name in ("input_ids", "positions", "slot_mapping", "seq_lens"):
            d[name][:size].copy_(h[name][:size], non_blocking=True)
        d["block_table"][:size, :width].copy_(h["block_table"][:size, :width], non_blocking=True)
        # query_start_loc is arange(size + 1) in every padded step: written at capture.
        if not self.graphs:
            d["query_start_loc"][: size + 1].copy_(h["query_start_loc"][: size + 1])
        self._copied = torch.cuda.Event()
        self._copied.record()

    def replay(self, size: int) -> torch.Tensor:
        """The hidden states `[size, hidden]` of the loaded step: the graph's replay,
        or (nothing captured) an eager forward over the same padded buffers."""
        self.steps_by_size[size] += 1
        graph = self.graphs.get(size)
        if graph is not None:
            graph[0].replay()
            return graph[1]
        meta = self._metadata(size, self._width, max(self._max_seq_len, 1))
        d = self._dev
        return self.model(d["input_ids"][:size], d["positions"][:size], self.kv_caches, meta)

    def _metadata(self, size: int, width: int, max_seq_len: int) -> AttentionMetadata:
        """A fresh metadata over the buffers' first `size` rows (fresh: `memo` is per step)."""
        d, h = self._dev, self._host
        return AttentionMetadata(
            num_reqs=size,
            num_actual_tokens=size,
            max_query_len=1,
            max_seq_len=max_seq_len,
            query_start_loc=d["query_start_loc"][: size + 1],
            seq_lens=d["seq_lens"][:size],
            block_tables=d["block_table"][:size, :width],
            slot_mapping=d["slot_mapping"][:size],
            query_start_loc_cpu=h["query_start_loc"][: size + 1],
            seq_lens_cpu=h["seq_lens"][:size],
        )

    # -- capture --------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self, warmup: int = 2) -> float:
        """Capture one graph per size, largest first, into one memory pool; returns
        the seconds it took. CUDA only. Each size first runs `warmup` eager forwards
        on the padding-only batch (Triton compiles, cuBLAS picks its kernels), which
        store nothing (slots -1) and read only the null block. Raises whatever the
        capture raises (a host sync in the forward, for example)."""
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the model runs on {self.device}")
        start = time.perf_counter()
        w = self.plan.max_blocks_per_req
        pool = torch.cuda.graph_pool_handle()
        d = self._dev
        for size in reversed(self.plan.sizes):
            fill_padding(self.host, 0, size, w)
            for name, t in self._host.items():
                d[name].copy_(t)
            meta = self._metadata(size, w, self.max_model_len)
            ids, pos = d["input_ids"][:size], d["positions"][:size]
            for _ in range(warmup):
                self.model(ids, pos, self.kv_caches, meta)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model(ids, pos, self.kv_caches, meta)
            self.graphs[size] = (graph, out)
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - start


def build_decode_graphs(
    model: torch.nn.Module,
    kv_caches: list[torch.Tensor],
    device: torch.device,
    *,
    max_model_len: int,
    max_num_seqs: int,
    block_size: int,
    sizes: Sequence[int] | None = None,
    capture: bool | None = None,
    hybrid: bool = False,
) -> tuple[DecodeGraphs | None, dict[str, Any]]:
    """Decode graphs for a runner, or None (eager decodes) with the reason.

    `capture` None: capture on CUDA, and on CPU return None ("ignored on CPU",
    logged). `capture=False`: the padded-buffer path without capture (any device;
    tests and dry runs compare it with the eager path). `capture=True` on a
    device that cannot: None with the reason. A capture that raises is logged as
    a warning and the runner stays eager. Returns `(graphs, report)`; report has
    `enabled`, `captured` (sizes), `capture_s` and `reason`.
    """
    report: dict[str, Any] = {"enabled": False, "captured": [], "capture_s": 0.0, "reason": ""}
    wanted = device.type == "cuda" if capture is None else capture
    reasons = []
    if hybrid:
        reasons.append("the model has recurrent-state layers (their metadata is built per step)")
    tp = getattr(model, "tp", None)
    if tp is not None and getattr(tp, "size", 1) > 1:
        reasons.append("tensor parallelism > 1 (not tried yet)")
    if wanted and device.type != "cuda":
        reasons.append(f"CUDA graphs need a CUDA device, not {device.type}")
    if wanted and not _all_triton(model):
        reasons.append("the attention backend is not triton (the torch reference syncs)")
    if capture is None and device.type != "cuda":
        reasons = [f"ignored on {device.type}"]
    plan = GraphPlan.build(max_num_seqs, max_model_len, block_size, sizes)
    if not plan.sizes:
        reasons.append(f"no batch size to capture (sizes {sizes}, max_num_seqs {max_num_seqs})")
    if reasons:
        report["reason"] = "; ".join(reasons)
        logger.info("CUDA graphs off: %s", report["reason"])
        return None, report
    graphs = DecodeGraphs(model, kv_caches, plan, device, max_model_len=max_model_len)
    if wanted:
        try:
            report["capture_s"] = round(graphs.capture(), 3)
        except Exception as exc:  # any capture failure leaves a working eager runner
            report["reason"] = f"capture failed: {type(exc).__name__}: {exc}"
            logger.warning("CUDA graphs off, %s", report["reason"])
            return None, report
        report["captured"] = list(plan.sizes)
        logger.info(
            "CUDA graphs: captured %d decode sizes (%s) in %.1f s",
            len(plan.sizes),
            ",".join(map(str, plan.sizes)),
            report["capture_s"],
        )
    else:
        report["reason"] = "padded buffers without capture (emulated on this device)"
    report["enabled"] = True
    return graphs, report


def _all_triton(model: torch.nn.Module) -> bool:
    backends = {m.backend for m in model.modules() if isinstance(m, PagedAttention)}
    return backends == {"triton"}
