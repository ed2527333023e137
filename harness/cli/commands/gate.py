"""`dsv4-drift gate`: block a regression in CI — a run directory judged against a policy (DESIGN §5).

    dsv4-drift gate reports/flash-27k-20250101-120000 --junit gate.xml --summary "$GITHUB_STEP_SUMMARY"
    dsv4-drift gate RUN --baseline baselines/flash-27k.json            # also: not worse than the baseline
    dsv4-drift gate RUN --update-baseline baselines/flash-27k.json     # ratchet: values only tighten
    dsv4-drift gate --schema > harness/gate/policies/policy.schema.json  # the policy JSON Schema, for editors

Exit codes: 0 pass, 1 regression (a failing check or any NaN/Inf finding), 2 usage or input error, including an
incomplete run (killed, interrupted, failed) unless --allow-incomplete. gate.json goes into the run directory and
its report.html, when there is one, is redrawn from it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness.errors import UsageError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "gate", help="judge a run against a drift policy: exit 0 pass, 1 regression, 2 bad input; JUnit/markdown/JSON",
        description="Evaluates every check of the policy per variant, mode, tap, layer and phase, and names the first "
                    "layer where each check fails. Bounds are absolute, relative to the yardstick (the bf16 noise "
                    "floor) or to the stock 'base' engine, each plus a rounding floor; any NaN/Inf finding fails. "
                    "Writes gate.json into the run directory and redraws its report.html from it. An incomplete run "
                    "(killed, interrupted or failed) never passes unless --allow-incomplete. Exit codes: 0 pass, 1 "
                    "regression, 2 usage or input error (an incomplete run included). Policy schema: `gate --schema` "
                    "(from harness/gate/policy.py); the default: harness/gate/policies/default.yaml.")
    p.add_argument("run_dir", type=Path, nargs="?", metavar="RUN_DIR", help="a run directory written by `dsv4-drift "
                                                                             "run`")
    p.add_argument("--policy", metavar="FILE",
                   help="policy YAML, or 'default' (default: the scenario's gate.policy, else the shipped default)")
    p.add_argument("--baseline", type=Path, metavar="RUN_DIR_OR_JSON",
                   help="also fail checks with `baseline: {slack: X}` when a loss exceeds baseline×(1+X) + floor")
    p.add_argument("--junit", type=Path, metavar="FILE", help="write JUnit XML (one testcase per check × variant)")
    p.add_argument("--summary", type=Path, metavar="FILE.md",
                   help="append a markdown summary (e.g. \"$GITHUB_STEP_SUMMARY\")")
    p.add_argument("--json", type=Path, metavar="FILE", help="write the full result as JSON (as gate.json)")
    p.add_argument("--update-baseline", type=Path, metavar="FILE",
                   help="write the observed losses as a baseline JSON; an existing file's values only tighten")
    p.add_argument("--allow-loosen", action="store_true",
                   help="with --update-baseline: accept values that grew (recorded in the file: who, when, what)")
    p.add_argument("--allow-incomplete", action="store_true",
                   help="judge an incomplete run on the layers it has (said in every output) instead of exit 2")
    p.add_argument("--no-report", action="store_true",
                   help="leave RUN_DIR/report.html as it is (by default it is redrawn with this verdict)")
    p.add_argument("--quiet", action="store_true", help="print only the verdict and the failures, not the table")
    p.add_argument("--schema", action="store_true",
                   help="print the policy JSON Schema (shipped as harness/gate/policies/policy.schema.json) and exit")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.text import Text

    from harness.gate.gate_run import gate_run
    from harness.gate.baseline import update_baseline
    from harness.gate.outputs import junit_xml, markdown, print_console, print_verdict, write_json

    if args.schema:
        from harness.gate.policy import Policy
        from harness.scenario.validation import schema_json

        sys.stdout.write(schema_json(Policy))
        return 0
    if args.run_dir is None:
        raise UsageError("RUN_DIR is required (or --schema, to print the policy JSON Schema)")
    if args.allow_loosen and not args.update_baseline:
        raise UsageError("--allow-loosen only applies with --update-baseline FILE")
    result = gate_run(args.run_dir, args.policy, args.baseline, allow_incomplete=args.allow_incomplete)
    console = Console(highlight=False)
    if not console.is_terminal:  # CI logs: do not wrap the table at 80 columns
        console = Console(highlight=False, width=160)
    if args.quiet:
        print_verdict(result, console)
    else:
        print_console(result, console)
    try:
        if args.json:
            write_json(result, args.json)
        if args.junit:
            args.junit.parent.mkdir(parents=True, exist_ok=True)
            args.junit.write_text(junit_xml(result))
        if args.summary:
            args.summary.parent.mkdir(parents=True, exist_ok=True)
            with args.summary.open("a") as f:
                f.write(markdown(result))
    except OSError as e:
        raise UsageError(f"cannot write an output file: {e}") from None
    if args.update_baseline:
        report = update_baseline(args.update_baseline, result, allow_loosen=args.allow_loosen)
        console.print(Text(report.summary(), style="yellow" if report.refused else ""), soft_wrap=True)
    if not args.no_report:
        console.print(Text(_refresh_report(result.gate_json)), soft_wrap=True)
    return result.exit_code


def _refresh_report(gate_json: Path | None) -> str:
    """Redraw RUN_DIR/report.html from the gate.json just written, so the page never shows an older verdict;
    the line to print says what happened."""
    from harness.report.write import REPORT_NAME, write_report

    if gate_json is None:
        return "report: not redrawn (gate.json could not be written into the run directory)"
    run_dir = gate_json.parent
    if not (run_dir / REPORT_NAME).is_file():
        return f"report: {run_dir} has no {REPORT_NAME} to redraw (`dsv4-drift report {run_dir}` writes one)"
    try:
        return f"report: {write_report(run_dir)} redrawn with this verdict"
    except OSError as e:
        return f"report: {run_dir / REPORT_NAME} not redrawn ({e.strerror or e})"
