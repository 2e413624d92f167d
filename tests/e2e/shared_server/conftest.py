"""The shared server of these modules, started once for them and stopped when the
last of them is done (package scope: while they run, no other test server runs).

    spur_server      `python -m spur.cluster.cli serve CONFIG` (`e2e.conftest.running`):
                     lanes
                       tiny      the tiny model, TP=1
                       tiny-tp2  the tiny model, TP=2 (Ray worker actors)
                       busy      the tiny model, max_ongoing 1 / max_queued 1
                       smol      SmolLM2-135M-Instruct (the demo model)
                       hybrid    configs/hybrid-tiny.yaml's random Qwen3.5
    openai_client    the official `openai` client on http://127.0.0.1:PORT/v1
    http             an httpx client on http://127.0.0.1:PORT (raw checks)
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.conftest import Launched, _tiny_engine, free_port, running


def server_config(model_dir: Path, port: int) -> dict[str, Any]:
    """The e2e config: three lanes of the tiny model (tiny-tp2 with sampling defaults
    of its own), one of SmolLM2 and one of the hybrid model."""
    return {
        "version": 1,
        "lanes": [
            {
                "name": "tiny",
                "served_model_names": ["tiny"],
                "engine": _tiny_engine(model_dir),
                "max_ongoing_requests": 32,
                "max_queued_requests": 64,
            },
            {
                "name": "tiny-tp2",
                "served_model_names": ["tiny-tp2"],
                # Sampling defaults of its own (test_served_models.py); the cap is above
                # the 16 tokens that test_tp2_equals_tp1 asks for.
                "engine": _with_overrides(
                    _tiny_engine(model_dir, tp=2), {"temperature": 0, "max_new_tokens": 20}
                ),
                "max_ongoing_requests": 32,
                "max_queued_requests": 64,
            },
            {
                "name": "busy",
                "served_model_names": ["busy"],
                "engine": _tiny_engine(model_dir),
                "max_ongoing_requests": 1,
                "max_queued_requests": 1,
            },
            {
                "name": "smol",
                "served_model_names": ["smol"],
                "engine": {
                    "model": {"path": "SmolLM2-135M-Instruct", "dtype": "float32"},
                    "cache": {"block_size": 16, "kv_cache_bytes": "256MiB"},
                    "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 1024},
                    "parallelism": {"device": "cpu"},
                    "runtime": {"num_threads": 1},
                },
                "max_ongoing_requests": 16,
                "max_queued_requests": 32,
            },
            hybrid_lane(),
        ],
        "server": {
            "host": "127.0.0.1",
            "port": port,
            "num_cpus": 8,
            "object_store_memory": "200MiB",
        },
    }


def _with_overrides(engine: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`engine` with model.override_generation_config set to `overrides`."""
    return {**engine, "model": {**engine["model"], "override_generation_config": overrides}}


def hybrid_lane() -> dict[str, Any]:
    """The lane of configs/hybrid-tiny.yaml (a random Qwen3.5 built on first use),
    named "hybrid", with a smaller pool and one thread."""
    preset = Path(__file__).resolve().parents[3] / "configs" / "hybrid-tiny.yaml"
    lane = yaml.safe_load(preset.read_text())["lanes"][0]
    lane["name"] = "hybrid"
    lane["engine"]["cache"]["kv_cache_bytes"] = "16MiB"
    lane["engine"]["runtime"]["num_threads"] = 1
    return lane


def undeployable_lanes(data: dict[str, Any]) -> dict[str, str]:
    """Lanes whose Serve deployment `build_app` refuses to build (no Ray needed),
    mapped to the error. Such a lane would stop the whole app from starting, so
    the server runs without it and its tests fail with this reason."""
    with warnings.catch_warnings():  # Ray Serve's own pydantic deprecations
        warnings.simplefilter("ignore", DeprecationWarning)
        from spur.cluster.app import build_app
    from spur.configs.loader import parse_config

    try:
        build_app(parse_config(data))
        return {}
    except Exception:  # find which lanes
        pass
    bad = {}
    for lane in data["lanes"]:
        try:
            build_app(parse_config({**data, "lanes": [lane]}))
        except Exception as exc:
            bad[lane["name"]] = f"{type(exc).__name__}: {exc}"
    if len(bad) == len(data["lanes"]):  # not about one lane: nothing could run
        raise RuntimeError(f"build_app fails for every lane: {bad}")
    return bad


class SpurServer(Launched):
    """The package's server (`spur_server`): a `Launched` with the tiny model's folder
    and the lanes that could not be deployed."""

    model_dir: Path
    missing_lanes: dict[str, str]
    """Lanes left out of the config because the app could not be built with them."""

    def require_lane(self, name: str) -> None:
        """Fail (not skip) the calling test when lane `name` is not deployed."""
        if name in self.missing_lanes:
            pytest.fail(f"lane {name!r} could not be deployed: {self.missing_lanes[name]}")


@pytest.fixture(scope="package")
def spur_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SpurServer]:
    data = server_config(tiny_model_dir, free_port())
    missing = undeployable_lanes(data)
    data["lanes"] = [lane for lane in data["lanes"] if lane["name"] not in missing]
    with running(data, tmp_path_factory.mktemp("e2e-server")) as srv:
        server = SpurServer(**vars(srv))
        server.model_dir, server.missing_lanes = tiny_model_dir, missing
        yield server


@pytest.fixture(scope="package")
def openai_client(spur_server: SpurServer) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=spur_server.base_url, api_key="x", max_retries=0, timeout=120.0)


@pytest.fixture(scope="package")
def http(spur_server: SpurServer) -> Iterator[Any]:
    import httpx

    with httpx.Client(base_url=spur_server.url, timeout=120.0) as client:
        yield client
