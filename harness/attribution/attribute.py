"""Attribution (DESIGN §6): which patch, which phase, which layer first.

One layer-major pass runs the reference once and, beside it, the base stack, each patch alone
(add-one-in), all but one (leave-one-out) and all (`harness.attribution.plan`). From its metrics:

- the **blame matrix**: per metric, phase, patch and layer, the drift the patch adds —
  the mean of its add-one-in effect loss(base+p) − loss(base) and its leave-one-out effect
  loss(all) − loss(all−p) — from *local* measurements (each layer run on the reference's input, so a
  layer's blame is its own and not what earlier layers left behind; DESIGN §3). Losses are errors, or
  1 − x for higher-is-better metrics (recalls, agreement).
- each patch's **first divergence**: the first layer (per phase) where its add-one-in variant fails the
  gate policy (harness.gate.gate_run), with the metric, value and bound;
- a **ranked verdict**: patches whose add-one-in variant fails, earliest first layer first, then by how far
  past the bound; when no single patch fails but `all` does, the effect is an interaction: every pair
  of patches runs in a second pass (delta debugging to depth two) and the smallest failing pair is named.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from itertools import combinations
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from harness.attribution.plan import BASE, attribution_variants, full_name, leave_one_out_name, only, pair, \
    pair_variants
from harness.gate.gate_run import gate_run
from harness.gate.evaluate import GateResult, Unit
from harness.run.runner import LockstepRunner, RunSpec, YARDSTICK
from harness.run.store import RunStore

ATTRIBUTION_FILE = "attribution.json"

BLAME_METRICS = [
    ("streams.rel_l2", "layer.out", "upper"),
    ("attn.out_rel_l2", "attn.out", "upper"),
    ("attn.tv", "attn.probs", "upper"),
    ("indexer.recall", "indexer.selected", "lower"),
    ("indexer.mass_recall", "attn.probs", "lower"),
    ("mhc.pre_rel_err", "attn.hc", "upper"),
    ("mhc.comb_rel_err", "ffn.hc", "upper"),
    ("moe.flip_rate", "moe.router", "upper"),
    ("moe.out_rel_l2", "moe.out", "upper"),
    ("logits.kl", "logits", "upper"),
]
"""Metrics of the blame matrix, with their taps and whether higher (upper) or lower is worse."""


def layer_losses(metrics: pd.DataFrame, metric: str, tap: str, direction: str) -> pd.DataFrame:
    """Count-weighted loss per (variant, mode, layer, phase)."""
    m = metrics[(metrics["metric"] == metric) & (metrics["tap"] == tap)].copy()
    if m.empty:
        return pd.DataFrame(columns=["variant", "mode", "layer", "phase", "loss"])
    m["loss"] = (1.0 - m["value"]) if direction == "lower" else m["value"]
    m["w"] = m["loss"] * m["count"]
    g = m.groupby(["variant", "mode", "layer", "phase"], as_index=False)[["w", "count"]].sum()
    g["loss"] = g["w"] / g["count"]
    return g[["variant", "mode", "layer", "phase", "loss"]]


def blame_matrix(metrics: pd.DataFrame, patch_ids: list[str], n_layers: int) -> dict[str, Any]:
    """{metric: {phase: {patch: [blame per layer]}}} plus the yardstick loss per layer for scale."""
    out: dict[str, Any] = {}
    for metric, tap, direction in BLAME_METRICS:
        losses = layer_losses(metrics, metric, tap, direction)
        if losses.empty:
            continue
        mode = "local" if (losses["mode"] == "local").any() else "global"
        losses = losses[losses["mode"] == mode]
        table = losses.set_index(["variant", "phase", "layer"])["loss"]

        def loss(variant: str, phase: str, layer: int) -> float:
            return float(table.get((variant, phase, layer), math.nan))

        per_phase: dict[str, Any] = {}
        layers = sorted(losses["layer"].unique().tolist())
        for phase in ("prefill", "decode"):
            if not (losses["phase"] == phase).any():
                continue
            rows: dict[str, list[float | None]] = {}
            for pid in patch_ids:
                values = []
                for layer in layers:
                    add = loss(only(pid), phase, layer) - loss(BASE, phase, layer)
                    loo = loss(full_name(patch_ids), phase, layer) - loss(
                        leave_one_out_name(patch_ids, pid), phase, layer)
                    both = [v for v in (add, loo) if not math.isnan(v)]
                    values.append(sum(both) / len(both) if both else None)
                rows[pid] = values
            rows["_yardstick"] = [None if math.isnan(v) else v for v in
                                  (loss(YARDSTICK, phase, layer) for layer in layers)]
            per_phase[phase] = rows
        out[metric] = {"mode": mode, "layers": layers, "phases": per_phase}
    return out


@dataclass
class Divergence:
    patch: str
    phase: str
    first_layer: int
    metric: str
    check: str
    value: float
    bound: float
    excess: float

    def to_dict(self) -> dict[str, Any]:
        return {"patch": self.patch, "phase": self.phase, "first_layer": self.first_layer, "metric": self.metric,
                "check": self.check, "value": _num(self.value), "bound": _num(self.bound),
                "excess": _num(self.excess)}


def _num(x: float) -> float | None:
    return None if x is None or math.isnan(x) else (x if math.isfinite(x) else (1e308 if x > 0 else -1e308))


def first_divergences(gate: GateResult, variant: str, patch: str) -> list[Divergence]:
    """Per phase, the first failing unit of `variant` over all checks (lowest layer, then largest excess)."""
    found: dict[str, tuple[Unit, Any]] = {}
    for check in gate.checks:
        for vr in check.variants:
            if vr.variant != variant:
                continue
            for unit in vr.failing():
                best = found.get(unit.phase)
                if best is None or (unit.layer, -unit.excess) < (best[0].layer, -best[0].excess):
                    found[unit.phase] = (unit, check)
    return [Divergence(patch, u.phase, u.layer, c.check.metric, c.check.name, u.value, u.effective_limit, u.excess)
            for u, c in found.values()]


def _divergence_order(d: Divergence) -> tuple:
    return (d.first_layer, {"prefill": 0, "decode": 1}.get(d.phase, 2), -d.excess if math.isfinite(d.excess) else -1e308)


@dataclass
class Attribution:
    patches: list[str]
    matrix: dict[str, Any]
    divergences: dict[str, list[Divergence]]
    full_fails: bool
    interactions: list[dict[str, Any]] = field(default_factory=list)

    def ranking(self) -> list[Divergence]:
        """Each patch's first divergence — lowest layer, prefill before decode at the same layer (data flows
        through prefill first), then the larger excess — ranked the same way."""
        firsts = [min(d, key=_divergence_order) for d in self.divergences.values() if d]
        return sorted(firsts, key=_divergence_order)

    def verdict(self) -> dict[str, Any]:
        ranked = self.ranking()
        if ranked:
            top = ranked[0]
            phases = sorted({d.phase for d in self.divergences[top.patch]})
            return {**top.to_dict(), "phases": phases, "kind": "single",
                    "summary": f"patch {top.patch}, {top.phase} phase, first at layer {top.first_layer}, "
                               f"{top.metric} {top.value:.3g} (bound {top.bound:.3g})"}
        if self.interactions:
            first = min(self.interactions, key=lambda d: (d["first_layer"], -d["excess"]))
            return {**first, "kind": "interaction",
                    "summary": f"patches {first['patch']} together, {first['phase']} phase, first at layer "
                               f"{first['first_layer']}, {first['metric']} {first['value']:.3g} "
                               f"(bound {first['bound']:.3g})"}
        if self.full_fails:
            return {"patch": None, "kind": "unresolved", "phase": None, "first_layer": None, "metric": None,
                    "value": None, "bound": None,
                    "summary": "all patches together fail the gate but no single patch or pair does"}
        return {"patch": None, "kind": "none", "phase": None, "first_layer": None, "metric": None, "value": None,
                "bound": None, "summary": "no patch crosses the gate"}

    def to_dict(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        return {
            **(extra or {}),
            "patches": self.patches,
            "matrix": self.matrix,
            "first_divergence": {p: [d.to_dict() for d in ds] for p, ds in self.divergences.items()},
            "ranking": [d.to_dict() for d in self.ranking()],
            "interactions": self.interactions,
            "verdict": self.verdict(),
        }


def analyze(run_dir: Path, patch_ids: list[str], policy: str | Path | None) -> tuple[Attribution, GateResult]:
    store = RunStore(run_dir)
    gate = gate_run(run_dir, policy)
    metrics = store.read_metrics().to_pandas()
    n_layers = int(store.read_manifest()["layers_total"])
    divergences = {pid: first_divergences(gate, only(pid), pid) for pid in patch_ids}
    full = full_name(patch_ids)
    full_fails = bool(first_divergences(gate, full, "all")) if len(patch_ids) >= 2 else False
    return Attribution(patch_ids, blame_matrix(metrics, patch_ids, n_layers), divergences, full_fails), gate


def run_lockstep(spec: RunSpec, store: RunStore, progress=None, start: int = 0) -> None:
    """One layer-major pass in this process, from layer `start` (the streams the pass saved after layer start − 1)."""
    streams = store.load_streams()[1] if start > 0 else None
    LockstepRunner(spec, store, progress).run(start, streams)


Execute = Callable[[RunSpec, RunStore, Any, int], None]
"""Runs a pass from a layer: in this process (run_lockstep) or sharded (harness.run.distributed)."""


def run_attribution(spec: RunSpec, store: RunStore, manifest: dict[str, Any], policy: str | Path | None,
                    progress=None, interactions: str = "auto", execute: Execute = run_lockstep,
                    pairs_on_host: bool | None = None) -> Attribution:
    """The whole of `dsv4-drift attribute`: the pass, the analysis, the optional pair pass, attribution.json.
    `spec.variants` carry the patches to attribute; `pairs_on_host`: the pair pass's RunSpec.streams_on_host (None:
    the first pass's), which the CLI decides for each pass apart."""
    choices = _as_attribution(spec)
    manifest["stacks"]["variants"] = [{"name": v.name, "patches": [
        {"id": c.id, "options": c.options, "phases": list(c.patch.active_phases(c.options)), "source": c.patch.source,
         "description": c.patch.description} for c in v.choices]} for v in spec.variants]
    manifest["attribution"] = {"patches": [c.id for c in choices], "interactions": interactions}
    store.create(manifest)
    return _complete(spec, choices, store, policy, progress, interactions, execute, pairs_on_host)


def resume_attribution(spec: RunSpec, store: RunStore, policy: str | Path | None, progress=None,
                       interactions: str = "auto", execute: Execute = run_lockstep,
                       pairs_on_host: bool | None = None) -> Attribution:
    """`dsv4-drift attribute --resume`: an attribution stopped in a pass (killed, interrupted, failed) or before its
    analysis, continued — each unfinished pass from the layer after its saved state — and concluded. `spec` is the
    run's, rebuilt from its manifest, its variants carrying the patches."""
    return _complete(spec, _as_attribution(spec), store, policy, progress, interactions, execute, pairs_on_host)


def _as_attribution(spec: RunSpec) -> list:
    """Turn `spec`, whose variants carry the patches, into the first pass (base, each alone, all but one, all;
    local mode on); returns the patches."""
    choices = [c for v in spec.variants for c in v.choices]
    spec.variants = attribution_variants(choices)
    spec.local = True
    return choices


def resume_layer(store: RunStore) -> int | None:
    """The layer a pass continues from: None when it is complete, else the layer after its saved state (0 without
    one)."""
    manifest = store.read_manifest()
    if manifest.get("status") == "complete":
        return None
    saved = manifest.get("state_layer")
    return saved + 1 if saved is not None and store.state_path.is_file() else 0


def _run_pass(spec: RunSpec, store: RunStore, progress, execute: Execute) -> None:
    """The pass from where it stopped (nothing when complete), as a segment of the manifest (start layer, seconds,
    device, threads, the last layer finished, kept current after every layer in this process; `wall_seconds` their
    sum, as a run's); its resume state deleted once it is complete (an
    attribution's analysis needs none: Flash at 30K tokens keeps 17 GB of streams)."""
    start = resume_layer(store)
    if start is not None:
        store.update_manifest(segments=store.new_segment(start, spec.device))  # open: a sharded pass's rank 0
        t0 = time.perf_counter()  # records the segment's seconds and last layer after every layer itself

        def record(**fields: Any) -> None:
            segments = store.read_manifest()["segments"]  # with what rank 0 of a sharded pass recorded
            segments[-1].update(seconds=round(time.perf_counter() - t0, 2), **fields)
            store.update_manifest(segments=segments, wall_seconds=round(sum(s["seconds"] for s in segments), 2))

        def noting(event: dict[str, Any]) -> None:  # after every layer, so a killed pass still says what it cost
            if event.get("event") == "layer_done":
                record(last_layer=event["layer"])
            if progress is not None:
                progress(event)

        try:
            execute(spec, store, noting, start)
        finally:
            record()
    store.delete_state()


_PASS_PROGRESS = frozenset({"status", "finished", "failure", "state_layer", "segments", "wall_seconds", "end_layer",
                            "peak_host_rss_gib", "peak_device_gib"})
"""Manifest fields a pass writes as it runs: the pair pass's manifest is the first pass's without them."""


def pair_pass(first_pass: RunSpec, choices: list, ids: list[str]) -> RunSpec:
    """The interactions pass of an attribution whose first pass is `first_pass`: base and every pair among `ids`."""
    return RunSpec(**{**first_pass.__dict__, "variants": first_pass.variants[:1] + pair_variants(choices, ids)})


def _complete(spec: RunSpec, choices: list, store: RunStore, policy: str | Path | None, progress,
              interactions: str, execute: Execute, pairs_on_host: bool | None = None) -> Attribution:
    """The first pass (what is left of it), the analysis, the pair pass when wanted, attribution.json."""
    _run_pass(spec, store, progress, execute)
    manifest = store.read_manifest()
    ids = [c.id for c in choices]
    result, gate = analyze(store.dir, ids, policy)
    wants_pairs = interactions == "always" or (interactions == "auto" and result.full_fails and not result.ranking())
    if wants_pairs and len(ids) >= 3:
        pair_store = RunStore(store.dir / "interactions")
        pair_spec = pair_pass(spec, choices, ids)
        if pairs_on_host is not None:
            pair_spec.streams_on_host = pairs_on_host
        if not pair_store.exists():
            pair_store.create({**{k: v for k, v in manifest.items() if k not in _PASS_PROGRESS}, "status": "running",
                               "finished": None, "attribution": {"patches": ids, "pass": "interactions"}})
        _run_pass(pair_spec, pair_store, progress, execute)
        pair_gate = gate_run(pair_store.dir, policy)
        for a, b in combinations(ids, 2):
            for d in first_divergences(pair_gate, pair(a, b), f"{a}+{b}"):
                result.interactions.append(d.to_dict())
    (store.dir / ATTRIBUTION_FILE).write_text(json.dumps(result.to_dict({
        "scenario": manifest["scenario"]["name"], "gate_passed": gate.passed,
        "variants": {v.name: [c.id for c in v.choices] for v in spec.variants}}), indent=2))
    return result
