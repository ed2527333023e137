"""How the gate reads each metric of harness.run.metrics: its taps, which way is worse, its rounding floor.

Shared by the policy (which metrics a check may name, their built-in floors), the evaluation (the loss of a value)
and the outputs (how a bound is written).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MetricRule:
    """How the gate reads one metric of harness.run.metrics.

    direction: "upper" (an error; loss = x), "lower" (a recall/agreement in [0, 1]; loss = 1 − x),
    "signed" (a signed error; loss = |x|), "db" (an SNR in dB, higher is better; loss = 10^(−x/20), the
    equivalent relative L2) or "descriptive" (a measurement, not a drift; cannot be gated).
    floor: the built-in rounding floor in loss units (an expression), or None when the metric has no
    magnitude-free floor and a relative bound must state one.
    order: 1 when the loss is linear in the error amplitude, 2 when it is quadratic (KL, JS, 1 − cos: their
    square roots are distances). Bound factors are factors on the amplitude, so for order 2 the gate applies
    them to square roots: yardstick F → loss ≤ F²·y + floor; base F → loss ≤ (√base + F·√y)² + floor."""

    taps: tuple[str, ...]
    direction: str
    floor: str | None
    order: int = 1
    pick_share: str | None = None
    """For a recall over a subset of the reference's picks: the metric holding each query's 1/|subset|, which a
    floor expression reads as `pick_share` (the unit's count-weighted mean: one lost pick per query)."""

    @property
    def gateable(self) -> bool:
        return self.direction != "descriptive"

    @property
    def policy_direction(self) -> str:
        """What a policy's `direction:` says: upper (larger is worse) or lower (smaller is worse)."""
        return "lower" if self.direction in ("lower", "db") else "upper"


_U = "2**-8"  # bf16 unit roundoff: rounding x to bf16 moves it by at most 2^-8·|x| (8-bit significand, RNE)
_HC = ("attn.hc", "ffn.hc")
METRICS: dict[str, MetricRule] = {
    # relative L2 of a tensor: one bf16 rounding of the tensor itself gives ‖δ‖/‖x‖ ≤ u = 2^-8
    "streams.rel_l2": MetricRule(("layer.out",), "upper", _U),
    "streams.sqnr_db": MetricRule(("layer.out",), "db", _U),  # loss is the equivalent rel L2
    "streams.cosine": MetricRule(("layer.out",), "lower", "2**-17", order=2),  # 1 − cos ≈ r²/2 ≤ u²/2
    "streams.max_abs": MetricRule(("layer.out",), "upper", None),  # absolute units: no magnitude-free floor
    "streams.bias": MetricRule(("layer.out",), "signed", None),
    "attn.out_rel_l2": MetricRule(("attn.out",), "upper", _U),
    "moe.out_rel_l2": MetricRule(("moe.out",), "upper", _U),
    "compressor.rows_rel_l2": MetricRule(("compressor.rows",), "upper", _U),
    "indexer.rows_rel_l2": MetricRule(("indexer.rows",), "upper", _U),
    "mhc.pre_rel_err": MetricRule(_HC, "upper", _U),
    "mhc.post_rel_err": MetricRule(_HC, "upper", _U),
    "mhc.comb_rel_err": MetricRule(_HC, "upper", _U),
    "mhc.ds_residual": MetricRule(_HC, "upper", _U),  # comb rows/cols sum to 1: bf16 storage moves a sum ≤ u
    # attention probabilities stored in bf16: |δp_i| ≤ u·p_i, so TV = ½Σ|δp_i| ≤ u/2, KL ≈ ½Σ δp_i²/p_i ≤ u²/2,
    # JS ≈ KL/4
    "attn.tv": MetricRule(("attn.probs",), "upper", "2**-9"),
    "attn.kl": MetricRule(("attn.probs",), "upper", "2**-17", order=2),
    "attn.js": MetricRule(("attn.probs",), "upper", "2**-19", order=2),
    "attn.lse_delta": MetricRule(("attn.lse",), "upper", None),  # nats at the logits' own scale
    "attn.max_logit_delta": MetricRule(("attn.lse",), "upper", None),
    # selections are discrete: the smallest non-zero change is one of k picks (a tie broken the other way)
    "indexer.recall": MetricRule(("indexer.selected",), "lower", "1/index_topk"),
    "indexer.flips": MetricRule(("indexer.selected",), "upper", "1"),
    "indexer.mass_recall": MetricRule(("attn.probs",), "lower", "1/index_topk"),
    "indexer.boundary_recall": MetricRule(("indexer.scores",), "lower", "1/index_topk"),
    # recalls over a subset of the picks (earlier turns, needles): one pick is 1/|subset| of a query's recall,
    # often far more than 1/k (a needle may hold 3 of a query's 512 picks), so the floor is one pick per query
    "ctx.earlier_turn_recall": MetricRule(("indexer.selected",), "lower", "pick_share",
                                          pick_share="ctx.earlier_turn_pick_share"),
    "ctx.needle_recall": MetricRule(("indexer.selected",), "lower", "pick_share", pick_share="ctx.needle_pick_share"),
    "ctx.earlier_turn_pick_share": MetricRule(("indexer.selected",), "descriptive", None),
    "ctx.needle_pick_share": MetricRule(("indexer.selected",), "descriptive", None),
    "moe.flip_rate": MetricRule(("moe.router",), "upper", "1/num_experts_per_tok"),
    # routing weights sum to routed_scaling_factor; bf16 weights move the sum's L1 by ≤ u·Σw
    "moe.weight_l1": MetricRule(("moe.router",), "upper", "2**-8 * routed_scaling_factor"),
    "logits.kl": MetricRule(("logits",), "upper", "2**-17", order=2),  # bf16 probabilities, as attn.kl
    "logits.top1_agree": MetricRule(("logits",), "lower", None),  # one position flips by 1: no fractional floor
    "logits.top1_flip_strict": MetricRule(("logits",), "upper", None),
    "ctx.earlier_turn_mass_ref": MetricRule(("attn.probs",), "descriptive", None),
    "ctx.earlier_turn_mass_opt": MetricRule(("attn.probs",), "descriptive", None),
    "ctx.needle_mass_ref": MetricRule(("attn.probs",), "descriptive", None),
    "ctx.needle_mass_opt": MetricRule(("attn.probs",), "descriptive", None),
}
"""Every metric harness.run.metrics emits, with its taps, direction and built-in rounding floor."""
GATEABLE = [metric for metric, rule in METRICS.items() if rule.gateable]
PICK_SHARE = "pick_share"
"""Floor variable: the unit's mean of 1/|subset| for a subset recall (MetricRule.pick_share)."""
PICK_SHARE_METRICS = frozenset(m for m, rule in METRICS.items() if rule.pick_share)
