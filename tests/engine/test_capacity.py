"""Capacity truth: the formula, geometry parsing, and the leak detector on the
hybrid scenario (attention + 4 state groups, block 800, chunks of 2,048)."""

from __future__ import annotations

import json
import logging

import pytest

from spur.actors.engine.core import capacity as cap
from spur.actors.engine.core.fake_executor import FakeExecutor
from spur.actors.engine.core.groups import StateManager
from spur.actors.engine.core.kv_cache_manager import KVCacheConfig
from spur.actors.engine.core.scheduler import Scheduler, SchedulerConfig
from spur.actors.step import SamplingParams
from spur.cluster.cli import main

# A Qwen3-Next-like hybrid: 8 full-attention layers, 32 Gated DeltaNet layers.
HYBRID_CONFIG = {
    "architectures": ["Qwen3NextForCausalLM"],
    "num_hidden_layers": 40,
    "hidden_size": 2048,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "full_attention_interval": 5,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 262144,
}
SMOLLM2_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
}


def test_formula_by_hand_for_a_plain_model():
    geo = cap.geometry_from_hf_config(SMOLLM2_CONFIG, kv_dtype="bfloat16")
    r = cap.capacity(geo, block_size=16, max_model_len=2048, kv_bytes=1 << 30)
    page = 2 * 16 * 3 * 64 * 2  # K and V, 16 tokens, 3 heads, dim 64, bf16
    assert r.block_bytes == page * 30 == 368_640
    assert r.num_blocks == (1 << 30) // 368_640 == 2912
    assert r.tokens == 2911 * 16
    assert r.blocks_per_request == 128
    assert r.max_concurrency == 2911 // 128 == 22
    assert r.padding_percent == 0


def test_hybrid_geometry_groups_and_padding_is_logged(caplog):
    geo = cap.geometry_from_hf_config(HYBRID_CONFIG)
    groups, size = cap.build_groups(geo)
    assert size == 8 and [g.spec.kind for g in groups] == ["full"] + ["state"] * 4
    conv = (2 * 16 * 128 + 32 * 128) * 3
    recurrent = 32 * 128 * 128
    assert groups[1].spec.state_bytes == (conv + recurrent) * 2
    with caplog.at_level(logging.INFO, logger="spur.actors.engine.core.capacity"):
        r = cap.capacity(geo, block_size=800, max_model_len=131072, num_blocks=1000)
    attention_page = 2 * 800 * 2 * 256 * 2
    assert r.block_bytes == attention_page * 8
    assert r.groups[1].padding_percent == pytest.approx(
        100 * (1 - 1_097_728 / attention_page), 0.01
    )
    assert "33.0% padding" in caplog.text
    assert r.blocks_per_request == 164 + 4 * 2
    assert r.max_concurrency == 999 // 172
    # one request alone: its 4 state groups keep 2 blocks each, the rest holds tokens
    assert r.tokens == (999 - 4 * 2) * 800


def test_sliding_and_mamba_geometries():
    sliding = cap.geometry_from_hf_config(
        {
            **SMOLLM2_CONFIG,
            "layer_types": ["sliding_attention", "full_attention"] * 15,
            "sliding_window": 512,
        }
    )
    groups, _ = cap.build_groups(sliding)
    assert [g.spec.kind for g in groups] == ["full", "sliding"]
    r = cap.capacity(
        sliding, block_size=16, max_model_len=8192, max_num_batched_tokens=256, num_blocks=5000
    )
    # sliding: ceil((512 - 1 + 256) / 16) + 1 = 49 blocks, full: 512
    assert [g.blocks_per_request for g in r.groups] == [512, 49]
    assert r.tokens == (4999 - 49) * 16  # the window's 49 blocks come off the pool
    mamba = cap.geometry_from_hf_config(
        {
            **SMOLLM2_CONFIG,
            "layers_block_type": ["mamba"] * 24 + ["attention"] * 6,
            "mamba_n_heads": 16,
            "mamba_head_dim": 64,
            "ssm_state_size": 128,
            "n_groups": 1,
            "conv_kernel": 4,
        }
    )
    kinds = {k.name: k.count for k in mamba.kinds}
    assert kinds == {"mamba": 24, "full_attention": 6}
    with pytest.raises(ValueError, match="unknown layer type"):
        cap.geometry_from_hf_config({**SMOLLM2_CONFIG, "layer_types": ["moe"] * 30})


def test_yaml_geometry(tmp_path):
    path = tmp_path / "geo.yaml"
    path.write_text(
        "name: tiny-hybrid\ndtype: float16\nlayers:\n"
        "  - {kind: full_attention, count: 2, num_kv_heads: 2, head_dim: 64}\n"
        "  - {kind: state, count: 4, shapes: [[256, 3], [4, 32, 32]]}\n"
    )
    geo = cap.load_geometry(path)
    assert geo.kinds[1].spec.state_bytes == (256 * 3 + 4 * 32 * 32) * 2
    path.write_text("name: x\nlayerz: []\n")
    with pytest.raises(ValueError, match="unknown key"):
        cap.load_geometry(path)


def _stop_at_null_retire(self, req_id, table, upto):
    """The old retirement loop: walk back from the read position and stop at
    the first null block. With chunks spanning several blocks there is a null
    gap right below the read position, so nothing is ever freed."""
    start = self.retired[req_id]
    dead = []
    i = min(upto, len(table)) - 1
    while i >= start and table[i] is not self.null:
        dead.append(table[i])
        table[i] = self.null
        i -= 1
    self.pool.free_blocks(dead)


def _run_hybrid(num_blocks: int = 2000) -> tuple[Scheduler, list[int], list[int]]:
    geo = cap.geometry_from_hf_config(HYBRID_CONFIG)
    groups, _ = cap.build_groups(geo)
    kv_config = KVCacheConfig(block_size=800, num_blocks=num_blocks, groups=groups)
    sched = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=2048,
            max_num_seqs=4,
            max_model_len=131072,
            long_prefill_token_threshold=0,
            policy="fcfs",
            check_kv_bounds=True,
        ),
        kv_config,
    )
    fake = FakeExecutor(kv_config, simulate_kv=False)
    req = sched.make_request(
        "long", list(range(84_495)), SamplingParams(max_tokens=100, ignore_eos=True)
    )
    sched.add_request(req)
    peak = [0] * len(groups)
    bound_seen = [0] * len(groups)
    while sched.has_unfinished_requests():
        out = sched.schedule()
        held = sched.kv.num_held("long")
        slots = sched.kv._slots["long"]
        bound = cap.geometry_blocks(groups, slots, 800, 2048)
        # The run-time check is the formula applied to the request's length.
        if sched.kv.leaks.num_violations == 0:
            assert all(h <= b for h, b in zip(held, bound, strict=True)), (held, bound)
        peak = [max(p, h) for p, h in zip(peak, held, strict=True)]
        bound_seen = [max(p, b) for p, b in zip(bound_seen, bound, strict=True)]
        sched.update_from_output(out, fake.execute_model(out))
        sched.check_integrity()
    return sched, peak, bound_seen


def test_hybrid_scenario_stays_within_the_formula_and_the_detector_is_silent():
    sched, peak, bound = _run_hybrid()
    assert sched.kv.leaks.num_violations == 0
    assert peak == bound == [106, 2, 2, 2, 2]
    assert sched.kv.num_free_blocks == 1999


def test_leak_detector_fires_with_the_stop_at_null_loop(monkeypatch, caplog):
    monkeypatch.setattr(StateManager, "_retire", _stop_at_null_retire)
    with caplog.at_level(logging.WARNING, logger="spur.actors.engine.core.kv_cache_manager"):
        sched, peak, bound = _run_hybrid()
    leaks = sched.kv.leaks
    assert leaks.num_violations == 1  # one request, reported once
    report = leaks.reports[0]
    assert report.group_id >= 1 and report.held > report.bound == 2
    assert caplog.text.count("KV leak: request long") == 1
    # The old loop held one state block per chunk per state group.
    assert peak[1:] == [53] * 4 and bound[1:] == [2] * 4


def test_cli_capacity_simulation_json(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(HYBRID_CONFIG))
    # KV and states in bf16 (the engine's defaults, which spur capacity takes: float32).
    code = main(
        [
            "capacity", "--model", str(cfg), "--block-size", "800", "--num-blocks", "2000",
            "--max-model-len", "131072", "--simulate-prompt", "84495", "--chunk", "2048",
            "--decode", "100", "--json", "--state-dtype", "bfloat16", "--kv-dtype", "bfloat16",
        ]
    )  # fmt: skip
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["num_blocks"] == 2000 and result["block_size"] == 800
    assert result["max_concurrency"] == 1999 // 172
    assert result["peak_blocks_held"]["total"] == result["geometry_blocks"]["total"] == 114
    assert result["simulation"]["leak_violations"] == 0
    assert result["groups"][1]["padding_percent"] == 33.0
    assert result["tokens"] == (1999 - 4 * 2) * 800  # the 4 state groups keep 2 blocks each


def test_cli_capacity_errors_name_the_problem(tmp_path, capsys):
    assert main(["capacity", "--model", str(tmp_path / "missing.json")]) == 2
    assert "no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["capacity", "--model", str(bad)]) == 2
    assert "not valid JSON" in capsys.readouterr().err


def test_context_tokens_is_the_largest_that_fits():
    """Two attention groups and a state group (4 full layers, 2 state layers: groups
    of 2): a token costs a slot in both attention groups. By hand for 99 usable
    blocks of 16: 2 * ceil(T / 16) + 2 <= 99 gives 48 blocks a group, T = 768."""
    full = cap.KVCacheGroup(cap.FullAttentionSpec(2, 64, 2), 2)
    state = cap.KVCacheGroup(cap.StateSpec(4096), 2)
    groups = (full, full, state)
    tokens = cap.context_tokens(groups, usable_blocks=99, block_size=16, max_num_batched_tokens=64)
    assert tokens == 768
    need = [sum(g.spec.max_blocks(t, 16, 64) for g in groups) for t in (tokens, tokens + 1)]
    assert need == [98, 100]
    assert (
        cap.context_tokens((full,), usable_blocks=99, block_size=16, max_num_batched_tokens=64)
        == 99 * 16
    )
    assert (
        cap.context_tokens(groups, usable_blocks=2, block_size=16, max_num_batched_tokens=64) == 0
    )


def _capacity_json(capsys, *args: str) -> dict:
    assert main(["capacity", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _capacity_error(capsys, *args: str) -> str:
    """`spur capacity ARGS` ends with exit 2 and one line on stderr; that line."""
    assert main(["capacity", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("spur: error: ") and err.count("\n") == 1, err
    return err


GEOMETRY = (
    "name: g\ndtype: {dtype}\nlayers:\n"
    "  - {{kind: full_attention, count: 4, num_kv_heads: 2, head_dim: 64}}\n"
)
FULL = "{kind: full_attention, count: 2, num_kv_heads: 2, head_dim: 64}"


def test_cli_capacity_sizes_pages_in_the_geometry_files_dtype(tmp_path, capsys):
    """--kv-dtype defaulted to bfloat16 and always won over the file's `dtype:`: a
    float32 geometry reported bf16 pages (half their size, twice the blocks)."""
    f32, bf16 = tmp_path / "f32.yaml", tmp_path / "bf16.yaml"
    f32.write_text(GEOMETRY.format(dtype="float32"))
    bf16.write_text(GEOMETRY.format(dtype="bfloat16"))
    page = 2 * 16 * 2 * 64  # K and V, 16 tokens, 2 heads, dim 64: elements
    wide = _capacity_json(capsys, "--model", str(f32), "--num-blocks", "100")
    assert wide["block_bytes"] == page * 4 * 4 and wide["kv_dtype"] == "float32"
    assert wide["assumes"]["kv_dtype"] == "float32 (the geometry file's dtype)"
    narrow = _capacity_json(capsys, "--model", str(bf16), "--num-blocks", "100")
    assert narrow["block_bytes"] == page * 4 * 2
    given = _capacity_json(
        capsys, "--model", str(f32), "--num-blocks", "100", "--kv-dtype", "bfloat16"
    )
    assert given["block_bytes"] == page * 4 * 2 and given["assumes"]["kv_dtype"].endswith(
        "(--kv-dtype)"
    )


@pytest.mark.parametrize(
    ("layers", "words"),
    [
        (
            "  - {kind: full_attention, count: 4, head_dim: 64}",
            "layers[0] (full_attention) has no 'num_kv_heads'",
        ),
        ("  - full_attention", "layers[0] is a str, not a mapping"),
        (
            f"  - {FULL}\n  - {{kind: sliding_attention, count: 2, num_kv_heads: 2, head_dim: 8}}",
            "layers[1] (sliding_attention) has no 'window'",
        ),
        ("  - {kind: state, count: 2}", "layers[0] (state) has no 'state_bytes' or 'shapes'"),
        ("  - {kind: state, count: 2, shapes: [[8, x]]}", "layers[0].shapes[0]='x' must be"),
        (
            "  - {kind: full_attention, num_kv_heads: 2, head_dim: 64}",
            "layers[0] (full_attention) has no 'count'",
        ),
        (
            "  - {kind: full_attention, count: 2, num_kv_heads: two, head_dim: 64}",
            "layers[0].num_kv_heads='two' must be an integer >= 1",
        ),
    ],
)
def test_cli_capacity_names_the_layer_and_key_of_a_malformed_geometry(
    tmp_path, capsys, layers, words
):
    """Each was a traceback (KeyError, AttributeError, TypeError) and exit 1."""
    path = tmp_path / "geo.yaml"
    path.write_text(f"name: bad\nlayers:\n{layers}\n")
    err = _capacity_error(capsys, "--model", str(path), "--num-blocks", "100")
    assert f"{path}: {words}" in err, err
    path.write_text("name: bad\nlayers: {kind: full_attention}\n")
    assert "layers must be a list of mappings" in _capacity_error(capsys, "--model", str(path))


def test_cli_capacity_reads_max_model_len_from_the_text_config(tmp_path, capsys):
    """A multimodal config.json (the decoder under text_config): the geometry came from
    text_config, max_model_len from the top level's (absent: 4,096, not the 8,192)."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"architectures": ["X"], "text_config": SMOLLM2_CONFIG}))
    result = _capacity_json(capsys, "--model", str(cfg), "--num-blocks", "100")
    assert result["max_model_len"] == 8192 and result["block_bytes"] > 0
    assert result["assumes"]["max_model_len"] == "8,192 (the model's max_position_embeddings)"


def test_cli_capacity_refuses_a_simulation_that_cannot_run_naming_its_flags(tmp_path, capsys):
    """A --simulate-prompt beyond max_model_len ran anyway; a pool too small for it was
    refused naming max_model_len (the simulation's own, prompt + decode + 1), which the
    user never gave, and no flag."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**SMOLLM2_CONFIG, "max_position_embeddings": 256}))
    err = _capacity_error(
        capsys, "--model", str(cfg), "--num-blocks", "800", "--simulate-prompt", "300"
    )
    assert "--simulate-prompt 300 plus --decode 0 (at least 1 token) is 301 tokens" in err
    assert "more than max_model_len 256 (the model's max_position_embeddings)" in err, err
    assert "raise --max-model-len" in err
    err = _capacity_error(
        capsys, "--model", str(cfg), "--num-blocks", "8", "--simulate-prompt", "200"
    )
    assert "the pool's 7 usable blocks (--num-blocks) cannot hold" in err, err
    assert "--simulate-prompt 200" in err and "larger --num-blocks or --kv-bytes" in err
    assert "max_model_len" not in err
    ok = _capacity_json(
        capsys,
        "--model",
        str(cfg),
        "--num-blocks",
        "800",
        "--simulate-prompt",
        "200",
        "--max-model-len",
        "256",
    )
    assert ok["simulation"]["leak_violations"] == 0
