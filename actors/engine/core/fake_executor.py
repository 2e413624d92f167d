"""A fake executor that stands in for the model.

`Executor` (in `spur.actors.step`) hides topology (one in-process worker, worker subprocesses, Ray
worker actors) behind `execute_model` and `collective_rpc`.

`FakeExecutor` is a worker without a model, for tests and the core benchmark.
It follows the SchedulerOutput protocol exactly as a real worker must (full data
for new requests, diffs for cached ones, drop finished and preempted ones, apply
block copies before the step), and with `simulate_kv=True` it also simulates
the cache memory: every attention slot stores the token written there, every
state block stores a rolling hash of the prefix it summarises. Before writing,
it reads back everything the real kernels would read through the block tables
and raises `KVCorruption` if it is not exactly the request's own tokens. Its
"model" picks the next token from that rolling hash, so a wrong prefix hit or
a bad copy-on-write also changes the generated text.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from spur.actors.cache_spec import SlidingWindowSpec, StateSpec, cdiv
from spur.actors.engine.core.kv_cache_manager import KVCacheConfig
from spur.actors.step import Executor, ModelRunnerOutput, SchedulerOutput

_MOD = (1 << 61) - 1


def roll(h: int, token: int) -> int:
    """The fake model's state update (a polynomial rolling hash)."""
    return (h * 1_000_003 + token + 1) % _MOD


class KVCorruption(AssertionError):
    """The simulated cache did not hold what a request's block table promised."""


@dataclass
class _FakeRequest:
    tokens: list[int]
    tables: list[list[int]]
    num_computed: int
    eos_token_id: int | None
    # Rolling hash of tokens[:len] kept incrementally, for the fake's outputs.
    prefix_hash: list[int] = field(default_factory=lambda: [0])


class FakeExecutor(Executor):
    """A deterministic stand-in for the model worker (see module doc).

    The next token is `h % vocab_size`, where h is the rolling hash of the
    whole sequence so far (with `simulate_kv=False`, of its length and last
    token only, which is cheap); with `eos_token_id` set, it is EOS instead when
    `h % 1000 < eos_per_mille`. Identical sequences therefore continue
    identically, whatever the batch, the cache hits or the preemptions.
    """

    def __init__(
        self,
        kv_config: KVCacheConfig,
        *,
        vocab_size: int = 32_000,
        eos_token_id: int | None = None,
        eos_per_mille: int = 0,
        simulate_kv: bool = True,
        model: Callable[[list[int]], int] | None = None,
    ) -> None:
        """`model(tokens) -> next token` replaces the rolling-hash model (tests of
        speculative decoding use one whose continuations repeat)."""
        self.model = model
        self.kv_config = kv_config
        self.block_size = kv_config.block_size
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.eos_per_mille = eos_per_mille
        self.simulate_kv = simulate_kv
        self.reqs: dict[str, _FakeRequest] = {}
        self.slots: list[int | None] = (
            [None] * (kv_config.num_blocks * kv_config.block_size) if simulate_kv else []
        )
        self.states: dict[int, int] = {}
        self.num_steps = 0
        self.num_copies = 0

    # -- protocol ------------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        out = scheduler_output
        self.num_steps += 1
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.reqs.pop(rid, None)
        if self.simulate_kv:
            bs = self.block_size
            for src, dst in out.blocks_to_copy:
                self.slots[dst * bs : (dst + 1) * bs] = self.slots[src * bs : (src + 1) * bs]
                if src in self.states:
                    self.states[dst] = self.states[src]
                self.num_copies += 1
        for new in out.scheduled_new_reqs:
            self.reqs[new.req_id] = _FakeRequest(
                tokens=list(new.prompt_token_ids) + list(new.output_token_ids),
                tables=[list(t) for t in new.block_ids],
                num_computed=new.num_computed_tokens,
                eos_token_id=new.eos_token_id,
            )
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            req = self.reqs[rid]
            req.tokens.extend(cached.new_token_ids[i])
            if cached.block_table_lengths and (cut := cached.block_table_lengths[i]) is not None:
                for table, length in zip(req.tables, cut, strict=True):
                    del table[length:]
            blocks = cached.new_block_ids[i]
            if blocks is not None:
                for table, extra in zip(req.tables, blocks, strict=True):
                    table.extend(extra)
            if req.num_computed != cached.num_computed_tokens[i]:
                raise KVCorruption(
                    f"{rid}: worker computed {req.num_computed} tokens, "
                    f"scheduler says {cached.num_computed_tokens[i]}"
                )

        sampled: dict[str, list[int]] = {}
        for rid, n in out.num_scheduled_tokens.items():
            req = self.reqs[rid]
            start = req.num_computed
            end = start + n
            drafts = out.scheduled_spec_decode_tokens.get(rid, [])
            known = len(req.tokens)
            if end > known + len(drafts):
                raise KVCorruption(f"{rid}: scheduled up to {end}, only {known} tokens known")
            drafts = drafts[: max(end - known, 0)]
            if self.simulate_kv:
                # Drafts' KV is written like any token's: a rejected one's slot then
                # holds a wrong token, which a missed rollback would read next step.
                req.tokens.extend(drafts)
                self._compute(rid, req, start, end)
                del req.tokens[known:]
                del req.prefix_hash[known + 1 :]
            req.num_computed = end
            if end >= known:
                # Greedy verification: keep drafts while they are what the model picks.
                out_tokens = [self._next_token(req)]
                for d in drafts:
                    if out_tokens[-1] != d:
                        break
                    req.tokens.append(d)
                    out_tokens.append(self._next_token(req))
                del req.tokens[known:]
                del req.prefix_hash[known + 1 :]
                req.num_computed = known + len(out_tokens) - 1
                sampled[rid] = out_tokens
            else:
                sampled[rid] = []
        return ModelRunnerOutput(sampled_token_ids=sampled)

    # -- the fake model -----------------------------------------------------------------
    @staticmethod
    def _prefix(req: _FakeRequest, n: int) -> int:
        """Rolling hash of req.tokens[:n], memoised per request."""
        hashes = req.prefix_hash
        if n >= len(hashes):
            h = hashes[-1]
            for t in req.tokens[len(hashes) - 1 : n]:
                h = roll(h, t)
                hashes.append(h)
        return hashes[n]

    def _next_token(self, req: _FakeRequest) -> int:
        if self.model is not None:
            return self.model(req.tokens)
        if self.simulate_kv:
            h = self._prefix(req, len(req.tokens))
        else:
            # Cheap mode (benchmarks): depends on the last token and the length.
            h = roll(roll(len(req.tokens), req.tokens[-1]), 0)
        if self.eos_token_id is not None and h % 1000 < self.eos_per_mille:
            return self.eos_token_id
        token = h % self.vocab_size
        if token == self.eos_token_id:
            token = (token + 1) % self.vocab_size
        return token

    def _compute(self, rid: str, req: _FakeRequest, start: int, end: int) -> None:
        """Check what the kernels would read, then write the new tokens' KV."""
        bs = self.block_size
        tokens = req.tokens
        for g, group in enumerate(self.kv_config.groups):
            table = req.tables[g]
            spec = group.spec
            if isinstance(spec, StateSpec):
                h = 0
                if start > 0:
                    read = table[cdiv(start, bs) - 1]
                    h = self.states.get(read, -1) if read else -1
                    want = self._prefix(req, start)
                    if h != want:
                        raise KVCorruption(
                            f"{rid}: group {g} state block {read} at {start} is stale"
                        )
                for t in tokens[start:end]:
                    h = roll(h, t)
                write = table[cdiv(end, bs) - 1]
                if write == 0:
                    raise KVCorruption(f"{rid}: group {g} writes state to the null block")
                self.states[write] = h
                continue
            lo = 0
            if isinstance(spec, SlidingWindowSpec):
                lo = max(0, start - spec.sliding_window + 1)
            for pos in range(lo, start):
                block = table[pos // bs]
                if block == 0 or self.slots[block * bs + pos % bs] != tokens[pos]:
                    raise KVCorruption(
                        f"{rid}: group {g} position {pos} reads block {block}: "
                        f"{self.slots[block * bs + pos % bs] if block else 'null'} != {tokens[pos]}"
                    )
            for pos in range(start, min(end, len(tokens))):
                block = table[pos // bs]
                if block == 0:
                    raise KVCorruption(f"{rid}: group {g} writes position {pos} to the null block")
                self.slots[block * bs + pos % bs] = tokens[pos]
