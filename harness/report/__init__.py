"""Showing a run: one self-contained HTML page (no network; data, script and styles embedded), and the same key
views as PNG and SVG figures.

    from harness.report.write import write_report
    write_report(run_dir)            # run_dir/report.html
    from harness.report.figures import write_figures      # needs matplotlib (the [figures] extra)
    write_figures(run_dir, run_dir / "figures")

Modules: `data` (the page's data from the run store, gate.json and attribution.json), `html` (the page),
`write` (both, atomically), `assets/` (script and styles), `figures` (the key views drawn with matplotlib from
the page's data), `synthetic` (a made-up run directory shaped like a real one, for sizing and testing the report).
"""
