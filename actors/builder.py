"""Build an engine (executor + workers + scheduler) from one flat set of args.

Shared by the offline `LLM` and the cluster's engine replica, so that both size
the KV pool and the scheduler the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from spur.actors.engine.capacity import build_groups
from spur.actors.engine.core import EngineCore
from spur.actors.engine.executor import Executor
from spur.actors.engine.groups import FullAttentionSpec, KVCacheGroup
from spur.actors.engine.hashing import DEFAULT_HASH_SEED
from spur.actors.engine.kv_cache_manager import KVCacheConfig
from spur.actors.engine.scheduler import Scheduler, SchedulerConfig
from spur.actors.engine.spec_decode import SpeculativeConfig
from spur.actors.worker.executors import make_executor
from spur.actors.worker.worker import ModelInfo, WorkerConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineArgs:
    """Everything that shapes one engine. See `LLM` for the meaning of each."""

    model: str = "SmolLM2-135M-Instruct"
    dtype: str = "float32"
    device: str = "cpu"
    tensor_parallel_size: int = 1
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_bytes: int | None = None
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    long_prefill_token_threshold: int = 0
    enable_prefix_caching: bool = True
    hash_seed: str = DEFAULT_HASH_SEED
    policy: str = "fcfs"
    attn_backend: str = "auto"
    seed: int = 0
    num_threads: int | None = None
    state_dtype: str = "float32"
    compute_dtype: str = "auto"
    """Dtype the matmuls run in: auto (the model's where the device computes it
    natively, else float32), or the model's dtype, or float32."""
    num_speculative_tokens: int = 0
    """n-gram speculative decoding: most drafts per request and step (0: off)."""
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4

    def speculative(self) -> SpeculativeConfig | None:
        """The scheduler's speculation settings, or None when it is off."""
        if not self.num_speculative_tokens:
            return None
        return SpeculativeConfig(
            num_speculative_tokens=self.num_speculative_tokens,
            prompt_lookup_min=self.prompt_lookup_min,
            prompt_lookup_max=self.prompt_lookup_max,
        )

    def worker_config(self) -> WorkerConfig:
        return WorkerConfig(
            model=self.model,
            dtype=self.dtype,
            device=self.device,
            tensor_parallel_size=self.tensor_parallel_size,
            block_size=self.block_size,
            max_num_batched_tokens=self.max_num_batched_tokens,
            kv_cache_dtype=self.kv_cache_dtype,
            attn_backend=self.attn_backend,
            seed=self.seed,
            num_threads=self.num_threads,
            gpu_memory_utilization=self.gpu_memory_utilization,
            state_dtype=self.state_dtype,
            compute_dtype=self.compute_dtype,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Engine:
    core: EngineCore
    scheduler: Scheduler
    executor: Executor
    info: ModelInfo
    args: EngineArgs

    def shutdown(self) -> None:
        self.executor.shutdown()


def build_engine(
    args: EngineArgs,
    *,
    executor_factory: Callable[[WorkerConfig], Executor] = make_executor,
    enable_kv_events: bool = False,
) -> Engine:
    """Start the workers, load the model, size and allocate the KV pool, and
    build the scheduler. Raises ValueError (naming the fix) for a pool that
    cannot hold one request; the workers are shut down on any failure."""
    executor = executor_factory(args.worker_config())
    try:
        info: ModelInfo = executor.collective_rpc("load_model")[0]
        num_blocks = args.num_kv_blocks
        if num_blocks is None:
            num_blocks = min(
                executor.collective_rpc("determine_num_blocks", (args.kv_cache_bytes,))
            )
        if num_blocks < 2:
            raise ValueError(
                f"the KV budget holds {num_blocks} blocks of {info.kv_bytes_per_block:,} bytes: "
                "give kv_cache_bytes more memory or lower block_size"
            )
        executor.collective_rpc("initialize_cache", (num_blocks,))
        groups = cache_groups(info)
        kv_config = KVCacheConfig(
            block_size=args.block_size,
            num_blocks=num_blocks,
            groups=groups,
            enable_prefix_caching=args.enable_prefix_caching,
            hash_seed=args.hash_seed,
        )
        max_model_len = args.max_model_len
        if max_model_len is None:
            max_model_len = min(
                info.max_position_embeddings,
                longest_request(groups, num_blocks, args.block_size, args.max_num_batched_tokens),
            )
        scheduler = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_num_seqs=args.max_num_seqs,
                max_model_len=max_model_len,
                long_prefill_token_threshold=args.long_prefill_token_threshold,
                policy=args.policy,
                speculative=args.speculative(),
            ),
            kv_config,
            enable_kv_events=enable_kv_events,
        )
    except BaseException:
        executor.shutdown()
        raise
    logger.info(
        "engine ready: %s, %d KV blocks of %d tokens, max_model_len %d",
        Path(info.model_dir).name,
        num_blocks,
        args.block_size,
        max_model_len,
    )
    return Engine(EngineCore(scheduler, executor), scheduler, executor, info, args)


def cache_groups(info: ModelInfo) -> tuple[KVCacheGroup, ...]:
    """The engine's cache groups: for a hybrid model those of its geometry, built by
    the same function (`capacity.build_groups`) as the worker's pool layout and as
    `spur capacity`; else one full-attention group."""
    if info.geometry is not None:
        return build_groups(info.geometry)[0]
    spec = FullAttentionSpec(info.num_kv_heads, info.head_dim, info.kv_dtype_bytes)
    return (KVCacheGroup(spec, info.num_attention_layers),)


def longest_request(
    groups: tuple[KVCacheGroup, ...], num_blocks: int, block_size: int, max_chunk: int
) -> int:
    """Most tokens one request may have so that its blocks, summed over the
    groups by the capacity formula, fit the pool's usable blocks (at least 1)."""
    usable = num_blocks - 1

    def fits(tokens: int) -> bool:
        return sum(g.spec.max_blocks(tokens, block_size, max_chunk) for g in groups) <= usable

    lo, hi = 1, usable * block_size
    while lo < hi:  # largest fitting length; the bounds grow monotonically with it
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def load_tokenizer(model_dir: str) -> Any | None:
    """The folder's Hugging Face tokenizer, or None when it has none."""
    folder = Path(model_dir)
    if not any((folder / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)
