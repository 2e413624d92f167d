"""The ingress's copy of an engine's tokenizer folder.

The engine reports where its tokenizer is (`tokenizer_dir` in its stats): a folder
on the engine's node, which the ingress may not see (on Kubernetes the ingress runs
on another pod; the demo model and GGUF models are converted into the engine pod's
own cache). The ingress then asks the engine for the folder's files
(`EngineReplica.tokenizer_files`) and writes them here, once per content.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from spur.configs.env import cache_dir


def local_tokenizer_dir(files: dict[str, bytes], root: Path | None = None) -> Path:
    """A folder on this node holding exactly `files` (name -> bytes):
    `<root>/<hash of the contents>`, `root` defaulting to `cache_dir()/tokenizers`.
    Written once: into a temporary folder renamed into place, so that a concurrent
    writer or a killed one never leaves a partial folder behind."""
    if not files:
        raise ValueError("the engine sent no tokenizer files")
    digest = hashlib.sha256()
    for name in sorted(files):
        if name != Path(name).name or name.startswith("."):
            raise ValueError(f"bad tokenizer file name {name!r} (a plain file name is needed)")
        digest.update(name.encode() + b"\0" + hashlib.sha256(files[name]).digest())
    root = root if root is not None else cache_dir() / "tokenizers"
    target = root / digest.hexdigest()[:24]
    if target.is_dir():
        return target
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".partial-", dir=root))
    try:
        for name, data in files.items():
            (staging / name).write_bytes(data)
        try:
            os.rename(staging, target)
        except OSError:  # another writer won the race: its folder holds the same files
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
