"""Number formats (reference/quant.py) against brute-force definitions: every rounding is exact and RNE."""

from __future__ import annotations

import torch

from reference.quant import (E2M1_VALUES, FP8_MAX, QuantizedTensor, ceil_log2, e2m1_decode, e2m1_encode,
                             e8m0_decode, e8m0_encode, fp4_fake_quant, fp8_fake_quant, mx32_to_nvfp4, pack_e2m1,
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
