"""Test-session setup shared by every test module.

TRITON_INTERPRET must be set before anything imports triton (transformers may import it while the test
modules are being collected), so on a machine without CUDA it is set here, first: the Triton kernels then
run in the interpreter, which the CPU kernel tests use for indexing and masking (DESIGN §10).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_float32_matmul_precision("highest")  # the reference refuses TF32 (DESIGN §10)
