"""The config tree, its loader and its reference: fast, no Ray, no torch."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from spur.configs import reference
from spur.configs.loader import (
    PRESETS,
    ConfigError,
    apply_overrides,
    config_to_dict,
    diff,
    load_config,
    parse_config,
    preset_path,
    show,
)
from spur.configs.schema import ALL_MODELS, SpurConfig, parse_size

ROOT = Path(__file__).resolve().parents[2]


def minimal(**sections: Any) -> dict[str, Any]:
    """The smallest valid config, with `sections` merged in."""
    return {"lanes": [{"name": "chat"}], **sections}


def problems(data: Any) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data, source="test.yaml")
    assert str(info.value).startswith("test.yaml: ")
    return info.value.problems


# -- presets -------------------------------------------------------------------------


@pytest.mark.parametrize("name", PRESETS)
def test_presets_load_and_round_trip(name):
    path = preset_path(name)
    assert path.is_file() and path.name == f"{name}.yaml"
    cfg = load_config(path)
    assert load_config(name) == cfg  # a bare preset name works too
    assert parse_config(config_to_dict(cfg)) == cfg
    assert diff(cfg, config_to_dict(cfg)) == []


def test_local_preset_is_a_cpu_laptop_setup():
    cfg = load_config(preset_path("local"))
    assert cfg.lane_names == ["chat"]
    assert cfg.lane_for_model("SmolLM2-135M-Instruct") is cfg.lane("chat")
    assert cfg.lane_for_model("chat") is cfg.lane("chat")
    assert cfg.lane_for_model("gpt-4") is None
    engine = cfg.lane("chat").engine
    assert engine.parallelism.device == "cpu" and engine.parallelism.num_gpus_per_worker == 0
    assert engine.cache.kv_cache_bytes == 1024**3
    assert cfg.server.embedded_ray and cfg.server.url == "http://127.0.0.1:8000"
    assert cfg.spare is None


def test_two_lanes_preset_has_a_spare_for_both():
    cfg = load_config(preset_path("two-lanes"))
    assert cfg.lane_names == ["chat", "reasoning"]
    assert cfg.spare_for("chat") is cfg.spare and cfg.spare_for("reasoning") is cfg.spare
    assert cfg.spare is not None and cfg.spare.engine.parallelism.tensor_parallel_size == 1
    assert cfg.server.object_store_memory is not None


def test_gpu_preset_is_tp2_on_cuda():
    cfg = load_config(preset_path("gpu-h200-tp2"))
    engine = cfg.lanes[0].engine
    assert engine.num_workers == 2 and engine.parallelism.num_gpus_per_replica == 2
    assert engine.model.dtype == "bfloat16" and engine.runtime.attn_backend == "triton"
    assert engine.scheduler.max_num_seqs == 256 and engine.cache.block_size == 16
    assert not cfg.server.embedded_ray


def test_defaults_fill_a_minimal_config():
    cfg = parse_config(minimal())
    lane = cfg.lanes[0]
    assert lane.served_model_names == ["chat"]  # default: the lane's name
    assert lane.engine.cache.block_size == 16 and lane.engine.max_model_len is None
    assert cfg.router.policy == "prefix" and cfg.server.port == 8000
    with pytest.raises(KeyError, match="lanes: 'chat'"):
        cfg.lane("nope")


def test_importing_the_config_modules_loads_neither_torch_nor_ray():
    code = (
        "import sys, spur.configs.loader, spur.configs.reference\n"
        "print(sorted(m for m in ('torch', 'ray') if m in sys.modules))\n"
    )
    assert subprocess.check_output([sys.executable, "-c", code], text=True).strip() == "[]"


# -- errors --------------------------------------------------------------------------


def test_unknown_key_names_its_full_path_and_the_fix(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("lanes:\n  - name: chat\n    engine:\n      cache:\n        blok_size: 8\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems == [
        "lanes[0].engine.cache.blok_size: unknown key 'blok_size'; did you mean 'block_size'?"
    ]
    assert str(info.value).startswith(f"{path}: ")


def test_unknown_key_without_a_close_match_lists_the_known_keys():
    (line,) = problems(minimal(server={"colour": "blue"}))
    assert line.startswith("server.colour: unknown key 'colour'; known keys: host, port")
    (line,) = problems(minimal(extra=1))
    assert line.startswith("extra: unknown key 'extra'; known keys: version, lanes")


@pytest.mark.parametrize(
    ("cache", "expected"),
    [
        ({"block_size": 0}, "lanes[0].engine.cache.block_size: must be >= 1 (got 0)"),
        ({"block_size": 2048}, "lanes[0].engine.cache.block_size: must be <= 1024 (got 2048)"),
        ({"block_size": "big"}, "lanes[0].engine.cache.block_size: must be an integer (got 'big')"),
        ({"block_size": 1.5}, "lanes[0].engine.cache.block_size: must be a whole number (got 1.5)"),
        ({"gpu_memory_utilization": 0.99}, "gpu_memory_utilization: must be <= 0.98 (got 0.99)"),
        ({"gpu_memory_utilization": 0}, "gpu_memory_utilization: must be > 0.0 (got 0)"),
        ({"kv_cache_dtype": "int4"}, "kv_cache_dtype: must be one of 'auto', 'float32', "),
        ({"enable_prefix_caching": "maybe"}, "enable_prefix_caching: must be true or false"),
        ({"kv_cache_bytes": 10}, "kv_cache_bytes: must be >= 1MiB (got 10 bytes)"),
        ({"kv_cache_bytes": "2 gigs"}, "kv_cache_bytes: '2 gigs' is not a size"),
        ({"num_kv_blocks": 1}, "lanes[0].engine.cache.num_kv_blocks: must be >= 2 (got 1)"),
        # YAML's true / false where a number is meant (pydantic took them as 1 / 0)
        ({"block_size": True}, "block_size: true is not a number; give a number"),
        ({"gpu_memory_utilization": False}, "gpu_memory_utilization: false is not a number"),
    ],
)
def test_type_and_range_errors_name_the_path_and_the_bound(cache, expected):
    (line,) = problems({"lanes": [{"name": "chat", "engine": {"cache": cache}}]})
    assert expected in line
    assert line.startswith("lanes[0].engine.cache.")


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ({}, "lanes: required, but missing"),
        ({"lanes": []}, "lanes: needs at least 1 item (got 0)"),
        ({"lanes": {"name": "chat"}}, "lanes: must be a list (got a mapping)"),
        ({"lanes": ["chat"]}, "lanes[0]: must be a mapping (got 'chat')"),
        ({"lanes": [{"name": "Chat Lane"}]}, "lanes[0].name: must be a slug"),
        (minimal(version=2), "version: 2 is not supported: this spur reads version 1"),
        (minimal(server={"port": 70000}), "server.port: must be <= 65535 (got 70000)"),
        (minimal(server={"ray_address": "http://h"}), "server.ray_address: must be 'auto'"),
        (minimal(server={"object_store_memory": "1MiB"}), "must be >= 75MiB (got '1MiB')"),
        (minimal(router={"policy": "random"}), "router.policy: must be one of 'prefix'"),
        (minimal(router={"max_attempts": 0}), "router.max_attempts: must be >= 1 (got 0)"),
        (
            {"lanes": [{"name": "a", "max_queued_requests": -1}]},
            "lanes[0].max_queued_requests: must be >= 0 (got -1)",
        ),
        (
            {"lanes": [{"name": "a", "resources": {"GPU": 1}}]},
            "lanes[0].resources: 'GPU' is a built-in Ray resource",
        ),
        (
            {"lanes": [{"name": "a", "resources": {"node": 1.5}}]},
            "Ray requires amounts above 1 to be whole numbers",
        ),
        (
            {"lanes": [{"name": "a", "served_model_names": ["x", "x"]}]},
            "lanes[0].served_model_names[1]: 'x' is listed twice",
        ),
    ],
)
def test_structural_errors(data, expected):
    lines = problems(data)
    assert any(expected in line for line in lines), lines


def test_two_errors_in_one_file_are_both_reported(tmp_path):
    path = tmp_path / "two.yaml"
    path.write_text(
        "lanes:\n  - name: chat\n    replicas: 0\nserver:\n  port: 0\n  hots: 0.0.0.0\n"
    )
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.problems == [
        "lanes[0].replicas: must be >= 1 (got 0)",
        "server.port: must be >= 1 (got 0)",
        "server.hots: unknown key 'hots'; did you mean 'host'?",
    ]
    assert str(info.value).startswith(f"{path}: 3 problems:\n  lanes[0].replicas")


def test_spare_must_be_a_single_device():
    spare = {"serves_lanes": ["chat"], "engine": {"parallelism": {"tensor_parallel_size": 2}}}
    (line,) = problems(minimal(spare=spare))
    assert line.startswith("spare: engine.parallelism.tensor_parallel_size is 2")
    assert "set it to 1" in line


def test_duplicate_lane_names_are_rejected():
    lines = problems({"lanes": [{"name": "chat"}, {"name": "chat", "served_model_names": ["b"]}]})
    assert lines == [
        "lanes[1].name: 'chat' is already the name of lanes[0]; lane names must be unique"
    ]


def test_a_model_name_selects_one_lane():
    lines = problems(
        {"lanes": [{"name": "chat"}, {"name": "reasoning", "served_model_names": ["r", "chat"]}]}
    )
    assert lines == [
        "lanes[1].served_model_names[1]: 'chat' is already served by lane 'chat' (lanes[0]); "
        "a model name selects exactly one lane"
    ]


def test_spare_references_are_checked():
    lines = problems(minimal(spare={"name": "chat", "serves_lanes": ["chta", "chat", "chat"]}))
    assert lines == [
        "spare.name: 'chat' is also a lane's name; give the spare its own name",
        "spare.serves_lanes[0]: no lane is named 'chta' (lanes: 'chat'); did you mean 'chat'?",
        "spare.serves_lanes[2]: 'chat' is listed twice",
    ]


def test_engine_cross_field_rules():
    both = {"num_kv_blocks": 100, "kv_cache_bytes": "1GiB"}
    (line,) = problems({"lanes": [{"name": "a", "engine": {"cache": both}}]})
    assert line.startswith("lanes[0].engine.cache: num_kv_blocks and kv_cache_bytes are both set")

    engine = {
        "model": {"max_model_len": 1000},
        "cache": {"num_kv_blocks": 10},
        "parallelism": {"device": "cpu"},
        "runtime": {"attn_backend": "triton"},
    }
    lines = problems({"lanes": [{"name": "a", "engine": engine}]})
    assert lines == [
        "lanes[0].engine: runtime.attn_backend is 'triton' but parallelism.device is 'cpu': "
        "Triton has no CPU backend; use 'torch' or 'auto', or set parallelism.device: cuda",
        "lanes[0].engine: model.max_model_len is 1,000 tokens but cache.num_kv_blocks 10 has "
        "144 token slots (one block is the null block): raise num_kv_blocks to at least 64 or "
        "lower max_model_len",
    ]
    # Refused at load, not by every replica after Ray started: device auto is CPU, and
    # a compute dtype narrower than (or beside) the model's.
    auto = {"runtime": {"attn_backend": "triton"}}
    (line,) = problems({"lanes": [{"name": "a", "engine": auto}]})
    assert "parallelism.device is 'auto', which is CPU" in line
    wide = {"model": {"dtype": "float32", "compute_dtype": "bfloat16"}}
    (line,) = problems({"lanes": [{"name": "a", "engine": wide}]})
    assert "model.compute_dtype bfloat16 with model.dtype float32" in line
    for ok in (
        {"dtype": "bfloat16", "compute_dtype": "float32"},
        {"dtype": "auto", "compute_dtype": "bfloat16"},
    ):
        parse_config({"lanes": [{"name": "a", "engine": {"model": ok}}]})


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"^config file configs/x.yaml does not exist"):
        load_config("configs/x.yaml")

    bad = tmp_path / "bad.yaml"
    bad.write_text("lanes:\n  - name: chat\n   replicas: [1\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: YAML syntax error at line 3, column 4"):
        load_config(bad)

    dup = tmp_path / "dup.yaml"
    dup.write_text("lanes:\n  - name: chat\n    replicas: 1\n    replicas: 2\n")
    with pytest.raises(ConfigError, match=r"line 4, .*'replicas' appears twice \(first on line 3"):
        load_config(dup)

    # A key brought in by a merge (<<: *base) may be overridden; a written one not twice.
    merged = tmp_path / "merged.yaml"
    base = "engine: &base\n  cache: {block_size: 32, kv_cache_bytes: 256MiB}\n"
    lane = "lanes:\n  - name: chat\n    engine:\n      <<: *base\n      cache: {block_size: 16}\n"
    merged.write_text("x-" + base + lane)
    with pytest.raises(ConfigError, match="unknown key 'x-engine'"):  # parsed, then checked
        load_config(merged)
    from spur.configs.loader import read_yaml

    data = read_yaml(base + lane, "merged.yaml")
    assert data["lanes"][0]["engine"]["cache"] == {"block_size": 16}
    with pytest.raises(ConfigError, match="'cache' appears twice"):
        read_yaml(base + lane + "      cache: {block_size: 8}\n", "merged.yaml")

    listed = tmp_path / "list.yaml"
    listed.write_text("- name: chat\n")
    with pytest.raises(ConfigError, match="top level must be a mapping of sections"):
        load_config(listed)

    with pytest.raises(ConfigError, match=r"no preset is named 'locl'.*did you mean 'local'"):
        preset_path("locl")


# -- values --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (4096, 4096),
        ("4096", 4096),
        ("1_000_000", 1_000_000),
        ("2GiB", 2 * 1024**3),
        ("512 MiB", 512 * 1024**2),
        ("1.5GB", 1_500_000_000),
        ("64k", 64_000),
        ("8Gi", 8 * 1024**3),
        ("1tib", 1024**4),
    ],
)
def test_size_strings_parse(text, expected):
    assert parse_size(text) == expected
    if expected >= 1024**2:  # the pool's lower bound
        cache = {"kv_cache_bytes": text}
        cfg = parse_config({"lanes": [{"name": "a", "engine": {"cache": cache}}]})
        assert cfg.lanes[0].engine.cache.kv_cache_bytes == expected


@pytest.mark.parametrize("text", ["", "GiB", "2 gigs", "1.2.3MB", "-1GiB", True, False])
def test_bad_size_strings_name_the_units(text):
    with pytest.raises(ValueError, match="is not a size: give bytes or a number with a unit"):
        parse_size(text)


def test_assignment_is_validated():
    cfg = parse_config(minimal())
    with pytest.raises(ValidationError):
        cfg.server.port = 0
    cfg.server.port = 9000
    assert cfg.server.port == 9000


def test_overrides_make_a_new_validated_config():
    cfg = parse_config(minimal())
    new = apply_overrides(
        cfg, {"server.port": 9000, "server.ray_address": "auto", "lanes[0].replicas": 2}
    )
    assert (new.server.port, new.server.ray_address, new.lanes[0].replicas) == (9000, "auto", 2)
    assert cfg.server.port == 8000  # unchanged
    with pytest.raises(ConfigError, match=r"overrides: server.prt: unknown key .*'port'"):
        apply_overrides(cfg, {"server.prt": 1})
    with pytest.raises(ConfigError, match=r"lanes\[3\]: no such item"):
        apply_overrides(cfg, {"lanes[3].replicas": 1})


def test_an_autoscaling_lane_round_trips_and_takes_overrides(tmp_path):
    """The dump carried `replicas: 1` beside `autoscaling`, which the loader refuses:
    `spur serve` with --port (or with API keys found) on an autoscaling lane failed,
    and `spur config show`'s output did not load back."""
    data = minimal(lanes=[{"name": "chat", "autoscaling": {"min_replicas": 1, "max_replicas": 3}}])
    cfg = parse_config(data)
    assert "replicas" not in config_to_dict(cfg)["lanes"][0]
    assert parse_config(config_to_dict(cfg)) == cfg
    new = apply_overrides(cfg, {"server.port": 9001, "server.auth.require_keys": True})
    assert (new.server.port, new.lanes[0].autoscaling) == (9001, cfg.lanes[0].autoscaling)
    with pytest.raises(ConfigError, match="mutually exclusive"):
        apply_overrides(cfg, {"lanes[0].replicas": 2})
    (tmp_path / "auto.yaml").write_text(yaml.safe_dump(data))
    (tmp_path / "resolved.yaml").write_text(show(tmp_path / "auto.yaml"))
    assert load_config(tmp_path / "resolved.yaml") == cfg


# -- show and diff -------------------------------------------------------------------


def test_show_prints_every_default_and_loads_back(tmp_path):
    text = show(preset_path("local"))
    assert "hash_seed: spur-kv-v1" in text and "check_kv_bounds: true" in text
    resolved = tmp_path / "resolved.yaml"
    resolved.write_text(text)
    assert load_config(resolved) == load_config(preset_path("local"))


def test_diff_reports_changed_fields_only():
    cfg = load_config(preset_path("two-lanes"))
    live = copy.deepcopy(config_to_dict(cfg))
    assert diff(cfg, live) == []
    live["lanes"][0]["engine"]["cache"]["block_size"] = 32
    live["router"]["load_weight"] = 1  # int vs float: the same value
    live["lanes"][1]["served_model_names"] = ["reasoning", "r1"]
    del live["server"]["num_cpus"]
    live["lanes"].append({"name": "extra"})
    assert diff(cfg, live) == [
        "lanes[0].engine.cache.block_size: file 16, running 32",
        'lanes[1].served_model_names: file ["reasoning"], running ["reasoning", "r1"]',
        'lanes[2]: file (absent), running {"name": "extra"}',
        "server.num_cpus: file 8, running (absent)",
    ]
    assert diff(config_to_dict(cfg), live)[0].startswith("lanes[0].engine.cache.block_size")


# -- documentation -------------------------------------------------------------------


def _reachable_models() -> list[type[BaseModel]]:
    return list(reference.models_in_order(SpurConfig))


def test_every_model_is_listed_and_reachable():
    assert set(_reachable_models()) == set(ALL_MODELS)


@pytest.mark.parametrize("model", ALL_MODELS, ids=lambda m: m.__name__)
def test_every_field_has_a_docstring(model):
    assert (model.__doc__ or "").strip(), f"{model.__name__} has no class docstring"
    undocumented = [n for n, f in model.model_fields.items() if not (f.description or "").strip()]
    assert not undocumented, f"{model.__name__}: add a docstring under {undocumented}"


def test_every_model_forbids_unknown_keys():
    assert all(m.model_config.get("extra") == "forbid" for m in ALL_MODELS)


def test_markdown_reference_mentions_every_field():
    text = reference.markdown_reference()
    for model in ALL_MODELS:
        section = text.split(f"### {model.__name__}\n", 1)[1].split("\n### ", 1)[0]
        for name, field in model.model_fields.items():
            row = next(line for line in section.splitlines() if line.startswith(f"| `{name}` |"))
            assert " ".join((field.description or "").split())[:40] in row.replace("\\|", "|")
    assert "| `block_size` | `int` | `16` | ≥ 1; ≤ 1,024 |" in text
    assert '`kv_cache_bytes` | size (bytes or `"2GiB"`) or null | `null` | ≥ 1MiB' in text
    assert "At `lanes[].engine.cache`, `spare.engine.cache`." in text


def test_reference_section_replacement_and_check(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(
        f"# spur\n\n{reference.BEGIN_MARKER}\nSTALE TEXT\n{reference.END_MARKER}\ntail\n"
    )
    assert reference.main(["--check", str(readme)]) == 1
    assert reference.main(["--write", str(readme)]) == 0
    assert reference.main(["--check", str(readme)]) == 0
    text = readme.read_text()
    assert "STALE TEXT" not in text and text.endswith(f"{reference.END_MARKER}\ntail\n")
    assert reference.main(["--check", str(tmp_path / "missing.md")]) == 2


def test_readme_reference_is_current():
    readme = ROOT / "README.md"
    if not readme.exists() or reference.BEGIN_MARKER not in readme.read_text():
        pytest.skip("README.md has no config reference section yet")
    assert reference.main(["--check", str(readme)]) == 0, (
        "run: python -m spur.configs.reference --write README.md"
    )


def test_a_key_pasted_as_keys_env_is_refused_and_never_shown():
    """A key given where the variable's name belongs was echoed in the error, or (made
    of name characters) accepted, printed in the effective configuration, served by
    /admin/config and quoted in the require_keys error."""
    for key in ("sk-live-9f8e7d6c5b4a", "sk_live_9f8e7d6c5b4a", "K" * 65):
        (line,) = problems(minimal(server={"auth": {"keys_env": key}}))
        assert line.startswith("server.auth.keys_env: ") and key not in line, line
    assert parse_config(minimal(server={"auth": {"keys_env": "MY_KEYS"}})).server.auth.keys_env


def test_errors_of_number_unions_and_flat_engine_arguments_read_like_the_files():
    """A value that fits no branch of `int | float` was two problems under the branch
    names (`temperature.int: must be an integer`, `temperature.float: ...`), and
    LLM(...)'s errors were pydantic's raw text ("invalid engine arguments: : Value error,
    ...")."""
    from spur.configs.engine_args import engine_config

    ogc = {"engine": {"model": {"override_generation_config": {"temperature": "0.7"}}}}
    assert problems(minimal(lanes=[{"name": "a", **ogc}])) == [
        "lanes[0].engine.model.override_generation_config.temperature: must be a number (got '0.7')"
    ]
    with pytest.raises(ValueError) as info:
        engine_config(num_kv_blocks=2, max_model_len=100)
    assert str(info.value).startswith("invalid engine arguments: model.max_model_len is 100")
    with pytest.raises(ValueError, match=r"arguments: model.max_num_seqs|scheduler.max_num_seqs"):
        engine_config(max_num_seqs=0)
