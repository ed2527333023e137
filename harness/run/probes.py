"""Probe sinks: the reference's taps recorded by position, every other stack's taps compared on arrival.

Layer-major lockstep (DESIGN §3): the reference runs layer L first with a `RecordingSink`; each variant
then runs layer L with a `ComparingSink` that looks up the reference's values at the same absolute
positions, turns both into metric values (harness.run.metrics) and folds them into bins. Dense taps are kept
for every position (O(T·D) per tap, never T×T); attention rows and indexer scores only at sampled
positions.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from harness.run.aggregate import LayerAccumulator
from harness.run.metrics import COMPARATORS, SITE_COMPARATORS, CompareContext, MetricValues, compare_indexer_scores
from reference import layer as reference_layer
from reference.graphs import clone_together

DENSE_TAPS = ("attn.out", "moe.out", "attn.hc", "ffn.hc", "attn.lse", "moe.router", "indexer.selected", "layer.out")
ROW_TAPS = ("compressor.rows", "indexer.rows")
SAMPLED_TAPS = ("attn.probs", "indexer.scores")
MASKED_FIELDS = {("indexer.scores", "scores")}
"""(tap, field) pairs where −inf is the value of a row the query cannot see, not a fault: only NaN and +inf
count there. Every other floating field of every tap a stack emits to a ComparingSink must be finite."""


def finite_flags(v: torch.Tensor, masked: bool = False) -> torch.Tensor:
    """Per element of a floating tensor: finite (`masked`: finite or −inf, the value of a row the query cannot see).

    The same flags as `torch.isfinite(v)` (and, masked, as `torch.isfinite(v.clamp_min(finfo.min))`) in fewer
    kernels: ATen's isfinite is `(v == v) * (v.abs() != inf)`, four element-wise kernels, where `|v| < inf` is two and
    `v < inf` one. Each comparison is False for NaN (IEEE: every comparison with NaN but != is false), so
    `|v| < inf` holds exactly for the finite values and `v < inf` for those and −inf. The check runs on every
    floating field of every emission a ComparingSink compares: with isfinite, ~1,300 launches per prefill stack and
    mode of a CSA layer at 30K tokens (flash-mini, Flash's structure: bench/launch_count.py; issue #14)."""
    if v.element_size() == 1:  # FP8: CPU kernels lack abs/lt for some formats; the fp32 value is exact (inf, NaN too)
        v = v.float()
    return (v < math.inf) if masked else (v.abs() < math.inf)


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


def _pad_last(v: torch.Tensor, width: int, fill: float | int | bool | None = None) -> torch.Tensor:
    if v.shape[-1] == width:
        return v
    fill = _fill(v) if fill is None else fill
    pad = torch.full((*v.shape[:-1], width - v.shape[-1]), fill, dtype=v.dtype, device=v.device)
    return torch.cat([v, pad], -1)


def stack_samples(entries: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Stack per-position sampled entries whose key lists differ in length, padding each list to the longest:
    ids −1, masks False, values 0, indexer scores −inf. An attn.probs row is [window keys | compressed keys],
    so its two parts are padded separately and each probability stays next to the key it belongs to.

    Consecutive entries of the same shapes (most of a batch: key lists grow with the position only now and then) are
    stacked in one operation and padded together, so a batch costs a few operations per field rather than two or
    three per entry (on a GPU each is a launch; issue #14). Padding and stacking only copy values: the same bits
    as padding entry by entry."""
    runs: list[dict[str, torch.Tensor]] = []  # each run of equal shapes, stacked
    start = 0
    while start < len(entries):
        stop = start + 1
        while stop < len(entries) and all(entries[stop][k].shape == v.shape for k, v in entries[start].items()):
            stop += 1
        runs.append({k: torch.stack([e[k] for e in entries[start:stop]]) for k in entries[start]})
        start = stop
    if len(runs) == 1:
        return runs[0]
    if "probs" in runs[0]:
        w_max = max(r["window_pos"].shape[-1] for r in runs)
        runs = [dict(r, probs=_aligned_probs(r["probs"], r["window_pos"].shape[-1], w_max)) for r in runs]
    out = {}
    for name in runs[0]:
        parts = [r[name] for r in runs]
        if parts[0].dim() == 1:  # one scalar per entry
            out[name] = torch.cat(parts)
            continue
        width = max(p.shape[-1] for p in parts)
        fill = float("-inf") if name == "scores" else None
        out[name] = torch.cat([_pad_last(p, width, fill) for p in parts])
    return out


def _aligned_probs(probs: torch.Tensor, w: int, w_max: int) -> torch.Tensor:
    """attn.probs rows [..., w window keys | compressed keys] with the window part padded to w_max."""
    if w == w_max:
        return probs
    return torch.cat([_pad_last(probs[..., :w], w_max), probs[..., w:]], -1)


class RecordingSink:
    """Keeps the reference's taps of one layer, indexed by absolute position (or compressed row id)."""

    def __init__(self, n_positions: int, sampled: torch.Tensor, dump: "DumpSink | None" = None) -> None:
        self.n = n_positions
        self.sampled_mask = sampled  # [T] bool
        self._sampled_list: list[bool] = sampled.tolist()
        self._mask_on: dict[torch.device, torch.Tensor] = {}  # the mask on each device asked (no sync per query)
        self._sampled_at: list[int] = torch.nonzero(sampled).flatten().tolist()  # the sampled positions, ascending
        self._sampled_on: dict[torch.device, torch.Tensor] = {}  # … on each device asked
        self.dense: dict[str, dict[str, torch.Tensor]] = {}
        self.rows: dict[str, dict[str, torch.Tensor]] = {}
        self.samples: dict[str, dict[int, dict[str, torch.Tensor]]] = {t: {} for t in SAMPLED_TAPS}
        self.dump = dump

    def wants(self, tap: str) -> bool:
        """Every tap the comparisons need, and those asked to be dumped."""
        return tap in DENSE_TAPS or tap in ROW_TAPS or tap in SAMPLED_TAPS \
            or (self.dump is not None and self.dump.wants(tap))

    def sampled(self, positions: torch.Tensor) -> torch.Tensor:
        mask = self._mask_on.get(positions.device)
        if mask is None:
            mask = self._mask_on[positions.device] = self.sampled_mask.to(positions.device)
        return mask[positions]

    def sampled_offsets(self, first: int, count: int, device: torch.device) -> torch.Tensor:
        """Offsets of the sampled positions among first … first + count − 1 (reference.probes.sampled_offsets),
        found on the host and sliced from a device copy made once: no device read."""
        on = self._sampled_on.get(torch.device(device))
        if on is None:
            on = self._sampled_on[torch.device(device)] = torch.tensor(self._sampled_at, dtype=torch.int64,
                                                                       device=device)
        lo, hi = bisect.bisect_left(self._sampled_at, first), bisect.bisect_left(self._sampled_at, first + count)
        return on[lo:hi] - first

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
            at = positions.tolist()  # kept where they are: they are compared on their device (metrics.py)
            for i in (i for i, p in enumerate(at) if self._sampled_list[p]):
                self.samples[tap][at[i]] = {k: v[i].detach() for k, v in values.items()}

    def at(self, tap: str, positions: torch.Tensor) -> dict[str, torch.Tensor]:
        return {k: v[positions] for k, v in self.dense[tap].items()}

    def rows_at(self, tap: str, row_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return {k: v[row_ids] for k, v in self.rows[tap].items()}

    def samples_at(self, tap: str, positions: list[int]) -> dict[str, torch.Tensor]:
        """The recorded sampled entries at these positions, stacked (ragged key lists padded: stack_samples)."""
        return stack_samples([self.samples[tap][p] for p in positions])


BATCHED_TAPS = frozenset({
    "layer.out", "attn.out", "moe.out", "attn.hc", "ffn.hc", "attn.lse", "compressor.rows", "indexer.rows",
    "indexer.selected", "attn.site", "attn.hc.site", "ffn.hc.site", "attn.hc.post.site", "ffn.hc.post.site",
    "moe.router.site", "indexer.site", "attn.kv.site", "moe.experts.site", "moe.shared.site"})
"""Taps whose comparator computes each position's values from that position's row alone, over widths that do not
depend on the other rows of the call: comparing one decode step's emission or 64 of them at once gives each
position the same bits on the CPU (the metric pin; on a GPU a reduction over 64 rows may be split differently from
one over a single row, moving an fp64 sum by an ulp). Not moe.router (its dense expert matrix is as wide as the
largest id in the call, and an fp64 row sum's association depends on that width) nor attn.probs (its key lists
grow from step to step; it is held and batched by itself): their deferred emissions are compared one at a time,
as they were on arrival."""

BATCHED_ON_DEVICE_TAPS = frozenset({"moe.router"})
"""Taps batched as BATCHED_TAPS are, but only off the CPU: moe.router's expert matrix is as wide as the largest id in
the call, so batching may re-associate an fp64 row sum of ≤ 2k nonzero terms — on the CPU that would move pinned bits;
on a GPU, where a reduction's split already depends on the number of rows, it moves a value by an ulp, and a decode
step's comparison costs a host read instead of one per 64 steps."""


@dataclass
class ComparingSink:
    """Compares one stack's taps of one layer with the reference's, accumulating metrics per bin.

    A decode step emits each tap for one position, and a prefill query block a block's positions; comparing each
    emission on arrival costs a dozen to a hundred small tensor operations and several device synchronisations per
    tap, which made the probes cost more than the steps they watch (issue #14: at Flash width and 30K tokens,
    indexer.selected alone was ~130 kernels and ~9 host reads per query block, 120 blocks per stack and mode).
    One-position emissions, and on a GPU the query blocks' emissions of BLOCK_TAPS, are kept (cloned: the stack may
    reuse its buffers) and compared when DEFER_EMISSIONS of a tap are waiting, when the tap next arrives with more
    positions, or at finish() — those of BATCHED_TAPS in one call per run of equal field widths, the others one by
    one. Each tap's emissions are compared in emission order, so every bin receives its values in the
    order it did before (and LayerAccumulator sums a layer's values once, in arrival order: the same bits); and a
    step or block no longer waits for the device to read a comparison's result. NaN/Inf checks of deferred
    emissions are made with their batch, and the first non-finite value is still the first in emission order.

    Sampled taps (attention rows, indexer scores) come a few positions per query block or decode step; they are
    held and compared in batches of up to BATCH_POSITIONS, never mixing phases. `finish()` compares what is left."""

    record: RecordingSink
    acc: LayerAccumulator
    ctx: CompareContext
    variant: str
    mode: str
    layer: int
    phase_of: torch.Tensor  # [T] 0 prefill / 1 decode
    findings: list[Finding]
    dump: "DumpSink | None" = None
    _held: dict[str, list[tuple[int, dict[str, torch.Tensor]]]] = field(
        default_factory=lambda: {"attn.probs": [], "indexer.scores": []})
    _deferred: dict[str, list[tuple[int, torch.Tensor, dict[str, torch.Tensor]]]] = field(default_factory=dict)
    """Per tap, deferred emissions not compared yet: (emission number, positions, cloned values)."""
    _emitted: int = 0
    _finite_notes: list[tuple[int, str, list[tuple[str, int, int]], torch.Tensor,
                              tuple[torch.Tensor, torch.Tensor, int]]] = field(default_factory=list)
    """Per emission with floating fields: (emission number, tap, [(field, rows, elements per row)], positions, (its
    check's all-finite flags and first-bad flat indices, one per emission of the check; this emission's index))."""

    BATCH_POSITIONS = 32
    """At Flash width an attention row is compared over ≤ ~2,000 key slots × 64 heads in fp64: 32 positions keep
    a batch's temporaries near 0.5 GB."""
    DEFER_EMISSIONS = 64
    """Deferred emissions of one tap compared together: a Flash decode step's largest deferred field is layer.out
    (4 × 4096 fp32, 64 KB), so a full batch of decode steps holds a few MB; a full batch of 256-query prefill blocks
    of indexer.selected (512 int64 ids and flags per query) ~75 MB."""
    BLOCK_TAPS = frozenset({"indexer.selected", "attn.lse", "attn.site", "indexer.site"})
    """The BATCHED_TAPS a stack emits once per query block of a prefill chunk (the indexer site per chunk, in calls of
    at most a block): on a GPU their emissions of at most reference.layer.MAX_QUERY_BLOCK positions are deferred too
    (read when emitted: a bench that sets another block size defers its blocks as well). Taps emitted
    once per chunk (layer.out, attn.out, the mHC taps, …) are compared as they arrive whatever the chunk's size:
    deferring 64 of those would hold 64 chunks' streams."""
    DEFER_BLOCKS_ON_CPU = False
    """Query blocks are deferred on a GPU only. On the CPU a comparison costs its arithmetic, not its launches, and
    deferring blocks made the demo ~8% slower (the clones and larger temporaries; 117.8 s against 108.3 s wall,
    the same metrics); tests set this to run the deferred path on the CPU."""

    def wants(self, tap: str) -> bool:
        """The taps compared with the reference's, and indexer.scores (at sampled positions) for its NaN/Inf
        check: an indexer fault that poisons the scores changes selections without a non-finite value reaching
        attn.out, so it is checked where it happens."""
        return (tap in COMPARATORS and (tap in self.record.dense or tap in self.record.rows or tap == "attn.probs"
                                        or tap in SITE_COMPARATORS)) \
            or tap == "indexer.scores" or (self.dump is not None and self.dump.wants(tap))

    def sampled(self, positions: torch.Tensor) -> torch.Tensor:
        return self.record.sampled(positions)

    def sampled_offsets(self, first: int, count: int, device: torch.device) -> torch.Tensor:
        return self.record.sampled_offsets(first, count, device)

    def emit(self, tap: str, positions: torch.Tensor, **values: torch.Tensor) -> None:
        if self.dump is not None and self.dump.wants(tap):
            self.dump.emit(tap, positions, **values)
        if positions.numel() == 0:  # no rows (a compressor that completed none this step): no value, no NaN
            return
        number, self._emitted = self._emitted, self._emitted + 1
        n = positions.numel()
        block = tap in self.BLOCK_TAPS and n <= reference_layer.MAX_QUERY_BLOCK \
            and (positions.device.type != "cpu" or self.DEFER_BLOCKS_ON_CPU)
        if (tap in COMPARATORS and positions.dim() == 1 and (n == 1 or block)
                and all(v.dim() and v.shape[0] == n for v in values.values())):
            held = self._deferred.setdefault(tap, [])
            kept = clone_together([positions, *values.values()])  # one copy, not one per field
            held.append((number, kept[0], dict(zip(values, kept[1:]))))
            if len(held) >= self.DEFER_EMISSIONS:
                self._compare_deferred(tap)
            return
        self._compare_deferred(tap)  # this tap's earlier emissions first: bins sum their values in arrival order
        self._check_finite(tap, [number], positions, values, rows_per_emission=None)
        # the accumulator keeps the positions until the layer's rows are made: a copy (on the device, no read), since
        # a stack may hand out a buffer it writes again, as the deferred emissions' clones assume too
        self._compare(tap, positions.clone(), values)

    def fork(self, variant: str) -> "ComparingSink":
        """This sink as `variant`'s, holding what it has compared, deferred and held so far: a variant whose prefill
        is another's continues from it (harness.run.prefill_sharing). The containers are copied; the tensors in them
        are shared, as nothing changes a value once it is kept."""
        return replace(self, variant=variant, acc=self.acc.copy(), _held={k: list(v) for k, v in self._held.items()},
                       _deferred={k: list(v) for k, v in self._deferred.items()},
                       _finite_notes=list(self._finite_notes))

    def _compare(self, tap: str, positions: torch.Tensor, values: dict[str, torch.Tensor]) -> None:
        if tap not in COMPARATORS:
            return
        # positions stay where the stack emitted them: the accumulator brings them to the host with the values when
        # the layer's rows are made (one copy per dtype), where a copy here would wait for the device every time
        if tap in ROW_TAPS:
            ids = values["row_ids"]
            ref = self.record.rows_at(tap, ids)
            row_end = positions + self.ctx.ratio - 1  # a row belongs to the bin of the token that completed it
            for mv in COMPARATORS[tap](positions, ref, values, self.ctx):
                self.acc.add(tap, mv, bin_positions=row_end)
            return
        if tap == "attn.probs":
            self._hold(tap, positions, values, self.record.samples["attn.probs"])
            return
        if tap in SITE_COMPARATORS:  # the variant against the stock op on its own inputs: no reference needed
            self._add(tap, COMPARATORS[tap](positions, None, values, self.ctx))
            return
        ref = self.record.at(tap, positions)
        self._add(tap, COMPARATORS[tap](positions, ref, values, self.ctx))
        if tap == "indexer.selected":  # boundary recall: the selections at positions with recorded scores
            self._hold("indexer.scores", positions, values, self.record.samples["indexer.scores"])

    def _compare_deferred(self, tap: str) -> None:
        """Compare the tap's deferred emissions in emission order: of a BATCHED_TAPS tap (and off the CPU a
        BATCHED_ON_DEVICE_TAPS one), each run of emissions with the same field widths (shapes past the positions) as
        one call; of any other, one call per emission."""
        held = self._deferred.pop(tap, None)
        if not held:
            return

        def widths(entry: tuple[int, torch.Tensor, dict[str, torch.Tensor]]) -> tuple:
            return tuple((k, v.shape[1:], v.dtype) for k, v in entry[2].items())

        batched = tap in BATCHED_TAPS or (tap in BATCHED_ON_DEVICE_TAPS and held[0][1].device.type != "cpu")
        start = 0
        while start < len(held):
            stop = start + 1
            while batched and stop < len(held) and widths(held[stop]) == widths(held[start]):
                stop += 1
            run = held[start:stop]
            positions = torch.cat([p for _, p, _ in run])
            values = {k: torch.cat([v[k] for _, _, v in run]) for k in run[0][2]}
            offset = 0  # NaN/Inf notes per stretch of emissions with as many positions each (a chunk's last block)
            for n, stretch in itertools.groupby(run, key=lambda entry: entry[1].numel()):
                numbers = [number for number, _, _ in stretch]
                rows = slice(offset, offset + n * len(numbers))
                self._check_finite(tap, numbers, positions[rows], {k: v[rows] for k, v in values.items()},
                                   rows_per_emission=n)
                offset = rows.stop
            self._compare(tap, positions, values)
            start = stop

    def _hold(self, tap: str, positions: torch.Tensor, values: dict[str, torch.Tensor], recorded: dict) -> None:
        """Keep the entries of positions the reference sampled, one per position, comparing in batches."""
        held = self._held[tap]
        for i, p in enumerate(positions.tolist()):
            if p not in recorded:
                continue
            if held and (len(held) >= self.BATCH_POSITIONS or self._phases[held[0][0]] != self._phases[p]):
                self._compare_held(tap)
            held.append((p, {k: v[i].detach() for k, v in values.items()}))

    @functools.cached_property
    def _phases(self) -> list[bool]:
        """phase_of as a list: read per held position, a host list costs no tensor operation."""
        return self.phase_of.tolist()

    def finish(self) -> None:
        """Compare the deferred and held entries still waiting and record this stack's first non-finite value, if
        any: call once the stack has run the layer."""
        for tap in list(self._deferred):
            self._compare_deferred(tap)
        for tap in self._held:
            self._compare_held(tap)
        self._record_first_non_finite()

    def _compare_held(self, tap: str) -> None:
        held = self._held[tap]
        if not held:
            return
        positions = [p for p, _ in held]
        pos = torch.tensor(positions)
        var = stack_samples([e for _, e in held])
        held.clear()
        ref = self.record.samples_at(tap, positions)
        if tap == "attn.probs":
            self._add(tap, COMPARATORS[tap](pos, ref, var, self.ctx))
            return
        ref_selected = self.record.at("indexer.selected", pos)
        self._add(tap, compare_indexer_scores(pos, ref, None, self.ctx, ref_selected, var))

    def _add(self, tap: str, values: list[MetricValues]) -> None:
        for mv in values:
            self.acc.add(tap, mv)

    def _check_finite(self, tap: str, numbers: list[int], positions: torch.Tensor, values: dict[str, torch.Tensor],
                      rows_per_emission: int | None) -> None:
        """Note, without waiting for the device, where each emission first holds NaN/Inf in any floating field
        (−inf allowed only as a mask value: MASKED_FIELDS); finish() reads every note at once and records the first
        (in emission order: the data flow) as this stack's finding. `numbers`: the emissions' numbers; with
        `rows_per_emission` None there is one emission, else len(numbers) emissions of that many rows per field,
        concatenated.

        One reduction per call, whatever the number of fields: each field's finite flags are laid out per emission
        (field-major, then row-major), joined, and one `min` over each emission's flags gives both whether all are
        finite and the first flag that is not (min returns the first minimal index) — the first bad field's first
        bad row, found on the host from the fields' sizes. A decode step's batch of a tap with five fields was ~20
        operations (per field isnan/isfinite, not, any; then cat, any, argmax, stack); now each field's flags take one or
        two element-wise kernels (finite_flags), then one cat and one min."""
        if self.has_finding():
            return
        emissions = len(numbers)
        names, flags = [], []
        for name, v in values.items():
            if not v.is_floating_point():
                continue
            rows = v.shape[0] if rows_per_emission is None and v.dim() else rows_per_emission or 1
            per_emission = v.numel() // emissions
            names.append((name, rows, per_emission // rows if rows else 0))
            flags.append(finite_flags(v, masked=(tap, name) in MASKED_FIELDS).reshape(emissions, per_emission))
        if not flags or all(f.numel() == 0 for f in flags):
            return
        good = flags[0] if len(flags) == 1 else torch.cat(flags, 1)
        all_finite, first_bad = good.min(1)  # per emission: False where some flag is False, and the first such
        step = rows_per_emission or positions.numel()
        for i, number in enumerate(numbers):
            self._finite_notes.append((number, tap, names, positions[i * step: (i + 1) * step],
                                       (all_finite, first_bad, i)))

    def has_finding(self) -> bool:
        """Whether this stack and mode already has its first non-finite value (from an earlier layer): no more are
        noted."""
        return any(f.variant == self.variant and f.mode == self.mode for f in self.findings)

    def _record_first_non_finite(self) -> None:
        """One device read for the whole layer: the first emission that held NaN/Inf becomes the Finding."""
        notes, self._finite_notes = sorted(self._finite_notes, key=lambda n: n[0]), []
        if not notes or self.has_finding():
            return
        checks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # each check's flags once, in the order met
        for note in notes:
            checks.setdefault(id(note[4][0]), note[4][:2])
        offsets, start = {}, 0
        for key, (all_finite, _) in checks.items():
            offsets[key], start = start, start + all_finite.numel()
        read = torch.cat([torch.cat([f for f, _ in checks.values()]).long(),
                          torch.cat([b for _, b in checks.values()])]).tolist()
        for (_, tap, names, positions, (all_finite, _, i)) in notes:
            at = offsets[id(all_finite)] + i
            if read[at]:
                continue
            first = read[start + at]
            for name, rows, width in names:
                if first < rows * width:
                    row = first // width
                    pos = int(positions[row]) if positions.numel() > row else -1
                    phase = "decode" if pos >= 0 and bool(self.phase_of[pos]) else "prefill"
                    self.findings.append(Finding(self.variant, self.mode, self.layer, tap, name, phase, pos))
                    return
                first -= rows * width


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
                        # a copy in every case (.float().cpu() of an fp32 CPU tensor is the tensor itself): a later
                        # in-place change to what the stack emitted must not reach the dump
                        self.tensors[f"{self.prefix}{tap}.{name}@{p}"] = v[i].detach().to(
                            "cpu", torch.float32, copy=True).contiguous()
