"""The offline engine end to end on tiny random models: scheduler + KV manager +
model runner + paged attention + sampler, against transformers' own forward.

The oracle is teacher forcing: every token we generate greedily must be the
argmax of transformers' logits at that position given the tokens before it.
(transformers' `generate` with a KV cache drifts from its own full forward on
these tiny random models with llama3 RoPE; the full forward is the reference.)
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from spur.actors.llm import LLM
from spur.actors.step import SamplingParams

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
CONFIGS = {
    "one batch": {},
    "chunked prefill": {"max_num_batched_tokens": 16},
    "tiny pool (preemption)": {"num_kv_blocks": 24, "block_size": 4, "max_num_batched_tokens": 32},
}


def make_prompts(n: int = 6, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(3, 56))] for _ in range(n)]


def teacher_forced_argmax(
    hf_logits: Callable, name: str, prompt: list[int], out: list[int]
) -> list[int]:
    logits = hf_logits(name, prompt + out)  # [len, vocab]
    return logits[len(prompt) - 1 : -1].argmax(-1).tolist()


@pytest.fixture(scope="module")
def runs(tiny_model_dir: Callable[[str], Path]) -> dict:
    """Each tiny model through each engine configuration, every prompt twice
    (the second copy hits the prefix cache)."""
    torch.set_num_threads(1)
    prompts = make_prompts()
    results = {}
    for name in ("llama", "qwen3"):
        for label, kwargs in CONFIGS.items():
            llm = LLM(str(tiny_model_dir(name)), **kwargs)
            try:
                outs = llm.generate(prompts + prompts, GREEDY)
                stats = dict(llm.last_run_stats)
                stats["prefix_hits"] = llm.scheduler.kv.prefix_stats.total_hits
                llm.scheduler.check_integrity()
                free = llm.scheduler.kv.num_free_blocks
                total = llm.scheduler.kv.pool.num_blocks - 1
            finally:
                llm.shutdown()
            results[name, label] = ([o.outputs[0].token_ids for o in outs], stats, free, total)
    return {"prompts": prompts, "results": results}


@pytest.mark.parametrize("name", ["llama", "qwen3"])
@pytest.mark.parametrize("label", list(CONFIGS))
def test_greedy_tokens_match_transformers(runs, hf_logits, name, label):
    prompts = runs["prompts"] * 2
    outs, _, free, total = runs["results"][name, label]
    for prompt, out in zip(prompts, outs, strict=True):
        assert len(out) == 16
        assert out == teacher_forced_argmax(hf_logits, name, prompt, out)
    assert free == total  # every block back in the pool


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_configurations_agree_and_exercise_the_core(runs, name):
    res = runs["results"]
    base = res[name, "one batch"][0]
    assert base[:6] == base[6:]  # the prefix-cached copies give the same text
    for label in CONFIGS:
        assert res[name, label][0] == base, label
    # Blocks are cached once computed: copies admitted in a later step hit.
    assert res[name, "chunked prefill"][1]["prefix_hits"] > 0
    assert res[name, "tiny pool (preemption)"][1]["num_preemptions"] > 0
    assert res[name, "chunked prefill"][1]["steps"] > res[name, "one batch"][1]["steps"]


def test_parallel_sampling_and_seeds(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), block_size=4)
    try:
        prompt = make_prompts(1, seed=5)[0]
        params = SamplingParams(max_tokens=8, temperature=1.0, seed=11, n=3, ignore_eos=True)
        (first,) = llm.generate([prompt], params)
        assert [c.index for c in first.outputs] == [0, 1, 2]
        texts = [tuple(c.token_ids) for c in first.outputs]
        assert len(set(texts)) > 1  # forks get seed + index
        # The same seed gives the same tokens whatever else is in the batch.
        others = make_prompts(4, seed=9)
        batch = llm.generate([*others, prompt], [GREEDY] * 4 + [params])
        assert [tuple(c.token_ids) for c in batch[-1].outputs] == texts
        llm.scheduler.check_integrity()
        assert llm.scheduler.kv.num_free_blocks == llm.scheduler.kv.pool.num_blocks - 1
    finally:
        llm.shutdown()


def test_a_tokenizer_folder_without_a_tokenizer_is_refused_at_start(tiny_model_dir, tmp_path):
    """LLM(tokenizer=<a folder with no tokenizer>) was ignored: text prompts then failed
    naming the model folder, and token-id prompts returned no text."""
    with pytest.raises(ValueError, match=rf"engine.model.tokenizer '{tmp_path}' holds no"):
        LLM(str(tiny_model_dir("llama")), num_kv_blocks=20, tokenizer=str(tmp_path))


def test_bad_input_is_rejected_before_anything_runs(tiny_model_dir):
    llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=20, block_size=4)
    try:
        with pytest.raises(ValueError, match="max_model_len is 76"):
            llm.generate([[1, 2, 3], list(range(200))], GREEDY)
        assert not llm.scheduler.has_unfinished_requests()
        with pytest.raises(ValueError, match="has no tokenizer"):
            llm.generate("text needs a tokenizer", GREEDY)
        # refused by the output processor (no tokenizer for stop strings): nothing stays
        with pytest.raises(ValueError, match="stop strings need a tokenizer"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, stop=["x"]))
        assert not llm.scheduler.has_unfinished_requests()
        # a stream its reader leaves aborts its request
        stream = llm.stream([1, 2, 3], SamplingParams(max_tokens=30, ignore_eos=True))
        next(stream)
        stream.close()
        assert not llm.scheduler.has_unfinished_requests()
        # The engine still serves afterwards.
        (out,) = llm.generate([[1, 2, 3]], GREEDY)
        assert len(out.outputs[0].token_ids) == 16
    finally:
        llm.shutdown()


def _one_request(folder, prompt, params: SamplingParams, **kwargs) -> tuple[list[int], str, object]:
    """(token ids, finish reason, stop reason) of one request on a fresh LLM of `folder`."""
    llm = LLM(str(folder), num_kv_blocks=32, block_size=4, **kwargs)
    try:
        (out,) = llm.generate([prompt], params)
        llm.scheduler.check_integrity()
    finally:
        llm.shutdown()
    c = out.outputs[0]
    return list(c.token_ids), c.finish_reason, c.stop_reason


@pytest.mark.parametrize("source", ["generation_config.json", "config.json"])
def test_the_generation_configs_eos_ids_end_requests(tiny_model_dir, tmp_path, source):
    """Llama 3.1 Instruct lists [<|end_of_text|>, <|eom_id|>, <|eot_id|>]; the model's
    first EOS is the first of them, and a chat turn ends at the last. Every listed id
    ends a request (vLLM's update_from_generation_config), from generation_config.json,
    or config.json when the folder has no generation config; not under "vllm"."""
    import json
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), folder)
    (folder / "generation_config.json").unlink(missing_ok=True)
    prompt = make_prompts(1, seed=5)[0]
    free = SamplingParams(max_tokens=16, temperature=0)

    def generate(params: SamplingParams = free, **kwargs) -> tuple[list[int], str, object]:
        return _one_request(folder, prompt, params, **kwargs)

    config = json.loads((folder / "config.json").read_text())
    primary = config["eos_token_id"]
    tokens, _, _ = generate()
    stop = next(t for t in tokens[3:] if t not in tokens[:3] and t != primary)
    k = tokens.index(stop)
    if source == "config.json":
        config["eos_token_id"] = [primary, stop]
        (folder / "config.json").write_text(json.dumps(config))
    else:
        (folder / source).write_text(json.dumps({"eos_token_id": [primary, stop]}))
    assert generate() == (tokens[: k + 1], "stop", stop)
    ignoring = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    assert generate(ignoring)[0] == tokens
    assert generate(generation_config="vllm")[0] == tokens


def test_the_tokenizers_eos_ends_requests_under_either_mode(tiny_model_dir, tmp_path):
    """A folder whose tokenizer ends a turn at an id its configs do not list (vLLM's
    first EOS is the tokenizer's): that id ends requests, under "auto" and "vllm"."""
    import json
    import shutil

    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), folder)
    (folder / "generation_config.json").unlink(missing_ok=True)
    config = json.loads((folder / "config.json").read_text())
    prompt = make_prompts(1, seed=5)[0]

    def generate(params: SamplingParams, **kwargs) -> tuple[list[int], str, object]:
        return _one_request(folder, prompt, params, **kwargs)

    greedy = SamplingParams(max_tokens=16, temperature=0)
    tokens, _, _ = generate(greedy)
    stop = next(t for t in tokens[3:] if t not in tokens[:3] and t != config["eos_token_id"])
    k = tokens.index(stop)
    vocab = {f"t{i}": i for i in range(config["vocab_size"])}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t0")), eos_token=f"t{stop}"
    )
    tok.save_pretrained(folder)
    # The request's own EOS, as vLLM's: stop_reason None (a stop token id would say it).
    assert generate(greedy) == (tokens[: k + 1], "stop", None)
    assert generate(greedy, generation_config="vllm") == (tokens[: k + 1], "stop", None)
    ignoring = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    assert generate(ignoring)[0] == tokens
    # min_tokens masks it even under ignore_eos (vLLM's _all_stop_token_ids)
    masked = SamplingParams(max_tokens=16, min_tokens=16, temperature=0, ignore_eos=True)
    assert stop not in generate(masked)[0]


def test_max_model_len_beyond_the_models_positions_is_refused(tiny_model_dir):
    import json

    path = tiny_model_dir("llama")
    limit = json.loads((path / "config.json").read_text())["max_position_embeddings"]
    with pytest.raises(ValueError, match=f"max_model_len {limit + 1:,} is more than the model"):
        LLM(str(path), num_kv_blocks=64, block_size=4, max_model_len=limit + 1)


@pytest.mark.slow
def test_tensor_parallel_2_equals_1(tiny_model_dir):
    prompts = make_prompts(4, seed=2)
    results = []
    for tp in (1, 2):
        llm = LLM(str(tiny_model_dir("llama")), tensor_parallel_size=tp, num_threads=1)
        try:
            results.append([o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)])
        finally:
            llm.shutdown()
    assert results[0] == results[1]


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float16", "fp8"])
def test_kv_cache_dtypes(tiny_model_dir, kv_dtype):
    """Lower-precision KV caches run end to end; greedy output mostly agrees
    with the fp32 cache (not exactly: the KV values are rounded)."""
    prompts = make_prompts(6, seed=3)
    outs = {}
    for dtype in ("float32", kv_dtype):
        llm = LLM(str(tiny_model_dir("llama")), kv_cache_dtype=dtype, block_size=4)
        try:
            assert (
                llm.executor.worker.runner.kv_caches[0].dtype
                == {
                    "float32": torch.float32,
                    "bfloat16": torch.bfloat16,
                    "float16": torch.float16,
                    "fp8": torch.uint8,  # e4m3 bits behind a uint8 view on CPU
                }[dtype]
            )
            outs[dtype] = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
        finally:
            llm.shutdown()
    same_first = sum(a[0] == b[0] for a, b in zip(outs["float32"], outs[kv_dtype], strict=True))
    assert all(len(o) == 16 for o in outs[kv_dtype])
    assert same_first >= (3 if kv_dtype == "fp8" else 5), (same_first, outs)


def test_logprobs_are_the_models_top_n(tiny_model_dir, hf_logits):
    prompt = make_prompts(1, seed=8)[0]
    llm = LLM(str(tiny_model_dir("llama")))
    try:
        (out,) = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, logprobs=3))
    finally:
        llm.shutdown()
    comp = out.outputs[0]
    assert comp.logprobs is not None and len(comp.logprobs) == len(comp.token_ids) == 4
    ref = torch.log_softmax(hf_logits("llama", prompt + comp.token_ids), dim=-1)
    for i, (tok, lp) in enumerate(zip(comp.token_ids, comp.logprobs, strict=True)):
        row = ref[len(prompt) - 1 + i]
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()
        assert lp.top[0][0] == tok  # greedy picks the top token
        assert lp.sampled == pytest.approx(row[tok].item(), abs=1e-4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is there")
def test_device_cuda_without_cuda_names_the_setting(tiny_model_dir):
    with pytest.raises(ValueError, match=r"engine.parallelism.device is 'cuda' but this machine"):
        LLM(str(tiny_model_dir("llama")), device="cuda", num_kv_blocks=32, block_size=4)


def test_a_failover_continuation_samples_as_the_unbroken_request(tiny_model_dir):
    """A continuation (the dead replica's output as the prompt's last `resumed` ids)
    counts those ids for presence / frequency penalties and replays a seeded
    request's draws: its tokens are the unbroken request's (with penalties even
    greedy output used to change at the break)."""
    import asyncio
    import dataclasses

    from spur.actors.engine.core.outputs import RequestOutput
    from spur.actors.engine.shell.async_engine import AsyncEngine

    llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=96, block_size=4)
    prompt = make_prompts(1, seed=3)[0]
    cases = [
        SamplingParams(max_tokens=12, temperature=0, presence_penalty=1.5, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0, frequency_penalty=1.0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True),
        SamplingParams(
            max_tokens=12,
            temperature=0.8,
            top_p=0.9,
            seed=11,
            presence_penalty=0.5,
            ignore_eos=True,
        ),
    ]

    async def run() -> list[tuple[list[int], list[int], int]]:
        engine = AsyncEngine(llm.engine, None, eos_token_id=None)

        async def tokens(rid: str, ids: list[int], params: SamplingParams, resumed: int = 0):
            final = None
            async for item in engine.generate(rid, ids, params, resumed=resumed):
                final = item if isinstance(item, RequestOutput) else final
            assert final is not None
            return list(final.outputs[0].token_ids)

        got = []
        try:
            for i, params in enumerate(cases):
                full = await tokens(f"full{i}", prompt, params)
                for k in (1, 5):
                    rest = dataclasses.replace(params, max_tokens=params.max_tokens - k)
                    cont = await tokens(f"cont{i}-{k}", prompt + full[:k], rest, resumed=k)
                    got.append((full, full[:k] + cont, i))
        finally:
            await engine.shutdown()
        return got

    try:
        for full, stitched, i in asyncio.run(run()):
            assert stitched == full, cases[i]
    finally:
        llm.shutdown()


def _word_tokenizer_model(
    tiny_model_dir, tmp_path, *, chat_template: bool = True, positions: int | None = None
) -> Path:
    """A copy of the tiny Llama with a word-level tokenizer ("t5 t6" -> [5, 6]) and (unless
    `chat_template` is false) a chat template that joins the messages' contents;
    `positions`: its max_position_embeddings instead of 128 (a longer stream)."""
    import json
    import shutil

    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path / "worded"
    shutil.copytree(tiny_model_dir("llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    if positions is not None:
        config["max_position_embeddings"] = positions
        (folder / "config.json").write_text(json.dumps(config))
    words = Tokenizer(WordLevel({f"t{i}": i for i in range(config["vocab_size"])}, unk_token="t0"))
    words.pre_tokenizer = Whitespace()
    tok = PreTrainedTokenizerFast(tokenizer_object=words)
    if chat_template:
        tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}t9"
    tok.save_pretrained(folder)
    return folder


def test_vllm_prompt_forms_chat_and_cumulative_logprobs(tiny_model_dir, tmp_path):
    """As vLLM's LLM: prompt dicts ({"prompt"}, {"prompt_token_ids"}) alone or in a list
    (a dict used to be taken as its keys, run as text), `chat` on one conversation or
    several, `get_tokenizer`, and `cumulative_logprob` (None unless logprobs asked)."""
    llm = LLM(str(_word_tokenizer_model(tiny_model_dir, tmp_path)), num_kv_blocks=64, block_size=4)
    try:
        ids = [5, 6, 7, 8]

        def tokens(outs) -> list[list[int]]:
            return [list(o.outputs[0].token_ids) for o in outs]

        plain = tokens(llm.generate([ids], GREEDY))
        assert tokens(llm.generate({"prompt_token_ids": ids}, GREEDY)) == plain
        assert tokens(llm.generate([{"prompt_token_ids": ids}, ids], GREEDY)) == plain * 2
        assert tokens(llm.generate({"prompt": "t5 t6 t7 t8"}, GREEDY)) == plain
        for bad, words in [
            ({"prompt_token_ids": ids, "multi_modal_data": {}}, "no other keys"),
            ((5, 6), "type int"),
            ([ids, 3.5], "type float"),
        ]:
            with pytest.raises(ValueError, match=words):
                llm.generate(bad, GREEDY)
        assert llm.get_tokenizer() is llm.tokenizer
        chat = [{"role": "user", "content": "t5 t6"}, {"role": "assistant", "content": "t7"}]
        (one,) = llm.chat(chat, GREEDY)
        assert one.prompt_token_ids == [5, 6, 7, 9]
        assert tokens(llm.chat([chat, chat[:1]], GREEDY, use_tqdm=True))[0] == tokens([one])[0]
        (scored,) = llm.generate([ids], GREEDY.with_changes(logprobs=0))
        c = scored.outputs[0]
        assert c.cumulative_logprob == pytest.approx(sum(lp.sampled for lp in c.logprobs))
        assert llm.generate([ids], GREEDY)[0].outputs[0].cumulative_logprob is None
        llm.scheduler.check_integrity()
    finally:
        llm.shutdown()


def test_one_call_at_a_time_and_none_after_shutdown(tiny_model_dir):
    """Each call collects only its own requests' outputs while it steps the shared
    engine: a call started while a stream is open lost tokens (both lost them); it is
    refused, and the engine serves again once the stream ends. After shutdown, every
    call is refused with the fix (with TP > 1 it was a bare IndexError)."""
    llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=64, block_size=4)
    prompt = make_prompts(1, seed=9)[0]
    (alone,) = llm.generate([prompt], GREEDY)
    stream = llm.stream(prompt, GREEDY)
    first = next(stream)
    with pytest.raises(RuntimeError, match="one call at a time"):
        llm.generate([prompt], GREEDY)
    with pytest.raises(RuntimeError, match="one call at a time"):
        next(llm.stream(prompt, GREEDY))
    rest = list(stream)
    assert [t for d in [first, *rest] for t in d.token_ids] == alone.outputs[0].token_ids
    assert llm.generate([prompt], GREEDY)[0].outputs[0].token_ids == alone.outputs[0].token_ids
    llm.scheduler.check_integrity()
    llm.shutdown()
    llm.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down: create a new LLM"):
        llm.generate([prompt], GREEDY)


def test_an_interrupted_step_leaks_no_worker_state(tiny_model_dir):
    """A KeyboardInterrupt in the step after a request finished: the step's
    SchedulerOutput carried the finished id, the worker never saw it, and its request
    and sampler state (a penalty row) stayed for good, one more per interrupt."""
    llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=64, block_size=4)
    runner = llm.executor.worker.runner
    real = llm.executor.execute_model
    params = [
        SamplingParams(max_tokens=2, temperature=0.8, repetition_penalty=1.2),
        SamplingParams(max_tokens=20, temperature=0),
    ]
    for _ in range(3):
        calls = [0]

        def interrupted(out, calls=calls):
            calls[0] += 1
            if calls[0] == 3:  # step 2 finished the first request; step 3 carries its id
                raise KeyboardInterrupt
            return real(out)

        llm.executor.execute_model = interrupted
        with pytest.raises(KeyboardInterrupt):
            llm.generate([[5, 6, 7], [8, 9, 10, 11]], params)
        llm.executor.execute_model = real
        llm.generate([[12, 13]], SamplingParams(max_tokens=2, temperature=0))
    llm.generate([[14]], SamplingParams(max_tokens=1, temperature=0))
    # At most the last call's request, whose end the next step would announce.
    assert len(runner.requests.states) <= 1, sorted(runner.requests.states)
    assert runner.sampler_state._num_penalized == 0
    llm.scheduler.check_integrity()


def test_override_max_new_tokens_caps_an_explicit_max_tokens(tiny_model_dir):
    """engine.model.override_generation_config's max_new_tokens caps every request's
    max_tokens, explicit ones included (the HTTP API's rule, vLLM's too): LLM and `spur
    generate` ignored it and generated the request's 10."""
    llm = LLM(
        str(tiny_model_dir("llama")),
        num_kv_blocks=64,
        block_size=4,
        override_generation_config={"max_new_tokens": 3},
    )
    try:
        params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
        (out,) = llm.generate([[5, 6, 7]], params)
        assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].finish_reason == "length"
        streamed = [t for d in llm.stream([5, 6, 7], params) for t in d.token_ids]
        assert streamed == out.outputs[0].token_ids
        # under the cap, a request's own max_tokens stands
        (short,) = llm.generate([[5, 6, 7]], params.with_changes(max_tokens=2))
        assert len(short.outputs[0].token_ids) == 2
        llm.scheduler.check_integrity()
    finally:
        llm.shutdown()


def test_use_tqdm_is_positional_and_the_bar_closes_when_generate_raises(tiny_model_dir):
    """vLLM's generate(prompts, sampling_params, use_tqdm): the third positional argument
    was a TypeError. A generate that raised (an interrupt) left its bar open, to redraw
    itself over whatever came next."""
    from tqdm import tqdm

    llm = LLM(str(tiny_model_dir("llama")), num_kv_blocks=64, block_size=4)
    real = llm.executor.execute_model
    try:
        (out,) = llm.generate([[5, 6, 7]], GREEDY, True)
        assert len(out.outputs[0].token_ids) == 16
        open_bars = len(tqdm._instances)
        calls = [0]

        def interrupted(scheduler_output):
            calls[0] += 1
            if calls[0] == 2:
                raise KeyboardInterrupt
            return real(scheduler_output)

        llm.executor.execute_model = interrupted
        with pytest.raises(KeyboardInterrupt) as info:  # its traceback holds the bar
            llm.generate([[5, 6, 7], [8, 9]], GREEDY, use_tqdm=True)
        assert len(tqdm._instances) == open_bars, info  # closed, not left to the GC
    finally:
        llm.executor.execute_model = real
        llm.shutdown()


def test_offline_chat_without_a_template_names_the_offline_fix(tiny_model_dir, tmp_path):
    """The error told offline users to use /v1/completions, an HTTP route they do not
    have; LLM.chat now says to call generate (`spur generate --chat`: below)."""
    from spur.actors.engine.shell.chat_template import ChatTemplateError

    folder = _word_tokenizer_model(tiny_model_dir, tmp_path, chat_template=False)
    llm = LLM(str(folder), num_kv_blocks=64, block_size=4)
    try:
        with pytest.raises(ChatTemplateError, match="no chat template: call generate") as info:
            llm.chat([{"role": "user", "content": "t5 t6"}], GREEDY)
        assert "/v1/completions" not in str(info.value)
    finally:
        llm.shutdown()


def test_spur_generate_chat_without_a_template_says_drop_chat(tiny_model_dir, tmp_path, capsys):
    """`spur generate --chat` on a model without a chat template: drop --chat (it said
    use /v1/completions)."""
    from spur.cluster.cli import main

    folder = _word_tokenizer_model(tiny_model_dir, tmp_path, chat_template=False)
    assert main(["generate", "--model", str(folder), "--prompt", "t5 t6", "--chat"]) == 2
    err = capsys.readouterr().err
    assert "no chat template: drop --chat" in err and "/v1/completions" not in err, err
    assert err.count("\n") == 1, err


def test_ctrl_c_ends_spur_generate_with_130_and_no_traceback(tiny_model_dir, tmp_path):
    """Ctrl-C while `spur generate` streamed: a KeyboardInterrupt traceback from deep in
    torch and exit status -2 (killed by the signal). Now one line and 130, the shell's."""
    import os
    import signal
    import subprocess
    import sys

    folder = _word_tokenizer_model(tiny_model_dir, tmp_path, positions=65536)
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "spur.cluster.cli", "generate", "--model", str(folder),
            "--prompt", "t5 t6 t7", "--max-tokens", "60000", "--ignore-eos",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.read(1)  # it streams
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    text = err.decode()
    assert proc.returncode == 130, text[-3000:]
    assert "Traceback" not in text and text.strip().endswith("spur: interrupted"), text[-3000:]


def test_tp_without_a_main_guard_names_the_fix(tiny_model_dir, tmp_path):
    """A vLLM-style script with LLM(..., tensor_parallel_size=2) at module level: the
    spawned workers re-run it, fail to start processes of their own and die; the error
    named only "the worker process died (exit code 1)"."""
    import os
    import subprocess
    import sys

    script = tmp_path / "unguarded.py"
    script.write_text(
        "from spur.actors.worker.executors import MultiprocExecutor\n"
        "MultiprocExecutor.failure_grace_s = 1.0  # do not wait long for the other rank\n"
        "from spur import LLM\n"
        f"llm = LLM({str(tiny_model_dir('llama'))!r}, tensor_parallel_size=2, "
        "num_kv_blocks=16, block_size=4, num_threads=1)\n"
    )
    res = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert res.returncode != 0
    last = res.stderr.strip().splitlines()[-1]
    assert f"if {script} creates the LLM at module level" in last, res.stderr[-3000:]
    assert 'under `if __name__ == "__main__":`' in last, last


def test_spur_capacity_defaults_are_the_engines(tiny_model_dir, capsys):
    """`spur capacity` without pool flags assumed 4 GiB of bf16 KV; the engine takes
    2 GiB on CPU in model.dtype (float32): four times the blocks it really has. It now
    takes the engine's defaults and says which it assumed."""
    import json

    from spur.cluster.cli import main

    path = tiny_model_dir("llama")
    assert main(["capacity", "--model", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    llm = LLM(str(path))
    try:
        assert report["num_blocks"] == llm.scheduler.kv.pool.num_blocks
        assert report["max_model_len"] == llm.scheduler.config.max_model_len
    finally:
        llm.shutdown()
    assert report["kv_dtype"] == "float32"
    assert "cache.kv_cache_bytes unset" in report["assumes"]["pool"]
    assert "model.dtype float32" in report["assumes"]["kv_dtype"]
    assert main(["capacity", "--model", str(path)]) == 0
    assert "assumes pool: " in capsys.readouterr().out
