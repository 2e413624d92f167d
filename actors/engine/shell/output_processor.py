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


@dataclass
class _Tracked:
    output: RequestOutput
    detoks: list[Any]  # one IncrementalDetokenizer (or None) per completion
    include_stop: bool  # SamplingParams.include_stop_str_in_output


class OutputProcessor:
    """Not thread-safe. `tokenizer` may be None: then no text, token ids only,
    and stop strings cannot be matched (they are rejected at add time)."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _Tracked] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        resumed: int = 0,
    ) -> None:
        """Track a request. `resumed` > 0: the last `resumed` prompt ids are output
        that another replica generated, and whose text it streamed (a failover
        continuation, n == 1). The detokenizer then starts where that replica's was:
        over the ids before them as the prompt, fed those ids without passing on their
        text. So the text it held back (the first bytes of a character, a possible
        start of a stop string) still reaches the client, a stop string across the
        break still matches, and min_tokens (the rest of it, in `params`) counts on."""
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; use stop_token_ids instead")
        outputs = [CompletionOutput(index=i, text="", token_ids=[]) for i in range(params.n)]
        detoks: list[Any] = []
        cut = len(prompt_token_ids) - resumed
        for _ in range(params.n):
            if self.tokenizer is None:
                detoks.append(None)
                continue
            from spur.actors.engine.shell.detokenizer import IncrementalDetokenizer

            detok = IncrementalDetokenizer(
                self.tokenizer,
                prompt_token_ids[:cut],
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
                # the resumed ids count, and were checked: no match among them
                min_tokens=params.min_tokens + resumed,
            )
            if resumed:
                detok.update(prompt_token_ids[cut:])  # streamed by the other replica
            detoks.append(detok)
        self.requests[request_id] = _Tracked(
            RequestOutput(request_id, prompt, list(prompt_token_ids), outputs),
            detoks,
            params.include_stop_str_in_output,
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
            comp.token_ids.extend(eo.new_token_ids)
            comp.num_draft_tokens = eo.num_draft_tokens
            comp.num_accepted_tokens = eo.num_accepted_tokens
            if eo.new_logprobs:
                comp.logprobs = (comp.logprobs or []) + eo.new_logprobs
            text = ""
            detok = tracked.detoks[eo.index]
            finish_reason, stop_reason = eo.finish_reason, eo.stop_reason
            if detok is not None:
                ids = eo.new_token_ids
                if eo.finish_reason == "stop" and ids and not tracked.include_stop:
                    # The engine stopped on a token (EOS, stop_token_ids), which is the
                    # last id: its text is not part of the output (vLLM's rule too).
                    ids = ids[:-1]
                text = detok.update(ids) if ids else ""
                if detok.stopped_by is not None:
                    finish_reason, stop_reason = "stop", detok.stopped_by
                    if not eo.finished:
                        update.to_finish.append(eo.req_id)
                elif finish_reason is not None:
                    text += detok.finish()
                comp.text = detok.text
            comp.finish_reason = finish_reason
            comp.stop_reason = stop_reason
            update.deltas.append(
                Delta(
                    rid,
                    eo.index,
                    text,
                    list(eo.new_token_ids),
                    finish_reason,
                    stop_reason,
                    eo.new_logprobs,
                )
            )
            if tracked.output.finished:
                update.finished.append(tracked.output)
                del self.requests[rid]
        return update
