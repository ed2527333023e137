"""The report's key views as figures to paste into a PR comment, a paper or a slide: PNG and SVG, by matplotlib.

    from harness.report.figures import write_figures
    written, skipped = write_figures(run_dir, run_dir / "figures")

Four views, each written as `<view>.png` and `<view>.svg`:

- `drift-vs-layer`: one row per metric family (streams, attention, indexer, mHC, MoE, final logits), prefill and
  decode side by side: every variant's per-layer mean against the yardstick (the bf16 noise floor) and the
  gate's bound for that variant;
- `heatmap`: one metric of one variant over layer × position bin, with the prefill-chunk, turn and
  prefill → decode boundaries and the layer-kind strip;
- `context-loss`: the context-loss lens (DESIGN §3): the needle answer rate when the run measured it, the
  attention mass on earlier turns and on the needles (reference vs variants), and the indexer's recall of
  earlier-turn and needle rows per layer;
- `attribution`: the patch × layer blame matrix of attribution.json, one panel per phase.

The numbers are the HTML page's: everything comes from `harness.report.data.build_payload` (per-layer means,
packed heatmap rows, the normalised attribution). Only the gate's bounds are read from gate.json's per-layer
units directly, because the page reduces them to cell colours. A bound is drawn only from checks that
aggregate the layer's positions by their mean, the aggregate these figures plot (the default policy's).

matplotlib is an optional extra (`pip install -e ".[figures]"`), imported at the top of this module: import it
only when figures are wanted. The figures are deterministic — fixed sizes, dpi and font (DejaVu Sans, which
ships with matplotlib), the object API only (no pyplot state shared between figures), a fixed SVG hash salt
and no date in the SVG — so the same run gives byte-identical files.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.colors import ListedColormap, LogNorm, Normalize, TwoSlopeNorm
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from harness.errors import UsageError
from harness.report.data import (YARDSTICK, _float, badness, build_payload, metric_info, metric_of_key,
                                 read_optional_json, unpack_row)

VIEWS = ("drift-vs-layer", "heatmap", "context-loss", "attribution")
FORMATS = ("png", "svg")
DPI = 150
WIDTH_IN = 11.0
"""11 inches at 150 dpi: 1650 pixels wide, sharp on a slide and scaled down cleanly in a PR comment."""

STYLE = {
    "font.family": "DejaVu Sans", "mathtext.fontset": "dejavusans", "font.size": 9, "axes.titlesize": 9.5,
    "axes.labelsize": 9, "xtick.labelsize": 8, "ytick.labelsize": 8, "legend.fontsize": 8, "figure.titlesize": 11,
    "axes.grid": True, "grid.color": "#e3e5e8", "grid.linewidth": 0.6, "axes.axisbelow": True,
    "axes.spines.top": False, "axes.spines.right": False, "image.interpolation": "nearest",
    "svg.fonttype": "path", "svg.hashsalt": "dsv4-drift", "figure.dpi": DPI, "savefig.dpi": DPI,
    "savefig.facecolor": "white",
}
"""One style for every figure; svg.hashsalt fixes the SVG's element ids (otherwise random per save)."""

VARIANT_COLOURS = ("#0072B2", "#D55E00", "#009E73", "#E69F00", "#CC79A7", "#56B4E9")
"""Okabe & Ito's colour-blind-safe palette, less black (the reference) and yellow (unreadable on white). Each
variant also has its own marker, and from the seventh on the colours come round again with a dash-dot line, so
lines stay apart in greyscale and past six variants."""
VARIANT_LINES = ("-", "-.", (0, (6, 1.5, 1, 1.5, 1, 1.5)))
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h", "p")
REFERENCE_COLOUR = "#000000"
REFERENCE_STYLE = {"color": REFERENCE_COLOUR, "linewidth": 2.4}
YARDSTICK_COLOUR = "#808080"
KIND_COLOURS = {"swa": "#99DDFF", "csa": "#44BB99", "hca": "#EEDD88"}  # Paul Tol's light (colour-blind-safe) scheme
HASH_COLOUR = "#AA3377"
KIND_NAMES = {"swa": "SWA (sliding window)", "csa": "CSA (compressed, indexer)", "hca": "HCA (heavily compressed)"}
BOUND_DASH = (0, (1.2, 1.6))
BOUNDARIES = {
    "chunk": {"color": "#1d2330", "linewidth": 1.0, "linestyle": "-"},
    "decode": {"color": "#1d2330", "linewidth": 2.6, "linestyle": "-"},
    "turn": {"color": "#0072B2", "linewidth": 1.3, "linestyle": (0, (4, 3))},
}
BOUNDARY_NAMES = {"chunk": "prefill chunk boundary", "decode": "prefill → decode", "turn": "turn boundary"}
HEAT_COLOURS = "YlOrRd"
"""Sequential, colour-blind safe (ColorBrewer), pale = close to the reference as on the page; the blue turn
marks stay visible on every shade of it."""
MISSING_COLOUR = "#e6e7ea"
BLAME_COLOURS = "RdBu_r"  # diverging, colour-blind safe (ColorBrewer): red adds drift, blue removes it

FAMILIES = (
    ("Hidden streams", ("streams.rel_l2",)),
    ("Attention", ("attn.tv",)),
    ("Indexer top-k", ("indexer.recall",)),
    ("mHC (hyper-connections)", ("mhc.comb_rel_err@attn.hc", "mhc.comb_rel_err")),
    ("MoE routing", ("moe.flip_rate",)),
    ("Final logits", ("logits.kl",)),
)
"""DESIGN §4's families and the series each row draws (the page's default choice per family; mHC's comb error
at the attention site when both sites are measured). Final logits have one value per variant, not per layer."""

CONTEXT_PANELS = (
    ("ctx.earlier_turn_mass", "Attention mass on earlier turns"),
    ("ctx.needle_mass", "Attention mass on needles"),
    ("ctx.earlier_turn_recall", "Indexer recall of earlier-turn rows"),
    ("ctx.needle_recall", "Indexer recall of needle rows"),
)
"""The lens per layer: masses come as a reference/variant pair (`_ref`, `_opt`), recalls per variant."""


class NothingToDraw(Exception):
    """The run has no data for a view (a single-turn prompt has no context-loss lens; a plain run no
    attribution): the view is skipped, and the message says why."""


# ----------------------------------------------------------------------------------------------
# the data: the page's payload, plus the gate's bounds
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FigureData:
    """A run as the figures read it. `variants` are the ones drawn: the yardstick first, then the variants in
    the scenario's order (the page's) or as chosen. `bounds[key][variant][phase]` is the gate's binding limit
    per layer (0 … n_layers, the last being the logits row) in the metric's own units, NaN where no check
    applies."""

    payload: dict[str, Any]
    bounds: dict[str, dict[str, dict[str, np.ndarray]]]
    variants: list[str]

    @classmethod
    def load(cls, run_dir: str | Path, variants: list[str] | None = None) -> FigureData:
        """The run's data; `variants` narrows the figures to those (a figure with fifteen lines argues nothing;
        the yardstick is always drawn). Raises UsageError for a variant the run does not have."""
        payload = build_payload(run_dir)
        unknown = [v for v in variants or [] if v not in payload["variants"]]
        if unknown:
            raise UsageError(f"variant {', '.join(map(repr, unknown))} is not in {run_dir}; its variants: "
                             f"{', '.join(v for v in payload['variants'] if v != YARDSTICK)}")
        drawn = ([YARDSTICK] if YARDSTICK in payload["variants"] else []) + \
            [v for v in variants or payload["variants"] if v != YARDSTICK]
        gate, _ = read_optional_json(Path(run_dir) / "gate.json")  # unreadable: already in payload["problems"]
        return cls(payload, gate_bounds(gate, payload["metrics"], len(payload["layers"])), drawn)

    @property
    def n_layers(self) -> int:
        return len(self.payload["layers"])

    @property
    def scenario(self) -> str:
        return str(((self.payload.get("manifest") or {}).get("scenario") or {}).get("name") or "run")

    @property
    def phases(self) -> list[str]:
        present = self.payload["bins"].get("phase") or []
        return [p for p in ("prefill", "decode") if p in present]

    def layer_series(self, variant: str, key: str, phase: str) -> tuple[np.ndarray, np.ndarray] | None:
        """(values, measured) of the page's per-layer mean in global mode, or None where never measured."""
        table = self.payload["table"].get("global", {})
        values = ((table.get(variant) or {}).get(key) or {}).get(phase)
        return _decoded(values["mean"]) if values else None

    def final(self, variant: str, phase: str, metric: str) -> float | None:
        """A final-logits metric (layer == n_layers) of a variant: the mean over the phase's positions."""
        entry = ((self.payload["logits"].get(variant) or {}).get(phase) or {}).get(metric)
        return _float(entry["mean"]) if entry else None

    def needle_stacks(self) -> dict[str, dict[str, Any]]:
        """The needle answer of the drawn stacks, as the page reads it (payload `needles`,
        harness.report.data.needle_outcome): empty when no decode step asks for a needle."""
        stacks = (self.payload.get("needles") or {}).get("stacks") or {}
        return {v: stacks[v] for v in self.variants if v in stacks}

    def label(self, key: str) -> str:
        """The page's label of a series: the metric's label, and the tap where one metric has several."""
        info = self.payload["metrics"].get(key) or {}
        label = info.get("label") or metric_info(metric_of_key(key)).label
        return f"{label} ({info['tap']})" if info.get("tap") else label


def _decoded(values: list[Any]) -> tuple[np.ndarray, np.ndarray]:
    """Payload numbers (null when missing, marker strings for NaN and ±inf) as (floats, measured)."""
    floats = [_float(v) for v in values]
    return (np.array([_or_nan(x) for x in floats], dtype=float),
            np.array([x is not None for x in floats], dtype=bool))


def _or_nan(x: float | None) -> float:
    return np.nan if x is None else x


def gate_bounds(gate: Any, metrics: dict[str, Any], n_layers: int) -> dict[str, dict[str, dict[str, np.ndarray]]]:
    """gate.json's per-layer limits for the figures: per series key, variant and phase, the tightest limit of
    the checks (and baselines) on the layer mean in global mode, converted from the gate's loss (1 − x for
    recall-like metrics) back to the metric's units. Checks on other aggregates (max, p99) bound a different
    number than the one drawn and are left out, and so are group scopes (a chunk's or a decode step's limit bounds
    that group's mean, not the layer's); so is a gate.json without per-layer units."""
    losses: dict[str, dict[str, dict[str, np.ndarray]]] = {}
    checks = gate.get("checks") if isinstance(gate, dict) else None
    for check in checks if isinstance(checks, list) else []:
        if not isinstance(check, dict) or check.get("aggregate") != "mean" or check.get("scope", "layer") != "layer":
            continue
        metric = str(check.get("metric"))
        if metric_info(metric).better not in ("lower", "higher"):
            continue
        for result in check.get("variants") or []:
            for unit in (result.get("units") or []) if isinstance(result, dict) else []:
                layer = unit.get("layer")
                if unit.get("mode") != "global" or not isinstance(layer, int) or not 0 <= layer <= n_layers:
                    continue
                key = f"{metric}@{unit.get('tap')}" if f"{metric}@{unit.get('tap')}" in metrics else metric
                limits = [x for x in (_float(unit.get("limit")), _float(unit.get("baseline_limit"))) if x is not None]
                if key not in metrics or not limits:
                    continue
                row = losses.setdefault(key, {}).setdefault(str(unit.get("variant")), {}).setdefault(
                    str(unit.get("phase")), np.full(n_layers + 1, np.nan))
                row[layer] = np.fmin(row[layer], min(limits))
    for key, per_variant in losses.items():
        if metric_info(metric_of_key(key)).better == "higher":
            for per_phase in per_variant.values():
                for phase, row in per_phase.items():
                    per_phase[phase] = np.maximum(1.0 - row, 0.0)  # a loss limit past 1 lets any recall pass
    return losses


# ----------------------------------------------------------------------------------------------
# shared drawing helpers
# ----------------------------------------------------------------------------------------------


def _styled(draw: Callable[..., Figure]) -> Callable[..., Figure]:
    """Draw under STYLE without touching matplotlib's global settings."""

    @functools.wraps(draw)
    def wrapper(*args: Any, **kwargs: Any) -> Figure:
        with matplotlib.rc_context(STYLE):
            return draw(*args, **kwargs)

    return wrapper


def variant_style(data: FigureData, variant: str) -> dict[str, Any]:
    """The yardstick dashed grey; every other variant its own colour and marker, the same in every figure."""
    if variant == YARDSTICK:
        return {"color": YARDSTICK_COLOUR, "linestyle": (0, (5, 3)), "linewidth": 1.4, "marker": None}
    others = [v for v in data.variants if v != YARDSTICK]
    i = others.index(variant) if variant in others else 0
    return {"color": VARIANT_COLOURS[i % len(VARIANT_COLOURS)], "linewidth": 1.6,
            "linestyle": VARIANT_LINES[i // len(VARIANT_COLOURS) % len(VARIANT_LINES)],
            "marker": MARKERS[i % len(MARKERS)], "markersize": 3.2}


def _variant_label(variant: str) -> str:
    return "yardstick (bf16 noise floor)" if variant == YARDSTICK else variant


def _plot_layers(ax: Axes, values: np.ndarray, measured: np.ndarray, label: str, style: dict[str, Any]) -> bool:
    """One per-layer series: its measured finite layers joined by a line (layers without the metric, such as
    the non-CSA layers of an indexer metric, do not break it, as on the page); a measured NaN or ±inf as a
    cross at the top edge. Returns whether any value was non-finite."""
    x = np.flatnonzero(measured & np.isfinite(values))
    ax.plot(x, values[x], label=label, **style)
    bad = np.flatnonzero(measured & ~np.isfinite(values))
    if bad.size:
        ax.plot(bad, np.full(bad.size, 0.97), transform=ax.get_xaxis_transform(), linestyle="none", marker="X",
                markersize=7, color=style["color"], clip_on=False)
    return bool(bad.size)


def _use_log(key: str, series: list[np.ndarray]) -> bool:
    """Log scale for the page's log metrics (errors) when their positive values span at least a decade."""
    if metric_info(metric_of_key(key)).scale != "log":
        return False
    positive = np.concatenate([s[np.isfinite(s) & (s > 0)] for s in series] + [np.empty(0)])
    return positive.size > 0 and positive.max() >= 10 * positive.min()


def _layer_ticks(n_layers: int) -> np.ndarray:
    return np.arange(0, n_layers, 1 if n_layers <= 12 else 2 if n_layers <= 30 else 5)


def _kind_strip(ax: Axes, layers: list[dict[str, Any]], axis: str) -> None:
    """The layer kinds as a strip of coloured cells beside the layer axis (outside the plot area): under the
    x axis when layers run along x, left of the y axis when they run along y; a dot marks hash-routed layers."""
    along_x = axis == "x"
    transform = ax.get_xaxis_transform() if along_x else ax.get_yaxis_transform()
    lo, size = (-0.05, 0.035) if along_x else (-0.028, 0.018)
    for i, layer in enumerate(layers):
        colour = KIND_COLOURS.get(layer["kind"], "#cccccc")
        xy, w, h = ((i - 0.5, lo), 1.0, size) if along_x else ((lo, i - 0.5), size, 1.0)
        ax.add_patch(Rectangle(xy, w, h, transform=transform, facecolor=colour, edgecolor="white", linewidth=0.3,
                               clip_on=False))
        if layer.get("hash"):
            centre = (i, lo + size / 2) if along_x else (lo + size / 2, i)
            ax.plot(*centre, transform=transform, marker="o", markersize=2.2, color=HASH_COLOUR, clip_on=False)
    ax.tick_params(axis=axis, pad=11 if along_x else 16)


def _kind_handles(layers: list[dict[str, Any]]) -> list[Any]:
    kinds = [k for k in KIND_COLOURS if any(layer["kind"] == k for layer in layers)]
    handles: list[Any] = [Patch(facecolor=KIND_COLOURS[k], label=KIND_NAMES[k]) for k in kinds]
    if any(layer.get("hash") for layer in layers):
        handles.append(Line2D([], [], linestyle="none", marker="o", markersize=4, color=HASH_COLOUR,
                              label="hash-routed MoE layer"))
    return handles


def _legend(fig: Figure, handles: list[Any]) -> None:
    """One legend for the whole figure, under the panels (the title stays alone on top), in as many columns as
    its longest label lets fit across the figure (~0.6 em per character, plus the handle)."""
    longest = max(len(h.get_label()) for h in handles)
    fits = int(WIDTH_IN * 72 // (longest * 0.6 * STYLE["legend.fontsize"] + 45))
    fig.legend(handles=handles, loc="outside lower center", ncols=max(1, min(len(handles), fits, 5)), frameon=False)


def _series_legend(fig: Figure, data: FigureData, bounds: bool, nonfinite: bool, reference: bool = False) -> None:
    """The legend of the per-layer line figures: reference, yardstick and variants as drawn, then the gate's
    bound, the layer kinds and the NaN/Inf mark where they appear."""
    handles: list[Any] = [Line2D([], [], label="reference (fp32)", **REFERENCE_STYLE)] if reference else []
    handles += [Line2D([], [], label=_variant_label(v), **variant_style(data, v)) for v in data.variants]
    if bounds:
        handles.append(Line2D([], [], color="#555555", linestyle=BOUND_DASH, linewidth=1.4,
                              label="gate bound (dotted, in each variant's colour)"))
    _legend(fig, handles + _kind_handles(data.payload["layers"]) + ([_nonfinite_handle()] if nonfinite else []))


def _layer_axis(ax: Axes, data: FigureData) -> None:
    """Layers along x, with the kind strip under them."""
    ax.set_xlim(-0.5, data.n_layers - 0.5)
    ax.set_xticks(_layer_ticks(data.n_layers))
    _kind_strip(ax, data.payload["layers"], "x")


def _not_measured(ax: Axes, text: str = "not measured") -> None:
    ax.text(0.5, 0.5, text, transform=ax.transAxes, ha="center", va="center", color="#6b7280")


def _nonfinite_handle() -> Line2D:
    return Line2D([], [], linestyle="none", marker="X", markersize=6, color="#444444",
                  label="NaN/Inf (at the top edge)")


# ----------------------------------------------------------------------------------------------
# drift vs layer
# ----------------------------------------------------------------------------------------------


@_styled
def drift_vs_layer(data: FigureData) -> Figure:
    """One row per metric family, prefill and decode side by side: each variant's per-layer mean (global mode),
    the yardstick dashed, each variant's gate bound dotted in its colour; final logits as bars per variant."""
    rows = [(title, next(k for k in keys if k in data.payload["metrics"])) for title, keys in FAMILIES
            if any(k in data.payload["metrics"] for k in keys)]
    phases = data.phases
    if not rows or not phases or not data.n_layers:
        raise NothingToDraw("no per-layer metrics in this run")
    fig = Figure(figsize=(WIDTH_IN, 1.4 + 2.3 * len(rows)), layout="constrained")
    axes = fig.subplots(len(rows), len(phases), squeeze=False)
    nonfinite = False
    for r, (title, key) in enumerate(rows):
        for c, phase in enumerate(phases):
            ax = axes[r][c]
            ax.set_title(f"{title} · {phase}")
            if c == 0:
                ax.set_ylabel(data.label(key))
            if key.startswith("logits."):
                _logits_panel(ax, data, key, phase)
            else:
                nonfinite |= _layer_panel(ax, data, key, phase)
                if r == len(rows) - 1 or rows[r + 1][1].startswith("logits."):
                    ax.set_xlabel("layer")
    _series_legend(fig, data, any(key in data.bounds for _, key in rows), nonfinite)
    fig.suptitle(f"Drift vs layer · {data.scenario} · global mode, mean over each layer's positions")
    return fig


def _layer_panel(ax: Axes, data: FigureData, key: str, phase: str) -> bool:
    """Variants and yardstick against the layers, with each variant's gate bound. Returns whether a value was
    non-finite."""
    drawn: list[np.ndarray] = []
    nonfinite = False
    for variant in data.variants:
        series = data.layer_series(variant, key, phase)
        if series is None:
            continue
        style = variant_style(data, variant)
        nonfinite |= _plot_layers(ax, *series, _variant_label(variant), style)
        drawn.append(series[0])
        bound = data.bounds.get(key, {}).get(variant, {}).get(phase)
        if bound is not None and variant != YARDSTICK:
            x = np.flatnonzero(np.isfinite(bound[:data.n_layers]))
            ax.plot(x, bound[x], color=style["color"], linestyle=BOUND_DASH, linewidth=1.3, label=f"bound {variant}")
            drawn.append(bound[x])
    if not drawn:
        _not_measured(ax)
    elif _use_log(key, drawn):
        ax.set_yscale("log")
    _layer_axis(ax, data)
    return nonfinite


def _logits_panel(ax: Axes, data: FigureData, key: str, phase: str) -> None:
    """The final logits: one bar per variant (the mean over the phase's sampled positions) and its gate bound."""
    values, bounds = [], []
    for variant in data.variants:
        values.append(data.final(variant, phase, key))
        bound = data.bounds.get(key, {}).get(variant, {}).get(phase)
        bounds.append(bound[data.n_layers] if bound is not None and variant != YARDSTICK else np.nan)
    if all(v is None for v in values):
        _not_measured(ax)
        return
    for i, (variant, value, bound) in enumerate(zip(data.variants, values, bounds)):
        style = variant_style(data, variant)
        if value is not None:
            ax.bar(i, value, width=0.6, color=style["color"], alpha=0.45, edgecolor=style["color"], linewidth=1.2,
                   hatch="//" if variant == YARDSTICK else None, label=_variant_label(variant))
            if len(data.variants) <= 8:  # more values than that would run into each other
                ax.annotate(f"{value:.3g}", (i, value), xytext=(0, 2), textcoords="offset points", ha="center",
                            va="bottom", fontsize=7)
        if np.isfinite(bound):
            ax.hlines(bound, i - 0.42, i + 0.42, colors=style["color"], linestyles=BOUND_DASH, linewidth=1.6)
    drawn = [np.array([_or_nan(v) for v in values]), np.array(bounds)]
    if _use_log(key, drawn):
        ax.set_yscale("log")
    crowded = len(data.variants) > 4
    ax.set_xticks(range(len(data.variants)), data.variants, rotation=35 if crowded else 0,
                  ha="right" if crowded else "center", rotation_mode="anchor")
    ax.grid(False, axis="x")


# ----------------------------------------------------------------------------------------------
# layer × position heatmap
# ----------------------------------------------------------------------------------------------


@_styled
def heatmap(data: FigureData, metric: str | None = None) -> Figure:
    """One metric (default: the stream error) per layer × position bin (global mode) of the first variant drawn
    after the yardstick. Recall-like metrics are drawn as 1 − value, so darker is always further from the
    reference. Raises UsageError for a metric the run does not keep per position."""
    heat, bins = data.payload["heat"], data.payload["bins"]
    n_bins = len(bins.get("pos_bin") or [])
    if not heat or not n_bins:
        raise NothingToDraw("no per-position metrics in this run")
    key = metric or ("streams.rel_l2" if "streams.rel_l2" in heat else next(iter(heat)))
    if key not in heat:
        raise UsageError(f"heatmap metric {key!r} is not kept per position in this run; choose one of: "
                         f"{', '.join(heat)}")
    candidates = [v for v in data.variants if v in heat[key]]
    if not candidates:
        raise NothingToDraw(f"no variant drawn has {key} per position")
    chosen = next((v for v in candidates if v != YARDSTICK), candidates[0])
    rows = [unpack_row(row, n_bins) for row in heat[key][chosen]]
    values = np.vstack([r[0] for r in rows])
    nonfinite = np.vstack([r[1] for r in rows]) & ~np.isfinite(values)
    info = metric_info(metric_of_key(key))
    shown = values if info.better == "neutral" else np.vectorize(  # as the page: an error, 0 = the reference
        lambda v: _or_nan(badness(metric_of_key(key), float(v))), otypes=[float])(values)
    label = data.label(key)
    colour_label = f"1 − {label}" if info.better == "higher" else label
    finite = shown[np.isfinite(shown)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    norm = LogNorm(lo, hi) if lo > 0 and hi > 10 * lo else Normalize(lo, hi if hi > lo else lo + 1)

    n_layers = data.n_layers
    fig = Figure(figsize=(WIDTH_IN, 2.6 + 0.15 * n_layers), layout="constrained")
    ax = fig.subplots()
    cmap = matplotlib.colormaps[HEAT_COLOURS].with_extremes(bad=MISSING_COLOUR)
    image = ax.imshow(np.ma.masked_invalid(shown), cmap=cmap, norm=norm, aspect="auto")
    if nonfinite.any():
        ax.imshow(np.ma.masked_where(~nonfinite, np.ones_like(shown)), cmap=ListedColormap(["#000000"]),
                  aspect="auto")
    ax.grid(False)
    fig.colorbar(image, ax=ax, label=colour_label, fraction=0.035, pad=0.01)
    handles = _boundary_marks(ax, bins)
    every = max(1, int(np.ceil(n_bins / 14)))
    ax.set_xticks(range(0, n_bins, every), [str(p) for p in bins["pos_bin"][::every]])
    ax.set_yticks(_layer_ticks(n_layers) if n_layers > 48 else range(n_layers))
    ax.set_xlabel("token position (start of each bin: prefill bins, then one column per decode step)")
    ax.set_ylabel("layer")
    _kind_strip(ax, data.payload["layers"], "y")
    handles += _kind_handles(data.payload["layers"]) + [Patch(facecolor=MISSING_COLOUR, label="not measured")]
    if nonfinite.any():
        handles.append(Patch(facecolor="#000000", label="NaN/Inf"))
    _legend(fig, handles)
    fig.suptitle(f"Layer × position · {colour_label} · variant {chosen} · {data.scenario} · global mode")
    return fig


def _boundary_marks(ax: Axes, bins: dict[str, list[Any]]) -> list[Any]:
    """Vertical lines where a prefill chunk, a turn or the prefill phase ends, labelled above the plot: chunk and
    decode labels on one row, turn labels on another. A label that would run into one already placed is left
    out (the line still shows); the decode label is placed first. Returns the legend handles."""
    marks: list[tuple[int, str, str]] = []  # (column, kind, label)
    for c in range(len(bins["pos_bin"])):
        if c > 0 and bins["phase"][c] != bins["phase"][c - 1]:
            marks.append((c, "decode", "decode"))
        elif c == 0 or (bins["phase"][c] == "prefill" and bins["chunk"][c] != bins["chunk"][c - 1]):
            marks.append((c, "chunk", f"chunk {bins['chunk'][c]}"))
        if c == 0 or bins["turn"][c] != bins["turn"][c - 1]:
            marks.append((c, "turn", "preamble" if bins["turn"][c] < 0 else f"turn {bins['turn'][c]}"))
    for c, kind, _ in marks:
        if c > 0:
            ax.axvline(c - 0.5, **BOUNDARIES[kind])
    label_gap = len(bins["pos_bin"]) / 15  # columns per label: ~0.6 inch of the ~9-inch-wide plot
    placed: dict[float, list[int]] = {1.012: [], 1.05: []}  # label row (axes height) → columns labelled
    for c, kind, text in sorted(marks, key=lambda m: m[1] != "decode"):
        row = 1.05 if kind == "turn" else 1.012
        if all(abs(c - other) >= label_gap for other in placed[row]):
            ax.text(c - 0.4, row, text, transform=ax.get_xaxis_transform(), fontsize=7.5,
                    color=BOUNDARIES[kind]["color"], va="bottom")
            placed[row].append(c)
    used = {kind for c, kind, _ in marks if c > 0}
    return [Line2D([], [], label=BOUNDARY_NAMES[k], **BOUNDARIES[k]) for k in BOUNDARIES if k in used]


# ----------------------------------------------------------------------------------------------
# context-loss lens
# ----------------------------------------------------------------------------------------------


@_styled
def context_loss(data: FigureData, phase: str | None = None) -> Figure:
    """The context-loss lens for one phase (default: decode, as on the page). First, when the run measured the
    needle answer: the reference's and each stack's answer rate at the final logits, and per layer through the
    logit lens. Then per layer the attention mass on earlier turns and needles (reference black, variants in
    colour) and the indexer's recall of earlier-turn and needle rows with each variant's bound."""
    metrics = data.payload["metrics"]
    phase = phase or ("decode" if "decode" in data.phases else (data.phases or ["prefill"])[0])
    stacks = data.needle_stacks()
    final = {v: s for v, s in stacks.items() if s.get("rate") is not None}
    lens = {v: _decoded(s["lens"]) for v, s in stacks.items() if s.get("lens")}
    panels = [(key, title) for key, title in CONTEXT_PANELS if key in metrics or f"{key}_ref" in metrics]
    if not panels and not final and not lens:
        raise NothingToDraw("no context-loss metrics: the prompt has a single turn and no needles, or no query "
                            "attends to an earlier turn")
    answer_rows = 1 if final or lens else 0
    n_rows = (len(panels) + 1) // 2 + answer_rows
    fig = Figure(figsize=(WIDTH_IN, 1.2 + 2.8 * n_rows), layout="constrained")
    grid = fig.add_gridspec(n_rows, 2)
    if final:
        _answer_panel(fig.add_subplot(grid[0, 0] if lens else grid[0, :]), data, final)
    if lens:
        _lens_panel(fig.add_subplot(grid[0, 1] if final else grid[0, :]), data, lens)
    needles = ", ".join((data.payload["manifest"].get("prompt") or {}).get("needles") or {})
    nonfinite = False
    for i, (key, title) in enumerate(panels):
        ax = fig.add_subplot(grid[i // 2 + answer_rows, i % 2])
        ax.set_title(title + (f" ({needles})" if "needle" in key and needles else ""))
        ax.set_ylabel("mean attention mass per query" if key.endswith("_mass") else data.label(key))
        ax.set_xlabel("layer")
        nonfinite |= _context_panel(ax, data, key, phase)
    _series_legend(fig, data, any(key in data.bounds for key, _ in panels), nonfinite,
                   reference=bool(answer_rows) or any(key.endswith("_mass") for key, _ in panels))
    fig.suptitle(f"Context-loss lens · {data.scenario} · {phase} queries in later turns · global mode")
    return fig


def _context_panel(ax: Axes, data: FigureData, key: str, phase: str) -> bool:
    """Masses: the reference's (one series: every variant's row carries the same reference) and each
    variant's; recalls: each variant's with its gate bound, as in the drift-vs-layer panels."""
    if not key.endswith("_mass"):
        return _layer_panel(ax, data, key, phase)
    nonfinite = False
    reference = next((s for v in data.variants if (s := data.layer_series(v, f"{key}_ref", phase))), None)
    if reference is None:
        _not_measured(ax)
    else:
        _plot_layers(ax, *reference, "reference", REFERENCE_STYLE)
    for variant in data.variants:
        series = data.layer_series(variant, f"{key}_opt", phase)
        if series is not None:
            nonfinite |= _plot_layers(ax, *series, _variant_label(variant), variant_style(data, variant))
    _layer_axis(ax, data)
    return nonfinite


def _answer_panel(ax: Axes, data: FigureData, final: dict[str, dict[str, Any]]) -> None:
    """The outcome: how often the reference and each stack answer the needle queries with their final logits,
    with the median margin and, for the stacks, the share of answers lost where the reference was sure."""
    reference = (data.payload.get("needles") or {}).get("reference")
    rows = [("reference", reference, None)] if reference and reference.get("rate") is not None else []
    rows += [(v, outcome, v) for v, outcome in final.items()]
    for i, (name, outcome, variant) in enumerate(rows):
        colour = REFERENCE_COLOUR if variant is None else variant_style(data, variant)["color"]
        rate, margin = _float(outcome["rate"]), _float(outcome.get("margin"))
        ax.barh(i, rate, height=0.6, color=colour, alpha=0.6, edgecolor=colour,
                hatch="//" if variant == YARDSTICK else None)
        lost = outcome["lost"] / outcome["queries"] if variant is not None and outcome["queries"] else None
        text = f"{rate:.2f}" + (f" · margin {margin:.3g}" if margin is not None else "") + \
            (f" · lost {lost:.2f}" if lost is not None else "")
        ax.annotate(text, (rate, i), xytext=(4, 0), textcoords="offset points", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [r[0] for r in rows])
    ax.invert_yaxis()
    ax.set_xlim(0, 1.45)
    ax.set_xticks(np.linspace(0, 1, 6))
    ax.set_xlabel("needle answer rate over the needle queries (decode)")
    ax.set_title("Needle answer (final logits)")
    ax.grid(False, axis="y")


def _lens_panel(ax: Axes, data: FigureData, lens: dict[str, tuple[np.ndarray, np.ndarray]]) -> None:
    """Where the answer is lost: the answer rate through each layer's logit lens, reference against stacks."""
    reference = ((data.payload.get("needles") or {}).get("reference") or {}).get("lens")
    if reference:
        _plot_layers(ax, *_decoded(reference), "reference", REFERENCE_STYLE)
    for variant, series in lens.items():
        _plot_layers(ax, *series, _variant_label(variant), variant_style(data, variant))
    ax.set_ylim(-0.04, 1.04)
    ax.set_ylabel("needle answer rate")
    ax.set_xlabel("layer")
    ax.set_title("Needle answer through each layer's logit lens")
    _layer_axis(ax, data)


# ----------------------------------------------------------------------------------------------
# attribution matrix
# ----------------------------------------------------------------------------------------------


@_styled
def attribution(data: FigureData, metric: str | None = None) -> Figure:
    """attribution.json's blame matrix for one metric (default: the verdict's), one panel per phase: the drift
    each patch adds at each layer on one colour scale centred at zero, the yardstick's own loss as a grey row
    (its range in the row's label), and each patch's first layer of divergence beyond the gate outlined."""
    view = data.payload["attribution"]
    if not view:
        raise NothingToDraw("no attribution.json in the run directory (`dsv4-drift attribute` writes one)")
    if not view["matrix"]:
        raise NothingToDraw("attribution.json has no blame matrix")
    verdict = view["verdict"] if isinstance(view.get("verdict"), dict) else {}
    key = metric or (verdict.get("metric") if verdict.get("metric") in view["matrix"] else next(iter(view["matrix"])))
    if key not in view["matrix"]:
        raise UsageError(f"attribution metric {key!r} is not in attribution.json; choose one of: "
                         f"{', '.join(view['matrix'])}")
    entry = view["matrix"][key]
    phases = [p for p in ("prefill", "decode") if p in entry["phases"]] + \
        sorted(p for p in entry["phases"] if p not in ("prefill", "decode"))
    if not phases:
        raise NothingToDraw(f"attribution.json has no blame for {key}")
    patches = [p for p in view["patches"] if any(p in entry["phases"][ph] for ph in phases)]
    width = max([data.n_layers] + [len(v) for ph in phases for v in entry["phases"][ph].values()])

    def row(phase: str, name: str) -> np.ndarray:
        values = _decoded(entry["phases"][phase].get(name) or [])[0]
        return np.concatenate([values, np.full(width - len(values), np.nan)])

    grids = {ph: np.array([row(ph, p) for p in patches]).reshape(len(patches), width) for ph in phases}
    yard = {ph: row(ph, "_yardstick") for ph in phases if "_yardstick" in entry["phases"][ph]}
    finite = np.concatenate([g[np.isfinite(g)] for g in grids.values()] + [np.empty(0)])
    reach = float(np.abs(finite).max()) if finite.size and np.abs(finite).max() > 0 else 1.0
    norm = TwoSlopeNorm(vcenter=0.0, vmin=-reach, vmax=reach)
    n_rows = len(patches) + (1 if yard else 0)
    fig = Figure(figsize=(WIDTH_IN, 1.3 + len(phases) * (0.9 + 0.26 * n_rows)), layout="constrained")
    axes = fig.subplots(len(phases), 1, squeeze=False)[:, 0]
    cmap = matplotlib.colormaps[BLAME_COLOURS].with_extremes(bad=MISSING_COLOUR)
    label = data.label(key)
    for ax, phase in zip(axes, phases):
        image = ax.imshow(np.ma.masked_invalid(grids[phase]), cmap=cmap, norm=norm, aspect="auto",
                          extent=(-0.5, width - 0.5, len(patches) - 0.5, -0.5))
        names = list(patches)
        if phase in yard:  # on its own grey scale: the noise floor is often far above any one patch's blame
            loss = np.abs(yard[phase])
            top = float(np.nanmax(loss)) if np.isfinite(loss).any() else 0.0
            ax.imshow(np.ma.masked_invalid(loss[None, :]), cmap="Greys", norm=Normalize(0, top or 1.0),
                      aspect="auto", extent=(-0.5, width - 0.5, len(patches) + 0.5, len(patches) - 0.5))
            names.append(f"yardstick loss (0–{top:.2g})")
        ax.set_ylim(len(names) - 0.5, -0.5)
        for patch_row, patch in enumerate(patches):
            first = next((d for d in view["first_divergence"].get(patch) or [] if d.get("phase") == phase), {})
            layer = first.get("first_layer")
            if isinstance(layer, int) and 0 <= layer < width:
                ax.add_patch(Rectangle((layer - 0.5, patch_row - 0.5), 1, 1, fill=False, edgecolor="#000000",
                                       linewidth=2.0))
        ax.grid(False)
        ax.set_yticks(range(len(names)), names)
        ticks = list(_layer_ticks(data.n_layers)) + ([data.n_layers] if width > data.n_layers else [])
        ax.set_xticks(ticks, [str(t) if t < data.n_layers else "logits" for t in ticks])
        ax.set_xlim(-0.5, width - 0.5)
        ax.set_title(f"{phase} · blame per patch and layer ({entry.get('mode') or 'local'} mode)", loc="left")
        _kind_strip(ax, data.payload["layers"], "x")
    axes[-1].set_xlabel("layer")
    fig.colorbar(image, ax=list(axes), fraction=0.03, pad=0.01,
                 label=f"blame ({label}): red adds drift, blue removes it")
    handles = [Patch(facecolor="none", edgecolor="#000000", linewidth=2.0,
                     label="first layer beyond the gate (any check)")] + _kind_handles(data.payload["layers"])
    _legend(fig, handles)
    summary = verdict.get("summary")
    fig.suptitle(f"Attribution · {label} · {data.scenario}" + (f"\nverdict: {summary}" if summary else ""))
    return fig


# ----------------------------------------------------------------------------------------------
# writing
# ----------------------------------------------------------------------------------------------


def save(fig: Figure, out_dir: Path, view: str) -> list[Path]:
    """`<view>.png` and `<view>.svg` in out_dir, each written to a temporary name and renamed; the SVG without
    a date, so the same figure gives the same bytes."""
    paths = []
    with matplotlib.rc_context(STYLE):
        for fmt in FORMATS:
            path = out_dir / f"{view}.{fmt}"
            tmp = path.with_name(f".{path.name}.tmp")
            fig.savefig(tmp, format=fmt, metadata={"Date": None} if fmt == "svg" else None)
            os.replace(tmp, path)
            paths.append(path)
    return paths


def write_figures(run_dir: str | Path, out_dir: str | Path, *, variants: list[str] | None = None,
                  heatmap_metric: str | None = None) -> tuple[list[Path], dict[str, str]]:
    """Draw every view the run has data for into out_dir (of `variants` only, when given; the heatmap shows the
    first of them); returns (the files written, {view: why skipped}). Every figure is drawn before any file is
    written, so a bad choice (UsageError) leaves the folder as it was; a skipped view's files from an earlier
    call are removed, so the folder never shows a stale figure."""
    data = FigureData.load(run_dir, variants)
    draw: dict[str, Callable[[], Figure]] = {
        "drift-vs-layer": lambda: drift_vs_layer(data),
        "heatmap": lambda: heatmap(data, heatmap_metric),
        "context-loss": lambda: context_loss(data),
        "attribution": lambda: attribution(data),
    }
    figures: dict[str, Figure] = {}
    skipped: dict[str, str] = {}
    for view in VIEWS:
        try:
            figures[view] = draw[view]()
        except NothingToDraw as e:
            skipped[view] = str(e)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for view in VIEWS:
        if view in figures:
            written += save(figures[view], out, view)
        else:
            for fmt in FORMATS:
                (out / f"{view}.{fmt}").unlink(missing_ok=True)
    return written, skipped
