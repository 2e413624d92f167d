"""Kernel-test settings: one torch thread, and `gpu` tests skipped without CUDA.

TRITON_INTERPRET is deliberately not set here: Triton reads it when a kernel is
decorated, other test modules may import spur.kernels (and so triton) first, and
the Hopper compile check needs it unset. The Triton checks therefore run in
subprocesses with the variable set explicitly (see test_triton_kernels.py).
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread():
    # Timing on the shared CI machine is noisy; these tests measure correctness only.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None and item.path.is_relative_to(
            config.rootpath / "tests/kernels"
        ):
            item.add_marker(skip)
