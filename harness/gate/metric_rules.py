"""How the gate reads each metric of harness.run.metrics: its taps, which way is worse, its rounding floor, and
for discrete metrics the decisions behind it; for fp32 decision sites, the benign twin that bounds it.

Shared by the policy (which metrics a check may name, their built-in floors), the evaluation (the loss of a value,
counted in decisions for a discrete metric) and the outputs (how a bound is written).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MetricRule:
    """How the gate reads one metric of harness.run.metrics.

    direction: "upper" (an error; loss = x), "lower" (a recall/agreement in [0, 1]; loss = 1 − x),
    "signed" (a signed error; loss = |x|), "db" (an SNR in dB, higher is better; loss = 10^(−x/20), the
    equivalent relative L2) or "descriptive" (not a drift: one side's value, a pick share or a benign twin's
    noise, which the gate reads beside a drift; cannot be gated).
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
    decisions: str | None = None
    """For a discrete metric (picks, expert choices, answers): the decisions one position makes, in the metric's
    unit, as an expression — positions × decisions × loss counts the decisions a unit lost, which the gate bounds
    as a count (harness.gate.evaluate). None for a continuous metric."""
    twin: str | None = None
    """For an fp32 decision site: the metric of the stock op's benign twin at the same tap (`twin:` bounds)."""

    @property
    def gateable(self) -> bool:
        return self.direction != "descriptive"

    @property
    def discrete(self) -> bool:
        return self.decisions is not None

    @property
    def policy_direction(self) -> str:
        """What a policy's `direction:` says: upper (larger is worse) or lower (smaller is worse)."""
        return "lower" if self.direction in ("lower", "db") else "upper"


_U = "2**-8"  # bf16 unit roundoff: rounding x to bf16 moves it by at most 2^-8·|x| (8-bit significand, RNE)
_HC = ("attn.hc", "ffn.hc")
_HC_SITES = ("attn.hc.site", "ffn.hc.site")
_HC_POST_SITES = ("attn.hc.post.site", "ffn.hc.post.site")
_EXPERTS_SITES = ("moe.experts.site", "moe.shared.site")
_ANSWER = ("needle.lens", "logits")  # the needle answer after every layer (lens) and from the final logits
# Discrete floors are one decision of the unit's N = positions × decisions (a tie broken the other way by one
# rounding), not one of a single position's: a layer mean over 10⁴ positions × 512 picks moves by 1/(5·10⁶) when
# one pick flips, so 1/k (one pick per query, every query) was 5·10⁵ times too loose for a mean.
_ONE_PICK = "1/(positions*index_topk)"
_ONE_EXPERT = "1/(positions*num_experts_per_tok)"
_ONE_SUBSET_PICK = "pick_share/positions"  # N = positions/pick_share: the unit's picks in the subset
_ONE_POSITION = "1/positions"
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
    # the variant's Sinkhorn residual beyond the reference's: the two run on different inputs, and 20 iterations
    # leave a residual that depends on the matrix, so no rounding bounds it (measured: 0.0043 for the stock
    # engine on the demo) — descriptive; mhc.site_ds_residual compares on the same input
    "mhc.ds_residual": MetricRule(_HC, "descriptive", None),
    # attention probabilities stored in bf16: |δp_i| ≤ u·p_i, so TV = ½Σ|δp_i| ≤ u/2, KL ≈ ½Σ δp_i²/p_i ≤ u²/2,
    # JS ≈ KL/4
    "attn.tv": MetricRule(("attn.probs",), "upper", "2**-9"),
    "attn.kl": MetricRule(("attn.probs",), "upper", "2**-17", order=2),
    "attn.js": MetricRule(("attn.probs",), "upper", "2**-19", order=2),
    # LSE = log Z with Z the softmax denominator: one bf16 rounding Z(1+δ), |δ| ≤ u, moves it by |log(1+δ)| ≈ u
    # nats — whatever the logits' scale, so this floor is magnitude-free
    "attn.lse_delta": MetricRule(("attn.lse",), "upper", _U),
    "attn.max_logit_delta": MetricRule(("attn.lse",), "upper", None),  # nats at the logits' own scale
    # selections are discrete: a unit's loss × positions × decisions counts the picks it lost
    "indexer.recall": MetricRule(("indexer.selected",), "lower", _ONE_PICK, decisions="index_topk"),
    "indexer.flips": MetricRule(("indexer.selected",), "upper", _ONE_POSITION, decisions="1"),  # picks per query
    # the mass-weighted recall is counted in queries' masses: one lost pick costs its share of its query's selected
    # mass, up to all of it (a row flipped at the k-th indexer score may hold most of the attention), so the lost
    # mass of a unit is a sum of jumps in [0, 1], whose variance is at most its mean: a Poisson count's bound holds
    "indexer.mass_recall": MetricRule(("attn.probs",), "lower", _ONE_POSITION, decisions="1"),
    "indexer.boundary_recall": MetricRule(("indexer.scores",), "lower", _ONE_PICK, decisions="index_topk"),
    "indexer.fp8_boundary_recall": MetricRule(("indexer.scores",), "lower", _ONE_PICK, decisions="index_topk"),
    "indexer.fp8_window_share": MetricRule(("indexer.scores",), "descriptive", None),  # the reference's picks only
    # recalls over a subset of the picks (earlier turns, needles): one pick is 1/|subset| of a query's recall,
    # often far more than 1/k (a needle may hold 3 of a query's 512 picks): a query decides |subset| picks
    "ctx.earlier_turn_recall": MetricRule(("indexer.selected",), "lower", _ONE_SUBSET_PICK,
                                          pick_share="ctx.earlier_turn_pick_share", decisions="1/pick_share"),
    "ctx.needle_recall": MetricRule(("indexer.selected",), "lower", _ONE_SUBSET_PICK,
                                    pick_share="ctx.needle_pick_share", decisions="1/pick_share"),
    "ctx.earlier_turn_pick_share": MetricRule(("indexer.selected",), "descriptive", None),
    "ctx.needle_pick_share": MetricRule(("indexer.selected",), "descriptive", None),
    "moe.flip_rate": MetricRule(("moe.router",), "upper", _ONE_EXPERT, decisions="num_experts_per_tok"),
    # routing weights sum to routed_scaling_factor; bf16 weights move the sum's L1 by ≤ u·Σw
    "moe.weight_l1": MetricRule(("moe.router",), "upper", "2**-8 * routed_scaling_factor"),
    "logits.kl": MetricRule(("logits",), "upper", "2**-17", order=2),  # bf16 probabilities, as attn.kl
    "logits.top1_agree": MetricRule(("logits",), "lower", _ONE_POSITION, decisions="1"),  # one argmax per position
    "logits.top1_flip_strict": MetricRule(("logits",), "upper", _ONE_POSITION, decisions="1"),
    "ctx.earlier_turn_mass_ref": MetricRule(("attn.probs",), "descriptive", None),
    "ctx.earlier_turn_mass_opt": MetricRule(("attn.probs",), "descriptive", None),
    "ctx.needle_mass_ref": MetricRule(("attn.probs",), "descriptive", None),
    "ctx.needle_mass_opt": MetricRule(("attn.probs",), "descriptive", None),
    # needle answers (harness.run.needles): one answer per needle query; `lost` is the outcome to hold at zero
    "ctx.needle_answer": MetricRule(_ANSWER, "lower", _ONE_POSITION, decisions="1"),
    "ctx.needle_lost": MetricRule(_ANSWER, "upper", _ONE_POSITION, decisions="1"),
    "ctx.needle_answer_ref": MetricRule(_ANSWER, "descriptive", None),
    "ctx.needle_margin": MetricRule(_ANSWER, "descriptive", None),
    "ctx.needle_margin_ref": MetricRule(_ANSWER, "descriptive", None),
    # fp32 decision sites: the variant's op against the stock op on the same inputs, bounded by the stock op's
    # benign twin (fp32 sums re-associated). The mixes' floor stands in for a twin that shows no noise (its split
    # coincided with the BLAS's blocking): twice a re-association's ~u_fp32, with room: 2^-22 (default.yaml).
    "moe.site_flip_rate": MetricRule(("moe.router.site",), "upper", _ONE_EXPERT, decisions="num_experts_per_tok",
                                     twin="moe.twin_flip_rate"),
    "mhc.site_rel_err": MetricRule(_HC_SITES, "upper", "2**-22", twin="mhc.twin_rel_err"),
    # the routing weights at tokens whose expert set both keep: a softplus, sqrt, sum and division, each rounded
    "moe.site_weight_err": MetricRule(("moe.router.site",), "upper", "4 * 2**-24", twin="moe.twin_weight_err"),
    # how much less doubly stochastic the variant's comb is than the stock Sinkhorn's on the same input: a comb
    # stored or normalised in bf16 moves a unit row/column sum by ≤ u_bf16 = 2^-8
    "mhc.site_ds_residual": MetricRule(_HC_SITES, "upper", _U),
    # hc_post's outputs beyond what any fp32 implementation with the bf16 store can differ by: one element of the
    # unit's positions × n·D
    "mhc.post_site_excess": MetricRule(_HC_POST_SITES, "upper", "1/(positions*hc_mult*hidden_size)",
                                       decisions="hc_mult*hidden_size"),
    "indexer.site_recall": MetricRule(("indexer.site",), "lower", _ONE_PICK, decisions="index_topk",
                                      twin="indexer.twin_recall"),
    # a stock pick lost although it led the k-th by more than 16× the twin's largest score change: no tie
    "indexer.site_margin_loss": MetricRule(("indexer.site",), "upper", _ONE_PICK, decisions="index_topk"),
    # a valid pick of a row the query may not see yet (its window ends past the query): causality, not rounding
    "indexer.site_future": MetricRule(("indexer.site",), "upper", _ONE_PICK, decisions="index_topk"),
    # the attention LSE on the stock op's own inputs; floor: one fp32 ulp of an LSE below 64 nats, 2^-18
    "attn.site_lse_err": MetricRule(("attn.site",), "upper", "2**-18", twin="attn.twin_lse_err"),
    # a cache row whose slot reads back other than its stored form: one row of the unit's positions
    "attn.kv_site_mismatch": MetricRule(("attn.kv.site",), "upper", _ONE_POSITION, decisions="1"),
    # a token whose experts output took the other side of the SwiGLU clamp's decision: one of the unit's positions
    "moe.clamp_site_miss": MetricRule(_EXPERTS_SITES, "upper", _ONE_POSITION, decisions="1"),
    # a token whose experts output lacks, repeats or misweighs a whole pair's contribution: one of the unit's positions
    "moe.pair_site_loss": MetricRule(_EXPERTS_SITES, "upper", _ONE_POSITION, decisions="1"),
    # a token routed to an expert whose output is scaled at most of its pairs: one of the unit's positions
    "moe.expert_site_bias": MetricRule(_EXPERTS_SITES, "upper", _ONE_POSITION, decisions="1"),
    "moe.twin_flip_rate": MetricRule(("moe.router.site",), "descriptive", None),
    "moe.twin_weight_err": MetricRule(("moe.router.site",), "descriptive", None),
    "mhc.twin_rel_err": MetricRule(_HC_SITES, "descriptive", None),
    "indexer.twin_recall": MetricRule(("indexer.site",), "descriptive", None),
    "attn.twin_lse_err": MetricRule(("attn.site",), "descriptive", None),
}
"""Every metric harness.run.metrics emits, with its taps, direction and built-in rounding floor."""
GATEABLE = [metric for metric, rule in METRICS.items() if rule.gateable]
PICK_SHARE = "pick_share"
"""Floor variable: the unit's mean of 1/|subset| for a subset recall (MetricRule.pick_share)."""
POSITIONS = "positions"
"""Floor variable: the positions a unit holds (Σ count of its rows), so a discrete floor is one decision of the
unit's N = positions × decisions."""
UNIT_VARIABLES = frozenset({PICK_SHARE, POSITIONS})
PICK_SHARE_METRICS = frozenset(m for m, rule in METRICS.items() if rule.pick_share)
