"""Manifold-constrained hyper-connections (spec §3): HC_pre with Sinkhorn, HC_post, HC head."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reference.graphs import replay
from reference.ops.norms import unweighted_rms_norm


@dataclass
class HCMix:
    """Per-token mixing weights of one sub-layer: pre [T, n], post [T, n], comb [T, n, n] (C[j, k])."""

    pre: torch.Tensor
    post: torch.Tensor
    comb: torch.Tensor


def hc_mixes(streams: torch.Tensor, fn: torch.Tensor, rms_eps: float) -> torch.Tensor:
    """m = ρ·(fn · x̂) with x̂ = the n·D streams flattened stream-major, ρ = 1/sqrt(mean(x̂²)+rms_eps) (§3.1 steps 1-3)."""
    flat = streams.flatten(-2)  # index k·D + j
    return unweighted_rms_norm(flat, rms_eps) @ fn.T


SINKHORN_GRAPH_ELEMENTS = 1 << 18
"""Sinkhorn inputs up to this many elements replay from a CUDA graph (reference.graphs.replay's max_elements): 16 per
token (n² at n = 4), so prefill chunks of up to 16,384 tokens, where the general cap (graphs.MAX_ELEMENTS, 65,536)
stops at 4,096. Its 4 + 3·(2·iters − 1) small kernels (121 at 20 iterations: a softmax, two copies, sums of 4, adds,
divides) each move 16 fp32 per token — 512 KiB at 8,192 tokens, less than a microsecond of an H100's bandwidth — so
a prefill chunk's Sinkhorn, like a decode step's, costs its launches, and every stack calls it twice per chunk
(HC_pre of attention and of the FFN). A graph's private pool holds the call's live intermediates, a few MiB at 16,384
tokens (an estimate, not measured). The gain is not measured apart: a Flash CSA layer's A/B of this with the
engines' per-tensor picks on an H100 (forty-fourth session, README Benchmarks) was 0.97x, within the lease's noise."""


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """§3.1 step 7: row softmax + eps, column normalise, then (iters−1)× (row normalise, column normalise).

    Every denominator carries +eps; the last step is a column normalisation, so columns sum to ~1.
    """
    c = torch.softmax(logits, dim=-1) + eps
    # iterate on a [j, k, tokens] copy: each row/column sum is then n contiguous vector adds over the tokens
    # instead of many 4-element reductions (same arithmetic, same bits, ~3× faster)
    c = c.movedim((-2, -1), (0, 1)).contiguous()
    c.div_(c.sum(0, keepdim=True) + eps)  # column normalise: Σ_j C[j, k] (in place: c is this function's copy)
    for _ in range(iters - 1):
        c.div_(c.sum(1, keepdim=True) + eps)  # row normalise: Σ_k C[j, k]
        c.div_(c.sum(0, keepdim=True) + eps)
    # back to [tokens, j, k] in memory too: a [T, n, n] view over [n, n, T] storage makes every later
    # Cᵀ·X batched matmul (HC_post) strided, ~20× slower on CPU for the same bits
    return c.movedim((0, 1), (-2, -1)).contiguous()


def hc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
           rms_eps: float, hc_eps: float, sinkhorn_iters: int) -> tuple[torch.Tensor, HCMix]:
    """HC_pre (§3.1): returns the sub-layer input a_t = Σ_k pre_k X_t[k] (un-normalised streams) and the mixes.

    streams [T, n, D]; fn [(2+n)n, n·D]; base [(2+n)n]; scale [3].
    """
    n = streams.shape[-2]
    m = hc_mixes(streams, fn, rms_eps)
    pre = torch.sigmoid(m[..., :n] * scale[0] + base[:n]) + hc_eps
    post = 2 * torch.sigmoid(m[..., n : 2 * n] * scale[1] + base[n : 2 * n])
    comb_logits = (m[..., 2 * n :] * scale[2] + base[2 * n :]).unflatten(-1, (n, n))  # row-major Ĉ[j][k]
    comb = replay(sinkhorn, comb_logits, iters=sinkhorn_iters, eps=hc_eps,  # sinkhorn(…), from a CUDA graph if small
                  max_elements=SINKHORN_GRAPH_ELEMENTS)
    a = (pre.unsqueeze(-1) * streams).sum(-2)
    return a, HCMix(pre, post, comb)


def hc_post(f: torch.Tensor, streams: torch.Tensor, mix: HCMix) -> torch.Tensor:
    """HC_post (§3.2): X'[k] = post_k·f + Σ_j C[j, k]·X[j] — comb contracted over its FIRST index."""
    mixed = mix.comb.transpose(-1, -2) @ streams  # Cᵀ X: Σ_j C[j, k] X[j]
    return mix.post.unsqueeze(-1) * f.unsqueeze(-2) + mixed


def hc_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
            rms_eps: float, hc_eps: float) -> torch.Tensor:
    """HCHead (§3.3): pre_k = sigmoid(m_k·scale + base_k) + hc_eps; h = Σ_k pre_k X[k]; no post, no Sinkhorn."""
    m = hc_mixes(streams, fn, rms_eps)
    pre = torch.sigmoid(m * scale[0] + base) + hc_eps
    return (pre.unsqueeze(-1) * streams).sum(-2)
