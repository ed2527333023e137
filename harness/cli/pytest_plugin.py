"""pytest plugin: gate DeepSeek-V4 drift inside your own test suite.

Installed with the package (entry point `pytest11: dsv4_drift`), or enabled explicitly with
`-p harness.cli.pytest_plugin` / `pytest_plugins = ["harness.cli.pytest_plugin"]` in your conftest.py. It adds one
fixture, `dsv4_drift`:

    def test_my_kernel_does_not_drift(dsv4_drift):
        run_dir = dsv4_drift.run("tiny-smoke", patches="my-kernel", patch_modules=["my_kernels/dsv4_patch.py"])
        dsv4_drift.assert_gate(run_dir)                       # the scenario's policy (default: the shipped one)

    def test_against_the_recorded_baseline(dsv4_drift):
        run_dir = dsv4_drift.run("scenarios/my-27k.yaml", device="cuda")
        dsv4_drift.assert_gate(run_dir, policy="ci/drift-policy.yaml", baseline="ci/drift-baseline.json")

`run(scenario, out=None, *, device=None, patches=None, patch_modules=())` runs a scenario (a shipped name, a
YAML path, or a dict/YAML text written to a temporary file) exactly like `dsv4-drift run --no-report --no-gate`
(the test gates it with `assert_gate`) and
returns the run directory (by default a fresh directory under pytest's tmp_path_factory). `patches`
replaces the scenario's variants by `base` plus one variant with these patches (comma list, `all`,
`id:key=value` options), as `--patches` does.

`assert_gate(run_dir, policy=None, baseline=None)` evaluates the gate (writing gate.json into the run
directory) and raises AssertionError listing every failing check — first failing layer, tap, phase, value
and the limit with its terms — and every NaN/Inf finding; it returns the GateResult when the gate passes.
`gate(run_dir, policy=None, baseline=None)` returns the GateResult without asserting. A bad policy or run
directory raises harness.errors.UsageError (a broken test, not a drift failure).

Command-line options (for CI): `--dsv4-drift-policy FILE` and `--dsv4-drift-baseline FILE_OR_RUN_DIR` set
the defaults of `assert_gate`/`gate` for the whole session.

The module imports only pytest at load time (the harness, torch included, loads on first use), so having
the plugin installed costs other test suites nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("dsv4-drift", "DeepSeek-V4 drift gate (harness.cli.pytest_plugin)")
    group.addoption("--dsv4-drift-policy", metavar="FILE", default=None,
                    help="default gate policy for the dsv4_drift fixture's assert_gate (default: the scenario's)")
    group.addoption("--dsv4-drift-baseline", metavar="FILE_OR_RUN_DIR", default=None,
                    help="default baseline for the dsv4_drift fixture's assert_gate")


class DriftHarness:
    """What the `dsv4_drift` fixture gives a test: run a scenario, gate a run directory."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory | None = None, policy: str | Path | None = None,
                 baseline: str | Path | None = None) -> None:
        self._tmp = tmp_path_factory
        self.default_policy = policy
        self.default_baseline = baseline

    def _fresh_dir(self, stem: str) -> Path:
        if self._tmp is not None:
            return self._tmp.mktemp(stem)
        import tempfile

        return Path(tempfile.mkdtemp(prefix=f"{stem}-"))

    def run(self, scenario: str | Path | dict[str, Any], out: str | Path | None = None, *, device: str | None = None,
            patches: str | None = None, patch_modules: tuple[str, ...] | list[str] = (), **unknown: Any) -> Path:
        """Run a scenario like `dsv4-drift run SCENARIO --out OUT --no-report --no-gate`; returns the run directory."""
        if unknown:
            raise TypeError(f"dsv4_drift.run: unknown override(s) {sorted(unknown)}; known: device, patches, "
                            "patch_modules (other settings belong in the scenario)")
        from harness.cli.main import build_parser, run_command

        if isinstance(scenario, dict) or (isinstance(scenario, str) and "\n" in scenario):
            import yaml

            text = yaml.safe_dump(scenario, sort_keys=False) if isinstance(scenario, dict) else scenario
            path = self._fresh_dir("dsv4-drift-scenario") / "scenario.yaml"
            path.write_text(text)
            scenario = path
        out_dir = Path(out) if out is not None else self._fresh_dir("dsv4-drift") / "run"
        argv = ["run", str(scenario), "--out", str(out_dir), "--no-report", "--no-gate"]
        if device:
            argv += ["--device", device]
        if patches is not None:
            argv += ["--patches", patches]
        for module in patch_modules:
            argv += ["--patch-module", str(module)]
        args = build_parser().parse_args(argv)
        run_command(args)  # as `dsv4-drift run` runs: no TF32, inference mode
        return out_dir

    def gate(self, run_dir: str | Path, policy: str | Path | None = None, baseline: str | Path | None = None):
        """The gate's result (harness.gate.evaluate.GateResult) for a run directory; writes gate.json into it."""
        from harness.gate.gate_run import gate_run

        return gate_run(run_dir, policy if policy is not None else self.default_policy,
                        baseline if baseline is not None else self.default_baseline)

    def assert_gate(self, run_dir: str | Path, policy: str | Path | None = None, baseline: str | Path | None = None):
        """Raise AssertionError naming every failing check (first layer, tap, phase) and NaN/Inf finding."""
        result = self.gate(run_dir, policy, baseline)
        if not result.passed:
            lines = result.failure_lines()
            raise AssertionError(f"dsv4-drift gate failed for {result.run.dir} (policy {result.policy.file}): "
                                 f"{len(lines)} failure(s)\n" + "\n".join(f"  - {line}" for line in lines))
        return result


@pytest.fixture
def dsv4_drift(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> DriftHarness:
    """Run DeepSeek-V4 drift scenarios and gate them: `.run(scenario, …)`, `.assert_gate(run_dir, …)`."""
    return DriftHarness(tmp_path_factory, request.config.getoption("--dsv4-drift-policy", default=None),
                        request.config.getoption("--dsv4-drift-baseline", default=None))
