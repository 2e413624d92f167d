"""EngineCore: the one step contract.

    out    = scheduler.schedule()               # SchedulerOutput
    result = executor.execute_model(out)        # ModelRunnerOutput
    outs   = scheduler.update_from_output(out, result)

Everything above this (the Ray actor, the offline LLM class) drives `step()`;
everything below it is behind the executor.
"""

from __future__ import annotations

from spur.actors.engine.core.outputs import EngineCoreOutput, SchedulerStats
from spur.actors.engine.core.request import Request
from spur.actors.engine.core.scheduler import Scheduler
from spur.actors.step import Executor


class EngineCore:
    """Scheduler + executor. Not thread-safe; call from one thread or task."""

    def __init__(self, scheduler: Scheduler, executor: Executor) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.num_steps = 0

    def add_request(self, request: Request) -> None:
        """Queue a request (raises RequestRejected if it can never run)."""
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str] | str) -> list[EngineCoreOutput]:
        """Abort now; blocks return to the pool before this returns."""
        return self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> tuple[list[EngineCoreOutput], SchedulerStats]:
        """Run one step. Returns outputs of requests that gained tokens or
        finished, and the stats after the step."""
        out = self.scheduler.schedule()
        outputs: list[EngineCoreOutput] = []
        if not out.is_empty or out.finished_req_ids or out.preempted_req_ids or out.blocks_to_copy:
            try:
                result = self.executor.execute_model(out)
            except BaseException:
                # The workers may never have seen this step (an interrupt, a failed
                # call): tell them of the finished requests again with the next one,
                # or their states stay (a worker drops an unknown id quietly).
                self.scheduler.resend_finished(out.finished_req_ids)
                raise
            outputs = self.scheduler.update_from_output(out, result)
        self.num_steps += 1
        return outputs, self.scheduler.make_stats()

    def run_until_done(self, max_steps: int = 1_000_000) -> dict[str, list[int]]:
        """Step until no request is left; returns every request's output ids
        (forks included, under their own ids). For tests and offline use."""
        tokens: dict[str, list[int]] = {}
        for _ in range(max_steps):
            if not self.has_unfinished_requests():
                return tokens
            outputs, _ = self.step()
            for o in outputs:
                tokens.setdefault(o.req_id, []).extend(o.new_token_ids)
        raise RuntimeError(f"requests still unfinished after {max_steps} steps")
