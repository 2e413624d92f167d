"""The `spur bench routing` workload: seeded shared-prefix multi-turn chat, in token ids.

`groups` x `users_per_group` users; the users of a group share one system prompt.
Users arrive as a Poisson process of `request_rate` (seeded random order over all
users) and each plays `rounds` turns back to back: round r's prompt is
system + q0 + a0 + ... + q_r, where the answers a_i are fixed by the workload and
replayed (so the workload never depends on what the model generates). Every token
id comes from one `random.Random(seed)`: same seed, same workload.

Oracle: the prefix-cache hits of an ideal cluster (every request meets its chain,
nothing is evicted: one infinite cache of full blocks), with the engine's rule: only
full blocks are cached, keyed by the engine's chained hash; a request hits its
longest run of cached leading blocks, at most (len(prompt) - 1) // block_size of
them (the last prompt token is always recomputed); then all its full prompt
blocks are cached (not the generated answer, which differs from the replayed one).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from spur.actors.engine.core.hashing import BlockHash, BlockHasher


@dataclass(frozen=True)
class WorkloadSpec:
    groups: int = 4
    """Groups of users; each group shares one system prompt (>= 1)."""
    users_per_group: int = 4
    """Users in each group (>= 1)."""
    rounds: int = 3
    """Turns per user (>= 1)."""
    system_prompt_tokens: int = 512
    """Length of each group's system prompt (>= 0)."""
    question_tokens: int = 32
    """Length of each user question (>= 1)."""
    answer_tokens: int = 16
    """Length of each replayed answer, and each turn's max_tokens (>= 1)."""
    request_rate: float = 8.0
    """New users per second, Poisson arrivals (finite, > 0)."""
    vocab_size: int = 256
    """Token ids are drawn from [1, vocab_size) (>= 2)."""
    seed: int = 0
    """Seed of the one random.Random every token id and arrival comes from."""

    def __post_init__(self) -> None:
        for name, low in (
            ("groups", 1),
            ("users_per_group", 1),
            ("rounds", 1),
            ("system_prompt_tokens", 0),
            ("question_tokens", 1),
            ("answer_tokens", 1),
            ("vocab_size", 2),
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"WorkloadSpec.{name}={value!r}: must be an int >= {low}")
        rate = self.request_rate
        if not isinstance(rate, int | float) or not math.isfinite(rate) or rate <= 0:
            raise ValueError(f"WorkloadSpec.request_rate={rate!r}: must be finite and > 0")
        if not isinstance(self.seed, int):
            raise ValueError(f"WorkloadSpec.seed={self.seed!r}: must be an int")


@dataclass(frozen=True)
class Turn:
    """One request: its prompt, and the answer the client appends to its history."""

    group: int
    user: int
    round: int
    prompt_token_ids: tuple[int, ...]
    answer_token_ids: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True)
class UserScript:
    """One user: arrives at `start_s` (seconds from the start), then plays its
    turns one after another, each after the previous answer."""

    group: int
    user: int
    start_s: float
    turns: tuple[Turn, ...]


def build_workload(spec: WorkloadSpec) -> list[UserScript]:
    """All users' scripts, sorted by start_s; deterministic for `spec.seed`."""
    rng = random.Random(spec.seed)

    def draw(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(1, spec.vocab_size) for _ in range(n))

    systems = [draw(spec.system_prompt_tokens) for _ in range(spec.groups)]
    turns: dict[tuple[int, int], tuple[Turn, ...]] = {}
    for g in range(spec.groups):
        for u in range(spec.users_per_group):
            history: tuple[int, ...] = systems[g]
            user_turns = []
            for r in range(spec.rounds):
                prompt = history + draw(spec.question_tokens)
                answer = draw(spec.answer_tokens)
                user_turns.append(Turn(g, u, r, prompt, answer, spec.answer_tokens))
                history = prompt + answer
            turns[g, u] = tuple(user_turns)
    order = list(turns)
    rng.shuffle(order)
    scripts, t = [], 0.0
    for i, (g, u) in enumerate(order):
        if i:  # the first user arrives at 0; then exponential gaps
            t += rng.expovariate(spec.request_rate)
        scripts.append(UserScript(g, u, t, turns[g, u]))
    return scripts


def _hits(chains: Iterable[tuple[int, list[BlockHash]]], block_size: int) -> tuple[int, int]:
    """(hit_tokens, prompt_tokens) over (prompt length, chain) pairs, in order."""
    cached: set[BlockHash] = set()
    hit = total = 0
    for length, chain in chains:
        limit = max(0, (length - 1) // block_size)
        n = 0
        while n < limit and chain[n] in cached:
            n += 1
        hit += n * block_size
        total += length
        cached.update(chain)
    return hit, total


def oracle_hit_tokens(prompts: Iterable[Sequence[int]], block_size: int) -> tuple[int, int]:
    """(hit_tokens, prompt_tokens) of an ideal cluster serving `prompts` in order:
    one infinite cache of full blocks, the engine's hit rule (module docstring)."""
    hasher = BlockHasher(block_size)
    return _hits(((len(p), hasher.chain(p)) for p in prompts), block_size)


def oracle_order(scripts: Iterable[UserScript]) -> list[list[int]]:
    """Every prompt in a plausible serving order: by (round, start_s), i.e. all
    first rounds by arrival, then all second rounds, and so on."""
    keyed = [
        ((turn.round, s.start_s, s.group, s.user), turn.prompt_token_ids)
        for s in scripts
        for turn in s.turns
    ]
    keyed.sort(key=lambda kt: kt[0])
    return [list(prompt) for _, prompt in keyed]


def oracle_hit_rate(spec: WorkloadSpec, block_size: int) -> float:
    """Oracle hit tokens / prompt tokens over `oracle_order(build_workload(spec))`."""
    hit, total = oracle_hit_tokens(oracle_order(build_workload(spec)), block_size)
    return hit / total if total else 0.0


def describe(spec: WorkloadSpec, block_size: int) -> dict[str, Any]:
    """JSON-safe summary: requests, prompt tokens, working set in distinct full
    blocks (what the engines' pools are sized against), largest prompt, oracle."""
    hasher = BlockHasher(block_size)
    prompts = oracle_order(build_workload(spec))
    chains = [(len(p), hasher.chain(p)) for p in prompts]
    hit, total = _hits(chains, block_size)
    return {
        "requests": len(prompts),
        "prompt_tokens": total,
        "block_size": block_size,
        "working_set_blocks": len({h for _, chain in chains for h in chain}),
        "max_prompt_tokens": max((len(p) for p in prompts), default=0),
        "oracle_hit_tokens": hit,
        "oracle_hit_rate": hit / total if total else 0.0,
    }
