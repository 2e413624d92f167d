"""One live `spur serve` and one real Prometheus scraping it every second, shared
by the module that needs them (module-scoped: CI pays one start-up).

    obs_server   lanes  chat    the tiny model, one primary with a small pool (96
                                blocks: preemption storms), spare "spare"
                        leaky   the tiny model with the tests-only broken retirement
                                (engine.runtime.test_leak_blocks_per_step), 48 blocks,
                                2 requests at a time (the rest wait), no spare
                 spare  spare   the tiny model, serves chat
    prom         Prometheus (Debian's `prometheus`; .ci/run installs it) scraping
                 /metrics every 0.25 s, with spur's alert rules loaded

The server helpers (tiny model, environment, start, clean stop) are the e2e
suite's own.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from e2e.conftest import (
    START_TIMEOUT_S,
    build_tiny_model,
    free_port,
    server_env,
    stop_server,
    wait_ready,
)

from spur.cluster.dashboards import export

PROMETHEUS = "prometheus"


def _engine(model_dir: Path, **extra: Any) -> dict[str, Any]:
    blocks = extra.pop("num_kv_blocks", 512)
    seqs = extra.pop("max_num_seqs", 16)
    engine = {
        "model": {"path": str(model_dir), "dtype": "float32", "max_model_len": 512},
        "cache": {"block_size": 16, "num_kv_blocks": blocks},
        "scheduler": {"max_num_seqs": seqs, "max_num_batched_tokens": 512},
        "parallelism": {"device": "cpu"},
        "runtime": {"num_threads": 1, **extra},
    }
    return engine


def obs_config(model_dir: Path, port: int, *, metrics: bool = True) -> dict[str, Any]:
    return {
        "version": 1,
        "lanes": [
            {
                "name": "chat",
                "served_model_names": ["chat"],
                "engine": _engine(model_dir, num_kv_blocks=96),
            },
            {
                "name": "leaky",
                "served_model_names": ["leaky"],
                "engine": _engine(
                    model_dir, num_kv_blocks=48, max_num_seqs=2, test_leak_blocks_per_step=1
                ),
            },
        ],
        "spare": {"name": "spare", "serves_lanes": ["chat"], "engine": _engine(model_dir)},
        "router": {"stats_period_s": 0.25, "failover_healthy_after_s": 1.0, "max_attempts": 1},
        "server": {
            "host": "127.0.0.1",
            "port": port,
            "num_cpus": 8,
            "object_store_memory": "200MiB",
            "metrics": metrics,
        },
    }


@dataclass
class Server:
    url: str
    config: dict[str, Any]
    log_path: Path
    pid: int
    ray_tmpdir: Path

    def ray_call(self, code: str, timeout_s: float = 120.0) -> str:
        """Run `code` in a Python process connected to the server's Ray cluster as
        a driver (namespace "spur"); returns its stdout."""
        port_file = next((self.ray_tmpdir / "ray" / "session_latest").glob("gcs_server_port_*"))
        prelude = (
            "import ray\n"
            "from ray.util import get_node_ip_address\n"
            f"ray.init(address=f'{{get_node_ip_address()}}:{port_file.read_text().strip()}', "
            "namespace='spur', logging_level='ERROR')\n"
        )
        env = {**server_env(self.ray_tmpdir)}
        res = subprocess.run(
            [sys.executable, "-c", prelude + code],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
        )
        assert res.returncode == 0, res.stdout + res.stderr[-3000:]
        return res.stdout

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=60) as resp:
            body = resp.read()
        return json.loads(body) if path != "/metrics" else body.decode()


@contextlib.contextmanager
def running_server(work: Path, config: dict[str, Any]) -> Iterator[Server]:
    """`spur serve` of `config` in its own session; stopped (and checked clean) on exit."""
    path = work / "spur-obs.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    log_path = work / "serve.log"
    ray_tmpdir = Path(tempfile.mkdtemp(prefix="spur-obs-", dir="/tmp"))
    env = {**server_env(ray_tmpdir), "SPUR_ALLOW_TEST_SETTINGS": "1"}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "spur.cluster.cli", "serve", str(path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=work,
            start_new_session=True,
        )
    try:
        url = wait_ready(proc, log_path, START_TIMEOUT_S)
        yield Server(url, config, log_path, proc.pid, ray_tmpdir)
    finally:
        problems = stop_server(proc, ray_tmpdir)
        shutil.rmtree(ray_tmpdir, ignore_errors=True)
        assert not problems, "\n".join(problems)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("obs-model") / "tiny")


@pytest.fixture(scope="module")
def obs_server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    work = tmp_path_factory.mktemp("obs-server")
    with running_server(work, obs_config(tiny_model, free_port())) as server:
        yield server


class Prometheus:
    """A real Prometheus scraping one target every second (HTTP API client)."""

    def __init__(self, url: str, log_path: Path) -> None:
        self.url = url
        self.log_path = log_path

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=30) as resp:
            return json.loads(resp.read())

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query; raises AssertionError (with Prometheus's message) on an error."""
        try:
            out = self.api("query", query=expr)
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{expr}: {exc.read().decode()[:500]}") from None
        assert out["status"] == "success", out
        return list(out["data"]["result"])

    def held_between(self, expr: str, start: float, end: float) -> bool:
        """True when `expr` returned a series at some evaluation between the unix
        times `start` and `end` (a range query, a step per scrape: 0.25 s)."""
        try:
            out = self.api(
                "query_range", query=expr, start=f"{start:.3f}", end=f"{end:.3f}", step="0.25"
            )
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{expr}: {exc.read().decode()[:500]}") from None
        assert out["status"] == "success", out
        return bool(out["data"]["result"])

    def value(self, expr: str) -> float | None:
        result = self.query(expr)
        return float(result[0]["value"][1]) if result else None

    def wait(
        self, what: str, check: Callable[[], Any], timeout_s: float = 60.0, every_s: float = 0.5
    ) -> Any:
        """Poll `check` until it returns something truthy; fail naming `what`."""
        deadline = time.monotonic() + timeout_s
        last: Any = None
        while time.monotonic() < deadline:
            last = check()
            if last:
                return last
            time.sleep(every_s)
        raise AssertionError(f"{what}: not true after {timeout_s:.0f} s (last: {last!r})")


def prometheus_binary() -> str:
    path = shutil.which(PROMETHEUS)
    if path is None:
        pytest.fail(
            "no `prometheus` binary: install Debian's package (apt-get install -y prometheus; "
            ".ci/run does it when missing)"
        )
    return path


@pytest.fixture(scope="module")
def prom(obs_server: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    binary = prometheus_binary()
    work = tmp_path_factory.mktemp("prometheus")
    export(work / "rules")
    target = urllib.parse.urlparse(obs_server.url).netloc
    config = {
        # 0.25 s, as the engines' reports (router.stats_period_s above): the leak test's
        # pool-full moments last a few steps of the tiny model
        "global": {"scrape_interval": "250ms", "evaluation_interval": "1s"},
        "rule_files": [str(work / "rules" / "alerts.yaml")],
        "scrape_configs": [
            {
                "job_name": "spur",
                "metrics_path": "/metrics",
                "static_configs": [{"targets": [target]}],
            }
        ],
    }
    (work / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    log_path = work / "prometheus.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [
                binary,
                f"--config.file={work / 'prometheus.yml'}",
                f"--storage.tsdb.path={work / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    prom = Prometheus(f"http://127.0.0.1:{port}", log_path)
    try:
        prom.wait(
            "Prometheus scrapes spur",
            lambda: _up(prom),
            timeout_s=60,
        )
        yield prom
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _up(prom: Prometheus) -> bool:
    try:
        return prom.value('up{job="spur"}') == 1.0
    except (OSError, AssertionError):
        return False
