"""The MoE clamp sites (`moe.experts.site`, `moe.shared.site`) catch experts that skip or move the SwiGLU clamp, and
pass experts that compute the clamped math in low precision (default policy check `moe-clamp-site`).

Serving stacks dropped the clamp in the shared expert (sgl-project/sglang PR #23776) and in the routed experts
(vllm-project/vllm-ascend #14363): the outputs differ only at the tokens whose pre-activations pass the limit, and
there by much — a few tokens in a hundred, which a layer's mean error hides. The site holds the variant's op against
the stock op with and without the clamp on the same input (optimized.engine.clamp_site_miss).

The model is `tiny` with swiglu_limit 3.0: tiny's pre-activations reach ~4, so at the real limit of 10 the clamp
never decides anything in five layers and a site that never judges a token could not fail (the transformers oracle
test lowers the limit for the same reason); at 3 it decides a minority of elements, as the real limit does on a
trained model's few large pre-activations, not most of them (at 1 it clamps nearly everything).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from optimized import base_ops
from optimized.engine import OptimizedModel, clamp_site_miss
from optimized.patching import Patch, PatchChoice
from optimized.registry import default_registry
from reference.config import TINY
from reference.model import segment_lengths
from reference.weights.synthetic import SyntheticWeights

CFG = dataclasses.replace(TINY, swiglu_limit=3.0)
SITES = ("moe.experts.site", "moe.shared.site")


class _SiteSink:
    """Keeps every miss the clamp sites emit, per tap."""

    def __init__(self) -> None:
        self.miss: dict[str, list[torch.Tensor]] = {tap: [] for tap in SITES}

    def wants(self, tap: str) -> bool:
        return tap in self.miss

    def sampled(self, positions: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(positions, dtype=torch.bool)

    def emit(self, tap: str, positions: torch.Tensor, **values: torch.Tensor) -> None:
        assert values["miss"].shape == values["lost"].shape == positions.shape, (tap, positions.shape)
        self.miss[tap].append(values["miss"][values["clamp_judged"] > 0])  # a call too small to judge: no data


def _limit(ctx, limit: float):
    return ctx.with_fields(cfg=dataclasses.replace(ctx.cfg, swiglu_limit=limit))


def _bug(name: str, op: str, limit: float) -> Patch:
    patch = Patch(name, ("prefill", "decode"), f"{op} with swiglu_limit {limit}")
    patch.op(op)(lambda ctx, y, routing: getattr(base_ops, op)(_limit(ctx, limit), y, routing))
    return patch


def _stock_through(op: str) -> Patch:
    patch = Patch(f"wrapped-{op}", ("prefill", "decode"), f"the stock {op}, through ctx.base")
    patch.op(op)(lambda ctx, y, routing: ctx.base(y=y, routing=routing))
    return patch


def _miss_rates(choices: list[PatchChoice]) -> dict[str, float]:
    """Share of the judged tokens each clamp site counts, over tiny's five layers (96 prompt tokens in one chunk — a
    call judges its tokens against the variant's error at the others, CLAMP_SITE_MIN_ALONE — and 4 decode steps),
    each layer on the stock engine's input (every layer judged on the same streams)."""
    source = SyntheticWeights(CFG, 0)
    stock, model = OptimizedModel(source, []), OptimizedModel(source, choices)
    ids = torch.randint(0, CFG.vocab_size, (100,), generator=torch.Generator().manual_seed(11))
    segments, sink = segment_lengths(96, 4, 96), _SiteSink()
    x = stock.embed(ids)
    for layer in range(CFG.num_hidden_layers):
        model.run_layer(model.layer(layer), x, ids, segments, 96, sink)
        x = stock.run_layer(stock.layer(layer), x, ids, segments, 96)
    return {tap: float(torch.cat(m).mean()) if m and torch.cat(m).numel() else 0.0 for tap, m in sink.miss.items()}


def _nvfp4_without_clamp() -> Patch:
    """The W4A4 experts of nvfp4-experts with swiglu_limit 0: optimized-stack O5's "swiglu clamp not applied"."""
    from optimized.patches import nvfp4_experts

    stock = default_registry().get("nvfp4-experts")
    patch = Patch("nvfp4-no-clamp", ("prefill", "decode"), "W4A4 experts without the clamp", defaults=stock.defaults)
    patch.op("experts")(lambda ctx, y, routing: nvfp4_experts.experts(_limit(ctx, 0.0), y, routing))
    return patch


def test_the_clamp_sites_fail_experts_that_skip_the_clamp_and_pass_correct_ones():
    """Measured (tiny, limit 3, the 480 prefill tokens: 4 decode steps a layer are too few to judge, and emit nothing):
    the shared expert without the clamp misses at 30% of tokens, the routed experts at 64%, the W4A4 experts
    without it at 2.1% (their own rounding is most of the clamp's change at most
    tokens, which the site then does not judge — the gate allows none, so a few fail them); the stock ops, a plugin
    that calls ctx.base and the W4A4 experts with the clamp at none. A lower limit is not this site's to find
    (clamp_site_miss: p < 0)."""
    none = {tap: 0.0 for tap in SITES}
    assert _miss_rates([]) == none  # the stock ops: 0 by construction
    for op in ("experts", "shared_expert"):
        assert _miss_rates([PatchChoice(_stock_through(op), {})]) == none, op
    registry = default_registry()
    nvfp4 = _miss_rates(registry.choose("nvfp4-experts"))  # W4A4: FP4 activations, the clamp kept
    assert nvfp4 == none, nvfp4
    shared = _miss_rates([PatchChoice(_bug("shared-no-clamp", "shared_expert", 0.0), {})])
    assert shared["moe.shared.site"] > 0.1 and shared["moe.experts.site"] == 0, shared
    routed = _miss_rates([PatchChoice(_bug("routed-no-clamp", "experts", 0.0), {})])
    assert routed["moe.experts.site"] > 0.3 and routed["moe.shared.site"] == 0, routed
    no_clamp = _nvfp4_without_clamp()
    w4a4 = _miss_rates([PatchChoice(no_clamp, no_clamp.resolve_options(None))])
    assert w4a4["moe.experts.site"] > 0.005, w4a4
    lower = _miss_rates([PatchChoice(_bug("routed-limit-lower", "experts", 2.0), {})])
    assert lower == none, lower


def test_the_site_reads_both_stock_sides_from_one_gate_and_up_product_with_each_sides_own_bits(monkeypatch):
    """The clamp site's stock op with and without the clamp (base_ops.*_at_limits) makes the W1 and W3 products once
    — the clamp acts after them — and each side is the bits of its own stock call with that limit (the same
    operations on the same values), checked at every call the site makes over tiny's layers, prefill and decode."""
    matrices: list[str] = []
    per_expert = base_ops._per_expert
    monkeypatch.setattr(base_ops, "_per_expert", lambda ctx, x, layout, matrix: (
        matrices.append(matrix), per_expert(ctx, x, layout, matrix))[1])
    checked = {"experts": 0, "shared_expert": 0}
    linears: list[str] = []
    linear = base_ops.linear

    def counting_linear(ctx, x, site):
        linears.append(site)
        return linear(ctx, x, site)

    def checked_at_limits(name: str, alone, op: str):
        def at_limits(ctx, y, routing, limits):
            if len(limits) == 1:  # a single stock call (the variant's own, or `alone` below)
                return together(ctx, y, routing, limits)
            matrices.clear()
            linears.clear()
            both = together(ctx, y, routing, limits)
            if op == "experts":  # W1 and W3 once for the two limits, W2 once per limit
                assert sorted(matrices) == ["w1", "w2", "w2", "w3"], matrices
            else:
                assert sorted(linears) == sorted(["ffn.shared_experts.w1", "ffn.shared_experts.w3"]
                                                 + ["ffn.shared_experts.w2"] * len(limits)), linears
            assert len(both) == 2, limits
            for limit, got in zip(limits, both):
                assert torch.equal(got, alone(_limit(ctx, limit), y, routing)), (op, limit)
            checked[op] += 1
            return both
        together = getattr(base_ops, name)
        monkeypatch.setattr(base_ops, name, at_limits)

    monkeypatch.setattr(base_ops, "linear", counting_linear)
    monkeypatch.setitem(base_ops.BASE_OPS, "linear", counting_linear)
    checked_at_limits("expert_pairs_at_limits", base_ops.expert_pairs, "experts")
    checked_at_limits("shared_expert_at_limits", base_ops.shared_expert, "shared_expert")
    choices = [PatchChoice(_bug("routed-no-clamp", "experts", 0.0), {}),
               PatchChoice(_bug("shared-no-clamp", "shared_expert", 0.0), {})]
    _miss_rates(choices)
    # five layers' prefill chunk each, and the joined decode steps of each layer (one call per routing width)
    assert checked["experts"] >= 2 * CFG.num_hidden_layers and checked["shared_expert"] >= 2 * CFG.num_hidden_layers, \
        checked


def test_a_decode_only_kernel_that_skips_the_clamp_fails_over_the_layers_steps():
    """A decode step has one token, too few to estimate the kernel's own error, so the steps are held and judged
    together at the end of the layer (OptimizedLayer.emit_held_experts): a decode-only experts kernel without the
    clamp, 40 steps, misses at decode positions (measured: 38% of them); prefill, stock, emits 0."""
    source = SyntheticWeights(CFG, 0)
    patch = Patch("decode-no-clamp", ("decode",), "decode experts without the clamp")
    patch.op("experts")(lambda ctx, y, routing: base_ops.experts(_limit(ctx, 0.0), y, routing))
    model = OptimizedModel(source, [PatchChoice(patch, {})])
    ids = torch.randint(0, CFG.vocab_size, (136,), generator=torch.Generator().manual_seed(11))
    sink = _PositionSink()
    model.run_layer(model.layer(3), model.embed(ids), ids, segment_lengths(96, 40, 96), 96, sink)
    decode = {p: m for p, m in sink.miss["moe.experts.site"].items() if p >= 96}
    prefill = [m for p, m in sink.miss["moe.experts.site"].items() if p < 96]
    assert len(decode) == 40 and sum(decode.values()) / 40 > 0.2, decode
    assert len(prefill) == 96 and sum(prefill) == 0


class _PositionSink(_SiteSink):
    """Keeps each clamp-site miss by position."""

    def __init__(self) -> None:
        self.miss = {tap: {} for tap in SITES}

    def emit(self, tap: str, positions: torch.Tensor, **values: torch.Tensor) -> None:
        judged = values["clamp_judged"] > 0
        self.miss[tap].update(zip(positions[judged].tolist(), values["miss"][judged].tolist()))


def test_clamp_site_miss_counts_a_move_along_the_clamps_change_beyond_the_kernels_own_error():
    """Unit cases: Δ = unclamped − stock, p = ⟨out − stock, Δ⟩/‖Δ‖², a miss where p > 3/4 at a token judged — where
    ‖Δ‖ exceeds 4× the variant's RMS relative error at the tokens the clamp leaves alone (at least 16 of them)."""
    alone = 16
    stock = torch.zeros(alone + 5, 3)
    stock[:, 0] = 1.0
    unclamped, out = stock.clone(), stock.clone()
    out[:alone, 2] = 0.05  # the kernel's own error where the clamp changes nothing: 5% RMS, so Δ must pass 20%
    unclamped[alone:, 1] = torch.tensor([1.0, 1.0, 1.0, 0.15, 1.0])
    out[alone:, 1] = torch.tensor([0.9,      # took the unclamped side: p = 0.9
                                   0.7,      # p = 0.7: within a kernel's rounding of either side
                                   -0.9,     # clamped harder (p < 0): the drift checks' to find
                                   0.15,     # p = 1, but Δ = 15% of the output, under 4× the kernel's 5%
                                   0.0])     # the clamped result
    assert clamp_site_miss(out, stock, unclamped)[alone:].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert clamp_site_miss(out[alone - 15:], stock[alone - 15:], unclamped[alone - 15:]) is None  # 15: no judgement
    # rows the clamp leaves alone that would spoil the kernel's error estimate: a NaN, a zero stock output with a
    # nonzero variant one (0 of the output: an infinite relative error), one corrupt token (error 10× the output)
    bad_out, bad_stock, bad_unclamped = out.clone(), stock.clone(), unclamped.clone()
    bad_out[0, 2] = float("nan")
    bad_stock[1], bad_unclamped[1], bad_out[1] = 0.0, 0.0, torch.tensor([0.0, 0.0, 1.0])
    bad_out[2, 2] = 10.0
    more = stock[:3].clone()  # three more ordinary rows keep 16 usable, the corrupt one among 17: the worst 1% out
    more[:, 2] = 0.05
    got = clamp_site_miss(torch.cat([bad_out, more]), torch.cat([bad_stock, stock[:3]]),
                          torch.cat([bad_unclamped, stock[:3]]))
    assert got is not None and got[alone:alone + 5].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0], got


PLUGIN = '''
import dataclasses

from optimized import base_ops
from optimized.patching import Patch

shared_no_clamp = Patch("shared-no-clamp", ("prefill", "decode"), "the shared expert without its SwiGLU clamp")


@shared_no_clamp.op("shared_expert")
def shared(ctx, y, routing):
    return base_ops.shared_expert(ctx.with_fields(cfg=dataclasses.replace(ctx.cfg, swiglu_limit=0.0)), y, routing)
'''


@pytest.mark.filterwarnings("ignore:.*has no tokenizer.json")  # the prompt is a token file: no tokenizer is used
def test_the_gate_fails_a_shared_expert_without_the_clamp_end_to_end(tmp_path):
    """`run` and the default policy's `moe-clamp-site` on tiny-smoke's prompt over a synthetic tiny checkpoint (the
    official format: FP4 experts, which nvfp4-experts converts) whose config.json lowers swiglu_limit to 3 (see the
    module docstring): the plugin's variant fails the check, `base` and `nvfp4-experts` (W4A4, the clamp kept) pass
    it."""
    import json
    from pathlib import Path

    import yaml

    from harness.cli.main import main

    ckpt = tmp_path / "ckpt"
    assert main(["checkpoint", "synth", "--format", "official", "--model", "tiny", "--out", str(ckpt)]) == 0
    config = json.loads((ckpt / "config.json").read_text())
    config["swiglu_limit"] = 3.0
    (ckpt / "config.json").write_text(json.dumps(config))
    (tmp_path / "bugs.py").write_text(PLUGIN)
    from harness.scenario.load import load_scenario
    from harness.scenario.prompt import resolve_prompt

    smoke = Path(__file__).resolve().parents[1] / "scenarios" / "tiny-smoke.yaml"
    plan = resolve_prompt(load_scenario(smoke))  # its ids folded into tiny's vocabulary: a checkpoint's are model ids
    (tmp_path / "prompt.json").write_text(json.dumps(list(plan.prompt_ids)))
    scenario = yaml.safe_load(smoke.read_text())
    scenario["name"], scenario["model"] = "clamp-site", {"checkpoint": str(ckpt)}
    scenario["prompt"] = {"token_file": str(tmp_path / "prompt.json")}
    scenario["decode"] = {"steps": len(plan.decode_ids), "tokens": list(plan.decode_ids)}
    scenario["tokenizer"] = "auto"
    scenario["stacks"]["variants"] = [{"name": "base", "patches": []}, {"name": "nvfp4", "patches": ["nvfp4-experts"]},
                                      {"name": "shared-no-clamp", "patches": ["shared-no-clamp"]}]
    path = tmp_path / "clamp-site.yaml"
    path.write_text(yaml.safe_dump(scenario, sort_keys=False))
    out = tmp_path / "run"
    main(["run", str(path), "--patch-module", str(tmp_path / "bugs.py"), "--out", str(out), "--no-report",
          "--no-triage"])
    gate = json.loads((out / "gate.json").read_text())
    check = next(c for c in gate["checks"] if c["name"] == "moe-clamp-site")
    assert {v["variant"]: v["status"] for v in check["variants"]} == {
        "base": "pass", "nvfp4": "pass", "shared-no-clamp": "fail"}, check


def test_the_memory_estimate_counts_the_experts_site_of_a_patched_variant():
    """A patched variant's prefill chunk holds the stock experts' output and its own while the site is judged
    (OptimizedLayer._judge_experts: the stock pairs with and without the clamp from one call, within the chunk's
    working set): two [chunk, D] fp32 beside the chunk's working set; a run of stock stacks only computes no site."""
    from harness.run.memory import predict_memory
    from harness.run.setup import Overrides, build_run_spec
    from harness.scenario import find_scenario, load_scenario

    spec = build_run_spec(load_scenario(find_scenario("tiny-smoke")), Overrides(patches="all"))[0]
    cfg = spec.source.config
    chunk = min(spec.n_total, spec.chunk_size)
    assert predict_memory(spec).host_terms["experts site (stock outputs)"] == 2 * chunk * cfg.hidden_size * 4
    spec.variants = [v for v in spec.variants if not v.choices]
    assert spec.variants and "experts site (stock outputs)" not in predict_memory(spec).host_terms
