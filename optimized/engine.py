"""The optimized engine: a serving-style low-precision DeepSeek-V4, layer by layer (DESIGN §3, Stacks).

It mirrors the reference's structure — the same block, the same state carried between prefill chunks
and decode steps — but every computation a kernel patch could replace goes through a named op
(`optimized.ops`), its caches are paged FP8 (`optimized.paged_cache`), its residual streams are bf16
tensors, and prefill runs in chunks (default 8192, optimized-stack §7) while decode runs one token per
step with query shape (1, …). The patch set of a variant decides which implementation each op runs in
each phase.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from optimized import base_ops
from optimized.base_ops import BASE_OPS
from optimized.numerics import bf16, constant, rms_norm_bf16
from optimized.ops import OpContext, OpTable, Routing, kernel_lanes
from optimized.paged_cache import IndexKeyCache, LatentCache
from optimized.patching import PHASES, PatchChoice
from optimized.state import EngineState
from reference.config import ModelConfig
from reference.graphs import clone_together, replay
from reference.layer import query_block_size
from reference.model import ForwardResult, segment_lengths
from reference.ops.attention import KeySet, sparse_attention_with_sink
from reference.ops.compressor import CompressorState, visible_rows
from reference.ops.mhc import hc_head
from reference.ops.norms import unweighted_rms_norm
from reference.ops.rope import apply_rope, cos_sin, layer_inverse_frequencies
from reference.probes import NULL_SINK, ProbeSink, sampled_offsets
from reference.quant import hadamard_matrix
from reference.weights.dense_cache import DenseCache
from reference.weights.source import TensorBundle, WeightSource

DEFAULT_CHUNK_SIZE = 8192  # optimized-stack §7 / §8: the deployed --chunked-prefill-size


@dataclass(frozen=True)
class EngineOptions:
    """Settings of the stock engine (not patches).

    indexer_fp4: store indexer keys as FP4 e2m1 with UE8M0 per 32 (the deployed `--enable-deepseek-v4-fp4-indexer`
                 layout) instead of FP8 with a per-row fp32 scale.
    """

    indexer_fp4: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"indexer_fp4": self.indexer_fp4}


def _routing_fields(r: Any, shared_expert: bool) -> dict[str, torch.Tensor]:
    """The expert ids and the weights each routed expert and the shared expert (if the model has one) get in the MoE
    output (the routing weight or the shared weight times output_scale: a fused kernel may move the scaling factor
    between them)."""
    weights = [_scaled(r.weights, r.output_scale)]
    if shared_expert:
        weights.append(r.expert_ids.new_full((r.expert_ids.shape[0], 1), r.shared_weight * r.output_scale,
                                             dtype=torch.float32))
    return {"expert_ids": r.expert_ids, "weights": torch.cat(weights, 1)}


def _scaled(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x · scale, or x itself when the scale is 1.0 (x · 1 = x in IEEE arithmetic, signed zeros, infinities and
    subnormals included: base routing's output_scale, two launches per decode step saved)."""
    return x if scale == 1.0 else x * scale


CLAMP_SITE_NOISE = 4
"""The clamp site judges a token where the clamp's change Δ exceeds 4× the variant's own error: the RMS, over the
tokens the clamp leaves alone (finite, nonzero stock output; the worst 1% left out, so one corrupt token cannot
switch the site off), of its relative error against the stock op. A clamp decision is identifiable only there:
where Δ is within a kernel's rounding the kernel may land on either side of it. Measured first without it: W4A4
experts (nvfp4-experts), which keep the clamp, moved by about Δ along Δ at 0.2–2.4% of tiny's tokens at limits
2–3, and at 3 units of the CPU demo with its experts calibrated to pass the limit — their largest rounding errors
sit on the largest elements, the clamped ones."""

CLAMP_SITE_MIN_ALONE = 16
"""Tokens the clamp leaves alone that a judgement needs for the variant's error to be estimated: fewer, and the
tokens' clamp is not judged (no clamp rows are emitted for them; the pair site's are). A decode step has one token,
so the steps are held and judged together at the end of the layer (OptimizedLayer.emit_held_experts)."""

CLAMP_SITE_MISS = 3 / 4
"""p past which a judged token counts as a skipped clamp (p = 0: the clamped result, 1: the unclamped one). A kernel
that keeps the clamp moves along Δ by its rounding, ≤ 3× its RMS error at nearly every token, so < 3/4 of Δ where
Δ is judged: no false count. One that skips it lands at 1 ± that rounding; where its rounding is large the skip may
land below 3/4 and go uncounted (W4A4 experts without the clamp: 1.6% of tiny's tokens counted at limit 3)."""


def clamp_site_miss(out: torch.Tensor, stock: torch.Tensor, unclamped: torch.Tensor) -> torch.Tensor | None:
    """Per token, 1 where `out` (a variant's experts or shared_expert over some tokens) skipped the SwiGLU clamp:
    with Δ = unclamped − stock (what the clamp changed at the token: 0 where no pre-activation passed the limit)
    and p = ⟨out − stock, Δ⟩ / ‖Δ‖², where ‖Δ‖ exceeds CLAMP_SITE_NOISE × the variant's RMS relative error at the
    tokens the clamp leaves alone, times ‖stock‖, and p > 3/4 (CLAMP_SITE_MISS). None when fewer than
    CLAMP_SITE_MIN_ALONE tokens can give that error. fp32 (its sums are judged against 3/4 and 4×, not bits)."""
    delta, moved = (unclamped - stock).float(), (out - stock).float()
    ref, size = stock.float().pow(2).sum(-1), delta.pow(2).sum(-1)
    alone = size <= 2 ** -16 * ref  # the clamp changed the output by less than bf16's unit roundoff (2^-8)
    rel = moved.pow(2).sum(-1) / ref
    usable = alone & (ref > 0) & torch.isfinite(rel)
    if int(usable.sum()) < CLAMP_SITE_MIN_ALONE:
        return None
    errors = rel[usable]
    noise = errors[errors <= torch.quantile(errors, 0.99)].mean()
    judged = ~alone & (size > CLAMP_SITE_NOISE ** 2 * noise * ref)
    p = (moved * delta).sum(-1) / size.clamp_min(torch.finfo(torch.float32).tiny)
    return (judged & (p > CLAMP_SITE_MISS)).float()


PAIR_SITE_SHARE = 3 / 4
"""|a| past which a pair's contribution counts as wrong: a = 0 is the stock pair, −1 the pair lost, +1 it counted
twice; a weight from another slot or scale off by 3/4 or more lies beyond it too. A kernel's rounding can move a
pair by much of itself where one intermediate channel makes most of the pair's output and FP4 activations round it:
the W4A4 experts of nvfp4-experts (correct) on the calibrated CPU demo, 43 layers, fitted in fp64 — up to |a| = 0.74
among pairs whose part of the fit stands 4× above the residual, up to 0.42 among those 8× above it. 1/2 left that
0.42 close; a misweight between 1/2 and 3/4 is left to the drift checks (the shared expert scaled by the routed
scaling factor 1.5, a = 0.5, failed eleven of them on the demo)."""

PAIR_SITE_DOMINANCE = 8
"""How much larger than what the fit leaves unexplained a counted pair's own part of the move must be (in norm;
its part: what the fit loses without it, the other pairs refitted). A kernel's rounding spreads over the output's D
dimensions: the W4A4 experts' pairs with |a| > 1/2 on the demo stood at most 5.2× above the residual. A pair lost by a
kernel that otherwise computes in the stock precision leaves a residual of the other pairs' rounding only. Lost from
W4A4 experts, it hides in their rounding at most tokens (not identifiable per token; the drift checks' to find)."""


def pair_sites(out: torch.Tensor, stock: torch.Tensor, pairs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The pair site per token, and each pair's own coefficient a = ⟨d, pair⟩/‖pair‖² [S, k] (expert_site_bias reads
    them; NaN for a pair of zero output), in one fp64 pass over PAIR_SITE_BLOCK tokens at a time.

    The site: 1 where the variant's `out` [S, D] (its experts, or its shared expert) lacks, repeats or misweighs
    a whole contribution of the stock op on the same inputs: `pairs` [S, k, D] are the stock op's routed pairs'
    weighted outputs (the shared expert: its output, k = 1), `stock` their sum. The move d = out − stock is fitted by
    Σ a_j·pair_j (least squares per token; a token whose pairs were all dropped has every a_j = −1); a pair j counts
    where |a_j| > PAIR_SITE_SHARE (3/4) and its own part of the fit (what the fit loses without it, a_j² / (G⁻¹)_jj,
    the others refitted) exceeds PAIR_SITE_DOMINANCE² × the residual's squared norm. What it catches is a pair's
    output lost (an expert-parallel dispatch or a capacity limit dropping it), counted twice (a combine reading a slot
    again), or weighted by another slot's or another scale's weight off by 3/4 or more — whatever the kernel's
    precision. A token whose output is not finite counts 0 here: the probes' non-finite finding fails the run for it."""
    blocks = [_pair_site_block(out[s : s + PAIR_SITE_BLOCK], stock[s : s + PAIR_SITE_BLOCK],
                               pairs[s : s + PAIR_SITE_BLOCK]) for s in range(0, out.shape[0], PAIR_SITE_BLOCK)]
    if not blocks:
        return out.new_zeros(0, dtype=torch.float32), out.new_zeros(0, pairs.shape[1], dtype=torch.float64)
    return torch.cat([lost for lost, _ in blocks]), torch.cat([own for _, own in blocks])


PAIR_SITE_BLOCK = 1024
"""Tokens fitted at once: their pairs in fp64 ([block, k, D]: 200 MB at Flash's k = 6, D = 4096)."""


def _pair_site_block(out: torch.Tensor, stock: torch.Tensor, pairs: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """pair_sites over a block of tokens. The Gram matrices in fp64 from the fp32 values (products exact, sums to
    2^-53): in fp32 their rounding exceeded what separates two nearly collinear pairs (a drop of one of two pairs
    differing by 1e-3 was counted at 40% of tokens, in fp64 at all)."""
    d = (out - stock).double()
    p = pairs.double()
    gram = torch.einsum("skd,sjd->skj", p, p)
    rhs = torch.einsum("skd,sd->sk", p, d)
    diag = gram.diagonal(dim1=-2, dim2=-1)
    ridge = 1e-9 * diag.mean(-1, keepdim=True) + torch.finfo(torch.float64).tiny  # a pair of zero output: a = 0
    inverse = torch.linalg.inv_ex(gram + torch.diag_embed(ridge.expand_as(diag)))[0]  # no error check: no host sync
    a = (inverse @ rhs.unsqueeze(-1)).squeeze(-1)
    residual = (d - torch.einsum("sk,skd->sd", a, p)).pow(2).sum(-1)
    # what the fit loses without pair j (the others refitted): a_j² / (G⁻¹)_jj — small where pair j's output is
    # nearly a combination of the others', whose moves could then stand in for its own
    own = a.pow(2) / inverse.diagonal(dim1=-2, dim2=-1)
    wrong = (a.abs() > PAIR_SITE_SHARE) & (own > PAIR_SITE_DOMINANCE ** 2 * residual[:, None])
    return wrong.any(-1).float(), rhs / diag  # each pair alone: ⟨d, pair⟩/‖pair‖²


EXPERT_BIAS_FLOOR = 1 / 4
"""|median a| past which an expert counts: most of its pairs in the call scaled by 1/4 or more against the stock
expert's output on the same inputs (a scale read for another block, another expert's weights). Measured on the
calibrated CPU demo: the W4A4 experts of nvfp4-experts (correct) bias some experts' *mean* coefficient by up to 0.18
(pairs where one intermediate channel makes the output and FP4 rounds it), far beyond its standard error; a mean
test flagged them. The median takes most of an expert's pairs to move."""

EXPERT_BIAS_MIN_PAIRS = 16
"""Pairs an expert needs in a call for its median to be judged (a decode step gives one token: a layer's steps are
judged together, and at Flash's 256 experts most experts still get too few of them there)."""


def expert_site_bias(coefficients: torch.Tensor, expert_ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Per token, 1 where one of its experts' outputs is scaled at most of that expert's pairs against the stock op's
    on the same inputs: each pair's `coefficients` a = ⟨d, pair⟩/‖pair‖² [S, k] (pair_sites; d = out − stock: what
    the variant added along the pair's own output; −1 the pair lost, −1/2 it halved), their median over the call's
    pairs of each expert; an expert counts where both middle values pass EXPERT_BIAS_FLOOR on the same side (more than
    half of its pairs moved that way), with at least EXPERT_BIAS_MIN_PAIRS pairs. What the pair site leaves (a move
    under 3/4 of a pair) is judged here over the expert's tokens: a loader bug confined to one expert of 256 touches
    ~2% of a layer's tokens, which the MoE's mean error hides. `expert_ids` [S, k] (the shared expert: k = 1, one
    expert). Grouped by sorting and searchsorted, on the device, without a host sync."""
    a = coefficients.flatten()
    if a.numel() == 0:
        return coefficients.new_zeros(coefficients.shape[0], dtype=torch.float32)
    usable = torch.isfinite(a)  # a pair of zero output (a zero routing weight) gives NaN: an extra group, never judged
    ids = torch.where(usable, expert_ids.flatten().long(), torch.full_like(expert_ids.flatten().long(), n_experts))
    order = torch.sort(a.nan_to_num(0.0, 0.0, 0.0), stable=True).indices  # by a, then (stable) by expert: each
    order = order[torch.sort(ids[order], stable=True).indices]  # expert's coefficients ascending, experts in turn
    sorted_ids, sorted_a = ids[order], a[order]
    groups = torch.arange(n_experts + 1, device=ids.device)
    starts = torch.searchsorted(sorted_ids, groups)
    counts = torch.searchsorted(sorted_ids, groups, right=True) - starts
    lo = sorted_a[(starts + (counts - 1).clamp_min(0) // 2).clamp_max(a.numel() - 1)]  # the two middle values,
    hi = sorted_a[(starts + counts // 2).clamp_max(a.numel() - 1)]  # lo ≤ hi: both past the floor on one side
    biased = (counts >= EXPERT_BIAS_MIN_PAIRS) & ((lo > EXPERT_BIAS_FLOOR) | (hi < -EXPERT_BIAS_FLOOR)) & (
        groups < n_experts)
    return biased[ids].view(expert_ids.shape).any(-1).float()


def post_site_excess(out: torch.Tensor, stock: torch.Tensor, f: torch.Tensor, streams: torch.Tensor,
                     post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Per token, the share of hc_post's n·D outputs X'[k] = post_k·f + Σ_j C[j,k]·X[j] (spec §3.2: fp32 math,
    stored bf16) that `out` puts further from `stock` than two fp32 implementations of the same math can differ:
    each sum of n + 1 products is within γ = (n + 2)·2^-24 of its terms' magnitudes whatever its order (Higham,
    Accuracy and Stability of Numerical Algorithms, §3.1: products and sums rounded once each), so two differ
    by ≤ 2γ·(|post_k·f| + Σ_j |C[j,k]|·|X[j]|); each stored value then moves by ≤ half a bf16 ulp of itself, one
    ulp of the larger of the two between them (at least bf16's subnormal spacing 2^-133), and a kernel that flushes
    subnormals to zero by up to 2^-126 more. A kernel that contracts the wrong index of C, accumulates in bf16, drops
    a term or writes NaN where the stock op has a number exceeds it; one that sums in another order or keeps the
    fp32 result does not."""
    n = comb.shape[-1]
    x, fo = streams.float(), f.float()
    envelope = post.abs().unsqueeze(-1) * fo.abs().unsqueeze(-2) + comb.abs().transpose(-1, -2) @ x.abs()
    a, b = out.float(), stock.float()
    _, exponent = torch.frexp(torch.maximum(a.abs(), b.abs()))
    # bf16: 8 significant bits, |v| in [2^(e-1), 2^e); below 2^-126 the spacing stays 2^-133
    ulp = torch.ldexp(torch.ones_like(a), exponent.clamp_min(-125) - 8)
    within = (a - b).abs() <= ulp + 2.0**-126 + 2 * (n + 2) * 2.0**-24 * envelope  # False where either is NaN
    beyond = ~within & ~(a.isnan() & b.isnan())  # NaN where the stock op has NaN too is the input's, not the op's
    return beyond.flatten(1).float().mean(1)


def _mix_fields(result: tuple[torch.Tensor, Any]) -> dict[str, torch.Tensor]:
    _, mix = result
    return {"pre": mix.pre, "post": mix.post, "comb": mix.comb}


def _in_blocks(parts: list[tuple[torch.Tensor, ...]], block: int) -> list[tuple[torch.Tensor, ...]]:
    """Per-block tuples of per-query tensors (positions, then [B, …] fields) joined along the queries and cut into
    calls of at most `block` queries. A [B, k] field whose width differs between blocks (an indexer_topk plugin may return
    fewer picks where fewer rows are visible) is padded with −1 / False: an invalid pick, as the op spec has it."""
    if not parts:
        return []
    joined = []
    for field in zip(*parts):
        if field[0].dim() == 2 and len({f.shape[1] for f in field}) > 1:
            width = max(f.shape[1] for f in field)
            fill = False if field[0].dtype == torch.bool else -1
            field = [torch.cat([f, f.new_full((f.shape[0], width - f.shape[1]), fill)], 1) for f in field]
        joined.append(field[0] if len(field) == 1 else torch.cat(field))  # one block (a decode step): no copy
    n = joined[0].shape[0]
    return [tuple(t[i:i + block] for t in joined) for i in range(0, n, block)]


def _in_runs(parts: list[tuple[Any, tuple[torch.Tensor, ...]]], block: int
             ) -> list[tuple[Any, tuple[torch.Tensor, ...]]]:
    """(key, rows) parts -> (key, call) calls: _in_blocks over each run of consecutive parts with one key."""
    return [(key, rows) for key, run in itertools.groupby(parts, key=lambda part: part[0])
            for rows in _in_blocks([r for _, r in run], block)]


def _at_most(sites: list["_HeldSite"], tokens: int) -> list[list["_HeldSite"]]:
    """`sites` cut, in order, into runs of at most `tokens` tokens (a site holds at least one run of its own)."""
    runs: list[list[_HeldSite]] = [[]]
    count = 0
    for site in sites:
        n = site.positions.numel()
        if runs[-1] and count + n > tokens:
            runs.append([])
            count = 0
        runs[-1].append(site)
        count += n
    return runs


class _SampledRows:
    """`t[sampled]` for a query block's tensors, each tensor indexed once: a block's position, query, window and
    compressed slots go to up to four consumers (indexer.scores, the indexer and attention sites, attn.probs), and
    each pick is an index kernel on a GPU (bench/launch_count.py, tiny, CSA layer 2 at 30,720 tokens: 19 picks per
    block before, 13 after, × 120 blocks per prefill stack). The picks are copies that only this repository's
    consumers read (probes and the stock and twin site calls, never a patched op), none writing into them, so one
    serves them all."""

    def __init__(self, sampled: torch.Tensor) -> None:
        self.sampled = sampled
        self._picked: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id → (the tensor, kept alive; its pick)

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        held = self._picked.get(id(t))
        if held is None:
            held = self._picked[id(t)] = (t, t[self.sampled])
        return held[1]


def _widths(rows: tuple[torch.Tensor, ...]) -> tuple[torch.Size, ...]:
    return tuple(f.shape[1:] for f in rows)


CACHE_OPS = ("kv_store", "kv_load", "chunk_state_carry")
"""The ops that write, read or replace the engine's caches between decode steps."""


PER_TOKEN_INPUTS = {"hc_pre": ("streams",), "router": ("y", "token_ids"),
                    "sparse_attention": ("q", "window_slots", "comp_slots", "comp_lanes", "comp_length")}
"""The inputs of each op whose site a decode step may hold that have one row per token: joined along the tokens over
the held steps. The others are the op's own at every step (hc_pre's site name, the attention's per-head sink)."""


@dataclass
class _HeldSite:
    """One decode step's decision site (OptimizedLayer._emit_site) waiting for its stock and twin calls: the tap, the
    op and how its result becomes fields, the step's positions, the variant's own fields, whether they are the stock
    op's (no patch ran), the op's per-token inputs (PER_TOKEN_INPUTS) and its other inputs."""

    tap: str
    op: str
    fields: Callable[[Any], dict[str, torch.Tensor]]
    positions: torch.Tensor
    own: dict[str, torch.Tensor]
    own_is_stock: bool
    per_token: dict[str, torch.Tensor]
    constants: dict[str, Any]

    @classmethod
    def kept(cls, tap: str, op: str, fields: Callable[[Any], dict[str, torch.Tensor]], positions: torch.Tensor,
             own: Any, own_is_stock: bool, inputs: dict[str, Any]) -> "_HeldSite":
        """The site with copies of its own fields and per-token inputs (clone_together: one copy per dtype): they are
        read at the end of the decode, and a patch may return a buffer it writes again at the next step (a kernel
        replayed from a CUDA graph returns its static output), as the sink's own deferred emissions assume too."""
        own_fields = fields(own)
        per_token = {k: inputs[k] for k in PER_TOKEN_INPUTS[op] if k in inputs}
        copies = iter(clone_together([*own_fields.values(), *per_token.values()]))
        return cls(tap, op, fields, positions, {k: next(copies) for k in own_fields}, own_is_stock,
                   {k: next(copies) for k in per_token}, {k: v for k, v in inputs.items() if k not in per_token})


@dataclass
class _HeldExperts:
    """One decode step's experts site (OptimizedLayer._experts_site) waiting to be judged with the layer's other steps:
    the tap, the op, the step's context, the variant's output and the op's inputs — copies (clone_together: one
    copy per dtype), since a patch may return a buffer it writes again at the next step."""

    tap: str
    op: str
    ctx: OpContext
    out: torch.Tensor
    y: torch.Tensor
    routing: Routing

    @classmethod
    def kept(cls, tap: str, op: str, ctx: OpContext, out: torch.Tensor, y: torch.Tensor,
             routing: Routing) -> "_HeldExperts":
        out, y, scores, ids, weights = clone_together([out, y, routing.scores, routing.expert_ids, routing.weights])
        return cls(tap, op, ctx, out, y, Routing(scores, ids, weights, routing.output_scale, routing.shared_weight))

    @property
    def key(self) -> tuple[str, int, int]:
        """Steps judged together: the same tap and routing widths (a plugin router's may vary from step to step)."""
        return self.tap, self.routing.scores.shape[-1], self.routing.expert_ids.shape[-1]


@dataclass
class _HeldSampled:
    """Per-query inputs of the sampled indexer site and attention rows not yet emitted, each with the key of the
    calls it may share (see OptimizedLayer._attention), and what emitting them needs: the context of the segment
    that held them last (its state: the caches), its query block size and the attention sink logits. Also the
    decode steps' decision sites (`sites`), emitted with one stock and one twin call per tap and input widths
    (OptimizedLayer._emit_held_sites), in the context `ctx`."""

    site_rows: list[tuple[Any, tuple[torch.Tensor, ...]]] = field(default_factory=list)
    probs_rows: list[tuple[Any, tuple[torch.Tensor, ...]]] = field(default_factory=list)
    ctx: OpContext | None = None
    block: int = 1
    sink_logit: torch.Tensor | None = None
    sites: list[_HeldSite] = field(default_factory=list)


# The attention's element-wise glue around its linears, each a pure function of its inputs replayed from a CUDA graph
# when small (reference.graphs.replay; the same kernels, the same bits). A replay costs its inputs' copies, one graph
# launch and its output's clone: the queries' 17 kernels (norm 5, two bf16 rounds 4, RoPE 8) become 5, the kv rows'
# 10 become 5, the indexer queries' 13 become 6 and the de-rotation's 11 become 5 — 51 → 21 launches per decode step.
# cos/sin [S, r/2]; queries [S, H, d], rows [S, d].
def _normed_rotated_queries(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """Each head's q RMS-normed without weight (spec §4.1), rounded to bf16 and RoPE'd (§4.3), bf16."""
    return bf16(apply_rope(bf16(unweighted_rms_norm(q, eps)), cos[:, None], sin[:, None]))


def _rotated_rows(kv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The normed kv row RoPE'd (spec §4.2, §4.3), bf16."""
    return bf16(apply_rope(kv, cos, sin))


def _rotated_index_queries(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, hadamard: torch.Tensor
                           ) -> torch.Tensor:
    """Indexer queries RoPE'd, bf16, then rotated by the Hadamard matrix, bf16 (the fused RoPE + Hadamard of
    optimized-stack §3.1; spec §5.3)."""
    return bf16(bf16(apply_rope(q, cos[:, None], sin[:, None])) @ hadamard)


def _derotated_outputs(out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The attention output's rope dims rotated back by −φ, bf16 (spec §4.6)."""
    return bf16(apply_rope(out, cos[:, None], sin[:, None], inverse=True))


@functools.lru_cache(maxsize=8)
def _window_offsets(window: int, device: torch.device) -> torch.Tensor:
    """−W+1 … 0 (int64), made once per window and device: a query's window slots are its position plus these.
    Read only: it is shared."""
    return torch.arange(-window + 1, 1, device=device)


class OptimizedLayer:
    """Block `layer` of the optimized engine for one variant (its patch choices)."""

    def __init__(self, cfg: ModelConfig, layer: int, weights: TensorBundle, choices: Sequence[PatchChoice],
                 device: torch.device | str = "cpu", options: EngineOptions = EngineOptions(),
                 dense: DenseCache | None = None) -> None:
        """`dense`: dequantized weights shared with the other stacks of this layer (a new cache when None)."""
        self.cfg, self.layer, self.weights = cfg, layer, weights
        self.kind, self.ratio = cfg.layer_kind(layer), cfg.compress_ratio(layer)
        self.device, self.options = torch.device(device), options
        self.dense = dense if dense is not None else DenseCache()
        acting = [c for c in choices if c.patch.acts_at(cfg, layer, c.options)]  # Patch.layers_for, enforced here
        self.tables = {phase: OpTable(BASE_OPS, acting, phase) for phase in PHASES}
        self.stock_tables = {phase: OpTable(BASE_OPS, [], phase) for phase in PHASES}
        self.hadamard = hadamard_matrix(cfg.index_head_dim, device=self.device) if self.kind == "csa" else None
        self._held_sampled = _HeldSampled()
        self._held_experts: list[_HeldExperts] = []
        self.holds_decode_samples = not any(self.tables["decode"].patched(op) for op in CACHE_OPS)
        """Whether run_layer may recompute the decode steps' sampled rows once after the last step: only when the
        stock ops write and read the caches in decode. They append and never rewrite a row, so the caches at the end
        hold what each step read; a patched store could rewrite rows a later step's query no longer sees, and a
        patched load could depend on the step it runs in — those recompute at every step, as the kernel saw them."""

    def new_state(self, capacity_tokens: int) -> EngineState:
        cfg, dev = self.cfg, self.device
        comp = idx = compressed = index_keys = None
        if self.kind != "swa":
            comp = CompressorState.empty(self.ratio, self.kind == "csa", cfg.head_dim, torch.float32, dev)
            compressed = LatentCache(capacity_tokens // self.ratio + 1, cfg.nope_head_dim, cfg.qk_rope_head_dim, dev)
        if self.kind == "csa":
            idx = CompressorState.empty(self.ratio, True, cfg.index_head_dim, torch.float32, dev)
            index_keys = IndexKeyCache(capacity_tokens // self.ratio + 1, cfg.index_head_dim, dev,
                                       fp4=self.options.indexer_fp4)
        window = LatentCache(capacity_tokens, cfg.nope_head_dim, cfg.qk_rope_head_dim, dev)
        return EngineState(0, 0, self.ratio, layer_inverse_frequencies(cfg, self.layer).to(dev), window, compressed,
                           index_keys, comp, idx)

    def _context(self, phase: str, segment: int, positions: torch.Tensor, state: EngineState) -> OpContext:
        return OpContext(self.cfg, self.layer, self.kind, phase, segment, positions, state, self.weights, self.dense,
                         self.device, self.options.to_dict(), self.tables[phase])

    def _stock(self, ctx: OpContext, reassociate: bool) -> OpContext:
        """The stock engine's ops (no patch) on this segment — or their benign twin, the same precision with fp32
        sums re-associated (base_ops.fp32_product). Comparing a variant's fp32 decision sites with the stock
        op on the *same inputs* measures what the site itself changed; the twin measures what fp32 rounding
        alone changes there (DESIGN §5: decision floors at sites the official model keeps in fp32)."""
        return ctx.with_fields(table=self.stock_tables[ctx.phase],
                               engine_options={**ctx.engine_options, "reassociate": reassociate})

    def _emit_site(self, probes: ProbeSink, tap: str, ctx: OpContext, op: str, fields: Callable[[Any], dict],
                   positions: torch.Tensor, own: Any, own_is_stock: bool, hold: list[_HeldSite] | None = None,
                   **inputs: Any) -> None:
        """Emit `tap` with the variant's result of `op` and the stock op's and its twin's on the same inputs.
        `own_is_stock`: no patch ran while `own` was computed, so `own` is the stock result (same code, same inputs)
        and is not computed again. `hold`: a list the site waits in, to be emitted with the others there
        (_emit_held_sites) — a decode step's (emit_held_sampled), whose `op` gives each token's row from that
        token's inputs alone (hc_pre and router always, sparse_attention while the caches keep the rows it read), or
        a prefill block's attention site, emitted with the chunk's other blocks' (_attention)."""
        if not probes.wants(tap):
            return
        if hold is not None:
            hold.append(_HeldSite.kept(tap, op, fields, positions, own, own_is_stock, inputs))
            return
        values = {}
        stock = own if own_is_stock else self._stock(ctx, False).call(op, **inputs)
        for prefix, result in (("", own), ("stock_", stock), ("twin_", self._stock(ctx, True).call(op, **inputs))):
            values.update({prefix + k: v for k, v in fields(result).items()})
        probes.emit(tap, positions, **values)

    def _hc_post(self, ctx: OpContext, sink: ProbeSink, tap: str, positions: torch.Tensor, f: torch.Tensor,
                 streams: torch.Tensor, mix: Any) -> torch.Tensor:
        """hc_post, and its site `tap`: per token, the share of the n·D outputs further from the stock hc_post's on
        the same inputs than any fp32 implementation of it can be (post_site_excess). No patch ran: the share is 0
        by construction (the same code on the same inputs), not computed."""
        out, stock_only = ctx.call_noting_patches("hc_post", f=f, streams=streams, mix=mix)
        if sink.wants(tap):
            excess = torch.zeros(positions.shape[0], device=positions.device) if stock_only else \
                post_site_excess(out, self._stock(ctx, False).call("hc_post", f=f, streams=streams, mix=mix),
                                 f, streams, mix.post, mix.comb)
            sink.emit(tap, positions, excess=excess)
        return out

    def _kv_store(self, ctx: OpContext, sink: ProbeSink, cache: str, rows: torch.Tensor,
                  row_positions: torch.Tensor | None) -> None:
        """kv_store, and the cache site `attn.kv.site`: the slots the write was for (the next `len(rows)` of the
        cache), read back — through the variant's kv_load for the window and compressed caches; the indexer's keys,
        which no op loads, from the cache itself — against the rows' stored form (the cache format's exact
        quantization: LatentCache / IndexKeyCache.stored_form): per row, 1 when any value differs. A write to the
        wrong slot, one that drops or alters part of a row, and a read from the wrong slot all differ; the format's
        own rounding does not. When neither op is patched the share is 0 by construction and not computed.
        `row_positions`: the token each row is binned at (None: compressed rows, at the token that completed them)."""
        state = ctx.state
        first = state.cache(cache).length
        _, stored_stock = ctx.call_noting_patches("kv_store", cache=cache, rows=rows)
        n = rows.shape[0]
        if not n or not sink.wants("attn.kv.site"):
            return
        slots = torch.arange(first, first + n, device=rows.device)
        if row_positions is None:
            row_positions = (slots + 1) * state.ratio - 1
        stored = state.cache(cache)
        if stored_stock and (cache == "index" or not ctx.table.patched("kv_load")):
            mismatch = torch.zeros(n, device=rows.device)
        else:  # compared bit for bit: a NaN written where a NaN was given is the row it was given
            expected = stored.stored_form(rows)
            back = stored.rows_at(slots) if cache == "index" else ctx.call("kv_load", cache=cache, slots=slots)
            bits = torch.int16 if expected.dtype == torch.bfloat16 else torch.int32
            mismatch = (back.to(expected.dtype).view(bits) != expected.view(bits)).any(-1).float()
        sink.emit("attn.kv.site", row_positions, mismatch=mismatch)

    def _emit_rows_missing(self, ctx: OpContext, sink: ProbeSink, end: int) -> None:
        """The cache site's count (`attn.kv.site`): once a segment's rows are stored, before any of its queries
        attends, the caches must hold exactly the rows its positions make — the window every token's row up to
        `end`, the compressed and indexer-key caches one row per window of `compress_ratio` tokens completed by then
        (spec §10.3: a row is visible to the query at the position that completes it). Each row lacking (stored a
        step late, never stored) or extra (stored twice) counts as a mismatched row at the segment's last position,
        as a wrong write does; such a row is absent from the variant's own caches, where the attention and indexer
        sites run the stock ops too, so they cannot see it. Python integers only: nothing is emitted, or read from
        the device, when the counts are right."""
        if not sink.wants("attn.kv.site"):
            return
        state = ctx.state
        expected = {"window": end}
        if self.kind != "swa":
            expected["compressed"] = end // state.ratio
        if self.kind == "csa":
            expected["index"] = end // state.ratio
        wrong = sum(abs(state.cache(name).length - n) for name, n in expected.items())
        if wrong:
            sink.emit("attn.kv.site", torch.full((wrong,), end - 1, device=self.device),
                      mismatch=torch.ones(wrong, device=self.device))

    # ------------------------------------------------------------------------------------------
    def forward(self, streams: torch.Tensor, token_ids: torch.Tensor, state: EngineState, phase: str,
                segment: int = 0, sink: ProbeSink = NULL_SINK, hold_sampled: bool = False,
                hold_sites: bool = False, join_sites: bool = False) -> torch.Tensor:
        """Block_l over the segment's tokens; streams [S, n, D] bf16 in and out. Mutates `state`.
        `hold_sampled`: keep the sampled queries' indexer site and attention rows (recomputed from the caches) for
        `emit_held_sampled` instead of emitting them at the end of this segment — valid only while later segments
        leave the rows these queries read as they are (`holds_decode_samples`). `hold_sites`: keep the mHC and
        router sites' inputs for `emit_held_sampled` too (valid in any case: those ops read no cache), and with
        `hold_sampled` the sampled queries' attention site's. `join_sites` (a prefill chunk): the attention site's
        stock and twin calls once over the chunk's sampled queries, after its last block, instead of once per block
        (the caches hold the whole chunk before its first block, so every block's queries read the same rows then)."""
        held = self._held_sampled.sites if hold_sites else None
        cfg = self.cfg
        positions = torch.arange(state.position, state.position + streams.shape[0], device=self.device)
        ctx = self._context(phase, segment, positions, state)
        if state.segment > 0:
            carried = ctx.call("chunk_state_carry", state=state)
            if carried is not state:
                state.__dict__.update(carried.__dict__)
        if sink.wants("layer.in"):
            sink.emit("layer.in", positions, streams=streams.float())

        (a, mix), stock_only = ctx.call_noting_patches("hc_pre", streams=streams, site="attn")
        if sink.wants("attn.hc"):
            sink.emit("attn.hc", positions, pre=mix.pre, post=mix.post, comb=mix.comb, mixed=a)
        self._emit_site(sink, "attn.hc.site", ctx, "hc_pre", _mix_fields, positions, (a, mix), stock_only,
                        held, streams=streams, site="attn")
        attn_out = self._attention(ctx, rms_norm_bf16(a, ctx.weight("attn_norm.weight"), cfg.rms_norm_eps), sink,
                                   hold_sampled, hold_sampled and hold_sites, join_sites)
        if sink.wants("attn.out"):
            sink.emit("attn.out", positions, out=attn_out)
        streams = self._hc_post(ctx, sink, "attn.hc.post.site", positions, attn_out, streams, mix)

        (a, mix), stock_only = ctx.call_noting_patches("hc_pre", streams=streams, site="ffn")
        if sink.wants("ffn.hc"):
            sink.emit("ffn.hc", positions, pre=mix.pre, post=mix.post, comb=mix.comb, mixed=a)
        self._emit_site(sink, "ffn.hc.site", ctx, "hc_pre", _mix_fields, positions, (a, mix), stock_only,
                        held, streams=streams, site="ffn")
        moe_out = self._moe(ctx, rms_norm_bf16(a, ctx.weight("ffn_norm.weight"), cfg.rms_norm_eps), token_ids, sink,
                            held)
        if sink.wants("moe.out"):
            sink.emit("moe.out", positions, out=moe_out)
        streams = self._hc_post(ctx, sink, "ffn.hc.post.site", positions, moe_out, streams, mix)

        if sink.wants("layer.out"):
            sink.emit("layer.out", positions, streams=streams.float())
        state.position += streams.shape[0]
        state.segment += 1
        return streams

    # ------------------------------------------------------------------------------------------
    def _attention(self, ctx: OpContext, x: torch.Tensor, sink: ProbeSink, hold_sampled: bool, hold_site: bool,
                   join_sites: bool = False) -> torch.Tensor:
        """`hold_sampled`: forward's; `hold_site`: hold the sampled queries' attention site as well (forward's
        hold_sites, valid only with hold_sampled: the site reads the caches by the step's slots); `join_sites`:
        forward's (the chunk's blocks' attention sites emitted together after the last block)."""
        cfg, state, positions = self.cfg, ctx.state, ctx.positions
        H, eps = cfg.num_attention_heads, cfg.rms_norm_eps
        cos, sin = cos_sin(state.inv_freq, positions, torch.float32)
        q_lat = rms_norm_bf16(ctx.call("linear", x=x, site="attn.wq_a"), ctx.weight("attn.q_norm.weight"), eps)
        q = ctx.call("linear", x=q_lat, site="attn.wq_b").unflatten(-1, (H, cfg.head_dim))
        q = replay(_normed_rotated_queries, q, cos, sin, eps=eps)
        kv = rms_norm_bf16(ctx.call("linear", x=x, site="attn.wkv"), ctx.weight("attn.kv_norm.weight"), eps)
        kv = replay(_rotated_rows, kv, cos, sin)
        self._kv_store(ctx, sink, "window", kv, positions)
        if sink.wants("attn.q"):
            sink.emit("attn.q", positions, q=q)
        if sink.wants("attn.kv"):
            sink.emit("attn.kv", positions, kv=ctx.call("kv_load", cache="window", slots=positions))

        if self.kind != "swa":
            rows = ctx.call("compressor", which="main", x=x, positions=positions)
            self._kv_store(ctx, sink, "compressed", rows, None)
            self._emit_rows(sink, "compressor.rows", rows, state.compressor)
        if self.kind == "csa":
            rows = ctx.call("compressor", which="indexer", x=x, positions=positions)
            # fused RoPE+Hadamard+quant (no row completed: nothing to rotate)
            self._kv_store(ctx, sink, "index", bf16(rows @ self.hadamard) if rows.shape[0] else rows, None)
            self._emit_rows(sink, "indexer.rows", rows, state.indexer_compressor)
            q_idx = ctx.call("linear", x=q_lat, site="attn.indexer.wq_b").unflatten(
                -1, (cfg.index_n_heads, cfg.index_head_dim))
            q_idx = replay(_rotated_index_queries, q_idx, cos, sin, self.hadamard)
            idx_weights = ctx.call("linear", x=x, site="attn.indexer.weights_proj").float() * (
                cfg.index_head_dim**-0.5 * cfg.index_n_heads**-0.5)
        self._emit_rows_missing(ctx, sink, state.position + x.shape[0])

        out = torch.empty_like(q)
        sink_logit = ctx.weight("attn.attn_sink")
        main_rows = state.compressor.n_rows if state.compressor else 0
        index_rows = state.index_keys.length if state.index_keys else 0
        block = query_block_size(cfg, self.kind, main_rows, index_rows, self.device)
        site_rows, probs_rows = [], []  # per block, the inputs of the chunk's indexer site and probs at its queries
        attn_sites = self._held_sampled.sites if hold_site else [] if join_sites else None
        for start in range(0, positions.numel(), block):
            blk = slice(start, start + block)
            pos = positions[blk]
            sampled = sampled_offsets(sink, state.position + start, pos.numel(), self.device) if any(
                sink.wants(tap) for tap in ("attn.probs", "attn.site", "indexer.scores", "indexer.site")) \
                else None  # no device read
            # slot t−W+1 … t of each query, the ones before the prompt (< 0) as −1
            window_slots = (pos[:, None] + _window_offsets(cfg.sliding_window, self.device)[None, :]).clamp_(min=-1)
            # every sampled query of a single-block chunk (a decode step whose position is sampled): offsets
            # 0 … n−1, so t[sampled] is t itself, and no later block of the chunk can reuse what an op returned
            whole = sampled is not None and sampled.numel() == pos.numel() and positions.numel() <= block
            pick = (lambda t: t) if whole else _SampledRows(sampled)
            q_blk = q[blk]
            if self.kind == "swa":
                comp_slots = torch.full((pos.numel(), 0), -1, dtype=torch.int64, device=self.device)
                lanes, length = comp_slots, torch.zeros(pos.numel(), dtype=torch.int64, device=self.device)
            elif self.kind == "hca":
                ids = torch.arange(state.compressor.n_rows, device=self.device)
                length = visible_rows(pos, self.ratio).clamp_max(ids.numel())
                comp_slots = torch.where(ids[None, :] < length[:, None], ids[None, :], -1)
                lanes = ids[None, :].expand(pos.numel(), -1)  # every block, the visible ones first
            elif self.kind == "csa":
                patched_before = ctx.table.patched_calls
                logits = ctx.call("indexer_logits", q=q_idx[blk], weights=idx_weights[blk], positions=pos)
                row_ids, valid = ctx.call("indexer_topk", logits=logits, positions=pos, k=cfg.index_topk)
                if sink.wants("indexer.scores"):
                    sink.emit("indexer.scores", pick(pos), scores=pick(logits))
                # the indexer site at every query of a prefill block whose selection a patch computed (as the
                # attention site below): a tiled kernel wrong in one row of each tile picks wrongly at 1/64 of
                # the queries, off any stride; indexer-site-margin counts a lost pick at any one of them
                every = ctx.phase == "prefill" and ctx.table.patched_calls != patched_before \
                    and ctx.table.patched_beyond_harness("indexer_logits", "indexer_topk")
                if sink.wants("indexer.site") and (every or sampled.numel()):
                    at = (lambda t: t) if every else pick  # noqa: E731
                    site_rows.append((at(pos), at(q_idx[blk]), at(idx_weights[blk]), at(row_ids), at(valid)))
                if sink.wants("indexer.selected"):
                    sink.emit("indexer.selected", pos, row_ids=row_ids, valid=valid)
                comp_slots = torch.where(valid, row_ids, constant(-1, row_ids.dtype, row_ids.device))
                lanes, length = kernel_lanes(row_ids, valid)
            (o, lse), stock_only = ctx.call_noting_patches(
                "sparse_attention", q=q_blk, window_slots=window_slots, comp_slots=comp_slots, sink=sink_logit,
                comp_lanes=lanes, comp_length=length)
            if sink.wants("attn.lse"):
                sink.emit("attn.lse", pos, lse=lse)
            # the site at every query of a prefill block whose attention a patch computed, not only the sampled
            # ones: a tiled kernel wrong in one row of each tile, or at one query, lies off any stride, and its
            # loss is 1/64 of a layer's queries or less — nothing in a mean (attn-site-worst-query holds the worst
            # query). A decode step's query is sampled already; the stock op's blocks need no site (own is stock).
            # Emitted with its block, not joined over the chunk: a whole block is a full call already, and holding
            # it would copy every query's q (8,192 queries × 64 heads × 512 dims × 4 B = 1 GiB per chunk at Flash)
            every = ctx.phase == "prefill" and not stock_only
            if sink.wants("attn.site") and (every or sampled.numel()):
                at = (lambda t: t) if every else pick  # noqa: E731
                self._emit_site(sink, "attn.site", ctx, "sparse_attention", lambda r: {"lse": r[1]}, at(pos),
                                (at(o), at(lse)), stock_only, None if every else attn_sites, q=at(q_blk),
                                window_slots=at(window_slots),
                                comp_slots=at(comp_slots), sink=sink_logit, comp_lanes=at(lanes),
                                comp_length=at(length))
            if sink.wants("attn.probs") and sampled.numel():
                probs_rows.append((pick(pos), pick(q_blk), pick(window_slots), pick(comp_slots)))
            out[blk] = o
        if join_sites and attn_sites:  # the chunk's attention sites: a stock and a twin call per budget of queries,
            # whose window band is the chunk's (the sampled queries lie across it), so sized for that band
            self._emit_held_sites(sink, attn_sites, ctx, query_block_size(
                cfg, self.kind, main_rows, index_rows, self.device, band=positions.numel() + cfg.sliding_window))
        # The indexer site and the attention rows are recomputed per query from the caches, which hold the whole
        # chunk before its first block: once per chunk over every block's sampled queries, not once per block
        # (120 blocks per stack and mode at 30K tokens, each a few dozen small kernels) — and, held, once over a
        # run of decode steps, whose caches only grow (a query masks what lies past its position).
        # A chunk's queries share calls as before (widths a plugin varies between blocks are padded: _in_blocks). Held
        # decode steps share a call only with steps of the same widths and the same number of index rows, whose
        # stock top-k the recomputation then takes over that many rows, as the step did: over more rows (the caches
        # at the end) torch.topk may break ties at the k-th score otherwise.
        held = self._held_sampled
        held.site_rows += [((index_rows, _widths(r)) if hold_sampled else None, r) for r in site_rows]
        held.probs_rows += [(_widths(r) if hold_sampled else None, r) for r in probs_rows]
        held.ctx, held.block, held.sink_logit = ctx, block, sink_logit
        if not hold_sampled:  # the sampled rows now (held sites wait for emit_held_sampled)
            self._emit_sampled_rows(sink, held)

        o = replay(_derotated_outputs, out, cos, sin)
        u = ctx.call("linear", x=o.flatten(-2).unflatten(-1, (cfg.o_groups, -1)), site="attn.wo_a")
        return ctx.call("linear", x=u.flatten(-2), site="attn.wo_b")

    def emit_held_sampled(self, sink: ProbeSink) -> None:
        """Emit the held decode sites (_emit_held_sites), then the held sampled queries' indexer site and attention
        rows, computed from the caches as they are now, in calls of at most `block` queries (the budget the last
        segment's blocks were sized by) over queries that share a key: a held decode step's fields are never padded
        to a width it never had, and its stock top-k runs over the index rows it had."""
        held = self.discard_held_sampled()
        self._emit_held_sites(sink, held.sites, held.ctx, held.block)
        self._emit_sampled_rows(sink, held)

    def _emit_sampled_rows(self, sink: ProbeSink, held: _HeldSampled) -> None:
        """The indexer site and attention rows of the sampled queries in `held`, which then holds none."""
        site_rows, probs_rows, held.site_rows, held.probs_rows = held.site_rows, held.probs_rows, [], []
        for key, rows in _in_runs(site_rows, held.block):
            self._emit_indexer_site(held.ctx, sink, *rows, index_rows=None if key is None else key[0])
        for _, rows in _in_runs(probs_rows, held.block):
            self._emit_probs(held.ctx, sink, *rows, held.sink_logit)

    def _emit_held_sites(self, sink: ProbeSink, sites: list[_HeldSite], ctx: OpContext, block: int) -> None:
        """The held sites — the decode steps', or a prefill chunk's attention sites (_attention's join_sites) — per tap
        and input widths, in calls of at most `block` tokens (the query budget the steps' blocks were sized by, or the
        chunk's for its window band), in the context `ctx` of the last segment (its caches): the steps' inputs joined
        along the tokens, one stock call (unless every step's own result was the stock op's) and one twin call, and
        one emission — instead of one of each per step (on an H200, ~3–4 ms of host time per decode step per stack and
        mode at Flash width). Each row
        is the op on that step's inputs (_emit_site's `hold`), up to the summation order of a differently shaped call
        (fp32 rounding: a GEMM over many rows, a softmax over the union of the steps' key rows with the others
        masked). The stock and twin fields are checked for NaN/Inf with this emission, after the decode steps' other
        taps: a non-finite value in the variant's own fields is found at its step by attn.hc, moe.router or attn.lse,
        which carry the same values."""
        by_call: dict[tuple, list[_HeldSite]] = {}  # steps whose inputs can be joined: one tap, the same widths
        for site in sites:
            by_call.setdefault((site.tap, _widths(tuple(site.per_token.values()))), []).append(site)
        for (tap, _), group in by_call.items():
            for run in _at_most(group, max(block, 1)):
                first = run[0]
                positions = torch.cat([site.positions for site in run])
                inputs = {**first.constants,
                          **{k: torch.cat([site.per_token[k] for site in run]) for k in first.per_token}}
                own = {k: torch.cat([site.own[k] for site in run]) for k in first.own}
                call_ctx = ctx.with_fields(positions=positions)  # the last step's: the caches as they are now
                # a step whose own result was the stock op's among steps whose were not (a patch acting on some
                # steps only) gets the recomputed stock row: the same op on the same inputs, up to the rounding
                stock = own if all(site.own_is_stock for site in run) else \
                    first.fields(self._stock(call_ctx, False).call(first.op, **inputs))
                twin = first.fields(self._stock(call_ctx, True).call(first.op, **inputs))
                sink.emit(tap, positions, **own, **{"stock_" + k: v for k, v in stock.items()},
                          **{"twin_" + k: v for k, v in twin.items()})

    def discard_held_sampled(self) -> _HeldSampled:
        """What is held, no longer held (run_layer starts from nothing: a run stopped by an error leaves no rows)."""
        held, self._held_sampled, self._held_experts = self._held_sampled, _HeldSampled(), []
        return held

    def _emit_indexer_site(self, ctx: OpContext, sink: ProbeSink, pos: torch.Tensor, q: torch.Tensor,
                           weights: torch.Tensor, row_ids: torch.Tensor, valid: torch.Tensor,
                           index_rows: int | None = None) -> None:
        """The indexer's selection at sampled queries (every query of a prefill block whose selection a patch
        computed: _attention), and the stock logits + top-k's (and its twin's) on the same queries, weights and
        keys: the fp32 weighted head-sum is a site the official model keeps in fp32. Also, per stock pick, its
        stock score's margin over the k-th pick's, and per query the largest change the twin's re-association
        made to any visible score: a lost pick whose margin is many times that is no tie.
        `index_rows`: the number of index rows the queries' step had (the cache may hold more now); None: all."""
        # the rows each query may see, from its position alone (not from what any indexer op says): a valid pick
        # past them is a row the query must not attend (harness.run.metrics.compare_indexer_site)
        values = {"row_ids": row_ids, "valid": valid, "visible": visible_rows(pos, ctx.state.ratio)}
        logits = {}
        for prefix, twin in (("stock_", False), ("twin_", True)):
            stock = self._stock(ctx, twin)
            logits[prefix] = stock.call("indexer_logits", q=q, weights=weights, positions=pos)[:, :index_rows]
            ids, ok = stock.call("indexer_topk", logits=logits[prefix], positions=pos, k=self.cfg.index_topk)
            values.update({prefix + "row_ids": ids, prefix + "valid": ok})
        ok, stock = values["stock_valid"], logits["stock_"]
        if stock.shape[1] == 0:  # no index row yet (positions before the first complete window): nothing picked
            values["stock_margin"] = torch.zeros(ok.shape, device=ok.device)
            values["twin_noise"] = torch.zeros(ok.shape[0], device=ok.device)
        else:
            picked = stock.gather(1, values["stock_row_ids"].long())
            inf, zero = constant(float("inf"), picked.dtype, ok.device), constant(0.0, picked.dtype, ok.device)
            kth = torch.where(ok, picked, inf).amin(1, keepdim=True)
            visible = torch.isfinite(stock) & torch.isfinite(logits["twin_"])
            values["stock_margin"] = torch.where(ok, picked - kth, zero)
            # at least one fp32 ulp (2^-23 relative) of the query's largest score: a twin whose split happens to
            # sum every score the same way (4 heads as 2 + 2) shows no noise, and a tie is still a tie
            ulp = torch.where(visible, stock.abs(), zero).amax(1) * 2.0**-23
            values["twin_noise"] = torch.maximum(
                torch.where(visible, (logits["twin_"] - stock).abs(), zero).amax(1), ulp)
        sink.emit("indexer.site", pos, **values)

    def _emit_probs(self, ctx: OpContext, sink: ProbeSink, pos: torch.Tensor, q: torch.Tensor,
                    window_slots: torch.Tensor, comp_slots: torch.Tensor, sink_logit: torch.Tensor) -> None:
        """Attention probabilities recomputed in fp32 from the q and cache rows the kernel used (DESIGN §3)."""
        comp_keys = ctx.call("kv_load", cache="compressed", slots=comp_slots) if comp_slots.shape[-1] \
            else q.new_zeros(q.shape[0], 0, q.shape[-1])
        res = sparse_attention_with_sink(q, [KeySet(ctx.call("kv_load", cache="window", slots=window_slots),
                                                   window_slots >= 0), KeySet(comp_keys, comp_slots >= 0)], sink_logit)
        sink.emit("attn.probs", pos, window_pos=window_slots, comp_rows=comp_slots, probs=res.probs,
                  sink_prob=res.sink_prob, max_logit=res.max_logit)

    @staticmethod
    def _emit_rows(sink: ProbeSink, tap: str, rows: torch.Tensor, state: CompressorState) -> None:
        if sink.wants(tap) and rows.shape[0]:  # no row completed: nothing to emit
            ids = torch.arange(state.n_rows - rows.shape[0], state.n_rows, device=rows.device)
            sink.emit(tap, ids * state.ratio, rows=rows, row_ids=ids)

    # ------------------------------------------------------------------------------------------
    def _moe(self, ctx: OpContext, y: torch.Tensor, token_ids: torch.Tensor, sink: ProbeSink,
             held: list[_HeldSite] | None) -> torch.Tensor:
        routing, stock_only = ctx.call_noting_patches("router", y=y, token_ids=token_ids)
        if sink.wants("moe.router"):
            sink.emit("moe.router", ctx.positions, scores=routing.scores, expert_ids=routing.expert_ids,
                      weights=_scaled(routing.weights, routing.output_scale))
        self._emit_site(sink, "moe.router.site", ctx, "router",
                        lambda r: _routing_fields(r, self.cfg.n_shared_experts > 0), ctx.positions, routing,
                        stock_only, held, y=y, token_ids=token_ids)
        total = self._experts_site(ctx, sink, "moe.experts.site", "experts", y=y, routing=routing)
        if self.cfg.n_shared_experts:
            total = total + self._experts_site(ctx, sink, "moe.shared.site", "shared_expert", y=y, routing=routing)
        return bf16(_scaled(total, routing.output_scale))

    def _experts_site(self, ctx: OpContext, sink: ProbeSink, tap: str, op: str, **inputs: Any) -> torch.Tensor:
        """`op` (experts or shared_expert), and its site `tap`, against the stock op on the same inputs: per token,
        `lost` (pair_sites: a pair's contribution lost, repeated or misweighted), `biased` (expert_site_bias: the
        token's expert scaled at most of its pairs) and `miss` (clamp_site_miss: the
        unclamped side of the SwiGLU clamp's decision), with `clamp_judged` (0 where too few tokens give the variant's
        own error to judge the clamp). No patch ran: 0 by construction (the stock op on the same inputs), not
        computed. A decode step's result is held and judged with the layer's other steps (emit_held_experts)."""
        out, stock_only = ctx.call_noting_patches(op, **inputs)
        if sink.wants(tap):
            if stock_only:
                zeros = torch.zeros(ctx.positions.shape[0], device=ctx.positions.device)
                sink.emit(tap, ctx.positions, lost=zeros, biased=zeros, miss=zeros, clamp_judged=zeros + 1)
            elif ctx.phase == "decode":
                self._held_experts.append(_HeldExperts.kept(tap, op, ctx, out, inputs["y"], inputs["routing"]))
            else:
                self._judge_experts(sink, tap, op, ctx, ctx.positions, out, **inputs)
        return out

    def _judge_experts(self, sink: ProbeSink, tap: str, op: str, ctx: OpContext, positions: torch.Tensor,
                       out: torch.Tensor, **inputs: Any) -> None:
        """Emit `tap`: pair_sites and expert_site_bias of the variant's `out` against the stock op's pairs on `inputs`
        in `ctx`, and clamp_site_miss against the stock op with and without the clamp (0 without a clamp: swiglu_limit
        ≤ 0, which the official code skips; clamp_judged 0 where too few tokens can give the variant's own error)."""
        stock_ctx = self._stock(ctx, False)
        clamped = self.cfg.swiglu_limit > 0
        # the stock op with the clamp and, where there is one, without it: one call sharing the gate and up GEMMs
        # (each side the bits of its own stock call)
        limits = (self.cfg.swiglu_limit, 0.0) if clamped else (self.cfg.swiglu_limit,)
        unclamped = None
        if op == "experts":  # the stock experts are the sum of these, bit for bit (base_ops.experts; asserted below)
            pairs, *rest = base_ops.expert_pairs_at_limits(stock_ctx, limits=limits, **inputs)
            stock = pairs.sum(1)
            if rest:
                unclamped = rest.pop().sum(1)  # its [S, k, D] pairs freed here
            expert_ids, n_experts = inputs["routing"].expert_ids, self.cfg.n_routed_experts
        else:  # the shared expert: one pair, one expert
            stock, *rest = base_ops.shared_expert_at_limits(stock_ctx, limits=limits, **inputs)
            unclamped = rest[0] if rest else None
            pairs = stock.unsqueeze(1)
            expert_ids, n_experts = torch.zeros(stock.shape[0], 1, dtype=torch.long, device=stock.device), 1
        lost, coefficients = pair_sites(out, stock, pairs)
        biased = expert_site_bias(coefficients, expert_ids, n_experts)
        del pairs  # [S, k, D]
        miss = clamp_site_miss(out, stock, unclamped) if unclamped is not None else None
        judged = torch.full_like(lost, float(miss is not None or not clamped))
        sink.emit(tap, positions, lost=lost, biased=biased, miss=torch.zeros_like(lost) if miss is None else miss,
                  clamp_judged=judged)

    def emit_held_experts(self, sink: ProbeSink) -> None:
        """The decode steps' experts sites, judged together (one token a step cannot give the variant's own error that
        the clamp's judgement needs): per tap and routing width (_HeldExperts.key), the steps' inputs joined along the
        tokens (the routing's rows; its scales are one per layer), one stock call with and without the clamp (the
        gate and up products shared: base_ops.expert_pairs_at_limits) in the last step's context, against the steps'
        own results. Each stock row is the op on that step's input up to the rounding of a differently shaped call,
        which both judgements' margins hold."""
        held, self._held_experts = self._held_experts, []
        for key in dict.fromkeys(h.key for h in held):
            steps = [h for h in held if h.key == key]
            last = steps[-1]
            routing = Routing(*(torch.cat([getattr(h.routing, f) for h in steps])
                                for f in ("scores", "expert_ids", "weights")),
                              last.routing.output_scale, last.routing.shared_weight)
            self._judge_experts(sink, last.tap, last.op, last.ctx, torch.cat([h.ctx.positions for h in steps]),
                              torch.cat([h.out for h in steps]), y=torch.cat([h.y for h in steps]), routing=routing)


# _judge_experts reads the stock experts and shared expert through base_ops' *_at_limits, which these are the
# one-limit case of
assert BASE_OPS["experts"] is base_ops.experts and BASE_OPS["shared_expert"] is base_ops.shared_expert


class OptimizedModel:
    """Embedding (bf16), the blocks of the optimized engine run layer-major, fp32 LM head."""

    def __init__(self, source: WeightSource, choices: Sequence[PatchChoice] = (), device: torch.device | str = "cpu",
                 options: EngineOptions = EngineOptions(), top_dense: DenseCache | None = None) -> None:
        """`top_dense`: the fp32 head weights, shared with other engines of the same run (a new cache when None)."""
        self.source, self.cfg, self.choices = source, source.config, list(choices)
        self.device, self.options = torch.device(device), options
        self._top: TensorBundle | None = None
        self._top_dense = top_dense if top_dense is not None else DenseCache()

    @property
    def top(self) -> TensorBundle:
        if self._top is None:
            self._top = self.source.top_level(self.device)
        return self._top

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        e = self.source.embed_rows(token_ids, self.device).to(torch.bfloat16)
        return e[:, None, :].expand(-1, self.cfg.hc_mult, -1).contiguous()

    def layer(self, layer: int, weights: TensorBundle | None = None, dense: DenseCache | None = None
              ) -> OptimizedLayer:
        return OptimizedLayer(self.cfg, layer, weights or self.source.layer(layer, self.device), self.choices,
                              self.device, self.options, dense)

    def run_layer(self, block: OptimizedLayer, streams: torch.Tensor, token_ids: torch.Tensor,
                  segments: Sequence[int], n_prompt: int, sink: ProbeSink = NULL_SINK, state: EngineState | None = None,
                  at_decode: Callable[[EngineState], None] | None = None, hold_sites: bool = False) -> torch.Tensor:
        """Prefill chunks (positions < n_prompt) then decode steps, from a fresh state — or from `state`, another
        run's state after the segments before its position (a variant whose patches act in decode only continues
        from a copy of a variant's state after the same prefill: harness.run.prefill_sharing); those segments are
        skipped and the output holds the positions from state.position on. `at_decode(state)` is called before the
        first decode step. `hold_sites`: the decode steps' sites are computed once over all the steps, and each
        prefill chunk's attention sites once over its blocks (OptimizedLayer.forward's hold_sites, join_sites)."""
        state = state if state is not None else block.new_state(int(streams.shape[0]))
        block.discard_held_sampled()
        outs, start, counts = [], 0, {"prefill": 0, "decode": 0}
        for n in segments:
            phase = "prefill" if start < n_prompt else "decode"
            if start >= state.position:
                if phase == "decode" and counts["decode"] == 0 and at_decode is not None:
                    at_decode(state)
                outs.append(block.forward(streams[start : start + n], token_ids[start : start + n], state, phase,
                                          counts[phase], sink,
                                          hold_sampled=phase == "decode" and block.holds_decode_samples,
                                          hold_sites=hold_sites and phase == "decode",
                                          join_sites=hold_sites and phase == "prefill"))
            counts[phase] += 1
            start += n
        block.emit_held_experts(sink)  # the decode steps' experts sites, judged together
        block.emit_held_sampled(sink)  # the decode steps' sampled queries, over every step at once (if held)
        return torch.cat(outs, 0)

    def logits(self, streams: torch.Tensor) -> torch.Tensor:
        """HC head and final norm in fp32 from the bf16 streams, bf16 normed hidden, fp32 LM head."""
        cfg = self.cfg

        def w(name: str) -> torch.Tensor:  # fp32 once per model: the needle lens reads logits after every layer
            return self._top_dense.get(name, lambda: self.top.stored(name), self.device)

        h = hc_head(streams.float(), w("hc_head_fn"), w("hc_head_base"), w("hc_head_scale"), cfg.rms_norm_eps,
                    cfg.hc_eps)
        h = rms_norm_bf16(h, w("norm.weight"), cfg.rms_norm_eps)
        return h @ w("head.weight").T

    def forward(self, prompt_ids: Sequence[int], decode_ids: Sequence[int] = (),
                chunk_size: int | None = DEFAULT_CHUNK_SIZE, keep_layer_outputs: bool = False,
                progress: Callable[[int, int], None] | None = None, compute_logits: bool = True) -> ForwardResult:
        ids = torch.tensor(list(prompt_ids) + list(decode_ids), dtype=torch.int64, device=self.device)
        segments = segment_lengths(len(prompt_ids), len(decode_ids), chunk_size)
        streams = self.embed(ids)
        kept = []
        for layer in range(self.cfg.num_hidden_layers):
            streams = self.run_layer(self.layer(layer), streams, ids, segments, len(prompt_ids))
            if keep_layer_outputs:
                kept.append(streams.float().cpu())
            if progress:
                progress(layer + 1, self.cfg.num_hidden_layers)
        return ForwardResult(self.logits(streams) if compute_logits else None, kept, streams)
