"""actors/generation_config.py: the model's generation_config.json as requests'
sampling defaults (vLLM's `--generation-config auto | vllm` and its overrides)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from spur.actors.generation_config import (
    SamplingDefaults,
    check,
    describe,
    read_file,
    sampling_defaults,
)

QWEN3 = {  # Qwen3's file: sampling keys among others that are not sampling defaults
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
    "transformers_version": "4.51.0",
}


def test_auto_takes_the_files_sampling_fields_and_nothing_else() -> None:
    d = sampling_defaults(QWEN3, "auto", {})
    assert d.values == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    assert d.max_tokens_cap is None
    d = sampling_defaults({"max_new_tokens": 512, "min_p": 0.1, "top_p": None}, "auto", {})
    assert d.values == {"max_tokens": 512, "min_p": 0.1}
    assert d.max_tokens_cap is None  # the model's max_new_tokens is a default, not a cap


def test_vllm_ignores_the_file_and_overrides_go_over_either() -> None:
    assert sampling_defaults(QWEN3, "vllm", {}).values == {}
    over = {"temperature": 0.2, "max_new_tokens": 64, "repetition_penalty": 1.1}
    d = sampling_defaults(QWEN3, "auto", over)
    assert d.values == {
        "temperature": 0.2,
        "top_k": 20,
        "top_p": 0.95,
        "max_tokens": 64,
        "repetition_penalty": 1.1,
    }
    assert d.max_tokens_cap == 64
    assert sampling_defaults(QWEN3, "vllm", over).values == {
        "temperature": 0.2,
        "max_tokens": 64,
        "repetition_penalty": 1.1,
    }
    with pytest.raises(ValueError, match="use one of auto, vllm"):
        sampling_defaults({}, "model", {})


def test_fill_and_max_tokens() -> None:
    d = SamplingDefaults({"temperature": 0.6, "top_k": 20, "max_tokens": 9}, max_tokens_cap=12)
    assert d.fill({"temperature": None, "top_k": 3}) == {"temperature": 0.6, "top_k": 3}
    assert d.max_tokens(None, 100) == 9  # the model's default before the server's
    assert d.max_tokens(40, 100) == 12  # the cap bounds the request's own
    assert SamplingDefaults().max_tokens(None, 100) == 100
    assert SamplingDefaults.from_dict(d.to_dict()) == d
    assert SamplingDefaults.from_dict(None) == SamplingDefaults()
    assert json.loads(json.dumps(d.to_dict())) == d.to_dict()  # crosses Ray as JSON


def test_read_file(tmp_path: Path) -> None:
    assert read_file(tmp_path) == {}  # no file: no defaults
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN3))
    assert read_file(tmp_path) == QWEN3
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6,')
    with pytest.raises(ValueError, match=r"generation_config\.json cannot be read as JSON") as e:
        read_file(tmp_path)
    assert "engine.model.generation_config: vllm" in str(e.value)
    (tmp_path / "generation_config.json").write_text("[0.6]")
    with pytest.raises(ValueError, match="holds a list, not a JSON object"):
        read_file(tmp_path)


@pytest.mark.parametrize(
    ("values", "cap", "named"),
    [
        ({"temperature": -1}, None, "temperature=-1"),
        ({"top_k": 2.5}, None, "top_k=2.5"),
        ({"top_p": "high"}, None, "top_p: 'high' is not a number"),
        ({"min_p": True}, None, "min_p: True is not a number"),
        ({"max_tokens": 0}, None, "max_new_tokens: max_tokens=0"),
        ({}, 0, "max_new_tokens: max_tokens=0"),
    ],
)
def test_check_names_the_bad_value_and_its_source(
    values: dict, cap: int | None, named: str
) -> None:
    with pytest.raises(ValueError) as e:
        check(SamplingDefaults(values, cap), "/m/generation_config.json")
    message = str(e.value)
    assert named in message and "/m/generation_config.json" in message
    assert "generation_config: vllm" in message
    check(sampling_defaults(QWEN3, "auto", {"max_new_tokens": 5}), "ok")  # valid: no error


def test_describe() -> None:
    assert describe(SamplingDefaults()).startswith("none")
    line = describe(sampling_defaults(QWEN3, "auto", {"max_new_tokens": 8}))
    assert line == (
        "max_tokens=8, temperature=0.6, top_k=20, top_p=0.95, every request's max_tokens at most 8"
    )
