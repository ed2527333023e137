"""Serving bugs of classes beyond the selftest's faults (tests/data/serving_bugs.py) fail the gate on tiny-smoke, and
`run`'s triage names the patch and the phase the bug lives in — whether it shows at a decision site (the stock op
beside the patched one on the same inputs) or only downstream (attention drifting from the reference past the base
stack's own drift)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.cli.main import main

pytestmark = pytest.mark.slow

PLUGIN = Path(__file__).resolve().parent / "data" / "serving_bugs.py"


@pytest.mark.parametrize("patch, phase, layer", [
    ("window-short", "decode", 0), ("no-renorm", "prefill", 0), ("kv-rope-dropped", "decode", 0),
    ("kv-overwrite", "decode", 0), ("capacity-drop", "prefill", 0), ("expert-scale", "prefill", 0),
    ("decode-sm-scale", "decode", 0),
    ("router-bias-dropped", "prefill", 3),  # tiny's first learned-routing layer (0-2 are hash-routed)
    ("indexer-chunk-positions", "prefill", 2),  # tiny's first CSA layer, the first with an indexer
    ("topk-short", "decode", 2),
    ("overlap-lost", "prefill", 2),  # one compressed row per boundary: the rows' worst-row checks
    ("comp-row-late", "decode", 2),  # the caches' row count (kv-cache-site)
    ("first-query-edge", "prefill", 0),  # one query per chunk: the attention site samples the chunks' edges
    ("tile-row-self", "prefill", 0),  # 1 query in 64, off the stride: the site at every query a patch computed
    ("index-tile-row", "prefill", 2)])  # likewise for the indexer's site (indexer-site-margin)
def test_a_serving_bug_fails_the_gate_and_is_triaged_to_its_patch_and_phase(tmp_path, patch, phase, layer):
    out = tmp_path / "run"
    code = main(["run", "tiny-smoke", "--patches", patch, "--patch-module", str(PLUGIN), "--threads", "1",
                 "--no-report", "--out", str(out)])
    assert code == 1, f"{patch}: the gate passed"
    verdict = json.loads((out / "attribution.json").read_text())["verdict"]
    assert (verdict["patch"], verdict["phase"], verdict["first_layer"]) == (patch, phase, layer), verdict


def test_a_change_that_moves_no_decision_passes(tmp_path):
    """The indexer's head weights doubled: every score doubles exactly, so every pick, attention row and output is
    the stock engine's — a tool that failed it would be measuring the scores' scale, not what the scores decide."""
    code = main(["run", "tiny-smoke", "--patches", "uniform-index-weights", "--patch-module", str(PLUGIN),
                 "--threads", "1", "--no-report", "--out", str(tmp_path / "run")])
    assert code == 0


def test_attention_in_another_order_passes_at_every_query(tmp_path):
    """Attention over its keys in reverse order (prefill and decode): the stock op's sums in another order, so its
    LSE moves by fp32 rounding only — at every prefill query, where the attention site now runs for a patched
    attention (attn-site-worst-query holds the worst of them to twice the twin's worst, plus the floor)."""
    out = tmp_path / "run"
    code = main(["run", "tiny-smoke", "--patches", "keys-reversed", "--patch-module", str(PLUGIN),
                 "--threads", "1", "--no-report", "--out", str(out)])
    assert code == 0
    check = next(c for c in json.loads((out / "gate.json").read_text())["checks"]
                 if c["name"] == "attn-site-worst-query")
    units = [u for v in check["variants"] if v["variant"] == "keys-reversed" for u in v["units"]]
    # every prefill query of tiny-smoke's 574-token prompt is at the site, in each layer and mode
    assert units and all(u["positions"] == 574 and u["status"] == "pass" for u in units), units
