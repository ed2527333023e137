"""The HTML report: one self-contained file, written for a real tiny run and for a synthetic 43-layer run,
with its JSON payload intact and every user-supplied string inert."""

from __future__ import annotations

import json
import math
import re
import textwrap
from pathlib import Path

import numpy as np
import pytest

from harness.cli.main import main
from harness.report.write import write_report
from harness.report.data import CODE_ALPHABET, NONFINITE, build_payload, pack_row
from harness.report.html import extract_payload
from harness.report.synthetic import BAD_FROM_LAYER, BAD_PATCH, CHUNK_FAULT, CHUNK_FAULT_VARIANT, write_synthetic_run

HOSTILE = "<script>document.title='pwned'</script></script><img src=x onerror=alert(1)>&amp;"

MINI_SCENARIO = textwrap.dedent("""\
    name: report-mini
    description: "report test <script>document.title='pwned'</script> & </script><b>bold</b>"
    model: {preset: tiny, seed: 0}
    prompt:
      thinking: false
      messages:
        - role: system
          content: "You are a terse assistant. <script>alert(1)</script>"
        - role: user
          content: "Remember the code word falcon-42 for later, then say ok."
          needles: {code: "falcon-42"}
        - role: assistant
          content: "ok"
        - role: user
          content: "What was the code word?"
        - role: assistant
          content: "falcon-42"
    tokenizer: fallback
    prefill: {chunk_size: 64}
    decode: {steps: 2, tokens: continuation}
    stacks:
      reference: {dtype: float32}
      yardstick: true
      variants:
        - {name: base, patches: []}
        - {name: all, patches: all}
    measure: {local: false, force_decisions: false}
    probes: {bin_size: 32, attn_sample_every: 4, logits_sample_every: 16}
    """)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """A real run of the tiny preset (5 layers, every layer kind) on a short two-turn chat with a needle."""
    root = tmp_path_factory.mktemp("tiny")
    scenario = root / "report-mini.yaml"
    scenario.write_text(MINI_SCENARIO)
    assert main(["run", str(scenario), "--out", str(root / "run"), "--no-report", "--no-gate"]) == 0
    return root / "run"


@pytest.fixture(scope="module")
def synthetic_run(tmp_path_factory) -> Path:
    """A 43-layer flash-schedule run (two prefill chunks, six needle queries) with gate.json (the gate's own shape,
    a chunk-scope check among its checks) and attribution.json."""
    return write_synthetic_run(tmp_path_factory.mktemp("synthetic") / "run", n_prompt=8192, n_decode=16, bin_size=512,
                               chunk_size=4096, needle_queries=6,
                               n_single_patch_variants=3, force_decisions=True, nan_variant="all",
                               scenario_name=HOSTILE, scenario_description=HOSTILE, scenario_text=HOSTILE,
                               extra_variant=HOSTILE, patch_note=HOSTILE)


def assert_self_contained(page: str) -> None:
    external = re.findall(r"(?i)\b(?:https?|ftp)://|//[a-z0-9.-]+\.[a-z]{2,}/|\bsrc\s*=\s*[\"'][^\"'#]|"
                          r"\bhref\s*=\s*[\"'][^\"'#]|@import|url\(", page)
    assert not external, f"the report must not reference anything outside itself, found {external[:5]}"


def assert_inert(page: str, hostile: str) -> None:
    assert hostile not in page, "user text reached the page unescaped"
    assert "<script>document.title" not in page and "<img src=x" not in page
    # exactly two script elements: the JSON payload and the page's own script
    assert page.count("<script") == 2 and page.count("</script>") == 2, "data must not open or close script elements"


@pytest.mark.slow
def test_report_of_a_real_tiny_run(tiny_run: Path) -> None:
    path = write_report(tiny_run)
    assert path == tiny_run / "report.html"
    page = path.read_text()
    assert page.startswith("<!doctype html>")
    assert path.stat().st_size < 1_000_000, f"tiny report is {path.stat().st_size} bytes"
    assert_self_contained(page)
    payload = extract_payload(page)
    assert len(payload["layers"]) == 5
    assert [layer["kind"] for layer in payload["layers"]] == ["swa", "swa", "csa", "hca", "csa"]
    assert payload["variants"] == ["yardstick", "base", "all"]
    stream = payload["table"]["global"]["all"]["streams.rel_l2"]["prefill"]["mean"]
    assert len(stream) == 5 and all(isinstance(v, float) and v > 0 for v in stream)
    assert payload["logits"]["all"]["prefill"]["logits.kl"]["mean"] > 0
    assert payload["heat"]["indexer.recall"]["all"][2] is not None, "CSA layer 2 has indexer recall per position"
    assert payload["heat"]["indexer.recall"]["all"][0] is None, "SWA layer 0 has no indexer"
    assert payload["gate"] is None and payload["attribution"] is None
    # the prompt's <script> travels only as escaped JSON and comes back intact
    assert "<script>alert(1)</script>" in payload["manifest"]["scenario"]["text"]
    assert_inert(page, "<script>alert(1)</script>")
    assert "<b>bold</b>" not in page


@pytest.mark.slow
def test_report_reads_the_gates_own_gate_json(tiny_run: Path, tmp_path: Path) -> None:
    """`dsv4-drift gate` writes gate.json into the run; the page's verdict and colours come from it."""
    rc = main(["gate", str(tiny_run), "--quiet"])
    assert rc in (0, 1), f"gate exit code {rc}"
    payload = extract_payload(write_report(tiny_run, tmp_path / "gated.html").read_text())
    gate = payload["gate"]
    assert gate["passed"] is (rc == 0)
    assert gate["rows"] and {"check", "variant", "phase", "status"} <= set(gate["rows"][0])
    cells = gate["cells"]["streams.rel_l2"]["all"]["global"]["prefill"]
    assert len(cells["ratio"]) == 6, "layers 0-4 and the logits row"
    assert all(r is not None for r in cells["ratio"][:5]) and cells["ratio"][5] is None
    assert all(0 <= i < len(gate["check_names"]) for i in cells["check"][:5])
    # twin bounds colour too: `all`'s bf16 mHC pre-linear fails its fp32 twin by orders of magnitude at every layer,
    # the stock op (`base`) is the site's own reference
    site = gate["cells"]["mhc.site_rel_err@attn.hc.site"]
    assert all(r > 100 for r in site["all"]["global"]["prefill"]["ratio"][:5]), site["all"]["global"]["prefill"]
    assert site["base"]["global"]["prefill"]["ratio"][:5] == [0] * 5
    assert {gate["check_names"][i] for i in site["all"]["global"]["prefill"]["check"][:5]} == {"mhc-site"}


def test_report_of_a_synthetic_43_layer_run(synthetic_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "nested" / "report.html"
    path = write_report(synthetic_run, out)
    assert path == out and out.is_file()
    page = out.read_text()
    assert_self_contained(page)
    assert_inert(page, HOSTILE)
    payload = extract_payload(page)
    assert len(payload["layers"]) == 43
    assert sum(layer["kind"] == "csa" for layer in payload["layers"]) == 21
    assert sum(layer["hash"] for layer in payload["layers"]) == 3
    assert payload["modes"] == ["global", "local", "forced"]
    assert HOSTILE in payload["variants"], "a hostile variant name survives as data"
    assert payload["manifest"]["scenario"]["name"] == HOSTILE
    rel = payload["table"]["global"]["base"]["streams.rel_l2"]
    assert len(rel["decode"]["mean"]) == 43 and len(rel["prefill"]["worst"]) == 43
    n_bins = len(payload["bins"]["pos_bin"])
    assert payload["bins"]["phase"].count("decode") == 16, "one bin per decode step"
    assert payload["bins"]["phase"].count("prefill") >= 8192 // 512, "512-token bins, split at turn boundaries"
    recall = payload["heat"]["indexer.recall"]["triton-indexer"]
    assert len(recall) == 43 and recall[0] is None and len(recall[2][3]) == 2 * n_bins
    # gate (the gate's own shape), attribution and findings reach the page normalised
    gate = payload["gate"]
    assert gate["passed"] is False and gate["failures"]
    failing = [r for r in gate["rows"] if r["status"] == "fail"]
    assert {r["check"]: r["first_failing_layer"] for r in failing} == {
        "attn-tv": 4, "indexer-mass-recall": 4, "attn-out-rel-l2-patch-by-chunk": 4, "needle-lost": BAD_FROM_LAYER + 1}
    assert max(r for r in gate["cells"]["attn.tv"]["triton-indexer"]["global"]["decode"]["ratio"] if r) > 1
    att = payload["attribution"]
    assert att["verdict"]["patch"] == "triton-indexer"
    assert len(att["matrix"]["attn.tv"]["phases"]["decode"]["triton-indexer"]) == 43
    assert payload["findings"][0]["variant"] == "all"


def test_payload_holds_the_needle_answer_per_stack(synthetic_run: Path) -> None:
    """Six needle queries; the answer appears through the lens from layer 4, one query per layer; the two broken
    variants lose every other answer from BAD_FROM_LAYER (harness.report.synthetic.needle_answers)."""
    needles = build_payload(synthetic_run)["needles"]
    reference = needles["reference"]
    assert needles["queries"] == 6 and (reference["answered"], reference["rate"]) == (6, 1)
    assert reference["lens"][:10] == [0, 0, 0, 0, 0.167, 0.333, 0.5, 0.667, 0.833, 1], "answers appear at L4-L9"
    assert reference["margin"] == 4.5, "median of the margins 2…7 (the mean would be the same; see the stacks)"
    base, broken = needles["stacks"]["base"], needles["stacks"][BAD_PATCH]
    assert (base["answered"], base["lost"], base["first_lost"], base["rate"]) == (6, 0, None, 1)
    assert (broken["answered"], broken["lost"], broken["rate"]) == (3, 3, 0.5)
    assert broken["margin"] == 0.75, "median of 2, 4, 6 and three misses at −0.5 (mean: 1.75)"
    assert broken["first_lost"] == BAD_FROM_LAYER + 1, "query 1 is answered from L5 by the reference, lost there"
    assert broken["lens_lost"][BAD_FROM_LAYER + 1] == 1 and broken["lens_lost"][-1] == 3
    assert list(needles["stacks"])[:2] == ["yardstick", "base"], "stacks in the page's order"


def test_a_run_without_needle_queries_has_no_outcome(tmp_path: Path) -> None:
    run = write_synthetic_run(tmp_path / "run", preset="tiny", n_prompt=256, n_decode=2, chunk_size=128, bin_size=64,
                              n_single_patch_variants=1, gate=False, attribution=False)
    payload = build_payload(run)
    assert payload["needles"] is None and payload["manifest"]["prompt"]["needles"], "needles planted, none asked for"


def test_payload_names_the_failing_groups(synthetic_run: Path) -> None:
    """The chunk-scope check fails for `all` in prefill chunk 1 (positions [4096, 8192)) in local mode from layer 4:
    the banner's entry, the check's rows, the layer's cell and the heatmap's bins all name that chunk."""
    payload = build_payload(synthetic_run)
    gate, bins = payload["gate"], payload["bins"]
    check = "attn-out-rel-l2-patch-by-chunk"
    failing = [f for f in gate["failing"] if f["check"] == check]
    assert len(failing) == 1 and failing[0]["variant"] == CHUNK_FAULT_VARIANT
    assert {k: failing[0][k] for k in ("layer", "phase", "mode", "scope", "group", "span", "failing_units")} == {
        "layer": BAD_FROM_LAYER, "phase": "prefill", "mode": "local", "scope": "chunk", "group": CHUNK_FAULT,
        "span": [4096, 8192], "failing_units": 43 - BAD_FROM_LAYER}
    assert failing[0]["line"].startswith(f"{check} [all]: attn.out_rel_l2 first fails at layer 4 prefill chunk 1")
    attn_tv = next(f for f in gate["failing"] if f["check"] == "attn-tv")
    assert "scope" not in attn_tv and attn_tv["mode"] == "global", "a layer-scope failure has no group"
    row = next(r for r in gate["rows"] if r["check"] == check and r["variant"] == "all" and r["phase"] == "prefill")
    assert (row["first_scope"], row["first_group"], row["first_span"], row["first_mode"]) == \
        ("chunk", CHUNK_FAULT, [4096, 8192], "local")
    cell = gate["cells"]["attn.out_rel_l2"]["all"]["local"]["prefill"]
    assert cell["ratio"][BAD_FROM_LAYER] > 1 and cell["ratio"][BAD_FROM_LAYER - 1] <= 1
    assert gate["check_names"][cell["check"][BAD_FROM_LAYER]] == check
    assert cell["where"][str(BAD_FROM_LAYER)] == [CHUNK_FAULT, 4096, 8192], "the tooltip's group"
    chunk_bins = [i for i, (phase, chunk) in enumerate(zip(bins["phase"], bins["chunk"]))
                  if phase == "prefill" and chunk == CHUNK_FAULT]
    (groups,) = gate["failing_groups"]["all"]
    assert gate["check_names"][groups["check"]] == check and (groups["mode"], groups["scope"]) == ("local", "chunk")
    assert sorted(map(int, groups["layers"])) == list(range(BAD_FROM_LAYER, 43))
    assert groups["layers"]["20"] == [[chunk_bins[0], chunk_bins[-1] + 1]], "the chunk's bins, one range"
    assert BAD_PATCH not in gate["failing_groups"], "layer-scope failures are not groups"


CHUNK_ONE_FAULT = """
import torch
from optimized.patching import Patch

chunk_one = Patch("chunk-one-window", phases=("prefill",),
                  description="in the second prefill chunk only, sparse attention skips the compressed rows and the "
                              "older half of the window")


@chunk_one.op("sparse_attention")
def attend(ctx, q, window_slots, comp_slots, sink):
    if ctx.segment == 1:
        comp_slots = torch.full_like(comp_slots, -1)
        newest = window_slots.max(1, keepdim=True).values
        window_slots = torch.where(window_slots > newest - 64, window_slots, -1)
    return ctx.base(q=q, window_slots=window_slots, comp_slots=comp_slots, sink=sink)
"""


@pytest.mark.slow
def test_a_real_chunk_scope_failure_reaches_the_page(tmp_path: Path) -> None:
    """A fault in prefill chunk 1 only (sparse attention drops the compressed rows and the older half of the window
    there) fails the default policy's per-chunk checks: the page names the chunk and colours the layer's local cell.
    (The selftest's one-chunk fault, which drops the compressed rows only, did until the synthetic experts passed the
    SwiGLU limit: its chunk-1 attention error, 0.092, now sits under the per-chunk bound, 0.099, at layer 4 — the
    attention site and the per-bin check still fail it.)"""
    run, plugin = tmp_path / "run", tmp_path / "chunk_one.py"
    plugin.write_text(CHUNK_ONE_FAULT)
    rc = main(["run", "selftest", "--patches", "chunk-one-window", "--patch-module", str(plugin),
               "--out", str(run), "--no-report", "--no-triage"])
    assert rc == 1, "the one-chunk fault fails the gate"
    gate = build_payload(run)["gate"]
    chunk = [f for f in gate["failing"] if f.get("scope") == "chunk"]
    assert chunk, f"no chunk-scope failure among {[f['check'] for f in gate['failing']]}"
    first = chunk[0]
    assert (first["phase"], first["group"], first["mode"]) == ("prefill", 1, "local")
    cell = gate["cells"][first["metric"]]["chunk-one-window"]["local"]["prefill"]
    assert cell["ratio"][first["layer"]] > 1, "a group-scope failure colours the layer's cell as failing"
    assert str(first["layer"]) in cell["where"], "and its tooltip names a group"
    groups = {gate["check_names"][e["check"]]: e for e in gate["failing_groups"]["chunk-one-window"]}
    assert str(first["layer"]) in groups[first["check"]]["layers"]


def test_payload_is_strict_json_and_parses_back(synthetic_run: Path, tmp_path: Path) -> None:
    page = write_report(synthetic_run, tmp_path / "r.html").read_text()
    start = page.index('<script type="application/json" id="report-data">')
    raw = page[start:page.index("</script>", start)].split(">", 1)[1]
    assert "<" not in raw and ">" not in raw and "&" not in raw, "payload must carry <, >, & as \\u escapes"

    def reject(constant: str) -> None:
        raise AssertionError(f"non-standard JSON constant {constant} in the payload")

    payload = json.loads(raw, parse_constant=reject)
    assert payload == extract_payload(page)
    rebuilt = build_payload(synthetic_run)
    for key in ("table", "heat", "bins", "layers", "variants"):
        assert payload[key] == json.loads(json.dumps(rebuilt[key])), f"payload[{key!r}] changed on the way"


def test_non_finite_values_travel_as_markers(tmp_path: Path) -> None:
    run = write_synthetic_run(tmp_path / "run", preset="tiny", n_prompt=256, n_decode=2, chunk_size=128, bin_size=64,
                              n_single_patch_variants=1, gate=False, attribution=False)
    import pyarrow.parquet as pq

    from harness.run.store import RunStore

    store = RunStore(run)
    table = pq.read_table(store.part_path(0)).to_pandas()
    mask = (table["variant"] == "all") & (table["metric"] == "streams.rel_l2") & (table["mode"] == "global")
    table.loc[mask, "value"] = [math.nan, math.inf] + [0.5] * (int(mask.sum()) - 2)
    rows = table.to_dict("records")
    store.write_layer(0, rows)
    payload = extract_payload(write_report(run, tmp_path / "r.html").read_text())
    prefill = payload["table"]["global"]["all"]["streams.rel_l2"]["prefill"]
    assert prefill["mean"][0] == NONFINITE["nan"] and prefill["mean"][1] != NONFINITE["nan"]
    assert decode_row(payload["heat"]["streams.rel_l2"]["all"][0], 2) == ["nan", "inf"]
    assert payload["gate"] is None


def decode_row(row: list, n: int) -> list:
    """Python twin of the page's unpackRow (report.js)."""
    lo, hi, use_log, codes = row
    out = []
    for c in range(n):
        k = CODE_ALPHABET.index(codes[2 * c]) * 64 + CODE_ALPHABET.index(codes[2 * c + 1])
        if k == 4095:
            out.append(None)
        elif k in (4094, 4093, 4092):
            out.append({4094: "nan", 4093: "inf", 4092: "-inf"}[k])
        else:
            t = k / 4091
            out.append(math.exp(math.log(lo) + t * (math.log(hi) - math.log(lo))) if use_log else lo + t * (hi - lo))
    return out


def test_packed_heatmap_rows_round_trip_within_a_colour_step() -> None:
    rng = np.random.default_rng(1)
    values = rng.lognormal(-6, 1.5, 120)
    present = np.ones(120, bool)
    present[[5, 17]] = False
    row = pack_row(values, present)
    assert row[2] == 1, "a positive row spanning decades is log-coded"
    back = decode_row(row, 120)
    assert back[5] is None and back[17] is None
    rel = max(abs(b - v) / v for b, v, p in zip(back, values, present) if p)
    span = math.log(values.max() / values.min())
    assert rel < span / 4091, f"relative error {rel} above one code step"
    recall = np.clip(1 - rng.uniform(0, 0.05, 64), 0, 1)
    back = decode_row(pack_row(recall, np.ones(64, bool)), 64)
    assert max(abs(b - v) for b, v in zip(back, recall)) < 0.05 / 4091 + 1e-12
    assert pack_row(values, np.zeros(120, bool)) is None


def test_flat_gate_and_unreadable_files_still_render(tmp_path: Path) -> None:
    run = write_synthetic_run(tmp_path / "run", n_prompt=2048, n_decode=4, bin_size=512, n_single_patch_variants=2,
                              flat_gate=True)
    payload = extract_payload(write_report(run).read_text())
    rows = payload["gate"]["rows"]
    assert payload["gate"]["passed"] is False and payload["gate"]["cells"] == {}
    assert any(r["status"] == "fail" and r["first_failing_layer"] == 4 and r["bound"] == 0.05 for r in rows)
    (run / "attribution.json").write_text("{not json")
    (run / "gate.json").write_text(json.dumps({"verdict": "pass", "checks": "?", "nonfinite": [{"x": float("nan")}]}))
    payload = extract_payload(write_report(run).read_text())
    assert payload["attribution"] is None and any("attribution.json" in p for p in payload["problems"])
    assert payload["gate"]["passed"] is True and payload["gate"]["rows"] == []
    assert payload["gate"]["findings"] == [{"x": NONFINITE["nan"]}]


def test_report_of_an_unfinished_run(tmp_path: Path) -> None:
    """A run killed before its first layer still gets a page (metadata, 'not measured' sections)."""
    run = write_synthetic_run(tmp_path / "run", preset="tiny", n_prompt=256, n_decode=2, chunk_size=128, bin_size=64,
                              n_single_patch_variants=1, gate=False, attribution=False)
    for part in (run / "parts").glob("*.parquet"):
        part.unlink()
    (run / "metrics.parquet").unlink()
    payload = extract_payload(write_report(run).read_text())
    assert payload["rows"] == 0 and payload["table"] == {} and payload["heat"] == {}
    assert len(payload["layers"]) == 5


def test_cli_report_command(synthetic_run: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "cli.html"
    assert main(["report", str(synthetic_run), "--out", str(out)]) == 0
    assert out.is_file() and str(out) in capsys.readouterr().out
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "not a run directory" in capsys.readouterr().err
