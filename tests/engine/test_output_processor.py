"""OutputProcessor: engine outputs to client text, with the SmolLM2 tokenizer. The
token that ended a completion (EOS, a stop_token_id) is in its token ids but not
in its text unless include_stop_str_in_output asks for it (vLLM's rule)."""

from __future__ import annotations

import pytest

from spur.actors.engine.core.outputs import EngineCoreOutput
from spur.actors.engine.shell.output_processor import OutputProcessor
from spur.actors.step import SamplingParams

from .helpers import sp_ids


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


@pytest.mark.parametrize("grouped", [False, True])
def test_ids_after_a_stop_string_in_the_same_step_are_not_output(smol, grouped):
    """A speculative step brings several ids at once (accepted drafts). When a stop
    string completes at one of them, the ids after it are not output (token ids,
    the streamed delta's ids, logprobs), as one id per step would never have
    generated them: the same output whether ids come grouped or one by one."""
    from spur.actors.step import Logprobs

    ids = smol.encode(" into a narrow valley. Farmers there")
    done = next(i for i in range(len(ids)) if "valley" in smol.decode(ids[: i + 1])) + 1
    params = SamplingParams(max_tokens=40, stop=("valley",), logprobs=0)
    proc = OutputProcessor(smol)
    proc.add_request("r", None, smol.encode("Hello"), params)
    groups = [ids] if grouped else [[t] for t in ids]
    deltas, final, to_finish = [], None, []
    for group in groups:
        lps = [Logprobs(sampled=-float(t), top=[]) for t in group]
        update = proc.process([EngineCoreOutput("r", group, None, None, new_logprobs=lps)])
        deltas += update.deltas
        to_finish += update.to_finish
        final = update.finished[0] if update.finished else final
    assert final is not None and to_finish == ["r"]
    out = final.outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (" into a narrow ", "stop", "valley")
    assert out.token_ids == ids[:done] == [t for d in deltas for t in d.token_ids]
    assert [lp.sampled for lp in out.logprobs] == [-float(t) for t in ids[:done]]
    assert [lp.sampled for d in deltas for lp in d.logprobs] == [-float(t) for t in ids[:done]]


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


def _stream_over_a_break(tok, text: str, k: int, params: SamplingParams, ids=None):
    """`text`'s ids (or `ids`) as output: the first `k` from one processor (the replica
    that died), the rest from a second one given prompt + those ids with resumed=k and
    the characters the client received (the failover continuation). Returns (all
    streamed text, the final output's stop)."""
    prompt, ids = tok.encode("Hello"), ids or tok.encode(text)
    first = OutputProcessor(tok)
    first.add_request("r", None, prompt, params)
    texts = []
    for t in ids[:k]:
        update = first.process([EngineCoreOutput("r", [t], None, None)])
        texts += [d.text for d in update.deltas]
        if update.finished:  # stopped before the break
            return "".join(texts), update.finished[0].outputs[0].stop_reason
    second = OutputProcessor(tok)
    rest = SamplingParams(**{**params.__dict__, "min_tokens": max(0, params.min_tokens - k)})
    received = len("".join(texts))  # what the ingress counted (EngineStream.streamed_chars)
    second.add_request("r-c1", None, prompt + ids[:k], rest, resumed=k, resumed_chars=received)
    final = None
    for i, t in enumerate(ids[k:]):
        last = i == len(ids) - k - 1
        update = second.process([EngineCoreOutput("r-c1", [t], "length" if last else None, None)])
        texts += [d.text for d in update.deltas]
        if update.finished:
            final = update.finished[0]
            break
    assert final is not None
    return "".join(texts), final.outputs[0].stop_reason


def test_a_failover_continuation_loses_no_held_text(smol):
    """The replica that died held back the first bytes of a character split over
    tokens: the continuation's text picks up where its text stopped."""
    text = " 日本語で話す and more"
    n = len(smol.encode(text))
    for k in range(1, n):
        got, _ = _stream_over_a_break(smol, text, k, SamplingParams(max_tokens=50))
        assert got == text, k


def test_a_failover_continuation_repeats_nothing_with_byte_tokens(sentencepiece):
    """Fed the streamed ids at once, the continuation's decoder turns a run of byte
    tokens that ends inside a character into U+FFFD throughout, so it holds back
    characters the dead replica had already sent: the client's count says where the
    text goes on (it used to send them twice: ' The word is 日日本語 and')."""
    tok = sentencepiece
    ids = sp_ids(tok, ["\u2581The", "\u2581word", "\u2581is", "\u2581", "日本語", "\u2581and"])
    assert tok.decode(ids) == "The word is 日本語 and"
    text = " The word is 日本語 and"  # after the prompt, its first space is not stripped
    for k in range(1, len(ids)):
        got, _ = _stream_over_a_break(tok, text, k, SamplingParams(max_tokens=50), ids=ids)
        assert got == text, k


def test_a_stop_string_across_a_failover_break_still_stops(smol):
    text = " Hi.\nHow are you"
    params = SamplingParams(max_tokens=50, stop=(".\n",))
    n = len(smol.encode(text))
    for k in range(1, n):
        got, stop = _stream_over_a_break(smol, text, k, params)
        assert (got, stop) == (" Hi", ".\n"), k
