"""Small builders shared by the engine-core tests (pure Python)."""

from __future__ import annotations

import random

from spur.actors.cache_spec import FullAttentionSpec, KVCacheGroup, SlidingWindowSpec, StateSpec
from spur.actors.engine.core.engine_core import EngineCore
from spur.actors.engine.core.fake_executor import FakeExecutor
from spur.actors.engine.core.kv_cache_manager import KVCacheConfig
from spur.actors.engine.core.scheduler import Scheduler, SchedulerConfig
from spur.actors.step import SamplingParams

FULL = KVCacheGroup(FullAttentionSpec(2, 8, 2), 2)
SLIDING = KVCacheGroup(SlidingWindowSpec(2, 8, 2, sliding_window=10), 2)
STATE = KVCacheGroup(StateSpec(64), 2)


def make_engine(
    *,
    block_size: int = 4,
    num_blocks: int = 64,
    groups: tuple[KVCacheGroup, ...] = (FULL,),
    budget: int = 32,
    max_num_seqs: int = 16,
    max_model_len: int | None = None,
    policy: str = "fcfs",
    threshold: int = 0,
    caching: bool = True,
    eos_token_id: int | None = None,
    eos_per_mille: int = 0,
    kv_events: bool = False,
) -> tuple[EngineCore, Scheduler, FakeExecutor]:
    if max_model_len is None:  # the longest that surely fits the pool
        max_model_len = min(256, (num_blocks - 1) // len(groups) * block_size)
    kv_config = KVCacheConfig(
        block_size=block_size, num_blocks=num_blocks, groups=groups, enable_prefix_caching=caching
    )
    sched = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            policy=policy,
            long_prefill_token_threshold=threshold,
            check_kv_bounds=True,
        ),
        kv_config,
        enable_kv_events=kv_events,
    )
    fake = FakeExecutor(
        kv_config, vocab_size=1000, eos_token_id=eos_token_id, eos_per_mille=eos_per_mille
    )
    return EngineCore(sched, fake), sched, fake


def prompts(n: int, length: int, *, shared: int = 0, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(1000) for _ in range(shared)]
    return [prefix + [rng.randrange(1000) for _ in range(length - shared)] for _ in range(n)]


def run_all(
    core: EngineCore,
    sched: Scheduler,
    token_lists: list[list[int]],
    max_tokens: int = 8,
    **params: object,
) -> dict[str, list[int]]:
    """Add every prompt, step to the end checking integrity each step."""
    for i, p in enumerate(token_lists):
        core.add_request(
            sched.make_request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, **params))  # type: ignore[arg-type]
        )
    out: dict[str, list[int]] = {}
    for _ in range(100_000):
        if not core.has_unfinished_requests():
            break
        outputs, _ = core.step()
        sched.check_integrity()
        for o in outputs:
            out.setdefault(o.req_id, []).extend(o.new_token_ids)
    assert not core.has_unfinished_requests()
    assert_all_free(sched)
    return out


def assert_all_free(sched: Scheduler) -> None:
    """After every request ended: every block but the null block is free."""
    sched.check_integrity()
    pool = sched.kv.pool
    assert pool.num_free_blocks == pool.num_blocks - 1


def sp_ids(sp, pieces: list[str]) -> list[int]:
    """Ids for words in the vocabulary, byte tokens for any other text."""
    ids = []
    for piece in pieces:
        if piece in sp.vocab_map:
            ids.append(sp.vocab_map[piece])
        else:
            ids.extend(sp.vocab_map[f"<0x{b:02X}>"] for b in piece.encode())
    return ids
