"""Low-precision building blocks of the serving stack, emulated exactly with torch (spec §7.1).

Each function reproduces what a deployed kernel computes up to the order of fp32 accumulation:
operands are rounded to the format the hardware sees (bf16, FP8 e4m3 with power-of-two scales,
FP4 e2m1), the products of such operands are exact in fp32, and sums are accumulated in fp32 — so
an fp32 matmul of the rounded operands is the kernel's result but for summation order.
"""

from __future__ import annotations

from typing import Callable

import torch

from reference.quant import QuantizedTensor, fp8_fake_quant

ACT_BLOCK = 128  # FP8 activation quantization: one UE8M0 scale per token per 128 K-elements
ACT_AMAX_FLOOR = 1e-4  # official act_quant floor on amax


def bf16(x: torch.Tensor) -> torch.Tensor:
    """Round to bf16 (RNE) and keep computing in fp32: the value a bf16 store then load gives."""
    return x.to(torch.bfloat16).float()


def fp8_activation(x: torch.Tensor) -> torch.Tensor:
    """Per-token FP8 e4m3 quantization with a power-of-two scale per 128 K-elements (official act_quant)."""
    return fp8_fake_quant(x.float(), block=ACT_BLOCK, amax_floor=ACT_AMAX_FLOOR)


class DenseCache:
    """Dequantized fp32 copies of stored weights, made once per layer (the kernels read the stored bits;
    the emulation multiplies the exactly dequantized values, which is the same arithmetic).

    Copies are kept only up to `budget_bytes`: a full-width layer's 768 expert matrices (256 experts × w1, w3,
    w2 of 2048 × 4096) are 256·3·2048·4096·4 B = 25.8 GB in fp32, so past the budget a tensor is dequantized on
    every use instead (cheap next to the GEMM that uses it). The 4 GB default holds a Flash layer's attention,
    indexer and shared-expert weights (< 1 GB in fp32) with room for the experts used most."""

    def __init__(self, budget_bytes: int = 4 << 30) -> None:
        self._cache: dict[str, torch.Tensor] = {}
        self.budget_bytes, self.used_bytes = budget_bytes, 0

    def get(self, name: str, stored: torch.Tensor | QuantizedTensor | Callable[[], torch.Tensor | QuantizedTensor],
            device: torch.device) -> torch.Tensor:
        """fp32 value of `stored` (or of what the callable returns, called only on a miss), cached by name."""
        t = self._cache.get(name)
        if t is None:
            if callable(stored) and not isinstance(stored, torch.Tensor):
                stored = stored()
            t = stored.dequantize(torch.float32) if isinstance(stored, QuantizedTensor) else stored.float()
            t = t.to(device)
            if self.used_bytes + t.numel() * 4 <= self.budget_bytes:
                self._cache[name] = t
                self.used_bytes += t.numel() * 4
        return t


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
    """RMSNorm computed in fp32 from its (bf16) input, written back as bf16 (spec §7.1)."""
    xf = x.float()
    return bf16(weight.float() * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))
