"""build_app(config): the Ray Serve application.

    Ingress (1 replica, FastAPI: OpenAI API, tokenization, lane choice)
      ├── engine-<lane> deployment per lane: EngineReplica x replicas, at most one per node
      └── engine-<spare> deployment when a spare is configured

Each engine replica asks Ray for the lane's custom resources (pinning it to the
lane's nodes) and, with TP > 1, for placement-group bundles on one node: bundle
0 for the replica, one per worker (STRICT_PACK).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from spur.actors.engine.shell.actor import EngineReplica
from spur.cluster.autoscaling import POLICY_IMPORT_PATH, target_metrics
from spur.cluster.ingress import Ingress
from spur.cluster.routing.index_actor import index_kwargs_of
from spur.configs.engine_args import flat_engine_args
from spur.configs.loader import config_to_dict
from spur.configs.schema import (
    AutoscalingConfig,
    EngineConfig,
    LaneConfig,
    RouterConfig,
    SpareConfig,
    SpurConfig,
)

DRAIN_MARGIN_S = 10.0
"""Serve's graceful_shutdown_timeout_s of an engine is its drain_timeout_s plus this:
the replica aborts what is left at drain_timeout_s itself (a clear error, blocks
returned) before Serve would kill it."""


def engine_args(engine: EngineConfig) -> dict[str, Any]:
    """The flat EngineArgs (spur.actors.builder) of one engine config: every field of
    the engine's schema, by `spur.configs.engine_args.flat_engine_args` (no field can
    be left out on the way)."""
    return flat_engine_args(engine)


def deployment_name(lane: str) -> str:
    return f"engine-{lane}"


def routing_of(router: RouterConfig) -> dict[str, Any]:
    """What engine replicas and routers need to reach the KV index."""
    return {
        "index_kwargs": index_kwargs_of(router.model_dump()),
        "stats_period_s": router.stats_period_s,
        "events_period_s": 0.05,
    }


def _router_config(lane: str, router: RouterConfig) -> RequestRouterConfig | None:
    """The Serve request router of a lane: spur's prefix router, the round-robin
    baseline, or None for Serve's default (power of two choices)."""
    if router.policy == "power_of_two":
        return None
    from spur.cluster.routing.router import PrefixRouter, RoundRobinRouter

    cls = PrefixRouter if router.policy == "prefix" else RoundRobinRouter
    return RequestRouterConfig(
        request_router_class=cls,
        request_router_kwargs={
            "lane": lane,
            "weights": {
                "load_weight": router.load_weight,
                "kv_usage_weight": router.kv_usage_weight,
                "hot_spot_margin": router.hot_spot_margin,
            },
            "index_kwargs": index_kwargs_of(router.model_dump()),
        },
        request_routing_stats_period_s=router.stats_period_s,
    )


STATS_PUSH_S = 1.0
"""How often engine replicas push their autoscaling stats to Serve's controller
(Serve's `metrics_interval_s`, default 10 s; half the look-back when that is
shorter). Ray 2.60 reads only this field: the RAY_SERVE_*_METRIC_PUSH_INTERVAL_S
variables its deprecation note names are not read yet."""


def serve_autoscaling_config(auto: AutoscalingConfig) -> dict[str, Any]:
    """Serve's autoscaling_config of a lane (spur's policy, Serve's delays and bounds,
    stats pushed every `STATS_PUSH_S`)."""
    out: dict[str, Any] = {
        "min_replicas": auto.min_replicas,
        "initial_replicas": auto.min_replicas,
        "max_replicas": auto.max_replicas,
        "upscale_delay_s": auto.upscale_delay_s,
        "downscale_delay_s": auto.downscale_delay_s,
        "look_back_period_s": auto.look_back_period_s,
        "metrics_interval_s": min(STATS_PUSH_S, auto.look_back_period_s / 2),
        "policy": {"policy_function": POLICY_IMPORT_PATH},
    }
    return out


def lane_options(lane: LaneConfig | SpareConfig) -> dict[str, Any]:
    """What an engine replica needs of its lane besides the engine: its drain grace
    and the autoscaling targets it reports to the policy."""
    auto = getattr(lane, "autoscaling", None)
    return {
        "drain_timeout_s": lane.drain_timeout_s,
        "autoscaling_targets": target_metrics(auto.model_dump() if auto else None),
    }


def _engine_deployment(lane: LaneConfig | SpareConfig, router: RouterConfig) -> Any:
    engine = lane.engine
    tp = engine.parallelism.tensor_parallel_size
    gpus = engine.parallelism.num_gpus_per_worker
    options: dict[str, Any] = {
        "name": deployment_name(lane.name),
        "max_ongoing_requests": lane.max_ongoing_requests,
        "max_queued_requests": lane.max_queued_requests,
        "health_check_period_s": 5.0,
        "graceful_shutdown_timeout_s": lane.drain_timeout_s + DRAIN_MARGIN_S,
        "graceful_shutdown_wait_loop_s": 0.5,
    }
    auto = getattr(lane, "autoscaling", None)
    if auto is not None:
        options["autoscaling_config"] = serve_autoscaling_config(auto)
    else:
        options["num_replicas"] = getattr(lane, "replicas", 1)
    request_router = _router_config(lane.name, router)
    if request_router is not None:
        options["request_router_config"] = request_router
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


def refuse_test_settings(lanes: list[LaneConfig | SpareConfig]) -> None:
    """Raise ValueError when a lane uses a TESTS ONLY field outside tests."""
    from spur.configs.env import test_settings_allowed

    leaky = [lane.name for lane in lanes if lane.engine.runtime.test_leak_blocks_per_step]
    if leaky and not test_settings_allowed():
        raise ValueError(
            f"lanes {leaky} set engine.runtime.test_leak_blocks_per_step, a deliberately "
            "broken engine for tests only: remove it (tests set SPUR_ALLOW_TEST_SETTINGS=1)"
        )


def refuse_speculation_on_state_models(lanes: list[LaneConfig | SpareConfig]) -> None:
    """Raise ValueError for a lane that sets engine.speculative on a model with
    recurrent-state layers, where this host can tell without loading it: a random demo
    model of a hybrid preset, or a model folder here whose config.json says so. The
    engine refuses it too (`Scheduler`), but only once Ray runs, three times over as
    Serve retries the replica, ending in a deployment traceback."""
    from spur.actors.engine.core.capacity import load_geometry
    from spur.actors.worker.loader import RANDOM_MODELS

    for lane in lanes:
        if lane.engine.speculative is None:
            continue
        path = lane.engine.model.path
        if str(path).lower() in RANDOM_MODELS:
            hybrid = True  # every random demo model is a hybrid preset
        elif (Path(path) / "config.json").is_file():
            try:
                geometry = load_geometry(path)
            except (OSError, ValueError):
                continue  # the engine says what is wrong with the folder
            hybrid = any(k.spec.kind == "state" for k in geometry.kinds)
        else:
            continue  # a model this host cannot see (another node's storage)
        if hybrid:
            raise ValueError(
                f"lane {lane.name!r}: speculative decoding is not supported for models with "
                f"recurrent-state layers ({path} is a hybrid model): their states cannot be "
                "rolled back past rejected drafts yet; unset engine.speculative for it"
            )


def refuse_bad_generation_overrides(lanes: list[LaneConfig | SpareConfig]) -> None:
    """Raise ValueError for a lane whose engine.model.override_generation_config holds
    a value out of its request field's range (temperature -1), which each engine
    replica would refuse only once Ray runs."""
    from spur.actors import generation_config as gen_config

    for lane in lanes:
        overrides = lane.engine.model.override_generation_config
        if overrides:
            defaults = gen_config.sampling_defaults({}, "vllm", overrides)
            source = f"lane {lane.name!r}: engine.model.override_generation_config"
            gen_config.check_defaults(defaults, source, from_file=False)


def refuse_bad_backend_override(lanes: list[LaneConfig | SpareConfig]) -> str | None:
    """Check SPUR_ATTENTION_BACKEND (which overrides every lane's runtime.attn_backend
    in the workers) against the lanes: raise ValueError for an unknown name, or for
    triton where a lane does not run on CUDA (unless TRITON_INTERPRET=1), which every
    replica would refuse only once Ray runs. Returns the override (None: unset)."""
    from spur.configs import env

    override = env.attention_backend_override()
    if override is None:
        return None
    choice = override.strip().lower()
    if choice not in ("auto", "torch", "triton"):
        raise ValueError(
            f"SPUR_ATTENTION_BACKEND {override!r} is unknown: use one of auto, torch, triton, "
            "or unset it"
        )
    if choice == "triton" and not env.triton_interpret():
        off_cuda = [lane.name for lane in lanes if lane.engine.parallelism.device != "cuda"]
        if off_cuda:
            raise ValueError(
                f"SPUR_ATTENTION_BACKEND is 'triton' but lanes {off_cuda} do not run on CUDA "
                "(parallelism.device): unset it or set it to torch"
            )
    return choice


def build_app(config: SpurConfig) -> Application:
    """The Serve application for `config` (not yet running: `serve.run` it)."""
    engines = {}
    routing = {**routing_of(config.router), "metrics": config.server.metrics}
    lanes: list[LaneConfig | SpareConfig] = list(config.lanes)
    if config.spare is not None:
        lanes.append(config.spare)
    refuse_test_settings(lanes)
    refuse_bad_generation_overrides(lanes)
    for lane in lanes:
        engines[lane.name] = _engine_deployment(lane, config.router).bind(
            engine_args(lane.engine), lane.name, routing, lane_options(lane)
        )
    ingress = serve.deployment(Ingress).options(
        name="ingress",
        num_replicas=config.server.ingress_replicas,
        max_ongoing_requests=4096,
        # Its streams end when the engines' drains do (the longest lane's grace).
        graceful_shutdown_timeout_s=max(lane.drain_timeout_s for lane in lanes)
        + 2 * DRAIN_MARGIN_S,
        graceful_shutdown_wait_loop_s=0.5,
        # Tokenization and streaming only: no CPU reservation, so that the
        # engines can take every core of a small machine.
        ray_actor_options={"num_cpus": 0, "resources": dict(config.server.ingress_resources)},
    )
    return ingress.bind(engines, config_to_dict(config))
