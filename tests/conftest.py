"""Suite-wide: under SPUR_CPU_TARGET (configs/cpu.py) torch's libraries are capped at that
x86-64 level before any test module loads torch, as `spur`'s command line does."""

from __future__ import annotations

from spur.configs import cpu

cpu.export_torch_isa()
