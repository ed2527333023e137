"""The gate in one call: a run directory and a policy in, a verdict out (DESIGN §5).

    from harness.gate.gate_run import gate_run
    result = gate_run("reports/flash-27k-…", policy="default", baseline="baselines/flash-27k.json")
    result.exit_code        # 0 pass, 1 regression
    result.failure_lines()  # what failed, where first, by how much

The pieces: harness.gate.policy (the policy file and the metrics it can name), harness.gate.evaluate (per-unit
evaluation), harness.gate.baseline (baselines and the ratchet), harness.gate.outputs (console, JSON,
JUnit, markdown). `dsv4-drift gate` (harness.cli.commands.gate) and the pytest plugin (harness.cli.pytest_plugin)
both call gate_run.
"""

from __future__ import annotations

from pathlib import Path

from harness.gate.baseline import load_baseline
from harness.gate.evaluate import GateResult, evaluate, load_run
from harness.gate.outputs import write_json
from harness.gate.policy import load_policy, resolve_policy

GATE_FILE = "gate.json"
"""Written into the run directory by every gate evaluation (the report's verdict banner reads it)."""


def gate_run(run_dir: str | Path, policy: str | Path | None = None, baseline: str | Path | None = None,
             write_gate_json: bool = True, allow_incomplete: bool = False) -> GateResult:
    """Evaluate `policy` (a file, "default", or None: the scenario's gate.policy) on a run directory. An
    incomplete run does not pass unless `allow_incomplete` (then judged on the layers it has, and said so).

    Raises harness.errors.UsageError for a bad policy, a missing run directory or an unreadable baseline."""
    run = load_run(run_dir)
    policy_obj = load_policy(resolve_policy(policy, run.manifest))
    baseline_obj = load_baseline(baseline, policy_obj) if baseline is not None else None
    result = evaluate(policy_obj, run, baseline_obj, allow_incomplete)
    if write_gate_json:
        try:
            result.gate_json = write_json(result, run.dir / GATE_FILE)
        except OSError as e:  # a read-only run directory must not hide the verdict
            result.notes.append(f"could not write {run.dir / GATE_FILE}: {e}")
    return result
