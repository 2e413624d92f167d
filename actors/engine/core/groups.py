"""KV cache groups: what one group of layers keeps per request, and when.

Every group draws blocks from the one shared `BlockPool` and keeps its own block
table per request (a list indexed by block position, i.e. token // block_size).
Three kinds:

    full attention   [b0 b1 b2 b3 b4]            every block of the sequence
    sliding window   [ 0  0 b2 b3 b4]            blocks that left the window are retired
    state (align)    [ 0  S1  0  S3]             one state block per block-aligned
                                                 position a chunk ended on; only the
                                                 current (S3) and previous (S1) are held

`0` is the null block. A state block at position i holds the recurrent state
after exactly (i + 1) * block_size tokens once that many are computed, which is
what makes it cacheable under block hash i. Retirement walks from the request's
retired watermark up to the block it must keep, stepping over null gaps: a loop
that stopped at the first null would free nothing once chunks span several
blocks, leaking a state block per group per chunk.

`max_blocks()` is the per-request block bound of each kind; `capacity()` and the
run-time leak detector both use it, so the claim and the check cannot disagree.
"""

from __future__ import annotations

from spur.actors.cache_spec import KVCacheSpec, SlidingWindowSpec, StateSpec, cdiv
from spur.actors.engine.core.block_pool import BlockPool, KVCacheBlock
from spur.actors.engine.core.hashing import BlockHash


# -- managers: per-request tables of one group ---------------------------------------
class GroupManager:
    """Block tables of one group. All planning methods are pure; mutating ones
    assume the caller (the coordinator) checked that the pool can serve them.

    Per request it keeps `tables[id]` (KVCacheBlock per position, null for gaps),
    `num_cached[id]` (positions already offered to the prefix cache) and
    `retired[id]` (positions below it are null: never read again).
    """

    def __init__(self, spec: KVCacheSpec, pool: BlockPool, group_id: int, block_size: int):
        self.spec = spec
        self.pool = pool
        self.group_id = group_id
        self.block_size = block_size
        self.null = pool.null_block
        self.tables: dict[str, list[KVCacheBlock]] = {}
        self.num_cached: dict[str, int] = {}
        self.retired: dict[str, int] = {}

    # prefix hits ---------------------------------------------------------------------
    def longest_hit(self, hashes: list[BlockHash], max_blocks: int) -> int:
        """Largest n <= max_blocks such that this group can serve the first n
        blocks of the chain from the cache."""
        cached = self.pool.cached[self.group_id]
        n = 0
        while n < max_blocks and hashes[n] in cached:
            n += 1
        return n

    def hit_blocks(self, hashes: list[BlockHash], n: int) -> list[KVCacheBlock]:
        """The table entries for a hit of `n` blocks (nulls where not needed)."""
        cached = self.pool.cached[self.group_id]
        return [cached[h] for h in hashes[:n]]

    # allocation ----------------------------------------------------------------------
    def _retire_until(self, num_computed: int) -> int:
        """Positions below this are not needed for the next tokens."""
        return 0

    def plan(
        self, req_id: str, num_computed: int, num_tokens: int, num_hit: int
    ) -> tuple[int, int]:
        """(new blocks needed, blocks that retirement would return to the pool)
        to hold `num_tokens` slots, given `num_hit` hit blocks being added."""
        table = self.tables.get(req_id)
        length = (len(table) if table else 0) + num_hit
        first_live = self._retire_until(num_computed)
        new = max(0, cdiv(num_tokens, self.block_size) - max(length, first_live))
        return new, self._freed_by_retire(req_id, first_live)

    def _freed_by_retire(self, req_id: str, first_live: int) -> int:
        """Blocks that retiring up to `first_live` would return to the pool
        (held by this request alone)."""
        table = self.tables.get(req_id)
        start = self.retired.get(req_id, 0)
        if not table or first_live <= start:
            return 0
        null = self.null
        return sum(1 for b in table[start:first_live] if b is not null and b.ref_cnt == 1)

    def allocate(
        self, req_id: str, num_computed: int, num_tokens: int, hits: list[KVCacheBlock]
    ) -> list[int]:
        """Grow the table to hold `num_tokens` slots; returns the ids appended
        to the table (hits, nulls and new blocks, in position order). `hits`
        must already be referenced (`BlockPool.touch`) by the caller, before
        any group allocates, so that no allocation evicts another's hit."""
        table = self._table(req_id, len(hits))
        first_live = self._retire_until(num_computed)
        start = len(table)
        table.extend(hits)  # the coordinator already took their references
        target = cdiv(num_tokens, self.block_size)
        if len(table) < first_live:
            table.extend([self.null] * (min(first_live, target) - len(table)))
        if len(table) < target:
            table.extend(self.pool.get_new_blocks(target - len(table)))
        return [b.block_id for b in table[start:]]

    def _table(self, req_id: str, num_hits: int) -> list[KVCacheBlock]:
        table = self.tables.get(req_id)
        if table is None:
            table = self.tables[req_id] = []
            self.num_cached[req_id] = num_hits
            self.retired[req_id] = 0
        return table

    def retire(self, req_id: str, num_computed: int) -> None:
        """Return the blocks the next tokens will never read (call before any
        group allocates, so that their blocks count as free)."""
        table = self.tables.get(req_id)
        if table is not None:
            first_live = self._retire_until(num_computed)
            if first_live > self.retired[req_id]:
                self._retire(req_id, table, first_live)

    def _retire(self, req_id: str, table: list[KVCacheBlock], upto: int) -> None:
        """Free every held block in [retired watermark, upto), stepping over nulls."""
        start = self.retired[req_id]
        null = self.null
        upto = min(upto, len(table))
        dead = []
        for i in range(upto - 1, start - 1, -1):
            block = table[i]
            if block is not null:
                dead.append(block)
                table[i] = null
        self.pool.free_blocks(dead)
        self.retired[req_id] = max(start, upto)

    # caching -------------------------------------------------------------------------
    def cache(self, req_id: str, hashes: list[BlockHash], num_computed: int) -> None:
        """Offer the blocks completed by `num_computed` computed tokens to the
        prefix cache (call after the step that computed them)."""
        table = self.tables.get(req_id)
        if table is None:
            return
        full = min(num_computed // self.block_size, len(hashes), len(table))
        start = self.num_cached[req_id]
        if full <= start:
            return
        pool, gid, null = self.pool, self.group_id, self.null
        for i in range(start, full):
            block = table[i]
            if block is not null and block.block_hash is None:
                pool.cache_block(block, hashes[i], gid)
        self.num_cached[req_id] = full

    # release -------------------------------------------------------------------------
    def free(self, req_id: str) -> None:
        """Release every block of the request, tail first (tails evict first)."""
        table = self.tables.pop(req_id, None)
        self.num_cached.pop(req_id, None)
        self.retired.pop(req_id, None)
        if table:
            self.pool.free_blocks(reversed(table))

    def truncate(self, req_id: str, num_tokens: int) -> int | None:
        """Free the table's blocks past the first ceil(num_tokens / bs) (slots of
        rejected draft tokens, never cached: they lie past the computed tokens).
        Returns the new table length, or None when nothing was cut."""
        table = self.tables.get(req_id)
        keep = cdiv(num_tokens, self.block_size)
        if table is None or len(table) <= keep:
            return None
        dead = table[keep:]
        del table[keep:]
        self.pool.free_blocks(reversed(dead))
        return keep

    def plan_fork(self, parent_id: str, num_computed: int) -> int:
        """New blocks a fork needs: 1 if the block holding the last computed
        token is partly filled (it is copied), else 0."""
        table = self.tables.get(parent_id, [])
        i = num_computed // self.block_size
        if num_computed % self.block_size and i < len(table) and table[i] is not self.null:
            return 1
        return 0

    def fork(self, parent_id: str, child_id: str, num_computed: int) -> list[tuple[int, int]]:
        """Give the child the parent's first ceil(num_computed / bs) positions:
        full blocks shared by reference, the partly filled last one copied.
        Returns the (src, dst) block copies the worker must make."""
        bs = self.block_size
        table = self.tables.get(parent_id, [])[: cdiv(num_computed, bs)]
        child: list[KVCacheBlock] = list(table)
        copies = []
        partial = num_computed // bs if num_computed % bs else -1
        shared = [b for i, b in enumerate(child) if i != partial]
        self.pool.touch(shared)
        if 0 <= partial < len(child) and child[partial] is not self.null:
            (dst,) = self.pool.get_new_blocks(1)
            copies.append((child[partial].block_id, dst.block_id))
            child[partial] = dst
        self.tables[child_id] = child
        self.num_cached[child_id] = min(self.num_cached.get(parent_id, 0), num_computed // bs)
        self.retired[child_id] = self.retired.get(parent_id, 0)
        return copies

    # introspection -------------------------------------------------------------------
    def num_held(self, req_id: str) -> int:
        """Non-null blocks in the request's table."""
        table = self.tables.get(req_id)
        if not table:
            return 0
        null = self.null
        return sum(1 for b in table if b is not null)

    def block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.tables.get(req_id, ())]


class FullAttentionManager(GroupManager):
    """Every position holds a block; nothing is retired before the end."""


class SlidingWindowManager(GroupManager):
    """Blocks wholly before the window of the next token return to the pool."""

    spec: SlidingWindowSpec

    def _retire_until(self, num_computed: int) -> int:
        # The next token (position num_computed) attends back to
        # num_computed - W + 1; whole blocks before that are dead.
        return max(0, num_computed - self.spec.sliding_window + 1) // self.block_size

    def longest_hit(self, hashes: list[BlockHash], max_blocks: int) -> int:
        # A hit of n blocks needs only the blocks covering the W - 1 tokens
        # before position n * bs; earlier ones may be evicted.
        cached = self.pool.cached[self.group_id]
        present = [h in cached for h in hashes[:max_blocks]]
        for n in range(max_blocks, 0, -1):
            first = self._retire_until(n * self.block_size)
            if all(present[first:n]):
                return n
        return 0

    def hit_blocks(self, hashes: list[BlockHash], n: int) -> list[KVCacheBlock]:
        cached = self.pool.cached[self.group_id]
        first = self._retire_until(n * self.block_size)
        return [self.null] * first + [cached[h] for h in hashes[first:n]]


class StateManager(GroupManager):
    """Align mode: one state block per block-aligned position a chunk ends on.

    A step that computes tokens [c, c + n) reads the state at position
    ceil(c / bs) - 1 and writes it at ceil((c + n) / bs) - 1 (a new block, or in
    place when both fall in the same partly filled block). Everything before
    the read position is retired at the next allocation.
    """

    def _retire_until(self, num_computed: int) -> int:
        return max(0, cdiv(num_computed, self.block_size) - 1)

    def longest_hit(self, hashes: list[BlockHash], max_blocks: int) -> int:
        # The state after n blocks is enough by itself: no need for a chain.
        cached = self.pool.cached[self.group_id]
        for n in range(max_blocks, 0, -1):
            if hashes[n - 1] in cached:
                return n
        return 0

    def hit_blocks(self, hashes: list[BlockHash], n: int) -> list[KVCacheBlock]:
        if n == 0:
            return []
        return [self.null] * (n - 1) + [self.pool.cached[self.group_id][hashes[n - 1]]]

    def plan(
        self, req_id: str, num_computed: int, num_tokens: int, num_hit: int
    ) -> tuple[int, int]:
        table = self.tables.get(req_id)
        length = (len(table) if table else 0) + num_hit
        last = cdiv(num_tokens, self.block_size) - 1
        new = 1 if last >= length else 0
        return new, self._freed_by_retire(req_id, self._retire_until(num_computed))

    def allocate(
        self, req_id: str, num_computed: int, num_tokens: int, hits: list[KVCacheBlock]
    ) -> list[int]:
        table = self._table(req_id, len(hits))
        start = len(table)
        table.extend(hits)  # the coordinator already took their references
        last = cdiv(num_tokens, self.block_size) - 1
        if last >= len(table):
            table.extend([self.null] * (last - len(table)))
            table.extend(self.pool.get_new_blocks(1))
        else:
            # In-place update of the state in a partly filled block we own.
            assert table[last] is not self.null, "state write position holds no block"
        return [b.block_id for b in table[start:]]

    def cache(self, req_id: str, hashes: list[BlockHash], num_computed: int) -> None:
        # Only a state that ends exactly on a block boundary is the state of
        # that block's prefix; intermediate positions are null.
        table = self.tables.get(req_id)
        if table is None or num_computed % self.block_size:
            return
        i = num_computed // self.block_size - 1
        if 0 <= i < len(table) and i < len(hashes):
            block = table[i]
            if block is not self.null and block.block_hash is None:
                self.pool.cache_block(block, hashes[i], self.group_id)


def make_manager(
    spec: KVCacheSpec, pool: BlockPool, group_id: int, block_size: int
) -> GroupManager:
    if isinstance(spec, StateSpec):
        return StateManager(spec, pool, group_id, block_size)
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager(spec, pool, group_id, block_size)
    return FullAttentionManager(spec, pool, group_id, block_size)
