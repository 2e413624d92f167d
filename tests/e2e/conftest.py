"""One real `spur serve` for the whole e2e directory (package-scoped: it stops
when the directory's last test is done, not at the end of the whole run).

    tiny_model_dir   a random 2-layer Llama with SmolLM2's tokenizer (text works)
    spur_server      `python -m spur.cluster.cli serve CONFIG` in its own session:
                     an embedded Ray under a private RAY_TMPDIR, lanes
                       tiny      the tiny model, TP=1
                       tiny-tp2  the tiny model, TP=2 (Ray worker actors)
                       busy      the tiny model, max_ongoing 1 / max_queued 1
                       smol      SmolLM2-135M-Instruct (the demo model)
                       hybrid    configs/hybrid-tiny.yaml's random Qwen3.5
    openai_client    the official `openai` client on http://127.0.0.1:PORT/v1
    http             an httpx client on http://127.0.0.1:PORT (raw checks)
    keyed_server     a second `spur serve` (lane tiny only) with API keys in
                     SPUR_API_KEYS: tenants, per-key limits, an admin key

Teardown sends SIGINT (the server's graceful shutdown: Serve drained, Ray shut
down), waits, SIGKILLs whatever of its session is left, and fails if a raylet
or any other process the server started outlived it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

START_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 60.0
READY_LINE = "spur is serving at "

TINY_LANES = ("tiny", "tiny-tp2", "busy")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
)


# -- the tiny model --------------------------------------------------------------------
def build_tiny_model(out: Path) -> Path:
    """A random Llama (2 layers, hidden 64, 4 heads / 2 KV heads) with SmolLM2's
    vocabulary and tokenizer files, saved with `save_pretrained` into `out`.

    Weights are drawn with a fixed seed and a wider spread than HF's init, so
    that greedy decoding has clear argmax margins (TP=1 and TP=2 then agree
    exactly instead of flipping near-ties)."""
    import torch
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    from spur.actors.worker.loader import resolve_model_dir

    src = resolve_model_dir("SmolLM2-135M-Instruct")
    smol = AutoConfig.from_pretrained(src)
    config = LlamaConfig(
        vocab_size=smol.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=smol.bos_token_id,
        eos_token_id=smol.eos_token_id,
        pad_token_id=smol.pad_token_id,
    )
    torch.manual_seed(20240611)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.1)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    return out


@pytest.fixture(scope="package")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("e2e-model") / "tiny")


# -- the server's config ---------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tiny_engine(model_dir: Path, tp: int = 1) -> dict[str, Any]:
    return {
        "model": {"path": str(model_dir), "dtype": "float32"},
        "cache": {"block_size": 16, "num_kv_blocks": 512},
        "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 2048},
        "parallelism": {"device": "cpu", "tensor_parallel_size": tp},
        "runtime": {"num_threads": 1},
    }


def server_config(model_dir: Path, port: int) -> dict[str, Any]:
    """The e2e config: three lanes of the tiny model and one of SmolLM2."""
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
                "engine": _tiny_engine(model_dir, tp=2),
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


def hybrid_lane() -> dict[str, Any]:
    """The lane of configs/hybrid-tiny.yaml (a random Qwen3.5 built on first use),
    named "hybrid", with a smaller pool and one thread."""
    preset = Path(__file__).resolve().parents[2] / "configs" / "hybrid-tiny.yaml"
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


# -- the server process ----------------------------------------------------------------
@dataclass
class SpurServer:
    url: str
    """http://127.0.0.1:PORT (the API is under /v1)."""
    config_path: Path
    config: dict[str, Any]
    log_path: Path
    model_dir: Path
    missing_lanes: dict[str, str] = field(default_factory=dict)
    """Lanes left out of the config because the app could not be built with them."""

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def require_lane(self, name: str) -> None:
        """Fail (not skip) the calling test when lane `name` is not deployed."""
        if name in self.missing_lanes:
            pytest.fail(f"lane {name!r} could not be deployed: {self.missing_lanes[name]}")

    def log_tail(self, num_chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-num_chars:]
        except OSError as exc:
            return f"(no log: {exc})"


def session_processes(sid: int) -> dict[int, str]:
    """pid -> command line of every live process in session `sid` (the server
    runs in a session of its own, so these are exactly the processes it started)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            # fields after the ")" closing the command name: state ppid pgrp session ...
            fields = stat[stat.rindex(")") + 2 :].split()
            if fields[0] == "Z" or int(fields[3]) != sid:
                continue
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            out[int(entry.name)] = cmd.strip()
        except (OSError, ValueError, IndexError):
            continue
    return out


def raylets_of(ray_tmpdir: Path) -> dict[int, str]:
    """Raylet processes whose command line names `ray_tmpdir` (any session)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "raylet" in cmd and str(ray_tmpdir) in cmd:
            out[int(entry.name)] = cmd[:200]
    return out


def server_env(ray_tmpdir: Path) -> dict[str, str]:
    env = dict(os.environ)
    for key in ("RAY_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(key, None)  # never join (or authenticate against) another cluster
    env.update(
        RAY_TMPDIR=str(ray_tmpdir),
        RAY_AUTH_MODE="disabled",
        RAY_USAGE_STATS_ENABLED="0",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    return env


def wait_ready(proc: subprocess.Popen[bytes], log_path: Path, timeout_s: float) -> str:
    """The URL the server announces; raises RuntimeError with the log's tail if it
    exits or stays silent for `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace") if log_path.exists() else ""
        for line in text.splitlines():
            if line.startswith(READY_LINE):
                return line[len(READY_LINE) :].strip().removesuffix("/v1")
        if proc.poll() is not None:
            raise RuntimeError(f"spur serve exited with {proc.returncode}:\n{text[-6000:]}")
        time.sleep(0.5)
    text = log_path.read_text(errors="replace")
    raise RuntimeError(f"spur serve not ready after {timeout_s:.0f} s:\n{text[-6000:]}")


def stop_server(proc: subprocess.Popen[bytes], ray_tmpdir: Path) -> list[str]:
    """SIGINT, wait, then SIGKILL the server's session. Returns the problems seen
    (processes that outlived the graceful shutdown), empty when it was clean."""
    problems = []
    sid = proc.pid  # start_new_session=True: the server leads its own session
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            problems.append(f"spur serve ignored SIGINT for {STOP_TIMEOUT_S:.0f} s")
    # Ray's workers notice their raylet's exit on their own: give them a moment.
    deadline = time.monotonic() + 15
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
    raylets = raylets_of(ray_tmpdir)
    if raylets:
        problems.append(f"raylet of {ray_tmpdir} left over: {raylets}")
    return problems


@pytest.fixture(scope="package")
def spur_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SpurServer]:
    work = tmp_path_factory.mktemp("e2e-server")
    data = server_config(tiny_model_dir, free_port())
    missing = undeployable_lanes(data)
    data["lanes"] = [lane for lane in data["lanes"] if lane["name"] not in missing]
    config_path = work / "spur-e2e.yaml"
    config_path.write_text(yaml.safe_dump(data, sort_keys=False))
    log_path = work / "serve.log"
    # Short: Ray's unix socket paths under it must stay below 108 characters.
    ray_tmpdir = Path(tempfile.mkdtemp(prefix="spur-e2e-", dir="/tmp"))
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "spur.cluster.cli", "serve", str(config_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=server_env(ray_tmpdir),
            cwd=work,
            start_new_session=True,
        )
    server = None
    try:
        url = wait_ready(proc, log_path, START_TIMEOUT_S)
        server = SpurServer(url, config_path, data, log_path, tiny_model_dir, missing)
        yield server
    finally:
        problems = stop_server(proc, ray_tmpdir)
        shutil.rmtree(ray_tmpdir, ignore_errors=True)
    if server is not None:
        assert not problems, "\n".join(problems) + "\n" + server.log_tail()


@pytest.fixture(scope="package")
def openai_client(spur_server: SpurServer) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=spur_server.base_url, api_key="x", max_retries=0, timeout=120.0)


@pytest.fixture(scope="package")
def http(spur_server: SpurServer) -> Iterator[Any]:
    import httpx

    with httpx.Client(base_url=spur_server.url, timeout=120.0) as client:
        yield client


# -- servers of one test module (readiness, drain) --------------------------------------
@dataclass
class Launched:
    """A `spur serve` started by `launch_server`: its process, log and URL (known
    before it is ready: the port is chosen by the test)."""

    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path
    ray_tmpdir: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def tiny_lane(model_dir: Path, name: str, **extra: Any) -> dict[str, Any]:
    """One lane of the tiny model, TP=1."""
    return {
        "name": name,
        "served_model_names": [name],
        "engine": _tiny_engine(model_dir),
        "max_ongoing_requests": 32,
        "max_queued_requests": 64,
        **extra,
    }


@pytest.fixture
def launch_server(tmp_path: Path) -> Iterator[Any]:
    """launch(lanes) -> Launched: `spur serve` with these lanes on a free port, in its
    own session and RAY_TMPDIR, not waited for. Whatever is still running at teardown
    is stopped like `stop_server` does; leftovers fail the test."""
    launched: list[Launched] = []

    def launch(lanes: list[dict[str, Any]], **server: Any) -> Launched:
        port = free_port()
        data = {
            "version": 1,
            "lanes": lanes,
            "server": {
                "host": "127.0.0.1",
                "port": port,
                "num_cpus": 8,
                "object_store_memory": "200MiB",
                **server,
            },
        }
        work = tmp_path / f"server-{len(launched)}"
        work.mkdir()
        config_path = work / "spur.yaml"
        config_path.write_text(yaml.safe_dump(data, sort_keys=False))
        log_path = work / "serve.log"
        ray_tmpdir = Path(tempfile.mkdtemp(prefix="spur-t-", dir="/tmp"))
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "spur.cluster.cli", "serve", str(config_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=server_env(ray_tmpdir),
                cwd=work,
                start_new_session=True,
            )
        out = Launched(proc, f"http://127.0.0.1:{port}", log_path, ray_tmpdir)
        launched.append(out)
        return out

    yield launch
    problems = []
    for srv in launched:
        problems += stop_server(srv.proc, srv.ray_tmpdir)
        shutil.rmtree(srv.ray_tmpdir, ignore_errors=True)
    assert not problems, (
        "\n".join(problems) + "\n" + (launched[-1].log()[-4000:] if launched else "")
    )


# -- a second server, with API keys ----------------------------------------------------------
# alice, alice2: tenant acme (two keys of one tenant); bob: tenant globex; solo:
# max_concurrent_requests 1; meter: tokens_per_minute 600; ops: the admin key.
KEYS = {
    "alice": "sk-alice-8c1f0e2a",
    "alice2": "sk-alice2-77d3b0aa",
    "bob": "sk-bob-4b9d61e0",
    "solo": "sk-solo-0a6e2f19",
    "meter": "sk-meter-5e80c3d4",
    "ops": "sk-ops-d2c48a11",
}
KEYS_TEXT = yaml.safe_dump(
    {
        "keys": [
            {"key": KEYS["alice"], "name": "alice", "tenant": "acme"},
            {"key": KEYS["alice2"], "name": "alice2", "tenant": "acme"},
            {"key": KEYS["bob"], "name": "bob", "tenant": "globex"},
            {"key": KEYS["solo"], "name": "solo", "max_concurrent_requests": 1},
            {"key": KEYS["meter"], "name": "meter", "tokens_per_minute": 600},
            {"key": KEYS["ops"], "name": "ops", "admin": True},
        ]
    }
)


class KeyedServer:
    def __init__(self, url: str, log_path: Path, sid: int) -> None:
        self.url = url
        self.log_path = log_path
        self.sid = sid
        """Session id of the server's processes (its Ray workers included)."""

    def processes(self) -> dict[int, str]:
        """pid -> command line of the server's live processes."""
        return session_processes(self.sid)

    def client(self, who: str | None) -> Any:
        """An httpx client sending `who`'s key (None: no key)."""
        import httpx

        headers = {"Authorization": f"Bearer {KEYS[who]}"} if who else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=120.0)


@pytest.fixture(scope="package")
def keyed_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[KeyedServer]:
    work = tmp_path_factory.mktemp("e2e-keyed")
    data = server_config(tiny_model_dir, free_port())
    data["lanes"] = [lane for lane in data["lanes"] if lane["name"] == "tiny"]
    data["server"]["num_cpus"] = 4
    config_path = work / "spur-auth.yaml"
    config_path.write_text(yaml.safe_dump(data, sort_keys=False))
    log_path = work / "serve.log"
    ray_tmpdir = Path(tempfile.mkdtemp(prefix="spur-auth-", dir="/tmp"))
    env = {**server_env(ray_tmpdir), "SPUR_API_KEYS": KEYS_TEXT}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "spur.cluster.cli", "serve", str(config_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=work,
            start_new_session=True,
        )
    try:
        url = wait_ready(proc, log_path, START_TIMEOUT_S)
        yield KeyedServer(url, log_path, proc.pid)
    finally:
        problems = stop_server(proc, ray_tmpdir)
        shutil.rmtree(ray_tmpdir, ignore_errors=True)
    log_text = log_path.read_text(errors="replace")
    leaked = [name for name, key in KEYS.items() if key in log_text]
    assert not leaked, f"keys of {leaked} appear in the server's log"
    assert not problems, "\n".join(problems)
