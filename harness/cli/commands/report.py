"""`dsv4-drift report`: the HTML report of a run directory (written by `run` too, unless --no-report)."""

from __future__ import annotations

import argparse
from pathlib import Path

from harness.cli.paths import writable_file
from harness.errors import UsageError
from harness.run.store import RunStore


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report", help="write a run directory's self-contained HTML report",
        description="Reads RUN_DIR (manifest.json, metrics.parquet, findings.json, and gate.json / attribution.json "
                    "when present) and writes one HTML file that opens offline: verdict, run metadata, per-layer "
                    "table, drift-vs-layer charts, layer × position heatmap, indexer recall by position, the "
                    "context-loss lens, mHC accumulation, the attribution matrix, first crossings and NaN/Inf "
                    "findings.")
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run directory written by `dsv4-drift run`")
    p.add_argument("--out", type=Path, metavar="FILE", help="where to write the page (default: RUN_DIR/report.html)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from harness.report.write import write_report

    if not RunStore(args.run_dir).exists():
        raise UsageError(f"{args.run_dir} is not a run directory (no manifest.json)")
    if args.out is not None:
        writable_file(args.out, "--out")
    path = write_report(args.run_dir, args.out)
    print(f"report: {path} ({path.stat().st_size / 1024:.0f} KiB)")
    return 0
