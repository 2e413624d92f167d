"""The Ray Serve shell of an engine: one replica per node, owning the engine core,
the KV pool and an executor (TP=1: the model runs in the replica; TP>1: one Ray
worker actor per device in a STRICT_PACK placement group on this node).

The replica is a plain class; `cluster/app.py` wraps it with `serve.deployment`
and its options (replicas, resources, back-pressure). Its streaming method
yields JSON-safe dicts, so the ingress never needs the engine's classes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

from spur.actors.engine.async_engine import AsyncEngine, EngineDeadError
from spur.actors.engine.output_processor import Delta
from spur.actors.engine.outputs import RequestOutput
from spur.actors.engine.sampling_params import SamplingParams, SamplingParamsError
from spur.actors.engine.scheduler import RequestRejected

logger = logging.getLogger(__name__)


class EngineReplica:
    """One engine. `engine_args` are `spur.actors.builder.EngineArgs` fields."""

    def __init__(self, engine_args: dict[str, Any], lane: str) -> None:
        from spur.actors.builder import EngineArgs, build_engine, load_tokenizer

        self.lane = lane
        self.args = EngineArgs(**engine_args)
        factory = None
        if self.args.tensor_parallel_size > 1:
            from spur.actors.worker.actor import RayExecutor

            factory = RayExecutor
        built = (
            build_engine(self.args, executor_factory=factory)
            if factory
            else build_engine(self.args)
        )
        self.built = built
        self.tokenizer = load_tokenizer(built.info.model_dir)
        self.engine: AsyncEngine | None = None
        self.node = socket.gethostname()
        self.pid = os.getpid()
        logger.info("engine replica for lane %s ready (pid %d)", lane, self.pid)

    def _engine(self) -> AsyncEngine:
        # Created lazily inside the replica's event loop (its asyncio queues
        # belong to that loop).
        if self.engine is None:
            self.engine = AsyncEngine(
                self.built.core,
                self.tokenizer,
                eos_token_id=self.built.info.eos_token_id,
                vocab_size=self.built.info.vocab_size,
            )
        return self.engine

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
            async for item in stream:
                if isinstance(item, Delta):
                    yield {"type": "delta", **_delta_dict(item)}
                elif isinstance(item, RequestOutput):
                    yield {"type": "final", **_final_dict(item)}
        except SamplingParamsError as exc:
            yield {"type": "error", "status": 400, "message": str(exc), "param": exc.param}
        except RequestRejected as exc:
            yield {"type": "error", "status": 400, "message": str(exc), "param": "prompt"}
        except EngineDeadError as exc:
            yield {"type": "error", "status": 503, "message": str(exc), "param": None}

    async def stats(self) -> dict[str, Any]:
        engine = self._engine()
        return {
            "lane": self.lane,
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
