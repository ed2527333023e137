"""Lightning indexer (spec §5.3): which compressed rows a CSA query attends to.

I_{t,w} = Σ_h wgt_h · ReLU(qI_h · kI_w), wgt = (x_t · weights_proj^T) · d_I^-0.5 · n_I^-0.5. Rows not yet
visible (w ≥ floor((t+1)/4)) are masked before the top-k; k = min(index_topk, visible rows); exact ties
go to the lower row index.
"""

from __future__ import annotations

import torch

from reference.ops.compressor import visible_rows
from reference.quant import FP8_MAX
from reference.ops.topk import stable_topk_set


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [B, n_I, d_I], weights [B, n_I], keys [R, d_I] -> scores [B, R]."""
    dots = q @ keys.T  # qI_h · kI_w: [B, n_I, R]
    return (weights.unsqueeze(-1) * torch.relu(dots)).sum(1)


E4M3_ROUNDING_VAR = 2.0**-6 / 12
"""Variance of one e4m3 rounding, relative to x²: round to nearest leaves an error uniform within half an ulp, and
an ulp is at most 2^-3·|x| (3 mantissa bits), so the variance is at most (2^-3·|x|)²/12."""

E4M3_SUBNORMAL_PAD = 2.0**-6 / FP8_MAX
"""Below 2^-6 (e4m3's smallest normal) a scaled value is subnormal, its ulp 2^-9 = 2^-3 of 2^-6: padding each
magnitude by 2^-6 of its row's scale (amax/448) keeps 'ulp ≤ 2^-3 of the padded magnitude' for every value."""

FP8_AMAX_FLOOR = 1e-4
"""The per-row quantizers' amax floor (spec §7: scale = max(amax, 1e-4)/448)."""

Q_ROUNDINGS = 3
"""FP8 roundings on the stock indexer's query path (spec §7.1, optimized-stack §3.1): the activations of wq_a and of
the indexer's wq_b, then q itself; the keys are rounded once (the compressor runs in fp32 and bf16). An upstream
rounding reaches q through a GEMM, which spreads it over a head's elements rather than in proportion to each;
counting it like q's own rounding is an approximation, checked on a simulated GEMM chain with outlier channels
(tests/test_metrics.py: the same spread of the error in units of σ as a spread model gives, for random weights)."""


def fp8_score_noise(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The standard deviation of the stock FP8 indexer's error in each score I_{t,w}: q [B, n_I, d_I], weights
    [B, n_I], keys [R, d_I] -> [B, R]. A probe quantity, not part of the model: the boundary recall (harness
    metrics) does not count a pick as lost when FP8 rounding could have reordered it.

    Each rounded value x carries an independent error of variance ≤ E4M3_ROUNDING_VAR·x̃² (x̃ = |x| + the
    subnormal pad of its row's scale, max(amax, 1e-4)/448: spec §7). With a_h = wgt_h·[qI_h·kI_w > 0] (ReLU
    passes an error where the dot is positive) the score error is Σ_h a_h·Σ_d (δq_hd·k_wd + q_hd·δk_wd); its
    variance is Σ_h a_h²·Σ_d var(δq_hd)·k_wd² + Σ_d var(δk_wd)·(Σ_h a_h·q_hd)² — a key's rounding is shared by
    every head, so its term sums the heads before squaring. The query side counts Q_ROUNDINGS roundings of q's
    size. The error is a sum of n_I·d_I such terms, Gaussian to good approximation; a worst-case bound
    (Σ|terms|·2^-3) would be ~50× this at Flash width and exceed most scores, leaving no pick outside it.
    """
    def padded_sq(x: torch.Tensor) -> torch.Tensor:
        mag = x.abs()
        return (mag + E4M3_SUBNORMAL_PAD * mag.amax(-1, keepdim=True).clamp_min(FP8_AMAX_FLOOR)) ** 2

    a = weights.unsqueeze(-1) * (q @ keys.T > 0)  # [B, n_I, R]
    from_q = Q_ROUNDINGS * (a**2 * (padded_sq(q) @ keys.T**2)).sum(1)
    heads_summed = torch.einsum("bhr,bhd->brd", a, q)  # Σ_h a_h·q_hd: [B, R, d_I]
    from_k = (heads_summed**2 * padded_sq(keys)).sum(-1)
    return (E4M3_ROUNDING_VAR * (from_q + from_k)).sqrt()


def select_rows(scores: torch.Tensor, positions: torch.Tensor, ratio: int, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal top-k: returns row ids [B, k'] (k' = min(topk, R)) and a validity mask [B, k'].

    Rows come in ascending index order. All visible rows are taken when there are at most `topk` of them;
    entries past a query's visible count are padding (valid = False).
    """
    n_rows = scores.shape[-1]
    visible = visible_rows(positions, ratio)  # [B]
    row_ids = torch.arange(n_rows, device=scores.device)
    if n_rows <= topk:  # at most k rows exist: every visible one is taken, no ranking needed
        chosen = row_ids.expand(scores.shape[0], n_rows)
    else:
        chosen = stable_topk_set(scores.masked_fill(row_ids[None, :] >= visible[:, None], float("-inf")), topk)
    return chosen, chosen < visible[:, None]  # not-yet-visible rows (−inf) fill a query's places last
