"""`dsv4-drift selftest` must be green: the harness names every injected fault and passes a benign change."""

from __future__ import annotations

import pytest

from harness.cli.main import main

pytestmark = pytest.mark.slow


def test_selftest_names_every_injected_fault_and_passes_the_benign_change(tmp_path, capsys):
    assert main(["selftest", "--out", str(tmp_path)]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "selftest passed" in out
    for fault in ("fault-chunk-carry", "fault-indexer-topk", "fault-split-merge", "fault-routing-scale",
                  "fault-mhc-fp8", "fault-sink-per-partial", "fault-bf16-router", "fault-lanes-past-length",
                  "fault-one-chunk"):
        assert fault in out
