"""From a scenario (plus command-line overrides) to the runner's `RunSpec` and the run's manifest."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from harness.run.environment import environment_record
from harness.errors import UsageError
from harness.run.greedy import greedy_decode_ids
from harness.run.runner import RunSpec, VariantSpec
from harness.scenario import Scenario, parse_scenario
from harness.scenario.prompt import PromptPlan, resolve_prompt
from optimized.patching import PatchChoice, PatchError, PatchRegistry, shadowed_patches
from optimized.registry import default_registry
from reference.model import ReferenceModel


@dataclass
class Overrides:
    """Command-line changes to a scenario."""

    device: str | None = None
    patches: str | None = None  # replaces the variants with `base` and one variant with these patches
    patch_modules: tuple[str, ...] = ()
    local: bool | None = None  # replaces the scenario's measure.local
    threads: int | None = None  # torch CPU threads asked for (None: the available cores); a resume reuses them


def prompt_digest(ids: list[int]) -> str:
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]


def check_device(device: str | None, flag: str = "--device") -> str:
    """The device a command runs on ('cpu' when none is given). Anything but cpu, cuda or an existing cuda:N is a
    usage error naming the flag, found before any compute."""
    device = device or "cpu"
    try:
        parsed = torch.device(device)
    except RuntimeError:
        raise UsageError(f"{flag} {device!r}: not a device; expected cpu, cuda or cuda:N") from None
    if parsed.type not in ("cpu", "cuda"):
        raise UsageError(f"{flag} {device!r}: expected cpu, cuda or cuda:N")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"{flag} {device}: no CUDA device is available")
    if parsed.type == "cuda" and parsed.index is not None and parsed.index >= torch.cuda.device_count():
        raise UsageError(f"{flag} {device}: there are {torch.cuda.device_count()} CUDA device(s)")
    return device


def choose_patches(registry: PatchRegistry, patches: str) -> list[PatchChoice]:
    """`--patches` parsed against a registry; a problem (unknown id, bad option value) names the flag."""
    try:
        return registry.choose(patches)
    except PatchError as e:
        raise UsageError(f"--patches {patches}: {e}") from None


def load_registry(modules: list[str]) -> PatchRegistry:
    """The built-in patches plus plugin modules; a module that fails to load names the flag."""
    try:
        return default_registry(modules)
    except PatchError as e:
        raise UsageError(f"--patch-module: {e}") from None


def shadowing_warnings(variants: list[VariantSpec], cfg: Any) -> list[str]:
    """One line per patch that never runs on an op because a later patch of the same variant replaces that op
    without calling ctx.base (optimized.patching.shadowed_patches, at the layers of model config `cfg`), naming the
    variants, both patches, the op and the layers."""
    variants_of: dict[str, list[str]] = {}
    for v in variants:
        for shadowing in shadowed_patches(v.choices, cfg):
            variants_of.setdefault(shadowing.message(), []).append(v.name)
    return [f"variant{'s' if len(names) > 1 else ''} {', '.join(repr(n) for n in names)}: {message}"
            for message, names in variants_of.items()]


def build_run_spec(scenario: Scenario, overrides: Overrides, decode_ids: list[int] | None = None
                   ) -> tuple[RunSpec, PromptPlan]:
    """Resolve the prompt, open the weights, choose the patches. `decode_ids` (from a manifest) skips greedy."""
    device = check_device(overrides.device)
    plan = resolve_prompt(scenario)
    source = scenario.model.open_weights()
    registry = load_registry(list(scenario.stacks.patch_modules) + list(overrides.patch_modules))
    if overrides.patches is not None:
        variants = [VariantSpec("base", [])]
        chosen = choose_patches(registry, overrides.patches)
        if chosen:
            variants.append(VariantSpec("+".join(c.id for c in chosen) if len(chosen) < 4 else "patched", chosen))
    else:
        try:  # checked when the scenario was loaded; a plugin edited since (a resumed run) may disagree
            variants = [VariantSpec(v.name, v.choices(registry)) for v in scenario.stacks.variants]
        except PatchError as e:
            raise UsageError(f"{scenario.file}: stacks.variants: {e}") from None
    parity = scenario.stacks.reference.parity_options()
    dtype = getattr(torch, scenario.stacks.reference.dtype)
    if decode_ids is None:
        decode_ids = plan.decode_ids
    if decode_ids is None:  # greedy
        decode_ids = greedy_decode_ids(ReferenceModel(source, dtype, device, parity), plan.prompt_ids,
                                       plan.decode_steps, plan.reference_chunk_size)
    n_total = plan.n_prompt + len(decode_ids)
    last_turn = plan.turn_of_position[-1] if plan.turn_of_position else 0
    turns = list(plan.turn_of_position) + [last_turn] * len(decode_ids)
    for p in scenario.probes.dump.positions:
        if p >= n_total:
            raise scenario.error("probes.dump.positions", f"position {p} is past the last token ({n_total - 1})")
    spec = RunSpec(
        source=source, prompt_ids=list(plan.prompt_ids), decode_ids=list(decode_ids), turn_of_position=turns,
        needle_spans=[(n.start, n.end) for n in plan.needles.values()], needle_names=list(plan.needles),
        variants=variants,
        chunk_size=scenario.prefill.chunk_size, reference_chunk_size=scenario.prefill.reference_chunk_size,
        reference_dtype=dtype, parity=parity, yardstick=scenario.stacks.yardstick,
        engine=scenario.stacks.engine.options(),
        local=scenario.measure.local if overrides.local is None else overrides.local,
        force_decisions=scenario.measure.force_decisions, bin_size=scenario.probes.bin_size,
        attn_sample_every=scenario.probes.attn_sample_every, logits_sample_every=scenario.probes.logits_sample_every,
        dump_taps=scenario.probes.dump.tap_names(), dump_positions=list(scenario.probes.dump.positions),
        device=device)
    return spec, plan


def scenario_from_manifest(manifest: dict[str, Any]) -> Scenario:
    """The scenario a run was started from, parsed again from the text its manifest keeps."""
    sc = manifest["scenario"]
    modules = list(manifest.get("overrides", {}).get("patch_modules") or [])  # --patch-module plugins
    return parse_scenario(sc["text"], sc["file"], Path(sc["file"]).parent if sc["file"] != "<string>" else None,
                          load_registry(modules) if modules else None)


def spec_from_manifest(manifest: dict[str, Any], device: str | None = None) -> RunSpec:
    """The RunSpec of an existing run, rebuilt from its manifest (scenario text, overrides, decode ids): for
    `run --resume`, and for every rank of a sharded run. `device` replaces the recorded one."""
    scenario = scenario_from_manifest(manifest)
    ov = manifest["overrides"]
    overrides = Overrides(device or ov["device"], ov["patches"], tuple(ov["patch_modules"]), ov.get("local"),
                          ov.get("threads"))
    spec, _ = build_run_spec(scenario, overrides, decode_ids=manifest["prompt"]["decode_ids"])
    return spec


def resume_problem(manifest: dict[str, Any], spec: RunSpec) -> str | None:
    """Why a run rebuilt from its manifest as `spec` cannot continue where it stopped, or None: its scenario now
    resolves to another prompt, or its synthetic weights' generator fingerprint
    (reference.weights.synthetic.generator_fingerprint) differs from the manifest's — the code now makes other weights
    under the same profile name, and the layers left would run on them. Manifests written before the fingerprint
    existed (2026-12-05) are not checked for it."""
    if prompt_digest(spec.prompt_ids) != manifest["prompt"]["digest"]:
        return "the scenario now resolves to a different prompt"
    was = ((manifest.get("model") or {}).get("weights") or {}).get("generator")
    now = spec.source.describe().get("generator")
    if was is None or was == now:
        return None
    profile = manifest["model"]["weights"].get("profile")
    return (f"the synthetic weights' generator changed since the run began (profile {profile!r}: fingerprint {was}, "
            f"now {now or 'none'}), so the layers left would run on other weights than the layers done; rerun it, or "
            "resume it with the code it began with")


def manifest_for(scenario: Scenario, scenario_text: str, overrides: Overrides, spec: RunSpec,
                 plan: PromptPlan) -> dict[str, Any]:
    """Everything needed to read, trust and resume the run (issue: manifest.json)."""
    cfg = spec.source.config
    return {
        "format": "dsv4-drift-run/1",
        "status": "running",
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "finished": None,
        "scenario": {"name": scenario.name, "file": scenario.file, "text": scenario_text,
                     "description": scenario.description},
        "overrides": {"device": overrides.device, "patches": overrides.patches,
                      "patch_modules": list(overrides.patch_modules), "local": overrides.local,
                      "threads": overrides.threads},
        "model": {"config": cfg.to_dict(), "weights": spec.source.describe()},
        "prompt": {"n_prompt": spec.n_prompt, "n_decode": len(spec.decode_ids), "digest": prompt_digest(spec.prompt_ids),
                   "decode_ids": spec.decode_ids, "decode_source": plan.decode_source,
                   "turns": [{"turn": t.turn, "start": t.start, "end": t.end} for t in plan.turn_spans],
                   "needles": {k: {"start": v.start, "end": v.end, "turn": v.turn} for k, v in plan.needles.items()},
                   "tokenizer": plan.tokenizer_label, "chunk_size": spec.chunk_size,
                   "reference_chunk_size": spec.reference_chunk_size},
        "stacks": {
            "reference": {"dtype": str(spec.reference_dtype).replace("torch.", ""), "parity": list(
                scenario.stacks.reference.parity)},
            "yardstick": spec.yardstick,
            "engine": spec.engine.to_dict(),
            "variants": [{"name": v.name, "patches": [
                {"id": c.id, "options": c.options, "phases": list(c.patch.active_phases(c.options)),
                 "source": c.patch.source, "description": c.patch.description} for c in v.choices]}
                for v in spec.variants],
        },
        "measure": {"local": spec.local, "force_decisions": spec.force_decisions, "bin_size": spec.bin_size,
                    "attn_sample_every": spec.attn_sample_every, "logits_sample_every": spec.logits_sample_every},
        "gate": {"policy": str(scenario.gate.policy)},
        "environment": environment_record(spec.device),
        "layers_total": cfg.num_hidden_layers,
    }


def default_out_dir(scenario: Scenario) -> Path:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    return Path("reports") / f"{scenario.name}-{stamp}"
