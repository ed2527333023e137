"""Attention pieces (spec §4): query/KV paths, window gathering, sparse attention with sink, output path."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reference.ops.norms import rms_norm, unweighted_rms_norm
from reference.ops.rope import apply_rope


def query_path(x: torch.Tensor, wq_a: torch.Tensor, q_norm: torch.Tensor, wq_b: torch.Tensor, n_heads: int,
               cos: torch.Tensor, sin: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """§4.1: q_lat = RMSNorm_q(x·wq_aᵀ); q = q_lat·wq_bᵀ as [S, H, d] (head-major); per-head unweighted RMS;
    RoPE on the last r dims. Returns (q_lat, q); q_lat also feeds the indexer."""
    q_lat = rms_norm(x @ wq_a.T, q_norm, eps)
    q = (q_lat @ wq_b.T).unflatten(-1, (n_heads, -1))
    q = unweighted_rms_norm(q, eps)
    return q_lat, apply_rope(q, cos[:, None], sin[:, None])


def kv_path(x: torch.Tensor, wkv: torch.Tensor, kv_norm: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            eps: float) -> torch.Tensor:
    """§4.2: kv = RMSNorm_kv(x·wkvᵀ) with RoPE on its last r dims; one latent row used as both K and V."""
    return apply_rope(rms_norm(x @ wkv.T, kv_norm, eps), cos, sin)


def window_keys(kv_history: torch.Tensor, history_start: int, positions: torch.Tensor, window: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The window W_t = positions max(0, t−W+1) … t (§4.4) of each query, gathered from kv rows.

    kv_history [N, d] holds positions history_start … history_start+N−1. Returns keys [B, W, d],
    their absolute positions [B, W] (−1 where the window reaches before position 0) and a validity mask.
    """
    offsets = torch.arange(-window + 1, 1, device=positions.device)
    key_pos = positions[:, None] + offsets[None, :]
    valid = key_pos >= 0
    idx = (key_pos - history_start).clamp(min=0)
    return kv_history[idx], torch.where(valid, key_pos, -1), valid


@dataclass
class AttentionResult:
    """Per query block: output [B, H, d] plus what the probes look at."""

    out: torch.Tensor
    probs: torch.Tensor  # [B, H, K] over the block's key list (window keys first, then compressed)
    sink_prob: torch.Tensor  # [B, H] mass on the sink
    lse: torch.Tensor  # [B, H] log of the softmax denominator, sink included
    max_logit: torch.Tensor  # [B, H] max over the real keys


def sparse_attention_with_sink(q: torch.Tensor, keys: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor
                               ) -> AttentionResult:
    """§4.5: s_j = q·kv_j/sqrt(d); o = Σ_j e^{s_j−M} kv_j / (Σ_j e^{s_j−M} + e^{sink−M}), M = max(max_j s_j, sink).

    q [B, H, d]; keys [B, K, d] (the query's own key list: values = keys); valid [B, K]; sink [H].
    """
    d = q.shape[-1]
    logits = torch.einsum("bhd,bkd->bhk", q, keys) / d**0.5
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    max_logit = logits.amax(-1)
    m = torch.maximum(max_logit, sink[None, :])
    e = torch.exp(logits - m[..., None])
    e_sink = torch.exp(sink[None, :] - m)
    denom = e.sum(-1) + e_sink
    probs = e / denom[..., None]
    out = torch.einsum("bhk,bkd->bhd", probs, keys)
    return AttentionResult(out, probs, e_sink / denom, m + torch.log(denom), max_logit)


def output_path(o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, wo_a: torch.Tensor, wo_b: torch.Tensor,
                n_groups: int) -> torch.Tensor:
    """§4.6: de-rotate the rope slice with −t; group heads (G groups of H/G consecutive heads) and
    project u_g = wo_a[g]·o_g ∈ R^{R_o}; out = wo_b·concat_g(u_g). o [S, H, d] -> [S, D]."""
    o = apply_rope(o, cos[:, None], sin[:, None], inverse=True)
    grouped = o.flatten(-2).unflatten(-1, (n_groups, -1))  # [S, G, (H/G)·d]
    wo_a_g = wo_a.unflatten(0, (n_groups, -1))  # [G, R_o, (H/G)·d]
    u = torch.einsum("sgi,gri->sgr", grouped, wo_a_g)
    return u.flatten(-2) @ wo_b.T
