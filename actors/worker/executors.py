"""Executors: where the workers live. The engine only sees `Executor`.

- `UniProcExecutor`: one worker in this process (TP=1).
- `MultiprocExecutor`: one worker process per rank, joined in a
  torch.distributed group (gloo on CPU, NCCL on CUDA); calls go over pipes.
The Ray executor of the cluster issue has the same shape with actors.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

from spur.actors.ports import free_port
from spur.actors.step import Executor, ModelRunnerOutput, SchedulerOutput
from spur.actors.worker.worker import Worker, WorkerConfig

logger = logging.getLogger(__name__)


class WorkerError(RuntimeError):
    """A worker raised; the message carries each failing rank and its traceback,
    `reason` the first one's error in one line (what a user acts on: the model
    path, the device)."""

    def __init__(self, message: str, reason: str = "", *, died: bool = False) -> None:
        super().__init__(message)
        self.reason = reason or message
        self.died = died
        """A worker process died during the call (it sent no traceback)."""


def _last_line(text: str) -> str:
    """A traceback's last line without its exception type: the error's own words."""
    lines = [ln for ln in str(text).strip().splitlines() if ln.strip()]
    return lines[-1].split(": ", 1)[-1].strip() if lines else str(text)


class UniProcExecutor(Executor):
    def __init__(self, config: WorkerConfig) -> None:
        if config.tensor_parallel_size != 1:
            raise ValueError("UniProcExecutor runs one worker: use MultiprocExecutor for TP > 1")
        self.worker = Worker(config, rank=0)
        self.worker.init_device()

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        fn = getattr(self.worker, method) if isinstance(method, str) else method
        return [fn(*args, **(kwargs or {}))]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def shutdown(self) -> None:
        self.worker.shutdown()


def _worker_main(
    conn: Any, config: WorkerConfig, rank: int, init_method: str, worker_cls: type[Worker]
) -> None:
    # The parent owns interruption: a terminal's Ctrl-C reaches the whole process group,
    # and a worker killed by it mid-call would break the group the parent can otherwise
    # keep (it collects the call's answers and re-raises the interrupt itself).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    worker = worker_cls(config, rank=rank, dist_init_method=init_method)
    while True:
        try:
            method, args, kwargs = conn.recv()
        except EOFError:
            break
        if method == "__stop__":
            worker.shutdown()
            conn.send(("ok", None))
            break
        try:
            conn.send(("ok", getattr(worker, method)(*args, **kwargs)))
        except Exception:  # the traceback goes back to the engine
            conn.send(("err", traceback.format_exc()))


class MultiprocExecutor(Executor):
    """`tensor_parallel_size` worker processes; rank 0's output is the step's.

    A rank that raises (or dies) while its peers wait for it in a collective would
    hang them until gloo's timeout (30 minutes): `collective_rpc` gives the other ranks
    `failure_grace_s` to answer, then stops every worker process and raises
    `WorkerError`; the executor is unusable from then on (its process group is broken),
    and says so on every later call. A call that fails on every rank (a bad argument)
    leaves the executor usable; a worker process that died breaks it.

    An interrupt (KeyboardInterrupt) while the workers run a call leaves the executor
    usable when every rank answers within `failure_grace_s` (their answers are read and
    dropped, so no later call reads them as its own); otherwise it is broken, as above.
    The workers ignore SIGINT: a terminal's Ctrl-C to the process group reaches only
    this process's handling."""

    failure_grace_s = 5.0
    """How long the other ranks may take to answer once one rank has failed, or once
    the caller was interrupted."""

    def __init__(self, config: WorkerConfig, worker_cls: type[Worker] = Worker) -> None:
        ctx = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.conns = []
        self.procs = []
        self.broken: str | None = None
        """Why the workers were stopped, once a rank's failure broke the group."""
        for rank in range(config.tensor_parallel_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main,
                args=(child, config, rank, init_method, worker_cls),
                name=f"spur-worker-{rank}",
                daemon=True,
            )
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        try:
            self.collective_rpc("init_device")
        except WorkerError as e:
            hint = unguarded_main_hint() if e.died else None
            if hint is None:
                raise
            raise WorkerError(f"{e}\n{hint}", f"{e.reason}: {hint}", died=True) from None

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """Run `method` on every rank; returns the ranks' results in rank order.

        Raises WorkerError naming each failing rank when any rank raised or died, and
        on every call once the executor is broken (the message says "create a new
        LLM"). Any BaseException while the ranks run the call (a KeyboardInterrupt)
        is re-raised after the ranks' answers are drained (see the class docstring):
        the pipes then hold nothing stale, or the workers are stopped."""
        if not isinstance(method, str):
            raise TypeError("MultiprocExecutor calls worker methods by name")
        self._check_usable(method)
        results: list[Any] = [None] * len(self.conns)
        errors: list[str] = []
        reasons: list[str] = []
        dead: list[str] = []  # "rank r: the worker process died (...)"
        pending = dict(enumerate(self.conns))
        sent = 0  # ranks whose pipe holds the whole call
        receiving: int | None = None  # the rank whose answer is being read
        try:
            for conn in self.conns:
                conn.send((method, args, kwargs or {}))
                sent += 1
            while pending:
                timeout = self.failure_grace_s if errors else None
                ready = mp_connection.wait(list(pending.values()), timeout=timeout)
                if not ready:  # the others wait for the failed rank: the group is broken
                    ranks = ", ".join(map(str, sorted(pending)))
                    errors.append(
                        f"rank {ranks}: no answer {self.failure_grace_s:g} s after "
                        "the failure (waiting for the failed rank); stopped"
                    )
                    self._break(errors[0].split(":", 1)[0] + ": " + reasons[0])
                    break
                for rank, conn in list(pending.items()):
                    if conn not in ready:
                        continue
                    receiving = rank
                    try:
                        status, value = conn.recv()
                    except (EOFError, OSError):
                        status, value = "err", self._death(rank)
                        dead.append(f"rank {rank}: {value}")
                    del pending[rank]
                    receiving = None
                    if status == "err":
                        errors.append(f"rank {rank}: {value}")
                        reasons.append(_last_line(value))
                    results[rank] = value
        except BaseException as exc:
            if isinstance(exc, OSError) and sent < len(self.conns):
                # The pipe of a worker that died since the last call (OOM-killed, a signal).
                why = f"rank {sent}: {self._death(sent)}"
                self._break(why)
                raise WorkerError(f"{method}: {why}; create a new LLM", why) from exc
            if sent < len(self.conns) or receiving is not None:
                # A call half sent or an answer half read leaves a pipe mid-message, and
                # ranks that never got the call would leave their peers in a collective.
                self._break(
                    f"interrupted ({type(exc).__name__}) while sending {method} or "
                    "reading its answers"
                )
            else:
                self._drain(method, pending, exc)
            raise
        if dead and self.broken is None:  # the group lost a rank: nothing can run on it
            self._break(dead[0])
        if errors:
            raise WorkerError(
                f"{method} failed on workers:\n" + "\n".join(errors),
                reasons[0] if reasons else "",
                died=bool(dead),
            )
        return results

    def _check_usable(self, method: str) -> None:
        if self.broken is not None:
            raise WorkerError(
                f"{method}: the TP workers were stopped after a failure ({self.broken}); "
                "create a new LLM",
                self.broken,
            )

    def _death(self, rank: int) -> str:
        """Why rank's pipe broke, in words; reaps the process if it has exited."""
        proc = self.procs[rank]
        proc.join(timeout=1.0)  # an exited process has no exit code until reaped
        return f"the worker process died (exit code {proc.exitcode})"

    def _drain(self, method: str, pending: dict[int, Any], exc: BaseException) -> None:
        """After an interrupt: read and drop the answers `pending` ranks still owe for
        `method`, for up to `failure_grace_s`, so the next call reads only its own.
        Breaks the executor (stops the workers) if any rank does not answer in time,
        died, or a second interrupt arrives meanwhile. Mutates `pending`."""
        deadline = time.monotonic() + self.failure_grace_s
        try:
            while pending:
                left = deadline - time.monotonic()
                ready = mp_connection.wait(list(pending.values()), timeout=max(left, 0.0))
                if not ready:
                    break
                for rank, conn in list(pending.items()):
                    if conn in ready:
                        conn.recv()  # EOFError / OSError: it died
                        del pending[rank]
        except BaseException:  # a dead rank, a second Ctrl-C: the caller re-raises `exc`
            pass
        if pending:
            ranks = ", ".join(map(str, sorted(pending)))
            self._break(
                f"interrupted ({type(exc).__name__}) while running {method}; rank {ranks} "
                f"gave no answer within {self.failure_grace_s:g} s"
            )
        else:
            logger.info("interrupted %s: dropped the workers' answers", method)

    def _break(self, why: str) -> None:
        """Mark the executor unusable for `why` and stop every worker process."""
        if self.broken is None:
            self.broken = why
        self._kill()

    def _kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(timeout=10)
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.collective_rpc("execute_model", (scheduler_output,))[0]

    def shutdown(self) -> None:
        for conn in self.conns:
            try:
                conn.send(("__stop__", (), {}))
                conn.recv()
            except (BrokenPipeError, EOFError, OSError):
                pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        self.conns, self.procs = [], []


def unguarded_main_hint() -> str | None:
    """What to fix when a worker process died while starting and the main module is a
    script: the likely cause. Workers are started with multiprocessing's spawn, which
    imports the main script again in each of them; a script that builds its LLM at
    module level (no `if __name__ == "__main__":`, as vLLM's examples often do) then
    builds one in every worker, whose own start of processes fails ("An attempt has
    been made to start a new process before the current process has finished its
    bootstrapping phase"), and the worker exits before it answers. Whether the script
    has the guard cannot be seen from here; None when there is no script to re-run
    (python -c, a notebook) or it is spur's own command line."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    spec = getattr(main, "__spec__", None)
    if (
        not path
        or os.path.basename(path) == "spur"
        or getattr(spec, "name", "").startswith("spur.")
    ):
        return None
    return (
        f"if {path} creates the LLM at module level, put that code under "
        '`if __name__ == "__main__":`: tensor_parallel_size > 1 starts worker processes '
        "with multiprocessing's spawn, and each of them re-runs the main script"
    )


def make_executor(config: WorkerConfig) -> Executor:
    if config.tensor_parallel_size == 1:
        return UniProcExecutor(config)
    return MultiprocExecutor(config)
