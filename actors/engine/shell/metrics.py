"""Engine-side statistics for Prometheus, under vLLM's names (pure Python).

The engine thread feeds one `EngineMetrics` per engine:

    on_add(req_id, num_prompt_tokens, n, arrival, lane)   a request entered the engine
    on_step(outputs, stats, scheduler, started)    after every EngineCore.step()
    on_abort(req_id)                               a request left without finishing

As in vLLM, each of an n > 1 request's completions counts as a request (its own
success, latencies, prompt and generation tokens), and `arrival` is taken when the
request reaches the engine's front (not when the engine thread next looks).

and the replica's publisher takes `snapshot()` (cumulative counters, histogram
buckets, gauges; JSON-safe) every stats period and pushes it to the cluster's
metrics store (`spur.cluster.metrics`), which renders every engine's snapshot
with its labels. Counters and buckets only ever grow for the life of the
engine, so a snapshot that is lost or sent twice changes nothing.

Per-request statistics (tokens, finish reasons, latency and size histograms) count
on the lane the request came for: a spare serves several lanes, and a request added
with another lane than the engine's own (`on_add(lane=...)`) counts in that lane's
`LaneCounts` (snapshot key "lanes"), so that its series carry that lane's label.
Per-step statistics (preemptions, prefix cache, iteration tokens, gauges, capacity)
belong to the engine and stay on its own lane.

Request phases follow vLLM's definitions (`vllm/v1/metrics/stats.py`):

    arrival ── queued ── scheduled ── prefill ── first token ── decode ── finished
    |<--------------------------- e2e -------------------------------------->|
               |<-queue->|<---------------------- inference ---------------->|
                         |<---- prefill ---->|<----------- decode ---------->|

Capacity truth, per KV group (`capacity_view`): the blocks the running requests
hold now against the blocks the capacity formula (`spec.max_blocks`, the one
`spur capacity` uses) says they should hold. Their ratio is 1 for a correct
engine; a retirement bug that keeps blocks past their use shows as a ratio
above 1 within one request, long before the pool runs dry.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from spur.actors.engine.core.capacity import context_tokens
from spur.actors.engine.core.request import Request

fork_id = Request.fork_id
# -- vLLM 0.33's default buckets (vllm/v1/metrics/loggers.py) ---------------------------
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
    7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
    120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


_REQ = REQUEST_LATENCY_BUCKETS
_TOK = TOKEN_LATENCY_BUCKETS
# name -> (buckets, or "tokens" for the per-engine 1-2-5 token buckets; help text)
HISTOGRAMS: dict[str, tuple[Sequence[float] | str, str]] = {
    "vllm:time_to_first_token_seconds": (TTFT_BUCKETS, "Time to first token in seconds."),
    "vllm:inter_token_latency_seconds": (_TOK, "Inter-token latency in seconds."),
    "vllm:request_time_per_output_token_seconds": (_TOK, "Time per output token per request."),
    "vllm:e2e_request_latency_seconds": (_REQ, "End-to-end request latency in seconds."),
    "vllm:request_queue_time_seconds": (_REQ, "Time spent in WAITING phase for request."),
    "vllm:request_inference_time_seconds": (_REQ, "Time spent in RUNNING phase for request."),
    "vllm:request_prefill_time_seconds": (_REQ, "Time spent in PREFILL phase for request."),
    "vllm:request_decode_time_seconds": (_REQ, "Time spent in DECODE phase for request."),
    "vllm:request_prompt_tokens": ("tokens", "Number of prefill tokens processed."),
    "vllm:request_generation_tokens": ("tokens", "Number of generation tokens processed."),
    "vllm:iteration_tokens_total": (ITERATION_TOKEN_BUCKETS, "Number of tokens per engine_step."),
}

FINISH_REASONS = ("stop", "length", "abort")
STEP_HISTOGRAMS = frozenset({"vllm:iteration_tokens_total"})
"""Histograms observed per engine step (the engine's own lane); the rest per request."""
MAX_TAGGED_LANES = 64
"""Other lanes one engine counts requests for (a spare's served lanes, at most): a
request for a lane past this many counts on the engine's own lane."""


@dataclass
class Histogram:
    """Cumulative histogram: per-bucket counts (not yet cumulated), sum, count."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def to_dict(self) -> dict[str, Any]:
        """{"buckets": upper bounds, "cumulative": counts per bound then +Inf, sum, count}."""
        cumulative, total = [], 0
        for c in self.counts:
            total += c
            cumulative.append(total)
        return {
            "buckets": list(self.buckets),
            "cumulative": cumulative,
            "sum": self.sum,
            "count": self.count,
        }


@dataclass
class LaneCounts:
    """The per-request statistics of one lane's requests on an engine: prompt and
    generation tokens, finishes by reason, the per-request histograms (the engine's
    own lane's also holds the per-step ones: `STEP_HISTOGRAMS`)."""

    histograms: dict[str, Histogram]
    prompt_tokens: int = 0
    generation_tokens: int = 0
    request_success: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0)
    )

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe, in the snapshot's own shape: counters, request_success, histograms."""
        return {
            "counters": {
                "vllm:prompt_tokens": self.prompt_tokens,
                "vllm:generation_tokens": self.generation_tokens,
            },
            "request_success": dict(self.request_success),
            "histograms": {name: h.to_dict() for name, h in list(self.histograms.items())},
        }


@dataclass
class _Timing:
    """One request's timestamps (monotonic seconds) and token counts."""

    arrival: float
    num_prompt_tokens: int
    counts: LaneCounts  # where its statistics count: its lane's
    parent: str = ""  # the request (n > 1: of its completions) it belongs to
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    num_generated: int = 0


@dataclass(frozen=True)
class GroupCapacity:
    """One KV group right now: blocks held by running requests and the blocks the
    capacity formula gives those requests (each counted per holder)."""

    group_id: int
    kind: str
    held: int
    geometry: int
    worst: float = 1.0
    """The highest held/geometry of any one running request (1 when none runs)."""

    @property
    def ratio(self) -> float:
        return self.held / self.geometry if self.geometry else 1.0


def capacity_view(kv: Any, running: Iterable[Any]) -> list[GroupCapacity]:
    """Per group of `kv` (a KVCacheManager): held vs geometry over `running`
    requests. Reads the manager's tables: call on the engine thread."""
    bs, chunk = kv.block_size, kv.max_chunk
    held = [0] * len(kv.managers)
    geometry = [0] * len(kv.managers)
    worst = [1.0] * len(kv.managers)
    slots_of = kv._slots
    for req in running:
        rid = req.request_id
        slots = slots_of.get(rid)
        if slots is None:
            continue
        for g, manager in enumerate(kv.managers):
            h = manager.num_held(rid)
            bound = manager.spec.max_blocks(slots, bs, chunk)
            held[g] += h
            geometry[g] += bound
            if bound and h / bound > worst[g]:
                worst[g] = h / bound
    return [
        GroupCapacity(g, m.spec.kind, held[g], geometry[g], worst[g])
        for g, m in enumerate(kv.managers)
    ]


class EngineMetrics:
    """Cumulative per-engine statistics (see the module docstring). Not
    thread-safe: the engine thread writes; `snapshot()` copies under the GIL
    (each value is read whole; a snapshot may straddle one step)."""

    def __init__(
        self,
        *,
        max_model_len: int,
        info: dict[str, Any] | None = None,
        capacity_period_s: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.clock = clock
        self.info = dict(info or {})
        self._token_buckets = build_1_2_5_buckets(max_model_len)
        self.own = LaneCounts(self._new_histograms(step=True))
        """The engine's own lane: its own requests and its steps."""
        self.lanes: dict[str, LaneCounts] = {}
        """Other lanes whose requests this engine served (a spare's), by name."""
        self.num_preemptions = 0
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.leak_violations = 0
        self.spec_drafts = 0
        self.spec_draft_tokens = 0
        self.spec_accepted_tokens = 0
        self.num_running = 0
        self.num_waiting = 0
        self.kv_usage = 0.0
        self.capacity: list[GroupCapacity] = []
        self.peak_ratio: list[float] = []
        # Per group, the worst request's ratio over the capacity samples since the last
        # snapshot: a leak that lasts less than the report interval still reaches
        # `spur:kv_request_held_over_geometry_max` (the latest sample alone could miss it).
        self._worst_since_snapshot: list[float] = []
        self.capacity_period_s = capacity_period_s
        self._last_capacity = -1e9
        self._requests: dict[str, _Timing] = {}
        # request id -> [n, completions not finished yet], for an abort of the request
        self._open: dict[str, list[int]] = {}

    # The engine's own lane's counts, under their historical names.
    @property
    def histograms(self) -> dict[str, Histogram]:
        return self.own.histograms

    @property
    def request_success(self) -> dict[str, int]:
        return self.own.request_success

    @property
    def prompt_tokens(self) -> int:
        return self.own.prompt_tokens

    @prompt_tokens.setter
    def prompt_tokens(self, value: int) -> None:
        self.own.prompt_tokens = value

    @property
    def generation_tokens(self) -> int:
        return self.own.generation_tokens

    @generation_tokens.setter
    def generation_tokens(self, value: int) -> None:
        self.own.generation_tokens = value

    def _new_histograms(self, *, step: bool) -> dict[str, Histogram]:
        return {
            name: Histogram(tuple(self._token_buckets if b == "tokens" else b))  # type: ignore[arg-type]
            for name, (b, _) in HISTOGRAMS.items()
            if step or name not in STEP_HISTOGRAMS
        }

    # -- engine thread ----------------------------------------------------------------
    def _counts(self, lane: str | None) -> LaneCounts:
        if lane is None:
            return self.own
        counts = self.lanes.get(lane)
        if counts is None:
            if len(self.lanes) >= MAX_TAGGED_LANES:
                return self.own
            counts = self.lanes[lane] = LaneCounts(self._new_histograms(step=False))
        return counts

    def on_add(
        self,
        req_id: str,
        num_prompt_tokens: int,
        n: int = 1,
        arrival: float | None = None,
        lane: str | None = None,
    ) -> None:
        """A request entered the engine, with `n` completions (forks `Request.fork_id`),
        having arrived at `arrival` (this clock; default now), for `lane` (another lane
        than the engine's own, whose requests a spare serves: its statistics count
        there; None: the engine's own)."""
        arrival = self.clock() if arrival is None else arrival
        counts = self._counts(lane)
        self._requests[req_id] = _Timing(arrival, num_prompt_tokens, counts, req_id)
        for index in range(1, n):
            self._requests[fork_id(req_id, index)] = _Timing(
                arrival, num_prompt_tokens, counts, req_id
            )
        self._open[req_id] = [n, n]

    def on_abort(self, req_id: str) -> None:
        """A request aborted by its caller (client gone), with its completions: no
        longer tracked; each counted as finished_reason "abort" (vLLM counts aborts)."""
        n = self._open.pop(req_id, [1, 1])[0]
        for rid in [req_id, *(fork_id(req_id, i) for i in range(1, n))]:
            t = self._requests.pop(rid, None)
            if t is not None:
                t.counts.request_success["abort"] += 1

    def refresh_gauges(self, scheduler: Any) -> None:
        """Running, waiting and KV usage from `scheduler` now (after an abort, when no
        step may follow to report them)."""
        self.num_running = len(scheduler.running)
        self.num_waiting = len(scheduler.waiting)
        self.kv_usage = scheduler.kv.usage

    def on_step(
        self,
        outputs: Sequence[Any],
        stats: Any,
        scheduler: Any,
        started: float | None = None,
        reasons: Mapping[str, str] | None = None,
        kept: Mapping[str, int] | None = None,
    ) -> None:
        """After one step: `outputs` are its EngineCoreOutputs, `stats` its
        SchedulerStats, `scheduler` the engine's Scheduler (read only), `started` the
        clock before the step (when its requests were scheduled; default now).
        `reasons`: finish reasons that replace an output's own (the client was told
        "stop" where the engine ended at "length": `Update.finish_reasons`). `kept`:
        the ids an output kept where a stop string cut it (`Update.kept`; accepted
        drafts past the stop are not generated tokens)."""
        now = self.clock()
        scheduled_at = now if started is None else started
        requests = self._requests
        for req in scheduler.running:
            rid = req.request_id
            t = requests.get(rid)
            if t is not None and t.scheduled is None:
                t.scheduled = scheduled_at
                parent = requests.get(t.parent) if t.parent != rid else None
                if (
                    parent is not None
                    and parent.scheduled is not None
                    and parent.first_token is None
                ):
                    # A completion of an n > 1 request seated when its parent forked
                    # (in the step of the parent's first token): the prompt's prefill
                    # was theirs together, as vLLM's children are scheduled together.
                    # One that waited for a seat is seen after the parent's first token.
                    t.scheduled = parent.scheduled
        step_prompt = 0
        step_generated = 0
        for out in outputs:
            t = requests.get(out.req_id)
            n = (
                len(out.new_token_ids)
                if kept is None
                else kept.get(out.req_id, len(out.new_token_ids))
            )
            step_generated += n
            if t is None:
                self.own.generation_tokens += n
                continue
            counts = t.counts
            if n:
                counts.generation_tokens += n
                if t.first_token is None:
                    t.first_token = now
                    if t.scheduled is None:  # scheduled and finished in this one step
                        t.scheduled = scheduled_at
                    step_prompt += t.num_prompt_tokens
                    counts.prompt_tokens += t.num_prompt_tokens
                    counts.histograms["vllm:time_to_first_token_seconds"].observe(now - t.arrival)
                elif t.last_token is not None:
                    # One observation per output, however many tokens it holds
                    # (accepted drafts), as vLLM records it.
                    counts.histograms["vllm:inter_token_latency_seconds"].observe(
                        now - t.last_token
                    )
                t.last_token = now
                t.num_generated += n
            if out.finish_reason is not None:
                reason = (
                    out.finish_reason
                    if reasons is None
                    else reasons.get(out.req_id, out.finish_reason)
                )
                self._finished(out.req_id, t, reason, now)
        self.own.histograms["vllm:iteration_tokens_total"].observe(
            stats.num_scheduled_tokens or (step_prompt + step_generated)
        )
        self.num_preemptions = stats.total_preemptions
        self.prefix_queries += stats.prefix_queries
        self.prefix_hits += stats.prefix_hits
        self.leak_violations = stats.kv_leak_violations
        self.spec_drafts += stats.spec_num_drafts
        self.spec_draft_tokens += stats.spec_num_draft_tokens
        self.spec_accepted_tokens += stats.spec_num_accepted_tokens
        self.num_running = stats.num_running
        self.num_waiting = stats.num_waiting
        self.kv_usage = stats.kv_usage
        if now - self._last_capacity >= self.capacity_period_s or not scheduler.running:
            self._last_capacity = now
            self.capacity = capacity_view(scheduler.kv, scheduler.running)
            if len(self.peak_ratio) != len(self.capacity):
                self.peak_ratio = [0.0] * len(self.capacity)
            worst = self._worst_since_snapshot
            if len(worst) != len(self.capacity):
                worst = self._worst_since_snapshot = [0.0] * len(self.capacity)
            for g in self.capacity:
                self.peak_ratio[g.group_id] = max(self.peak_ratio[g.group_id], g.worst)
                worst[g.group_id] = max(worst[g.group_id], g.worst)
        # Requests over their bound, seen by the leak detector at every step (between
        # two capacity samples too): the peak and the window's worst see each of them.
        leaks = getattr(scheduler.kv, "leaks", None)
        if leaks is not None and leaks.worst:
            for g, ratio in leaks.take_worst().items():
                for ratios in (self.peak_ratio, self._worst_since_snapshot):
                    if len(ratios) <= g:  # sized as the capacity samples size them
                        ratios.extend([0.0] * (max(g + 1, len(self.capacity)) - len(ratios)))
                    ratios[g] = max(ratios[g], ratio)

    def finish(self, req_id: str, reason: str) -> None:
        """A request finished outside the core's outputs (a stop string matched by
        the detokenizer): count it now."""
        t = self._requests.get(req_id)
        if t is not None:
            self._finished(req_id, t, reason, self.clock())

    def _finished(self, req_id: str, t: _Timing, reason: str, now: float) -> None:
        del self._requests[req_id]
        counts = self._open.get(t.parent)
        if counts is not None:
            counts[1] -= 1
            if counts[1] <= 0:  # the request's last completion
                del self._open[t.parent]
        success = t.counts.request_success
        success[reason] = success.get(reason, 0) + 1
        h = t.counts.histograms
        scheduled = t.scheduled if t.scheduled is not None else now
        first = t.first_token if t.first_token is not None else now
        h["vllm:e2e_request_latency_seconds"].observe(now - t.arrival)
        h["vllm:request_queue_time_seconds"].observe(scheduled - t.arrival)
        h["vllm:request_inference_time_seconds"].observe(now - scheduled)
        h["vllm:request_prefill_time_seconds"].observe(first - scheduled)
        h["vllm:request_decode_time_seconds"].observe(now - first)
        h["vllm:request_prompt_tokens"].observe(t.num_prompt_tokens)
        h["vllm:request_generation_tokens"].observe(t.num_generated)
        # As vLLM: a request with at most one output token has no decode, and its time
        # per output token is observed as 0 (so the count is the finished requests').
        h["vllm:request_time_per_output_token_seconds"].observe(
            (now - first) / (t.num_generated - 1) if t.num_generated > 1 else 0.0
        )

    # -- any thread -------------------------------------------------------------------
    def restore_window(self, snapshot: dict[str, Any]) -> None:
        """Put a snapshot's per-group worst ratios back into the current window: the
        report that carried them did not arrive, so the next one must."""
        worst = [g["worst_ratio"] for g in snapshot.get("capacity", ())]
        current = self._worst_since_snapshot
        merged = [max(a, b) for a, b in itertools.zip_longest(current, worst, fillvalue=0.0)]
        self._worst_since_snapshot = merged

    def snapshot(self) -> dict[str, Any]:
        """Everything, JSON-safe: counters (cumulative), gauges, histograms, info;
        and, when the engine served other lanes' requests (a spare), "lanes": {lane:
        its requests' counters, request_success and histograms (`LaneCounts.to_dict`)}
        (the rest, at the top, is the engine's own lane's and its steps').

        Capacity's `worst_ratio` is the worst request's held/geometry over the samples
        since the previous snapshot (and the latest one), so each call starts a new
        window: the engine's heartbeat is the one caller. A sample taken while a
        snapshot is read may count in the next window instead."""
        window, self._worst_since_snapshot = self._worst_since_snapshot, []
        return {
            "counters": {
                "vllm:prompt_tokens": self.prompt_tokens,
                "vllm:generation_tokens": self.generation_tokens,
                "vllm:num_preemptions": self.num_preemptions,
                "vllm:prefix_cache_queries": self.prefix_queries,
                "vllm:prefix_cache_hits": self.prefix_hits,
                "spur:kv_leak_violations": self.leak_violations,
                "vllm:spec_decode_num_drafts": self.spec_drafts,
                "vllm:spec_decode_num_draft_tokens": self.spec_draft_tokens,
                "vllm:spec_decode_num_accepted_tokens": self.spec_accepted_tokens,
            },
            "request_success": dict(self.request_success),
            "gauges": {
                "vllm:num_requests_running": self.num_running,
                "vllm:num_requests_waiting": self.num_waiting,
                "vllm:kv_cache_usage_perc": self.kv_usage,
            },
            "capacity": [
                {
                    "group": g.group_id,
                    "kind": g.kind,
                    "held": g.held,
                    "geometry": g.geometry,
                    "ratio": g.ratio,
                    "worst_ratio": max(
                        g.worst, window[g.group_id] if g.group_id < len(window) else 0.0
                    ),
                    "peak_ratio": self.peak_ratio[g.group_id] if self.peak_ratio else g.worst,
                }
                for g in self.capacity
            ],
            "histograms": {name: h.to_dict() for name, h in list(self.histograms.items())},
            **(
                {"lanes": {lane: c.to_dict() for lane, c in list(self.lanes.items())}}
                if self.lanes
                else {}
            ),
            "info": dict(self.info),
        }


def engine_info(kv_config: Any, scheduler_config: Any, args: Any) -> dict[str, Any]:
    """Start-up facts of an engine: vLLM's cache_config_info labels plus spur's
    capacity claim: requests of max_model_len the pool holds, and the longest
    context one request holds with the pool to itself (`capacity.context_tokens`:
    usable blocks * block_size for a plain model, less for a hybrid one)."""
    bs = kv_config.block_size
    usable = kv_config.num_blocks - 1
    per_request = sum(
        g.spec.max_blocks(
            scheduler_config.max_model_len, bs, scheduler_config.max_num_batched_tokens
        )
        for g in kv_config.groups
    )
    return {
        "cache_config": {
            "block_size": str(bs),
            "num_gpu_blocks": str(kv_config.num_blocks),
            "num_cpu_blocks": "0",
            "cache_dtype": str(getattr(args, "kv_cache_dtype", "auto")),
            "enable_prefix_caching": str(bool(kv_config.enable_prefix_caching)),
            "gpu_memory_utilization": str(getattr(args, "gpu_memory_utilization", "")),
            "prefix_caching_hash_algo": "sha256",
            "max_model_len": str(scheduler_config.max_model_len),
        },
        "claimed_max_concurrency": usable // per_request if per_request else 0,
        "pool_tokens": context_tokens(
            kv_config.groups,
            usable_blocks=usable,
            block_size=bs,
            max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
        ),
        "groups": [g.spec.kind for g in kv_config.groups],
    }


# -- tests only: a deliberately broken engine ---------------------------------------------
def break_retirement(kv: Any, blocks_per_step: int) -> None:
    """TESTS ONLY (`engine.runtime.test_leak_blocks_per_step`): make `kv` (a
    KVCacheManager) keep `blocks_per_step` extra blocks in group 0's table of a
    request at every allocation, as a retirement that forgets to return blocks
    would, up to one block more than twice what the request needs (or until the
    pool has no free block left). The blocks are real
    (taken from the pool, freed with the request), so KV usage rises,
    held/geometry exceeds 2 within one request, and the leak detector (switched
    on for plain models too) counts the request."""
    if blocks_per_step <= 0:
        return
    original = kv.allocate_slots
    kv._plain = False  # the detector skips a lone full-attention group otherwise
    manager = kv.managers[0]
    pool = kv.pool

    def leaky(request: Any, *args: Any, **kwargs: Any) -> Any:
        out = original(request, *args, **kwargs)
        table = manager.tables.get(request.request_id)
        if out is None or table is None or pool.num_free_blocks < blocks_per_step:
            return out
        need = -(-kv._slots.get(request.request_id, 0) // kv.block_size)
        if len(table) > 2 * need:
            return out  # just over 2x its geometry: leaky, yet the pool stays shared
        extra = pool.get_new_blocks(blocks_per_step)
        table.extend(extra)
        out[0] = [*out[0], *(b.block_id for b in extra)]
        return out

    kv.allocate_slots = leaky
