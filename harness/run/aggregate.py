"""Aggregation of per-position metric values into position bins.

A layer's values arrive in many small pieces (one per query block, decode step and tap). They are kept
per (tap, metric) as they come, on the device that computed them, and reduced once, when the layer's rows are
written: count, sum, max, and for ratio metrics the summed numerator and denominator, per bin, each summed in
arrival order. Holding one layer's values costs O(positions) per metric; reducing them in one pass instead of
one pass per piece removes ~5 small tensor ops per piece (tens of thousands per run), and copying every piece
to the host in one transfer when the rows are written, instead of one per piece, removes a device
synchronisation per piece (issue #14: ~80,000 per Flash layer at 30K tokens). For the same reason a piece may
carry a mask of the positions that have a value (MetricValues.keep), applied here on the host: a comparison never
waits for the device to learn how many positions it keeps.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field

import torch

from harness.run.bins import BinPlan
from harness.run.metrics import RATIO_COMBINE, MetricValues


@dataclass
class _Pieces:
    """One (tap, metric)'s values in arrival order: the positions that bin them, values and (ratio metrics)
    numerators, denominators — each piece on the device it was computed on, values in fp64 (an exact widening)."""

    combine: str | None
    positions: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)
    num: list[torch.Tensor] = field(default_factory=list)
    den: list[torch.Tensor] = field(default_factory=list)
    keep: list[torch.Tensor | None] = field(default_factory=list)  # per piece its mask (MetricValues.keep) or None
    arrivals: list[int] = field(default_factory=list)  # per piece, its number in the layer's arrival order


@dataclass
class LayerAccumulator:
    """All metrics of one (variant, mode, layer)."""

    plan: BinPlan
    pieces: dict[tuple[str, str], _Pieces] = field(default_factory=dict)
    arrived: int = 0  # pieces added so far

    def add(self, tap: str, values: MetricValues, bin_positions: torch.Tensor | None = None) -> None:
        """Keep; `bin_positions` overrides the positions used for binning (compressed rows)."""
        if values.positions.numel() == 0:
            return
        if values.keep is not None and (values.keep.shape != values.value.shape or values.keep.dtype != torch.bool):
            raise ValueError(f"{tap} {values.metric}: mask of shape {tuple(values.keep.shape)} and dtype "
                             f"{values.keep.dtype} for values of shape {tuple(values.value.shape)}: "
                             "a bool mask per value")
        p = self.pieces.get((tap, values.metric))
        if p is None:
            p = self.pieces[(tap, values.metric)] = _Pieces(values.combine)
        p.positions.append(values.positions if bin_positions is None else bin_positions)
        p.values.append(values.value.detach().to(torch.float64))
        if values.num is not None:
            p.num.append(values.num.detach().to(torch.float64))
            p.den.append(values.den.detach().to(torch.float64))
        p.keep.append(None if values.keep is None else values.keep.detach())
        p.arrivals.append(self.arrived)
        self.arrived += 1

    def copy(self) -> "LayerAccumulator":
        """An accumulator holding the same pieces so far, each to grow on its own (the tensors are shared: nothing
        changes a value once it is kept)."""
        return LayerAccumulator(self.plan, {key: _Pieces(p.combine, list(p.positions), list(p.values), list(p.num),
                                                         list(p.den), list(p.keep), list(p.arrivals))
                                            for key, p in self.pieces.items()}, self.arrived)

    def _on_host(self) -> dict[tuple[str, str], tuple[torch.Tensor | None, ...]]:
        """Every piece on the host, concatenated per (tap, metric) and field in arrival order: (positions, values,
        numerators, denominators, masks), numerators and denominators None for mean metrics, masks None when no
        piece has one (all True for a piece without). The pieces held on a device travel in one copy per dtype."""
        lists = [(key, name, part) for key, p in self.pieces.items()
                 for name, part in (("positions", p.positions), ("values", p.values), ("num", p.num),
                                    ("den", p.den), ("keep", [k for k in p.keep if k is not None])) if part]
        on_device: dict[torch.dtype, list[torch.Tensor]] = {}
        for _, _, part in lists:
            for t in part:
                if t.device.type != "cpu":
                    on_device.setdefault(t.dtype, []).append(t.flatten())
        host = {dtype: iter(torch.cat(ts).cpu().split([t.numel() for t in ts])) for dtype, ts in on_device.items()}
        out: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
        for key, name, part in lists:
            parts = [next(host[t.dtype]) if t.device.type != "cpu" else t.flatten() for t in part]
            if name == "keep":  # the masks in piece order, all True for a piece that came without one
                masks = iter(parts)
                parts = [torch.ones(v.numel(), dtype=torch.bool) if k is None else next(masks)
                         for k, v in zip(self.pieces[key].keep, self.pieces[key].values)]
            out.setdefault(key, {})[name] = torch.cat(parts)
        return {key: (f["positions"], f["values"], f.get("num"), f.get("den"), f.get("keep")) for key, f in out.items()}

    def _kept_on_host(self) -> dict[tuple[str, str], tuple[torch.Tensor | None, ...]]:
        """_on_host with the masked positions dropped, per (tap, metric) that kept any, ordered by the first piece
        that kept a position: as if every piece had been cut to its kept positions before it was added (where an
        empty piece is not kept), so the rows are the same, in the same order, as with pieces cut on the device."""
        kept, first = {}, {}
        for key, (positions, v, num, den, keep) in self._on_host().items():
            arrivals = self.pieces[key].arrivals
            if keep is None:
                kept[key], first[key] = (positions, v, num, den), arrivals[0]
                continue
            at = torch.nonzero(keep)
            if at.numel():  # the piece holding the first kept position: the first whose end lies past it
                ends = list(itertools.accumulate(t.numel() for t in self.pieces[key].values))
                kept[key] = (positions[keep], v[keep], None if num is None else num[keep],
                             None if den is None else den[keep])
                first[key] = arrivals[bisect.bisect_right(ends, int(at[0]))]
        return {key: kept[key] for key in sorted(kept, key=first.__getitem__)}

    def rows(self, variant: str, mode: str, layer: int) -> list[dict]:
        n = len(self.plan)
        out = []
        for (tap, metric), (positions, v, num, den) in self._kept_on_host().items():
            p = self.pieces[(tap, metric)]
            bins = self.plan.bin_ids(positions)
            zeros = torch.zeros(n, dtype=torch.float64)
            count = zeros.index_add(0, bins, torch.ones_like(v))
            peak = torch.full((n,), -math.inf, dtype=torch.float64).scatter_reduce_(0, bins, v, reduce="amax")
            if p.combine is not None:
                value = RATIO_COMBINE[p.combine](zeros.index_add(0, bins, num), zeros.index_add(0, bins, den))
            else:
                value = zeros.index_add(0, bins, v) / count.clamp_min(1)
            value_of, peak_of, count_of = value.tolist(), peak.tolist(), count.tolist()
            for b in torch.nonzero(count > 0).flatten().tolist():
                bin_ = self.plan.bins[b]
                out.append({
                    "variant": variant, "mode": mode, "layer": layer, "phase": bin_.phase, "chunk": bin_.chunk,
                    "step": bin_.step, "turn": bin_.turn, "pos_bin": bin_.start, "pos_end": bin_.end, "tap": tap,
                    "metric": metric, "value": value_of[b], "max": peak_of[b], "count": int(count_of[b]),
                })
        return out
