"""The probe stream: named taps that every stack emits identically (DESIGN §3, Probes).

A stack calls `sink.emit(tap, positions, **tensors)` at fixed points of each layer; `positions` are
the absolute token positions [B] that the tensors' first dimension is aligned with (on the stack's device, or,
for a sampled tap, on the host: `sampled_positions_on_host`, which a sink reads without waiting for the device).
The harness implements the sink (pairing reference and variant taps, computing metrics as they stream past);
the model code only needs this protocol, so `reference/` never imports `harness/`.

Canonical taps (values are keyword tensors; [B] = the positions given):
  layer.in            streams [B, n, D]
  attn.hc / ffn.hc    pre [B, n], post [B, n], comb [B, n, n], mixed [B, D] (the sub-layer input a)
  attn.q              q [B, H, d] (after per-head norm and RoPE)
  attn.kv             kv [B, d] (as stored in the window cache)
  compressor.rows     rows [R, d], row_ids [R] (rows emitted by this call; `positions` = row start w·m)
  indexer.rows        rows [R, d_I], row_ids [R]
  indexer.scores      scores [B, R_total] over every row emitted so far (−inf where not visible)
  indexer.selected    row_ids [B, k], valid [B, k]
  attn.probs          window_pos [B, Kw], comp_rows [B, Kc], probs [B, H, Kw+Kc], sink_prob [B, H],
                      max_logit [B, H] — sampled: a stack may emit only the positions `sampled()` selects
  attn.lse            lse [B, H]
  attn.out            out [B, D] (attention sub-layer output, before HC_post)
  moe.router          scores [B, E], expert_ids [B, k], weights [B, k]
  moe.out             out [B, D]
  layer.out           streams [B, n, D]
"""

from __future__ import annotations

from typing import Protocol

import torch


class ProbeSink(Protocol):
    def wants(self, tap: str) -> bool:
        """False lets a stack skip building a tap's tensors."""
        ...

    def emit(self, tap: str, positions: torch.Tensor, **values: torch.Tensor) -> None:
        ...

    def sampled(self, positions: torch.Tensor) -> torch.Tensor:
        """Which of these positions the sink wants expensive taps (attn.probs, indexer.scores) for: a bool mask on
        the positions' device, which may be the host's (sampled_positions_on_host asks with host positions)."""
        ...


def sampled_offsets(sink: ProbeSink, first: int, count: int, device: torch.device) -> torch.Tensor:
    """Offsets in [0, count) of the positions first … first + count − 1 that `sink` samples, an int64 tensor on
    `device`. A sink that knows its mask on the host answers through its own `sampled_offsets(first, count, device)`
    without reading the device (a GPU decode step would otherwise wait for its queue to drain once per query
    block); any other sink is asked `sampled()` and the answer read back."""
    own = getattr(sink, "sampled_offsets", None)
    if own is not None:
        return own(first, count, device)
    return torch.nonzero(sink.sampled(torch.arange(first, first + count, device=device))).flatten()


def sampled_positions_on_host(sink: ProbeSink, first: int, count: int) -> torch.Tensor:
    """The positions among first … first + count − 1 that `sink` samples, as an int64 tensor on the host: the same
    numbers as `first + sampled_offsets(sink, first, count, device)`, for a sampled tap's emission (attn.probs,
    indexer.scores) to give. The sinks read a sampled tap's positions on the host (which to keep, where to file
    them), and on a GPU a read of device positions waits for every queued kernel: the reference's and the
    yardstick's emissions were one such wait per query block and tap (at 30,720 + 64 tokens, 121 blocks — 120 of
    256 prefill queries, the decode tokens as one segment — so 2 × 121 = 242 reads in the reference's record, which
    files both taps, and 121 in each yardstick comparison, which holds attn.probs: bench/launch_count.py)."""
    return first + sampled_offsets(sink, first, count, torch.device("cpu"))


class NullSink:
    """Wants nothing; the default when no harness is listening."""

    def wants(self, tap: str) -> bool:
        return False

    def emit(self, tap: str, positions: torch.Tensor, **values: torch.Tensor) -> None:
        pass

    def sampled(self, positions: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(positions, dtype=torch.bool)

    def sampled_offsets(self, first: int, count: int, device: torch.device) -> torch.Tensor:
        return torch.zeros(0, dtype=torch.int64, device=device)


NULL_SINK = NullSink()
