"""Low-precision building blocks of the serving stack, emulated exactly with torch (spec §7.1).

Each function reproduces what a deployed kernel computes up to the order of fp32 accumulation:
operands are rounded to the format the hardware sees (bf16, FP8 e4m3 with power-of-two scales,
FP4 e2m1), the products of such operands are exact in fp32, and sums are accumulated in fp32 — so
an fp32 matmul of the rounded operands is the kernel's result but for summation order.
"""

from __future__ import annotations

import functools
import math

import torch

from reference.graphs import replay
from reference.quant import fp8_fake_quant

ACT_BLOCK = 128  # FP8 activation quantization: one UE8M0 scale per token per 128 K-elements
ACT_AMAX_FLOOR = 1e-4  # official act_quant floor on amax


def constant(value: float | int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 0-dim tensor of `value`, made once per (value, dtype, device). `torch.where(c, x, <python number>)` turns
    the number into a tensor at every call — on a GPU one more launch, at every decode step; a 0-dim tensor of x's
    own dtype gives the same result dtype and the same bits. Read only: it is shared. Keyed by the value's sign
    too (−0.0 == 0.0 in Python, not in bits); NaN is refused (it equals nothing, so it would never be found)."""
    if value != value:
        raise ValueError("constant(): NaN has no cache key")
    return _constant(value, math.copysign(1.0, value) < 0, dtype, torch.device(device))


@functools.lru_cache(maxsize=None)
def _constant(value: float | int, negative: bool, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(value, dtype=dtype, device=device)


def bf16(x: torch.Tensor) -> torch.Tensor:
    """Round to bf16 (RNE) and keep computing in fp32: the value a bf16 store then load gives."""
    return x.to(torch.bfloat16).float()


def fp8_activation(x: torch.Tensor) -> torch.Tensor:
    """Per-token FP8 e4m3 quantization with a power-of-two scale per 128 K-elements (official act_quant)."""
    return replay(fp8_fake_quant, x.float(), block=ACT_BLOCK, amax_floor=ACT_AMAX_FLOOR)  # a graph in decode


def fp8_linear(x: torch.Tensor, weight_fp32: torch.Tensor) -> torch.Tensor:
    """FP8 GEMM: FP8 activations (1×128, UE8M0) × FP8 block-scaled weights, fp32 accumulation, bf16 output."""
    return bf16(fp8_activation(x) @ weight_fp32.T)


def bf16_linear(x: torch.Tensor, weight_fp32: torch.Tensor, out_bf16: bool = True) -> torch.Tensor:
    """bf16 tensor-core GEMM: bf16 operands, fp32 accumulation; output bf16 (or fp32 when asked)."""
    y = bf16(x) @ bf16(weight_fp32).T
    return bf16(y) if out_bf16 else y


def fp32_linear(x: torch.Tensor, weight_fp32: torch.Tensor) -> torch.Tensor:
    """Full fp32 GEMM (SIMT): the official path for compressor projections and the router."""
    return x.float() @ weight_fp32.T


def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 from its (bf16) input, written back as bf16 (spec §7.1); a graph in decode."""
    return replay(_rms_norm_bf16, x, weight, eps=eps)


def _rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return bf16(weight.float() * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))
