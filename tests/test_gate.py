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
from typing import Callable

import numpy as np
import pytest

from harness.cli.main import main
from harness.errors import UsageError
from harness.gate.expressions import Expr
from harness.gate.gate_run import gate_run
from harness.gate.evaluate import allowed_count, load_run, select_layers
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
        mode: str = "global", peak: float | None = None, count: int = 64, pos_bin: int = 0, chunk: int = 0,
        step: int = 0, turn: int = 0) -> dict:
    """One metrics.parquet row (one position bin); `chunk` is written for prefill rows, `step` for decode rows (the
    other is −1, as harness.run.bins writes them)."""
    return {"variant": variant, "mode": mode, "layer": layer, "phase": phase,
            "chunk": chunk if phase == "prefill" else -1, "step": -1 if phase == "prefill" else step, "turn": turn,
            "pos_bin": pos_bin, "pos_end": pos_bin + count, "tap": tap or METRICS[metric].taps[0], "metric": metric,
            "value": value, "max": value if peak is None else peak, "count": count}


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


def counted_limit(terms: list[tuple[float, float]], n: float, z: float = 4) -> float:
    """The limit of a counted bound (harness.gate.evaluate), written out apart from the gate's code: with reference
    counts N·r and coefficients c, √(V + 3/8) ≤ √(Σ c·(N·r + 3/8)) + z·s, s² = ¼ + Σ c²·(N·r + 3/8)/(4·Σ c·(N·r + 3/8)),
    plus the floor, one decision of N; in loss units."""
    shifted = sum(c * (r * n + 3 / 8) for c, r in terms)
    spread = math.sqrt(0.25 + sum(c * c * (r * n + 3 / 8) for c, r in terms) / (4 * shifted))
    return ((math.sqrt(shifted) + z * spread) ** 2 - 3 / 8 + 1) / n


def test_recall_worst_bin_is_a_bin_scope_counted_as_lost_picks(tmp_path):
    policy = write(tmp_path / "p.yaml", "checks:\n  - name: recall\n    metric: indexer.recall\n    layers: csa\n"
                                        "    scope: bin\n    bound: {yardstick: 16}\n")
    rows = []
    for variant, recalls in {"yardstick": [1.0, 0.99], "base": [0.95, 0.85], "patched": [0.95, 0.5]}.items():
        for i, r in enumerate(recalls):  # two bins at layer 1; the max column (best position) must be ignored
            rows.append(row(variant, 1, "indexer.recall", r, peak=1.0, pos_bin=64 * i))
    result = gate_run(make_run(tmp_path / "run", rows), policy)
    (check,) = result.checks
    by_variant = {v.variant: v for v in check.variants}
    # each bin: 64 queries × index_topk 16 = 1024 picks. The first: the yardstick lost none, 16× its count's noise
    # allows 115 picks (0.112 ≥ 0.05, base's and patched's loss there); the second: the yardstick lost 1% (10.24),
    # 16× that is 164 and with the noise of both counts 453 picks, 0.443 < 0.5
    limit = counted_limit([(16, 0.01)], 64 * 16)
    patched = {u.group: u for u in by_variant["patched"].units}
    assert by_variant["patched"].status == "fail" and not patched[64].passed and patched[0].passed
    assert patched[64].value == pytest.approx(0.5) and patched[64].limit == pytest.approx(limit)
    assert patched[64].decisions == 1024 and patched[64].where() == "layer 1 prefill positions 64-127 (global, " \
                                                                    "indexer.selected)"
    assert by_variant["base"].status == "pass"  # 0.15 ≤ 0.443 in the second bin
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


def test_a_counted_baseline_allows_the_count_noise_of_two_draws(tmp_path):
    """A discrete metric's baseline is a count like this run's: both are Poisson draws of the flips at near-ties (a
    re-association re-draws them), so `baseline: {slack: 0}` allows allowed_count([(1, baseline·N)], z), not the
    one-decision floor above the old count. 64 positions × index_topk 16 = 1,024 picks per unit."""
    policy = write(tmp_path / "p.yaml", "description: recall vs its baseline\nchecks:\n  - name: recall\n"
                                        "    metric: indexer.recall\n    layers: csa\n    baseline: {slack: 0}\n")
    n = 64 * CONFIG["index_topk"]

    def run_losing(name: str, picks: int) -> Path:
        return make_run(tmp_path / name, rows_for("indexer.recall", {v: [1 - picks / n] * 4 for v in
                                                                     ("yardstick", "base", "patched")}))

    old = run_losing("old", 2)
    limit = allowed_count([(1.0, 2.0)], 4) + 1  # + the floor, one pick
    assert 5 < limit < 25
    assert gate_run(run_losing("redraw", 5), policy, baseline=old).passed  # failed the 2 + 1 picks of the old rule
    result = gate_run(run_losing("worse", 25), policy, baseline=old)
    assert not result.passed
    first = next(c for c in result.checks if c.check.name == "recall").variants[0].first_failure()
    assert first.baseline_limit == pytest.approx(limit / n)
    assert "baseline 0.001953×(1+0) + count noise (z = 4)" in " ".join(result.failure_lines())


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
    names = {**config_names({"index_topk": 512, "num_experts_per_tok": 6, "routed_scaling_factor": 1.5,
                             "hc_mult": 4, "hidden_size": 4096}),
             "pick_share": 0.25, "positions": 1000}  # the per-unit floor variables
    for metric, expr in policy.floors.items():
        built_in = METRICS[metric].floor
        assert built_in is not None, metric
        assert expr.evaluate(names) == pytest.approx(eval(built_in, {}, dict(names))), metric  # noqa: S307
    by_name = {c.name: c for c in policy.checks}
    assert by_name["streams-rel-l2"].bound.value.evaluate({}) == 16
    assert by_name["logits-kl"].bound.value.evaluate({}) == 16 and by_name["logits-kl"].rule.order == 2
    assert by_name["streams-rel-l2-patch"].bound.kind == "base"
    assert by_name["hash-routing-exact"].bound.value.evaluate({}) == 0
    assert policy.poisson_z.evaluate({}) == 4
    # every discrete floor is one decision of the unit's N = positions × decisions
    for metric, expr in policy.floors.items():
        rule = METRICS[metric]
        if rule.discrete:
            decisions = Expr(rule.decisions).evaluate(names)
            assert expr.evaluate(names) == pytest.approx(1 / (names["positions"] * decisions)), metric


NEEDLE_POLICY = """\
checks:
  - name: needle
    metric: ctx.needle_recall
    layers: csa
    bound: {yardstick: 16}
"""


def test_subset_recall_counts_the_picks_of_the_subset(tmp_path):
    """A needle holding 4 of each query's picks (pick share 1/4): a unit of 64 queries decides N = 64/(1/4) = 256
    needle picks, and its floor is one of them, pick_share/positions = 1/256 — not 1/4, one pick at every query.
    With a zero yardstick the bound allows 114 lost picks plus that one (16× the yardstick's count, whose 0 is a
    Poisson draw too: harness.gate.evaluate.allowed_count); 16 queries losing 2 picks each (32) pass, all 64
    losing 2 (128) fail."""
    policy = write(tmp_path / "p.yaml", NEEDLE_POLICY)
    share = rows_for("ctx.needle_pick_share", {v: [0.25] * 4 for v in ("yardstick", "base", "patched")})
    some = rows_for("ctx.needle_recall", {"yardstick": [1] * 4, "base": [1, 1 - 32 / 256, 1, 1], "patched": [1] * 4})
    assert main(["gate", str(make_run(tmp_path / "some", some + share)), "--policy", str(policy)]) == 0
    many = rows_for("ctx.needle_recall", {"yardstick": [1] * 4, "base": [1, 0.5, 1, 1], "patched": [1] * 4})
    result = gate_run(make_run(tmp_path / "many", many + share), policy)
    failed = {(v.variant, u.phase, u.layer) for _, v in result.failed_checks for u in v.units if not u.passed}
    assert failed == {("base", phase, 1) for phase in ("prefill", "decode")}
    unit = result.failed_checks[0][1].units[0]
    assert (unit.decisions, unit.floor) == (256, 1 / 256)
    assert unit.limit == pytest.approx(counted_limit([(16, 0)], 256))


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
    # base: 16 expert flips of 64 tokens × 4 at learned layer 1, within what 16× a zero-count yardstick allows
    rows += rows_for("moe.flip_rate", {"yardstick": [0, 0, 0, 0], "base": [0, 1 / 16, 0, 0], "patched": [0, 0, 0, 0]})
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


# --------------------------------------------------------------------------- where a loss happens (DESIGN §5)


Y, B = 0.01, 0.1  # yardstick and base attn.out_rel_l2 everywhere in the scope runs
PATCH_ALLOWANCE = 2 * Y + U  # `base: 2`: what a patch may add over base, with the rel-L2 floor 2^-8


def scope_rows(bad: Callable[[dict], bool]) -> list[dict]:
    """attn.out_rel_l2 at layer 1 over 12 prefill bins of 64 positions — chunk 0 is bins 0-7, chunk 1 bins 8-11;
    turn 0 bins 0-3, turn 1 bins 4-9, turn 2 bins 10-11 and the 8 decode steps — for yardstick, base and a patch
    that adds 2× its allowance in the bins where `bad(row)`: a loss that the layer's mean dilutes."""
    rows = []
    for b in range(12):
        where = {"pos_bin": 64 * b, "chunk": b // 8, "turn": 0 if b < 4 else 1 if b < 10 else 2}
        rows += [row("yardstick", 1, "attn.out_rel_l2", Y, **where), row("base", 1, "attn.out_rel_l2", B, **where)]
        rows.append(row("patched", 1, "attn.out_rel_l2", B, **where))
    for step in range(8):
        where = {"phase": "decode", "pos_bin": 768 + step, "count": 1, "step": step, "turn": 2}
        rows += [row(v, 1, "attn.out_rel_l2", x, **where) for v, x in (("yardstick", Y), ("base", B), ("patched", B))]
    for r in rows:
        if r["variant"] == "patched" and bad(r):
            r["value"] = r["max"] = B + 2 * PATCH_ALLOWANCE
    return rows


@pytest.mark.parametrize("scope, bad, where", [
    ("chunk", lambda r: r["phase"] == "prefill" and r["chunk"] == 1, "layer 1 prefill chunk 1"),
    ("turn", lambda r: r["phase"] == "prefill" and r["turn"] == 2, "layer 1 prefill turn 2"),
    ("step", lambda r: r["step"] == 2, "layer 1 decode step 2"),
    ("bin", lambda r: r["pos_bin"] < 64, "layer 1 prefill positions 0-63"),  # before the indexer has k rows
])
def test_a_loss_confined_to_one_group_fails_its_scope_while_the_layer_mean_passes(tmp_path, scope, bad, where):
    """The patch adds 2× its allowance in a third of the prefill bins or fewer (one decode step of eight): the
    layer's mean adds at most 2/3 of the allowance and passes; the group's mean adds twice it and fails."""
    policy = write(tmp_path / "p.yaml", "checks:\n  - name: layer\n    metric: attn.out_rel_l2\n    aggregate: mean\n"
                                        "    bound: {base: 2}\n  - name: group\n    metric: attn.out_rel_l2\n"
                                        f"    aggregate: mean\n    scope: {scope}\n    bound: {{base: 2}}\n")
    result = gate_run(make_run(tmp_path / "run", scope_rows(bad)), policy)
    layer, group = result.checks
    assert layer.status == "pass"
    (patched,) = group.variants
    first = patched.first_failure()
    assert patched.status == "fail" and len(patched.failing()) == 1
    assert first.where() == f"{where} (global, attn.out)"
    assert first.value == pytest.approx(B + 2 * PATCH_ALLOWANCE) and first.limit == pytest.approx(B + PATCH_ALLOWANCE)
    assert (first.yardstick, first.base) == (pytest.approx(Y), pytest.approx(B))  # taken over the same group
    assert f"group [patched]: attn.out_rel_l2 first fails at {where} (global, attn.out)" in result.failure_lines()[0]
    gate = json.loads((tmp_path / "run" / "gate.json").read_text())
    written = next(c for c in gate["checks"] if c["name"] == "group")
    assert written["scope"] == scope and written["variants"][0]["first_failure"]["group"] == first.group


def test_scoped_units_carry_their_group_to_junit_markdown_and_the_baseline(tmp_path, capsys):
    policy = write(tmp_path / "p.yaml", "checks:\n  - name: by-chunk\n    metric: attn.out_rel_l2\n    scope: chunk\n"
                                        "    aggregate: mean\n    bound: {base: 2}\n    baseline: {slack: 0}\n")
    run = make_run(tmp_path / "run", scope_rows(lambda r: r["chunk"] == 1))
    junit, summary, baseline = tmp_path / "j.xml", tmp_path / "s.md", tmp_path / "b.json"
    assert main(["gate", str(run), "--policy", str(policy), "--junit", str(junit), "--summary", str(summary)]) == 1
    failure = next(c.find("failure") for c in ET.parse(junit).getroot().iter("testcase")
                   if c.get("classname") == "dsv4-drift.by-chunk")
    assert "first fails at layer 1 prefill chunk 1 (global, attn.out)" in failure.get("message")
    assert "| by-chunk | `attn.out_rel_l2` | patched | prefill | ❌ FAIL | 1 chunk 1 |" in summary.read_text()
    assert main(["gate", str(run), "--policy", str(policy), "--update-baseline", str(baseline)]) == 1
    entries = json.loads(baseline.read_text())["values"]
    assert {"check": "by-chunk", "variant": "patched", "mode": "global", "tap": "attn.out", "layer": 1,
            "phase": "prefill", "scope": "chunk", "group": 1, "value": B + 2 * PATCH_ALLOWANCE} in entries
    decode = next(e for e in entries if e["phase"] == "decode")  # chunk scope: the decode rows are one group
    assert (decode["scope"], decode["group"]) == ("chunk", None)
    # an older baseline has no scope or group keys: its entries are layer-scope units
    old = {"format": "dsv4-drift-baseline/1", "values": [{"check": "layer", "variant": "patched", "mode": "global",
                                                         "tap": "attn.out", "layer": 1, "phase": "prefill",
                                                         "value": 0.05}]}
    write(baseline, json.dumps(old))
    write(policy, "checks:\n  - name: layer\n    metric: attn.out_rel_l2\n    baseline: {slack: 0}\n")
    patched = next(v for v in gate_run(run, policy, baseline).checks[0].variants if v.variant == "patched")
    (unit,) = [u for u in patched.units if u.phase == "prefill"]
    assert unit.baseline == 0.05 and not unit.passed  # the patched layer's worst position is 0.148 > 0.05 + 2^-8


def test_gate_json_keeps_a_groups_failing_units_and_each_layers_worst(tmp_path):
    """Bin scope makes a unit per bin; gate.json keeps the failing ones and, per layer, phase, mode and tap, the
    group nearest its limit (the report's cell), and says how many there were."""
    policy = write(tmp_path / "p.yaml", "checks:\n  - name: by-bin\n    metric: attn.out_rel_l2\n    scope: bin\n"
                                        "    aggregate: mean\n    bound: {base: 2}\n")
    run = make_run(tmp_path / "run", scope_rows(lambda r: r["pos_bin"] in (0, 64)))
    gate_run(run, policy)
    (variant,) = json.loads((run / "gate.json").read_text())["checks"][0]["variants"]
    assert variant["units_total"] == 12 + 8
    kept = {(u["phase"], u["group"], u["status"]) for u in variant["units"]}
    # decode: all 8 steps pass at the same excess; the first (lowest position) is the one kept
    assert kept == {("prefill", 0, "fail"), ("prefill", 64, "fail"), ("decode", 768, "pass")}
    assert variant["units"][0]["span"] == [0, 64] and variant["units"][0]["positions"] == 64


def test_local_mode_checks_name_the_first_layer_a_patch_breaks_by_itself(tmp_path):
    """The patch breaks layer 2 by itself (local error beyond base + 2× yardstick); its global error stays past the
    bound at layer 3, carried. The local check names layer 2 and only it; the global one cannot tell them apart."""
    local = {"yardstick": [0.01] * 4, "base": [0.1] * 4, "patched": [0.1, 0.11, 0.3, 0.11]}
    accumulated = {"yardstick": [0.01, 0.02, 0.03, 0.04], "base": [0.1, 0.15, 0.2, 0.25],
                   "patched": [0.1, 0.16, 0.4, 0.45]}
    rows = rows_for("streams.rel_l2", local, mode="local") + rows_for("streams.rel_l2", accumulated)
    result = gate_run(make_run(tmp_path / "run", rows), "default")
    checks = {c.check.name: c for c in result.checks}
    (own,) = checks["streams-rel-l2-local"].variants
    assert own.status == "fail" and {u.layer for u in own.failing()} == {2}
    assert own.first_failure().where() == "layer 2 prefill (local, layer.out)"
    (carried,) = checks["streams-rel-l2-patch"].variants
    assert {u.layer for u in carried.failing()} == {2, 3}


def flips(counts: dict[str, int], positions: int = 640, k: int = CONFIG["num_experts_per_tok"]) -> list[dict]:
    """moe.flip_rate at learned layer 1: one prefill bin of `positions` tokens per variant, `counts` experts lost
    of its positions × k."""
    return [row(v, 1, "moe.flip_rate", c / (positions * k), count=positions) for v, c in counts.items()]


@pytest.mark.parametrize("counts, passed", [
    ({"yardstick": 0, "base": 0, "patched": 1}, True),  # one flip: a tie broken the other way
    # yardstick 16 and base 100 of N = 2560 allow A = 100 + 2·16 = 132. On the square-root scale the counts' noise
    # is s = √(¼ + (100.375 + 2²·16.375)/(4·(100.375 + 2·16.375))) = 0.749: √(V + 3/8) may exceed √133.125 by 4s,
    # so two of them, V = 169, are noise; V = 210.9 is the last count allowed, 211.9 with the floor's one decision
    ({"yardstick": 16, "base": 100, "patched": 169}, True),
    ({"yardstick": 16, "base": 100, "patched": 211}, True),
    ({"yardstick": 16, "base": 100, "patched": 212}, False),
])
def test_discrete_metrics_are_bounded_as_a_count_with_poisson_noise(tmp_path, counts, passed):
    policy = write(tmp_path / "p.yaml", "checks:\n  - name: flips\n    metric: moe.flip_rate\n    layers: learned\n"
                                        "    bound: {base: 2}\n")
    (variant,) = gate_run(make_run(tmp_path / "run", flips(counts)), policy).checks[0].variants
    (unit,) = variant.units
    assert unit.decisions == 640 * 4 and unit.floor == pytest.approx(1 / 2560)
    assert unit.passed is passed, (unit.value * 2560, unit.limit * 2560)


def test_a_router_swapping_the_kth_expert_for_30_percent_of_tokens_fails_the_default_policy(tmp_path):
    """The issue's example: the k-th expert swapped for the (k+1)-th at 30% of tokens is a flip rate of 0.3/k —
    under the old floor 1/k (one expert of every token) it passed. Now the floor is one expert of the layer's
    positions × k, and 0.3·640 = 192 flips of 2560 are beyond both the stock engine's allowance (16× a yardstick
    count of 0, itself a Poisson draw: 115 flips) and the patch's (19)."""
    rows = flips({"yardstick": 0, "base": 0, "patched": 192})
    result = gate_run(make_run(tmp_path / "run", rows), "default")
    statuses = {c.check.name: c.variants for c in result.checks if c.check.name.startswith("moe-flip-rate")}
    assert [v.status for v in statuses["moe-flip-rate"]] == ["pass", "fail"]  # base, patched
    (patch,) = statuses["moe-flip-rate-patch"]
    assert patch.status == "fail" and patch.units[0].value == pytest.approx(0.3 / 4)
    assert patch.units[0].limit == pytest.approx(counted_limit([(1, 0), (2, 0)], 2560))  # 19.3 flips of 2560


@pytest.mark.parametrize("metric, tap, twin_value, site_value, passed", [
    # mHC mixes: fp32 re-association moves them ~u_fp32 = 6e-8; another re-association is the same size (passes),
    # a bf16 pre-linear moves them ~u_bf16·(a few) = 3e-4 (fails): limit 2·twin + 2^-22
    ("mhc.site_rel_err", "attn.hc.site", 6e-8, 1.2e-7, True),
    ("mhc.site_rel_err", "attn.hc.site", 6e-8, 3e-4, False),
    # a twin whose split coincides with the BLAS's blocking shows 0; a re-association still moves the mixes by
    # ~1.07·2^-24 (the selftest's decoy on an AMD EPYC machine): the floor passes it, and still fails bf16
    ("mhc.site_rel_err", "attn.hc.site", 0.0, 1.07 * 2**-24, True),
    ("mhc.site_rel_err", "attn.hc.site", 0.0, 2**-8, False),
    # router: the twin flips nothing of 640 × 4; 2× its count's noise and the floor allow 19.4 experts, not 20
    ("moe.site_flip_rate", "moe.router.site", 0, 19 / 2560, True),
    ("moe.site_flip_rate", "moe.router.site", 0, 20 / 2560, False),
])
def test_twin_bounds_pass_a_reassociation_and_fail_a_precision_loss(tmp_path, metric, tap, twin_value, site_value,
                                                                    passed):
    twin = METRICS[metric].twin
    rows = []
    for variant, site in (("base", 0.0), ("patched", site_value)):  # base is the stock op: its site change is 0
        rows += [row(variant, 1, metric, site, tap=tap, count=640), row(variant, 1, twin, twin_value, tap=tap,
                                                                       count=640)]
    result = gate_run(make_run(tmp_path / "run", rows), "default")
    (check,) = [c for c in result.checks if c.check.metric == metric]
    by_variant = {v.variant: v for v in check.variants}
    assert by_variant["base"].status == "pass"
    assert (by_variant["patched"].status == "pass") is passed
    if metric == "mhc.site_rel_err":
        assert by_variant["patched"].units[0].limit == pytest.approx(2 * twin_value + 2.0**-22)
    assert "×twin" in check.check.bound_text()


def test_a_lost_needle_answer_fails_at_the_first_layer_that_lost_it(tmp_path):
    """ctx.needle_lost is 1 at a needle query where the reference answers beyond FP8 noise and the variant does not
    (harness.run.needles). The patch stops answering the first query from layer 2 on: it fails there (absolute 0,
    max), at that query. Base does not answer the second query, which the reference does not answer either:
    nothing is lost."""
    rows = []
    for variant in ("yardstick", "base", "patched"):
        for layer, tap in [(layer, "needle.lens") for layer in range(4)] + [(4, "logits")]:
            for step in range(2):  # two needle queries; the second one the reference does not answer
                lost = float(variant == "patched" and layer >= 2 and step == 0)
                answer = float(not lost and not (variant == "base" and step == 1))
                for mode in ("global", "local") if tap == "needle.lens" else ("global",):
                    where = {"tap": tap, "phase": "decode", "mode": mode, "count": 1, "pos_bin": 600 + step,
                             "step": step}
                    rows += [row(variant, layer, "ctx.needle_lost", lost if mode == "global" else 0.0, **where),
                             row(variant, layer, "ctx.needle_answer", answer if mode == "global" else 1.0, **where),
                             row(variant, layer, "ctx.needle_answer_ref", float(step == 0), **where)]
    result = gate_run(make_run(tmp_path / "run", rows), "default")
    (check,) = [c for c in result.checks if c.check.name == "needle-lost"]
    by_variant = {v.variant: v for v in check.variants}
    assert by_variant["base"].status == "pass"
    patched = by_variant["patched"]
    # aggregate max: the failure names the query that lost it (step 0, position 600), not only the layer
    assert patched.first_failure().where() == "layer 2 decode, worst at position 600 (global, needle.lens)"
    assert sorted((u.layer, u.tap) for u in patched.failing()) == [(2, "needle.lens"), (3, "needle.lens"),
                                                                   (4, "logits")]


@pytest.mark.parametrize("text, line, field, words", [
    ("checks:\n  - name: a\n    metric: streams.rel_l2\n    bound: {twin: 2}\n", 4, "checks[0].bound.twin",
     "streams.rel_l2 has no benign twin (twin bounds apply to the fp32 decision sites: moe.site_flip_rate"),
    ("checks:\n  - name: a\n    metric: attn.out_rel_l2\n    phases: prefill\n    scope: step\n    bound: {base: 2}\n",
     5, "checks[0].scope", "scope step groups decode steps"),
    ("checks:\n  - name: a\n    metric: attn.out_rel_l2\n    scope: chunks\n    bound: {absolute: 1}\n", 4,
     "checks[0].scope", "expected one of layer, chunk, turn, step, bin; got 'chunks'"),
    ("checks:\n  - name: a\n    metric: indexer.recall\n    aggregate: max\n    bound: {yardstick: 16}\n", 4,
     "checks[0].aggregate", "indexer.recall is discrete: a relative bound counts the decisions a unit lost"),
    ("defaults:\n  aggregate: p99\nchecks:\n  - name: a\n    metric: moe.flip_rate\n    bound: {base: 2}\n", 2,
     "defaults.aggregate", "needs aggregate: mean (got 'p99')"),
    ("checks:\n  - name: a\n    metric: moe.twin_flip_rate\n    bound: {absolute: 0}\n", 3, "checks[0].metric",
     "moe.twin_flip_rate is a measurement, not a drift"),
])
def test_scope_twin_and_count_rules_are_checked_when_the_policy_loads(tmp_path, capsys, text, line, field, words):
    run = make_run(tmp_path / "run", rows_for("streams.rel_l2", good_streams()))
    bad = write(tmp_path / "bad.yaml", text)
    assert main(["gate", str(run), "--policy", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"{bad}:{line}: {field}: " in err and words in err, err


@pytest.mark.parametrize("coefficients, means", [
    ((16,), (3,)), ((16,), (10,)), ((16,), (100,)),  # yardstick: 16 — the worst case is a yardstick mean near 10
    ((1, 2), (10, 3)), ((1, 2), (100, 10)), ((1, 2), (1000, 100)),  # base: 2 (base, yardstick)
    ((2,), (0.3,)), ((2,), (10,)),  # twin: 2
])
def test_the_count_noise_allowance_fails_a_variant_at_its_allowed_rate_rarely(coefficients, means):
    """At the edge of H0 — the variant's true count mean exactly Σ c·μ of the references' means — draw every count
    (Poisson) 10⁶ times. The nominal false-failure rate of z = 4 is the one-sided Gaussian tail 3.2·10⁻⁵; the
    square-root comparison (allowed_count) stays within 10× of it (measured worst 1.7·10⁻⁴, at a yardstick mean of
    10). Allowing only the variant's own noise, A + 4·√(A + 1), fails such a variant 1-20% of the time."""
    rng = np.random.default_rng(0)
    draws = 10**6
    references = [(c, rng.poisson(mu, draws).astype(float)) for c, mu in zip(coefficients, means)]
    variant = rng.poisson(sum(c * mu for c, mu in zip(coefficients, means)), draws)
    false_failures = float(np.mean(variant > allowed_count(references, 4.0) + 1))  # + 1: the floor's decision
    assert false_failures < 3.2e-4, false_failures


def decode_steps(per_variant: dict[str, list[float]], mode: str = "global", layer: int = 1) -> list[dict]:
    """attn.lse_delta rows of one layer's decode phase, one row per step (count 1), per variant."""
    return [row(v, layer, "attn.lse_delta", x, phase="decode", mode=mode, count=1, pos_bin=1000 + s, step=s)
            for v, xs in per_variant.items() for s, x in enumerate(xs)]


def batch_se(x: np.ndarray, w: np.ndarray) -> float:
    """The standard error of the w-weighted mean of x by batch means, written out (harness.gate.evaluate._batch_se)."""
    mean = (w * x).sum() / w.sum()
    return math.sqrt(len(x) / (len(x) - 1) * (w * w * (x - mean) ** 2).sum() / w.sum() ** 2)


def lse_unit(tmp_path: Path, rows: list[dict], name: str, check: str = "attn-lse-delta-patch", baseline=None,
             variant: str = "patched"):
    result = gate_run(make_run(tmp_path / name, rows), "default", baseline=baseline)
    (part,) = [v for v in next(c for c in result.checks if c.check.name == check).variants if v.variant == variant]
    return result, part.units[0]


def test_a_global_unit_allows_the_noise_of_a_draw_estimated_from_paired_rows(tmp_path):
    """Global mode re-draws the carried noise (policy rule 5): a variant whose steps scatter around base's as a second
    draw may pass base + 2×yardstick by z = 4 standard errors — the smaller of the paired differences' and √2 × base's
    own; the same rows in local mode, where the triangle inequality holds position by position, may not; a shift at
    every step fails in global mode too."""
    rng = np.random.default_rng(0)
    steps = 32
    base = rng.exponential(0.45, steps)  # |ΔLSE| per step: heavy-tailed, as chaotic decode steps are
    drawn = rng.exponential(0.45, steps) + 0.2  # another draw, 0.2 higher on average: past 2×yardstick = 0.02
    values = {"yardstick": [0.01] * steps, "base": base.tolist(), "patched": drawn.tolist()}
    ones = np.ones(steps)
    se = min(batch_se(drawn - base, ones), math.sqrt(2) * batch_se(base, ones))
    plain = base.mean() + 2 * 0.01 + 2**-8  # the bound without the draw noise (floor: attn.lse_delta's 2^-8)
    assert plain < drawn.mean() < plain + 4 * se  # the case this test is about

    _, drawn_unit = lse_unit(tmp_path, decode_steps(values), "global")
    assert drawn_unit.passed and drawn_unit.draw_allowance == pytest.approx(4 * se)
    assert drawn_unit.limit == pytest.approx(plain + 4 * se)
    _, local_unit = lse_unit(tmp_path, decode_steps(values, mode="local"), "local", "attn-lse-delta-local")
    assert not local_unit.passed and local_unit.draw_allowance is None
    assert local_unit.limit == pytest.approx(plain)
    shifted = {**values, "patched": (base + 0.2 + rng.normal(0, 0.005, steps)).tolist()}
    result, shifted_unit = lse_unit(tmp_path, decode_steps(shifted), "shifted")
    assert not shifted_unit.passed and shifted_unit.draw_allowance < 0.01
    assert any("+ draw noise (z = 4)" in line for line in result.failure_lines())


def test_a_bug_confined_to_one_step_cannot_widen_its_own_draw_allowance(tmp_path):
    """One decode step of 32 wrong by 20 nats: the paired differences' standard error alone would grow with it (an
    allowance of 4× the excess, whatever its size); √2 × base's own caps it, and the unit fails."""
    rng = np.random.default_rng(2)
    base = rng.exponential(0.45, 32)
    bad = base.copy()
    bad[7] += 20.0
    _, unit = lse_unit(tmp_path, decode_steps({"yardstick": [0.01] * 32, "base": base.tolist(),
                                               "patched": bad.tolist()}), "one-step")
    assert 4 * batch_se(bad - base, np.ones(32)) > 20 / 32  # what the paired estimate alone would have allowed
    assert unit.draw_allowance == pytest.approx(4 * math.sqrt(2) * batch_se(base, np.ones(32)))
    assert not unit.passed


@pytest.mark.parametrize("case", ["few rows", "base lacks a row", "a NaN"])
def test_no_draw_allowance_without_an_estimate(tmp_path, case):
    """No allowance (the plain bound) for a unit of fewer than 16 rows (DRAW_MIN_ROWS: a t tail at 4 of 0.08 at two
    rows), for a unit with a row base lacks (the estimate would cover other rows than the value), and for a unit
    with a non-finite loss (it fails anyway)."""
    rng = np.random.default_rng(3)
    steps = 15 if case == "few rows" else 32
    base, patched = rng.exponential(0.45, steps), rng.exponential(0.45, steps)
    rows = decode_steps({"yardstick": [0.01] * steps, "base": base.tolist(), "patched": patched.tolist()})
    if case == "base lacks a row":
        rows = [r for r in rows if not (r["variant"] == "base" and r["step"] == 3)]
    if case == "a NaN":
        next(r for r in rows if r["variant"] == "patched" and r["step"] == 3)["value"] = math.nan
    _, unit = lse_unit(tmp_path, rows, case.replace(" ", "-"))
    assert unit.draw_allowance is None


def test_draw_noise_matches_the_batch_means_formula_per_unit(tmp_path):
    """Two variants, two layers, prefill bins of unequal counts: each unit's estimate is the smaller of the paired
    and √2 × base's batch-means standard errors of its own rows (the groupby and its re-indexing keep units apart)."""
    rng = np.random.default_rng(4)
    counts = rng.integers(16, 200, 18)
    rows, expected = [], {}
    values = {"yardstick": {}, "base": {}, "patched": {}, "other": {}}
    for layer in (1, 2):
        for v in values:
            values[v][layer] = rng.exponential(0.1 * layer, 18) + (0.05 if v == "other" else 0.0)
            rows += [row(v, layer, "moe.out_rel_l2", float(x), count=int(c), pos_bin=int(counts[:i].sum()))
                     for i, (x, c) in enumerate(zip(values[v][layer], counts))]
        for v in ("patched", "other"):
            w = counts.astype(float)
            expected[(v, layer)] = min(batch_se(values[v][layer] - values["base"][layer], w),
                                       math.sqrt(2) * batch_se(values["base"][layer], w))
    result = gate_run(make_run(tmp_path / "run", rows, variants=("base", "patched", "other")), "default")
    check = next(c for c in result.checks if c.check.name == "moe-out-rel-l2-patch")
    got = {(v.variant, u.layer): u.draw_allowance / 4 for v in check.variants for u in v.units}
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-9), key


def test_a_global_units_baseline_allows_the_same_draw_noise(tmp_path):
    """A baseline run's global value is another draw too (policy rule 5): `baseline: {slack: 0}` allows the unit's
    draw noise above it — for the base-relative check and its yardstick-relative sibling alike — so a re-drawn benign
    variant passes its baseline, and a shift at every step beyond it fails."""
    rng = np.random.default_rng(1)
    steps = 32
    base = rng.exponential(0.45, steps)
    old = {"yardstick": [0.05] * steps, "base": base.tolist(),  # 16×yardstick + floor: 0.80, above the draws
           "patched": np.abs(base + rng.normal(0, 0.3, steps)).tolist()}  # |ΔLSE| per step: another draw
    redrawn = {**old, "patched": (rng.permutation(old["patched"]) + 0.08).tolist()}  # higher by 0.08, re-drawn
    old_run = make_run(tmp_path / "old", decode_steps(old))
    old_value = np.mean(old["patched"])
    for check in ("attn-lse-delta-patch", "attn-lse-delta"):
        _, again = lse_unit(tmp_path, decode_steps(redrawn), f"redrawn-{check}", check, baseline=old_run)
        assert again.baseline == pytest.approx(old_value) and again.baseline_allowance > 0
        assert again.baseline_limit == pytest.approx(old_value + 2**-8 + again.baseline_allowance)
        assert again.value > old_value + 2**-8 and again.passed  # past the old rule's one rounding, within the draw
    worse = {**old, "patched": (np.array(old["patched"]) + 0.5).tolist()}
    result, shifted = lse_unit(tmp_path, decode_steps(worse), "worse", "attn-lse-delta", baseline=old_run)
    assert not shifted.passed and shifted.value > shifted.baseline_limit
    assert any(re.search(r"baseline [\d.]+×\(1\+0\) \+ draw noise \(z = 4\)", line)
               for line in result.failure_lines())
