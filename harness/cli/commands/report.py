"""`dsv4-drift report`: the HTML report of a run directory (written by `run` too, unless --no-report), and with
--figures its key views as PNG and SVG files for PR comments, papers and slides."""

from __future__ import annotations

import argparse
from pathlib import Path

from harness.cli.paths import writable_file
from harness.errors import UsageError
from harness.run.store import RunStore

DEFAULT_FIGURES = "RUN_DIR/figures"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "report", help="write a run directory's self-contained HTML report (and, with --figures, PNG/SVG figures)",
        description="Reads RUN_DIR (manifest.json, metrics.parquet, findings.json, and gate.json / attribution.json "
                    "when present) and writes one HTML file that opens offline: verdict, run metadata, per-layer "
                    "table, drift-vs-layer charts, layer × position heatmap, indexer recall by position, the "
                    "context-loss lens, mHC accumulation, the attribution matrix, the first failing layers and NaN/Inf "
                    "findings. --figures also draws the key views with matplotlib, as PNG and SVG: drift vs layer "
                    "per metric family (variants, yardstick, gate bound), the layer × position heatmap, the "
                    "context-loss lens and the attribution matrix. Run `dsv4-drift gate` first for the bounds; "
                    "its markdown summary then lists the figures in RUN_DIR/figures.")
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a run directory written by `dsv4-drift run`")
    p.add_argument("--out", type=Path, metavar="FILE", help="where to write the page (default: RUN_DIR/report.html)")
    p.add_argument("--figures", nargs="?", const=DEFAULT_FIGURES, metavar="DIR",
                   help="also write the figures, <view>.png and <view>.svg, into DIR (default: RUN_DIR/figures); "
                        "needs matplotlib: pip install -e \".[figures]\"")
    p.add_argument("--figure-variants", metavar="LIST",
                   help="with --figures: draw only these variants (comma-separated; the yardstick is always drawn, "
                        "the heatmap shows the first)")
    p.add_argument("--heatmap-metric", metavar="METRIC",
                   help="with --figures: the heatmap's metric (default streams.rel_l2; any metric the page's heatmap "
                        "offers, e.g. indexer.recall, attn.tv)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from harness.report.write import write_report

    if not RunStore(args.run_dir).exists():
        raise UsageError(f"{args.run_dir} is not a run directory (no manifest.json)")
    if args.out is not None:
        writable_file(args.out, "--out")
    if args.figures is None and (args.figure_variants or args.heatmap_metric):
        raise UsageError("--figure-variants and --heatmap-metric apply only with --figures")
    if args.figures is not None:
        write_figure_files(args)
    path = write_report(args.run_dir, args.out)
    print(f"report: {path} ({path.stat().st_size / 1024:.0f} KiB)")
    return 0


def write_figure_files(args: argparse.Namespace) -> None:
    """The figures first: a bad --figure-variants or --heatmap-metric stops the command before it writes anything."""
    try:
        import matplotlib  # noqa: F401  (the optional extra)
    except ImportError:
        raise UsageError("--figures draws with matplotlib, an optional extra: pip install -e \".[figures]\"") from None
    from harness.gate.outputs import FIGURES_DIR
    from harness.report.figures import write_figures

    out = args.run_dir / FIGURES_DIR if args.figures == DEFAULT_FIGURES else Path(args.figures)
    variants = [v.strip() for v in args.figure_variants.split(",") if v.strip()] if args.figure_variants else None
    written, skipped = write_figures(args.run_dir, out, variants=variants, heatmap_metric=args.heatmap_metric)
    print(f"figures: {out}")
    for path in written:
        print(f"  {path}")
    for view, why in skipped.items():
        print(f"  {view}: skipped: {why}")
