"""O2 — FP8 paged MQA logits of the indexer (optimized-stack §3).

logit[b, t] = Σ_h w[b, h] · ReLU(dot_h[b, t]) · key_scale[t]   for t < context_lens[b], else masked_value,
dot_h[b, t] = Σ_d q[b, h, d] · k[t, d] over the FP8 e4m3 VALUES (each product exact in fp32, fp32 accumulation).

Key row t lives at page page_table[t // 64] (or page_table[b, t // 64] for a per-row table), offset t % 64.

dot_precision (the per-head dot of the deployed variants, §3.2):
- "fp32": fp32 accumulation (SIMT FMA on the GPU).
- "bf16": the fp32 dot rounded to bf16 (round-to-nearest-even) before the ReLU — sglang's capture-safe bmm.
- "tf32": a tf32 tensor-core dot. e4m3 values (4 significant bits) are exact in tf32, so the value recipe is
  the fp32 one; only the accumulation order differs. The emulation computes it as "fp32".

Order of the fp32 epilogue (sglang's): s = Σ_h (w_h · ReLU(dot_h)) in fp32, then logit = s · key_scale[t].
The caller folds the per-(row, head) q scale and the indexer's weight scaling into `weights`.
"""

from __future__ import annotations

import torch

from optimized.kernels import fp32_matmul_exact, resolve_impl
from optimized.paged_cache import PAGE_SIZE

DOT_PRECISIONS = ("fp32", "bf16", "tf32")
# Rows per emulation chunk: keeps the [rows, heads, cols] fp32 dot tensor near 2^28 elements (1 GiB).
_EMULATION_ELEMENTS = 1 << 28


def fp8_paged_mqa_logits(q_codes: torch.Tensor, weights: torch.Tensor, key_codes: torch.Tensor,
                         key_scale: torch.Tensor, page_table: torch.Tensor, context_lens: torch.Tensor, n_cols: int,
                         dot_precision: str = "bf16", masked_value: float = float("-inf"), impl: str = "auto",
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """Indexer logits [B, n_cols] fp32.

    q_codes [B, nI, dI] float8_e4m3fn; weights [B, nI] fp32; key_codes [P, 64, dI] float8_e4m3fn;
    key_scale [P, 64] fp32; page_table [n_pages] (shared by all rows) or [B, n_pages] int32;
    context_lens [B] int32 (<= 64 · n_pages); columns t >= context_lens[b] get masked_value.
    out: optional preallocated contiguous [B, n_cols] fp32 result buffer.
    """
    _check_inputs(q_codes, weights, key_codes, key_scale, page_table, context_lens, n_cols, dot_precision)
    if resolve_impl(impl, q_codes.device) == "triton":
        from optimized.kernels.indexer_logits_triton import fp8_paged_mqa_logits_triton
        return fp8_paged_mqa_logits_triton(q_codes, weights, key_codes, key_scale, page_table, context_lens, n_cols,
                                           dot_precision, masked_value, out)
    return _logits_torch(q_codes, weights, key_codes, key_scale, page_table, context_lens, n_cols, dot_precision,
                         masked_value, out)


def gather_index_keys(key_codes: torch.Tensor, key_scale: torch.Tensor, page_table: torch.Tensor, n_cols: int
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Key values (fp32, exact) and scales of logical columns 0..n_cols−1: ([..., n_cols, dI], [..., n_cols]).

    Columns past the page table read page 0; they are always masked (context_lens <= 64 · n_pages)."""
    cols = torch.arange(n_cols, device=key_codes.device)
    logical_page = torch.div(cols, PAGE_SIZE, rounding_mode="floor").clamp(max=page_table.shape[-1] - 1)
    page = page_table[..., logical_page].long()
    offset = cols % PAGE_SIZE
    return key_codes[page, offset].float(), key_scale[page, offset].float()


def _logits_torch(q_codes, weights, key_codes, key_scale, page_table, context_lens, n_cols, dot_precision,
                  masked_value, out=None) -> torch.Tensor:
    n_rows, n_heads, _ = q_codes.shape
    if out is None:
        out = torch.empty(n_rows, n_cols, dtype=torch.float32, device=q_codes.device)
    chunk = max(1, _EMULATION_ELEMENTS // max(1, n_heads * n_cols))
    shared_keys = gather_index_keys(key_codes, key_scale, page_table, n_cols) if page_table.dim() == 1 else None
    cols = torch.arange(n_cols, device=q_codes.device)
    for start in range(0, n_rows, chunk):
        rows = slice(start, min(n_rows, start + chunk))
        if shared_keys is None:
            keys, scale = gather_index_keys(key_codes, key_scale, page_table[rows], n_cols)  # [b, T, dI], [b, T]
            keys_expr, scale = "btd", scale
        else:
            keys, scale = shared_keys
            keys_expr, scale = "td", scale[None, :]
        with fp32_matmul_exact():
            # e4m3·e4m3 products are exact in fp32; the einsum accumulates them in fp32
            dots = torch.einsum(f"bhd,{keys_expr}->bht", q_codes[rows].float(), keys)
        if dot_precision == "bf16":
            dots = dots.to(torch.bfloat16).float()  # torch's fp32 -> bf16 cast is round-to-nearest-even
        head_sum = (weights[rows].float()[..., None] * torch.relu(dots)).sum(1)  # fp32 [b, T]
        logits = head_sum * scale
        visible = cols[None, :] < context_lens[rows].long()[:, None]
        out[rows] = torch.where(visible, logits, torch.tensor(masked_value, dtype=torch.float32, device=out.device))
    return out


def _check_inputs(q_codes, weights, key_codes, key_scale, page_table, context_lens, n_cols, dot_precision) -> None:
    if dot_precision not in DOT_PRECISIONS:
        raise ValueError(f"dot_precision must be one of {DOT_PRECISIONS}, got {dot_precision!r}")
    if q_codes.dim() != 3 or q_codes.dtype != torch.float8_e4m3fn:
        raise ValueError(f"q_codes must be [B, nI, dI] float8_e4m3fn, got {tuple(q_codes.shape)} {q_codes.dtype}")
    n_rows, n_heads, dim = q_codes.shape
    if tuple(weights.shape) != (n_rows, n_heads):
        raise ValueError(f"weights must be [B={n_rows}, nI={n_heads}], got {tuple(weights.shape)}")
    if key_codes.dim() != 3 or key_codes.shape[1:] != (PAGE_SIZE, dim) or key_codes.dtype != torch.float8_e4m3fn:
        raise ValueError(f"key_codes must be [P, {PAGE_SIZE}, {dim}] float8_e4m3fn, got {tuple(key_codes.shape)}")
    if tuple(key_scale.shape) != tuple(key_codes.shape[:2]):
        raise ValueError(f"key_scale must be [P, {PAGE_SIZE}], got {tuple(key_scale.shape)}")
    if page_table.dim() not in (1, 2) or (page_table.dim() == 2 and page_table.shape[0] != n_rows):
        raise ValueError(f"page_table must be [n_pages] or [B, n_pages], got {tuple(page_table.shape)}")
    if tuple(context_lens.shape) != (n_rows,):
        raise ValueError(f"context_lens must be [B={n_rows}], got {tuple(context_lens.shape)}")
    # (a host sync on CUDA, skipped under graph capture; the Triton launcher never reads past the table anyway)
    capturing = context_lens.is_cuda and torch.cuda.is_current_stream_capturing()
    if n_rows and not capturing and int(context_lens.max()) > PAGE_SIZE * page_table.shape[-1]:
        raise ValueError(f"a context_len exceeds the page table's {PAGE_SIZE * page_table.shape[-1]} rows")
