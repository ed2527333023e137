"""Number formats (reference/quant.py) against brute-force definitions: every rounding is exact and RNE."""

from __future__ import annotations

import pytest
import torch

from reference.quant import (E2M1_VALUES, FP8_MAX, QuantizedTensor, ceil_log2, e2m1_decode, e2m1_encode,
                             e8m0_decode, e8m0_encode, fp4_fake_quant, fp8_fake_quant, mx32_to_nvfp4,
                             mx32_to_nvfp4_forms, nvfp4_factors_from_mx, pack_e2m1,
                             quantize_fp4_mx32, quantize_fp8_block128, round_to_e2m1, round_to_e4m3, unpack_e2m1)


def brute_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 magnitude by exhaustive search; ties to the even code; saturate at 6."""
    grid = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    mag = x.double().abs().clamp(max=6.0)
    dist = (mag[:, None] - grid[None, :]).abs()
    best = dist.min(1).values
    candidates = dist == best[:, None]
    even = candidates & (torch.arange(8) % 2 == 0)[None, :]
    idx = torch.where(candidates.sum(1) > 1, even.float().argmax(1), dist.argmin(1))
    return (grid[idx] * torch.where(x < 0, -1.0, 1.0).double()).float()


def test_e2m1_rounding_is_rne_everywhere():
    x = torch.cat([torch.linspace(-9, 9, 200001), torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0])])
    expected = brute_e2m1(x)
    assert torch.equal(e2m1_decode(e2m1_encode(x)).abs(), expected.abs())
    assert torch.equal(round_to_e2m1(x).abs(), expected.abs())
    assert torch.equal(torch.signbit(round_to_e2m1(x)), torch.signbit(e2m1_decode(e2m1_encode(x))))


def test_e2m1_codes_and_nibble_order():
    codes = torch.arange(16, dtype=torch.uint8)
    assert e2m1_decode(codes).tolist() == [0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6]
    assert torch.signbit(e2m1_decode(codes)).tolist() == [False] * 8 + [True] * 8, "code 8 is −0 (== hides it)"
    grid = codes[torch.randperm(16, generator=torch.Generator().manual_seed(0))].repeat(3, 2).t()  # not contiguous
    assert torch.equal(e2m1_decode(grid), e2m1_decode(grid.contiguous())) and e2m1_decode(grid).shape == grid.shape
    packed = pack_e2m1(torch.tensor([[1, 15, 7, 0]], dtype=torch.uint8))
    assert packed.tolist() == [[0xF1, 0x07]]  # element 2k in the low nibble (spec §8.2)
    assert torch.equal(unpack_e2m1(packed), torch.tensor([[1, 15, 7, 0]], dtype=torch.uint8))


def test_e4m3_rounding_saturates_and_keeps_representable_values():
    vals = torch.tensor([0.0, 1.0, 1.0625, 1.125, 448.0, 500.0, -1e9, 2**-9])
    out = round_to_e4m3(vals)
    assert out[0] == 0 and out[1] == 1 and out[4] == FP8_MAX and out[5] == FP8_MAX and out[6] == -FP8_MAX
    assert out[2] in (1.0, 1.125)  # 1.0625 is the midpoint: RNE picks the even mantissa 1.0
    assert out[2] == 1.0 and out[3] == 1.125 and out[7] == 2**-9


def test_ceil_log2_and_e8m0_are_exact():
    x = torch.tensor([1.0, 1.5, 2.0, 3.0, 0.75, 2**-20, 2**-20 * 1.0001, 448.0])
    assert ceil_log2(x).tolist() == [0, 1, 1, 2, 0, -20, -19, 9]
    assert torch.equal(e8m0_decode(e8m0_encode(torch.tensor([-127, 0, 5, 127]))),
                       torch.tensor([2.0**-127, 1.0, 32.0, 2.0**127]))


def test_an_all_zero_weight_block_quantizes_under_the_smallest_ue8m0_scale():
    """Flash's retrieval layers zero whole 128×128 blocks of attn.wq_b; their scale must be representable (2^-127,
    byte 0), not the 2^-128 the old floor asked for, which stopped flash-30k at layer 4."""
    w = torch.randn(256, 384, generator=torch.Generator().manual_seed(1))
    w[:128, 128:256] = 0
    q = quantize_fp8_block128(w)
    assert q.scale[0, 1] == 0 and int(q.scale.min()) == 0
    d = q.dequantize()
    assert torch.equal(d[:128, 128:256], torch.zeros(128, 128))
    assert torch.equal(quantize_fp8_block128(d).dequantize(), d)


def test_block_quantizers_dequantize_exactly_and_respect_their_ranges():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 260, generator=g) * torch.exp(torch.randn(300, 1, generator=g))
    q8 = quantize_fp8_block128(w)
    assert q8.scale.shape == (3, 3) and q8.shape == (300, 260)
    d8 = q8.dequantize()
    assert torch.equal(quantize_fp8_block128(d8).dequantize(), d8), "a dequantized FP8 tensor must round-trip"
    assert float((d8 - w).norm() / w.norm()) < 2**-4  # e4m3 unit roundoff bounds the relative error
    w4 = torch.randn(64, 256, generator=g)
    q4 = quantize_fp4_mx32(w4)
    d4 = q4.dequantize()
    assert torch.equal(quantize_fp4_mx32(d4).dequantize(), d4)
    nv = mx32_to_nvfp4(q4, "pow2")
    assert isinstance(nv, QuantizedTensor) and nv.scale.shape == (64, 16)
    assert torch.equal(nv.dequantize(), d4), "MXFP4 -> NVFP4 with power-of-two globals must be lossless"
    modelopt = mx32_to_nvfp4(q4)
    assert torch.equal(modelopt.codes, q4.codes), "the e2m1 codes carry over unchanged"
    # block·global = 2^e up to one fp32 rounding of 2^k/f and one of the product (2·2^-24 relative)
    assert torch.allclose(modelopt.dequantize(), d4, rtol=2.0**-23, atol=0)
    # the global scale tracks ModelOpt's amax/(6·448): their ratio is the constant 448/2^7 = 3.5 up to rounding f
    # to 3 mantissa bits (≤ 1/16 of f ≥ 1)
    ratio = float(modelopt.global_scale) / (float(d4.abs().max()) / (6 * 448))
    assert abs(ratio / 3.5 - 1) <= 1 / 16


def _fp4_stack_of_every_kind() -> list[QuantizedTensor]:
    """FP4 tensors [32, 64] covering what an NVFP4 conversion branches on: plain values, all-zero 32-blocks (under
    the quantizer's smallest scale and under UE8M0's smallest byte, e = −127), −0 codes, a span that sends modelopt
    to the pow2 rule (14 binades), small values (emax −100; an all-zero tensor's −122 would send the whole stack to
    the codes: tested apart)."""
    g = torch.Generator().manual_seed(11)
    plain = quantize_fp4_mx32(torch.randn(32, 64, generator=g) * torch.exp(torch.randn(32, 1, generator=g)))
    zeros = torch.randn(32, 64, generator=g)
    zeros[3] = 0.0
    zeros[7, 32:] = 0.0
    zero_blocks = quantize_fp4_mx32(zeros)
    scale = zero_blocks.scale.clone()
    scale[3] = 0  # an all-zero block stored under 2^-127, as a checkpoint may write it
    zero_byte = QuantizedTensor("fp4_mx32", zero_blocks.codes.clone(), scale)
    codes = plain.codes.clone()
    codes[0, :4] = 0x88  # −0 in both nibbles
    negative_zero = QuantizedTensor("fp4_mx32", codes, plain.scale.clone())
    wide = torch.randn(32, 64, generator=g)
    wide[0, :32] *= 2.0**8
    wide[5, 32:] *= 2.0**-6
    tiny = quantize_fp4_mx32(torch.randn(32, 64, generator=g) * 2.0**-100)
    return [plain, zero_blocks, zero_byte, negative_zero, quantize_fp4_mx32(wide), tiny]


def test_nvfp4_factors_make_the_forms_and_block_products_from_each_fp32_copy():
    """nvfp4_factors_from_mx, tensor by tensor from a list of fp32 copies (what a layer's dense cache holds; no stack
    of them is made): fl(fl(mx·c)·g) is each tensor's NVFP4 form — the bits, −0 included, of mx32_to_nvfp4's
    dequantization and of mx32_to_nvfp4_forms — g is its global scale, and bf16(mx·c) its block products code·b
    (which numerics.scaled_bf16_products reads on tensor cores). Every kind of stack, both rules."""
    qs = _fp4_stack_of_every_kind()
    mx = [q.dequantize() for q in qs]
    for rule in ("modelopt", "pow2"):
        c, g, derivable = nvfp4_factors_from_mx(mx, qs, rule)
        assert bool(derivable.all()) and c.dtype == g.dtype == torch.float32
        stacked, stacked_g = mx32_to_nvfp4_forms(qs, rule)
        assert torch.equal(g, stacked_g)
        for i, q in enumerate(qs):
            one = mx32_to_nvfp4(q, rule)
            assert float(one.global_scale) == float(g[i]), f"{rule}, tensor {i}"
            form = (mx[i] * c[i]) * g[i]
            assert torch.equal(form.view(torch.int32), one.dequantize().view(torch.int32)), f"{rule}, tensor {i}"
            assert torch.equal(form.view(torch.int32), stacked[i].view(torch.int32)), f"{rule}, tensor {i}"
            blocks = e2m1_decode(unpack_e2m1(one.codes)) * one.scale.float().repeat_interleave(16, -1)
            assert torch.equal((mx[i] * c[i]).bfloat16().float().view(torch.int32), blocks.view(torch.int32))
        if rule == "pow2":
            assert all(torch.equal((m * ci) * gi, m) for m, ci, gi in zip(mx, c, g)), "pow2 forms are the MX values"
    assert (mx32_to_nvfp4_forms(qs[:1])[0][0] != mx[0]).any(), \
        "modelopt's global scale moves some values (the test's teeth)"


def test_nvfp4_forms_over_their_global_scale_are_bf16_block_products():
    """The global scales returned beside the NVFP4 forms (mx32_to_nvfp4_forms: each tensor's
    mx32_to_nvfp4().global_scale) make the tensor-core path of optimized.numerics.scaled_bf16_products exact for a
    kept form: dense = fl(code·b · g) with code·b of ≤ 6 significant bits, so fl(dense / g) rounds in bf16 to code·b —
    which times g rounds back to dense, every bit (−0 included). Every kind of stack, both rules."""
    qs = _fp4_stack_of_every_kind()
    for rule in ("modelopt", "pow2"):
        dense, g = mx32_to_nvfp4_forms(qs, rule)
        assert g.dtype == torch.float32
        for i, q in enumerate(qs):
            one = mx32_to_nvfp4(q, rule)
            blocks = e2m1_decode(unpack_e2m1(one.codes)) * one.scale.float().repeat_interleave(16, -1)
            unscaled = (dense[i] / g[i]).bfloat16().float()
            assert torch.equal(unscaled, blocks), f"{rule}, tensor {i}: dense / g is not code·b in bf16"
            assert torch.equal((unscaled * g[i]).view(torch.int32), dense[i].view(torch.int32)), f"{rule}, tensor {i}"


def test_an_nvfp4_factor_past_fp32s_range_is_not_derivable():
    """A tensor whose largest block exponent is below −119 has no normal per-tensor factor 2^(7−emax)·f (its forms come
    from its codes: optimized.base_ops.prepare_nvfp4_forms); an all-zero tensor (emax −122) is such a tensor too."""
    scale = torch.full((32, 2), 5, dtype=torch.uint8)  # every block 2^-122
    low = QuantizedTensor("fp4_mx32", quantize_fp4_mx32(torch.randn(32, 64)).codes, scale)
    empty, plain = quantize_fp4_mx32(torch.zeros(32, 64)), quantize_fp4_mx32(torch.randn(32, 64))
    stack = [low, plain, empty]
    assert nvfp4_factors_from_mx([q.dequantize() for q in stack], stack)[2].tolist() == [False, True, False]


def test_nvfp4_stack_errors_name_the_tensor():
    plain, other = quantize_fp4_mx32(torch.randn(32, 64)), quantize_fp4_mx32(torch.randn(64, 64))
    with pytest.raises(ValueError, match="w3: shape \\(64, 64\\) differs from w1's \\(32, 64\\)"):
        mx32_to_nvfp4_forms([plain, other], names=["w1", "w3"])
    with pytest.raises(ValueError, match="1 fp32 tensors of shapes \\[\\(32, 64\\)\\] for 2 tensors .*w1 and the rest"):
        nvfp4_factors_from_mx([plain.dequantize()], [plain, plain], names=["w1", "w2"])


def test_fake_quant_blocks_use_power_of_two_scales():
    x = torch.randn(4, 448) * 10
    y = fp8_fake_quant(x, block=64)
    # every 64-block is (e4m3 value)·2^k with one k per block: dividing by the block's power-of-two scale
    # yields e4m3-representable numbers
    blocks = y.view(4, 7, 64)
    amax = x.view(4, 7, 64).abs().amax(-1, keepdim=True)
    scale = torch.ldexp(torch.ones_like(amax), ceil_log2(amax / FP8_MAX).to(torch.int32))
    assert torch.equal(round_to_e4m3(blocks / scale), blocks / scale)
    z = fp4_fake_quant(x, block=32).view(4, 14, 32)
    amax4 = x.view(4, 14, 32).abs().amax(-1, keepdim=True)
    scale4 = torch.ldexp(torch.ones_like(amax4), ceil_log2(amax4 / 6.0).to(torch.int32))
    assert torch.equal(round_to_e2m1(z / scale4), z / scale4)
