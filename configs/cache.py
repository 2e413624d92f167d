"""spur's on-disk cache (`env.cache_dir()`): the lock its builders share.

What is built there, once per machine and key: the native kernels
(`kernels/native.py`), models converted from GGUF (`actors/worker/loader.py`), random
test models (`actors/worker/random_models.py`) and llama.cpp's server for the peer
bench (`cluster/bench/llama_build.py`). Each builds under `lock`, so that concurrent
callers build once and the others wait, then reuse the result.
"""

from __future__ import annotations

import fcntl
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on the lock file `path` (created if missing) for the block.

    An flock: the kernel releases it when its holder exits, however it exits, so a
    builder that is killed never leaves the cache locked. Blocks while another process
    holds it. The file itself stays (empty); it is not the lock.
    """
    with open(path, "a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
