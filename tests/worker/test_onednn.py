"""Which path torch's CPU matmuls take (actors/worker/onednn.py)."""

from __future__ import annotations

import torch

from spur.actors.worker.onednn import matmul_path, parse_verbose

SAMPLE = """onednn_verbose,v1,info,oneDNN v3.12.0 (commit 80afa71)
onednn_verbose,v1,info,cpu,runtime:OpenMP,nthr:2
onednn_verbose,v1,info,cpu,isa:Intel AVX-512 with AVX512BW, AVX512VL, and AVX512DQ extensions
onednn_verbose,v1,primitive,exec,cpu,matmul,gemm:jit:bf16,undef,src:bf16::blocked:ab::f0,,64x576:576x1536,1.2
"""


def test_the_implementation_and_isa_are_read_from_oneDNNs_lines():
    got = parse_verbose(SAMPLE)
    assert got["library"] == "oneDNN"
    assert got["implementation"] == "gemm:jit:bf16"
    assert got["isa"].startswith("Intel AVX-512")


def test_no_matmul_line_means_another_library():
    got = parse_verbose("some other output\nonednn_verbose,v1,info,cpu,runtime:OpenMP,nthr:2\n")
    assert got == {"library": "not oneDNN", "implementation": None, "isa": None}


def test_a_real_bf16_linear_reports_its_path_and_prints_nothing(capfd):
    """Whichever library this CPU takes, the answer is one of the two shapes, and
    oneDNN's verbose lines do not reach stdout (a bench's stdout is JSON)."""
    got = matmul_path("bfloat16")
    assert got["dtype"] == "bfloat16"
    if got["library"] == "oneDNN":
        assert got["implementation"]
    else:
        assert got == {
            "dtype": "bfloat16",
            "library": "not oneDNN",
            "implementation": None,
            "isa": None,
        }
    assert "onednn_verbose" not in capfd.readouterr().out
    # verbose mode is off again: a later linear prints nothing
    torch.nn.functional.linear(torch.randn(2, 8).bfloat16(), torch.randn(4, 8).bfloat16())
    assert "onednn_verbose" not in capfd.readouterr().out
