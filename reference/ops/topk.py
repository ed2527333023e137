"""Top-k with a defined order among exact ties: the lower index wins.

`torch.topk` orders equal scores by nothing stable (it changes with the row length and the
device), so the same position of a prompt prefix and of the whole prompt could select different
rows on the indexer's ReLU zero plateau (DESIGN §10). The choice here is a function of the scores
alone: exactly the first k entries of a stable descending sort.

Two forms:
- `stable_topk_indices` — ranked, best first (the router: k = 6 of a few hundred experts). A top-k over
  int64 keys `(order(score) << 32) | (2^32 − 1 − index)`: `order` maps fp32 bit patterns to int32
  monotonically (−0.0 folded onto +0.0, as the comparison does), so keys are distinct, larger scores
  win and equal scores go to the lower index. Identical to the stable sort, 2–3× cheaper.
- `stable_topk_set` — the same set in ascending index order (the indexer: 512 of thousands of rows,
  where only the set matters). On a CPU an unranked top-k finds the k-th largest value v; every score > v
  is in, and the lowest-index scores == v fill the rest: about twice as fast as the ranked form at
  [3072 × 2000] → 512. It reads three or four values on the host per call (whether rows are crowded, whether
  NaN broke the count, the chosen entries' positions), and on a GPU each read waits for every queued kernel:
  at 30,720 tokens the reference's and the yardstick's prefill stacks read 120 times each per CSA layer, and
  the device sat idle 0.2–0.3 s in each of them (bench/launch_count.py --kernels on an H100). There the
  ranked form, sorted by index, gives the same set without a host read.
"""

from __future__ import annotations

import torch


QUIET_NAN_BITS = 0x7FC00000
"""The one fp32 NaN every NaN is ranked as: above +inf (0x7F800000), where torch.sort and torch.topk put NaN."""


def _ordered_int32(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> int64 holding an int32 that orders like the floats (−0.0 == +0.0; −inf lowest; every NaN above +inf).

    A NaN's sign and payload are not the scores' to choose: the CPU's cast of float("nan") to bf16 makes a negative
    NaN (0xFFFF), which the CPU's widening and `+ 0.0` keep, while an H100 given those bits ranked it as a positive
    NaN (CUDA arithmetic returns its canonical NaN; 2026-12-07, torch 2.11/2.13), so ranked by its bits it was last
    on one device and first on the other. Every NaN is ranked as QUIET_NAN_BITS instead, the order the float64
    path's torch.sort gives."""
    bits = (x + 0.0).view(torch.int32).to(torch.int64)  # + 0.0 turns −0.0 into +0.0
    bits = torch.where(torch.isnan(x), QUIET_NAN_BITS, bits)
    return torch.where(bits >= 0, bits, -(2**31) - 1 - bits)


def stable_topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries along the last dim, ties broken by the lower index, best first."""
    if scores.dtype == torch.float64:
        return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    n = scores.shape[-1]
    index = torch.arange(n, device=scores.device, dtype=torch.int64)
    keys = (_ordered_int32(scores.float().contiguous()) << 32) | (2**32 - 1 - index)
    return torch.topk(keys, k, dim=-1, sorted=True).indices


def reads_stall(device: torch.device) -> bool:
    """Whether a host read on `device` waits for queued work (a GPU's): stable_topk_set then takes the ranked form,
    which reads nothing. bench/launch_count.py models a GPU on any machine by answering True."""
    return device.type == "cuda"


def stable_topk_set(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The indices `stable_topk_indices` picks for 2-D scores [B, n], in ascending index order: [B, k]."""
    if reads_stall(scores.device):
        return stable_topk_indices(scores, k).sort(-1).values
    kth = torch.topk(scores, k, dim=-1, sorted=False).values.amin(-1, keepdim=True)  # the k-th largest value
    take = scores >= kth
    crowded = take.sum(-1) > k  # rows where more entries tie with the k-th value than places are left
    if bool(crowded.any()):
        rows = torch.nonzero(crowded).flatten()
        s, v = scores[rows], kth[rows]
        tie = s == v
        above = s > v
        take[rows] = above | (tie & (tie.cumsum(-1) <= k - above.sum(-1, keepdim=True)))  # lowest indices first
    if int(take.sum()) != take.shape[0] * k:  # NaN scores compare false everywhere: the ranked form (NaN first)
        return stable_topk_indices(scores, k).sort(-1).values
    return torch.nonzero(take)[:, 1].view(scores.shape[0], k)
