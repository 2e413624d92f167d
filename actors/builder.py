"""Build an engine (executor + workers + scheduler) from one flat set of args.

Shared by the offline `LLM` and the cluster's engine replica, so that both size
the KV pool and the scheduler the same way.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from spur.actors import generation_config as gen_config
from spur.actors.cache_spec import FullAttentionSpec, KVCacheGroup, StateSpec, build_groups
from spur.actors.engine.core.capacity import context_tokens
from spur.actors.engine.core.engine_core import EngineCore
from spur.actors.engine.core.kv_cache_manager import KVCacheConfig
from spur.actors.engine.core.scheduler import (
    SPECULATION_ON_STATE_MODELS,
    Scheduler,
    SchedulerConfig,
)
from spur.actors.engine.core.spec_decode import SpeculativeConfig
from spur.actors.engine.shell.metrics import break_retirement
from spur.actors.generation_config import SamplingDefaults
from spur.actors.step import Executor
from spur.actors.worker.executors import make_executor
from spur.actors.worker.worker import ModelInfo, WorkerConfig

if TYPE_CHECKING:
    from spur.configs.schema import EngineConfig

logger = logging.getLogger(__name__)

DEFAULTS_JSON = "engine_defaults.json"
"""Beside `spur.configs.engine_args`: the schema's flat defaults, generated from it
(`python -m spur.configs.engine_args --write`), for `EngineArgs.of` without pydantic."""


@dataclass(frozen=True)
class EngineArgs:
    """Everything that shapes one engine: the flat view of one
    `spur.configs.schema.EngineConfig` (`spur.configs.engine_args`), so every field's
    meaning, default and bounds are the schema's. No defaults here: build it with
    `from_config` (a config tree) or `of` (flat keywords, as `LLM(...)` takes), never
    field by field, so that a setting cannot be forgotten on the way to the engine
    (a schema field without a field here fails `from_config` with a TypeError)."""

    # model
    model: str
    dtype: str
    max_model_len: int | None
    tokenizer: str | None
    compute_dtype: str
    """What the matmuls run in: "auto" (resolved per device: actors/worker/compute_dtype.py)."""
    generation_config: str
    """Requests' sampling defaults: "auto" (the model's file) or "vllm" (none)."""
    override_generation_config: dict[str, Any]
    """Sampling defaults set over the model's (generation_config.json keys)."""
    # cache
    block_size: int
    num_kv_blocks: int | None
    kv_cache_bytes: int | None
    kv_cache_dtype: str
    enable_prefix_caching: bool
    gpu_memory_utilization: float
    hash_seed: str
    state_dtype: str
    # scheduler
    max_num_batched_tokens: int
    max_num_seqs: int
    long_prefill_token_threshold: int
    policy: str
    check_kv_bounds: bool
    # parallelism
    tensor_parallel_size: int
    device: str
    """"cpu" or "cuda" ("auto" is resolved by `spur.configs.engine_args.resolve_device`)."""
    # runtime
    attn_backend: str
    seed: int
    num_threads: int | None
    stream_interval: int
    """Tokens per streamed chunk after a request's first (`AsyncEngine.stream_interval`)."""
    step_timeout_s: float
    """Longest step before the replica is unhealthy (`AsyncEngine.step_timeout_s`)."""
    test_leak_blocks_per_step: int
    """TESTS ONLY: see `RuntimeConfig.test_leak_blocks_per_step` (0: a correct engine)."""
    # speculative
    method: str
    num_speculative_tokens: int
    """n-gram speculative decoding: most drafts per request and step (0: off)."""
    prompt_lookup_min: int
    prompt_lookup_max: int
    disable_by_batch_size: int | None
    """Draft only while fewer than this many requests run (None: always)."""
    cuda_graphs: bool
    """Capture decode steps as CUDA graphs at start (CUDA only; ignored on CPU)."""
    cuda_graph_batch_sizes: list[int] | None
    """Decode batch sizes to capture; None: 1, 2, 4, multiples of 8 up to max_num_seqs."""

    @classmethod
    def from_config(cls, engine: EngineConfig) -> EngineArgs:
        """The args of one engine config (every field, by `flat_engine_args`)."""
        from spur.configs.engine_args import flat_engine_args

        return cls(**flat_engine_args(engine))

    @classmethod
    def of(cls, **flat: Any) -> EngineArgs:
        """The args of flat keywords (`LLM(...)`'s); the others take the schema's
        defaults. Raises ValueError for an unknown keyword or an invalid value.

        Where pydantic is not installed (a bare GPU machine running
        `actors/gpu_check.py`), the defaults come from the schema's generated flat
        snapshot (`configs/engine_defaults.json`) and the values are not validated
        (logged)."""
        try:
            from spur.configs.engine_args import engine_config
        except ImportError as exc:
            if "pydantic" not in str(exc):
                raise
            return cls._of_snapshot(flat)
        return cls.from_config(engine_config(**flat))

    @classmethod
    def _of_snapshot(cls, flat: dict[str, Any]) -> EngineArgs:
        import importlib.util
        import json

        spec = importlib.util.find_spec("spur.configs")
        assert spec is not None and spec.submodule_search_locations
        path = Path(next(iter(spec.submodule_search_locations))) / DEFAULTS_JSON
        defaults = json.loads(path.read_text())
        unknown = sorted(set(flat) - set(defaults))
        if unknown:
            raise ValueError(
                f"unknown engine argument(s) {', '.join(unknown)}: valid ones are "
                f"{', '.join(sorted(defaults))}"
            )
        logger.warning("pydantic is not installed: engine arguments are not validated")
        return cls(**{**defaults, **flat})

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """The engine core's scheduler settings (`max_model_len` resolved at load time)."""
        return SchedulerConfig(
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            max_model_len=max_model_len,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            policy=self.policy,
            check_kv_bounds=self.check_kv_bounds,
            speculative=self.speculative(),
        )

    def tokenizer_dir(self, model_dir: str) -> str:
        """The tokenizer folder: `tokenizer` when set, else the loaded model's folder."""
        return self.tokenizer or model_dir

    def speculative(self) -> SpeculativeConfig | None:
        """The scheduler's speculation settings, or None when it is off."""
        if not self.num_speculative_tokens:
            return None
        return SpeculativeConfig(
            num_speculative_tokens=self.num_speculative_tokens,
            prompt_lookup_min=self.prompt_lookup_min,
            prompt_lookup_max=self.prompt_lookup_max,
            method=self.method,
            disable_by_batch_size=self.disable_by_batch_size,
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
            cuda_graphs=self.cuda_graphs,
            cuda_graph_batch_sizes=tuple(self.cuda_graph_batch_sizes or ()) or None,
            compute_dtype=self.compute_dtype,
        )

    def sampling_defaults(self, model_dir: str) -> SamplingDefaults:
        """What requests that leave sampling fields out get: the model folder's
        generation_config.json under "auto", then the overrides. Raises ValueError
        (naming the file or the setting, and the fix) for an unreadable file or a value
        out of range."""
        mode = self.generation_config
        file_cfg = gen_config.read_generation_config(model_dir) if mode == "auto" else {}
        defaults = gen_config.sampling_defaults(file_cfg, mode, self.override_generation_config)
        source = (
            f"{Path(model_dir) / 'generation_config.json'} and "
            "engine.model.override_generation_config"
            if mode == "auto"
            else "engine.model.override_generation_config"
        )
        gen_config.check_defaults(defaults, source, from_file=mode == "auto")
        return defaults

    def more_eos_token_ids(self, model_dir: str, primary: int | None) -> tuple[int, ...]:
        """EOS ids every request stops at besides `primary` (`gen_config.more_eos_token_ids`:
        generation_config.json's, else config.json's, under "auto"). Raises ValueError
        naming the file for an eos_token_id that is not ids."""
        folder = Path(model_dir)
        has_file = (folder / gen_config.FILE_NAME).is_file()
        source = folder / (gen_config.FILE_NAME if has_file else "config.json")
        file_cfg = gen_config.read_generation_config(folder) if has_file else None
        model_cfg: dict[str, Any] = {}
        if not has_file and (folder / "config.json").is_file():
            loaded = json.loads((folder / "config.json").read_text())
            model_cfg = loaded if isinstance(loaded, dict) else {}
        return gen_config.more_eos_token_ids(
            file_cfg, model_cfg, self.generation_config, primary, str(source)
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
    sampling_defaults: SamplingDefaults
    """Requests' sampling defaults (actors/generation_config.py): the LLM's
    `get_default_sampling_params`, and the ingress reads them from the replica's stats."""
    more_eos_token_ids: tuple[int, ...] = ()
    """EOS ids besides `info.eos_token_id` that end every request without ignore_eos
    (`generation_config.with_eos`, applied where requests enter the engine)."""

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
    cannot hold one request or a `tokenizer` folder without a tokenizer; the workers
    are shut down on any failure."""
    if args.tokenizer is not None and not has_tokenizer(args.tokenizer):
        # Else ignored: text prompts would fail naming the model folder, token-id
        # prompts would return no text, and the tokenizer's EOS would not end them.
        raise ValueError(
            f"engine.model.tokenizer {args.tokenizer!r} holds no Hugging Face tokenizer "
            "(tokenizer.json or tokenizer_config.json): give a tokenizer folder, or unset it "
            "to use the model folder's"
        )
    executor = executor_factory(args.worker_config())
    try:
        info: ModelInfo = executor.collective_rpc("load_model")[0]
        groups = cache_groups(info)
        if args.speculative() is not None and any(isinstance(g.spec, StateSpec) for g in groups):
            raise ValueError(SPECULATION_ON_STATE_MODELS)  # before the pool takes memory
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
        sampling_defaults = args.sampling_defaults(info.model_dir)
        more_eos = args.more_eos_token_ids(info.model_dir, info.eos_token_id)
        executor.collective_rpc("initialize_cache", (num_blocks,))
        kv_config = KVCacheConfig(
            block_size=args.block_size,
            num_blocks=num_blocks,
            groups=groups,
            enable_prefix_caching=args.enable_prefix_caching,
            hash_seed=args.hash_seed,
        )
        max_model_len = args.max_model_len
        if max_model_len is not None and max_model_len > info.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_model_len:,} is more than the model's "
                f"max_position_embeddings ({info.max_position_embeddings:,}, its config.json): "
                "positions past it have no rotary embedding; lower max_model_len to at most "
                f"{info.max_position_embeddings:,} (or leave it unset)"
            )
        if max_model_len is None:
            max_model_len = min(
                info.max_position_embeddings,
                max(
                    1,
                    context_tokens(
                        groups,
                        usable_blocks=num_blocks - 1,
                        block_size=args.block_size,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                    ),
                ),
            )
        scheduler = Scheduler(
            args.scheduler_config(max_model_len), kv_config, enable_kv_events=enable_kv_events
        )
        if args.cuda_graphs and args.device.startswith("cuda"):
            executor.collective_rpc("capture_decode_graphs", (max_model_len, args.max_num_seqs))
        elif args.cuda_graphs:
            logger.info("CUDA graphs: ignored on %s", args.device)
        if args.test_leak_blocks_per_step:
            # Tests only (build_app refuses it outside tests): a broken retirement.
            break_retirement(scheduler.kv, args.test_leak_blocks_per_step)
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
    level, message = gen_config.startup_message(
        sampling_defaults, args.generation_config, Path(info.model_dir).name
    )
    logger.log(level, message)
    if more_eos:
        logger.info(
            "EOS ids: %s and %s (the model's generation config)", info.eos_token_id, list(more_eos)
        )
    return Engine(
        EngineCore(scheduler, executor),
        scheduler,
        executor,
        info,
        args,
        sampling_defaults,
        more_eos,
    )


def cache_groups(info: ModelInfo) -> tuple[KVCacheGroup, ...]:
    """The engine's cache groups: for a hybrid model those of its geometry, built by
    the same function (`cache_spec.build_groups`) as the worker's pool layout and as
    `spur capacity`; else one full-attention group."""
    if info.geometry is not None:
        return build_groups(info.geometry)[0]
    spec = FullAttentionSpec(info.num_kv_heads, info.head_dim, info.kv_dtype_bytes)
    return (KVCacheGroup(spec, info.num_attention_layers),)


TOKENIZER_FILES_MAX_BYTES = 64 << 20
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")


def tokenizer_files(model_dir: str) -> dict[str, bytes]:
    """What another process needs to load the folder's tokenizer (and chat template)
    where the folder is not on its disk (the ingress on another pod than the engine):
    every regular file of the folder but weights, name -> bytes.

    Raises ValueError when they exceed TOKENIZER_FILES_MAX_BYTES (set
    `engine.model.tokenizer` to a folder holding the tokenizer alone)."""
    files: dict[str, bytes] = {}
    total = 0
    for path in sorted(Path(model_dir).iterdir()):
        if not path.is_file() or path.name.startswith(".") or path.suffix in _WEIGHT_SUFFIXES:
            continue
        total += path.stat().st_size
        if total > TOKENIZER_FILES_MAX_BYTES:
            raise ValueError(
                f"the tokenizer folder {model_dir} holds over "
                f"{TOKENIZER_FILES_MAX_BYTES >> 20} MiB of files besides weights: set "
                "engine.model.tokenizer to a folder with the tokenizer's files alone"
            )
        files[path.name] = path.read_bytes()
    return files


def has_tokenizer(folder: str) -> bool:
    """Whether the folder holds a Hugging Face tokenizer's files."""
    return any((Path(folder) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))


def load_tokenizer(model_dir: str) -> Any | None:
    """The folder's Hugging Face tokenizer, or None when it has none."""
    folder = Path(model_dir)
    if not has_tokenizer(model_dir):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)
