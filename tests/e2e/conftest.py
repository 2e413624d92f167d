"""What every e2e test shares: the tiny model, and one launcher for `spur serve`.

    tiny_model_dir   a random 2-layer Llama with SmolLM2's tokenizer (text works)
    launch / running `python -m spur.cluster.cli serve CONFIG` in its own session:
                     an embedded Ray under a private RAY_TMPDIR; `running` waits
                     for it to announce its URL and stops it afterwards
    launch_server    a fixture: servers of one test (readiness, drain)

Servers live no longer than their tests, so that two test servers (two Ray
clusters on a 2-core CI machine) never run at once: the server of
shared_server/ (five lanes) and of keyed_server/ (API keys) are package-scoped
in those folders, the other modules start their own.

Teardown sends SIGINT (the server's graceful shutdown: Serve drained, Ray shut
down), waits, SIGKILLs whatever of its session is left, and fails if a raylet
or any other process the server started outlived it.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from spur.actors.ports import free_port
from spur.cluster.fake_cluster import ray_test_env, session_processes, stop_session

START_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 60.0
READY_LINE = "spur is serving at "

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
def wait_for(
    what: str, check: Callable[[], Any], timeout_s: float, srv: Launched | None = None
) -> Any:
    """Poll `check` until it returns something truthy, and return that; fail with
    `what` (and `srv`'s log tail, when given) after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            log = f"\n{srv.log_tail()}" if srv is not None else ""
            pytest.fail(f"no {what} within {timeout_s:.0f} s{log}")
        time.sleep(0.2)


def _tiny_engine(model_dir: Path, tp: int = 1) -> dict[str, Any]:
    return {
        "model": {"path": str(model_dir), "dtype": "float32"},
        "cache": {"block_size": 16, "num_kv_blocks": 512},
        "scheduler": {"max_num_seqs": 16, "max_num_batched_tokens": 2048},
        "parallelism": {"device": "cpu", "tensor_parallel_size": tp},
        "runtime": {"num_threads": 1},
    }


# -- the server process: one launcher for every `spur serve` of the tests ----------------
def server_env(ray_tmpdir: Path) -> dict[str, str]:
    """The environment of a test's `spur serve`: a private Ray under `ray_tmpdir`
    (`spur.cluster.fake_cluster.ray_test_env`), offline, unbuffered."""
    env = ray_test_env(ray_tmpdir)
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return env


@dataclass
class Launched:
    """A `spur serve` started by `launch`: its process (leader of a session of its
    own), config, log and URL (known before it is ready: the port is chosen here)."""

    proc: subprocess.Popen[bytes]
    url: str
    """http://127.0.0.1:PORT (the API is under /v1)."""
    config_path: Path
    config: dict[str, Any]
    log_path: Path
    ray_tmpdir: Path

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    @property
    def sid(self) -> int:
        """Session id of the server's processes (its Ray workers included)."""
        return self.proc.pid

    def processes(self) -> dict[int, str]:
        """pid -> command line of the server's live processes."""
        return session_processes(self.sid)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, num_chars: int = 6000) -> str:
        return self.log()[-num_chars:] or "(no log)"


def server_data(lanes: list[dict[str, Any]], **server: Any) -> dict[str, Any]:
    """A config with these lanes on a free loopback port (`server` overrides the
    server section; `spare=...` adds a spare)."""
    spare = server.pop("spare", None)
    data: dict[str, Any] = {
        "version": 1,
        "lanes": lanes,
        "server": {
            "host": "127.0.0.1",
            "port": free_port(),
            "num_cpus": 8,
            "object_store_memory": "200MiB",
            **server,
        },
    }
    if spare is not None:
        data["spare"] = spare
    return data


def launch(data: dict[str, Any], work: Path, env: dict[str, str] | None = None) -> Launched:
    """Write `data` to work/spur.yaml and start `spur serve` on it in its own session
    and RAY_TMPDIR (extra environment `env`); returns without waiting for it."""
    work.mkdir(parents=True, exist_ok=True)
    config_path = work / "spur.yaml"
    config_path.write_text(yaml.safe_dump(data, sort_keys=False))
    log_path = work / "serve.log"
    # Short: Ray's unix socket paths under it must stay below 108 characters.
    ray_tmpdir = Path(tempfile.mkdtemp(prefix="spur-t-", dir="/tmp"))
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "spur.cluster.cli", "serve", str(config_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**server_env(ray_tmpdir), **(env or {})},
            cwd=work,
            start_new_session=True,
        )
    port = data["server"]["port"]
    return Launched(proc, f"http://127.0.0.1:{port}", config_path, data, log_path, ray_tmpdir)


def stop(srv: Launched) -> list[str]:
    """`stop_server`, then remove its RAY_TMPDIR; returns the problems seen."""
    try:
        return stop_server(srv.proc, srv.ray_tmpdir)
    finally:
        shutil.rmtree(srv.ray_tmpdir, ignore_errors=True)


@contextlib.contextmanager
def running(
    data: dict[str, Any], work: Path, env: dict[str, str] | None = None
) -> Iterator[Launched]:
    """`launch`, wait until it announces its URL (RuntimeError with the log's tail if
    it does not within START_TIMEOUT_S), yield it, stop it. A server that started and
    then left processes behind (or ignored SIGINT) fails the caller at the end."""
    srv = launch(data, work, env)
    try:
        wait_ready(srv.proc, srv.log_path, START_TIMEOUT_S)
    except BaseException:
        stop(srv)
        raise
    try:
        yield srv
    finally:
        problems = stop(srv)
    assert not problems, "\n".join(problems) + "\n" + srv.log_tail()


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
    """SIGINT (the server's graceful shutdown: Serve drained, Ray shut down), wait,
    then SIGKILL what is left of the server's session (`fake_cluster.stop_session`).
    Returns the problems seen, empty when it was clean."""
    problems = stop_session(proc, signal.SIGINT, STOP_TIMEOUT_S)
    raylets = raylets_of(ray_tmpdir)
    if raylets:
        problems.append(f"raylet of {ray_tmpdir} left over: {raylets}")
    return problems


# -- servers of one test (readiness, drain) -----------------------------------------------
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
    """launch(lanes, **server) -> Launched: `spur serve` with these lanes (`launch`),
    not waited for. Whatever is still running at teardown is stopped like
    `stop_server` does; leftovers fail the test."""
    launched: list[Launched] = []

    def start(lanes: list[dict[str, Any]], **server: Any) -> Launched:
        srv = launch(server_data(lanes, **server), tmp_path / f"server-{len(launched)}")
        launched.append(srv)
        return srv

    yield start
    problems = []
    for srv in launched:
        problems += stop(srv)
    assert not problems, (
        "\n".join(problems) + "\n" + (launched[-1].log_tail(4000) if launched else "")
    )
