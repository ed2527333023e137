"""Number formats of the DeepSeek-V4 checkpoint and serving stack, decoded and encoded exactly.

Shared by the synthetic weight source (which stores weights the way the real checkpoint does, so
the weight format itself is never counted as drift), the checkpoint readers, the reference's
optional QAT simulation (spec §7) and the optimized stack (which computes in these formats).

Every function here is exact, elementwise IEEE arithmetic (power-of-two scaling, table lookups,
round-to-nearest-even) so it gives bit-identical results on every device.

Formats (spec §8.2, optimized-stack §0.1, §6.1):
- E8M0 / UE8M0 scale byte u -> 2^(u-127).
- FP8 e4m3fn: torch.float8_e4m3fn (max 448).
- FP4 e2m1: 4-bit code, bit 3 sign, magnitudes [0, .5, 1, 1.5, 2, 3, 4, 6]; two per byte, even
  element in the low nibble.
- NVFP4: e2m1 with one e4m3 scale per 16 elements and one fp32 global scale per tensor.
"""

from __future__ import annotations


from dataclasses import dataclass

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# ---------------------------------------------------------------------------------------------
# power-of-two scales
# ---------------------------------------------------------------------------------------------


def ceil_log2(x: torch.Tensor) -> torch.Tensor:
    """Exact ceil(log2(x)) for positive finite x, as int32 (frexp: x = m·2^e, m in [0.5, 1))."""
    mantissa, exponent = torch.frexp(x.float())
    return torch.where(mantissa == 0.5, exponent - 1, exponent).to(torch.int32)


def pow2(exponent: torch.Tensor) -> torch.Tensor:
    """2^exponent in fp32, exact (ldexp)."""
    return torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent.to(torch.int32))


def e8m0_decode(u: torch.Tensor) -> torch.Tensor:
    """UE8M0 byte (uint8) -> fp32 power of two 2^(u-127). u = 255 (NaN) is rejected by the readers."""
    return pow2(u.to(torch.int32) - 127)


def e8m0_encode(exponent: torch.Tensor) -> torch.Tensor:
    """Power-of-two exponent (int) -> UE8M0 byte (uint8)."""
    e = exponent.to(torch.int32) + 127
    if bool(((e < 0) | (e > 254)).any()):
        raise ValueError("scale exponent outside the UE8M0 range [-127, 127]")
    return e.to(torch.uint8)


def ue8m0_scale_for(amax: torch.Tensor, format_max: float, floor: float) -> torch.Tensor:
    """Exponent of the smallest power of two s with amax/s <= format_max: 2^ceil(log2(max(amax,floor)/max)).

    The rule of the official act_quant / KV writer (optimized-stack §0.1) and of the checkpoint's block scales.
    """
    return ceil_log2(torch.clamp(amax.float(), min=floor) / format_max)


# ---------------------------------------------------------------------------------------------
# FP8 e4m3
# ---------------------------------------------------------------------------------------------


def round_to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 to the nearest e4m3fn value (RNE), saturating at ±448, returned as fp32."""
    return torch.clamp(x.float(), -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()


# ---------------------------------------------------------------------------------------------
# FP4 e2m1
# ---------------------------------------------------------------------------------------------

# Round-to-nearest-even decision points between consecutive e2m1 magnitudes; at an exact midpoint
# the even code wins (codes 0,2,4,6 are even): 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4.
_E2M1_UPPER = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_TIES_UP = (0.75, 1.75, 3.5)  # midpoints whose upper neighbour has the even code


_TABLES: dict[tuple[str, torch.device], torch.Tensor] = {}


def _table(name: str, values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """A small constant table on `device`, made once (a host-to-device copy per call would stall a GPU)."""
    key = (name, torch.device(device))
    if key not in _TABLES:
        _TABLES[key] = torch.tensor(values, dtype=torch.float32, device=device)
    return _TABLES[key]


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> 4-bit e2m1 code (uint8 in [0, 15]), RNE, saturating at ±6."""
    mag = x.float().abs()
    upper = _table("e2m1_upper", _E2M1_UPPER, x.device)
    code = torch.bucketize(mag, upper, right=False)  # decision points strictly below mag (ties round down)
    tie_up = (mag == _E2M1_TIES_UP[0]) | (mag == _E2M1_TIES_UP[1]) | (mag == _E2M1_TIES_UP[2])
    code = (code + tie_up.to(code.dtype)).to(torch.uint8)
    sign = (x < 0) | ((x == 0) & torch.signbit(x))
    return code | (sign.to(torch.uint8) << 3)


E2M1_BY_CODE = E2M1_VALUES + tuple(-v for v in E2M1_VALUES)
"""The value of each 4-bit e2m1 code: bit 3 the sign, bits 0-2 the magnitude's index in E2M1_VALUES (code 8 is −0)."""


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    """4-bit e2m1 code (uint8, 0-15) -> fp32: one lookup in E2M1_BY_CODE, through int32 indices. Bytes moved per
    code: 1 read + 4 written (the index), 4 read + 4 written (the lookup) = 13, against ~48 for an int64 lookup of
    the magnitude (code & 7, .long(), the gather) and a sign step (code & 8, != 0, negation, where); a Flash layer's
    fp32 copies and NVFP4 forms decode ~6.4·10⁹ codes. On one CPU thread 16.8 M codes took 0.31 → 0.09 s."""
    table = _table("e2m1_by_code", E2M1_BY_CODE, code.device)
    return torch.index_select(table, 0, code.reshape(-1).to(torch.int32)).view(code.shape)


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 to the nearest e2m1 value, RNE, saturating at ±6, without going through codes.

    The e2m1 grid is uniform within [0, 2) (step 0.5), [2, 4) (step 1) and [4, 6] (step 2), and in each
    stretch ties-to-even-code equals ties-to-even-multiple-of-the-step, so torch.round (half to even) of
    |x|/step gives the exact result (equal to e2m1_decode(e2m1_encode(x)), tested exhaustively)."""
    mag = x.float().abs()
    step = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0))
    return torch.copysign(torch.clamp(torch.round(mag / step) * step, max=FP4_MAX), x.float())


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """[..., n] codes -> [..., n/2] bytes, element 2k in the low nibble (spec §8.2)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"FP4 packing needs an even last dimension, got {tuple(codes.shape)}")
    lo = codes[..., 0::2]
    hi = codes[..., 1::2]
    return (lo | (hi << 4)).to(torch.uint8)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[..., n/2] bytes -> [..., n] codes."""
    p = packed.view(torch.uint8) if packed.dtype != torch.uint8 else packed
    lo = p & 0x0F
    hi = (p >> 4) & 0x0F
    return torch.stack([lo, hi], dim=-1).flatten(-2)


# ---------------------------------------------------------------------------------------------
# block helpers
# ---------------------------------------------------------------------------------------------


def _pad_to(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    n = x.shape[dim]
    pad = (-n) % multiple
    if pad == 0:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, torch.zeros(shape, dtype=x.dtype, device=x.device)], dim=dim)


def blocks_last(x: torch.Tensor, block: int) -> torch.Tensor:
    """View the last dim as [n_blocks, block] (zero-padding a partial last block, a copy; else a view)."""
    xp = _pad_to(x, -1, block)
    return xp.view(*x.shape[:-1], xp.shape[-1] // block, block)


def blockwise_amax_last(x: torch.Tensor, block: int) -> torch.Tensor:
    """amax over consecutive blocks of `block` along the last dim (last block may be partial: its zero padding
    changes no maximum of magnitudes)."""
    return blocks_last(x.abs().float(), block).amax(-1)


def expand_blocks_last(s: torch.Tensor, block: int, n: int) -> torch.Tensor:
    """Per-block values along the last dim -> per-element (length n)."""
    return s.repeat_interleave(block, dim=-1)[..., :n]


# ---------------------------------------------------------------------------------------------
# fake-quant (QAT simulation, spec §7) and activation quantization
# ---------------------------------------------------------------------------------------------


def _fake_quant_blocks(x: torch.Tensor, block: int, fmt_max: float, amax_floor: float,
                       round_fn) -> torch.Tensor:
    n = x.shape[-1]
    xb = blocks_last(x.float(), block)
    scale = pow2(ue8m0_scale_for(xb.abs().amax(-1, keepdim=True), fmt_max, amax_floor))  # [..., nb, 1]
    q = round_fn(xb / scale) * scale  # dividing by a power of two is exact
    return q.flatten(-2)[..., :n].to(x.dtype)


def fp8_fake_quant(x: torch.Tensor, block: int = 64, amax_floor: float = 1e-4) -> torch.Tensor:
    """Round-trip x through FP8 e4m3 with one UE8M0 scale per `block` elements of the last dim.

    Spec §7: scale = 2^ceil(log2(max(amax, 1e-4)/448)); q = e4m3_RNE(clamp(x/scale, ±448)); x <- q·scale.
    Used for the 448 nope dims of kv rows (block 64) and for FP8 activations (block 128).
    Returns x's dtype.
    """
    return _fake_quant_blocks(x, block, FP8_MAX, amax_floor, round_to_e4m3)


def fp4_fake_quant(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Round-trip x through FP4 e2m1 with one UE8M0 scale per `block` elements of the last dim.

    Spec §7: scale = 2^ceil(log2(max(amax, 6·2^-126)/6)); q = e2m1_RNE(clamp(x/scale, ±6)); x <- q·scale.
    """
    return _fake_quant_blocks(x, block, FP4_MAX, FP4_MAX * 2.0**-126, round_to_e2m1)


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """Sylvester Hadamard matrix in natural order, scaled by 1/sqrt(n) (orthonormal); n a power of two."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / n**0.5).to(dtype=dtype, device=device)


# ---------------------------------------------------------------------------------------------
# stored weight formats
# ---------------------------------------------------------------------------------------------

WEIGHT_FORMATS = ("fp8_block128", "fp4_mx32", "nvfp4")


@dataclass
class QuantizedTensor:
    """A weight kept in its storage format; `dequantize()` is exact in fp32.

    - fp8_block128: codes float8_e4m3fn [out, in]; scale uint8 UE8M0 [ceil(out/128), ceil(in/128)].
    - fp4_mx32:     codes uint8 packed e2m1 [out, in/2]; scale uint8 UE8M0 [out, in/32].
    - nvfp4:        codes uint8 packed e2m1 [out, in/2]; scale float8_e4m3fn [out, in/16];
                    global_scale fp32 scalar; input_scale optional fp32 scalar (W4A4 activations).
    """

    format: str
    codes: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        rows = self.codes.shape[-2]
        cols = self.codes.shape[-1] * (1 if self.format == "fp8_block128" else 2)
        return (rows, cols)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def to(self, device: torch.device | str) -> "QuantizedTensor":
        def mv(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return QuantizedTensor(self.format, self.codes.to(device), self.scale.to(device),
                               mv(self.global_scale), mv(self.input_scale))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The exact value. Codes and scales may carry leading dimensions (a stack of same-shaped tensors of one
        format, dequantize_stack): the scales are expanded over the last two dimensions either way."""
        out, inp = self.shape
        if self.format == "fp8_block128":
            s = e8m0_decode(self.scale)
            s = s.repeat_interleave(128, -2)[..., :out, :].repeat_interleave(128, -1)[..., :inp]
            return (self.codes.float() * s).to(dtype)
        vals = e2m1_decode(unpack_e2m1(self.codes))
        if self.format == "fp4_mx32":
            s = e8m0_decode(self.scale).repeat_interleave(32, -1)[..., :inp]
            return (vals * s).to(dtype)
        if self.format == "nvfp4":
            assert self.global_scale is not None
            s = self.scale.float().repeat_interleave(16, -1)[..., :inp]
            return (vals * s * self.global_scale.float()).to(dtype)
        raise ValueError(f"unknown weight format {self.format!r}")


STACKABLE_FORMATS = ("fp8_block128", "fp4_mx32")
"""Formats whose dequantization is element-wise given the scales, with no per-tensor number: G tensors of one shape
dequantize as one stack (nvfp4's per-tensor global scale would need one more broadcast)."""


def dequantize_stack(qs: list[QuantizedTensor]) -> torch.Tensor:
    """[G, out, in] fp32: the dequantize() of G tensors of one STACKABLE_FORMATS format and shape, computed over their
    stack — the same element-wise products of the same values, so the same bits, in a dozen launches instead of a
    dozen per tensor (a Flash layer has 768 expert matrices: reference.weights.dense_cache.DenseCache.fill)."""
    if not qs:
        raise ValueError("dequantize_stack: no tensors given")
    first = qs[0]
    for i, q in enumerate(qs):
        if q.format not in STACKABLE_FORMATS or (q.format, q.shape, q.device) != (first.format, first.shape, first.device):
            raise ValueError(f"dequantize_stack: tensor {i} is {q.format} {q.shape} on {q.device}; a stack takes one "
                             f"format among {STACKABLE_FORMATS}, one shape and one device (tensor 0: {first.format} "
                             f"{first.shape} on {first.device})")
    return QuantizedTensor(first.format, torch.stack([q.codes for q in qs]),
                           torch.stack([q.scale for q in qs])).dequantize(torch.float32)


FP8_BLOCK_AMAX_FLOOR = FP8_MAX * 2.0**-127
"""The amax a weight block's scale is computed from when its own is smaller: the one whose scale is UE8M0's smallest,
2^-127 (ceil(log2(floor / 448)) = -127). An all-zero block (the retrieval circuits zero whole 128×128 blocks of
Flash's attn.wq_b) then stores zeros under a representable scale; the earlier floor 2^-120 asked for 2^-128."""


def quantize_fp8_block128(w: torch.Tensor) -> QuantizedTensor:
    """fp32 [out, in] -> FP8 e4m3 with one UE8M0 scale per 128x128 block (checkpoint layout, spec §8.2)."""
    out, inp = w.shape
    wp = _pad_to(_pad_to(w.float(), 0, 128), 1, 128)
    blocks = wp.view(wp.shape[0] // 128, 128, wp.shape[1] // 128, 128)
    amax = blocks.abs().amax(dim=(1, 3))
    exp = ue8m0_scale_for(amax, FP8_MAX, FP8_BLOCK_AMAX_FLOOR)
    s = pow2(exp).repeat_interleave(128, 0)[:out].repeat_interleave(128, 1)[:, :inp]
    codes = torch.clamp(w.float() / s, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return QuantizedTensor("fp8_block128", codes, e8m0_encode(exp))


def quantize_fp4_mx32(w: torch.Tensor) -> QuantizedTensor:
    """fp32 [out, in] -> packed e2m1 with one UE8M0 scale per 32 inputs (routed-expert layout, spec §8.2)."""
    out, inp = w.shape
    if inp % 32:
        raise ValueError(f"FP4 expert weights need in_features % 32 == 0, got {inp}")
    exp = ue8m0_scale_for(blockwise_amax_last(w, 32), FP4_MAX, 2.0**-120)
    s = pow2(exp).repeat_interleave(32, 1)
    codes = e2m1_encode(w.float() / s)
    return QuantizedTensor("fp4_mx32", pack_e2m1(codes), e8m0_encode(exp))


NVFP4_GLOBAL_RULES = ("modelopt", "pow2")


def mx32_to_nvfp4(q: QuantizedTensor, global_rule: str = "modelopt", name: str = "tensor") -> QuantizedTensor:
    """MXFP4 -> NVFP4 (spec §8.4) with the same e2m1 codes; per-16 e4m3 block scale = 2^e / global.

    The block scale 2^e·(2^k/global) must be exact in e4m3. `pow2`: global = 2^(emax−8), a power of two, so every
    block scale is a power of two in [2^-9, 2^8] (exact while the per-32 exponents span ≤ 17 binades). `modelopt`
    (the default): ModelOpt sets global = amax/(6·448), a per-tensor number that is rarely a power of two, and
    real NVFP4 checkpoints' w1/w3 globals differ accordingly (sglang PR #27588: ratio median 1.077). Here
    global = 2^(emax−7)/f with f = 6·2^emax/amax rounded to 3 mantissa bits: the largest per-32 block holds
    amax = c·2^emax with c ∈ (3, 6], so f ∈ [1, 2) and global ≈ amax/(6·2^7) — ModelOpt's amax/(6·448) times the
    constant 3.5, tracking amax to within 1/16 — while block scales 2^(e−emax+7)·f stay exact e4m3 normals
    (≤ 2^7·1.875 = 240, ≥ 2^-6 while the exponents span ≤ 13 binades; wider spans take the pow2 rule). Codes and
    block scales are then exactly the FP4 source's value; the fp32 product block·global is within 2^-23 relative of
    2^e (one rounding of 2^k/f). `name` is the tensor's, for errors.
    """
    if q.format != "fp4_mx32":
        raise ValueError(f"{name}: expected an fp4_mx32 tensor, got {q.format}")
    _, block16, global_scale = _nvfp4_scales(q.codes[None], q.scale[None], global_rule, [name])
    return QuantizedTensor("nvfp4", q.codes.clone(), block16[0], global_scale[0].reshape(()), None)


def mx32_to_nvfp4_forms(qs: list[QuantizedTensor], global_rule: str = "modelopt", names: list[str] | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """([G, out, in] fp32: `mx32_to_nvfp4(q, global_rule).dequantize()` of G same-shaped FP4 tensors, the same bits,
    computed over the stack at once; the tensors' fp32 global scales [G] on the host). A Flash layer converts 768
    expert matrices: a few dozen launches and one host read per stack instead of per matrix. Each dense value is
    fl(code·b · global) with code·b exact in ≤ 6 significant bits, so dense / global rounds to code·b in bf16
    (optimized.numerics.scaled_bf16_products reads the NVFP4 forms on tensor cores so)."""
    names = _checked_fp4_names(qs, names, "mx32_to_nvfp4_forms")
    vals, block16, global_scale = _nvfp4_scales(torch.stack([q.codes for q in qs]), torch.stack([q.scale for q in qs]),
                                                global_rule, names)
    s = block16.float().repeat_interleave(16, -1)[..., : vals.shape[-1]]
    # QuantizedTensor.dequantize's arithmetic, in order
    return vals * s * global_scale.to(vals.device)[:, None, None], global_scale


def nvfp4_factors_from_mx(mx: list[torch.Tensor], qs: list[QuantizedTensor], global_rule: str = "modelopt",
                          names: list[str] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-tensor numbers that make each FP4 tensor's NVFP4 form from its own fp32 values mx[i] ([out, in],
    QuantizedTensor.dequantize of qs[i], as a layer's dense cache holds them; one device): (c, global_scale,
    derivable), each [G] on the host, c and global_scale fp32. Where derivable[i]:

    - bf16(mx[i]·c[i]) is the form's block products code·b, exactly (optimized.numerics.scaled_bf16_products reads
      them on tensor cores), and
    - fl(fl(mx[i]·c[i])·global_scale[i]) is mx32_to_nvfp4(qs[i], global_rule).dequantize(), bit for bit.

    So a run keeps two numbers per matrix instead of a second fp32 copy of every expert (25.8 GB per Flash layer).

    Why: every non-zero 32-block's NVFP4 block scale is its MX scale 2^e times a per-tensor factor c — modelopt
    b = 2^(e−emax+7)·f, so c = 2^(7−emax)·f; pow2 b = 2^(e−emax+8), so c = 2^(8−emax) — and an all-zero block's
    values are ±0 whatever its scale. So code·b = (code·2^e)·c = mx·c, and both are exact (≤ 6 significant bits,
    normal: |code·b| ≥ 0.5·2^-9), which makes fl(fl(mx·c)·global) the dequantization's fl(fl(code·b)·global) bit for
    bit. The per-tensor numbers (all-zero blocks, amax) come from mx too: a block is all zero exactly when its codes
    are, and max|mx| is the largest block's max|code|·2^e, as every code·2^e is exact in fp32 (UE8M0 gives e ≥ −127,
    and 0.5·2^-127 is a subnormal). c = 2^(7−emax)·f must be a finite fp32, which emax ≥ −119 ensures: derivable[i]
    is False for a tensor of smaller values, an all-zero one included (its form comes from its codes). Raises
    ValueError, naming the tensor, when a tensor has no lossless NVFP4 form (the pow2 rule's scales spanning more than
    17 binades). One host read; the temporaries are 1/32 of a tensor per tensor (its block maxima), so large stacks
    cost no more memory than their maxima."""
    names = _checked_fp4_names(qs, names, "nvfp4_factors_from_mx")
    if len(mx) != len(qs) or any(tuple(m.shape) != tuple(qs[0].shape) for m in mx):
        raise ValueError(f"nvfp4_factors_from_mx: {len(mx)} fp32 tensors of shapes "
                         f"{sorted({tuple(m.shape) for m in mx})} for {len(qs)} tensors of shape {tuple(qs[0].shape)} "
                         f"({names[0]} and the rest of its stack)")
    rows, cols = qs[0].shape
    device = mx[0].device
    block_amax = torch.empty(len(mx), rows, cols // 32, device=device)
    for i, m in enumerate(mx):  # max |mx| per 32-block: exact (negation and max)
        lo, hi = torch.aminmax(m.unflatten(-1, (-1, 32)), dim=-1)
        torch.maximum(hi, -lo, out=block_amax[i])
    scale = torch.stack([q.scale for q in qs]).to(device)
    rule = _nvfp4_rule(scale.to(torch.int32) - 127, block_amax == 0, block_amax.flatten(1).amax(1), global_rule, names)
    c = torch.where(rule.modelopt_host, torch.ldexp(torch.ones_like(rule.f), 7 - rule.top_exponent) * rule.f,
                    torch.ldexp(torch.ones_like(rule.f), 8 - rule.top_exponent)).float()
    return c, rule.global_scale, rule.top_exponent >= -119


def _checked_fp4_names(qs: list[QuantizedTensor], names: list[str] | None, caller: str) -> list[str]:
    """The names of a stack of fp4_mx32 tensors of one shape (given, or "tensor i"), checked."""
    names = names or [f"tensor {i}" for i in range(len(qs))]
    if not qs or len(names) != len(qs):
        raise ValueError(f"{caller}: give at least one tensor and one name per tensor ({len(qs)} tensors, "
                         f"{len(names)} names)")
    for q, name in zip(qs, names):
        if q.format != "fp4_mx32":
            raise ValueError(f"{name}: expected an fp4_mx32 tensor, got {q.format}")
        if q.shape != qs[0].shape:
            raise ValueError(f"{name}: shape {tuple(q.shape)} differs from {names[0]}'s {tuple(qs[0].shape)}; a stack "
                             "converts tensors of one shape")
    return names


@dataclass(frozen=True)
class _Nvfp4Rule:
    """The per-tensor numbers of an MX→NVFP4 conversion of a stack of G tensors (mx32_to_nvfp4's docstring).
    exponent: [G, out, in/32] int32, the MX block exponents with each all-zero block's set to emax (any exponent
    is exact for zeros, and it must not widen the span); emax, modelopt: [G, 1, 1] on the device; top_exponent
    (emax), modelopt_host, f, global_scale: [G] on the host."""

    exponent: torch.Tensor
    emax: torch.Tensor
    modelopt: torch.Tensor
    top_exponent: torch.Tensor
    modelopt_host: torch.Tensor
    f: torch.Tensor
    global_scale: torch.Tensor


def _nvfp4_rule(exp: torch.Tensor, zero_block: torch.Tensor, amax: torch.Tensor, global_rule: str,
                names: list[str]) -> _Nvfp4Rule:
    """From the MX block exponents [G, out, in/32] (int32), which blocks are all zero and each tensor's amax [G]:
    the rule and numbers of each tensor's conversion. The per-tensor arithmetic once done in Python floats (f, the
    global) runs in float64 tensors on the host, the same IEEE double operations (round() and torch.round both
    round half to even); one host read for the stack."""
    if global_rule not in NVFP4_GLOBAL_RULES:
        raise ValueError(f"unknown NVFP4 global-scale rule {global_rule!r}; expected one of {NVFP4_GLOBAL_RULES}")
    emax = exp.flatten(1).amax(1)[:, None, None]
    exp = torch.where(zero_block, emax, exp)
    lowest = exp.flatten(1).amin(1)[:, None, None]
    modelopt = (lowest - emax + 7 >= -6) & (global_rule == "modelopt")
    lossy = ~modelopt & (lowest - emax + 8 < -9)  # the pow2 rule's block scales lie in [2^-9, 2^8]
    # the per-tensor numbers on the host, as the one-tensor code computed them in Python: one transfer
    is_modelopt, is_lossy, top_exp, amax = torch.stack([modelopt.flatten().double(), lossy.flatten().double(),
                                                        emax.flatten().double(), amax.double()]).cpu()
    bad = torch.nonzero(is_lossy).flatten().tolist()
    if bad:
        raise ValueError(f"{names[bad[0]]}: per-32 scales span more than 17 binades; NVFP4 conversion would not be "
                         "lossless")
    top = torch.ldexp(torch.ones_like(amax), top_exp.long())  # 2^emax, exact
    f = torch.where(amax > 0, ((FP4_MAX * top / amax * 8).round() / 8).clamp(1.0, 1.875), 1.0)
    global_scale = torch.where(is_modelopt > 0, (top * 2.0**-7 / f).float(), pow2(top_exp.long() - 8))
    return _Nvfp4Rule(exp, emax, modelopt, top_exp.long(), is_modelopt > 0, f, global_scale)


def _nvfp4_scales(codes: torch.Tensor, scale: torch.Tensor, global_rule: str, names: list[str]
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mx32_to_nvfp4 over a stack: packed e2m1 codes [G, out, in/2] and UE8M0 scales [G, out, in/32] -> the e2m1
    values [G, out, in] (fp32, on the codes' device), the e4m3 block scales [G, out, in/16] (there too) and the fp32
    global scales [G] (on the host, as the one-tensor code made them). Each tensor's rule and numbers are those of
    mx32_to_nvfp4's docstring (_nvfp4_rule)."""
    vals = e2m1_decode(unpack_e2m1(codes))
    # amax of the dequantized tensor: each 32-block's largest |value| times its power-of-two scale (exact)
    amax = (vals.abs().unflatten(-1, (-1, 32)).amax(-1) * e8m0_decode(scale)).flatten(1).amax(1)
    rule = _nvfp4_rule(scale.to(torch.int32) - 127, (vals == 0).unflatten(-1, (-1, 32)).all(-1), amax, global_rule,
                       names)
    exp, emax = rule.exponent, rule.emax
    block = torch.where(rule.modelopt, pow2(exp - emax + 7) * rule.f.float().to(exp.device)[:, None, None],
                        pow2(exp - emax + 8))
    return vals, block.repeat_interleave(2, dim=-1).to(torch.float8_e4m3fn), rule.global_scale
