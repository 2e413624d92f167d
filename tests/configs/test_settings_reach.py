"""Every setting of the config tree reaches the component it configures.

The tree is walked (`leaf_paths`), so a field added to the schema fails
`test_every_setting_is_checked` until it gets an entry below:

- ENGINE: the fields of `EngineConfig` (under `lanes[].engine` and `spare.engine`): a
  non-default value each, set together on one engine that is really built on CPU from
  a tiny random model (the cluster's path: `cluster.app.engine_args` -> `EngineReplica`
  -> `build_engine`), then read back from the scheduler, the KV manager, the worker or
  the tokenizer that uses it.
- PROJECTED: engine fields that cannot take effect on this machine (CUDA, worker
  processes): checked in the worker config the executor would be given.
- OUTSIDE: fields that configure something other than the engine (Serve deployments,
  the ingress, the Ray connection, the API keys): each with its own assertion on the
  object built by the functions `cluster.app` / `cluster.server` use.

Ray is not started: the Serve application is built (`build_app`, not run), the
ingress object is constructed with its KV-index handle replaced (the one Ray actor it
would create), and `cluster.server.start` runs against recorders of `ray.init` /
`serve.start` / `serve.run`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import BaseModel

from spur.configs.engine_args import engine_paths, flat_engine_args
from spur.configs.schema import EngineConfig, SpurConfig

pytestmark = pytest.mark.timeout(300)

# -- the walk -----------------------------------------------------------------------------


def _section(annotation: Any) -> type[BaseModel] | None:
    """The model class of a section field (`X`, `X | None` or `list[X]`), else None."""
    for candidate in (annotation, *getattr(annotation, "__args__", ())):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def leaf_paths(model: type[BaseModel] = SpurConfig, prefix: str = "") -> list[str]:
    """Dotted paths of every leaf field under `model` (lists of sections as `name[]`);
    the fields of an `EngineConfig` are named `engine.<section>.<field>` wherever the
    engine sits (lanes and spare build it with the same function)."""
    out = []
    for name, info in model.model_fields.items():
        sub = _section(info.annotation)
        is_list = getattr(info.annotation, "__origin__", None) is list
        path = f"{prefix}{name}{'[]' if is_list and sub is not None else ''}"
        if sub is EngineConfig:
            out += leaf_paths(sub, "engine.")
        elif sub is not None:
            out += leaf_paths(sub, f"{path}.")
        else:
            out.append(path)
    return sorted(set(out))


# -- a tiny model with a tokenizer of its own ---------------------------------------------

GEN_DEFAULTS = {"temperature": 0.0, "top_k": 7, "max_new_tokens": 6}
"""The tiny model's recommended sampling (its generation_config.json): the offline LLM
takes them (generation_config auto, the default); the replica, under "vllm", does not."""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> types.SimpleNamespace:
    """A random 2-layer Llama (no tokenizer files) whose generation_config.json
    recommends sampling defaults (GEN_DEFAULTS), and, in another folder, a word-level
    tokenizer of 64 tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("settings_reach")
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=256,
    )
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(root / "model")
    gen_file = root / "model" / "generation_config.json"
    gen_file.write_text(json.dumps({**json.loads(gen_file.read_text()), **GEN_DEFAULTS}))
    vocab = {"<unk>": 0, "</s>": 1, **{f"w{i}": i + 2 for i in range(62)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="</s>")
    fast.save_pretrained(root / "tokenizer")
    return types.SimpleNamespace(model=root / "model", tokenizer=root / "tokenizer")


# -- engine fields ------------------------------------------------------------------------

Check = Callable[[Any], tuple[Any, Any]]
"""(built) -> (what arrived, what was set)."""


def _worker(b: Any) -> Any:
    return b.replica.built.executor.worker


def _sched(b: Any) -> Any:
    return b.replica.built.scheduler


async def _stop_replica_engine(b: Any) -> None:
    """The replica's engine belongs to the event loop that made it: stop it, so that the
    next test (another loop) starts its own."""
    if b.replica.engine is not None:
        await b.replica.engine.shutdown()
        b.replica.engine = None
    if b.replica._watcher is not None:
        b.replica._watcher.cancel()


def _streamed(b: Any) -> tuple[Any, Any]:
    """stream_interval 3: the replica's engine has it, and a streamed request's deltas
    after the first hold 3 tokens or more (but the last)."""

    async def stream() -> tuple[int, list[int]]:
        payload = {
            "request_id": "reach-stream-interval",
            "prompt_token_ids": [5, 6, 7],
            "sampling_params": {"max_tokens": 10, "ignore_eos": True, "temperature": 0},
        }
        try:
            sizes = [
                len(item["token_ids"])
                async for item in b.replica.generate(payload)
                if item["type"] == "delta"
            ]
            return b.replica.engine.stream_interval, sizes
        finally:
            await _stop_replica_engine(b)

    interval, sizes = asyncio.run(stream())
    grouped = sum(sizes) == 10 and all(n >= 3 for n in sizes[1:-1])
    return (interval, grouped, sizes), (3, True, sizes)


def _step_timeout(b: Any) -> tuple[Any, Any]:
    """step_timeout_s 123: the replica's engine has it (`AsyncEngine.stuck`)."""

    async def timeout() -> float | None:
        try:
            return b.replica._engine().step_timeout_s
        finally:
            await _stop_replica_engine(b)

    return asyncio.run(timeout()), 123.0


ENGINE: dict[str, tuple[Any, Check]] = {
    # model
    "engine.model.path": (
        None,  # the tiny model's folder
        lambda b: (Path(b.replica.built.info.model_dir).resolve(), b.tiny.model.resolve()),
    ),
    "engine.model.dtype": (
        "bfloat16",
        lambda b: (next(_worker(b).runner.model.parameters()).dtype, torch.bfloat16),
    ),
    # Explicit: the served dtype itself (so the weights stay bfloat16 on any CPU; "auto"
    # widens them to float32 where the CPU has no native bfloat16).
    "engine.model.compute_dtype": (
        "bfloat16",
        lambda b: (
            (_worker(b).config.compute_dtype, b.replica.built.info.compute_dtype),
            ("bfloat16", "bfloat16"),
        ),
    ),
    # "vllm": the file's defaults (GEN_DEFAULTS) are ignored; only the override's are left
    "engine.model.generation_config": (
        "vllm",
        lambda b: (b.replica.built.sampling_defaults.values.get("top_k"), None),
    ),
    "engine.model.override_generation_config": (
        {"temperature": 0.5, "max_new_tokens": 9},
        lambda b: (
            b.replica.built.sampling_defaults.to_dict(),
            {"values": {"temperature": 0.5, "max_tokens": 9}, "max_tokens_cap": 9},
        ),
    ),
    "engine.model.max_model_len": (96, lambda b: (_sched(b).config.max_model_len, 96)),
    "engine.model.tokenizer": (
        None,  # the tokenizer folder
        lambda b: (b.replica.tokenizer and len(b.replica.tokenizer), 64),
    ),
    # cache
    "engine.cache.block_size": (
        8,
        lambda b: ((_sched(b).kv.config.block_size, _worker(b).runner.block_size), (8, 8)),
    ),
    "engine.cache.num_kv_blocks": (
        40,
        lambda b: ((_sched(b).kv.pool.num_blocks, _worker(b).runner.num_blocks), (40, 40)),
    ),
    "engine.cache.kv_cache_bytes": (
        2 * 1024**2,  # its own engine (exclusive with num_kv_blocks): see the LLM test
        lambda b: (b.llm_num_blocks, b.llm_expected_blocks),
    ),
    "engine.cache.kv_cache_dtype": (
        "float16",
        lambda b: (_worker(b).runner.kv_dtype, torch.float16),
    ),
    "engine.cache.enable_prefix_caching": (
        False,
        lambda b: (_sched(b).kv.config.enable_prefix_caching, False),
    ),
    # Used on CUDA only (sizing from free device memory): it reaches the worker.
    "engine.cache.gpu_memory_utilization": (
        0.5,
        lambda b: (_worker(b).config.gpu_memory_utilization, 0.5),
    ),
    "engine.cache.hash_seed": ("reach", lambda b: (_sched(b).kv.config.hash_seed, "reach")),
    # Hybrid models only (recurrent states): it reaches the worker's runner.
    "engine.cache.state_dtype": ("bfloat16", lambda b: (_worker(b).config.state_dtype, "bfloat16")),
    # scheduler
    "engine.scheduler.max_num_batched_tokens": (
        256,
        lambda b: (
            (_sched(b).config.max_num_batched_tokens, _worker(b).config.max_num_batched_tokens),
            (256, 256),
        ),
    ),
    "engine.scheduler.max_num_seqs": (7, lambda b: (_sched(b).config.max_num_seqs, 7)),
    "engine.scheduler.long_prefill_token_threshold": (
        32,
        lambda b: (_sched(b).config.long_prefill_token_threshold, 32),
    ),
    "engine.scheduler.policy": ("priority", lambda b: (_sched(b).config.policy, "priority")),
    "engine.scheduler.check_kv_bounds": (
        False,
        lambda b: (_sched(b).config.check_kv_bounds, False),
    ),
    # runtime
    "engine.runtime.attn_backend": (
        "torch",
        lambda b: (_worker(b).config.attn_backend, "torch"),
    ),
    "engine.runtime.seed": (5, lambda b: (_worker(b).config.seed, 5)),
    "engine.runtime.num_threads": (1, lambda b: (_worker(b).config.num_threads, 1)),
    "engine.runtime.stream_interval": (3, _streamed),
    "engine.runtime.step_timeout_s": (123.0, _step_timeout),
    # CUDA graphs are captured on CUDA only (a log line on CPU): they reach the worker.
    "engine.runtime.cuda_graphs": (False, lambda b: (_worker(b).config.cuda_graphs, False)),
    "engine.runtime.cuda_graph_batch_sizes": (
        [1, 2],
        lambda b: (_worker(b).config.cuda_graph_batch_sizes, (1, 2)),
    ),
    "engine.runtime.test_leak_blocks_per_step": (
        1,  # a broken retirement: the KV manager's allocate_slots is wrapped
        lambda b: (_sched(b).kv.allocate_slots.__name__, "leaky"),
    ),
    # speculative (the section itself is optional: set, it turns speculation on)
    "engine.speculative.method": (
        "ngram",  # the only method: checked to arrive
        lambda b: (_sched(b).proposer.config.method, "ngram"),
    ),
    "engine.speculative.num_speculative_tokens": (
        3,
        lambda b: (_sched(b).proposer.config.num_speculative_tokens, 3),
    ),
    "engine.speculative.prompt_lookup_min": (
        1,
        lambda b: (_sched(b).proposer.config.prompt_lookup_min, 1),
    ),
    "engine.speculative.prompt_lookup_max": (
        3,
        lambda b: (_sched(b).proposer.config.prompt_lookup_max, 3),
    ),
    "engine.speculative.disable_by_batch_size": (
        5,
        lambda b: (_sched(b).proposer.config.disable_by_batch_size, 5),
    ),
}

PROJECTED: dict[str, tuple[Any, str, Callable[[Any], tuple[Any, Any]]]] = {
    "engine.parallelism.tensor_parallel_size": (
        2,
        "worker processes (tests/worker/test_llm.py builds TP=2)",
        lambda w: (w.tensor_parallel_size, 2),
    ),
    "engine.parallelism.device": ("cuda", "no GPU here", lambda w: (w.device, "cuda")),
}
"""Engine fields whose effect needs hardware or processes this test does not start:
checked in the `WorkerConfig` the executor would get."""


def _engine_tree(tiny: Any) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, (value, _) in ENGINE.items():
        if path == "engine.cache.kv_cache_bytes":
            continue  # exclusive with num_kv_blocks
        _, section, name = path.split(".")
        tree.setdefault(section, {})[name] = value
    tree["model"]["path"] = str(tiny.model)
    tree["model"]["tokenizer"] = str(tiny.tokenizer)
    return tree


def test_every_setting_is_checked() -> None:
    """A new field of the schema fails here until it has an entry (ENGINE, PROJECTED
    or OUTSIDE, whose own assertions run in the tests below)."""
    covered = set(ENGINE) | set(PROJECTED) | set(OUTSIDE)
    leaves = set(leaf_paths())
    assert leaves - covered == set(), "settings no test checks: add them to this file"
    assert covered - leaves == set(), "entries for settings the schema no longer has"
    # Every engine leaf has a flat name (EngineArgs field) and non-default values differ.
    flat = {f"engine.{s}.{n}" for s, n in engine_paths().values()}
    assert flat == {p for p in leaves if p.startswith("engine.")}
    for path, (value, _) in ENGINE.items():
        _, section, name = path.split(".")
        field = EngineConfig.model_fields[section]
        default = _section(field.annotation).model_fields[name].default  # type: ignore[union-attr]
        if value is not None and name != "method":  # method has a single valid value
            assert value != default, f"{path}: pick a non-default value"


def test_no_engine_component_declares_a_default_of_its_own() -> None:
    """The schema is the one source: the builder's EngineArgs has no defaults, the
    scheduler's config none for the schema's settings, and the engine-side dataclasses
    that keep defaults (for their unit tests) keep the schema's."""
    from spur.actors.builder import EngineArgs
    from spur.actors.engine.core.kv_cache_manager import KVCacheConfig
    from spur.actors.engine.core.scheduler import SchedulerConfig
    from spur.actors.engine.core.spec_decode import SpeculativeConfig
    from spur.actors.worker.worker import WorkerConfig

    fields = {f.name: f for f in dataclasses.fields(EngineArgs)}
    assert set(fields) == set(engine_paths())
    assert [n for n, f in fields.items() if f.default is not dataclasses.MISSING] == []
    schema_names = set(engine_paths())
    own = [
        f.name
        for f in dataclasses.fields(SchedulerConfig)
        if f.name in schema_names and f.default is not dataclasses.MISSING
    ]
    assert own == [], f"engine core SchedulerConfig declares defaults for {own}"
    defaults = flat_engine_args(EngineConfig())
    for cls in (WorkerConfig, KVCacheConfig, SpeculativeConfig):
        for f in dataclasses.fields(cls):
            if f.name in defaults and f.default is not dataclasses.MISSING:
                assert f.default == defaults[f.name], f"{cls.__name__}.{f.name}"


@pytest.fixture(scope="module")
def built(tiny: Any) -> Any:
    """One engine replica built from a config whose every ENGINE field is non-default,
    the way the cluster builds it (`engine_args` of the lane -> EngineReplica)."""
    from spur.actors.engine.shell.actor import EngineReplica
    from spur.actors.llm import LLM
    from spur.cluster.app import engine_args

    torch.set_num_threads(1)
    engine = EngineConfig.model_validate(_engine_tree(tiny))
    replica = EngineReplica(engine_args(engine), "chat")
    # kv_cache_bytes sizes the pool (exclusive with num_kv_blocks), and the tokenizer
    # again: through the offline LLM(...).
    llm = LLM(
        str(tiny.model),
        kv_cache_bytes=ENGINE["engine.cache.kv_cache_bytes"][0],
        tokenizer=str(tiny.tokenizer),
    )
    try:
        yield types.SimpleNamespace(
            tiny=tiny,
            engine=engine,
            replica=replica,
            llm=llm,
            llm_num_blocks=llm.scheduler.kv.pool.num_blocks,
            llm_expected_blocks=ENGINE["engine.cache.kv_cache_bytes"][0]
            // llm.info.kv_bytes_per_block,
        )
    finally:
        llm.shutdown()
        replica.built.shutdown()


@pytest.mark.parametrize("path", sorted(ENGINE))
def test_engine_setting_reaches_the_engine(built: Any, path: str) -> None:
    arrived, wanted = ENGINE[path][1](built)
    assert arrived == wanted, f"{path}: set {wanted!r}, the engine has {arrived!r}"


@pytest.mark.parametrize("path", sorted(PROJECTED))
def test_projected_engine_setting_reaches_the_worker_config(path: str) -> None:
    from spur.actors.builder import EngineArgs

    value, _, check = PROJECTED[path]
    _, section, name = path.split(".")
    engine = EngineConfig.model_validate({section: {name: value}})
    arrived, wanted = check(EngineArgs.from_config(engine).worker_config())
    assert arrived == wanted
    # "auto" (the default) runs on the CPU: Ray reserves no GPU for it.
    assert EngineArgs.from_config(EngineConfig()).worker_config().device == "cpu"


def test_tokenizer_reaches_llm_and_the_ingress(
    built: Any, tiny: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """model.tokenizer: the offline LLM and the ingress (which loads the folder its
    engines report) tokenize with it, not with the model folder's (it has none). An
    ingress on another node than the engine (on Kubernetes: another pod), where the
    reported folder does not exist, loads a copy of the files the engine sends."""
    from spur.actors.builder import load_tokenizer
    from spur.cluster.ingress import Ingress
    from spur.cluster.lanes import Lane

    assert load_tokenizer(str(tiny.model)) is None  # the model folder has none
    assert built.llm.tokenizer is not None, "LLM(tokenizer=...) loaded no tokenizer"
    assert built.llm.encode("w3 w4") == [5, 6]
    monkeypatch.setenv("SPUR_CACHE_DIR", str(tmp_path))
    sent: list[int] = []

    async def ingress_lanes() -> tuple[Any, Any]:
        stats = await built.replica.stats()
        await built.replica.engine.shutdown()
        built.replica.engine = None  # it belonged to this event loop
        if built.replica._watcher is not None:
            built.replica._watcher.cancel()
        elsewhere = {**stats, "tokenizer_dir": str(tmp_path / "on-the-engine-pod-only")}

        async def tokenizer_files() -> dict[str, bytes]:
            sent.append(1)
            return await built.replica.tokenizer_files()

        def ingress(reported: dict[str, Any]) -> Any:
            async def _stats(name: str, timeout_s: float = 10.0, *, quiet: bool = False) -> Any:
                return reported

            handle = types.SimpleNamespace(
                tokenizer_files=types.SimpleNamespace(remote=tokenizer_files)
            )
            fake = types.SimpleNamespace(
                selector=types.SimpleNamespace(spare_of={}),
                draining=None,
                _stats=_stats,
                lanes={"chat": types.SimpleNamespace(handle=handle)},
            )
            fake._engine_tokenizer = functools.partial(Ingress._engine_tokenizer, fake)
            return fake

        lanes = []
        for reported in (stats, elsewhere):
            lane = Lane("chat", None, {"block_size": 8, "hash_seed": "reach"})
            await Ingress._init_lane(ingress(reported), lane)  # type: ignore[arg-type]
            lanes.append(lane)
        return lanes[0], lanes[1]

    lane, remote = asyncio.run(ingress_lanes())
    assert lane.tokenizer("w3 w4")["input_ids"] == [5, 6]
    assert remote.tokenizer("w3 w4")["input_ids"] == [5, 6]
    assert sent == [1]  # only the ingress that lacked the folder asked for it
    [copy] = (tmp_path / "tokenizers").iterdir()
    assert {f.name for f in copy.iterdir()} == {f.name for f in tiny.tokenizer.iterdir()}
    assert lane.max_model_len == 96
    # the replica's sampling defaults (generation_config vllm + the override) reach the lane
    assert lane.sampling_defaults == built.replica.built.sampling_defaults
    assert lane.sampling_defaults.max_tokens(None, 50) == 9


def test_generation_config_reaches_llm_generate(built: Any) -> None:
    """engine.model.generation_config auto (the default): `LLM.generate` without params
    samples with the model's recommended defaults (GEN_DEFAULTS): greedy, top_k 7, 6
    tokens, the same as those params passed explicitly."""
    from spur.actors.step import SamplingParams

    p = built.llm.get_default_sampling_params()
    assert (p.temperature, p.top_k, p.max_tokens, p.top_p) == (0.0, 7, 6, 1.0)
    (default,) = built.llm.generate(["w3 w4 w5"])
    explicit = SamplingParams(temperature=0.0, top_k=7, max_tokens=6)
    (same,) = built.llm.generate(["w3 w4 w5"], explicit)
    assert default.outputs[0].token_ids == same.outputs[0].token_ids
    assert 1 <= len(default.outputs[0].token_ids) <= 6
    long = built.llm.generate(["w3 w4 w5"], SamplingParams(max_tokens=20, ignore_eos=True))
    assert len(long[0].outputs[0].token_ids) == 20  # a request's own params win
    streamed = [t for d in built.llm.stream("w3 w4 w5") for t in d.token_ids]
    assert streamed == list(default.outputs[0].token_ids)  # stream() without params too


def test_a_bad_generation_config_stops_the_engine_naming_the_file(
    tiny: Any, tmp_path: Path
) -> None:
    """A value out of range in the model's generation_config.json: `LLM(...)` (and so
    an engine replica) refuses to start, naming the file, the key and the fix."""
    import shutil

    from spur.actors.llm import LLM

    model = tmp_path / "model"
    shutil.copytree(tiny.model, model)
    gen_file = model / "generation_config.json"
    gen_file.write_text(json.dumps({**GEN_DEFAULTS, "top_p": 1.5}))
    with pytest.raises(ValueError) as info:
        LLM(str(model), num_kv_blocks=16, tokenizer=str(tiny.tokenizer))
    message = str(info.value)
    assert str(gen_file) in message and "top_p" in message
    assert "generation_config: vllm" in message
    # the way out the message names: the file is ignored, the engine starts
    llm = LLM(str(model), num_kv_blocks=16, tokenizer=str(tiny.tokenizer), generation_config="vllm")
    try:
        assert llm.get_default_sampling_params().top_p == 1.0
    finally:
        llm.shutdown()


# -- settings outside the engine ----------------------------------------------------------

KEYS_ENV = "SPUR_SETTINGS_REACH_KEYS"


def _deployments(app: Any) -> dict[str, Any]:
    ingress = app._bound_deployment
    engines, _ = ingress.init_args
    out = {"ingress": ingress}
    out.update({name: a._bound_deployment for name, a in engines.items()})
    return out


def _cfg(d: Any, name: str) -> Any:
    return d[name]._deployment_config


def _engine_options(d: Any, name: str) -> dict[str, Any]:
    return d[name].init_args[3]  # (engine_args, lane, routing, lane_options)


def _target(name: str, value: float) -> Callable[[Any], tuple[Any, Any]]:
    """An autoscaling target: reported by the lane's engine replicas to the policy."""
    return lambda o: (_engine_options(o.d, "code")["autoscaling_targets"][f"target_{name}"], value)


def _weight(name: str, value: float) -> Callable[[Any], tuple[Any, Any]]:
    """A router weight: given to the lane's Serve request router."""
    return lambda o: (
        _cfg(o.d, "chat").request_router_config.request_router_kwargs["weights"][name],
        value,
    )


OUTSIDE: dict[str, tuple[Any, Callable[[Any], tuple[Any, Any]]]] = {
    "version": (1, lambda o: (o.version_2_refused, True)),  # one valid value: 2 is refused
    # lanes ("chat" has replicas, "code" autoscaling: they exclude each other)
    "lanes[].name": (
        "chat",
        lambda o: ((o.d["chat"].name, "chat" in o.ingress.lanes), ("engine-chat", True)),
    ),
    "lanes[].served_model_names": (
        ["chat-a", "chat-b"],
        lambda o: (
            {m: o.ingress.model_to_lane[m] for m in ("chat-a", "chat-b")},
            {"chat-a": "chat", "chat-b": "chat"},
        ),
    ),
    "lanes[].replicas": (3, lambda o: (_cfg(o.d, "chat").num_replicas, 3)),
    "lanes[].drain_timeout_s": (
        12.0,
        lambda o: (
            (
                _engine_options(o.d, "chat")["drain_timeout_s"],
                _cfg(o.d, "chat").graceful_shutdown_timeout_s,
            ),
            (12.0, 22.0),
        ),
    ),
    "lanes[].resources": (
        {"lane-chat": 1.0},
        lambda o: (o.d["chat"].ray_actor_options["resources"], {"lane-chat": 1.0}),
    ),
    "lanes[].max_ongoing_requests": (
        100,
        lambda o: (_cfg(o.d, "chat").max_ongoing_requests, 100),
    ),
    "lanes[].max_queued_requests": (
        50,
        lambda o: ((_cfg(o.d, "chat").max_queued_requests, o.ingress.hold_limit["chat"]), (50, 50)),
    ),
    "lanes[].saturation_queue_threshold": (
        9,
        lambda o: (o.ingress.selector.saturation["chat"], 9),
    ),
    "lanes[].autoscaling.min_replicas": (
        2,
        lambda o: (_cfg(o.d, "code").autoscaling_config.min_replicas, 2),
    ),
    "lanes[].autoscaling.max_replicas": (
        5,
        lambda o: (_cfg(o.d, "code").autoscaling_config.max_replicas, 5),
    ),
    "lanes[].autoscaling.upscale_delay_s": (
        3.0,
        lambda o: (_cfg(o.d, "code").autoscaling_config.upscale_delay_s, 3.0),
    ),
    "lanes[].autoscaling.downscale_delay_s": (
        20.0,
        lambda o: (_cfg(o.d, "code").autoscaling_config.downscale_delay_s, 20.0),
    ),
    "lanes[].autoscaling.look_back_period_s": (
        6.0,
        lambda o: (_cfg(o.d, "code").autoscaling_config.look_back_period_s, 6.0),
    ),
    **{
        f"lanes[].autoscaling.{name}": (value, _target(name, value))
        for name, value in (
            ("target_ongoing_requests", 5.0),
            ("waiting_per_replica_high", 4.0),
            ("kv_usage_high", 0.8),
            ("kv_usage_low", 0.3),
        )
    },
    # spare
    "spare.name": (
        "backup",
        lambda o: ((o.d["backup"].name, "backup" in o.ingress.lanes), ("engine-backup", True)),
    ),
    "spare.serves_lanes": (["chat"], lambda o: (o.ingress.selector.spare_of, {"chat": "backup"})),
    "spare.resources": (
        {"spare": 1.0},
        lambda o: (o.d["backup"].ray_actor_options["resources"], {"spare": 1.0}),
    ),
    "spare.max_ongoing_requests": (
        70,
        lambda o: (_cfg(o.d, "backup").max_ongoing_requests, 70),
    ),
    "spare.max_queued_requests": (
        40,
        lambda o: (
            (_cfg(o.d, "backup").max_queued_requests, o.ingress.hold_limit["backup"]),
            (40, 40),
        ),
    ),
    "spare.drain_timeout_s": (
        7.0,
        lambda o: (_engine_options(o.d, "backup")["drain_timeout_s"], 7.0),
    ),
    # router
    "router.policy": (
        "round_robin",
        lambda o: (
            _cfg(o.d, "chat").request_router_config.request_router_class.rsplit(".", 1)[-1],
            "RoundRobinRouter",
        ),
    ),
    **{
        f"router.{name}": (value, _weight(name, value))
        for name, value in (
            ("load_weight", 2.0),
            ("kv_usage_weight", 3.0),
            ("hot_spot_margin", 4.0),
        )
    },
    "router.affinity_header": ("x-user", lambda o: (o.ingress.router["affinity_header"], "x-user")),
    "router.stats_period_s": (
        0.5,
        lambda o: (
            (
                _cfg(o.d, "chat").request_router_config.request_routing_stats_period_s,
                o.d["chat"].init_args[2]["stats_period_s"],
            ),
            (0.5, 0.5),
        ),
    ),
    "router.max_attempts": (5, lambda o: (o.ingress.router["max_attempts"], 5)),
    "router.failover_healthy_after_s": (
        2.0,
        lambda o: (
            (o.ingress.selector.healthy_after_s, o.index_kwargs["healthy_after_s"]),
            (2.0, 2.0),
        ),
    ),
    # server
    "server.host": ("0.0.0.0", lambda o: (o.serve_start["http_options"]["host"], "0.0.0.0")),
    "server.port": (8123, lambda o: (o.serve_start["http_options"]["port"], 8123)),
    "server.ray_address": ("10.0.0.1:6379", lambda o: (o.ray_join["address"], "10.0.0.1:6379")),
    "server.namespace": (
        "reach",
        lambda o: ((o.ray_init["namespace"], o.ray_join["namespace"]), ("reach", "reach")),
    ),
    "server.object_store_memory": (
        100 * 1024**2,
        lambda o: (o.ray_init["object_store_memory"], 100 * 1024**2),
    ),
    "server.num_cpus": (3, lambda o: (o.ray_init["num_cpus"], 3)),
    "server.ingress_replicas": (2, lambda o: (_cfg(o.d, "ingress").num_replicas, 2)),
    "server.ingress_resources": (
        {"head": 1.0},
        lambda o: (o.d["ingress"].ray_actor_options["resources"], {"head": 1.0}),
    ),
    "server.data_plane": ("object_ref", lambda o: (o.ingress.by_reference, True)),
    "server.metrics": (
        False,
        lambda o: ((o.ingress.metrics_on, o.d["chat"].init_args[2]["metrics"]), (False, False)),
    ),
    "server.auth.keys_env": (
        KEYS_ENV,
        lambda o: (o.ingress.guard.check("/v1/models", "Bearer sk-env-reach").name, "from-env"),
    ),
    "server.auth.keys_file": (
        None,  # a temporary file
        lambda o: (o.ingress.guard.check("/v1/models", "Bearer sk-file-reach").name, "from-file"),
    ),
    "server.auth.require_keys": (True, lambda o: (o.keyless_ingress_refused, True)),
    "server.auth.open_paths": (
        ["/health"],
        lambda o: (o.ingress.guard.open_paths, ("/health",)),
    ),
    "server.auth.default_max_concurrent_requests": (
        3,
        lambda o: (
            o.ingress.guard.check("/v1/models", "Bearer sk-env-reach").max_concurrent_requests,
            3,
        ),
    ),
    "server.auth.default_tokens_per_minute": (
        1000,
        lambda o: (
            o.ingress.guard.check("/v1/models", "Bearer sk-env-reach").tokens_per_minute,
            1000,
        ),
    ),
    "server.requests.max_body_bytes": (8192, lambda o: (o.ingress.max_body_bytes, 8192)),
    "server.requests.max_prompts": (5, lambda o: (o.ingress.max_prompts, 5)),
    "server.requests.tokenizer_threads": (3, lambda o: (o.ingress.pool._max_workers, 3)),
    "server.requests.stream_buffer": (11, lambda o: (o.ingress.stream_buffer, 11)),
    "server.requests.cors_allowed_origins": (
        ["http://app.example"],
        lambda o: (o.ingress.cors_origins, ("http://app.example",)),
    ),
}


def _set(tree: dict[str, Any], path: str, value: Any) -> None:
    node: Any = tree
    *parents, leaf = path.replace("[]", "").split(".")
    for part in parents:
        if isinstance(node, list):
            node = node[0]
        node = node.setdefault(part, {})
    if isinstance(node, list):
        node = node[0]
    node[leaf] = value


def _outside_tree(tmp_path: Path) -> dict[str, Any]:
    tree: dict[str, Any] = {
        "lanes": [{"name": "chat"}, {"name": "code", "autoscaling": {"max_replicas": 5}}],
        "spare": {"serves_lanes": ["chat"]},
    }
    keys_file = tmp_path / "keys.yaml"
    keys_file.write_text("keys:\n  - {key: sk-file-reach, name: from-file}\n")
    for path, (value, _) in OUTSIDE.items():
        if path == "server.ray_address":
            continue  # joining a cluster: the second start below
        if path.startswith("lanes[].autoscaling."):
            tree["lanes"][1]["autoscaling"][path.rsplit(".", 1)[1]] = value
            continue
        _set(tree, path, str(keys_file) if path == "server.auth.keys_file" else value)
    return tree


@pytest.fixture
def outside(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    import ray
    from ray import serve

    from spur.cluster import metrics as M
    from spur.cluster import server as server_mod
    from spur.cluster.app import build_app
    from spur.cluster.auth import AuthConfigError, install_guard
    from spur.cluster.ingress import Ingress
    from spur.configs.loader import config_to_dict

    monkeypatch.setenv(KEYS_ENV, "keys:\n  - {key: sk-env-reach, name: from-env}\n")
    monkeypatch.delenv("RAY_SERVE_PROXY_USE_GRPC", raising=False)  # start() may set it
    cfg = SpurConfig.model_validate(_outside_tree(tmp_path))
    d = _deployments(build_app(cfg))

    # The ingress, constructed as Serve would (its class under the ASGI wrapper), with
    # the KV-index handle (a Ray actor) recorded instead of created.
    cls = Ingress.__mro__[1]
    index_kwargs: dict[str, Any] = {}
    monkeypatch.setitem(cls.__init__.__globals__, "get_index", lambda kw: index_kwargs.update(kw))
    ingress = cls.__new__(cls)
    cls.__init__(ingress, dict.fromkeys(["chat", "code", "backup"]), config_to_dict(cfg))
    ingress.pool.shutdown()
    # The same ingress on a node without the keys: require_keys makes it refuse to start.
    keyless = config_to_dict(cfg)
    keyless["server"]["auth"]["keys_file"] = None
    with monkeypatch.context() as env:
        env.delenv(KEYS_ENV)
        try:
            cls.__init__(cls.__new__(cls), dict.fromkeys(["chat", "code", "backup"]), keyless)
            keyless_refused = False
        except AuthConfigError:
            keyless_refused = True

    # cluster.server.start against recorders of Ray's entry points.
    calls: list[tuple[str, dict[str, Any]]] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(("init", kw)))
    monkeypatch.setattr(serve, "start", lambda **kw: calls.append(("start", kw)))
    monkeypatch.setattr(serve, "run", lambda *a, **kw: None)
    server_mod.start(cfg)
    joined = cfg.model_copy(deep=True)
    joined.server.ray_address = OUTSIDE["server.ray_address"][0]
    server_mod.start(joined)
    inits = [kw for name, kw in calls if name == "init"]

    try:
        SpurConfig.model_validate({**_outside_tree(tmp_path), "version": 2})
        refused = False
    except ValueError:
        refused = True
    yield types.SimpleNamespace(
        d=d,
        ingress=ingress,
        index_kwargs=index_kwargs,
        ray_init=inits[0],
        ray_join=inits[1],
        serve_start=next(kw for name, kw in calls if name == "start"),
        version_2_refused=refused,
        keyless_ingress_refused=keyless_refused,
    )
    # The ingress installs process-wide state (its key guard, the HTTP metrics switch).
    install_guard(None)
    M.HTTP.enabled = True


def test_settings_outside_the_engine_reach_their_component(outside: Any) -> None:
    wrong = {}
    for path, (_, check) in sorted(OUTSIDE.items()):
        arrived, wanted = check(outside)
        if arrived != wanted:
            wrong[path] = (arrived, wanted)
    assert wrong == {}, "setting -> (arrived, set)"


def test_every_lane_and_the_spare_get_their_whole_engine(tmp_path: Path) -> None:
    """Lanes and the spare hand their engine to the replica through one function,
    with every field (so the ENGINE checks hold for each of them)."""
    from spur.cluster.app import build_app

    cfg = SpurConfig.model_validate(
        {
            "lanes": [{"name": "chat", "engine": {"scheduler": {"max_num_seqs": 3}}}],
            "spare": {"serves_lanes": ["chat"], "engine": {"cache": {"block_size": 32}}},
        }
    )
    d = _deployments(build_app(cfg))
    for name, engine in (("chat", cfg.lanes[0].engine), ("spare", cfg.spare.engine)):  # type: ignore[union-attr]
        assert d[name].init_args[0] == flat_engine_args(engine)
    assert d["chat"].init_args[0]["max_num_seqs"] == 3
    assert d["spare"].init_args[0]["block_size"] == 32


def test_spur_generate_takes_a_lanes_engine_and_its_flags(tmp_path: Path) -> None:
    """`spur generate --config F --lane L`: every engine field of the lane (the same
    function as the cluster), then the flags given; without --config the schema's."""
    import yaml

    from spur.cluster.cli import UsageError, _generate_engine_args, build_parser

    path = tmp_path / "two.yaml"
    lanes = [
        {"name": "chat"},
        {"name": "code", "engine": {"scheduler": {"max_num_seqs": 5, "check_kv_bounds": False}}},
    ]
    path.write_text(yaml.safe_dump({"lanes": lanes}))

    def flat(*argv: str) -> dict[str, Any]:
        args = build_parser().parse_args(["generate", "--prompt", "x", *argv])
        return _generate_engine_args(args)

    cfg = SpurConfig.model_validate({"lanes": lanes})
    got = flat("--config", str(path), "--lane", "code", "--dtype", "bfloat16")
    assert got == {**flat_engine_args(cfg.lanes[1].engine), "dtype": "bfloat16"}
    assert got["max_num_seqs"] == 5 and got["check_kv_bounds"] is False
    assert flat("--model", "m") == {"model": "m"}  # the rest: the schema's defaults
    with pytest.raises(UsageError, match="no lane is named 'nope'"):
        flat("--config", str(path), "--lane", "nope")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
