"""`dsv4-drift run` names the patch, the phase and the first layer when its gate fails a patched variant (triage)."""

from __future__ import annotations

import json

import pytest

from harness.cli.main import main

pytestmark = pytest.mark.slow


def test_a_failing_patched_variant_is_triaged_to_its_patch_phase_and_layer(tmp_path, capsys):
    """nvfp4-experts quantizes the routed experts' activations to 4 bits (W4A4) from layer 0 on; mma-sparse-decode
    changes decode attention only. The variant with both fails the gate at layer 0 prefill, and the triage pass —
    each patch alone in local mode over layers 0 … 0 — must blame nvfp4-experts in prefill at layer 0."""
    out = tmp_path / "run"
    code = main(["run", "tiny-smoke", "--patches", "mma-sparse-decode,nvfp4-experts", "--out", str(out)])
    assert code == 1, "the gate fails the variant with nvfp4-experts"
    printed = capsys.readouterr()
    assert "triage verdict: patch nvfp4-experts, prefill phase, first at layer 0" in printed.err + printed.out
    attribution = json.loads((out / "attribution.json").read_text())
    assert attribution["kind"] == "triage" and attribution["layers"] == [0, 0]
    assert attribution["verdict"]["patch"] == "nvfp4-experts" and attribution["verdict"]["phase"] == "prefill"
    assert attribution["first_divergence"]["mma-sparse-decode"] == [], "a decode-only patch cannot fail in prefill"
    triage_manifest = json.loads((out / "triage" / "manifest.json").read_text())
    assert triage_manifest["end_layer"] == 1 and triage_manifest["triage"]["of"] == "mma-sparse-decode+nvfp4-experts"
    assert not (out / "state").exists() and not (out / "triage" / "state").exists(), "no resume state is left behind"
    assert "nvfp4-experts" in (out / "report.html").read_text(), "the report's banner shows the verdict"


def test_no_triage_skips_the_pass(tmp_path):
    out = tmp_path / "run"
    assert main(["run", "tiny-smoke", "--patches", "nvfp4-experts", "--out", str(out), "--no-triage",
                 "--no-report"]) == 1
    assert not (out / "attribution.json").exists() and not (out / "triage").exists()
