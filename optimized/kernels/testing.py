"""Random inputs, straightforward fp64 references and DERIVED error bounds for the O1/O2 kernels.

Shared by tests/test_kernels_cpu.py, tests/test_kernels_gpu.py and bench_kernels.py. The references here are
independent of the kernels' code paths: rows come from the caches' own readers (LatentCache.load,
IndexKeyCache-style gathers), math is dense and in fp64.

Error-bound vocabulary (standard rounding-error analysis, Higham ch. 3):
- u_bf16 = 2^-8: unit roundoff of bf16 (8 significant bits); RNE gives |bf16(x) − x| <= 2^-8·|x|.
  (2^-9 is the typical, RMS-like size of that error, not its bound.)
- u_fp32 = 2^-24; an n-term fp32 sum of exact products errs by at most γ_n·Σ|terms|, γ_n = n·u/(1−n·u) ≈ n·u.
  GPU tensor cores add with truncation rather than RNE, so for them u_fp32 is replaced by 2^-23.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from optimized.kernels.sparse_decode import PagedLatentRows
from optimized.paged_cache import PAGE_SIZE, IndexKeyCache, LatentCache, quantize_fp8_per_row

U_BF16 = 2.0**-8
U_FP32 = 2.0**-24
U_TENSOR_CORE = 2.0**-23
# GPU exp/log are ex2.approx/lg2.approx (rel. error ~2^-22) of arguments |x·log2 e| <= ~64: absolute error in a
# log-sum-exp <= 64·2^-22 = 2^-16.
LSE_APPROX_SLACK = 2.0**-16


def random_page_order(n_pages: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randperm(n_pages, generator=generator).to(torch.int32)


# ---------------------------------------------------------------------------------------------
# O1: sparse decode
# ---------------------------------------------------------------------------------------------


@dataclass
class DecodeCase:
    q: torch.Tensor  # [B, H, d] bf16
    main_cache: LatentCache
    main_slots: torch.Tensor  # [B, Kw] int32
    extra_cache: LatentCache
    extra_slots: torch.Tensor  # [B, Kc] int32
    sink: torch.Tensor  # [H] fp32
    softmax_scale: float

    @property
    def main(self) -> PagedLatentRows:
        return PagedLatentRows.of(self.main_cache)

    @property
    def extra(self) -> PagedLatentRows:
        return PagedLatentRows.of(self.extra_cache)

    def args(self) -> tuple:
        """Positional arguments of sparse_decode_splitk."""
        return (self.q, self.main, self.main_slots, self.extra, self.extra_slots, self.sink, self.softmax_scale)


def _latent_cache(n_rows: int, nope: int, rope: int, device: str, generator: torch.Generator,
                  scrambled: bool) -> LatentCache:
    cache = LatentCache(n_rows, nope, rope, "cpu")
    if scrambled:
        # its own generator, so the stored values do not depend on whether the table is scrambled
        cache.page_table = random_page_order(cache.codes.shape[0], torch.Generator().manual_seed(n_rows))
    # kv rows are RMS-normalised in the model: entries ~N(0, 1), a few larger outliers per row
    rows = torch.randn(n_rows, nope + rope, generator=generator)
    rows[:, :nope] *= torch.exp(0.5 * torch.randn(n_rows, (nope + 63) // 64, generator=generator)
                                ).repeat_interleave(64, 1)[:, :nope]
    cache.append(rows)
    return cache.to(device)


def make_decode_case(batch: int, heads: int, nope: int, rope: int, n_main: int, n_extra: int, device: str = "cpu",
                     seed: int = 0, main_rows: int = 256, extra_rows: int = 700, scrambled: bool = True,
                     q_gain: float = 2.0) -> DecodeCase:
    """Random decode inputs with the invalid-lane patterns the deployed kernel sees:
    row 0: first window tile fully invalid (a short sequence), row 1: no extra lanes valid at all;
    other rows: a random valid top-k length for the extra list, plus sprinkled −1 lanes."""
    g = torch.Generator().manual_seed(seed)
    main_cache = _latent_cache(main_rows, nope, rope, device, g, scrambled)
    extra_cache = _latent_cache(extra_rows, nope, rope, device, g, scrambled)
    d = nope + rope
    # q after the per-head RMS norm, with a per-head gain so some heads are peaky and some flat
    gain = torch.linspace(0.5, q_gain, heads)[None, :, None]
    q = (torch.randn(batch, heads, d, generator=g) * gain).to(torch.bfloat16)
    main_slots = torch.randint(0, main_rows, (batch, n_main), generator=g, dtype=torch.int32)
    main_slots[torch.rand(batch, n_main, generator=g) < 0.1] = -1
    extra_slots = torch.randint(0, extra_rows, (batch, n_extra), generator=g, dtype=torch.int32)
    if n_extra:
        topk_len = torch.randint(0, n_extra + 1, (batch, 1), generator=g)
        extra_slots[torch.arange(n_extra)[None, :] >= topk_len] = -1
    if batch > 0:
        main_slots[0, : min(64, n_main)] = -1
    if batch > 1:
        extra_slots[1] = -1
    # sinks around the typical lse (~ln of the lane count) so the sink takes anything from ~0 to most of the mass
    sink = torch.randn(heads, generator=g) * 2.0 + 4.0
    return DecodeCase(q.to(device), main_cache, main_slots.to(device), extra_cache, extra_slots.to(device),
                      sink.to(device), d**-0.5)


@dataclass
class DecodeReference:
    out: torch.Tensor  # [B, H, d] fp64
    lse: torch.Tensor  # [B, H] fp64
    v_absmax: torch.Tensor  # [B, d] max over valid lanes of |v_jd| (0 if none)
    logit_bound: torch.Tensor  # [B, H] bound on the fp32 error of any one logit


def dense_decode_reference(case: DecodeCase, u_accumulate: float = U_FP32) -> DecodeReference:
    """Dense softmax with sink over all valid lanes, fp64: o = Σ_j e^{s_j−M} v_j / (Σ_j e^{s_j−M} + e^{sink−M})."""
    rows = torch.cat([case.main_cache.load(case.main_slots), case.extra_cache.load(case.extra_slots)], 1).double()
    valid = torch.cat([case.main_slots, case.extra_slots], 1) >= 0
    q = case.q.double()
    logits = torch.einsum("bhd,bkd->bhk", q, rows) * case.softmax_scale
    logits = logits.masked_fill(~valid[:, None], float("-inf"))
    sink = case.sink.double()[None, :]
    big_m = torch.maximum(logits.amax(-1), sink)
    e = torch.exp(logits - big_m[..., None])
    denom = e.sum(-1) + torch.exp(sink - big_m)
    out = torch.einsum("bhk,bkd->bhd", e / denom[..., None], rows)
    abs_dot = torch.einsum("bhd,bkd->bhk", q.abs(), rows.abs()).masked_fill(~valid[:, None], 0.0)
    d = q.shape[-1]
    logit_bound = d * u_accumulate * abs_dot.amax(-1) * case.softmax_scale
    return DecodeReference(out, big_m + torch.log(denom), (rows.abs() * valid[..., None]).amax(1), logit_bound)


def recipe_partials_fp64(case: DecodeCase, split: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The split recipe with its bf16 roundings made explicit, everything else in fp64: per `split`-lane tile,
    p = exp(s − m), l = Σ p, out = bf16(Σ bf16(p)·v / l), lse = m + ln l.
    Returns (out [B, H, S, d], lse [B, H, S], abs_out [B, H, S, d] = Σ_j (p_j/l)·|v_jd|), fp64.

    An fp32 implementation of the recipe differs from this model only where an fp32 intermediate and its fp64
    counterpart straddle a bf16 rounding boundary (see partial_straddle_bound); an implementation that skips
    a rounding step differs on a large fraction of the elements."""
    outs, lses, abs_outs = [], [], []
    for cache, slots in ((case.main_cache, case.main_slots), (case.extra_cache, case.extra_slots)):
        for start in range(0, slots.shape[1], split):
            tile = slots[:, start: start + split]
            rows = cache.load(tile).double()
            logits = torch.einsum("bhd,bkd->bhk", case.q.double(), rows) * case.softmax_scale
            logits = logits.masked_fill((tile < 0)[:, None], float("-inf"))
            m = logits.amax(-1, keepdim=True)
            p = torch.exp(logits - m.nan_to_num(0.0, 0.0, 0.0)).nan_to_num(0.0)
            l = p.sum(-1, keepdim=True)
            p_bf16 = p.float().to(torch.bfloat16).double()
            out = torch.einsum("bhk,bkd->bhd", p_bf16, rows) / l.clamp(min=1e-300)
            outs.append(out.float().to(torch.bfloat16).double())
            lses.append(torch.where(l > 0, m + torch.log(l), float("-inf"))[..., 0])
            abs_outs.append(torch.einsum("bhk,bkd->bhd", p / l.clamp(min=1e-300), rows.abs()))
    b, h, d = case.q.shape
    if not outs:
        empty = case.q.new_zeros(b, h, 0, d, dtype=torch.float64)
        return empty, case.q.new_zeros(b, h, 0, dtype=torch.float64), empty
    return torch.stack(outs, 2), torch.stack(lses, 2), torch.stack(abs_outs, 2)


def partial_straddle_bound(model_out: torch.Tensor, abs_out: torch.Tensor) -> torch.Tensor:
    """|impl − model| for a correct fp32 implementation of the split recipe, elementwise.
    Where fp32 and fp64 p_j straddle a bf16 boundary, bf16(p_j) moves by one bf16 ulp <= 2^-7·p_j, so the
    partial moves by <= 2^-7·Σ_j (p_j/l)·|v_jd| = 2^-7·abs_out (every lane flipping, the worst case); the stored
    bf16 partial may then straddle once more: one ulp, <= 2^-7·|out|. (An ulp of bf16(x) is <= 2^-7·|x|.)"""
    return 2.0**-7 * (abs_out + model_out.abs()) + 2.0**-20 * abs_out


def decode_out_bound(ref: DecodeReference) -> torch.Tensor:
    """Elementwise bound on |out − exact| [B, H, d]. Three bf16 roundings each move an element by at most
    2^-8 of a convex combination of |v_jd| (hence of max_j |v_jd|): P cast to bf16 (each weight ±2^-8),
    partial out stored as bf16, final out cast to bf16 (the merge weights and the sink factor sum to <= 1).
    2^-10·max|v| covers second-order terms (3·2^-16) and fp32 logit/exp noise (relative ~1e-5 = 2^-16.6)."""
    return (3 * U_BF16 + 2.0**-10) * ref.v_absmax[:, None, :]


def decode_lse_bound(ref: DecodeReference) -> torch.Tensor:
    """|lse − exact| <= max fp32 logit error (softmax-weighted, so at most the max) + approximate exp/log on the
    GPU (LSE_APPROX_SLACK) + a few fp32 roundings of lse itself. P's bf16 rounding does not enter: l uses fp32 p."""
    return ref.logit_bound + LSE_APPROX_SLACK + 8 * U_FP32 * ref.lse.abs()


# ---------------------------------------------------------------------------------------------
# O2: indexer logits
# ---------------------------------------------------------------------------------------------


@dataclass
class IndexerCase:
    q_codes: torch.Tensor  # [B, nI, dI] e4m3
    weights: torch.Tensor  # [B, nI] fp32
    cache: IndexKeyCache
    context_lens: torch.Tensor  # [B] int32
    n_cols: int

    def args(self) -> tuple:
        """Positional arguments of fp8_paged_mqa_logits up to n_cols."""
        return (self.q_codes, self.weights, self.cache.codes, self.cache.scale, self.cache.page_table,
                self.context_lens, self.n_cols)


def make_indexer_case(batch: int, heads: int, dim: int, n_keys: int, device: str = "cpu", seed: int = 0,
                      n_cols: int | None = None, causal: bool = False, scrambled: bool = True) -> IndexerCase:
    """Random indexer inputs. context_lens: random in [0, n_keys] with the edge values 0, 1, 63, 64, 65 and
    n_keys in the first rows (batch >= 6; else row 0 sees n_keys − 17); causal=True gives the prefill pattern (row i sees (i+1)·n_keys/B rows)."""
    g = torch.Generator().manual_seed(seed)
    cache = IndexKeyCache(n_keys, dim, "cpu")
    if scrambled:
        cache.page_table = random_page_order(cache.codes.shape[0], torch.Generator().manual_seed(seed + 1))
    cache.append(torch.randn(n_keys, dim, generator=g) * torch.exp(torch.randn(n_keys, 1, generator=g)))
    for name in ("codes", "scale", "page_table"):
        setattr(cache, name, getattr(cache, name).to(device))
    q_codes, q_scale = quantize_fp8_per_row(torch.randn(batch, heads, dim, generator=g))
    # weights_proj(x)·softmax_scale·nI^-0.5 with the per-(row, head) q scale folded in
    weights = torch.randn(batch, heads, generator=g) * dim**-0.5 * heads**-0.5 * q_scale
    if causal:
        context = ((torch.arange(batch) + 1) * n_keys) // batch
    else:
        context = torch.randint(0, n_keys + 1, (batch,), generator=g)
        if batch >= 6:
            context[:6] = torch.tensor([0, 1, 63, 64, 65, n_keys]).clamp(max=n_keys)
        elif batch:
            context[0] = max(0, n_keys - 17)  # a single row: long context ending in a partial page
    return IndexerCase(q_codes.to(device), weights.to(device), cache, context.to(torch.int32).to(device),
                       n_cols if n_cols is not None else n_keys + 37)


@dataclass
class IndexerReference:
    logits: torch.Tensor  # [B, n_cols] fp64, exact head dots; −inf where masked
    dots: torch.Tensor  # [B, nI, n_cols] fp64 exact per-head dots
    abs_dots: torch.Tensor  # [B, nI, n_cols] Σ_d |q_hd·k_td|
    key_scale: torch.Tensor  # [n_cols] fp64
    visible: torch.Tensor  # [B, n_cols] bool


def indexer_reference(case: IndexerCase) -> IndexerReference:
    """Exact logits in fp64 from the cache's logical rows (IndexKeyCache.dense: codes·scale per row)."""
    codes, scale = _logical_index_keys(case.cache, case.n_cols)
    q = case.q_codes.double()
    dots = torch.einsum("bhd,td->bht", q, codes)
    abs_dots = torch.einsum("bhd,td->bht", q.abs(), codes.abs())
    logits = (case.weights.double()[..., None] * torch.relu(dots)).sum(1) * scale[None, :]
    visible = torch.arange(case.n_cols, device=q.device)[None, :] < case.context_lens.long()[:, None]
    return IndexerReference(logits.masked_fill(~visible, float("-inf")), dots, abs_dots, scale, visible)


def _logical_index_keys(cache: IndexKeyCache, n_cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 key codes and scales of logical rows 0..n_cols−1 (rows past the cache: zeros, always masked)."""
    n = min(n_cols, cache.length)
    slots = torch.arange(n, device=cache.codes.device)
    page = cache.page_table[torch.div(slots, PAGE_SIZE, rounding_mode="floor")].long()
    codes = torch.zeros(n_cols, cache.dim, dtype=torch.float64, device=cache.codes.device)
    scale = torch.zeros(n_cols, dtype=torch.float64, device=cache.codes.device)
    codes[:n] = cache.codes[page, slots % PAGE_SIZE].double()
    scale[:n] = cache.scale[page, slots % PAGE_SIZE].double()
    return codes, scale


def indexer_bound(case: IndexerCase, ref: IndexerReference, dot_precision: str, u_dot: float = U_FP32
                  ) -> torch.Tensor:
    """Elementwise bound on |logit − exact| [B, n_cols] for visible columns.
    per-head dot: fp32 sum of dI exact products: |Δdot| <= dI·u_dot·Σ_d|q k|;
      "bf16" adds the RNE rounding of the dot: + 2^-8·(|dot| + |Δdot|).
    ReLU is 1-Lipschitz; w·ReLU(dot) one fp32 rounding, the nI-term head sum (nI+1)·u, · key_scale one more."""
    dim, heads = case.q_codes.shape[-1], case.q_codes.shape[1]
    dot_err = dim * u_dot * ref.abs_dots
    if dot_precision == "bf16":
        dot_err = dot_err + U_BF16 * (ref.dots.abs() + dot_err)
    w = case.weights.double().abs()[..., None]
    head_sum_err = (w * dot_err).sum(1) + (heads + 2) * U_FP32 * (w * (torch.relu(ref.dots) + dot_err)).sum(1)
    return head_sum_err * ref.key_scale[None, :] + 2 * U_FP32 * ref.logits.abs().nan_to_num(0.0, 0.0, 0.0)


# ---------------------------------------------------------------------------------------------
# rounding.py: inputs whose every rounding decision is a hard one
# ---------------------------------------------------------------------------------------------


def bf16_round_cases(n_random: int = 1 << 18, device: str = "cpu", seed: int = 0) -> torch.Tensor:
    """fp32 inputs for bf16_round: n_random uniformly random bit patterns (every exponent, subnormals, ±inf and
    NaNs among them); at eight exponents (bf16's subnormals 2^-130 and 2^-127, its smallest normal, around 1, the
    largest) every value with 8 fractional mantissa bits — each bf16 value and each tie between two — with its fp32
    neighbours and two more values that round across; the largest finite fp32 (rounds to inf), ±0 and ±inf."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-2**31, 2**31, (n_random,), generator=g, dtype=torch.int64).to(torch.int32)
    ties = []
    for exponent in (-130, -127, -126, -1, 0, 1, 100, 127):  # bf16 subnormals, its smallest normal, 1, the largest
        base = torch.arange(256, dtype=torch.float64) / 256 + 1  # the 128 bf16 mantissas and the midpoints between
        tie = (base * 2.0**exponent).float()
        tie_bits = tie.view(torch.int32)
        ties += [tie_bits, tie_bits + 1, tie_bits - 1, tie_bits + 0x8000, tie_bits + 0x7FFF]
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 3.4028234663852886e38,
                            -3.4028234663852886e38], dtype=torch.float32).view(torch.int32)
    return torch.cat([bits, *ties, special]).view(torch.float32).to(device)


def fp8_block_quant_cases(block: int = 128, device: str = "cpu", seed: int = 0) -> torch.Tensor:
    """[rows, 4·block] fp32 inputs for fp8_block_quant whose blocks hit every kind of decision: every e4m3 value's
    midpoint to the next (normal and subnormal) and its fp32 neighbours under a block maximum of exactly 448·2^k
    (scale 2^k) for several k; maxima one ulp either side of 448·2^k (the scale's exponent flips there); a block below
    the amax floor; zeros of both signs; a block holding inf, one holding a NaN; random normal blocks of many
    magnitudes."""
    g = torch.Generator().manual_seed(seed)
    e4m3 = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 … 448, positive finite
    mid = (e4m3[:-1] + e4m3[1:]) / 2  # exact in fp32: one more bit
    mid_bits = mid.view(torch.int32)
    grid = torch.cat([e4m3, mid, (mid_bits + 1).view(torch.float32), (mid_bits - 1).view(torch.float32)])
    values = torch.cat([grid, -grid])
    width = 4 * block
    rows = []
    for k in (-20, -6, 0, 7, 100):
        scaled = values * 2.0**k
        padded = torch.cat([scaled, torch.zeros((-scaled.numel()) % (block - 1))])
        chunks = padded.view(-1, block - 1)  # each block: block − 1 test values and one 448·2^k (its maximum)
        blocks = torch.cat([chunks, torch.full((chunks.shape[0], 1), 448.0 * 2.0**k)], 1)
        rows.append(blocks)
    flips = []
    for k in (-10, 0, 10):
        top = torch.tensor(448.0 * 2.0**k).view(torch.int32)
        for top_bits in (top - 1, top, top + 1):
            blk = torch.randn(block, generator=g) * 2.0**k
            blk[0] = top_bits.view(torch.float32)
            blk[1:] = blk[1:].clamp(-float(blk[0]) / 2, float(blk[0]) / 2)
            flips.append(blk)
    rows.append(torch.stack(flips))
    tiny = torch.randn(2, block, generator=g) * 1e-6  # under the 1e-4 floor: scale 2^-22
    signed_zeros = torch.zeros(2, block)
    signed_zeros[1] = -0.0
    with_inf = torch.randn(1, block, generator=g)
    with_inf[0, 5] = float("inf")
    with_nan = torch.randn(1, block, generator=g)
    with_nan[0, 9] = float("nan")
    rows.append(torch.cat([tiny, signed_zeros, with_inf, with_nan]))
    magnitudes = 2.0 ** torch.randint(-40, 40, (64, 1), generator=g).float()
    rows.append(torch.randn(64, block, generator=g) * magnitudes)
    flat = torch.cat(rows)
    flat = torch.cat([flat, torch.zeros((-flat.shape[0]) % 4, block)])
    return flat.reshape(-1, width).to(device)  # four blocks per row: the kernel's block index along the row


def same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Element by element: equal fp32 bit patterns, or both NaN (a NaN's payload is not compared)."""
    return (a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())
