"""Showing a run: one self-contained HTML page (no network; data, script and styles embedded).

    from harness.report.write import write_report
    write_report(run_dir)            # run_dir/report.html

Modules: `data` (the page's data from the run store, gate.json and attribution.json), `html` (the page),
`write` (both, atomically), `assets/` (script and styles), `synthetic` (a made-up run directory shaped like a
real one, for sizing and testing the report).
"""
