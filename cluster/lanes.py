"""Which deployment serves a lane's traffic now: its primaries or its spare (pure
Python; the ingress feeds it the KV index's health view a few times a second).

A lane's primaries are usable when at least one replica is healthy and not all
of the healthy ones are saturated (more than `saturation_queue_threshold`
requests waiting). A lane with a spare moves to the spare as soon as its
primaries are unusable, and back once they have been usable for
`healthy_after_s` without a break (hysteresis: a flapping node does not bounce
traffic). A lane without a spare always targets its primaries; with none
healthy, its requests fail after their attempts with a 503.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LaneView:
    """One poll of a lane's primaries: healthy replicas and their waiting queues."""

    healthy: int
    waiting: Sequence[int] = ()


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
            if not ok:
                st.usable_since = None
                if not st.on_spare:
                    st.on_spare, st.reason = True, reason
                    switched.append((lane, reason))
                continue
            if st.on_spare:
                st.usable_since = now if st.usable_since is None else st.usable_since
                if now - st.usable_since >= self.healthy_after_s:
                    st.on_spare, st.reason = False, "primary"
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
