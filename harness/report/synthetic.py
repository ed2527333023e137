"""A synthetic run directory shaped like a real product run, for sizing and testing the HTML report.

`write_synthetic_run` writes manifest.json, metrics.parquet (through RunStore), findings.json and,
optionally, gate.json and attribution.json for a 43-layer `flash` schedule, a 27K-token prompt in
512-token bins, 64 decode steps and several variants — without running a model. The numbers are
invented but shaped like real drift: errors grow with depth and position, each variant has its own
scale, one patch goes wrong in decode from a chosen layer. Nothing here is used by a real run.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from harness.report.data import LENS_TAP, LOGITS_TAP
from harness.run.bins import BinPlan
from harness.run.store import METRICS_SCHEMA, RunStore
from reference.config import get_preset

PATCHES = [
    ("mma-sparse-decode", ["decode"], "split-K MMA sparse attention decode: bf16 QK/PV, bf16 partials, LSE merge"),
    ("triton-indexer", ["decode"], "Triton FP8 paged MQA indexer logits, then top-k"),
    ("bf16-indexer-gemm", ["prefill", "decode"], "indexer projections as bf16 GEMMs with fp32 accumulation"),
    ("bf16-mhc-prelinear", ["prefill", "decode"], "mHC pre-linear fn in bf16 with fp32 accumulation"),
    ("hash-topk", ["prefill", "decode"], "fused hash routing on hash layers"),
    ("nvfp4-experts", ["prefill", "decode"], "routed experts as NVFP4 with W4A4 activation quantization"),
]
BAD_PATCH = "triton-indexer"
BAD_FROM_LAYER = 4
CHUNK_FAULT_VARIANT = "all"
CHUNK_FAULT = 1
"""In a run of two or more prefill chunks, `all` goes wrong in prefill chunk 1 alone from BAD_FROM_LAYER (the
attention output it adds by itself, local mode): a loss a layer's mean dilutes and the per-chunk check catches."""

# (tap, metric, base error scale, kind: "err" | "recall" | "mass" | "signed" | "sqnr" | "cos" | "share",
#  layer kinds or None)
SERIES = [
    ("layer.out", "streams.rel_l2", 4e-3, "err", None),
    ("layer.out", "streams.sqnr_db", 4e-3, "sqnr", None),
    ("layer.out", "streams.cosine", 4e-3, "cos", None),
    ("layer.out", "streams.max_abs", 5e-2, "err", None),
    ("layer.out", "streams.bias", 1e-5, "signed", None),
    ("attn.out", "attn.out_rel_l2", 6e-3, "err", None),
    ("moe.out", "moe.out_rel_l2", 8e-3, "err", None),
    ("attn.hc", "mhc.pre_rel_err", 2e-3, "err", None),
    ("attn.hc", "mhc.post_rel_err", 2e-3, "err", None),
    ("attn.hc", "mhc.comb_rel_err", 3e-3, "err", None),
    ("attn.hc", "mhc.ds_residual", 1e-4, "err", None),
    ("ffn.hc", "mhc.pre_rel_err", 2e-3, "err", None),
    ("ffn.hc", "mhc.post_rel_err", 2e-3, "err", None),
    ("ffn.hc", "mhc.comb_rel_err", 3e-3, "err", None),
    ("ffn.hc", "mhc.ds_residual", 1e-4, "err", None),
    ("attn.lse", "attn.lse_delta", 2e-3, "err", None),
    ("attn.lse", "attn.max_logit_delta", 3e-3, "err", None),
    ("moe.router", "moe.flip_rate", 1e-2, "err", None),
    ("moe.router", "moe.weight_l1", 5e-3, "err", None),
    ("attn.probs", "attn.tv", 5e-3, "err", None),
    ("attn.probs", "attn.kl", 2e-4, "err", None),
    ("attn.probs", "attn.js", 5e-5, "err", None),
    ("attn.probs", "ctx.earlier_turn_mass_ref", 0.0, "mass", None),
    ("attn.probs", "ctx.earlier_turn_mass_opt", 1e-2, "mass", None),
    ("attn.probs", "ctx.needle_mass_ref", 0.0, "mass", None),
    ("attn.probs", "ctx.needle_mass_opt", 1e-2, "mass", None),
    ("attn.probs", "indexer.mass_recall", 2e-3, "recall", ("csa",)),
    ("indexer.selected", "indexer.recall", 1e-2, "recall", ("csa",)),
    ("indexer.selected", "indexer.flips", 5.0, "err", ("csa",)),
    ("indexer.selected", "ctx.earlier_turn_recall", 1e-2, "recall", ("csa",)),
    ("indexer.selected", "ctx.needle_recall", 1e-2, "recall", ("csa",)),
    ("indexer.selected", "ctx.earlier_turn_pick_share", 1 / 96, "share", ("csa",)),  # ~96 earlier-turn picks
    ("indexer.selected", "ctx.needle_pick_share", 1 / 6, "share", ("csa",)),  # ~6 needle picks per query
    ("indexer.scores", "indexer.boundary_recall", 4e-3, "recall", ("csa",)),
    ("compressor.rows", "compressor.rows_rel_l2", 4e-3, "err", ("csa", "hca")),
    ("indexer.rows", "indexer.rows_rel_l2", 4e-3, "err", ("csa",)),
]


def _turn_layout(n_prompt: int, n_turns: int) -> list[int]:
    """Turn of each prompt position: a 1K-token preamble (turn −1), then n_turns turns of growing length."""
    turns = np.full(n_prompt, -1, dtype=np.int64)
    start = min(1024, n_prompt // 8)
    weights = np.arange(1, n_turns + 1, dtype=float)
    ends = start + np.cumsum(weights / weights.sum() * (n_prompt - start)).astype(int)
    prev = start
    for t, end in enumerate(ends):
        turns[prev:end] = t
        prev = end
    turns[prev:] = n_turns - 1
    return turns.tolist()


def _manifest(name: str, description: str, scenario_text: str, cfg: dict, n_prompt: int, n_decode: int,
              chunk_size: int, bin_size: int, turns: list[int], needles: dict, variants: list[dict],
              force: bool) -> dict[str, Any]:
    spans = []
    for t in sorted(set(turns)):
        idx = [i for i, x in enumerate(turns) if x == t]
        spans.append({"turn": t, "start": idx[0], "end": idx[-1] + 1})
    return {
        "format": "dsv4-drift-run/1", "status": "complete",
        "started": "2026-01-01T00:00:00+00:00", "finished": "2026-01-01T00:00:58+00:00", "wall_seconds": 58.0,
        "scenario": {"name": name, "file": f"scenarios/{name}.yaml", "text": scenario_text, "description": description},
        "overrides": {"device": "cuda", "patches": None, "patch_modules": []},
        "model": {"config": cfg, "weights": {"kind": "synthetic", "seed": 0, "model": cfg["name"]}},
        "prompt": {"n_prompt": n_prompt, "n_decode": n_decode, "digest": "0" * 16, "decode_ids": list(range(n_decode)),
                   "decode_source": "greedy", "turns": spans, "needles": needles, "tokenizer": "fallback",
                   "chunk_size": chunk_size, "reference_chunk_size": chunk_size},
        "stacks": {"reference": {"dtype": "float32", "parity": []}, "yardstick": True, "engine": {"indexer_fp4": False},
                   "variants": variants},
        "measure": {"local": True, "force_decisions": force, "bin_size": bin_size, "attn_sample_every": 64,
                    "logits_sample_every": 256},
        "gate": {"policy": "default"},
        "environment": {"dsv4_drift": "0.1.0", "torch": "2.13.0", "triton": "3.9.0", "python": "3.11.7",
                        "platform": "Linux-x86_64", "device": "cuda", "device_name": "NVIDIA H200",
                        "compute_capability": "9.0", "cuda": "13.0"},
        "layers_total": cfg["num_hidden_layers"],
    }


def write_synthetic_run(run_dir: str | Path, *, preset: str = "flash", n_prompt: int = 27648, n_decode: int = 64,
                        chunk_size: int = 8192, bin_size: int = 512, n_turns: int = 6, n_single_patch_variants: int = 6,
                        force_decisions: bool = False, gate: bool = True, attribution: bool = True,
                        nan_variant: str | None = None, flat_gate: bool = False, extra_variant: str | None = None,
                        patch_note: str = "", scenario_name: str = "flash-27k-synthetic",
                        scenario_description: str = "synthetic 27K-token agent session (report sizing)",
                        scenario_text: str = "# synthetic scenario\nname: flash-27k-synthetic\n",
                        needle_queries: int = 0, seed: int = 0) -> Path:
    """Write a synthetic run directory; returns its path. `nan_variant` adds a NaN finding for that variant;
    `flat_gate` writes gate.json in the minimal flat shape instead of the gate's own; `extra_variant` adds a
    patch-less variant of that name and `patch_note` is appended to every patch description (tests use both
    to smuggle hostile text into the page). `needle_queries` makes that many decode steps (from step 1) needle
    queries with answer rows (`needle_answers`)."""
    rng = np.random.default_rng(seed)
    cfg = get_preset(preset).to_dict()
    n_layers = cfg["num_hidden_layers"]
    kinds = cfg["layer_kinds"]
    turns = _turn_layout(n_prompt, n_turns)
    needle_start = (turns.index(0) if 0 in turns else 0) + 200
    needles = {"service_account": {"start": needle_start, "end": needle_start + 6, "turn": turns[needle_start]}}
    plan = BinPlan(n_prompt, n_decode, chunk_size, turns, bin_size)
    bins = plan.bins
    nb = len(bins)
    pos = np.array([(b.start + b.end) / 2 for b in bins])
    decode = np.array([b.phase == "decode" for b in bins])
    turn = np.array([b.turn for b in bins])
    count = np.array([b.end - b.start for b in bins], dtype=np.int64)
    after_needle = np.array([b.start >= needle_start + 6 for b in bins])
    col = {
        "phase": np.array([b.phase for b in bins]), "chunk": np.array([b.chunk for b in bins], dtype=np.int32),
        "step": np.array([b.step for b in bins], dtype=np.int32), "turn": turn.astype(np.int32),
        "pos_bin": np.array([b.start for b in bins], dtype=np.int64),
        "pos_end": np.array([b.end for b in bins], dtype=np.int64),
    }

    patch_list = [{"id": pid, "options": {}, "phases": phases, "source": "built-in", "description": desc + patch_note}
                  for pid, phases, desc in PATCHES]
    variants = [{"name": "base", "patches": []}]
    variants += [{"name": p["id"], "patches": [p]} for p in patch_list[:n_single_patch_variants]]
    variants += [{"name": "all", "patches": patch_list}]
    if extra_variant:
        variants.append({"name": extra_variant, "patches": []})
    scale = {"yardstick": 0.5, "base": 1.0, "all": 1.6}
    chunk = col["chunk"]
    chunk_fault = int(chunk.max()) >= CHUNK_FAULT
    answers = needle_answers(["yardstick"] + [v["name"] for v in variants], n_layers, needle_queries) \
        if needle_queries else None
    query_bins = [b for b in bins if b.phase == "decode" and 1 <= b.step <= needle_queries]
    modes = ["global", "local"] + (["forced"] if force_decisions else [])
    stacks = [("yardstick", "global"), ("yardstick", "local")] + [(v["name"], m) for v in variants for m in modes]
    store = RunStore(run_dir)
    store.create(_manifest(scenario_name, scenario_description, scenario_text, cfg, n_prompt, n_decode, chunk_size,
                           bin_size, turns, needles, variants, force_decisions))

    def bad(variant: str) -> bool:
        return variant in (BAD_PATCH, "all")

    for layer in range(n_layers):
        columns: dict[str, list[np.ndarray]] = {k: [] for k in METRICS_SCHEMA.names}
        depth = 1 + 0.06 * layer
        for variant, mode in stacks:
            s = scale.get(variant, 1.1) * (depth if mode == "global" else 1.0) * (0.6 if mode == "forced" else 1.0)
            for tap, metric, base, kind, only in SERIES:
                if only is not None and kinds[layer] not in only:
                    continue
                keep = np.ones(nb, bool)
                if metric.startswith("ctx.earlier"):
                    keep = turn > 0
                elif metric.startswith("ctx.needle"):
                    keep = after_needle
                if not keep.any():
                    continue
                growth = (1 + pos / 20000.0) * rng.lognormal(0, 0.15, nb)
                err = base * s * growth
                if bad(variant) and layer >= BAD_FROM_LAYER and mode != "forced" and \
                        metric.startswith(("indexer.", "ctx.", "attn.tv", "attn.kl")):
                    err = np.where(decode, err * 12, err)
                if chunk_fault and variant == CHUNK_FAULT_VARIANT and mode == "local" and layer >= BAD_FROM_LAYER \
                        and metric == "attn.out_rel_l2":
                    err = np.where(~decode & (chunk == CHUNK_FAULT), err * 3, err)
                if kind == "err":
                    value, peak = err, err * rng.uniform(1.5, 3.0, nb)
                elif kind == "sqnr":
                    value = -20 * np.log10(err)
                    peak = value + rng.uniform(2, 6, nb)
                elif kind == "cos":
                    value, peak = 1 - err * err / 2, np.ones(nb)
                elif kind == "signed":
                    value = err * rng.normal(0, 1, nb)
                    peak = np.abs(value) * 2
                elif kind == "share":  # 1/|subset|: a property of the reference's picks, the same in every stack
                    value = peak = np.full(nb, base)
                elif kind == "recall":
                    value = np.clip(1 - err, 0, 1)
                    peak = np.ones(nb)
                else:  # attention mass on earlier turns / needle: reference and variant
                    ref = 0.35 * np.exp(-layer / 60) * (0.02 if metric.startswith("ctx.needle") else 1.0) * np.ones(nb)
                    value = ref if base == 0 else ref * (1 - np.minimum(err * 4, 0.9))
                    peak = value * 1.5
                n = int(keep.sum())
                columns["variant"].append(np.full(n, variant, dtype=object))
                columns["mode"].append(np.full(n, mode, dtype=object))
                columns["layer"].append(np.full(n, layer, dtype=np.int32))
                for c, v in col.items():
                    columns[c].append(v[keep])
                columns["tap"].append(np.full(n, tap, dtype=object))
                columns["metric"].append(np.full(n, metric, dtype=object))
                columns["value"].append(value[keep].astype(np.float64))
                columns["max"].append(peak[keep].astype(np.float64))
                columns["count"].append(count[keep])
        table = pa.table({k: pa.array(np.concatenate(v), type=METRICS_SCHEMA.field(k).type)
                          for k, v in columns.items()}, schema=METRICS_SCHEMA)
        if answers is not None:
            table = pa.concat_tables([table, pa.Table.from_pylist(_needle_rows(answers, layer, LENS_TAP, query_bins),
                                                                  schema=METRICS_SCHEMA)])
        pq.write_table(table, store.part_path(layer))

    logits_rows = []
    for variant in ["yardstick"] + [v["name"] for v in variants]:
        s = scale.get(variant, 1.1) * (3 if bad(variant) else 1)
        for i in range(0, nb, 4):
            for metric, value in (("logits.kl", 1e-3 * s), ("logits.top1_agree", 1 - 0.02 * s),
                                  ("logits.top1_flip_strict", 0.01 * s)):
                logits_rows.append({"variant": variant, "mode": "global", "layer": n_layers,
                                    **{c: (str(v[i]) if c == "phase" else int(v[i])) for c, v in col.items()},
                                    "tap": "logits", "metric": metric, "value": float(value),
                                    "max": float(value * 2), "count": 4})
    if answers is not None:  # the last layer's answers are the stack's answers: again on the logits row
        logits_rows += _needle_rows(answers, n_layers - 1, LOGITS_TAP, query_bins, at_layer=n_layers)
    store.write_layer(n_layers, logits_rows)  # also combines every part into metrics.parquet

    findings = []
    if nan_variant:
        findings.append({"variant": nan_variant, "mode": "global", "layer": 17, "tap": "moe.out", "field": "out",
                         "phase": "decode", "position": n_prompt + 3})
    store.write_findings(findings)
    if gate:
        chunk_spans = [(min(b.start for b in bins if b.chunk == c), max(b.end for b in bins if b.chunk == c))
                       for c in range(int(chunk.max()) + 1)]
        lost = {stack: lost.sum(axis=1) for stack, lost in answers["lost"].items()} if answers is not None else None
        gate_json = synthetic_gate(variants, nan_variant, kinds, flat_gate, chunk_spans=chunk_spans, needle_lost=lost)
        (store.dir / "gate.json").write_text(json.dumps(gate_json, indent=1))
    if attribution:
        attribution_json = synthetic_attribution(patch_list, n_layers, rng)
        (store.dir / "attribution.json").write_text(json.dumps(attribution_json, indent=1))
    return store.dir


def needle_answers(stacks: list[str], n_layers: int, n_queries: int) -> dict[str, Any]:
    """Which needle queries each stack answers through each layer's logit lens, shaped like a real run's (the
    answer appears at the retrieval layers, one query after another from layer n_layers // 10) with the two
    broken variants losing every other answer from BAD_FROM_LAYER on:
    {"reference": [n_layers, Q] bool, "stacks": {stack: [n_layers, Q]}, "lost": {stack: [n_layers, Q]}}."""
    layer = np.arange(n_layers)[:, None]
    query = np.arange(n_queries)[None, :]
    reference = layer >= np.minimum(n_layers // 10 + query, n_layers - 1)
    answered = {stack: reference & ~((layer >= BAD_FROM_LAYER) & (query % 2 == 1) & (stack in (BAD_PATCH, "all")))
                for stack in stacks}
    return {"reference": reference, "stacks": answered,
            "lost": {stack: reference & ~mine for stack, mine in answered.items()}}


def _needle_rows(answers: dict[str, Any], layer: int, tap: str, query_bins: list, at_layer: int | None = None
                 ) -> list[dict[str, Any]]:
    """The rows the runner records per stack and needle query (harness.run.needles), global mode: tap
    `needle.lens` at a layer, or the last layer's answers on the logits row (`at_layer`, tap `logits`). The
    reference's margin grows with the query; a stack that misses the answer has margin −0.5."""
    reference = answers["reference"][layer]
    rows = []
    for stack, answered in answers["stacks"].items():
        for i, b in enumerate(query_bins):
            ref_margin = 2.0 + i if reference[i] else -1.0
            values = {"ctx.needle_answer": float(answered[layer, i]), "ctx.needle_answer_ref": float(reference[i]),
                      "ctx.needle_margin": ref_margin if answered[layer, i] else -0.5,
                      "ctx.needle_margin_ref": ref_margin, "ctx.needle_lost": float(answers["lost"][stack][layer, i])}
            rows += [{"variant": stack, "mode": "global", "layer": layer if at_layer is None else at_layer,
                      "phase": "decode", "chunk": b.chunk, "step": b.step, "turn": b.turn, "pos_bin": b.start,
                      "pos_end": b.end, "tap": tap, "metric": metric, "value": value, "max": value, "count": 1}
                     for metric, value in values.items()]
    return rows


def synthetic_gate(variants: list[dict], nan_variant: str | None, kinds: list[str] | None = None,
                   flat: bool = False, chunk_spans: list[tuple[int, int]] | None = None,
                   needle_lost: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
    """A gate.json for the synthetic run: the gate's own shape ("dsv4-drift-gate/1", checks × variants × phases
    with per-layer units), or with `flat` the minimal shape {passed, policy, checks: [...], findings}.

    The gate's shape also carries, as the default policy does, a group scope — attention output per prefill chunk
    in local mode (`chunk_spans`: each chunk's positions [first, end); `all` fails in chunk CHUNK_FAULT) — and,
    with `needle_lost` (per stack, the answers lost at each layer's lens), the needle-lost check at every lens
    layer and the logits row (the last layer's answers)."""
    kinds = kinds or list(get_preset("flash").layer_kinds)
    specs = (("attn-tv", "attn.tv", "attn.probs", 0.05, None),
             ("indexer-mass-recall", "indexer.mass_recall", "attn.probs", 0.1, "csa"),
             ("streams-rel-l2", "streams.rel_l2", "layer.out", 0.05, None))
    if flat:
        checks = []
        for v in variants:
            for name, metric, _, bound, _ in specs:
                for phase in ("prefill", "decode"):
                    failing = v["name"] in (BAD_PATCH, "all") and phase == "decode" and metric != "streams.rel_l2"
                    checks.append({"name": f"{name} {phase}", "metric": metric, "variant": v["name"], "phase": phase,
                                   "status": "fail" if failing else "pass",
                                   "first_failing_layer": BAD_FROM_LAYER if failing else None,
                                   "worst_value": 0.31 if failing else 0.012,
                                   "bound": 1 - bound if metric.endswith("recall") else bound})
        findings = [{"variant": nan_variant, "layer": 17, "tap": "moe.out", "phase": "decode"}] if nan_variant else []
        return {"passed": not any(c["status"] == "fail" for c in checks) and not findings, "policy": "default",
                "checks": checks, "findings": findings}
    checks, failures = [], []

    def check(name: str, metric: str, tap: str, bound: float, scope: str, modes: list[str],
              units_of: Callable[[str, str], list[dict[str, Any]]]) -> None:
        """One check: its units per variant and phase from `units_of(variant, phase)`, the first failure and the
        worst unit per phase and per variant, and the failure line the gate prints."""
        check_variants = []
        for v in variants:
            units, phases = [], {}
            for phase in ("prefill", "decode"):
                mine = units_of(v["name"], phase)
                units += mine
                if not mine:
                    continue
                bad = [u for u in mine if u["status"] == "fail"]
                first = bad[0] if bad else None
                worst = max(mine, key=lambda u: u["value"] / u["limit"] if u["limit"] else
                            (math.inf if u["value"] > 0 else 0.0))
                phases[phase] = {"status": "fail" if first else "pass",
                                 "first_failing_layer": first["layer"] if first else None, "first_failure": first,
                                 "worst": worst}
            bad = [u for u in units if u["status"] == "fail"]
            first = min(bad, key=lambda u: (u["layer"], u["phase"] != "prefill")) if bad else None
            if first:
                group = "" if first["group"] is None else \
                    f" chunk {first['group']}" if scope == "chunk" else f" positions {first['span'][0]}-{first['span'][1] - 1}"
                failures.append(f"{name} [{v['name']}]: {metric} first fails at layer {first['layer']} "
                                f"{first['phase']}{group} ({first['mode']}, {tap}): {first['value']:.4g} > "
                                f"{first['limit']:.4g}; {len(bad)} failing unit(s)")
            check_variants.append({"variant": v["name"], "status": "fail" if first else "pass" if units else "no_data",
                                   "reason": "", "phases": phases, "first_failure": first,
                                   "worst": max(units, key=lambda u: u["value"]) if units else None,
                                   "units_total": len(units), "units": units})
        checks.append({"name": name, "description": f"{metric} within its bound", "metric": metric,
                       "taps": [tap], "layers": ["all"], "phases": ["prefill", "decode"], "modes": modes,
                       "scope": scope, "aggregate": "max", "direction": "upper", "severity": "error",
                       "bound": {"kind": "absolute", "expression": str(bound), "value": bound}, "floor": 0.0039,
                       "baseline_slack": 0.0, "bound_text": f"≤ {bound}",
                       "status": "fail" if any(c["status"] == "fail" for c in check_variants) else "pass",
                       "variants": check_variants})

    def unit(variant: str, mode: str, tap: str, layer: int, phase: str, value: float, limit: float, failing: bool,
             scope: str = "layer", group: int | None = None, span: tuple[int, int] = (0, 0)) -> dict[str, Any]:
        return {"variant": variant, "mode": mode, "tap": tap, "layer": layer, "phase": phase, "scope": scope,
                "group": group, "span": list(span), "value": value, "limit": limit,
                "status": "fail" if failing else "pass", "yardstick": limit / 16, "base": None, "floor": 0.0039,
                "baseline": None, "baseline_limit": None, "notes": []}

    for name, metric, tap, bound, only_kind in specs:
        def per_layer(variant: str, phase: str, metric=metric, tap=tap, bound=bound, only_kind=only_kind) -> list:
            out = []
            for layer, kind in enumerate(kinds):
                if only_kind and kind != only_kind:
                    continue
                failing = variant in (BAD_PATCH, "all") and phase == "decode" and layer >= BAD_FROM_LAYER \
                    and metric != "streams.rel_l2"
                value = (0.2 + 0.004 * layer) if failing else bound * (0.2 + 0.01 * layer)
                out.append(unit(variant, "global", tap, layer, phase, value, bound, failing))
            return out
        check(name, metric, tap, bound, "layer", ["global"], per_layer)

    def per_chunk(variant: str, phase: str) -> list:
        if phase != "prefill":
            return []
        return [unit(variant, "local", "attn.out", layer, phase, value, 0.05, value > 0.05, "chunk", c, span)
                for layer in range(len(kinds)) for c, span in enumerate(chunk_spans or [])
                for value in [0.12 if variant == CHUNK_FAULT_VARIANT and c == CHUNK_FAULT and layer >= BAD_FROM_LAYER
                              else 0.01 + 0.0005 * layer]]
    if chunk_spans and len(chunk_spans) > CHUNK_FAULT:
        check("attn-out-rel-l2-patch-by-chunk", "attn.out_rel_l2", "attn.out", 0.05, "chunk", ["local"], per_chunk)

    def per_lens_layer(variant: str, phase: str) -> list:
        if phase != "decode" or needle_lost is None:
            return []
        lost = needle_lost[variant]  # the lens layers, then the logits row: the last layer's answers
        return [unit(variant, "global", "needle.lens" if layer < len(kinds) else "logits", layer, phase,
                     float(n > 0), 0.0, n > 0) for layer, n in enumerate([*lost, lost[-1]])]
    if needle_lost is not None:
        check("needle-lost", "ctx.needle_lost", "needle.lens", 0.0, "layer", ["global"], per_lens_layer)
    nonfinite = []
    if nan_variant:
        nonfinite.append({"variant": nan_variant, "mode": "global", "layer": 17, "tap": "moe.out", "field": "out",
                          "phase": "decode", "position": 0,
                          "message": f"NaN/Inf in {nan_variant} (global): first at layer 17"})
    n_fail = sum(v["status"] == "fail" for c in checks for v in c["variants"])
    n_cases = sum(len(c["variants"]) for c in checks)
    return {"format": "dsv4-drift-gate/1", "verdict": "fail" if n_fail or nonfinite else "pass",
            "exit_code": 1 if n_fail or nonfinite else 0, "created": "2026-01-01T00:01:00+00:00",
            "run": {}, "policy": {"file": "harness/gate/policies/default.yaml", "sha256": "0" * 64,
                                  "description": "synthetic policy", "base_variant": "base"},
            "baseline": None, "counts": {"checks": len(checks), "testcases": n_cases, "pass": n_cases - n_fail,
                                         "fail": n_fail, "warn": 0, "no_data": 0, "skipped": 0,
                                         "nonfinite": len(nonfinite)},
            "failures": [n["message"] for n in nonfinite] + failures, "nonfinite": nonfinite, "checks": checks,
            "notes": []}


def synthetic_attribution(patches: list[dict], n_layers: int, rng: np.random.Generator) -> dict[str, Any]:
    """An attribution.json in the shape `dsv4-drift attribute` writes."""
    ids = [p["id"] for p in patches]
    layers = list(range(n_layers))
    matrix: dict[str, Any] = {}
    for metric in ("attn.tv", "indexer.mass_recall", "streams.rel_l2"):
        phases = {}
        for phase in ("prefill", "decode"):
            rows = {}
            for pid in ids:
                blame = rng.uniform(-0.01, 0.03, n_layers)
                if pid == BAD_PATCH and phase == "decode":
                    blame[BAD_FROM_LAYER:] += np.linspace(0.2, 0.5, n_layers - BAD_FROM_LAYER)
                rows[pid] = [round(float(x), 4) for x in blame]
            rows["_yardstick"] = [round(float(x), 4) for x in rng.uniform(0.005, 0.02, n_layers)]
            phases[phase] = rows
        matrix[metric] = {"mode": "local", "layers": layers, "phases": phases}
    bad = {"patch": BAD_PATCH, "phase": "decode", "first_layer": BAD_FROM_LAYER, "metric": "indexer.mass_recall",
           "check": "indexer-mass-recall", "value": 0.29, "bound": 0.1, "excess": 0.19}
    first = {pid: ([bad] if pid == BAD_PATCH else []) for pid in ids}
    verdict = {**bad, "phases": ["decode"], "kind": "single",
               "summary": f"patch {BAD_PATCH}, decode phase, first at layer {BAD_FROM_LAYER}, indexer.mass_recall 0.29 "
                          "(bound 0.1)"}
    return {"scenario": "synthetic", "gate_passed": False, "patches": ids, "matrix": matrix,
            "first_divergence": first, "ranking": [bad], "interactions": [], "verdict": verdict}
