"""Triage: a run whose patched variant fails the gate names the patch, the phase and the first layer — cheaply.

A full attribution (harness.attribution.attribute) runs base, each patch alone, all but one and all over every layer.
A run that already failed knows more: the failing variant's first failing layer L bounds where its cause can be.
Triage runs only the add-one-in half — base and each of the variant's patches alone — in local mode (each layer on
the reference's input, so a layer's failure is its own, DESIGN §3) over layers 0 … L, gates that partial pass with
the same policy, and ranks each patch's first divergence as attribution does. A patch whose own local error
crosses the gate at or before L is named; when none does, the failure needs the patches together (an interaction,
which `dsv4-drift attribute` resolves) or is carried from an earlier layer's global drift, and triage says so.

For the CPU demo, whose patched variant fails within its first layers, the pass costs seconds, and the run's first
command answers the question the tool exists for: which patch, in prefill or decode, from which layer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from harness.attribution.attribute import ATTRIBUTION_FILE, Attribution, blame_matrix, first_divergences
from harness.attribution.plan import BASE, only
from harness.gate.evaluate import GateResult
from harness.gate.gate_run import gate_run
from harness.run.runner import LockstepRunner, ProgressFn, RunSpec, VariantSpec
from harness.run.store import RunStore

TRIAGE_DIR = "triage"


def failing_patched_variant(gate: GateResult, spec: RunSpec) -> tuple[VariantSpec, int] | None:
    """The run's failing variant with the most patches (the one triage explains) and its first failing layer."""
    patched = {v.name: v for v in spec.variants if v.choices}
    first: dict[str, int] = {}
    for check in gate.checks:
        for vr in check.variants:
            if vr.variant in patched and vr.status == "fail":
                unit = vr.first_failure()
                first[vr.variant] = min(first.get(vr.variant, unit.layer), unit.layer)
    if not first:
        return None
    name = max(first, key=lambda n: (len(patched[n].choices), -first[n]))
    return patched[name], first[name]


def triage(spec: RunSpec, run_dir: Path, gate: GateResult, manifest: dict[str, Any],
           progress: ProgressFn | None = None) -> dict[str, Any] | None:
    """Run the triage pass for the run in `run_dir` (already gated as `gate`) and write its verdict to
    attribution.json there; None when no patched variant fails."""
    found = failing_patched_variant(gate, spec)
    if found is None:
        return None
    variant, last_layer = found
    choices = variant.choices
    ids = [c.id for c in choices]
    if len(choices) == 1:  # nothing to separate: the variant's own first divergence is the answer
        divergences = {ids[0]: first_divergences(gate, variant.name, ids[0])}
        result = Attribution(ids, {}, divergences, full_fails=True)
        return _write(run_dir, result, variant.name, last_layer, pass_dir=None)
    store = RunStore(run_dir / TRIAGE_DIR)
    pass_spec = RunSpec(**{**spec.__dict__, "variants": [VariantSpec(BASE, [])] + [
        VariantSpec(only(c.id), [c]) for c in choices], "local": True, "global_mode": False, "force_decisions": False,
        "dump_taps": [], "dump_positions": []})
    store.create({**manifest, "stacks": {**manifest.get("stacks", {}), "variants": [
        {"name": v.name, "patches": [{"id": c.id} for c in v.choices]} for v in pass_spec.variants]},
        "triage": {"of": variant.name, "patches": ids, "layers": [0, last_layer]}})
    LockstepRunner(pass_spec, store, progress).run(end_layer=last_layer + 1)
    store.delete_state()  # a triage pass is never resumed: its streams would only take disk (Flash at 27K: 3.5 GB)
    pass_gate = gate_run(store.dir, allow_incomplete=True)
    divergences = {pid: first_divergences(pass_gate, only(pid), pid) for pid in ids}  # the pass ends at last_layer
    matrix = blame_matrix(store.read_metrics().to_pandas(), ids, last_layer + 1)
    result = Attribution(ids, matrix, divergences, full_fails=True)
    return _write(run_dir, result, variant.name, last_layer, pass_dir=store.dir)


def _write(run_dir: Path, result: Attribution, variant: str, last_layer: int, pass_dir: Path | None
           ) -> dict[str, Any]:
    verdict = result.verdict()
    if verdict["kind"] == "unresolved":
        verdict["summary"] = (f"{variant} fails from layer {last_layer}, but no single patch crosses the gate by itself "
                              f"in local mode by then: an interaction, or drift carried from earlier layers — run "
                              f"`dsv4-drift attribute` for the full picture")
    payload = result.to_dict({"kind": "triage", "variant": variant, "layers": [0, last_layer],
                              "pass": str(pass_dir) if pass_dir else None})
    (run_dir / ATTRIBUTION_FILE).write_text(json.dumps(payload, indent=2))
    return verdict

