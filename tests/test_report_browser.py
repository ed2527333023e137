"""The HTML report in a real browser: headless Chromium runs the page's script, then we read the DOM it built
(--dump-dom) and a screenshot. Skipped, with the reason, where no Chromium is installed (.ci/run installs it)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import zlib
from pathlib import Path

import pytest

from harness.report.write import write_report
from harness.report.synthetic import write_synthetic_run

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
BROWSER = os.environ.get("CHROMIUM") or next((b for b in map(shutil.which, BROWSERS) if b), None)
pytestmark = pytest.mark.skipif(BROWSER is None, reason="headless Chromium not installed (apt-get install chromium)")

# if any of this were parsed as HTML it would mark the body, retitle the page or add an <img>
HOSTILE = ("<script>document.title='pwned';document.body.setAttribute('data-pwned','script')</script>"
           "<img src=x onerror=\"document.body.setAttribute('data-pwned','img')\"></script>")


def chromium(page: Path, profile: Path, *args: str, window: str = "1400,2200") -> subprocess.CompletedProcess:
    cmd = [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--disable-extensions", "--no-first-run",
           "--mute-audio", f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
           "--virtual-time-budget=15000", f"--window-size={window}", *args, page.as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180)


def console_lines(stderr: str) -> list[str]:
    """Everything the page said on the console (the report logs nothing when all is well), incl. CSP refusals."""
    return [line for line in stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]


def dump_dom(page: Path, tmp: Path) -> str:
    result = chromium(page, tmp / "profile-dom", "--dump-dom")
    assert result.returncode == 0, result.stderr[-2000:]
    assert not console_lines(result.stderr), f"console output: {console_lines(result.stderr)}"
    return result.stdout


@pytest.fixture(scope="module")
def hostile_report(tmp_path_factory) -> Path:
    """43 layers, gate.json (failing), attribution.json, a NaN finding, and hostile text in every user field."""
    root = tmp_path_factory.mktemp("browser")
    run = write_synthetic_run(root / "run", n_prompt=8192, n_decode=16, bin_size=512, n_single_patch_variants=3,
                              nan_variant="all", scenario_name=HOSTILE, scenario_description=HOSTILE,
                              scenario_text=f"name: x\ndescription: \"{HOSTILE}\"\n", extra_variant=HOSTILE,
                              patch_note=HOSTILE)
    return write_report(run)


def test_page_renders_every_section_without_console_errors(hostile_report: Path, tmp_path: Path) -> None:
    dom = dump_dom(hostile_report, tmp_path)
    assert 'data-rendered="ok"' in dom, "the page's script did not finish (or a section failed)"
    table = dom[dom.index('id="layer-table"'):]
    table = table[:table.index("</table>")]
    assert table.count("<tr data-layer=") == 43, "one row per layer"
    assert re.search(r'<canvas[^>]*data-rows="43"', dom), "the heatmap canvas is drawn for 43 layers"
    for verdict in ("GATE FAILED", "Top suspect", "triton-indexer", "NaN/Inf"):
        assert verdict in dom, f"verdict text {verdict!r} missing"
    for section in ("summary-table", "attribution-matrix", "gate-table", "context-table"):
        assert f'id="{section}"' in dom, f"section element #{section} missing"
    assert dom.count("<svg") >= 12, "drift-vs-layer, indexer, context and mHC charts are drawn"
    assert "<div class=\"error-box\"" not in dom, "a section failed to draw"


def test_user_text_renders_inert(hostile_report: Path, tmp_path: Path) -> None:
    dom = dump_dom(hostile_report, tmp_path)
    assert "data-pwned" not in dom.replace("setAttribute('data-pwned'", ""), "an injected script or handler ran"
    assert "<title>pwned</title>" not in dom and "<img" not in dom, "hostile markup became elements"
    title = re.search(r"<title>(.*?)</title>", dom, re.S).group(1)
    assert title.startswith("dsv4-drift · &lt;script&gt;document.title"), f"title shows the text inertly: {title[:80]}"
    assert dom.count("&lt;script&gt;document.title='pwned'") >= 3, "hostile text is displayed as text"


@pytest.mark.parametrize("variant", ["flat-gate", "no-gate", "unfinished"])
def test_partial_inputs_render_without_errors(variant: str, tmp_path: Path) -> None:
    run = write_synthetic_run(tmp_path / "run", n_prompt=2048, n_decode=4, bin_size=512, n_single_patch_variants=1,
                              flat_gate=variant == "flat-gate", gate=variant == "flat-gate", attribution=False)
    if variant == "unfinished":
        for part in (run / "parts").glob("*.parquet"):
            part.unlink()
        (run / "metrics.parquet").unlink()
    dom = dump_dom(write_report(run), tmp_path)
    assert 'data-rendered="ok"' in dom
    expected = {"flat-gate": "GATE FAILED", "no-gate": "Not gated", "unfinished": "Incomplete run"}[variant]
    assert expected in dom


def test_screenshot_shows_a_drawn_page(hostile_report: Path, tmp_path: Path) -> None:
    shot = tmp_path / "report.png"
    result = chromium(hostile_report, tmp_path / "profile-shot", f"--screenshot={shot}", window="1400,2600")
    assert result.returncode == 0 and shot.is_file(), result.stderr[-2000:]
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    assert (width, height) == (1400, 2600)
    pixels = zlib.decompress(b"".join(chunk_data(png, b"IDAT")))
    assert len(set(pixels[::97])) > 60, "the screenshot is (nearly) blank"


def chunk_data(png: bytes, kind: bytes) -> list[bytes]:
    out, i = [], 8
    while i < len(png):
        length = int.from_bytes(png[i:i + 4], "big")
        if png[i + 4:i + 8] == kind:
            out.append(png[i + 8:i + 8 + length])
        i += 12 + length
    return out


DRIVER = """
setTimeout(function () {
  var body = document.body;
  try {
    var th = Array.prototype.find.call(document.querySelectorAll('#layers th.sortable'),
      function (t) { return t.title === 'sort by attention TV (decode)'; });
    th.click();
    body.setAttribute('data-sorted-first', document.querySelector('#layer-table tbody tr').getAttribute('data-layer'));
    document.querySelectorAll('select').forEach(function (sel) {
      for (var i = 0; i < sel.options.length; i++) { sel.selectedIndex = i; sel.dispatchEvent(new Event('change')); }
    });
    document.querySelectorAll('.legend .item').forEach(function (item) { item.click(); });
    document.querySelectorAll('input[type=checkbox]').forEach(function (box) { box.click(); });
    document.querySelectorAll('svg rect[fill="transparent"]').forEach(function (r) {
      var b = r.getBoundingClientRect();
      r.dispatchEvent(new MouseEvent('mousemove', {clientX: b.left + b.width / 2, clientY: b.top + b.height / 2, bubbles: true}));
    });
    var canvas = document.querySelector('#heatmap-canvas canvas'), b = canvas.getBoundingClientRect();
    canvas.dispatchEvent(new MouseEvent('mousemove', {clientX: b.left + 150, clientY: b.top + 60}));
    var tip = document.querySelector('.tooltip');
    body.setAttribute('data-driven', tip && tip.style.display === 'block' ? 'ok' : 'no tooltip');
    body.setAttribute('data-tooltip', tip ? tip.textContent : '');
  } catch (e) { body.setAttribute('data-driven', 'error: ' + e.message); }
}, 0);
"""


def test_controls_redraw_without_errors(hostile_report: Path, tmp_path: Path) -> None:
    """Drive every control like a user: sort a column, cycle every select, toggle every legend entry and
    checkbox, hover every chart and the heatmap. (The copy drops the page's CSP so the driver may run.)"""
    page = hostile_report.read_text()
    page = re.sub(r'<meta http-equiv="Content-Security-Policy"[^>]*>', "", page)
    page = page.replace("</body>", f"<script>{DRIVER}</script>\n</body>")
    driven = tmp_path / "driven.html"
    driven.write_text(page)
    dom = dump_dom(driven, tmp_path)
    assert 'data-driven="ok"' in dom, re.search(r'data-driven="[^"]*"', dom)
    assert 'data-sorted-first="0"' not in dom, "sorting by decode attention TV puts the worst layer first"
    assert re.search(r'data-tooltip="layer \d+', dom), "the heatmap tooltip names the layer"
    assert 'data-rendered="ok"' in dom and '<div class="error-box"' not in dom
