"""Hybrid models (Qwen3.5 dense, Qwen3-Next MoE) end to end through the engine:
GDN states in the paged pool, prefix hits on states, preemption, TP.

The oracle is teacher forcing against transformers' own full forward (fp32): every
token spur generates greedily must be transformers' argmax at that position given
the tokens before it. (transformers' cached `generate` switches from the chunked
to the recurrent delta rule after the prompt; the full forward is the sharper
reference.) The random weights keep the top-2 logit gap far above the ~1e-4
difference between chunked and stepwise fp32 paths; the test checks that margin
so a near-tie would fail loudly as such, not as a wrong token.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from spur.actors.llm import LLM
from spur.actors.step import SamplingParams
from spur.actors.worker.random_models import build_random_model

MODELS = ("qwen3_5-test", "qwen3_next-test")
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
CONFIGS: dict[str, dict[str, Any]] = {
    "one batch": {"num_kv_blocks": 256, "block_size": 16},
    "chunked prefill": {"num_kv_blocks": 256, "block_size": 8, "max_num_batched_tokens": 16},
    "tiny pool (preemption)": {
        "num_kv_blocks": 30,
        "block_size": 4,
        "max_num_batched_tokens": 32,
    },
}
MIN_GAP = 1e-3  # top-2 logit gap below which a position counts as a near-tie


def make_prompts(n: int = 8, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(3, 60))] for _ in range(n)]


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    made: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("hybrid_models")

    def get(name: str) -> Path:
        if name not in made:
            made[name] = build_random_model(name, root / name, seed=1)
        return made[name]

    return get


@pytest.fixture(scope="module")
def hf_forward(hybrid_dir: Callable[[str], Path]) -> Callable[[str, list[int]], torch.Tensor]:
    from transformers import AutoModelForCausalLM

    models: dict[str, Any] = {}

    def run(name: str, ids: list[int]) -> torch.Tensor:
        if name not in models:
            models[name] = AutoModelForCausalLM.from_pretrained(
                hybrid_dir(name), dtype=torch.float32
            ).eval()
        with torch.no_grad():
            return models[name](torch.tensor([ids])).logits[0].float()  # [len, vocab]

    return run


def _generate(path: Path, prompts: list[list[int]], **kwargs: Any) -> dict[str, Any]:
    llm = LLM(str(path), **kwargs)
    try:
        outs = llm.generate(prompts, GREEDY)
        kv = llm.scheduler.kv
        llm.scheduler.check_integrity()
        return {
            "tokens": [o.outputs[0].token_ids for o in outs],
            "hits": kv.prefix_stats.total_hits + kv.prefix_stats.preempted_hits,
            "preemptions": llm.scheduler.total_preemptions,
            "leaks": kv.leaks.num_violations,
            "free": kv.num_free_blocks,
            "total": kv.pool.num_blocks - 1,
            "kinds": [m.spec.kind for m in kv.managers],
        }
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def runs(hybrid_dir: Callable[[str], Path]) -> dict[Any, Any]:
    """Each model through each configuration, every prompt sent twice."""
    torch.set_num_threads(1)
    prompts = make_prompts()
    results = {}
    for name in MODELS:
        for label, kwargs in CONFIGS.items():
            results[name, label] = _generate(hybrid_dir(name), prompts + prompts, **kwargs)
    return {"prompts": prompts + prompts, "results": results}


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("label", list(CONFIGS))
def test_greedy_tokens_match_transformers(runs, hf_forward, name, label):
    res = runs["results"][name, label]
    assert res["kinds"] == ["full", "state", "state"]  # 2 GDN layers per attention layer
    for prompt, out in zip(runs["prompts"], res["tokens"], strict=True):
        assert len(out) == GREEDY.max_tokens
        logits = hf_forward(name, prompt + out)[len(prompt) - 1 : -1]  # [12, vocab]
        top2 = logits.topk(2, dim=-1).values
        assert float((top2[:, 0] - top2[:, 1]).min()) > MIN_GAP, "near-tie: pick other inputs"
        assert out == logits.argmax(-1).tolist(), f"prompt of {len(prompt)} tokens"
    assert res["free"] == res["total"]  # every block back in the pool
    assert res["leaks"] == 0


@pytest.mark.parametrize("name", MODELS)
def test_configurations_agree_and_exercise_the_core(runs, name):
    res = runs["results"]
    base = res[name, "one batch"]["tokens"]
    assert base[:8] == base[8:]  # the copies (state prefix hits, later ones) say the same
    for label in CONFIGS:
        assert res[name, label]["tokens"] == base, label
    assert res[name, "chunked prefill"]["hits"] > 0
    assert res[name, "tiny pool (preemption)"]["hits"] > 0
    assert res[name, "tiny pool (preemption)"]["preemptions"] > 0


def test_state_prefix_hit_equals_cold_run(hybrid_dir):
    """A long shared prefix: the second request starts from the cached state at
    the last matching block boundary and says what a cold engine says."""
    rng = random.Random(7)
    prefix = [rng.randrange(256) for _ in range(150)]
    a, b = [*prefix, 1, 2, 3], [*prefix, 9, 8, 7, 6, 5]
    path = hybrid_dir("qwen3_5-test")
    cold = _generate(path, [b], num_kv_blocks=128, block_size=16)
    llm = LLM(str(path), num_kv_blocks=128, block_size=16)
    try:
        # max_model_len unset: the longest context the pool holds for one request, by
        # hand: 127 usable blocks less the 2 state groups' 2 blocks each, 16 tokens a block
        assert [m.spec.kind for m in llm.scheduler.kv.managers] == ["full", "state", "state"]
        assert llm.scheduler.config.max_model_len == (127 - 2 * 2) * 16
        llm.generate([a], GREEDY)
        (out,) = llm.generate([b], GREEDY)
        assert out.num_cached_tokens == 144  # 9 blocks: the last boundary inside the prefix
        assert out.outputs[0].token_ids == cold["tokens"][0]
        # cache_salt separates tenants for state blocks too
        salted = llm.scheduler.make_request("salted", b, GREEDY, cache_salt="tenant-b").block_hashes
        assert salted[:9] != llm.scheduler.make_request("plain", b, GREEDY).block_hashes[:9]
    finally:
        llm.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_tensor_parallel_2_equals_1(runs, hybrid_dir, name):
    """GDN key/value heads, attention heads, experts' widths split over 2 ranks."""
    prompts = runs["prompts"][:4]
    tp2 = _generate(
        hybrid_dir(name),
        prompts,
        tensor_parallel_size=2,
        num_threads=1,
        **CONFIGS["chunked prefill"],
    )
    assert tp2["tokens"] == runs["results"][name, "one batch"]["tokens"][:4]


LIVE_LENGTHS = (4096, 16384, 40960)
LIVE_CHUNK, LIVE_DECODE, LIVE_BLOCKS = 4096, 4, 2800


@pytest.fixture(scope="module")
def live_capacity(hybrid_dir) -> list[dict[str, Any]]:
    """One request at each length through the real engine; the blocks it holds in
    each group, sampled right after every step's scheduling (as the simulation
    samples them), next to `spur capacity --simulate-prompt` on the same config."""
    import contextlib
    import io
    import json

    from spur.cluster.cli import main as spur_main

    path = hybrid_dir("qwen3_5-test")
    llm = LLM(
        str(path),
        num_kv_blocks=LIVE_BLOCKS,
        block_size=16,
        max_num_batched_tokens=LIVE_CHUNK,
        max_model_len=LIVE_LENGTHS[-1] + LIVE_DECODE + 1,
    )
    rows = []
    try:
        sched, executor = llm.scheduler, llm.executor
        rng = random.Random(3)
        for length in LIVE_LENGTHS:
            rid = f"live-{length}"
            params = SamplingParams(max_tokens=LIVE_DECODE, temperature=0, ignore_eos=True)
            sched.add_request(
                sched.make_request(rid, [rng.randrange(256) for _ in range(length)], params)
            )
            peak = [0] * len(sched.kv.managers)
            while sched.has_unfinished_requests():
                out = sched.schedule()
                peak = [max(p, h) for p, h in zip(peak, sched.kv.num_held(rid), strict=True)]
                sched.update_from_output(out, executor.execute_model(out))
            sched.check_integrity()
            buf = io.StringIO()
            argv = [
                "capacity", "--model", str(path), "--block-size", "16",
                "--num-blocks", str(LIVE_BLOCKS), "--kv-dtype", "float32",
                "--max-model-len", str(LIVE_LENGTHS[-1] + LIVE_DECODE + 1),
                "--max-num-batched-tokens", str(LIVE_CHUNK),
                "--simulate-prompt", str(length), "--chunk", str(LIVE_CHUNK),
                "--decode", str(LIVE_DECODE), "--json",
            ]  # fmt: skip
            with contextlib.redirect_stdout(buf):
                assert spur_main(argv) == 0
            report = json.loads(buf.getvalue())
            rows.append(
                {
                    "tokens": length,
                    "live_peak": peak,
                    "simulated_peak": report["peak_blocks_held"],
                    "geometry": report["geometry_blocks"],
                    "leaks": sched.kv.leaks.num_violations,
                }
            )
    finally:
        llm.shutdown()
    return rows


@pytest.mark.slow
def test_live_capacity_equals_geometry(live_capacity):
    """A runner that kept states it should retire (or leaked attention blocks)
    would hold more than the capacity formula's blocks per group."""
    for row in live_capacity:
        print("live capacity:", row)  # the table of the closing note (pytest -s)
        geometry = [v for k, v in row["geometry"].items() if k != "total"]
        simulated = [v for k, v in row["simulated_peak"].items() if k != "total"]
        assert row["live_peak"] == geometry == simulated, row
        assert geometry[1:] == [2, 2]  # two states per state group: read and written
        assert row["leaks"] == 0


def test_multimodal_qwen3_5_checkpoint_served_text_only(tmp_path, hybrid_dir):
    """A Qwen3_5ForConditionalGeneration folder (language model under
    model.language_model, a vision tower) loads text-only and says what
    transformers' own multimodal model says for text."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from spur.actors.worker.random_models import PRESETS, hf_config

    text = hf_config("qwen3_5-test").to_dict()
    vision = dict(
        depth=1,
        hidden_size=32,
        num_heads=2,
        intermediate_size=64,
        out_hidden_size=PRESETS["qwen3_5-test"]["hidden_size"],
    )
    config = Qwen3_5Config(text_config=text, vision_config=vision)
    torch.manual_seed(5)
    hf = Qwen3_5ForConditionalGeneration(config).eval()
    # The same language weights as the dense test model: its margins are known good.
    from transformers import AutoModelForCausalLM

    dense = AutoModelForCausalLM.from_pretrained(hybrid_dir("qwen3_5-test"))
    missing = hf.model.language_model.load_state_dict(dense.model.state_dict())
    assert not missing.missing_keys
    hf.lm_head.load_state_dict(dense.lm_head.state_dict())
    hf.save_pretrained(tmp_path / "mm")
    prompts = make_prompts(3, seed=11)
    res = _generate(tmp_path / "mm", prompts, num_kv_blocks=128, block_size=8)
    for prompt, out in zip(prompts, res["tokens"], strict=True):
        with torch.no_grad():
            logits = hf(input_ids=torch.tensor([prompt + out])).logits[0]
        assert out == logits[len(prompt) - 1 : -1].argmax(-1).tolist()


def _state_group_scheduler(caching: bool) -> tuple[Any, Any]:
    """(KV config, scheduler): one attention and one state group, blocks of 16."""
    from spur.actors.cache_spec import FullAttentionSpec, KVCacheGroup, StateSpec
    from spur.actors.engine.core.kv_cache_manager import KVCacheConfig
    from spur.actors.engine.core.scheduler import Scheduler, SchedulerConfig

    groups = (KVCacheGroup(FullAttentionSpec(1, 1, 2), 1), KVCacheGroup(StateSpec(64), 1))
    kv = KVCacheConfig(block_size=16, num_blocks=64, groups=groups, enable_prefix_caching=caching)
    config = SchedulerConfig(
        max_num_batched_tokens=512,
        max_num_seqs=16,
        max_model_len=256,
        long_prefill_token_threshold=0,
        policy="fcfs",
        check_kv_bounds=True,
    )
    return kv, Scheduler(config, kv)


@pytest.mark.parametrize("caching", [True, False])
def test_prefill_stops_at_its_last_block_boundary(caching):
    """With state groups (and prefix caching), a prompt of 100 tokens in blocks of
    16 prefills 96 tokens, then the 4-token tail: the state after 96 tokens is
    kept and cacheable. Without caching there is nothing to keep: one chunk."""
    from spur.actors.engine.core.fake_executor import FakeExecutor

    kv, sched = _state_group_scheduler(caching)
    executor = FakeExecutor(kv)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    sched.add_request(sched.make_request("a", list(range(100)), params))
    chunks = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        chunks.append(out.num_scheduled_tokens["a"])
        sched.update_from_output(out, executor.execute_model(out))
    assert chunks == ([96, 4, 1] if caching else [100, 1])
    sched.check_integrity()


@pytest.mark.parametrize("prompt_len", [64, 65, 100])
def test_a_repeated_prompt_hits_all_but_its_last_block_also_when_aligned(prompt_len):
    """A prompt sent twice reuses (P - 1) // 16 blocks, as on a model without state
    groups. A prompt ending on a block boundary (64) was prefilled in one chunk: the
    only state kept was the one after all 64 tokens, which no repeat can use (its last
    token is always computed), so its repeat hit nothing."""
    from spur.actors.engine.core.engine_core import EngineCore
    from spur.actors.engine.core.fake_executor import FakeExecutor

    kv, sched = _state_group_scheduler(caching=True)
    core = EngineCore(sched, FakeExecutor(kv))
    cached = []
    for name in ("first", "repeat"):
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        core.add_request(sched.make_request(name, list(range(1, prompt_len + 1)), params))
        while core.has_unfinished_requests():
            outputs, _ = core.step()
            cached += [o.num_cached_tokens for o in outputs if o.finished]
            sched.check_integrity()
    assert cached == [0, (prompt_len - 1) // 16 * 16]


def test_a_cached_random_model_is_keyed_by_its_definition(monkeypatch, tmp_path):
    """The cache folder was named by preset and seed only: after a preset changed (an
    upgrade, or nodes of two versions on one shared cache) the old weights were reused,
    and nodes could serve different models under one name."""
    from spur.actors.worker import random_models

    first = random_models.ensure_random_model("hybrid-tiny", root=tmp_path)
    assert random_models.ensure_random_model("hybrid-tiny", root=tmp_path) == first
    changed = {**random_models.PRESETS["hybrid-tiny"], "rms_norm_eps": 1e-5}
    monkeypatch.setitem(random_models.PRESETS, "hybrid-tiny", changed)
    second = random_models.ensure_random_model("hybrid-tiny", root=tmp_path)
    assert second != first
    assert json.loads((second / "config.json").read_text())["rms_norm_eps"] == 1e-5
    monkeypatch.setattr(random_models, "BUILD_VERSION", random_models.BUILD_VERSION + 1)
    assert random_models._build_key("hybrid-tiny", None) not in str(second)
