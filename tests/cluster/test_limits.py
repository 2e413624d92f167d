"""Per-key limits bookkeeping (cluster/limits.py) with a fake clock."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import types
from typing import Any

import pytest

from spur.cluster.auth import Principal
from spur.cluster.errors import ProtocolError
from spur.cluster.ingress import Ingress
from spur.cluster.lanes import LaneMonitor, LaneSelector
from spur.cluster.limits import OWNER_SILENCE_S, RENEW_EVERY_S, WINDOW_S, LimitBook


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_concurrency_lease_and_release() -> None:
    book = LimitBook(clock=Clock())
    a = book.admit("k", 2, None, 10)
    b = book.admit("k", 2, None, 10)
    assert "lease" in a and "lease" in b
    refused = book.admit("k", 2, None, 10)
    assert refused == {"retry_after_s": 1.0, "reason": "concurrency"}
    assert "lease" in book.admit("other", 2, None, 10)  # keys are independent
    book.release("k", a["lease"], 5)
    assert "lease" in book.admit("k", 2, None, 10)
    book.release("k", a["lease"], 5)  # twice: ignored
    book.check_integrity()


def test_tokens_per_minute_window_and_retry_after() -> None:
    clock = Clock()
    book = LimitBook(clock=clock)
    first = book.admit("k", None, 100, 60)
    book.release("k", first["lease"], 30)  # 90 used
    clock.t += 10
    refused = book.admit("k", None, 100, 20)
    assert refused["reason"] == "tokens"
    # the first charges (60 + 30 at t=1000) leave the window at t=1060: 50 s from now
    assert math.isclose(refused["retry_after_s"], WINDOW_S - 10)
    assert "lease" in book.admit("k", None, 100, 10)  # 100 fits exactly
    clock.t += WINDOW_S
    assert book.usage("k")["tokens_last_minute"] == 0
    assert book.admit("k", None, 100, 101)["reason"] == "too_large"
    book.check_integrity()


def test_unreleased_leases_expire() -> None:
    clock = Clock()
    book = LimitBook(lease_ttl_s=30, clock=clock)
    assert "lease" in book.admit("k", 1, None, 1)
    assert book.admit("k", 1, None, 1)["reason"] == "concurrency"
    clock.t += 31  # its ingress died: the lease goes
    assert "lease" in book.admit("k", 1, None, 1)
    book.check_integrity()


def test_random_sequences_keep_the_books_consistent() -> None:
    rng = random.Random(7)
    clock = Clock()
    book = LimitBook(lease_ttl_s=50, clock=clock)
    held: list[tuple[str, int]] = []
    for _ in range(3000):
        clock.t += rng.random() * 2
        if held and rng.random() < 0.5:
            book.release(*held.pop(rng.randrange(len(held))), rng.randrange(50))
        else:
            key = f"k{rng.randrange(3)}"
            answer = book.admit(
                key, rng.choice([None, 3]), rng.choice([None, 500]), 10, rng.choice([0, 100])
            )
            if "lease" in answer:
                held.append((key, answer["lease"]))
        book.check_integrity()
        for key in ("k0", "k1", "k2"):
            assert book.usage(key)["in_flight"] <= len(held)


def test_random_owners_and_repeated_releases_keep_the_books_consistent() -> None:
    """Owners that renew, fall silent and come back, and releases sent twice."""
    rng = random.Random(11)
    clock = Clock()
    book = LimitBook(lease_ttl_s=50, clock=clock, owner_silence_s=8)
    held: list[tuple[str, int]] = []
    done: list[tuple[str, int]] = []
    last = clock.t  # when done[-1] was released
    for _ in range(3000):
        clock.t += rng.random() * 2
        roll = rng.random()
        if roll < 0.2:
            book.renew(f"i{rng.randrange(2)}")  # i2 never renews
        elif roll < 0.3 and done and clock.t - last < WINDOW_S:  # remembered a window
            before = book.usage(done[-1][0])["tokens_last_minute"]
            book.release(*done[-1], rng.randrange(1, 50))
            assert book.usage(done[-1][0])["tokens_last_minute"] == before
        elif roll < 0.6 and held:
            done.append(held.pop(rng.randrange(len(held))))
            book.release(*done[-1], rng.randrange(50))
            last = clock.t
        else:
            key = f"k{rng.randrange(3)}"
            owner = rng.choice([None, "i0", "i1", "i2"])
            answer = book.admit(key, 3, rng.choice([None, 500]), 10, 100, owner=owner)
            if "lease" in answer:
                held.append((key, answer["lease"]))
        book.check_integrity()


def test_a_lease_from_before_a_restart_never_ends_a_new_one() -> None:
    """The actor restarted (a new book): a request admitted before it releases its
    old lease. It must neither free another key's new lease nor bill that key."""
    old, new = LimitBook(clock=Clock()), LimitBook(clock=Clock())
    stale = old.admit("a", 1, None, 10)["lease"]
    fresh = new.admit("b", 1, None, 100)["lease"]
    assert stale != fresh  # ids start at a random number in each life
    new.release("a", fresh, 5000)  # even a colliding id: it is not a's lease
    assert new.usage("b") == {"in_flight": 1, "tokens_last_minute": 100}
    assert new.usage("a") == {"in_flight": 0, "tokens_last_minute": 5000}
    assert new.admit("b", 1, None, 1)["reason"] == "concurrency"
    new.release("b", fresh, 7)
    assert new.usage("b") == {"in_flight": 0, "tokens_last_minute": 107}
    new.check_integrity()


def test_an_expired_lease_still_bills_its_tokens() -> None:
    """A request that outlives lease_ttl_s is billed whether or not anything touched
    its key in between."""
    for touch in (False, True):
        clock = Clock()
        book = LimitBook(lease_ttl_s=30, clock=clock)
        lease = book.admit("k", 1, None, 0)["lease"]
        clock.t += 31
        if touch:
            book.usage("k")  # purges the expired lease
        book.release("k", lease, 500)
        assert book.usage("k") == {"in_flight": 0, "tokens_last_minute": 500}, touch
        book.check_integrity()


def test_concurrent_requests_reserve_their_completion_at_admission() -> None:
    """Charging only the prompt at admission let ten concurrent requests of 2 prompt
    tokens and 1,000 max tokens all in under a 600-token budget (10,020 tokens in the
    minute). Each now reserves its completion's maximum (a default one cut to what the
    window has left after its prompt); the release takes the reservation back and bills what
    was generated."""
    clock = Clock()
    book = LimitBook(clock=clock)
    first = book.admit("k", None, 600, 2, 1000)
    assert "lease" in first and book.usage("k")["tokens_last_minute"] == 600
    assert book.admit("k", None, 600, 2, 1000)["reason"] == "tokens"
    clock.t += 5
    book.release("k", first["lease"], 40)  # it generated 40
    assert book.usage("k")["tokens_last_minute"] == 2 + 40
    small = [book.admit("k", None, 600, 2, 100, asked=True) for _ in range(6)]
    assert ["lease" in a for a in small] == [True] * 5 + [False]  # 42 + 5 * 102 <= 600
    # Unasked, the sixth takes the 46 tokens left instead (refunded here).
    sixth = book.admit("k", None, 600, 2, 100)
    assert sixth["completion_tokens"] == 46
    book.release("k", sixth["lease"], 0, refund=True)
    for a in small[:5]:
        book.release("k", a["lease"], 100)
    assert book.usage("k")["tokens_last_minute"] == 42 + 5 * 102
    book.check_integrity()
    # A reservation the window already dropped is not taken back twice, and the
    # completion it covered for a minute is not billed again (it was: 300 + 250).
    late = book.admit("other", None, 600, 10, 300)
    clock.t += WINDOW_S + 1
    book.release("other", late["lease"], 250)
    assert book.usage("other")["tokens_last_minute"] == 0
    over = book.admit("over", None, 600, 10, 300)
    clock.t += WINDOW_S + 1
    book.release("over", over["lease"], 420)  # only what passed the reservation is new
    assert book.usage("over")["tokens_last_minute"] == 120
    book.check_integrity()


def test_a_default_max_tokens_takes_what_the_window_has_left() -> None:
    """A request without max_tokens (the ingress passes max_model_len - prompt) reserved
    the whole budget after its prompt, whatever the window already held: after one chat
    of 70 tokens, every chat without max_tokens got a 429 for a minute. It now reserves
    what the window has left (at least what its choices need) and waits only when that
    is less."""
    clock = Clock()
    book = LimitBook(clock=clock)
    first = book.admit("k", None, 10_000, 20, 32_748)
    assert first["completion_tokens"] == 9_980
    clock.t += 3
    book.release("k", first["lease"], 50)
    assert book.usage("k")["tokens_last_minute"] == 70
    second = book.admit("k", None, 10_000, 20, 32_748)
    assert second["completion_tokens"] == 10_000 - 70 - 20
    # While it runs nothing is left: the next waits for room for its own choices
    # (3 choices of min_tokens 2: 6 tokens) and is told when the window has it.
    third = book.admit("k", None, 10_000, 20, 32_748, min_completion_tokens=6)
    assert third["reason"] == "tokens" and 0 < third["retry_after_s"] <= WINDOW_S
    book.release("k", second["lease"], 100)
    fourth = book.admit("k", None, 10_000, 20, 32_748, min_completion_tokens=6)
    assert fourth["completion_tokens"] == 10_000 - 70 - 120 - 20
    # A request that named its max tokens still reserves exactly that.
    assert book.admit("a", None, 10_000, 20, 500, asked=True)["completion_tokens"] == 500
    book.check_integrity()


def test_the_reservation_is_all_a_request_may_generate() -> None:
    """A request admitted with 50,000 max tokens under a budget of 1,000 reserved 990
    and was told nothing; generating 50,000 tokens over five minutes, billed at the end,
    it used 50x the budget in a minute. The answer now names the reservation (what the
    ingress cuts a default max_tokens to), and a request that asked for more than the
    budget can hold is refused as too large, as OpenAI refuses one."""
    book = LimitBook(clock=Clock())
    granted = book.admit("k", None, 1000, 10, 50_000)
    assert granted["completion_tokens"] == 990
    book.release("k", granted["lease"], 990)
    assert book.admit("k", None, 1000, 10, 50_000, asked=True)["reason"] == "too_large"
    assert book.admit("other", None, 1000, 10, 990, asked=True)["completion_tokens"] == 990
    # A prompt that fills the budget leaves no token for a completion that needs one.
    assert book.admit("full", None, 1000, 1000, 16)["reason"] == "too_large"
    assert "lease" in book.admit("full", None, 1000, 1000, 0)  # none needed: it fits
    assert book.admit("free", None, None, 10, 50_000)["completion_tokens"] is None
    book.check_integrity()


def test_a_refund_takes_back_the_whole_admission() -> None:
    """A request refused before its first token (a full queue, a prompt the engine
    rejects) kept its prompt charged, so a client retrying after a 429 was locked out
    for a minute by work that never ran. `refund` takes back prompt and reservation."""
    clock = Clock()
    book = LimitBook(clock=clock)
    for _ in range(5):  # five tries of a request that fills a third of the budget
        lease = book.admit("k", None, 900, 250, 50)["lease"]
        assert book.usage("k")["tokens_last_minute"] == 300
        book.release("k", lease, 0, refund=True)
        assert book.usage("k")["tokens_last_minute"] == 0
    billed = book.admit("k", None, 900, 250, 50)["lease"]
    book.release("k", billed, 0)  # no refund: the prompt stays billed
    assert book.usage("k")["tokens_last_minute"] == 250
    # A refund the window already dropped takes nothing back twice.
    late = book.admit("k", None, 900, 100, 0)["lease"]
    clock.t += WINDOW_S + 1
    book.release("k", late, 0, refund=True)
    assert book.usage("k")["tokens_last_minute"] == 0
    book.check_integrity()


def test_the_leases_of_a_silent_owner_expire() -> None:
    """An ingress replica died holding the only lease of a key limited to one request:
    nothing released it, and the key got 429s for the hour of the lease's TTL. A lease
    now names its owner; once that owner has not renewed for OWNER_SILENCE_S its leases
    expire (their slots come back), while a renewing owner's lease, and one taken
    without an owner (only the TTL ends it), stay."""
    clock = Clock()
    book = LimitBook(clock=clock)
    book.admit("a", 1, None, 10, owner="ingress-dead")
    book.admit("b", 1, None, 10, owner="ingress-live")
    book.admit("c", 1, None, 10)
    while clock.t < 1000.0 + OWNER_SILENCE_S - RENEW_EVERY_S:
        clock.t += RENEW_EVERY_S
        book.renew("ingress-live")
        assert book.admit("a", 1, None, 1)["reason"] == "concurrency"  # not yet
        book.check_integrity()
    clock.t += RENEW_EVERY_S
    book.renew("ingress-live")
    assert "lease" in book.admit("a", 1, None, 1, owner="ingress-new")  # its slot came back
    for key in ("b", "c"):
        assert book.admit(key, 1, None, 1)["reason"] == "concurrency", key
    assert "ingress-dead" not in book.heard  # a dead owner is forgotten
    book.check_integrity()


def test_a_silent_owners_lease_expires_as_the_ttl_ends_one() -> None:
    """Its reservation stays charged until the window drops it, and a release that
    comes after all (the owner was only stalled) bills the completion."""
    clock = Clock()
    book = LimitBook(clock=clock, owner_silence_s=20)
    lease = book.admit("k", 2, 1000, 10, 40, asked=True, owner="ingress-a")["lease"]
    clock.t += 21
    assert book.usage("k") == {"in_flight": 0, "tokens_last_minute": 50}
    book.check_integrity()
    book.release("k", lease, 30)
    assert book.usage("k") == {"in_flight": 0, "tokens_last_minute": 80}
    book.check_integrity()


class _Remote:
    """`handle.method.remote(*args)` of an actor whose method is `fn`."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.calls = fn, []

    def remote(self, *args: Any) -> Any:
        self.calls.append(args)
        future = asyncio.get_running_loop().create_future()
        future.set_result(self.fn(*args))
        return future


def _limits(book: LimitBook) -> Any:
    return types.SimpleNamespace(
        admit=_Remote(book.admit), release=_Remote(book.release), renew=_Remote(book.renew)
    )


def test_the_ingress_owns_its_leases_and_its_monitor_renews_them() -> None:
    """`_admit` takes the lease in this ingress's name, and the lane monitor renews it
    every period in a task of its own: a monitor round stuck on the KV index (slow,
    restarting: its calls never answer) held the renewals too, and a live ingress's
    leases expired."""
    book = LimitBook(clock=Clock())
    ingress = types.SimpleNamespace(limits=_limits(book))
    solo = Principal("kid", "solo", "t", False, max_concurrent_requests=1, tokens_per_minute=None)
    _, lease, _ = asyncio.run(Ingress._admit(ingress, solo, 10, owner="ingress-7"))  # type: ignore[arg-type]
    assert book.held == {"ingress-7": {lease}}

    class HangingIndex:
        def __getattr__(self, name: str) -> Any:
            class Method:
                def remote(self, *args: Any, **kwargs: Any) -> Any:
                    return asyncio.get_running_loop().create_future()  # never answered

            return Method()

    selector = LaneSelector(["chat"], spare_of={}, saturation={}, healthy_after_s=1)
    monitor = LaneMonitor({}, ["chat"], selector, HangingIndex(), "ingress-7", metrics_on=False)
    monitor.limits = ingress.limits

    async def running() -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(monitor.run(period_s=0.01, renew_every_s=0.01))
        deadline = loop.time() + 10
        while len(ingress.limits.renew.calls) < 3:
            assert loop.time() < deadline, ingress.limits.renew.calls
            await asyncio.sleep(0.005)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    asyncio.run(running())
    assert set(ingress.limits.renew.calls) == {("ingress-7",)}


def test_too_large_for_its_choices_names_the_choices_not_max_tokens() -> None:
    """A request that named no max_tokens, whose prompt fits the key's budget but whose
    choices' minimum (n=4) does not, was told to lower max_tokens, a field it never
    sent and whose default the server already cuts to fit."""
    book = LimitBook(clock=Clock())
    ingress = types.SimpleNamespace(limits=_limits(book))
    alice = Principal(
        "kid", "alice", "t", False, max_concurrent_requests=None, tokens_per_minute=100
    )
    n = 4
    admit = Ingress._admit(ingress, alice, 98, (8192 - 98) * n, False, n, choices=n)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError) as err:
        asyncio.run(admit)
    assert err.value.param == "prompt", err.value.message
    assert "fewer than 1 (min_tokens, at least 1) for each of its 4 choices" in err.value.message
    assert "max_tokens" not in err.value.message.replace("min_tokens", "")
    # A request that named its max_tokens is still told to lower it.
    asked = Ingress._admit(ingress, alice, 50, 60, True, 1)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError) as err:
        asyncio.run(asked)
    assert err.value.param == "max_tokens"


def test_a_second_release_bills_nothing() -> None:
    """Releasing a lease twice charged its completion twice (130 tokens, then 160),
    and check_integrity passed. The second release is now ignored, for a live lease
    and for one that had expired; the book forgets releases after a window."""
    clock = Clock()
    book = LimitBook(lease_ttl_s=30, clock=clock)
    lease = book.admit("k", 4, 1000, 100, 50, asked=True)["lease"]
    book.release("k", lease, 30)
    book.release("k", lease, 30)
    assert book.usage("k") == {"in_flight": 0, "tokens_last_minute": 130}
    book.check_integrity()
    expired = book.admit("e", 4, None, 0)["lease"]
    clock.t += 31
    book.release("e", expired, 20)
    book.release("e", expired, 20)
    assert book.usage("e")["tokens_last_minute"] == 20
    book.check_integrity()
    clock.t += WINDOW_S
    book.usage("k")
    assert not book.ended  # bounded: one window of releases
    book.check_integrity()
