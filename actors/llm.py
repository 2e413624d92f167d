"""The offline API: `LLM(model=...).generate(prompts, sampling_params)`.

It builds one engine in this process (the scheduler and KV manager of
`actors/engine`, workers through an executor: in-process for TP=1, worker
processes for TP>1) and drives its step loop until the prompts are done.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from spur.actors.builder import EngineArgs, build_engine, load_tokenizer
from spur.actors.engine.core.outputs import RequestOutput
from spur.actors.engine.core.request import RequestStatus
from spur.actors.engine.core.scheduler import check_token_ids
from spur.actors.engine.shell.chat_template import chat_token_ids, template_message
from spur.actors.engine.shell.output_processor import Delta, OutputProcessor
from spur.actors.generation_config import eos_ids, with_eos
from spur.actors.step import SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | list[int]
"""Text, or token ids. `generate` also takes vLLM's prompt dicts: {"prompt": text} and
{"prompt_token_ids": ids} (`TextPrompt`, `TokensPrompt`)."""


class LLM:
    """A whole engine in one process. Not thread-safe.

    Keyword arguments are the engine settings of the config file, flattened: each
    field of `engine.*` (`spur.configs.schema.EngineConfig`) under its own name
    (`model` for model.path; `num_speculative_tokens` > 0 turns speculation on), with
    the schema's defaults and bounds (`spur.configs.engine_args`). For example:
        model: Hugging Face folder, .gguf file, or "SmolLM2-135M-Instruct".
        dtype: float32 | bfloat16 | float16 | auto.
        tokenizer: tokenizer folder (default: the model folder's).
        compute_dtype: auto | float32 | the dtype (actors/worker/compute_dtype.py).
        tensor_parallel_size: worker processes (gloo on CPU, NCCL on CUDA).
        num_kv_blocks / kv_cache_bytes: size of the KV pool (set at most one);
            default: 2 GiB on CPU, gpu_memory_utilization on CUDA.
        max_model_len: default the model's max_position_embeddings, capped to
            what one request can hold in the pool.
    Raises ValueError for an unknown keyword or a value the schema refuses.

    With tensor_parallel_size > 1 the workers are processes started with
    multiprocessing's spawn, which re-runs the main script in each of them: a script
    must create its LLM under `if __name__ == "__main__":` (vLLM's rule too), else every
    worker builds an LLM of its own and dies, and `WorkerError` says so.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        if model is not None:
            kwargs["model"] = model
        self.args = EngineArgs.of(**kwargs)
        built = build_engine(self.args)
        self.engine = built.core
        self.scheduler = built.scheduler
        self.executor = built.executor
        self.info = built.info
        self.sampling_defaults = built.sampling_defaults
        self._more_eos = built.more_eos_token_ids
        self._eos: tuple[int | None, tuple[int, ...]] | None = None
        self._tokenizer: Any = None
        self._ids = itertools.count()
        self.last_run_stats: dict[str, Any] = {}
        self._busy = False  # a generate / chat / stream is running (one at a time)
        self._closed = False

    # -- tokenizer ----------------------------------------------------------------------
    @property
    def tokenizer(self) -> Any:
        """The tokenizer (`tokenizer`, else the model folder's), or None when there is
        none (token ids only)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.args.tokenizer_dir(self.info.model_dir)) or False
        return self._tokenizer or None

    @property
    def eos_token_ids(self) -> tuple[int | None, tuple[int, ...]]:
        """(each request's EOS id, the other EOS ids that end requests without
        ignore_eos), as vLLM sets them (`generation_config.eos_ids`): the tokenizer's
        EOS first, then the model's configs'."""
        if self._eos is None:
            self._eos = eos_ids(self.info.eos_token_id, self._more_eos, self.tokenizer)
        return self._eos

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"{self.info.model_dir} has no tokenizer: pass token ids instead of text"
                )
            return list(self.tokenizer(prompt, add_special_tokens=True)["input_ids"])
        return list(prompt)

    def get_tokenizer(self) -> Any:
        """The tokenizer, or None (vLLM's `LLM.get_tokenizer`)."""
        return self.tokenizer

    def chat_prompt(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        instead: str = (
            "call generate with a prompt you format yourself, or load a model whose "
            "tokenizer has a chat template"
        ),
    ) -> list[int]:
        """Token ids of a chat, with the tokenizer's chat template (by default ending
        with the assistant's turn opener). Raises ValueError (ChatTemplateError) when
        the model has no tokenizer, or no template (the message then offers `instead`:
        what the caller can do without one; the CLI names its flags), or the template
        refuses the messages."""
        if self.tokenizer is None:
            raise ValueError(f"{self.info.model_dir} has no tokenizer: chat needs one")
        # The template already holds the special tokens (BOS, role markers).
        return chat_token_ids(
            self.tokenizer,
            [template_message(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            template_kwargs=chat_template_kwargs,
            instead=instead,
        )

    # -- generation ---------------------------------------------------------------------
    def get_default_sampling_params(self) -> SamplingParams:
        """The params of `generate` / `stream` without any: the model's recommended
        sampling defaults (`engine.model.generation_config`, as vLLM's LLM), else
        SamplingParams()."""
        defaults = self.sampling_defaults
        max_tokens = defaults.max_tokens(None, SamplingParams.max_tokens)
        return SamplingParams(**defaults.fill({}), max_tokens=max_tokens)

    def _add(self, prompt: Prompt, params: SamplingParams, processor: OutputProcessor) -> str:
        rid = str(next(self._ids))
        token_ids = self.encode(prompt)
        check_token_ids(token_ids, self.info.vocab_size)
        eos, more_eos = self.eos_token_ids
        params = with_eos(params, more_eos)
        # The ingress's rule (`api_requests.to_sampling_params`): override_generation_config's
        # max_new_tokens caps every request's max_tokens, explicit ones included. (The
        # fallback is unused: max_tokens is always set here.)
        max_tokens = self.sampling_defaults.max_tokens(params.max_tokens, params.max_tokens)
        if max_tokens != params.max_tokens:
            params = params.with_changes(max_tokens=max_tokens)
        request = self.scheduler.make_request(rid, token_ids, params, eos_token_id=eos)
        # The processor first: it refuses what it cannot follow (stop strings without a
        # tokenizer) before the engine holds a request nobody would collect.
        processor.add_request(rid, prompt if isinstance(prompt, str) else None, token_ids, params)
        try:
            self.engine.add_request(request)
        except BaseException:
            processor.abort(rid)
            raise
        return rid

    def _run(self, processor: OutputProcessor) -> Iterator[list[Delta]]:
        peak_slots = peak_held = steps = running_at_peak = 0
        preempt_before = self.scheduler.total_preemptions
        block_size = self.scheduler.block_size
        while self.engine.has_unfinished_requests():
            outputs, stats = self.engine.step()
            steps += 1
            held = sum(len(r.all_token_ids) for r in self.scheduler.running)
            slots = (self.scheduler.kv.pool.num_blocks - 1 - stats.num_free_blocks) * block_size
            if slots > peak_slots:
                running_at_peak = len(self.scheduler.running)
            peak_slots, peak_held = max(peak_slots, slots), max(peak_held, held)
            update = processor.process(outputs)
            if update.to_finish:
                self.scheduler.finish_requests(update.to_finish, RequestStatus.FINISHED_STOPPED)
            yield update.deltas
        self.last_run_stats = {
            "steps": steps,
            "kv_slots_allocated_peak": peak_slots,
            "kv_tokens_held_peak": peak_held,
            "kv_blocks_used_peak": peak_slots // block_size,
            "running_at_kv_peak": running_at_peak,
            "num_preemptions": self.scheduler.total_preemptions - preempt_before,
            "step_times": self.executor.collective_rpc("step_times")[0],
        }

    @contextlib.contextmanager
    def _one_call(self) -> Iterator[None]:
        """Marks a generate / chat / stream as running. Each call collects only its own
        requests' outputs while it steps the shared engine, so a second one started
        before the first ends would lose tokens: it is refused instead."""
        if self._closed:
            raise RuntimeError("this LLM was shut down: create a new LLM")
        if self._busy:
            raise RuntimeError(
                "this LLM is already running a generate or stream (a stream not read to its "
                "end, or a call from inside its loop): finish or close it first; an LLM runs "
                "one call at a time"
            )
        self._busy = True
        try:
            yield
        finally:
            self._busy = False

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in input order.

        `prompts`: one prompt or a list of them, each text, token ids, or a vLLM prompt
        dict ({"prompt": text} or {"prompt_token_ids": ids}). `use_tqdm`: a progress
        bar on stderr (vLLM's third argument; off by default here). An
        `override_generation_config` max_new_tokens caps every prompt's max_tokens, as on
        the HTTP API. Raises RequestRejected (a
        ValueError naming the fix) for a prompt that can never run, before any prompt
        starts; ValueError for a prompt of another form; RuntimeError while another
        call of this LLM runs, or after `shutdown`.
        """
        batch = prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = (
            [sampling_params] * len(batch)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params) != len(batch):
            raise ValueError(f"{len(batch)} prompts but {len(params)} sampling params")
        with self._one_call():
            processor = OutputProcessor(self.tokenizer)
            ids: list[str] = []
            try:
                for prompt, p in zip(batch, params, strict=True):
                    ids.append(self._add(prompt, p, processor))
                results = {rid: processor.requests[rid].output for rid in ids}
                bar = _progress(len(ids)) if use_tqdm else None
                try:
                    for _ in self._run(processor):
                        if bar is not None:
                            bar.update(sum(o.finished for o in results.values()) - bar.n)
                finally:  # a bar left open redraws itself over the traceback
                    if bar is not None:
                        bar.close()
            except BaseException:  # a refused prompt, an interrupt: leave nothing behind
                self.scheduler.abort_requests(ids)
                raise
        return [results[rid] for rid in ids]

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of {"role", "content"}) or a list
        of them, through the tokenizer's chat template, then `generate` (`use_tqdm` its
        third argument, as vLLM's). Raises ValueError (ChatTemplateError) when the model
        has no template or it refuses."""
        many = bool(messages) and not isinstance(messages[0], Mapping)
        conversations = list(messages) if many else [messages]
        prompts = [
            self.chat_prompt(
                conversation,  # type: ignore[arg-type]
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs,
            )
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def stream(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None
    ) -> Iterator[Delta]:
        """Yield text deltas of one prompt as they are produced (for the CLI). The LLM
        runs nothing else until the stream is read to its end or closed."""
        batch = prompt_list(prompt)
        if len(batch) != 1:
            raise ValueError(f"stream takes one prompt, got {len(batch)}: use generate for several")
        (one,) = batch
        with self._one_call():
            processor = OutputProcessor(self.tokenizer)
            params = sampling_params or self.get_default_sampling_params()
            rid = self._add(one, params, processor)
            try:
                for deltas in self._run(processor):
                    yield from deltas
            finally:  # a caller that stops reading (or an interrupt) aborts the request
                self.scheduler.abort_requests(rid)

    def shutdown(self) -> None:
        """Stop the workers (idempotent); later calls raise RuntimeError."""
        self._closed = True
        self.executor.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def prompt_list(prompts: Any) -> list[Prompt]:
    """`generate`'s prompts as a list of text or token ids: one prompt (text, ids, or a
    vLLM prompt dict) or a sequence of them. Raises ValueError naming the forms for
    anything else (a dict used to become its keys, run as text)."""
    if isinstance(prompts, (str, Mapping)) or (
        isinstance(prompts, list) and prompts and _is_id(prompts[0])
    ):
        return [_one_prompt(prompts)]
    if isinstance(prompts, (list, tuple)):
        return [_one_prompt(p) for p in prompts]
    return [_one_prompt(prompts)]


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _one_prompt(prompt: Any) -> Prompt:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Mapping):
        keys = set(prompt)
        if keys == {"prompt"} and isinstance(prompt["prompt"], str):
            return prompt["prompt"]
        ids = prompt.get("prompt_token_ids")
        if keys == {"prompt_token_ids"} and isinstance(ids, list) and all(map(_is_id, ids)):
            return list(ids)
        raise ValueError(
            f"a prompt dict with keys {sorted(map(str, keys))}: give {{'prompt': text}} or "
            "{'prompt_token_ids': [ids]} (no other keys: multimodal data is not supported)"
        )
    if isinstance(prompt, list) and all(map(_is_id, prompt)):
        return list(prompt)
    raise ValueError(
        f"a prompt of type {type(prompt).__name__}: give text, a list of token ids, or "
        "{'prompt': text} / {'prompt_token_ids': [ids]}"
    )


def _progress(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="Processed prompts", unit="prompt")
