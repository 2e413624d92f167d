"""Capacity truth: how many requests the KV pool really holds.

From a model's geometry this module builds the cache groups, sizes the pool and
states how many requests of `max_model_len` tokens fit at once:

    page_bytes   = max over groups of one layer's page; smaller pages (usually
                   state pages) are padded up to it, so one pool serves all groups
                   attention page = 2 * block_size * kv_heads * head_dim * dtype_bytes
                   state page     = conv state + recurrent state bytes of one layer
    group_size   = layers per group (the smallest layer-kind count; every kind is
                   split into groups of that many layers)
    block_bytes  = page_bytes * group_size      (one page per layer of a group)
    num_blocks   = kv_bytes // block_bytes       (or given), usable = num_blocks - 1
    tokens       = the longest context one request holds with the pool to itself:
                   the largest T <= usable * block_size with the sum over groups of
                   blocks per request of T tokens (below) <= usable (a plain model:
                   usable * block_size; state and sliding groups' fixed blocks and
                   a second attention group's blocks come off it)
    blocks per request of L tokens, per group  (groups.*Spec.max_blocks):
        full     ceil(L / bs)
        sliding  min(ceil(L / bs), ceil((W - 1 + C) / bs) + 1)   C = max_num_batched_tokens
        state    min(ceil(L / bs), 2)            (the state read and the one written)
    max_concurrency = usable // sum over groups of blocks per request

The run-time leak detector (`KVCacheManager.check_bounds`) applies the same
per-group bound to every running request, so a claim that is not kept shows up
as a counted, logged violation instead of silently lower capacity.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from spur.actors.cache_spec import (
    FullAttentionSpec,
    KVCacheGroup,
    KVCacheSpec,
    LayerKind,
    ModelGeometry,
    SlidingWindowSpec,
    StateSpec,
    build_groups,
    dtype_bytes,
)
from spur.actors.engine.core.kv_cache_manager import KVCacheConfig

logger = logging.getLogger(__name__)


# -- geometry from a Hugging Face config.json or a small YAML -----------------------------
def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The part of a config.json that describes the decoder: `text_config` of a
    multimodal model's (when the top level has no num_hidden_layers), else the whole;
    with `architectures` set to the model's. Every figure of a geometry
    (`geometry_from_hf_config`) and its max_position_embeddings come from this dict."""
    name = (cfg.get("architectures") or [cfg.get("model_type", "model")])[0]
    text = cfg.get("text_config")
    if isinstance(text, dict) and "num_hidden_layers" not in cfg:
        return {**text, "architectures": [name]}
    return {**cfg, "architectures": [name]}


def geometry_from_hf_config(
    cfg: dict[str, Any], *, kv_dtype: str = "bfloat16", state_dtype: str | None = None
) -> ModelGeometry:
    """Read layer kinds and sizes from a config.json dict.

    Understands plain attention models, `layer_types` lists (full_attention,
    sliding_attention, linear_attention (Gated DeltaNet, Qwen3-Next style),
    conv (LFM2)), and `layers_block_type` lists (attention / mamba, Mamba2).
    """
    cfg = text_config(cfg)
    name = cfg["architectures"][0]
    try:
        num_layers = int(cfg["num_hidden_layers"])
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
    except KeyError as e:
        raise ValueError(
            f"config.json has no {e.args[0]!r}: it does not describe a decoder model"
        ) from None
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    kvb = dtype_bytes(kv_dtype)
    sb = dtype_bytes(state_dtype or kv_dtype)

    types = cfg.get("layer_types") or cfg.get("layers_block_type")
    if not types:
        interval = cfg.get("full_attention_interval")
        if interval and cfg.get("linear_num_value_heads"):
            types = [
                "full_attention" if (i + 1) % int(interval) == 0 else "linear_attention"
                for i in range(num_layers)
            ]
        else:
            types = ["full_attention"] * num_layers
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries, num_hidden_layers is {num_layers}")

    counts: dict[str, int] = {}
    for t in types:
        kind = _normalise_kind(t)
        counts[kind] = counts.get(kind, 0) + 1
    kinds = []
    for kind, count in counts.items():
        spec: KVCacheSpec
        if kind == "full_attention":
            spec = FullAttentionSpec(kv_heads, head_dim, kvb)
        elif kind == "sliding_attention":
            window = cfg.get("sliding_window")
            if not window:
                raise ValueError("sliding_attention layers need `sliding_window` in config.json")
            spec = SlidingWindowSpec(kv_heads, head_dim, kvb, sliding_window=int(window))
        else:
            spec = StateSpec(_state_bytes(cfg, kind, sb))
        kinds.append(LayerKind(kind, count, spec))
    return ModelGeometry(name, tuple(kinds))


_KIND_ALIASES = {
    "full_attention": "full_attention",
    "attention": "full_attention",
    "attn": "full_attention",
    "sliding_attention": "sliding_attention",
    "sliding_window": "sliding_attention",
    "local_attention": "sliding_attention",
    "linear_attention": "linear_attention",
    "mamba": "mamba",
    "mamba2": "mamba",
    "conv": "conv",
    "short_conv": "conv",
}


def _normalise_kind(t: str) -> str:
    try:
        return _KIND_ALIASES[t.lower()]
    except KeyError:
        raise ValueError(
            f"unknown layer type {t!r} in config.json; known: {sorted(_KIND_ALIASES)}"
        ) from None


def _first(cfg: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        if cfg.get(key):
            return cfg[key]
    raise ValueError(f"config.json has none of {list(keys)}: cannot size the state layers")


def _state_bytes(cfg: dict[str, Any], kind: str, elem: int) -> int:
    """Bytes of one state layer (conv state + recurrent state)."""
    if kind == "linear_attention":  # Gated DeltaNet (Qwen3-Next / Qwen3.5)
        nk, nv = int(cfg["linear_num_key_heads"]), int(cfg["linear_num_value_heads"])
        dk, dv = int(cfg["linear_key_head_dim"]), int(cfg["linear_value_head_dim"])
        kernel = int(cfg.get("linear_conv_kernel_dim", 4))
        conv_dim = 2 * nk * dk + nv * dv
        return (conv_dim * (kernel - 1) + nv * dk * dv) * elem
    if kind == "mamba":  # Mamba2
        hidden = int(cfg["hidden_size"])
        n_heads = int(_first(cfg, "mamba_n_heads", "mamba_num_heads"))
        head_dim = int(_first(cfg, "mamba_head_dim", "mamba_d_head"))
        d_state = int(_first(cfg, "ssm_state_size", "mamba_d_state"))
        n_groups = int(cfg.get("n_groups") or cfg.get("mamba_n_groups") or 1)
        kernel = int(cfg.get("conv_kernel") or cfg.get("mamba_d_conv") or 4)
        intermediate = int(cfg.get("mamba_intermediate_size") or n_heads * head_dim or 2 * hidden)
        conv_dim = intermediate + 2 * n_groups * d_state
        return (conv_dim * (kernel - 1) + n_heads * head_dim * d_state) * elem
    # LFM2-style short convolution: state [hidden, L_cache]
    hidden = int(cfg["hidden_size"])
    return hidden * int(cfg.get("conv_L_cache", 3)) * elem


def geometry_from_yaml(data: dict[str, Any], *, kv_dtype: str | None = None) -> ModelGeometry:
    """A small format for geometries without a config.json:

    name: my-hybrid
    dtype: bfloat16
    layers:
      - {kind: full_attention, count: 8, num_kv_heads: 2, head_dim: 256}
      - {kind: sliding_attention, count: 8, num_kv_heads: 2, head_dim: 128, window: 4096}
      - {kind: state, count: 32, state_bytes: 1097728}   # or shapes: [[8192, 3], [32, 128, 128]]

    Pages are sized in `kv_dtype`, else the file's `dtype`, else bfloat16.

    Raises:
        ValueError: an unknown key, a layer that is not a mapping, lacks a key its kind
            needs or holds a value that is not a positive integer (the message names
            `layers[i]` and the key).
    """
    allowed = {"name", "dtype", "layers"}
    unknown = set(data) - allowed
    if unknown:
        raise ValueError(f"unknown key(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    dtype = kv_dtype or data.get("dtype") or "bfloat16"
    if not isinstance(dtype, str):
        raise ValueError(f"dtype {dtype!r} is not a dtype name")
    elem = dtype_bytes(dtype)
    layers = data.get("layers") or []
    if not isinstance(layers, list):
        raise ValueError(
            "layers must be a list of mappings ({kind: ..., count: ...}), "
            f"not a {type(layers).__name__}"
        )
    kinds = []
    for i, layer in enumerate(layers):
        where = f"layers[{i}]"
        if not isinstance(layer, dict):
            raise ValueError(
                f"{where} is a {type(layer).__name__}, not a mapping: write it as "
                "{kind: full_attention, count: N, num_kv_heads: H, head_dim: D}"
            )
        kind = layer.get("kind")
        if kind not in ("full_attention", "sliding_attention", "state"):
            raise ValueError(
                f"{where}.kind={kind!r}: use full_attention, sliding_attention or state"
            )

        count = _need(layer, "count", where)
        spec: KVCacheSpec
        if kind in ("full_attention", "sliding_attention"):
            base = (_need(layer, "num_kv_heads", where), _need(layer, "head_dim", where), elem)
            spec = (
                SlidingWindowSpec(*base, sliding_window=_need(layer, "window", where))
                if kind == "sliding_attention"
                else FullAttentionSpec(*base)
            )
        elif "state_bytes" in layer:
            spec = StateSpec(_need(layer, "state_bytes", where))
        elif "shapes" in layer:
            spec = StateSpec(_shapes_elements(layer["shapes"], f"{where}.shapes") * elem)
        else:
            raise ValueError(f"{where} (state) has no 'state_bytes' or 'shapes': add one")
        kinds.append(LayerKind(kind, count, spec))
    if not kinds:
        raise ValueError("the geometry file lists no layers: list them under `layers:`")
    return ModelGeometry(str(data.get("name", "model")), tuple(kinds))


def _need(layer: dict[str, Any], key: str, where: str) -> int:
    """`layer[key]`, a positive integer; ValueError naming `where` and the key."""
    if key not in layer:
        raise ValueError(f"{where} ({layer['kind']}) has no {key!r}: add it")
    return _positive_int(layer[key], f"{where}.{key}")


def _positive_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}={value!r} must be an integer >= 1")
    return value


def _shapes_elements(shapes: Any, where: str) -> int:
    """Elements of a state layer's `shapes` (a list of shapes, each a list of sizes)."""
    if not isinstance(shapes, list) or not shapes:
        raise ValueError(f"{where} must be a list of shapes, e.g. [[8192, 3]]")
    total = 0
    for j, shape in enumerate(shapes):
        if not isinstance(shape, list) or not shape:
            raise ValueError(f"{where}[{j}] must be a list of sizes")
        total += math.prod(_positive_int(n, f"{where}[{j}]") for n in shape)
    return total


@dataclass(frozen=True)
class GeometryFile:
    """What `read_geometry` found in a model folder, config.json or geometry YAML."""

    geometry: ModelGeometry
    kv_dtype: str
    """The dtype the attention pages are sized in."""
    kv_dtype_from_file: bool
    """The geometry YAML's `dtype:` chose `kv_dtype` (no kv_dtype was given)."""
    max_position_embeddings: int | None
    """The config's (its text_config's, as the geometry); None for a YAML."""


def read_geometry(
    path: str | Path,
    *,
    kv_dtype: str | None = None,
    default_kv_dtype: str = "bfloat16",
    state_dtype: str | None = None,
) -> GeometryFile:
    """From a model folder (its config.json), a config.json, or a YAML geometry. The KV
    dtype: `kv_dtype`, else a YAML's `dtype:`, else `default_kv_dtype`; state layers of
    a config.json in `state_dtype`, else the KV dtype.

    Raises:
        FileNotFoundError: no such file.
        ValueError: a file that is not valid YAML / JSON or does not describe a model
            (the message names the file or the key).
    """
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        raise FileNotFoundError(
            f"{p}: no such file; pass a model folder, a config.json or a geometry YAML"
        )
    if p.suffix in (".yaml", ".yml"):
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            where = getattr(e, "problem_mark", None)
            at = f" at line {where.line + 1}" if where is not None else ""
            raise ValueError(f"{p}: not valid YAML{at}: fix the file") from None
        if not isinstance(data, dict):
            raise ValueError(f"{p}: holds a {type(data).__name__}, not a geometry mapping")
        from_file = kv_dtype is None and data.get("dtype") is not None
        dtype = kv_dtype or (data["dtype"] if from_file else default_kv_dtype)
        try:
            geometry = geometry_from_yaml(data, kv_dtype=dtype)
        except ValueError as e:
            raise ValueError(f"{p}: {e}") from None
        return GeometryFile(geometry, dtype, from_file, None)
    try:
        cfg = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{p}: holds a {type(cfg).__name__}, not a model config object")
    dtype = kv_dtype or default_kv_dtype
    geometry = geometry_from_hf_config(cfg, kv_dtype=dtype, state_dtype=state_dtype)
    positions = text_config(cfg).get("max_position_embeddings")
    known = isinstance(positions, int) and not isinstance(positions, bool) and positions > 0
    return GeometryFile(geometry, dtype, False, positions if known else None)


def load_geometry(
    path: str | Path, *, kv_dtype: str | None = None, state_dtype: str | None = None
) -> ModelGeometry:
    """The geometry of `read_geometry` (a YAML's own `dtype:` unless `kv_dtype` is
    given; bfloat16 otherwise)."""
    return read_geometry(path, kv_dtype=kv_dtype, state_dtype=state_dtype).geometry


# -- groups and the report ---------------------------------------------------------------
@dataclass
class GroupReport:
    group_id: int
    kind: str
    num_layers: int
    page_bytes: int
    """One layer's page before padding."""
    padded_page_bytes: int
    padding_percent: float
    blocks_per_request: int
    max_concurrency: int
    """Requests of max_model_len if this group alone used the pool."""


@dataclass
class CapacityReport:
    model: str
    block_size: int
    num_blocks: int
    usable_blocks: int
    block_bytes: int
    tokens: int
    """The longest context one request holds with the pool to itself (`context_tokens`)."""
    max_model_len: int
    blocks_per_request: int
    max_concurrency: int
    groups: list[GroupReport] = field(default_factory=list)
    padding_percent: float = 0.0
    """Share of the pool's bytes that is padding (state pages padded to the page size)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def capacity(
    geometry: ModelGeometry,
    *,
    block_size: int,
    max_model_len: int,
    max_num_batched_tokens: int = 2048,
    num_blocks: int | None = None,
    kv_bytes: int | None = None,
) -> CapacityReport:
    """The capacity report (see the module docstring for the formula). Give
    exactly one of `num_blocks` and `kv_bytes`. Logs the padding in percent."""
    if (num_blocks is None) == (kv_bytes is None):
        raise ValueError("give exactly one of num_blocks and kv_bytes")
    groups, group_size = build_groups(geometry)
    pages = [g.spec.page_bytes(block_size) for g in groups]
    page = max(pages)
    block_bytes = page * group_size
    if num_blocks is None:
        assert kv_bytes is not None
        num_blocks = kv_bytes // block_bytes
    if num_blocks < 2:
        raise ValueError(
            f"the KV budget holds {num_blocks} block(s) of {block_bytes:,} bytes; need at least 2: "
            "give the cache more memory or use a smaller block_size"
        )
    usable = num_blocks - 1
    reports = []
    per_request = 0
    used_bytes = 0
    for i, (g, p) in enumerate(zip(groups, pages, strict=True)):
        need = g.spec.max_blocks(max_model_len, block_size, max_num_batched_tokens)
        per_request += need
        used_bytes += p * g.num_layers * need
        pad = 100.0 * (page - p) / page
        if pad > 0:
            logger.info(
                "KV group %d (%s): page of %d B padded to %d B (%.1f%% padding)",
                i,
                g.spec.kind,
                p,
                page,
                pad,
            )
        reports.append(
            GroupReport(
                i,
                g.spec.kind,
                g.num_layers,
                p,
                page,
                round(pad, 2),
                need,
                usable // need if need else 0,
            )
        )
    total_padding = 100.0 * (1 - used_bytes / (block_bytes * per_request)) if per_request else 0.0
    return CapacityReport(
        model=geometry.name,
        block_size=block_size,
        num_blocks=num_blocks,
        usable_blocks=usable,
        block_bytes=block_bytes,
        tokens=context_tokens(
            groups,
            usable_blocks=usable,
            block_size=block_size,
            max_num_batched_tokens=max_num_batched_tokens,
        ),
        max_model_len=max_model_len,
        blocks_per_request=per_request,
        max_concurrency=usable // per_request if per_request else 0,
        groups=reports,
        padding_percent=round(total_padding, 2),
    )


def context_tokens(
    groups: tuple[KVCacheGroup, ...] | list[KVCacheGroup],
    *,
    usable_blocks: int,
    block_size: int,
    max_num_batched_tokens: int,
) -> int:
    """The longest context one request holds with the pool to itself: the largest
    T <= usable_blocks * block_size whose blocks over all groups
    (`spec.max_blocks(T, ...)`, non-decreasing in T) fit in usable_blocks; 0 when
    not even one token fits."""

    def fits(t: int) -> bool:
        need = sum(g.spec.max_blocks(t, block_size, max_num_batched_tokens) for g in groups)
        return need <= usable_blocks

    lo, hi = 0, usable_blocks * block_size
    if fits(hi):
        return hi
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def kv_cache_config(
    geometry: ModelGeometry, block_size: int, num_blocks: int, **kwargs: Any
) -> KVCacheConfig:
    groups, _ = build_groups(geometry)
    return KVCacheConfig(block_size=block_size, num_blocks=num_blocks, groups=groups, **kwargs)


def geometry_blocks(
    groups: tuple[KVCacheGroup, ...], num_tokens: int, block_size: int, max_chunk: int
) -> list[int]:
    """Per group, the blocks the formula allows a request of `num_tokens`."""
    return [g.spec.max_blocks(num_tokens, block_size, max_chunk) for g in groups]


class PoolTooSmall(ValueError):
    """`simulate_request`: the simulated request needs more blocks than the pool's
    usable ones (`need`, `usable`)."""

    def __init__(self, num_tokens: int, need: int, usable: int) -> None:
        super().__init__(
            f"one request of {num_tokens:,} tokens needs {need:,} blocks but the pool has "
            f"{usable:,} usable blocks: give the pool more blocks or simulate a shorter request"
        )
        self.need = need
        self.usable = usable


@dataclass
class SimulationReport:
    prompt_tokens: int
    decode_tokens: int
    chunk: int
    steps: int
    peak_blocks_held: dict[str, int]
    geometry_blocks: dict[str, int]
    leak_violations: int
    preemptions: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def simulate_request(
    groups: tuple[KVCacheGroup, ...],
    *,
    block_size: int,
    num_blocks: int,
    prompt_tokens: int,
    chunk: int,
    decode_tokens: int,
    seed: int = 0,
) -> SimulationReport:
    """Run one request of `prompt_tokens` + `decode_tokens` through the real
    scheduler and KV manager (fake executor, simulated KV checked every step);
    record the most blocks it held per group against the formula's bound for
    its full length. Raises PoolTooSmall when the pool cannot hold the request."""
    import random

    from spur.actors.engine.core.fake_executor import FakeExecutor
    from spur.actors.engine.core.scheduler import Scheduler, SchedulerConfig
    from spur.actors.step import SamplingParams

    kv_config = KVCacheConfig(block_size=block_size, num_blocks=num_blocks, groups=groups)
    total = prompt_tokens + decode_tokens
    max_model_len = total + 1
    need = sum(geometry_blocks(groups, max_model_len, block_size, chunk))
    if need > num_blocks - 1:  # the scheduler's own refusal would name max_model_len
        raise PoolTooSmall(prompt_tokens + max(1, decode_tokens), need, num_blocks - 1)
    sched = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=chunk,
            max_num_seqs=1,
            max_model_len=max_model_len,
            long_prefill_token_threshold=0,
            policy="fcfs",
            check_kv_bounds=True,
        ),
        kv_config,
    )
    # The fake checks every cached read; for very long prompts that is most
    # of the time, so keep it on only when it stays cheap.
    executor = FakeExecutor(kv_config, simulate_kv=total <= 20_000)
    rng = random.Random(seed)
    prompt = [rng.randrange(32_000) for _ in range(prompt_tokens)]
    # decode_tokens 0: the prefill and its one token (a request makes at least one)
    req = sched.make_request(
        "sim", prompt, SamplingParams(max_tokens=max(1, decode_tokens), ignore_eos=True)
    )
    sched.add_request(req)
    peak = [0] * len(groups)
    steps = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        for g, held in enumerate(sched.kv.num_held("sim")):
            peak[g] = max(peak[g], held)
        sched.update_from_output(out, executor.execute_model(out))
        steps += 1
    sched.check_integrity()
    names = [f"{i}:{g.spec.kind}" for i, g in enumerate(groups)]
    bound = geometry_blocks(groups, total, block_size, chunk)
    return SimulationReport(
        prompt_tokens=prompt_tokens,
        decode_tokens=decode_tokens,
        chunk=chunk,
        steps=steps,
        peak_blocks_held={**dict(zip(names, peak, strict=True)), "total": sum(peak)},
        geometry_blocks={**dict(zip(names, bound, strict=True)), "total": sum(bound)},
        leak_violations=sched.kv.leaks.num_violations,
        preemptions=sched.total_preemptions,
    )
