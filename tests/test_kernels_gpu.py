"""O1/O2 Triton kernels on the GPU at DeepSeek-V4-Flash shapes: against the torch emulation (same recipe) and the
fp64 reference math, with derived bounds (optimized/kernels/testing.py). Outputs are poisoned with NaN before each
launch so an element the kernel forgets to write shows up.

Run on the accelerator machine:  PYTHONPATH=. python3 -m pytest -q -m gpu tests/test_kernels_gpu.py
Bound arithmetic for the kernel side uses u = 2^-23 for tensor-core dots (they add with truncation, not RNE).
"""

from __future__ import annotations

import pytest
import torch

from optimized.kernels import triton_available
from optimized.kernels.indexer_logits import fp8_paged_mqa_logits
from optimized.kernels.sparse_decode import merge_partials, sparse_decode_partials, sparse_decode_splitk
from optimized.kernels.testing import (U_BF16, U_FP32, U_TENSOR_CORE, decode_lse_bound, decode_out_bound,
                                       dense_decode_reference, indexer_bound, indexer_reference, make_decode_case,
                                       make_indexer_case, partial_straddle_bound, recipe_partials_fp64)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs CUDA + triton")]

FLASH_DECODE = dict(heads=64, nope=448, rope=64, n_main=128, n_extra=512, main_rows=2048, extra_rows=6000)
FLASH_INDEXER = dict(heads=64, dim=128, n_keys=6000)  # several thousand compressed rows, not a page multiple


def assert_within(actual, expected, bound, what):
    err = (actual.double() - expected.double()).abs()
    excess = err - bound
    if excess.numel() == 0:
        return
    worst = int(excess.flatten().argmax())
    assert bool((excess <= 0).all()), (
        f"{what}: {int((excess > 0).sum())} elements outside the derived bound; worst at flat index {worst}: "
        f"|err| = {err.flatten()[worst]:.3e} > bound {bound.flatten()[worst]:.3e}")


def rel_l2(actual, expected):
    return float((actual.double() - expected.double()).norm() / expected.double().norm().clamp(min=1e-300))


def poisoned(*shape_dtype):
    return tuple(torch.full(shape, float("nan"), dtype=dtype, device="cuda") for shape, dtype in shape_dtype)


# ---------------------------------------------------------------------------------------------
# O1
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 64])
def test_decode_triton_at_flash_shapes(batch):
    from optimized.kernels.sparse_decode_triton import merge_partials_triton, sparse_decode_partials_triton
    case = make_decode_case(batch=batch, **FLASH_DECODE, device="cuda", seed=100 + batch)
    b, h, d = case.q.shape
    n_splits = 2 + 8
    mid = poisoned(((b, h, n_splits, d), torch.bfloat16), ((b, h, n_splits), torch.float32))
    sparse_decode_partials_triton(case.q, case.main, case.main_slots, case.extra, case.extra_slots,
                                  case.softmax_scale, 64, out=mid)
    final = poisoned(((b, h, d), torch.bfloat16), ((b, h), torch.float32))
    merge_partials_triton(*mid, case.sink, out=final)
    torch.cuda.synchronize()
    mid_out, mid_lse = mid
    out, lse = final
    assert not bool(torch.isnan(mid_out).any() or torch.isnan(mid_lse).any()), "a partial element was not written"
    assert not bool(torch.isnan(out).any() or torch.isnan(lse).any()), "an output element was not written"

    # partials vs the emulation and vs the fp64 recipe model
    emu_out, emu_lse = sparse_decode_partials(*case.args()[:5], case.softmax_scale, impl="torch")
    assert torch.equal(torch.isneginf(mid_lse), torch.isneginf(emu_lse)), "empty splits differ from the emulation"
    model_out, _, abs_out = recipe_partials_fp64(case)
    differ = float((mid_out.double() != model_out).float().mean())
    print(f"\n[B={batch}] partial elements differing from the fp64 recipe model: {differ:.3%}; "
          f"vs emulation: {float((mid_out != emu_out).float().mean()):.3%}")
    # only rounding-boundary straddles (fp32 order, ex2.approx: p_j off by ~2^-22, so a straddle has probability
    # ~2^-14 per bf16(p_j)) may differ; a skipped bf16 rounding step would differ on most elements
    assert differ <= 0.05
    assert_within(mid_out, model_out, partial_straddle_bound(model_out, abs_out), "partials vs fp64 recipe model")
    assert_within(mid_out, emu_out, 2 * partial_straddle_bound(model_out, abs_out), "partials vs emulation")

    # final output vs the fp64 dense softmax with sink
    ref = dense_decode_reference(case, u_accumulate=U_TENSOR_CORE)
    assert_within(out, ref.out, decode_out_bound(ref), "Triton out vs fp64 dense")
    assert_within(lse, ref.lse, decode_lse_bound(ref), "Triton lse vs fp64 dense")
    assert rel_l2(out, ref.out) <= U_BF16
    # vs the emulation: both within the bound of the exact answer (triangle inequality), and in L2 they differ
    # only by rare boundary straddles: rel L2 <= 2^-10 (expected ~2^-14: flip rate ~3e-4 × 2^-8 per element)
    emu_final = sparse_decode_splitk(*case.args(), impl="torch")
    assert_within(out, emu_final[0], 2 * decode_out_bound(ref), "Triton out vs emulation")
    assert_within(lse, emu_final[1], 2 * decode_lse_bound(ref), "Triton lse vs emulation")
    assert rel_l2(out, emu_final[0]) <= 2.0**-10, f"rel L2 vs emulation {rel_l2(out, emu_final[0]):.2e}"
    print(f"[B={batch}] rel L2: vs fp64 {rel_l2(out, ref.out):.2e}, vs emulation {rel_l2(out, emu_final[0]):.2e}; "
          f"max |lse diff| vs fp64 {float((lse.double() - ref.lse).abs().max()):.2e}")


def test_decode_triton_window_only_and_empty_rows():
    case = make_decode_case(batch=8, **{**FLASH_DECODE, "n_extra": 0}, device="cuda", seed=7)
    case.main_slots[5] = -1  # a row without any valid lane
    case.main_slots[6, 1:] = -1  # a row with one valid lane
    out, lse = sparse_decode_splitk(case.q, case.main, case.main_slots, None, None, case.sink, case.softmax_scale,
                                    impl="triton")
    ref = dense_decode_reference(case, u_accumulate=U_TENSOR_CORE)
    assert bool((out[5] == 0).all()) and torch.equal(lse[5], case.sink.float())
    assert_within(out, ref.out, decode_out_bound(ref), "window-only out")
    assert_within(lse, ref.lse, decode_lse_bound(ref), "window-only lse")
    # one valid lane: the partial is the row itself, out = bf16(v·sigmoid(logit − sink))
    assert_within(out[6], ref.out[6], U_BF16 * ref.out[6].abs() + 2.0**-16 * ref.v_absmax[6], "one lane")


def test_decode_auto_picks_triton_and_merge_dispatch():
    case = make_decode_case(batch=2, **FLASH_DECODE, device="cuda", seed=8)
    mid = sparse_decode_partials(*case.args()[:5], case.softmax_scale, impl="auto")
    tri = merge_partials(*mid, case.sink, impl="triton")
    emu = merge_partials(*mid, case.sink, impl="torch")
    # same partials in: the merges differ only in fp32 order and exp/log implementation, then one bf16 cast
    assert torch.allclose(tri[0].float(), emu[0].float(), rtol=2 * U_BF16, atol=2.0**-20)
    assert torch.allclose(tri[1], emu[1], rtol=0, atol=2.0**-16)


# ---------------------------------------------------------------------------------------------
# O2
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 64])
@pytest.mark.parametrize("dot_precision", ["bf16", "fp32", "tf32"])
def test_indexer_triton_at_flash_shapes(dot_precision, batch):
    case = make_indexer_case(batch=batch, **FLASH_INDEXER, device="cuda", seed=200 + batch)
    (out,) = poisoned(((batch, case.n_cols), torch.float32))
    fp8_paged_mqa_logits(*case.args(), dot_precision=dot_precision, impl="triton", out=out)
    torch.cuda.synchronize()
    assert not bool(torch.isnan(out).any()), "a logit was not written"
    ref = indexer_reference(case)
    assert torch.equal(torch.isneginf(out), ~ref.visible), "masked columns must be exactly t >= context_len"
    vis = ref.visible
    u_dot = U_FP32 if dot_precision == "fp32" else U_TENSOR_CORE
    bound = indexer_bound(case, ref, dot_precision, u_dot=u_dot)
    assert_within(out[vis], ref.logits[vis], bound[vis], f"Triton {dot_precision} vs exact")
    emu = fp8_paged_mqa_logits(*case.args(), dot_precision=dot_precision, impl="torch")
    assert_within(out[vis], emu[vis], 2 * bound[vis], f"Triton {dot_precision} vs emulation")
    same = float((out[vis] == emu[vis]).float().mean()) if bool(vis.any()) else 1.0
    print(f"\n[{dot_precision} B={batch}] identical to emulation: {same:.2%}; max |err| / bound vs exact: "
          f"{float(((out[vis] - ref.logits[vis]).abs() / bound[vis].clamp(min=1e-30)).max()):.3f}")


def test_indexer_triton_prefill_rows_and_zero_masking():
    """1024 prefill rows with causal lengths (the deployed prefill: one row per token), masked_value 0."""
    case = make_indexer_case(batch=1024, heads=64, dim=128, n_keys=8192, device="cuda", seed=300, n_cols=8192,
                             causal=True)
    (out,) = poisoned(((1024, 8192), torch.float32))
    fp8_paged_mqa_logits(*case.args(), dot_precision="bf16", masked_value=0.0, impl="triton", out=out)
    emu = fp8_paged_mqa_logits(*case.args(), dot_precision="bf16", masked_value=0.0, impl="torch")
    assert not bool(torch.isnan(out).any())
    visible = torch.arange(8192, device="cuda")[None, :] < case.context_lens.long()[:, None]
    assert bool((out[~visible] == 0).all())
    # Both round bf16(dot_h) of fp32 dots that differ by accumulation order (<= 2·dI·2^-23·A_h, A_h = Σ_d|q k|);
    # where they straddle a rounding boundary they differ by one bf16 ulp <= 2^-7·|dot_h| <= 2^-7·A_h. Head sum:
    # (nI+2)·2^-24 more each. So |Δlogit| <= (2^-7 + 256·2^-23 + 132·2^-24)·ks_t·Σ_h |w_h|·A_h.
    err = (out - emu)[visible].abs()
    keys = case.cache.codes[case.cache.page_table.long()].flatten(0, 1).float()[:8192]
    ks = case.cache.scale[case.cache.page_table.long()].flatten()[:8192]
    abs_head = torch.einsum("bh,bhd,td->bt", case.weights.abs(), case.q_codes.float().abs(), keys.abs()) * ks
    assert bool((err <= (2 * U_BF16 + 256 * U_TENSOR_CORE + 132 * U_FP32) * abs_head[visible]).all())
    print(f"\n[prefill 1024 rows] identical to emulation: {float((err == 0).float().mean()):.2%}")


@pytest.mark.parametrize("dot_precision", ["bf16", "fp32", "tf32"])
def test_indexer_triton_passes_a_nan_dot_on_as_the_recipe_does(dot_precision):
    """A NaN query code (e4m3fn's 0x7F) makes every visible logit of its row NaN in the kernel as in the torch recipe
    (torch.relu keeps NaN; tl.maximum's default would return 0.0 for it and hide the NaN — the stock indexer runs this
    kernel for GPU prefill blocks, base_ops.paged_logits_apply); the other rows and the masked columns do not change.
    The CPU's interpreter cannot check it: it decodes e4m3fn's NaN code as 480."""
    case = make_indexer_case(batch=8, heads=64, dim=128, n_keys=700, device="cuda", seed=500)
    q = case.q_codes.clone()
    q[2, 5, 7] = float("nan")
    args = (q, *case.args()[1:])
    out = fp8_paged_mqa_logits(*args, dot_precision=dot_precision, impl="triton")
    emu = fp8_paged_mqa_logits(*args, dot_precision=dot_precision, impl="torch")
    clean = fp8_paged_mqa_logits(*case.args(), dot_precision=dot_precision, impl="triton")
    visible = ~torch.isneginf(emu[2])
    assert bool(visible.any()) and bool(torch.isnan(emu[2][visible]).all()), "the recipe passes the NaN on"
    assert torch.equal(torch.isnan(out), torch.isnan(emu)), "the kernel's NaN logits are the recipe's"
    others = torch.arange(8, device="cuda") != 2
    assert torch.equal(out[others], clean[others]) and torch.equal(torch.isneginf(out[2]), ~visible)


def test_indexer_triton_bf16_rounds_to_nearest_even():
    key_codes = torch.zeros(1, 64, 128, dtype=torch.float8_e4m3fn, device="cuda")
    key_codes[:, :, :3] = 1.0
    q_codes = torch.zeros(1, 64, 128, dtype=torch.float8_e4m3fn, device="cuda")
    q_codes[0, 0, :3] = torch.tensor([1.0, 2.0**-8, 2.0**-9])
    weights = torch.zeros(1, 64, device="cuda")
    weights[0, 0] = 1.0
    args = (q_codes, weights, key_codes, torch.ones(1, 64, device="cuda"), torch.zeros(1, dtype=torch.int32,
            device="cuda"), torch.tensor([64], dtype=torch.int32, device="cuda"), 64)
    assert float(fp8_paged_mqa_logits(*args, dot_precision="bf16", impl="triton")[0, 0]) == 1 + 2.0**-7
    assert float(fp8_paged_mqa_logits(*args, dot_precision="fp32", impl="triton")[0, 0]) == 1 + 2.0**-8 + 2.0**-9


def test_rounding_kernels_are_the_torch_ops_bit_for_bit_on_the_gpu():
    """optimized.kernels.rounding on the device: the hard cases (every tie, scale flip, floor, ±0, inf, NaN) and a
    prefill chunk's FP8 linear input at Flash width (8,192 × 4,096, magnitudes over 2^±20), each the same bits as
    the torch ops the engine ran before (a NaN still a NaN)."""
    from optimized.kernels.rounding import bf16_round, fp8_block_quant
    from optimized.kernels.testing import bf16_round_cases, fp8_block_quant_cases, same_bits
    from reference.quant import fp8_fake_quant

    x = bf16_round_cases(device="cuda")
    assert bool(same_bits(bf16_round(x, impl="triton"), x.to(torch.bfloat16).float()).all())
    for block in (128, 64):
        y = fp8_block_quant_cases(block, device="cuda")
        assert bool(same_bits(fp8_block_quant(y, block, 1e-4, impl="triton"),
                              fp8_fake_quant(y, block=block, amax_floor=1e-4)).all()), block
    g = torch.Generator(device="cuda").manual_seed(0)
    chunk = torch.randn(8192, 4096, device="cuda", generator=g) \
        * 2.0 ** torch.randint(-20, 20, (8192, 32), device="cuda", generator=g).float().repeat_interleave(128, 1)
    assert torch.equal(bf16_round(chunk, impl="triton"), chunk.to(torch.bfloat16).float())
    assert torch.equal(fp8_block_quant(chunk, 128, 1e-4, impl="triton"),
                       fp8_fake_quant(chunk, block=128, amax_floor=1e-4))


def test_the_engine_rounds_prefill_sized_tensors_in_one_pass(monkeypatch):
    """numerics.bf16 and fp8_activation take the one-pass kernels for a prefill-sized fp32 tensor on the device and
    keep the torch ops for a decode step's (which its graphs replay); the values are the same either way."""
    from optimized import numerics
    from reference.quant import fp8_fake_quant

    calls = []

    def spy(name):
        real = getattr(numerics, name)
        return lambda *args, **kwargs: calls.append(name) or real(*args, **kwargs)

    for name in ("bf16_round", "fp8_block_quant"):
        monkeypatch.setattr(numerics, name, spy(name))
    big = torch.randn(512, 4096, device="cuda")
    from optimized.kernels.rounding import kernels_match_torch
    assert kernels_match_torch(big.device), "the kernels gave other bits than the torch ops on this device"
    assert torch.equal(numerics.bf16(big), big.to(torch.bfloat16).float())
    assert torch.equal(numerics.fp8_activation(big), fp8_fake_quant(big, block=128, amax_floor=1e-4))
    assert calls == ["bf16_round", "fp8_block_quant"]
    small = big[:2].clone()
    numerics.bf16(small)
    numerics.fp8_activation(small)
    assert calls == ["bf16_round", "fp8_block_quant"], "a decode step's tensors keep the torch ops"


def test_the_stock_indexer_runs_a_prefill_block_as_the_paged_kernel(monkeypatch):
    """base_ops.indexer_logits on a GPU prefill block (causal positions, a scrambled page table, Flash's 64 heads ×
    128 dims, compression ratio 4) takes the paged kernel at "tf32" (base_ops.paged_logits_apply) and gives the torch
    steps' logits but for fp32 accumulation order: both within indexer_bound of the exact fp64 logits, the tensor-core
    u for the kernel's dots and for the torch steps' (exact_matmul, also on tensor cores), and the same −inf columns.
    The twin (`reassociate`), FP4 keys, a decode step's query and DSV4_DRIFT_KERNEL_IMPL=torch keep the torch steps."""
    from optimized import base_ops
    from optimized.kernels import IMPL_ENV, indexer_logits_triton
    from optimized.kernels.testing import IndexerCase
    from optimized.ops import OpContext
    from optimized.state import EngineState
    from reference.config import FLASH
    from reference.ops.compressor import visible_rows

    ratio, n_keys, queries = 4, 6000, 256
    case = make_indexer_case(batch=1, **{**FLASH_INDEXER, "n_keys": n_keys}, device="cuda", seed=400)
    state = EngineState(0, 0, ratio, torch.ones(1), None, None, case.cache, None, None)
    ctx = OpContext(FLASH, 2, "csa", "prefill", 2, torch.arange(queries), state, None, None, torch.device("cuda"), {},
                    None)
    g = torch.Generator(device="cuda").manual_seed(401)
    q = torch.randn(queries, 64, 128, device="cuda", generator=g)
    weights = torch.randn(queries, 64, device="cuda", generator=g) * 64**-0.5
    positions = torch.arange(queries, device="cuda") * (ratio * n_keys // queries)  # from no row visible to ~all
    launched = []
    kernel = indexer_logits_triton.fp8_paged_mqa_logits_triton
    monkeypatch.setattr(indexer_logits_triton, "fp8_paged_mqa_logits_triton",
                        lambda *a, **k: launched.append(a[7]) or kernel(*a, **k))  # a[7]: the dot precision
    fused = base_ops.indexer_logits(ctx, q, weights, positions)
    assert launched == ["tf32"], "a prefill block on the GPU takes the paged kernel"
    monkeypatch.setenv(IMPL_ENV, "torch")
    steps = base_ops.indexer_logits(ctx, q, weights, positions)
    assert launched == ["tf32"], "DSV4_DRIFT_KERNEL_IMPL=torch keeps the torch steps"
    monkeypatch.delenv(IMPL_ENV)
    base_ops.indexer_logits(ctx.with_fields(engine_options={"reassociate": True}), q, weights, positions)
    base_ops.indexer_logits(ctx, q[:1], weights[:1], positions[:1])
    assert launched == ["tf32"], "the twin and a decode step's query keep the torch steps"
    torch.cuda.synchronize()

    q8, w = base_ops.quantize_indexer_q(q, weights)
    exact_case = IndexerCase(q8, w, case.cache, visible_rows(positions, ratio).to(torch.int32), n_keys)
    ref = indexer_reference(exact_case)
    assert torch.equal(torch.isneginf(fused), ~ref.visible) and torch.equal(torch.isneginf(steps), ~ref.visible)
    bound = indexer_bound(exact_case, ref, "tf32", u_dot=U_TENSOR_CORE)
    vis = ref.visible
    assert_within(fused[vis], ref.logits[vis], bound[vis], "stock indexer, paged kernel vs exact")
    assert_within(steps[vis], ref.logits[vis], bound[vis], "stock indexer, torch steps vs exact")
    # the top-512 the indexer picks from them: the same rows but where two logits lie within the bound of each other
    picked = [set(torch.topk(x, 512, dim=-1).indices[-1].tolist()) for x in (fused, steps)]
    same = float((fused[vis] == steps[vis]).float().mean())
    print(f"\n[stock indexer, prefill block] identical to the torch steps: {same:.2%}; the last query's top-512 "
          f"shared: {len(picked[0] & picked[1])}")
