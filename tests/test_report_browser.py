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
    """43 layers in two prefill chunks, six needle queries, gate.json (failing, a chunk-scope check among its
    checks), attribution.json, a NaN finding, and hostile text in every user field."""
    root = tmp_path_factory.mktemp("browser")
    run = write_synthetic_run(root / "run", n_prompt=8192, n_decode=16, bin_size=512, chunk_size=4096,
                              needle_queries=6, n_single_patch_variants=3,
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
    assert "No decode step asks for a needle: add decode steps that recall the needles (service_account)" in dom


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


def test_the_lens_opens_with_the_needle_answer(hostile_report: Path, tmp_path: Path) -> None:
    dom = dump_dom(hostile_report, tmp_path)
    assert re.search(r'<section id="context"><h2>Context-loss lens</h2><div id="needle-outcome"', dom), \
        "the context-loss lens's first element is the needle-answer outcome"
    outcome = dom[dom.index('id="needle-outcome"'):dom.index("</table>", dom.index('id="needle-table"'))]
    assert "Over 6 needle queries" in outcome
    rows = dict(re.findall(r'<tr data-stack="([^"]+)">(.*?)</tr>', outcome))
    assert list(rows)[:3] == ["reference", "yardstick", "base"]
    cells = {name: re.findall(r"<td[^>]*>(.*?)</td>", row) for name, row in rows.items()}
    assert "6 of 6" in cells["reference"][1] and "6 of 6" in cells["base"][1]
    assert "3 of 6" in cells["triton-indexer"][1] and cells["triton-indexer"][3] == "3", "three answers lost"
    lost = re.search(r'<tr data-stack="triton-indexer">.*?<td class="([^"]*)"[^>]*>3</td>', outcome).group(1)
    assert lost.startswith("c-bad"), f"the lost answers carry the gate's failing colour, not {lost!r}"
    assert ">L5 <" in rows["triton-indexer"], "the first layer that loses an answer"


def test_the_banner_names_the_chunk_of_a_chunk_scope_failure(hostile_report: Path, tmp_path: Path) -> None:
    dom = dump_dom(hostile_report, tmp_path)
    banner = dom[dom.index('id="gate-failures"'):]
    banner = banner[:banner.index("</ul>")]
    line = next(li for li in re.findall(r"<li[^>]*>(.*?)</li>", banner) if "attn-out-rel-l2-patch-by-chunk" in li)
    assert 'class="where">prefill chunk 1 · local</span>' in line, line
    assert "L4" in line and "39 failing units" in line
    layer_scope = next(li for li in re.findall(r"<li[^>]*>(.*?)</li>", banner) if "<b>attn-tv</b>" in li)
    assert 'class="where">decode · global</span>' in layer_scope
    table = dom[dom.index('id="gate-table"'):]
    assert "prefill chunk 1 · local" in table[:table.index("</table>")], "the first-failure table names it too"


HEAT_DRIVER = """
setTimeout(function () {
  var body = document.body;
  try {
    var variant = document.querySelectorAll('#heatmap select')[1];
    variant.value = 'all'; variant.dispatchEvent(new Event('change'));
    var canvas = document.querySelector('#heatmap-canvas canvas'), b = canvas.getBoundingClientRect();
    body.setAttribute('data-outlines', canvas.getAttribute('data-failing-groups'));
    // layer 20, the first bin of prefill chunk 1 (the bin starting at position 4096): the canvas is
    // 92 px of labels + one column per bin + 12, and 34 + one row per layer + 26 high
    var cols = +canvas.getAttribute('data-cols'), rows = +canvas.getAttribute('data-rows');
    var cw = (b.width - 104) / cols, ch = (b.height - 60) / rows, bin = +body.getAttribute('data-chunk-bin');
    canvas.dispatchEvent(new MouseEvent('mousemove', {clientX: b.left + 92 + (bin + 0.5) * cw, clientY: b.top + 34 + 20.5 * ch}));
    body.setAttribute('data-tooltip', document.querySelector('.tooltip').textContent);
    var selects = document.querySelectorAll('#layers select');  // the per-layer table: variant, mode
    selects[0].value = 'all'; selects[0].dispatchEvent(new Event('change'));
    selects[1].value = 'local'; selects[1].dispatchEvent(new Event('change'));
    var cell = Array.prototype.find.call(document.querySelectorAll('#layer-table tr[data-layer="4"] td'),
      function (td) { return (td.title || '').indexOf('attention output rel L2 · prefill') === 0; });
    body.setAttribute('data-cell', cell.getAttribute('data-gated') + '|' + cell.title);
  } catch (e) { body.setAttribute('data-outlines', 'error: ' + e.message); }
}, 0);
"""


def test_the_heatmap_and_the_layer_table_show_the_failing_chunk(hostile_report: Path, tmp_path: Path) -> None:
    """Switched to the variant that fails in prefill chunk 1, the heatmap outlines that chunk in each failing layer
    (4 … 42: one outline a row) and the tooltip of a cell inside it names the check and the chunk; in local mode
    the per-layer table colours layer 4's attention-output cell as failing and its tooltip names the chunk."""
    from harness.report.html import extract_payload

    bins = extract_payload(hostile_report.read_text())["bins"]
    first_bin = bins["pos_bin"].index(4096)
    page = re.sub(r'<meta http-equiv="Content-Security-Policy"[^>]*>', "", hostile_report.read_text())
    page = page.replace("<body>", f'<body data-chunk-bin="{first_bin}">')
    page = page.replace("</body>", f"<script>{HEAT_DRIVER}</script>\n</body>")
    driven = tmp_path / "heat.html"
    driven.write_text(page)
    dom = dump_dom(driven, tmp_path)
    assert 'data-outlines="39"' in dom, re.search(r'data-outlines="[^"]*"', dom)
    tooltip = re.search(r'data-tooltip="([^"]*)"', dom).group(1)
    assert "fails: attn-out-rel-l2-patch-by-chunk (local)" in tooltip and "prefill chunk 1" in tooltip, tooltip
    gated, title = re.search(r'data-cell="([^"]*)"', dom).group(1).split("|", 1)
    assert gated == "fail", title
    assert "gate check attn-out-rel-l2-patch-by-chunk at prefill chunk 1 (local)" in title, title
