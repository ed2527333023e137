"""The report's data: a run directory reduced to the compact JSON payload the HTML page draws from.

The run's metrics.parquet holds one row per (variant, mode, layer, bin, tap, metric) — millions of rows for
a 43-layer, 27K-token run with eight variants. The page needs two reductions of it:

- per layer: each series (tap, metric) aggregated over a phase's bins, for every variant and mode
  (`mean` over positions, and `worst` = the largest per-position value, or the lowest bin for metrics where
  higher is better);
- per layer × position bin, global mode, for the HEATMAP_METRICS only (the heatmap and the per-position
  charts).

Numbers are rounded to SIGNIFICANT_DIGITS; missing cells are null and non-finite values are the strings
in NONFINITE (strict JSON has no NaN/Infinity).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from harness.errors import UsageError
from harness.run.store import RunStore

YARDSTICK = "yardstick"  # harness.run.runner.YARDSTICK (not imported: the runner pulls in torch models)
SIGNIFICANT_DIGITS = 3
NONFINITE = {"nan": "__nan__", "inf": "__inf__", "-inf": "__-inf__"}


@dataclass(frozen=True)
class MetricInfo:
    family: str  # section of DESIGN §4: streams, attention, indexer, mhc, moe, logits, context
    label: str
    better: str  # "lower" | "higher" (bounded by 1: recall, agreement, cosine) | "sqnr" | "neutral"
    scale: str  # "log" | "linear": how charts draw it


METRICS: dict[str, MetricInfo] = {
    "streams.rel_l2": MetricInfo("streams", "stream rel L2", "lower", "log"),
    "streams.cosine": MetricInfo("streams", "stream cosine", "higher", "linear"),
    "streams.sqnr_db": MetricInfo("streams", "stream SQNR dB", "sqnr", "linear"),
    "streams.max_abs": MetricInfo("streams", "stream max |err|", "lower", "log"),
    "streams.bias": MetricInfo("streams", "stream bias (mean signed err)", "neutral", "linear"),
    "streams.amplification": MetricInfo("streams", "amplification global(L)/global(L−1)", "neutral", "linear"),
    "attn.tv": MetricInfo("attention", "attention TV", "lower", "log"),
    "attn.kl": MetricInfo("attention", "attention KL(ref‖opt)", "lower", "log"),
    "attn.js": MetricInfo("attention", "attention JS", "lower", "log"),
    "attn.out_rel_l2": MetricInfo("attention", "attention output rel L2", "lower", "log"),
    "attn.lse_delta": MetricInfo("attention", "LSE |Δ|", "lower", "log"),
    "attn.max_logit_delta": MetricInfo("attention", "max-logit |Δ|", "lower", "log"),
    "indexer.recall": MetricInfo("indexer", "indexer recall@k", "higher", "linear"),
    "indexer.mass_recall": MetricInfo("indexer", "indexer mass recall", "higher", "linear"),
    "indexer.boundary_recall": MetricInfo("indexer", "indexer boundary-aware recall", "higher", "linear"),
    "indexer.fp8_boundary_recall": MetricInfo("indexer", "indexer recall outside FP8 ties", "higher", "linear"),
    "indexer.fp8_window_share": MetricInfo("indexer", "share of the picks outside FP8 ties (what the FP8 recall judges)",
                                           "neutral", "linear"),
    "indexer.flips": MetricInfo("indexer", "indexer flips per query", "lower", "linear"),
    "indexer.rows_rel_l2": MetricInfo("indexer", "indexer-compressor rows rel L2", "lower", "log"),
    "compressor.rows_rel_l2": MetricInfo("indexer", "compressor rows rel L2", "lower", "log"),
    "mhc.pre_rel_err": MetricInfo("mhc", "mHC pre rel err", "lower", "log"),
    "mhc.post_rel_err": MetricInfo("mhc", "mHC post rel err", "lower", "log"),
    "mhc.comb_rel_err": MetricInfo("mhc", "mHC comb rel err", "lower", "log"),
    "mhc.ds_residual": MetricInfo("mhc", "mHC doubly-stochastic residual", "lower", "log"),
    "moe.flip_rate": MetricInfo("moe", "MoE expert flip rate", "lower", "linear"),
    "moe.weight_l1": MetricInfo("moe", "MoE routing-weight L1", "lower", "log"),
    "moe.out_rel_l2": MetricInfo("moe", "MoE output rel L2", "lower", "log"),
    "logits.kl": MetricInfo("logits", "logits KL", "lower", "log"),
    "logits.top1_agree": MetricInfo("logits", "top-1 agreement", "higher", "linear"),
    "logits.top1_flip_strict": MetricInfo("logits", "top-1 flips beyond a bf16 ulp", "lower", "linear"),
    "ctx.earlier_turn_mass_ref": MetricInfo("context", "earlier-turn attention mass (reference)", "neutral", "linear"),
    "ctx.earlier_turn_mass_opt": MetricInfo("context", "earlier-turn attention mass (variant)", "neutral", "linear"),
    "ctx.needle_mass_ref": MetricInfo("context", "needle attention mass (reference)", "neutral", "linear"),
    "ctx.needle_mass_opt": MetricInfo("context", "needle attention mass (variant)", "neutral", "linear"),
    "ctx.earlier_turn_recall": MetricInfo("context", "earlier-turn indexer recall", "higher", "linear"),
    "ctx.needle_recall": MetricInfo("context", "needle indexer recall", "higher", "linear"),
    "ctx.earlier_turn_pick_share": MetricInfo("context", "1 / earlier-turn picks per query", "neutral", "linear"),
    "ctx.needle_pick_share": MetricInfo("context", "1 / needle picks per query", "neutral", "linear"),
    "ctx.needle_answer": MetricInfo("context", "needle answer rate", "higher", "linear"),
    "ctx.needle_answer_ref": MetricInfo("context", "needle answer rate (reference)", "neutral", "linear"),
    "ctx.needle_margin": MetricInfo("context", "needle answer margin", "neutral", "linear"),
    "ctx.needle_margin_ref": MetricInfo("context", "needle answer margin (reference)", "neutral", "linear"),
    "ctx.needle_lost": MetricInfo("context", "needle answers lost", "lower", "linear"),
    "moe.site_flip_rate": MetricInfo("moe", "router site: expert flips vs the stock router", "lower", "linear"),
    "moe.twin_flip_rate": MetricInfo("moe", "router site: the stock router's twin's flips", "lower", "linear"),
    "mhc.site_rel_err": MetricInfo("mhc", "mHC site: rel err vs the stock hc_pre", "lower", "log"),
    "mhc.twin_rel_err": MetricInfo("mhc", "mHC site: the stock hc_pre's twin's rel err", "lower", "log"),
    "mhc.site_ds_residual": MetricInfo("mhc", "mHC site: doubly-stochastic residual vs the stock Sinkhorn", "lower",
                                       "log"),
    "indexer.site_recall": MetricInfo("indexer", "indexer site: recall of the stock top-k", "higher", "linear"),
    "indexer.twin_recall": MetricInfo("indexer", "indexer site: the stock top-k's twin's recall", "higher", "linear"),
    "indexer.site_margin_loss": MetricInfo("indexer", "indexer site: stock picks lost that were no tie", "lower",
                                           "linear"),
    "moe.clamp_site_miss": MetricInfo("moe", "MoE clamp site: tokens on the wrong side of the SwiGLU clamp", "lower",
                                      "linear"),
    "moe.pair_site_loss": MetricInfo("moe", "MoE pair site: tokens missing, repeating or misweighing a pair",
                                     "lower", "linear"),
    "moe.expert_site_bias": MetricInfo("moe", "MoE expert site: tokens routed to an expert scaled at most tokens",
                                       "lower", "linear"),
    "attn.kv_site_mismatch": MetricInfo("attention", "KV cache site: rows that read back other than written", "lower",
                                        "linear"),
    "mhc.post_site_excess": MetricInfo("mhc", "mHC post site: outputs beyond fp32 rounding of the stock hc_post",
                                       "lower", "linear"),
    "indexer.site_future": MetricInfo("indexer", "indexer site: picks of rows the query may not see yet", "lower",
                                      "linear"),
    "attn.site_lse_err": MetricInfo("attention", "attention site: |ΔLSE| vs the stock op", "lower", "log"),
    "attn.twin_lse_err": MetricInfo("attention", "attention site: the stock op's twin's |ΔLSE|", "lower", "log"),
    "moe.site_weight_err": MetricInfo("moe", "router site: routing-weight rel err vs the stock router", "lower",
                                      "log"),
    "moe.twin_weight_err": MetricInfo("moe", "router site: the stock router's twin's weight rel err", "lower", "log"),
}

HEATMAP_METRICS = (
    "streams.rel_l2", "attn.tv", "attn.out_rel_l2", "indexer.recall", "indexer.mass_recall",
    "indexer.boundary_recall", "mhc.comb_rel_err", "moe.flip_rate", "moe.out_rel_l2",
    "ctx.earlier_turn_recall", "ctx.needle_recall",
)
"""Metrics kept per (layer, position bin) in global mode: one or two per family, so the page stays small."""

GROUP_KEYS = ["variant", "mode", "layer", "phase", "tap", "metric"]

NEEDLE_ANSWER = "ctx.needle_answer"
NEEDLE_MARGIN = "ctx.needle_margin"
NEEDLE_LOST = "ctx.needle_lost"
LENS_TAP = "needle.lens"
LOGITS_TAP = "logits"
"""The needle answer as an outcome, per needle query (a decode step whose continuation only a needle gives):
1 when a stack's top-1 is the needle's continuation (`_ref`: the reference's), the logit margin, and `lost` where
the reference answers beyond FP8 noise and the stack does not. The run records it on the final logits row (tap
`logits`) and through each layer's logit lens (tap `needle.lens`); `needle_outcome` reads it for the page and the
figures alike."""


def metric_info(metric: str) -> MetricInfo:
    """Known metrics from METRICS; anything else (a user's plugin metric) is drawn as a lower-is-better log series."""
    if metric in METRICS:
        return METRICS[metric]
    return MetricInfo(metric.split(".")[0], metric, "lower", "log")


def badness(metric: str, value: float) -> float | None:
    """The metric as an error (0 = perfect, larger = worse), as the page's heatmap draws it: 1 − v for
    recall-like metrics, the amplitude noise ratio 10^(−dB/20) for SQNR, None for neutral ones. A magnitude, not a
    verdict: pass/fail colours come from the gate only."""
    better = metric_info(metric).better
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    if better == "lower":
        return abs(value) if metric.endswith((".bias", "_delta")) else value
    if better == "higher":
        return 1.0 - value
    if better == "sqnr":
        return 10.0 ** (-value / 20.0)
    return None


# ----------------------------------------------------------------------------------------------
# number encoding
# ----------------------------------------------------------------------------------------------


def num(x: Any) -> Any:
    """One number for the payload: rounded, None for missing, a NONFINITE string for NaN/±inf."""
    if x is None:
        return None
    x = float(x)
    if math.isnan(x):
        return NONFINITE["nan"]
    if math.isinf(x):
        return NONFINITE["inf"] if x > 0 else NONFINITE["-inf"]
    if x == 0:
        return 0
    r = float(f"{x:.{SIGNIFICANT_DIGITS}g}")
    return int(r) if r.is_integer() and abs(r) < 1e15 else r


def nums(values: np.ndarray, present: np.ndarray | None = None) -> list[Any]:
    """An array for the payload; `present` False marks missing cells (null)."""
    out = [num(v) for v in values.tolist()]
    if present is not None:
        out = [v if p else None for v, p in zip(out, present.tolist())]
    return out


CODE_ALPHABET = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
CODE_LEVELS = 4092
CODE_MISSING, CODE_NAN, CODE_POS_INF, CODE_NEG_INF = 4095, 4094, 4093, 4092
_PAIRS = np.array([a + b for a in CODE_ALPHABET for b in CODE_ALPHABET])


def pack_row(values: np.ndarray, present: np.ndarray) -> list[Any] | None:
    """A heatmap row as [lo, hi, log, codes]: every value is one of CODE_LEVELS steps between the row's
    finite min and max (log-spaced when all are positive), written as two base64url characters; codes
    4092–4095 are −inf, +inf, NaN and missing. 2 characters per cell instead of ~7 for a JSON number;
    the error is below 1/4091 of the row's (log) range, far under a colour step. None if the row is empty."""
    if not present.any():
        return None
    finite = present & np.isfinite(values)
    codes = np.full(values.shape, CODE_MISSING, dtype=np.int64)
    codes[present & np.isnan(values)] = CODE_NAN
    codes[present & (values == np.inf)] = CODE_POS_INF
    codes[present & (values == -np.inf)] = CODE_NEG_INF
    lo = hi = 0.0
    use_log = False
    if finite.any():
        f = values[finite]
        lo, hi = float(f.min()), float(f.max())
        use_log = lo > 0 and hi / lo > 4
        if use_log:
            t = (np.log(f) - np.log(lo)) / (np.log(hi) - np.log(lo))
        else:
            t = (f - lo) / (hi - lo) if hi > lo else np.zeros_like(f)
        codes[finite] = np.rint(np.clip(t, 0, 1) * (CODE_LEVELS - 1)).astype(np.int64)
    return [num_exact(lo), num_exact(hi), int(use_log), "".join(_PAIRS[codes].tolist())]


def unpack_row(row: list[Any] | None, n_bins: int) -> tuple[np.ndarray, np.ndarray]:
    """pack_row's inverse, read as the page's unpackRow reads it: (values, measured). values holds a float per
    bin (NaN where missing, NaN and ±inf as measured); measured is False where the bin has no value, so a
    measured NaN can be told from a gap. An empty row (None) is all missing."""
    values, measured = np.full(n_bins, np.nan), np.zeros(n_bins, bool)
    if row is None:
        return values, measured
    lo, hi, use_log, chars = row
    index = {c: i for i, c in enumerate(CODE_ALPHABET)}
    codes = np.array([index[a] * len(CODE_ALPHABET) + index[b] for a, b in zip(chars[0::2], chars[1::2])],
                     dtype=np.int64)[:n_bins]
    t = np.minimum(codes, CODE_LEVELS - 1) / (CODE_LEVELS - 1)
    decoded = np.exp(np.log(lo) + t * (np.log(hi) - np.log(lo))) if use_log else lo + t * (hi - lo)
    decoded[codes == CODE_POS_INF] = np.inf
    decoded[codes == CODE_NEG_INF] = -np.inf
    decoded[(codes == CODE_NAN) | (codes == CODE_MISSING)] = np.nan
    values[:len(codes)] = decoded
    measured[:len(codes)] = codes != CODE_MISSING
    return values, measured


def num_exact(x: float) -> float | int:
    """A row bound, to 7 significant digits (the codes are relative to it)."""
    r = float(f"{x:.7g}")
    return int(r) if r.is_integer() and abs(r) < 1e15 else r


def trim_nulls(values: list[Any]) -> list[Any] | None:
    """An all-missing series is dropped (None) rather than shipped as a list of nulls."""
    return None if all(v is None for v in values) else values


# ----------------------------------------------------------------------------------------------
# loading
# ----------------------------------------------------------------------------------------------


def read_metrics_frame(store: RunStore) -> pd.DataFrame:
    """metrics.parquet with the string columns as categoricals (a large run has millions of rows)."""
    if not store.metrics_path.is_file():
        return pd.DataFrame(columns=["variant", "mode", "layer", "phase", "chunk", "step", "turn", "pos_bin",
                                     "pos_end", "tap", "metric", "value", "max", "count"])
    frame = store.read_metrics().to_pandas(strings_to_categorical=True)
    for c in ("variant", "mode", "phase", "tap", "metric"):
        if not isinstance(frame[c].dtype, pd.CategoricalDtype):
            frame[c] = frame[c].astype("category")
    return frame


def read_optional_json(path: Path) -> tuple[Any, str | None]:
    """(data, problem): a missing file is (None, None); an unreadable one is (None, the reason)."""
    if not path.is_file():
        return None, None
    try:
        return json.loads(path.read_text()), None
    except (OSError, ValueError) as e:
        return None, f"{path.name} could not be read: {e}"


def series_keys(frame: pd.DataFrame) -> dict[tuple[str, str], str]:
    """(tap, metric) -> the series key: the metric name, or 'metric@tap' where one metric comes from several
    taps (mHC metrics from attn.hc and ffn.hc)."""
    pairs = frame[["tap", "metric"]].drop_duplicates()
    pairs = [(str(t), str(m)) for t, m in pairs.itertuples(index=False)]
    taps_of: dict[str, int] = {}
    for _, m in pairs:
        taps_of[m] = taps_of.get(m, 0) + 1
    return {(t, m): (m if taps_of[m] == 1 else f"{m}@{t}") for t, m in pairs}


def metric_of_key(key: str) -> str:
    return key.split("@", 1)[0]


# ----------------------------------------------------------------------------------------------
# aggregation
# ----------------------------------------------------------------------------------------------


def _category_flags(column: pd.Series, test) -> np.ndarray:
    """test(name) for every row of a categorical column, evaluated once per category."""
    flags = np.array([bool(test(str(c))) for c in column.cat.categories] + [False])
    return flags[column.cat.codes.to_numpy()]  # code −1 (missing) reads the trailing False


def per_layer(frame: pd.DataFrame, keys: dict[tuple[str, str], str]) -> pd.DataFrame:
    """One row per (variant, mode, layer, phase, tap, metric): count-weighted mean over the phase's bins,
    and the worst value (largest per-position max; lowest bin value for higher-is-better metrics); both NaN
    when any bin is NaN.

    rel_l2 bins combine as a weighted root-mean-square and SQNR through its noise power: exact when the
    positions' reference norms are equal, and a close, order-independent approximation otherwise (the
    exact sums are not stored per bin)."""
    if frame.empty:
        return pd.DataFrame(columns=GROUP_KEYS + ["key", "mean", "worst", "count"])
    f = frame[GROUP_KEYS + ["value", "max", "count"]].copy()
    w = f["count"].astype(np.float64)
    v = f["value"].astype(np.float64)
    is_rel = _category_flags(f["metric"], lambda m: m.endswith("rel_l2"))
    is_sqnr = _category_flags(f["metric"], lambda m: m.endswith("sqnr_db"))
    with np.errstate(over="ignore", invalid="ignore"):
        transformed = np.where(is_rel, v * v, np.where(is_sqnr, 10.0 ** (-v / 10.0), v))
    f["wsum"] = transformed * w
    f["w"] = w
    f["lowest"] = v
    f["nan"] = (np.isnan(v) | np.isnan(f["max"].astype(np.float64))).astype(np.int64)
    f["count"] = f["count"].astype(np.int64)
    g = f.groupby(GROUP_KEYS, observed=True, sort=False).agg(
        wsum=("wsum", "sum"), w=("w", "sum"), peak=("max", "max"), lowest=("lowest", "min"),
        count=("count", "sum"), nan=("nan", "sum"))
    g = g.reset_index()
    metric = g["metric"].astype(str)
    is_rel = metric.str.endswith("rel_l2").to_numpy()
    is_sqnr = metric.str.endswith("sqnr_db").to_numpy()
    with np.errstate(divide="ignore", invalid="ignore"):
        m = (g["wsum"] / g["w"]).to_numpy()
        mean = np.where(is_rel, np.sqrt(m), np.where(is_sqnr, -10.0 * np.log10(m), m))
    g["mean"] = mean
    higher = metric.map(lambda name: metric_info(name).better in ("higher", "sqnr")).to_numpy(bool)
    g["worst"] = np.where(higher, g["lowest"], g["peak"])
    poisoned = g["nan"].to_numpy() > 0  # pandas sums skip NaN; a NaN anywhere in the layer must show
    g.loc[poisoned, ["mean", "worst"]] = np.nan
    g["key"] = [keys[(str(t), str(mt))] for t, mt in zip(g["tap"], g["metric"])]
    return g[GROUP_KEYS + ["key", "mean", "worst", "count"]]


def layer_table(agg: pd.DataFrame, n_layers: int) -> dict[str, Any]:
    """{mode: {variant: {key: {phase: {"mean": [L], "worst": [L]}}}}} over layers 0 … n_layers−1."""
    out: dict[str, Any] = {}
    body = agg[agg["layer"] < n_layers]
    for (mode, variant, key, phase), part in body.groupby(["mode", "variant", "key", "phase"], observed=True,
                                                          sort=False):
        mean = np.full(n_layers, np.nan)
        worst = np.full(n_layers, np.nan)
        present = np.zeros(n_layers, bool)
        idx = part["layer"].to_numpy(int)
        mean[idx] = part["mean"].to_numpy(float)
        worst[idx] = part["worst"].to_numpy(float)
        present[idx] = True
        slot = out.setdefault(str(mode), {}).setdefault(str(variant), {}).setdefault(key, {})
        slot[str(phase)] = {"mean": nums(mean, present), "worst": nums(worst, present)}
    # amplification = global(L) / global(L−1) of the stream rel L2 (DESIGN §3)
    for variant, series in out.get("global", {}).items():
        streams = series.get("streams.rel_l2")
        if not streams:
            continue
        amp = {}
        for phase, vals in streams.items():
            mean = [v if isinstance(v, (int, float)) else None for v in vals["mean"]]
            ratio = [None] + [num(b / a) if a and b is not None else None for a, b in zip(mean[:-1], mean[1:])]
            amp[phase] = {"mean": ratio, "worst": ratio}
        series["streams.amplification"] = amp
    return out


def logits_summary(agg: pd.DataFrame, n_layers: int) -> dict[str, Any]:
    """{variant: {phase: {metric: {"mean", "worst"}}}} from the final-logits rows (layer == n_layers)."""
    out: dict[str, Any] = {}
    for r in agg[(agg["layer"] == n_layers) & (agg["mode"] == "global")].itertuples(index=False):
        out.setdefault(str(r.variant), {}).setdefault(str(r.phase), {})[r.key] = {
            "mean": num(r.mean), "worst": num(r.worst), "count": int(r.count)}
    return out


def needle_outcome(frame: pd.DataFrame, agg: pd.DataFrame, n_layers: int, order: list[str]) -> dict[str, Any] | None:
    """The needle answer, the context-loss lens's outcome (global mode, decode): None when no stack has an answer
    row (no decode step asks for a needle). Otherwise

        {"queries": Q, "reference": {"answered", "rate", "margin", "lens"},
         "stacks": {variant: {"queries", "answered", "rate", "lost", "margin", "lens", "lens_lost", "first_lost"}}}

    At the final logits (tap `logits`): the needle queries, how many the stack answers (top-1 = the needle's
    continuation), the answers lost (`ctx.needle_lost`: the reference was sure beyond FP8 noise, the stack
    missed) and the median margin (logit of the answer − the best other; a median, because one query the stack
    gets badly wrong should not hide that it answers the rest). Through each layer's logit lens (tap
    `needle.lens`): the answer rate per layer (`lens`, layers 0 … n_layers−1: where the answer appears, the
    retrieval layers), the answers lost there (`lens_lost`) and the first layer that loses one (`first_lost`,
    n_layers for the logits). Every stack's rows carry the same reference side (`_ref`): it is read from the first
    stack in `order` that has it."""
    wanted = [NEEDLE_ANSWER, f"{NEEDLE_ANSWER}_ref", NEEDLE_MARGIN, f"{NEEDLE_MARGIN}_ref", NEEDLE_LOST]
    rows = frame[frame["metric"].isin(wanted) & (frame["mode"] == "global") & (frame["phase"] == "decode")]
    final = rows[(rows["layer"] == n_layers) & (rows["tap"] == LOGITS_TAP)]
    if final.empty or not (final["metric"] == NEEDLE_ANSWER).any():
        return None
    lens = agg[(agg["tap"] == LENS_TAP) & (agg["mode"] == "global") & (agg["phase"] == "decode")
               & (agg["layer"] < n_layers)]

    def side(variant: str, suffix: str) -> dict[str, Any] | None:
        """One side (the stack's, or with suffix `_ref` the reference's) of a variant's rows."""
        mine = final[final["variant"] == variant]
        answers = mine[mine["metric"] == NEEDLE_ANSWER + suffix]
        if answers.empty:
            return None
        counts = answers["count"].to_numpy(np.int64)
        queries = int(counts.sum())
        answered = int(round(float((answers["value"].to_numpy(float) * counts).sum())))
        margins = mine[mine["metric"] == NEEDLE_MARGIN + suffix]
        per_layer = np.full(n_layers, np.nan)
        present = np.zeros(n_layers, bool)
        part = lens[(lens["variant"] == variant) & (lens["metric"] == NEEDLE_ANSWER + suffix)]
        per_layer[part["layer"].to_numpy(int)] = part["mean"].to_numpy(float)
        present[part["layer"].to_numpy(int)] = True
        return {"queries": queries, "answered": answered, "rate": num(answered / queries) if queries else None,
                "margin": num(np.median(np.repeat(margins["value"].to_numpy(float),
                                                  margins["count"].to_numpy(np.int64)))) if len(margins) else None,
                "lens": trim_nulls(nums(per_layer, present))}

    stacks: dict[str, Any] = {}
    for variant in order:
        mine = side(variant, "")
        if mine is None:
            continue
        lost_final = final[(final["variant"] == variant) & (final["metric"] == NEEDLE_LOST)]
        lost = int(round(float((lost_final["value"].to_numpy(float) * lost_final["count"].to_numpy(np.int64)).sum())))
        part = lens[(lens["variant"] == variant) & (lens["metric"] == NEEDLE_LOST)]
        lens_lost: list[int | None] = [None] * n_layers
        for layer, mean, count in zip(part["layer"].to_numpy(int), part["mean"].to_numpy(float),
                                      part["count"].to_numpy(np.int64)):
            lens_lost[layer] = int(round(mean * count)) if math.isfinite(mean) else None
        first_lost = next((layer for layer, n in enumerate(lens_lost) if n), n_layers if lost else None)
        stacks[variant] = {**mine, "lost": lost, "lens_lost": trim_nulls(lens_lost), "first_lost": first_lost}
    reference = next((r for v in order if (r := side(v, "_ref")) is not None), None)
    return {"queries": reference["queries"] if reference else max(s["queries"] for s in stacks.values()),
            "reference": reference, "stacks": stacks}


def bins_of(frame: pd.DataFrame) -> pd.DataFrame:
    cols = ["phase", "chunk", "step", "turn", "pos_bin", "pos_end"]
    if frame.empty:
        return pd.DataFrame(columns=cols)
    b = frame[cols].drop_duplicates(subset=["pos_bin"]).copy()
    b["phase"] = b["phase"].astype(str)
    return b.sort_values("pos_bin").reset_index(drop=True)


def heatmaps(frame: pd.DataFrame, bins: pd.DataFrame, keys: dict[tuple[str, str], str], n_layers: int
             ) -> dict[str, Any]:
    """{key: {variant: [per layer: [per bin] | null]}} in global mode for HEATMAP_METRICS."""
    wanted = {k: v for k, v in keys.items() if metric_of_key(v) in HEATMAP_METRICS
              and (v == metric_of_key(v) or v.endswith("@attn.hc"))}
    if not wanted or bins.empty:
        return {}
    bin_starts = bins["pos_bin"].to_numpy(np.int64)  # sorted
    g = frame[(frame["mode"] == "global") & (frame["layer"] < n_layers)]
    g = g[g["metric"].isin([m for _, m in wanted])]
    out: dict[str, Any] = {}
    for (tap, metric, variant), part in g.groupby(["tap", "metric", "variant"], observed=True, sort=False):
        key = wanted.get((str(tap), str(metric)))
        if key is None or part.empty:
            continue
        grid = np.full((n_layers, len(bins)), np.nan)
        present = np.zeros((n_layers, len(bins)), bool)
        rows = part["layer"].to_numpy(int)
        cols = np.searchsorted(bin_starts, part["pos_bin"].to_numpy(np.int64))
        grid[rows, cols] = part["value"].to_numpy(float)
        present[rows, cols] = True
        out.setdefault(key, {})[str(variant)] = [pack_row(grid[layer], present[layer]) for layer in range(n_layers)]
    return out


def _as_float(v: Any) -> float | None:
    if v is None:
        return None
    if isinstance(v, str):
        return {NONFINITE["nan"]: math.nan, NONFINITE["inf"]: math.inf, NONFINITE["-inf"]: -math.inf}.get(v)
    return float(v)


# ----------------------------------------------------------------------------------------------
# gate.json and attribution.json, normalised for the page
# ----------------------------------------------------------------------------------------------


def _float(x: Any) -> float | None:
    """A number from another tool's JSON: floats, ints, or the strings "nan"/"inf"/"-inf" (gate.json)."""
    if isinstance(x, bool) or x is None:
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, str):
        try:
            return float(x)
        except ValueError:
            return _as_float(x)
    return None


def _compact(d: dict[str, Any]) -> dict[str, Any]:
    """Drop missing fields (gate rows are many; the page reads absent as missing)."""
    return {k: v for k, v in d.items() if v is not None}


def _rounded(x: Any) -> Any:
    f = _float(x)
    return num(f) if f is not None else x


def _key_for(keys: dict[tuple[str, str], str], metric: Any, tap: Any) -> str | None:
    if (str(tap), str(metric)) in keys:
        return keys[(str(tap), str(metric))]
    return str(metric) if metric is not None else None


def _unit_ratio(unit: dict[str, Any]) -> float | None:
    """value / the binding limit (the policy bound, or the baseline's where tighter); > 1 fails."""
    value = _float(unit.get("value"))
    limits = [x for x in (_float(unit.get("limit")), _float(unit.get("baseline_limit"))) if x is not None]
    if value is None or not limits:
        return math.inf if unit.get("status") == "fail" else None
    limit = min(limits)
    if math.isnan(value):
        return math.inf
    ratio = value / limit if limit > 0 else (math.inf if value > 0 else 0.0)
    if unit.get("status") == "fail" and not ratio > 1:
        ratio = math.nextafter(1.0, 2.0)
    return ratio


def _group_fields(unit: dict[str, Any], prefix: str) -> dict[str, Any]:
    """Where a gate unit sits inside its layer, as `{prefix}scope`, `{prefix}group`, `{prefix}span`: the check's
    scope (layer, chunk, turn, step, bin), the group (chunk, turn or step index, a bin's first position; None for
    the whole layer and phase) and its positions [first, end). Empty for a layer-scope unit."""
    if not isinstance(unit, dict) or unit.get("group") is None or unit.get("scope", "layer") == "layer":
        return {}
    span = unit.get("span")
    return {f"{prefix}scope": unit.get("scope"), f"{prefix}group": unit.get("group"),
            f"{prefix}span": list(span) if isinstance(span, list) and len(span) == 2 else None}


def _bin_ranges(spans: list[tuple[int, int]], bin_starts: np.ndarray) -> list[list[int]]:
    """Position spans [first, end) as merged ranges of bin indices [b0, b1): a group is a set of whole bins
    (harness.run.bins), so the bins whose first position lies in the span are exactly the group's."""
    marked = np.zeros(len(bin_starts) + 1, np.int64)
    for first, end in spans:
        marked[np.searchsorted(bin_starts, first)] += 1
        marked[np.searchsorted(bin_starts, end)] -= 1
    inside = np.cumsum(marked[:-1]) > 0
    edges = np.flatnonzero(np.diff(np.concatenate([[0], inside.astype(np.int8), [0]])))
    return [[int(b0), int(b1)] for b0, b1 in zip(edges[0::2], edges[1::2])]


def gate_view(raw: Any, keys: dict[tuple[str, str], str], n_layers: int,
              bin_starts: np.ndarray | None = None) -> dict[str, Any] | None:
    """gate.json as the page reads it, from either shape:

    - the gate's own format ("dsv4-drift-gate/1": checks × variants × phases, with per-layer units), or
    - a flat one: {"passed", "policy", "checks": [{name, metric, variant, phase, status, first_failing_layer,
      worst_value, bound}], "findings"}.

    rows: one per check × variant × phase (check_info: each check's description, bound text, aggregate,
    direction, scope), with the first failing unit's and the worst unit's layer, mode, value, limit and — for a
    group scope (chunk, turn, step, bin) — group and span (`first_group`, `first_span`, …), and the number of
    failing units;
    failing: one per failing check × variant (the banner): its first failing unit (where: layer, phase, mode, tap,
    scope, group, span; value and limit), the number of failing units and the gate's own line for it;
    cells: {series key: {variant: {mode: {phase: {"ratio", "check", "value", "limit": [per layer 0 … n_layers],
    "where": {layer: [group, first, end]}}}}}} (the last entry: the final logits row): at each layer the most
    binding check's loss over its limit, the check (an index into check_names), its loss and the limit it was
    held to, and where that unit is a group of a group scope, the group. These are the page's only colours: a
    cell the gate did not judge is not coloured;
    failing_groups: {variant: [{"check", "mode", "scope", "layers": {layer: [[first bin, end bin), …]]}}]}: the
    bins (indices into the payload's bins, from `bin_starts`) of every failing unit of a group scope, per check
    and mode, for the heatmap's outlines."""
    if not isinstance(raw, dict):
        return None
    verdict = raw.get("verdict")
    passed = raw.get("passed") if isinstance(raw.get("passed"), bool) else (
        True if verdict == "pass" else False if verdict == "fail" else None)
    policy = raw.get("policy")
    if isinstance(policy, dict):
        policy_text = policy.get("file") or policy.get("name") or ""
        policy_description = policy.get("description")
    else:
        policy_text, policy_description = (str(policy) if policy is not None else None), None
    failures = raw.get("failures") if isinstance(raw.get("failures"), list) else None
    rows: list[dict[str, Any]] = []
    failing: list[dict[str, Any]] = []
    check_names: list[str] = []
    check_info: dict[str, dict[str, Any]] = {}
    best: dict[tuple, tuple[float, int, Any, Any, Any]] = {}
    group_spans: dict[tuple[str, int, str], dict[int, list[tuple[int, int]]]] = {}
    checks = raw.get("checks") if isinstance(raw.get("checks"), list) else []
    for check in checks:
        if not isinstance(check, dict):
            continue
        name = str(check.get("name") or check.get("metric") or "check")
        variants = check.get("variants")
        if not isinstance(variants, list):  # the flat shape: one row per check
            rows.append({"check": name, "description": check.get("description"), "metric": check.get("metric"),
                         "variant": check.get("variant"), "phase": check.get("phase"), "status": check.get("status"),
                         "first_failing_layer": check.get("first_failing_layer"),
                         "worst_value": check.get("worst_value"), "bound": check.get("bound"),
                         "bound_text": check.get("bound_text")})
            continue
        check_index = len(check_names)
        check_names.append(name)
        scope = str(check.get("scope") or "layer")
        check_info[name] = _compact({"description": check.get("description"), "bound_text": check.get("bound_text"),
                                     "aggregate": check.get("aggregate"), "taps": check.get("taps"),
                                     "modes": check.get("modes"), "severity": check.get("severity"),
                                     "metric": check.get("metric"), "direction": check.get("direction"),
                                     "scope": scope})
        for vr in variants:
            if not isinstance(vr, dict):
                continue
            units = [u for u in vr.get("units") or [] if isinstance(u, dict)]
            phases = vr.get("phases") if isinstance(vr.get("phases"), dict) else {}
            for phase, pr in (phases.items() or [(None, {})]):
                pr = pr if isinstance(pr, dict) else {}
                first = pr.get("first_failure") if isinstance(pr.get("first_failure"), dict) else {}
                worst = pr.get("worst") if isinstance(pr.get("worst"), dict) else {}
                rows.append(_compact({"check": name, "metric": check.get("metric"), "variant": vr.get("variant"),
                                      "phase": phase, "status": pr.get("status", vr.get("status")),
                                      "reason": vr.get("reason") or None,
                                      "first_failing_layer": pr.get("first_failing_layer"),
                                      "first_value": _rounded(first.get("value")),
                                      "first_limit": _rounded(first.get("limit")),
                                      "first_tap": first.get("tap"), "first_mode": first.get("mode"),
                                      **_group_fields(first, "first_"),
                                      "worst_value": _rounded(worst.get("value")),
                                      "worst_limit": _rounded(worst.get("limit")),
                                      "worst_layer": worst.get("layer"), "worst_mode": worst.get("mode"),
                                      **_group_fields(worst, "worst_"),
                                      "failing_units": sum(u.get("status") == "fail" and u.get("phase") == phase
                                                           for u in units) or None}))
            if not phases:
                rows.append({"check": name, "metric": check.get("metric"), "variant": vr.get("variant"), "phase": None,
                             "status": vr.get("status"), "reason": vr.get("reason") or None,
                             "bound_text": check.get("bound_text")})
            first = vr.get("first_failure")
            if vr.get("status") == "fail" and isinstance(first, dict):
                prefix = f"{name} [{vr.get('variant')}]:"
                failing.append(_compact({
                    "check": name, "metric": check.get("metric"), "variant": vr.get("variant"),
                    "layer": first.get("layer"), "phase": first.get("phase"), "mode": first.get("mode"),
                    "tap": first.get("tap"), **_group_fields(first, ""), "value": _rounded(first.get("value")),
                    "limit": _rounded(first.get("limit")),
                    "failing_units": sum(u.get("status") == "fail" for u in units),
                    "line": next((f for f in failures or [] if isinstance(f, str) and f.startswith(prefix)), None)}))
            for unit in units:
                if not isinstance(unit.get("layer"), int):
                    continue
                layer = unit["layer"]
                if not 0 <= layer <= n_layers:
                    continue
                variant = str(unit.get("variant", vr.get("variant")))
                mode = str(unit.get("mode", "global"))
                where = _group_fields(unit, "")
                if where and unit.get("status") == "fail" and layer < n_layers and where["span"]:
                    group_spans.setdefault((variant, check_index, mode), {}).setdefault(layer, []).append(
                        tuple(where["span"]))
                key = _key_for(keys, check.get("metric"), unit.get("tap"))
                ratio = _unit_ratio(unit)
                if key is None or ratio is None:
                    continue
                cell = (key, variant, mode, str(unit.get("phase")), layer)
                if cell not in best or ratio > best[cell][0]:
                    limits = [x for x in (_float(unit.get("limit")), _float(unit.get("baseline_limit"))) if x is not None]
                    best[cell] = (ratio, check_index, _rounded(unit.get("value")), num(min(limits)) if limits else None,
                                  [where["group"], *where["span"]] if where and where["span"] else None)
    cells: dict[str, Any] = {}
    for (key, variant, mode, phase, layer), (ratio, index, value, limit, group) in best.items():
        slot = cells.setdefault(key, {}).setdefault(variant, {}).setdefault(mode, {}).setdefault(
            phase, {field: [None] * (n_layers + 1) for field in ("ratio", "check", "value", "limit")})
        slot["ratio"][layer] = num(ratio)
        slot["check"][layer] = index
        slot["value"][layer] = value
        slot["limit"][layer] = limit
        if group is not None:
            slot.setdefault("where", {})[str(layer)] = group
    failing_groups: dict[str, list[dict[str, Any]]] = {}
    if bin_starts is not None and len(bin_starts):
        for (variant, index, mode), per_layer in group_spans.items():
            failing_groups.setdefault(variant, []).append({
                "check": index, "mode": mode, "scope": check_info[check_names[index]]["scope"],
                "layers": {str(layer): _bin_ranges(spans, bin_starts) for layer, spans in sorted(per_layer.items())}})
    findings = raw.get("nonfinite") if isinstance(raw.get("nonfinite"), list) else raw.get("findings")
    return {"format": raw.get("format"), "passed": passed, "verdict": verdict, "exit_code": raw.get("exit_code"),
            "incomplete": raw.get("incomplete"), "allow_incomplete": raw.get("allow_incomplete"),
            "created": raw.get("created"), "policy": policy_text, "policy_description": policy_description,
            "baseline": raw.get("baseline"),
            "counts": raw.get("counts") if isinstance(raw.get("counts"), dict) else None,
            "failures": [str(f) for f in failures] if failures is not None else None,
            "findings": findings if isinstance(findings, list) else [], "notes": raw.get("notes"),
            "rows": rows, "failing": failing, "check_names": check_names, "check_info": check_info, "cells": cells,
            "failing_groups": failing_groups}


def attribution_view(raw: Any, n_layers: int) -> dict[str, Any] | None:
    """attribution.json as the page reads it, from either shape of the matrix —
    {metric: {"mode", "layers", "phases": {phase: {patch: [blame per listed layer]}}}} (`dsv4-drift attribute`)
    or {metric: {phase: {patch: [blame per layer]}}} — with blame spread over layers 0 … n_layers (the last:
    logits) and first divergences as a list per patch."""
    if not isinstance(raw, dict):
        return None
    patches = [p if isinstance(p, str) else str((p or {}).get("id", p)) if isinstance(p, dict) else str(p)
               for p in raw.get("patches") or []]
    matrix: dict[str, Any] = {}
    for metric, entry in (raw.get("matrix") or {}).items():
        if not isinstance(entry, dict):
            continue
        phases = entry.get("phases") if isinstance(entry.get("phases"), dict) else entry
        layers = entry.get("layers") if isinstance(entry.get("layers"), list) else None
        out_phases = {}
        for phase, rows in phases.items():
            if not isinstance(rows, dict):
                continue
            spread: dict[str, list[Any]] = {}
            for patch, values in rows.items():
                if not isinstance(values, list):
                    continue
                where = layers if layers is not None and len(layers) == len(values) else list(range(len(values)))
                full = [None] * max(n_layers, (max(where) + 1) if where else 0)
                for layer, value in zip(where, values):
                    if isinstance(layer, int) and 0 <= layer < len(full):
                        full[layer] = num(_float(value)) if value is not None else None
                spread[str(patch)] = full
                if not str(patch).startswith("_") and str(patch) not in patches:
                    patches.append(str(patch))
            out_phases[str(phase)] = spread
        matrix[str(metric)] = {"mode": entry.get("mode"), "phases": out_phases}
    first: dict[str, list[Any]] = {}
    for patch, entry in (raw.get("first_divergence") or {}).items():
        items = entry if isinstance(entry, list) else [entry] if isinstance(entry, dict) else []
        first[str(patch)] = [{**d, "first_layer": d.get("first_layer", d.get("layer"))} for d in items
                             if isinstance(d, dict)]
    return {"patches": patches, "matrix": matrix, "first_divergence": first,
            "ranking": raw.get("ranking") if isinstance(raw.get("ranking"), list) else [],
            "verdict": raw.get("verdict"), "interactions": raw.get("interactions") or [],
            "gate_passed": raw.get("gate_passed"), "variants": raw.get("variants")}


# ----------------------------------------------------------------------------------------------
# the payload
# ----------------------------------------------------------------------------------------------


def layer_list(config: dict[str, Any], n_layers: int) -> list[dict[str, Any]]:
    kinds = list(config.get("layer_kinds") or [])
    hashes = list(config.get("hash_layers") or [])
    rate = {"swa": 0, "csa": config.get("compress_rate_csa"), "hca": config.get("compress_rate_hca")}
    return [{"layer": i, "kind": str(kinds[i]) if i < len(kinds) else "?",
             "hash": bool(hashes[i]) if i < len(hashes) else False,
             "ratio": rate.get(kinds[i]) if i < len(kinds) else None} for i in range(n_layers)]


def build_payload(run_dir: str | Path) -> dict[str, Any]:
    """Everything the page shows, as plain JSON-able data."""
    store = RunStore(run_dir)
    manifest = store.read_manifest()
    frame = read_metrics_frame(store)
    config = (manifest.get("model") or {}).get("config") or {}
    n_layers = int(config.get("num_hidden_layers") or manifest.get("layers_total") or
                   (int(frame["layer"].max()) if not frame.empty else 0))
    keys = series_keys(frame)
    agg = per_layer(frame, keys)
    bins = bins_of(frame)
    table = layer_table(agg, n_layers)
    logits = logits_summary(agg, n_layers)
    problems: list[str] = []
    gate, problem = read_optional_json(store.dir / "gate.json")
    problems += [problem] if problem else []
    attribution, problem = read_optional_json(store.dir / "attribution.json")
    problems += [problem] if problem else []
    try:
        findings = store.read_findings()
    except (OSError, UsageError) as e:
        findings, problems = [], problems + [f"findings.json could not be read: {e}"]
    variants = [str(v) for v in frame["variant"].cat.remove_unused_categories().cat.categories] \
        if not frame.empty else []
    present_modes = {str(m) for m in frame["mode"].cat.remove_unused_categories().cat.categories} \
        if not frame.empty else set()
    declared = [v.get("name") for v in (manifest.get("stacks") or {}).get("variants", []) if isinstance(v, dict)]
    order = ([YARDSTICK] if YARDSTICK in variants else []) + [v for v in declared if v in variants] + \
        sorted(v for v in variants if v != YARDSTICK and v not in declared)
    used_keys = sorted(set(keys.values()) | ({"streams.amplification"} if "streams.rel_l2" in keys.values() else set()))
    return {
        "format": "dsv4-drift-report/1",
        "run_dir": str(store.dir),
        "manifest": manifest,
        "layers": layer_list(config, n_layers),
        "variants": order,
        "modes": [m for m in ("global", "local", "forced") if m in present_modes],
        "metrics": {k: {**metric_info(metric_of_key(k)).__dict__, "metric": metric_of_key(k),
                        "tap": k.split("@", 1)[1] if "@" in k else None} for k in used_keys},
        "table": table,
        "logits": logits,
        "bins": {c: (bins[c].astype(str).tolist() if c == "phase" else [int(x) for x in bins[c].tolist()])
                 for c in bins.columns},
        "heat": heatmaps(frame, bins, keys, n_layers),
        "needles": needle_outcome(frame, agg, n_layers, order),
        "findings": findings,
        "gate": gate_view(gate, keys, n_layers, bins["pos_bin"].to_numpy(np.int64) if not bins.empty else None),
        "attribution": attribution_view(attribution, n_layers),
        "layers_with_data": sorted(int(x) for x in frame["layer"].unique() if int(x) < n_layers)
        if not frame.empty else [],
        "problems": problems,
        "rows": int(len(frame)),
    }
