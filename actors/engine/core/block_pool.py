"""The pool of fixed-size KV blocks shared by every cache group of an engine.

    blocks:      [ null | b1 | b2 | ... | b(N-1) ]      block 0 is the null block
    free queue:  head <-> bX <-> bY <-> ... <-> bZ <-> tail     (O(1) remove anywhere)
                 ^ handed out first                 ^ handed out last

The free queue is the eviction order. A freed block that carries a cached hash
goes to the back (least recently used is evicted first); one without a hash goes
to the front (reused before any cached block). A cached block stays findable by
its hash while it sits in the queue; it is evicted lazily, only when it is handed
out again. The null block fills gaps in block tables (sliding windows, state
groups) and is never allocated, freed or counted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from spur.actors.engine.core.hashing import BlockHash


class IntegrityError(AssertionError):
    """An allocator's internal invariant is broken (a bug, never user input)."""


class KVCacheBlock:
    """One block: an id, a reference count, an optional cached hash and the
    links of the free queue (only meaningful while the block is free)."""

    __slots__ = ("block_hash", "block_id", "group_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.group_id = -1
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = "cached" if self.block_hash is not None else "-"
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, {cached})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with sentinels; every operation is O(1)
    per block (no scans). Blocks carry their own links (no node objects)."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        self.append_n(list(blocks))

    def popleft(self) -> KVCacheBlock:
        first = self._head.next_free
        if first is self._tail or first is None:
            raise IndexError("no free blocks")
        self.remove(first)
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Take the first `n` blocks (raises IndexError if fewer are free)."""
        if n > self.num_free:
            raise IndexError(f"asked for {n} blocks, {self.num_free} free")
        out = []
        node = self._head.next_free
        for _ in range(n):
            assert node is not None
            out.append(node)
            nxt = node.next_free
            node.prev_free = node.next_free = None
            node = nxt
        self._head.next_free = node
        assert node is not None
        node.prev_free = self._head
        self.num_free -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise IntegrityError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        first = self._head.next_free
        assert first is not None
        self._head.next_free = block
        block.prev_free = self._head
        block.next_free = first
        first.prev_free = block
        self.num_free += 1

    def append_n(self, blocks: list[KVCacheBlock]) -> None:
        for block in blocks:
            self.append(block)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        node = self._head.next_free
        while node is not None and node is not self._tail:
            yield node
            node = node.next_free

    def check_links(self) -> list[KVCacheBlock]:
        """Walk both directions; returns the blocks front to back."""
        forward = list(self)
        backward = []
        node = self._tail.prev_free
        while node is not None and node is not self._head:
            backward.append(node)
            node = node.prev_free
        if forward != backward[::-1]:
            raise IntegrityError("free queue links disagree between directions")
        if len(forward) != self.num_free:
            raise IntegrityError(
                f"free queue holds {len(forward)} blocks, counter says {self.num_free}"
            )
        return forward


# -- KV events (consumed by the prefix-aware router) -----------------------------------
@dataclass(frozen=True)
class BlockStored:
    """Blocks of `group_id` became findable under these hashes."""

    block_hashes: list[BlockHash]
    group_id: int


@dataclass(frozen=True)
class BlockRemoved:
    """These hashes of `group_id` are no longer cached (evicted)."""

    block_hashes: list[BlockHash]
    group_id: int


@dataclass(frozen=True)
class AllBlocksCleared:
    """The prefix cache was reset: forget everything this engine held."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class PoolStats:
    num_evictions: int = 0
    events: list[KVEvent] = field(default_factory=list)


class BlockPool:
    """Allocator of `num_blocks` blocks (block 0 is the null block).

    Not thread-safe. Every method keeps these invariants, which
    `check_integrity` verifies: each non-null block is either free (ref 0, in
    the queue exactly once) or used (ref > 0, not in the queue); every cached
    hash maps to a block that carries it, and back.
    """

    def __init__(
        self,
        num_blocks: int,
        *,
        num_groups: int = 1,
        enable_caching: bool = True,
        enable_kv_events: bool = False,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks={num_blocks}: the pool needs the null block and at least one more"
            )
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_kv_events = enable_kv_events
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.null_block = self.free_queue.popleft()
        # One hash -> block map per cache group: a hash names a prefix, and
        # each group keeps its own KV (or state) for it.
        self.cached: list[dict[BlockHash, KVCacheBlock]] = [{} for _ in range(num_groups)]
        self.stats = PoolStats()

    # -- queries ------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        """Fraction of allocatable blocks in use, in [0, 1]."""
        return 1.0 - self.free_queue.num_free / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: BlockHash, group_id: int) -> KVCacheBlock | None:
        return self.cached[group_id].get(block_hash)

    # -- allocation ---------------------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Hand out `n` blocks with ref 1, evicting cached ones as they come.

        Raises ValueError when fewer than `n` are free (callers check first).
        """
        if n > self.free_queue.num_free:
            raise ValueError(f"asked for {n} blocks, only {self.free_queue.num_free} free")
        blocks = self.free_queue.popleft_n(n)
        for block in blocks:
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (prefix hit or fork sharing);
        a free block leaves the queue. The null block is skipped."""
        null = self.null_block
        for block in blocks:
            if block is null:
                continue
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, in the given order. A block that
        reaches 0 becomes free: to the back if cached (evicted last, in this
        order), else to the front. Callers pass a request's blocks tail first,
        so that its least shareable blocks are evicted first."""
        null = self.null_block
        queue = self.free_queue
        for block in ordered_blocks:
            if block is null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is not None:
                    queue.append(block)
                else:
                    queue.appendleft(block)
            elif block.ref_cnt < 0:
                raise IntegrityError(f"{block} freed more times than it was held")

    # -- prefix cache -------------------------------------------------------------------
    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash, group_id: int) -> bool:
        """Make `block` findable under `block_hash` in `group_id`. If another
        block already holds that hash, this one stays uncached (returns False):
        its content is a duplicate and it will be reused first when freed."""
        if not self.enable_caching or block.block_hash is not None or block is self.null_block:
            return False
        table = self.cached[group_id]
        if block_hash in table:
            return False
        block.block_hash = block_hash
        block.group_id = group_id
        table[block_hash] = block
        if self.enable_kv_events:
            self._record_event(BlockStored([block_hash], group_id))
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        block_hash = block.block_hash
        assert block_hash is not None
        group_id = block.group_id
        table = self.cached[group_id]
        if table.get(block_hash) is block:
            del table[block_hash]
        block.block_hash = None
        block.group_id = -1
        self.stats.num_evictions += 1
        if self.enable_kv_events:
            self._record_event(BlockRemoved([block_hash], group_id))

    def _record_event(self, event: KVEvent) -> None:
        # Batch consecutive events of one kind and group into one.
        events = self.stats.events
        if events and type(events[-1]) is type(event) and not isinstance(event, AllBlocksCleared):
            last = events[-1]
            assert isinstance(last, BlockStored | BlockRemoved)
            assert isinstance(event, BlockStored | BlockRemoved)
            if last.group_id == event.group_id:
                last.block_hashes.extend(event.block_hashes)
                return
        events.append(event)

    def take_events(self) -> list[KVEvent]:
        """The events since the last call, oldest first (the buffer is emptied)."""
        events, self.stats.events = self.stats.events, []
        return events

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use keep their data and owners)."""
        for table in self.cached:
            for block in table.values():
                block.block_hash = None
                block.group_id = -1
            table.clear()
        if self.enable_kv_events:
            self.stats.events.append(AllBlocksCleared())

    # -- invariants ---------------------------------------------------------------------
    def check_integrity(self, holders: Counter[int] | None = None) -> None:
        """Raise IntegrityError unless: free + used + null == total; each free
        block is in the queue once with ref 0; each used block has ref > 0; the
        hash maps and the blocks agree; and, when `holders` (block id -> number
        of block-table entries holding it) is given, every ref count equals it.
        """
        free = self.free_queue.check_links()
        free_ids = {b.block_id for b in free}
        if len(free_ids) != len(free):
            raise IntegrityError("a block is in the free queue twice")
        if self.null_block.block_id in free_ids:
            raise IntegrityError("the null block is in the free queue")
        used = 0
        for block in self.blocks[1:]:
            if block.block_id in free_ids:
                if block.ref_cnt != 0:
                    raise IntegrityError(f"{block} is free with a non-zero ref count")
            elif block.ref_cnt <= 0:
                raise IntegrityError(f"{block} is neither free nor held")
            else:
                used += 1
            if holders is not None and block.ref_cnt != holders.get(block.block_id, 0):
                raise IntegrityError(
                    f"{block} has ref {block.ref_cnt} but "
                    f"{holders.get(block.block_id, 0)} block-table entries hold it"
                )
        if len(free) + used + 1 != self.num_blocks:
            raise IntegrityError(
                f"free {len(free)} + used {used} + null != total {self.num_blocks}"
            )
        for group_id, table in enumerate(self.cached):
            for block_hash, block in table.items():
                if block.block_hash != block_hash or block.group_id != group_id:
                    raise IntegrityError(f"hash map of group {group_id} points at {block}")
        for block in self.blocks:
            if (
                block.block_hash is not None
                and self.cached[block.group_id].get(block.block_hash) is not block
            ):
                raise IntegrityError(f"{block} carries a hash that the map does not know")
