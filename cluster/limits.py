"""Per-key limits, enforced across every ingress replica: concurrent generation
requests and tokens (prompt + completion) per minute.

    ingress replica ──admit(key, limits, prompt_tokens, max_completion, owner)──> LimitsActor
                    <── {"lease": id, "completion_tokens": n}      (one, named)
                        | {"retry_after_s": s, "reason": ...}
                    ──release(key, lease, completion_tokens, refund)──>
                    ──renew(owner)──>   (every RENEW_EVERY_S, one per ingress replica)

The state lives in one Ray actor (as the KV index does), so limits hold however
many ingress replicas there are. `LimitBook` is the pure bookkeeping (unit
tested without Ray); `LimitsActor` is its thin shell. A request is admitted when its
prompt plus the completion it may still generate (its max tokens, all choices and
prompts; a default max tokens is cut to what the window has left) fits the key's window, and
that much is charged at once, so that concurrent requests cannot overrun the budget
before any of them is billed (OpenAI's limiter counts max_tokens too). That reservation
is also all the request may generate: the ingress cuts a default max_tokens to it, and
a request that asked for more than the budget can ever hold is refused. At release the
reservation is taken back and the completion's real tokens are charged; a request that
failed before its first token is refunded whole. A window is the last 60 seconds.
A lease names its owner, the ingress replica that took it, and each ingress renews
its ownership every `RENEW_EVERY_S` (one `renew` call per ingress, from its lane
monitor, whatever its number of requests). A lease that is never released because its
ingress died expires once that owner has been silent for `OWNER_SILENCE_S`, so a lost
replica pins a key's concurrency for about a minute; `lease_ttl_s` (an hour) stays
as the backstop for a lease taken without an owner, or an owner that renews but
never releases. An expired lease's reservation stays charged until the window drops
it, and a late release of it bills its completion. A lease released again within a
window of its release is not billed again.
The actor restarts if it dies; counts then start from zero (a brief window of
leniency, never a lock-out). Lease ids start at a random number in each actor's
life, and `release` names the key, so a lease taken before a restart can never end
(or bill) a lease of the new actor.
"""

from __future__ import annotations

import collections
import itertools
import math
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

WINDOW_S = 60.0
LIMITS_NAME = "spur-limits"
LIMITS_NAMESPACE = "spur"
OWNER_SILENCE_S = 60.0
"""How long an owner (ingress replica) may go unheard before its leases expire: six
renewals, so a few lost or late ones (a busy actor, a stalled event loop) never end a
live ingress's leases, yet a dead one's slots come back within about a minute."""
RENEW_EVERY_S = OWNER_SILENCE_S / 6
"""How often each ingress calls `renew` (`LaneMonitor._renew_loop`)."""


class _Charge:
    """Tokens charged at `time`; `live` until the window drops it."""

    __slots__ = ("live", "time", "tokens")

    def __init__(self, time: float, tokens: int) -> None:
        self.time, self.tokens, self.live = time, tokens, True


@dataclass
class _KeyState:
    leases: dict[int, float] = field(default_factory=dict)  # lease id -> expiry time
    tokens: collections.deque[_Charge] = field(default_factory=collections.deque)
    tokens_sum: int = 0


class LimitBook:
    """Concurrency leases and token windows per key id. Not thread-safe (the actor
    runs one call at a time). `clock`: monotonic seconds (injectable for tests).
    `owner_silence_s`: how long an owner may go unheard before its leases expire."""

    def __init__(
        self,
        lease_ttl_s: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
        owner_silence_s: float = OWNER_SILENCE_S,
    ) -> None:
        self.lease_ttl_s = lease_ttl_s
        self.owner_silence_s = owner_silence_s
        self.clock = clock
        self.keys: dict[str, _KeyState] = {}
        self.lease_key: dict[int, str] = {}  # live lease -> the key it counts against
        self.lease_holder: dict[int, str] = {}  # live lease -> its owner, if it named one
        self.held: dict[str, set[int]] = {}  # owner -> its live leases
        self.heard: dict[str, float] = {}  # owner -> when it last renewed or admitted
        # Unique across the actor's restarts, so an old lease never names a new one.
        self._ids = itertools.count(secrets.randbits(62))
        self.refused: collections.Counter[str] = collections.Counter()
        # lease id -> (its admission charge, the completion tokens reserved in it)
        self.reserved: dict[int, tuple[_Charge, int]] = {}
        # (key, lease) released in the last window, and when (in release order): a
        # second release of one is ignored rather than billed again.
        self.ended: set[tuple[str, int]] = set()
        self._ended_at: collections.deque[tuple[float, str, int]] = collections.deque()

    def _state(self, key_id: str, now: float) -> _KeyState:
        self._expire_silent(now)
        while self._ended_at and self._ended_at[0][0] <= now - WINDOW_S:
            self.ended.discard(self._ended_at.popleft()[1:])
        st = self.keys.setdefault(key_id, _KeyState())
        while st.tokens and st.tokens[0].time <= now - WINDOW_S:
            gone = st.tokens.popleft()
            gone.live = False
            st.tokens_sum -= gone.tokens
        for lease in [k for k, v in st.leases.items() if v <= now]:
            self._forget(lease)
            self.reserved.pop(lease, None)  # charged until the window drops it
        return st

    def _expire_silent(self, now: float) -> None:
        """Expire every lease of an owner unheard for `owner_silence_s` (as the TTL
        expires one: its reservation stays charged until the window drops it)."""
        for owner in [o for o, t in self.heard.items() if t <= now - self.owner_silence_s]:
            del self.heard[owner]
            for lease in list(self.held.get(owner, ())):
                self._forget(lease)
                self.reserved.pop(lease, None)

    def _forget(self, lease: int) -> None:
        """Drop a live lease from its key's leases and its owner's."""
        key_id = self.lease_key.pop(lease)
        self.keys[key_id].leases.pop(lease, None)
        owner = self.lease_holder.pop(lease, None)
        if owner is not None:
            self.held[owner].discard(lease)
            if not self.held[owner]:
                del self.held[owner]

    def renew(self, owner: str) -> None:
        """`owner` (an ingress replica) is alive: its leases stay until released, or
        until it has been silent for `owner_silence_s` (or their TTL ends)."""
        self.heard[owner] = self.clock()

    def admit(
        self,
        key_id: str,
        max_concurrent: int | None,
        tokens_per_minute: int | None,
        prompt_tokens: int,
        max_completion_tokens: int = 0,
        asked: bool = False,
        min_completion_tokens: int = 1,
        owner: str | None = None,
    ) -> dict[str, Any]:
        """Take a lease for one request of `prompt_tokens` that may generate up to
        `max_completion_tokens`, or refuse it. `owner`: the ingress replica taking it,
        which must `renew` at least every `owner_silence_s` or the lease expires (the
        admission counts as hearing from it); None: only `lease_ttl_s` ends it.

        Returns {"lease": int, "completion_tokens": int | None}: the prompt and the
        reservation are charged now, and `completion_tokens` is that reservation, the
        most the request may generate (None: no token budget, no bound). The
        reservation is `max_completion_tokens` when the request named it (`asked`);
        else (a default maximum) what the window has left after the prompt, at most
        `max_completion_tokens` and at least `min_completion_tokens` (what all its
        choices need: a request refused for "tokens" waits for that much room).
        Or {"retry_after_s": float, "reason": "concurrency" | "tokens"} with nothing
        charged. A request that can never be admitted is refused with "reason":
        "too_large": its prompt is larger than the whole per-minute budget, or leaves
        no token of it for a completion that needs some, or (`asked`: the request named
        its max tokens itself) its prompt plus `max_completion_tokens` exceed it."""
        now = self.clock()
        if owner is not None:
            self.heard[owner] = now
        st = self._state(key_id, now)
        if max_concurrent is not None and len(st.leases) >= max_concurrent:
            self.refused["concurrency"] += 1
            return {"retry_after_s": 1.0, "reason": "concurrency"}
        reserve: int | None = None
        if tokens_per_minute is not None:
            needs = (
                max_completion_tokens
                if asked
                else min(max_completion_tokens, max(1, min_completion_tokens))
            )
            if tokens_per_minute - prompt_tokens < needs:
                self.refused["too_large"] += 1
                return {"retry_after_s": math.inf, "reason": "too_large"}
            # An unasked maximum takes what the window has left now (at least `needs`).
            room = tokens_per_minute - st.tokens_sum - prompt_tokens
            reserve = (
                max_completion_tokens if asked else max(needs, min(max_completion_tokens, room))
            )
            if st.tokens_sum + prompt_tokens + reserve > tokens_per_minute:
                # Wait until enough of the oldest charges leave the window.
                need = st.tokens_sum + prompt_tokens + reserve - tokens_per_minute
                freed, when = 0, now
                for charge in st.tokens:
                    freed += charge.tokens
                    when = charge.time + WINDOW_S
                    if freed >= need:
                        break
                self.refused["tokens"] += 1
                return {"retry_after_s": max(0.0, when - now), "reason": "tokens"}
        lease = next(self._ids)
        st.leases[lease] = now + self.lease_ttl_s
        self.lease_key[lease] = key_id
        if owner is not None:
            self.lease_holder[lease] = owner
            self.held.setdefault(owner, set()).add(lease)
        charge = self._charge(st, now, prompt_tokens + (reserve or 0))
        if charge is not None:
            self.reserved[lease] = (charge, reserve or 0)
        return {"lease": lease, "completion_tokens": reserve}

    def release(
        self, key_id: str, lease: int, completion_tokens: int = 0, refund: bool = False
    ) -> None:
        """End `key_id`'s lease: take back its reservation (while the window still
        holds it) and charge the completion's tokens to the key. `refund`: the request
        failed before its first token (the engine refused it, no replica could serve
        it), so its whole admission charge, prompt included, is taken back. A request
        that outlived the window (its reservation already dropped from it) is charged
        only the completion tokens beyond its reservation. The tokens are charged even
        when the lease is no longer known (it expired, or was taken
        before the actor restarted); a lease that is not the key's is left alone. A
        second release of a lease within a window of the first does nothing."""
        now = self.clock()
        st = self._state(key_id, now)
        if (key_id, lease) in self.ended:
            return  # released already: billed once
        self.ended.add((key_id, lease))
        self._ended_at.append((now, key_id, lease))
        if self.lease_key.get(lease) == key_id:
            self._forget(lease)
            charge, reserve = self.reserved.pop(lease, (None, 0))
            if charge is not None and charge.live:
                back = charge.tokens if refund else reserve
                charge.tokens -= back
                st.tokens_sum -= back
            elif charge is not None:
                # The window already dropped the reservation, which was charged for
                # a minute: only what the completion used beyond it is new.
                completion_tokens = max(0, completion_tokens - reserve)
        self._charge(st, now, completion_tokens)

    @staticmethod
    def _charge(st: _KeyState, now: float, tokens: int) -> _Charge | None:
        if tokens <= 0:
            return None
        charge = _Charge(now, tokens)
        st.tokens.append(charge)
        st.tokens_sum += tokens
        return charge

    def usage(self, key_id: str) -> dict[str, int]:
        """{"in_flight", "tokens_last_minute"} of a key (reservations included)."""
        st = self._state(key_id, self.clock())
        return {"in_flight": len(st.leases), "tokens_last_minute": st.tokens_sum}

    def check_integrity(self) -> None:
        """Every lease has one key and sits in that key's state, and one owner at most,
        who holds it and is heard from; sums match; a reservation belongs to a lease
        and is part of a charge that still holds it; a released lease is never live
        again (a second release would bill it twice) and is remembered once."""
        owned = 0
        for key_id, st in self.keys.items():
            for lease in st.leases:
                assert self.lease_key.get(lease) == key_id, (lease, key_id)
            owned += len(st.leases)
            assert st.tokens_sum == sum(c.tokens for c in st.tokens), key_id
            assert all(c.live and c.tokens >= 0 for c in st.tokens), key_id
        assert owned == len(self.lease_key), (owned, len(self.lease_key))
        for lease, owner in self.lease_holder.items():
            assert lease in self.lease_key and lease in self.held[owner], (lease, owner)
            assert owner in self.heard, owner
        assert sum(map(len, self.held.values())) == len(self.lease_holder)
        for lease, (charge, reserve) in self.reserved.items():
            assert lease in self.lease_key or not charge.live, lease
            assert not charge.live or charge.tokens >= reserve, lease
        for key_id, lease in self.ended:
            assert self.lease_key.get(lease) != key_id, ("a released lease is live", lease)
        assert len(self.ended) == len(self._ended_at), "a lease released twice"


class LimitsActor:
    """Ray actor shell of a LimitBook (one call at a time)."""

    def __init__(self, lease_ttl_s: float = 3600.0) -> None:
        self.book = LimitBook(lease_ttl_s)

    def admit(
        self,
        key_id: str,
        max_concurrent: int | None,
        tokens_per_minute: int | None,
        prompt_tokens: int,
        max_completion_tokens: int = 0,
        asked: bool = False,
        min_completion_tokens: int = 1,
        owner: str | None = None,
    ) -> dict[str, Any]:
        return self.book.admit(
            key_id,
            max_concurrent,
            tokens_per_minute,
            prompt_tokens,
            max_completion_tokens,
            asked,
            min_completion_tokens,
            owner,
        )

    def renew(self, owner: str) -> None:
        self.book.renew(owner)

    def release(
        self, key_id: str, lease: int, completion_tokens: int = 0, refund: bool = False
    ) -> None:
        self.book.release(key_id, lease, completion_tokens, refund)

    def usage(self, key_id: str) -> dict[str, int]:
        return self.book.usage(key_id)


def get_limits() -> Any:
    """The deployment's limits actor, created on first use (on the head node)."""
    import ray

    remote = ray.remote(LimitsActor)
    return remote.options(  # type: ignore[attr-defined]
        name=LIMITS_NAME,
        namespace=LIMITS_NAMESPACE,
        get_if_exists=True,
        lifetime="detached",
        num_cpus=0,
        max_restarts=-1,
        max_concurrency=1,
        resources={"node:__internal_head__": 0.001},
    ).remote()


def kill_limits() -> None:
    """Stop the limits actor if it runs (on `spur serve` shutdown and in tests)."""
    import ray

    try:
        actor = ray.get_actor(LIMITS_NAME, namespace=LIMITS_NAMESPACE)
    except ValueError:
        return
    ray.kill(actor, no_restart=True)
