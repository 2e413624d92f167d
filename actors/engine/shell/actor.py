"""The Ray Serve shell of an engine: one replica per node, owning the engine core,
the KV pool and an executor (TP=1: the model runs in the replica; TP>1: one Ray
worker actor per device in a STRICT_PACK placement group on this node).

The replica is a plain class; `cluster/app.py` wraps it with `serve.deployment`
and its options (replicas, resources, back-pressure). Its streaming method
yields JSON-safe dicts, so the ingress never needs the engine's classes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

from spur.actors.engine.core.outputs import RequestOutput
from spur.actors.engine.core.scheduler import RequestRejected
from spur.actors.engine.shell.async_engine import AsyncEngine, EngineDeadError
from spur.actors.engine.shell.metrics import EngineMetrics, engine_info
from spur.actors.engine.shell.output_processor import Delta
from spur.actors.step import SamplingParams, SamplingParamsError

logger = logging.getLogger(__name__)


DRAIN_CODE = "draining"
"""`code` of the error item a draining replica ends (or refuses) a request with: the
ingress continues the request on another replica when one serves, or reports it."""


class Draining(Exception):
    """Ends a request's stream when its replica is removed (planned) before it finished."""


class EngineReplica:
    """One engine. `engine_args` are flat engine settings (`EngineArgs.of`: the
    schema's defaults for those left out);
    `routing` (optional) connects it to the deployment's KV index:
    {"index_kwargs": {...}, "stats_period_s": float, "events_period_s": float};
    `options` (optional): {"drain_timeout_s": float, "autoscaling_targets": {...}}
    (`spur.cluster.app.lane_options`).

    Drain: when Serve stops the replica (scale-down, `serve.delete` on shutdown) it
    takes no new request, lets the running ones finish for drain_timeout_s, then ends
    the rest with an error item (code "draining") and checks the pool's integrity; it
    leaves the KV index at once (its hashes dropped, not counted as a failure)."""

    def __init__(
        self,
        engine_args: dict[str, Any],
        lane: str,
        routing: dict[str, Any] | None = None,
        options: dict[str, Any] | None = None,
    ) -> None:
        from spur.actors.builder import EngineArgs, build_engine, load_tokenizer
        from spur.actors.generation_config import eos_ids

        self.lane = lane
        self.routing = routing
        self.metrics_on = bool((routing or {}).get("metrics", True))
        options = options or {}
        self.drain_timeout_s = float(options.get("drain_timeout_s", 30.0))
        self.autoscaling_targets = dict(options.get("autoscaling_targets") or {})
        self.draining_since: float | None = None
        self.drain_report: dict[str, Any] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._spare_demand = 0.0
        self._tokens = 0
        self._rate: tuple[float, int] = (time.monotonic(), 0)
        self._tokens_per_s = 0.0
        self.node = socket.gethostname()
        self.pid = os.getpid()
        self.index: Any = None
        self.replica_id = f"{lane}-{self.pid}"
        self.node_id = self.node
        if routing is not None:
            import ray
            from ray import serve

            from spur.cluster.routing.index_actor import get_index

            self.index = get_index(routing.get("index_kwargs"))
            self.node_id = ray.get_runtime_context().get_node_id()
            with contextlib.suppress(Exception):  # outside Serve (tests): keep the default
                self.replica_id = serve.get_replica_context().replica_id.unique_id
        try:
            self.args = EngineArgs.of(**engine_args)
            factory = None
            if self.args.tensor_parallel_size > 1:
                from spur.actors.worker.actor import RayExecutor

                factory = RayExecutor
            events = routing is not None
            kwargs: dict[str, Any] = {"enable_kv_events": events}
            if factory:
                kwargs["executor_factory"] = factory
            built = _in_own_thread(lambda: build_engine(self.args, **kwargs))
            self.built = built
            self.tokenizer = load_tokenizer(self.args.tokenizer_dir(built.info.model_dir))
            self.eos_ids = eos_ids(
                built.info.eos_token_id, built.more_eos_token_ids, self.tokenizer
            )
        except BaseException as exc:
            if self.index is not None:  # counted: a restart loop marks this node down
                import ray

                with contextlib.suppress(Exception):
                    ray.get(
                        self.index.start_failed.remote(
                            lane, self.node_id, f"{type(exc).__name__}: {exc}"
                        ),
                        timeout=10,
                    )
            raise
        self.engine: AsyncEngine | None = None
        self._publisher: asyncio.Task[None] | None = None
        if self.index is not None:
            self.index.register.remote(self.replica_id, lane, self.node_id)
            with contextlib.suppress(RuntimeError):  # no running loop: start on first call
                self._engine()
        logger.info("engine replica %s for lane %s ready (pid %d)", self.replica_id, lane, self.pid)

    def _engine(self) -> AsyncEngine:
        # Created inside the replica's event loop (its asyncio queues belong to
        # that loop), with the KV-event publisher when routing is on.
        if self.engine is None:
            threads = self.args.num_threads if self.args.tensor_parallel_size == 1 else None
            metrics = None
            if self.metrics_on:
                sched = self.built.scheduler
                metrics = EngineMetrics(
                    max_model_len=sched.config.max_model_len,
                    info=engine_info(sched.kv.config, sched.config, self.args),
                )
            self.engine = AsyncEngine(
                self.built.core,
                self.tokenizer,
                eos_token_id=self.eos_ids[0],
                more_eos_token_ids=self.eos_ids[1],
                vocab_size=self.built.info.vocab_size,
                stream_interval=self.args.stream_interval,
                step_timeout_s=self.args.step_timeout_s,
                on_thread_start=(lambda: _set_torch_threads(threads)) if threads else None,
                metrics=metrics,
            )
            if self.index is not None:
                self._publisher = asyncio.get_running_loop().create_task(self._publish_loop())
            self._watcher = asyncio.get_running_loop().create_task(self._watch_shutdown())
        return self.engine

    # -- drain ----------------------------------------------------------------------------
    async def _watch_shutdown(self, period_s: float = 0.1) -> None:
        """Start the drain as soon as Serve begins this replica's graceful shutdown."""
        while self.draining_since is None:
            if _serve_shutting_down():
                # Abort before Serve kills the replica, whichever grace won (the
                # chart's serveConfigV2 may set Serve's to exactly drain_timeout_s).
                grace = _serve_grace_s()
                timeout = self.drain_timeout_s
                if grace is not None:
                    timeout = max(0.0, min(timeout, grace - 2.0))
                await self.drain(timeout)
                return
            await asyncio.sleep(period_s)

    async def drain(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Stop taking requests, leave the KV index, wait up to `timeout_s` (default:
        drain_timeout_s) for the open requests, end the rest with a "draining" error,
        then check the pool. Idempotent; returns the report (also logged):
        {"finished", "aborted", "integrity", "num_free_blocks", "num_blocks"}."""
        if self.drain_report is not None:
            return self.drain_report
        engine = self._engine()
        if self.draining_since is None:
            self.draining_since = time.monotonic()
        timeout = self.drain_timeout_s if timeout_s is None else timeout_s
        if self.index is not None:
            with contextlib.suppress(Exception):
                self.index.leave.remote(self.replica_id)
        at_start = set(engine.request_ids)
        deadline = self.draining_since + timeout
        while engine.request_ids and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        # A request whose final output is queued for its consumer finished: not aborted.
        left = [
            rid
            for rid in engine.request_ids
            if engine.fail(
                rid,
                Draining(
                    f"this replica of lane {self.lane!r} was removed (shutdown or scale-down) "
                    f"and its drain_timeout_s ({timeout:g} s) passed before the request "
                    "finished: it was aborted; retry it"
                ),
            )
        ]
        report: dict[str, Any] = {
            "replica_id": self.replica_id,
            "finished": len(at_start - set(left)),
            "aborted": len(left),
        }
        # Aborts return the blocks within a step; the check runs between steps.
        check_deadline = time.monotonic() + 10.0
        while True:
            try:
                # Answered between steps: an engine stuck in one never answers.
                report.update(
                    await asyncio.wait_for(
                        engine.check_integrity(), max(0.1, check_deadline - time.monotonic())
                    ),
                    integrity="ok",
                )
            except AssertionError as exc:
                report["integrity"] = f"FAILED: {exc}"
            except EngineDeadError as exc:  # nothing to check: the engine thread is gone
                report["integrity"] = f"not checked: {exc}"
                break
            except TimeoutError:
                report["integrity"] = "not checked: the engine did not answer (stuck in a step)"
                break
            if report.get("num_requests", 1) == 0 or time.monotonic() > check_deadline:
                break
            await asyncio.sleep(0.05)
        self.drain_report = report
        logger.warning("spur drain: %s", report)
        if self.index is not None:
            # The publish loop stopped when the drain began: the requests that finished
            # since reach /metrics through this last snapshot.
            metrics = engine.metrics.snapshot() if engine.metrics is not None else None
            with contextlib.suppress(Exception):
                await self.index.record_drain.remote({**report, "lane": self.lane}, metrics)
        return report

    async def _publish_loop(self) -> None:
        """Push KV event batches every events_period_s, and a heartbeat with the
        engine's load at least every stats_period_s; send a snapshot when the
        index asks for one (a gap, or an index that restarted)."""
        assert self.routing is not None and self.engine is not None
        engine = self.engine
        events_period = float(self.routing.get("events_period_s", 0.05))
        stats_period = float(self.routing.get("stats_period_s", 1.0))
        metrics_period = min(stats_period, 1.0)
        last = last_metrics = 0.0
        warned = False
        while True:
            await asyncio.sleep(events_period)
            batches = engine.take_kv_batches()
            now = time.monotonic()
            send, with_metrics = _publish_due(
                now,
                bool(batches),
                last,
                stats_period,
                None if engine.metrics is None else last_metrics,
                metrics_period,
            )
            if not send:
                continue
            if self.draining_since is not None:
                return  # left the index: nothing more to tell it
            snapshot = None
            if with_metrics and engine.metrics is not None:
                snapshot = engine.metrics.snapshot()
            # The arrivals first: the load read after them counts each (see take_arrived).
            arrived = engine.take_arrived()
            stats = {**engine.stats(), "arrived": arrived}
            try:
                answer = await self.index.publish.remote(self.replica_id, batches, stats, snapshot)
                if self.draining_since is not None:
                    # The drain began while this publish was in flight and has left the
                    # index: a resync now would register the replica again.
                    return
                self._spare_demand = float(answer.get("spare_demand", 0.0))
                if answer.get("draining") is not None:  # the whole deployment stops
                    asyncio.get_running_loop().create_task(self.drain())
                    return
                last = now
                if snapshot is not None:
                    last_metrics = now
                for command in answer["commands"]:
                    if command == "reset_prefix_cache":
                        await engine.reset_prefix_cache()
                if answer["resync"]:
                    seq, hashes, states = await engine.snapshot()
                    self.index.register.remote(
                        self.replica_id, self.lane, self.node_id, engine.stats()
                    )
                    await self.index.resync.remote(self.replica_id, seq, hashes, states)
                warned = False
            except Exception as exc:  # the index restarts: the next publish resyncs
                # An index that stays up would never see these batches' removals (an
                # idle replica's heartbeats carry no sequence number): send them again.
                engine.return_kv_batches(batches)
                engine.return_arrived(arrived)
                if snapshot is not None and engine.metrics is not None:
                    engine.metrics.restore_window(snapshot)  # its worst ratios: next report
                if not warned:
                    logger.warning("KV index unreachable (%s); retrying", exc)
                    warned = True

    async def generate(self, payload: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Stream one request. payload: request_id, prompt_token_ids,
        sampling_params (SamplingParams fields), optional prompt, priority,
        cache_salt, resumed and resumed_chars (a failover continuation: how many of the
        prompt's last ids are output streamed by another replica, and how many
        characters of their text the client received; `AsyncEngine.generate`), lane
        (the lane the request came for: a spare serves several; its per-request
        metrics carry that lane's label; default this replica's own lane). Yields
        {"type": "delta", ...} items, then {"type": "final"} or a single
        {"type": "error", "status", "message", "param"}."""
        engine = self._engine()
        if self.draining_since is not None:
            yield {
                "type": "error",
                "status": 503,
                "code": DRAIN_CODE,
                "message": f"this replica of lane {self.lane!r} is draining; retry",
                "param": None,
                "replica_id": self.replica_id,
            }
            return
        try:
            params = SamplingParams(**payload.get("sampling_params", {}))
            lane = payload.get("lane")
            if not isinstance(lane, str) or lane in ("", self.lane):
                lane = None  # this replica's own lane
            stream = engine.generate(
                payload["request_id"],
                list(payload["prompt_token_ids"]),
                params,
                prompt=payload.get("prompt"),
                priority=int(payload.get("priority", 0)),
                cache_salt=payload.get("cache_salt"),
                resumed=int(payload.get("resumed", 0)),
                resumed_chars=payload.get("resumed_chars"),
                lane=lane,
            )
            first = True
            async for item in stream:
                if isinstance(item, Delta):
                    self._tokens += len(item.token_ids)
                    out = {"type": "delta", **_delta_dict(item)}
                    if first:  # lets the caller report a replica that dies mid-stream
                        out["replica_id"] = self.replica_id
                        first = False
                    yield out
                elif isinstance(item, RequestOutput):
                    yield {"type": "final", **_final_dict(item)}
        except SamplingParamsError as exc:
            yield {"type": "error", "status": 400, "message": str(exc), "param": exc.param}
        except RequestRejected as exc:
            yield {"type": "error", "status": 400, "message": str(exc), "param": "prompt"}
        except Draining as exc:  # planned: the caller continues elsewhere, no failure
            yield {
                "type": "error",
                "status": 503,
                "code": DRAIN_CODE,
                "message": str(exc),
                "param": None,
                "replica_id": self.replica_id,
            }
        except EngineDeadError as exc:  # the caller retries elsewhere and reports us
            yield {
                "type": "error",
                "status": 503,
                "message": str(exc),
                "param": None,
                "replica_id": self.replica_id,
            }

    async def stats(self) -> dict[str, Any]:
        engine = self._engine()
        return {
            "lane": self.lane,
            "replica_id": self.replica_id,
            "node_id": self.node_id,
            "pid": self.pid,
            "node": self.node,
            "max_model_len": self.built.scheduler.config.max_model_len,
            "model_dir": self.built.info.model_dir,
            "tokenizer_dir": self.args.tokenizer_dir(self.built.info.model_dir),
            "sampling_defaults": self.built.sampling_defaults.to_dict(),
            **engine.stats(),
        }

    async def tokenizer_files(self) -> dict[str, bytes]:
        """The files of this engine's tokenizer folder (`builder.tokenizer_files`), for
        an ingress on a node where that folder does not exist (the demo model's
        conversion cache, a GGUF's, a path mounted on the engine's pod only)."""
        from spur.actors.builder import tokenizer_files

        folder = self.args.tokenizer_dir(self.built.info.model_dir)
        return await asyncio.to_thread(tokenizer_files, folder)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Called by Serve every few seconds for the autoscaling policy
        (`spur.cluster.autoscaling`): this replica's waiting and running requests, KV
        usage, generated tokens/s, the lane's requests on its spare (from the KV index)
        and the lane's targets."""
        engine = self._engine()
        stats = engine.stats()
        now = time.monotonic()
        since, tokens = self._rate
        if now - since >= 1.0:
            self._tokens_per_s = (self._tokens - tokens) / (now - since)
            self._rate = (now, self._tokens)
        return {
            "waiting": float(stats["num_waiting"]),
            "running": float(stats["num_running"]),
            "kv_usage": float(stats["kv_usage"]),
            "tokens_per_s": float(self._tokens_per_s),
            "spare_demand": float(self._spare_demand),
            **self.autoscaling_targets,
        }

    async def reset_prefix_cache(self) -> None:
        """Forget every cached block hash (done by the engine thread, between steps)."""
        await self._engine().reset_prefix_cache()

    async def check_health(self) -> None:
        """Called by Serve; raising marks the replica unhealthy (restarted): the engine
        thread failed or has been stuck in one step past `step_timeout_s`, or a TP worker
        of its executor is gone (`RayExecutor`)."""
        if self.engine is not None and not self.engine.alive:
            raise EngineDeadError(self.engine.dead_message)
        check = getattr(self.built.executor, "check_health", None)
        if check is not None:
            check()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # already gone at interpreter exit
            self.built.shutdown()


def _publish_due(
    now: float,
    has_batches: bool,
    last_publish: float,
    stats_period: float,
    last_metrics: float | None,
    metrics_period: float,
) -> tuple[bool, bool]:
    """(send a publish now, with a metrics snapshot) for the replica's publish loop.

    A publish goes out when there are KV event batches, when the last one is
    `stats_period` old (the heartbeat), or when metrics are on (`last_metrics` not
    None: the time of the last snapshot sent) and the last snapshot is
    `metrics_period` old. With metrics off an idle replica sends only its heartbeat;
    times are `time.monotonic()` seconds."""
    metrics_due = last_metrics is not None and now - last_metrics >= metrics_period
    send = has_batches or now - last_publish >= stats_period or metrics_due
    return send, metrics_due


def _serve_shutting_down() -> bool:
    """True once Ray Serve has begun this replica's graceful shutdown (it was scaled
    down or its application deleted). Serve offers no hook for that to user code; its
    replica actor's `_replica_impl._shutting_down` flag is read (False outside Serve)."""
    try:
        import ray

        if not ray.is_initialized():  # get_runtime_context() would start a local Ray
            return False
        actor_id = ray.get_runtime_context().get_actor_id()
        actors = ray._private.worker.global_worker.actors
        actor = next((a for k, a in actors.items() if k.hex() == actor_id), None)
        impl = getattr(actor, "_replica_impl", None)
        return bool(getattr(impl, "_shutting_down", False))
    except Exception:
        return False


def _serve_grace_s() -> float | None:
    """This replica's graceful_shutdown_timeout_s as Serve runs it (None outside Serve)."""
    try:
        from ray import serve

        return float(serve.get_replica_context()._deployment_config.graceful_shutdown_timeout_s)
    except Exception:
        return None


def _set_torch_threads(n: int) -> None:
    """OpenMP's thread count is a per-thread setting: the engine thread (which
    runs the forward with TP=1) sets its own."""
    import torch

    torch.set_num_threads(n)


def _in_own_thread(fn: Any) -> Any:
    """Run `fn` in a thread that then exits, and return its result.

    Loading the model runs parallel torch ops, and OpenMP (libgomp) keeps a
    thread team per calling thread. A team left behind by the loader (Serve's
    event loop thread) next to the engine thread's own team makes libgomp see
    more OpenMP threads than CPUs, and it then stops spinning between ops: each
    op's workers sleep and wake, and the forward idles up to a fifth of the
    CPU. A thread that exits takes its team with it."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:
            out["error"] = exc

    thread = threading.Thread(target=run, name="spur-engine-build")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def _delta_dict(delta: Delta) -> dict[str, Any]:
    out = {
        "index": delta.index,
        "text": delta.text,
        "token_ids": delta.token_ids,
        "finish_reason": delta.finish_reason,
        "stop_reason": delta.stop_reason,
    }
    if delta.logprobs is not None:
        out["logprobs"] = [asdict(lp) for lp in delta.logprobs]
    return out


def _final_dict(final: RequestOutput) -> dict[str, Any]:
    return {
        "num_prompt_tokens": len(final.prompt_token_ids),
        "num_cached_tokens": final.num_cached_tokens,
        "completions": [
            {
                "index": c.index,
                "num_tokens": len(c.token_ids),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in final.outputs
        ],
    }
