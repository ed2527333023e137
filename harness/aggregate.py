"""Streaming aggregation of per-position metric values into position bins (no per-position storage).

For every (tap, metric) a layer keeps five per-bin vectors — count, sum, max, and for ratio metrics
the summed numerator and denominator — so a bin's value is exact whatever order positions arrive in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from harness.bins import BinPlan
from harness.metrics import RATIO_COMBINE, MetricValues


@dataclass
class _Sums:
    count: torch.Tensor
    total: torch.Tensor
    peak: torch.Tensor
    num: torch.Tensor
    den: torch.Tensor
    combine: str | None = None


@dataclass
class LayerAccumulator:
    """All metrics of one (variant, mode, layer)."""

    plan: BinPlan
    sums: dict[tuple[str, str], _Sums] = field(default_factory=dict)

    def add(self, tap: str, values: MetricValues, bin_positions: torch.Tensor | None = None) -> None:
        """Accumulate; `bin_positions` overrides the positions used for binning (compressed rows)."""
        if values.positions.numel() == 0:
            return
        n = len(self.plan)
        key = (tap, values.metric)
        s = self.sums.get(key)
        if s is None:
            z = lambda: torch.zeros(n, dtype=torch.float64)  # noqa: E731
            s = self.sums[key] = _Sums(z(), z(), torch.full((n,), -math.inf, dtype=torch.float64), z(), z(),
                                       values.combine)
        bins = self.plan.bin_ids(values.positions if bin_positions is None else bin_positions)
        v = values.value.to("cpu", torch.float64)
        s.count.index_add_(0, bins, torch.ones_like(v))
        s.total.index_add_(0, bins, v)
        s.peak.scatter_reduce_(0, bins, v, reduce="amax")
        if values.num is not None:
            s.num.index_add_(0, bins, values.num.to("cpu", torch.float64))
            s.den.index_add_(0, bins, values.den.to("cpu", torch.float64))

    def rows(self, variant: str, mode: str, layer: int) -> list[dict]:
        out = []
        for (tap, metric), s in self.sums.items():
            used = torch.nonzero(s.count > 0).flatten().tolist()
            if s.combine is not None:
                value = RATIO_COMBINE[s.combine](s.num, s.den)
            else:
                value = s.total / s.count.clamp_min(1)
            for b in used:
                bin_ = self.plan.bins[b]
                out.append({
                    "variant": variant, "mode": mode, "layer": layer, "phase": bin_.phase, "chunk": bin_.chunk,
                    "step": bin_.step, "turn": bin_.turn, "pos_bin": bin_.start, "pos_end": bin_.end, "tap": tap,
                    "metric": metric, "value": float(value[b]), "max": float(s.peak[b]), "count": int(s.count[b]),
                })
        return out
