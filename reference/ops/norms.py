"""RMS normalisations (spec §2): y = w ⊙ x / sqrt(mean(x²) + eps) over the last dim."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Weighted RMSNorm (attn_norm, ffn_norm, q_norm, kv_norm, compressor norms, final norm)."""
    return weight * unweighted_rms_norm(x, eps)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight (per-head q norm, spec §4.1; the mHC ρ factor, §3.1)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
