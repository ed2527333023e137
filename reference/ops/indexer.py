"""Lightning indexer (spec §5.3): which compressed rows a CSA query attends to.

I_{t,w} = Σ_h wgt_h · ReLU(qI_h · kI_w), wgt = (x_t · weights_proj^T) · d_I^-0.5 · n_I^-0.5. Rows not yet
visible (w ≥ floor((t+1)/4)) are masked before the top-k; k = min(index_topk, visible rows); exact ties
go to the lower row index.
"""

from __future__ import annotations

import torch

from reference.ops.compressor import visible_rows
from reference.ops.topk import stable_topk_set


def indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """q [B, n_I, d_I], weights [B, n_I], keys [R, d_I] -> scores [B, R]."""
    dots = q @ keys.T  # qI_h · kI_w: [B, n_I, R]
    return (weights.unsqueeze(-1) * torch.relu(dots)).sum(1)


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
