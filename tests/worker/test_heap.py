"""keep_step_buffers_on_the_heap: a step's large tensors stop being page-faulted in
again every step (counted as minor page faults, in fresh processes)."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

SCRIPT = """
import resource, sys, torch
from spur.actors.worker.worker import keep_step_buffers_on_the_heap
if sys.argv[1] == "on":
    assert keep_step_buffers_on_the_heap()
def step():
    logits = torch.empty(16, 49152, dtype=torch.bfloat16).fill_(1)  # 1.5 MiB
    chunk = torch.empty(2048, 3072).fill_(1)  # a prefill chunk's gate_up, 24 MiB
    out = logits.float()
    del chunk
    return out
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults(arm: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, arm], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split()[-1])


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt only")
def test_step_buffers_are_reused_not_faulted_in_again():
    default, kept = faults("off"), faults("on")
    # default: each step maps its 3 MiB float logits afresh (768 pages) and more
    assert default >= 20 * 256, default
    assert kept * 4 <= default, (kept, default)
