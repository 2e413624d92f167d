"""From engine outputs (token ids per engine request) to what a client sees.

It keeps, per client request, its n completions (forks report under their own
engine ids `<id>#<i>` and are folded back by `parent_id` / `index`), runs an
incremental detokenizer per completion and applies stop strings. A stop string
is found here, on text; the engine must then be told to finish that request
(`Update.to_finish`), so its blocks return at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from spur.actors.engine.core.outputs import CompletionOutput, EngineCoreOutput, RequestOutput
from spur.actors.engine.shell.detokenizer import IncrementalDetokenizer, direct_decoder
from spur.actors.step import Logprobs, SamplingParams


@dataclass
class Delta:
    """What one completion gained in one step (for streaming)."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[Logprobs] | None = None


@dataclass
class Update:
    deltas: list[Delta] = field(default_factory=list)
    finished: list[RequestOutput] = field(default_factory=list)
    # Engine request ids that hit a stop string: finish them in the scheduler.
    to_finish: list[str] = field(default_factory=list)
    # Engine request ids the engine finished this step for one reason ("length") but
    # whose client was told another ("stop": a stop string on the last allowed
    # token): the reason the metrics must count.
    finish_reasons: dict[str, str] = field(default_factory=dict)
    # Engine request ids whose step's ids were cut at a stop string (accepted drafts
    # past it are not output) -> the ids kept: what the metrics count as generated.
    kept: dict[str, int] = field(default_factory=dict)


@dataclass
class _Tracked:
    output: RequestOutput
    detoks: list[Any]  # one IncrementalDetokenizer (or None) per completion
    include_stop: bool  # SamplingParams.include_stop_str_in_output
    carry: str = ""
    """A continuation's text the client has not received yet: sent before the next."""
    skip: int = 0
    """Characters of a continuation's coming text the client already received."""


class OutputProcessor:
    """Not thread-safe. `tokenizer` may be None: then no text, token ids only,
    and stop strings cannot be matched (they are rejected at add time)."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self._decoder = None if tokenizer is None else direct_decoder(tokenizer)
        self.requests: dict[str, _Tracked] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        resumed: int = 0,
        resumed_chars: int | None = None,
    ) -> None:
        """Track a request. `resumed` > 0: the last `resumed` prompt ids are output
        that another replica generated, and whose text it streamed (a failover
        continuation, n == 1). The detokenizer then starts where that replica's was:
        over the ids before them as the prompt, fed those ids. So a stop string across
        the break still matches, and min_tokens (the rest of it, in `params`) counts on.
        The text goes on from the `resumed_chars` characters the client received: what
        that replica held back (the first bytes of a character, a possible start of a
        stop string) still comes, and nothing comes twice, though this detokenizer,
        fed the ids at once, holds back other text than that replica's did (a
        byte-fallback tokenizer decodes a run of byte tokens that ends inside a
        character as U+FFFD throughout). Without `resumed_chars`, the text fed here
        is taken as what the client received."""
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; use stop_token_ids instead")
        outputs = [CompletionOutput(index=i, text="", token_ids=[]) for i in range(params.n)]
        detoks: list[Any] = []
        carry, skip = "", 0
        cut = len(prompt_token_ids) - resumed
        for _ in range(params.n):
            if self._decoder is None:  # no tokenizer
                detoks.append(None)
                continue
            detok = IncrementalDetokenizer(
                self._decoder,
                prompt_token_ids[:cut],
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
                # the resumed ids count, and were checked: no match among them
                min_tokens=params.min_tokens + resumed,
            )
            if resumed:
                caught_up = detok.update(prompt_token_ids[cut:])  # the other replica's
                received = len(caught_up) if resumed_chars is None else resumed_chars
                carry, skip = caught_up[received:], max(0, received - len(caught_up))
            detoks.append(detok)
        self.requests[request_id] = _Tracked(
            RequestOutput(request_id, prompt, list(prompt_token_ids), outputs),
            detoks,
            params.include_stop_str_in_output,
            carry,
            skip,
        )

    def abort(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def process(self, engine_outputs: list[EngineCoreOutput]) -> Update:
        update = Update()
        for eo in engine_outputs:
            rid = eo.parent_id or eo.req_id
            tracked = self.requests.get(rid)
            if tracked is None:
                continue
            if eo.num_cached_tokens > tracked.output.num_cached_tokens:
                tracked.output.num_cached_tokens = eo.num_cached_tokens
            comp = tracked.output.outputs[eo.index]
            if comp.finished:
                continue  # already ended by a stop string
            new_ids, new_logprobs = eo.new_token_ids, eo.new_logprobs
            text = ""
            detok = tracked.detoks[eo.index]
            finish_reason, stop_reason = eo.finish_reason, eo.stop_reason
            if detok is not None:
                ids = new_ids
                if eo.finish_reason == "stop" and ids and not tracked.include_stop:
                    # The engine stopped on a token (EOS, stop_token_ids), which is the
                    # last id: its text is not part of the output (vLLM's rule too).
                    ids = ids[:-1]
                text, used = detok.update_counted(ids) if ids else ("", 0)
                if detok.stopped_by is not None:
                    # Ids past the stop string's (accepted drafts of the same step)
                    # are not output: the same ids as without speculation.
                    new_ids = new_ids[:used]
                    new_logprobs = new_logprobs[:used] if new_logprobs else new_logprobs
                    update.kept[eo.req_id] = used
                    finish_reason, stop_reason = "stop", detok.stopped_by
                    if not eo.finished:
                        update.to_finish.append(eo.req_id)
                    elif eo.finish_reason != "stop":
                        update.finish_reasons[eo.req_id] = "stop"
                elif finish_reason is not None:
                    text += detok.finish()
                if tracked.skip:  # a continuation: the client has this text already
                    cut = min(tracked.skip, len(text))
                    text, tracked.skip = text[cut:], tracked.skip - cut
                if tracked.carry:
                    text, tracked.carry = tracked.carry + text, ""
                comp.text = detok.text
            comp.token_ids.extend(new_ids)
            comp.num_draft_tokens = eo.num_draft_tokens
            comp.num_accepted_tokens = eo.num_accepted_tokens
            if new_logprobs:
                comp.logprobs = (comp.logprobs or []) + new_logprobs
                comp.cumulative_logprob = (comp.cumulative_logprob or 0.0) + sum(
                    lp.sampled for lp in new_logprobs
                )
            comp.finish_reason = finish_reason
            comp.stop_reason = stop_reason
            update.deltas.append(
                Delta(
                    rid,
                    eo.index,
                    text,
                    list(new_ids),
                    finish_reason,
                    stop_reason,
                    new_logprobs,
                )
            )
            if tracked.output.finished:
                update.finished.append(tracked.output)
                del self.requests[rid]
        return update
