"""IncrementalDetokenizer: streamed text equals the full decode, windows stay
short, stop strings cut the text and are never leaked while held back."""

from __future__ import annotations

import random

import pytest

from spur.actors.engine.shell.detokenizer import IncrementalDetokenizer, direct_decoder

from .helpers import sp_ids

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

C = IncrementalDetokenizer.CONTEXT_TOKENS

ENGLISH = "The quick brown fox jumps over the lazy dog. It wasn't   there,\n\tnor here!"
MULTIBYTE = "Héllo wörld 🙂 日本語で話す, 你好世界。 Ça va? naïve café ✓ 🚀🚀 Ünïcödé"
CODE = "def f(x):\n    return {'a': [1, 2]}  # done\n\n"


class CountingTokenizer:
    """Wraps a tokenizer and records the length of every decoded id list."""

    def __init__(self, inner):
        self.inner = inner
        self.lengths: list[int] = []

    def decode(self, ids, skip_special_tokens=False):
        self.lengths.append(len(ids))
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


class PieceTokenizer:
    """Id i decodes to pieces[i]; decode concatenates. For exact token
    boundaries in stop-string tests."""

    def __init__(self, pieces: list[str]):
        self.pieces = pieces

    def decode(self, ids, skip_special_tokens=False):
        return "".join(self.pieces[i] for i in ids)


def stream(detok: IncrementalDetokenizer, ids: list[int], step: int = 1) -> list[str]:
    """Feed `ids` `step` at a time, then finish; return every delta."""
    deltas = [detok.update(ids[i : i + step]) for i in range(0, len(ids), step)]
    deltas.append(detok.finish())
    return deltas


# -- streaming equals the full decode ------------------------------------------


@pytest.mark.parametrize("step", [1, 3])
@pytest.mark.parametrize("text", [ENGLISH, MULTIBYTE, CODE], ids=["en", "multibyte", "code"])
def test_stream_equals_full_decode(smol, text, step):
    ids = smol.encode(text)
    prompt = smol.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert smol.convert_tokens_to_ids("<|im_start|>") in prompt[-C:]  # a special in the context
    detok = IncrementalDetokenizer(smol, prompt)
    deltas = stream(detok, ids, step)
    assert "".join(deltas) == smol.decode(ids, skip_special_tokens=True) == text
    assert detok.text == text
    assert detok.stopped_by is None
    # Partial characters are held back, never streamed as U+FFFD.
    assert not any("\ufffd" in d for d in deltas)


def test_multibyte_text_really_splits_characters_over_tokens(smol):
    """Guards the test above: it must exercise tokens holding part of a char."""
    ids = smol.encode(MULTIBYTE)
    assert sum("\ufffd" in smol.decode([i]) for i in ids) >= 4


def test_random_ids_match_full_decode(smol):
    """Arbitrary ids (invalid UTF-8, special tokens, split characters) in
    arbitrary groups: the stream still adds up to the full decode."""
    rng = random.Random(1234)
    pieces = smol.encode(MULTIBYTE)  # ids holding parts of characters
    prompt = smol.encode("Say something:")
    for _ in range(60):
        # Half split-character pieces, a tenth special tokens, the rest anything.
        draws = [rng.random() for _ in range(rng.randrange(1, 40))]
        ids = [
            rng.choice(pieces)
            if r < 0.5
            else rng.randrange(17)
            if r < 0.6
            else rng.randrange(49152)
            for r in draws
        ]
        skip = rng.random() < 0.5
        detok = IncrementalDetokenizer(smol, prompt, skip_special_tokens=skip)
        out = "".join(stream(detok, ids, rng.randrange(1, 5)))
        assert out == smol.decode(ids, skip_special_tokens=skip)


def test_direct_decoder_gives_the_tokenizers_text(smol, sentencepiece):
    """The Rust decoder the output processor streams through, for a fast tokenizer
    without clean-up, decodes every id list as the tokenizer does, specials skipped or
    kept (its own default skips them); the random-id stream above adds up through it too.
    A tokenizer with clean-up on keeps its own decode."""
    direct = direct_decoder(smol)
    assert direct is not smol and not smol.clean_up_tokenization_spaces
    rng = random.Random(7)
    specials = list(range(17))
    for _ in range(200):
        ids = [
            rng.choice(specials) if rng.random() < 0.2 else rng.randrange(49152)
            for _ in range(rng.randrange(0, 30))
        ]
        for skip in (True, False):
            assert direct.decode(ids, skip_special_tokens=skip) == smol.decode(
                ids, skip_special_tokens=skip
            )
    assert "<|im_end|>" in direct.decode(smol.encode("<|im_end|>"))  # default: kept
    ids = [*smol.encode(MULTIBYTE), 2, *smol.encode(CODE)]
    for skip in (True, False):
        detok = IncrementalDetokenizer(direct, smol.encode("Say:"), skip_special_tokens=skip)
        assert "".join(stream(detok, ids, 2)) == smol.decode(ids, skip_special_tokens=skip)
    sp = direct_decoder(sentencepiece)  # byte fallback, through the Rust decoder too
    assert sp is not sentencepiece
    out = sp_ids(sentencepiece, "Hello日本 world!")
    assert "".join(stream(IncrementalDetokenizer(sp, []), out)) == "Hello日本 world!"
    cleaned = transformers.AutoTokenizer.from_pretrained(
        smol.name_or_path, clean_up_tokenization_spaces=True
    )
    assert direct_decoder(cleaned) is cleaned


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_skipped_or_kept(smol, skip):
    im_end, im_start = smol.convert_tokens_to_ids(["<|im_end|>", "<|im_start|>"])
    ids = [*smol.encode("Hi there"), im_end, im_start, *smol.encode("again")]
    detok = IncrementalDetokenizer(smol, [], skip_special_tokens=skip)
    out = "".join(stream(detok, ids))
    assert out == smol.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in out) is not skip


def test_prompt_ending_inside_a_character_is_not_glued_to_output(smol):
    ids = smol.encode("日本語")
    split = next(i for i in range(1, len(ids)) if smol.decode(ids[:i]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(smol, ids[:split])
    out_ids = smol.encode(" ok")
    assert "".join(stream(detok, out_ids)) == " ok"


def test_sentencepiece_leading_space_and_byte_fallback(sentencepiece):
    sp = sentencepiece
    out = sp_ids(sp, ["▁Hello", "日本", "▁world", "!"])
    # No prompt: exactly the standalone decode (leading space stripped).
    assert "".join(stream(IncrementalDetokenizer(sp, []), out)) == "Hello日本 world!"
    assert sp.decode(out) == "Hello日本 world!"
    # With a prompt the output continues it: the first token keeps its space,
    # as in decode(prompt + output) minus decode(prompt).
    prompt = sp_ids(sp, ["▁The", "▁end"])
    deltas = stream(IncrementalDetokenizer(sp, prompt), out)
    full, head = sp.decode(prompt + out), sp.decode(prompt)
    assert "".join(deltas) == full[len(head) :] == " Hello日本 world!"
    assert not any("\ufffd" in d for d in deltas)


def test_sentencepiece_cut_inside_a_character_ends_in_one_replacement(sentencepiece):
    """max_tokens cuts one byte into 語 after 日本, all three spelled in byte tokens:
    the decoder makes the whole byte run U+FFFD, 日本 included (HF decode:
    'Hello' + 7 x U+FFFD); the text keeps 日本, already streamed, and one U+FFFD
    for the unfinished character (it used to end in five)."""
    sp = sentencepiece
    out = sp_ids(sp, ["\u2581Hello", "日本"]) + sp_ids(sp, ["語"])[:1]
    detok = IncrementalDetokenizer(sp, [])
    deltas = [detok.update([i]) for i in out] + [detok.finish()]
    assert "".join(deltas) == detok.text == "Hello日本\ufffd"


def test_sentencepiece_long_byte_fallback_run(sentencepiece):
    """90 byte tokens in a row: each 3-byte character spans 3 ids and the byte
    group never ends, so only some window starts decode cleanly."""
    sp = sentencepiece
    text = "日本語で話すのは楽しいです" * 3
    out = sp_ids(sp, ["▁Hello", text, "!"])
    counting = CountingTokenizer(sp)
    deltas = stream(IncrementalDetokenizer(counting, []), out)
    assert "".join(deltas) == "Hello" + text + "!"
    assert not any("\ufffd" in d for d in deltas)
    # While a character is incomplete the window may not move: a few ids more.
    assert max(counting.lengths) <= 2 * C + 4


@pytest.mark.parametrize("tail", ["😀", "😀😀", "日本", "é"])
def test_a_prompt_ending_in_byte_tokens_is_context_for_the_first_output_token(sentencepiece, tail):
    """The prompt's last 5 ids began inside a run of byte tokens, which the decoder makes
    all U+FFFD: the context was dropped and the output's first token lost its space
    ('world!' for ' world!'). The context is now the fewest ids, up to 24, that end on a
    complete character."""
    sp = sentencepiece
    prompt = sp_ids(sp, ["\u2581Hello", tail])
    out = sp_ids(sp, ["\u2581world", "!"])
    detok = IncrementalDetokenizer(sp, prompt)
    text = "".join(stream(detok, out))
    assert text == sp.decode(prompt + out)[len(sp.decode(prompt)) :] == " world!"


@pytest.mark.parametrize("k", range(2, 9))
def test_byte_fallback_text_streamed_k_ids_at_a_time(sentencepiece, k):
    """Steps of k ids (1 + accepted drafts): the window moved only where an update
    began on a character boundary, which updates out of step with a character's bytes
    never do; after 64 ids the stream gave up and sent valid emoji, CJK and accents as
    U+FFFD (k = 2, 3, 4, 6, 8 failed)."""
    sp = sentencepiece
    the = sp.vocab_map["\u2581The"]
    for text in ("😀" * 40, "中文字符" * 15, "éàü" * 30, "日本😀é€" * 12):
        for lead in range(4):  # where the byte run starts against the update boundaries
            ids = [the] * (lead + 1) + sp_ids(sp, [text])
            detok = IncrementalDetokenizer(sp, [])
            deltas = [detok.update(ids[i : i + k]) for i in range(0, len(ids), k)]
            deltas.append(detok.finish())
            assert "".join(deltas) == sp.decode(ids), (text[:4], lead)
            assert "\ufffd" not in "".join(deltas)


# -- cost per update ---------------------------------------------------------


@pytest.mark.parametrize("step", [1, 4])
def test_decode_windows_are_bounded(smol, step):
    ids = smol.encode((ENGLISH + MULTIBYTE + CODE) * 4)
    assert len(ids) > 300
    counting = CountingTokenizer(smol)
    detok = IncrementalDetokenizer(counting, smol.encode("A long prompt " * 50))
    deltas = stream(detok, ids, step)
    assert "".join(deltas) == smol.decode(ids)
    # Each decode covers the context plus the last two ids (an update of several ids
    # is taken one id at a time, as vLLM does: see the byte-fallback test above)...
    assert max(counting.lengths) <= 2 * C + 2
    # ...and there are one or two decodes per id, not per id so far.
    assert len(counting.lengths) <= 2 * len(ids) + 1


# -- stop strings --------------------------------------------------------------


def _spans_tokens(tok, ids: list[int], stop: str) -> bool:
    return stop in tok.decode(ids) and not any(stop in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("step", [1, 3])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(smol, step, include):
    text = "The answer is 42. Goodbye now, and the answer is 42 again."
    stop = "is 42."
    ids = smol.encode(text)
    assert _spans_tokens(smol, ids, stop)
    detok = IncrementalDetokenizer(smol, [], stop=[stop], include_stop_str_in_output=include)
    deltas = stream(detok, ids, step)
    cut = text.index(stop) + (len(stop) if include else 0)
    assert "".join(deltas) == detok.text == text[:cut]
    assert detok.stopped_by == stop


def test_updates_after_stop_are_ignored(smol):
    detok = IncrementalDetokenizer(smol, [], stop=["stop"])
    assert detok.update(smol.encode("go stop")) == "go "
    assert detok.stopped_by == "stop"
    assert detok.update(smol.encode(" more")) == ""
    assert detok.finish() == ""
    assert detok.text == "go "


def test_stop_string_at_the_very_start(smol):
    ids = smol.encode("Sure! Here it is.")
    detok = IncrementalDetokenizer(smol, [], stop=["Sure"])
    deltas = stream(detok, ids)
    assert deltas == [""] * len(deltas)
    assert detok.text == ""
    assert detok.stopped_by == "Sure"


def test_partial_stop_string_is_held_then_released(smol):
    detok = IncrementalDetokenizer(smol, [], stop=["world peace"])
    assert detok.update(smol.encode("Hello world")) == "Hello "  # "world" may start it
    assert detok.update(smol.encode(" war")) == "world war"
    assert detok.update(smol.encode(" and world")) == " and "
    assert detok.finish() == "world"  # the request ended otherwise: release it
    assert detok.text == "Hello world war and world"
    assert detok.stopped_by is None


def test_include_stop_string_holds_nothing_back(smol):
    detok = IncrementalDetokenizer(smol, [], stop=["world peace"], include_stop_str_in_output=True)
    assert detok.update(smol.encode("Hello world")) == "Hello world"
    assert detok.update(smol.encode(" peace now")) == " peace"
    assert detok.stopped_by == "world peace"


def test_first_completed_stop_string_wins_whatever_the_grouping():
    tok = PieceTokenizer(list("abcdx"))
    ids = [4, 0, 1, 2, 3]  # "xabcd"
    for step in (1, 2, 5):
        detok = IncrementalDetokenizer(tok, [], stop=["abcd", "bc", "c"])
        assert "".join(stream(detok, ids, step)) == "xa"
        assert detok.stopped_by == "bc"  # ends with "c", and is longer


def _reference(raw: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Cut `raw` at the stop string completed first (ties: the longest)."""
    hits = [(raw.find(s) + len(s), -len(s), s) for s in stops if s in raw]
    if not hits:
        return raw, None
    end, neg_len, s = min(hits)
    return raw[: end if include else end + neg_len], s


def _longest_partial(raw: str, stops: list[str]) -> int:
    return max(
        (k for s in stops for k in range(1, len(s)) if raw.endswith(s[:k])),
        default=0,
    )


def test_random_stop_strings_against_reference():
    """Random pieces and stop strings over a 3-letter alphabet: the stream is
    cut exactly as the reference says, and after every update exactly the text
    that cannot begin a stop string has been released (no leak, no over-holding)."""
    rng = random.Random(7)
    pieces = ["a", "b", "c", "ab", "ba", "cab", "bca", "aaa"]
    tok = PieceTokenizer(pieces)
    for _ in range(300):
        stops = ["".join(rng.choice("abc") for _ in range(rng.randrange(1, 5))) for _ in range(3)]
        include = rng.random() < 0.3
        ids = [rng.randrange(len(pieces)) for _ in range(rng.randrange(1, 12))]
        detok = IncrementalDetokenizer(tok, [], stop=stops, include_stop_str_in_output=include)
        raw, released, i = "", "", 0
        while i < len(ids) and detok.stopped_by is None:
            n = rng.randrange(1, 4)
            raw += tok.decode(ids[i : i + n])
            released += detok.update(ids[i : i + n])
            i += n
            if detok.stopped_by is None:
                hold = 0 if include else _longest_partial(raw, stops)
                assert released == raw[: len(raw) - hold], (stops, raw)
        released += detok.finish()
        expected, stopped_by = _reference(raw, stops, include)
        assert (released, detok.stopped_by) == (expected, stopped_by), (stops, raw)
        assert detok.text == released


def test_long_stop_strings_hold_back_exactly_their_partial_match():
    """Stop strings of 5-40 chars over a 2-letter alphabet, so that most positions
    of the held-back text could begin one: the text released after every update is
    all that cannot begin a stop string, and the cut is the reference's."""
    rng = random.Random(11)
    pieces = ["a", "b", "ab", "ba", "aab"]
    tok = PieceTokenizer(pieces)
    for _ in range(200):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randrange(5, 41))) for _ in range(2)]
        ids = [rng.randrange(len(pieces)) for _ in range(rng.randrange(1, 60))]
        detok = IncrementalDetokenizer(tok, [], stop=stops)
        raw, released = "", ""
        for i in ids:
            if detok.stopped_by is not None:
                break
            raw += tok.decode([i])
            released += detok.update([i])
            if detok.stopped_by is None:
                assert released == raw[: len(raw) - _longest_partial(raw, stops)], (stops, raw)
        released += detok.finish()
        assert (released, detok.stopped_by) == _reference(raw, stops, False), (stops, raw)


# -- misuse --------------------------------------------------------------------


def test_misuse_raises():
    tok = PieceTokenizer(["a"])
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(tok, [], stop=["x", ""])
    detok = IncrementalDetokenizer(tok, [])
    assert detok.update([0]) == "a"
    assert detok.finish() == ""
    assert detok.finish() == ""
    with pytest.raises(RuntimeError, match="after finish"):
        detok.update([0])


def test_invalid_utf8_run_keeps_the_window_bounded(smol):
    """200 lone UTF-8 lead bytes: no id ends a character, so the window cannot
    move safely; past MAX_WINDOW_TOKENS the U+FFFD are passed on as they are."""
    lead = smol.convert_tokens_to_ids("æ")  # the byte 0xE6 alone
    ids = [lead] * 200 + smol.encode(" ok")
    counting = CountingTokenizer(smol)
    deltas = stream(IncrementalDetokenizer(counting, []), ids)
    assert "".join(deltas) == smol.decode(ids) == "\ufffd" * 200 + " ok"
    assert max(counting.lengths) <= IncrementalDetokenizer.MAX_WINDOW_TOKENS + 4


@pytest.mark.parametrize("text", [MULTIBYTE, ENGLISH, CODE])
def test_token_bytes_join_into_the_texts_utf8(smol, sentencepiece, text):
    """OpenAI's logprobs `bytes`: a token that holds part of a character gives those
    bytes (its own decode shows U+FFFD), so a text's tokens' bytes join into its UTF-8,
    for a byte-level BPE (SmolLM2) and a byte-fallback tokenizer (Llama 2 style)."""
    from spur.actors.engine.shell.detokenizer import token_bytes

    of = token_bytes(smol)
    ids = smol.encode(text, add_special_tokens=False)
    assert any("\ufffd" in smol.decode([t]) for t in ids) == (text == MULTIBYTE)
    assert b"".join(of(t) for t in ids) == text.encode()
    end = smol.convert_tokens_to_ids("<|im_end|>")
    assert of(end) == b"<|im_end|>"

    of = token_bytes(sentencepiece)
    words = text.split(" ")
    pieces = [words[0]]
    for w in words[1:]:  # a word out of the vocabulary: its space, then its bytes
        pieces += [f"\u2581{w}"] if f"\u2581{w}" in sentencepiece.vocab_map else ["\u2581", w]
    ids = sp_ids(sentencepiece, [p for p in pieces if p])
    assert b"".join(of(t) for t in ids) == text.encode()


def test_logprob_tokens_join_into_the_text_sentencepiece_spaces_included(sentencepiece):
    """A SentencePiece decoder strips a lone token's leading space (decode of
    "\u2581world" alone is "world"); logprobs spell tokens from their bytes, so
    `tokens` join into the text and text_offset counts its spaces, as vLLM's
    incremental detokenization of each logprob token does."""
    from spur.actors.engine.shell.detokenizer import token_bytes
    from spur.actors.step import Logprobs
    from spur.cluster import api_responses as rs

    ids = sp_ids(sentencepiece, ["\u2581Hello", "\u2581world", "!", "\u2581The", "\u2581end"])
    assert sentencepiece.decode(ids[1:2]) == "world"  # the decoder's own spelling
    strs = rs.token_strings(token_bytes(sentencepiece))
    lp = rs.completion_logprobs(ids, [Logprobs(-1.0, [])] * len(ids), strs, num_top=0)
    assert lp["tokens"] == [" Hello", " world", "!", " The", " end"]
    assert lp["text_offset"] == [0, 6, 12, 13, 17]
