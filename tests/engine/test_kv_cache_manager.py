"""KVCacheManager: hand-checked prefix hits, atomic allocation, forks (CoW),
sliding windows and state groups."""

from __future__ import annotations

import random

from spur.actors.cache_spec import FullAttentionSpec, KVCacheGroup, SlidingWindowSpec, StateSpec
from spur.actors.engine.core.kv_cache_manager import KVCacheConfig, KVCacheManager
from spur.actors.engine.core.request import Request
from spur.actors.step import SamplingParams

PARAMS = SamplingParams(max_tokens=4)


def manager(num_blocks=200, block_size=16, groups=None, max_chunk=4096) -> KVCacheManager:
    cfg = KVCacheConfig(block_size=block_size, num_blocks=num_blocks)
    if groups is not None:
        cfg = KVCacheConfig(block_size=block_size, num_blocks=num_blocks, groups=groups)
    return KVCacheManager(cfg, max_chunk=max_chunk)


def admit(kv: KVCacheManager, rid: str, tokens: list[int]) -> tuple[Request, int]:
    """Look up, allocate the rest of the prompt, mark it computed and cached."""
    req = Request(rid, tokens, PARAMS, block_hasher=kv.hasher)
    hits, num_hit = kv.get_computed_blocks(req)
    assert kv.allocate_slots(req, req.num_tokens - num_hit, 0, hits, num_hit) is not None
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req)
    return req, num_hit


def test_prompt_of_1024_tokens_and_a_512_token_shared_prefix():
    rng = random.Random(1)
    kv = manager()
    shared = [rng.randrange(5000) for _ in range(512)]
    a_tokens = shared + [rng.randrange(5000) for _ in range(512)]
    b_tokens = shared + [rng.randrange(5000) for _ in range(512)]
    a, hit_a = admit(kv, "a", a_tokens)
    assert hit_a == 0
    assert len(a.block_hashes) == 64 and kv.num_held("a") == [64]
    _b, hit_b = admit(kv, "b", b_tokens)
    assert hit_b == 512  # exactly 32 blocks
    assert kv.block_ids("b")[0][:32] == kv.block_ids("a")[0][:32]
    assert kv.block_ids("b")[0][32] not in kv.block_ids("a")[0]
    shared_block = kv.pool.blocks[kv.block_ids("a")[0][0]]
    assert shared_block.ref_cnt == 2
    assert kv.prefix_stats.queries == 2048 and kv.prefix_stats.hits == 512
    assert kv.num_free_blocks == 199 - 64 - 32
    kv.check_integrity()


def test_a_full_hit_still_recomputes_the_last_token():
    kv = manager()
    tokens = list(range(1025))  # 64 full blocks + 1 token
    admit(kv, "a", tokens)
    again = Request("b", tokens, PARAMS, block_hasher=kv.hasher)
    _, num_hit = kv.get_computed_blocks(again)
    assert num_hit == 1024  # one token left to compute, for its logits
    # When the prompt ends on a block boundary the last block is recomputed:
    # its last token must run and a cached block is never written.
    exact = Request("c", list(range(1024)), PARAMS, block_hasher=kv.hasher)
    _, num_hit = kv.get_computed_blocks(exact)
    assert num_hit == 1008


def test_allocate_slots_is_all_or_nothing():
    kv = manager(num_blocks=11, block_size=4)
    a = Request("a", list(range(30)), PARAMS, block_hasher=kv.hasher)
    assert kv.allocate_slots(a, 30) is not None  # 8 of the 10 usable blocks
    before = (kv.num_free_blocks, kv.block_ids("a"))
    b = Request("b", list(range(100, 120)), PARAMS, block_hasher=kv.hasher)
    assert kv.allocate_slots(b, 20) is None  # needs 5, 2 free
    assert (kv.num_free_blocks, kv.block_ids("a")) == before
    assert kv.block_ids("b") == [[]]
    kv.check_integrity()
    # Hits that sit in the free queue count against what is free.
    kv.free(a)
    kv.check_integrity()


def test_decode_allocates_a_block_only_at_the_boundary():
    kv = manager(block_size=4)
    req = Request("a", [1, 2, 3], PARAMS, block_hasher=kv.hasher)
    assert kv.allocate_slots(req, 3) == [[1]]
    req.num_computed_tokens = 3
    req.append_output_token_ids([9])
    assert kv.allocate_slots(req, 1) == [[]]  # fits in block 1
    req.num_computed_tokens = 4
    req.append_output_token_ids([9])
    assert kv.allocate_slots(req, 1) == [[2]]
    req.num_computed_tokens = 5
    assert kv.allocate_slots(req, 1, num_lookahead_tokens=4) == [[3]]  # lookahead slots
    kv.check_integrity()


def test_lru_eviction_order_across_requests():
    kv = manager(num_blocks=5, block_size=4)  # 4 usable
    a, _ = admit(kv, "a", list(range(9)))  # blocks for 0-3, 4-7 (cached), 8
    kv.free(a)  # freed tail first: [8] uncached -> front, then 4-7, 0-3 to the back
    free_order = [b.block_id for b in kv.pool.free_queue]
    ids = kv.pool.cached[0]
    h0, h1 = a.block_hashes
    assert free_order[-2:] == [ids[h1].block_id, ids[h0].block_id]
    # A new request takes uncached blocks first, then evicts the tail block.
    b = Request("b", list(range(100, 112)), PARAMS, block_hasher=kv.hasher)
    assert kv.allocate_slots(b, 12) is not None
    assert h0 in kv.pool.cached[0] and h1 not in kv.pool.cached[0]
    assert kv.pool.stats.num_evictions == 1
    kv.check_integrity()


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    kv = manager(block_size=4)
    parent, _ = admit(kv, "p", list(range(10)))  # blocks: [0-3] [4-7] [8,9]
    child = parent.fork("p#1", 1)
    assert kv.fork(parent, child)
    p_ids, c_ids = kv.block_ids("p")[0], kv.block_ids("p#1")[0]
    assert c_ids[:2] == p_ids[:2]
    assert c_ids[2] != p_ids[2]
    assert kv.take_block_copies() == [(p_ids[2], c_ids[2])]
    assert kv.take_block_copies() == []
    for bid in p_ids[:2]:
        assert kv.pool.blocks[bid].ref_cnt == 2
    kv.check_integrity()
    kv.free(parent)
    kv.check_integrity()
    assert kv.pool.blocks[c_ids[0]].ref_cnt == 1
    kv.free(child)
    assert kv.num_free_blocks == 199


def test_fork_at_a_block_boundary_copies_nothing():
    kv = manager(block_size=4)
    parent, _ = admit(kv, "p", list(range(8)))
    assert kv.fork(parent, parent.fork("p#1", 1))
    assert kv.take_block_copies() == []
    kv.check_integrity()


def test_reset_prefix_cache_forgets_hits():
    kv = manager(block_size=4)
    admit(kv, "a", list(range(20)))
    _, hit = admit(kv, "b", list(range(20)))
    assert hit == 16
    kv.reset_prefix_cache()
    _, hit = admit(kv, "c", list(range(20)))
    assert hit == 0
    kv.check_integrity()


def test_sliding_window_returns_blocks_that_left_the_window():
    groups = (KVCacheGroup(SlidingWindowSpec(1, 1, 2, sliding_window=8), 1),)
    kv = manager(block_size=4, groups=groups)
    req = Request("a", list(range(40)), PARAMS, block_hasher=kv.hasher)
    for start in range(0, 40, 4):  # 4-token chunks
        assert kv.allocate_slots(req, 4) is not None
        req.num_computed_tokens = start + 4
        kv.cache_blocks(req)
        held = kv.num_held("a")[0]
        assert held <= groups[0].spec.max_blocks(start + 4, 4, 4), (start, held)
        kv.check_integrity()
    table = kv.block_ids("a")[0]
    # Computed 40; next token (pos 40) needs 33..40 -> blocks 8, 9 (+ 7 kept one step).
    assert table[:7] == [0] * 7
    # A new request with the same prompt hits using only the window's blocks.
    again = Request("b", [*list(range(40)), 7], PARAMS, block_hasher=kv.hasher)
    hits, num_hit = kv.get_computed_blocks(again)
    assert num_hit == 40
    assert [b.block_id for b in hits[0]][:8] == [0] * 8


def test_state_group_keeps_the_current_and_previous_state_only():
    groups = (
        KVCacheGroup(FullAttentionSpec(1, 1, 2), 1),
        KVCacheGroup(StateSpec(8), 1),
    )
    kv = manager(block_size=4, groups=groups, num_blocks=100)
    req = Request("a", list(range(41)), PARAMS, block_hasher=kv.hasher)
    tables = []
    for end in (8, 16, 24, 32, 40, 41):  # chunks spanning 2 blocks, then the tail
        assert kv.allocate_slots(req, end - req.num_computed_tokens) is not None
        req.num_computed_tokens = end
        kv.cache_blocks(req)
        tables.append(kv.block_ids("a")[1])
        assert kv.num_held("a")[1] <= 2
        kv.check_integrity()
    # After the third chunk: [0, 0, 0, S1 (read, prev), 0, S5 (written)] with the
    # state of the first chunk (position 1) retired across the null gap at 2.
    third = tables[2]
    assert third[:3] == [0, 0, 0] and third[3] != 0 and third[4] == 0 and third[5] != 0
    # Chunk-end states sit in the cache under their block's hash.
    assert req.block_hashes[9] in kv.pool.cached[1]
    assert req.block_hashes[7] in kv.pool.cached[1]


def test_hybrid_hit_is_the_longest_length_every_group_serves():
    groups = (
        KVCacheGroup(FullAttentionSpec(1, 1, 2), 1),
        KVCacheGroup(StateSpec(8), 1),
    )
    kv = manager(block_size=4, groups=groups)
    tokens = list(range(30))
    req = Request("a", tokens, PARAMS, block_hasher=kv.hasher)
    # Chunks end at 8 and 20: states exist for blocks 1 and 4 only.
    for end in (8, 20, 30):
        kv.allocate_slots(req, end - req.num_computed_tokens)
        req.num_computed_tokens = end
        kv.cache_blocks(req)
    other = Request("b", tokens[:26] + [999] * 4, PARAMS, block_hasher=kv.hasher)
    hits, num_hit = kv.get_computed_blocks(other)
    # Attention could serve 6 blocks (24 tokens); the latest state at or
    # below that is after block 4 (20 tokens).
    assert num_hit == 20
    assert [b.block_id for b in hits[1]][:4] == [0, 0, 0, 0] and hits[1][4].block_id != 0
    assert kv.allocate_slots(other, 10, 0, hits, num_hit) is not None
    kv.check_integrity()
