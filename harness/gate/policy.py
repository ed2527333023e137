"""Gate policies: which drift metric, where, aggregated how, bounded by what (DESIGN §5) — a policy is data.

A policy is a YAML file with a list of checks. Each check names one metric of harness.run.metrics, the
layers, phases, modes and variants it covers, how the bins of one layer and phase are aggregated, and a
bound. Checks are evaluated per (variant, mode, tap, layer, phase) — a *unit* — so the gate can name the
first layer where a check fails (harness.gate.evaluate).

    version: 1                     [1]
    description: "…"               [""]
    base_variant: base             [base] the variant `base:` bounds are relative to (the stock engine)
    floors:                        [{}] metric -> rounding floor, overriding the metric's built-in floor
      streams.rel_l2: 2**-8        expressions over the config's numeric fields; subset recalls also `pick_share`
    defaults:                      [{}] any of layers, phases, modes, variants, aggregate, severity, baseline
      modes: [global]
    checks:                        required, a non-empty list
      - name: stream-drift         required; [A-Za-z0-9_.-]+, unique
        description: "…"           [""]
        metric: streams.rel_l2     required; a gateable metric of METRICS below
        tap: layer.out             [every tap that carries the metric] one tap or a list
        layers: all                [all] all | a layer | a list of layers, ranges "2-10" and selectors:
                                   swa, csa, hca (layer kinds), hash, learned (routing), logits (the final
                                   logits row, layer = num_hidden_layers); `all` includes the logits row
        phases: both               [both] prefill | decode | both | a list
        modes: global              [global] global | local | forced | a list
        variants: ["*"]            [every variant but the yardstick (and but base_variant for base: bounds)];
                                   names or shell globs
        aggregate: max             [max] over the bins of one layer+phase, taken on the *loss* (larger = worse):
                                   max (the worst position: per-position maxima for error metrics; for
                                   higher-is-better metrics the store keeps no per-position minima, so the
                                   worst bin), p99 (99th percentile of the bins), mean (count-weighted), min
        direction: upper           [inferred] upper (an error: larger is worse) | lower (a recall or agreement:
                                   smaller is worse; bounded as the loss 1 − x); must match the metric
        bound:                     exactly one of (may be left out when `baseline` is given):
          absolute: 0.05             loss ≤ X
          yardstick: 16              loss ≤ F × yardstick loss (same layer, phase, mode, tap) + floor
          base: 2                    loss ≤ base loss + F × yardstick loss + floor
                                     F is a factor on the error amplitude: for metrics quadratic in it (KL, JS,
                                     1 − cos) the gate bounds square roots — F²·yardstick, (√base + F·√yd)²
        floor: 2**-8               [floors[metric], else the metric's built-in floor] the rounding floor, in
                                   loss units, added to relative bounds so a zero yardstick cannot fail
        baseline: {slack: 0.1}     [none] with `gate --baseline`: loss ≤ baseline × (1 + slack) + floor;
                                   `baseline: null` turns off a baseline given in defaults
        severity: error            [error] error | warn (a failing warn check is reported, never fails the gate)

Numbers (bound factors, floors, slack) may be arithmetic expressions over numbers and the run's model
config fields, e.g. `2**-4 / 2**-8` or `1/index_topk`, evaluated against each run's config (`Expr.evaluate`).
"""

from __future__ import annotations

import ast
import difflib
import fnmatch
import hashlib
import math
import operator
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from harness.errors import UsageError
from harness.scenario.yaml_source import Issue, Located, ScenarioError, load_located

POLICIES_DIR = Path(__file__).resolve().parent / "policies"
DEFAULT_POLICY = POLICIES_DIR / "default.yaml"
YARDSTICK = "yardstick"  # harness.run.runner.YARDSTICK (not imported: the gate must not pull in torch)


# --------------------------------------------------------------------------- the metrics a check can name


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


# --------------------------------------------------------------------------- policy objects

AGGREGATES = ("max", "p99", "mean", "min")
PHASES = ("prefill", "decode")
MODES = ("global", "local", "forced")
SEVERITIES = ("error", "warn")
LAYER_SELECTORS = ("all", "swa", "csa", "hca", "hash", "learned", "logits")
BOUND_KINDS = ("absolute", "yardstick", "base")
CHECK_KEYS = ("name", "description", "metric", "tap", "layers", "phases", "modes", "variants", "aggregate",
              "direction", "bound", "floor", "baseline", "severity")
DEFAULT_KEYS = ("layers", "phases", "modes", "variants", "aggregate", "severity", "baseline")
TOP_KEYS = ("version", "description", "base_variant", "floors", "defaults", "checks")
NAME_PATTERN = re.compile(r"[A-Za-z0-9_.-]+")


class PolicyError(ScenarioError):
    """A policy file is invalid: every problem as `file:line: field: problem` (a UsageError: exit code 2)."""


@dataclass(frozen=True)
class Expr:
    """A number or an arithmetic expression over the model config's numeric fields (`1/index_topk`)."""

    text: str
    line: int = 0
    path: str = ""

    def names(self) -> set[str]:
        """The names the expression reads (a syntax error surfaces in evaluate, with its location)."""
        try:
            return {n.id for n in ast.walk(ast.parse(self.text, mode="eval")) if isinstance(n, ast.Name)}
        except SyntaxError:
            return set()

    def evaluate(self, names: Mapping[str, float], file: str = "") -> float:
        try:
            value = float(_eval(ast.parse(self.text, mode="eval").body, names))
        except KeyError as e:
            raise UsageError(f"{file}:{self.line}: {self.path}: {self.text!r} names {e.args[0]!r}, which is not a "
                             f"numeric field of this run's model config or a floor variable (known: "
                             f"{', '.join(sorted(names))})") from None
        except (ZeroDivisionError, OverflowError, ValueError) as e:
            raise UsageError(f"{file}:{self.line}: {self.path}: cannot evaluate {self.text!r}: {e}") from None
        if not math.isfinite(value) or value < 0:
            raise UsageError(f"{file}:{self.line}: {self.path}: {self.text!r} = {value} must be finite and ≥ 0")
        return value


_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.Pow: operator.pow}


def _eval(node: ast.AST, names: Mapping[str, float]) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.Name):
        return names[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _eval(node.operand, names)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval(node.left, names), _eval(node.right, names)
        if isinstance(node.op, ast.Pow) and abs(right) > 1024:
            raise ValueError(f"exponent {right} is out of range")
        return _BINOPS[type(node.op)](left, right)
    raise ValueError(f"only numbers, config names and + - * / ** are allowed, not {ast.dump(node)[:40]}")


def _check_expr_syntax(text: str) -> str | None:
    """None when `text` is an allowed expression, else the problem."""
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        return f"{text!r} is not a number or an arithmetic expression"
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Constant, ast.Name, ast.UnaryOp, ast.BinOp, ast.USub, ast.UAdd, ast.Load)
                          + tuple(_BINOPS)):
            return f"{text!r}: only numbers, model config names and + - * / ** are allowed"
        if isinstance(node, ast.Constant) and (isinstance(node.value, bool)
                                               or not isinstance(node.value, (int, float))):
            return f"{text!r}: {node.value!r} is not a number"
    return None


@dataclass(frozen=True)
class Bound:
    kind: str  # absolute | yardstick | base
    value: Expr


@dataclass(frozen=True)
class Check:
    name: str
    metric: str
    taps: tuple[str, ...]  # the taps evaluated (the metric's taps when the check names none)
    layers: tuple[str | int, ...]  # ints, "a-b" ranges as (a, b) tuples, selectors
    phases: tuple[str, ...]
    modes: tuple[str, ...]
    variants: tuple[str, ...] | None  # globs; None: the default set
    aggregate: str
    direction: str  # upper | lower (as the policy reads it)
    bound: Bound | None
    floor: Expr | None
    baseline_slack: Expr | None
    severity: str
    description: str = ""
    line: int = 0
    index: int = 0  # position in the policy's checks list

    @property
    def path(self) -> str:
        """The check's field path in the policy file, for error messages: `checks[3]`."""
        return f"checks[{self.index}]"

    @property
    def rule(self) -> MetricRule:
        return METRICS[self.metric]

    def bound_text(self, with_baseline: bool = True) -> str:
        """The bound as one line, e.g. `≤ 16×yardstick + floor`."""
        parts = []
        if self.bound is not None:
            v = self.bound.value.text
            if self.rule.order == 2:
                parts.append({"absolute": f"≤ {v}", "yardstick": f"≤ ({v})²×yardstick + floor",
                              "base": f"≤ (√base + ({v})×√yardstick)² + floor"}[self.bound.kind])
            else:
                parts.append({"absolute": f"≤ {v}", "yardstick": f"≤ {v}×yardstick + floor",
                              "base": f"≤ base + {v}×yardstick + floor"}[self.bound.kind])
        if self.baseline_slack is not None and with_baseline:
            parts.append(f"≤ baseline×(1+{self.baseline_slack.text}) + floor")
        return "; ".join(parts)


@dataclass
class Policy:
    file: str
    sha256: str
    checks: list[Check]
    description: str = ""
    base_variant: str = "base"
    floors: dict[str, Expr] = field(default_factory=dict)

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
        candidates = [v for v in run_variants if v != YARDSTICK]
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
    reader = _PolicyReader(file)
    policy = reader.policy(root, hashlib.sha256(text.encode()).hexdigest())
    if reader.issues:
        raise PolicyError(reader.issues)
    return policy


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


class _Bad(Exception):
    pass


def _suggest(word: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return f"{value!r}"


class _PolicyReader:
    def __init__(self, file: str) -> None:
        self.file = file
        self.issues: list[Issue] = []

    def fail(self, line: int, path: str, problem: str) -> None:
        self.issues.append(Issue(self.file, line, path, problem))

    def mapping(self, loc: Located, path: str, known: Sequence[str]) -> dict[str, Located] | None:
        if not isinstance(loc.value, dict):
            self.fail(loc.line, path, f"expected a mapping with keys {', '.join(known)}; got {_describe(loc.value)}")
            return None
        for key, value in loc.value.items():
            if key not in known:
                self.fail(value.key_line, f"{path}.{key}" if path else key,
                          f"unknown key{_suggest(key, known)} (known: {', '.join(known)})")
        return loc.value

    def policy(self, root: Located, sha: str) -> Policy:
        top = self.mapping(root, "", TOP_KEYS) or {}
        if "version" in top and top["version"].value != 1:
            self.fail(top["version"].line, "version", f"unsupported policy version {top['version'].value!r} (known: 1)")
        description = self.string(top.get("description"), "description") or ""
        base_variant = self.string(top.get("base_variant"), "base_variant") or "base"
        floors: dict[str, Expr] = {}
        if "floors" in top:
            fields = top["floors"].value
            if not isinstance(fields, dict):
                self.fail(top["floors"].line, "floors", f"expected a mapping metric: floor; got {_describe(fields)}")
            else:
                for metric, loc in fields.items():
                    if self.known_metric(metric, loc.key_line, f"floors.{metric}"):
                        expr = self.expr(loc, f"floors.{metric}")
                        if expr is not None:
                            floors[metric] = expr
        defaults = self.mapping(top["defaults"], "defaults", DEFAULT_KEYS) if "defaults" in top else {}
        defaults = defaults or {}
        checks: list[Check] = []
        if "checks" not in top:
            self.fail(root.line, "checks", "required field is missing: a policy is a list of checks")
        elif not isinstance(top["checks"].value, list) or not top["checks"].value:
            self.fail(top["checks"].line, "checks", f"expected a non-empty list of checks; got "
                                                    f"{_describe(top['checks'].value)}")
        else:
            seen: dict[str, int] = {}
            for i, loc in enumerate(top["checks"].value):
                check = self.check(loc, i, defaults)
                if check is None:
                    continue
                if check.name in seen:
                    self.fail(loc.line, f"checks[{i}].name", f"duplicate check name {check.name!r} (first on line "
                                                             f"{seen[check.name]})")
                seen[check.name] = loc.line
                checks.append(check)
        return Policy(self.file, sha, checks, description, base_variant, floors)

    # ---- one check
    def check(self, loc: Located, index: int, defaults: dict[str, Located]) -> Check | None:
        path = f"checks[{index}]"
        n_before = len(self.issues)
        fields = self.mapping(loc, path, CHECK_KEYS)
        if fields is None:
            return None
        name = self.string(fields.get("name"), f"{path}.name")
        if "name" not in fields:
            self.fail(loc.line, f"{path}.name", "required field is missing")
        elif name is not None and not NAME_PATTERN.fullmatch(name):
            self.fail(fields["name"].line, f"{path}.name", f"{name!r} must match [A-Za-z0-9_.-]+ (it names a JUnit "
                                                           "testcase and baseline entries)")
        label = path
        metric = self.string(fields.get("metric"), f"{label}.metric")
        if "metric" not in fields:
            self.fail(loc.line, f"{label}.metric", "required field is missing")
        rule = None
        if metric is not None and self.known_metric(metric, fields["metric"].line, f"{label}.metric"):
            rule = METRICS[metric]
            if not rule.gateable:
                self.fail(fields["metric"].line, f"{label}.metric",
                          f"{metric} is a measurement, not a drift (it is the same kind of number for the reference "
                          "and the variant); gate a recall or an error metric instead")
                rule = None

        def field_or_default(key: str) -> tuple[Located | None, str]:
            if key in fields:
                return fields[key], f"{label}.{key}"
            if key in defaults:
                return defaults[key], f"defaults.{key}"
            return None, f"{label}.{key}"

        taps: tuple[str, ...] = rule.taps if rule else ()
        if "tap" in fields:
            given = self.strings(fields["tap"], f"{label}.tap")
            if given is not None and rule is not None:
                bad = [t for t in given if t not in rule.taps]
                if bad:
                    self.fail(fields["tap"].line, f"{label}.tap",
                              f"{metric} is not measured at tap {', '.join(bad)} (it is at {', '.join(rule.taps)})")
                else:
                    taps = tuple(given)
        layers = self.layers(*field_or_default("layers"))
        phases = self.choices(*field_or_default("phases"), PHASES, {"both": PHASES}, PHASES)
        modes = self.choices(*field_or_default("modes"), MODES, {"all": MODES}, ("global",))
        variants_loc, variants_path = field_or_default("variants")
        variants = tuple(self.strings(variants_loc, variants_path) or ()) if variants_loc is not None else None
        aggregate = self.one_of(*field_or_default("aggregate"), AGGREGATES, "max")
        severity = self.one_of(*field_or_default("severity"), SEVERITIES, "error")
        direction = rule.policy_direction if rule else "upper"
        if "direction" in fields:
            given = self.one_of(fields["direction"], f"{label}.direction", ("upper", "lower"), direction)
            if rule is not None and given != direction:
                self.fail(fields["direction"].line, f"{label}.direction",
                          f"{metric} is {'higher' if direction == 'lower' else 'lower'}-is-better, so its direction "
                          f"is {direction!r}, not {given!r}")
        bound = self.bound(fields.get("bound"), f"{label}.bound")
        floor = self.expr(fields["floor"], f"{label}.floor") if "floor" in fields else None
        slack = None
        baseline_loc, baseline_path = field_or_default("baseline")
        if baseline_loc is not None and baseline_loc.value is not None:
            bl = self.mapping(baseline_loc, baseline_path, ("slack",))
            if bl is not None:
                if "slack" not in bl:
                    self.fail(baseline_loc.line, f"{baseline_path}.slack", "required field is missing")
                else:
                    slack = self.expr(bl["slack"], f"{baseline_path}.slack")
        if bound is None and "bound" not in fields and slack is None:
            self.fail(loc.line, f"{label}.bound", "required field is missing (absolute, yardstick or base; or give "
                                                  "`baseline: {slack: X}` for a non-regression check only)")
        description = self.string(fields.get("description"), f"{label}.description") or ""
        if len(self.issues) > n_before:
            return None
        return Check(name=name, metric=metric, taps=taps, layers=layers, phases=phases, modes=modes,
                     variants=variants, aggregate=aggregate, direction=direction, bound=bound, floor=floor,
                     baseline_slack=slack, severity=severity, description=description, line=loc.line, index=index)

    # ---- field readers
    def known_metric(self, metric: str, line: int, path: str) -> bool:
        if metric in METRICS:
            return True
        self.fail(line, path, f"unknown metric {metric!r}{_suggest(metric, list(METRICS))} "
                              f"(known: {', '.join(m for m, r in METRICS.items() if r.gateable)})")
        return False

    def string(self, loc: Located | None, path: str) -> str | None:
        if loc is None:
            return None
        if not isinstance(loc.value, str):
            self.fail(loc.line, path, f"expected a string; got {_describe(loc.value)}")
            return None
        return loc.value

    def strings(self, loc: Located | None, path: str) -> list[str] | None:
        if loc is None:
            return None
        items = loc.value if isinstance(loc.value, list) else [loc]
        out = []
        for i, item in enumerate(items):
            if not isinstance(item.value, str) or not item.value:
                self.fail(item.line, f"{path}[{i}]" if isinstance(loc.value, list) else path,
                          f"expected a non-empty string; got {_describe(item.value)}")
                return None
            out.append(item.value)
        return out

    def one_of(self, loc: Located | None, path: str, known: Sequence[str], default: str) -> str:
        if loc is None:
            return default
        if loc.value not in known:
            self.fail(loc.line, path, f"{loc.value!r} is not one of {', '.join(known)}"
                                      f"{_suggest(str(loc.value), known)}")
            return default
        return loc.value

    def choices(self, loc: Located | None, path: str, known: Sequence[str], aliases: dict[str, tuple[str, ...]],
                default: tuple[str, ...]) -> tuple[str, ...]:
        if loc is None:
            return default
        if isinstance(loc.value, str) and loc.value in aliases:
            return aliases[loc.value]
        names = self.strings(loc, path)
        if names is None:
            return default
        bad = [n for n in names if n not in known]
        if bad:
            self.fail(loc.line, path, f"{', '.join(map(repr, bad))}: expected {', '.join(known)} or "
                                      f"{', '.join(aliases)}")
            return default
        return tuple(dict.fromkeys(names))

    def layers(self, loc: Located | None, path: str) -> tuple:
        if loc is None:
            return ("all",)
        items = loc.value if isinstance(loc.value, list) else [loc]
        out: list = []
        for i, item in enumerate(items):
            where = f"{path}[{i}]" if isinstance(loc.value, list) else path
            v = item.value
            if isinstance(v, bool) or v is None or isinstance(v, (dict, list, float)):
                self.fail(item.line, where, f"expected a layer number, a range like \"2-10\" or one of "
                                            f"{', '.join(LAYER_SELECTORS)}; got {_describe(v)}")
            elif isinstance(v, int):
                if v < 0:
                    self.fail(item.line, where, f"layer {v} is negative")
                else:
                    out.append(v)
            elif v in LAYER_SELECTORS:
                out.append(v)
            elif (m := re.fullmatch(r"\s*(\d+)\s*-\s*(\d+)\s*", v)) is not None:
                a, b = int(m.group(1)), int(m.group(2))
                if a > b:
                    self.fail(item.line, where, f"range {v!r} is empty (start > end)")
                else:
                    out.append((a, b))
            else:
                self.fail(item.line, where, f"{v!r} is not a layer number, a range like \"2-10\" or one of "
                                            f"{', '.join(LAYER_SELECTORS)}{_suggest(v, LAYER_SELECTORS)}")
        if not out and not isinstance(loc.value, list):
            return ("all",)
        if isinstance(loc.value, list) and not loc.value:
            self.fail(loc.line, path, "an empty list selects no layer")
        return tuple(out)

    def expr(self, loc: Located, path: str) -> Expr | None:
        v = loc.value
        if isinstance(v, bool) or not isinstance(v, (int, float, str)):
            self.fail(loc.line, path, f"expected a number or an expression like \"1/index_topk\"; got {_describe(v)}")
            return None
        if isinstance(v, (int, float)):
            if not math.isfinite(v) or v < 0:
                self.fail(loc.line, path, f"{v} must be a finite number ≥ 0")
                return None
            return Expr(repr(v), loc.line, path)
        problem = _check_expr_syntax(v)
        if problem:
            self.fail(loc.line, path, problem)
            return None
        return Expr(v, loc.line, path)

    def bound(self, loc: Located | None, path: str) -> Bound | None:
        if loc is None:
            return None
        fields = self.mapping(loc, path, BOUND_KINDS)
        if fields is None:
            return None
        kinds = [k for k in BOUND_KINDS if k in fields]
        if len(kinds) != 1:
            self.fail(loc.line, path, f"give exactly one of {', '.join(BOUND_KINDS)}"
                                      + (f" (got {', '.join(kinds)})" if kinds else ""))
            return None
        expr = self.expr(fields[kinds[0]], f"{path}.{kinds[0]}")
        return Bound(kinds[0], expr) if expr is not None else None


PICK_SHARE = "pick_share"
"""Floor variable: the unit's mean of 1/|subset| for a subset recall (MetricRule.pick_share)."""
PICK_SHARE_METRICS = frozenset(m for m, rule in METRICS.items() if rule.pick_share)


def config_names(config: Mapping[str, Any]) -> dict[str, float]:
    """The model config's numeric fields, the names a policy expression may use."""
    return {k: v for k, v in config.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
