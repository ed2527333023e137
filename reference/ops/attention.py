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


def window_band(kv_history: torch.Tensor, history_start: int, positions: torch.Tensor, window: int,
                first_last: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The windows W_t = positions max(0, t−W+1) … t (§4.4) of a block of consecutive queries, as one band.

    kv_history [N, d] holds positions history_start … history_start+N−1. Returns the rows every query of
    the block may see ([Nw, d], shared: no per-query copies), their positions [Nw], and which query sees
    which row [B, Nw] (key position in [t−W+1, t]). `first_last`, the block's first and last position when the
    caller knows them, spares reading them back from the device.
    """
    first, last = first_last if first_last is not None else (int(positions[0]), int(positions[-1]))
    lo = max(history_start, first - window + 1)
    hi = last + 1
    key_pos = torch.arange(lo, hi, device=positions.device)
    offset = positions[:, None] - key_pos[None, :]
    valid = (offset >= 0) & (offset < window)
    return kv_history[lo - history_start : hi - history_start], key_pos, valid


@dataclass
class KeySet:
    """Candidate keys of a query block: `keys` [K, d] shared by all queries, or [B, K, d] per query; and
    `valid` [B, K] saying which of them each query attends to. Keys are also the values (latent MQA)."""

    keys: torch.Tensor
    valid: torch.Tensor


@dataclass
class AttentionResult:
    """Per query block: output [B, H, d] plus what the probes look at."""

    out: torch.Tensor
    probs: torch.Tensor  # [B, H, ΣK] over the key sets in order (window band first, then compressed)
    sink_prob: torch.Tensor  # [B, H] mass on the sink
    lse: torch.Tensor  # [B, H] log of the softmax denominator, sink included
    max_logit: torch.Tensor  # [B, H] max over the real keys


def sparse_attention_with_sink(q: torch.Tensor, key_sets: list[KeySet], sink: torch.Tensor) -> AttentionResult:
    """§4.5: s_j = q·kv_j/sqrt(d); o = Σ_j e^{s_j−M} kv_j / (Σ_j e^{s_j−M} + e^{sink−M}), M = max(max_j s_j, sink),
    over j ∈ J_t = the valid keys of every key set. q [B, H, d]; sink [H]."""
    d = q.shape[-1]

    def scores(ks: KeySet) -> torch.Tensor:  # q·kv_j for every key of the set: [B, H, K]
        return torch.where(ks.valid[:, None, :], q @ ks.keys.transpose(-1, -2), float("-inf"))

    logits = torch.cat([scores(ks) for ks in key_sets], -1).div_(d**0.5)
    max_logit = logits.amax(-1)
    m = torch.maximum(max_logit, sink[None, :])
    e = logits.sub_(m[..., None]).exp_()  # in place: the logits are not needed again
    e_sink = torch.exp(sink[None, :] - m)
    denom = e.sum(-1) + e_sink
    probs = e.div_(denom[..., None])
    out = torch.zeros_like(q)
    for ks, p in zip(key_sets, probs.split([ks.valid.shape[-1] for ks in key_sets], -1)):
        out = out + p @ ks.keys  # Σ_j p_j kv_j
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
