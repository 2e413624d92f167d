"""Which deployment serves a lane's traffic now: its primaries or its spare.

`LaneSelector` decides (pure Python); `LaneMonitor` is the ingress's asyncio loop
that feeds it the KV index's health view a few times a second; `Lane` is what
the ingress knows of one lane's engines.

A lane's primaries are usable when at least one replica is healthy and not all
of the healthy ones are saturated (more than `saturation_queue_threshold`
requests waiting). A lane with a spare moves to the spare as soon as its
primaries are unusable, and back once they have been usable for
`healthy_after_s` without a break (hysteresis: a flapping node does not bounce
traffic). Saturated primaries stay the target while the spare has no healthy
replica (they still queue a request, which a dead spare would hold until it gave up),
and a lane on its spare comes back at once, without the hysteresis, when the spare has
no healthy replica left while its primaries are usable (whether it moved for
saturation or because they were down). A lane without a spare always targets its
primaries; with none healthy, its requests fail after their attempts with a 503.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from spur.actors.engine.core.hashing import BlockHasher
from spur.actors.generation_config import SamplingDefaults
from spur.cluster import metrics as M
from spur.cluster.limits import RENEW_EVERY_S

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LaneView:
    """One poll of a lane's primaries: healthy replicas and their waiting queues."""

    healthy: int
    waiting: Sequence[int] = ()
    spare_healthy: int | None = None
    """Healthy replicas of the lane's spare (None: no spare, or not known)."""


@dataclass
class _LaneState:
    on_spare: bool = False
    usable_since: float | None = None
    reason: str = "primary"
    switches: int = 0
    history: list[tuple[float, str]] = field(default_factory=list)


class LaneSelector:
    """Primary-or-spare state per lane, with hysteresis."""

    def __init__(
        self,
        lanes: Sequence[str],
        *,
        spare_of: dict[str, str],
        saturation: dict[str, int],
        healthy_after_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.spare_of = dict(spare_of)
        self.saturation = dict(saturation)
        self.healthy_after_s = healthy_after_s
        self.clock = clock
        self.state = {lane: _LaneState() for lane in lanes}
        self.disabled: dict[str, str] = {}

    def usable(self, lane: str, view: LaneView) -> tuple[bool, str]:
        if view.healthy == 0:
            return False, "down"
        limit = self.saturation.get(lane)
        if limit is not None and view.waiting and all(w > limit for w in view.waiting):
            return False, "saturated"
        return True, "primary"

    def update(self, views: dict[str, LaneView]) -> list[tuple[str, str]]:
        """Apply one poll; returns the lanes that switched, with their new reason."""
        now = self.clock()
        switched = []
        for lane, view in views.items():
            st = self.state.get(lane)
            if st is None:
                continue
            ok, reason = self.usable(lane, view)
            if lane not in self.spare_of:
                st.reason = reason
                continue
            if reason == "saturated" and view.spare_healthy == 0:
                # The spare could not take the traffic: the primaries still queue it.
                if st.on_spare:
                    st.on_spare, st.usable_since = False, None
                    switched.append((lane, "primary"))
                st.reason = "primary"
                continue
            if not ok:
                st.usable_since = None
                if not st.on_spare:
                    st.on_spare = True
                    switched.append((lane, reason))
                st.reason = reason  # why it is on the spare now: saturated, then down
                continue
            if st.on_spare:
                st.usable_since = now if st.usable_since is None else st.usable_since
                # A spare with no healthy replica left would hold the lane's requests
                # (and /health would still say ok): the usable primaries win at once.
                if view.spare_healthy == 0 or now - st.usable_since >= self.healthy_after_s:
                    st.on_spare, st.reason, st.usable_since = False, "primary", None
                    switched.append((lane, "primary"))
        for lane, reason in switched:
            st = self.state[lane]
            st.switches += 1
            st.history = [*st.history[-19:], (now, reason)]
        return switched

    def fail_over_now(self, lane: str, reason: str = "down") -> bool:
        """A request just found the lane's primaries gone: move to the spare without
        waiting for the next poll. Returns True when the lane switched."""
        st = self.state.get(lane)
        if st is None or lane not in self.spare_of or st.on_spare:
            return False
        st.on_spare, st.reason, st.usable_since = True, reason, None
        st.switches += 1
        st.history = [*st.history[-19:], (self.clock(), reason)]
        return True

    def disable_spare(self, lane: str, why: str) -> None:
        """Stop falling back for `lane` (its spare cannot serve it), saying why."""
        self.spare_of.pop(lane, None)
        self.disabled[lane] = why
        st = self.state.get(lane)
        if st is not None:
            st.on_spare = False

    def target(self, lane: str) -> str:
        """The deployment (lane or spare name) that should take the lane's next request."""
        st = self.state.get(lane)
        if st is not None and st.on_spare:
            return self.spare_of[lane]
        return lane

    def report(self, lane: str) -> dict[str, object]:
        st = self.state[lane]
        return {
            "target": self.target(lane),
            "reason": st.reason,
            "spare": self.spare_of.get(lane),
            "switches": st.switches,
            "spare_disabled": self.disabled.get(lane),
        }


class Lane:
    """What the ingress knows of one lane's (or the spare's) engines: its Serve
    handle, how it hashes blocks, and (filled on first use by the ingress) its
    tokenizer, max_model_len and requests' sampling defaults (the model's
    generation_config; of a spare, only its max_model_len, learned by the failover
    opener from its first refusal of a prompt over it). `healthy` is written by
    `LaneMonitor`."""

    def __init__(self, name: str, handle: Any, cache: dict[str, Any]) -> None:
        self.name = name
        self.handle = handle
        self.hasher = BlockHasher(int(cache["block_size"]), str(cache["hash_seed"]))
        self.caching = bool(cache.get("enable_prefix_caching", True))
        self.tokenizer: Any = None
        self.max_model_len = 0
        self.sampling_defaults = SamplingDefaults()
        self.limits_from_spare = False  # max_model_len and defaults: the spare's, for now
        # (tokenizer folder, model folder) of the spare the tokenizer came from, until
        # a primary answers (the ingress then checks the spare's vocabulary).
        self.spare_source: tuple[str, str] | None = None
        self.relearn: asyncio.Future[None] | None = None  # the ingress's re-read in flight
        self.relearn_after = 0.0  # monotonic time of the next re-read try
        self.lock = asyncio.Lock()
        self.healthy = -1  # replicas the index holds healthy (-1: not polled yet)


class LaneMonitor:
    """The ingress's loop around `LaneSelector`: a few times a second it reads the
    KV index's health view (healthy replicas and waiting queues per lane), moves
    lanes to and from their spare, learns whether the deployment is draining, and
    pushes this ingress's metrics counters every second. Once the ingress set
    `limits` (the per-key limits actor, `spur.cluster.limits`), it also renews this
    ingress's ownership of its key leases there every `RENEW_EVERY_S`, so the leases
    of an ingress that died expire within `OWNER_SILENCE_S`.

    `index` is the KV index actor's handle (`routing.index_actor.get_index`): the
    monitor only calls `.remote(...)` on its methods, so no Ray import here.
    `draining` (None, or why the deployment drains) and `on_spare` (lane ->
    requests this ingress has on the lane's spare now, kept by `CountedStream`)
    are read by the ingress and the failover opener.
    """

    def __init__(
        self,
        lanes: dict[str, Lane],
        primaries: Sequence[str],
        selector: LaneSelector,
        index: Any,
        ingress_id: str,
        *,
        metrics_on: bool,
    ) -> None:
        self.lanes = lanes
        self.primaries = list(primaries)
        self.selector = selector
        self.index = index
        self.ingress_id = ingress_id
        self.metrics_on = metrics_on
        self.draining: str | None = None
        self.on_spare: Counter[str] = Counter()
        self._pushed = float("-inf")  # loop time of the last metrics push
        self.limits: Any = None  # the limits actor, once this ingress admitted by it
        self._round: asyncio.Future[None] | None = None  # the poll in flight, if any

    async def run(self, period_s: float = 0.25, renew_every_s: float = RENEW_EVERY_S) -> None:
        """`refresh()` every `period_s` until cancelled; meanwhile renew the leases
        every `renew_every_s` in a task of their own (`_renew_loop`)."""
        renewer = asyncio.ensure_future(self._renew_loop(renew_every_s))
        try:
            while True:
                await self.refresh()
                await asyncio.sleep(period_s)
        finally:
            renewer.cancel()

    async def _renew_loop(self, every_s: float) -> None:
        """Once the ingress set `limits`, tell the limits actor every `every_s` that
        this ingress is alive (sent, not awaited). Its own task: a round stuck on the
        KV index (slow, restarting) would otherwise hold the renewals too, and a live
        ingress's leases would expire."""
        while True:
            if self.limits is not None:
                try:
                    self.limits.renew.remote(self.ingress_id)
                except Exception as exc:  # the actor restarts: the next call goes through
                    logger.warning("lane monitor: lease renewal: %s", exc)
            await asyncio.sleep(every_s)

    async def refresh(self) -> None:
        """Returns once a `poll()` round that started after this call has run (rounds
        are shared by the callers that wait for them). A retry calls it before
        choosing where to go: the index then has the failures this ingress reported
        before it (the index runs one call at a time, in the order each caller sent
        them), so a lane whose replicas just failed moves to its spare for that retry
        instead of at the loop's next round. A round already in flight at the call
        sent its calls before the caller's report, so its answer may predate it: the
        caller waits for it to end, then joins (or starts) the next one. Cancelling
        the caller does not cancel a round."""
        if self._round is not None:
            await asyncio.shield(self._round)
        if self._round is None:
            self._round = asyncio.ensure_future(self._poll_round())
        await asyncio.shield(self._round)

    async def _poll_round(self) -> None:
        try:
            await self.poll()
        finally:
            self._round = None

    async def poll(self) -> None:
        """One round: read the drain state and the index's health view, move lanes to
        and from their spare (not while draining: replicas leave on shutdown), and
        push this ingress's metrics counters when a second has passed since the
        last push. A failed round is logged, not raised (the next one retries)."""
        loop = asyncio.get_running_loop()
        try:
            draining = await self.index.report_spare_load.remote(
                self.ingress_id, {k: v for k, v in self.on_spare.items() if v > 0}
            )
            if draining is not None and self.draining is None:
                logger.warning("draining: %s", draining)
            self.draining = draining
            counts = await self.index.healthy_counts.remote(list(self.lanes))
            for name, c in counts.items():
                self.lanes[name].healthy = c["healthy"]
            spare_of = self.selector.spare_of
            views = {
                name: LaneView(
                    c["healthy"],
                    c["waiting"],
                    counts[spare_of[name]]["healthy"] if spare_of.get(name) in counts else None,
                )
                for name, c in counts.items()
                if name in self.primaries
            }
            if self.draining is None:  # replicas leaving on shutdown: no failover
                for lane, reason in self.selector.update(views):
                    self.switched(lane, reason)
            if self.metrics_on and loop.time() - self._pushed >= 1.0:
                self._pushed = loop.time()
                self.index.push_ingress.remote(
                    self.ingress_id, M.HTTP.snapshot(), self.lane_states()
                )
        except Exception as exc:
            logger.warning("lane monitor: %s", exc)

    def lane_states(self) -> dict[str, Any]:
        """Per primary lane: its target now, why, and its spare (for /metrics)."""
        return M.lane_states(self.selector, self.primaries)

    def switched(self, lane: str, reason: str) -> None:
        """Log, count (index and this ingress's metrics) a lane's move to `reason`."""
        logger.warning("lane %s now served by %s (%s)", lane, self.selector.target(lane), reason)
        self.index.count.remote(lane, "to_primary" if reason == "primary" else "to_spare")
        M.count_switch(M.HTTP, self.selector, lane, reason)
