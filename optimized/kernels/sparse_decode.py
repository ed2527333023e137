"""O1 — split-K sparse-MLA decode over paged FP8 latent caches (optimized-stack §2.4).

One query token per batch row, H heads sharing one latent KV head (MQA): K = V = the dequantized cache row.
Candidates are a main list (window rows, Kw lanes) and an extra list (compressed rows, Kc lanes, may be
empty), each in its own cache; lane value −1 = invalid.

Numeric recipe (this module's `torch` implementation follows it step by step; the Triton kernel in
`sparse_decode_triton.py` follows it up to summation order and exp implementation, see NOTES.md):

1. Row = dequantized cache row: nope = e4m3 code · 2^(u−127) in fp32, cast to bf16 (exact); rope = stored bf16.
2. Splits: consecutive `split`-lane tiles of the main list, then of the extra list;
   S = ceil(Kw/split) + ceil(Kc/split).
3. Per split: logit_j = fp32 sum of bf16 q · bf16 k_j, then · softmax_scale in fp32; invalid lanes excluded;
   m = max valid logit; p_j = exp(logit_j − m) (fp32); l = Σ p_j (fp32); P cast to bf16;
   acc = Σ bf16(p_j)·v_j (fp32 accumulation); partial out = bf16(acc / l); partial lse = m + ln l (fp32).
   A split without valid lanes has lse = −inf, out = 0.
4. Merge (fp32): M = max_s lse_s; w_s = exp(lse_s − M) (0 for −inf); W = Σ w_s;
   out = Σ w_s·out_s / W; lse = M + ln W.
5. Sink once, after the merge: out ← out·exp(lse − logaddexp(lse, sink_h)); lse ← logaddexp(lse, sink_h).
   No valid lane at all: out = 0, lse = sink_h.
6. out cast to bf16 [B, H, d]; lse fp32 [B, H].
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from optimized.kernels import fp32_matmul_exact, resolve_impl
from optimized.paged_cache import KV_SCALE_BLOCK, PAGE_SIZE, LatentCache, dequantize_latent_nope

SPLIT_SIZES = (16, 32, 64, 128)


class PagedLatentRows(NamedTuple):
    """The raw tensors of a LatentCache, so kernels read the stored bits (optimized-stack §2.2)."""

    codes: torch.Tensor  # [P, 64, nope] float8_e4m3fn
    scales: torch.Tensor  # [P, 64, ceil(nope/64)] uint8, UE8M0 byte u -> 2^(u-127)
    rope: torch.Tensor  # [P, 64, r] bfloat16
    page_table: torch.Tensor  # [n_logical_pages] int32: logical page -> physical page

    @classmethod
    def of(cls, cache: LatentCache) -> "PagedLatentRows":
        return cls(cache.codes, cache.scales, cache.rope_part, cache.page_table)

    @property
    def nope(self) -> int:
        return self.codes.shape[-1]

    @property
    def rope_dim(self) -> int:
        return self.rope.shape[-1]


# ---------------------------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------------------------


def sparse_decode_splitk(q: torch.Tensor, main: PagedLatentRows, main_slots: torch.Tensor,
                         extra: PagedLatentRows | None, extra_slots: torch.Tensor | None, sink: torch.Tensor,
                         softmax_scale: float, split: int = 64, impl: str = "auto"
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse attention decode with sink: (out [B, H, d] bf16, lse [B, H] fp32, sink included).

    q [B, H, d] bf16 with d = nope + r; main_slots [B, Kw] / extra_slots [B, Kc] int32 logical cache rows
    (−1 = invalid lane; extra may be None or have Kc = 0); sink [H] fp32. Recipe: module docstring.
    """
    mid_out, mid_lse = sparse_decode_partials(q, main, main_slots, extra, extra_slots, softmax_scale, split, impl)
    return merge_partials(mid_out, mid_lse, sink, impl)


def sparse_decode_partials(q: torch.Tensor, main: PagedLatentRows, main_slots: torch.Tensor,
                           extra: PagedLatentRows | None, extra_slots: torch.Tensor | None, softmax_scale: float,
                           split: int = 64, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 1–3: per-split partials (mid_out [B, H, S, d] bf16, mid_lse [B, H, S] fp32)."""
    extra, extra_slots = _check_inputs(q, main, main_slots, extra, extra_slots, split)
    if resolve_impl(impl, q.device) == "triton":
        from optimized.kernels.sparse_decode_triton import sparse_decode_partials_triton
        return sparse_decode_partials_triton(q, main, main_slots, extra, extra_slots, softmax_scale, split)
    return _partials_torch(q, main, main_slots, extra, extra_slots, softmax_scale, split)


def merge_partials(mid_out: torch.Tensor, mid_lse: torch.Tensor, sink: torch.Tensor, impl: str = "auto"
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 4–6: LSE-merge the splits in fp32, then apply the sink once."""
    if resolve_impl(impl, mid_out.device) == "triton":
        from optimized.kernels.sparse_decode_triton import merge_partials_triton
        return merge_partials_triton(mid_out, mid_lse, sink)
    return _merge_torch(mid_out, mid_lse, sink)


def num_splits(n_main: int, n_extra: int, split: int = 64) -> int:
    return -(-n_main // split) + -(-n_extra // split)


# ---------------------------------------------------------------------------------------------
# torch emulation (the recipe)
# ---------------------------------------------------------------------------------------------


def gather_latent_rows(cache: PagedLatentRows, slots: torch.Tensor) -> torch.Tensor:
    """Step 1: dequantized rows [..., d] bf16 of logical slots (slot s: page_table[s // 64], offset s % 64);
    invalid slots (< 0) give zero rows."""
    safe = slots.clamp(min=0).long()
    page = cache.page_table[torch.div(safe, PAGE_SIZE, rounding_mode="floor")].long()
    offset = safe % PAGE_SIZE
    nope = dequantize_latent_nope(cache.codes[page, offset], cache.scales[page, offset])
    rows = torch.cat([nope, cache.rope[page, offset]], -1)
    return torch.where((slots >= 0)[..., None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device))


def split_tiles(slots: torch.Tensor, split: int) -> torch.Tensor:
    """Step 2: [B, K] lanes -> [B, ceil(K/split), split], padded with invalid lanes (−1)."""
    b, k = slots.shape
    pad = (-k) % split
    padded = torch.cat([slots, slots.new_full((b, pad), -1)], 1)
    return padded.view(b, -1, split)


def _partials_torch(q: torch.Tensor, main: PagedLatentRows, main_slots: torch.Tensor, extra: PagedLatentRows,
                    extra_slots: torch.Tensor, softmax_scale: float, split: int) -> tuple[torch.Tensor, torch.Tensor]:
    tiles = [split_tiles(main_slots, split), split_tiles(extra_slots, split)]
    rows = torch.cat([gather_latent_rows(main, tiles[0]), gather_latent_rows(extra, tiles[1])], 1)  # [B,S,n,d]
    valid = torch.cat(tiles, 1) >= 0  # [B, S, n]
    with fp32_matmul_exact():
        # bf16·bf16 products are exact in fp32; the einsum accumulates them in fp32. Scale after the dot.
        logits = torch.einsum("bhd,bsjd->bhsj", q.float(), rows.float()) * torch.tensor(
            softmax_scale, dtype=torch.float32, device=q.device)
        logits = logits.masked_fill(~valid[:, None], float("-inf"))
        m = logits.amax(-1)  # [B, H, S]; −inf for a split without valid lanes
        p = torch.exp(logits - torch.where(torch.isfinite(m), m, 0.0)[..., None])  # invalid lanes: exp(−inf) = 0
        l = p.sum(-1)
        acc = torch.einsum("bhsj,bsjd->bhsd", p.to(torch.bfloat16).float(), rows.float())
    nonempty = l > 0
    mid_out = torch.where(nonempty[..., None], acc / torch.where(nonempty, l, 1.0)[..., None], 0.0)
    mid_lse = torch.where(nonempty, m + torch.log(l), float("-inf"))
    return mid_out.to(torch.bfloat16), mid_lse


def _merge_torch(mid_out: torch.Tensor, mid_lse: torch.Tensor, sink: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    big_m = mid_lse.amax(-1)  # [B, H]
    empty = big_m == float("-inf")
    w = torch.where(mid_lse == float("-inf"), 0.0, torch.exp(mid_lse - torch.where(empty, 0.0, big_m)[..., None]))
    big_w = w.sum(-1)
    out = (w[..., None] * mid_out.float()).sum(-2) / torch.where(empty, 1.0, big_w)[..., None]
    lse = big_m + torch.log(big_w)
    sink = sink.float()[None, :].expand_as(lse)
    lse_with_sink = torch.logaddexp(lse, sink)
    out = out * torch.exp(lse - lse_with_sink)[..., None]
    out = torch.where(empty[..., None], 0.0, out)
    lse_with_sink = torch.where(empty, sink, lse_with_sink)
    return out.to(torch.bfloat16), lse_with_sink


# ---------------------------------------------------------------------------------------------
# argument checks shared by both implementations
# ---------------------------------------------------------------------------------------------


def _check_inputs(q: torch.Tensor, main: PagedLatentRows, main_slots: torch.Tensor, extra: PagedLatentRows | None,
                  extra_slots: torch.Tensor | None, split: int) -> tuple[PagedLatentRows, torch.Tensor]:
    if split not in SPLIT_SIZES:
        raise ValueError(f"split must be one of {SPLIT_SIZES}, got {split}")
    if q.dim() != 3 or q.dtype != torch.bfloat16:
        raise ValueError(f"q must be [B, H, d] bf16, got {tuple(q.shape)} {q.dtype}")
    b, _, d = q.shape
    if extra_slots is None or extra_slots.shape[-1] == 0 or extra is None:
        extra = main  # no compressed candidates: zero extra splits, the cache is never read
        extra_slots = torch.empty(b, 0, dtype=torch.int32, device=q.device)
    for name, cache, slots in (("main", main, main_slots), ("extra", extra, extra_slots)):
        if cache.nope + cache.rope_dim != d:
            raise ValueError(f"{name} cache rows are {cache.nope}+{cache.rope_dim} wide, q has d = {d}")
        if cache.codes.shape[1] != PAGE_SIZE or cache.scales.shape[-1] != -(-cache.nope // KV_SCALE_BLOCK):
            raise ValueError(f"{name} cache must use {PAGE_SIZE}-row pages and one scale per {KV_SCALE_BLOCK} nope")
        if cache.codes.dtype != torch.float8_e4m3fn or cache.scales.dtype != torch.uint8 \
                or cache.rope.dtype != torch.bfloat16:
            raise ValueError(f"{name} cache dtypes must be (float8_e4m3fn, uint8, bfloat16)")
        if slots.dim() != 2 or slots.shape[0] != b:
            raise ValueError(f"{name}_slots must be [B={b}, K], got {tuple(slots.shape)}")
    return extra, extra_slots
