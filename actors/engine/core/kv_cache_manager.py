"""The KV cache manager: one coordinator over every cache group of an engine.

It answers three questions for the scheduler: how much of a prompt is already
cached (`get_computed_blocks`), can a request get slots for its next tokens
(`allocate_slots`, atomic: all groups or nothing), and which blocks go back
(`free`). It also forks requests for parallel sampling (copy-on-write of the
partly filled last block) and checks, per request, that no group holds more
blocks than the capacity formula assumes (the leak detector).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

from spur.actors.cache_spec import FullAttentionSpec, KVCacheGroup, StateSpec
from spur.actors.engine.core.block_pool import BlockPool, KVCacheBlock, KVEvent
from spur.actors.engine.core.groups import GroupManager, make_manager
from spur.actors.engine.core.hashing import BlockHasher
from spur.actors.engine.core.request import Request
from spur.configs.defaults import DEFAULT_HASH_SEED

logger = logging.getLogger(__name__)

# The geometry of a plain model when the caller does not care (pure-logic tests,
# benchmarks): one full-attention group. Only block counts matter to the core.
DEFAULT_GROUPS = (KVCacheGroup(FullAttentionSpec(num_kv_heads=1, head_size=1, dtype_bytes=2), 1),)


@dataclass(frozen=True)
class KVCacheConfig:
    """What the pool looks like: block size, block count, groups."""

    block_size: int
    """Tokens per block (every group uses the same size; state pages are padded)."""
    num_blocks: int
    """Blocks in the pool, the null block included."""
    groups: tuple[KVCacheGroup, ...] = DEFAULT_GROUPS
    enable_prefix_caching: bool = True
    hash_seed: str = DEFAULT_HASH_SEED
    """Seed of the block-hash chain; routers must use the same one."""

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size={self.block_size} must be >= 1")
        if self.num_blocks < 2:
            raise ValueError(
                f"num_blocks={self.num_blocks}: need the null block and at least one more"
            )
        if not self.groups:
            raise ValueError("a KV cache needs at least one group")

    @property
    def has_state_groups(self) -> bool:
        return any(isinstance(g.spec, StateSpec) for g in self.groups)


@dataclass
class PrefixCacheStats:
    """Counted in tokens: queries = prompt tokens looked up, hits = served.
    `queries` / `hits` restart every step (Scheduler.make_stats); the totals don't.
    A preempted request's lookup on its return (its own blocks, often) counts apart,
    in `preempted_*`, as vLLM counts it: not in queries and hits."""

    queries: int = 0
    hits: int = 0
    requests: int = 0
    total_queries: int = 0
    total_hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0


@dataclass
class LeakReport:
    """One request seen holding more blocks than the capacity formula allows."""

    request_id: str
    group_id: int
    held: int
    bound: int
    num_tokens: int


@dataclass
class LeakDetector:
    """Counts requests whose blocks exceed the per-request bound; each request
    is reported (logged) once. `num_violations` becomes a metric. `worst` holds, per
    group, the highest held / bound of a request seen over its bound at any step since
    the engine's metrics last took it (`take_worst`): the metrics' capacity samples
    (every 0.25 s) miss a leak shorter than that."""

    num_violations: int = 0
    reports: list[LeakReport] = field(default_factory=list)
    _flagged: set[str] = field(default_factory=set)
    worst: dict[int, float] = field(default_factory=dict)

    def take_worst(self) -> dict[int, float]:
        """Group id -> the highest held / bound over a bound since the last call."""
        worst, self.worst = self.worst, {}
        return worst


Hits = list[list[KVCacheBlock]]


class KVCacheManager:
    """Coordinator of the cache groups over one shared `BlockPool`.

    Not thread-safe. `max_chunk` is the most tokens one request may be given in
    a step (the scheduler's token budget); the sliding-window bound uses it.
    """

    def __init__(
        self,
        config: KVCacheConfig,
        *,
        max_chunk: int,
        enable_kv_events: bool = False,
    ) -> None:
        self.config = config
        self.block_size = config.block_size
        self.max_chunk = max_chunk
        self.enable_caching = config.enable_prefix_caching
        self.pool = BlockPool(
            config.num_blocks,
            num_groups=len(config.groups),
            enable_caching=config.enable_prefix_caching,
            enable_kv_events=enable_kv_events,
        )
        self.managers: list[GroupManager] = [
            make_manager(g.spec, self.pool, i, config.block_size)
            for i, g in enumerate(config.groups)
        ]
        self.hasher = BlockHasher(config.block_size, config.hash_seed)
        self.has_state_groups = config.has_state_groups
        # One full-attention group: nothing to retire, so a decode step inside
        # the last block can return at once.
        self._plain = len(self.managers) == 1 and self.managers[0].spec.kind == "full"
        self.prefix_stats = PrefixCacheStats()
        self.leaks = LeakDetector()
        self._copies: list[tuple[int, int]] = []
        self._slots: dict[str, int] = {}
        """Slots (tokens) each request's tables were last sized for."""

    # -- prefix cache -------------------------------------------------------------------
    def get_computed_blocks(self, request: Request, *, record: bool = True) -> tuple[Hits, int]:
        """The longest cached prefix that every group can serve, as per-group
        table entries (not yet referenced) and a token count.

        The last prompt token is never served from the cache (its logits are
        needed), so a full hit returns num_tokens - 1 rounded down to blocks.
        Pure except for the query/hit statistics, which `record=False` leaves to
        the caller (`record_prefix_lookup`): the scheduler counts a request once,
        when it is admitted, not at every step it waits at the head of the queue.
        """
        groups = len(self.managers)
        if not self.enable_caching or request.num_computed_tokens:
            return [[] for _ in range(groups)], 0
        hashes = request.block_hashes
        limit = min(len(hashes), (request.num_tokens - 1) // self.block_size)
        n = limit
        # Each group may shorten the hit; repeat until every group agrees.
        while True:
            before = n
            for manager in self.managers:
                n = manager.longest_hit(hashes, n)
            if n == before:
                break
        if record:
            self.record_prefix_lookup(request, n * self.block_size)
        return [m.hit_blocks(hashes, n) for m in self.managers], n * self.block_size

    def record_prefix_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Count one prefix-cache lookup of `request`: its tokens queried, `num_hit_tokens`
        of them hits (vllm:prefix_cache_queries / _hits); a preempted request's in the
        `preempted_*` totals instead."""
        if not self.enable_caching:
            return
        stats = self.prefix_stats
        if request.num_preemptions:
            stats.preempted_requests += 1
            stats.preempted_queries += request.num_tokens
            stats.preempted_hits += num_hit_tokens
            return
        stats.requests += 1
        stats.queries += request.num_tokens
        stats.hits += num_hit_tokens
        stats.total_queries += request.num_tokens
        stats.total_hits += num_hit_tokens

    # -- allocation ---------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        num_lookahead_tokens: int = 0,
        hits: Hits | None = None,
        num_hit_tokens: int = 0,
    ) -> list[list[int]] | None:
        """Make room for `num_new_tokens` (+ lookahead) after the request's
        computed tokens and the `num_hit_tokens` of `hits` (from
        `get_computed_blocks`, at admission only).

        Returns, per group, the block ids appended to the request's table, or
        None when the pool cannot serve every group; nothing changes then.
        """
        computed = request.num_computed_tokens + num_hit_tokens
        slots = computed + num_new_tokens + num_lookahead_tokens
        req_id = request.request_id
        if self._plain and not hits:
            # Fast path (one full-attention group): a decode step that stays
            # inside the request's last block needs no planning at all.
            table = self.managers[0].tables.get(req_id)
            if table is not None and -(-slots // self.block_size) <= len(table):
                self._slots[req_id] = slots
                return [[]]
        state_slots = computed + num_new_tokens
        managers = self.managers
        need = freed = 0
        for g, manager in enumerate(managers):
            n_hit = len(hits[g]) if hits else 0
            tokens = state_slots if manager.spec.kind == "state" else slots
            new, fr = manager.plan(req_id, computed, tokens, n_hit)
            need += new
            freed += fr
        pool = self.pool
        if need:
            available = pool.free_queue.num_free + freed
            if hits:
                null = pool.null_block
                available -= sum(1 for hg in hits for b in hg if b.ref_cnt == 0 and b is not null)
            if need > available:
                return None
        if slots == 0:
            return [[] for _ in managers]  # a fork parent admitted with nothing to compute
        for manager in managers:
            manager.retire(req_id, computed)
        if hits:
            for hg in hits:
                pool.touch(hg)
        out = []
        for g, manager in enumerate(managers):
            tokens = state_slots if manager.spec.kind == "state" else slots
            out.append(manager.allocate(req_id, computed, tokens, hits[g] if hits else []))
        self._slots[req_id] = slots
        return out

    def rollback(self, request: Request, num_tokens: int) -> list[int] | None:
        """Shrink the request's slots to `num_tokens` after rejected drafts: the
        blocks wholly past them go back to the pool. Returns per group the new
        table length (the worker must cut its tables to it), or None when no
        group held a block past them."""
        req_id = request.request_id
        if req_id not in self._slots:
            return None
        self._slots[req_id] = min(self._slots[req_id], num_tokens)
        cuts = [m.truncate(req_id, num_tokens) for m in self.managers]
        if all(c is None for c in cuts):
            return None
        return [len(m.tables.get(req_id, ())) for m in self.managers]

    def cache_blocks(self, request: Request) -> None:
        """Offer the request's newly completed blocks to the prefix cache. Call
        after the step that computed them (never before: a block is findable
        only once its KV, or state, is really there)."""
        if not self.enable_caching:
            return
        computed = min(request.num_computed_tokens, request.num_tokens)
        if self._plain and computed // self.block_size <= self.managers[0].num_cached.get(
            request.request_id, 0
        ):
            return  # no block completed since the last call
        for manager in self.managers:
            manager.cache(request.request_id, request.block_hashes, computed)

    def free(self, request: Request) -> None:
        """Return every block of the request (its cached ones stay findable). A block
        copy still pending into one of its blocks (a fork preempted in the step that
        made it) is dropped: the block may go to another request in the same step."""
        if self._copies:
            mine = {b for ids in self.block_ids(request.request_id) for b in ids if b}
            self._copies = [(src, dst) for src, dst in self._copies if dst not in mine]
        for manager in self.managers:
            manager.free(request.request_id)
        self._slots.pop(request.request_id, None)

    # -- forks (n > 1) ------------------------------------------------------------------
    def fork(self, parent: Request, child: Request) -> bool:
        """Give `child` the parent's blocks for its computed tokens: full blocks
        shared, the partly filled last block copied (the copy is reported by
        `take_block_copies`). Returns False, changing nothing, if the copies do
        not fit in the pool."""
        computed = parent.num_computed_tokens
        need = sum(m.plan_fork(parent.request_id, computed) for m in self.managers)
        if need > self.pool.num_free_blocks:
            return False
        for manager in self.managers:
            self._copies.extend(manager.fork(parent.request_id, child.request_id, computed))
        self._slots[child.request_id] = computed
        return True

    def take_block_copies(self) -> list[tuple[int, int]]:
        """(src, dst) block copies the worker must make before the next forward."""
        copies, self._copies = self._copies, []
        return copies

    # -- run-time capacity check --------------------------------------------------------
    def check_bounds(self, request: Request) -> bool:
        """True if every group holds no more blocks than the capacity formula
        assumes for this request's slots; otherwise the violation is counted and
        logged (once per request) and False is returned."""
        slots = self._slots.get(request.request_id)
        if slots is None or self._plain:
            # A lone full-attention table is sized to ceil(slots / bs) by
            # construction: it cannot exceed the bound.
            return True
        ok = True
        bs, chunk = self.block_size, self.max_chunk
        for g, manager in enumerate(self.managers):
            bound = manager.spec.max_blocks(slots, bs, chunk)
            table = manager.tables.get(request.request_id)
            if table is None or len(table) <= bound:
                continue  # cannot exceed: even counting nulls it is within
            held = manager.num_held(request.request_id)
            if held > bound:
                ok = False
                worst = self.leaks.worst
                worst[g] = max(worst.get(g, 0.0), held / bound)
                self._report(request.request_id, g, held, bound, slots)
        return ok

    def _report(self, req_id: str, group_id: int, held: int, bound: int, slots: int) -> None:
        leaks = self.leaks
        if req_id in leaks._flagged:
            return
        leaks._flagged.add(req_id)
        leaks.num_violations += 1
        leaks.reports.append(LeakReport(req_id, group_id, held, bound, slots))
        logger.warning(
            "KV leak: request %s holds %d blocks in group %d (%s) for %d tokens; the capacity "
            "formula assumes at most %d. Capacity claimed at start is overstated.",
            req_id,
            held,
            group_id,
            self.managers[group_id].spec.kind,
            slots,
            bound,
        )

    # -- misc ---------------------------------------------------------------------------
    def reset_prefix_cache(self) -> None:
        """Forget all cached hashes (requests in flight keep their blocks)."""
        self.pool.reset_prefix_cache()

    def take_events(self) -> list[KVEvent]:
        return self.pool.take_events()

    def block_ids(self, req_id: str) -> list[list[int]]:
        """The request's full block table per group (0 = null block)."""
        return [m.block_ids(req_id) for m in self.managers]

    def num_held(self, req_id: str) -> list[int]:
        return [m.num_held(req_id) for m in self.managers]

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def check_integrity(self) -> None:
        """Pool invariants plus: every ref count equals the number of table
        entries (over all groups and requests) that hold the block; a block sits at
        one position of one table of one group, except when shared between requests
        (a prefix hit, a fork) and then always at the same position of the same group;
        a cached block is in its own group's tables; positions below a request's
        retired watermark are null; each group keeps per-request bookkeeping exactly
        for the requests it has tables for; only a request with a table has a slot
        count; and a pending block copy writes into a block that only its fork holds
        (not free, not cached: it is overwritten before the next forward)."""
        holders: Counter[int] = Counter()
        where: dict[int, tuple[int, int]] = {}  # block id -> (group, position)
        null = self.pool.null_block
        for g, manager in enumerate(self.managers):
            tables = manager.tables
            for name in ("num_cached", "retired"):
                keys = set(getattr(manager, name))
                assert keys == set(tables), (
                    f"group {g}: {name} names {sorted(keys ^ set(tables))}, which "
                    "hold no table or lack the entry"
                )
            for rid, table in tables.items():
                mine: set[int] = set()
                for i, b in enumerate(table):
                    if b is null:
                        continue
                    bid = b.block_id
                    assert bid not in mine, f"{rid}: block {bid} twice in group {g}'s table"
                    mine.add(bid)
                    assert where.setdefault(bid, (g, i)) == (g, i), (
                        f"{rid}: block {bid} at position {i} of group {g}, and at "
                        f"{where[bid][1]} of group {where[bid][0]} in another table"
                    )
                    assert b.block_hash is None or b.group_id == g, (
                        f"{rid}: group {g} holds block {bid}, cached for group {b.group_id}"
                    )
                holders.update(mine)
                retired = manager.retired[rid]
                assert all(b is null for b in table[:retired]), (
                    f"{rid}: group {g} holds a block below its retired watermark {retired}"
                )
        self.pool.check_integrity(holders)
        owners = {rid for m in self.managers for rid in m.tables}
        assert set(self._slots) <= owners, (
            f"slots of requests without blocks: {set(self._slots) - owners}"
        )
        for src, dst in self._copies:
            block = self.pool.blocks[dst]
            assert block.ref_cnt == 1 and block.block_hash is None, (
                f"pending copy {src} -> {dst} writes into {block}: it must be held by "
                "its fork alone (a freed or shared destination is someone else's block)"
            )
