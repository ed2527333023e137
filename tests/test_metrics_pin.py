"""Speed work keeps every number: a fixed tiny run's metrics are bit-identical to the pinned ones (issue #14).

How the pin is made and when to regenerate it: tests/metrics_pin.py."""

from __future__ import annotations

import json

import pandas as pd

from metrics_pin import PIN_FILE, metrics_digests, platform_fingerprint, run_pinned


def test_tiny_smoke_metrics_are_bit_identical_to_the_pin(tmp_path):
    pin = json.loads(PIN_FILE.read_text())
    pinned = pin["digests"]
    now = metrics_digests(pd.read_parquet(run_pinned(tmp_path / "run")))
    moved = sorted(k for k in set(pinned) | set(now) if pinned.get(k) != now.get(k) and k != "*")
    platform, here = pin.get("platform"), platform_fingerprint()
    elsewhere = "" if platform == here else (
        f" The pin was made on {platform}, this run is on {here}: if no numerics code changed, the platform re-ordered "
        "sums; regenerate the pin on this platform.")
    assert now["*"] == pinned["*"], (
        f"the pinned tiny-smoke metrics changed in {len(moved)} (variant/mode/layer) groups: {moved[:12]}. A speed "
        "change must keep every bit; if numerics changed on purpose, regenerate the pin (tests/metrics_pin.py) and "
        "say why in the commit." + elsewhere)
