"""The pytest plugin (harness.cli.pytest_plugin): a team's own test suite gating drift with the `dsv4_drift` fixture.

The inner test sessions load the plugin with `-p harness.cli.pytest_plugin` and entry-point autoloading off, so
these tests behave the same whether or not the package's pytest11 entry point is installed.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from harness.cli.pytest_plugin import DriftHarness
from test_gate import STREAM_POLICY, good_streams, make_run, rows_for, write

pytest_plugins = ["pytester"]


@pytest.fixture
def runs(tmp_path: Path) -> dict[str, Path]:
    """A passing and a failing synthetic run directory, and the policy that judges them."""
    bad = good_streams()
    bad["patched"][1] = 0.5  # fails both checks at layer 1
    return {
        "good": make_run(tmp_path / "good", rows_for("streams.rel_l2", good_streams())),
        "bad": make_run(tmp_path / "bad", rows_for("streams.rel_l2", bad, phases=("decode",))),
        "policy": write(tmp_path / "policy.yaml", STREAM_POLICY),
    }


def run_inner(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, *args: str) -> pytest.RunResult:
    monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
    return pytester.runpytest_inprocess("-p", "harness.cli.pytest_plugin", "-p", "no:cacheprovider",
                                        "-W", "ignore::pytest.PytestAssertRewriteWarning", *args)


def test_fixture_assert_gate_passes_and_fails_with_the_failing_checks_listed(pytester, monkeypatch, runs):
    pytester.makepyfile(f"""
        import pytest

        def test_good(dsv4_drift):
            result = dsv4_drift.assert_gate({str(runs['good'])!r}, policy={str(runs['policy'])!r})
            assert result.exit_code == 0

        def test_bad(dsv4_drift):
            dsv4_drift.assert_gate({str(runs['bad'])!r}, policy={str(runs['policy'])!r})

        def test_bad_result_without_asserting(dsv4_drift):
            result = dsv4_drift.gate({str(runs['bad'])!r}, policy={str(runs['policy'])!r})
            assert result.exit_code == 1 and len(result.failed_checks) == 2
    """)
    result = run_inner(pytester, monkeypatch)
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines([
        "*AssertionError: dsv4-drift gate failed for*: 2 failure(s)",
        "*- streams [[]patched]: streams.rel_l2 first fails at layer 1 decode (global, layer.out): "
        "0.5 > 0.1639 = 16×yardstick 0.01 + floor 0.003906; 1 failing unit(s)",
        "*- streams-patch [[]patched]: streams.rel_l2 first fails at layer 1 decode (global, layer.out)*",
    ])


def test_command_line_options_set_the_session_default_policy(pytester, monkeypatch, runs):
    pytester.makepyfile(f"""
        def test_bad(dsv4_drift):
            dsv4_drift.assert_gate({str(runs['bad'])!r})
    """)
    run_inner(pytester, monkeypatch, "--dsv4-drift-policy", str(runs["policy"])).assert_outcomes(failed=1)
    lenient = write(runs["policy"].parent / "lenient.yaml",
                    "checks:\n  - name: loose\n    metric: streams.rel_l2\n    bound: {absolute: 1}\n")
    run_inner(pytester, monkeypatch, "--dsv4-drift-policy", str(lenient)).assert_outcomes(passed=1)


def test_run_passes_the_scenario_and_overrides_to_dsv4_drift_run(tmp_path, monkeypatch, runs):
    """`run` goes through the `dsv4-drift run` command (replaced here by a stub that writes a synthetic run)."""
    import harness.cli.commands.run

    seen: list[argparse.Namespace] = []

    def fake_run(args: argparse.Namespace) -> int:
        seen.append(args)
        make_run(args.out, rows_for("streams.rel_l2", good_streams()))
        return 0

    monkeypatch.setattr(harness.cli.commands.run, "run", fake_run)
    drift = DriftHarness(policy=runs["policy"])
    run_dir = drift.run("tiny-smoke", out=tmp_path / "r", device="cpu", patches="all", patch_modules=["p.py"])
    assert run_dir == tmp_path / "r"
    (args,) = seen
    assert (args.scenario, args.out, args.device, args.patches, args.patch_module, args.no_report, args.no_gate) == \
        ("tiny-smoke", tmp_path / "r", "cpu", "all", ["p.py"], True, True)
    assert drift.assert_gate(run_dir).passed

    scenario = {"name": "inline", "model": {"preset": "tiny"}}
    inline_dir = drift.run(scenario)
    assert Path(seen[-1].scenario).read_text().startswith("name: inline\n")
    assert inline_dir.name == "run" and (inline_dir / "manifest.json").is_file()

    with pytest.raises(TypeError, match="unknown override"):
        drift.run("tiny-smoke", chunk_size=64)


def test_a_bad_policy_is_a_usage_error_not_a_drift_failure(runs):
    from harness.errors import UsageError

    bad = write(runs["policy"].parent / "bad.yaml", "checks:\n  - name: a\n    metric: nope\n")
    with pytest.raises(UsageError, match=r"bad.yaml:3: checks\[0\].metric: unknown metric 'nope'"):
        DriftHarness().assert_gate(runs["good"], policy=bad)


README = Path(__file__).resolve().parent.parent / "README.md"
MY_KERNEL = '''
from optimized.patching import Patch

my_kernel = Patch("my-kernel", phases=("decode",), description="a sparse-attention kernel that defers to the stock one")


@my_kernel.op("sparse_attention")
def attend(ctx, q, window_slots, comp_slots, sink):
    return ctx.base(q=q, window_slots=window_slots, comp_slots=comp_slots, sink=sink)
'''


@pytest.mark.slow
def test_the_readmes_pytest_example_passes_as_written(pytester, monkeypatch):
    """The README's first fixture example, verbatim, with a kernel plugin at the path it names: a patch that keeps
    the stock numbers passes the default gate on tiny-smoke (issue #13: the example could not pass)."""
    block = next(b for b in README.read_text().split("```python\n")[1:] if "def test_my_kernel_does_not_drift" in b)
    example = block.split("```")[0].split("\ndef test_against_the_recorded_baseline")[0]
    pytester.makepyfile(test_example=example)
    (pytester.path / "my_kernels").mkdir()
    (pytester.path / "my_kernels" / "dsv4_patch.py").write_text(MY_KERNEL)
    result = run_inner(pytester, monkeypatch)
    result.assert_outcomes(passed=1)
