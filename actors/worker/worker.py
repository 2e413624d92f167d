"""A worker: one device (one tensor-parallel rank), its model share and KV cache.

The executor calls these methods on every worker, in the same order, through
`collective_rpc`; the Ray actor of the cluster issue is a thin shell around the
same class.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from spur.actors.cache_spec import DEFAULT_CPU_KV_BYTES, ModelGeometry
from spur.actors.step import ModelRunnerOutput, SchedulerOutput
from spur.actors.worker import host_memory
from spur.actors.worker.compute_dtype import cpu_flags, native_dtypes, pick_compute_dtype
from spur.actors.worker.layers.linear import pack_linears
from spur.actors.worker.loader import load_model
from spur.actors.worker.model_runner import ModelRunner, kv_cache_dtype
from spur.configs import cpu

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerConfig:
    """What every worker of an engine needs to know (picklable)."""

    model: str
    dtype: str = "float32"
    device: str = "cpu"
    tensor_parallel_size: int = 1
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    kv_cache_dtype: str = "auto"
    attn_backend: str = "auto"
    seed: int = 0
    num_threads: int | None = None
    """torch intra-op threads per worker (None: torch's default)."""
    gpu_memory_utilization: float = 0.9
    state_dtype: str = "float32"
    """Storage dtype of recurrent states (hybrid models; float32 as transformers' cache)."""
    cuda_graphs: bool = True
    """Capture decode CUDA graphs in `capture_decode_graphs` (CUDA only)."""
    cuda_graph_batch_sizes: tuple[int, ...] | None = None
    """Decode batch sizes to capture (None: cuda_graphs.capture_sizes' default)."""
    compute_dtype: str = "auto"
    """Dtype the model computes in (actors/worker/compute_dtype.py): auto, or dtype / float32."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ModelInfo:
    """What the engine core needs from the model to size its pool."""

    num_attention_layers: int
    num_kv_heads: int  # per rank
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    kv_dtype_bytes: int
    kv_bytes_per_block: int  # this rank, all layers
    eos_token_id: int | None
    model_dir: str
    geometry: ModelGeometry | None = None
    """Layer kinds and page sizes (this rank) of a hybrid model, whose cache groups the
    engine builds with `cache_spec.build_groups`; None for plain attention models."""
    compute_dtype: str = "float32"
    """What the model computes in (model.compute_dtype resolved on this device)."""


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
# Blocks up to this size come from the heap; larger ones (the KV pool) are mmapped.
HEAP_BLOCK_MAX = 32 << 20  # glibc's own ceiling for the mmap threshold on 64-bit
# Free memory at the heap's top kept, not returned to the kernel.
HEAP_TRIM_KEEP = 256 << 20


def keep_step_buffers_on_the_heap() -> bool:
    """Serve the step's large tensors (logits [rows, vocab], prefill activations) from
    glibc's heap, so that freed ones are reused rather than unmapped.

    torch's CPU allocator calls malloc per tensor. By default glibc maps blocks over its
    (adaptive) mmap threshold afresh and trims the heap's top when they are freed, so a
    3 MiB logits tensor made each step is page-faulted in again each step: a bf16 ->
    float32 copy of 16 x 49152 logits took 5 ms on the twelfth round's EPYC, and 16 bf16
    decodes ran 8-15% faster offline with these settings (BENCHMARKS.md). Returns
    whether they were applied (glibc on Linux only; elsewhere a no-op)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    ok = libc.mallopt(_M_MMAP_THRESHOLD, HEAP_BLOCK_MAX) == 1
    ok = libc.mallopt(_M_TRIM_THRESHOLD, HEAP_TRIM_KEEP) == 1 and ok
    logger.info(
        "malloc: blocks up to %d MiB from the heap, %d MiB kept at its top: %s",
        HEAP_BLOCK_MAX >> 20,
        HEAP_TRIM_KEEP >> 20,
        "set" if ok else "refused by glibc",
    )
    return ok


class Worker:
    """One device's share of the model (TP rank `rank`). `local_rank`: the index of its
    CUDA device among those its process sees when `config.device` names none (default:
    `rank`, a process that sees every GPU of the node; a Ray actor sees only its own)."""

    def __init__(
        self,
        config: WorkerConfig,
        rank: int = 0,
        dist_init_method: str | None = None,
        local_rank: int | None = None,
    ):
        self.config = config
        self.rank = rank
        self.local_rank = rank if local_rank is None else local_rank
        self.dist_init_method = dist_init_method
        self.runner: ModelRunner | None = None
        self.info: ModelInfo | None = None

    def init_device(self) -> None:
        cfg = self.config
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        device = torch.device(cfg.device)
        if device.type == "cpu":
            keep_step_buffers_on_the_heap()
        if device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError(
                    f"engine.parallelism.device is {cfg.device!r} but this machine has no "
                    "CUDA device torch can use: set it to cpu (or auto)"
                )
            torch.cuda.set_device(self.device)
        if cfg.tensor_parallel_size > 1 and not dist.is_initialized():
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(
                backend,
                init_method=self.dist_init_method,
                rank=self.rank,
                world_size=cfg.tensor_parallel_size,
            )

    @property
    def device(self) -> torch.device:
        device = torch.device(self.config.device)
        if device.type == "cuda" and device.index is None:
            return torch.device("cuda", self.local_rank)
        return device

    def load_model(self) -> ModelInfo:
        cfg = self.config
        tp = cfg.tensor_parallel_size
        loaded = load_model(
            cfg.model,
            dtype=cfg.dtype,
            device=self.device,
            tp_rank=self.rank,
            tp_size=tp,
            attn_backend=cfg.attn_backend,
        )
        model = loaded.model
        hf = getattr(model, "config", None) or loaded.config  # text config of multimodal ones
        param_dtype = next(model.parameters()).dtype  # the served dtype (model.dtype)
        compute = self._compute_dtype(model, param_dtype)
        if self.device.type == "cpu":
            packed, nbytes = pack_linears(model)  # where native.pack_linear serves
            if packed:
                logger.info(
                    "%s linears: %d weights packed for native.linear_panels (%.1f MiB)",
                    str(compute).removeprefix("torch."),
                    packed,
                    nbytes / 2**20,
                )
        kv_dtype = kv_cache_dtype(cfg.kv_cache_dtype, param_dtype)
        self.runner = ModelRunner(
            model,
            block_size=cfg.block_size,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            device=self.device,
            kv_dtype=kv_dtype,
            vocab_size=hf.vocab_size,
            seed=cfg.seed,
            state_dtype=kv_cache_dtype(cfg.state_dtype, param_dtype),
        )
        eos = getattr(hf, "eos_token_id", None)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        self.info = ModelInfo(
            num_attention_layers=model.num_attention_layers,
            num_kv_heads=model.num_kv_heads_per_rank,
            head_dim=model.head_dim,
            vocab_size=hf.vocab_size,
            max_position_embeddings=int(getattr(hf, "max_position_embeddings", 4096)),
            kv_dtype_bytes=torch.empty((), dtype=kv_dtype).element_size(),
            kv_bytes_per_block=self.runner.kv_bytes_per_block(),
            eos_token_id=eos,
            model_dir=str(loaded.path),
            geometry=self.runner.layout.geometry if self.runner.layout else None,
            compute_dtype=str(compute).removeprefix("torch."),
        )
        return self.info

    def _compute_dtype(self, model: torch.nn.Module, served: torch.dtype) -> torch.dtype:
        """Resolve model.compute_dtype on this device, log it, and widen the weights
        when it differs from the served dtype (in place; KV keeps the served dtype)."""
        name = str(served).removeprefix("torch.")
        flags = cpu_flags() if self.device.type == "cpu" else set()
        chosen = pick_compute_dtype(name, self.config.compute_dtype, self.device.type, flags)
        if self.device.type == "cpu":
            here = cpu.here()
            logger.info(
                "CPU %s (%s) computes natively: %s; model.dtype %s, compute_dtype %s -> %s",
                cpu.describe(here),
                cpu.uarch(here) or f"family {here.family}, model {here.model_number}",
                ", ".join(native_dtypes(flags)),
                name,
                self.config.compute_dtype,
                chosen,
            )
        target = getattr(torch, chosen)
        if target != served:
            model.to(target)
        return target

    def determine_num_blocks(self, kv_cache_bytes: int | None = None) -> int:
        """Blocks that fit the KV budget: `kv_cache_bytes` if given; else on
        CUDA, gpu_memory_utilization of the device minus what is in use; on
        CPU, 2 GiB."""
        assert self.info is not None, "load_model first"
        budget = kv_cache_bytes
        if budget is None:
            if self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                used = total - free
                budget = int(total * self.config.gpu_memory_utilization) - used
            else:
                budget = DEFAULT_CPU_KV_BYTES
        return max(0, budget // self.info.kv_bytes_per_block)

    def initialize_cache(self, num_blocks: int) -> None:
        assert self.runner is not None and self.info is not None, "load_model first"
        if self.device.type == "cpu":
            # The ranks of one engine share its host (one node: STRICT_PACK, or the
            # processes of MultiprocExecutor) and check at once: each counts them all.
            ranks = self.config.tensor_parallel_size
            _check_host_memory(num_blocks, num_blocks * self.info.kv_bytes_per_block, ranks)
        self.runner.initialize_cache(num_blocks)

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        assert self.runner is not None, "load_model first"
        return self.runner.execute_model(out)

    def capture_decode_graphs(self, max_model_len: int, max_num_seqs: int) -> dict[str, Any]:
        """Capture the decode CUDA graphs (after `initialize_cache`) when the config asks
        for them; returns the report of `ModelRunner.capture_decode_graphs`."""
        assert self.runner is not None, "load_model first"
        if not self.config.cuda_graphs:
            return {"enabled": False, "captured": [], "capture_s": 0.0, "reason": "off"}
        sizes = self.config.cuda_graph_batch_sizes
        return self.runner.capture_decode_graphs(
            max_model_len, max_num_seqs, list(sizes) if sizes else None
        )

    def step_times(self) -> dict[str, Any]:
        assert self.runner is not None
        t = self.runner.times
        return {
            "prepare_s": t.prepare,
            "forward_s": t.forward,
            "logits_s": t.logits,
            "sample_s": t.sample,
            "steps": t.steps,
            "graph_steps": sum(self.runner.graphs.steps_by_size.values())
            if self.runner.graphs
            else 0,
            "shapes": [[n, m, c] for (n, m), c in sorted(t.shapes.items())],
        }

    def time_matmuls(self, shapes: list[tuple[int, int, int]], torch_path: bool = False) -> float:
        """See `ModelRunner.time_matmuls`."""
        assert self.runner is not None, "load_model first"
        return self.runner.time_matmuls(shapes, torch_path=torch_path)

    def memory_read_rate(self) -> float:
        """See `ModelRunner.memory_read_rate`."""
        assert self.runner is not None, "load_model first"
        return self.runner.memory_read_rate()

    def ping(self) -> int:
        return os.getpid()

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _check_host_memory(num_blocks: int, size: int, ranks: int = 1) -> None:
    """Refuse a CPU KV pool (`size` bytes, this rank's) larger than the memory this
    process may still take (`host_memory`) once the `ranks` pools of the engine's
    ranks on this host are counted: allocated anyway, the OOM killer ends a process
    when they fill."""
    found = host_memory.available_bytes()
    if found is None or size * ranks <= found[0]:
        return
    room, source = found
    what = (
        f"{ranks} ranks' KV pools of {num_blocks:,} blocks each ({size * ranks / 2**30:.2f} "
        "GiB in all) are"
        if ranks > 1
        else f"a KV pool of {num_blocks:,} blocks ({size / 2**30:.2f} GiB) is"
    )
    raise ValueError(
        f"{what} more than the "
        f"memory this process may still take, {room / 2**30:.2f} GiB ({source}): set "
        "engine.kv_cache_bytes or engine.num_kv_blocks lower (the CPU default is "
        f"{DEFAULT_CPU_KV_BYTES / 2**30:g} GiB), or give the host or container more memory"
    )
