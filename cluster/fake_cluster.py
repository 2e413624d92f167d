"""A local Ray cluster whose worker nodes the autoscaler really launches and terminates:
Ray's fake multi-node provider on one host (what `ray.cluster_utils.AutoscalingCluster`
uses), started without `ray stop --force`.

    head (ray start --head --block, own session and RAY_TMPDIR, free GCS port)
      └── monitor (autoscaler v1, provider "fake_multinode")
            └── fake worker nodes: raylets of the node types below, launched when
                Serve's replicas ask for their resources, terminated after
                idle_timeout_s without work

`AutoscalingCluster.start()` / `shutdown()` run `ray stop --force`, which kills every
Ray process on the host (other test clusters included). This class starts the head in
a session of its own and stops exactly that session's processes. Used by the
autoscaling e2e test and `spur bench autoscale`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from spur.actors.ports import free_port

logger = logging.getLogger(__name__)

HEAD_TYPE = "ray.head.default"


@dataclass
class NodeType:
    """A worker node type: its Ray resources (CPU, custom ones) and node count bounds."""

    resources: dict[str, float]
    min_workers: int = 0
    max_workers: int = 2
    object_store_memory: int = 100 * 1024**2


@dataclass
class FakeCluster:
    """See the module docstring. `start()` returns the GCS address to join."""

    worker_types: dict[str, NodeType]
    head_cpus: int = 2
    head_resources: dict[str, float] = field(default_factory=dict)
    idle_timeout_s: float = 6.0
    object_store_memory: int = 100 * 1024**2
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment of every Ray process of the cluster (workers included)."""
    proc: subprocess.Popen[bytes] | None = None
    address: str = ""
    tmpdir: Path | None = None
    log_path: Path | None = None

    def config(self, gcs_address: str) -> dict[str, Any]:
        """The autoscaler's cluster config for the fake provider."""
        types: dict[str, Any] = {
            HEAD_TYPE: {"resources": {}, "node_config": {}, "max_workers": 0},
        }
        for name, t in self.worker_types.items():
            types[name] = {
                "resources": {**t.resources, "object_store_memory": t.object_store_memory},
                "node_config": {},
                "min_workers": t.min_workers,
                "max_workers": t.max_workers,
            }
        return {
            "cluster_name": "spur-fake",
            "max_workers": sum(t.max_workers for t in self.worker_types.values()),
            "upscaling_speed": 1.0,
            "idle_timeout_minutes": self.idle_timeout_s / 60.0,
            "provider": {
                "type": "fake_multinode",
                "use_node_id_as_ip": True,
                "disable_node_updaters": True,
                "disable_launch_config_check": True,
                "gcs_address": gcs_address,
            },
            "auth": {"ssh_user": "ubuntu"},
            "available_node_types": types,
            "head_node_type": HEAD_TYPE,
            "file_mounts": {},
            "cluster_synced_files": [],
            "file_mounts_sync_continuously": False,
            "rsync_exclude": [],
            "rsync_filter": [],
            "initialization_commands": [],
            "setup_commands": [],
            "head_setup_commands": [],
            "worker_setup_commands": [],
            "head_start_ray_commands": [],
            "worker_start_ray_commands": [],
        }

    def process_env(self) -> dict[str, str]:
        assert self.tmpdir is not None, "start() first"
        env = ray_test_env(self.tmpdir)
        env.update(
            RAY_FAKE_CLUSTER="1",
            AUTOSCALER_UPDATE_INTERVAL_S="1",
            **self.env,
        )
        return env

    def start(self, timeout_s: float = 120.0) -> str:
        """Start the head and its autoscaler; returns the address ("IP:PORT").

        Raises:
            RuntimeError: the head did not come up within `timeout_s` (its log's tail).
        """
        import ray

        ip = ray._private.services.get_node_ip_address()
        port = free_port("")
        self.address = f"{ip}:{port}"
        # Short: Ray's socket paths under it must stay below 108 characters.
        self.tmpdir = Path(tempfile.mkdtemp(prefix="spur-fc-", dir="/tmp"))
        config_path = self.tmpdir / "autoscaler.json"
        config_path.write_text(json.dumps(self.config(self.address)))
        self.log_path = self.tmpdir / "head.log"
        cmd = [
            sys.executable,
            "-m",
            "ray.scripts.scripts",
            "start",
            "--head",
            "--block",
            f"--port={port}",
            f"--node-ip-address={ip}",
            f"--autoscaling-config={config_path}",
            f"--num-cpus={self.head_cpus}",
            f"--object-store-memory={self.object_store_memory}",
            "--include-dashboard=false",
            f"--temp-dir={self.tmpdir}",
            "--disable-usage-stats",
        ]
        if self.head_resources:
            cmd.append(f"--resources={json.dumps(self.head_resources)}")
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.process_env(),
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited {self.proc.returncode}:\n{self.log()}")
            if "Ray runtime started" in self.log():
                return self.address
            time.sleep(0.5)
        raise RuntimeError(f"the Ray head did not start in {timeout_s:.0f} s:\n{self.log()}")

    def log(self, num_chars: int = 6000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def shutdown(self, timeout_s: float = 30.0) -> list[str]:
        """Stop the head (SIGTERM: `ray start --block` stops what it started), then
        SIGKILL whatever of its session is left (the fake worker nodes included).
        Returns the processes that had to be killed (empty when it was clean)."""
        if self.proc is None:
            return []
        return stop_session(self.proc, signal.SIGTERM, timeout_s)


def ray_test_env(tmpdir: Path) -> dict[str, str]:
    """This process's environment for a private Ray cluster under `tmpdir`: never
    joining (or authenticating against) another cluster, no token auth, no usage
    stats. Shared by the fake cluster and the e2e tests' `spur serve` processes."""
    env = dict(os.environ)
    for key in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(key, None)
    env.update(
        RAY_TMPDIR=str(tmpdir),
        RAY_AUTH_MODE="disabled",
        RAY_USAGE_STATS_ENABLED="0",
    )
    return env


def stop_session(
    proc: subprocess.Popen[bytes], sig: int, timeout_s: float, grace_s: float = 15.0
) -> list[str]:
    """Stop `proc`, the leader of a session of its own, and everything it started:
    send `sig`, wait up to `timeout_s` for it to exit, give the rest of its session
    `grace_s` to follow (Ray's workers notice their raylet's exit on their own), then
    SIGKILL what is left. Returns the problems seen, empty when the stop was clean:
    a leader that ignored `sig`, processes that had to be killed."""
    problems = []
    sid = proc.pid
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            problems.append(f"pid {sid} ignored signal {sig} for {timeout_s:.0f} s")
    deadline = time.monotonic() + grace_s
    left = session_processes(sid)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = session_processes(sid)
    if left:
        problems.append(
            "still running after shutdown: " + "; ".join(f"{p} {c[:100]}" for p, c in left.items())
        )
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)
    return problems


def session_processes(sid: int) -> dict[int, str]:
    """pid -> command line of every live process of session `sid`."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            if fields[0] == "Z" or int(fields[3]) != sid:
                continue
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            out[int(entry.name)] = cmd.strip()
        except (OSError, ValueError, IndexError):
            continue
    return out


def alive_nodes(address: str) -> list[dict[str, Any]]:
    """The cluster's alive nodes ({"node_id", "resources"}), read through a GCS client
    (no driver connection)."""
    from ray._raylet import GcsClient

    client = GcsClient(address=address)
    out = []
    for node_id, info in client.get_all_node_info(timeout=10).items():
        if info.state == 0:  # ALIVE
            out.append({"node_id": node_id.hex(), "resources": dict(info.resources_total)})
    return out
