"""Synthetic weight profiles: the statistics that decide which real serving bugs a synthetic model can show.

A CI gate that runs on synthetic weights is only as sensitive as those weights let it be. A synthetic model
whose decisions all have wide margins hides every bug that only flips a near-tie; one whose sinks never take
any mass hides every bug in the sink. The `calibrated` profile (the default) sets those statistics from public
evidence about real checkpoints and real serving bugs (`shared/calibration-evidence.md`); each number below
carries its source. `uncalibrated` is the generator as it was before 2026-12-01, kept bit-for-bit so that
earlier runs stay reproducible (tests/test_calibration.py pins its tensors' digests as that code made them). An
earlier run's NVFP4 forms used the power-of-two global scale, which the profile names (`nvfp4_global_rule`, used by
synthetic NVFP4 checkpoints); the `nvfp4-experts` patch builds its own form and takes the rule as its option
`global_scale` (`pow2` to reproduce such a run).

Statistics of the calibrated profile (each measured on the synthetic model by tests/test_calibration.py):
- learned attention sinks: per-head sink mass spread from ~1% to heads where the sink takes most of the mass;
  dropping the sinks moves a layer's attention output by the order of 0.23 relative L2
  (vllm-project/vllm PR #54568: dropping DeepSeek-V4's learned sinks changed attention output by 0.23 rel L2);
- router top-k margins: the k-th and (k+1)-th expert scores as close, in bf16 ulps, as in a 256-expert top-6
  router (vllm-project/vllm-ascend PRs #9676, #9831; NVIDIA-NeMo/Automodel PR #2201: DeepSeek keeps gate
  scores in fp32 because bf16 routing perturbs near-ties);
- per-expert w1/w3 global-scale spreads: gate/up pairs whose NVFP4 global scales differ like a real NVFP4
  checkpoint's (sgl-project/sglang PR #27588: 69.1% of w1/w3 pairs differ, ratio median 1.077, p99 1.69,
  max 10; vllm-project/vllm #54974);
- activation outlier channels: one systematic outlier feature in every token's residual (Dettmers et al.,
  LLM.int8(), 2022: large-magnitude features in fixed dimensions of most tokens' hidden states; Sun et al.,
  "Massive Activations in Large Language Models", 2024: a few near-constant activations act as bias terms)
  on top of the norm-weight outlier channels, so 1×128 FP8 and per-16 FP4 blocks that hold it lose their small
  entries;
- SwiGLU pre-activations past swiglu_limit: one channel per expert whose gate and up rows are flat at the
  tensor's largest magnitude, so that the clamp engages at some tokens (sgl-project/sglang PR #23776, vllm-project/vllm-ascend #14363: serving stacks
  that dropped the clamp gave wrong tokens at those tokens), not at none;
- indexer score margins at the k-th pick: ReLU plateaus and exact code ties at the rank-k boundary (spec §5.3,
  DESIGN §10), produced by the planted retrieval heads (`reference.weights.retrieval`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

from reference.config import ModelConfig

DEFAULT_PROFILE = "calibrated"


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    calibrated: bool
    nvfp4_global_rule: str
    """How FP4 experts are given an NVFP4 global scale (reference.quant.mx32_to_nvfp4): `modelopt` spreads like a
    real checkpoint's; `pow2` is what the generator did before 2026-12-01."""
    clamp_channels: bool = True
    """Whether each expert has a channel whose pre-activations pass swiglu_limit (CLAMP_ROW_NORM; calibrated only):
    off in `calibrated-2026-12-04`, the calibrated generator before they were added."""


PROFILES: dict[str, Profile] = {
    "calibrated": Profile("calibrated", "statistics calibrated to public evidence, with planted retrieval circuits "
                                        "(the default since 2026-12-01; SwiGLU clamp channels since 2026-12-05)",
                          True, "modelopt"),
    "calibrated-2026-12-04": Profile("calibrated-2026-12-04", "the calibrated generator before its SwiGLU clamp "
                                                              "channels (2026-12-05), bit for bit (reproduces runs "
                                                              "of 2026-12-01 to 12-04)", True, "modelopt",
                                     clamp_channels=False),
    "uncalibrated": Profile("uncalibrated", "the synthetic generator before 2026-12-01, bit for bit (reproduces "
                                            "earlier runs)", False, "pow2"),
}


def get_profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown synthetic weight profile {name!r}; choose one of {sorted(PROFILES)}") from None


# --------------------------------------------------------------------------- learned sinks

SINK_DROP_REL_L2 = 0.23
"""vllm-project/vllm PR #54568: dropping DeepSeek-V4's learned sinks changed the attention output by 0.23
relative L2. A head whose sink holds mass m scales its output by (1 − m); dropping the sink divides by it, a
change of m/(1 − m) relative to that head's output."""

HEAVY_SINK_SHARE = 1 / 16
"""Share of heads whose sink takes most of the mass (m ∈ [0.6, 0.9]): every 16th head of the model, counting
heads layer by layer, so a model of few heads still has them (flash-mini: 5 of 86). With light heads at m ≈ 1–10%, the
expected rel L2 of dropping every sink, sqrt(Σ m_h²)/sqrt(Σ (1 − m_h)²) over heads of equal output norm, is
sqrt(1/16·0.56 + 15/16·0.0034)/sqrt(1/16·0.06 + 15/16·0.90) ≈ 0.20 — the order of SINK_DROP_REL_L2."""

ATTN_LOGIT_STD = 2.5
"""Std of the synthetic attention logits q·k/√d: q is RMS-normalised per head (‖q‖ = √d), a key is a unit-RMS
row times the kv-norm gain 2.5 (`synthetic._value`), so for unrelated q and k, q·k/√d ~ N(0, 2.5²)."""


def typical_lse(cfg: ModelConfig, layer: int, tokens: int = 8192) -> float:
    """E[log Σ_j exp(s_j)] for N keys with s ~ N(0, σ²): log N + σ²/2. N = the 128-row window plus the
    compressed rows a query at `tokens` sees (CSA: min(index_topk, t/4); HCA: t/128)."""
    n = cfg.sliding_window
    kind = cfg.layer_kind(layer)
    if kind == "csa":
        n += min(cfg.index_topk, tokens // cfg.compress_ratio(layer))
    elif kind == "hca":
        n += tokens // cfg.compress_ratio(layer)
    return math.log(n) + ATTN_LOGIT_STD**2 / 2


def sink_logit(cfg: ModelConfig, layer: int, head: int, u_mass: float) -> float:
    """A head's sink logit for a target sink mass m: sink share = sigmoid(S − lse) ⇒ S = lse + logit(m).
    Heavy heads (HEAVY_SINK_SHARE of them) get m ∈ [0.6, 0.9], the others m log-uniform in [1%, 10%];
    `u_mass` is a uniform in (0, 1)."""
    period = round(1 / HEAVY_SINK_SHARE)
    if (layer * cfg.num_attention_heads + head) % period == period // 2 - 1:
        m = 0.6 + 0.3 * u_mass
    else:
        m = math.exp(math.log(0.01) + u_mass * (math.log(0.10) - math.log(0.01)))
    return typical_lse(cfg, layer) + math.log(m / (1 - m))


# --------------------------------------------------------------------------- router margins

REFERENCE_ROUTER = (256, 6)
"""The router whose near-tie statistics the synthetic routers reproduce: DeepSeek-V4's 256 experts, top-6
(spec §1.1). Its logits are N(0, 1) in the synthetic Flash preset (unit-RMS input, weights N(0, 1/D))."""


def kth_gap(n_experts: int, k: int, logit_std: float) -> float:
    """Expected gap between the k-th and (k+1)-th largest scores s = √softplus(logit) of n i.i.d. N(0, σ²)
    logits, in units of one bf16 ulp of the k-th score. Order statistics: near the quantile x_k = Φ⁻¹(1 − k/n)
    the spacing of n samples is σ/(n·φ(x_k/σ)·…) = σ/(n·φ(Φ⁻¹(1 − k/n))); the score's slope there is
    ds/dl = sigmoid(l)/(2s); one bf16 ulp of s is 2^(⌊log2 s⌋ − 7)."""
    z = NormalDist().inv_cdf(1 - k / n_experts)
    spacing = logit_std / (n_experts * NormalDist().pdf(z))
    logit = z * logit_std
    s = math.sqrt(math.log1p(math.exp(logit)))
    slope = 1 / (1 + math.exp(-logit)) / (2 * s)
    ulp = 2.0 ** (math.floor(math.log2(s)) - 7)
    return spacing * slope / ulp


def router_logit_std(cfg: ModelConfig) -> float:
    """The logit std at which this config's router has the reference router's k-th gap in bf16 ulps (bisection
    on kth_gap, which grows with σ). 1.0 for Flash itself; ≈ 0.22 for flash-mini's 16 experts, top-6."""
    n_ref, k_ref = REFERENCE_ROUTER
    target = kth_gap(n_ref, k_ref, 1.0)
    lo, hi = 1e-3, 4.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if kth_gap(cfg.n_routed_experts, cfg.num_experts_per_tok, mid) < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


# --------------------------------------------------------------------------- NVFP4 w1/w3 global-scale spread

W13_LOG_RATIO_SCALE = 0.097
"""log(w3 gain / w1 gain) = 0.097·T with T Student-t with 3 degrees of freedom: median |T| = 0.765 and
p99 |T| = 5.84 give a w1/w3 amax ratio with median exp(0.097·0.765) = 1.077 and p99 exp(0.097·5.84) = 1.76,
matching sglang PR #27588's median 1.077 and p99 1.69; the t tail reaches ratios near 10 over a layer's
thousands of pairs. After NVFP4's e4m3-grid global scales, pairs closer than one grid step share a scale,
so not every pair differs (69.1% did in the real checkpoint)."""


def student_t3(u: tuple[float, ...]) -> float:
    """A Student-t(3) variate from four uniforms in (0, 1): Z / √(χ²₃/3), with Z and the three normals of χ²₃
    from Box–Muller pairs (cos and sin of one pair are independent normals)."""
    def pair(a: float, b: float) -> tuple[float, float]:
        r = math.sqrt(-2 * math.log(a))
        return r * math.cos(2 * math.pi * b), r * math.sin(2 * math.pi * b)

    z, n1 = pair(u[0], u[1])
    n2, n3 = pair(u[2], u[3])
    chi2 = n1 * n1 + n2 * n2 + n3 * n3
    return z / math.sqrt(max(chi2, 1e-12) / 3)


# --------------------------------------------------------------------------- activation outliers

def outlier_dim(cfg: ModelConfig) -> int:
    """The residual dimension of the outlier channel: the last, whose per-16 FP4 and 1×128 FP8 activation blocks
    otherwise hold ordinary N(0, 1) values (the planted retrieval circuit's codes use the first dims)."""
    return cfg.hidden_size - 1


OUTLIER_CHANNEL_VALUE = 12.0
"""The systematic outlier feature: the last residual dimension holds 12.0 in every token's embedding — LLM.int8()'s
outlier features (magnitude ≥ 6 where most hidden values are within ±1, in the same dimension across most
tokens) — and, being constant, it is also a bias term the planted indexer heads read (Sun et al. 2024).
Measured on flash-mini's embedding (D = 64; the other dimensions are ±1 codes and N(0, 1), median |value| 0.70):
17× the median; after the input RMSNorm (RMS ≈ 1.7, raised by the outlier itself) ~7.1 against a median 0.41,
well past LLM.int8()'s 6 (tests/test_calibration.py checks ≥ 6× the median in layer 0's attention input). A
per-16 FP4 block holding it scales its e2m1 max (6) to the outlier: its step amax/6 ≈ 1.2 rounds the small entries
of its block mates (|x| ≲ 0.3) to zero, which a block without it keeps (the test: at least twice the block mates'
error).
FP8 e4m3 blocks (1×128) keep their small entries at this magnitude (its normals span 2^15); only a massive
activation (10^3–10^5×, Sun et al.) would empty them."""


# --------------------------------------------------------------------------- the SwiGLU clamp

CLAMP_ROW_NORM = 4.0
"""Norm of one intermediate channel's gate and up rows in every expert (routed and shared) — against an ordinary
row's ≈ 1 (N(0, 1/D) draws) — so that its pre-activations pass swiglu_limit at some tokens. The rows are flat:
random signs times the tensor's largest magnitude on as many random columns as give this norm, the outlier column
zero (SyntheticWeights._clamp_channel), so no tensor's largest magnitude changes.

Why: a trained DeepSeek-V4's expert pre-activations pass the limit (10) at some tokens, and serving stacks that
dropped the clamp produced wrong tokens there — the shared expert's clamp missing gave deterministic spurious
tokens at sentence boundaries (sgl-project/sglang PR #23776; vllm-project/vllm PR #40950), the routed experts'
"severe next-token logit cliffs" at sensitive prefixes (vllm-project/vllm-ascend #14363). The synthetic experts
without such a channel never reach it on the CPU demo's prompt (every pre-activation within ±10, most within ±6),
so a variant without the clamp computed the same numbers as one with it and passed every check. No public figure
gives how often the limit is passed; the norm aims at some tokens in a hundred, not most.

Derivation: the tensor's largest magnitude is ≈ max|z|/√D over its out·D draws — 3.6/√D at flash-mini's 64×64,
5.3/√D at Flash's 2048×4096 — so a flat row on every column has norm ≈ 3.6 at flash-mini (all 64 columns: the
cap there) and takes (4.0/5.3)² ≈ 57% of Flash's columns. The expert input is RMS-normalized times norm weights with
mean square ≈ 1.3, so at Flash width (the outlier channel ~4% of the input's square) the channel's pre-activation has
std ≈ 4.0·1.14 ≈ 4.6: the gate passes 10 at P(Z > 2.2) ≈ 1.5% of tokens and the up row ±10 at twice that (the
rows' signs and columns are independent draws), ~4% of tokens at the channel. At flash-mini's D = 64 the outlier
channel holds most of the input's square (12² against 63·1 at layer 0), so the token-varying part — and the share —
is smaller and grows with the streams: on the CPU demo's first 2,048 prompt tokens routed (token, expert) pairs pass
the limit in 7 of the first 12 layers (0.03–8%), the shared expert at 0.1–4% of tokens in 4 of them, by up to 1.6×
the limit (tests/test_calibration.py)."""
