"""Drift metrics: plain functions of (reference tap, variant tap), chosen by tap name (DESIGN §4).

Each comparator returns per-position values of its canonical metrics. A metric is either a *mean*
metric (a bin's value is the mean of its positions' values) or a *ratio* metric (a bin's value is
computed from summed numerators and denominators, e.g. rel_l2 = sqrt(Σ‖a−b‖² / Σ‖b‖²), so bins
combine exactly). All arithmetic is fp64: dense taps and the sampled attention rows and indexer scores are compared
on the device that holds them (one fp64 pass on a GPU instead of a copy to the host and a pass on the CPU per batch;
on a CPU both are the same), discrete taps (selections, routing) on the CPU.

Canonical names (README, metrics glossary): streams.{rel_l2,cosine,sqnr_db,max_abs,bias},
attn.{tv,kl,js,out_rel_l2,lse_delta,max_logit_delta}, indexer.{recall,mass_recall,boundary_recall,fp8_boundary_recall,fp8_window_share,flips},
mhc.{pre_rel_err,post_rel_err,comb_rel_err,ds_residual}, moe.{flip_rate,weight_l1,out_rel_l2},
the fp32 decision sites mhc.{site_rel_err,twin_rel_err,site_ds_residual,post_site_excess},
moe.{site_flip_rate,twin_flip_rate,site_weight_err,twin_weight_err}, indexer.{site_recall,twin_recall,site_margin_loss,site_future},
attn.{site_lse_err,twin_lse_err,kv_site_mismatch}, moe.{clamp_site_miss,pair_site_loss,expert_site_bias},
logits.{kl,top1_agree,top1_flip_strict}, ctx.{earlier_turn_mass_ref,earlier_turn_mass_opt,needle_mass_ref,
needle_mass_opt,earlier_turn_recall,needle_recall,earlier_turn_pick_share,needle_pick_share}, compressor.rows_rel_l2,
indexer.rows_rel_l2; the needle answers (ctx.needle_answer, …) come from harness.run.needles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from harness.run.stream_sums import flat32_pair, stream_sums

KL_FLOOR = 1e-12
"""Probability floor in KL(ref‖opt): a key the variant never attended (another indexer pick) would make
KL infinite; flooring at 1e-12 caps one such key's contribution at p·27.6 nats."""

BOUNDARY_REL = 2.0**-7
"""boundary_recall ignores reference picks within one bf16 ulp (2^-7 relative) of the k-th score:
such a pick can flip under any bf16 rounding of the scores and is a tie, not drift (DESIGN §4, §10)."""

FP8_SCORE_REL = 2.0**-3
"""fp8_boundary_recall ignores reference picks within one e4m3 ulp (3 mantissa bits: 2^-3 relative) of the k-th
score: the stock indexer scores FP8 queries against FP8 keys (spec §5.3, optimized-stack O2), so such a pick may
flip under any FP8 indexer. (A window from this layer's FP8 rounding alone, reference.ops.indexer.fp8_score_noise
at FP8_NOISE_MULTIPLE σ, was tried in the fifth session: it passes the stock engine at Flash width where this one
fails it, but fails it in the CPU demo's global decode, where drift through FP8 layers moves scores relative to
themselves; not wired in until both are reconciled — closing note.)"""

FP8_NOISE_MULTIPLE = 4.0
"""The withdrawn σ window's width (FP8_SCORE_REL says why it is not in use; tests/test_metrics.py still checks
fp8_score_noise against it): its window in standard deviations of the FP8 score error on each side of a (pick, rival)
pair: c·(σ_r + σ_j) ≥ c·sqrt(σ_r² + σ_j²), the pair difference's σ, so a reorder by rounding alone lies beyond it
with probability < 3.2e-5 (Gaussian tail at 4σ; the error sums 64 × 128 roundings) — and σ is itself an upper
estimate (ulp ≤ 2^-3·|x|): on random data the measured error is 0.71 σ (tests/test_metrics.py)."""

BF16_ULP_REL = 2.0**-7
"""logits.top1_flip_strict counts a top-1 disagreement only when the reference's top-2 gap exceeds one bf16
ulp of the top logit (2^-7 relative): smaller gaps are near-ties any bf16 stack may break either way."""

def combine_rel_l2(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """sqrt(Σ‖a−b‖² / Σ‖b‖²); 0/0 = 0 (both zero), x/0 = inf."""
    safe = torch.where(den > 0, num / den.clamp_min(1e-300), torch.where(num > 0, math.inf, 0.0))
    return safe.sqrt()


def combine_sqnr_db(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """10·log10(Σ‖b‖² / Σ‖a−b‖²) in dB; an exact match is +inf."""
    return torch.where(num > 0, 10 * torch.log10(den.clamp_min(1e-300) / num.clamp_min(1e-300)), math.inf)


RATIO_COMBINE: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "rel_l2": combine_rel_l2,
    "sqnr_db": combine_sqnr_db,
}


@dataclass
class MetricValues:
    metric: str
    positions: torch.Tensor  # [B] int64
    value: torch.Tensor  # [B] float64 per-position value
    num: torch.Tensor | None = None  # ratio metrics: per-position numerator and denominator
    den: torch.Tensor | None = None
    combine: str | None = None  # key of RATIO_COMBINE for ratio metrics
    keep: torch.Tensor | None = None
    """[B] bool: the positions that have a value (the others are dropped when the layer's rows are made:
    harness.run.aggregate), None for all. Cutting them on a GPU (`pos[keep]`, or asking `keep.any()` first) would wait
    for the device to count them: a host read per comparison."""

    def cut(self) -> "MetricValues":
        """These values with the masked positions dropped (keep None): what the layer's rows are made of. A reader's
        view, for tests and tools; on a GPU it reads the mask's count from the device."""
        if self.keep is None:
            return self
        k = self.keep.to(self.value.device)
        return MetricValues(self.metric, self.positions[k.to(self.positions.device)], self.value[k],
                            None if self.num is None else self.num[k], None if self.den is None else self.den[k],
                            self.combine)


def kept(metric: str, pos: torch.Tensor, value: torch.Tensor, keep: torch.Tensor) -> MetricValues:
    """The values of the positions where `keep` holds (MetricValues.keep): the same rows as
    MetricValues(metric, pos[keep], value[keep]), with no host read."""
    return MetricValues(metric, pos, value, keep=keep)


@dataclass
class CompareContext:
    """What comparators need beyond the two taps."""

    layer_kind: str
    ratio: int  # compress ratio m (0 for SWA)
    window: int
    turn_of_position: torch.Tensor  # [T] turn index per position
    turn_start: torch.Tensor  # [T] first position of the turn that position belongs to
    needle_spans: list[tuple[int, int]]  # token spans [start, end)
    # caches, not fields: `dataclasses.replace` must not hand them to a context of another layer kind or ratio
    _turn_start_on: dict[torch.device, torch.Tensor] = field(default_factory=dict, init=False, repr=False,
                                                             compare=False)
    _needle_rows_on: dict[torch.device, torch.Tensor] = field(default_factory=dict, init=False, repr=False,
                                                              compare=False)

    def turn_start_on(self, device: torch.device) -> torch.Tensor:
        """turn_start on `device`, copied there once (a comparison on a GPU would otherwise copy it every call)."""
        on = self._turn_start_on.get(device)
        if on is None:
            on = self._turn_start_on[device] = self.turn_start.to(device)
        return on

    def row_bound(self) -> int:
        """A bound above every compressed row id of the sequence (a compressed layer's: ratio > 0): a row is complete
        once its m tokens are, so ids stay below ⌊T/m⌋ (T = the prompt and decode positions); this is ⌊T/m⌋ + 1.
        Sizes per-row tables without reading an id back from the device."""
        return self.turn_start.numel() // self.ratio + 1

    def needle_rows_on(self, device: torch.device) -> torch.Tensor:
        """[row_bound() + 1] bool on `device`, made once: whether the row's token span (row_span) touches a needle;
        the last entry, False, is what an id at or past the bound reads (clamped there), as a row past the sequence
        touches no needle."""
        on = self._needle_rows_on.get(device)
        if on is None:
            on = torch.zeros(self.row_bound() + 1, dtype=torch.bool, device=device)
            on[:-1] = touches_needle(self, *row_span(self, torch.arange(self.row_bound(), device=device)))
            self._needle_rows_on[device] = on
        return on


def _f64(x: torch.Tensor) -> torch.Tensor:
    """fp64 on the tensor's own device (large dense taps are compared where they live)."""
    return x.detach().to(torch.float64)


def _rel(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per-row ‖a−b‖/‖b‖ over all but the first dim."""
    err = (a - b).flatten(1).norm(dim=1)
    ref = b.flatten(1).norm(dim=1)
    return torch.where(ref > 0, err / ref, torch.where(err > 0, torch.full_like(err, math.inf), torch.zeros_like(err)))


def ratio_metric(name: str, positions: torch.Tensor, a: torch.Tensor, b: torch.Tensor, combine: str) -> MetricValues:
    """A ratio metric of Σ(a−b)² and Σb² per row (a: variant, b: reference, any float dtype)."""
    _, bf, diff = flat32_pair(a, b)
    err2, ref2 = diff.pow(2).sum(1, dtype=torch.float64), bf.pow(2).sum(1, dtype=torch.float64)
    return MetricValues(name, positions, RATIO_COMBINE[combine](err2, ref2), err2, ref2, combine)


# ---------------------------------------------------------------------------------------------
# comparators: (positions, ref tensors, variant tensors, ctx) -> list[MetricValues]
# ---------------------------------------------------------------------------------------------


def compare_streams(pos, ref, var, ctx) -> list[MetricValues]:
    """layer.out: the residual streams [B, n, D]."""
    s = stream_sums(var["streams"], ref["streams"])
    cos = s.dot / (s.var2 * s.ref2).sqrt().clamp_min(1e-300)
    n = var["streams"].flatten(1).shape[1]
    return [
        MetricValues("streams.rel_l2", pos, combine_rel_l2(s.err2, s.ref2), s.err2, s.ref2, "rel_l2"),
        MetricValues("streams.sqnr_db", pos, combine_sqnr_db(s.err2, s.ref2), s.err2, s.ref2, "sqnr_db"),
        MetricValues("streams.cosine", pos, cos),
        MetricValues("streams.max_abs", pos, s.max_abs.double()),
        MetricValues("streams.bias", pos, s.diff_sum / n),
    ]


def compare_output(prefix: str) -> Callable:
    def compare(pos, ref, var, ctx) -> list[MetricValues]:
        return [ratio_metric(f"{prefix}.out_rel_l2", pos, var["out"], ref["out"], "rel_l2")]

    return compare


def ds_residual(comb: torch.Tensor) -> torch.Tensor:
    """max |row or column sum − 1| of each token's Sinkhorn matrix [B, n, n]."""
    return torch.maximum((comb.sum(-1) - 1).abs().amax(-1), (comb.sum(-2) - 1).abs().amax(-1))


def compare_hc(pos, ref, var, ctx) -> list[MetricValues]:
    """attn.hc / ffn.hc: relative errors of pre, post, comb; the variant's doubly-stochastic residual beyond the
    reference's own (20 Sinkhorn iterations leave a convergence residual that depends on the matrix — the
    fp32 reference has it too — so only the excess is the variant's doing)."""
    comb = _f64(var["comb"])
    ds = (ds_residual(comb) - ds_residual(_f64(ref["comb"]))).clamp_min(0)
    return [
        MetricValues("mhc.pre_rel_err", pos, _rel(_f64(var["pre"]), _f64(ref["pre"]))),
        MetricValues("mhc.post_rel_err", pos, _rel(_f64(var["post"]), _f64(ref["post"]))),
        MetricValues("mhc.comb_rel_err", pos, _rel(comb, _f64(ref["comb"]))),
        MetricValues("mhc.ds_residual", pos, ds),
    ]


def compare_lse(pos, ref, var, ctx) -> list[MetricValues]:
    """attn.lse: |LSE_opt − LSE_ref| (sink included), mean over heads."""
    return [MetricValues("attn.lse_delta", pos, (_f64(var["lse"]) - _f64(ref["lse"])).abs().mean(-1))]


def compare_router(pos, ref, var, ctx) -> list[MetricValues]:
    """moe.router: expert-set flip rate 1 − |E_opt ∩ E_ref|/k and routing-weight L1 over the union of experts.
    Computed where the reference's ids are (the same operations on the CPU as ever; on a GPU no copy to the host:
    a Flash prefill chunk's [8192, 256] fp64 matrices took ~50 ms on the host, with four synchronising copies)."""
    dev = ref["expert_ids"].device
    ids_r, ids_v, pos = ref["expert_ids"].long(), var["expert_ids"].long().to(dev), pos.to(dev)
    n_exp = _max_id(ids_r, ids_v) + 1
    dense_r = torch.zeros(ids_r.shape[0], n_exp, dtype=torch.float64, device=dev).scatter_add_(
        1, ids_r, _f64(ref["weights"]))
    dense_v = torch.zeros(ids_v.shape[0], n_exp, dtype=torch.float64, device=dev).scatter_add_(
        1, ids_v, _f64(var["weights"]).to(dev))
    member_r = torch.zeros(ids_r.shape[0], n_exp, dtype=torch.bool, device=dev).scatter_(1, ids_r, True)
    member_v = torch.zeros(ids_v.shape[0], n_exp, dtype=torch.bool, device=dev).scatter_(1, ids_v, True)
    overlap = (member_r & member_v).sum(1).double()
    # k as a tensor: CUDA divides by a Python scalar as a product with its rounded reciprocal (5 · fl(1/6) ≠ 5/6
    # by an ulp, seen on an H200), a tensor divisor is a correctly rounded division, as on the CPU
    k = overlap.new_full((), float(ids_r.shape[1]))
    return [
        MetricValues("moe.flip_rate", pos, 1 - overlap / k),
        MetricValues("moe.weight_l1", pos, (dense_v - dense_r).abs().sum(1)),
    ]


# ---------------------------------------------------------------------------------------------
# fp32 decision sites: the variant's op against the stock op on the same inputs, and the stock op's benign twin
# (fp32 sums re-associated) against the stock op — no reference involved (optimized/engine.py, _emit_site)
# ---------------------------------------------------------------------------------------------


def _set_overlap(ids_a: torch.Tensor, ids_b: torch.Tensor, valid_a: torch.Tensor | None = None,
                 valid_b: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(|A ∩ B|, |B|) per row for id sets [n, k] (optional validity masks), on B's device (exact integer work)."""
    ids_a, ids_b = ids_a.long().to(ids_b.device), ids_b.long()
    valid_a = torch.ones_like(ids_a, dtype=torch.bool) if valid_a is None else valid_a.to(ids_b.device)
    valid_b = torch.ones_like(ids_b, dtype=torch.bool) if valid_b is None else valid_b
    hit = _picked_in(ids_b, valid_b, ids_a, valid_a)
    return hit.sum(1).double(), valid_b.sum(1).double()


def _weights_by_expert(ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[S, k] ids and [S, k] or [S, k + 1] effective weights (the last: the shared expert's, when the model has one)
    with the routed weights in ascending expert order, so two routings of the same expert set line up whatever
    their slot order."""
    k = ids.shape[1]
    order = torch.argsort(ids.long(), dim=1)
    w = weights.detach().double()
    return torch.cat([w[:, :k].gather(1, order), w[:, k:]], 1)


def compare_router_site(pos, ref, var, ctx) -> list[MetricValues]:
    """moe.router.site: expert-set flips of the variant's router against the stock router on the same input y
    (what the router itself changed), and of the stock router's twin (fp32 re-association alone); and, at tokens
    whose expert set both keep, the relative L1 error of the weights each expert (and the shared expert) gets in
    the MoE output — fp32 in the official Gate (moe.site_weight_err, the twin's moe.twin_weight_err)."""
    var = {name: v.cpu() for name, v in var.items()}  # a few ids and weights per token: compared on the host
    k = var["expert_ids"].shape[1]
    site, _ = _set_overlap(var["expert_ids"], var["stock_expert_ids"])
    twin, _ = _set_overlap(var["twin_expert_ids"], var["stock_expert_ids"])
    stock = _weights_by_expert(var["stock_expert_ids"], var["stock_weights"])
    out = [MetricValues("moe.site_flip_rate", pos, 1 - site / k), MetricValues("moe.twin_flip_rate", pos, 1 - twin / k)]
    for name, prefix, same in (("moe.site_weight_err", "", site == k), ("moe.twin_weight_err", "twin_", twin == k)):
        w = _weights_by_expert(var[prefix + "expert_ids"], var[prefix + "weights"])
        err = (w - stock).abs().sum(1) / stock.abs().sum(1).clamp_min(torch.finfo(torch.float64).tiny)
        out.append(kept(name, pos, err, same))
    return out


def compare_hc_site(pos, ref, var, ctx) -> list[MetricValues]:
    """attn.hc.site / ffn.hc.site: relative error of the variant's (pre, post, comb) against the stock hc_pre's
    on the same streams — the mHC pre-linear, sigmoids and Sinkhorn, an fp32 site — and the twin's; and how much
    less doubly stochastic the variant's comb is than the stock Sinkhorn's on the same input (20 iterations
    leave a residual that depends on the matrix, so only the same input makes the two comparable)."""
    def joined(prefix: str) -> torch.Tensor:
        return torch.cat([_f64(var[prefix + f]).flatten(1) for f in ("pre", "post", "comb")], 1)

    stock = joined("stock_")
    excess = (ds_residual(_f64(var["comb"])) - ds_residual(_f64(var["stock_comb"]))).clamp_min(0)
    return [MetricValues("mhc.site_rel_err", pos, _rel(joined(""), stock)),
            MetricValues("mhc.twin_rel_err", pos, _rel(joined("twin_"), stock)),
            MetricValues("mhc.site_ds_residual", pos, excess)]


TIE_NOISE_MULTIPLE = 16
"""A stock pick whose score leads the k-th pick's by more than this many times the largest change the twin's fp32
re-association made to any of the query's scores is no tie: no re-ordering of the same fp32 sums loses it (the
changes of two orders are two draws of the same noise, and 16× its maximum is far past their spread)."""


def compare_indexer_site(pos, ref, var, ctx) -> list[MetricValues]:
    """indexer.site at sampled queries: recall of the stock indexer's top-k (logits and top-k on the same queries,
    weights and keys) in the variant's selection, and in the twin's; and the share of the stock picks the variant
    lost although they were no tie (indexer.site_margin_loss: their score led the k-th by more than
    TIE_NOISE_MULTIPLE × the twin's largest score change) — a selection that drops rows it should keep (a stale
    page table, a mask off by one), not one that breaks ties another way."""
    stock_ids, stock_valid = var["stock_row_ids"].long(), var["stock_valid"]
    pos = pos.to(stock_ids.device)  # counted where the picks are (exact integer work: the same on any device)
    retained = _picked_in(stock_ids, stock_valid, var["row_ids"].long(), var["valid"])
    site, n = retained.sum(1).double(), stock_valid.sum(1).double()
    twin, _ = _set_overlap(var["twin_row_ids"], stock_ids, var["twin_valid"], stock_valid)
    clear = var["stock_margin"].double() > TIE_NOISE_MULTIPLE * var["twin_noise"].double()[:, None]
    hard = (stock_valid & ~retained & clear).sum(1).double()
    keep = n > 0
    picked, future = _future_picks(var)
    some = picked > 0  # a query before the first complete row may still pick one: a future row, counted
    return [kept("indexer.site_recall", pos, site / n.clamp_min(1), keep),
            kept("indexer.twin_recall", pos, twin / n.clamp_min(1), keep),
            kept("indexer.site_margin_loss", pos, hard / n.clamp_min(1), keep),
            kept("indexer.site_future", pos, future / picked.clamp_min(1), some)]


def _future_picks(var: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query, the variant's valid picks and those of rows it may not see yet (a row is visible once its window
    of `compress_ratio` tokens ends at or before the query: compressor.visible_rows, from the position alone). Any
    such pick is a causality violation whatever the arithmetic — a mask or a length off by one row, a page table
    pointing past the query — and none is a tie another rounding could break."""
    ids, valid = var["row_ids"].long(), var["valid"]
    future = valid & (ids >= var["visible"].to(ids.device).long()[:, None])
    return valid.sum(1).double(), future.sum(1).double()


def compare_attn_site(pos, ref, var, ctx) -> list[MetricValues]:
    """attn.site at sampled queries: the variant's attention LSE against the stock sparse_attention's on the same
    q, key slots, caches and sinks (mean |Δ| over heads, nats), and the twin's (q·k summed in two halves of d). The
    LSE is the log of the softmax denominator with the sink: a kernel that attends a key it was not given, drops
    one it was, applies the sink per split or scales the logits wrongly moves it by the mass involved; re-ordering
    the same fp32 sums moves it by rounding."""
    stock = _f64(var["stock_lse"])
    return [MetricValues("attn.site_lse_err", pos, (_f64(var["lse"]) - stock).abs().mean(-1)),
            MetricValues("attn.twin_lse_err", pos, (_f64(var["twin_lse"]) - stock).abs().mean(-1))]


def compare_post_site(pos, ref, var, ctx) -> list[MetricValues]:
    """attn.hc.post.site / ffn.hc.post.site: per token, the share of hc_post's outputs that the variant puts further
    from the stock hc_post's on the same f, streams and mixes than two fp32 implementations of it can differ, with
    the bf16 store (optimized.engine.post_site_excess: computed where the tensors are, a share per token here)."""
    return [MetricValues("mhc.post_site_excess", pos, _f64(var["excess"]))]


def compare_kv_site(pos, ref, var, ctx) -> list[MetricValues]:
    """attn.kv.site: per cache row written, 1 when reading its slot back through the variant's kv_load does not give
    the row's stored form (optimized.engine.OptimizedLayer._kv_store)."""
    return [MetricValues("attn.kv_site_mismatch", pos, _f64(var["mismatch"]))]


def compare_experts_site(pos, ref, var, ctx) -> list[MetricValues]:
    """moe.experts.site / moe.shared.site, per token: `moe.pair_site_loss`, 1 where the variant's experts (or shared
    expert) output lacks, repeats or misweighs a whole pair's contribution of the stock op on the same input
    (optimized.engine.pair_sites), and `moe.clamp_site_miss`, 1 where it took the other side of the SwiGLU
    clamp's decision (optimized.engine.clamp_site_miss) — at the tokens whose call could judge the clamp only (both
    computed where the tensors are); and `moe.expert_site_bias`, 1 where the token is routed to an expert whose
    output the variant scales at most of the call's pairs of that expert (optimized.engine.expert_site_bias)."""
    return [MetricValues("moe.pair_site_loss", pos, _f64(var["lost"])),
            MetricValues("moe.expert_site_bias", pos, _f64(var["biased"])),
            kept("moe.clamp_site_miss", pos, _f64(var["miss"]), var["clamp_judged"] > 0)]


SITE_COMPARATORS: dict[str, Callable] = {
    "attn.site": compare_attn_site,
    "attn.kv.site": compare_kv_site,
    "attn.hc.post.site": compare_post_site,
    "ffn.hc.post.site": compare_post_site,
    "moe.router.site": compare_router_site,
    "moe.experts.site": compare_experts_site,
    "moe.shared.site": compare_experts_site,
    "attn.hc.site": compare_hc_site,
    "ffn.hc.site": compare_hc_site,
    "indexer.site": compare_indexer_site,
}
"""Site taps: compared within the variant's own emission (no reference record)."""


def compare_rows(name: str) -> Callable:
    def compare(pos, ref, var, ctx) -> list[MetricValues]:
        return [ratio_metric(name, pos, var["rows"], ref["rows"], "rel_l2")]

    return compare


def _max_id(*tensors: torch.Tensor) -> int:
    """Largest id in any of the tensors (−1 when all are empty), with one host read."""
    maxima = [t.max().to(tensors[0].device) for t in tensors if t.numel()]
    return int(torch.stack(maxima).max()) if maxima else -1


def _membership(rows: torch.Tensor, valid: torch.Tensor, n_rows: int) -> torch.Tensor:
    """[B, k] row ids with validity -> dense [B, n_rows] membership (on the rows' device)."""
    member = torch.zeros(rows.shape[0], n_rows + 1, dtype=torch.bool, device=rows.device)
    rows = rows.long()
    idx = torch.where(valid & (rows < n_rows) & (rows >= 0), rows, n_rows)  # invalid picks land in a spill column
    return member.scatter_(1, idx, True)[:, :n_rows]


def _picked_in(rows: torch.Tensor, valid: torch.Tensor, other: torch.Tensor, other_valid: torch.Tensor,
               n_rows: int | None = None) -> torch.Tensor:
    """[B, k] — is each valid pick of `rows` also a valid pick of `other`? (one dense membership row per query)

    `n_rows`: a bound above every valid id of `rows` and `other` a correct stack emits; an id at or past it matches
    nothing (counted as lost, not matched by a clamp). Without it the largest id of either side is read from the
    device."""
    if n_rows is None:
        n_rows = _max_id(rows, other) + 1
    elif n_rows:
        valid = valid & (rows < n_rows)
    member = _membership(other, other_valid, n_rows)
    # clamped in the ids' own dtype, then widened for gather: the same indices (an int64 clamp is ~40× slower on a
    # CPU: 559 against 12 µs for [256, 512] ids, one thread, thirty-second session)
    return valid & member.gather(1, rows.clamp(0, max(n_rows - 1, 0)).long()) if n_rows else torch.zeros_like(valid)


def compare_selected(pos, ref, var, ctx) -> list[MetricValues]:
    """indexer.selected: recall@k = |S_opt ∩ S_ref|/|S_ref| and flips = |S_ref \\ S_opt| per query, plus the
    recall restricted to reference picks in earlier turns and on needles (context-loss lens), each with its
    pick share 1/|subset|: what one lost pick costs that query's subset recall (the gate's rounding floor)."""
    rows_r, valid_r = ref["row_ids"], ref["valid"]
    dev = rows_r.device  # counted where the picks are (exact integer work: the same on any device)
    pos = pos.to(dev)
    n_rows = ctx.row_bound()
    hit = _picked_in(rows_r, valid_r, var["row_ids"].to(dev), var["valid"].to(dev), n_rows)
    n_ref = valid_r.sum(1).double()
    n_hit = hit.sum(1).double()
    recall = torch.where(n_ref > 0, n_hit / n_ref.clamp_min(1), torch.ones_like(n_ref))
    out = [MetricValues("indexer.recall", pos, recall), MetricValues("indexer.flips", pos, n_ref - n_hit)]
    # A row's span ends by the turn's start t: end = (r + 1)·m ≤ t ⇔ r < ⌊t/m⌋ (row_span; integers, m > 0), so the
    # earlier-turn picks are the ids below one bound per query — no per-pick lookup.
    rows = rows_r.clamp(0, n_rows)  # an invalid −1 reads row 0, an id past the sequence the bound (no needle)
    first_later = torch.div(ctx.turn_start_on(dev)[pos], ctx.ratio, rounding_mode="floor").to(rows.dtype)
    early = valid_r & (rows < first_later[:, None])
    n_early = early.sum(1).double()
    keep = n_early > 0
    out.append(kept("ctx.earlier_turn_recall", pos, (hit & early).sum(1).double() / n_early, keep))
    out.append(kept("ctx.earlier_turn_pick_share", pos, 1 / n_early, keep))
    if ctx.needle_spans:
        on_needle = valid_r & ctx.needle_rows_on(dev)[rows]
        n_needle = on_needle.sum(1).double()
        keep = n_needle > 0
        out.append(kept("ctx.needle_recall", pos, (hit & on_needle).sum(1).double() / n_needle, keep))
        out.append(kept("ctx.needle_pick_share", pos, 1 / n_needle, keep))
    return out


def touches_needle(ctx: CompareContext, start: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """Whether each token span [start, end) overlaps any of the context's needle spans."""
    out = torch.zeros_like(start, dtype=torch.bool)
    for s, e in ctx.needle_spans:
        out |= (start < e) & (end > s)
    return out


def row_span(ctx: CompareContext, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token span [start, end) a compressed row pools: CSA rows reach back one window (overlap), HCA do not."""
    m = ctx.ratio
    start = rows * m - (m if ctx.layer_kind == "csa" else 0)
    return start.clamp_min(0), (rows + 1) * m


_NO_KEY = torch.iinfo(torch.int64).max


def _key_codes(pos: torch.Tensor, tap: dict[str, torch.Tensor]) -> torch.Tensor:
    """One id per attended key: window key at position p → 2p, compressed row r → 2r+1, invalid → _NO_KEY."""
    wpos, crow = tap["window_pos"].long(), tap["comp_rows"].long()
    return torch.cat([torch.where(wpos >= 0, 2 * wpos, _NO_KEY), torch.where(crow >= 0, 2 * crow + 1, _NO_KEY)], 1)


def key_union(codes_r: torch.Tensor, codes_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The union of both sides' keys per query, compacted: (the compact slot of every ref key, of every variant
    key, and the key code held by every compact slot). Slots number ≤ Kr + Kv — not the whole window plus every
    compressed row of the sequence — so a Flash layer's 64 heads stay cheap. Invalid keys share one last slot."""
    both = torch.cat([codes_r, codes_v], 1)
    ordered, order = both.sort(1)
    fresh = torch.ones_like(ordered, dtype=torch.bool)
    fresh[:, 1:] = ordered[:, 1:] != ordered[:, :-1]
    slot = fresh.long().cumsum(1) - 1
    spill = both.shape[1]
    slot = torch.where(ordered == _NO_KEY, spill, slot)
    compact = torch.empty_like(slot).scatter_(1, order, slot)
    codes = torch.full((both.shape[0], spill + 1), _NO_KEY, dtype=torch.long, device=both.device).scatter_(1, slot,
                                                                                                          ordered)
    return compact[:, : codes_r.shape[1]], compact[:, codes_r.shape[1]:], codes[:, :spill]


def _scatter_probs(tap: dict[str, torch.Tensor], slots: torch.Tensor, n_slots: int) -> torch.Tensor:
    probs = _f64(tap["probs"])
    B, H, _ = probs.shape
    out = torch.zeros(B, H, n_slots + 1, dtype=torch.float64, device=probs.device)
    return out.scatter_add_(2, slots[:, None, :].expand(B, H, -1), probs)[..., :n_slots]


def _attended(slots: torch.Tensor, side_codes: torch.Tensor, n_slots: int) -> torch.Tensor:
    """[B, n_slots]: which compact keys this side attended (invalid keys go to the spill slot, dropped)."""
    present = torch.zeros(slots.shape[0], n_slots + 1, dtype=torch.bool, device=slots.device)
    return present.scatter_(1, slots, side_codes != _NO_KEY)[:, :n_slots]


def key_masks(ctx: CompareContext, pos: torch.Tensor, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per compact key: lies wholly before the query's turn; touches a needle. (pos on the codes' device.)"""
    valid = codes != _NO_KEY
    window = valid & (codes % 2 == 0)
    index = torch.where(valid, codes // 2, 0)
    start, end = row_span(ctx, index) if ctx.ratio else (index, index + 1)
    start = torch.where(window, index, start)
    end = torch.where(window, index + 1, end)
    early = valid & (end <= ctx.turn_start_on(codes.device)[pos][:, None])
    if not ctx.needle_spans:
        return early, None
    return early, valid & touches_needle(ctx, start, end)


def compare_attention(pos, ref, var, ctx) -> list[MetricValues]:
    """attn.probs at sampled queries: distance between the two attention distributions over the union of
    their keys plus the sink (TV, KL(ref‖opt), JS; mean over heads), indexer mass recall, and the
    context-loss lens (mass on earlier turns and on needles). Computed on the device holding the rows."""
    pos = pos.to(ref["probs"].device)
    codes_r, codes_v = _key_codes(pos, ref), _key_codes(pos, var)
    slots_r, slots_v, codes = key_union(codes_r, codes_v)
    n_slots = codes.shape[1]
    pr, pv = _scatter_probs(ref, slots_r, n_slots), _scatter_probs(var, slots_v, n_slots)
    P = torch.cat([pr, _f64(ref["sink_prob"])[..., None]], -1)
    Q = torch.cat([pv, _f64(var["sink_prob"])[..., None]], -1)
    tv = 0.5 * (P - Q).abs().sum(-1)
    kl = (P * (torch.log(P.clamp_min(KL_FLOOR)) - torch.log(Q.clamp_min(KL_FLOOR)))).sum(-1)
    M = 0.5 * (P + Q)

    def kl_to_m(X: torch.Tensor) -> torch.Tensor:
        return torch.where(X > 0, X * (torch.log(X.clamp_min(1e-300)) - torch.log(M.clamp_min(1e-300))),
                           torch.zeros_like(X)).sum(-1)

    js = 0.5 * (kl_to_m(P) + kl_to_m(Q))
    out = [MetricValues("attn.tv", pos, tv.mean(-1)), MetricValues("attn.kl", pos, kl.mean(-1)),
           MetricValues("attn.js", pos, js.mean(-1)),
           MetricValues("attn.max_logit_delta", pos, (_f64(var["max_logit"]) - _f64(ref["max_logit"])).abs().mean(-1))]

    if ctx.layer_kind == "csa":  # a query whose keys hold no compressed row the reference attended keeps no value
        compressed = (codes != _NO_KEY) & (codes % 2 == 1)
        in_ref = _attended(slots_r, codes_r, n_slots) & compressed
        in_var = _attended(slots_v, codes_v, n_slots) & compressed
        mass = pr.mean(1)  # reference attention mass per key, mean over heads
        on_ref = (mass * in_ref).sum(1)
        out.append(kept("indexer.mass_recall", pos, (mass * (in_ref & in_var)).sum(1) / on_ref, on_ref > 0))

    early, needle = key_masks(ctx, pos, codes)
    has_early = ctx.turn_start_on(pos.device)[pos] > 0  # queries in a later turn: earlier turns exist to attend to
    out += [kept("ctx.earlier_turn_mass_ref", pos, (pr * early[:, None, :]).sum(-1).mean(-1), has_early),
            kept("ctx.earlier_turn_mass_opt", pos, (pv * early[:, None, :]).sum(-1).mean(-1), has_early)]
    if needle is not None:
        has_needle = pos >= min(e for _, e in ctx.needle_spans)  # a needle lies wholly in the past
        out += [kept("ctx.needle_mass_ref", pos, (pr * needle[:, None, :]).sum(-1).mean(-1), has_needle),
                kept("ctx.needle_mass_opt", pos, (pv * needle[:, None, :]).sum(-1).mean(-1), has_needle)]
    return out


def compare_indexer_scores(pos, ref, var, ctx, ref_selected: dict[str, torch.Tensor], var_selected: dict[str, torch.Tensor]
                           ) -> list[MetricValues]:
    """Boundary-aware recalls at sampled queries: recall over the reference picks that no rounding of the given
    kind could have reordered — ties are not drift. Computed on the device holding the scores.

    - indexer.boundary_recall (bf16): picks more than BOUNDARY_REL·|k-th score| above the weakest pick.
    - indexer.fp8_boundary_recall (FP8): picks more than FP8_SCORE_REL·|k-th score| above the weakest pick.
    """
    scores = _f64(ref["scores"])
    pos, dev = pos.to(scores.device), scores.device
    rows_r, valid_r = ref_selected["row_ids"].to(dev).long(), ref_selected["valid"].to(dev)
    n_rows = scores.shape[1]
    s_ref = _membership(rows_r, valid_r, n_rows)
    s_opt = _membership(var_selected["row_ids"].to(dev), var_selected["valid"].to(dev), n_rows)
    kth = torch.where(s_ref, scores, torch.full_like(scores, math.inf)).amin(1)  # the weakest reference pick
    outside_fp8 = s_ref & (scores > (kth + FP8_SCORE_REL * kth.abs())[:, None])  # see FP8_SCORE_REL
    n_picks = s_ref.sum(1).double()
    judged = n_picks > 0
    # what share of the picks the FP8 check judges at all (at Flash width ~23%: the rest lie within FP8 rounding)
    out = [kept("indexer.fp8_window_share", pos, outside_fp8.sum(1).double() / n_picks, judged)]
    for name, confident in (("indexer.boundary_recall", s_ref & (scores > (kth + BOUNDARY_REL * kth.abs())[:, None])),
                            ("indexer.fp8_boundary_recall", outside_fp8)):
        n_conf = confident.sum(1).double()
        recall = (confident & s_opt).sum(1).double() / n_conf.clamp_min(1)
        out.append(kept(name, pos, recall, n_conf > 0))
    return out


def compare_logits(pos: torch.Tensor, ref_logits: torch.Tensor, var_logits: torch.Tensor) -> list[MetricValues]:
    """Final logits: KL(ref‖opt) of the softmaxes (fp64), top-1 agreement, strict flips beyond a bf16 ulp."""
    lr, lv = _f64(ref_logits), _f64(var_logits)
    log_p, log_q = torch.log_softmax(lr, -1), torch.log_softmax(lv, -1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    top_r, top_v = lr.argmax(-1), lv.argmax(-1)
    agree = (top_r == top_v).double()
    two = lr.topk(2, dim=-1).values
    gap_ok = (two[:, 0] - two[:, 1]) > BF16_ULP_REL * two[:, 0].abs()
    return [MetricValues("logits.kl", pos, kl), MetricValues("logits.top1_agree", pos, agree),
            MetricValues("logits.top1_flip_strict", pos, ((1 - agree) * gap_ok.double()))]


COMPARATORS: dict[str, Callable] = {
    "layer.out": compare_streams,
    "attn.out": compare_output("attn"),
    "moe.out": compare_output("moe"),
    "attn.hc": compare_hc,
    "ffn.hc": compare_hc,
    "attn.lse": compare_lse,
    "moe.router": compare_router,
    "compressor.rows": compare_rows("compressor.rows_rel_l2"),
    "indexer.rows": compare_rows("indexer.rows_rel_l2"),
    "indexer.selected": compare_selected,
    "attn.probs": compare_attention,
    **SITE_COMPARATORS,
}
"""Taps compared per position as they stream past; indexer.scores (boundary recall) pairs with
indexer.selected and logits are compared after the last layer."""
