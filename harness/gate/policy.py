"""Gate policies: which drift metric, where, aggregated how, bounded by what (DESIGN §5) — a policy is data.

A policy is a YAML file with a list of checks. Each check names one metric of harness.run.metrics, the
layers, phases, modes and variants it covers, its scope (the whole layer, or each prefill chunk, turn, decode
step or position bin of it), how the bins of one group are aggregated, and a bound. Checks are evaluated per
(variant, mode, tap, layer, phase, group) — a *unit* — so the gate can name the first layer, and the chunk,
turn, step or bin, where a check fails (harness.gate.evaluate). The models below describe the file; their field
descriptions are its documentation and land in the JSON Schema (`dsv4-drift gate --schema`, shipped as
policies/policy.schema.json). Problems are reported as `file:line: field: problem` (harness.scenario.validation).

Numbers (bound factors, floors, slack) may be arithmetic expressions over numbers and the run's model
config fields, e.g. `2**-4 / 2**-8` or `1/index_topk`, evaluated against each run's config (`Expr.evaluate`):
the same policy holds for every model size. Floors may also read the unit's `positions` (and, for subset
recalls, `pick_share`), so a discrete floor is one decision of what the unit holds.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Mapping, Sequence, Union

from pydantic import (AfterValidator, BeforeValidator, ConfigDict, Field, PlainValidator, PrivateAttr, ValidationInfo,
                      WithJsonSchema, create_model, model_validator)

from harness.errors import UsageError
from harness.gate.expressions import Expr, ExprValue
from harness.gate.metric_rules import GATEABLE, METRICS, MetricRule
from harness.scenario.validation import (FileModel, Int, Model, Str, describe, matching, problem, suggest,
                                         validate_located)
from harness.scenario.yaml_source import Issue, ScenarioError, load_located

POLICIES_DIR = Path(__file__).resolve().parent / "policies"
DEFAULT_POLICY = POLICIES_DIR / "default.yaml"
SCHEMA_FILE = POLICIES_DIR / "policy.schema.json"
"""The policy JSON Schema the shipped policies name in their `# yaml-language-server: $schema=…` line."""
YARDSTICK = "yardstick"  # harness.run.runner.YARDSTICK (not imported: the gate must not pull in torch)
AGGREGATES = ("max", "p99", "mean", "min")
PHASES = ("prefill", "decode")
MODES = ("global", "local", "forced")
SEVERITIES = ("error", "warn")
LAYER_SELECTORS = ("all", "swa", "csa", "hca", "hash", "learned", "logits")
BOUND_KINDS = ("absolute", "yardstick", "base", "twin")
RELATIVE_KINDS = ("yardstick", "base", "twin")
SCOPES = ("layer", "chunk", "turn", "step", "bin")
LAYER_RANGE = r"\s*(\d+)\s*-\s*(\d+)\s*"  # "2-10": layers 2 to 10, both included
NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]+")


class PolicyError(ScenarioError):
    """A policy file is invalid: every problem as `file:line: field: problem` (a UsageError: exit code 2)."""


# --------------------------------------------------------------------------- value types


def _known_metric(metric: str) -> str:
    if metric not in METRICS:
        raise problem(f"unknown metric {metric!r}{suggest(metric, list(METRICS))} (known: {', '.join(GATEABLE)})")
    return metric


def _gateable(metric: str) -> str:
    if not METRICS[metric].gateable:
        raise problem(f"{metric} is a measurement, not a drift (one side's value, a pick share or a benign twin's "
                      "noise, which the gate reads beside a drift); gate a recall or an error metric instead")
    return metric


def _layer(value: Any) -> int | str | tuple[int, int]:
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise problem(f"layer {value} is negative")
        return value
    if isinstance(value, str) and value in LAYER_SELECTORS:
        return value
    if isinstance(value, str) and (m := re.fullmatch(LAYER_RANGE, value)) is not None:
        first, last = int(m.group(1)), int(m.group(2))
        if first > last:
            raise problem(f"range {value!r} is empty (start > end)")
        return first, last
    hint = suggest(value, LAYER_SELECTORS) if isinstance(value, str) else ""
    raise problem(f"expected a layer number, a range like \"2-10\" or one of {', '.join(LAYER_SELECTORS)}; got "
                  f"{describe(value)}{hint}")


def _one_or_many(item: Any, aliases: Mapping[str, tuple[str, ...]] | None = None) -> Any:
    """One value or a list of them, duplicates dropped; an alias word stands for several (`both`)."""
    aliases = dict(aliases or {})

    def distinct(values: tuple) -> tuple:
        if not values:
            raise problem("expected a non-empty list")
        return tuple(dict.fromkeys(one for value in values for one in aliases.get(value, (value,))))
    return Annotated[tuple[item, ...], AfterValidator(distinct), BeforeValidator(
        lambda value: value if isinstance(value, list) else [value], json_schema_input_type=Union[item, list[item]])]


MetricName = Annotated[Str, AfterValidator(_known_metric), WithJsonSchema({"type": "string", "enum": list(METRICS)})]
GateableMetric = Annotated[MetricName, AfterValidator(_gateable), WithJsonSchema({"type": "string", "enum": GATEABLE})]
Layer = Annotated[Union[int, str, tuple[int, int]], PlainValidator(_layer), WithJsonSchema({"anyOf": [
    {"type": "integer", "minimum": 0}, {"enum": list(LAYER_SELECTORS)},
    {"type": "string", "pattern": f"^{LAYER_RANGE}$"}]})]


# --------------------------------------------------------------------------- policy objects


class Bound(Model):
    """Exactly one kind of bound; F is a factor on the error amplitude: for metrics quadratic in it (KL, JS,
    1 − cos) the gate bounds square roots — F²·yardstick, (√base + F·√yardstick)²."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": [kind]} for kind in BOUND_KINDS]})
    absolute: ExprValue | None = Field(None, description="loss ≤ X")
    yardstick: ExprValue | None = Field(None, description="loss ≤ F × yardstick loss (same layer, phase, mode, tap) "
                                                          "+ floor")
    base: ExprValue | None = Field(None, description="loss ≤ base loss + F × yardstick loss + floor")
    twin: ExprValue | None = Field(None, description="fp32 decision sites: loss ≤ F × the same variant's benign-twin "
                                                     "loss at the same unit + floor")

    @model_validator(mode="after")
    def _exactly_one(self) -> Bound:
        kinds = [kind for kind in BOUND_KINDS if getattr(self, kind) is not None]
        if len(kinds) != 1:
            raise problem(f"give exactly one of {', '.join(BOUND_KINDS)}" + (f" (got {', '.join(kinds)})"
                                                                               if kinds else ""))
        return self

    @property
    def kind(self) -> str:
        return next(kind for kind in BOUND_KINDS if getattr(self, kind) is not None)

    @property
    def value(self) -> Expr:
        return getattr(self, self.kind)


class Baseline(Model):
    slack: ExprValue = Field(description="with `gate --baseline`: loss ≤ baseline × (1 + slack) + floor")


class Check(Model):
    """One check. Until the policy fills them in, the fields its `defaults` may give are None where not written."""

    name: matching(NAME_PATTERN, "check name") = Field(description="unique; names a JUnit testcase and baseline "
                                                                    "entries")
    description: Str = ""
    metric: GateableMetric = Field(description="a gateable metric of harness.run.metrics")
    taps: _one_or_many(Str) | None = Field(None, alias="tap", description="[every tap that carries the metric] one "
                                                                          "tap or a list")
    layers: _one_or_many(Layer) | None = Field(
        None, description="[all] a layer, a range \"2-10\", selectors swa, csa, hca (layer kinds), hash, learned "
                          "(routing), logits (the final logits row, layer = num_hidden_layers; `all` includes it), or "
                          "a list of those")
    phases: _one_or_many(Literal[(*PHASES, "both")], {"both": PHASES}) | None = Field(
        None, description="[both] prefill | decode | both, or a list")
    modes: _one_or_many(Literal[(*MODES, "all")], {"all": MODES}) | None = Field(
        None, description="[global] global (accumulated drift) | local (the layer's own) | forced (decisions forced "
                          "to the reference's) | all, or a list")
    variants: _one_or_many(Annotated[Str, Field(min_length=1)]) | None = Field(
        None, description="[every variant but the yardstick (and but base_variant for base: bounds)] names or shell "
                          "globs")
    scope: Literal[SCOPES] | None = Field(
        None, description="[layer] the group one unit aggregates: layer (all its positions in the phase), chunk "
                          "(each prefill chunk; decode rows are one group), turn (each scenario turn), step (each "
                          "decode step; prefill rows are not in this scope), bin (each position bin). The "
                          "yardstick's, base's and twin's values are aggregated over the same group")
    aggregate: Literal[AGGREGATES] | None = Field(
        None, description="[max; mean for discrete metrics] over the bins of one group, taken on the loss (larger = "
                          "worse): max (the worst position for error metrics, the worst bin for higher-is-better "
                          "ones), p99 (of the bins), mean (count-weighted), min. A discrete metric (picks, experts, "
                          "answers) is bounded relatively as a count of lost decisions, which needs mean")
    direction: Literal["upper", "lower"] | None = Field(
        None, description="[inferred] upper (an error: larger is worse) | lower (a recall or agreement: smaller is "
                          "worse; bounded as the loss 1 − x); must match the metric")
    bound: Bound | None = Field(None, description="required unless `baseline` is given")
    floor: ExprValue | None = Field(
        None, description="[floors[metric], else the metric's built-in floor] the rounding floor, in loss units, added "
                          "to relative bounds so a zero yardstick cannot fail")
    baseline: Baseline | None = Field(None, description="[none] `baseline: null` turns off a baseline given in "
                                                        "defaults")
    severity: Literal[SEVERITIES] | None = Field(None, description="[error] error | warn (a failing warn check is "
                                                                   "reported, never fails the gate)")
    _line: int = PrivateAttr(0)
    _index: int = PrivateAttr(0)

    @model_validator(mode="after")
    def _fits_the_metric(self) -> Check:
        rule = METRICS[self.metric]
        bad = [tap for tap in self.taps or () if tap not in rule.taps]
        if bad:
            raise problem(f"{self.metric} is not measured at tap {', '.join(bad)} (it is at {', '.join(rule.taps)})",
                          at=("tap",))
        if self.direction not in (None, rule.policy_direction):
            better = "higher" if rule.policy_direction == "lower" else "lower"
            raise problem(f"{self.metric} is {better}-is-better, so its direction is {rule.policy_direction!r}, not "
                          f"{self.direction!r}", at=("direction",))
        if self.bound is not None and self.bound.kind == "twin" and rule.twin is None:
            with_twin = [m for m, r in METRICS.items() if r.twin]
            raise problem(f"{self.metric} has no benign twin (twin bounds apply to the fp32 decision sites: "
                          f"{', '.join(with_twin)})", at=("bound", "twin"))
        return self

    @property
    def line(self) -> int:
        return self._line

    @property
    def index(self) -> int:
        """Position in the policy's checks list."""
        return self._index

    @property
    def path(self) -> str:
        """The check's field path in the policy file, for error messages: `checks[3]`."""
        return f"checks[{self.index}]"

    @property
    def rule(self) -> MetricRule:
        return METRICS[self.metric]

    @property
    def baseline_slack(self) -> Expr | None:
        return self.baseline.slack if self.baseline is not None else None

    @property
    def counted(self) -> bool:
        """Bounded as a count of lost decisions: a relative bound on a discrete metric (harness.gate.evaluate)."""
        return self.rule.discrete and self.bound is not None and self.bound.kind in RELATIVE_KINDS

    @property
    def drawn(self) -> bool:
        """Its global-mode units are draws of the noise carried from upstream flips (harness.gate.evaluate.draw_noise):
        a continuous metric aggregated as a mean over groups of several rows (layer, chunk or turn scope). Their
        base-relative bound, and a baseline bound of any kind, allow that noise."""
        return (not self.rule.discrete and self.aggregate == "mean" and self.scope in ("layer", "chunk", "turn")
                and "global" in self.modes)

    def bound_text(self, with_baseline: bool = True, poisson_z: str = "z", draw_z: str = "z") -> str:
        """The bound as one line, e.g. `≤ 16×yardstick + floor`; a counted bound adds the noise of its counts,
        `count noise (z = 4)` (harness.gate.evaluate.allowed_count), a drawn one (base-relative, or a baseline) the
        noise of global mode's draws, `(global: + draw noise, z = 4)` (harness.gate.evaluate.draw_noise)."""
        parts = []
        if self.bound is not None:
            v = self.bound.value.text
            if self.rule.order == 2:
                text = {"absolute": f"≤ {v}", "yardstick": f"≤ ({v})²×yardstick + floor",
                        "base": f"≤ (√base + ({v})×√yardstick)² + floor"}[self.bound.kind]
            else:
                text = {"absolute": f"≤ {v}", "yardstick": f"≤ {v}×yardstick + floor",
                        "base": f"≤ base + {v}×yardstick + floor", "twin": f"≤ {v}×twin + floor"}[self.bound.kind]
            if self.counted:
                text = text.replace(" + floor", f" + count noise (z = {poisson_z}) + floor")
            elif self.drawn and self.bound.kind == "base":
                text = text.replace(" + floor", f" + floor (global: + draw noise, z = {draw_z})")
            parts.append(text)
        if self.baseline_slack is not None and with_baseline:
            if self.rule.discrete:
                noise = f" + count noise (z = {poisson_z})"
            else:
                noise = f" (global: + draw noise, z = {draw_z})" if self.drawn else ""
            parts.append(f"≤ baseline×(1+{self.baseline_slack.text}){noise} + floor")
        return "; ".join(parts)


def _version_1(version: int) -> int:
    if version != 1:
        raise problem(f"unsupported policy version {version!r} (known: 1)")
    return version


DEFAULT_KEYS = ("layers", "phases", "modes", "variants", "aggregate", "severity", "baseline")
CheckDefaults = create_model("CheckDefaults", __base__=Model, __doc__="Fields every check takes unless it gives "
                             "its own.", **{key: (Check.model_fields[key].annotation, Check.model_fields[key])
                                            for key in DEFAULT_KEYS})


class Policy(FileModel):
    """A dsv4-drift gate policy (DESIGN §5)."""

    model_config = ConfigDict(frozen=False)
    error_type = PolicyError
    version: Annotated[Int, AfterValidator(_version_1)] = Field(1, json_schema_extra={"const": 1})
    description: Str = ""
    base_variant: Str = Field("base", description="the variant `base:` bounds are relative to (the stock engine)")
    floors: dict[MetricName, ExprValue] = Field(
        {}, description="metric → rounding floor, overriding the metric's built-in floor; expressions may use the "
                        "unit's `positions` and, for subset recalls, `pick_share`")
    poisson_z: ExprValue = Field(
        Expr("4"), json_schema_extra={"default": 4},
        description="[4] counted bounds (relative bounds on discrete metrics) allow the lost decisions A of a unit's "
                    "N that their relative part allows, plus z standard deviations of the Poisson noise of the "
                    "variant's count and of the counts A is built from (harness.gate.evaluate.allowed_count), plus "
                    "the floor")
    draw_z: ExprValue = Field(
        Expr("4"), json_schema_extra={"default": 4},
        description="[4] base-relative bounds and baseline bounds on continuous metrics, in global mode, allow z "
                    "standard errors of the difference between the variant's mean and base's over the unit's rows "
                    "(each a bin of positions or a decode step): there a unit's accumulated loss is a draw of the "
                    "noise carried from upstream flips (harness.gate.evaluate.draw_noise)")
    defaults: CheckDefaults = Field(default_factory=CheckDefaults)
    checks: tuple[Check, ...] = Field(min_length=1)
    _sha256: str = PrivateAttr("")

    @model_validator(mode="after")
    def _resolve(self, info: ValidationInfo) -> Policy:
        """Each check with the defaults filled in and its expressions located, so evaluation needs neither."""
        self._sha256 = (info.context or {}).get("sha256", "")
        names = [check.name for check in self.checks]
        for index, name in enumerate(names):
            if name in names[:index]:
                raise problem(f"duplicate check name {name!r}", at=("checks", index, "name"),
                              first=("checks", names.index(name)))
        self.floors = {metric: expr.at(f"floors.{metric}", self.line_of) for metric, expr in self.floors.items()}
        self.poisson_z = self.poisson_z.at("poisson_z", self.line_of)
        self.draw_z = self.draw_z.at("draw_z", self.line_of)
        self.checks = tuple(self._resolved(check, index) for index, check in enumerate(self.checks))
        return self

    def _resolved(self, check: Check, index: int) -> Check:
        path = f"checks[{index}]"

        def given(key: str) -> tuple[Any, str]:
            """The check's own value, else the defaults' (or None), and where it was written."""
            if key in check.model_fields_set or key not in self.defaults.model_fields_set:
                return getattr(check, key), path
            return getattr(self.defaults, key), "defaults"

        baseline, baseline_at = given("baseline")
        if baseline is not None:
            baseline = Baseline.model_construct(slack=baseline.slack.at(f"{baseline_at}.baseline.slack", self.line_of))
        elif check.bound is None:
            raise problem(f"required field is missing ({', '.join(BOUND_KINDS)}; or give `baseline: {{slack: X}}` for "
                          "a non-regression check only)", at=("checks", index, "bound"))
        bound = check.bound
        if bound is not None:
            bound = bound.model_copy(update={bound.kind: bound.value.at(f"{path}.bound.{bound.kind}", self.line_of)})
        phases = given("phases")[0] or PHASES
        scope = check.scope or "layer"
        if scope == "step" and "decode" not in phases:
            raise problem("scope step groups decode steps, and this check's phases have none (add decode)",
                          at=("checks", index, "scope"))
        aggregate, aggregate_at = given("aggregate")
        aggregate = aggregate or ("mean" if check.rule.discrete else "max")
        if check.counted and aggregate != "mean":
            raise problem(f"{check.metric} is discrete: a relative bound counts the decisions a unit lost, which needs "
                          f"aggregate: mean (got {aggregate!r}); for the worst group use scope: bin, step, chunk or "
                          "turn", at=("checks", index, "aggregate") if aggregate_at == path else ("defaults",
                                                                                                 "aggregate"))
        resolved = check.model_copy(update=dict(
            taps=check.taps or check.rule.taps, layers=given("layers")[0] or ("all",), phases=phases, scope=scope,
            modes=given("modes")[0] or ("global",), variants=given("variants")[0], aggregate=aggregate,
            severity=given("severity")[0] or "error", direction=check.rule.policy_direction, bound=bound,
            floor=check.floor.at(f"{path}.floor", self.line_of) if check.floor else None, baseline=baseline))
        resolved._line, resolved._index = self.line_of(path), index
        return resolved

    @property
    def sha256(self) -> str:
        return self._sha256

    def floor_of(self, check: Check) -> Expr | None:
        if check.floor is not None:
            return check.floor
        if check.metric in self.floors:
            return self.floors[check.metric]
        rule_floor = check.rule.floor
        return Expr(rule_floor, check.line, f"{check.path}.floor (built-in for {check.metric})") \
            if rule_floor is not None else None

    def variants_for(self, check: Check, run_variants: Sequence[str]) -> list[str]:
        """The run's variants a check covers, in run order."""
        candidates = [v for v in run_variants if v != YARDSTICK]  # the yardstick has no fp32 sites, so no twin
        if check.bound is not None and check.bound.kind == "base":
            candidates = [v for v in candidates if v != self.base_variant]
        if check.variants is None:
            return candidates
        return [v for v in candidates if any(fnmatch.fnmatchcase(v, g) for g in check.variants)]


# --------------------------------------------------------------------------- loading


def load_policy(path: str | Path) -> Policy:
    """Read and validate a policy file; raises PolicyError (exit code 2) naming file, line and field."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise PolicyError([Issue(str(p), 1, "", "no such policy file")]) from None
    except (OSError, UnicodeDecodeError) as e:
        raise PolicyError([Issue(str(p), 1, "", f"cannot read the policy file: {e}")]) from None
    return parse_policy(text, str(p))


def parse_policy(text: str, file: str = "<string>") -> Policy:
    if not text.strip():
        raise PolicyError([Issue(file, 1, "", "the policy file is empty; it needs at least `checks:`")])
    try:
        root = load_located(text, file, "policy")
    except ScenarioError as e:
        raise PolicyError(e.issues) from None
    return validate_located(Policy, root, file, error=PolicyError,
                            context={"sha256": hashlib.sha256(text.encode()).hexdigest()})


def resolve_policy(policy_arg: str | Path | None, manifest: Mapping[str, Any] | None = None) -> Path:
    """The policy file to use: --policy, else the scenario's gate.policy recorded in the manifest, else the default.
    `default` names the shipped default policy."""
    chosen = policy_arg
    if chosen is None and manifest is not None:
        chosen = (manifest.get("gate") or {}).get("policy")
    if chosen is None or str(chosen) == "default":
        return DEFAULT_POLICY
    path = Path(chosen)
    if not path.is_file():
        source = "--policy" if policy_arg is not None else "the run's scenario (gate.policy)"
        raise UsageError(f"{source}: policy file {path} does not exist")
    return path


def config_names(config: Mapping[str, Any]) -> dict[str, float]:
    """The model config's numeric fields, the names a policy expression may use."""
    return {k: v for k, v in config.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
