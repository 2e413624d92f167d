"""BlockPool: free-queue order, lazy eviction, reference counts, integrity."""

from __future__ import annotations

from collections import Counter

import pytest

from spur.actors.engine.core.block_pool import (
    AllBlocksCleared,
    BlockPool,
    BlockRemoved,
    BlockStored,
    FreeBlockQueue,
    IntegrityError,
    KVCacheBlock,
)


def test_free_queue_removes_from_the_middle_and_keeps_order():
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeBlockQueue(blocks)
    q.remove(blocks[3])
    q.remove(blocks[0])
    assert [b.block_id for b in q.check_links()] == [1, 2, 4, 5]
    q.appendleft(blocks[3])
    q.append(blocks[0])
    assert [b.block_id for b in q.check_links()] == [3, 1, 2, 4, 5, 0]
    assert [b.block_id for b in q.popleft_n(2)] == [3, 1]
    assert q.num_free == 4
    with pytest.raises(IndexError):
        q.popleft_n(5)
    with pytest.raises(IntegrityError):
        q.remove(blocks[3])  # not in the queue any more


def test_null_block_is_never_handed_out_or_counted():
    pool = BlockPool(4)
    assert pool.null_block.block_id == 0
    assert pool.num_free_blocks == 3
    got = pool.get_new_blocks(3)
    assert 0 not in {b.block_id for b in got}
    pool.free_blocks([pool.null_block, *got])  # the null block is skipped
    assert pool.num_free_blocks == 3
    pool.check_integrity(Counter())


def test_freed_cached_blocks_go_to_the_back_uncached_to_the_front():
    pool = BlockPool(6)
    a, b, c, d = pool.get_new_blocks(4)
    pool.cache_block(a, b"A" * 32, 0)
    pool.cache_block(b, b"B" * 32, 0)
    # Freed in this order: a, b cached -> back; c, d uncached -> front.
    pool.free_blocks([a, b, c, d])
    order = [blk.block_id for blk in pool.free_queue]
    assert order == [d.block_id, c.block_id, 5, a.block_id, b.block_id]
    pool.check_integrity(Counter())


def test_lru_eviction_is_lazy_and_in_free_order():
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    for blk, h in ((a, b"a"), (b, b"b"), (c, b"c")):
        pool.cache_block(blk, h * 32, 0)
    pool.free_blocks([b, a, c])  # b least recently used
    # Still findable while free: nothing evicted yet.
    assert pool.get_cached_block(b"b" * 32, 0) is b
    assert pool.stats.num_evictions == 0
    (first,) = pool.get_new_blocks(1)
    assert first is b and pool.get_cached_block(b"b" * 32, 0) is None
    assert pool.stats.num_evictions == 1
    (second,) = pool.get_new_blocks(1)
    assert second is a
    assert pool.get_cached_block(b"c" * 32, 0) is c
    pool.check_integrity(Counter({a.block_id: 1, b.block_id: 1}))


def test_touch_revives_a_free_cached_block():
    pool = BlockPool(4)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, b"x" * 32, 0)
    pool.free_blocks([a])
    assert pool.num_free_blocks == 3
    pool.touch([pool.get_cached_block(b"x" * 32, 0)])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.check_integrity(Counter({a.block_id: 2}))


def test_duplicate_hash_leaves_the_second_block_uncached():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_block(a, b"h" * 32, 0)
    assert not pool.cache_block(b, b"h" * 32, 0)
    assert b.block_hash is None
    # The same hash in another group is a different entry.
    assert pool.cached[0][b"h" * 32] is a


def test_events_are_batched_and_reset_clears_everything():
    pool = BlockPool(4, enable_kv_events=True)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_block(a, b"1" * 32, 0)
    pool.cache_block(b, b"2" * 32, 0)
    pool.free_blocks([a, b])
    pool.get_new_blocks(1)  # evicts a (free-queue front after c? c is held) -> a
    events = pool.take_events()
    assert events[0] == BlockStored([b"1" * 32, b"2" * 32], 0)
    assert events[1] == BlockRemoved([b"1" * 32], 0)
    assert pool.take_events() == []
    pool.reset_prefix_cache()
    assert pool.take_events() == [AllBlocksCleared()]
    assert not pool.cached[0] and b.block_hash is None
    del c


def test_check_integrity_catches_broken_state():
    pool = BlockPool(5)
    a, b = pool.get_new_blocks(2)
    pool.check_integrity(Counter({a.block_id: 1, b.block_id: 1}))
    with pytest.raises(IntegrityError, match="block-table entries hold it"):
        pool.check_integrity(Counter({a.block_id: 2, b.block_id: 1}))
    b.ref_cnt = 0  # held by nobody, yet not free
    with pytest.raises(IntegrityError, match="neither free nor held"):
        pool.check_integrity()
    b.ref_cnt = 1
    pool.cached[0][b"z" * 32] = a  # map points at a block without that hash
    with pytest.raises(IntegrityError, match="hash map"):
        pool.check_integrity()


def test_double_free_is_detected():
    pool = BlockPool(3)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(IntegrityError):
        pool.free_blocks([a])
