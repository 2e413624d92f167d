"""build_app(config): the Ray Serve application.

    Ingress (1 replica, FastAPI: OpenAI API, tokenization, lane choice)
      ├── engine-<lane> deployment per lane: EngineReplica x replicas, at most one per node
      └── engine-<spare> deployment when a spare is configured

Each engine replica asks Ray for the lane's custom resources (pinning it to the
lane's nodes) and, with TP > 1, for placement-group bundles on one node: bundle
0 for the replica, one per worker (STRICT_PACK).
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application

from spur.actors.engine.actor import EngineReplica
from spur.cluster.ingress import Ingress
from spur.configs.loader import config_to_dict
from spur.configs.schema import EngineConfig, LaneConfig, SpareConfig, SpurConfig


def engine_args(engine: EngineConfig) -> dict[str, Any]:
    """The flat EngineArgs (spur.actors.builder) of one engine config."""
    device = engine.parallelism.device
    return {
        "model": engine.model.path,
        "dtype": engine.model.dtype,
        "device": "cpu" if device == "auto" else device,
        "tensor_parallel_size": engine.parallelism.tensor_parallel_size,
        "block_size": engine.cache.block_size,
        "num_kv_blocks": engine.cache.num_kv_blocks,
        "kv_cache_bytes": engine.cache.kv_cache_bytes,
        "kv_cache_dtype": engine.cache.kv_cache_dtype,
        "gpu_memory_utilization": engine.cache.gpu_memory_utilization,
        "max_model_len": engine.model.max_model_len,
        "max_num_batched_tokens": engine.scheduler.max_num_batched_tokens,
        "max_num_seqs": engine.scheduler.max_num_seqs,
        "long_prefill_token_threshold": engine.scheduler.long_prefill_token_threshold,
        "enable_prefix_caching": engine.cache.enable_prefix_caching,
        "hash_seed": engine.cache.hash_seed,
        "policy": engine.scheduler.policy,
        "attn_backend": engine.runtime.attn_backend,
        "seed": engine.runtime.seed,
        "num_threads": engine.runtime.num_threads,
    }


def deployment_name(lane: str) -> str:
    return f"engine-{lane}"


def _engine_deployment(lane: LaneConfig | SpareConfig) -> Any:
    engine = lane.engine
    tp = engine.parallelism.tensor_parallel_size
    gpus = engine.parallelism.num_gpus_per_worker
    options: dict[str, Any] = {
        "name": deployment_name(lane.name),
        "num_replicas": getattr(lane, "replicas", 1),
        "max_ongoing_requests": lane.max_ongoing_requests,
        "max_queued_requests": lane.max_queued_requests,
        "health_check_period_s": 5.0,
        "graceful_shutdown_timeout_s": 20.0,
    }
    actor: dict[str, Any] = {"resources": dict(lane.resources)}
    if tp == 1:
        # At most one engine per node. (Serve refuses this option together with
        # placement-group bundles; a TP>1 replica's STRICT_PACK group of devices
        # already fills its node's GPUs.)
        options["max_replicas_per_node"] = 1
        # The replica runs the model: reserve as many CPUs as it runs threads
        # (Ray also sets OMP_NUM_THREADS to this reservation).
        actor.update(num_cpus=engine.runtime.num_threads or 1, num_gpus=gpus)
    else:
        worker = {"CPU": 1.0, "GPU": float(gpus)} if gpus else {"CPU": 0.5}
        options["placement_group_bundles"] = [{"CPU": 0.5, **dict(lane.resources)}] + [
            dict(worker) for _ in range(tp)
        ]
        options["placement_group_strategy"] = "STRICT_PACK"
        actor.update(num_cpus=0.5, resources={})
    options["ray_actor_options"] = actor
    return serve.deployment(EngineReplica).options(**options)


def build_app(config: SpurConfig) -> Application:
    """The Serve application for `config` (not yet running: `serve.run` it)."""
    engines = {}
    for lane in config.lanes:
        engines[lane.name] = _engine_deployment(lane).bind(engine_args(lane.engine), lane.name)
    if config.spare is not None:
        spare = config.spare
        engines[spare.name] = _engine_deployment(spare).bind(engine_args(spare.engine), spare.name)
    ingress = serve.deployment(Ingress).options(
        name="ingress",
        num_replicas=1,
        max_ongoing_requests=4096,
        # Tokenization and streaming only: no CPU reservation, so that the
        # engines can take every core of a small machine.
        ray_actor_options={"num_cpus": 0},
    )
    return ingress.bind(engines, config_to_dict(config))
