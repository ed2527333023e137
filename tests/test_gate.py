"""The gate (DESIGN §5) on small synthetic run directories: each test builds a run with RunStore and a few
hand-written metric rows, runs `dsv4-drift gate` (harness.cli.main.main) and checks the exit code and outputs.

`make_run` and `rows_for` are reused by tests/test_pytest_plugin.py.
"""

from __future__ import annotations

import json
import math
import re
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from harness.cli.main import main
from harness.errors import UsageError
from harness.gate.gate_run import gate_run
from harness.gate.evaluate import load_run, select_layers
from harness.gate.policy import DEFAULT_POLICY, METRICS, config_names, load_policy, parse_policy
from harness.run.store import RunStore

CONFIG = {
    "name": "synthetic", "num_hidden_layers": 4, "layer_kinds": ["swa", "csa", "hca", "csa"],
    "hash_layers": [True, False, False, False], "index_topk": 16, "num_experts_per_tok": 4,
    "routed_scaling_factor": 1.5,
}
U = 2.0**-8  # the built-in floor of relative L2 metrics

STREAM_POLICY = """\
description: streams only
checks:
  - name: streams
    metric: streams.rel_l2
    bound: {yardstick: 16}
  - name: streams-patch
    metric: streams.rel_l2
    bound: {base: 2}
    baseline: {slack: 0.1}
"""


def row(variant: str, layer: int, metric: str, value: float, *, tap: str | None = None, phase: str = "prefill",
        mode: str = "global", peak: float | None = None, count: int = 64, pos_bin: int = 0) -> dict:
    """One metrics.parquet row (one position bin)."""
    return {"variant": variant, "mode": mode, "layer": layer, "phase": phase, "chunk": 0 if phase == "prefill" else -1,
            "step": -1 if phase == "prefill" else 0, "turn": 0, "pos_bin": pos_bin, "pos_end": pos_bin + count,
            "tap": tap or METRICS[metric].taps[0], "metric": metric, "value": value,
            "max": value if peak is None else peak, "count": count}


def rows_for(metric: str, per_variant: dict[str, list[float]], phases=("prefill", "decode"), **kw) -> list[dict]:
    """Rows of one metric: per variant, one value per layer (index = layer), in every phase."""
    return [row(v, layer, metric, x, phase=ph, **kw) for v, xs in per_variant.items() for layer, x in enumerate(xs)
            for ph in phases]


def make_run(run_dir: Path, rows: list[dict], variants=("base", "patched"), yardstick: bool = True,
             findings: list[dict] | None = None, policy: str = "default", status: str = "complete") -> Path:
    """A run directory as `dsv4-drift run` writes it, holding only `rows` (`status`: how far the run got)."""
    store = RunStore(run_dir)
    store.create({
        "format": "dsv4-drift-run/1", "status": status, "scenario": {"name": "synthetic", "file": "<test>"},
        "model": {"config": CONFIG}, "layers_total": CONFIG["num_hidden_layers"],
        "stacks": {"yardstick": yardstick, "variants": [{"name": v, "patches": []} for v in variants]},
        "gate": {"policy": policy},
    })
    for layer in sorted({r["layer"] for r in rows}):
        store.write_layer(layer, [r for r in rows if r["layer"] == layer])
    store.write_findings(findings or [])
    return run_dir


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def good_streams() -> dict[str, list[float]]:
    """base = 10× the yardstick (≤ 16×); patched adds 1× the yardstick (≤ 2×)."""
    return {"yardstick": [0.01, 0.01, 0.02, 0.02], "base": [0.1, 0.1, 0.2, 0.2], "patched": [0.11, 0.11, 0.22, 0.22]}


@pytest.fixture
def policy_file(tmp_path: Path) -> Path:
    return write(tmp_path / "policy.yaml", STREAM_POLICY)


# --------------------------------------------------------------------------- exit codes


def test_exit_0_when_every_check_passes(tmp_path, policy_file, capsys):
    run = make_run(tmp_path / "run", rows_for("streams.rel_l2", good_streams()))
    assert main(["gate", str(run), "--policy", str(policy_file)]) == 0
    gate = json.loads((run / "gate.json").read_text())
    assert gate["verdict"] == "pass" and gate["exit_code"] == 0
    assert gate["counts"] == {"checks": 2, "testcases": 3, "pass": 3, "fail": 0, "warn": 0, "no_data": 0,
                              "skipped": 0, "nonfinite": 0}
    assert "PASS" in capsys.readouterr().out


def test_exit_1_names_the_first_failing_layer(tmp_path, policy_file, capsys):
    values = good_streams()
    values["patched"] = [0.11, 0.11, 0.3, 0.3]  # layers 2, 3: 0.3 > 0.2 + 2·0.02 + 2^-8
    run = make_run(tmp_path / "run", rows_for("streams.rel_l2", values, phases=("decode",)))
    assert main(["gate", str(run), "--policy", str(policy_file), "--json", str(tmp_path / "g.json")]) == 1
    out = capsys.readouterr().out
    assert "streams-patch [patched]: streams.rel_l2 first fails at layer 2 decode" in out
    result = json.loads((tmp_path / "g.json").read_text())
    check = next(c for c in result["checks"] if c["name"] == "streams-patch")
    variant = check["variants"][0]
    assert variant["status"] == "fail"
    assert variant["phases"]["decode"]["first_failing_layer"] == 2
    first = variant["first_failure"]
    assert (first["layer"], first["tap"], first["phase"]) == (2, "layer.out", "decode")
    assert first["limit"] == pytest.approx(0.2 + 2 * 0.02 + U)
    assert [u["layer"] for u in variant["units"] if u["status"] == "fail"] == [2, 3]
    # the yardstick-relative check still passes: 0.3 ≤ 16·0.02 + 2^-8
    assert next(c for c in result["checks"] if c["name"] == "streams")["status"] == "pass"


def test_exit_2_for_a_missing_run_dir_a_missing_policy_and_a_run_without_metrics(tmp_path, policy_file, capsys):
    assert main(["gate", str(tmp_path / "nope"), "--policy", str(policy_file)]) == 2
    assert "does not exist" in capsys.readouterr().err
    run = make_run(tmp_path / "run", rows_for("streams.rel_l2", good_streams()))
    assert main(["gate", str(run), "--policy", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "manifest.json").write_text("{}")
    assert main(["gate", str(tmp_path / "empty"), "--policy", str(policy_file)]) == 2
    assert "no metrics.parquet" in capsys.readouterr().err


@pytest.mark.parametrize("text, line, field, words", [
    ("checks:\n  - name: a\n    metric: streams.rel_l2\n    bound: {absolute: 1}\n    tolerance: 3\n",
     5, "checks[0].tolerance", "unknown key"),
    ("checks:\n  - name: a\n    metric: streams.rel_l3\n    bound: {absolute: 1}\n",
     3, "checks[0].metric", "unknown metric 'streams.rel_l3'; did you mean 'streams.rel_l2'"),
    ("checks:\n  - name: a\n    metric: streams.rel_l2\n    bound: {yardstick: 2, base: 2}\n",
     4, "checks[0].bound", "exactly one of"),
    ("checks:\n  - name: a\n    metric: streams.rel_l2\n    bound: {yardstick: -1}\n",
     4, "checks[0].bound.yardstick", "≥ 0"),
    ("checks:\n  - name: a\n    metric: streams.rel_l2\n    bound: {relative: 2}\n",
     4, "checks[0].bound.relative", "unknown key"),
    ("checks:\n  - name: a\n    metric: streams.rel_l2\n    bound: {absolute: \"import os\"}\n",
     4, "checks[0].bound.absolute", "not a number"),
    ("checks:\n  - name: a\n    metric: indexer.recall\n    direction: upper\n    bound: {absolute: 0.1}\n",
     4, "checks[0].direction", "'lower'"),
    ("checks:\n  - name: a\n    metric: streams.rel_l2\n    layers: [csa, 3-1]\n    bound: {absolute: 1}\n",
     4, "checks[0].layers[1]", "empty"),
    ("checks:\n  - name: a\n    metric: streams.rel_l2\n    aggregate: median\n    bound: {absolute: 1}\n",
     4, "checks[0].aggregate", "expected one of max, p99, mean, min; got 'median'"),
    ("checks:\n  - name: a\n    metric: streams.rel_l2\n    tap: attn.out\n    bound: {absolute: 1}\n",
     4, "checks[0].tap", "not measured at tap attn.out"),
    ("checks:\n  - name: a\n    metric: streams.rel_l2\n", 2, "checks[0].bound", "required"),
    ("chekcs: []\n", 1, "chekcs", "did you mean 'checks'"),
])
def test_exit_2_for_a_bad_policy_names_file_line_and_field(tmp_path, capsys, text, line, field, words):
    run = make_run(tmp_path / "run", rows_for("streams.rel_l2", good_streams()))
    bad = write(tmp_path / "bad.yaml", text)
    assert main(["gate", str(run), "--policy", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:{line}: {field}: " in err, err
    assert words in err, err
    assert not (run / "gate.json").exists()


def test_exit_2_for_an_expression_naming_an_unknown_config_field(tmp_path, capsys):
    run = make_run(tmp_path / "run", rows_for("streams.rel_l2", good_streams()))
    bad = write(tmp_path / "bad.yaml", "checks:\n  - name: a\n    metric: streams.rel_l2\n"
                                       "    bound: {yardstick: 16}\n    floor: 1/index_top_k\n")
    assert main(["gate", str(run), "--policy", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:5: checks[0].floor: '1/index_top_k' names 'index_top_k'" in err


def test_exit_2_when_a_relative_bound_has_no_yardstick_or_base_to_compare_with(tmp_path, policy_file, capsys):
    values = good_streams()
    del values["yardstick"]
    run = make_run(tmp_path / "run", rows_for("streams.rel_l2", values), yardstick=False)
    assert main(["gate", str(run), "--policy", str(policy_file)]) == 2
    assert "has none (scenario stacks.yardstick: false)" in capsys.readouterr().err
    run2 = make_run(tmp_path / "run2", rows_for("streams.rel_l2", {"yardstick": [0.01] * 4, "stock": [0.1] * 4,
                                                                    "patched": [0.1] * 4}),
                    variants=("stock", "patched"))
    assert main(["gate", str(run2), "--policy", str(policy_file)]) == 2
    assert "does not have (variants: stock, patched); set base_variant:" in capsys.readouterr().err
    write(policy_file, "base_variant: stock\n" + STREAM_POLICY)
    assert main(["gate", str(run2), "--policy", str(policy_file)]) == 0


# --------------------------------------------------------------------------- bounds


def test_a_zero_yardstick_cannot_fail_a_value_within_the_rounding_floor(tmp_path, policy_file):
    values = {"yardstick": [0.0] * 4, "base": [U * 0.9] * 4, "patched": [U * 0.9] * 4}
    assert gate_run(make_run(tmp_path / "ok", rows_for("streams.rel_l2", values)), policy_file).passed
    values["base"][1] = 0.01  # one bf16 rounding is 0.0039: 0.01 is drift even with a zero floor
    result = gate_run(make_run(tmp_path / "bad", rows_for("streams.rel_l2", values)), policy_file)
    check = next(c for c in result.checks if c.check.name == "streams")
    (base,) = [v for v in check.variants if v.variant == "base"]
    assert base.status == "fail" and base.first_failure().layer == 1
    assert base.first_failure().limit == pytest.approx(U)


def test_base_relative_bound_is_base_plus_factor_times_yardstick_plus_floor(tmp_path, policy_file):
    limit = 0.2 + 2 * 0.02 + U
    for value, passed in ((limit * (1 - 1e-6), True), (limit * (1 + 1e-6), False)):
        values = good_streams()
        values["patched"][3] = value
        result = gate_run(make_run(tmp_path / f"run-{passed}", rows_for("streams.rel_l2", values)), policy_file)
        (variant,) = next(c for c in result.checks if c.check.name == "streams-patch").variants
        assert variant.variant == "patched"  # base itself is not checked against base
        assert variant.status == ("pass" if passed else "fail"), (value, limit)


def test_quadratic_metrics_apply_the_amplitude_factor_to_square_roots(tmp_path):
    """KL is quadratic in the error amplitude: `base: 2` bounds √KL by √KL_base + 2·√KL_yardstick."""
    policy = write(tmp_path / "p.yaml", "checks:\n  - name: kl\n    metric: logits.kl\n    layers: logits\n"
                                        "    bound: {base: 2}\n  - name: kl-noise\n    metric: logits.kl\n"
                                        "    layers: logits\n    bound: {yardstick: 16}\n")
    floor = 2.0**-17
    limit = (0.04**0.5 + 2 * 0.01**0.5) ** 2 + floor  # (0.2 + 0.2)² = 0.16, not 0.04 + 2·0.01 = 0.06
    for value, passed in ((limit * (1 - 1e-6), True), (limit * (1 + 1e-6), False)):
        rows = [row("yardstick", 4, "logits.kl", 0.01), row("base", 4, "logits.kl", 0.04),
                row("patched", 4, "logits.kl", value)]
        result = gate_run(make_run(tmp_path / f"run-{passed}", rows), policy)
        by_name = {c.check.name: c for c in result.checks}
        (patched,) = by_name["kl"].variants
        assert patched.status == ("pass" if passed else "fail")
        assert patched.units[0].limit == pytest.approx(limit)
        noise = {v.variant: v.units[0].limit for v in by_name["kl-noise"].variants}
        assert noise["base"] == pytest.approx(16**2 * 0.01 + floor)
    assert "(√base 0.04 + 2×√yardstick 0.01)²" in result.failure_lines()[0]


def test_absolute_zero_bound_holds_hash_layer_routing_exact(tmp_path):
    policy = write(tmp_path / "p.yaml", "checks:\n  - name: hash-exact\n    metric: moe.flip_rate\n    layers: hash\n"
                                        "    modes: [global, local]\n    bound: {absolute: 0}\n")
    flips = {"yardstick": [0, 0.25, 0, 0], "base": [0, 0.25, 0, 0], "patched": [0, 0.5, 0.25, 0]}
    rows = rows_for("moe.flip_rate", flips) + rows_for("moe.flip_rate", flips, mode="local")
    assert gate_run(make_run(tmp_path / "ok", rows), policy).passed  # learned layers 1-3 are not hash layers
    flips["patched"][0] = 1 / 4
    result = gate_run(make_run(tmp_path / "bad", rows_for("moe.flip_rate", flips, mode="local")), policy)
    assert [line.split(":")[0] for line in result.failure_lines()] == ["hash-exact [patched]"]
    assert "layer 0 prefill (local, moe.router)" in result.failure_lines()[0]


def test_recall_is_bounded_as_a_loss_over_its_worst_bin(tmp_path):
    policy = write(tmp_path / "p.yaml", "checks:\n  - name: recall\n    metric: indexer.recall\n    layers: csa\n"
                                        "    bound: {yardstick: 16}\n")
    rows = []
    for variant, recalls in {"yardstick": [1.0, 0.99], "base": [0.9, 0.85], "patched": [0.95, 0.6]}.items():
        for i, r in enumerate(recalls):  # two bins at layer 1; the max column (best position) must be ignored
            rows.append(row(variant, 1, "indexer.recall", r, peak=1.0, pos_bin=64 * i))
    result = gate_run(make_run(tmp_path / "run", rows), policy)
    (check,) = result.checks
    by_variant = {v.variant: v for v in check.variants}
    # loss of the worst bin: 1 − 0.6 = 0.4 > 16·(1 − 0.99) + 1/index_topk = 0.16 + 0.0625
    assert by_variant["patched"].status == "fail"
    assert by_variant["patched"].units[0].value == pytest.approx(0.4)
    assert by_variant["patched"].units[0].limit == pytest.approx(16 * 0.01 + 1 / 16)
    assert by_variant["base"].status == "pass"  # 0.15 ≤ 0.2225
    assert {u.layer for u in by_variant["base"].units} == {1}  # layers: csa on this run's [swa, csa, hca, csa]


@pytest.mark.parametrize("aggregate, expected", [("max", 0.5), ("p99", 0.2 + 0.98 * (0.3 - 0.2)), ("min", 0.1),
                                                 ("mean", (0.1 * 10 + 0.2 * 30 + 0.3 * 60) / 100)])
def test_aggregates_over_the_bins_of_one_layer_and_phase(tmp_path, aggregate, expected):
    policy = write(tmp_path / "p.yaml", f"checks:\n  - name: a\n    metric: attn.tv\n    aggregate: {aggregate}\n"
                                        "    bound: {absolute: 1}\n")
    # (bin value, per-position max, count); p99 interpolates linearly at rank 0.99·(3 − 1) = 1.98
    bins = [(0.1, 0.2, 10), (0.2, 0.3, 30), (0.3, 0.5, 60)]
    rows = [row("base", 0, "attn.tv", v, peak=p, count=c, pos_bin=64 * i) for i, (v, p, c) in enumerate(bins)]
    result = gate_run(make_run(tmp_path / "run", rows, variants=("base",), yardstick=False), policy)
    (unit,) = result.checks[0].variants[0].units
    assert unit.value == pytest.approx(expected)


def test_a_nan_metric_value_fails_its_check(tmp_path, policy_file):
    values = good_streams()
    values["patched"][2] = math.nan
    result = gate_run(make_run(tmp_path / "run", rows_for("streams.rel_l2", values)), policy_file)
    assert not result.passed
    (variant,) = next(c for c in result.checks if c.check.name == "streams-patch").variants
    assert variant.first_failure().layer == 2 and math.isnan(variant.first_failure().value)


def test_nan_inf_finding_fails_the_gate_naming_layer_tap_and_phase(tmp_path, policy_file, capsys):
    finding = {"variant": "patched", "mode": "global", "layer": 2, "tap": "attn.out", "field": "out",
               "phase": "decode", "position": 700}
    run = make_run(tmp_path / "run", rows_for("streams.rel_l2", good_streams()), findings=[finding])
    assert main(["gate", str(run), "--policy", str(policy_file), "--junit", str(tmp_path / "j.xml")]) == 1
    out = capsys.readouterr().out
    assert "NaN/Inf in patched (global): first at layer 2, tap attn.out.out, decode position 700" in out
    gate = json.loads((run / "gate.json").read_text())
    assert gate["verdict"] == "fail" and gate["counts"]["nonfinite"] == 1 and gate["counts"]["fail"] == 0
    cases = ET.parse(tmp_path / "j.xml").getroot().iter("testcase")
    failed = [(c.get("classname"), c.get("name")) for c in cases if c.find("failure") is not None]
    assert failed == [("dsv4-drift.nonfinite", "patched")]


def test_variant_globs_and_layer_selectors(tmp_path):
    run = make_run(tmp_path / "run", rows_for("streams.rel_l2", good_streams()) +
                   [row(v, 4, "logits.kl", 0.0) for v in ("yardstick", "base", "patched")])
    policy = write(tmp_path / "p.yaml", "checks:\n  - name: a\n    metric: streams.rel_l2\n    variants: ['pat*']\n"
                                        "    layers: [hash, 2-3]\n    bound: {absolute: 1}\n")
    result = gate_run(run, policy)
    assert [v.variant for v in result.checks[0].variants] == ["patched"]
    assert sorted({u.layer for u in result.checks[0].variants[0].units}) == [0, 2, 3]
    data = load_run(run)
    layers = {}
    for sel in ("csa", "hca", "swa", "hash", "learned", "logits", "all"):
        check = parse_policy(f"checks:\n  - name: a\n    metric: streams.rel_l2\n    layers: {sel}\n"
                             "    bound: {absolute: 1}\n").checks[0]
        layers[sel] = sorted(select_layers(check, data, "p.yaml"))
    assert layers == {"csa": [1, 3], "hca": [2], "swa": [0], "hash": [0], "learned": [1, 2, 3], "logits": [4],
                      "all": [0, 1, 2, 3, 4]}
    too_far = parse_policy("checks:\n  - name: a\n    metric: streams.rel_l2\n    layers: [9]\n"
                           "    bound: {absolute: 1}\n").checks[0]
    with pytest.raises(UsageError, match="layer 9 is past this run's model"):
        select_layers(too_far, data, "p.yaml")


def test_warn_checks_are_reported_but_never_fail_the_gate(tmp_path):
    policy = write(tmp_path / "p.yaml", "checks:\n  - name: soft\n    metric: streams.rel_l2\n    severity: warn\n"
                                        "    bound: {absolute: 0.05}\n")
    result = gate_run(make_run(tmp_path / "run", rows_for("streams.rel_l2", good_streams())), policy)
    assert result.passed and {v.status for v in result.checks[0].variants} == {"warn"}


def test_a_check_without_rows_is_no_data_and_does_not_fail(tmp_path):
    policy = write(tmp_path / "p.yaml", "checks:\n  - name: needle\n    metric: ctx.needle_recall\n"
                                        "    bound: {yardstick: 16}\n")
    result = gate_run(make_run(tmp_path / "run", rows_for("streams.rel_l2", good_streams())), policy)
    assert result.passed and {v.status for v in result.checks[0].variants} == {"no_data"}


# --------------------------------------------------------------------------- outputs


def test_junit_xml_has_one_testcase_per_check_and_variant_and_the_failures(tmp_path, policy_file):
    values = good_streams()
    values["base"][3] = 0.5  # streams: base fails (0.5 > 16·0.02 + 2^-8); streams-patch: patched passes vs base
    values["patched"][1] = 0.5  # both checks fail for patched at layer 1
    run = make_run(tmp_path / "run", rows_for("streams.rel_l2", values))
    assert main(["gate", str(run), "--policy", str(policy_file), "--junit", str(tmp_path / "out" / "gate.xml")]) == 1
    root = ET.parse(tmp_path / "out" / "gate.xml").getroot()
    (suite,) = root.iter("testsuite")
    cases = list(suite.iter("testcase"))
    # streams × {base, patched} + streams-patch × {patched} + nonfinite × {yardstick, base, patched} + run complete
    assert len(cases) == int(suite.get("tests")) == 7
    failures = {(c.get("classname"), c.get("name")): c.find("failure") for c in cases if c.find("failure") is not None}
    assert sorted(failures) == [("dsv4-drift.streams", "base"), ("dsv4-drift.streams", "patched"),
                                ("dsv4-drift.streams-patch", "patched")]
    assert int(suite.get("failures")) == 3
    assert "first fails at layer 1 prefill" in failures[("dsv4-drift.streams-patch", "patched")].get("message")
    assert "first fails at layer 3 prefill" in failures[("dsv4-drift.streams", "base")].get("message")


def test_markdown_summary_lists_failures_first_and_appends(tmp_path, policy_file):
    values = good_streams()
    values["patched"][2] = 0.3  # > 0.2 + 2·0.02 + 2^-8 (streams-patch), ≤ 16·0.02 + 2^-8 (streams)
    run = make_run(tmp_path / "run", rows_for("streams.rel_l2", values, phases=("decode",)))
    summary = write(tmp_path / "summary.md", "# earlier step\n")
    assert main(["gate", str(run), "--policy", str(policy_file), "--summary", str(summary)]) == 1
    text = summary.read_text()
    assert text.startswith("# earlier step\n### dsv4-drift gate: ❌ FAIL")
    failing = text[text.index("#### Failing checks"):text.index("<details>")]
    assert "| streams-patch | `streams.rel_l2` | patched | decode | ❌ FAIL | 2 | 0.3 > 0.2439 at L2" in failing
    assert "streams | `streams.rel_l2` | base" not in failing
    assert "2 passed, 1 failed" in text and "NaN/Inf findings: none" in text


def test_gate_json_in_the_run_dir_feeds_the_report_banner(tmp_path, policy_file):
    run = make_run(tmp_path / "run", rows_for("streams.rel_l2", good_streams()))
    gate_run(run, policy_file)
    gate = json.loads((run / "gate.json").read_text())
    assert gate["format"] == "dsv4-drift-gate/1"
    assert set(gate) >= {"verdict", "exit_code", "run", "policy", "counts", "failures", "nonfinite", "checks"}
    check = gate["checks"][1]
    assert check["bound"] == {"kind": "base", "expression": "2", "value": 2.0}
    assert check["floor"] == U and check["variants"][0]["units"][0].keys() >= {"layer", "phase", "value", "limit"}
    # this synthetic run stops at layer 3: the final logits row (layer 4) is missing, and the gate says so
    assert any("no metrics for layer(s) 4" in note for note in gate["notes"]), gate["notes"]


# --------------------------------------------------------------------------- baselines and the ratchet


def test_baseline_ratchet_tightens_refuses_to_loosen_and_records_allow_loosen(tmp_path, policy_file, capsys,
                                                                              monkeypatch):
    monkeypatch.setenv("GITHUB_ACTOR", "ci-bot")
    baseline = tmp_path / "baseline.json"
    run = make_run(tmp_path / "run", rows_for("streams.rel_l2", good_streams()))
    assert main(["gate", str(run), "--policy", str(policy_file), "--update-baseline", str(baseline)]) == 0
    created = json.loads(baseline.read_text())
    entry = {"check": "streams-patch", "variant": "patched", "mode": "global", "tap": "layer.out", "layer": 2,
             "phase": "prefill"}
    assert entry | {"value": 0.22} in created["values"]
    assert created["history"][0]["action"] == "create" and created["history"][0]["who"] == "ci-bot"

    # a better run tightens
    better = good_streams()
    better["patched"][2] = 0.21
    run2 = make_run(tmp_path / "run2", rows_for("streams.rel_l2", better))
    assert main(["gate", str(run2), "--policy", str(policy_file), "--update-baseline", str(baseline)]) == 0
    assert entry | {"value": 0.21} in json.loads(baseline.read_text())["values"]

    # a worse run (still within the policy bound) may not loosen: values and file unchanged
    worse = good_streams()
    worse["patched"][2] = 0.235  # ≤ 0.2 + 0.04 + 2^-8, but > 0.21
    run3 = make_run(tmp_path / "run3", rows_for("streams.rel_l2", worse))
    before = baseline.read_bytes()
    capsys.readouterr()
    assert main(["gate", str(run3), "--policy", str(policy_file), "--update-baseline", str(baseline)]) == 0
    assert baseline.read_bytes() == before
    # 4 = the same unit in both checks (streams, streams-patch), in both phases
    assert "refused to loosen 4 value(s)" in capsys.readouterr().out

    # ... and the baseline then fails it: 0.235 > 0.21·1.1 + 2^-8
    assert main(["gate", str(run3), "--policy", str(policy_file), "--baseline", str(baseline)]) == 1
    result = gate_run(run3, policy_file, baseline)
    (line,) = result.failure_lines()
    assert "layer 2 prefill" in line and "baseline 0.21×(1+0.1)" in line
    assert gate_run(run2, policy_file, baseline).passed

    # --allow-loosen takes the observed value and records who, when and what
    assert main(["gate", str(run3), "--policy", str(policy_file), "--update-baseline", str(baseline),
                 "--allow-loosen"]) == 0
    data = json.loads(baseline.read_text())
    assert entry | {"value": 0.235} in data["values"]
    last = data["history"][-1]
    assert last["action"] == "loosen" and last["who"] == "ci-bot" and last["when"]
    assert entry | {"old": 0.21, "new": 0.235} in last["loosened"] and len(last["loosened"]) == 4
    assert main(["gate", str(run3), "--policy", str(policy_file), "--baseline", str(baseline)]) == 0


def test_baseline_may_be_another_run_directory(tmp_path, policy_file):
    earlier = good_streams()
    earlier["patched"] = list(earlier["base"])  # the patch used to add nothing
    old = make_run(tmp_path / "old", rows_for("streams.rel_l2", earlier))
    now = good_streams()
    now["patched"] = [0.12, 0.12, 0.24, 0.24]  # now it adds 2× the yardstick
    new = make_run(tmp_path / "new", rows_for("streams.rel_l2", now))
    assert gate_run(new, policy_file).passed  # within the policy's bound, base + 2×yardstick + floor ...
    result = gate_run(new, policy_file, baseline=old)  # ... but 0.12 > 0.1·(1 + 0.1) + 2^-8 = 0.1139
    assert not result.passed and result.baseline_source == f"run {old}"
    (variant,) = next(c for c in result.checks if c.check.name == "streams-patch").variants
    assert variant.first_failure().layer == 0
    assert variant.first_failure().baseline_limit == pytest.approx(0.1 * 1.1 + U)


def test_allow_loosen_without_update_baseline_and_a_bad_baseline_file_are_usage_errors(tmp_path, policy_file,
                                                                                        capsys):
    run = make_run(tmp_path / "run", rows_for("streams.rel_l2", good_streams()))
    assert main(["gate", str(run), "--policy", str(policy_file), "--allow-loosen"]) == 2
    bad = write(tmp_path / "b.json", json.dumps({"format": "something-else"}))
    assert main(["gate", str(run), "--policy", str(policy_file), "--baseline", str(bad)]) == 2
    assert "not a dsv4-drift baseline" in capsys.readouterr().err


# --------------------------------------------------------------------------- the shipped policy


def test_default_policy_loads_and_its_floors_match_the_metric_registry():
    policy = load_policy(DEFAULT_POLICY)
    names = {**config_names({"index_topk": 512, "num_experts_per_tok": 6, "routed_scaling_factor": 1.5}),
             "pick_share": 0.25}  # the subset recalls' per-unit floor variable
    for metric, expr in policy.floors.items():
        built_in = METRICS[metric].floor
        assert built_in is not None, metric
        assert expr.evaluate(names) == pytest.approx(eval(built_in, {}, dict(names))), metric  # noqa: S307
    by_name = {c.name: c for c in policy.checks}
    assert by_name["streams-rel-l2"].bound.value.evaluate({}) == 16
    assert by_name["logits-kl"].bound.value.evaluate({}) == 16 and by_name["logits-kl"].rule.order == 2
    assert by_name["streams-rel-l2-patch"].bound.kind == "base"
    assert by_name["hash-routing-exact"].bound.value.evaluate({}) == 0


NEEDLE_POLICY = """\
checks:
  - name: needle
    metric: ctx.needle_recall
    layers: csa
    bound: {yardstick: 16}
"""


def test_subset_recall_floor_is_one_pick_of_the_subset_per_query(tmp_path):
    """A needle holding 4 of a query's picks: one pick lost per query is 1/4 of its needle recall — one rounding's
    worth of a discrete selection, as 1/k is for indexer.recall — so with a zero yardstick a loss of 1/4 passes
    and 2/4 fails. The floor is the unit's count-weighted mean of ctx.needle_pick_share (= 1/|needle picks|)."""
    policy = write(tmp_path / "p.yaml", NEEDLE_POLICY)
    share = rows_for("ctx.needle_pick_share", {v: [0.25] * 4 for v in ("yardstick", "base", "patched")})
    one_pick = rows_for("ctx.needle_recall", {"yardstick": [1] * 4, "base": [1, 0.75, 1, 0.75], "patched": [1] * 4})
    assert main(["gate", str(make_run(tmp_path / "one", one_pick + share)), "--policy", str(policy)]) == 0
    two_picks = rows_for("ctx.needle_recall", {"yardstick": [1] * 4, "base": [1, 0.5, 1, 1], "patched": [1] * 4})
    result = gate_run(make_run(tmp_path / "two", two_picks + share), policy)
    failed = {(v.variant, u.phase, u.layer, u.floor, u.limit) for _, v in result.failed_checks for u in v.units
              if not u.passed}
    assert failed == {("base", phase, 1, 0.25, 0.25) for phase in ("prefill", "decode")}


def test_pick_share_floor_needs_its_metric(tmp_path):
    policy = write(tmp_path / "p.yaml", NEEDLE_POLICY)
    old_run = make_run(tmp_path / "old", rows_for("ctx.needle_recall", {v: [1] * 4 for v in ("yardstick", "base",
                                                                                            "patched")}))
    with pytest.raises(UsageError, match="ctx.needle_pick_share rows .* predates"):
        gate_run(old_run, policy)
    wrong = write(tmp_path / "w.yaml", "checks:\n  - name: r\n    metric: indexer.recall\n    floor: pick_share\n"
                                       "    bound: {yardstick: 16}\n")
    with pytest.raises(UsageError, match="pick_share. is defined only for recalls over a subset"):
        gate_run(old_run, wrong)


def test_default_policy_on_a_synthetic_run_passes_then_fails_on_hash_flips(tmp_path):
    rows = rows_for("streams.rel_l2", good_streams())
    rows += rows_for("moe.flip_rate", {"yardstick": [0, 0, 0, 0], "base": [0, 0.25, 0, 0], "patched": [0, 0, 0, 0]})
    assert main(["gate", str(make_run(tmp_path / "ok", rows))]) == 0  # the manifest's gate.policy: default
    rows += [row("patched", 0, "moe.flip_rate", 0.25, pos_bin=64)]
    result = gate_run(make_run(tmp_path / "bad", rows))
    assert [c.check.name for c, _ in result.failed_checks] == ["hash-routing-exact"]


def test_every_metric_harness_metrics_documents_is_known_to_the_gate():
    import harness.run.metrics

    doc = harness.run.metrics.__doc__
    names = set()
    for prefix, members in re.findall(r"(\w+)\.\{([^}]*)\}", doc):
        names |= {f"{prefix}.{m.strip()}" for m in members.split(",")}
    names |= set(re.findall(r"\b(?:compressor|indexer)\.rows_rel_l2\b", doc))
    assert names and names <= set(METRICS), names - set(METRICS)
