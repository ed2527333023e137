"""Triton kernels of rounding.py: the bf16 round trip and the FP8 block fake-quant, one pass each.

Every rounding is integer arithmetic on the fp32 bits (or an fp32 addition whose rounding is the one wanted), not a
conversion instruction: the Triton interpreter truncates fp32 → bf16 where the GPU rounds to nearest even (DESIGN
§10), so a kernel written with casts would be checked on the CPU for a rounding the GPU does not do. Written this
way, the interpreter runs the GPU's arithmetic and tests/test_kernels_cpu.py can compare every bit on a CPU.

- bf16, round to nearest even: bits + 0x7FFF + (bit 16 of bits), low 16 bits cleared. Overflow past the largest
  finite bf16 carries into the exponent and gives ±inf, as the conversion does; a NaN is passed through.
- The UE8M0 exponent e = ceil(log2(a / 448)) of a block's a = max(amax, floor) without a division: with
  a = m·2^k (m in [1, 2)), a ≤ 448·2^e = 1.75·2^(8+e) holds first at e = k − 8 when m ≤ 1.75, else at k − 7
  (m > 1.75 ⟺ mantissa field > 0x600000). It is the exponent torch's path finds from the rounded quotient
  fl(a/448): a rounding of a/448 onto a power of two from above would need a/64 = 7·2^e·(1+δ) with
  0 < 7·2^e·δ < 7·2^(e−24), while a/64's spacing there is 2^(e−21). A block whose amax is inf or NaN gets
  e = 0, as torch.frexp gives exponent 0 for them (x is then clamped to ±448 at scale 1, NaN kept).
- x / 2^e as x · 2^−e: both are the correctly rounded x·2^−e.
- e4m3 with round to nearest even, |v| ≤ 448 after the clamp: from 2^−6 (the smallest normal) the fp32 mantissa
  is rounded to 3 bits (+0x7FFFF + bit 20, low 20 bits cleared; 448 is representable, so nothing rounds past
  it); below 2^−6 the spacing is 2^−9, and fl(|v| + 2^14) − 2^14 rounds |v| to a multiple of 2^−9 (ulp(2^14) =
  2^−9), ties to even. The sign is the input's bit, so −0 and small negatives that round to zero stay −0.
- The exponent field read above is a's only for a normal a, and 2^e is built from bits only for e ≥ −126: hence an
  amax floor of at least 2^−118 (rounding.MIN_AMAX_FLOOR; the engine's is 1e−4).

Launches are serialised (optimized.kernels.serialized_launch): the engine rounds in both host lanes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from optimized.kernels import serialized_launch

BF16_BLOCK = 2048
"""Elements per program of the round trip (8 KiB in, 8 KiB out; 8 per thread of 8 warps). A choice, not tuned: the
kernel is bound by memory, and on an H100 it took 0.169 s of a Flash CSA layer, whose two cast kernels took 0.35 s
less than before (0.456 → 0.233 and 0.295 → 0.170 s: Benchmarks)."""
QUANT_ROWS = 16
"""Rows per program of the quantizer: a [16, block] tile, one scale per row (16 × 128 × 4 B = 8 KiB read). A choice,
not tuned."""


@triton.jit
def _bf16_bits(x):
    """x rounded to bf16, as fp32 (NaN passed through)."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536  # -65536 = 0xFFFF0000
    return tl.where(x != x, x, rounded.to(tl.float32, bitcast=True))


@triton.jit
def _bf16_round_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, _bf16_bits(x), mask=mask)


@triton.jit
def _fp8_block_quant_kernel(x_ptr, out_ptr, rows, width, amax_floor, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (r < rows)[:, None] & (c < width)[None, :]
    offs = r[:, None] * width + c[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    amax = tl.max(tl.abs(x), axis=1)
    has_nan = tl.max((x != x).to(tl.int32), axis=1) > 0  # tl.max need not propagate a NaN; torch's amax does
    a = tl.maximum(amax, amax_floor)
    a_bits = a.to(tl.int32, bitcast=True)
    e = ((a_bits >> 23) & 0xFF) - 127 - 8 + ((a_bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    e = tl.where(has_nan | (amax > 3.4028234663852886e38), 0, e)  # inf: above the largest finite fp32
    scale = ((e + 127) << 23).to(tl.float32, bitcast=True)
    inverse = ((127 - e) << 23).to(tl.float32, bitcast=True)
    v = x * inverse[:, None]
    v = tl.where(v != v, v, tl.minimum(tl.maximum(v, -448.0), 448.0))
    bits = v.to(tl.int32, bitcast=True)
    mag_bits = bits & 0x7FFFFFFF
    normal = (mag_bits + 0x7FFFF + ((mag_bits >> 20) & 1)) & -1048576  # -1048576 = 0xFFF00000
    mag = mag_bits.to(tl.float32, bitcast=True)
    subnormal = ((mag + 16384.0) - 16384.0).to(tl.int32, bitcast=True)
    q_bits = tl.where(mag >= 0.015625, normal, subnormal) | (bits & -2147483648)  # 2^-6; the sign bit
    q = tl.where(v != v, v, q_bits.to(tl.float32, bitcast=True))
    tl.store(out_ptr + offs, q * scale[:, None], mask=mask)


def bf16_round_triton(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    n = x.numel()
    if n:
        with serialized_launch(x.device):
            _bf16_round_kernel[(triton.cdiv(n, BF16_BLOCK),)](x, out, n, BLOCK=BF16_BLOCK, num_warps=8)
    return out


def fp8_block_quant_triton(x: torch.Tensor, block: int, amax_floor: float) -> torch.Tensor:
    out = torch.empty_like(x)
    width = x.shape[-1]
    rows = x.numel() // width if width else 0
    if rows:
        floor = float(torch.tensor(amax_floor, dtype=torch.float32))  # the fp32 floor torch.clamp compares with
        with serialized_launch(x.device):
            _fp8_block_quant_kernel[(triton.cdiv(rows, QUANT_ROWS), width // block)](
                x, out, rows, width, floor, ROWS=QUANT_ROWS, BLOCK=block, num_warps=4)
    return out

