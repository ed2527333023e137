"""Low-precision kernels of the optimized stack, each as a torch emulation (CPU and GPU) and a Triton kernel.

- `sparse_decode.sparse_decode_splitk` — O1, split-K sparse-MLA decode over paged FP8 latent caches.
- `indexer_logits.fp8_paged_mqa_logits` — O2, the indexer's FP8 paged MQA logits.

Every public kernel takes `impl`: "torch" (the emulation, which IS the numeric recipe, step by step),
"triton" (the GPU kernel; on CPU tensors only under TRITON_INTERPRET=1) or "auto" (Triton for CUDA tensors
when triton imports, else the emulation). The environment variable DSV4_DRIFT_KERNEL_IMPL overrides what
"auto" picks ("torch" or "triton"), so a whole run can be forced onto one implementation.
See NOTES.md for the kernel designs and measured timings.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import threading
from typing import Iterator

import torch

IMPLS = ("auto", "torch", "triton")
IMPL_ENV = "DSV4_DRIFT_KERNEL_IMPL"

_LAUNCH_LOCK = threading.Lock()


@contextlib.contextmanager
def serialized_launch(device: torch.device) -> Iterator[None]:
    """Around a Triton kernel's launch: one launch at a time in this process, with `device` current (a CUDA device;
    nothing to make current for the interpreter's CPU tensors). The engine's rounding, the stock indexer and the
    stream comparison run in both host lanes (harness.run.host_lanes), and a kernel's first launch compiles it,
    which Triton does not promise to be safe from two threads at once."""
    with _LAUNCH_LOCK, torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        yield


@functools.cache
def triton_available() -> bool:
    """Whether triton imports here (looked up once: the engine asks at every rounding it might fuse)."""
    return importlib.util.find_spec("triton") is not None


def triton_interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (decided by triton when a kernel is decorated)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def resolve_impl(impl: str, device: torch.device) -> str:
    """"auto" -> "triton" for CUDA tensors when triton imports (or under the interpreter), else "torch"."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        impl = os.environ.get(IMPL_ENV, "auto")
        if impl not in IMPLS:
            raise ValueError(f"{IMPL_ENV} must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if impl == "triton":
        if not triton_available():
            raise RuntimeError("impl='triton' asked for, but triton is not importable")
        if device.type != "cuda" and not triton_interpreting():
            raise RuntimeError("impl='triton' on CPU tensors needs TRITON_INTERPRET=1 (set before triton is imported)")
    return impl


class fp32_matmul_exact:
    """Context: fp32 matmuls stay true fp32 (no TF32) whatever the process-wide setting (DESIGN §10)."""

    def __enter__(self) -> None:
        self._saved = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")

    def __exit__(self, *exc: object) -> None:
        torch.set_float32_matmul_precision(self._saved)
