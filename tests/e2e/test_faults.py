"""Process faults on a real `spur serve`, one server for the module: lanes "tiny"
(TP=1), "tiny-tp2" (TP=2: two Ray worker actors) and "brittle" (TP=1, its model in
a folder of its own), all the tiny model, and a spare that serves all three.

- kill -9 of a lane's engine replica while 16 streams run: every stream ends
  complete (those without a token yet are retried, the others continue on the spare
  from the tokens they had), and the server keeps answering.
- kill -9 of one TP worker actor of the TP=2 replica while 16 streams run: the engine
  notices (it does not hang in the collective), its streams continue on the spare,
  Serve's health check replaces the replica (new engine, new workers), 0 lost; a
  worker killed while the lane is idle gets its replica replaced too.
- the model folder of lane "brittle" disappears and its replica dies: every restart
  fails, the restart-loop detector marks the lane's slot down, `/admin/lanes` names
  the missing folder, traffic goes to the spare, and the server answers throughout.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from e2e.conftest import Launched, _tiny_engine, running, server_data, tiny_lane, wait_for

pytestmark = pytest.mark.slow

STREAMS = 16
MAX_TOKENS = 150
LANES = ("tiny", "tiny-tp2", "brittle")


@pytest.fixture(scope="module")
def brittle_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the tiny model that only lane "brittle" uses (a test removes it)."""
    out = tmp_path_factory.mktemp("e2e-brittle") / "model"
    shutil.copytree(tiny_model_dir, out)
    return out


@pytest.fixture(scope="module")
def spare_server(
    tiny_model_dir: Path, brittle_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Launched]:
    lanes = [
        tiny_lane(tiny_model_dir, "tiny"),
        {**tiny_lane(tiny_model_dir, "tiny-tp2"), "engine": _tiny_engine(tiny_model_dir, tp=2)},
        tiny_lane(brittle_dir, "brittle"),
    ]
    spare = {"name": "spare", "serves_lanes": list(LANES), "engine": _tiny_engine(tiny_model_dir)}
    data = server_data(lanes, spare=spare, num_cpus=6)
    with running(data, tmp_path_factory.mktemp("e2e-faults")) as srv:
        with httpx.Client(base_url=srv.url, timeout=60.0) as http:
            for lane in LANES:  # warm every lane
                r = http.post("/v1/completions", json={"model": lane, "prompt": "hi"})
                assert r.status_code == 200, r.text
        yield srv


def worker_actors(srv: Launched) -> list[int]:
    """pids of the server's TP worker actors (only lane "tiny-tp2" has any)."""
    return sorted(p for p, cmd in srv.processes().items() if cmd.startswith("ray::WorkerActor"))


def replaced(http: httpx.Client, old_pid: int) -> int | None:
    """The pid of lane tiny-tp2's engine once it is not `old_pid` (None before)."""
    r = http.get("/admin/engines")
    pid = r.json().get("tiny-tp2", {}).get("pid") if r.status_code == 200 else None
    return int(pid) if pid is not None and int(pid) != old_pid else None


async def streams_through(url: str, model: str, kill: Callable[[], None]) -> list[dict[str, Any]]:
    """16 greedy streams of MAX_TOKENS on `model`; `kill()` runs once half of them have
    tokens (so that both paths run: retry before the first token, continuation
    after). Returns each stream's finish reason and completion token count."""
    from openai import AsyncOpenAI

    async with httpx.AsyncClient(timeout=180.0) as http:
        client = AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, http_client=http)
        started = [asyncio.Event() for _ in range(STREAMS)]

        async def one(i: int) -> dict[str, Any]:
            stream = await client.completions.create(
                model=model,
                prompt=f"Stream {i} tells a story:",
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            finish, usage = None, None
            async for chunk in stream:
                for choice in chunk.choices:
                    if choice.text:
                        started[i].set()
                    finish = choice.finish_reason or finish
                usage = chunk.usage or usage
            return {"finish": finish, "tokens": usage.completion_tokens if usage else None}

        tasks = [asyncio.create_task(one(i)) for i in range(STREAMS)]
        while sum(e.is_set() for e in started) < STREAMS // 2:
            done = [t for t in tasks if t.done()]
            assert not done or all(not t.exception() for t in done)
            await asyncio.sleep(0.02)
        kill()
        return list(await asyncio.gather(*tasks))


def test_kill_9_of_an_engine_replica_loses_no_stream(spare_server: Launched) -> None:
    """A replica process killed mid-generation costs no request: retried before the
    first token, continued on the spare after it; the lane answers afterwards."""
    url = spare_server.url
    victim = int(httpx.get(f"{url}/admin/engines", timeout=60).json()["tiny"]["pid"])
    results = asyncio.run(
        asyncio.wait_for(streams_through(url, "tiny", lambda: os.kill(victim, signal.SIGKILL)), 300)
    )
    assert results == [{"finish": "length", "tokens": MAX_TOKENS}] * STREAMS, results
    with httpx.Client(base_url=url, timeout=60.0) as http:
        # the server keeps answering (from the spare, or the restarted replica)
        deadline = time.monotonic() + 60
        while True:
            r = http.post("/v1/completions", json={"model": "tiny", "prompt": "after"})
            if r.status_code == 200:
                break
            assert r.status_code in (429, 503) and time.monotonic() < deadline, r.text
            time.sleep(0.5)
        lanes = http.get("/admin/lanes").json()
        assert "tiny" in lanes and "spare" in lanes


def test_kill_9_of_a_tp_worker_replaces_the_replica_and_loses_no_stream(
    spare_server: Launched,
) -> None:
    """One of the two TP worker actors killed mid-generation: the engine fails its
    requests with a retriable error instead of hanging in the collective, the ingress
    retries or continues them on the spare (0 lost), and Serve's health check
    replaces the replica: a new engine process with two new workers serves the lane."""
    srv = spare_server
    with httpx.Client(base_url=srv.url, timeout=60.0) as http:
        old_pid = int(http.get("/admin/engines").json()["tiny-tp2"]["pid"])
        workers = worker_actors(srv)
        assert len(workers) == 2, srv.processes()
        results = asyncio.run(
            asyncio.wait_for(
                streams_through(srv.url, "tiny-tp2", lambda: os.kill(workers[1], signal.SIGKILL)),
                300,
            )
        )
        assert results == [{"finish": "length", "tokens": MAX_TOKENS}] * STREAMS, results

        wait_for("new tiny-tp2 engine", lambda: replaced(http, old_pid), 180, srv)
        with pytest.raises(ProcessLookupError):
            os.kill(old_pid, 0)  # the old engine process is gone, not left hanging
        wait_for(
            "two new TP workers",
            lambda: len(new := worker_actors(srv)) == 2 and not set(new) & set(workers),
            60,
            srv,
        )
        # the new replica takes the lane back: its generations come from the primary
        body = {"model": "tiny-tp2", "prompt": "back", "max_tokens": 4}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        wait_for(
            "tiny-tp2 routed to its primary again",
            lambda: http.get("/admin/lanes").json()["tiny-tp2"].get("target") == "tiny-tp2",
            120,
            srv,
        )


def test_a_tp_worker_that_dies_while_its_lane_is_idle_gets_the_replica_replaced(
    spare_server: Launched,
) -> None:
    """No request has to find the dead worker first: the replica's health check sees
    it (its executor checks its workers' processes) and Serve replaces the replica,
    with new workers, while the lane gets no traffic."""
    srv = spare_server
    with httpx.Client(base_url=srv.url, timeout=60.0) as http:
        wait_for("two TP workers", lambda: len(worker_actors(srv)) == 2, 120, srv)
        workers = worker_actors(srv)
        old_pid = int(http.get("/admin/engines").json()["tiny-tp2"]["pid"])
        os.kill(workers[0], signal.SIGKILL)
        wait_for("new tiny-tp2 engine", lambda: replaced(http, old_pid), 120, srv)
        wait_for(
            "two new TP workers",
            lambda: len(new := worker_actors(srv)) == 2 and not set(new) & set(workers),
            60,
            srv,
        )
        body = {"model": "tiny-tp2", "prompt": "idle", "max_tokens": 4}
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text


class Poller:
    """A thread that polls GET /health/live and a short completion on `model` until
    stopped, counting answers by status (anything but 200 is a failure here)."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self.answers: dict[str, int] = {}
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Poller:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(120)

    def _run(self) -> None:
        body = {"model": self.model, "prompt": "still there?", "max_tokens": 4}
        with httpx.Client(base_url=self.url, timeout=60.0) as http:
            while not self._stop.is_set():
                for what, call in (
                    ("live", lambda: http.get("/health/live")),
                    ("completion", lambda: http.post("/v1/completions", json=body)),
                ):
                    try:
                        r = call()
                        ok, detail = r.status_code == 200, f"{r.status_code} {r.text[:200]}"
                    except httpx.HTTPError as exc:
                        ok, detail = False, f"{type(exc).__name__}: {exc}"
                    self.answers[what] = self.answers.get(what, 0) + 1
                    if not ok:
                        self.failures.append(f"{what}: {detail}")
                self._stop.wait(0.2)


def test_a_lane_whose_model_folder_is_gone_is_marked_down_and_served_by_the_spare(
    spare_server: Launched, brittle_dir: Path
) -> None:
    """The model folder of lane "brittle" vanishes (an unmounted disk) and its replica
    dies: Serve's restarts all fail, the restart-loop detector marks the slot down
    within its window, /admin/lanes says why (the error names the missing folder),
    the lane's traffic goes to the spare, and /health/live and completions of the lane
    answer 200 throughout."""
    srv = spare_server
    gone = brittle_dir.with_name("model-unmounted")
    with httpx.Client(base_url=srv.url, timeout=60.0) as http, Poller(srv.url, "brittle") as poll:
        victim = int(http.get("/admin/engines").json()["brittle"]["pid"])
        brittle_dir.rename(gone)
        try:
            os.kill(victim, signal.SIGKILL)

            def down() -> dict[str, Any] | None:
                lane = http.get("/admin/lanes").json()["brittle"]
                return lane if lane.get("down_slots") else None

            lane = wait_for("down slot of lane brittle", down, 240, srv)
            slot = lane["down_slots"][0]
            assert slot["recent_start_failures"] >= 3, lane
            assert str(brittle_dir) in (slot["last_error"] or ""), lane
            assert not any(r["healthy"] for r in lane["replicas"]), lane
            wait_for(
                "lane brittle routed to the spare",
                lambda: http.get("/admin/lanes").json()["brittle"].get("target") == "spare",
                60,
                srv,
            )
            answers = dict(poll.answers)
            wait_for(  # the lane keeps answering while it is down
                "more answers",
                lambda: poll.answers.get("completion", 0) >= answers.get("completion", 0) + 3,
                60,
                srv,
            )
        finally:
            gone.rename(brittle_dir)  # Serve's next restart succeeds: no restarts left
    assert poll.answers.get("live", 0) >= 3 and poll.answers.get("completion", 0) >= 3
    assert not poll.failures, poll.failures[:5]
