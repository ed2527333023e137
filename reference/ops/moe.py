"""Mixture of experts (spec §6): sqrtsoftplus router (hash or learned selection), SwiGLU experts with clamp."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from reference.ops.topk import stable_topk_indices


@dataclass
class Routing:
    scores: torch.Tensor  # [S, E] sqrt(softplus(logits)), unbiased
    expert_ids: torch.Tensor  # [S, k]
    weights: torch.Tensor  # [S, k], renormalised and multiplied by routed_scaling_factor


def route(y: torch.Tensor, gate_weight: torch.Tensor, k: int, routed_scaling: float,
          bias: torch.Tensor | None = None, tid2eid: torch.Tensor | None = None,
          token_ids: torch.Tensor | None = None) -> Routing:
    """§6.1. Learned layers: ids = top-k(s + bias) (bias for selection only), weights from the unbiased s.
    Hash layers: ids = tid2eid[token id]. Both: w = s[ids] / Σ s[ids] · routed_scaling (no epsilon, as official).
    """
    scores = torch.sqrt(F.softplus(y @ gate_weight.T))
    if tid2eid is not None:
        if token_ids is None:
            raise ValueError("hash routing needs the token ids of the sequence")
        expert_ids = tid2eid[token_ids]
    else:
        assert bias is not None, "learned routing needs ffn.gate.bias"
        expert_ids = stable_topk_indices(scores + bias, k)
    w = scores.gather(-1, expert_ids)
    w = w / w.sum(-1, keepdim=True) * routed_scaling
    return Routing(scores, expert_ids, w)


def swiglu_expert(y: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor, limit: float) -> torch.Tensor:
    """§6.2: g = W1·y, u = W3·y; g ≤ limit (one-sided), u ∈ [−limit, limit]; out = W2·(silu(g)·u).
    The official code skips the clamp when limit ≤ 0 (transformers clamps unconditionally); we follow official."""
    g = y @ w1.T
    u = y @ w3.T
    if limit > 0:
        g = torch.clamp(g, max=limit)
        u = torch.clamp(u, -limit, limit)
    return (F.silu(g) * u) @ w2.T


def expert_groups(expert_ids: torch.Tensor) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(expert, tokens, pairs) for every expert some token picked: the tokens in ascending order and their flat
    (token·k + slot) pair indices — what `torch.nonzero(expert_ids == e)` gives per expert, from one stable sort of
    the pairs by expert and one host read (the per-expert counts) instead of a search and a read per expert."""
    flat = expert_ids.flatten()
    order = torch.argsort(flat, stable=True)  # by expert; within an expert, pairs (hence tokens) in ascending order
    counts = torch.bincount(flat).tolist()
    tokens = order // expert_ids.shape[-1]
    groups, start = [], 0
    for e, n in enumerate(counts):
        if n:
            groups.append((e, tokens[start : start + n], order[start : start + n]))
            start += n
    return groups


def moe_forward(y: torch.Tensor, routing: Routing,
                expert_weights: Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                shared_weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, limit: float) -> torch.Tensor:
    """Σ_{e∈ids} w_e·expert_e(y) + shared(y). Tokens are grouped per expert; expert weights are
    materialised one expert at a time (`expert_weights(e)` -> (w1, w3, w2)) so only one is resident.
    Each (token, slot) result lands in its own row of a [S, k, D] buffer, summed over slots in slot order."""
    S, k = routing.expert_ids.shape
    per_slot = torch.empty(S * k, y.shape[-1], dtype=y.dtype, device=y.device)  # every pair is written once
    weights = routing.weights.flatten()
    for e, tokens, pairs in expert_groups(routing.expert_ids):
        w1, w3, w2 = expert_weights(e)
        per_slot[pairs] = swiglu_expert(y[tokens], w1, w3, w2, limit) * weights[pairs, None]
    out = per_slot.view(S, k, -1).sum(1)
    if shared_weights is not None:
        out = out + swiglu_expert(y, *shared_weights, limit)
    return out
