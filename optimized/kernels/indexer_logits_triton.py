"""O2 Triton kernel: FP8 paged MQA logits (recipe in indexer_logits.py).

Grid (B, ceil(n_cols / 64)): one program = one query row against one 64-row key page. A program whose page
starts at or beyond context_lens[b] writes masked_value and returns without loading anything (early exit);
in the partial last page the columns >= context_len are masked one by one (and not loaded).
Per program: q [BLOCK_H, BLOCK_D] fp8 and the page's keys [64, BLOCK_D] fp8 are widened to bf16 (exact) or fp32
and contracted with one tl.dot into [BLOCK_H, 64] per-head dots; then ReLU, · w_h, head sum, · key_scale.
FP8 tensor-core dots are avoided on purpose: Hopper's fp8 MMA accumulates with reduced precision, which
is not the recipe (fp32 accumulation of exact products); bf16/tf32/fp32 operands hold e4m3 values exactly.
The "fp32" FMA dot is contracted 16 dims at a time so its accumulator stays in registers. Shared memory per
program, measured on an H200: 16 KB ("bf16"), 32 KB ("tf32"), 8 KB ("fp32") — within the 99 KB of sm_120;
no Hopper-only code.

Launches are serialised (optimized.kernels.serialized_launch): the stock indexer runs this kernel for prefill
blocks in both host lanes (optimized.base_ops.paged_logits_apply).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from optimized.kernels import serialized_launch, triton_interpreting
from optimized.kernels.sparse_decode_triton import _bf16_rne
from optimized.paged_cache import PAGE_SIZE

PRECISION_CODE = {"fp32": 0, "bf16": 1, "tf32": 2}
LAST_COMPILED: dict[str, object] = {}


@triton.jit
def _logits_kernel(q_ptr, w_ptr, key_ptr, key_scale_ptr, page_table_ptr, stride_pt_row, context_lens_ptr,
                   out_ptr, n_cols, masked_value,
                   N_HEADS: tl.constexpr, DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                   PAGE: tl.constexpr, PRECISION: tl.constexpr, FMA_K: tl.constexpr, INTERPRET: tl.constexpr):
    b = tl.program_id(0)
    tile = tl.program_id(1)
    cols = tile * PAGE + tl.arange(0, PAGE)
    col_ok = cols < n_cols
    out_row = out_ptr + b.to(tl.int64) * n_cols
    context_len = tl.load(context_lens_ptr + b)
    if tile * PAGE >= context_len:  # early exit: the whole page is past the context
        tl.store(out_row + cols, tl.zeros([PAGE], dtype=tl.float32) + masked_value, mask=col_ok)
        return

    visible = cols < context_len
    page = tl.load(page_table_ptr + b.to(tl.int64) * stride_pt_row + tile)
    key_row = page.to(tl.int64) * PAGE + tl.arange(0, PAGE)
    heads = tl.arange(0, BLOCK_H)
    head_ok = heads < N_HEADS
    q_rows = q_ptr + (b.to(tl.int64) * N_HEADS + heads[:, None]) * DIM
    k_rows = key_ptr + key_row[:, None] * DIM
    if PRECISION == 0:
        # fp32 FMA dot, contracted FMA_K dims at a time: the [BLOCK_H, PAGE] fp32 accumulator stays in registers
        # (one 128-deep FMA dot spills ~1.5K registers per thread)
        dots = tl.zeros([BLOCK_H, PAGE], dtype=tl.float32)
        for c in tl.static_range(BLOCK_D // FMA_K):
            dims = c * FMA_K + tl.arange(0, FMA_K)
            q = tl.load(q_rows + dims[None, :], mask=head_ok[:, None] & (dims < DIM)[None, :], other=0.0)
            k = tl.load(k_rows + dims[None, :], mask=visible[:, None] & (dims < DIM)[None, :], other=0.0)
            dots += tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        dims = tl.arange(0, BLOCK_D)
        q = tl.load(q_rows + dims[None, :], mask=head_ok[:, None] & (dims < DIM)[None, :], other=0.0).to(tl.float32)
        k = tl.load(k_rows + dims[None, :], mask=visible[:, None] & (dims < DIM)[None, :], other=0.0).to(tl.float32)
        kt = tl.trans(k)
        if INTERPRET:  # CPU interpreter: fp32 dot for bf16/tf32 too (values identical, DESIGN §10)
            dots = tl.dot(q, kt, input_precision="ieee")
        elif PRECISION == 1:  # bf16 operands (e4m3 values are exact in bf16), fp32 accumulation
            dots = tl.dot(q.to(tl.bfloat16), kt.to(tl.bfloat16))
        else:  # tf32 tensor cores (e4m3 values are exact in tf32)
            dots = tl.dot(q, kt, input_precision="tf32")
        if PRECISION == 1:  # the per-head dot rounded to bf16 (RNE), sglang's bf16 bmm output
            dots = _bf16_rne(dots, INTERPRET).to(tl.float32)

    w = tl.load(w_ptr + b.to(tl.int64) * N_HEADS + heads, mask=head_ok, other=0.0)
    # ReLU as torch.relu: a NaN dot stays NaN (tl.maximum's default would return 0.0 for it, hiding a NaN query or key
    # that the recipe's torch steps — and the stock indexer on the CPU — pass on to the logits)
    relu = tl.maximum(dots, 0.0, propagate_nan=tl.PropagateNan.ALL)
    head_sum = tl.sum(w[:, None] * relu, axis=0)  # [PAGE] fp32
    key_scale = tl.load(key_scale_ptr + key_row, mask=visible, other=0.0)
    logits = tl.where(visible, head_sum * key_scale, masked_value)
    tl.store(out_row + cols, logits, mask=col_ok)


def fp8_paged_mqa_logits_triton(q_codes, weights, key_codes, key_scale, page_table, context_lens, n_cols: int,
                                dot_precision: str, masked_value: float, out: torch.Tensor | None = None
                                ) -> torch.Tensor:
    n_rows, n_heads, dim = q_codes.shape
    if out is None:
        out = torch.empty(n_rows, n_cols, dtype=torch.float32, device=q_codes.device)
    assert out.shape == (n_rows, n_cols) and out.is_contiguous() and out.dtype == torch.float32
    if n_rows == 0 or n_cols == 0:
        return out
    page_table = page_table.to(torch.int32).contiguous()
    n_pages = page_table.shape[-1]
    if triton.cdiv(n_cols, PAGE_SIZE) > n_pages:  # columns past the table are always masked (early exit)
        pad = page_table.new_zeros(*page_table.shape[:-1], triton.cdiv(n_cols, PAGE_SIZE) - n_pages)
        page_table = torch.cat([page_table, pad], -1)
    stride_pt_row = page_table.stride(0) if page_table.dim() == 2 else 0
    args = (q_codes.contiguous(), weights.float().contiguous(), key_codes.contiguous(), key_scale.float().contiguous(),
            page_table, stride_pt_row, context_lens.to(torch.int32).contiguous(), out, n_cols, float(masked_value))
    with serialized_launch(out.device):
        LAST_COMPILED["logits"] = _logits_kernel[(n_rows, triton.cdiv(n_cols, PAGE_SIZE))](
            *args, N_HEADS=n_heads, DIM=dim, BLOCK_H=max(16, triton.next_power_of_2(n_heads)),
            BLOCK_D=max(16, triton.next_power_of_2(dim)), PAGE=PAGE_SIZE, PRECISION=PRECISION_CODE[dot_precision],
            FMA_K=16, INTERPRET=triton_interpreting(), num_warps=4)
    return out
