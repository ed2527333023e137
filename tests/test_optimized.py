"""The optimized engine and its patches, held to the reference layer by layer.

Envelopes are derived, not tuned: the yardstick (the reference graph in naive bf16) is the noise a bf16
implementation is allowed; a stack whose coarsest activation format has unit roundoff u may drift
u / u_bf16 times that — FP8 e4m3 (u = 2^-4) gives 16× for the base engine, FP4 e2m1 (u = 2^-2, the W4A4
experts) 64×. Comparisons are *local* (every stack runs a layer on the reference's input for that layer),
so one near-tie flip in an early layer cannot be mistaken for a precision problem in a later one.
"""

from __future__ import annotations

import functools

import pytest
import torch

from optimized.engine import OptimizedModel
from optimized.registry import default_registry
from reference.config import FLASH_MINI, TINY
from reference.layer import ReferenceLayer
from reference.model import ReferenceModel, segment_lengths
from reference.weights.synthetic import SyntheticWeights

U_BF16, U_E4M3, U_E2M1 = 2.0**-8, 2.0**-4, 2.0**-2
REGISTRY = default_registry()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.fixture(scope="module")
def tiny_setup():
    src = SyntheticWeights(TINY, 0)
    ids = torch.randint(0, TINY.vocab_size, (700,), generator=torch.Generator().manual_seed(11))
    n_prompt, n_decode = 690, 10
    ref = ReferenceModel(src)
    inputs, outputs = [], []
    x = ref.embed(ids)
    for layer in range(TINY.num_hidden_layers):
        inputs.append(x)
        x = ref.run_layer(ReferenceLayer(TINY, layer, src.layer(layer)), x, ids, segment_lengths(n_prompt, n_decode, None))
        outputs.append(x)
    return src, ids, n_prompt, n_decode, inputs, outputs


def local_outputs(src, cfg, ids, n_prompt, n_decode, inputs, choices, chunk_size, layers):
    model = OptimizedModel(src, choices)
    segs = segment_lengths(n_prompt, n_decode, chunk_size)
    return {L: model.run_layer(model.layer(L), inputs[L].to(torch.bfloat16), ids, segs, n_prompt).float()
            for L in layers}


def yardstick_outputs(src, cfg, ids, n_prompt, n_decode, inputs, chunk_size, layers):
    yard = ReferenceModel(src, torch.bfloat16)
    segs = segment_lengths(n_prompt, n_decode, chunk_size)
    return {L: yard.run_layer(ReferenceLayer(cfg, L, src.layer(L), torch.bfloat16), inputs[L].to(torch.bfloat16),
                              ids, segs).float() for L in layers}


class IndexerScores:
    """Probe sink keeping the indexer scores of every query."""

    def __init__(self) -> None:
        self.scores: dict[int, torch.Tensor] = {}

    def wants(self, tap: str) -> bool:
        return tap == "indexer.scores"

    def sampled(self, positions: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(positions, dtype=torch.bool)

    def emit(self, tap, positions, scores):
        for p, row in zip(positions.tolist(), scores):
            self.scores[p] = row


def test_decode_only_patches_leave_prefill_bit_identical(tiny_setup):
    src, ids, n_prompt, n_decode, inputs, _ = tiny_setup
    layers = range(TINY.num_hidden_layers)
    base = local_outputs(src, TINY, ids, n_prompt, n_decode, inputs, [], 256, layers)
    for pid in ("mma-sparse-decode", "triton-indexer"):
        assert REGISTRY.get(pid).active_phases(REGISTRY.get(pid).defaults) == ("decode",)
        out = local_outputs(src, TINY, ids, n_prompt, n_decode, inputs, REGISTRY.choose(pid), 256, layers)
        for L in layers:
            assert torch.equal(out[L][:n_prompt], base[L][:n_prompt]), f"{pid} changed prefill at layer {L}"
    # and they do act in decode: split-K attention changes the decode outputs; the indexer kernel changes the
    # decode scores (bf16-rounded per-head dots) — its picks may or may not flip on a short prompt
    mma = local_outputs(src, TINY, ids, n_prompt, n_decode, inputs, REGISTRY.choose("mma-sparse-decode"), 256, layers)
    assert any(not torch.equal(mma[L][n_prompt:], base[L][n_prompt:]) for L in layers)
    csa = next(L for L in layers if TINY.layer_kind(L) == "csa")
    seen = {}
    for name, choices in (("base", []), ("triton", REGISTRY.choose("triton-indexer"))):
        model, sink = OptimizedModel(src, choices), IndexerScores()
        model.run_layer(model.layer(csa), inputs[csa].to(torch.bfloat16), ids,
                        segment_lengths(n_prompt, n_decode, 256), n_prompt, sink)
        seen[name] = sink.scores
    assert all(torch.equal(seen["base"][p], seen["triton"][p]) for p in range(n_prompt))
    assert all(not torch.equal(seen["base"][p], seen["triton"][p]) for p in range(n_prompt, n_prompt + n_decode))


def test_each_patch_changes_only_the_layers_its_ops_touch(tiny_setup):
    src, ids, n_prompt, n_decode, inputs, _ = tiny_setup
    layers = list(range(TINY.num_hidden_layers))
    base = local_outputs(src, TINY, ids, n_prompt, n_decode, inputs, [], 256, layers)
    csa = {L for L in layers if TINY.layer_kind(L) == "csa"}
    hashed = {L for L in layers if TINY.is_hash_layer(L)}
    expect = {
        "bf16-indexer-gemm": csa,  # indexer projections exist only in CSA layers
        "hash-topk": hashed,  # fused hash routing replaces the router on hash layers only
        "triton-indexer:prefill_rows=true": csa,  # indexer logits: CSA layers (prefill rows too, so picks flip)
        "mma-sparse-decode": set(layers),  # every layer attends in decode
        "bf16-mhc-prelinear": set(layers),
        "nvfp4-experts": set(layers),
    }
    for pid, touched in expect.items():
        out = local_outputs(src, TINY, ids, n_prompt, n_decode, inputs, REGISTRY.choose(pid), 256, layers)
        changed = {L for L in layers if not torch.equal(out[L], base[L])}
        assert changed == touched, f"{pid}: changed layers {sorted(changed)}, expected {sorted(touched)}"


def test_chunked_prefill_agrees_with_one_shot_within_bf16_noise(tiny_setup):
    """Chunk sizes that split 4- and 128-token windows and the deployed 8192 (one chunk here): the base engine's
    chunked result differs from its one-shot result by less than the yardstick's own error (bf16 noise)."""
    src, ids, n_prompt, n_decode, inputs, outputs = tiny_setup
    layers = list(range(TINY.num_hidden_layers))
    one_shot = local_outputs(src, TINY, ids, n_prompt, n_decode, inputs, [], None, layers)
    yard = yardstick_outputs(src, TINY, ids, n_prompt, n_decode, inputs, None, layers)
    for chunk in (8192, 97, 130, 256):
        chunked = local_outputs(src, TINY, ids, n_prompt, n_decode, inputs, [], chunk, layers)
        for L in layers:
            noise = rel(yard[L], outputs[L])
            assert rel(chunked[L], one_shot[L]) <= noise, (
                f"chunk {chunk}, layer {L}: chunked vs one-shot {rel(chunked[L], one_shot[L]):.2e} exceeds the "
                f"bf16 noise {noise:.2e}")


@pytest.mark.parametrize("pid, u", [(None, U_E4M3), ("mma-sparse-decode", U_E4M3), ("triton-indexer", U_E4M3),
                                    ("bf16-indexer-gemm", U_E4M3), ("bf16-mhc-prelinear", U_E4M3),
                                    ("hash-topk", U_E4M3), ("nvfp4-experts", U_E2M1)])
def test_base_and_patches_within_derived_envelope_tiny(tiny_setup, pid, u):
    src, ids, n_prompt, n_decode, inputs, outputs = tiny_setup
    layers = list(range(TINY.num_hidden_layers))
    choices = REGISTRY.choose(pid) if pid else []
    out = local_outputs(src, TINY, ids, n_prompt, n_decode, inputs, choices, 256, layers)
    yard = yardstick_outputs(src, TINY, ids, n_prompt, n_decode, inputs, 256, layers)
    envelope = u / U_BF16
    for L in layers:
        drift, noise = rel(out[L], outputs[L]), rel(yard[L], outputs[L])
        assert 0 < drift <= envelope * noise, (f"{pid or 'base'} layer {L}: drift {drift:.3e} vs "
                                               f"{envelope:.0f}× yardstick {noise:.3e}")


@pytest.mark.slow
def test_base_and_all_within_derived_envelope_flash_mini():
    src = SyntheticWeights(FLASH_MINI, 0)
    ids = torch.randint(1000, 60000, (1200,), generator=torch.Generator().manual_seed(5))
    n_prompt, n_decode = 1196, 4
    ref = ReferenceModel(src)
    layers = [0, 2, 3]  # SWA (hash), CSA (hash), HCA (learned)
    x = ref.embed(ids)
    inputs, outputs = {}, {}
    for L in range(max(layers) + 1):
        inputs[L] = x
        x = ref.run_layer(ReferenceLayer(FLASH_MINI, L, src.layer(L)), x, ids, segment_lengths(n_prompt, n_decode, None))
        outputs[L] = x
    yard = yardstick_outputs(src, FLASH_MINI, ids, n_prompt, n_decode, inputs, 512, layers)
    for choices, u in (([], U_E4M3), (REGISTRY.choose("all"), U_E2M1)):
        out = local_outputs(src, FLASH_MINI, ids, n_prompt, n_decode, inputs, choices, 512, layers)
        for L in layers:
            drift, noise = rel(out[L], outputs[L]), rel(yard[L], outputs[L])
            assert 0 < drift <= (u / U_BF16) * noise, f"layer {L}: {drift:.3e} vs yardstick {noise:.3e}"


def test_patch_options_change_what_they_claim(tiny_setup):
    src, ids, n_prompt, n_decode, inputs, _ = tiny_setup
    layers = list(range(TINY.num_hidden_layers))
    csa = [L for L in layers if TINY.layer_kind(L) == "csa"]

    def run(spec, opts=None):
        return local_outputs(src, TINY, ids, n_prompt, n_decode, inputs, REGISTRY.choose(spec, opts), 256, layers)

    # triton-indexer prefill_rows: serves prefill rows too (prefill changes only with the option)
    base = local_outputs(src, TINY, ids, n_prompt, n_decode, inputs, [], 256, layers)
    rows = run("triton-indexer", {"triton-indexer": {"prefill_rows": True}})
    assert any(not torch.equal(rows[L][:n_prompt], base[L][:n_prompt]) for L in csa)
    # dot precision: fp32 dots vs bf16-rounded dots give different decode selections/outputs
    fp32 = run("triton-indexer", {"triton-indexer": {"dot_precision": "fp32", "prefill_rows": True}})
    assert any(not torch.equal(fp32[L], rows[L]) for L in csa)
    # hash-topk scale_on=none under-scales the routed experts on hash layers only
    none = run("hash-topk", {"hash-topk": {"scale_on": "none"}})
    output = run("hash-topk")
    hashed = [L for L in layers if TINY.is_hash_layer(L)]
    assert all(not torch.equal(none[L], output[L]) for L in hashed)
    assert all(torch.equal(none[L], output[L]) for L in layers if L not in hashed)
    # mma-sparse-decode split size changes where the bf16 partials are rounded
    s16 = run("mma-sparse-decode", {"mma-sparse-decode": {"split": 16}})
    s64 = run("mma-sparse-decode")
    assert any(not torch.equal(s16[L][n_prompt:], s64[L][n_prompt:]) for L in layers)
    # nvfp4 activations: W4A16 is closer to the base engine than W4A4
    a16 = run("nvfp4-experts", {"nvfp4-experts": {"activations": "w4a16"}})
    a4 = run("nvfp4-experts")
    assert sum(rel(a16[L], base[L]) for L in layers) < sum(rel(a4[L], base[L]) for L in layers)
    # bf16-mhc-prelinear precision: tf32 rounds less than bf16
    tf32 = run("bf16-mhc-prelinear", {"bf16-mhc-prelinear": {"precision": "tf32"}})
    b16 = run("bf16-mhc-prelinear")
    assert sum(rel(tf32[L], base[L]) for L in layers) < sum(rel(b16[L], base[L]) for L in layers)


class _SitesSink:
    """Wants the fp32-site taps at every position and keeps what they emit."""

    def __init__(self) -> None:
        self.emitted: dict[str, list[dict]] = {}

    def wants(self, tap: str) -> bool:
        return tap.endswith(".site")

    def emit(self, tap: str, positions: torch.Tensor, **values: torch.Tensor) -> None:
        self.emitted.setdefault(tap, []).append(values)

    def sampled(self, positions: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(positions, dtype=torch.bool)


def test_site_taps_before_the_first_index_row():
    """A first chunk shorter than the CSA ratio has no index row yet: the indexer site emits empty margins and zero
    noise (it raised on reducing an empty row), and the attention and router sites still emit."""
    source = SyntheticWeights(TINY, 0)
    model = OptimizedModel(source, default_registry().choose("all"))
    ids = torch.arange(100, 110)
    sink = _SitesSink()
    model.run_layer(model.layer(2), model.embed(ids), ids, [2, 8], 10, sink)  # layer 2 is CSA; ratio 4
    first = sink.emitted["indexer.site"][0]
    assert first["stock_margin"].shape[1] == 0 and torch.equal(first["twin_noise"], torch.zeros(2))
    assert {"attn.site", "moe.router.site", "attn.hc.site"} <= set(sink.emitted)


@pytest.mark.parametrize("activations,scales", [("w4a4", "shared"), ("w4a4", "per-expert"), ("w4a16", "shared")])
def test_nvfp4_experts_laid_out_by_expert_give_the_per_expert_loops_bits(monkeypatch, activations, scales):
    """The NVFP4 experts op quantizes and runs SwiGLU over all pairs at once (issue #14). Oracle: the loop it replaced,
    one expert at a time, on the same weights — with one input_scale for every expert (synthetic checkpoints) and
    with a different one per expert and matrix (real ModelOpt checkpoints), where the quantizer runs per scale. It
    holds one weight at a time: with all of a layer's loaded at once, 2 ranks sharing an H200 ran out of memory at
    Flash width (25.8 GB of NVFP4 forms the halved dense cache could not keep)."""
    import weakref
    from types import SimpleNamespace

    from optimized.base_ops import swiglu_fp32
    from optimized.numerics import bf16
    from optimized.ops import Routing
    from optimized.patches import nvfp4_experts as nv
    from reference.ops.moe import expert_groups

    gen = torch.Generator().manual_seed(3)
    S, k, E, D, inter = 37, 3, 8, 64, 32
    table = {}
    for e in range(E):
        for i, p in enumerate(("w1", "w3", "w2")):
            shape = (inter, D) if p != "w2" else (D, inter)
            scale = None if scales == "shared" else [0.5, 0.75, 1.25, 2.0][(e + i) % 4]
            table[f"ffn.experts.{e}.{p}.weight"] = (torch.randn(shape, generator=gen) * 0.1, scale)
    live: list = []  # weak references to every weight handed out: how many the op holds at once

    def load(ctx, name):
        w = table[name][0].clone()  # a fresh tensor, as a dequantization on use gives
        live.append(weakref.ref(w))
        assert sum(r() is not None for r in live) == 1, "the op holds more than one expert weight at a time"
        return w

    monkeypatch.setattr(nv, "_nvfp4_weight", load)
    monkeypatch.setattr(nv, "_input_scale", lambda ctx, name: table[name][1])
    monkeypatch.setattr(nv, "prepare_nvfp4_forms", lambda ctx, names, fmt: None)  # the cache's part: tested below
    ctx = SimpleNamespace(options={"activations": activations, "input_scale": "checkpoint", "global_scale": "modelopt"},
                          cfg=SimpleNamespace(moe_intermediate_size=inter, swiglu_limit=7.0))
    y = torch.randn(S, D, generator=gen) * 3
    ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(S)])
    routing = Routing(torch.rand(S, E, generator=gen), ids, torch.rand(S, k, generator=gen))

    def act(x, s):
        return bf16(x) if activations == "w4a16" else nv.nvfp4_activation(x, 1.0 if s is None else s)

    per_slot = torch.empty(S * k, D)
    for e, tok, pairs in expert_groups(ids):
        (w1, s1), (w3, s3), (w2, s2) = (table[f"ffn.experts.{e}.{p}.weight"] for p in ("w1", "w3", "w2"))
        h = swiglu_fp32(bf16(act(y, s1)[tok] @ w1.T), bf16(act(y, s3)[tok] @ w3.T), 7.0)
        h = bf16(h * routing.weights.flatten()[pairs, None])
        per_slot[pairs] = bf16(act(h, s2) @ w2.T)
    expected = per_slot.view(S, k, -1).sum(1)
    assert torch.equal(nv.experts(ctx, y, routing), expected)


def test_the_nvfp4_activation_quantizer_per_block_is_the_per_element_definitions_bits():
    """nvfp4-experts' W4A4 quantizer (O5: block scale e4m3(amax₁₆/6/input_scale), x_q = e2m1(x / (b·s))·b·s, a block
    of zeros kept 0) works on [..., blocks, 16] views; held here to the per-element formula written out (each block's
    scale repeated over its elements) bit for bit — all-zero and subnormal-scale blocks, ties of e2m1, values past
    6·b·s, a partial last block (padded with zeros), signed zeros — for input scales of both kinds; bf16, 1-D, 3-D and
    strided inputs; NaN and ±Inf in a block."""
    from optimized.patches.nvfp4_experts import _nvfp4_activation
    from reference.quant import FP4_MAX, round_to_e2m1, round_to_e4m3

    def per_element(x: torch.Tensor, input_scale: float) -> torch.Tensor:
        n = x.shape[-1]
        pad = torch.zeros(*x.shape[:-1], -n % 16)
        amax = torch.cat([x.float().abs(), pad], -1).unflatten(-1, (-1, 16)).amax(-1)
        scale = round_to_e4m3(amax / FP4_MAX / input_scale).repeat_interleave(16, -1)[..., :n] * input_scale
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        return torch.where(scale > 0, round_to_e2m1(x.float() / safe) * scale, torch.zeros_like(scale))

    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 96, generator=g) * torch.logspace(-6, 3, 96)  # blocks of very different sizes
    x[0, :16] = 0.0  # an all-zero block
    x[1, :16] = -0.0
    x[2, 16:32] = 1e-40  # a block whose scale underflows to 0 in e4m3
    x[3, :16] = torch.tensor([6.0, 5.0, 3.5, 2.5, 1.75, 1.25, 0.75, 0.25] * 2)  # e2m1 ties at a scale of 1
    x[4, :16] = torch.tensor([100.0] + [-7.0] * 15)
    x[5, 3] = -0.0  # a signed zero inside a non-zero block
    x[6, 20], x[7, 40], x[8, 60] = float("nan"), float("inf"), -float("inf")  # a block's NaN/Inf spreads as before
    cases = [(x[:, :cols], f"{cols} columns") for cols in (96, 40)]  # 40: a partial last block of 8
    cases += [(x.bfloat16(), "bf16"), (x.unflatten(0, (4, 16)), "3-D"), (x[9], "1-D"), (x.T.contiguous().T, "strided")]
    for input_scale in (1.0, 0.37, 3.0e-3):
        for rows, what in cases:
            got, want = _nvfp4_activation(rows, input_scale), per_element(rows, input_scale)
            assert got.shape == want.shape and torch.equal(got.view(torch.int32), want.view(torch.int32)), \
                (input_scale, what)


@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4-pow2"])
def test_nvfp4_forms_prepared_in_groups_are_load_weights_bits_and_stop_at_the_budget(fmt):
    """prepare_nvfp4_forms converts FP4 expert matrices to their NVFP4 form in groups (issue #14: 768 conversions per
    Flash layer, ~70 launches and three host reads each) into the layer's dense cache. What load_weight then returns
    must be the bits it converts one at a time; groups that would pass the cache's budget are left to load_weight
    (converted on use, as before), and names not stored as FP4 are skipped."""
    from types import SimpleNamespace

    from optimized import base_ops
    from reference.quant import quantize_fp4_mx32
    from reference.weights.dense_cache import DenseCache

    gen = torch.Generator().manual_seed(5)
    stored = {f"ffn.experts.{e}.w{i}.weight": quantize_fp4_mx32(
        torch.randn((32, 64) if i != 2 else (64, 32), generator=gen) * 2.0 ** float(e % 5 - 2))
        for e in range(20) for i in (1, 2, 3)}
    stored["ffn.experts.0.w1.weight"] = quantize_fp4_mx32(torch.zeros(32, 64))  # all-zero: every block's exponent
    stored["attn.wkv.weight"] = torch.randn(8, 64, generator=gen)  # not FP4: skipped
    weights = SimpleNamespace(stored=stored.__getitem__)
    names = list(stored)

    def ctx(budget: int, load_weight_patched: bool = False) -> SimpleNamespace:
        return SimpleNamespace(weights=weights, dense=DenseCache(budget), device=torch.device("cpu"),
                               table=SimpleNamespace(patched=lambda op: op == "load_weight" and load_weight_patched))

    one_by_one = ctx(0)  # caches nothing: load_weight converts every call
    expected = {n: base_ops.load_weight(one_by_one, n, fmt) for n in names if n != "attn.wkv.weight"}
    whole = ctx(1 << 30)
    base_ops.prepare_nvfp4_forms(whole, names, fmt)
    assert all(f"{n}#{fmt}" in whole.dense for n in expected) and f"attn.wkv.weight#{fmt}" not in whole.dense
    assert all(torch.equal(base_ops.load_weight(whole, n, fmt), v) for n, v in expected.items())
    group_bytes = base_ops.NVFP4_GROUP * 32 * 64 * 4
    part = ctx(int(2.5 * group_bytes))  # two groups fit; a third, of either shape, does not
    base_ops.prepare_nvfp4_forms(part, names, fmt)
    assert sum(f"{n}#{fmt}" in part.dense for n in expected) == 2 * base_ops.NVFP4_GROUP
    assert all(torch.equal(base_ops.load_weight(part, n, fmt), v) for n, v in expected.items())
    patched = ctx(1 << 30, load_weight_patched=True)  # a plugin's load_weight may never ask for these forms
    base_ops.prepare_nvfp4_forms(patched, names, fmt)
    assert not any(f"{n}#{fmt}" in patched.dense for n in expected)


def test_an_nvfp4_group_that_cannot_convert_is_left_to_its_use():
    """A matrix whose per-32 scales span more than 17 binades has no lossless NVFP4 form (pow2 rule): preparing a
    group from the codes that holds it skips that group (the error is load_weight's, for the tensor actually loaded),
    and the other groups are still prepared; from the fp32 copies, only that matrix is skipped."""
    from types import SimpleNamespace

    from optimized import base_ops
    from reference.quant import quantize_fp4_mx32
    from reference.weights.dense_cache import DenseCache

    gen = torch.Generator().manual_seed(6)
    stored = {f"w{i}": quantize_fp4_mx32(torch.randn(32, 64, generator=gen)) for i in range(2 * base_ops.NVFP4_GROUP)}
    wide = torch.randn(32, 64, generator=gen)
    wide[0, :32] *= 2.0**14
    wide[5, 32:] *= 2.0**-12
    stored["w0"] = quantize_fp4_mx32(wide)
    c = SimpleNamespace(weights=SimpleNamespace(stored=stored.__getitem__), dense=DenseCache(1 << 30),
                        device=torch.device("cpu"), table=SimpleNamespace(patched=lambda op: False))
    base_ops.prepare_nvfp4_forms(c, list(stored), "nvfp4-pow2")
    assert [f"w{i}#nvfp4-pow2" in c.dense for i in range(len(stored))] == \
        [False] * base_ops.NVFP4_GROUP + [True] * base_ops.NVFP4_GROUP
    with pytest.raises(ValueError, match="w0: per-32 scales span more than 17 binades"):
        base_ops.load_weight(c, "w0", "nvfp4-pow2")
    # from the fp32 copies: only the tensor that cannot convert is left to its use, and one whose factor is past
    # fp32's range (an all-zero matrix: emax −122) is converted from its codes
    stored["w1"] = quantize_fp4_mx32(torch.zeros(32, 64))
    c.dense = DenseCache(1 << 30)
    assert c.dense.fill(list(stored), stored.__getitem__, c.device)
    base_ops.prepare_nvfp4_forms(c, list(stored), "nvfp4-pow2")
    assert [f"w{i}#nvfp4-pow2#factor" in c.dense for i in range(len(stored))] == [False, False] + [True] * (
        len(stored) - 2)
    assert "w1#nvfp4-pow2" in c.dense and "w0#nvfp4-pow2" not in c.dense
    for name in list(stored)[1:]:
        assert torch.equal(base_ops.load_weight(c, name, "nvfp4-pow2"), stored[name].dequantize()), name  # pow2: MX
    with pytest.raises(ValueError, match="w0: per-32 scales span more than 17 binades"):
        base_ops.load_weight(c, "w0", "nvfp4-pow2")


def test_a_checkpoints_own_nvfp4_form_is_its_fp32_copy():
    """A checkpoint's own NVFP4 expert weights: prepare_nvfp4_forms keeps their global scales (the tensor-core path
    needs them) and no second copy — the form load_weight gives is the weight's fp32 copy, the same dequantization —
    and the tensor-core operand (base_ops.nvfp4_operand) is that copy where the cache holds it, else made on use
    (nvfp4_operand_made), the same bits and the stored global either way."""
    from types import SimpleNamespace

    from optimized import base_ops
    from reference.quant import mx32_to_nvfp4, quantize_fp4_mx32
    from reference.weights.dense_cache import DenseCache

    gen = torch.Generator().manual_seed(8)
    stored = {f"w{i}": mx32_to_nvfp4(quantize_fp4_mx32(torch.randn(32, 64, generator=gen))) for i in range(3)}
    c = SimpleNamespace(weights=SimpleNamespace(stored=stored.__getitem__), dense=DenseCache(2 * 32 * 64 * 4 + 8),
                        device=torch.device("cpu"), table=SimpleNamespace(patched=lambda op: False))
    assert c.dense.fill(["w0", "w1"], stored.__getitem__, c.device)  # room for two copies
    base_ops.prepare_nvfp4_forms(c, list(stored), "nvfp4")
    assert not any(f"{n}#nvfp4" in c.dense for n in stored), "no second copy"
    operands = [base_ops.nvfp4_operand(c, n, "nvfp4") for n in stored]
    assert [o is not None for o in operands] == [True, True, False]
    operands[2] = base_ops.nvfp4_operand_made(c, "w2", "nvfp4")
    for name, operand in zip(stored, operands):
        assert operand.factor is None and c.dense.holds(name, operand.source) == (name != "w2")
        assert torch.equal(operand.source, stored[name].dequantize())
        assert torch.equal(base_ops.load_weight(c, name, "nvfp4"), operand.source)
        assert float(operand.global_scale) == float(stored[name].global_scale)


def test_nvfp4_forms_are_derived_from_the_cached_fp32_copies_when_the_cache_holds_them(monkeypatch):
    """prepare_nvfp4_forms keeps each FP4 matrix's factor and global scale when the layer's dense cache holds its fp32
    copy (reference.quant.nvfp4_factors_from_mx) — converting nothing from the codes and keeping no second fp32 copy
    (an H100's cache holds a Flash layer's copies, not their forms as well) — and load_weight derives the form from
    the copy on use; matrices whose copies are not cached are converted from their codes, in groups. The forms are
    mx32_to_nvfp4's bits either way, and so are the global scales; a derived form's tensor-core operand is the copy
    and its factor, whose product is the form's block products code·b in bf16."""
    from types import SimpleNamespace

    from optimized import base_ops
    from reference.quant import e2m1_decode, mx32_to_nvfp4, quantize_fp4_mx32, unpack_e2m1
    from reference.weights.dense_cache import DenseCache

    gen = torch.Generator().manual_seed(7)
    stored = {f"w{i}": quantize_fp4_mx32(torch.randn(32, 64, generator=gen) * 2.0 ** (i % 5 - 2))
              for i in range(2 * base_ops.NVFP4_GROUP)}
    calls = {"factors": 0, "from_codes": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper
    monkeypatch.setattr(base_ops, "nvfp4_factors_from_mx", counted("factors", base_ops.nvfp4_factors_from_mx))
    monkeypatch.setattr(base_ops, "mx32_to_nvfp4_forms", counted("from_codes", base_ops.mx32_to_nvfp4_forms))
    expected = {name: mx32_to_nvfp4(q, "modelopt", name) for name, q in stored.items()}
    first = list(stored)[:base_ops.NVFP4_GROUP]
    copies = len(stored) * 32 * 64 * 4  # fp32 bytes of every copy; copies + 64 leaves no room for one 8 KB form
    # every copy (with room for the forms; without: derived at every use); the first group's only
    for filled, budget in ((list(stored), 1 << 30), (list(stored), copies + 64), (first, 1 << 30)):
        one_by_one = base_ops.mx32_to_nvfp4
        monkeypatch.setattr(base_ops, "mx32_to_nvfp4", lambda q, rule, name: pytest.fail(f"{name} converted from its "
                            "codes") if name in filled else one_by_one(q, rule, name))
        c = SimpleNamespace(weights=SimpleNamespace(stored=stored.__getitem__), dense=DenseCache(budget),
                            device=torch.device("cpu"), table=SimpleNamespace(patched=lambda op: False))
        assert c.dense.fill(filled, stored.__getitem__, c.device)
        base_ops.prepare_nvfp4_forms(c, list(stored), "nvfp4")
        assert [f"w{i}#nvfp4" in c.dense for i in range(len(stored))] == [n not in filled for n in stored]
        for name, form in expected.items():
            for _ in range(2):  # a derived form is kept while there is room; else derived again, the same bits
                assert torch.equal(base_ops.load_weight(c, name, "nvfp4").view(torch.int32),
                                   form.dequantize().view(torch.int32)), name
            assert (f"{name}#nvfp4" in c.dense) == (budget > copies + 64), name
            operand = base_ops.nvfp4_operand(c, name, "nvfp4")
            assert float(operand.global_scale) == float(form.global_scale), name
            if name in filled:
                assert operand.factor is not None and c.dense.holds(name, operand.source)
                blocks = e2m1_decode(unpack_e2m1(form.codes)) * form.scale.float().repeat_interleave(16, -1)
                assert torch.equal((operand.source * operand.factor).bfloat16().float(), blocks), name
    assert calls == {"factors": 3, "from_codes": 1}


def test_a_weight_is_rounded_for_a_low_precision_gemm_once_per_layer():
    """base_ops.rounded_weight: a cached weight whose values are bf16 already is used as it is (rounding changes no
    bit); another is rounded once and its rounded copy kept (bf16 and a second rounding kept apart); a weight that is
    not the cached one (a load_weight patch's, which may change between calls) is rounded at every call."""
    from types import SimpleNamespace

    from optimized.base_ops import rounded_weight
    from optimized.numerics import bf16
    from optimized.patches.bf16_mhc_prelinear import round_tf32
    from reference.weights.dense_cache import DenseCache

    gen = torch.Generator().manual_seed(9)
    exact = torch.randn(16, 32, generator=gen).bfloat16().float()
    fp32 = torch.randn(16, 32, generator=gen)
    dense = DenseCache()
    dense.put("exact", exact)
    dense.put("fp32", fp32)
    weights = {"exact": exact, "fp32": fp32, "patched": fp32 * 3}
    ctx = SimpleNamespace(weight=weights.__getitem__, dense=dense, device=torch.device("cpu"))
    assert rounded_weight(ctx, "exact") is exact
    once = rounded_weight(ctx, "fp32")
    assert torch.equal(once, bf16(fp32)) and rounded_weight(ctx, "fp32") is once, "rounded once, then kept"
    tf32 = rounded_weight(ctx, "fp32", round_tf32, "tf32")
    assert torch.equal(tf32, round_tf32(fp32)) and not torch.equal(tf32, once)
    patched = rounded_weight(ctx, "patched")
    assert torch.equal(patched, bf16(fp32 * 3)) and rounded_weight(ctx, "patched") is not patched
    assert "patched#rounded:bf16" not in dense and "fp32#rounded:bf16" in dense


def test_an_op_contexts_copy_is_what_dataclasses_replace_builds():
    """OpContext.with_fields (every patched op call makes one) must build what dataclasses.replace would: the same
    field values, a new object, the original untouched — which holds while OpContext has no __post_init__ and every
    field is an __init__ argument."""
    from dataclasses import fields, replace

    from optimized.ops import OpContext

    assert not hasattr(OpContext, "__post_init__") and all(f.init for f in fields(OpContext))
    ctx = OpContext(TINY, 0, "csa", "decode", 3, torch.arange(2), None, None, None, torch.device("cpu"), {}, None)
    changes = {"options": {"k": 1}, "patch_id": "p", "base": print}
    copied, replaced = ctx.with_fields(**changes), replace(ctx, **changes)
    assert all(getattr(copied, f.name) is getattr(replaced, f.name) for f in fields(OpContext))
    assert copied is not ctx and ctx.options == {} and ctx.patch_id is None and ctx.base is None


def test_per_chunk_probe_rows_are_padded_to_one_width_and_cut_into_blocks():
    """The engine joins every block's sampled queries for the indexer site and the attention rows (issue #14). An
    indexer_topk plugin may return fewer picks in an early block: those rows are padded as invalid picks (−1, False),
    and the joined queries go out in calls of at most one block."""
    from optimized.engine import _in_blocks

    first = (torch.tensor([3, 7]), torch.ones(2, 4), torch.tensor([[5, 6], [1, 2]]), torch.ones(2, 2, dtype=torch.bool))
    second = (torch.tensor([11, 15, 19]), torch.zeros(3, 4), torch.tensor([[1, 2, 3]] * 3),
              torch.ones(3, 3, dtype=torch.bool))
    calls = _in_blocks([first, second], block=4)
    assert [c[0].tolist() for c in calls] == [[3, 7, 11, 15], [19]]
    pos, weights, ids, valid = calls[0]
    assert weights.shape == (4, 4) and ids.tolist()[0] == [5, 6, -1] and valid.tolist()[0] == [True, True, False]
    assert _in_blocks([], block=4) == []


def test_a_weight_is_bf16_exact_only_when_every_value_is_and_it_is_the_cached_tensor(monkeypatch):
    """DenseCache.bf16_exact decides whether an engine GEMM may run on bf16 tensor cores (numerics.exact_product): it
    must say yes only for the very tensor it holds, and only when no value changes when rounded to bf16."""
    from reference.weights import dense_cache
    from reference.weights.dense_cache import DenseCache, all_bf16_exact

    fp8_like = torch.randn(300, 70, generator=torch.Generator().manual_seed(0)).to(torch.float8_e4m3fn).float()
    exact = fp8_like * 2.0 ** -9  # FP8 element times a power-of-two (UE8M0) block scale
    assert all_bf16_exact(exact)
    off = exact.clone()
    off.view(-1)[-1] += off.view(-1)[-1].abs().clamp(min=1e-30) * 2.0 ** -12  # one value with a 12th mantissa bit
    assert not all_bf16_exact(off)
    monkeypatch.setattr(dense_cache, "CHECK_ELEMENTS", 1000)  # the last value lies in the last of several steps
    assert all_bf16_exact(exact) and not all_bf16_exact(off)

    cache = DenseCache()
    cache.put("w", exact)
    cache.put("v", off)
    assert cache.bf16_exact("w", exact) and cache.bf16_exact("w", exact), "asked twice: remembered, the same answer"
    assert not cache.bf16_exact("w", exact.clone()), "another tensor of the same values is not the one checked"
    assert not cache.bf16_exact("v", off) and not cache.bf16_exact("u", exact)


def test_exact_product_is_the_fp32_gemm_on_the_cpu():
    """On the CPU the tensor-core path is never taken: the same bits as x @ wᵀ (the metric pin depends on it)."""
    from optimized.numerics import exact_product, on_tensor_cores

    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 3, 256, generator=g).to(torch.float8_e4m3fn).float()
    w = torch.randn(96, 256, generator=g).to(torch.float8_e4m3fn).float() * 2.0 ** -6
    assert not on_tensor_cores(x)
    assert torch.equal(exact_product(x, w), x @ w.T)


def _experts_operands(rows: list[int], k: int, n: int, integers: bool, seed: int = 0):
    """x [Σrows, k] of FP8 values and one [n, k] weight of FP4-like values per entry of rows, their row slices; with
    `integers` every value is a small integer, so every product and every fp32 partial sum is exact (|Σ| < 2^24)."""
    g = torch.Generator().manual_seed(seed)
    if integers:
        x = torch.randint(-8, 9, (sum(rows), k), generator=g).float()
        ws = [torch.randint(-6, 7, (n, k), generator=g).float() for _ in rows]
    else:
        x = torch.randn(sum(rows), k, generator=g).to(torch.float8_e4m3fn).float()
        ws = [(torch.randn(n, k, generator=g) * 3).to(torch.float8_e4m3fn).float() * 2.0 ** -8 for _ in rows]
    ends = torch.tensor(rows).cumsum(0).tolist()
    return x, ws, [slice(e - r, e) for e, r in zip(ends, rows)]


@pytest.mark.parametrize("group", [32, 3])
def test_grouped_expert_products_are_the_per_expert_gemms_rounded_to_bf16(monkeypatch, group):
    """numerics.grouped_bf16_products (the GPU's grouped expert GEMMs; torch runs the same operator on the CPU) against
    a GEMM per expert: with exact sums the very bits of bf16(x_e @ w_eᵀ), in every group (group 3: seven experts in
    three grouped calls, a one-row expert among them); with FP8 × FP4-like values within half a bf16 ulp (at most
    2^-8 of the value, at the bottom of a binade) of the fp64 product plus the fp32 accumulation's worst case
    (K·2^-24·Σ|xw|)."""
    from optimized import numerics

    monkeypatch.setattr(numerics, "GROUPED_EXPERTS", group)
    rows = [5, 1, 17, 2, 9, 30, 4]
    x, ws, spans = _experts_operands(rows, 64, 24, integers=True)
    expected = torch.cat([(x[s] @ w.T).bfloat16().float() for s, w in zip(spans, ws)])
    assert torch.equal(numerics.grouped_bf16_products(x, ws, spans), expected)
    x, ws, spans = _experts_operands(rows, 256, 40, integers=False)
    got = numerics.grouped_bf16_products(x, ws, spans).double()
    exact = torch.cat([x[s].double() @ w.double().T for s, w in zip(spans, ws)])
    size = torch.cat([x[s].double().abs() @ w.double().abs().T for s, w in zip(spans, ws)])
    assert bool(((got - exact).abs() <= 2.0 ** -8 * exact.abs() + 256 * 2.0 ** -24 * size).all())


def test_grouped_expert_products_read_kept_bf16_copies_in_place_with_the_fp32_copies_bits(monkeypatch):
    """The experts' bf16 copies a layer's dense cache keeps as one stack (DenseCache.bf16_stack) give the grouped GEMMs
    of the fp32 copies bit for bit: a group of consecutive experts is read where it lies (a view of the stack, no
    copy), any other group is copied into a buffer first (experts 0, 2, 3, … here: the first group skips one)."""
    from optimized import numerics
    from reference.weights.dense_cache import DenseCache

    monkeypatch.setattr(numerics, "GROUPED_EXPERTS", 3)
    rows = [5, 1, 17, 2, 9, 30, 4]
    x, ws, spans = _experts_operands(rows, 64, 24, integers=False)
    cache = DenseCache(1 << 20)
    names = [f"e{i}" for i in range(len(ws))]
    for name, w in zip(names, ws):
        cache.put(name, w)
    stack = cache.bf16_stack(names)
    assert stack is not None and cache.used_bytes == sum(w.numel() for w in ws) * (4 + 2)
    copies = [cache.bf16_copy(n) for n in names]
    view = numerics._rows_of_one_stack(copies[2:5])
    assert view is not None and view.data_ptr() == stack[2].data_ptr() and torch.equal(view, stack[2:5])
    assert numerics._rows_of_one_stack([copies[0], copies[2]]) is None
    assert numerics._rows_of_one_stack(ws[:2]) is None  # fp32: cast into the buffer
    expected = numerics.grouped_bf16_products(x, ws, spans)
    assert torch.equal(numerics.grouped_bf16_products(x, copies, spans), expected)
    picked = [0, 2, 3, 4, 5, 6]
    some = [slice(0, spans[1].stop)] + spans[2:]  # expert 0 takes expert 1's rows too: another layout, same rule
    assert torch.equal(numerics.grouped_bf16_products(x, [copies[i] for i in picked], some),
                       numerics.grouped_bf16_products(x, [ws[i] for i in picked], some))


def test_the_dense_cache_keeps_bf16_stacks_of_cached_exact_copies_within_its_budget():
    """DenseCache.bf16_stack: a stack of every named copy, kept once (2 bytes per element counted) and shared; none when
    a name is not cached, a copy is not bf16-exact, the shapes differ or the budget has no room — and nothing counted
    then."""
    from reference.weights.dense_cache import DenseCache

    exact = [torch.randn(4, 8).bfloat16().float() for _ in range(3)]
    cache = DenseCache(3 * 32 * 4 + 3 * 32 * 2)
    for i, w in enumerate(exact):
        cache.put(f"w{i}", w)
    names = ["w0", "w1", "w2"]
    assert cache.bf16_stack(["w0", "missing"]) is None
    stack = cache.bf16_stack(names)
    assert stack is not None and stack.dtype == torch.bfloat16 and torch.equal(stack.float(), torch.stack(exact))
    assert cache.bf16_stack(names) is stack and cache.bf16_copy("w1").data_ptr() == stack[1].data_ptr()
    assert cache.used_bytes == cache.budget_bytes and cache.bf16_copy("w9") is None
    roomy = DenseCache(1 << 20)
    roomy.put("a", exact[0])
    roomy.put("b", exact[1] + 2.0 ** -20)  # not a bf16 value
    roomy.put("c", torch.zeros(2, 8))
    used = roomy.used_bytes
    assert roomy.bf16_stack(["a", "b"]) is None and roomy.bf16_stack(["a", "c"]) is None and roomy.used_bytes == used
    full = DenseCache(2 * 32 * 4 + 32 * 2)  # room for one bf16 copy, not two
    full.put("a", exact[0])
    full.put("b", exact[1])
    assert full.bf16_stack(["a", "b"]) is None and full.used_bytes == 2 * 32 * 4


def test_stock_experts_take_grouped_products_over_a_prefill_chunk_only(monkeypatch):
    """The stock experts op computes a prefill chunk's expert GEMMs grouped where grouped_products_apply says so (a
    GPU; forced here) and a decode step's per expert (≤ FEW_PAIRS pairs); the engine's logits move by the rounding of
    the same exact sums only (on the CPU not at all), an order of magnitude under its drift from the reference (as
    in the test below; the GPU's figure in tests/test_gpu_engine.py)."""
    from optimized import numerics

    src = SyntheticWeights(TINY, 0)
    ids = torch.randint(0, TINY.vocab_size, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = ReferenceModel(src).forward(ids[:296], ids[296:], chunk_size=128).logits
    plain = OptimizedModel(src, []).forward(ids[:296], ids[296:], 128).logits
    grouped_rows = []
    products = numerics.grouped_bf16_products

    def spy(x, weights, rows):
        grouped_rows.append(x.shape[0])
        return products(x, weights, rows)

    monkeypatch.setattr(numerics, "grouped_products_apply", lambda x, width: True)
    monkeypatch.setattr(numerics, "grouped_bf16_products", spy)
    grouped = OptimizedModel(src, []).forward(ids[:296], ids[296:], 128).logits
    assert grouped_rows and min(grouped_rows) > 64, grouped_rows  # prefill chunks' pairs only, never a decode step's
    # w1, w3, w2 of the last 2 chunks (128, 40) per layer: the first chunk's weights enter the layer's dense cache
    # as it uses them (a run fills the cache before the layer's first stack), and only cached weights are grouped
    assert len(grouped_rows) == 2 * 3 * TINY.num_hidden_layers, grouped_rows
    moved = float((grouped - plain).norm() / plain.norm())  # 0 here: the CPU's grouped operator sums as its GEMM
    drift = float((plain - ref).norm() / ref.norm())
    assert torch.isfinite(grouped).all() and moved < 0.1 * drift, (moved, drift)


def test_nvfp4_products_factored_into_block_products_and_one_alpha_are_the_fp32_gemms_but_for_rounding():
    """numerics.scaled_bf16_products against fp64 on real NVFP4 operands: activations quantized with a global input
    scale per expert (two experts share one, so both ways of dividing it out run) and weights' NVFP4 forms with their
    global scales. The block products x̃·w̃ are exact, so the only errors are the fp32 accumulation's (K·2^-24·Σ|xw|
    at worst), the alpha fl(s·g)'s and the final product's roundings (2^-24 each) and the operands' own roundings to
    fp32 (x and w: 2^-24 each); the fp32 GEMM of x and w stays inside the same bound."""
    from optimized import numerics
    from optimized.patches.nvfp4_experts import nvfp4_activation
    from reference.quant import mx32_to_nvfp4_forms, nvfp4_factors_from_mx, quantize_fp4_mx32

    g = torch.Generator().manual_seed(5)
    rows, K, N = [9, 1, 30, 17], 128, 48
    qs = [quantize_fp4_mx32(torch.randn(N, K, generator=g) * 0.05) for _ in rows]
    forms, w_scales = mx32_to_nvfp4_forms(qs, "modelopt")
    x_scales = [0.37, 0.37, 1.9, 0.0061]
    ends = torch.tensor(rows).cumsum(0).tolist()
    spans = [slice(e - r, e) for e, r in zip(ends, rows)]
    y = torch.randn(sum(rows), K, generator=g) * 4
    x = torch.cat([nvfp4_activation(y[sp], s) for sp, s in zip(spans, x_scales)])
    got = numerics.scaled_bf16_products(x, [numerics.Nvfp4Operand(f, None, s) for f, s in zip(forms, w_scales)], spans,
                                        x_scales)
    exact = torch.cat([x[sp].double() @ w.double().T for sp, w in zip(spans, forms)])
    size = torch.cat([x[sp].double().abs() @ w.double().abs().T for sp, w in zip(spans, forms)])
    bound = (K * 2.0 ** -24 + 4 * 2.0 ** -24) * size
    fp32 = torch.cat([x[sp] @ w.T for sp, w in zip(spans, forms)])
    assert bool(((got.double() - exact).abs() <= bound).all()) and bool(((fp32.double() - exact).abs() <= bound).all())
    assert not torch.equal(got, fp32), "another rounding of the same sums: other bits somewhere (the test's teeth)"
    # read from the MX copies a layer's dense cache holds, with their factors (base_ops.nvfp4_operand): the same w̃
    mx = [q.dequantize() for q in qs]
    factors, _, derivable = nvfp4_factors_from_mx(mx, qs, "modelopt")
    assert bool(derivable.all())
    from_copies = numerics.scaled_bf16_products(x, [numerics.Nvfp4Operand(m, k, s) for m, k, s in
                                                    zip(mx, factors, w_scales)], spans, x_scales)
    assert torch.equal(from_copies, got)
    # …or from their bf16 copies (DenseCache.bf16_stack): mx·c is exact in fp32, so the same block products
    from_bf16 = numerics.scaled_bf16_products(x, [numerics.Nvfp4Operand(m, k, s, m.bfloat16()) for m, k, s in
                                                  zip(mx, factors, w_scales)], spans, x_scales)
    assert torch.equal(from_bf16, got)
    # operands made as their GEMMs run (forms a layer's dense cache could not keep), one at a time: the same bits
    made = []

    def made_on_use(i: int) -> numerics.Nvfp4Operand:
        made.append(i)
        return numerics.Nvfp4Operand(forms[i].clone(), None, w_scales[i])
    on_use = numerics.scaled_bf16_products(x, [functools.partial(made_on_use, i) for i in range(len(rows))], spans,
                                           x_scales)
    assert torch.equal(on_use, got) and made == list(range(len(rows)))


def test_nvfp4_experts_run_their_prefill_gemms_on_tensor_cores_whatever_the_cache_keeps(
        monkeypatch, tensor_cores_on_cpu):
    """With tensor cores (forced here; bf16_mm emulated as exact products summed once, since the CPU's torch has no bf16
    GEMM with fp32 output) the nvfp4-experts op runs a prefill chunk's three expert GEMMs through
    scaled_bf16_products, and the run's logits move as much as one fp32 ulp of noise on the fp32 GEMMs' products moves
    them — no more: W4A4 re-quantizes the SwiGLU output to e2m1, so an fp32-rounding change that flips one bf16 or
    e2m1 rounding moves that element by up to a third, and tiny's routing amplifies it (measured over seeds 3–5:
    6.4–8.6e-2 of the logits' norm against 7.9–8.6e-2 for the ulp noise; the engine's drift from the reference is
    0.10–0.12). The operands are the kept forms, or — once the layer's cache holds the experts' fp32 copies — the
    copies and their factors, or forms made as each GEMM runs, all to the same bits. A load_weight patch's forms are
    never read so: the op then keeps its fp32 GEMMs."""
    from types import SimpleNamespace

    from optimized import numerics
    from optimized.patches import nvfp4_experts as nv

    src = SyntheticWeights(TINY, 0)
    ids = torch.randint(0, TINY.vocab_size, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    choices = default_registry().choose("nvfp4-experts")
    plain = OptimizedModel(src, choices).forward(ids[:296], ids[296:], 128).logits
    joined, noise = nv.joined_products, torch.Generator().manual_seed(3)

    def one_ulp_off(layout, product, width, device):  # each fp32 product moved by one ulp, up or down
        out = joined(layout, product, width, device)
        return out * (1 + (torch.randint(0, 2, out.shape, generator=noise).float() * 2 - 1) * 2.0 ** -23)

    monkeypatch.setattr(nv, "joined_products", one_ulp_off)
    ulp_noise = OptimizedModel(src, choices).forward(ids[:296], ids[296:], 128).logits
    monkeypatch.setattr(nv, "joined_products", joined)
    calls, factored = [], []
    scaled = numerics.scaled_bf16_products

    def counted(*a):
        calls.append(a[0].shape[0])
        factored.append(all(not callable(o) and o.factor is not None for o in a[1]))
        return scaled(*a)
    monkeypatch.setattr(numerics, "scaled_bf16_products", counted)
    tensor_cores_on_cpu()
    fast = OptimizedModel(src, choices).forward(ids[:296], ids[296:], 128).logits
    assert len(calls) == 3 * 3 * TINY.num_hidden_layers and min(calls) > 64, calls  # w1, w3, w2 of 3 chunks
    moved = float((fast - plain).norm() / plain.norm())
    by_noise = float((ulp_noise - plain).norm() / plain.norm())
    assert torch.isfinite(fast).all() and 0 < moved < 1.5 * by_noise, (moved, by_noise)
    assert not any(factored), "no fp32 copies cached here: the operands are the kept forms"
    # with the experts' fp32 copies in the layer's cache (a run fills it before the layer's first stack), the operands
    # are the copies and their factors (base_ops.nvfp4_operand): the same block products, so the same bits
    prepare = nv.prepare_nvfp4_forms

    def filled_first(ctx, names, fmt):
        assert ctx.dense.fill(names, ctx.weights.stored, ctx.device)
        prepare(ctx, names, fmt)
    monkeypatch.setattr(nv, "prepare_nvfp4_forms", filled_first)
    calls.clear()
    factored.clear()
    from_copies = OptimizedModel(src, choices).forward(ids[:296], ids[296:], 128).logits
    assert len(calls) == 3 * 3 * TINY.num_hidden_layers and all(factored)
    assert torch.equal(from_copies, fast)
    # every operand given as a callable that makes it as its GEMM runs (base_ops.nvfp4_operand_made; here the forms
    # load_weight keeps, so this checks the plumbing: tests/test_host_lanes.py runs it with no room for the forms)
    monkeypatch.setattr(nv, "prepare_nvfp4_forms", prepare)
    monkeypatch.setattr(nv, "nvfp4_operand", lambda ctx, name, fmt: None)
    calls.clear()
    factored.clear()
    on_use = OptimizedModel(src, choices).forward(ids[:296], ids[296:], 128).logits
    assert len(calls) == 3 * 3 * TINY.num_hidden_layers and not any(factored)
    assert torch.equal(on_use, fast)
    ctx = SimpleNamespace(table=SimpleNamespace(patched=lambda op: op == "load_weight"),
                          options={"global_scale": "modelopt"})
    assert nv._tensor_core_operands(ctx, ["ffn.experts.0.w1.weight"]) is None, "a patched load_weight: fp32 GEMMs"


def test_an_nvfp4_operand_the_cache_cannot_keep_is_made_on_use_with_the_kept_operands_bits():
    """base_ops.nvfp4_operand_made: with no room for a form (budget 0), the tensor-core operand is the form load_weight
    makes for this use — converted from the FP4 codes, or a checkpoint's own NVFP4 form — and its global scale (kept:
    4 bytes); nothing else is kept. It is the operand a roomy cache keeps, bit for bit, so nvfp4-experts' GEMMs take
    one path whatever the cache admitted."""
    from types import SimpleNamespace

    from optimized import base_ops
    from reference.quant import mx32_to_nvfp4, quantize_fp4_mx32
    from reference.weights.dense_cache import DenseCache

    gen = torch.Generator().manual_seed(9)
    stored = {"fp4": quantize_fp4_mx32(torch.randn(32, 64, generator=gen)),
              "nvfp4": mx32_to_nvfp4(quantize_fp4_mx32(torch.randn(32, 64, generator=gen)))}

    def ctx(budget: int) -> SimpleNamespace:
        return SimpleNamespace(weights=SimpleNamespace(stored=stored.__getitem__), dense=DenseCache(budget),
                               device=torch.device("cpu"), table=SimpleNamespace(patched=lambda op: False))
    roomy, tight = ctx(1 << 30), ctx(0)
    roomy.dense.fill(["nvfp4"], stored.__getitem__, roomy.device)  # a checkpoint's own form is its fp32 copy
    base_ops.prepare_nvfp4_forms(roomy, list(stored), "nvfp4")
    base_ops.prepare_nvfp4_forms(tight, list(stored), "nvfp4")
    for name in stored:
        kept = base_ops.nvfp4_operand(roomy, name, "nvfp4")
        assert kept is not None and base_ops.nvfp4_operand(tight, name, "nvfp4") is None, name
        made = base_ops.nvfp4_operand_made(tight, name, "nvfp4")
        assert made.factor is None and kept.factor is None and roomy.dense.holds(name, kept.source) == (name == "nvfp4")
        assert torch.equal(made.source.view(torch.int32), kept.source.view(torch.int32)), name
        assert float(made.global_scale) == float(kept.global_scale), name
        assert base_ops.nvfp4_operand(tight, name, "nvfp4") is None, name
    assert tight.dense.used_bytes == 4 * len(stored), "nothing kept but the global scales (4 bytes each)"


def test_on_tensor_cores_the_engine_sends_only_bf16_valued_operands_and_moves_by_rounding_only(tensor_cores_on_cpu):
    """What the GPU path does, run on the CPU: numerics.on_tensor_cores says yes from TENSOR_CORE_MIN_ROWS rows and
    numerics.bf16_mm is emulated (exact products summed in fp64, rounded once to fp32: another rounding of the
    same sum, as tensor cores give). Every operand that reaches it must be bf16-valued (the exactness the path
    rests on), and the FP8 linears, the grouped wo_a and the experts must all reach it. The logits may move: another
    rounding of an fp32 sum now and then flips a bf16 output rounding (2^-8 relative) or a near-tie routing or
    top-k decision downstream — 2.2e-3 against the engine's 9.9e-2 drift from the reference on an AMD machine; 0 on
    an Intel one, whose fp32 GEMMs summed these short bf16 products exactly — and must stay an order of magnitude
    under the drift, as in the GPU test (tests/test_gpu_engine.py). That the path ran is the shapes check."""
    from reference.weights.dense_cache import all_bf16_exact

    shapes = []

    def emulated_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        assert x.dtype == w.dtype == torch.float32 and all_bf16_exact(x) and all_bf16_exact(w), "not bf16 values"
        shapes.append((x.shape[1], w.shape[0]))
        return (x.double() @ w.double().T).float()

    src = SyntheticWeights(TINY, 0)
    ids = torch.randint(0, TINY.vocab_size, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = ReferenceModel(src).forward(ids[:296], ids[296:], chunk_size=128).logits
    plain = OptimizedModel(src, []).forward(ids[:296], ids[296:], 128).logits
    tensor_cores_on_cpu(emulated_mm)
    routed = OptimizedModel(src, []).forward(ids[:296], ids[296:], 128).logits
    c = TINY
    expected = {(c.hidden_size, c.q_lora_rank), (c.q_lora_rank, c.num_attention_heads * c.head_dim),  # wq_a, wq_b
                (c.hidden_size, c.head_dim), (c.o_groups * c.o_lora_rank, c.hidden_size),  # wkv, wo_b
                (c.num_attention_heads * c.head_dim // c.o_groups, c.o_lora_rank),  # wo_a, per group
                (c.hidden_size, c.moe_intermediate_size), (c.moe_intermediate_size, c.hidden_size)}  # experts
    assert expected <= set(shapes), expected - set(shapes)
    moved = float((routed - plain).norm() / plain.norm())
    drift = float((plain - ref).norm() / ref.norm())
    assert torch.isfinite(routed).all() and moved < 0.1 * drift, (moved, drift)


class _SampledRowsSink:
    """Samples every position and keeps, per tap and position, what the indexer site and the attention rows emit."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[int, dict[str, torch.Tensor]]] = {"indexer.site": {}, "attn.probs": {}}
        self.calls = {tap: 0 for tap in self.rows}

    def wants(self, tap: str) -> bool:
        return tap in self.rows

    def emit(self, tap: str, positions: torch.Tensor, **values: torch.Tensor) -> None:
        self.calls[tap] += 1
        for i, p in enumerate(positions.tolist()):
            self.rows[tap][p] = {name: v[i].clone() for name, v in values.items()}

    def sampled(self, positions: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(positions, dtype=torch.bool)


def _emitting_every_step(block):
    """`block`, whose forward emits each segment's sampled rows itself whatever run_layer asks (the per-step way)."""
    each_step = block.forward
    block.forward = lambda *args, hold_sampled=False, **kw: each_step(*args, **kw)
    return block


@pytest.mark.parametrize("n_prompt,n_decode,seed", [(50, 16, 5), (150, 24, 5)])
def test_decode_steps_sampled_rows_recomputed_once_give_each_step_its_own_bits(n_prompt, n_decode, seed):
    """run_layer holds the decode steps' sampled indexer-site and attention-row inputs and recomputes them once over
    all steps (issue #14: a few dozen small kernels per step and stack). The caches only grow and every query masks
    what lies past its position, so on the CPU every emitted field of every query must be its own step's, bit for
    bit. Two traps this holds to: while tiny's indexer has fewer rows than index_topk (16; the first case), its picks
    widen from 12 to 16, so steps share a call only at one width and are never padded; and once it has more (the
    second case: 37 to 43 rows), exact ties at the k-th stock score occur (at positions 150, 151, 159 here), and
    torch.topk over the caches' rows at the end instead of the step's would break them another way — so steps share
    a call only with steps that had as many index rows, and the stock top-k runs over those rows."""
    source = SyntheticWeights(TINY, 0)
    model = OptimizedModel(source, default_registry().choose("all"))
    ids = torch.randint(0, TINY.vocab_size, (n_prompt + n_decode,), generator=torch.Generator().manual_seed(seed))
    segments = segment_lengths(n_prompt, n_decode, 64)
    x = model.embed(ids)
    decode = range(n_prompt, n_prompt + n_decode)
    for layer in (2, 3):  # CSA, HCA (no indexer: the compressed rows the probs read widen every 128 tokens)
        held, stepwise = _SampledRowsSink(), _SampledRowsSink()
        model.run_layer(model.layer(layer), x, ids, segments, n_prompt, held)
        model.run_layer(_emitting_every_step(model.layer(layer)), x, ids, segments, n_prompt, stepwise)
        for tap in stepwise.rows:
            assert held.rows[tap].keys() == stepwise.rows[tap].keys(), (layer, tap)
            for p, fields in stepwise.rows[tap].items():
                for name, value in fields.items():
                    once = held.rows[tap][p][name]
                    assert once.shape == value.shape and torch.equal(once, value), (layer, tap, p, name)
        assert held.calls["attn.probs"] < stepwise.calls["attn.probs"], layer
        if layer == 2:
            site = stepwise.rows["indexer.site"]
            assert held.calls["indexer.site"] < stepwise.calls["indexer.site"]
            widths = {site[p]["stock_row_ids"].numel() for p in decode}
            ties = [p for p in decode if int(((site[p]["stock_margin"] == 0) & site[p]["stock_valid"]).sum()) >= 2]
            if n_prompt == 50:
                assert widths == {12, 13, 14, 15, 16}, widths
            else:
                assert widths == {16} and ties, (widths, ties)


def test_a_patched_cache_store_keeps_the_decode_samples_per_step():
    """Recomputing the decode steps' sampled rows once at the end is only valid while the caches are append-only:
    a kv_store patch that also rewrites the previous token's window row (an off-by-one slot bug) changes, at step
    t + 1, a row query t read. With kv_store (or kv_load, chunk_state_carry) patched in decode the engine therefore
    recomputes at every step, what each step's kernel saw — and held to the end, the rows would have differed."""
    from optimized.patching import Patch, PatchChoice

    overwrite = Patch("overwrite-previous-row", phases=("decode",), description="also writes the previous slot")

    @overwrite.op("kv_store")
    def kv_store(ctx, cache, rows):
        ctx.base(cache=cache, rows=rows)
        if cache == "window" and rows.shape[0]:
            store = ctx.state.cache(cache)
            store.length -= 2  # rewrite the previous token's slot with this token's row, then this one's again
            store.append(torch.cat([rows[-1:], rows[-1:]]))

    source = SyntheticWeights(TINY, 0)
    model = OptimizedModel(source, [PatchChoice(overwrite, {})])
    n_prompt, n_decode = 50, 8
    ids = torch.randint(0, TINY.vocab_size, (n_prompt + n_decode,), generator=torch.Generator().manual_seed(5))
    segments = segment_lengths(n_prompt, n_decode, 32)
    x = model.embed(ids)
    runs = {}
    for how in ("engine", "stepwise", "held anyway"):
        block, sink = model.layer(2), _SampledRowsSink()
        if how == "stepwise":
            _emitting_every_step(block)
        if how == "held anyway":
            block.holds_decode_samples = True
        assert block.holds_decode_samples == (how == "held anyway")
        model.run_layer(block, x, ids, segments, n_prompt, sink)
        runs[how] = sink
    decode = range(n_prompt, n_prompt + n_decode)
    assert runs["engine"].calls["attn.probs"] == runs["stepwise"].calls["attn.probs"] == 2 + n_decode
    for p in decode:
        for name, value in runs["stepwise"].rows["attn.probs"][p].items():
            assert torch.equal(runs["engine"].rows["attn.probs"][p][name], value), (p, name)
    assert any(not torch.equal(runs["held anyway"].rows["attn.probs"][p]["probs"],
                               runs["stepwise"].rows["attn.probs"][p]["probs"]) for p in decode)


class _SiteSink(_SampledRowsSink):
    """Samples every position and keeps what the decision sites emit, per tap and position, and how often."""

    SITES = ("attn.hc.site", "ffn.hc.site", "moe.router.site", "attn.site")

    def __init__(self) -> None:
        self.rows = {tap: {} for tap in self.SITES}
        self.calls = {tap: 0 for tap in self.SITES}


def test_held_decode_sites_give_each_step_its_own_row_with_a_reassociated_twin():
    """run_layer(hold_sites=True) holds the decode steps' sites and emits each once per layer (GPU default,
    LockstepRunner.sites_together). Per decode position: the variant's own fields are the per-step run's bits (they
    are the step's own results, copied); the stock and twin fields are those of the joined calls — equal to the
    per-step ones up to fp32 rounding — and the twin is still the re-associated op (whether its bits differ from the
    stock op's depends on how the BLAS splits its sums, so the calls are checked)."""
    source = SyntheticWeights(TINY, 0)
    model = OptimizedModel(source, REGISTRY.choose("bf16-mhc-prelinear,mma-sparse-decode"))
    n_prompt, n_decode = 50, 6
    ids = torch.randint(0, TINY.vocab_size, (n_prompt + n_decode,), generator=torch.Generator().manual_seed(9))
    segments = segment_lengths(n_prompt, n_decode, 32)
    x = model.embed(ids)
    runs, joined_calls = {}, []
    for held in (False, True):
        sink, block = _SiteSink(), model.layer(2)
        stock = block._stock

        def noting(ctx, reassociate, stock=stock):  # the decode calls over more than one step: the joined ones
            if ctx.phase == "decode" and ctx.positions.numel() > 1:
                joined_calls.append(reassociate)
            return stock(ctx, reassociate)
        block._stock = noting
        model.run_layer(block, x, ids, segments, n_prompt, sink, hold_sites=held)
        runs[held] = sink
    decode = range(n_prompt, n_prompt + n_decode)
    for tap in _SiteSink.SITES:
        assert runs[False].calls[tap] == 2 + n_decode, tap  # two prefill chunks, then one emission per step
        assert 2 < runs[True].calls[tap] < 2 + n_decode, tap  # the steps joined (attn.site: by compressed widths)
        for p in decode:
            step, joined = runs[False].rows[tap][p], runs[True].rows[tap][p]
            assert step.keys() == joined.keys()
            for name, value in step.items():
                if name.startswith(("stock_", "twin_")) and value.is_floating_point():
                    # fp32 values of order 1–10 (an ulp at 10: 9.5e-7): a differently shaped call moves them by a
                    # few ulps; 1e-5 absolute and relative is ~10 ulps at 10
                    assert torch.allclose(joined[name], value, rtol=1e-5, atol=1e-5), (tap, p, name)
                elif not name.startswith(("stock_", "twin_")):
                    assert torch.equal(joined[name], value), (tap, p, name)
    # one twin call (re-associated) per joined group, and a stock call only where a patch ran in the op (hc_pre)
    assert joined_calls.count(True) >= len(_SiteSink.SITES) and False in joined_calls, joined_calls


class _SparseSiteSink(_SiteSink):
    """A _SiteSink that samples every fifth position, as a run samples every attn_sample_every-th."""

    def sampled(self, positions: torch.Tensor) -> torch.Tensor:
        return positions % 5 == 0


def _prefill_attention_patch() -> list:
    """A prefill sparse_attention patch that computes what the stock op does: the site's own result is then not the
    stock one (a patch ran), so the stock op is called again beside it, per block or joined."""
    from optimized.patching import Patch, PatchChoice

    patch = Patch("prefill-attention", ("prefill",), "the stock attention, as a patch", source="test")

    @patch.op("sparse_attention")
    def sparse_attention(ctx, **inputs):
        return ctx.base(**inputs)
    return [PatchChoice(patch, {})]


@pytest.mark.parametrize("patched", ["decode only", "prefill attention"])
def test_a_prefill_chunks_attention_sites_are_joined_over_its_blocks(monkeypatch, patched):
    """With hold_sites (a GPU's default) a prefill chunk's attention site makes its stock and twin calls once over the
    sampled queries of all its blocks, after the last block, in calls sized for the chunk's window band — instead of
    once per block (120 blocks per stack and mode at 30K tokens). The caches hold the whole chunk before its first
    block, so each query's own fields are the per-block run's bits and its stock and twin values are the same ops on
    the same inputs, up to the rounding of a wider call. Here 8-query blocks (MAX_QUERY_BLOCK patched) over one
    64-token chunk, every fifth position sampled: 8 calls become 2 (13 queries, at most 8 per call), and the stock op
    is not called again (no patch ran: the own result is the stock one). With a prefill attention patch the site
    covers every query of each block, emitted with its block in either case, the stock op computed beside the
    patch."""
    from reference import layer as reference_layer

    monkeypatch.setattr(reference_layer, "MAX_QUERY_BLOCK", 8)
    source = SyntheticWeights(TINY, 0)
    choices = REGISTRY.choose("mma-sparse-decode") if patched == "decode only" else _prefill_attention_patch()
    model = OptimizedModel(source, choices)
    n_prompt, n_decode = 64, 2
    ids = torch.randint(0, TINY.vocab_size, (n_prompt + n_decode,), generator=torch.Generator().manual_seed(4))
    x = model.embed(ids)
    runs, twins, stocks = {}, [], []
    for held in (False, True):
        sink, block = _SparseSiteSink(), model.layer(2)
        stock = block._stock

        def noting(ctx, reassociate, stock=stock):  # the prefill calls over more than one block's queries
            if ctx.phase == "prefill":
                (twins if reassociate else stocks).append((held, ctx.positions.numel()))
            return stock(ctx, reassociate)
        block._stock = noting
        model.run_layer(block, x, ids, segment_lengths(n_prompt, n_decode, 64), n_prompt, sink, hold_sites=held)
        runs[held] = sink
    if patched == "prefill attention":  # the site at every prefill query, emitted per block in both runs (a
        # whole block is a full call: nothing joined, so no query's q is copied), its stock op computed again
        assert runs[False].calls["attn.site"] == runs[True].calls["attn.site"] == 8 + 1  # + decode
        assert set(range(n_prompt)) <= set(runs[True].rows["attn.site"])
        for p in range(n_prompt):
            for name in ("lse", "stock_lse", "twin_lse"):  # the same calls on the same inputs: the same bits
                assert torch.equal(runs[True].rows["attn.site"][p][name], runs[False].rows["attn.site"][p][name])
        assert {n for _, n in twins} == {n for _, n in stocks} == {64}, (twins, stocks)  # in the chunk's context
        return
    sampled = [p for p in range(n_prompt) if p % 5 == 0]
    assert runs[False].calls["attn.site"] == 8 + 1 and runs[True].calls["attn.site"] == 2 + 1  # decode: 65 sampled
    assert sorted(runs[True].rows["attn.site"]) == sorted(runs[False].rows["attn.site"])
    for p in sampled:
        alone, joined = runs[False].rows["attn.site"][p], runs[True].rows["attn.site"][p]
        assert torch.equal(joined["lse"], alone["lse"]), p  # the variant's own: the block's result, copied
        for name in ("stock_lse", "twin_lse"):  # log-sum-exps of order 1–10: ~10 ulps, as the decode test's
            assert torch.allclose(joined[name], alone[name], rtol=1e-5, atol=1e-5), (p, name)
    # re-associated twins over the joined queries (8 + 5); per block, the twins ran in the chunk's context (64)
    assert {8, 5} <= {n for held, n in twins if held} and {n for held, n in twins if not held} == {64}, twins
    assert not {8, 5} <= {n for held, n in stocks if held}, stocks  # no patch: the own result is the stock op's


def test_the_shared_expert_is_an_op_a_plugin_can_replace():
    """Serving stacks run the shared expert apart from the routed ones, and that path is where they dropped the SwiGLU
    clamp (sgl-project/sglang PR #23776; vllm-project/vllm PR #40950): `shared_expert` is an op, so a plugin can say
    so in one override. With swiglu_limit 0.3 (tiny's pre-activations reach ~4; the limit the transformers oracle
    test uses for the same reason), the shared expert without its clamp moves the logits; a plugin that calls
    `ctx.base` keeps every bit, and the op is called once per prefill chunk and decode step of every layer."""
    import dataclasses

    from optimized import base_ops
    from optimized.patching import Patch, PatchChoice

    cfg = dataclasses.replace(TINY, swiglu_limit=0.3)
    source = SyntheticWeights(cfg, 0)
    ids = torch.randint(0, cfg.vocab_size, (200,), generator=torch.Generator().manual_seed(5)).tolist()
    calls = []
    unclamped = Patch("no-clamp", phases=("prefill", "decode"), description="the shared expert without its clamp")
    wrapped = Patch("wrap", phases=("prefill", "decode"), description="the stock shared expert, counted")

    @unclamped.op("shared_expert")
    def _unclamped(ctx, y, routing):
        return base_ops.shared_expert(ctx.with_fields(cfg=dataclasses.replace(ctx.cfg, swiglu_limit=0.0)), y, routing)

    @wrapped.op("shared_expert")
    def _wrapped(ctx, y, routing):
        calls.append(y.shape[0])
        return ctx.base(y=y, routing=routing)

    def logits(patch: Patch | None) -> torch.Tensor:
        return OptimizedModel(source, [PatchChoice(patch, {})] if patch else []).forward(ids[:196], ids[196:], 128).logits

    stock = logits(None)
    assert torch.equal(logits(wrapped), stock)
    assert len(calls) == cfg.num_hidden_layers * (2 + 4), calls  # two prefill chunks and four decode steps a layer
    moved = float((logits(unclamped) - stock).norm() / stock.norm())
    assert moved > 1e-2, moved


def test_a_table_tells_a_patch_of_its_own_from_the_harness_forcing_patch():
    """OpTable.patched_beyond_harness: the indexer site runs at every prefill query only for a selection a built-in's
    or a plugin's kernel computed — not for decision forcing (the harness's own patch of indexer_topk, which hands
    down the reference's picks), whose run would otherwise pay two more indexers per block for nothing."""
    from optimized.base_ops import BASE_OPS
    from optimized.ops import OpTable
    from optimized.patching import HARNESS_SOURCE, Patch, PatchChoice

    forcing = Patch("forcing", ("prefill",), "hands down picks", source=HARNESS_SOURCE)
    forcing.op("indexer_topk")(lambda ctx, logits, positions, k: None)
    kernel = Patch("tile-kernel", ("prefill",), "a tiled indexer")
    kernel.op("indexer_logits")(lambda ctx, q, weights, positions: None)
    forced = OpTable(BASE_OPS, [PatchChoice(forcing, {})], "prefill")
    assert forced.patched("indexer_topk") and not forced.patched_beyond_harness("indexer_logits", "indexer_topk")
    both = OpTable(BASE_OPS, [PatchChoice(forcing, {}), PatchChoice(kernel, {})], "prefill")
    assert both.patched_beyond_harness("indexer_logits", "indexer_topk")
    assert not OpTable(BASE_OPS, [PatchChoice(kernel, {})], "decode").patched_beyond_harness("indexer_logits")
