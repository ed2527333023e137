"""O2 Triton kernel: FP8 paged MQA logits (recipe in indexer_logits.py).

Grid (B, ceil(n_cols / 64)): one program = one query row against one 64-row key page. A program whose page
starts at or beyond context_lens[b] writes masked_value and returns without loading anything (early exit);
in the partial last page the columns >= context_len are masked one by one (and not loaded).
Per program: q [BLOCK_H, BLOCK_D] fp8 and the page's keys [64, BLOCK_D] fp8 are widened to bf16 (exact) or fp32
and contracted with one tl.dot into [BLOCK_H, 64] per-head dots; then ReLU, · w_h, head sum, · key_scale.
FP8 tensor-core dots are avoided on purpose: Hopper's fp8 MMA accumulates with reduced precision, which
is not the recipe (fp32 accumulation of exact products); bf16/tf32/fp32 operands hold e4m3 values exactly.
Shared memory per program: at most ([64, 128] + [128, 64]) fp32 operands = 64 KB for "fp32"/"tf32", 32 KB
for "bf16" — within the 99 KB of sm_120; no Hopper-only code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from optimized.kernels import triton_interpreting
from optimized.kernels.sparse_decode_triton import _bf16_rne
from optimized.paged_cache import PAGE_SIZE

PRECISION_CODE = {"fp32": 0, "bf16": 1, "tf32": 2}
LAST_COMPILED: dict[str, object] = {}


@triton.jit
def _logits_kernel(q_ptr, w_ptr, key_ptr, key_scale_ptr, page_table_ptr, stride_pt_row, context_lens_ptr,
                   out_ptr, n_cols, masked_value,
                   N_HEADS: tl.constexpr, DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                   PAGE: tl.constexpr, PRECISION: tl.constexpr, INTERPRET: tl.constexpr):
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
    dims = tl.arange(0, BLOCK_D)
    head_ok = heads < N_HEADS
    dim_ok = dims < DIM
    q = tl.load(q_ptr + (b.to(tl.int64) * N_HEADS + heads[:, None]) * DIM + dims[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
    k = tl.load(key_ptr + key_row[:, None] * DIM + dims[None, :], mask=visible[:, None] & dim_ok[None, :],
                other=0.0).to(tl.float32)
    kt = tl.trans(k)
    if PRECISION == 1:  # bf16 operands (exact), fp32 accumulation, dot rounded to bf16 (RNE)
        if INTERPRET:
            dots = tl.dot(q, kt, input_precision="ieee")
        else:
            dots = tl.dot(q.to(tl.bfloat16), kt.to(tl.bfloat16))
        dots = _bf16_rne(dots, INTERPRET).to(tl.float32)
    elif PRECISION == 2:  # tf32 tensor cores (e4m3 values are exact in tf32)
        if INTERPRET:
            dots = tl.dot(q, kt, input_precision="ieee")
        else:
            dots = tl.dot(q, kt, input_precision="tf32")
    else:  # fp32 FMA
        dots = tl.dot(q, kt, input_precision="ieee")

    w = tl.load(w_ptr + b.to(tl.int64) * N_HEADS + heads, mask=head_ok, other=0.0)
    head_sum = tl.sum(w[:, None] * tl.maximum(dots, 0.0), axis=0)  # [PAGE] fp32
    key_scale = tl.load(key_scale_ptr + key_row, mask=visible, other=0.0)
    logits = tl.where(visible, head_sum * key_scale, masked_value)
    tl.store(out_row + cols, logits, mask=col_ok)


def fp8_paged_mqa_logits_triton(q_codes, weights, key_codes, key_scale, page_table, context_lens, n_cols: int,
                                dot_precision: str, masked_value: float) -> torch.Tensor:
    n_rows, n_heads, dim = q_codes.shape
    out = torch.empty(n_rows, n_cols, dtype=torch.float32, device=q_codes.device)
    if n_rows == 0 or n_cols == 0:
        return out
    page_table = page_table.to(torch.int32).contiguous()
    n_pages = page_table.shape[-1]
    if triton.cdiv(n_cols, PAGE_SIZE) > n_pages:  # columns past the table are always masked (early exit)
        pad = page_table.new_zeros(*page_table.shape[:-1], triton.cdiv(n_cols, PAGE_SIZE) - n_pages)
        page_table = torch.cat([page_table, pad], -1)
    stride_pt_row = page_table.stride(0) if page_table.dim() == 2 else 0
    LAST_COMPILED["logits"] = _logits_kernel[(n_rows, triton.cdiv(n_cols, PAGE_SIZE))](
        q_codes.contiguous(), weights.float().contiguous(), key_codes.contiguous(), key_scale.float().contiguous(),
        page_table, stride_pt_row, context_lens.to(torch.int32).contiguous(), out, n_cols, float(masked_value),
        N_HEADS=n_heads, DIM=dim, BLOCK_H=max(16, triton.next_power_of_2(n_heads)),
        BLOCK_D=max(16, triton.next_power_of_2(dim)), PAGE=PAGE_SIZE, PRECISION=PRECISION_CODE[dot_precision],
        INTERPRET=triton_interpreting(), num_warps=4)
    return out
