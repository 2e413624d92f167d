"""AsyncEngine: the core on its own thread, asyncio callers, aborts on close."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from spur.actors.engine.core.outputs import RequestOutput
from spur.actors.engine.core.scheduler import RequestRejected
from spur.actors.engine.shell.async_engine import AsyncEngine, EngineDeadError
from spur.actors.engine.shell.output_processor import Delta
from spur.actors.step import SamplingParams

from .helpers import FULL, STATE, make_engine, prompts


async def collect(engine: AsyncEngine, rid: str, tokens: list[int], **params) -> RequestOutput:
    deltas = []
    final = None
    async for item in engine.generate(rid, tokens, SamplingParams(**params)):
        if isinstance(item, Delta):
            deltas.append(item)
        else:
            final = item
    assert final is not None
    streamed = [t for d in deltas if d.index == 0 for t in d.token_ids]
    assert streamed == final.outputs[0].token_ids
    return final


def test_concurrent_requests_stream_to_the_end_and_free_everything():
    async def main():
        core, sched, _ = make_engine(block_size=4, num_blocks=64, budget=24)
        engine = AsyncEngine(core, None, eos_token_id=None)
        ps = prompts(6, 18, shared=8)
        finals = await asyncio.gather(
            *(collect(engine, f"r{i}", p, max_tokens=10, ignore_eos=True) for i, p in enumerate(ps))
        )
        await engine.shutdown()
        return finals, sched

    finals, sched = asyncio.run(main())
    assert all(len(f.outputs[0].token_ids) == 10 for f in finals)
    assert all(f.outputs[0].finish_reason == "length" for f in finals)
    sched.check_integrity()
    assert sched.kv.num_free_blocks == 63


def test_closing_a_stream_aborts_the_request_and_returns_its_blocks():
    async def main():
        core, sched, _ = make_engine(block_size=4, num_blocks=64, budget=24)
        engine = AsyncEngine(core, None, eos_token_id=None)
        gen = engine.generate(
            "long", list(range(20)), SamplingParams(max_tokens=200, ignore_eos=True)
        )
        got = 0
        async for item in gen:
            got += isinstance(item, Delta)
            if got == 3:
                break
        await gen.aclose()  # what a client disconnect does
        for _ in range(100):
            await asyncio.sleep(0.01)
            if not sched.requests:
                break
        held_after = sched.kv.num_free_blocks
        await engine.shutdown()
        return held_after, sched

    free, sched = asyncio.run(main())
    assert free == 63
    sched.check_integrity()


def test_bad_prompt_is_rejected_before_it_runs():
    async def main():
        core, _, _ = make_engine(block_size=4, num_blocks=20)
        engine = AsyncEngine(core, None, eos_token_id=None)
        with pytest.raises(RequestRejected, match="max_model_len"):
            async for _ in engine.generate("x", list(range(500)), SamplingParams()):
                pass
        final = await collect(engine, "ok", [1, 2, 3], max_tokens=4, ignore_eos=True)
        await engine.shutdown()
        return final

    assert len(asyncio.run(main()).outputs[0].token_ids) == 4


def test_a_failing_executor_fails_streams_loudly():
    async def main():
        core, _, fake = make_engine(block_size=4)

        def boom(_out):
            raise RuntimeError("device lost")

        fake.execute_model = boom
        engine = AsyncEngine(core, None, eos_token_id=None)
        with pytest.raises(EngineDeadError, match="device lost"):
            await collect(engine, "a", [1, 2, 3], max_tokens=4)
        assert not engine.alive
        with pytest.raises(EngineDeadError):
            await collect(engine, "b", [1, 2, 3], max_tokens=4)
        await engine.shutdown()

    asyncio.run(main())


def test_nothing_waits_on_an_engine_thread_that_is_gone():
    """After the thread dies: a command (the drain's integrity check, a snapshot) fails
    at once; so does a request whose stream registers just after the thread failed the
    open ones (forced here: validate() waits for the thread to die, as a GIL switch
    between the caller's check and its registration would); a shut-down engine ends
    its streams too. Each used to wait forever."""

    async def dies() -> None:
        core, _, fake = make_engine(block_size=4)

        def boom(_out):
            time.sleep(0.05)
            raise RuntimeError("device lost")

        fake.execute_model = boom
        engine = AsyncEngine(core, None, eos_token_id=None)
        first = asyncio.ensure_future(collect(engine, "a", [1, 2, 3], max_tokens=4))
        await asyncio.sleep(0.01)  # "a" is in its (failing) step
        validate = engine.validate

        def validate_then_wait(ids):
            validate(ids)
            engine._thread.join()

        engine.validate = validate_then_wait
        second = asyncio.ensure_future(collect(engine, "b", [4, 5, 6], max_tokens=4))
        for task in (first, second):
            with pytest.raises(EngineDeadError, match="device lost"):
                await asyncio.wait_for(task, 5)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(engine.check_integrity(), 5)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(engine.snapshot(), 5)
        assert engine.request_ids == [] and engine.processor.requests == {}

    async def shut_down() -> None:
        core, sched, fake = make_engine(block_size=4, num_blocks=64)
        step = fake.execute_model

        def slow(out):  # the request is still running when the engine stops
            time.sleep(0.01)
            return step(out)

        fake.execute_model = slow
        engine = AsyncEngine(core, None, eos_token_id=None)
        gen = engine.generate(
            "long", list(range(8)), SamplingParams(max_tokens=200, ignore_eos=True)
        )
        await gen.__anext__()
        await engine.shutdown()

        async def rest() -> None:
            async for _ in gen:  # the steps run before the stop, then the end
                pass

        with pytest.raises(EngineDeadError, match="shut down"):
            await asyncio.wait_for(rest(), 5)
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(collect(engine, "later", [1, 2], max_tokens=2), 5)
        assert engine.processor.requests == {} and not sched.requests
        sched.check_integrity()

    asyncio.run(dies())
    asyncio.run(shut_down())


class _RaisingTokenizer:
    """Decodes ids as letters, and raises TypeError on id 999 (a tokenizer's own bug)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        if 999 in ids:
            raise TypeError("decoder failed on id 999")
        return "".join(chr(97 + i % 26) for i in ids)


def test_a_request_whose_add_fails_in_any_way_fails_alone():
    """Only ValueError was caught when a request was added: a tokenizer raising
    TypeError on its prompt, or float ids (which passed the range check), ended the
    engine thread and every other request with it."""

    async def main():
        core, sched, _ = make_engine(block_size=4, num_blocks=64)
        engine = AsyncEngine(core, _RaisingTokenizer(), eos_token_id=None, vocab_size=1000)
        bystander = asyncio.ensure_future(
            collect(engine, "ok", list(range(8)), max_tokens=30, ignore_eos=True)
        )
        with pytest.raises(TypeError, match="decoder failed"):
            await collect(engine, "bad", [5, 999], max_tokens=4)
        with pytest.raises(ValueError, match=r"not integers in the vocabulary"):
            await collect(engine, "floats", [5.0, 6.5], max_tokens=4)  # type: ignore[list-item]
        with pytest.raises(ValueError, match=r"not integers in the vocabulary"):
            await collect(engine, "bools", [True, 3], max_tokens=4)  # type: ignore[list-item]
        assert len((await bystander).outputs[0].token_ids) == 30 and engine.alive
        await engine.shutdown()
        sched.check_integrity()

    asyncio.run(main())


def test_a_command_taken_with_one_that_fails_the_engine_is_still_answered():
    """The engine thread takes its inbox in batches: when one command failed the
    engine, those after it in the batch had left the inbox, and `_end` answered only
    the ones still there, so an integrity check (the drain's) waited forever."""

    async def main():
        core, sched, _ = make_engine(block_size=4, num_blocks=64)
        engine = AsyncEngine(core, None, eos_token_id=None)

        def broken() -> None:
            raise RuntimeError("the pool is broken")

        sched.kv.reset_prefix_cache = broken  # type: ignore[method-assign]
        await asyncio.sleep(0.05)  # the engine thread waits on its inbox
        reset = asyncio.ensure_future(engine.reset_prefix_cache())
        check = asyncio.ensure_future(engine.check_integrity())
        done, _ = await asyncio.wait({reset, check}, timeout=10)
        assert done == {reset, check}, "a command was never answered"
        for fut in (reset, check):
            assert isinstance(fut.exception(), EngineDeadError), fut.exception()
        assert not engine.alive

    asyncio.run(main())


def test_an_engine_stuck_in_a_step_is_not_alive():
    """A forward that never returns (a hung device or collective): the engine thread
    was alive and the replica's health check passed, while its heartbeats (sent from
    the event loop) kept it routed, so its requests hung forever. Past step_timeout_s
    it is not alive, and says why."""

    async def main():
        core, _sched, fake = make_engine(block_size=4, num_blocks=64)
        release = threading.Event()
        forward = fake.execute_model

        def hang(out):  # type: ignore[no-untyped-def]
            release.wait(30)
            return forward(out)

        fake.execute_model = hang
        engine = AsyncEngine(core, None, eos_token_id=None, step_timeout_s=0.2)
        stream = engine.generate("a", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
        first = asyncio.ensure_future(stream.__anext__())
        deadline = time.monotonic() + 10
        while engine.alive:
            assert time.monotonic() < deadline, "a stuck engine stayed alive"
            await asyncio.sleep(0.02)
        assert engine.step_running_s() > 0.2 and engine.stats()["alive"] is False
        assert "engine.runtime.step_timeout_s (0.2 s)" in engine.dead_message
        # A new request is refused with the reason (it queued behind the stuck step,
        # hanging until the replica was restarted).
        with pytest.raises(EngineDeadError, match="stuck"):
            await engine.generate("b", [4, 5], SamplingParams(max_tokens=2)).__anext__()
        release.set()  # the step ends: alive again, the request completes
        await first
        async for _ in stream:
            pass
        assert engine.alive and engine.step_running_s() == 0.0
        await collect(engine, "c", [6, 7], max_tokens=2, ignore_eos=True)  # served again
        await engine.shutdown()

    asyncio.run(main())


def test_requests_queued_behind_a_step_count_as_waiting_and_as_arrived():
    """The router's index charged a routed request until the engine's next report,
    which could not hold it yet when it was queued behind a running step: the load
    the router saw dipped at every report. Queued requests are now reported apart
    (`num_queued`: the router counts them, the autoscaling policy's `num_waiting` does
    not), and each request that reached `generate` is listed once (`take_arrived`)."""

    async def main():
        core, _sched, fake = make_engine(block_size=4, num_blocks=64)
        release, entered = threading.Event(), threading.Event()
        forward = fake.execute_model

        def slow(out):  # type: ignore[no-untyped-def]
            entered.set()
            release.wait(30)
            return forward(out)

        fake.execute_model = slow
        engine = AsyncEngine(core, None, eos_token_id=None)
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        first = asyncio.ensure_future(collect(engine, "a", [1, 2, 3], max_tokens=2))
        deadline = time.monotonic() + 10
        while not entered.is_set():  # "a" is in a step that holds the engine thread
            assert time.monotonic() < deadline, "the step never started"
            await asyncio.sleep(0.01)
        streams = [engine.generate(rid, [4, 5, 6], params) for rid in ("b", "c")]
        nexts = [asyncio.ensure_future(s.__anext__()) for s in streams]
        while len(engine._arrived) < 3:  # both reached generate and queued their add
            assert time.monotonic() < deadline, "the requests never reached generate"
            await asyncio.sleep(0.01)
        assert engine.take_arrived() == ["a", "b", "c"]
        assert engine.take_arrived() == []
        stats = engine.stats()
        assert (stats["num_running"], stats["num_waiting"], stats["num_queued"]) == (1, 0, 2)
        release.set()
        await first
        for nxt, stream in zip(nexts, streams, strict=True):
            await nxt
            async for _ in stream:
                pass
        stats = engine.stats()
        assert (stats["num_running"], stats["num_waiting"], stats["num_queued"]) == (0, 0, 0)
        await engine.shutdown()

    asyncio.run(main())


def test_failing_a_request_whose_final_output_is_queued_changes_nothing():
    """A drain's deadline ends the open streams with an error: a request whose final
    output was already queued (its consumer had not read it yet) had finished; it was
    counted as aborted and its stream ended... after the final output anyway. `fail`
    now leaves it alone and says so; a request still running is failed."""

    async def main():
        core, sched, fake = make_engine(block_size=4, num_blocks=64)
        hold, release = threading.Event(), threading.Event()
        forward = fake.execute_model

        def gated(out):  # type: ignore[no-untyped-def]
            if hold.is_set():
                release.wait(30)
            return forward(out)

        fake.execute_model = gated
        engine = AsyncEngine(core, None, eos_token_id=None)
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        done = engine.generate("done", [1, 2, 3], params)
        first = await done.__anext__()  # the stream is open; the rest queues up
        assert isinstance(first, Delta)
        deadline = time.monotonic() + 10
        while "done" in sched.requests or "done" not in engine._ended:
            assert time.monotonic() < deadline, "the request never finished"
            await asyncio.sleep(0.01)
        hold.set()  # from now on a step waits: "running" cannot finish
        running = engine.generate("running", [4, 5], SamplingParams(max_tokens=50))
        nxt = asyncio.ensure_future(running.__anext__())
        while "running" not in engine._streams:
            assert time.monotonic() < deadline, "the second request never opened"
            await asyncio.sleep(0.01)
        assert engine.fail("done", RuntimeError("drained")) is False
        assert engine.fail("running", RuntimeError("drained")) is True
        assert engine.fail("running", RuntimeError("again")) is False  # one ending
        rest = [item async for item in done]
        assert isinstance(rest[-1], RequestOutput)
        assert len(rest[-1].outputs[0].token_ids) == 3
        with pytest.raises(RuntimeError, match="drained"):
            await nxt
        release.set()
        await engine.shutdown()

    asyncio.run(main())


def test_stop_strings_without_a_tokenizer_fail_that_request_only():
    async def main():
        core, sched, _ = make_engine(block_size=4, num_blocks=64)
        engine = AsyncEngine(core, None, eos_token_id=None)
        bystander = asyncio.ensure_future(
            collect(engine, "ok", list(range(8)), max_tokens=30, ignore_eos=True)
        )
        with pytest.raises(ValueError, match="stop strings need a tokenizer"):
            await collect(engine, "bad", [1, 2, 3], max_tokens=4, stop=["x"])
        assert len((await bystander).outputs[0].token_ids) == 30 and engine.alive
        await engine.shutdown()
        sched.check_integrity()

    asyncio.run(main())


def test_a_slow_consumer_gets_coalesced_deltas_and_every_token():
    async def main():
        core, _, _ = make_engine(block_size=4, num_blocks=64, budget=24)
        engine = AsyncEngine(core, None, eos_token_id=None)
        deltas = []
        final = None
        async for item in engine.generate(
            "slow", list(range(10)), SamplingParams(max_tokens=40, ignore_eos=True)
        ):
            if isinstance(item, Delta):
                deltas.append(item)
                await asyncio.sleep(0.02)  # the engine runs ahead meanwhile
            else:
                final = item
        await engine.shutdown()
        return deltas, final

    deltas, final = asyncio.run(main())
    tokens = [t for d in deltas for t in d.token_ids]
    assert tokens == final.outputs[0].token_ids and len(tokens) == 40
    assert len(deltas) < 40  # several steps' tokens went out together
    assert deltas[-1].finish_reason == "length"


@pytest.mark.parametrize(("interval", "max_tokens"), [(3, 10), (4, 4), (5, 1)])
def test_stream_interval_groups_tokens_after_the_first(interval, max_tokens):
    """The first tokens go at once, then groups of `stream_interval` or more; the last
    delta carries the finish reason and every token arrives, in order."""

    async def main():
        core, sched, fake = make_engine(block_size=4, num_blocks=64, budget=24)
        engine = AsyncEngine(core, None, eos_token_id=None, stream_interval=interval)
        _pace(fake, engine)
        got = await asyncio.gather(
            *(_deltas(engine, f"r{i}", list(range(5 + i)), max_tokens=max_tokens) for i in range(3))
        )
        await engine.shutdown()
        return got, sched

    got, sched = asyncio.run(main())
    for deltas, final in got:
        sizes = [len(d.token_ids) for d in deltas]
        assert [t for d in deltas for t in d.token_ids] == final.outputs[0].token_ids
        assert sum(sizes) == max_tokens
        assert all(n >= interval for n in sizes[1:-1]), sizes
        assert deltas[-1].finish_reason == "length"
        assert all(d.finish_reason is None for d in deltas[:-1])
        assert len(deltas) == min(max_tokens, 1 + -(-(max_tokens - 1) // interval))
    sched.check_integrity()


def test_stream_interval_sends_the_first_token_at_once():
    """Time to first token does not wait for the interval: the engine's second step
    waits until the consumer holds the first delta (a deadline ends the wait)."""

    async def main():
        core, _, fake = make_engine(block_size=4, num_blocks=64, budget=24)
        real, steps, first_seen = fake.execute_model, [], threading.Event()

        def gated(out):
            steps.append(first_seen.wait(timeout=10) if steps else None)
            return real(out)

        fake.execute_model = gated
        engine = AsyncEngine(core, None, eos_token_id=None, stream_interval=16)
        deltas = []
        async for item in engine.generate(
            "a", [1, 2, 3], SamplingParams(max_tokens=6, ignore_eos=True)
        ):
            if isinstance(item, Delta):
                deltas.append(item)
                first_seen.set()
        await engine.shutdown()
        return steps, deltas

    steps, deltas = asyncio.run(main())
    assert steps[1] is True  # the first delta arrived while the engine waited
    assert [len(d.token_ids) for d in deltas] == [1, 5]


def test_stream_interval_hands_over_held_tokens_before_a_failure():
    """A request whose engine dies mid-way still streams the tokens generated before
    (the caller resumes from them elsewhere), then raises."""

    async def main():
        core, _, fake = make_engine(block_size=4, num_blocks=64, budget=24)
        engine = AsyncEngine(core, None, eos_token_id=None, stream_interval=8)
        _pace(fake, engine, fail_at=4)
        tokens = []
        with pytest.raises(EngineDeadError, match="device lost"):
            async for item in engine.generate(
                "a", [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True)
            ):
                tokens += item.token_ids
        await engine.shutdown()
        return tokens

    assert len(asyncio.run(main())) == 3  # one token per step that ran, none held back


def _pace(fake, engine: AsyncEngine, fail_at: int | None = None) -> None:
    """Each step of the fake executor starts once the consumers took every item
    delivered so far (so that back-pressure does not merge deltas: what the interval
    groups is then all there is to see); step `fail_at` (1-based) raises."""
    real, count = fake.execute_model, [0]

    def paced(out):
        delivered = threading.Event()  # queued after the last step's deliveries: FIFO
        engine._loop.call_soon_threadsafe(delivered.set)
        assert delivered.wait(timeout=10), "the event loop did not run"
        deadline = time.monotonic() + 10
        while any(not q.empty() for q in list(engine._streams.values())):
            assert time.monotonic() < deadline, "the consumer did not take its deltas"
            time.sleep(0.001)
        count[0] += 1
        if count[0] == fail_at:
            raise RuntimeError("device lost")
        return real(out)

    fake.execute_model = paced


async def _deltas(engine: AsyncEngine, rid: str, tokens: list[int], **params):
    deltas, final = [], None
    async for item in engine.generate(rid, tokens, SamplingParams(ignore_eos=True, **params)):
        if isinstance(item, Delta):
            deltas.append(item)
        else:
            final = item
    return deltas, final


def test_prefix_cache_reset_runs_on_the_engine_thread():
    async def main():
        core, sched, _ = make_engine(block_size=4, num_blocks=64, budget=64)
        engine = AsyncEngine(core, None, eos_token_id=None)
        prompt = list(range(20))
        await collect(engine, "a", prompt, max_tokens=2, ignore_eos=True)
        await collect(engine, "b", prompt, max_tokens=2, ignore_eos=True)
        hits_before = sched.kv.prefix_stats.total_hits
        await engine.reset_prefix_cache()
        await collect(engine, "c", prompt, max_tokens=2, ignore_eos=True)
        hits_after = sched.kv.prefix_stats.total_hits
        await engine.shutdown()
        return hits_before, hits_after

    before, after = asyncio.run(main())
    assert before == 16 and after == before  # "c" found nothing after the reset


# -- KV events for the router's index ---------------------------------------------------
def test_event_batch_keeps_the_net_effect_in_order():
    from spur.actors.engine.core.block_pool import AllBlocksCleared, BlockRemoved, BlockStored
    from spur.actors.engine.shell.async_engine import event_batch

    a, b, c, d = b"a", b"b", b"c", b"d"
    batch = event_batch(
        7,
        [
            BlockStored([a, b], 0),
            BlockRemoved([a], 0),  # stored then evicted: removed
            BlockStored([c], 1),  # another group: not the router's
            BlockRemoved([d], 0),
            BlockStored([d], 0),  # evicted then stored again: stored
        ],
    )
    assert batch["seq"] == 7 and not batch["cleared"]
    assert sorted(batch["stored"]) == [b, d] and batch["removed"] == [a]
    cleared = event_batch(8, [BlockStored([a], 0), AllBlocksCleared(), BlockStored([b], 0)])
    assert cleared["cleared"] and cleared["stored"] == [b] and cleared["removed"] == []


@pytest.mark.parametrize("hybrid", [False, True])
def test_published_batches_replay_to_the_pool_and_match_a_snapshot(hybrid):
    """Applying the engine's batches in order gives exactly the hashes its pool
    holds (through evictions and a reset), and a snapshot says the same; for a
    model with state layers, the state group's hashes too (the router's hit needs
    the state at its last block)."""

    def replay(batches, held, states, last_seq):
        for batch in batches:
            assert batch["seq"] == last_seq + 1  # numbered without gaps
            last_seq = batch["seq"]
            if batch["cleared"]:
                held.clear()
                states.clear()
            held.update(batch["stored"])
            held.difference_update(batch["removed"])
            assert ("state_stored" in batch) == hybrid
            states.update(batch.get("state_stored", ()))
            states.difference_update(batch.get("state_removed", ()))
        return last_seq

    async def main():
        # 24 blocks of 4 tokens (48 for two groups): eight 18-token prompts with 8
        # shared tokens evict.
        groups = (FULL, STATE) if hybrid else (FULL,)
        core, sched, _ = make_engine(
            block_size=4, num_blocks=24 * len(groups), budget=24, kv_events=True, groups=groups
        )
        engine = AsyncEngine(core, None, eos_token_id=None)
        assert engine.state_group == (1 if hybrid else None)
        held: set[bytes] = set()
        states: set[bytes] = set()
        last = -1
        for round_ in range(2):
            ps = prompts(8, 18, shared=8, seed=round_)
            await asyncio.gather(
                *(
                    collect(engine, f"r{round_}-{i}", p, max_tokens=4, ignore_eos=True)
                    for i, p in enumerate(ps)
                )
            )
            last = replay(engine.take_kv_batches(), held, states, last)
        assert sched.kv.pool.stats.num_evictions > 0
        seq, snap, snap_states = await engine.snapshot()
        last = replay(engine.take_kv_batches(), held, states, last)
        pool = sched.kv.pool.cached
        assert held == set(pool[0]) == set(snap) and seq == last
        if hybrid:
            assert states == set(pool[1]) == set(snap_states) and states
            assert states < held  # sparse: where chunks ended, of blocks it holds
        else:
            assert snap_states is None and not states
        await engine.reset_prefix_cache()
        last = replay(engine.take_kv_batches(), held, states, last)
        await engine.shutdown()
        return held, states, sched

    held, states, sched = asyncio.run(main())
    assert held == states == set() and not any(sched.kv.pool.cached)


def test_on_thread_start_runs_first_on_the_engine_thread():
    import threading

    seen: list[str] = []

    async def main():
        core, _, _ = make_engine(block_size=4, num_blocks=64)
        engine = AsyncEngine(
            core,
            None,
            eos_token_id=None,
            on_thread_start=lambda: seen.append(threading.current_thread().name),
        )
        await collect(engine, "r", [1, 2, 3], max_tokens=2, ignore_eos=True)
        await engine.shutdown()

    asyncio.run(main())
    assert seen == ["spur-engine"]


def test_a_stop_string_in_one_completion_leaves_the_others_to_their_end():
    """n=3: completion 0 samples "x" (a stop string), its forks never do. Completion 0
    ends "stop"; the forks run to max_tokens; the stream ends (it used to hang: the
    stop ended every fork without telling the output processor)."""

    class Letters:
        def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
            return "".join(chr(97 + i % 26) for i in ids)

    async def main():
        core, sched, fake = make_engine(block_size=4, num_blocks=64)
        execute = fake.execute_model

        def diverging(out):  # completion 0 ("r") samples 23 ("x"), its forks ("r#i") 0 ("a")
            res = execute(out)
            for rid, toks in res.sampled_token_ids.items():
                res.sampled_token_ids[rid] = [0 if "#" in rid else 23 for _ in toks]
            return res

        fake.execute_model = diverging
        engine = AsyncEngine(core, Letters(), eos_token_id=None)
        params = SamplingParams(n=3, max_tokens=5, stop=("x",))
        final = await asyncio.wait_for(collect_all(engine, "r", [1, 2, 3, 4, 5, 6], params), 30)
        await engine.shutdown()
        return final, sched

    final, sched = asyncio.run(main())
    got = sorted((o.index, o.text, o.finish_reason) for o in final.outputs)
    assert got == [(0, "", "stop"), (1, "aaaaa", "length"), (2, "aaaaa", "length")]
    assert sched.requests == {} and sched._children == {}
    sched.check_integrity()


async def collect_all(engine: AsyncEngine, rid: str, tokens: list[int], params) -> RequestOutput:
    final = None
    async for item in engine.generate(rid, tokens, params):
        if isinstance(item, RequestOutput):
            final = item
    assert final is not None
    return final


def test_the_models_other_eos_ids_end_requests_unless_they_ignore_eos():
    """`more_eos_token_ids` (generation_config.json's eos list, as vLLM applies it):
    a request stops at any of them, with the id as its stop_reason; ignore_eos runs on."""

    async def run(more: tuple[int, ...], **params) -> RequestOutput:
        core, sched, _ = make_engine(block_size=4, num_blocks=64, budget=24)
        engine = AsyncEngine(core, None, eos_token_id=None, more_eos_token_ids=more)
        try:
            return await collect(engine, "r", list(range(10, 22)), max_tokens=12, **params)
        finally:
            await engine.shutdown()
            sched.check_integrity()

    free = asyncio.run(run(())).outputs[0].token_ids
    stop = next(t for t in free[3:] if t not in free[:3])
    k = free.index(stop)
    out = asyncio.run(run((stop,))).outputs[0]
    assert out.token_ids == free[: k + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert asyncio.run(run((stop,), ignore_eos=True)).outputs[0].token_ids == free


@pytest.mark.parametrize("at_the_end", [False, True])
def test_a_stop_string_ending_is_counted_and_reported_as_the_client_sees_it(smol, at_the_end):
    """A stop string on the last token max_tokens allows: the engine ended at
    "length", the client is told "stop", and vllm:request_success_total counts
    "stop". One before the end finishes the request after the step's stats were
    taken, and no step may follow: the gauges must read the engine as idle."""
    from spur.actors.engine.shell.metrics import EngineMetrics

    words = smol.encode(" one two three four five six")
    prompt = [1, 2, 3, 4]

    async def run() -> tuple[object, dict]:
        core, sched, fake = make_engine(block_size=4, num_blocks=64, budget=24)
        fake.model = lambda tokens: words[len(tokens) - len(prompt)]
        metrics = EngineMetrics(max_model_len=200)
        engine = AsyncEngine(core, smol, eos_token_id=None, metrics=metrics)
        try:
            stop = " six" if at_the_end else " three"
            out = await collect(engine, "r", prompt, max_tokens=len(words), stop=[stop])
            return out.outputs[0], metrics.snapshot()
        finally:
            await engine.shutdown()
            sched.check_integrity()

    comp, snap = asyncio.run(run())
    text = " one two three four five" if at_the_end else " one two"
    assert (comp.text, comp.finish_reason) == (text, "stop")
    assert snap["request_success"].get("stop") == 1 and not snap["request_success"].get("length")
    assert snap["gauges"]["vllm:num_requests_running"] == 0
    assert snap["gauges"]["vllm:kv_cache_usage_perc"] == 0.0


def test_an_id_is_not_reused_while_its_closed_request_may_still_deliver():
    """A stream closed while a step ran: that step's output for it was still delivered
    by id, into a new request that reused the id at once (its stream began with the
    old request's tokens). The id is now refused until the engine applied the abort."""

    async def main():
        core, _sched, fake = make_engine(block_size=4, num_blocks=64)
        gate, entered = threading.Event(), threading.Event()
        forward, calls = fake.execute_model, [0]

        def paced(out):  # type: ignore[no-untyped-def]
            calls[0] += 1
            if calls[0] == 3:  # the step that runs while the consumer goes away
                entered.set()
                gate.wait(10)
            return forward(out)

        fake.execute_model = paced
        engine = AsyncEngine(core, None, eos_token_id=None)
        first = engine.generate("x", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
        await first.__anext__()
        await asyncio.to_thread(entered.wait, 10)
        await first.aclose()
        with pytest.raises(ValueError, match="already in use"):
            await engine.generate("x", [7, 8], SamplingParams(max_tokens=4)).__anext__()
        gate.set()
        deadline = time.monotonic() + 10
        while "x" in engine._closing:  # the abort is applied after that step
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        final = await collect(engine, "x", [7, 8, 9, 10, 11], max_tokens=4, ignore_eos=True)
        assert final.prompt_token_ids == [7, 8, 9, 10, 11]  # collect: streamed == final
        await engine.shutdown()

    asyncio.run(main())
