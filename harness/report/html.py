"""The report page: the payload as an inert JSON block plus the page's own CSS and script, in one HTML file.

Everything the page needs is inside the file (no network at view time). User-supplied text (scenario,
prompt, variant and patch names) only ever travels inside the JSON block, escaped so that nothing in
it can close the <script> element, and the script puts it on the page with textContent. A
Content-Security-Policy admits exactly the page's own script (by hash) and no network requests, so an
injected <script> or event handler would not run even if escaping were ever bypassed.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
import math
from pathlib import Path
from typing import Any

ASSETS = Path(__file__).with_name("assets")
PAYLOAD_ID = "report-data"


def asset(name: str) -> str:
    text = (ASSETS / name).read_text(encoding="utf-8")
    if any(tag in text.lower() for tag in ("<script", "</script", "</style", "<!--")):
        raise ValueError(f"report asset {name} must not contain script/style tags or <!-- (it is inlined)")
    return text


def finite_json(obj: Any) -> Any:
    """Non-finite floats (from gate/attribution files written by other tools) as the NONFINITE strings."""
    from harness.report.data import NONFINITE

    if isinstance(obj, float) and not math.isfinite(obj):
        return NONFINITE["nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")]
    if isinstance(obj, dict):
        return {str(k): finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj


def script_json(payload: dict[str, Any]) -> str:
    """Strict JSON safe inside <script type="application/json">: <, > and & as \\u escapes (so `</script>`
    or `<!--` in any string cannot end or alter the element), U+2028/9 escaped too. JSON.parse reads it back."""
    text = json.dumps(payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return (text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
            .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029"))


def extract_payload(page: str) -> dict[str, Any]:
    """The payload back from a written page (tests, tools)."""
    start_tag = f'<script type="application/json" id="{PAYLOAD_ID}">'
    start = page.index(start_tag) + len(start_tag)
    end = page.index("</script>", start)
    return json.loads(page[start:end])


def render_page(payload: dict[str, Any]) -> str:
    script = asset("report.js")
    style = asset("report.css")
    digest = base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode()
    csp = (f"default-src 'none'; script-src 'sha256-{digest}'; style-src 'unsafe-inline'; img-src 'none'; "
           "connect-src 'none'; form-action 'none'; base-uri 'none'")
    scenario = ((payload.get("manifest") or {}).get("scenario") or {}).get("name") or "run"
    title = html.escape(f"dsv4-drift · {scenario}")
    data = script_json(payload)
    return (
        "<!doctype html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
        f"<meta http-equiv=\"Content-Security-Policy\" content=\"{csp}\">\n"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
        f"<title>{title}</title>\n<style>\n{style}</style>\n</head>\n<body>\n"
        "<noscript><p style=\"padding:20px\">This report draws its tables and charts with JavaScript; "
        "the data is in the report-data block of this file.</p></noscript>\n"
        "<div id=\"app\"></div>\n"
        f"<script type=\"application/json\" id=\"{PAYLOAD_ID}\">{data}</script>\n"
        f"<script>{script}</script>\n</body>\n</html>\n"
    )
