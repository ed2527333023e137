"""`dsv4-drift selftest`: proof the harness has teeth (DESIGN §6).

Injects faults of known classes through the plugin API (harness.attribution.faults) into a small scenario and
checks, for each: the gate fails, attribution names the injected patch and its phase — with a benign
change (same precision, different summation order) riding along as a decoy that must pass.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from rich.table import Table

from harness.cli.commands.attribute import attribute
from harness.cli.paths import writable_dir
from harness.cli.threads import add_threads_argument, torch_threads
from harness.attribution.faults import FAULTS, benign_change
from harness.attribution.plan import BASE, only
from harness.cli.console import console

SELFTEST_SCENARIO = "selftest"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("selftest", help="inject known faults; check the gate fails and attribution names them",
                       description="Injects each fault class through the plugin API, runs `attribute` on it beside a "
                                   "benign change and checks that the gate fails and the verdict names the fault and "
                                   "its phase. Exit codes: 0 every fault caught, 1 one was missed, 2 usage error, 3 a "
                                   "patch's op raised, 4 internal error.")
    p.add_argument("--scenario", default=SELFTEST_SCENARIO, metavar="SCENARIO",
                   help=f"scenario to inject into (default {SELFTEST_SCENARIO})")
    p.add_argument("--only", action="append", default=[], metavar="FAULT_CLASS",
                   help=f"run only this fault class (repeatable): {', '.join(repr(f) for f in FAULTS)}")
    p.add_argument("--out", type=Path, metavar="DIR", help="keep the run directories here (default: a temporary "
                                                          "directory)")
    add_threads_argument(p)
    p.set_defaults(func=run)


def check_fault(name: str, scenario: str, out_dir: Path, threads: int | None = None, announce_threads: bool = False
                ) -> dict:
    """One fault: attribution over {benign, fault}; the verdict must name the fault and its phase, the benign
    patch must not diverge, and the gate must fail. The benign change comes first: patches apply in order, so where
    both override one op the fault (later) replaces the decoy in their combined variant, not the other way."""
    patch, phase = FAULTS[name]
    module = "harness.attribution.faults"
    result, run_dir = attribute(scenario, f"{benign_change.id},{patch.id}", (module,), None, None,
                                out_dir / patch.id, interactions="never", threads=threads,
                                announce_threads=announce_threads)
    verdict = result.verdict()
    benign_divergences = result.divergences.get(benign_change.id, [])
    problems = []
    if verdict.get("patch") != patch.id:
        problems.append(f"verdict names {verdict.get('patch')!r}, expected {patch.id!r}")
    elif verdict.get("phase") != phase:
        problems.append(f"verdict phase {verdict.get('phase')!r}, expected {phase!r}")
    if benign_divergences:
        d = benign_divergences[0]
        problems.append(f"benign change diverged: {d.metric} at layer {d.first_layer} {d.phase}")
    if not result.divergences.get(patch.id):
        problems.append("the gate did not fail for the fault")
    if not benign_changes_numbers(run_dir):
        problems.append("the benign change left every metric identical to base: it tests nothing")
    return {"fault": name, "patch": patch.id, "expected_phase": phase, "verdict": verdict["summary"],
            "ok": not problems, "problems": problems, "run_dir": str(run_dir)}


def benign_changes_numbers(run_dir: Path) -> bool:
    """Does the benign patch alone change any stream metric against the stock engine? A decoy that is
    bit-identical to base (e.g. an FP8 linear split into fp32 K-partials whose products and sums are exact)
    passes any gate and proves nothing."""
    import pandas as pd

    metrics = pd.read_parquet(Path(run_dir) / "metrics.parquet", columns=["variant", "mode", "layer", "phase",
                                                                          "pos_bin", "metric", "value"])
    streams = metrics[metrics["metric"] == "streams.rel_l2"].set_index(["mode", "layer", "phase", "pos_bin"])
    benign = streams[streams["variant"] == only(benign_change.id)]["value"]
    base = streams[streams["variant"] == BASE]["value"]
    return not benign.sort_index().equals(base.reindex(benign.index).sort_index())


def run(args: argparse.Namespace) -> int:
    out = console()
    names = args.only or list(FAULTS)
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        from harness.errors import UsageError

        raise UsageError(f"unknown fault class(es) {unknown}; known: {list(FAULTS)}")
    with tempfile.TemporaryDirectory(prefix="dsv4-selftest-") as tmp, torch_threads(args.threads):
        base = writable_dir(args.out, "--out") if args.out else Path(tmp)
        rows = []
        for i, name in enumerate(names):  # the first attribution says how many threads they all run with
            out.print(f"selftest: injecting {name} …")
            rows.append(check_fault(name, args.scenario, base, args.threads, announce_threads=i == 0))
    table = Table(title=f"selftest on {args.scenario}")
    for col in ("fault class", "patch", "expected phase", "verdict", "result"):
        table.add_column(col)
    for r in rows:
        table.add_row(r["fault"], r["patch"], r["expected_phase"], r["verdict"],
                      "[green]ok[/]" if r["ok"] else "[red]FAIL[/]: " + "; ".join(r["problems"]))
    out.print(table)
    failed = [r for r in rows if not r["ok"]]
    out.print("[green]selftest passed[/]" if not failed else f"[red]selftest failed: {len(failed)} fault class(es)[/]")
    return 0 if not failed else 1
