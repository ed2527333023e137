"""Variants that differ only in decode share one prefill (issue #14: attribution at Flash width).

A patch acts only in the phases it declares (optimized.ops.OpTable builds each phase's op chains from the patches
active in it), and a prefill position never reads a decode position (causal attention, teacher-forced decode).
So two variants whose patches active in prefill are the same — `base` and `only:mma-sparse-decode`, `all` and
`all-but:triton-indexer` — compute the same prefill, bit for bit, at every layer: the same ops on the same inputs
(the embedding at layer 0; each one's own prefill rows after, equal by induction). Attribution over the six built-in
patches runs 14 variants with 10 distinct prefills.

The runner runs the first such variant of a mode in full and keeps, at its first decode step, a copy of its engine
state (paged caches, compressor windows, plugins' `extras`), of its comparing sink (what it compared and holds) and
its prefill output; each later one continues from copies of these with its own decode steps. Whatever could make
the shared prefill differ from the variant's own falls back to running the variant in full: a global input whose
prefill rows differ (a resumed or nondeterministic run), a different NaN/Inf history (a sink stops noting
non-finite values once its stack has a finding), a state that cannot be copied (`copy.deepcopy` raises: a plugin
whose `ctx.state.extras` must not be copied opts out by raising in `__deepcopy__`). Decision forcing (its patch is
made per variant) and dumps (kept per variant and position) are never shared.

A whole layer is shared too, in local mode: a patch that acts only at some layers (Patch.layers_for: the indexer
patches on CSA layers, hash-topk on hash layers) is left out of the other layers' op chains, so there
`only:hash-topk` computes `base`'s layer and `all-but:hash-topk` computes `all`'s — the same ops on the same input,
which in local mode is the reference's for every variant. A pair whose patches acting at the layer, in each phase,
are an earlier pair's takes that pair's rows (its metrics, the needle answer included) under its own name, and its
first non-finite value if the earlier pair found one at this layer and neither had one before; nothing else of a
local pair outlives its layer. At Flash's 43 layers, attribution over the six built-in patches shares 168 of its 602
local pairs' layers this way (the two indexer patches' four variants on 22 layers, hash-topk's two on 40).
"""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from harness.run.probes import ComparingSink, Finding
from harness.run.stream_placement import to_device
from optimized.patching import PatchChoice
from optimized.state import EngineState

PrefillKey = tuple[str, tuple[tuple[int, str], ...]]


def prefill_key(choices: list[PatchChoice], mode: str) -> PrefillKey | None:
    """What decides a variant's prefill in `mode`: its choices active in prefill, in order (a later patch wraps an
    earlier one), each as (the patch object's identity, its options). None for a mode that is never shared."""
    if mode == "forced":
        return None
    return mode, _active_in(choices, "prefill")


def _active_in(choices: list[PatchChoice], phase: str) -> tuple[tuple[int, str], ...]:
    """The choices active in `phase`, in order, each as (the patch object's identity, its options)."""
    return tuple((id(c.patch), repr(sorted(c.options.items()))) for c in choices
                 if phase in c.patch.active_phases(c.options))


@dataclass
class PrefillShare:
    """A variant's layer at its first decode step: what a variant with the same prefill continues from."""

    state: EngineState
    sink: ComparingSink
    had_finding: bool  # the variant had its first non-finite value before this layer: its sink noted none since
    prefill_out: torch.Tensor  # the output rows of the prompt positions
    prefill_in: torch.Tensor | None  # global mode: the variant's own input rows of the prompt (local: the reference's)

    @classmethod
    def at_decode(cls, state: EngineState, sink: ComparingSink) -> "PrefillShare | None":
        """Copies of the state and sink now (the output and input are filled in once the layer has run); None when
        the state cannot be copied (a plugin's `extras`)."""
        try:
            kept = copy.deepcopy(state)
        except Exception:  # noqa: BLE001 — any object a plugin keeps: this variant's prefill is not shared
            return None
        return cls(kept, sink.fork(sink.variant), sink.has_finding(), torch.empty(0), None)

    def fits(self, x_in: torch.Tensor, sink: ComparingSink, n_prompt: int) -> bool:
        """Whether a variant about to run with input `x_in` and a fresh `sink` would compute this prefill: the same
        NaN/Inf history and, in global mode, the same input rows bit for bit (in local mode every variant's input
        is the reference's)."""
        return sink.has_finding() == self.had_finding and (
            self.prefill_in is None or (x_in.dtype == self.prefill_in.dtype and bool(torch.equal(
                _bits(x_in[:n_prompt]), _bits(to_device(self.prefill_in, x_in.device))))))  # kept on the host or not

    def continue_as(self, variant: str) -> tuple[EngineState, ComparingSink]:
        """A state and sink of `variant`'s own to run its decode steps from."""
        return copy.deepcopy(self.state), self.sink.fork(variant)


class SharedPrefills:
    """The shares of one layer: a pair's prefill is kept only when a later pair of this process has the same key,
    and dropped once the last of them has run (at Flash width a local share holds ~1 GB, its bf16 output rows:
    30,784 tokens × 4 streams × 4096 × 2 B; a global share views the next layer's input, or with the streams placed
    on the host, holds host copies of its rows: harness.run.stream_placement)."""

    def __init__(self, keys: dict[tuple[str, str], PrefillKey]) -> None:
        self._waiting = Counter(keys.values())  # pairs of each key not run yet
        self._shares: dict[PrefillKey, PrefillShare | None] = {}  # None: the first could not be kept

    def get(self, key: PrefillKey | None) -> PrefillShare | None:
        return self._shares.get(key) if key is not None else None

    def keeper(self, key: PrefillKey | None, sink: ComparingSink) -> Callable[[EngineState], None] | None:
        """The `at_decode` hook of a pair about to run in full: it keeps the share when a later pair can use it."""
        if key is None or key in self._shares or self._waiting[key] < 2:
            return None

        def keep(state: EngineState) -> None:
            self._shares[key] = PrefillShare.at_decode(state, sink)
        return keep

    def finish(self, key: PrefillKey | None, prefill_out: torch.Tensor, prefill_in: torch.Tensor | None) -> None:
        """A pair that ran in full: its prefill rows (and in global mode its input's) complete the share its hook
        kept."""
        share = self.get(key)
        if share is not None and share.prefill_out.numel() == 0:
            share.prefill_out, share.prefill_in = prefill_out, prefill_in

    def done(self, key: PrefillKey | None) -> None:
        """A pair of `key` has run: after the last, its share goes."""
        if key is None:
            return
        self._waiting[key] -= 1
        if self._waiting[key] <= 0:
            self._shares.pop(key, None)


LayerKey = tuple[tuple[tuple[int, str], ...], tuple[tuple[int, str], ...]]


def layer_key(choices: list[PatchChoice], mode: str, cfg: Any, layer: int) -> LayerKey | None:
    """What decides a variant's local-mode layer `layer`: its choices acting at the layer (Patch.acts_at), in each
    phase, in order. None in the other modes (their inputs are the variants' own)."""
    if mode != "local":
        return None
    acting = [c for c in choices if c.patch.acts_at(cfg, layer, c.options)]
    return _active_in(acting, "prefill"), _active_in(acting, "decode")


@dataclass
class LayerShare:
    """A local pair's layer as a later pair with the same layer key takes it."""

    rows: list[dict]
    had_finding: bool  # the pair had its first non-finite value before this layer
    finding: Finding | None  # its first non-finite value, found at this layer

    def rows_as(self, variant: str) -> list[dict]:
        return [{**row, "variant": variant} for row in self.rows]


class SharedLayers:
    """The local pairs of one layer, by layer key: the first of a key runs, the later ones take its rows."""

    def __init__(self, keys: dict[tuple[str, str], LayerKey]) -> None:
        """`keys`: the layer key of each pair that may share, in the order the pairs run."""
        self._keys = keys
        self._waiting = Counter(keys.values())
        self._shares: dict[LayerKey, LayerShare] = {}
        self.takers: set[tuple[str, str]] = set()
        """The pairs an earlier pair's layer serves (they take it unless their NaN/Inf history differs)."""
        firsts: set[LayerKey] = set()
        for pair, key in keys.items():
            if key in firsts:
                self.takers.add(pair)
            firsts.add(key)

    def take(self, pair: tuple[str, str], findings: list[Finding]) -> list[dict] | None:
        """The rows of `pair` from an earlier pair with its key whose NaN/Inf history matches, its finding (if any)
        added to `findings` as the pair's own; None when the pair must run."""
        share = self._shares.get(self._keys.get(pair))  # type: ignore[arg-type]
        name, mode = pair
        if share is None or share.had_finding != any(f.variant == name and f.mode == mode for f in findings):
            return None
        if share.finding is not None:
            findings.append(replace(share.finding, variant=name))
        return share.rows_as(name)

    def keep(self, pair: tuple[str, str], rows: list[dict], had_finding: bool, findings: list[Finding],
             layer: int) -> None:
        """A pair that ran: its rows, when a later pair has its key (and none is kept for the key yet)."""
        key = self._keys.get(pair)
        if key is None or key in self._shares or self._waiting[key] < 2:
            return
        name, mode = pair
        found = next((f for f in findings if f.variant == name and f.mode == mode and f.layer == layer), None)
        self._shares[key] = LayerShare(rows, had_finding, None if had_finding else found)

    def done(self, pair: tuple[str, str]) -> None:
        key = self._keys.get(pair)
        if key is not None:
            self._waiting[key] -= 1


def layer_keys(spec: Any, pairs: list[tuple[str, str]], layer: int) -> dict[tuple[str, str], LayerKey]:
    """The layer key of each local pair of `pairs` at `layer` (none when the run dumps tensors)."""
    if not shareable(spec):
        return {}
    choices = {v.name: v.choices for v in spec.variants}
    cfg = spec.source.config
    keys = {(name, mode): layer_key(choices[name], mode, cfg, layer) for name, mode in pairs if name in choices}
    return {pair: key for pair, key in keys.items() if key is not None}


def shareable(spec: Any) -> bool:
    """Whether a run may share prefills at all: not when it dumps tensors (kept per variant and position)."""
    return not spec.dump_taps


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers of its width: equal bits, not equal values (−0.0 is not +0.0, a NaN equals
    itself)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def pair_keys(spec: Any, pairs: list[tuple[str, str]]) -> dict[tuple[str, str], PrefillKey]:
    """The prefill key of each variant pair of `pairs` that may share its prefill (the yardstick and forced mode
    never do; no pair when the run dumps tensors)."""
    if not shareable(spec):
        return {}
    choices = {v.name: v.choices for v in spec.variants}
    keys = {(name, mode): prefill_key(choices[name], mode) for name, mode in pairs if name in choices}
    return {pair: key for pair, key in keys.items() if key is not None}


def kept_prefill_keys(spec: Any, pairs: list[tuple[str, str]], layer: int | None = None) -> list[PrefillKey]:
    """The keys whose prefill a process running `pairs` keeps during layer `layer`: those two or more of them share,
    leaving out the local pairs that take an earlier pair's layer there (SharedLayers.takers: the runner keeps no
    share for them); none without decode tokens (a share is kept at the first decode step). `layer` None: every
    pair counted, the most any layer can keep."""
    if not spec.decode_ids:
        return []
    keys = pair_keys(spec, pairs)
    if layer is not None:
        keys = without_takers(keys, SharedLayers(layer_keys(spec, pairs, layer)))
    return [key for key, n in Counter(keys.values()).items() if n >= 2]


def without_takers(keys: dict[tuple[str, str], PrefillKey], layers: SharedLayers
                   ) -> dict[tuple[str, str], PrefillKey]:
    """The prefill keys of the pairs that take no earlier pair's layer: a pair that will take one keeps and continues
    no prefill share (if it has to run after all, a different NaN/Inf history, it runs in full). The runner and the
    memory estimate both count shares by this."""
    return {pair: key for pair, key in keys.items() if pair not in layers.takers}


def kept_global_prefills(spec: Any, pairs: list[tuple[str, str]]) -> int:
    """How many of kept_prefill_keys(spec, pairs) are global mode's: each keeps its input and output rows, which
    are host copies when the streams are placed (harness.run.stream_placement)."""
    return sum(mode == "global" for mode, _ in kept_prefill_keys(spec, pairs))
