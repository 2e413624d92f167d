"""The cache's builders' lock (configs/cache.py): exclusive across processes, and
released by the kernel when its holder is killed, so a killed builder never leaves the
cache locked."""

from __future__ import annotations

import fcntl
import subprocess
import sys
import time

from spur.configs import cache

HOLD = """
import sys, time
from pathlib import Path
from spur.configs import cache
with cache.lock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(600)
"""


def _free(path) -> bool:
    """Whether the lock on `path` can be taken now (taken and released at once)."""
    with open(path, "a") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
        return True


def test_the_lock_excludes_other_processes_and_dies_with_its_holder(tmp_path):
    path = tmp_path / "x.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert not _free(path)  # another process holds it
        holder.kill()  # SIGKILL: no finally block, no unlock of its own
        holder.wait(timeout=30)
        deadline = time.monotonic() + 30
        while not _free(path):
            assert time.monotonic() < deadline, "the killed holder's lock was not released"
            time.sleep(0.01)
    finally:
        holder.kill()
    with cache.lock(path):  # and the helper itself takes it
        assert not _free(path)
    assert _free(path)


def test_the_cache_dir_variable_expands_the_home_and_is_absolute(monkeypatch, tmp_path):
    """SPUR_CACHE_DIR=~/spur-cache was a folder named '~' under each process's working
    directory."""
    from spur.configs import env

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("SPUR_CACHE_DIR", "~/spur-cache ")
    assert env.cache_dir() == tmp_path / "spur-cache"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPUR_CACHE_DIR", "rel")
    assert env.cache_dir() == tmp_path.resolve() / "rel"
