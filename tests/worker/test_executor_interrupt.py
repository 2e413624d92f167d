"""Interrupts and dead workers under tensor parallelism (MultiprocExecutor).

A Ctrl-C while the engine waits for the TP workers must leave the offline LLM either
working (the next generate gives the same tokens) or saying "create a new LLM": never
reading the interrupted step's answers as the next step's (its requests then got no
token and `step()` spun forever), never a raw BrokenPipeError after a worker died.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import spur.actors.worker.executors as executors
from spur.actors.llm import LLM
from spur.actors.step import ModelRunnerOutput, SamplingParams
from spur.actors.worker.executors import MultiprocExecutor, WorkerError
from spur.actors.worker.worker import WorkerConfig

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = [[5, 17, 99, 3, 42], [7, 8, 9, 10, 11, 12, 13]]
MAX_STEPS = 200  # a generate of PROMPTS takes ~10 steps; more is the old spin


@pytest.fixture(scope="module")
def tp_llm(tiny_model_dir: Callable[[str], Path]) -> Iterator[LLM]:
    llm = LLM(str(tiny_model_dir("llama")), tensor_parallel_size=2, num_threads=1)
    try:
        yield llm
    finally:
        llm.shutdown()


def _generate(llm: LLM) -> list[list[int]]:
    """`llm.generate(PROMPTS)`'s tokens; fails (instead of spinning) past MAX_STEPS steps."""
    real_step, steps = llm.engine.step, [0]

    def step() -> Any:
        steps[0] += 1
        assert steps[0] <= MAX_STEPS, "the engine spins: a request waits for a token forever"
        return real_step()

    llm.engine.step = step  # type: ignore[method-assign]
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        del llm.engine.step


def _interrupt_third_step(
    llm: LLM, monkeypatch: pytest.MonkeyPatch, before_raise: Callable[[], None]
) -> None:
    """Run a generate whose third step raises KeyboardInterrupt while the engine waits
    for the workers' answers (after `before_raise()`), as a Ctrl-C does."""
    real_wait, real_exec = executors.mp_connection.wait, llm.executor.execute_model
    calls, armed = [0], [False]

    def execute(out: Any) -> Any:
        calls[0] += 1
        armed[0] = calls[0] == 3
        return real_exec(out)

    def wait(conns: Any, timeout: float | None = None) -> Any:
        if armed[0]:
            armed[0] = False
            before_raise()
            raise KeyboardInterrupt
        return real_wait(conns, timeout)

    monkeypatch.setattr(llm.executor, "execute_model", execute)
    monkeypatch.setattr(executors.mp_connection, "wait", wait)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, GREEDY)
    monkeypatch.undo()
    assert calls[0] == 3


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_interrupt_in_the_main_process_leaves_no_stale_answer(tp_llm, monkeypatch):
    """Ctrl-C reaching only this process: the workers' answers to the interrupted
    step are drained, so the next generate reads its own and gives the same tokens."""
    reference = _generate(tp_llm)
    _interrupt_third_step(tp_llm, monkeypatch, lambda: None)
    assert tp_llm.executor.broken is None
    assert not any(conn.poll() for conn in tp_llm.executor.conns), "stale answers in the pipes"
    assert _generate(tp_llm) == reference


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_interrupt_of_the_process_group_spares_the_workers(tp_llm, monkeypatch):
    """A terminal's Ctrl-C reaches the workers too: they ignore it (the parent owns
    interruption), so the LLM survives the interrupt and the next generate works."""
    reference = _generate(tp_llm)
    pids = [proc.pid for proc in tp_llm.executor.procs]

    def sigint_workers() -> None:
        for pid in pids:
            os.kill(pid, signal.SIGINT)
        time.sleep(0.5)  # delivered and (not) handled

    _interrupt_third_step(tp_llm, monkeypatch, sigint_workers)
    assert all(proc.is_alive() for proc in tp_llm.executor.procs)
    assert _generate(tp_llm) == reference


class _FlakyWorker:
    """Mixed into `Worker` below: `nap(seconds)` answers late; `die()` exits the
    process without an answer (an OOM kill in the middle of a call)."""

    def nap(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank

    def die(self) -> None:
        os._exit(9)


def _flaky_worker_cls() -> type:
    from spur.actors.worker.worker import Worker

    return type("FlakyWorker", (_FlakyWorker, Worker), {"__module__": __name__})


FlakyWorker = _flaky_worker_cls()


@pytest.fixture
def executor() -> Iterator[MultiprocExecutor]:
    config = WorkerConfig(model="(never loaded)", tensor_parallel_size=2, num_threads=1)
    ex = MultiprocExecutor(config, worker_cls=FlakyWorker)
    ex.failure_grace_s = 1.0
    try:
        yield ex
    finally:
        ex.shutdown()


def _interrupted(ex: MultiprocExecutor, monkeypatch: pytest.MonkeyPatch, *call: Any) -> None:
    """`ex.collective_rpc(*call)` interrupted while it waits for the first answer."""
    real_wait = executors.mp_connection.wait

    def wait(conns: Any, timeout: float | None = None) -> Any:
        monkeypatch.setattr(executors.mp_connection, "wait", real_wait)
        raise KeyboardInterrupt

    monkeypatch.setattr(executors.mp_connection, "wait", wait)
    with pytest.raises(KeyboardInterrupt):
        ex.collective_rpc(*call)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_interrupted_calls_drain_or_stop_the_workers(executor, monkeypatch):
    """Answers that come within the grace are dropped and the executor stays usable;
    a call still running after it stops the workers, and later calls say so."""
    _interrupted(executor, monkeypatch, "nap", (0.2,))
    assert executor.collective_rpc("nap", (0.0,)) == [0, 1]  # its own answers, not stale
    procs = list(executor.procs)
    _interrupted(executor, monkeypatch, "nap", (30.0,))
    assert not any(p.is_alive() for p in procs)
    with pytest.raises(WorkerError, match=r"interrupted \(KeyboardInterrupt\).*create a new LLM"):
        executor.collective_rpc("ping")


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("when", ["between calls", "during a call"])
def test_a_dead_worker_breaks_the_executor_with_a_clear_error(executor, when):
    """A worker that died breaks the group: this call and every later one raise
    WorkerError saying "create a new LLM", never a raw BrokenPipeError."""
    procs = list(executor.procs)
    if when == "between calls":
        procs[1].kill()
        procs[1].join(10)
        call: tuple[Any, ...] = ("ping",)
    else:
        call = ("die",)
    with pytest.raises(WorkerError, match="worker process died"):
        executor.collective_rpc(*call)
    assert executor.broken is not None
    assert not any(p.is_alive() for p in procs)
    for _ in range(2):
        with pytest.raises(WorkerError, match="create a new LLM"):
            executor.collective_rpc("ping")


def test_a_step_without_the_token_of_a_finished_position_raises():
    """Defensive: a runner output lacking the token of a request whose last position
    ran (another step's answer) raises, naming the request, instead of leaving it
    RUNNING with nothing to schedule."""
    from tests.engine.helpers import make_engine

    core, sched, fake = make_engine()
    real = fake.execute_model

    def stale(out: Any) -> ModelRunnerOutput:
        real(out)
        return ModelRunnerOutput(sampled_token_ids={"other": [1]})

    fake.execute_model = stale  # type: ignore[method-assign]
    core.add_request(sched.make_request("r0", [1, 2, 3], SamplingParams(max_tokens=4)))
    with pytest.raises(RuntimeError, match="request r0 ran its last position"):
        core.step()
