"""hashing.standard_normal as one Triton kernel: the same integers and the one rounded multiply, in one pass.

`hashing.standard_normal` is the definition: murmur3's finaliser over int64 tensors, then the Irwin–Hall sum of the
hash's four bytes times 1/sqrt(21845). In torch that is ~22 element-wise passes over int64 temporaries — ~1.5 GB
written per 8.4 M-element Flash expert matrix, ~0.8 s of a Flash layer's 1.25 s of synthetic weights on an H200,
made while the run's previous layer computes and competing with it for the GPU (issue #14). Here each element is
hashed in registers and written once as fp32.

Same bits, by construction: the finaliser's multiplies wrap modulo 2^32 in uint32 arithmetic, as the int64 code's
masks make them; the byte sum (≤ 1020) and its offset are integers, exact in fp32; the one float operation is
fp32(sum − 510) × fp32(1/sqrt(21845)), correctly rounded — as torch's mul_ by the Python scalar, which it casts to
the fp32 tensor's type. tests/test_gpu_engine.py compares synthetic weights made on the GPU with the CPU's bit for
bit; tests/test_kernels_cpu.py runs this kernel in the Triton interpreter against the torch path.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

BLOCK = 1024
"""Elements per program: a choice for an element-wise kernel (each program writes 4 KB), not tuned. The kernel
writes 34 MB per Flash expert matrix; the quantization after it writes ~0.5 GB (counted on the CPU), so the block
size is not where a layer's 0.57–0.73 s of weights goes."""


@triton.jit
def _standard_normal_kernel(out_ptr, key, offset, numel, inv_std, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < numel
    h = ((i + offset) ^ key).to(tl.uint32)  # index and key < 2^32: the xor is their low 32 bits
    h ^= h >> 16
    h *= tl.full([BLOCK], 0x85EBCA6B, tl.uint32)
    h ^= h >> 13
    h *= tl.full([BLOCK], 0xC2B2AE35, tl.uint32)
    h ^= h >> 16
    s = (h >> 24) + (h & 255) + ((h >> 8) & 255) + ((h >> 16) & 255)  # ≤ 1020
    z = (s.to(tl.int32) - 510).to(tl.float32) * inv_std
    tl.store(out_ptr + i, z, mask=mask)


def standard_normal_triton(key: int, numel: int, device: torch.device | str, offset: int, inv_std: float
                           ) -> torch.Tensor:
    """hashing.standard_normal(key, numel, device, offset) in one kernel (CUDA, or CPU under TRITON_INTERPRET=1), for
    indices offset … offset + numel − 1 below 2^32 (the kernel hashes their low 32 bits; hashing falls back to torch
    past that). `inv_std`: the multiplier, passed from hashing so there is one constant (Triton passes it as fp32)."""
    out = torch.empty(numel, dtype=torch.float32, device=device)
    if numel:
        # Triton launches on the thread's current device, whatever the tensors' (torch follows the tensor)
        with torch.cuda.device(out.device) if out.is_cuda else contextlib.nullcontext():
            _standard_normal_kernel[(triton.cdiv(numel, BLOCK),)](out, key, offset, numel, inv_std, BLOCK=BLOCK)
    return out
