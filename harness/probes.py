"""Probe sinks: the reference's taps recorded by position, every other stack's taps compared on arrival.

Layer-major lockstep (DESIGN §3): the reference runs layer L first with a `RecordingSink`; each variant
then runs layer L with a `ComparingSink` that looks up the reference's values at the same absolute
positions, turns both into metric values (harness.metrics) and folds them into bins. Dense taps are kept
for every position (O(T·D) per tap, never T×T); attention rows and indexer scores only at sampled
positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from harness.aggregate import LayerAccumulator
from harness.metrics import COMPARATORS, CompareContext, MetricValues, compare_indexer_scores

DENSE_TAPS = ("attn.out", "moe.out", "attn.hc", "ffn.hc", "attn.lse", "moe.router", "indexer.selected", "layer.out")
ROW_TAPS = ("compressor.rows", "indexer.rows")
SAMPLED_TAPS = ("attn.probs", "indexer.scores")
FINITE_CHECKED_TAPS = ("attn.hc", "attn.lse", "attn.out", "ffn.hc", "moe.router", "moe.out", "layer.out")
"""Taps checked for NaN/Inf, in data-flow order (none of them carries −inf as a mask value)."""


@dataclass
class Finding:
    """The first non-finite value a stack produced."""

    variant: str
    mode: str
    layer: int
    tap: str
    field: str
    phase: str
    position: int

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _fill(v: torch.Tensor) -> float | int | bool:
    """Padding for ragged taps: −1 for ids, False for masks, 0 for values."""
    if v.dtype == torch.bool:
        return False
    return 0 if v.is_floating_point() else -1


def _pad_last(v: torch.Tensor, width: int) -> torch.Tensor:
    if v.shape[-1] == width:
        return v
    pad = torch.full((*v.shape[:-1], width - v.shape[-1]), _fill(v), dtype=v.dtype, device=v.device)
    return torch.cat([v, pad], -1)


class RecordingSink:
    """Keeps the reference's taps of one layer, indexed by absolute position (or compressed row id)."""

    def __init__(self, n_positions: int, sampled: torch.Tensor, dump: "DumpSink | None" = None) -> None:
        self.n = n_positions
        self.sampled_mask = sampled  # [T] bool
        self.dense: dict[str, dict[str, torch.Tensor]] = {}
        self.rows: dict[str, dict[str, torch.Tensor]] = {}
        self.samples: dict[str, dict[int, dict[str, torch.Tensor]]] = {t: {} for t in SAMPLED_TAPS}
        self.dump = dump

    def wants(self, tap: str) -> bool:
        return tap in DENSE_TAPS or tap in ROW_TAPS or tap in SAMPLED_TAPS or (self.dump is not None and self.dump.wants(tap))

    def sampled(self, positions: torch.Tensor) -> torch.Tensor:
        return self.sampled_mask[positions.cpu()].to(positions.device)

    def emit(self, tap: str, positions: torch.Tensor, **values: torch.Tensor) -> None:
        if self.dump is not None and self.dump.wants(tap):
            self.dump.emit(tap, positions, **values)
        if tap in DENSE_TAPS:
            store = self.dense.setdefault(tap, {})
            for name, v in values.items():
                if name not in store:
                    store[name] = torch.full((self.n,) + tuple(v.shape[1:]), _fill(v), dtype=v.dtype, device=v.device)
                if v.dim() == 2 and v.shape[1] != store[name].shape[1]:  # ragged picks (k grows with the rows)
                    width = max(v.shape[1], store[name].shape[1])
                    store[name] = _pad_last(store[name], width)
                    v = _pad_last(v, width)
                store[name][positions] = v
        elif tap in ROW_TAPS:
            store = self.rows.setdefault(tap, {})
            ids = values["row_ids"]
            for name, v in values.items():
                if name == "row_ids":
                    continue
                if name not in store:
                    store[name] = torch.zeros((self.n,) + tuple(v.shape[1:]), dtype=v.dtype, device=v.device)
                store[name][ids] = v
        elif tap in SAMPLED_TAPS:
            keep = torch.nonzero(self.sampled_mask[positions.cpu()]).flatten()
            for i in keep.tolist():
                self.samples[tap][int(positions[i])] = {k: v[i].detach().cpu() for k, v in values.items()}

    def at(self, tap: str, positions: torch.Tensor) -> dict[str, torch.Tensor]:
        return {k: v[positions] for k, v in self.dense[tap].items()}

    def rows_at(self, tap: str, row_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return {k: v[row_ids] for k, v in self.rows[tap].items()}

    def samples_at(self, tap: str, positions: list[int]) -> dict[str, torch.Tensor]:
        """Stack the recorded sampled entries, padding ragged key lists (comp_rows −1, probs 0)."""
        entries = [self.samples[tap][p] for p in positions]
        out = {}
        for name in entries[0]:
            parts = [e[name] for e in entries]
            width = max(p.shape[-1] for p in parts) if parts[0].dim() else 0
            if parts[0].dim() == 0 or all(p.shape[-1] == width for p in parts):
                out[name] = torch.stack(parts)
                continue
            fill = -1 if not parts[0].is_floating_point() else (float("-inf") if name == "scores" else 0.0)
            out[name] = torch.stack([torch.nn.functional.pad(p, (0, width - p.shape[-1]), value=fill) for p in parts])
        return out


@dataclass
class ComparingSink:
    """Compares one stack's taps of one layer with the reference's, accumulating metrics per bin."""

    record: RecordingSink
    acc: LayerAccumulator
    ctx: CompareContext
    variant: str
    mode: str
    layer: int
    phase_of: torch.Tensor  # [T] 0 prefill / 1 decode
    findings: list[Finding]
    dump: "DumpSink | None" = None
    _pending_scores: dict[int, Any] = field(default_factory=dict)

    def wants(self, tap: str) -> bool:
        return (tap in COMPARATORS and (tap in self.record.dense or tap in self.record.rows or tap == "attn.probs")) \
            or (self.dump is not None and self.dump.wants(tap))

    def sampled(self, positions: torch.Tensor) -> torch.Tensor:
        return self.record.sampled(positions)

    def emit(self, tap: str, positions: torch.Tensor, **values: torch.Tensor) -> None:
        if self.dump is not None and self.dump.wants(tap):
            self.dump.emit(tap, positions, **values)
        self._check_finite(tap, positions, values)
        if tap not in COMPARATORS:
            return
        if tap in ROW_TAPS:
            ids = values["row_ids"]
            ref = self.record.rows_at(tap, ids)
            row_end = positions + self.ctx.ratio - 1  # a row belongs to the bin of the token that completed it
            for mv in COMPARATORS[tap](positions.cpu(), ref, values, self.ctx):
                self.acc.add(tap, mv, bin_positions=row_end.cpu())
            return
        if tap == "attn.probs":
            sampled = [int(p) for p in positions.tolist() if int(p) in self.record.samples["attn.probs"]]
            if not sampled:
                return
            index = {int(p): i for i, p in enumerate(positions.tolist())}
            pick = torch.tensor([index[p] for p in sampled])
            var = {k: v[pick.to(v.device)].cpu() for k, v in values.items()}
            ref = self.record.samples_at("attn.probs", sampled)
            self._add(tap, COMPARATORS[tap](torch.tensor(sampled), ref, var, self.ctx))
            return
        ref = self.record.at(tap, positions)
        pos_cpu = positions.cpu()
        self._add(tap, COMPARATORS[tap](pos_cpu, ref, values, self.ctx))
        if tap == "indexer.selected":
            self._boundary_recall(positions, ref, values)

    def _boundary_recall(self, positions: torch.Tensor, ref_sel: dict, var_sel: dict) -> None:
        scored = self.record.samples["indexer.scores"]
        picks = [i for i, p in enumerate(positions.tolist()) if p in scored]
        if not picks:
            return
        idx = torch.tensor(picks)
        pos = positions.cpu()[idx]
        ref_scores = self.record.samples_at("indexer.scores", pos.tolist())
        mv = compare_indexer_scores(pos, ref_scores, None, self.ctx,
                                    {k: v[idx.to(v.device)] for k, v in ref_sel.items()},
                                    {k: v[idx.to(v.device)] for k, v in var_sel.items()})
        self._add("indexer.scores", mv)

    def _add(self, tap: str, values: list[MetricValues]) -> None:
        for mv in values:
            self.acc.add(tap, mv)

    def _check_finite(self, tap: str, positions: torch.Tensor, values: dict[str, torch.Tensor]) -> None:
        """Record the first tap (in emission order: the data flow) where this stack produced NaN/Inf. Taps off
        the main path are skipped: a non-finite value there reaches attn.out or moe.out in the same layer."""
        if tap not in FINITE_CHECKED_TAPS:
            return
        if any(f.variant == self.variant and f.mode == self.mode for f in self.findings):
            return
        for name, v in values.items():
            if not v.is_floating_point():
                continue
            if bool(torch.isfinite(v.sum(dtype=torch.float64))):  # one reduction; NaN/Inf anywhere poisons it
                continue
            bad = ~torch.isfinite(v)
            if bool(bad.any()):
                first = int(torch.nonzero(bad.flatten(1).any(1) if bad.dim() > 1 else bad).flatten()[0])
                pos = int(positions[first]) if positions.numel() > first else -1
                phase = "decode" if pos >= 0 and bool(self.phase_of[pos]) else "prefill"
                self.findings.append(Finding(self.variant, self.mode, self.layer, tap, name, phase, pos))
                return


class DumpSink:
    """Raw tensors of chosen taps at chosen positions, for deep dives (scenario probes.dump)."""

    def __init__(self, taps: list[str], positions: list[int]) -> None:
        self.taps, self.positions = set(taps), set(positions)
        self.tensors: dict[str, torch.Tensor] = {}
        self.prefix = ""

    def wants(self, tap: str) -> bool:
        return tap in self.taps

    def emit(self, tap: str, positions: torch.Tensor, **values: torch.Tensor) -> None:
        for i, p in enumerate(positions.tolist()):
            if p in self.positions:
                for name, v in values.items():
                    if v.dim() and v.shape[0] == positions.shape[0]:
                        self.tensors[f"{self.prefix}{tap}.{name}@{p}"] = v[i].detach().float().cpu().contiguous()
