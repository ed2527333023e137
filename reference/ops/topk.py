"""Top-k with a defined order among exact ties: the lower index wins.

`torch.topk` orders equal scores by nothing stable (it changes with the row length and the
device), so the same position of a prompt prefix and of the whole prompt could select different
rows on the indexer's ReLU zero plateau (DESIGN §10). A stable descending sort makes the choice a
function of the scores alone.
"""

from __future__ import annotations

import torch


def stable_topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries along the last dim, ties broken by the lower index, best first."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return order[..., :k]
