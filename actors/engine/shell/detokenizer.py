"""Incremental detokenization of one request's output, with stop strings.

The engine produces token ids a few at a time; clients want text as soon as it
is final. Decoding every id on its own is wrong (a byte-level BPE token may hold
half of a UTF-8 character, a SentencePiece token's leading space depends on what
precedes it) and decoding the whole output at every step costs O(length) per
token. `IncrementalDetokenizer` decodes a short window of recent ids instead and
passes on only the part of the window's text that later ids can no longer change:

```
 ids:      ... | context ids          | ids whose text is held | new ids
                 ^ window start         (text ends in U+FFFD)
 window text:  [ consumed chars (already passed on, or prompt) | new text ]
                                                               ^ delta = new text
                                                                 minus any trailing
                                                                 U+FFFD run
```

The context ids give the decoder what it needs to place the first new token
(its leading space, the start of a character split over ids); the window start
moves forward every few steps so that each step decodes O(window) ids.

On top of that text stream sits the stop-string check: text that could still be
the start of a stop string is held back, so that a client never receives text
that later turns out to belong to a stop string.

The tokenizer is duck-typed: anything with `decode(ids, skip_special_tokens=...)`
(a Hugging Face tokenizer, or a fake in a test). Its decode must not clean up
tokenization spaces (`clean_up_tokenization_spaces=False`, as for SmolLM2): that
clean-up looks across token boundaries, so a windowed decode cannot reproduce it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from typing import Any, Protocol

_REPLACEMENT = "\ufffd"
"""What a decoder writes for bytes that are not (yet) valid UTF-8."""


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer that the detokenizer uses."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str: ...


def direct_decoder(tokenizer: Any) -> Tokenizer:
    """`tokenizer`, or its Rust decoder where its `decode` comes down to that decoder's.

    A Hugging Face fast tokenizer's `decode` converts the ids (`to_py_obj`) and
    dispatches through two layers before it calls its backend's, then applies the
    tokenization-space clean-up if that is on. The detokenizer decodes once an update
    a request: 64 requests streaming 10,014 tokens took 0.037 s through transformers
    and 0.019 s direct (BENCHMARKS.md, thirty-sixth round). Where the clean-up is off,
    the backend's decode gives the same text, so it is called directly; anything else
    is returned as it is."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return tokenizer
    return _BackendDecoder(backend)


class _BackendDecoder:
    """The `Tokenizer` protocol over a `tokenizers.Tokenizer`."""

    __slots__ = ("_decode",)

    def __init__(self, backend: Any) -> None:
        self._decode = backend.decode

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        # the backend's own default is True: always passed
        return self._decode(token_ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns one request's output token ids into streamable text deltas.

    Contract: the concatenation of everything `update` and `finish` return equals
    `text`, and, without stop strings, equals the decode of the prompt's last ids
    plus the output ids, minus the decode of those prompt ids. For a byte-level
    BPE tokenizer (GPT-2 style, SmolLM2) that is exactly
    `tokenizer.decode(output_ids, skip_special_tokens=...)`; for a SentencePiece
    tokenizer it differs in that the first output token keeps its leading space
    (the text continues the prompt), which a standalone decode strips.

    With stop strings, the text ends just before the first stop string to be
    completed (or just after it with `include_stop_str_in_output`); a match may
    span tokens and updates. Among several matches the one that ends first wins
    (ties: the longer one), which is what a character-by-character stream would
    see, so the result does not depend on how ids are grouped into updates.

    Not thread-safe; one instance per request (and per completion when n > 1).
    """

    CONTEXT_TOKENS = 5
    """Ids kept (up to 3 more, to start on a character boundary) when the window
    moves on, which it does once it holds more than twice this many."""
    MAX_CONTEXT_SEARCH = 24
    """Most prompt ids tried as the first window's context (vLLM's bound too)."""
    MAX_WINDOW_TOKENS = 64
    """Bound on the ids kept besides the newest one. Only reached when
    the window cannot move for that many ids: the model keeps producing invalid
    UTF-8. The held U+FFFD characters are then passed on as they are, which may
    differ from a full decode of such garbage."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        """`min_tokens`: stop strings only match once the output has more ids than
        this (vLLM's rule): a match must end in text that an update past the first
        `min_tokens` ids released. Raises ValueError if a stop string is empty (it
        would match at once)."""
        if isinstance(stop, str):
            stop = (stop,)
        if any(not s for s in stop):
            raise ValueError(f"stop strings must be non-empty, got {tuple(stop)!r}")
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stops = tuple(stop)
        self._include_stop = include_stop_str_in_output
        # A match can begin up to this many chars before the newest text.
        self._lookback = max((len(s) for s in self._stops), default=1) - 1

        # The window: ids whose decode is `_window_text`, of which the first
        # `_consumed` chars have been passed on (or are prompt context).
        # The prompt's last ids as context, the fewest from CONTEXT_TOKENS up to
        # MAX_CONTEXT_SEARCH that decode to a complete character at their end (as vLLM
        # searches): a byte-fallback decoder makes a whole run of byte tokens U+FFFD
        # when the run's first bytes are cut off, so 5 ids inside an emoji run need more.
        context, context_text = [], ""
        for n in range(self.CONTEXT_TOKENS, self.MAX_CONTEXT_SEARCH + 1):
            ids = list(prompt_token_ids[-n:])
            text = self._decode(ids)
            if not text.endswith(_REPLACEMENT):
                context, context_text = ids, text
                break
            if n >= len(prompt_token_ids):
                break
        # None found: the prompt ends inside a character (or in invalid bytes); as
        # context it would glue its partial bytes to the output's first token, so the
        # output is decoded on its own.
        self._ids = context
        self._window_text = context_text
        self._consumed = len(context_text)

        # The stop-string stage: the last `_lookback` chars of the text stream,
        # of which the last `_held` have not been released yet.
        self._recent = ""
        self._held = 0
        self._released: list[str] = []

        self._stopped_by: str | None = None
        self._finished = False
        self._min_tokens = min_tokens
        self._num_tokens = 0  # output ids seen

    @property
    def text(self) -> str:
        """Text released so far: the concatenation of all returned deltas. Once
        `stopped_by` is set or `finish` has run, the request's final text."""
        if len(self._released) > 1:
            self._released[:] = ["".join(self._released)]
        return self._released[0] if self._released else ""

    @property
    def stopped_by(self) -> str | None:
        """The stop string that ended the text, or None. Once set, the caller
        should finish the request (status FINISHED_STOPPED, stop_reason = it);
        later updates are ignored."""
        return self._stopped_by

    def update(self, new_token_ids: Sequence[int]) -> str:
        """Append output ids; return the text that became final (maybe "").

        Mutates the detokenizer. Several ids (accepted drafts, a failover's caught-up
        output) are taken one at a time, as vLLM does: the window moves only where an
        update starts on a character boundary, and with a byte-fallback tokenizer
        updates of k ids out of step with a character's bytes never start on one (the
        stream gave up and passed the byte run on as U+FFFD). Decodes O(CONTEXT_TOKENS)
        ids at most 5 times (usually once) per id. After a stop string matched, returns
        "" and ignores the ids (a step may have produced ids past the stop). Raises
        RuntimeError after `finish`.
        """
        return self.update_counted(new_token_ids)[0]

    def update_counted(self, new_token_ids: Sequence[int]) -> tuple[str, int]:
        """`update`, and how many of the ids the output keeps: all of them, unless a
        stop string is completed, then those up to the one that completed it. One
        step can bring several ids (accepted speculative drafts); fed one by one, as a
        step without drafts brings them, the ids after the stop string's are left out
        of the output, as they would never have been generated."""
        if self._finished:
            raise RuntimeError("update() after finish(): the request has ended")
        if self._stopped_by is not None:
            return "", len(new_token_ids)
        parts = []
        for i, token_id in enumerate(new_token_ids):
            parts.append(self._update_one(token_id))
            if self._stopped_by is not None:
                return "".join(parts), i + 1
        return "".join(parts), len(new_token_ids)

    def _update_one(self, token_id: int) -> str:
        self._num_tokens += 1
        if len(self._ids) > 2 * self.CONTEXT_TOKENS:
            self._try_move_window()
        # Moves kept failing (not counting the newest id): see MAX_WINDOW_TOKENS.
        give_up = len(self._ids) - 1 > self.MAX_WINDOW_TOKENS
        self._ids.append(token_id)
        text = self._decode(self._ids)
        self._window_text = text
        # A trailing run of U+FFFD may be a character whose remaining bytes are
        # still to come: hold the whole run (a byte-fallback decoder writes one
        # U+FFFD per byte of an unfinished character, not one in all).
        stable = len(text) if give_up else len(text.rstrip(_REPLACEMENT))
        delta = text[self._consumed : stable]
        self._consumed = max(self._consumed, stable)
        if give_up:
            self._move_window(len(self._ids) - self.CONTEXT_TOKENS, held=0)
        return self._release(delta, final=False)

    def finish(self) -> str:
        """End the stream (EOS, length, abort): return all text still held back, an
        unfinished character at the end as one U+FFFD. Idempotent; returns "" if a
        stop string already ended the text."""
        if self._finished:
            return ""
        self._finished = True
        if self._stopped_by is not None:
            return ""
        sent = self._consumed
        tail = self._window_text[sent:]
        self._consumed = len(self._window_text)
        if tail and len(self._window_text.rstrip(_REPLACEMENT)) < sent:
            # The U+FFFD run reaches into text already passed on: a byte-fallback decoder
            # turns the whole run of byte tokens that an unfinished character ends into
            # U+FFFD, the characters before it included, so its count says nothing here.
            # One U+FFFD stands for the unfinished character.
            tail = _REPLACEMENT
        return self._release(tail, final=True)

    # -- token window ------------------------------------------------------

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _try_move_window(self) -> None:
        """Drop old ids so that about CONTEXT_TOKENS remain, if that is safe.

        Safe means the ids kept decode the not-yet-passed-on tail, and the char
        before it, exactly as the current window does. A window that starts
        inside a character decodes its first bytes as junk; the check fails if
        that junk reaches the tail (the held character would lose its first
        bytes) or, for a byte-fallback decoder, if it spoils the group of byte
        tokens that the next ids extend (such a decoder writes U+FFFD for every
        byte of a group with any invalid byte). A character has at most 4 bytes,
        so trying 4 starts finds a character boundary unless the ids are
        garbage; if all fail, the window grows and the move is tried again at
        the next update.
        """
        held = len(self._window_text) - self._consumed
        k = held + 1
        if held < 0 or len(self._window_text) < k:
            return
        want = self._window_text[-k:]
        newest = len(self._ids) - self.CONTEXT_TOKENS
        for start in range(newest, max(0, newest - 4), -1):
            moved = self._decode(self._ids[start:])
            if len(moved) >= k and moved[-k] != _REPLACEMENT and moved[-k:] == want:
                self._move_window(start, held, moved)
                return

    def _move_window(self, start: int, held: int, moved: str | None = None) -> None:
        """Make `self._ids[start:]` the window, whose last `held` chars are not
        passed on yet. `moved` is the decode of those ids, if known."""
        del self._ids[:start]
        self._window_text = self._decode(self._ids) if moved is None else moved
        self._consumed = len(self._window_text) - held

    # -- stop strings --------------------------------------------------------

    def _release(self, delta: str, *, final: bool) -> str:
        """Feed final text through the stop-string check; return what the client
        may have now. `final` releases everything held (end of stream)."""
        if not self._stops:
            if delta:
                self._released.append(delta)
            return delta
        buf = self._recent + delta
        new_from = len(self._recent)  # buf[new_from:] is the new text
        unreleased_from = new_from - self._held
        match = self._first_match(buf, new_from) if self._num_tokens > self._min_tokens else None
        if match is not None:
            start, stop = match
            cut = start + len(stop) if self._include_stop else start
            # Held-back text covers any stop-string prefix, so no released text
            # lies past the cut.
            assert cut >= unreleased_from, (cut, unreleased_from)
            out = buf[unreleased_from:cut]
            self._stopped_by = stop
            self._recent, self._held = "", 0
        else:
            hold = 0 if final or self._include_stop else self._partial_stop_len(buf)
            # With include_stop_str_in_output nothing is held: a stop string
            # that later completes is part of the output anyway.
            out = buf[unreleased_from : len(buf) - hold]
            self._recent = buf[-self._lookback :] if self._lookback else ""
            self._held = hold
        if out:
            self._released.append(out)
        return out

    def _first_match(self, buf: str, new_from: int) -> tuple[int, str] | None:
        """The stop string completed first in `buf`, as (start, stop string).

        Only matches that end in the new text `buf[new_from:]` are possible:
        earlier text was checked before. For each stop string the first
        occurrence is its earliest end; across them, the earliest end wins,
        then the longest."""
        best: tuple[int, int, str] | None = None  # (end, -len, stop)
        for s in self._stops:
            i = buf.find(s, max(0, new_from - len(s) + 1))
            if i >= 0:
                key = (i + len(s), -len(s), s)
                if best is None or key < best:
                    best = key
        if best is None:
            return None
        end, neg_len, s = best
        return end + neg_len, s

    def _partial_stop_len(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of a stop
        string: the text that must be held back. At most `_lookback` chars.

        A suffix of 16 chars or more must begin with the stop string's first 16, so
        those candidates are found by one `str.find` over the last len(s) - 1 chars
        and each checked once; the 15 shorter ones are compared directly. Comparing
        every length (as before) was quadratic in the stop string's length, at every
        update of every choice."""
        best = 0
        end = len(buf)
        for s in self._stops:
            longest = min(len(s) - 1, end)
            if longest <= best:
                continue
            head = s[: min(HEAD_CHARS, longest)]
            p = buf.find(head, end - longest)  # leftmost first: the longest suffix
            while p != -1 and end - p > best:
                if s.startswith(buf[p:]):
                    best = end - p
                    break
                p = buf.find(head, p + 1)
            else:
                for k in range(len(head) - 1, best, -1):
                    if buf.endswith(s[:k]):
                        best = k
                        break
        return best


HEAD_CHARS = 16
"""How many first chars of a stop string `_partial_stop_len` searches for at once."""


# -- the bytes of one token (OpenAI's logprobs `bytes`) -----------------------------------
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _decoder_kinds(tokenizer: Any) -> set[str]:
    """The types of a fast tokenizer's decoder (a Sequence's members too); empty when
    it has none or is not a fast tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    parts = decoder.get("decoders") or [decoder]
    return {str(p.get("type")) for p in parts if isinstance(p, dict)}


def token_bytes(tokenizer: Any) -> Callable[[int], bytes]:
    """`tid -> the bytes token tid stands for`: OpenAI's logprobs `bytes`, which
    "must be combined to generate the correct text representation", so a token that
    holds part of a UTF-8 character gives those bytes, not the U+FFFD its own decode
    shows. A byte-level BPE piece (GPT-2, SmolLM2, Llama 3, Qwen) maps through GPT-2's
    byte table; a byte-fallback piece (Llama 2, Mistral) `<0xNN>` is the byte NN and
    its '\u2581' a space; added tokens, and tokenizers of other kinds, give the UTF-8
    of their own decode."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    kinds = _decoder_kinds(tokenizer)
    table = {c: b for b, c in bytes_to_unicode().items()} if "ByteLevel" in kinds else None
    fallback = "ByteFallback" in kinds
    added = set(getattr(tokenizer, "added_tokens_decoder", None) or ())

    def of(tid: int) -> bytes:
        if tid not in added and (table is not None or fallback):
            piece = tokenizer.convert_ids_to_tokens(tid)
            if isinstance(piece, str) and piece:
                if table is not None and all(c in table for c in piece):
                    return bytes(table[c] for c in piece)
                if fallback:
                    match = _BYTE_PIECE.fullmatch(piece)
                    if match:
                        return bytes([int(match.group(1), 16)])
                    return piece.replace("\u2581", " ").encode()
        return tokenizer.decode([tid], skip_special_tokens=False).encode("utf-8", "replace")

    return of
