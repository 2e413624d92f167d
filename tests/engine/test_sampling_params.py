"""`SamplingParams` as the offline API's users build it: vLLM's None defaults, and a
value of the wrong type refused naming its parameter (not a TypeError naming none)."""

from __future__ import annotations

import pytest

from spur.actors.step import SamplingParams, SamplingParamsError


def test_none_stop_fields_are_empty_as_in_vllm():
    """stop=None and stop_token_ids=None (vLLM's defaults, which scripts pass on) were
    a bare TypeError: 'NoneType' object is not iterable."""
    params = SamplingParams(stop=None, stop_token_ids=None)  # type: ignore[arg-type]
    assert params.stop == () and params.stop_token_ids == ()
    assert params == SamplingParams()
    assert SamplingParams(stop="x").stop == ("x",)
    assert SamplingParams(stop=["a", "b"], stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": "0.5"}, "temperature"),
        ({"top_p": None}, "top_p"),
        ({"min_p": "0"}, "min_p"),
        ({"presence_penalty": None}, "presence_penalty"),
        ({"frequency_penalty": "1"}, "frequency_penalty"),
        ({"repetition_penalty": True}, "repetition_penalty"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"stop_token_ids": 7}, "stop_token_ids"),
        ({"stop_token_ids": "12"}, "stop_token_ids"),
        ({"stop": 5}, "stop"),
        ({"stop": [None]}, "stop"),
        ({"n": "2"}, "n"),
        ({"max_tokens": 2.0}, "max_tokens"),
    ],
)
def test_a_wrong_type_is_refused_naming_the_parameter(kwargs, param):
    with pytest.raises(SamplingParamsError, match=f"^{param}=") as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_max_tokens_none_is_refused_naming_the_fix():
    """vLLM's None means "up to max_model_len"; max_tokens is an int through the engine
    core here, so None is refused with the equivalent: a request stops at max_model_len
    (it was "allowed an integer >= 1", naming no way to get vLLM's behaviour)."""
    with pytest.raises(SamplingParamsError, match="give max_tokens=max_model_len") as info:
        SamplingParams(max_tokens=None)  # type: ignore[arg-type]
    assert info.value.param == "max_tokens"


def test_numbers_of_other_real_types_are_taken_as_floats():
    """A sweep built with numpy (float32 scalars) or fractions worked before the type
    checks; it still does, and the fields hold plain floats."""
    from fractions import Fraction

    import numpy as np

    params = SamplingParams(temperature=np.float32(0.5), top_p=Fraction(1, 2))  # type: ignore[arg-type]
    assert params.temperature == 0.5 and type(params.temperature) is float
    assert params.top_p == 0.5 and type(params.top_p) is float
