"""O1 Triton kernels: split-K sparse-MLA decode (partials) and the LSE merge with the sink.

Design (NOTES.md has the numbers):
- `_split_kernel`, grid (B, ceil(H / BLOCK_H), splits of one candidate list). One program = BLOCK_H heads of one
  query token against one `split`-lane tile of the shared MQA key list (tl.dot needs >= 16 rows, so heads are
  the M dimension). The 512-wide head dim is tiled: nope in 64-wide slices (one UE8M0 scale byte per slice),
  rope in one slice; logits accumulate over slices, then P·V is computed and stored slice by slice, so no
  program holds more than a [BLOCK_H, 64] and a [split, 64] operand at a time (shared memory well under the
  99 KB of sm_120; no Hopper-only code, tl.dot lowers to mma.sync there).
- A split is one tile, so its softmax is exact within the program (no online rescaling); a tile with no valid
  lane writes lse = −inf and zeros without loading the cache (early out).
- The main and extra lists live in different caches: the same kernel is launched once per list, writing
  splits [0, S_main) and [S_main, S) of the shared partial buffers.
- `_merge_kernel`, grid (B, H): fp32 LSE merge over splits, then the sink, once.

Under the Triton CPU interpreter (TRITON_INTERPRET=1) bf16 tl.dot gives garbage and fp32->bf16 truncates
(DESIGN §10): there the bf16 operands (whose values are exact in fp32) are dotted in fp32 and bf16 rounding is
done by integer round-to-nearest-even, so interpreter runs exercise the same indexing and masking.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from optimized.kernels import triton_interpreting
from optimized.paged_cache import PAGE_SIZE

# The compiled kernels of the last launch, for the bench script (registers, shared memory).
LAST_COMPILED: dict[str, object] = {}


@triton.jit
def _bf16_rne(x, INTERPRET: tl.constexpr):
    """fp32 -> bf16 with round-to-nearest-even (finite x). The GPU conversion is RNE already."""
    if INTERPRET:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def _dot_bf16(a, b, INTERPRET: tl.constexpr):
    """bf16 x bf16 -> fp32 accumulation (exact products)."""
    if INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _load_k_nope(codes_ptr, scales_ptr, row, valid, i: tl.constexpr, NOPE: tl.constexpr, N_SCALES: tl.constexpr):
    """Nope slice i (64 wide) of the tile's rows as bf16: e4m3 value · 2^(u−127) in fp32 (exact), cast to bf16."""
    dcol = i * 64 + tl.arange(0, 64)
    code = tl.load(codes_ptr + row[:, None] * NOPE + dcol[None, :], mask=valid[:, None] & (dcol < NOPE)[None, :],
                   other=0.0).to(tl.float32)
    u = tl.load(scales_ptr + row * N_SCALES + i, mask=valid, other=127).to(tl.int32)
    scale = (u << 23).to(tl.float32, bitcast=True)  # 2^(u−127) for u in [1, 254]
    return (code * scale[:, None]).to(tl.bfloat16)  # exact: a power-of-two multiple of an e4m3 value


@triton.jit
def _split_kernel(q_ptr, stride_qb, stride_qh,
                  codes_ptr, scales_ptr, rope_ptr, page_table_ptr,
                  slots_ptr, stride_sb, n_lanes,
                  mid_out_ptr, mid_lse_ptr, split_offset, n_splits, n_heads, softmax_scale,
                  NOPE: tl.constexpr, ROPE: tl.constexpr, ROPE_PAD: tl.constexpr, N_SCALES: tl.constexpr,
                  BLOCK_H: tl.constexpr, SPLIT: tl.constexpr, PAGE: tl.constexpr, INTERPRET: tl.constexpr):
    b = tl.program_id(0)
    head_block = tl.program_id(1)
    tile = tl.program_id(2)
    D: tl.constexpr = NOPE + ROPE

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < n_heads
    # partial rows of mid_out [B, H, S, D] / mid_lse [B, H, S] written by this program
    mid_row = (b * n_heads + heads).to(tl.int64) * n_splits + split_offset + tile

    lanes = tile * SPLIT + tl.arange(0, SPLIT)
    slot = tl.load(slots_ptr + b.to(tl.int64) * stride_sb + lanes, mask=lanes < n_lanes, other=-1)
    valid = slot >= 0

    if tl.max(valid.to(tl.int32), axis=0) == 0:  # early out: no valid lane, nothing is loaded
        tl.store(mid_lse_ptr + mid_row, tl.full([BLOCK_H], float("-inf"), tl.float32), mask=head_ok)
        zeros = tl.zeros([BLOCK_H, 64], dtype=tl.bfloat16)
        for i in tl.static_range((D + 63) // 64):
            dcol = i * 64 + tl.arange(0, 64)
            tl.store(mid_out_ptr + mid_row[:, None] * D + dcol[None, :], zeros,
                     mask=head_ok[:, None] & (dcol < D)[None, :])
        return

    safe = tl.where(valid, slot, 0)
    page = tl.load(page_table_ptr + safe // PAGE, mask=valid, other=0)
    row = page.to(tl.int64) * PAGE + safe % PAGE  # physical row of each lane

    q_base = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
    rcol = tl.arange(0, ROPE_PAD)
    rope_mask = valid[:, None] & (rcol < ROPE)[None, :]

    # logits [BLOCK_H, SPLIT] = Σ over d-slices of bf16 q · bf16 k, fp32 accumulation
    logits = tl.zeros([BLOCK_H, SPLIT], dtype=tl.float32)
    for i in tl.static_range((NOPE + 63) // 64):
        dcol = i * 64 + tl.arange(0, 64)
        q_slice = tl.load(q_base + dcol[None, :], mask=head_ok[:, None] & (dcol < NOPE)[None, :], other=0.0)
        k_slice = _load_k_nope(codes_ptr, scales_ptr, row, valid, i, NOPE, N_SCALES)
        logits += _dot_bf16(q_slice, tl.trans(k_slice), INTERPRET)
    q_rope = tl.load(q_base + NOPE + rcol[None, :], mask=head_ok[:, None] & (rcol < ROPE)[None, :], other=0.0)
    k_rope = tl.load(rope_ptr + row[:, None] * ROPE + rcol[None, :], mask=rope_mask, other=0.0)
    logits += _dot_bf16(q_rope, tl.trans(k_rope), INTERPRET)

    # softmax of the tile in fp32; the scale is applied after the dot, not folded into q
    logits = logits * softmax_scale
    logits = tl.where(valid[None, :], logits, float("-inf"))
    m = tl.max(logits, axis=1)
    p = tl.exp(logits - m[:, None])  # invalid lanes: exp(−inf) = 0
    l = tl.sum(p, axis=1)
    p_bf16 = _bf16_rne(p, INTERPRET)

    # P·V slice by slice (V = K), partial out = bf16(acc / l)
    for i in tl.static_range((NOPE + 63) // 64):
        dcol = i * 64 + tl.arange(0, 64)
        v_slice = _load_k_nope(codes_ptr, scales_ptr, row, valid, i, NOPE, N_SCALES)
        acc = _dot_bf16(p_bf16, v_slice, INTERPRET)
        tl.store(mid_out_ptr + mid_row[:, None] * D + dcol[None, :], _bf16_rne(acc / l[:, None], INTERPRET),
                 mask=head_ok[:, None] & (dcol < NOPE)[None, :])
    v_rope = tl.load(rope_ptr + row[:, None] * ROPE + rcol[None, :], mask=rope_mask, other=0.0)
    acc = _dot_bf16(p_bf16, v_rope, INTERPRET)
    tl.store(mid_out_ptr + mid_row[:, None] * D + NOPE + rcol[None, :], _bf16_rne(acc / l[:, None], INTERPRET),
             mask=head_ok[:, None] & (rcol < ROPE)[None, :])
    tl.store(mid_lse_ptr + mid_row, m + tl.log(l), mask=head_ok)


@triton.jit
def _merge_kernel(mid_out_ptr, mid_lse_ptr, sink_ptr, out_ptr, lse_ptr, n_splits, n_heads,
                  D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_S: tl.constexpr, INTERPRET: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    bh = b.to(tl.int64) * n_heads + h
    s = tl.arange(0, BLOCK_S)
    dcol = tl.arange(0, D_PAD)
    split_ok = s < n_splits
    lse_s = tl.load(mid_lse_ptr + bh * n_splits + s, mask=split_ok, other=float("-inf"))
    sink = tl.load(sink_ptr + h)
    big_m = tl.max(lse_s, axis=0)
    if big_m == float("-inf"):  # no valid lane in any split: out = 0, lse = sink
        tl.store(out_ptr + bh * D + dcol, tl.zeros([D_PAD], dtype=tl.bfloat16), mask=dcol < D)
        tl.store(lse_ptr + bh, sink)
        return
    w = tl.where(lse_s == float("-inf"), 0.0, tl.exp(lse_s - big_m))
    big_w = tl.sum(w, axis=0)
    part = tl.load(mid_out_ptr + (bh * n_splits + s[:, None]) * D + dcol[None, :],
                   mask=split_ok[:, None] & (dcol < D)[None, :], other=0.0).to(tl.float32)
    out = tl.sum(w[:, None] * part, axis=0) / big_w
    lse = big_m + tl.log(big_w)
    # sink once: lse' = logaddexp(lse, sink); out · exp(lse − lse')
    top = tl.maximum(lse, sink)
    lse_with_sink = top + tl.log(tl.exp(lse - top) + tl.exp(sink - top))
    out = out * tl.exp(lse - lse_with_sink)
    tl.store(out_ptr + bh * D + dcol, _bf16_rne(out, INTERPRET), mask=dcol < D)
    tl.store(lse_ptr + bh, lse_with_sink)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _block_h(n_heads: int, n_programs_per_head_block: int, n_sms: int) -> int:
    """Heads per program: all of them (up to 64) share one K tile load, but drop to 32/16 when that leaves
    most SMs idle (e.g. one decode row)."""
    block = min(64, max(16, triton.next_power_of_2(n_heads)))
    while block > 16 and n_programs_per_head_block * triton.cdiv(n_heads, block) < n_sms:
        block //= 2
    return block


def sparse_decode_partials_triton(q, main, main_slots, extra, extra_slots, softmax_scale: float, split: int,
                                  out: tuple[torch.Tensor, torch.Tensor] | None = None
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the split kernel once per candidate list. `out` = preallocated contiguous (mid_out, mid_lse)."""
    b, n_heads, d = q.shape
    q = q.contiguous() if q.stride(-1) != 1 else q
    splits = [triton.cdiv(main_slots.shape[1], split), triton.cdiv(extra_slots.shape[1], split)]
    n_splits = sum(splits)
    if out is None:
        out = (torch.empty(b, n_heads, n_splits, d, dtype=torch.bfloat16, device=q.device),
               torch.empty(b, n_heads, n_splits, dtype=torch.float32, device=q.device))
    mid_out, mid_lse = out
    assert mid_out.shape == (b, n_heads, n_splits, d) and mid_out.is_contiguous() and mid_lse.is_contiguous()
    n_sms = _sm_count(q.device.index if q.device.index is not None else torch.cuda.current_device()) \
        if q.is_cuda else 1
    block_h = _block_h(n_heads, b * n_splits, n_sms)
    offset = 0
    for cache, slots, n_tiles in ((main, main_slots, splits[0]), (extra, extra_slots, splits[1])):
        if n_tiles and b:
            slots = slots.to(torch.int32).contiguous()
            LAST_COMPILED["split"] = _split_kernel[(b, triton.cdiv(n_heads, block_h), n_tiles)](
                q, q.stride(0), q.stride(1),
                cache.codes.contiguous(), cache.scales.contiguous(), cache.rope.contiguous(),
                cache.page_table.to(torch.int32).contiguous(),
                slots, slots.stride(0), slots.shape[1],
                mid_out, mid_lse, offset, n_splits, n_heads, float(softmax_scale),
                NOPE=cache.nope, ROPE=cache.rope_dim, ROPE_PAD=max(16, triton.next_power_of_2(cache.rope_dim)),
                N_SCALES=cache.scales.shape[-1], BLOCK_H=block_h, SPLIT=split, PAGE=PAGE_SIZE,
                INTERPRET=triton_interpreting(), num_warps=4)
        offset += n_tiles
    return mid_out, mid_lse


def merge_partials_triton(mid_out: torch.Tensor, mid_lse: torch.Tensor, sink: torch.Tensor,
                          out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`out` = preallocated contiguous (out [B, H, d] bf16, lse [B, H] fp32)."""
    b, n_heads, n_splits, d = mid_out.shape
    if out is None:
        out = (torch.empty(b, n_heads, d, dtype=torch.bfloat16, device=mid_out.device),
               torch.empty(b, n_heads, dtype=torch.float32, device=mid_out.device))
    out, lse = out
    assert out.shape == (b, n_heads, d) and out.is_contiguous() and lse.is_contiguous()
    if b:
        LAST_COMPILED["merge"] = _merge_kernel[(b, n_heads)](
            mid_out.contiguous(), mid_lse.contiguous(), sink.float().contiguous(), out, lse, n_splits, n_heads,
            D=d, D_PAD=triton.next_power_of_2(d), BLOCK_S=max(2, triton.next_power_of_2(n_splits)),
            INTERPRET=triton_interpreting(), num_warps=4)
    return out, lse
