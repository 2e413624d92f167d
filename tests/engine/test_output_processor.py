"""OutputProcessor: engine outputs to client text, with the SmolLM2 tokenizer. The
token that ended a completion (EOS, a stop_token_id) is in its token ids but not
in its text unless include_stop_str_in_output asks for it (vLLM's rule)."""

from __future__ import annotations

import pytest
import transformers

from spur.actors.engine.core.outputs import EngineCoreOutput
from spur.actors.engine.shell.output_processor import OutputProcessor
from spur.actors.step import SamplingParams


@pytest.fixture(scope="module")
def smol():
    from spur.actors.worker.loader import resolve_model_dir

    return transformers.AutoTokenizer.from_pretrained(resolve_model_dir("SmolLM2-135M-Instruct"))


def run(tok, params: SamplingParams, steps: list[tuple[list[int], str | None, object]]):
    """Feed one completion's engine outputs (ids, finish_reason, stop_reason); return
    (the streamed texts, the final RequestOutput)."""
    proc = OutputProcessor(tok)
    proc.add_request("r", None, tok.encode("Hello"), params)
    texts, final = [], None
    for ids, finish, stop in steps:
        update = proc.process([EngineCoreOutput("r", ids, finish, stop)])
        texts += [d.text for d in update.deltas]
        final = update.finished[0] if update.finished else final
    assert final is not None
    return texts, final


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_id_is_not_in_the_text(smol, include):
    (dot,) = smol.encode(".")
    body = smol.encode(" world")
    params = SamplingParams(
        max_tokens=10, stop_token_ids=(dot,), include_stop_str_in_output=include
    )
    texts, final = run(smol, params, [(body, None, None), ([dot], "stop", dot)])
    out = final.outputs[0]
    assert out.text == "".join(texts) == (" world." if include else " world")
    assert out.token_ids == [*body, dot] and (out.finish_reason, out.stop_reason) == ("stop", dot)


@pytest.mark.parametrize("include", [False, True])
def test_eos_kept_as_a_special_token_is_not_in_the_text(smol, include):
    eos = smol.eos_token_id
    body = smol.encode(" world")
    params = SamplingParams(
        max_tokens=10, skip_special_tokens=False, include_stop_str_in_output=include
    )
    # the stop token and the ids before it in one output (a speculative step's)
    _texts, final = run(smol, params, [([*body, eos], "stop", None)])
    assert final.outputs[0].text == " world" + (smol.decode([eos]) if include else "")


def test_a_stop_token_after_held_text_releases_that_text(smol):
    (dot,) = smol.encode(".")
    body = smol.encode(" a wor")  # "wor" may begin the stop string "world": held
    params = SamplingParams(max_tokens=10, stop=("world",), stop_token_ids=(dot,))
    texts, final = run(smol, params, [(body, None, None), ([dot], "stop", dot)])
    assert final.outputs[0].text == "".join(texts) == " a wor"


def test_stop_strings_wait_for_min_tokens(smol):
    ids = smol.encode(" Hi. How are you. Fine")
    first_dot = next(i for i, t in enumerate(ids) if smol.decode(ids[: i + 1]).endswith("."))
    params = SamplingParams(max_tokens=20, min_tokens=first_dot + 1, stop=(".",))
    steps = [([t], None, None) for t in ids]
    steps[-1] = ([ids[-1]], "length", None)
    _texts, final = run(smol, params, steps)
    out = final.outputs[0]
    # the first "." came with token first_dot + 1 <= min_tokens: it does not stop
    assert (out.text, out.finish_reason, out.stop_reason) == (" Hi. How are you", "stop", ".")
