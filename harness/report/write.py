"""`write_report(run_dir)`: the run directory as one self-contained HTML file (DESIGN §1, the kernel engineer's view).

The page shows the verdict (gate.json, attribution.json, NaN/Inf findings when present), the run's
metadata, a per-layer table, drift-vs-layer charts, a layer × position heatmap, indexer recall by
position, the context-loss lens, mHC accumulation, the attribution matrix and the first layer where
each metric crosses its bound. Data: harness.report.data; page: harness.report.html + report_assets/.
"""

from __future__ import annotations

import os
from pathlib import Path

from harness.report.data import build_payload
from harness.report.html import finite_json, render_page

REPORT_NAME = "report.html"


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write the HTML report of `run_dir` to `out` (default RUN_DIR/report.html) atomically; returns its path."""
    payload = build_payload(run_dir)
    for key in ("manifest", "gate", "attribution", "findings"):
        payload[key] = finite_json(payload[key])
    page = render_page(payload)
    path = Path(out) if out is not None else Path(run_dir) / REPORT_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, path)
    return path
