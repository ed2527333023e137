"""Paged caches in the deployed formats (optimized-stack §2.2, §3.1).

LatentCache — main-attention rows (window kv and compressed kv): per row the nope dims as FP8 e4m3
with one UE8M0 scale per 64 elements (scale = 2^ceil(log2(max(amax, 1e-4)/448))) and the rope dims
in bf16, as the 584-byte FlashMLA row holds them. Rows live in 64-row pages reached through a page
table, so kernels see the same indirection the serving engine gives them.

IndexKeyCache — the indexer's compressed keys: FP8 e4m3 values with one fp32 scale per row
(DeepGEMM's paged layout, 132 bytes per row at d_I = 128), or optionally FP4 e2m1 with a UE8M0 scale
per 32 values (the `--enable-deepseek-v4-fp4-indexer` layout).

Both are emulated with torch tensors: a row's stored bits are exactly what the deployed cache would hold.
LatentCache also keeps each row's dequantized bf16 value beside its bits, decoded once at append: decoding
is exact, so torch paths that read rows per query block get the same values without decoding the same
rows again for every block; the kernels read the bits.
"""

from __future__ import annotations

import torch

from reference.graphs import replay
from reference.quant import (FP8_MAX, blockwise_amax_last, e8m0_decode, expand_blocks_last,
                             fp4_fake_quant, pow2, ue8m0_scale_for)

PAGE_SIZE = 64
KV_SCALE_BLOCK = 64  # nope elements per UE8M0 scale
KV_AMAX_FLOOR = 1e-4


def scrambled_page_order(n_pages: int) -> torch.Tensor:
    """A fixed non-identity logical→physical page map (reversed), so paging bugs cannot hide behind an
    identity table; deterministic so runs are reproducible."""
    return torch.arange(n_pages, dtype=torch.int32).flip(0)


class LatentCache:
    """Append-only paged store of 512-wide (generally d-wide) latent rows: FP8 nope + bf16 rope."""

    def __init__(self, capacity_rows: int, nope: int, rope: int, device: torch.device | str) -> None:
        n_pages = max(1, -(-capacity_rows // PAGE_SIZE))
        n_blocks = -(-nope // KV_SCALE_BLOCK)
        self.nope, self.rope, self.device = nope, rope, torch.device(device)
        self.codes = torch.zeros(n_pages, PAGE_SIZE, nope, dtype=torch.float8_e4m3fn, device=device)
        self.scales = torch.full((n_pages, PAGE_SIZE, n_blocks), 127, dtype=torch.uint8, device=device)
        self.rope_part = torch.zeros(n_pages, PAGE_SIZE, rope, dtype=torch.bfloat16, device=device)
        # the decoded rows of every page, then one zero row that every slot < 0 reads (load: one gather, no mask)
        self._decoded_rows = torch.zeros(n_pages * PAGE_SIZE + 1, nope + rope, dtype=torch.bfloat16, device=device)
        self.page_table = scrambled_page_order(n_pages).to(device)
        self.length = 0
        self._slot_rows_of: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def capacity(self) -> int:
        return self.codes.shape[0] * PAGE_SIZE

    def append(self, rows: torch.Tensor) -> None:
        """Quantize and store rows [n, nope + rope] at the next slots (no row: nothing to store)."""
        n = rows.shape[0]
        if self.length + n > self.capacity:
            raise RuntimeError(f"latent cache full: {self.length} + {n} rows > capacity {self.capacity}")
        if n == 0:
            return
        code_bytes, scales, rope, decoded = replay(_latent_row_parts, rows, nope=self.nope)  # a graph in decode
        at = slot_rows(self)[self.length : self.length + n]  # flat rows (page·64 + offset) of the next slots
        self.codes.view(torch.uint8).flatten(0, 1)[at] = code_bytes  # byte copy: no fp8 index_put
        self.scales.flatten(0, 1)[at] = scales
        self.rope_part.flatten(0, 1)[at] = rope
        self._decoded_rows[at] = decoded
        self.length += n

    def stored_form(self, rows: torch.Tensor) -> torch.Tensor:
        """What load() returns for `rows` once appended (bf16), computed without storing them: the value a cache
        write must leave for its slots (OptimizedLayer._kv_store's site compares what a read gives back with it)."""
        codes, _, scale = quantize_latent_nope(rows[:, : self.nope])
        return _decoded(codes, scale, rows[:, self.nope :].to(torch.bfloat16))

    def to(self, device: torch.device | str) -> "LatentCache":
        """Move every stored tensor (bits, decoded copy, page table) to `device`; returns self."""
        for name in ("codes", "scales", "rope_part", "_decoded_rows", "page_table"):
            setattr(self, name, getattr(self, name).to(device))
        self.device = torch.device(device)
        self._slot_rows_of = None
        return self

    def load(self, slots: torch.Tensor) -> torch.Tensor:
        """Dequantized rows (bf16, exact) for slots of any shape; slots < 0 give zero rows (the row after the
        pages, which slot_rows names for slot −1)."""
        return self._decoded_rows[slot_rows(self)[slots.clamp(min=-1)]]


def _latent_row_parts(rows: torch.Tensor, nope: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What LatentCache.append stores for rows [n, nope + rope] — the nope dims' FP8 codes as bytes, their UE8M0
    scale bytes, the rope dims in bf16 — and the rows' decoded bf16 value. A pure function of the rows with no host
    read, so a decode step's append replays it from a CUDA graph (reference.graphs.replay): ~20 small kernels per
    row written, a window row at every step and a compressed row every m steps, become a launch and two copies (the
    row in, the packed parts out; bench/launch_count.py, flash-mini: a decode step 380 → 348 operations, the index
    keys' replay included)."""
    codes, scales, scale = quantize_latent_nope(rows[:, :nope])
    rope = rows[:, nope:].to(torch.bfloat16)
    return codes.view(torch.uint8), scales, rope, _decoded(codes, scale, rope)


def _decoded(codes: torch.Tensor, scale: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """A latent row as load() returns it: codes·2^e with the quantizer's own 2^e (what dequantize_latent_nope decodes
    from the bytes), then the bf16 rope dims."""
    return torch.cat([(codes.float() * scale).to(torch.bfloat16), rope], -1)


def slot_rows(cache: "LatentCache | IndexKeyCache") -> torch.Tensor:
    """The flat physical row (page·64 + offset) of every logical slot of `cache`, then one more entry — what slot
    −1 indexes — naming the row after the last physical page. Built once per page table (fixed for a cache's life;
    the kernel tests replace it, so it is rebuilt when the table object changes — a table edited in place is not
    seen): an append or a load then indexes rows directly instead of dividing, looking up and taking remainders
    at every step."""
    memo = cache._slot_rows_of
    if memo is None or memo[0] is not cache.page_table:
        pages = cache.page_table.long()
        rows = (pages[:, None] * PAGE_SIZE + torch.arange(PAGE_SIZE, device=pages.device)).flatten()
        after_pages = cache.codes.shape[0] * PAGE_SIZE  # the physical pool's end, whatever the table's length
        memo = cache._slot_rows_of = (cache.page_table, torch.cat([rows, rows.new_full((1,), after_pages)]))
    return memo[1]


def quantize_latent_nope(nope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """nope [..., nope] -> (e4m3 codes, UE8M0 bytes per 64, the per-element scale 2^e the codes were divided by):
    the KV writer's rule (optimized-stack §0.1). The scale is exactly what the bytes decode to
    (e8m0_decode(u) = 2^(u−127) = 2^e).

    The bytes are e + 127 without reference.quant.e8m0_encode's range check, which reads the device (a host read per
    append, and no CUDA graph around it): e lies in range by construction. amax ≥ KV_AMAX_FLOOR = 1e-4 gives
    e = ⌈log2(amax/448)⌉ ≥ ⌈log2(2.2e-7)⌉ = −22 and a finite fp32 amax ≤ 3.4e38 gives e ≤ ⌈log2(7.6e35)⌉ = 120, so
    e + 127 ∈ [105, 247]. A block holding inf or NaN gets frexp's exponent for them: 0 on a CPU (and on an H100,
    where the thirty-third session's review checked it), so e = 0 and the byte 127; CUDA leaves it unspecified for
    NaN, so e is clamped to [−127, 127] — a no-op in range — and the byte stays valid (never 255, UE8M0's NaN) and
    equal to the scale its codes were divided by."""
    exp = ue8m0_scale_for(blockwise_amax_last(nope.float(), KV_SCALE_BLOCK), FP8_MAX, KV_AMAX_FLOOR).clamp(-127, 127)
    scale = expand_blocks_last(pow2(exp), KV_SCALE_BLOCK, nope.shape[-1])
    codes = torch.clamp(nope.float() / scale, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, (exp + 127).to(torch.uint8), scale


def dequantize_latent_nope(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes·2^(u−127) in fp32, cast to bf16: exact, since an e4m3 value times a power of two fits bf16."""
    s = expand_blocks_last(e8m0_decode(scales), KV_SCALE_BLOCK, codes.shape[-1])
    return (codes.float() * s).to(torch.bfloat16)


class IndexKeyCache:
    """Paged indexer keys: FP8 e4m3 with a per-row fp32 scale (default) or FP4 e2m1 with UE8M0 per 32."""

    def __init__(self, capacity_rows: int, dim: int, device: torch.device | str, fp4: bool = False) -> None:
        n_pages = max(1, -(-capacity_rows // PAGE_SIZE))
        self.dim, self.fp4, self.device = dim, fp4, torch.device(device)
        self.codes = torch.zeros(n_pages, PAGE_SIZE, dim, dtype=torch.float8_e4m3fn, device=device)
        self.scale = torch.ones(n_pages, PAGE_SIZE, dtype=torch.float32, device=device)
        self.values_fp4 = torch.zeros(n_pages, PAGE_SIZE, dim, dtype=torch.float32, device=device) if fp4 else None
        self.page_table = scrambled_page_order(n_pages).to(device)
        self.length = 0
        self._slot_rows_of: tuple[torch.Tensor, torch.Tensor] | None = None
        self._dense_codes: tuple[int, tuple, tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def capacity(self) -> int:
        return self.codes.shape[0] * PAGE_SIZE

    def append(self, rows: torch.Tensor) -> None:
        n = rows.shape[0]
        if self.length + n > self.capacity:
            raise RuntimeError(f"index key cache full: {self.length} + {n} rows > capacity {self.capacity}")
        if n == 0:
            return
        at = slot_rows(self)[self.length : self.length + n]
        if self.fp4:
            self.values_fp4.flatten(0, 1)[at] = fp4_fake_quant(rows.float(), block=32)
        else:
            codes, scale = replay(quantize_fp8_per_row, rows)  # a graph in decode
            self.codes.view(torch.uint8).flatten(0, 1)[at] = codes.view(torch.uint8)
            self.scale.flatten(0, 1)[at] = scale
        self.length += n

    def stored_form(self, rows: torch.Tensor) -> torch.Tensor:
        """What rows_at() returns for `rows` once appended (fp32), computed without storing them (the kv cache
        site's expectation, as LatentCache.stored_form)."""
        if self.fp4:
            return fp4_fake_quant(rows.float(), block=32)
        codes, scale = quantize_fp8_per_row(rows)
        return codes.float() * scale[:, None]

    def rows_at(self, slots: torch.Tensor) -> torch.Tensor:
        """The stored keys of `slots` (valid ones, < length) dequantized to fp32: dense()'s rows, read alone."""
        at = slot_rows(self)[slots]
        if self.fp4:
            return self.values_fp4.flatten(0, 1)[at]
        return self.codes.flatten(0, 1)[at].float() * self.scale.flatten(0, 1)[at][:, None]

    def dense(self) -> torch.Tensor:
        """All stored keys dequantized to fp32 in logical order: [length, dim]."""
        at = slot_rows(self)[: self.length]
        if self.fp4:
            return self.values_fp4.flatten(0, 1)[at]
        return self.codes.flatten(0, 1)[at].float() * self.scale.flatten(0, 1)[at][:, None]

    def dense_codes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """FP8 layout only: the e4m3 values as fp32 [length, dim] and the per-row scales [length] — the caller's
        own tensors (a patch may change them in place)."""
        codes, scale = self.shared_dense_codes()
        return codes.clone(), scale.clone()

    def shared_dense_codes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """dense_codes(), kept until the keys change (an append, or a tensor or page table replaced — not edited in
        place) and handed to every caller: a decode step's stock indexer op and its site's stock and twin ops read
        the same keys, once. Read only: the stock op (base_ops.indexer_logits) never writes to them."""
        key = (self.codes, self.scale, self.page_table)
        memo = self._dense_codes
        if memo is None or memo[0] != self.length or any(a is not b for a, b in zip(memo[1], key)):
            at = slot_rows(self)[: self.length]
            memo = self._dense_codes = (self.length, key,
                                        (self.codes.flatten(0, 1)[at].float(), self.scale.flatten(0, 1)[at]))
        return memo[2]


def quantize_fp8_per_row(x: torch.Tensor, amax_floor: float = 1e-4) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 with one fp32 scale per row (amax/448), as DeepGEMM's indexer cache and q quantizer use."""
    scale = torch.clamp(x.float().abs().amax(-1), min=amax_floor) / FP8_MAX
    codes = torch.clamp(x.float() / scale[..., None], -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scale
