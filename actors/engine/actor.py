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

from spur.actors.engine.async_engine import AsyncEngine, EngineDeadError
from spur.actors.engine.metrics import EngineMetrics, break_retirement, engine_info
from spur.actors.engine.output_processor import Delta
from spur.actors.engine.outputs import RequestOutput
from spur.actors.engine.sampling_params import SamplingParams, SamplingParamsError
from spur.actors.engine.scheduler import RequestRejected

logger = logging.getLogger(__name__)


class EngineReplica:
    """One engine. `engine_args` are `spur.actors.builder.EngineArgs` fields;
    `routing` (optional) connects it to the deployment's KV index:
    {"index_kwargs": {...}, "stats_period_s": float, "events_period_s": float}."""

    def __init__(
        self, engine_args: dict[str, Any], lane: str, routing: dict[str, Any] | None = None
    ) -> None:
        from spur.actors.builder import EngineArgs, build_engine, load_tokenizer

        self.lane = lane
        self.routing = routing
        engine_args = dict(engine_args)
        # Tests only (engine.runtime.test_leak_blocks_per_step; build_app refuses it
        # outside tests): a deliberately broken retirement, for the leak metrics.
        test_leak = int(engine_args.pop("test_leak_blocks_per_step", 0) or 0)
        self.metrics_on = bool((routing or {}).get("metrics", True))
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
            self.args = EngineArgs(**engine_args)
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
            if test_leak:
                break_retirement(built.scheduler.kv, test_leak)
            self.tokenizer = load_tokenizer(built.info.model_dir)
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
                eos_token_id=self.built.info.eos_token_id,
                vocab_size=self.built.info.vocab_size,
                on_thread_start=(lambda: _set_torch_threads(threads)) if threads else None,
                metrics=metrics,
            )
            if self.index is not None:
                self._publisher = asyncio.get_running_loop().create_task(self._publish_loop())
        return self.engine

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
            if not batches and now - last < stats_period and now - last_metrics < metrics_period:
                continue
            snapshot = None
            if engine.metrics is not None and now - last_metrics >= metrics_period:
                snapshot = engine.metrics.snapshot()
            try:
                answer = await self.index.publish.remote(
                    self.replica_id, batches, engine.stats(), snapshot
                )
                last = now
                if snapshot is not None:
                    last_metrics = now
                for command in answer["commands"]:
                    if command == "reset_prefix_cache":
                        await engine.reset_prefix_cache()
                if answer["resync"]:
                    seq, hashes = await engine.snapshot()
                    self.index.register.remote(
                        self.replica_id, self.lane, self.node_id, engine.stats()
                    )
                    await self.index.resync.remote(self.replica_id, seq, hashes)
                warned = False
            except Exception as exc:  # the index restarts: the next publish resyncs
                if not warned:
                    logger.warning("KV index unreachable (%s); retrying", exc)
                    warned = True

    async def generate(self, payload: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Stream one request. payload: request_id, prompt_token_ids,
        sampling_params (SamplingParams fields), optional prompt, priority,
        cache_salt. Yields {"type": "delta", ...} items, then {"type": "final"}
        or a single {"type": "error", "status", "message", "param"}."""
        engine = self._engine()
        try:
            params = SamplingParams(**payload.get("sampling_params", {}))
            stream = engine.generate(
                payload["request_id"],
                list(payload["prompt_token_ids"]),
                params,
                prompt=payload.get("prompt"),
                priority=int(payload.get("priority", 0)),
                cache_salt=payload.get("cache_salt"),
            )
            first = True
            async for item in stream:
                if isinstance(item, Delta):
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
            **engine.stats(),
        }

    async def reset_prefix_cache(self) -> None:
        """Forget every cached block hash (done by the engine thread, between steps)."""
        await self._engine().reset_prefix_cache()

    async def check_health(self) -> None:
        """Called by Serve; raising marks the replica unhealthy (restarted)."""
        if self.engine is not None and not self.engine.alive:
            raise EngineDeadError(self.engine.dead_message)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # already gone at interpreter exit
            self.built.shutdown()


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
