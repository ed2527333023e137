"""Evaluate a gate policy on a run directory (DESIGN §5): per check, variant, mode, tap, layer and phase.

A *unit* is one (variant, mode, tap, layer, phase). For each check and unit the metric's rows (one per
position bin) are turned into the check's loss (larger is worse: x for errors, 1 − x for recalls) and
aggregated over the bins; the same aggregate of the yardstick's (and the base variant's) rows at the same
mode, tap, layer and phase gives the relative bound:

    absolute:  loss ≤ X
    yardstick: loss ≤ F·max(yardstick, 0) + floor
    base:      loss ≤ base + F·max(yardstick, 0) + floor
    baseline:  loss ≤ baseline·(1 + slack) + floor        (with a baseline, for checks that ask for one)

F is a factor on the error amplitude. For metrics quadratic in it (KL, JS, 1 − cos, whose square roots are
distances) the same triangle inequality is applied to square roots: F²·yardstick and (√base + F·√yardstick)².

A NaN loss fails every bound. Comparisons allow a 1e-9 relative tolerance, so a loss computed as
1 − 2/3 still equals a floor of 1/3. Any NaN/Inf finding of the run (findings.json) fails the gate,
whatever the policy says. An incomplete run (manifest status other than `complete`: killed, interrupted, failed,
still running) never passes (DESIGN §5): it exits 2 unless a check already fails (1), and only
`allow_incomplete` (`gate --allow-incomplete`, named in every output) gates the layers it has.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import pandas as pd

from harness.errors import UsageError
from harness.gate.metric_rules import PICK_SHARE, PICK_SHARE_METRICS
from harness.gate.policy import YARDSTICK, Check, Policy, config_names

REL_TOL = 1e-9
UNIT_KEYS = ["variant", "mode", "tap", "layer", "phase"]
PHASE_ORDER = {"prefill": 0, "decode": 1}
MODE_ORDER = {"global": 0, "local": 1, "forced": 2}


# --------------------------------------------------------------------------- the run


@dataclass
class RunData:
    dir: Path
    manifest: dict[str, Any]
    metrics: pd.DataFrame
    findings: list[dict[str, Any]]

    _by_metric: dict[str, pd.DataFrame] | None = field(default=None, repr=False)

    def rows_of(self, metric: str) -> pd.DataFrame:
        """The metric's rows (grouped once: a flash run holds ~10⁶ rows and a policy ~30 checks)."""
        if self._by_metric is None:
            self._by_metric = {m: part for m, part in self.metrics.groupby("metric", sort=False)}
        return self._by_metric.get(metric, self.metrics.iloc[0:0])

    @property
    def config(self) -> dict[str, Any]:
        return (self.manifest.get("model") or {}).get("config") or {}

    @property
    def n_layers(self) -> int:
        n = self.config.get("num_hidden_layers", self.manifest.get("layers_total"))
        if n is None:
            n = int(self.metrics["layer"].max()) if len(self.metrics) else 0
        return int(n)

    @property
    def scenario(self) -> str:
        return str((self.manifest.get("scenario") or {}).get("name", self.dir.name))

    @property
    def variants(self) -> list[str]:
        """The run's stacks compared against the reference: the yardstick (when it ran), then the variants."""
        stacks = self.manifest.get("stacks") or {}
        names = ([YARDSTICK] if stacks.get("yardstick") else []) + [v["name"] for v in stacks.get("variants", [])]
        for v in self.metrics["variant"].unique().tolist():
            if v not in names:
                names.append(v)
        return names


def load_run(run_dir: str | Path) -> RunData:
    """Read manifest, metrics and findings (pandas and pyarrow only: no torch)."""
    import pyarrow.parquet as pq

    d = Path(run_dir)
    if d.exists() and not d.is_dir():
        raise UsageError(f"RUN_DIR {d} is a file, not a run directory: give the directory `dsv4-drift run` wrote "
                         "(a policy file goes to --policy, a baseline to --baseline)")
    if not d.is_dir():
        raise UsageError(f"run directory {d} does not exist")
    manifest_path = d / "manifest.json"
    if not manifest_path.is_file():
        raise UsageError(f"{d} is not a run directory (no manifest.json)")
    import json

    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"{manifest_path}: cannot read the manifest: {e}") from None
    metrics_path = d / "metrics.parquet"
    if not metrics_path.is_file():
        raise UsageError(f"{d}: no metrics.parquet (the run has not finished a layer)")
    try:
        metrics = pq.read_table(metrics_path).to_pandas()
    except Exception as e:  # noqa: BLE001 - any unreadable parquet is an input error
        raise UsageError(f"{metrics_path}: cannot read the metrics: {e}") from None
    findings_path = d / "findings.json"
    findings = []
    if findings_path.is_file():
        try:
            findings = json.loads(findings_path.read_text())
        except (OSError, ValueError) as e:
            raise UsageError(f"{findings_path}: cannot read the findings: {e}") from None
    for col in ("variant", "mode", "tap", "metric", "phase"):
        metrics[col] = metrics[col].astype(object)
    return RunData(d, manifest, metrics, findings)


# --------------------------------------------------------------------------- results


@dataclass
class Unit:
    """One evaluated (variant, mode, tap, layer, phase) of a check."""

    variant: str
    mode: str
    tap: str
    layer: int
    phase: str
    value: float  # the aggregated loss
    limit: float | None  # the policy bound at this unit (None: the check has no bound, only a baseline)
    passed: bool
    yardstick: float | None = None
    base: float | None = None
    floor: float | None = None
    baseline: float | None = None
    baseline_limit: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def effective_limit(self) -> float:
        """The tighter of the policy bound and the baseline bound (what the value was held to)."""
        limits = [x for x in (self.limit, self.baseline_limit) if x is not None]
        return min(limits) if limits else math.inf

    @property
    def excess(self) -> float:
        """value / limit (inf when the limit is 0 and the value is not; nan for a nan value)."""
        lim = self.effective_limit
        if math.isnan(self.value):
            return math.nan
        if lim == 0:
            return 0.0 if self.value <= 0 else math.inf
        return self.value / lim

    def where(self) -> str:
        return f"layer {self.layer} {self.phase} ({self.mode}, {self.tap})"

    def to_dict(self) -> dict[str, Any]:
        return {"variant": self.variant, "mode": self.mode, "tap": self.tap, "layer": self.layer, "phase": self.phase,
                "value": _num(self.value), "limit": _num(self.limit), "status": "pass" if self.passed else "fail",
                "yardstick": _num(self.yardstick), "base": _num(self.base), "floor": _num(self.floor),
                "baseline": _num(self.baseline), "baseline_limit": _num(self.baseline_limit), "notes": self.notes}


@dataclass
class VariantResult:
    variant: str
    status: str  # pass | fail | warn (failing, severity warn) | no_data | skipped
    units: list[Unit] = field(default_factory=list)
    reason: str = ""

    def failing(self, phase: str | None = None) -> list[Unit]:
        return [u for u in self.units if not u.passed and (phase is None or u.phase == phase)]

    def first_failure(self, phase: str | None = None) -> Unit | None:
        """The failing unit at the lowest layer (prefill before decode, global before local)."""
        bad = self.failing(phase)
        return min(bad, key=_unit_order) if bad else None

    def worst(self, phase: str | None = None) -> Unit | None:
        """The unit closest to (or furthest past) its limit."""
        units = [u for u in self.units if phase is None or u.phase == phase]
        if not units:
            return None
        return max(units, key=lambda u: (math.inf if math.isnan(u.excess) else u.excess, -u.layer))

    def phases(self) -> list[str]:
        return sorted({u.phase for u in self.units}, key=lambda p: PHASE_ORDER.get(p, 9))

    def phase_status(self, phase: str) -> str:
        if any(not u.passed for u in self.units if u.phase == phase):
            return self.status if self.status in ("fail", "warn") else "fail"
        return "pass"


@dataclass
class CheckResult:
    check: Check
    variants: list[VariantResult]
    factor: float | None = None  # the bound's evaluated number (X or F)
    floor: float | None = None
    slack: float | None = None

    @property
    def status(self) -> str:
        statuses = {v.status for v in self.variants}
        for s in ("fail", "warn", "pass", "skipped", "no_data"):
            if s in statuses:
                return s
        return "no_data"


@dataclass
class GateResult:
    run: RunData
    policy: Policy
    checks: list[CheckResult]
    nonfinite: list[dict[str, Any]]
    baseline_source: str | None = None
    notes: list[str] = field(default_factory=list)
    created: str = field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    incomplete: str | None = None  # why the run is not complete (see incompleteness), None when it is
    allow_incomplete: bool = False  # gate --allow-incomplete: judge the layers an incomplete run has
    gate_json: Path | None = None  # where gate_run wrote gate.json into the run directory (None: not written)

    @property
    def failed_checks(self) -> list[tuple[CheckResult, VariantResult]]:
        return [(c, v) for c in self.checks for v in c.variants if v.status == "fail"]

    @property
    def regressed(self) -> bool:
        return bool(self.failed_checks or self.nonfinite)

    @property
    def blocked_as_incomplete(self) -> bool:
        return self.incomplete is not None and not self.allow_incomplete

    @property
    def passed(self) -> bool:
        return not self.regressed and not self.blocked_as_incomplete

    @property
    def exit_code(self) -> int:
        """0 pass, 1 regression (a failing check or NaN/Inf, also in an incomplete run), 2 an incomplete run."""
        return 1 if self.regressed else 2 if self.blocked_as_incomplete else 0

    @property
    def verdict(self) -> str:
        return "fail" if self.regressed else "incomplete" if self.blocked_as_incomplete else "pass"

    def failure_lines(self) -> list[str]:
        """One line per failure: what failed, where first, by how much."""
        lines = []
        if self.blocked_as_incomplete:
            lines.append(f"{self.incomplete}: an incomplete run never passes; finish it with `dsv4-drift run "
                         f"--resume {self.run.dir}`, or judge the layers it has with `gate --allow-incomplete`")
        for f in self.nonfinite:
            lines.append(nonfinite_message(f))
        for c, v in self.failed_checks:
            u = v.first_failure()
            lines.append(f"{c.check.name} [{v.variant}]: {c.check.metric} first fails at {u.where()}: "
                         f"{_fmt(u.value)} > {explain_limit(c, u)}; {len(v.failing())} failing unit(s)")
        return lines


def explain_limit(c: CheckResult, u: Unit) -> str:
    """The limit a unit was held to, with its terms: `0.31 = base 0.23 + 2×yardstick 0.041 + floor 0.0039`."""
    parts = []
    kind = c.check.bound.kind if c.check.bound else None
    if kind == "absolute":
        parts.append(f"{_fmt(u.limit)} (absolute)")
    elif kind == "yardstick" and c.check.rule.order == 2:
        parts.append(f"{_fmt(u.limit)} = {_fmt(c.factor)}²×yardstick {_fmt(u.yardstick)} + floor {_fmt(u.floor)}")
    elif kind == "yardstick":
        parts.append(f"{_fmt(u.limit)} = {_fmt(c.factor)}×yardstick {_fmt(u.yardstick)} + floor {_fmt(u.floor)}")
    elif kind == "base" and c.check.rule.order == 2:
        parts.append(f"{_fmt(u.limit)} = (√base {_fmt(u.base)} + {_fmt(c.factor)}×√yardstick {_fmt(u.yardstick)})² "
                     f"+ floor {_fmt(u.floor)}")
    elif kind == "base":
        parts.append(f"{_fmt(u.limit)} = base {_fmt(u.base)} + {_fmt(c.factor)}×yardstick {_fmt(u.yardstick)} + "
                     f"floor {_fmt(u.floor)}")
    if u.baseline_limit is not None:
        parts.append(f"{_fmt(u.baseline_limit)} = baseline {_fmt(u.baseline)}×(1+{_fmt(c.slack)}) + floor "
                     f"{_fmt(u.floor)}")
    return " and ".join(parts) if parts else "no bound"


def nonfinite_message(f: Mapping[str, Any]) -> str:
    pos = f.get("position")
    return (f"NaN/Inf in {f.get('variant')} ({f.get('mode', 'global')}): first at layer {f.get('layer')}, tap "
            f"{f.get('tap')}.{f.get('field')}, {f.get('phase')}" + (f" position {pos}" if pos is not None else ""))


def _unit_order(u: Unit) -> tuple:
    return (u.layer, PHASE_ORDER.get(u.phase, 9), MODE_ORDER.get(u.mode, 9), u.tap)


def _num(x: float | None) -> float | str | None:
    """JSON-safe number: NaN and ±inf as strings (JSON has no such numbers)."""
    if x is None:
        return None
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def _fmt(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:.4g}"


# --------------------------------------------------------------------------- baselines (values to not regress from)


class Baseline:
    """Observed losses per (check, variant, mode, tap, layer, phase), from a baseline JSON or another run."""

    def __init__(self, values: Mapping[tuple, float], source: str) -> None:
        self.values = dict(values)
        self.source = source

    def get(self, check: str, unit: Mapping[str, Any]) -> float | None:
        return self.values.get((check, unit["variant"], unit["mode"], unit["tap"], int(unit["layer"]), unit["phase"]))


# --------------------------------------------------------------------------- evaluation


def select_layers(check: Check, run: RunData, file: str) -> set[int]:
    cfg, n = run.config, run.n_layers
    kinds = list(cfg.get("layer_kinds") or [])
    hash_flags = list(cfg.get("hash_layers") or [])
    out: set[int] = set()
    for sel in check.layers:
        if isinstance(sel, int) or isinstance(sel, tuple):
            a, b = (sel, sel) if isinstance(sel, int) else sel
            if b > n:
                raise UsageError(f"{file}:{check.line}: {check.path}.layers: layer {b} is past this run's "
                                 f"model ({n} layers 0-{n - 1}; {n} is the logits row)")
            out.update(range(a, b + 1))
        elif sel == "all":
            out.update(range(n + 1))
        elif sel == "logits":
            out.add(n)
        elif sel in ("swa", "csa", "hca"):
            if not kinds:
                raise UsageError(f"{file}:{check.line}: {check.path}.layers: '{sel}' needs model.config."
                                 "layer_kinds in the run's manifest")
            out.update(i for i, k in enumerate(kinds) if k == sel)
        elif sel in ("hash", "learned"):
            flags = hash_flags if len(hash_flags) == n else \
                [i < int(cfg.get("num_hash_layers", 0)) for i in range(n)]
            out.update(i for i, h in enumerate(flags) if h == (sel == "hash"))
    return out


def loss_columns(frame: pd.DataFrame, direction: str) -> pd.DataFrame:
    """Add loss_value (per bin) and loss_peak (per-position maximum of the loss, where the store has it)."""
    v = frame["value"].astype(float)
    if direction == "upper":
        frame = frame.assign(loss_value=v, loss_peak=frame["max"].astype(float))
    elif direction == "lower":
        frame = frame.assign(loss_value=1.0 - v, loss_peak=np.nan)
    elif direction == "signed":
        frame = frame.assign(loss_value=v.abs(), loss_peak=np.nan)
    elif direction == "db":
        frame = frame.assign(loss_value=np.power(10.0, -v / 20.0), loss_peak=np.nan)
    else:
        raise ValueError(direction)
    return frame


def aggregate_units(frame: pd.DataFrame, how: str, direction: str) -> pd.Series:
    """Aggregate a metric's bin rows into one loss per unit; any NaN in a unit makes its aggregate NaN."""
    if frame.empty:
        return pd.Series(dtype=float)
    use_peak = how == "max" and direction == "upper"
    col = "loss_peak" if use_peak else "loss_value"
    frame = frame.assign(_nan=frame[col].isna() | (frame["loss_value"].isna() if use_peak else False))
    g = frame.groupby(UNIT_KEYS, sort=False)
    if how == "max":
        out = g[col].max()
    elif how == "min":
        out = g[col].min()
    elif how == "p99":
        out = g[col].quantile(0.99)
    elif how == "mean":
        weighted = (frame[col] * frame["count"]).groupby([frame[k] for k in UNIT_KEYS], sort=False).sum()
        out = weighted / g["count"].sum()
    else:
        raise ValueError(how)
    out = out.astype(float)
    out[g["_nan"].any()] = math.nan
    return out


def evaluate_check(check: Check, policy: Policy, run: RunData, baseline: Baseline | None) -> CheckResult:
    rule = check.rule
    names = config_names(run.config)
    floor_expr = policy.floor_of(check)
    per_unit_floor = floor_expr is not None and PICK_SHARE in floor_expr.names()
    if per_unit_floor and check.rule.pick_share is None:
        raise UsageError(f"{policy.file}:{check.line}: {check.path}.floor: `{PICK_SHARE}` is defined only for recalls "
                         f"over a subset of the picks ({', '.join(sorted(PICK_SHARE_METRICS))}), not {check.metric}")
    floor = floor_expr.evaluate(names, policy.file) if floor_expr is not None and not per_unit_floor else None
    kind = check.bound.kind if check.bound else None
    if kind in ("yardstick", "base") and floor_expr is None:
        raise UsageError(f"{policy.file}:{check.line}: {check.path}.floor: {check.metric} has no built-in rounding "
                         "floor (its unit depends on the tensor's magnitude); give `floor:` for a relative bound")
    factor = check.bound.value.evaluate(names, policy.file) if check.bound else None
    slack = check.baseline_slack.evaluate(names, policy.file) if check.baseline_slack is not None else None
    variants = policy.variants_for(check, run.variants)
    if not variants:
        reason = f"no variant of the run matches {list(check.variants)}" if check.variants else "no variant to check"
        return CheckResult(check, [VariantResult("*", "no_data", reason=reason)], factor, floor, slack)
    if kind in ("yardstick", "base") and YARDSTICK not in run.variants:
        raise UsageError(f"{policy.file}:{check.line}: check {check.name!r} is bounded relative to the yardstick, but "
                         f"run {run.dir} has none (scenario stacks.yardstick: false); rerun with the yardstick or "
                         "use absolute bounds")
    if kind == "base" and policy.base_variant not in run.variants:
        raise UsageError(f"{policy.file}:{check.line}: check {check.name!r} is bounded relative to variant "
                         f"{policy.base_variant!r} (the stock engine), which run {run.dir} does not have (variants: "
                         f"{', '.join(v for v in run.variants if v != YARDSTICK)}); set base_variant: in the policy")

    layers = select_layers(check, run, policy.file)
    rows = _check_rows(run, check.metric, check, layers)
    wanted = set(variants) | {YARDSTICK, policy.base_variant}
    rows = loss_columns(rows[rows["variant"].isin(wanted)], rule.direction)
    agg = aggregate_units(rows, check.aggregate, rule.direction)
    shares = _pick_shares(run, check, layers) if per_unit_floor else None
    ref_keys = ["mode", "tap", "layer", "phase"]
    ref_values: dict[str, dict[tuple, float]] = {}
    for ref in (YARDSTICK, policy.base_variant):
        part = agg[agg.index.get_level_values("variant") == ref] if len(agg) else agg
        ref_values[ref] = {k[1:]: float(v) for k, v in part.items()}

    results = []
    for variant in variants:
        part = agg[agg.index.get_level_values("variant") == variant] if len(agg) else agg
        if part.empty:
            results.append(VariantResult(variant, "no_data", reason=f"no {check.metric} rows for {variant} at the "
                                                                    "selected layers, phases and modes"))
            continue
        units = []
        for key, value in part.items():
            unit = dict(zip(UNIT_KEYS, key))
            ref_key = tuple(unit[k] for k in ref_keys)
            unit_floor = floor
            if shares is not None:
                if key not in shares.index:
                    raise UsageError(f"{run.dir}: no {rule.pick_share} rows for {variant} at layer {unit['layer']} "
                                     f"{unit['phase']}: the run predates that metric, which the floor of check "
                                     f"{check.name!r} reads; rerun it")
                unit_floor = floor_expr.evaluate({**names, PICK_SHARE: float(shares[key])}, policy.file)
            units.append(_evaluate_unit(check, unit, float(value), kind, factor, unit_floor, slack, baseline,
                                        ref_values[YARDSTICK].get(ref_key),
                                        ref_values[policy.base_variant].get(ref_key)))
        units.sort(key=_unit_order)
        if check.bound is None and (baseline is None or all(u.baseline is None for u in units)):
            results.append(VariantResult(variant, "skipped", units, reason="baseline-only check and no baseline value"))
            continue
        failed = any(not u.passed for u in units)
        status = ("warn" if check.severity == "warn" else "fail") if failed else "pass"
        results.append(VariantResult(variant, status, units))
    return CheckResult(check, results, factor, floor, slack)


def _check_rows(run: RunData, metric: str, check: Check, layers: Sequence[int]) -> pd.DataFrame:
    """The rows of `metric` at the check's taps, modes, phases and layers."""
    m = run.rows_of(metric)
    return m[m["tap"].isin(check.taps) & m["mode"].isin(check.modes) & m["phase"].isin(check.phases)
             & m["layer"].isin(layers)]


def _pick_shares(run: RunData, check: Check, layers: Sequence[int]) -> pd.Series:
    """Per unit, the count-weighted mean of the metric's pick share 1/|subset| over the unit's queries: the
    recall loss of one pick lost at every query, the subset-recall analogue of 1/k for indexer.recall."""
    shares = _check_rows(run, check.rule.pick_share, check, layers)
    return aggregate_units(loss_columns(shares, "upper"), "mean", "upper")  # "upper": the value as it is


def _evaluate_unit(check: Check, unit: dict, value: float, kind: str | None, factor: float | None,
                   floor: float | None, slack: float | None, baseline: Baseline | None,
                   yard: float | None, base: float | None) -> Unit:
    notes = []
    if kind in ("yardstick", "base"):
        if yard is None or not math.isfinite(yard):
            notes.append(f"yardstick value {'missing' if yard is None else yard} at this unit: taken as 0")
            yard_used = 0.0
        else:
            yard_used = max(yard, 0.0)
    limit = None
    quadratic = check.rule.order == 2  # bound √loss: the factor is on the error amplitude
    if kind == "absolute":
        limit = factor
    elif kind == "yardstick":
        limit = (factor ** 2 if quadratic else factor) * yard_used + floor
    elif kind == "base":
        if base is None or not math.isfinite(base):
            notes.append(f"base value {'missing' if base is None else base} at this unit: taken as 0")
            base_used = 0.0
        else:
            base_used = max(base, 0.0)
        if quadratic:
            limit = (math.sqrt(base_used) + factor * math.sqrt(yard_used)) ** 2 + floor
        else:
            limit = base_used + factor * yard_used + floor
    passed = _within(value, limit) if limit is not None else True
    bl = bl_limit = None
    if slack is not None and baseline is not None:
        bl = baseline.get(check.name, unit)
        if bl is None:
            notes.append("no baseline value at this unit")
        else:
            bl_limit = bl * (1 + slack) + (floor or 0.0)
            passed = passed and _within(value, bl_limit)
    return Unit(unit["variant"], unit["mode"], unit["tap"], int(unit["layer"]), unit["phase"], value, limit, passed,
                yardstick=yard if kind in ("yardstick", "base") else None, base=base if kind == "base" else None,
                floor=floor if kind in ("yardstick", "base") or bl is not None else None,
                baseline=bl, baseline_limit=bl_limit, notes=notes)


def _within(value: float, limit: float) -> bool:
    if math.isnan(value):
        return False
    return value <= limit + REL_TOL * abs(limit)


def incompleteness(run: RunData) -> str | None:
    """Why a run cannot be judged whole — its manifest status is not `complete` (killed or still running,
    interrupted, failed) — with the error that stopped it and the layers it has metrics for; None when complete."""
    status = run.manifest.get("status")
    if status == "complete":
        return None
    error = (run.manifest.get("failure") or {}).get("error")
    present = sorted(int(x) for x in run.metrics["layer"].unique())
    return (f"run {run.dir} is incomplete (status {status or 'missing'}{': ' + str(error) if error else ''}): it "
            f"has metrics for layer(s) {_ranges(present) or 'none'} of 0-{run.n_layers - 1} and the logits row "
            f"{run.n_layers}")


def evaluate(policy: Policy, run: RunData, baseline: Baseline | None = None,
             allow_incomplete: bool = False) -> GateResult:
    checks = [evaluate_check(c, policy, run, baseline) for c in policy.checks]
    notes = []
    if baseline is not None and not any(c.baseline_slack is not None for c in policy.checks):
        notes.append("a baseline was given but no check of the policy has `baseline: {slack: …}`")
    incomplete = incompleteness(run)
    present = set(run.metrics["layer"].unique().tolist())
    missing = [layer for layer in range(run.n_layers + 1) if layer not in present]
    if incomplete is not None and allow_incomplete:
        notes.append(f"gated with --allow-incomplete: {incomplete}; layers without metrics are not gated")
    elif incomplete is None and missing:
        notes.append(f"the run has no metrics for layer(s) {_ranges(missing)} (layer {run.n_layers} is the final "
                     "logits row): a partial run; those layers are not gated")
    nonfinite = sorted(run.findings, key=lambda f: (int(f.get("layer", 0)), str(f.get("variant"))))
    return GateResult(run, policy, checks, nonfinite, baseline.source if baseline else None, notes,
                      incomplete=incomplete, allow_incomplete=allow_incomplete)


def _ranges(values: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(f"{start}-{v}" if v != start else f"{v}")
            start = None
    return ", ".join(out)


def observed_values(result: GateResult) -> Iterable[tuple[tuple, float]]:
    """(check, variant, mode, tap, layer, phase) -> loss for every finite evaluated unit (what a baseline records)."""
    for c in result.checks:
        for v in c.variants:
            for u in v.units:
                if math.isfinite(u.value):
                    yield (c.check.name, u.variant, u.mode, u.tap, u.layer, u.phase), u.value
