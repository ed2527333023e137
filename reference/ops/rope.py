"""Interleaved partial RoPE on the last r dims (spec §4.3).

Tables are built in fp32 exactly the way the official code and transformers build them: inverse
frequencies in fp32 (YaRN blend in fp32), the angle as one fp32 product float32(p)·inv_i, cos/sin in
fp32. An fp64 angle differs by up to |φ|·2⁻²⁴ rad and measurably flips indexer near-ties (spec §4.3),
so the fp64 reference also uses these fp32 tables (upcast): the tables are part of the model's
definition, not of its arithmetic.
"""

from __future__ import annotations

import math

import torch

from reference.config import ModelConfig, YarnConfig


def inverse_frequencies(rope_dim: int, base: float, yarn: YarnConfig | None) -> torch.Tensor:
    """θ_i = base^(−2i/r) in fp32, optionally YaRN-blended (spec §4.3): θ'_i = θ_i(1−ramp_i) + (θ_i/s)·ramp_i."""
    pos_freqs = base ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim)
    if yarn is None:
        return 1.0 / pos_freqs
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (yarn.factor * pos_freqs)

    def correction_dim(n_rotations: float) -> float:
        # corr(nrot) = r·ln(L0 / (2π·nrot)) / (2·ln base)
        return rope_dim * math.log(yarn.original_max_position_embeddings / (n_rotations * 2 * math.pi)) / (
            2 * math.log(base))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # weight of the unscaled (extrapolated) frequency
    return interpolation * (1 - keep) + extrapolation * keep


def layer_inverse_frequencies(cfg: ModelConfig, layer: int) -> torch.Tensor:
    """SWA layers: θ = rope_theta, no YaRN; CSA/HCA layers: compress_rope_theta (+ YaRN when configured)."""
    if cfg.layer_kind(layer) == "swa":
        return inverse_frequencies(cfg.qk_rope_head_dim, cfg.rope_theta, None)
    return inverse_frequencies(cfg.qk_rope_head_dim, cfg.compress_rope_theta,
                               cfg.yarn if cfg.uses_yarn(layer) else None)


def cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos φ, sin φ for φ = float32(p)·θ_i (fp32 product), returned as `dtype`; shapes [..., r/2]."""
    phi = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)
    return phi.cos().to(dtype), phi.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate adjacent pairs (2i, 2i+1) of the last r = 2·cos.shape[-1] dims of x: (a, b) → (a·c − b·s, a·s + b·c).

    `inverse` rotates by −φ (output de-rotation, spec §4.6). cos/sin broadcast against x[..., :-r] minus
    its last dim (e.g. [T, 1, r/2] for x [T, H, d]).
    """
    r = 2 * cos.shape[-1]
    nope, rot = x[..., :-r], x[..., -r:]
    a, b = rot[..., 0::2], rot[..., 1::2]
    if inverse:
        sin = -sin
    rotated = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    return torch.cat([nope, rotated], dim=-1)
