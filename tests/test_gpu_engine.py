"""The whole stack on a CUDA device (run on the H200: `python -m pytest -m gpu`); skipped without CUDA.

Device independence is part of the product: synthetic weights must be bit-identical on every device, and the
fp32 reference on the GPU must agree with the CPU reference to fp32 noise (different kernels, same math).
"""

from __future__ import annotations

import pytest
import torch

from optimized.engine import OptimizedModel
from optimized.registry import default_registry
from reference.config import FLASH, TINY
from reference.model import ReferenceModel
from reference.quant import QuantizedTensor
from reference.weights.synthetic import SyntheticWeights

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _same(a, b) -> bool:
    if isinstance(a, QuantizedTensor):
        return torch.equal(a.codes.cpu().view(torch.uint8), b.codes.cpu().view(torch.uint8)) and torch.equal(
            a.scale.cpu().view(torch.uint8), b.scale.cpu().view(torch.uint8))
    return torch.equal(a.cpu(), b.cpu())


def test_synthetic_weights_are_bit_identical_on_gpu_and_cpu():
    src = SyntheticWeights(TINY, 7)
    for layer in range(TINY.num_hidden_layers):
        cpu, gpu = src.layer(layer, "cpu"), src.layer(layer, "cuda")
        for name in cpu.names():
            assert _same(cpu.stored(name), gpu.stored(name)), f"layer {layer} {name} differs between devices"
    ids = torch.arange(0, 500, 7)
    assert torch.equal(src.embed_rows(ids, "cpu"), src.embed_rows(ids, "cuda").cpu())


def test_flash_layer_weights_identical_on_gpu_and_cpu_for_a_sample():
    """One full-width Flash layer's non-expert tensors and a few experts (the CPU side is slow at full width)."""
    src = SyntheticWeights(FLASH, 0)
    gpu = src.layer(2, "cuda")
    from reference.weights.schema import layer_specs

    names = [s.name for s in layer_specs(FLASH, 2) if not s.name.startswith("ffn.experts.")][:12]
    names += ["ffn.experts.0.w1.weight", "ffn.experts.255.w2.weight"]
    for name in names:
        spec = next(s for s in layer_specs(FLASH, 2) if s.name == name)
        cpu = src._make(spec, 2, "cpu")  # noqa: SLF001 - one tensor, not the whole 25 GB layer
        assert _same(cpu, gpu.stored(name)), f"{name} differs between devices"


def test_reference_on_gpu_matches_cpu_to_fp32_noise():
    src = SyntheticWeights(TINY, 0)
    ids = torch.randint(0, TINY.vocab_size, (600,), generator=torch.Generator().manual_seed(1)).tolist()
    cpu = ReferenceModel(src, device="cpu").forward(ids[:590], ids[590:], chunk_size=256).logits
    gpu = ReferenceModel(src, device="cuda").forward(ids[:590], ids[590:], chunk_size=256).logits.cpu()
    # fp32 noise: the CPU reference's own fp32-vs-fp64 difference on this model is ~2e-6 relative L2
    # (tests/test_reference_invariants.py); different GEMM kernels change rounding at that level. A near-tie
    # flip would show as ~1e-2; allow 10× the noise.
    assert float((gpu - cpu).norm() / cpu.norm()) < 2e-5


def test_optimized_engine_with_triton_kernels_on_gpu():
    """The engine with every patch on CUDA (O1/O2 as Triton kernels) against the same engine with the kernels'
    torch emulations: same numeric recipe, different summation order, so they agree far better than the
    engine agrees with the reference."""
    src = SyntheticWeights(TINY, 0)
    ids = torch.randint(0, TINY.vocab_size, (600,), generator=torch.Generator().manual_seed(2)).tolist()
    registry = default_registry()
    ref = ReferenceModel(src, device="cuda").forward(ids[:590], ids[590:], chunk_size=256).logits
    triton = OptimizedModel(src, registry.choose("all"), "cuda").forward(ids[:590], ids[590:], 256).logits
    emulated = OptimizedModel(src, registry.choose(
        "mma-sparse-decode:impl=torch,triton-indexer:impl=torch,bf16-indexer-gemm,bf16-mhc-prelinear,hash-topk,"
        "nvfp4-experts"), "cuda").forward(ids[:590], ids[590:], 256).logits
    assert torch.isfinite(triton).all()
    kernel_vs_emulation = float((triton - emulated).norm() / emulated.norm())
    engine_vs_reference = float((emulated - ref).norm() / ref.norm())
    assert kernel_vs_emulation < 0.5 * engine_vs_reference, (kernel_vs_emulation, engine_vs_reference)


def test_graph_replays_give_the_eager_bits():
    """reference.graphs replays the decode step's small pure functions (mHC mix, FP8 activation quantizer, RMSNorm,
    the attention's RoPE glue, the NVFP4 activation quantizer) and a prefill chunk's Sinkhorn from CUDA graphs: the
    same kernels on inputs of the same layout, so the eager call's bits — also for a strided input and for a second
    call with new values (the replay path, not the capture). The mix is made into a graph first, before any Sinkhorn
    graph exists: its nested Sinkhorn replay must run eagerly inside the making (reference.graphs._making)."""
    from reference import graphs
    from optimized.base_ops import hc_mix
    from optimized import engine
    from optimized.numerics import fp8_activation, rms_norm_bf16
    from optimized.patches.nvfp4_experts import nvfp4_activation
    from reference.ops.mhc import SINKHORN_GRAPH_ELEMENTS, sinkhorn
    from reference.quant import hadamard_matrix

    graphs.clear()  # the mix's graph first of all: made while no Sinkhorn graph exists (its nested replay runs eagerly)
    g = torch.Generator(device="cuda").manual_seed(3)
    for trial in range(2):
        m = torch.randn(1, 24, device="cuda", generator=g)
        streams = torch.randn(1, 4, 512, device="cuda", generator=g).bfloat16()
        base, scale = torch.randn(24, device="cuda", generator=g), torch.rand(3, device="cuda", generator=g)
        x = torch.randn(3, 2048, device="cuda", generator=g)[:, ::2]  # strided
        w = torch.rand(1024, device="cuda", generator=g) + 0.5
        q, kv, q_idx = (torch.randn(1, 8, 64, device="cuda", generator=g), torch.randn(1, 64, device="cuda", generator=g),
                        torch.randn(1, 4, 32, device="cuda", generator=g))
        cos, sin = torch.rand(1, 8, device="cuda", generator=g), torch.rand(1, 8, device="cuda", generator=g)
        hadamard = hadamard_matrix(32, device="cuda")
        m_chunk = torch.randn(8192, 24, device="cuda", generator=g)
        streams_chunk = torch.randn(8192, 4, 512, device="cuda", generator=g).bfloat16()
        comb_chunk = torch.randn(8192, 4, 4, device="cuda", generator=g)
        calls = [lambda: graphs.replay(hc_mix, m, streams, base, scale, n=4, iters=20, eps=1e-6),
                 lambda: hc_mix(m, streams, base, scale, n=4, iters=20, eps=1e-6),
                 lambda: fp8_activation(x), lambda: rms_norm_bf16(x, w, 1e-6),
                 lambda: graphs.replay(engine._normed_rotated_queries, q, cos, sin, eps=1e-6),
                 lambda: graphs.replay(engine._rotated_rows, kv, cos, sin),
                 lambda: graphs.replay(engine._rotated_index_queries, q_idx, cos, sin, hadamard),
                 lambda: graphs.replay(engine._derotated_outputs, q, cos, sin),
                 lambda: nvfp4_activation(x, 0.37),
                 # a prefill chunk's mix: hc_mix eager (its streams too large for a graph), its Sinkhorn replayed
                 # (reference.ops.mhc.SINKHORN_GRAPH_ELEMENTS), and the reference's Sinkhorn at that size
                 lambda: hc_mix(m_chunk, streams_chunk, base, scale, n=4, iters=20, eps=1e-6),
                 lambda: graphs.replay(sinkhorn, comb_chunk, iters=20, eps=1e-6,
                                       max_elements=SINKHORN_GRAPH_ELEMENTS)]
        replayed = [c() for c in calls]
        graphs.ENABLED = False
        try:
            eager = [c() for c in calls]
        finally:
            graphs.ENABLED = True
        for i, (r, e) in enumerate(zip(replayed, eager)):
            for a, b in zip(r if isinstance(r, tuple) else (r,), e if isinstance(e, tuple) else (e,)):
                assert torch.equal(a, b), f"call {i}, trial {trial}: the replay differs from the eager call"
    assert any(v is not None for v in graphs._graphs.values()), "nothing was captured"  # noqa: SLF001
    chunk_sinkhorn = [v for (fn, layout, _), v in graphs._graphs.items()  # noqa: SLF001
                      if fn is sinkhorn and layout[0][0] == (8192, 4, 4)]
    assert chunk_sinkhorn and all(v is not None for v in chunk_sinkhorn), "a prefill chunk's Sinkhorn ran eagerly"


def test_a_function_is_captured_for_at_most_its_cap_of_keys(monkeypatch):
    """reference.graphs.MAX_GRAPHS_PER_FUNCTION: a static argument with many values (per-expert NVFP4 input scales)
    must not hold a graph for each — past the cap, calls run eagerly and give the same values."""
    from reference import graphs
    from optimized.patches.nvfp4_experts import _nvfp4_activation, nvfp4_activation

    monkeypatch.setattr(graphs, "MAX_GRAPHS_PER_FUNCTION", 3)
    graphs.clear()
    x = torch.randn(2, 256, device="cuda", generator=torch.Generator(device="cuda").manual_seed(8))
    for scale in (0.5, 0.25, 0.125, 1.5, 3.0):
        assert torch.equal(nvfp4_activation(x, scale), _nvfp4_activation(x, scale))
    captured = [g for key, g in graphs._graphs.items() if key[0] is _nvfp4_activation]  # noqa: SLF001
    assert len(captured) == 5 and sum(g is not None for g in captured) == 3  # two keys past the cap: eager
    graphs.clear()


def test_reference_decode_with_graph_replays_is_bit_identical():
    """The reference replays its Sinkhorn from a CUDA graph in decode steps (reference.graphs): a prompt and 8
    teacher-forced decode steps, replays on and off, give identical logits."""
    from reference import graphs

    src = SyntheticWeights(TINY, 0)
    ids = torch.randint(0, TINY.vocab_size, (300,), generator=torch.Generator().manual_seed(5)).tolist()
    model = ReferenceModel(src, device="cuda")
    graphs.clear()
    replayed = model.forward(ids[:292], ids[292:]).logits
    assert any(v is not None for v in graphs._graphs.values()), "nothing was captured"  # noqa: SLF001
    graphs.ENABLED = False
    try:
        eager = model.forward(ids[:292], ids[292:]).logits
    finally:
        graphs.ENABLED = True
    assert torch.equal(replayed, eager)


def test_the_yardstick_reads_its_experts_from_the_caches_bf16_copies_with_the_cast_experts_bits(monkeypatch):
    """On a GPU the yardstick takes its experts from the dense cache's bf16 stacks (ReferenceLayer._bf16_experts)
    instead of casting each expert for every chunk: the stacks hold the same values (bf16-exact experts), so a
    layer's prefill chunks and decode steps give identical outputs with and without them, and the stacks were made
    (from a cache filled before the layer, as the runner fills it)."""
    from reference.layer import ReferenceLayer
    from reference.weights.dense_cache import DenseCache

    src, dev = SyntheticWeights(TINY, 0), torch.device("cuda")
    model = ReferenceModel(src, torch.bfloat16, dev)
    ids = torch.randint(0, TINY.vocab_size, (300,), generator=torch.Generator().manual_seed(6)).to(dev)
    streams, segments = model.embed(ids), [128, 128, 36, 1, 1, 1, 1, 1, 1, 1, 1]
    layer = next(n for n in range(TINY.num_hidden_layers) if not TINY.is_hash_layer(n))
    weights = src.layer(layer, dev)

    def run() -> torch.Tensor:
        dense = DenseCache.for_device(dev)
        assert dense.fill(weights.names(), weights.stored, dev)
        return model.run_layer(ReferenceLayer(TINY, layer, weights, torch.bfloat16, device=dev, dense=dense),
                               streams, ids, segments)

    made = []
    original = ReferenceLayer._bf16_experts

    def noting(self, matrix):  # noqa: ANN001
        made.append(original(self, matrix) is not None)
        return original(self, matrix)

    monkeypatch.setattr(ReferenceLayer, "_bf16_experts", noting)
    stacked = run()
    assert made and all(made), "the yardstick made no bf16 stack of its experts"
    monkeypatch.setattr(ReferenceLayer, "_bf16_experts", lambda self, matrix: None)
    assert torch.equal(stacked, run())


def test_engine_decode_with_graph_replays_is_bit_identical():
    """A whole engine (every patch) over a prompt and 8 decode steps, graph replays on and off: identical logits."""
    from reference import graphs

    src = SyntheticWeights(TINY, 0)
    ids = torch.randint(0, TINY.vocab_size, (300,), generator=torch.Generator().manual_seed(4)).tolist()
    model = OptimizedModel(src, default_registry().choose("all"), "cuda")
    replayed = model.forward(ids[:292], ids[292:], 128).logits
    graphs.ENABLED = False
    try:
        eager = model.forward(ids[:292], ids[292:], 128).logits
    finally:
        graphs.ENABLED = True
    assert torch.equal(replayed, eager)


def test_tensor_core_products_of_exact_operands_are_fp32_gemms_but_for_accumulation_order():
    """numerics.exact_product on bf16 tensor cores against fp64: FP8/FP4 operands' products are exact, so the only
    error is the fp32 accumulation's, as the fp32 GEMM's is. Bound: a K-term fp32 sum's worst-case error is K·u·Σ|xw|
    (u = 2^-24); both paths stay far inside it, and within 4× of each other's max error."""
    from optimized import numerics
    from optimized.numerics import exact_product

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1024, 4096, device="cuda", generator=g).to(torch.float8_e4m3fn).float() * 2.0 ** -3
    w = (torch.randn(2048, 4096, device="cuda", generator=g) * 3).to(torch.float8_e4m3fn).float() * 2.0 ** -8
    exact = x.double() @ w.double().T
    bound = 4096 * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T)
    assert numerics.on_tensor_cores(x) and not numerics.on_tensor_cores(x[:1])
    tensor_core, simt = exact_product(x, w), x @ w.T
    assert not torch.equal(tensor_core, simt), "the tensor-core path ran (another accumulation: other bits somewhere)"
    err_tc, err_simt = (tensor_core.double() - exact).abs(), (simt.double() - exact).abs()
    assert bool((err_tc <= bound).all()) and bool((err_simt <= bound).all())
    # measured on an H200: max errors 3.05e-7 against 1.87e-7 of the largest output (1.6×); 4× leaves room for
    # another GEMM kernel's split while catching a path that lost the exactness (a bf16-rounded operand: ~2^-9)
    assert float(err_tc.max()) <= 4 * float(err_simt.max()) + 1e-30
    assert torch.equal(exact_product(x[:1], w), x[:1] @ w.T), "one row (a decode step) stays the fp32 GEMM"


def test_grouped_expert_gemms_are_the_per_expert_gemms_but_for_accumulation_order():
    """numerics.grouped_bf16_products on the H200 (one CUTLASS grouped GEMM per GROUPED_EXPERTS experts) against the
    per-expert tensor-core GEMMs it replaces, both rounded to bf16 as the experts op does next: over a prefill
    chunk's skewed routing at Flash's expert shapes, each output within half a bf16 ulp (≤ 2^-8 of the value) of the
    fp64 product plus the fp32 accumulation's worst case (K·2^-24·Σ|xw|); the two paths' bf16 values differ by at
    most one ulp plus both accumulations' worst cases (an output near zero, where the sum cancels, may differ by
    several of its own ulps), and in under 1% of the outputs."""
    from optimized import numerics

    g = torch.Generator(device="cuda").manual_seed(2)
    rows = torch.multinomial(torch.softmax(torch.randn(40, generator=torch.Generator().manual_seed(2)), 0), 1536,
                             replacement=True).bincount(minlength=40)
    rows = [int(r) for r in rows if r > 0]
    x = torch.randn(sum(rows), 4096, device="cuda", generator=g).to(torch.float8_e4m3fn).float()
    ws = [(torch.randn(512, 4096, device="cuda", generator=g) * 3).to(torch.float8_e4m3fn).float() * 2.0 ** -8
          for _ in rows]
    ends = torch.tensor(rows).cumsum(0).tolist()
    spans = [slice(e - r, e) for e, r in zip(ends, rows)]
    assert numerics.grouped_products_apply(x, 512)
    grouped = numerics.grouped_bf16_products(x, ws, spans)
    loop = torch.cat([numerics.exact_product(x[s], w).bfloat16().float() for s, w in zip(spans, ws)])
    exact = torch.cat([x[s].double() @ w.double().T for s, w in zip(spans, ws)])
    size = torch.cat([x[s].double().abs() @ w.double().abs().T for s, w in zip(spans, ws)])
    accumulation = 4096 * 2.0 ** -24 * size
    assert bool(((grouped.double() - exact).abs() <= 2.0 ** -8 * exact.abs() + accumulation).all())
    ulp = 2.0 ** (torch.floor(torch.log2(loop.abs().clamp_min(1e-30))) - 7)
    assert bool(((grouped - loop).abs().double() <= ulp.double() + 2 * accumulation).all())
    assert (grouped == loop).float().mean() > 0.99, "another order flips a rounding now and then, not often"
    # the weights' bf16 copies as one stack (DenseCache.bf16_stack), each group read where it lies: the same bits
    stack = torch.stack([w.bfloat16() for w in ws])
    assert numerics._rows_of_one_stack(list(stack[:3].unbind(0))) is not None
    assert torch.equal(numerics.grouped_bf16_products(x, list(stack.unbind(0)), spans), grouped)


def test_nvfp4_tensor_core_products_are_the_fp32_gemms_but_for_rounding():
    """numerics.scaled_bf16_products on the H200 at Flash's expert shapes (K = 4096) with NVFP4 operands — activations
    quantized under per-expert input scales, the weights' NVFP4 forms with their global scales — against fp64: inside
    the fp32 accumulation's worst case plus four roundings (K·2^-24 + 4·2^-24)·Σ|xw|, as the fp32 SIMT GEMM it
    replaces is, and within 4× of that GEMM's largest error."""
    from optimized import numerics
    from optimized.patches.nvfp4_experts import nvfp4_activation
    from reference.quant import mx32_to_nvfp4_forms, nvfp4_factors_from_mx, quantize_fp4_mx32

    g = torch.Generator().manual_seed(6)
    rows, K, N = [200, 3, 57, 120], 4096, 512
    qs = [quantize_fp4_mx32(torch.randn(N, K, generator=g) * 0.02) for _ in rows]
    forms, w_scales = mx32_to_nvfp4_forms(qs, "modelopt")
    forms, w_scales = [f.cuda() for f in forms], [s.cuda() for s in w_scales]
    x_scales = [0.41, 0.41, 1.3, 0.027]
    ends = torch.tensor(rows).cumsum(0).tolist()
    spans = [slice(e - r, e) for e, r in zip(ends, rows)]
    y = torch.randn(sum(rows), K, generator=g).cuda() * 3
    x = torch.cat([nvfp4_activation(y[sp], s) for sp, s in zip(spans, x_scales)])
    operands = [numerics.Nvfp4Operand(f, None, s) for f, s in zip(forms, w_scales)]
    got = numerics.scaled_bf16_products(x, operands, spans, x_scales).double()
    # operands given as callables, each made (here a copy of the form) as its GEMM runs and freed after it: the same bits
    made = numerics.scaled_bf16_products(x, [lambda o=o: numerics.Nvfp4Operand(o.source.clone(), None, o.global_scale)
                                             for o in operands], spans, x_scales).double()
    assert torch.equal(made, got)
    # from the MX copies and their factors (kept on the host: a kernel's scalar argument), in fp32 or in bf16 (the
    # dense cache's bf16 stack): the same block products, so the same bits
    mx = [q.dequantize().cuda() for q in qs]
    factors, _, derivable = nvfp4_factors_from_mx(mx, qs, "modelopt")
    assert bool(derivable.all()) and factors.device.type == "cpu"
    for bf16_copy in (False, True):
        operands = [numerics.Nvfp4Operand(m, k, s, m.bfloat16() if bf16_copy else None)
                    for m, k, s in zip(mx, factors, w_scales)]
        from_copies = numerics.scaled_bf16_products(x, operands, spans, x_scales)
        assert torch.equal(from_copies.double(), got), bf16_copy
    fp32 = torch.cat([x[sp] @ w.T for sp, w in zip(spans, forms)]).double()
    exact = torch.cat([x[sp].double() @ w.double().T for sp, w in zip(spans, forms)])
    bound = (K + 4) * 2.0 ** -24 * torch.cat([x[sp].double().abs() @ w.double().abs().T for sp, w in zip(spans, forms)])
    err_tc, err_fp32 = (got - exact).abs(), (fp32 - exact).abs()
    assert bool((err_tc <= bound).all()) and bool((err_fp32 <= bound).all())
    assert float(err_tc.max()) <= 4 * float(err_fp32.max()) + 1e-30


def test_tensor_core_indexer_dots_are_fp32_matmuls_but_for_accumulation_order():
    """numerics.exact_matmul, the stock indexer's dots over a prefill block, on bf16 tensor cores against fp64: FP8
    query and key codes multiply exactly, so the only error is the fp32 accumulation's, as the fp32 matmul's is (the
    bound and the 4× of the GEMM test above). A decode step's single query stays the fp32 matmul."""
    from optimized.numerics import exact_matmul, tensor_core_queries

    g = torch.Generator(device="cuda").manual_seed(1)
    q = (torch.randn(32, 64, 128, device="cuda", generator=g) * 40).to(torch.float8_e4m3fn).float()
    keys = (torch.randn(2048, 128, device="cuda", generator=g) * 40).to(torch.float8_e4m3fn).float()
    assert tensor_core_queries(q) and not tensor_core_queries(q[:1]) and not tensor_core_queries(q.cpu())
    exact = q.double() @ keys.double().T
    bound = 128 * 2.0 ** -24 * (q.double().abs() @ keys.double().abs().T)
    tensor_core, simt = exact_matmul(q, keys.T, True), q @ keys.T
    assert tensor_core.shape == simt.shape == (32, 64, 2048) and tensor_core.dtype == torch.float32
    err_tc, err_simt = (tensor_core.double() - exact).abs(), (simt.double() - exact).abs()
    assert bool((err_tc <= bound).all()) and bool((err_simt <= bound).all())
    assert float(err_tc.max()) <= 4 * float(err_simt.max()) + 1e-30
    assert torch.equal(exact_matmul(q[:1], keys.T, False), q[:1] @ keys.T)


def test_tensor_core_gemms_move_an_engine_run_by_fp32_accumulation_noise_only(monkeypatch):
    """The engine on the GPU with its FP8/FP4/bf16 GEMMs on tensor cores against the same engine with them as fp32
    GEMMs (TENSOR_CORE_MIN_ROWS past any row count): the same exact products summed in another order, so the two
    agree orders of magnitude better than either agrees with the reference (bf16 outputs: a rounding flip moves an
    output by one bf16 ulp now and then)."""
    from optimized import numerics

    src = SyntheticWeights(TINY, 0)
    ids = torch.randint(0, TINY.vocab_size, (600,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = ReferenceModel(src, device="cuda").forward(ids[:590], ids[590:], chunk_size=256).logits
    calls = []
    mm = numerics.bf16_mm
    monkeypatch.setattr(numerics, "bf16_mm", lambda x, w: calls.append(x.shape) or mm(x, w))
    fast = OptimizedModel(src, [], "cuda").forward(ids[:590], ids[590:], 256).logits
    assert calls, "no product reached the tensor cores"
    monkeypatch.setattr(numerics, "TENSOR_CORE_MIN_ROWS", 1 << 40)
    fp32 = OptimizedModel(src, [], "cuda").forward(ids[:590], ids[590:], 256).logits
    moved = float((fast - fp32).norm() / fp32.norm())
    engine_vs_reference = float((fp32 - ref).norm() / ref.norm())
    assert torch.isfinite(fast).all() and moved < 0.1 * engine_vs_reference, (moved, engine_vs_reference)


def test_router_comparison_on_the_device_gives_the_hosts_values_and_batches_decode_steps():
    """metrics.compare_router runs where the reference's ids are: on a GPU the same flip rates (integer counts over a
    tensor k: a correctly rounded division on both, where CUDA's division by a Python scalar multiplies by its
    rounded reciprocal and failed this test) and
    the same weight L1s — each a sum of ≤ 12 differences of torch.rand values (multiples of 2^-24 below 1), so every
    partial sum is a multiple of 2^-24 below 16 and exact in fp64 in any order — and a GPU sink compares 64
    deferred decode emissions of moe.router in one call (probes.BATCHED_ON_DEVICE_TAPS)."""
    from harness.run import probes
    from harness.run.aggregate import LayerAccumulator
    from harness.run.metrics import CompareContext, compare_router

    g = torch.Generator().manual_seed(4)
    T, k = 70, 6
    ids_r = torch.stack([torch.randperm(256, generator=g)[:k] for _ in range(T)])
    ids_v = torch.where(torch.rand(T, k, generator=g) < 0.1, torch.randint(0, 256, (T, k), generator=g), ids_r)
    w_r, w_v = torch.rand(T, k, generator=g), torch.rand(T, k, generator=g)
    ctx = CompareContext("csa", 4, 128, torch.zeros(T, dtype=torch.long), torch.zeros(T, dtype=torch.long), [])
    pos = torch.arange(T)
    host = compare_router(pos, {"expert_ids": ids_r, "weights": w_r}, {"expert_ids": ids_v, "weights": w_v}, ctx)
    dev = compare_router(pos, {"expert_ids": ids_r.cuda(), "weights": w_r.cuda()},
                         {"expert_ids": ids_v.cuda(), "weights": w_v.cuda()}, ctx)
    for h, d in zip(host, dev):
        assert h.metric == d.metric and d.value.is_cuda
        assert torch.equal(d.value.cpu(), h.value), h.metric

    calls = []
    original = probes.COMPARATORS["moe.router"]
    probes.COMPARATORS["moe.router"] = lambda *a: calls.append(a[0].numel()) or original(*a)
    try:
        record = probes.RecordingSink(T, torch.zeros(T, dtype=torch.bool))
        record.emit("moe.router", pos.cuda(), expert_ids=ids_r.cuda(), weights=w_r.cuda())
        sink = probes.ComparingSink(record, LayerAccumulator([]), ctx, "v", "global", 0,
                                    torch.zeros(T, dtype=torch.bool), [])
        for p in range(T - 64, T):
            sink.emit("moe.router", pos[p:p + 1].cuda(), expert_ids=ids_v[p:p + 1].cuda(),
                      weights=w_v[p:p + 1].cuda())
        sink.finish()
    finally:
        probes.COMPARATORS["moe.router"] = original
    assert calls == [64], calls


def test_the_resume_state_of_device_streams_is_copied_through_kept_page_locked_buffers(tmp_path):
    """RunStore.save_streams copies device streams into page-locked host buffers it keeps for the next save (a
    fresh pageable copy of Flash's 5 GB took ~4 s of the run's thread): what is written is the streams' bits at each
    save, the second save reuses the first's buffers (after its write finished), and delete_state drops them (to
    torch's page-locked cache)."""
    from harness.run.store import RunStore

    store = RunStore(tmp_path / "run")
    store.create({})
    gen = torch.Generator(device="cuda").manual_seed(0)
    first = {"reference": torch.randn(64, 4, 32, device="cuda", generator=gen),
             "base": torch.randn(64, 4, 32, device="cuda", generator=gen).bfloat16()}
    store.save_streams(3, first, background=True)
    buffers = {k: b.data_ptr() for k, b in store._host_buffers.items()}
    assert set(buffers) == set(first) and all(b.is_pinned() for b in store._host_buffers.values())
    second = {k: v * 2 for k, v in first.items()}
    store.save_streams(4, second, background=True)
    assert {k: b.data_ptr() for k, b in store._host_buffers.items()} == buffers
    store.wait_for_state()
    layer, loaded = store.load_streams()
    assert layer == 4 and all(torch.equal(loaded[k], second[k].cpu()) and loaded[k].dtype == second[k].dtype
                              for k in second)
    store.delete_state()
    assert not store._host_buffers and not store.state_path.exists()


@pytest.mark.parametrize("key,offset,numel", [(0xDEADBEEF, 0, 3 * (1 << 20) + 7), (0x7FFFFFFF, 5, 1000),
                                              (1, 2**32 - 4096, 4096), (7, 2**32 - 10, 20)])
def test_the_fused_normal_kernel_gives_the_torch_paths_bits_on_the_device(key, offset, numel, monkeypatch):
    """hashing.standard_normal on CUDA through the Triton kernel and through the torch int64 path (FUSED off) give
    the same fp32 bits, and the CPU's: keys below and above 2^31, key 1 (which Triton would specialise), the last
    indices below 2^32, and a range past 2^32 (the kernel hashes 32 bits, so hashing takes the torch path there)."""
    from reference.weights import hashing

    fused = hashing.standard_normal(key, numel, "cuda", offset)
    monkeypatch.setattr(hashing, "FUSED", False)
    unfused = hashing.standard_normal(key, numel, "cuda", offset)
    cpu = hashing.standard_normal(key, numel, "cpu", offset)
    assert torch.equal(fused.view(torch.int32), unfused.view(torch.int32))
    assert torch.equal(fused.cpu().view(torch.int32), cpu.view(torch.int32))


def test_device_busy_counts_the_kernels_and_not_the_host_time_between_them():
    """harness.run.device_time: a region with 8 GEMMs is busy about as long as they take; host sleep between kernels
    is not busy time. Bounds: 8 products of 4096² fp32 (~1.1 TFLOP, ~21 ms at an H200's ~51 TFLOP/s) must show as at
    least 10 ms, and well under the 0.3 s sleep that follows them (0.2 s: a span from the first kernel to the last,
    sleep included, would exceed it)."""
    import time

    from harness.run.device_time import device_busy

    dev = torch.device("cuda")
    a = torch.randn(4096, 4096, device=dev)
    a @ a
    torch.cuda.synchronize()
    start = time.perf_counter()
    with device_busy(dev) as busy:
        for _ in range(8):
            a @ a
        time.sleep(0.3)  # the host waits; the device has nothing to do
        a.sum()
    wall = time.perf_counter() - start
    assert busy.events >= 9
    assert 0.01 <= busy.seconds < 0.2 and busy.seconds < wall
    # a sum per name ≥ the union (one stream: equal, up to the rounding of summing ns/1e9 in another order: 1e-9)
    assert sum(busy.by_name.values()) >= busy.seconds * (1 - 1e-9)
    # the GEMM's kernel dominates: ~21 ms of GEMMs against ~20 µs for the sum of 16M elements at ~4.8 TB/s, so the
    # GEMM's share is > 0.99; 0.9 is a margin, not a measured spread
    assert busy.top(1)[0][1] >= 0.9 * busy.seconds


def test_bench_on_a_gpu_reports_device_busy_seconds_below_the_wall_time(tmp_path):
    from harness.cli.main import main
    import json

    out = tmp_path / "bench.json"
    assert main(["bench", "--model", "tiny", "--tokens", "200", "--decode", "2", "--chunk-size", "128",
                 "--layers", "1-3", "--device", "cuda", "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    for row in record["layers"]:
        busy = row["busy_s"]
        assert set(busy) == {"weights", "reference", "yardstick", "base", "all", "run"}
        assert 0 < busy["run"] < row["run_s"] and all(0 < busy[s] for s in row["alone_s"])
        assert row["top_kernels"] and all(0 < seconds <= busy["run"] for _, seconds in row["top_kernels"])
    assert 0 < record["projected_busy_s"] < record["projected_run_s"]


def test_the_indexer_top_k_set_on_a_gpu_is_the_cpus():
    """reference.ops.topk.stable_topk_set takes the ranked form on a GPU (no host reads): the same rows as the CPU's
    unranked path on the hard cases — plateaus of exact ties wider than the places left, signed zeros, −inf padding,
    a NaN — at an indexer block's shape (256 queries, 7,680 rows → 512), in fp32 and bf16."""
    from reference.ops.topk import stable_topk_set

    g = torch.Generator().manual_seed(5)
    plateau = torch.randint(-2, 3, (256, 7680), generator=g).float().clamp_min(0)
    signed_zeros = torch.where(torch.rand(256, 7680, generator=g) < 0.5, -0.0, 0.0)
    hidden = torch.randn(256, 7680, generator=g).masked_fill(torch.arange(7680) >= 300, float("-inf"))
    with_nan = torch.randn(256, 7680, generator=g)
    with_nan[9, 70] = float("nan")
    for scores in (plateau, signed_zeros, hidden, with_nan, torch.randn(256, 7680, generator=g)):
        for dtype in (torch.float32, torch.bfloat16):  # the yardstick's scores are bf16
            typed = scores.to(dtype)
            assert torch.equal(stable_topk_set(typed.cuda(), 512).cpu(), stable_topk_set(typed, 512))
