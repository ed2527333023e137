"""What the gate writes: a console table, gate.json (also in the run directory, for the report's verdict
banner and colours), JUnit XML (one testcase per check × variant, one for the run's completeness) and a markdown
summary for $GITHUB_STEP_SUMMARY (which links the figures `dsv4-drift report --figures` left in RUN_DIR/figures).

gate.json (format "dsv4-drift-gate/1"):

    verdict, exit_code, created   verdict: pass | fail | incomplete (an incomplete run, exit code 2)
    incomplete: why the run is not complete, or null; allow_incomplete: gated anyway (--allow-incomplete)
    run:      {dir, scenario, status, layers, variants}
    policy:   {file, sha256, description, base_variant}
    baseline: the baseline's source or null
    counts:   {checks, testcases, pass, fail, warn, no_data, skipped, nonfinite}
    failures: one line per failure (NaN/Inf findings first), what the console and banner print
    nonfinite: the run's NaN/Inf findings, each with a `message`
    checks:   [{name, description, metric, taps, layers, phases, modes, scope, aggregate, direction, order,
                severity, bound: {kind, expression, value} | null, floor, baseline_slack, poisson_z, draw_z, bound_text,
                status, variants: [{variant, status, reason, first_failure, worst,
                                    phases: {prefill|decode: {status, first_failing_layer, first_failure, worst}},
                                    units_total, units: [unit, …]}]}]
    notes

A unit is {variant, mode, tap, layer, phase, scope, group, span, positions, value, limit, status, yardstick, base,
twin, floor, decisions, allowance, draw_allowance, baseline, baseline_limit, notes}: value is the aggregated loss
(1 − x for recalls), limit the policy bound there; group is the chunk, turn, decode step or bin's first position
(null: the whole layer and phase), span the unit's positions [first, end); decisions (N) and allowance (the count
noise allowed above the relative part) are set for counted bounds, draw_allowance (draw_z × the estimated standard
error of value − base, harness.gate.evaluate.draw_noise) for base-relative bounds on continuous metrics in global
mode; baseline_allowance is the count or draw noise allowed above the baseline. NaN and infinities are written as the
strings "nan", "inf".

`units` holds every unit of a layer-scope check. A group scope has up to one unit per bin (a 27K-token run:
~10⁴ per check and variant), so for it `units` keeps the failing units and, per (mode, tap, layer, phase), the
group nearest its limit — the report's per-layer cell is that worst ratio either way; `units_total` counts all.
"""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any
from urllib.parse import quote

from harness.gate.evaluate import (CheckResult, GateResult, Unit, VariantResult, _fmt, _num, explain_limit,
                               nonfinite_message)

GATE_FORMAT = "dsv4-drift-gate/1"
STATUS_STYLE = {"pass": "green", "fail": "bold red", "warn": "yellow", "no_data": "dim", "skipped": "dim"}
STATUS_MARK = {"pass": "✅ pass", "fail": "❌ FAIL", "warn": "⚠️ warn", "no_data": "➖ no data", "skipped": "⏭️ skipped"}
FIGURES_DIR = "figures"
"""RUN_DIR/figures: where `dsv4-drift report RUN_DIR --figures` writes its PNG and SVG figures by default. The
markdown summary links the ones it finds there by file name (the gate reads numbers, never pages: it does not
import harness.report)."""


def _layers_text(layers: tuple) -> list[Any]:
    return [f"{sel[0]}-{sel[1]}" if isinstance(sel, tuple) else sel for sel in layers]


def _unit(u: Unit | None) -> dict[str, Any] | None:
    return u.to_dict() if u is not None else None


def counts(result: GateResult) -> dict[str, int]:
    out = {"checks": len(result.checks), "testcases": 0, "pass": 0, "fail": 0, "warn": 0, "no_data": 0,
           "skipped": 0, "nonfinite": len(result.nonfinite)}
    for c in result.checks:
        for v in c.variants:
            out["testcases"] += 1
            out[v.status] += 1
    return out


def to_dict(result: GateResult) -> dict[str, Any]:
    run, policy = result.run, result.policy
    checks = []
    for c in result.checks:
        ch = c.check
        variants = []
        for v in c.variants:
            phases = {}
            for phase in v.phases():
                first = v.first_failure(phase)
                phases[phase] = {"status": v.phase_status(phase), "first_failing_layer": first.layer if first else None,
                                 "first_failure": _unit(first), "worst": _unit(v.worst(phase))}
            units = v.units if ch.scope == "layer" else _kept_units(v.units)
            variants.append({"variant": v.variant, "status": v.status, "reason": v.reason,
                             "first_failure": _unit(v.first_failure()), "worst": _unit(v.worst()), "phases": phases,
                             "units_total": len(v.units), "units": [u.to_dict() for u in units]})
        checks.append({
            "name": ch.name, "description": ch.description, "metric": ch.metric, "taps": list(ch.taps),
            "layers": _layers_text(ch.layers), "phases": list(ch.phases), "modes": list(ch.modes),
            "scope": ch.scope, "aggregate": ch.aggregate, "direction": ch.direction, "order": ch.rule.order,
            "severity": ch.severity,
            "bound": {"kind": ch.bound.kind, "expression": ch.bound.value.text, "value": _num(c.factor)}
            if ch.bound else None,
            "floor": _num(c.floor), "baseline_slack": _num(c.slack), "poisson_z": _num(c.poisson_z),
            "draw_z": _num(c.draw_z),
            "bound_text": ch.bound_text(poisson_z=_fmt(c.poisson_z) if c.poisson_z is not None else "z",
                                        draw_z=_fmt(c.draw_z) if c.draw_z is not None else "z"),
            "status": c.status, "variants": variants})
    return {
        "format": GATE_FORMAT, "verdict": result.verdict, "exit_code": result.exit_code, "created": result.created,
        "incomplete": result.incomplete, "allow_incomplete": result.allow_incomplete,
        "run": {"dir": str(run.dir), "scenario": run.scenario, "status": run.manifest.get("status"),
                "layers": run.n_layers, "variants": run.variants},
        "policy": {"file": policy.file, "sha256": policy.sha256, "description": policy.description,
                   "base_variant": policy.base_variant},
        "baseline": result.baseline_source,
        "counts": counts(result),
        "failures": result.failure_lines(),
        "nonfinite": [dict(f) | {"message": nonfinite_message(f)} for f in result.nonfinite],
        "checks": checks,
        "notes": result.notes,
    }


def _kept_units(units: list[Unit]) -> list[Unit]:
    """A group scope's units worth writing: the failing ones and, per (mode, tap, layer, phase), the group
    nearest its limit (module docstring)."""
    worst: dict[tuple, Unit] = {}
    for u in units:
        cell = (u.mode, u.tap, u.layer, u.phase)
        if cell not in worst or u.rank > worst[cell].rank:
            worst[cell] = u
    kept = {id(u) for u in worst.values()} | {id(u) for u in units if not u.passed}
    return [u for u in units if id(u) in kept]


def write_json(result: GateResult, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(to_dict(result), indent=2) + "\n")
    os.replace(tmp, path)
    return path


# --------------------------------------------------------------------------- one row per check × variant × phase


def _rows(result: GateResult) -> list[dict[str, str]]:
    """The table behind the console and markdown views."""
    rows = []
    for c in result.checks:
        for v in c.variants:
            if not v.units:
                rows.append({"check": c.check.name, "metric": c.check.metric, "variant": v.variant, "phase": "—",
                             "status": v.status, "first": "—", "worst": v.reason})
                continue
            for phase in v.phases():
                first = v.first_failure(phase)
                rows.append({"check": c.check.name, "metric": c.check.metric, "variant": v.variant, "phase": phase,
                             "status": v.phase_status(phase),
                             "first": _first_text(first, len(c.check.taps) > 1) if first else "—",
                             "worst": _worst_text(v.worst(phase))})
    return rows


def _first_text(u: Unit, many_taps: bool) -> str:
    """`4`, `4 chunk 1`, `4 step 3 (local, attn.out)`: the first failing layer, its group, and the mode and tap
    when they are not obvious."""
    group = f" {u.group_text}" if u.group_text else ""
    return f"{u.layer}{group}" + (f" ({u.mode}, {u.tap})" if u.mode != "global" or many_taps else "")


def _worst_text(u: Unit | None) -> str:
    """`0.42 > 0.32 at L4 (base 0.23, yd 0.041)`: the unit nearest to (or furthest past) its limit."""
    if u is None:
        return "—"
    op = "≤" if u.passed else ">"
    terms = [f"{name} {_fmt(x)}" for name, x in (("base", u.base), ("yd", u.yardstick), ("twin", u.twin),
                                                  ("baseline", u.baseline)) if x is not None]
    group = f" {u.group_text}" if u.group_text else ""
    return (f"{_fmt(u.value)} {op} {_fmt(u.effective_limit)} at L{u.layer}{group}"
            + (f" ({', '.join(terms)})" if terms else ""))


def console_table(result: GateResult):
    from rich.table import Table
    from rich.text import Text

    run = result.run
    table = Table(title=Text(f"dsv4-drift gate · {run.scenario} · {Path(result.policy.file).name}"))
    for col, justify in (("check", "left"), ("variant", "left"), ("phase", "left"), ("status", "left"),
                         ("first failing layer", "right"), ("worst value vs bound", "left")):
        table.add_column(col, justify=justify, overflow="fold")
    for f in result.nonfinite:
        table.add_row(Text("NaN/Inf"), Text(str(f.get("variant"))), Text(str(f.get("phase"))),
                      Text("fail", style="bold red"), Text(str(f.get("layer"))),
                      Text(f"{f.get('tap')}.{f.get('field')} at position {f.get('position')} ({f.get('mode')})"))
    for r in _rows(result):
        table.add_row(Text(r["check"]), Text(r["variant"]), Text(r["phase"]),
                      Text(r["status"], style=STATUS_STYLE.get(r["status"], "")), Text(r["first"]), Text(r["worst"]))
    return table


def print_console(result: GateResult, console=None) -> None:
    from rich.console import Console

    if console is None:
        console = Console(highlight=False)
        if not console.is_terminal:  # CI logs: do not wrap the table at 80 columns
            console = Console(highlight=False, width=160)
    console.print(console_table(result))
    print_verdict(result, console)


def print_verdict(result: GateResult, console, max_failures: int | None = None) -> None:
    """The notes, the verdict with its counts, and one line per failure (what `gate --quiet` and `run` print;
    `run` shows the first `max_failures` and points at `gate` for the rest)."""
    from rich.text import Text

    for note in result.notes:
        console.print(Text(f"note: {note}", style="dim"), soft_wrap=True)
    c = counts(result)
    head = Text(result.verdict.upper(), style="bold green" if result.passed else "bold red")
    console.print(Text.assemble("gate: ", head, f" — {c['pass']} passed, {c['fail']} failed, {c['warn']} warned, "
                                f"{c['no_data'] + c['skipped']} without data, {c['nonfinite']} NaN/Inf finding(s)"))
    lines = result.failure_lines()
    shown = lines if max_failures is None else lines[:max_failures]
    for line in shown:
        console.print(Text(f"  {line}", style="red"), soft_wrap=True)
    if len(shown) < len(lines):
        console.print(Text(f"  … and {len(lines) - len(shown)} more (`dsv4-drift gate {result.run.dir}` lists them)"),
                      soft_wrap=True)


# --------------------------------------------------------------------------- markdown


def _md(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(result: GateResult) -> str:
    run, c = result.run, counts(result)
    mark = "✅ PASS" if result.passed else f"❌ {result.verdict.upper()}"
    lines = [f"### dsv4-drift gate: {mark}", "",
             f"**{_md(run.scenario)}** (`{_md(run.dir)}`) · policy `{_md(Path(result.policy.file).name)}`"
             + (f" · baseline `{_md(result.baseline_source)}`" if result.baseline_source else ""), "",
             f"{c['testcases']} check × variant: **{c['pass']} passed, {c['fail']} failed**, {c['warn']} warned, "
             f"{c['no_data'] + c['skipped']} without data · NaN/Inf findings: {c['nonfinite'] or 'none'}", ""]
    if result.nonfinite:
        lines += ["#### NaN/Inf", "", "| variant | mode | first layer | tap | phase | position |",
                  "|---|---|---:|---|---|---:|"]
        lines += [f"| {_md(f.get('variant'))} | {_md(f.get('mode'))} | {f.get('layer')} | "
                  f"`{_md(f.get('tap'))}.{_md(f.get('field'))}` | {_md(f.get('phase'))} | {f.get('position')} |"
                  for f in result.nonfinite]
        lines.append("")
    rows = _rows(result)
    header = ["| check | metric | variant | phase | status | first failing layer | worst value vs bound |",
              "|---|---|---|---|---|---:|---|"]

    def row(r: dict[str, str]) -> str:
        return (f"| {_md(r['check'])} | `{_md(r['metric'])}` | {_md(r['variant'])} | {_md(r['phase'])} | "
                f"{STATUS_MARK.get(r['status'], r['status'])} | {_md(r['first'])} | {_md(r['worst'])} |")

    failing = [r for r in rows if r["status"] in ("fail", "warn")]
    if failing:
        lines += ["#### Failing checks", ""] + header + [row(r) for r in failing] + [""]
    lines += [f"<details><summary>All checks ({len(rows)} rows)</summary>", ""] + header + [row(r) for r in rows]
    lines += ["", "</details>", ""]
    figures = figure_links(run.dir)
    if figures:
        lines += ["#### Figures", "", f"In `{_md(run.dir)}` (links relative to it):", ""] + figures + [""]
    for note in result.notes:
        lines.append(f"> note: {_md(note)}")
    return "\n".join(lines) + "\n"


def figure_links(run_dir: Path) -> list[str]:
    """A markdown list item per RUN_DIR/figures/*.png, linked relative to the run directory, with its SVG
    beside it where there is one."""
    items = []
    for png in sorted((Path(run_dir) / FIGURES_DIR).glob("*.png")):
        name = _md(png.stem).replace("[", "\\[").replace("]", "\\]")
        item = f"- [{name}]({quote(f'{FIGURES_DIR}/{png.name}')})"
        if png.with_suffix(".svg").is_file():
            item += f" ([SVG]({quote(f'{FIGURES_DIR}/{png.stem}.svg')}))"
        items.append(item)
    return items


# --------------------------------------------------------------------------- JUnit XML


def junit_xml(result: GateResult) -> str:
    """One testcase per check × variant (classname dsv4-drift.<check>, name <variant>) and one `nonfinite`
    testcase per stack; failures carry the first failing layer in their message and every failing unit."""
    c = counts(result)
    suites = ET.Element("testsuites", name="dsv4-drift gate")
    stacks = result.run.variants
    n_tests = c["testcases"] + len(stacks) + 1
    n_fail = c["fail"] + len({f.get("variant") for f in result.nonfinite}) + int(result.blocked_as_incomplete)
    suite = ET.SubElement(suites, "testsuite", name=f"dsv4-drift gate: {result.run.scenario}", tests=str(n_tests),
                          failures=str(n_fail), errors="0", skipped=str(c["no_data"] + c["skipped"]),
                          timestamp=result.created)
    suites.set("tests", str(n_tests))
    suites.set("failures", str(n_fail))
    props = ET.SubElement(suite, "properties")
    for name, value in (("run_dir", str(result.run.dir)), ("policy", result.policy.file),
                        ("baseline", result.baseline_source or "")):
        ET.SubElement(props, "property", name=name, value=value)
    complete = ET.SubElement(suite, "testcase", classname="dsv4-drift.run", name="complete", time="0")
    if result.blocked_as_incomplete:
        ET.SubElement(complete, "failure", type="incomplete", message=result.failure_lines()[0])
    elif result.incomplete:
        ET.SubElement(complete, "system-out").text = f"gated with --allow-incomplete: {result.incomplete}"
    for stack in stacks:
        case = ET.SubElement(suite, "testcase", classname="dsv4-drift.nonfinite", name=stack, time="0")
        found = [f for f in result.nonfinite if f.get("variant") == stack]
        if found:
            failure = ET.SubElement(case, "failure", type="nonfinite", message=nonfinite_message(found[0]))
            failure.text = "\n".join(nonfinite_message(f) for f in found)
    for cr in result.checks:
        for v in cr.variants:
            _testcase(suite, cr, v)
    ET.indent(suites)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(suites, encoding="unicode") + "\n"


def _testcase(suite: ET.Element, cr: CheckResult, v: VariantResult) -> None:
    ch = cr.check
    case = ET.SubElement(suite, "testcase", classname=f"dsv4-drift.{ch.name}", name=v.variant, time="0")
    if v.status in ("no_data", "skipped"):
        ET.SubElement(case, "skipped", message=v.reason or v.status)
        return
    bad = v.failing()
    if v.status == "fail":
        first = v.first_failure()
        failure = ET.SubElement(case, "failure", type="regression",
                                message=f"{ch.metric} first fails at {first.where()}: {_fmt(first.value)} > "
                                        f"{explain_limit(cr, first)}")
        failure.text = "\n".join(_unit_line(cr, u) for u in bad)
    elif v.status == "warn":
        out = ET.SubElement(case, "system-out")
        out.text = "warning (severity warn):\n" + "\n".join(_unit_line(cr, u) for u in bad)


def _unit_line(cr: CheckResult, u: Unit) -> str:
    return f"{u.where()}: {_fmt(u.value)} > {explain_limit(cr, u)}"
