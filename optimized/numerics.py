"""Low-precision building blocks of the serving stack, emulated exactly with torch (spec §7.1).

Each function reproduces what a deployed kernel computes up to the order of fp32 accumulation:
operands are rounded to the format the hardware sees (bf16, FP8 e4m3 with power-of-two scales,
FP4 e2m1), the products of such operands are exact in fp32, and sums are accumulated in fp32 — so
an fp32 matmul of the rounded operands is the kernel's result but for summation order.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from optimized.kernels.rounding import bf16_round, fp8_block_quant, fused_rounding_applies
from reference.graphs import replay
from reference.quant import fp8_fake_quant

ACT_BLOCK = 128  # FP8 activation quantization: one UE8M0 scale per token per 128 K-elements
ACT_AMAX_FLOOR = 1e-4  # official act_quant floor on amax


def constant(value: float | int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 0-dim tensor of `value`, made once per (value, dtype, device). `torch.where(c, x, <python number>)` turns
    the number into a tensor at every call — on a GPU one more launch, at every decode step; a 0-dim tensor of x's
    own dtype gives the same result dtype and the same bits. Read only: it is shared. Keyed by the value's sign
    too (−0.0 == 0.0 in Python, not in bits); NaN is refused (it equals nothing, so it would never be found)."""
    if value != value:
        raise ValueError("constant(): NaN has no cache key")
    return _constant(value, math.copysign(1.0, value) < 0, dtype, torch.device(device))


@functools.lru_cache(maxsize=None)
def _constant(value: float | int, negative: bool, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(value, dtype=dtype, device=device)


def bf16(x: torch.Tensor) -> torch.Tensor:
    """Round to bf16 (RNE) and keep computing in fp32: the value a bf16 store then load gives. A prefill-sized fp32
    tensor on a GPU in one pass (optimized.kernels.rounding: the same bits, a third less memory traffic and one
    launch instead of two)."""
    if fused_rounding_applies(x):
        return bf16_round(x, impl="triton")
    return x.to(torch.bfloat16).float()


def fp8_activation(x: torch.Tensor) -> torch.Tensor:
    """Per-token FP8 e4m3 quantization with a power-of-two scale per 128 K-elements (official act_quant). A graph in
    decode; a prefill-sized input on a GPU in one pass (optimized.kernels.rounding: the same bits, one launch
    instead of ~17)."""
    x = x.float()
    if fused_rounding_applies(x) and x.shape[-1] % ACT_BLOCK == 0:
        return fp8_block_quant(x, ACT_BLOCK, ACT_AMAX_FLOOR, impl="triton")
    return replay(fp8_fake_quant, x, block=ACT_BLOCK, amax_floor=ACT_AMAX_FLOOR)


TENSOR_CORE_MIN_ROWS = 16
"""Rows from which exact_product runs on bf16 tensor cores. Measured on an H200 (fp32 SIMT against bf16 with fp32
output): 8192×4096 by 4096→1024 1.39 ms against 0.09 ms; 190 rows by 4096→2048 0.088 against 0.022 ms; one row
by 4096→1024 0.019 against 0.024 ms plus the casts' launches — a decode step's products stay fp32 GEMMs. 16 is a
choice between the two measured sizes: few prefill products have fewer rows (an expert with a handful of tokens), and
for those either GEMM costs little."""


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def on_tensor_cores(x: torch.Tensor) -> bool:
    """Whether exact_product may run a product with x's rows on bf16 tensor cores: on a CUDA device, from
    TENSOR_CORE_MIN_ROWS rows."""
    return x.is_cuda and _rows(x) >= TENSOR_CORE_MIN_ROWS


def tensor_core_queries(q: torch.Tensor) -> bool:
    """Whether the indexer's dots for these queries (q's first dim) run on bf16 tensor cores (exact_matmul): on a CUDA
    device, from TENSOR_CORE_MIN_ROWS queries — a prefill block. A decode step's single query stays on fp32 GEMMs:
    its products are a few microseconds of GPU time either way, and the casts would add launches to a host-bound
    step."""
    return q.is_cuda and q.shape[0] >= TENSOR_CORE_MIN_ROWS


def exact_matmul(a: torch.Tensor, b: torch.Tensor, tensor_cores: bool) -> torch.Tensor:
    """a [..., K] @ b [K, N] for fp32 operands whose every value is a bf16 (the indexer's FP8 query and key codes),
    accumulated in fp32. With `tensor_cores` (tensor_core_queries) on bf16 tensor cores with fp32 output: every
    product is exact either way, so it is the fp32 GEMM's sum in another order (as exact_product). Measured on an
    H200 at a Flash CSA prefill block's shapes (256 queries × 64 heads × 128 dims against 7,680 key rows): 0.93 →
    0.17 ms, and no value changed in that sample (sums of 128 exact products).

    Not the attention's q·k and P·V: a micro-benchmark of their products gained 0.06–0.13 ms per block, but a Flash
    CSA layer with them on tensor cores (and this session's other changes) ran 1.036× slower than the code before in
    one A/B (two rounds each; the gathered keys are cast twice per block), while with the indexer alone it ran 0.958×
    in another; and they moved a tiny run's logits by 5.4e-2 of their norm — the size of what the benign twin's
    re-association moves (4.7e-2), bf16 outputs flipping and routing amplifying the flips — where the GEMMs and the
    indexer on tensor cores moved nothing there."""
    if not tensor_cores:
        return a @ b
    flat = torch.mm(a.reshape(-1, a.shape[-1]).bfloat16(), b.bfloat16(), out_dtype=torch.float32)
    return flat.reshape(*a.shape[:-1], b.shape[-1])


def bf16_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K]ᵀ for fp32 tensors whose every value is a bf16, on bf16 tensor cores with fp32 output (the
    casts change no value; fp32 output, so no reduction is made in bf16)."""
    return torch.mm(x.bfloat16(), w.bfloat16().T, out_dtype=torch.float32)


def exact_product(x: torch.Tensor, w: torch.Tensor, weight_is_bf16: Callable[[], bool] = lambda: True
                  ) -> torch.Tensor:
    """x @ wᵀ accumulated in fp32, for x whose every value is a bf16 — the caller knows it: FP8 activations,
    bf16-rounded tensors — and w whose values are bf16 when `weight_is_bf16()` says so (a weight the layer's dense
    cache found exact: DenseCache.bf16_exact; asked only when the product could run on tensor cores, so the CPU never
    pays for the check).

    Each product of two such values is exact in fp32 (≤ 8 + 8 significant bits; exponents of weights and activations
    far from fp32's underflow), so the fp32 GEMM a CPU runs and bf16 tensor cores with fp32 accumulation (what the
    deployed kernels use) sum the same exact terms, differing in the order and the rounding of the fp32
    accumulation (tensor cores may truncate where an FMA rounds to nearest): max error ~3·10⁻⁷ of the largest output
    on an H200, against ~2·10⁻⁷ for the fp32 GEMM (measured). Where on_tensor_cores(x) and the weight is bf16-valued
    it runs there — ~15× faster at a prefill chunk's shapes; elsewhere it is `x @ w.T`, the same bits as before."""
    if not (on_tensor_cores(x) and weight_is_bf16()):
        return x @ w.T
    return bf16_mm(x.reshape(_rows(x), x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[0])


def _on_device(values: list[float] | list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on `device` without waiting for the queue: through page-locked memory on a GPU
    (a copy from pageable memory would wait for every queued kernel)."""
    cuda = device.type == "cuda"
    return torch.tensor(values, dtype=dtype, pin_memory=cuda).to(device, non_blocking=cuda)


GROUPED_EXPERTS = 32
"""Experts whose weights one grouped GEMM reads (grouped_bf16_products): their bf16 copies, made for the call where
the dense cache keeps no bf16 stack of them, are 32 × 2048 × 4096 × 2 B = 0.5 GB at Flash width (harness.run.memory
counts them), and a prefill chunk's 256 experts take 8 grouped GEMMs per matrix instead of 256 GEMMs."""


@functools.lru_cache(maxsize=None)
def _grouped_gemm_device(device: torch.device) -> bool:
    """Whether torch's grouped GEMM runs as one CUTLASS kernel on `device` (sm90 and sm100 only; elsewhere torch
    falls back to a loop that reads the group sizes on the host)."""
    return device.type == "cuda" and hasattr(torch, "_grouped_mm") \
        and torch.cuda.get_device_capability(device)[0] in (9, 10)


def grouped_products_apply(x: torch.Tensor, width: int) -> bool:
    """Whether grouped_bf16_products may compute x's rows' products: on a GPU with a grouped GEMM kernel, from
    TENSOR_CORE_MIN_ROWS rows (a decode step's few rows stay per-expert fp32 GEMMs), with both inner and output
    widths multiples of 8 (the kernel's 16-byte alignment of bf16 rows)."""
    return on_tensor_cores(x) and x.shape[-1] % 8 == 0 and width % 8 == 0 and _grouped_gemm_device(x.device)


def grouped_bf16_products(x: torch.Tensor, weights: list[torch.Tensor], rows: list[slice]) -> torch.Tensor:
    """[P, K] x, whose every value is a bf16, times weights[i]ᵀ ([N, K], every value a bf16) over rows[i] (consecutive
    slices covering x, one per weight): grouped bf16 GEMMs with fp32 accumulation, **rounded to bf16** (returned as
    fp32) — the value bf16(exact_product(...)) has but for the accumulation order, for callers that round the
    products to bf16 next (the experts' GEMM outputs, spec §7.1).

    A per-expert loop launches four kernels per expert (the weight's and the rows' bf16 casts, the GEMM, the copy into
    the output), 3,072 per prefill chunk at Flash width, and was host-bound at 11.4 ms per matrix and chunk on an
    H200; the grouped form casts GROUPED_EXPERTS weights with one multi-tensor copy and runs one grouped GEMM for them
    (6.4 ms per matrix and chunk, bound by the casts' reads, with 1 ms of host time).

    The weights may be fp32 or bf16 tensors: bf16 ones that are consecutive rows of one stack (a layer's experts kept
    in bf16 by the dense cache, DenseCache.bf16_stack) are read where they lie, with no copy; any other group is
    copied into one bf16 buffer first. The same values in the same layout either way, so the same GEMM and bits."""
    xb = x.bfloat16()
    out = torch.empty(x.shape[0], weights[0].shape[0], dtype=torch.bfloat16, device=x.device)
    buffer = None  # one group's buffer, made when a group needs it and reused: the stream orders each grouped GEMM's
    # read before the next group's copy writes it
    for g in range(0, len(weights), GROUPED_EXPERTS):
        ws, spans = weights[g:g + GROUPED_EXPERTS], rows[g:g + GROUPED_EXPERTS]
        stack = _rows_of_one_stack(ws)
        if stack is None:
            if buffer is None:
                buffer = torch.empty(min(len(weights), GROUPED_EXPERTS), *weights[0].shape, dtype=torch.bfloat16,
                                     device=x.device)
            stack = buffer[:len(ws)]
            torch._foreach_copy_(list(stack.unbind(0)), ws)
        start, stop = spans[0].start, spans[-1].stop
        ends = _on_device([s.stop - start for s in spans], torch.int32, x.device)
        out[start:stop] = torch._grouped_mm(xb[start:stop], stack.transpose(1, 2), offs=ends, out_dtype=torch.bfloat16)
    return out.float()


def _rows_of_one_stack(ws: list[torch.Tensor]) -> torch.Tensor | None:
    """[len(ws), N, K] bf16 view of the memory that holds ws when they are contiguous bf16 tensors lying one after
    another in one storage (consecutive rows of a stack), else None."""
    first = ws[0]
    if first.dtype != torch.bfloat16 or not all(w.is_contiguous() and w.shape == first.shape for w in ws):
        return None
    storage, step = first.untyped_storage().data_ptr(), first.numel() * first.element_size()
    if any(w.untyped_storage().data_ptr() != storage or w.data_ptr() != first.data_ptr() + i * step
           for i, w in enumerate(ws)):
        return None
    return first.as_strided((len(ws), *first.shape), (first.numel(), *first.stride()))


def _bf16_product_into(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """out = x @ wᵀ for bf16 x and w with fp32 accumulation: on a GPU on tensor cores with fp32 output; on a CPU (whose
    torch has no bf16 GEMM with fp32 output) as the fp32 GEMM of their values, whose products are exact as well."""
    if x.is_cuda:
        torch.mm(x, w.T, out_dtype=torch.float32, out=out)
    else:
        torch.mm(x.float(), w.float().T, out=out)


@dataclass(frozen=True)
class Nvfp4Operand:
    """An NVFP4 weight as scaled_bf16_products reads it: its block products code·b are bf16(source · factor) — source
    the weight's MX copy (reference.quant.nvfp4_factors_from_mx) — or, with no factor, bf16(source / global_scale) —
    source its NVFP4 form — and global_scale is its fp32 global scale (0-dim, on the device). `factor` is a 0-dim
    fp32 tensor on the host: a kernel reads it as a scalar argument, where a device tensor would be one more
    (broadcast) operand of the element-wise kernel. `source_bf16`, when the dense cache keeps one, is the MX copy's
    bf16 copy (the same values: they are bf16), read instead of the fp32 copy: half the bytes."""

    source: torch.Tensor
    factor: torch.Tensor | None
    global_scale: torch.Tensor
    source_bf16: torch.Tensor | None = None


def scaled_bf16_products(x: torch.Tensor, weights: Sequence[Nvfp4Operand | Callable[[], Nvfp4Operand]],
                         rows: list[slice], x_scales: list[float]) -> torch.Tensor:
    """[P, N] fp32: x[rows[i]] @ wᵀ for NVFP4 operands — x = fl(x̃·s) with s = x_scales[i] (the activations' global
    input scale, 1.0 for bf16 activations), w = fl(w̃·g) the form of weights[i] with g its global scale — where x̃
    (e2m1 code × e4m3 block scale) and w̃ (likewise) have ≤ 6 significant bits: then fl(x / s) and fl(w / g) lie
    within 2^-22 of them and round to them exactly in bf16, so x̃·w̃ products are exact on bf16 tensor cores, and the
    result is fl(Σ x̃·w̃ · fl(s·g)) — the deployed NVFP4 GEMM's own form (block products on tensor cores, one fp32
    alpha at the end), which the fp32 GEMM of fl(x·w) products equals but for fp32 rounding. An operand with a
    factor k reads w̃ = bf16(source · k) from the weight's MX copy instead, exact (Nvfp4Operand): the same w̃.

    weights[i] may be a callable that makes its operand: it is called right before that expert's GEMM, so a form
    made for this use only (one the layer's dense cache could not keep) lives for one GEMM, not the whole matrix
    kind's 256 — and the path, so the bits, do not depend on what the cache kept.

    One weight conversion and one GEMM per expert, as the fp32 loop has one GEMM and one copy: on an H200 a prefill
    chunk's 256 Flash expert matrices took 25 ms as fp32 SIMT GEMMs (host 8 ms)."""
    xt = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device)
    if len(set(x_scales)) == 1:
        torch.div(x, x_scales[0], out=xt)
    else:
        for span, s in zip(rows, x_scales):
            torch.div(x[span], s, out=xt[span])
    # one bf16 weight buffer, reused: the stream orders each GEMM's read before the next expert's conversion writes it;
    # it and the output are made once the first operand is (its shape is the weights')
    out = wt = None
    w_scales = []
    for weight, span in zip(weights, rows, strict=True):
        w = weight() if callable(weight) else weight
        if wt is None:
            wt = torch.empty(w.source.shape, dtype=torch.bfloat16, device=x.device)
            out = torch.empty(x.shape[0], w.source.shape[0], dtype=torch.float32, device=x.device)
        if w.factor is None:
            torch.div(w.source, w.global_scale, out=wt)
        else:  # mx·c is exact in fp32 (≤ 6 significant bits), so bf16 and fp32 sources give the same bf16 product
            torch.mul(w.source if w.source_bf16 is None else w.source_bf16, w.factor, out=wt)
        _bf16_product_into(xt[span], wt, out[span])
        w_scales.append(w.global_scale)
        del w  # a form made for this GEMM is freed once it is queued (the allocator orders its reuse on the stream)
    counts = _on_device([span.stop - span.start for span in rows], torch.int64, x.device)
    scales = _on_device(x_scales, torch.float32, x.device)  # s in fp32, as the activations' quantizer used it
    alpha = torch.repeat_interleave(torch.stack(w_scales) * scales, counts, output_size=x.shape[0])  # fl(g·s) per row
    return out.mul_(alpha[:, None])


def fp8_linear(x: torch.Tensor, weight_fp32: torch.Tensor,
               weight_is_bf16: Callable[[], bool] = lambda: False) -> torch.Tensor:
    """FP8 GEMM: FP8 activations (1×128, UE8M0) × FP8 block-scaled weights, fp32 accumulation, bf16 output; on
    tensor cores when the weight is bf16-valued (exact_product: the activations are FP8 values times powers of two,
    bf16 by construction)."""
    return bf16(exact_product(fp8_activation(x), weight_fp32, weight_is_bf16))


def bf16_linear(x: torch.Tensor, weight_fp32: torch.Tensor, out_bf16: bool = True, weight_rounded: bool = False
                ) -> torch.Tensor:
    """bf16 tensor-core GEMM: bf16 operands, fp32 accumulation; output bf16 (or fp32 when asked). `weight_rounded`:
    the weight's values are bf16 already (base_ops.rounded_weight), so it is not rounded again."""
    y = exact_product(bf16(x), weight_fp32 if weight_rounded else bf16(weight_fp32))
    return bf16(y) if out_bf16 else y


def fp32_linear(x: torch.Tensor, weight_fp32: torch.Tensor) -> torch.Tensor:
    """Full fp32 GEMM (SIMT): the official path for compressor projections and the router."""
    return x.float() @ weight_fp32.T


def rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 from its (bf16) input, written back as bf16 (spec §7.1); a graph in decode."""
    return replay(_rms_norm_bf16, x, weight, eps=eps)


def _rms_norm_bf16(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return bf16(weight.float() * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps))
