"""Evaluate a gate policy on a run directory (DESIGN §5): per check, variant, mode, tap, layer, phase and group.

A *unit* is one (variant, mode, tap, layer, phase, group). The group is the check's scope: the whole layer, or
one prefill chunk, turn, decode step or position bin of it (harness.run.bins: bins never straddle a chunk or a
turn, so every group is a set of whole bins). For each check and unit the metric's rows (one per position bin)
are turned into the check's loss (larger is worse: x for errors, 1 − x for recalls) and aggregated over the
group's bins; the same aggregate of the yardstick's (and the base variant's, and the variant's own benign
twin's) rows over the same group gives the relative bound:

    absolute:  loss ≤ X
    yardstick: loss ≤ F·max(yardstick, 0) + floor
    base:      loss ≤ base + F·max(yardstick, 0) + floor
    twin:      loss ≤ F·twin + floor                      (fp32 decision sites: the stock op re-associated)
    baseline:  loss ≤ baseline·(1 + slack) + floor        (with a baseline, for checks that ask for one; a
                                                          discrete metric adds the count noise below, since
                                                          the baseline's count and this run's are both draws)

F is a factor on the error amplitude. For metrics quadratic in it (KL, JS, 1 − cos, whose square roots are
distances) the same triangle inequality is applied to square roots: F²·yardstick and (√base + F·√yardstick)².

Discrete metrics (indexer picks, expert choices, needle answers) are bounded as counts. A unit of `positions`
positions makes N = positions × decisions of them (MetricRule.decisions), and V = loss × N of them were lost. A
relative bound whose right-hand side without the floor is R = Σ c·r (c: F for the yardstick and the twin, 1 for
base) allows A = N·R lost decisions; the unit passes when

    loss ≤ allowed_count(...)/N + floor

allowed_count is A plus z standard deviations of V − A: flips are rare independent events at near-ties whose rate
scales with the perturbation, so V and every reference count N·r are Poisson draws, and a low draw of a
reference must not fail a variant at its allowed rate. The comparison is made on the square-root scale, where
Poisson counts are nearly Gaussian with variance 1/4 (`allowed_count`); z = the policy's `poisson_z`. The floor
of a discrete metric is one decision of the unit's N (a tie broken the other way): 1/N.

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
from harness.gate.expressions import Expr
from harness.gate.metric_rules import PICK_SHARE, PICK_SHARE_METRICS, POSITIONS, UNIT_VARIABLES
from harness.gate.policy import RELATIVE_KINDS, YARDSTICK, Check, Policy, config_names

REL_TOL = 1e-9
UNIT_KEYS = ["variant", "mode", "tap", "layer", "phase", "group"]
SCOPE_COLUMN = {"chunk": "chunk", "turn": "turn", "step": "step", "bin": "pos_bin"}
"""The metrics.parquet column that names a row's group in each scope (layer scope: one group)."""
PHASE_ORDER = {"prefill": 0, "decode": 1}
MODE_ORDER = {"global": 0, "local": 1, "forced": 2}


# --------------------------------------------------------------------------- the run


@dataclass
class RunData:
    dir: Path
    manifest: dict[str, Any]
    metrics: pd.DataFrame
    findings: list[dict[str, Any]]

    # found once from `metrics` and `manifest`, which are never replaced or edited after load_run
    _by_metric: dict[str, pd.DataFrame] | None = field(default=None, repr=False, compare=False)
    _variants: list[str] | None = field(default=None, repr=False, compare=False)

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
        """The run's stacks compared against the reference: the yardstick (when it ran), then the variants. Found
        once: every check asks, and a unique() over the string column took ~8 ms on the demo's 262,000 rows (1.1 s of
        its gate's 2.8 s). A copy, so a caller's edit changes nothing here."""
        if self._variants is None:
            stacks = self.manifest.get("stacks") or {}
            names = ([YARDSTICK] if stacks.get("yardstick") else []) + [v["name"] for v in stacks.get("variants", [])]
            for v in self.metrics["variant"].unique().tolist():
                if v not in names:
                    names.append(v)
            self._variants = names
        return list(self._variants)


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
    """One evaluated (variant, mode, tap, layer, phase, group) of a check."""

    variant: str
    mode: str
    tap: str
    layer: int
    phase: str
    value: float  # the aggregated loss
    limit: float | None  # the policy bound at this unit (None: the check has no bound, only a baseline)
    passed: bool
    scope: str = "layer"
    group: int | None = None  # chunk, turn, step, or the bin's first position; None: the whole layer and phase
    span: tuple[int, int] = (0, 0)  # [first position, one past the last) of the unit's rows
    worst: tuple[int, int] | None = None  # aggregate max over several bins: the bin holding the unit's loss
    positions: int = 0  # Σ count of the unit's rows
    yardstick: float | None = None
    base: float | None = None
    twin: float | None = None
    floor: float | None = None
    decisions: float | None = None  # counted bounds: the unit's N = positions × decisions per position
    allowance: float | None = None  # counted bounds: the count noise allowed above R (allowed_count/N − R)
    draw_allowance: float | None = None  # base-relative drawn bounds in global mode: draw_z × draw_noise
    baseline: float | None = None
    baseline_limit: float | None = None
    baseline_allowance: float | None = None  # the count noise (discrete metrics) or the draw noise (drawn checks in
    # global mode: draw_z × draw_noise) allowed above baseline·(1 + slack)
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

    @property
    def rank(self) -> float:
        """The excess with NaN as +inf: how near to (or far past) its limit, for picking the worst unit."""
        return math.inf if math.isnan(self.excess) else self.excess

    @property
    def group_text(self) -> str:
        """The group within the layer and phase: "" (the whole of it), `chunk 1`, `turn 2`, `step 3`,
        `positions 320-383`."""
        if self.group is None:
            return ""
        if self.scope == "bin":
            first, end = self.span
            return f"position {first}" if end - first == 1 else f"positions {first}-{end - 1}"
        if self.scope == "turn" and self.group < 0:
            return "turn -1 (preamble)"
        return f"{self.scope} {self.group}"

    def where(self) -> str:
        """`layer 4 prefill chunk 1 (global, attn.out)`; a unit aggregated by its worst bin says which:
        `layer 2 prefill, worst at positions 320-383 (local, compressor.rows)`."""
        group = f" {self.group_text}" if self.group_text else ""
        worst = ""
        if self.worst is not None and self.worst != self.span:
            first, end = self.worst
            worst = f", worst at position {first}" if end - first == 1 else f", worst at positions {first}-{end - 1}"
        return f"layer {self.layer} {self.phase}{group}{worst} ({self.mode}, {self.tap})"

    @property
    def key(self) -> tuple:
        """(variant, mode, tap, layer, phase, scope, group): the unit's identity in a baseline."""
        return self.variant, self.mode, self.tap, self.layer, self.phase, self.scope, self.group

    def to_dict(self) -> dict[str, Any]:
        return {"variant": self.variant, "mode": self.mode, "tap": self.tap, "layer": self.layer, "phase": self.phase,
                "scope": self.scope, "group": self.group, "span": list(self.span), "positions": self.positions,
                "worst": None if self.worst is None else list(self.worst),
                "value": _num(self.value), "limit": _num(self.limit), "status": "pass" if self.passed else "fail",
                "yardstick": _num(self.yardstick), "base": _num(self.base), "twin": _num(self.twin),
                "floor": _num(self.floor), "decisions": _num(self.decisions), "allowance": _num(self.allowance),
                "draw_allowance": _num(self.draw_allowance),
                "baseline": _num(self.baseline), "baseline_limit": _num(self.baseline_limit),
                "baseline_allowance": _num(self.baseline_allowance), "notes": self.notes}


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
        return max(units, key=lambda u: (u.rank, -u.layer))

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
    floor: float | None = None  # None where it depends on the unit (positions, pick_share)
    slack: float | None = None
    poisson_z: float | None = None  # counted bounds and counted baselines only
    draw_z: float | None = None  # drawn checks (Check.drawn) only

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
    """The limit a unit was held to, with its terms: `0.31 = base 0.23 + 2×yardstick 0.041 + floor 0.0039`; a
    counted bound adds its Poisson allowance and N, A."""
    parts = []
    kind = c.check.bound.kind if c.check.bound else None
    quadratic = c.check.rule.order == 2
    relative = {
        "yardstick": f"{_fmt(c.factor)}{'²' if quadratic else ''}×yardstick {_fmt(u.yardstick)}",
        "base": f"(√base {_fmt(u.base)} + {_fmt(c.factor)}×√yardstick {_fmt(u.yardstick)})²" if quadratic else
                f"base {_fmt(u.base)} + {_fmt(c.factor)}×yardstick {_fmt(u.yardstick)}",
        "twin": f"{_fmt(c.factor)}×twin {_fmt(u.twin)}"}
    if kind == "absolute":
        parts.append(f"{_fmt(u.limit)} (absolute)")
    elif kind in relative and u.allowance is not None:
        n, allowed = u.decisions, (u.limit - u.allowance - u.floor) * u.decisions
        parts.append(f"{_fmt(u.limit)} = {relative[kind]} + count noise (z = {_fmt(c.poisson_z)}) "
                     f"{_fmt(u.allowance)} + floor {_fmt(u.floor)} (N = {n:.0f} decisions, A = {allowed:.3g})")
    elif kind in relative and u.draw_allowance is not None:
        parts.append(f"{_fmt(u.limit)} = {relative[kind]} + draw noise (z = {_fmt(c.draw_z)}) "
                     f"{_fmt(u.draw_allowance)} + floor {_fmt(u.floor)}")
    elif kind in relative:
        parts.append(f"{_fmt(u.limit)} = {relative[kind]} + floor {_fmt(u.floor)}")
    if u.baseline_limit is not None:
        if u.baseline_allowance is None:
            noise = ""
        elif not c.check.rule.discrete:
            noise = f" + draw noise (z = {_fmt(c.draw_z)}) {_fmt(u.baseline_allowance)}"
        else:
            noise = f" + count noise (z = {_fmt(c.poisson_z)}) {_fmt(u.baseline_allowance)}"
        parts.append(f"{_fmt(u.baseline_limit)} = baseline {_fmt(u.baseline)}×(1+{_fmt(c.slack)}){noise} + floor "
                     f"{_fmt(u.floor)}")
    return " and ".join(parts) if parts else "no bound"


def nonfinite_message(f: Mapping[str, Any]) -> str:
    pos = f.get("position")
    return (f"NaN/Inf in {f.get('variant')} ({f.get('mode', 'global')}): first at layer {f.get('layer')}, tap "
            f"{f.get('tap')}.{f.get('field')}, {f.get('phase')}" + (f" position {pos}" if pos is not None else ""))


def _unit_order(u: Unit) -> tuple:
    return (u.layer, PHASE_ORDER.get(u.phase, 9), MODE_ORDER.get(u.mode, 9), u.tap, u.span[0])


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
    """Observed losses per (check, variant, mode, tap, layer, phase, scope, group), from a baseline JSON or another
    run."""

    def __init__(self, values: Mapping[tuple, float], source: str) -> None:
        self.values = dict(values)
        self.source = source

    def get(self, check: str, unit: Unit) -> float | None:
        return self.values.get((check, *unit.key))


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


def scoped(frame: pd.DataFrame, scope: str) -> pd.DataFrame:
    """The rows with a `group` column naming each row's group in `scope`: one group per layer and phase (layer),
    per prefill chunk (chunk: the decode rows, chunk −1, are one group of their own), turn, decode step (step:
    prefill rows are not in this scope) or position bin (bin: its first position)."""
    if scope == "step":
        frame = frame[frame["phase"] == "decode"]
    return frame.assign(group=frame[SCOPE_COLUMN[scope]] if scope in SCOPE_COLUMN else 0)


def aggregate_units(frame: pd.DataFrame, how: str, direction: str) -> pd.DataFrame:
    """Aggregate a metric's bin rows (with their `group`, see `scoped`) into one row per unit: its loss (NaN when
    any of its bins is NaN), positions (Σ count) and span [start, end) of positions."""
    if frame.empty:
        return pd.DataFrame({"loss": [], "positions": [], "start": [], "end": []},
                            index=pd.MultiIndex.from_tuples([], names=UNIT_KEYS))
    use_peak = how == "max" and direction == "upper"
    col = "loss_peak" if use_peak else "loss_value"
    frame = frame.assign(_nan=frame[col].isna() | (frame["loss_value"].isna() if use_peak else False))
    g = frame.groupby(UNIT_KEYS, sort=False)
    if how == "max":
        loss = g[col].max()
    elif how == "min":
        loss = g[col].min()
    elif how == "p99":
        loss = g[col].quantile(0.99)
    elif how == "mean":
        weighted = (frame[col] * frame["count"]).groupby([frame[k] for k in UNIT_KEYS], sort=False).sum()
        loss = weighted / g["count"].sum()
    else:
        raise ValueError(how)
    loss = loss.astype(float)
    loss[g["_nan"].any()] = math.nan
    out = pd.DataFrame({"loss": loss, "positions": g["count"].sum(), "start": g["pos_bin"].min(),
                        "end": g["pos_end"].max()})
    if how == "max":  # the bin that holds the unit's loss: where to look (a row, a query) in a large unit
        worst = frame.sort_values(col, ascending=False, na_position="first", kind="stable") \
            .drop_duplicates(UNIT_KEYS).set_index(UNIT_KEYS)
        out["worst_start"], out["worst_end"] = worst["pos_bin"].reindex(out.index), worst["pos_end"].reindex(out.index)
    return out


@dataclass(frozen=True)
class _Bound:
    """What one check's units are held to, evaluated once per check: the relative kind and its factor, the floor
    (a number, or the expression when it reads the unit's positions or pick share) and, for counted bounds, the
    decisions per position."""

    kind: str | None
    factor: float | None
    floor: float | Expr | None
    slack: float | None
    decisions: Expr | None
    poisson_z: float
    names: Mapping[str, float]
    file: str

    def floor_at(self, unit_names: Mapping[str, float]) -> float | None:
        if isinstance(self.floor, Expr):
            return self.floor.evaluate({**self.names, **unit_names}, self.file)
        return self.floor

    def decisions_at(self, positions: int, unit_names: Mapping[str, float]) -> float | None:
        """N = positions × decisions per position, for a counted bound."""
        if self.decisions is None:
            return None
        return positions * self.decisions.evaluate({**self.names, **unit_names}, self.file)


def evaluate_check(check: Check, policy: Policy, run: RunData, baseline: Baseline | None) -> CheckResult:
    rule = check.rule
    names = config_names(run.config)
    floor_expr = policy.floor_of(check)
    decisions = Expr(rule.decisions, check.line, f"{check.path} (decisions of {check.metric})") \
        if check.counted or (rule.discrete and check.baseline_slack is not None and check.aggregate == "mean") \
        else None  # a count only as a mean over the unit's decisions (a max of a unit is no count)
    unit_names = set().union(*(e.names() for e in (floor_expr, decisions) if e is not None)) & UNIT_VARIABLES
    if PICK_SHARE in unit_names and check.rule.pick_share is None:
        raise UsageError(f"{policy.file}:{check.line}: {check.path}.floor: `{PICK_SHARE}` is defined only for recalls "
                         f"over a subset of the picks ({', '.join(sorted(PICK_SHARE_METRICS))}), not {check.metric}")
    kind = check.bound.kind if check.bound else None
    if kind in RELATIVE_KINDS and floor_expr is None:
        raise UsageError(f"{policy.file}:{check.line}: {check.path}.floor: {check.metric} has no built-in rounding "
                         "floor (its unit depends on the tensor's magnitude); give `floor:` for a relative bound")
    floor = None if floor_expr is None else floor_expr if unit_names & floor_expr.names() else \
        floor_expr.evaluate(names, policy.file)
    factor = check.bound.value.evaluate(names, policy.file) if check.bound else None
    slack = check.baseline_slack.evaluate(names, policy.file) if check.baseline_slack is not None else None
    z = policy.poisson_z.evaluate(names, policy.file) if decisions is not None else None
    draw_z = policy.draw_z.evaluate(names, policy.file) if check.drawn else None
    bound = _Bound(kind, factor, floor, slack, decisions, z or 0.0, names, policy.file)
    fixed_floor = None if isinstance(floor, Expr) else floor

    def result(variants: list[VariantResult]) -> CheckResult:
        return CheckResult(check, variants, factor, fixed_floor, slack, z, draw_z)

    variants = policy.variants_for(check, run.variants)
    if not variants:
        reason = f"no variant of the run matches {list(check.variants)}" if check.variants else "no variant to check"
        return result([VariantResult("*", "no_data", reason=reason)])
    if kind in ("yardstick", "base") and YARDSTICK not in run.variants:
        raise UsageError(f"{policy.file}:{check.line}: check {check.name!r} is bounded relative to the yardstick, but "
                         f"run {run.dir} has none (scenario stacks.yardstick: false); rerun with the yardstick or "
                         "use absolute bounds")
    if kind == "base" and policy.base_variant not in run.variants:
        raise UsageError(f"{policy.file}:{check.line}: check {check.name!r} is bounded relative to variant "
                         f"{policy.base_variant!r} (the stock engine), which run {run.dir} does not have (variants: "
                         f"{', '.join(v for v in run.variants if v != YARDSTICK)}); set base_variant: in the policy")

    layers = select_layers(check, run, policy.file)
    agg = _aggregated(run, check.metric, check, layers, set(variants) | {YARDSTICK, policy.base_variant},
                      check.aggregate, rule.direction)
    refs = {ref: {key[1:]: float(v) for key, v in _of(agg, ref)["loss"].items()}
            for ref in (YARDSTICK, policy.base_variant)}
    twins = _aggregated(run, rule.twin, check, layers, set(variants), check.aggregate, rule.direction)["loss"] \
        if kind == "twin" else None
    shares = _aggregated(run, rule.pick_share, check, layers, set(variants), "mean", "upper")["loss"] \
        if PICK_SHARE in unit_names else None  # "upper": the share as it is
    draws = draw_noise(run, check, layers, set(variants), policy.base_variant, rule.direction) \
        if draw_z is not None and (kind == "base" or (slack is not None and baseline is not None)) else None

    results = []
    for variant in variants:
        part = _of(agg, variant)
        if part.empty:
            results.append(VariantResult(variant, "no_data", reason=f"no {check.metric} rows for {variant} at the "
                                                                    "selected layers, phases and modes"))
            continue
        units = []
        for key, row in zip(part.index, part.itertuples(index=False)):
            at = {POSITIONS: float(row.positions)}
            if shares is not None:
                if key not in shares.index:
                    raise UsageError(f"{run.dir}: no {rule.pick_share} rows for {variant} at layer {key[3]} {key[4]}: "
                                     f"the run predates that metric, which the floor of check {check.name!r} reads; "
                                     "rerun it")
                at[PICK_SHARE] = float(shares[key])
            unit = _unit(check.scope, key, row)
            refs_at = (refs[YARDSTICK].get(key[1:]), refs[policy.base_variant].get(key[1:]),
                       None if twins is None else _value(twins, key))
            draw = None if draws is None or key not in draws.index else draw_z * float(draws[key])
            units.append(_evaluate_unit(check, unit, bound, at, refs_at, baseline, draw))
        units.sort(key=_unit_order)
        if check.bound is None and (baseline is None or all(u.baseline is None for u in units)):
            results.append(VariantResult(variant, "skipped", units, reason="baseline-only check and no baseline value"))
            continue
        failed = any(not u.passed for u in units)
        status = ("warn" if check.severity == "warn" else "fail") if failed else "pass"
        results.append(VariantResult(variant, status, units))
    return result(results)


def _aggregated(run: RunData, metric: str, check: Check, layers: Sequence[int], variants: set[str], how: str,
                direction: str) -> pd.DataFrame:
    """`metric`'s rows of `variants` at the check's taps, modes, phases and layers, aggregated per unit of the
    check's scope."""
    rows = _check_rows(run, metric, check, layers, variants, check.modes)
    return aggregate_units(scoped(loss_columns(rows, direction), check.scope), how, direction)


def _check_rows(run: RunData, metric: str, check: Check, layers: Sequence[int], variants: set[str],
                modes: Sequence[str]) -> pd.DataFrame:
    """`metric`'s rows of `variants` at the check's taps and phases, in `modes`, at `layers`."""
    m = run.rows_of(metric)
    return m[m["tap"].isin(check.taps) & m["mode"].isin(modes) & m["phase"].isin(check.phases)
             & m["layer"].isin(layers) & m["variant"].isin(variants)]


ROW_KEYS = ["mode", "tap", "layer", "phase", "chunk", "step", "turn", "pos_bin"]
"""What names one row of a variant's metric: the same bins (or decode steps) in every variant of a run."""


DRAW_MIN_ROWS = 16
"""Rows a unit needs for its draw noise to be estimated (fewer: no allowance). The allowance is z estimated standard
errors, whose one-sided tail is Student's t with n − 1 degrees of freedom, not the normal's: P(T > 4) is 6·10⁻⁴ at
16 rows and 2·10⁻⁴ at 32 (a decode phase of 32–64 steps; a prefill of 8K positions in 512-position bins: 16–20),
against 0.08 at 2 rows."""


def _batch_se(frame: pd.DataFrame, value: str, keys: list[str]) -> tuple[pd.Series, pd.Series]:
    """Per group of `keys`, the standard error of the count-weighted mean of `value` over the group's rows (batch
    means: SE² = n/(n − 1) · Σ w_i²·(x_i − x̄)² / (Σ w_i)², x̄ = Σ w_i·x_i / Σ w_i), and the group's row count."""
    w, x = frame["count"].astype(float), frame[value].astype(float)
    by = [frame[k] for k in keys]
    total = w.groupby(by, sort=False).sum()
    mean = (w * x).groupby(by, sort=False).sum() / total
    centred = x - mean.reindex(pd.MultiIndex.from_frame(frame[keys])).to_numpy()
    n = w.groupby(by, sort=False).size().astype(float)
    spread = (w * w * centred * centred).groupby(by, sort=False).sum() / (total * total)
    return (spread * n / (n - 1)).pow(0.5), n


def draw_noise(run: RunData, check: Check, layers: Sequence[int], variants: set[str], base: str,
               direction: str) -> pd.Series:
    """Per global-mode unit of `variants`, the standard error of (the variant's loss − base's loss), a mean over the
    unit's rows: the noise of a draw (policy rule 5); NaN where it is not estimated.

    In global mode each stack runs on its own upstream output, and any change upstream — an fp32 re-association
    included — re-draws which near-ties the stock engine flips; a flipped expert or indexer row carries an O(1) error
    to its position and, through the caches, to later ones. A unit's accumulated loss is then one draw of that noise,
    and a benign variant's draw and base's differ by it: at the CPU demo's layer 41 global decode (32 steps), |ΔLSE|
    was 0.458 for base and 0.66–0.69 for a more precise experts op, `all` and bugs elsewhere in the model, against a
    bound of 0.658 — the paired differences' standard error was 0.056–0.067, base's own 0.049 (×√2: 0.070).

    Estimated by batch means (_batch_se: a row is the mean of one bin or decode step, which keeps the correlation of
    neighbouring positions inside it), as the smaller of two estimates:
    - the unit's rows paired with base's at the same bins or steps: pairing cancels what every variant shares (the
      error's growth along the positions of a prefill), but a variant's own error inflates it — a bug confined to a
      few rows would widen its own allowance at any size (one decode step of 32 wrong by δ: an allowance of 4× its
      excess, whatever δ);
    - √2 × the standard error of base's own rows (two independent draws of base's noise), which the variant cannot
      move, but which a prefill's position trend inflates.
    The estimate still assumes rows uncorrelated with one another; an early flip carried to later rows makes them
    positively correlated and the estimate low (the bound then errs on the strict side). NaN (no allowance) for a
    unit with fewer than DRAW_MIN_ROWS rows, with a non-finite loss in it (it fails anyway), or with a row base
    lacks. Local mode needs none: the triangle inequality holds there position by position."""
    rows = _check_rows(run, check.metric, check, layers, variants | {base}, ["global"])
    rows = scoped(loss_columns(rows, direction), check.scope)
    base_rows = rows[rows["variant"] == base]
    paired = rows[rows["variant"] != base].merge(
        base_rows[ROW_KEYS + ["loss_value"]].rename(columns={"loss_value": "base_loss"}), on=ROW_KEYS,
        how="left", validate="many_to_one")  # row keys are unique per variant (the store's schema)
    if paired.empty:
        return pd.Series([], dtype=float, index=pd.MultiIndex.from_tuples([], names=UNIT_KEYS))
    paired = paired.assign(difference=paired["loss_value"] - paired["base_loss"])
    se, n = _batch_se(paired, "difference", UNIT_KEYS)
    unfit = (~np.isfinite(paired["difference"])).groupby([paired[k] for k in UNIT_KEYS], sort=False).any()
    group_keys = UNIT_KEYS[1:]  # a unit's place, without its variant
    base_se = _batch_se(base_rows, "loss_value", group_keys)[0] * math.sqrt(2) if not base_rows.empty else None
    own = se.index.droplevel("variant")
    base_part = base_se.reindex(own).to_numpy() if base_se is not None else np.full(len(se), np.nan)
    estimate = pd.Series(np.fmin(se.to_numpy(), base_part), index=se.index)  # fmin: base's NaN leaves the paired
    return estimate.where((n >= DRAW_MIN_ROWS) & ~unfit)


def _of(agg: pd.DataFrame, variant: str) -> pd.DataFrame:
    return agg[agg.index.get_level_values("variant") == variant]


def _value(series: pd.Series, key: tuple) -> float | None:
    return float(series[key]) if key in series.index else None


def _unit(scope: str, key: tuple, row: Any) -> Unit:
    """A unit's identity from its aggregated row: the group is None for the whole layer and phase (layer scope,
    and the decode rows of chunk scope)."""
    unit = dict(zip(UNIT_KEYS, key))
    whole = scope == "layer" or (scope == "chunk" and unit["phase"] == "decode")
    worst = getattr(row, "worst_start", None)
    return Unit(unit["variant"], unit["mode"], unit["tap"], int(unit["layer"]), unit["phase"], float(row.loss),
                None, True, scope=scope, group=None if whole else int(unit["group"]),
                span=(int(row.start), int(row.end)), positions=int(row.positions),
                worst=None if worst is None or pd.isna(worst) else (int(worst), int(row.worst_end)))


def _evaluate_unit(check: Check, unit: Unit, bound: _Bound, at: Mapping[str, float],
                   refs: tuple[float | None, float | None, float | None], baseline: Baseline | None,
                   draw: float | None = None) -> Unit:
    """Fill in the unit's limit and verdict from the bound and the yardstick's, base's and twin's losses there, and,
    at a global unit of a drawn check, from its draw noise `draw` (draw_z × draw_noise; NaN or None: none), which a
    base-relative bound and a baseline bound allow."""
    kind, factor = bound.kind, bound.factor
    yard, base, twin = refs
    floor = bound.floor_at(at)

    def used(name: str, value: float | None) -> float:
        if value is None or not math.isfinite(value):
            unit.notes.append(f"{name} value {'missing' if value is None else value} at this unit: taken as 0")
            return 0.0
        return max(value, 0.0)

    if kind == "absolute":
        unit.limit = factor
    elif kind in RELATIVE_KINDS:
        # (coefficient, reference loss) of the bound's right-hand side R = Σ c·r; for metrics quadratic in the
        # error amplitude the triangle inequality is on square roots: R = (Σ c·√r)²
        if kind == "yardstick":
            terms = [(factor, used("yardstick", yard))]
        elif kind == "base":
            terms = [(1.0, used("base", base)), (factor, used("yardstick", yard))]
        else:
            terms = [(factor, used("twin", twin))]
        if check.rule.order == 2:
            relative = sum(c * math.sqrt(r) for c, r in terms) ** 2
        else:
            relative = sum(c * r for c, r in terms)
        n = bound.decisions_at(unit.positions, at)
        if n is not None and n > 0:  # counted (module docstring)
            allowed = allowed_count([(c, r * n) for c, r in terms], bound.poisson_z)
            unit.decisions, unit.allowance = n, allowed / n - relative
        if kind == "base" and draw is not None and math.isfinite(draw):
            unit.draw_allowance = draw
        unit.limit = relative + (unit.allowance or 0.0) + floor + (unit.draw_allowance or 0.0)
    unit.passed = _within(unit.value, unit.limit) if unit.limit is not None else True
    if kind in ("yardstick", "base"):
        unit.yardstick = yard
    unit.base = base if kind == "base" else None
    unit.twin = twin if kind == "twin" else None
    if bound.slack is not None and baseline is not None:
        unit.baseline = baseline.get(check.name, unit)
        if unit.baseline is None:
            unit.notes.append("no baseline value at this unit")
        else:
            allowed = unit.baseline * (1 + bound.slack)
            n = bound.decisions_at(unit.positions, at)
            if n is not None and n > 0:  # the baseline's count and this run's are both draws (rule 5 of the policy)
                counted = allowed_count([(1 + bound.slack, unit.baseline * n)], bound.poisson_z) / n
                unit.baseline_allowance = counted - allowed
                allowed = counted
            elif draw is not None and math.isfinite(draw):  # a global unit: the baseline's is another draw (rule 5)
                unit.baseline_allowance = draw
                allowed += draw
            unit.baseline_limit = allowed + (floor or 0.0)
            unit.passed = unit.passed and _within(unit.value, unit.baseline_limit)
    if kind in RELATIVE_KINDS or unit.baseline is not None:
        unit.floor = floor
    return unit


ANSCOMBE = 3 / 8
"""√(X + 3/8) of a Poisson count X has variance 1/4 + O(1/mean) whatever its mean, and little skew (Anscombe 1948)."""


def allowed_count(references: Sequence[tuple[float, float]], z: float) -> float:
    """The lost decisions a counted bound allows before its floor. `references`: (coefficient c, count n) of each
    reference in the relative part (yardstick F, base 1, twin F), which allows A = Σ c·n. Every count is a
    Poisson draw, so the variant may exceed A by z standard deviations of the difference, taken on the
    square-root scale where they are nearly Gaussian: √(V + 3/8) ≤ √(Σ c·(n + 3/8)) + z·s with
    s² = 1/4 + Σ c²·(n + 3/8) / (4·Σ c·(n + 3/8)) — the variant's 1/4 and the references' by the delta method.
    Works on numpy arrays too (tests check its false-failure rate by sampling)."""
    shifted = sum(c * (n + ANSCOMBE) for c, n in references)
    spread2 = 0.25 + sum(c * c * (n + ANSCOMBE) for c, n in references) / (4 * shifted)
    return (shifted ** 0.5 + z * spread2 ** 0.5) ** 2 - ANSCOMBE


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
    """(check, variant, mode, tap, layer, phase, scope, group) -> loss for every finite evaluated unit (what a
    baseline records)."""
    for c in result.checks:
        for v in c.variants:
            for u in v.units:
                if math.isfinite(u.value):
                    yield (c.check.name, *u.key), u.value
