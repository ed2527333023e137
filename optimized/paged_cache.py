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

from reference.quant import (FP8_MAX, blockwise_amax_last, e8m0_decode, e8m0_encode, expand_blocks_last,
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
        self.decoded = torch.zeros(n_pages, PAGE_SIZE, nope + rope, dtype=torch.bfloat16, device=device)
        self.page_table = scrambled_page_order(n_pages).to(device)
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.codes.shape[0] * PAGE_SIZE

    def physical(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(physical page, offset) of logical row slots."""
        return self.page_table[torch.div(slots, PAGE_SIZE, rounding_mode="floor").long()].long(), slots % PAGE_SIZE

    def append(self, rows: torch.Tensor) -> None:
        """Quantize and store rows [n, nope + rope] at the next slots."""
        n = rows.shape[0]
        if self.length + n > self.capacity:
            raise RuntimeError(f"latent cache full: {self.length} + {n} rows > capacity {self.capacity}")
        codes, scales = quantize_latent_nope(rows[:, : self.nope])
        page, off = self.physical(torch.arange(self.length, self.length + n, device=self.device))
        self.codes.view(torch.uint8)[page, off] = codes.view(torch.uint8)  # byte copy: no fp8 index_put needed
        self.scales[page, off] = scales
        rope = rows[:, self.nope :].to(torch.bfloat16)
        self.rope_part[page, off] = rope
        self.decoded[page, off] = torch.cat([dequantize_latent_nope(codes, scales), rope], -1)
        self.length += n

    def to(self, device: torch.device | str) -> "LatentCache":
        """Move every stored tensor (bits, decoded copy, page table) to `device`; returns self."""
        for name in ("codes", "scales", "rope_part", "decoded", "page_table"):
            setattr(self, name, getattr(self, name).to(device))
        self.device = torch.device(device)
        return self

    def load(self, slots: torch.Tensor) -> torch.Tensor:
        """Dequantized rows (bf16, exact) for slots of any shape; slots < 0 give zero rows."""
        valid = slots >= 0
        page, off = self.physical(slots.clamp(min=0))
        rows = self.decoded[page, off]
        return torch.where(valid[..., None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device))


def quantize_latent_nope(nope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """nope [..., nope] -> (e4m3 codes, UE8M0 bytes per 64): the KV writer's rule (optimized-stack §0.1)."""
    exp = ue8m0_scale_for(blockwise_amax_last(nope.float(), KV_SCALE_BLOCK), FP8_MAX, KV_AMAX_FLOOR)
    scale = expand_blocks_last(pow2(exp), KV_SCALE_BLOCK, nope.shape[-1])
    codes = torch.clamp(nope.float() / scale, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, e8m0_encode(exp)


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

    @property
    def capacity(self) -> int:
        return self.codes.shape[0] * PAGE_SIZE

    def append(self, rows: torch.Tensor) -> None:
        n = rows.shape[0]
        if self.length + n > self.capacity:
            raise RuntimeError(f"index key cache full: {self.length} + {n} rows > capacity {self.capacity}")
        slots = torch.arange(self.length, self.length + n, device=self.device)
        page = self.page_table[torch.div(slots, PAGE_SIZE, rounding_mode="floor")].long()
        off = slots % PAGE_SIZE
        if self.fp4:
            self.values_fp4[page, off] = fp4_fake_quant(rows.float(), block=32)
        else:
            codes, scale = quantize_fp8_per_row(rows)
            self.codes.view(torch.uint8)[page, off] = codes.view(torch.uint8)
            self.scale[page, off] = scale
        self.length += n

    def _logical(self) -> tuple[torch.Tensor, torch.Tensor]:
        slots = torch.arange(self.length, device=self.device)
        return self.page_table[torch.div(slots, PAGE_SIZE, rounding_mode="floor")].long(), slots % PAGE_SIZE

    def dense(self) -> torch.Tensor:
        """All stored keys dequantized to fp32 in logical order: [length, dim]."""
        page, off = self._logical()
        if self.fp4:
            return self.values_fp4[page, off]
        return self.codes[page, off].float() * self.scale[page, off][:, None]

    def dense_codes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """FP8 layout only: the e4m3 values as fp32 [length, dim] and the per-row scales [length]."""
        page, off = self._logical()
        return self.codes[page, off].float(), self.scale[page, off]


def quantize_fp8_per_row(x: torch.Tensor, amax_floor: float = 1e-4) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 with one fp32 scale per row (amax/448), as DeepGEMM's indexer cache and q quantizer use."""
    scale = torch.clamp(x.float().abs().amax(-1), min=amax_floor) / FP8_MAX
    codes = torch.clamp(x.float() / scale[..., None], -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scale
