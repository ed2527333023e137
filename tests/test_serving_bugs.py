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


@pytest.mark.parametrize("patch, phase", [("window-short", "decode"), ("no-renorm", "prefill"),
                                          ("kv-rope-dropped", "decode"), ("kv-overwrite", "decode"),
                                          ("capacity-drop", "prefill"), ("expert-scale", "prefill")])
def test_a_serving_bug_fails_the_gate_and_is_triaged_to_its_patch_and_phase(tmp_path, patch, phase):
    out = tmp_path / "run"
    code = main(["run", "tiny-smoke", "--patches", patch, "--patch-module", str(PLUGIN), "--threads", "1",
                 "--no-report", "--out", str(out)])
    assert code == 1, f"{patch}: the gate passed"
    verdict = json.loads((out / "attribution.json").read_text())["verdict"]
    assert (verdict["patch"], verdict["phase"], verdict["first_layer"]) == (patch, phase, 0), verdict
