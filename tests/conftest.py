"""Test-session setup shared by every test module.

TRITON_INTERPRET must be set before anything imports triton (transformers may import it while the test
modules are being collected), so on a machine without CUDA it is set here, first: the Triton kernels then
run in the interpreter, which the CPU kernel tests use for indexing and masking (DESIGN §10).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_float32_matmul_precision("highest")  # the reference refuses TF32 (DESIGN §10)


@pytest.fixture
def tensor_cores_on_cpu(monkeypatch):
    """A function that makes the engine take its GPU tensor-core paths on the CPU from then on (the test may first run
    something without them): numerics.on_tensor_cores says yes from TENSOR_CORE_MIN_ROWS rows, and numerics.bf16_mm
    is `mm`, by default exact products summed in fp64 and rounded once to fp32 — another rounding of the same sum, as
    tensor cores give (the CPU's torch has no bf16 GEMM with fp32 output)."""
    from optimized import numerics

    def enable(mm=lambda x, w: (x.double() @ w.double().T).float()) -> None:
        monkeypatch.setattr(numerics, "on_tensor_cores",
                            lambda x: numerics._rows(x) >= numerics.TENSOR_CORE_MIN_ROWS)
        monkeypatch.setattr(numerics, "bf16_mm", mm)
    return enable
