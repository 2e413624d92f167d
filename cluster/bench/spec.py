"""`spur bench spec`: n-gram speculative decoding on and off, same engine, same run.

Two seeded workloads, chat-templated for SmolLM2-Instruct, greedy (so both arms
must produce the same tokens, which the bench checks):

- "repeat": each prompt holds a passage of about 300 tokens (whole sentences of
  the engine bench's prose, from a seeded offset) and asks for it back verbatim;
  up to 320 output tokens, ending at EOS. The case speculation is for.
- "chat": prompts of about 50 tokens (a few seeded notes, then a request for a
  story on a seeded topic), 128 output tokens (ignore_eos): ordinary generation,
  where drafts are rare and mostly wrong. The case where it must not cost much.

Each workload runs at each concurrency (1 and 16: requests are kept in flight up
to that many, a new one joining as one finishes). One engine serves both arms
(`LLM(num_speculative_tokens=k)`; the "off" arm takes its proposer away, so no
request drafts and every step is an ordinary one); the prefix cache is reset
before every arm. With `rounds` > 1 the arms alternate (off, on, on, off, ...)
and each level reports the median of the per-round ratios on / off
(docs/architecture.md, "Facts the code relies on": absolute speed on a shared
machine is noise; back-to-back ratios are not). Tokens/s is generated tokens
over the arm's wall time; ITL is the gap between a request's steps divided by
the tokens that step gave it.

This module imports no torch (cluster/ never does); `spur.actors.llm` is
imported inside `run`.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from typing import Any

from spur.cluster.bench.cpu import cpu_info
from spur.cluster.bench.engine import TEXT
from spur.cluster.bench.serve import WORDS, percentile_ms

SENTENCES = [s.strip() + "." for s in TEXT.split(". ") if s.strip()]
TOPICS = (
    "a lighthouse keeper",
    "a lost dog in a big city",
    "the first day at a new school",
    "a storm at sea",
    "a baker who cannot sleep",
    "two friends climbing a mountain",
    "a robot learning to paint",
    "a village without electricity",
)
WORKLOADS = ("repeat", "chat")


def repeat_messages(n: int, seed: int, passage_words: int = 220) -> list[list[dict[str, str]]]:
    """n chats asking for a passage of about 300 tokens back, verbatim."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        start = rng.randrange(len(SENTENCES))
        words: list[str] = []
        i = start
        while len(words) < passage_words:
            words.extend(SENTENCES[i % len(SENTENCES)].split())
            i += 1
        passage = " ".join(words)
        text = f"Repeat the following text exactly, word for word:\n\n{passage}"
        out.append([{"role": "user", "content": text}])
    return out


def chat_messages(n: int, seed: int) -> list[list[dict[str, str]]]:
    """n chats of about 50 tokens asking for a story."""
    rng = random.Random(seed + 1)
    out = []
    for _ in range(n):
        notes = " ".join(rng.choice(WORDS) for _ in range(rng.randint(18, 26)))
        topic = rng.choice(TOPICS)
        text = f"Here are some notes: {notes}. Now write a long story about {topic}."
        out.append([{"role": "user", "content": text}])
    return out


def drive(llm: Any, prompts: list[list[int]], params: Any, concurrency: int) -> dict[str, Any]:
    """Run `prompts` through the engine keeping up to `concurrency` in flight.
    Returns tokens/s, latency percentiles, draft counts and the token ids."""
    from spur.actors.engine.shell.output_processor import OutputProcessor

    processor = OutputProcessor(None)
    engine = llm.engine
    pending = list(range(len(prompts)))
    in_flight: dict[str, int] = {}
    tokens: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    added: dict[str, float] = {}
    last: dict[str, float] = {}
    ttft: list[float] = []
    itl: list[float] = []
    drafts = accepted = steps = 0
    t0 = time.perf_counter()
    while pending or in_flight:
        while pending and len(in_flight) < concurrency:
            i = pending.pop(0)
            rid = llm._add(prompts[i], params, processor)
            in_flight[rid] = i
            added[rid] = time.perf_counter()
        outputs, _ = engine.step()
        steps += 1
        now = time.perf_counter()
        for o in outputs:
            i = in_flight.get(o.req_id)
            if i is None:
                continue
            n = len(o.new_token_ids)
            if n:
                tokens[i].extend(o.new_token_ids)
                if o.req_id in last:
                    itl.extend([(now - last[o.req_id]) / n] * n)
                else:
                    ttft.append(now - added[o.req_id])
                last[o.req_id] = now
            if o.finished:
                del in_flight[o.req_id]
                processor.abort(o.req_id)
                drafts += o.num_draft_tokens
                accepted += o.num_accepted_tokens
    elapsed = time.perf_counter() - t0
    generated = sum(len(t) for t in tokens.values())
    return {
        "tokens_per_s": round(generated / elapsed, 2) if elapsed else None,
        "elapsed_s": round(elapsed, 3),
        "generated_tokens": generated,
        "steps": steps,
        "ttft_ms_p50": percentile_ms(ttft, 50),
        "itl_ms_p50": percentile_ms(itl, 50),
        "itl_ms_p99": percentile_ms(itl, 99),
        "draft_tokens": drafts,
        "accepted_tokens": accepted,
        "acceptance_rate": round(accepted / drafts, 3) if drafts else None,
        "token_ids": [tokens[i] for i in range(len(prompts))],
    }


def run(
    *,
    model: str = "SmolLM2-135M-Instruct",
    dtype: str = "float32",
    concurrencies: tuple[int, ...] = (1, 16),
    workloads: tuple[str, ...] = WORKLOADS,
    requests: int = 4,
    rounds: int = 2,
    num_speculative_tokens: int = 4,
    prompt_lookup_min: int = 2,
    prompt_lookup_max: int = 4,
    disable_by_batch_size: int | None = None,
    seed: int = 0,
    quick: bool = False,
    max_tokens: int | None = None,
    num_threads: int | None = None,
) -> dict[str, Any]:
    """Run the benchmark; returns a JSON-ready dict (see the module docstring).

    `requests`: requests per level at concurrency 1 (a level at concurrency c runs
    max(requests, c)). `quick`: 2 requests, 24 output tokens, concurrencies 1 and
    2, one round (a CI smoke test). `max_tokens` caps both workloads' outputs
    (default 320 for repeat, 128 for chat); `num_threads`: torch threads of the
    engine (on an oversubscribed machine 1 thread is far steadier than 2).
    Raises ValueError for an unknown workload.
    """
    from spur.actors.llm import LLM
    from spur.actors.step import SamplingParams

    unknown = set(workloads) - set(WORKLOADS)
    if unknown or not workloads:
        raise ValueError(f"workloads {workloads!r}: choose from {', '.join(WORKLOADS)}")
    if quick:
        requests, rounds, concurrencies = 2, 1, (1, 2)
    # disable_by_batch_size: None keeps the schema's default; 0 drafts at any size.
    limit = (
        {}
        if disable_by_batch_size is None
        else {"disable_by_batch_size": disable_by_batch_size or None}
    )
    llm = LLM(
        model,
        dtype=dtype,
        num_speculative_tokens=num_speculative_tokens,
        prompt_lookup_min=prompt_lookup_min,
        prompt_lookup_max=prompt_lookup_max,
        **limit,
        max_num_seqs=max(max(concurrencies), 1),
        seed=seed,
        num_threads=num_threads,
    )
    proposer = llm.scheduler.proposer
    results: dict[str, Any] = {}
    try:
        llm.generate([llm.chat_prompt([{"role": "user", "content": "Hi"}])] * 2)  # warm-up
        for workload in workloads:
            n_max = max(requests, max(concurrencies))
            if workload == "repeat":
                chats = repeat_messages(n_max, seed)
                params = SamplingParams(
                    max_tokens=24 if quick else max_tokens or 320, temperature=0
                )
            else:
                chats = chat_messages(n_max, seed)
                params = SamplingParams(
                    max_tokens=24 if quick else max_tokens or 128, temperature=0, ignore_eos=True
                )
            all_prompts = [llm.chat_prompt(m) for m in chats]
            entry: dict[str, Any] = {
                "prompt_tokens_mean": round(statistics.mean(len(p) for p in all_prompts), 1),
                "max_tokens": params.max_tokens,
                "ignore_eos": params.ignore_eos,
                "levels": {},
            }
            for c in concurrencies:
                prompts = all_prompts[: max(requests, c)]
                arms: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
                for r in range(rounds):
                    for arm in ("off", "on") if r % 2 == 0 else ("on", "off"):
                        llm.scheduler.proposer = proposer if arm == "on" else None
                        llm.scheduler.kv.reset_prefix_cache()
                        print(f"spec bench: {workload} c={c} round {r + 1} {arm}", file=sys.stderr)
                        res = drive(llm, prompts, params, c)
                        arms[arm].append(res)
                        print(
                            f"  {res['tokens_per_s']} tok/s, {res['accepted_tokens']}/"
                            f"{res['draft_tokens']} drafts kept, {res['steps']} steps",
                            file=sys.stderr,
                        )
                level = _level(arms)
                entry["levels"][str(c)] = level
            results[workload] = entry
    finally:
        llm.scheduler.proposer = proposer
        llm.shutdown()
    return {
        "bench": "spec",
        "model": model,
        "dtype": dtype,
        "seed": seed,
        "quick": quick,
        "rounds": rounds,
        "speculative": {
            "method": "ngram",
            "num_speculative_tokens": num_speculative_tokens,
            "prompt_lookup_min": prompt_lookup_min,
            "prompt_lookup_max": prompt_lookup_max,
            "disable_by_batch_size": proposer.config.disable_by_batch_size,
        },
        "torch_num_threads": num_threads,
        "cpu": cpu_info(),
        "results": results,
    }


def _level(arms: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per-round ratios on / off, their median, the arms' figures, token identity."""
    ratios = [
        round(on["tokens_per_s"] / off["tokens_per_s"], 3)
        for on, off in zip(arms["on"], arms["off"], strict=True)
        if on["tokens_per_s"] and off["tokens_per_s"]
    ]
    same = all(
        on["token_ids"] == off["token_ids"] for on, off in zip(arms["on"], arms["off"], strict=True)
    )
    for runs in arms.values():
        for run_ in runs:
            run_.pop("token_ids")
    return {
        "speedup": statistics.median(ratios) if ratios else None,
        "speedup_per_round": ratios,
        "identical_tokens": same,
        "off": arms["off"],
        "on": arms["on"],
    }
