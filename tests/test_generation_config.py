"""actors/generation_config.py: the model's generation_config.json as requests'
sampling defaults (vLLM's `--generation-config auto | vllm` and its overrides)."""

from __future__ import annotations

import json
import logging
import typing
from pathlib import Path

import pytest

from spur.actors.generation_config import (
    FIELDS,
    MODES,
    SamplingDefaults,
    check_defaults,
    describe,
    eos_ids,
    more_eos_token_ids,
    read_generation_config,
    sampling_defaults,
    startup_message,
    with_eos,
)
from spur.actors.step import SamplingParams
from spur.configs.schema import GenerationKey, ModelConfig

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
    # the schema refuses unknown keys; without pydantic (the bare GPU machine) this does
    with pytest.raises(
        ValueError, match=r"unknown key\(s\) temprature: valid ones are temperature"
    ):
        sampling_defaults({}, "auto", {"temprature": 0.5})


def test_a_null_override_drops_the_files_value() -> None:
    """As vLLM: the override is merged over the file, then null values are dropped."""
    d = sampling_defaults(QWEN3, "auto", {"top_k": None, "max_new_tokens": None})
    assert d.values == {"temperature": 0.6, "top_p": 0.95}
    assert d.max_tokens_cap is None
    cfg = ModelConfig(override_generation_config={"top_k": None, "temperature": 0.2})
    assert cfg.override_generation_config == {"top_k": None, "temperature": 0.2}


def test_whole_number_floats_are_integers() -> None:
    d = sampling_defaults({"top_k": 20.0, "max_new_tokens": 512.0, "top_p": 0.5}, "auto", {})
    assert d.values == {"top_k": 20, "max_tokens": 512, "top_p": 0.5}
    assert isinstance(d.values["top_k"], int) and isinstance(d.values["max_tokens"], int)
    check_defaults(d, "a file written with floats")  # valid
    assert sampling_defaults({}, "auto", {"max_new_tokens": 64.0}).max_tokens_cap == 64


def test_the_schema_lists_the_same_keys_and_modes() -> None:
    """One source: the schema's Literal types name what this module reads."""
    assert set(typing.get_args(GenerationKey)) == set(FIELDS)
    mode_type = ModelConfig.model_fields["generation_config"].annotation
    assert set(typing.get_args(mode_type)) == set(MODES)


def test_fill_and_max_tokens() -> None:
    d = SamplingDefaults({"temperature": 0.6, "top_k": 20, "max_tokens": 9}, max_tokens_cap=12)
    assert d.fill({"temperature": None, "top_k": 3}) == {"temperature": 0.6, "top_k": 3}
    assert d.max_tokens(None, 100) == 9  # the model's default before the server's
    assert d.max_tokens(40, 100) == 12  # the cap bounds the request's own
    assert SamplingDefaults().max_tokens(None, 100) == 100
    assert SamplingDefaults.from_dict(d.to_dict()) == d
    assert SamplingDefaults.from_dict(None) == SamplingDefaults()
    assert json.loads(json.dumps(d.to_dict())) == d.to_dict()  # /admin/engines serves it


def test_read_generation_config(tmp_path: Path) -> None:
    assert read_generation_config(tmp_path) == {}  # no file: no defaults
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN3))
    assert read_generation_config(tmp_path) == QWEN3
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6,')
    with pytest.raises(ValueError, match=r"generation_config\.json cannot be read as JSON") as e:
        read_generation_config(tmp_path)
    assert "engine.model.generation_config: vllm" in str(e.value)
    (tmp_path / "generation_config.json").write_text("[0.6]")
    with pytest.raises(ValueError, match="holds a list, not a JSON object"):
        read_generation_config(tmp_path)


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
        check_defaults(SamplingDefaults(values, cap), "/m/generation_config.json")
    message = str(e.value)
    assert named in message and "/m/generation_config.json" in message
    assert "generation_config: vllm" in message


def test_valid_defaults_pass_the_check() -> None:
    check_defaults(sampling_defaults(QWEN3, "auto", {"max_new_tokens": 5}), "ok")


def test_startup_message() -> None:
    model_defaults = sampling_defaults(QWEN3, "auto", {})
    level, message = startup_message(model_defaults, "auto", "Qwen3-8B")
    assert level == logging.WARNING
    assert message.startswith("Qwen3-8B: requests that leave them out get the sampling defaults")
    assert "temperature=0.6" in message and "set engine.model.generation_config: vllm" in message
    level, message = startup_message(sampling_defaults(QWEN3, "vllm", {"top_k": 5}), "vllm", "m")
    assert level == logging.WARNING and "top_k=5" in message
    assert "the model's file is ignored" in message and "set engine" not in message
    level, message = startup_message(SamplingDefaults(), "auto", "SmolLM2")
    assert (level, message) == (
        logging.INFO,
        "SmolLM2: no sampling defaults (generation_config auto)",
    )


def test_describe() -> None:
    assert describe(SamplingDefaults()).startswith("none")
    line = describe(sampling_defaults(QWEN3, "auto", {"max_new_tokens": 8}))
    assert line == (
        "max_tokens=8, temperature=0.6, top_k=20, top_p=0.95, every request's max_tokens at most 8"
    )


def test_more_eos_ids_come_from_the_generation_config_else_the_model_config() -> None:
    """As vLLM's update_from_generation_config: the file's eos ids beyond the model's
    first; with no file, config.json's (transformers' from_model_config); none under
    "vllm"."""
    llama31 = [128001, 128008, 128009]  # Llama 3.1 Instruct: <|eot_id|> is the last
    assert more_eos_token_ids({"eos_token_id": llama31}, {}, "auto", 128001, "f") == (
        128008,
        128009,
    )
    assert more_eos_token_ids(QWEN3, {"eos_token_id": 151645}, "auto", 151645, "f") == (151643,)
    assert more_eos_token_ids({}, {"eos_token_id": llama31}, "auto", 128001, "f") == ()
    assert more_eos_token_ids(None, {"eos_token_id": llama31}, "auto", 128001, "f") == (
        128008,
        128009,
    )
    assert more_eos_token_ids(QWEN3, {}, "vllm", 151645, "f") == ()
    assert more_eos_token_ids({"eos_token_id": 7}, {}, "auto", 7, "f") == ()
    with pytest.raises(ValueError, match=r"gen\.json: eos_token_id \['x'\] is not a token id"):
        more_eos_token_ids({"eos_token_id": ["x"]}, {}, "auto", 1, "gen.json")


def test_with_eos_adds_stop_ids_unless_ignore_eos() -> None:
    params = SamplingParams(stop_token_ids=(5, 9))
    assert with_eos(params, (9, 11)).stop_token_ids == (5, 9, 11)
    assert with_eos(params, ()) is params
    ignoring = SamplingParams(ignore_eos=True)
    assert with_eos(ignoring, (11,)) is ignoring
    # under ignore_eos they stop nothing, but min_tokens masks them (vLLM's
    # _all_stop_token_ids): they travel in masked_eos_token_ids
    waiting = SamplingParams(ignore_eos=True, min_tokens=3, stop_token_ids=(5,))
    masked = with_eos(waiting, (9, 11))
    assert masked.masked_eos_token_ids == (9, 11) and masked.stop_token_ids == (5,)
    assert with_eos(masked, (9, 11)) is masked
    assert params.masked_eos_token_ids == () == with_eos(params, (9, 11)).masked_eos_token_ids


def test_the_tokenizers_eos_is_the_requests_eos_and_the_models_joins_the_others() -> None:
    """vLLM's request EOS is the tokenizer's (stop_reason None, masked by min_tokens
    even under ignore_eos): config.json's first EOS then ends requests as another id."""

    class Tok:
        def __init__(self, eos: object) -> None:
            self.eos_token_id = eos

    assert eos_ids(2, (7,), Tok(9)) == (9, (7, 2))
    assert eos_ids(2, (7, 9), Tok(9)) == (9, (7, 2))  # listed already: not twice
    assert eos_ids(2, (7,), Tok(2)) == (2, (7,))  # the same id
    assert eos_ids(None, (), Tok(0)) == (0, ())
    for none in (None, Tok(None), Tok(True), Tok(-1)):
        assert eos_ids(2, (7,), none) == (2, (7,))
