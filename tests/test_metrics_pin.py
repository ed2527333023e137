"""Speed work keeps every number: a fixed tiny run's metrics are bit-identical to the pinned ones (issue #14).

How the pin is made, why it is kept per platform, and when to regenerate it: tests/metrics_pin.py."""

from __future__ import annotations

import pandas as pd
import pytest

from metrics_pin import metrics_digests, pin_for, platform_fingerprint, read_pins, run_pinned


def test_tiny_smoke_metrics_are_bit_identical_to_the_pin(tmp_path):
    here = platform_fingerprint()
    pin = pin_for(here)
    if pin is None:
        pytest.skip(f"no pin for this platform ({here}; pinned: {[p['platform'] for p in read_pins()]}): make one "
                    "from unchanged code with `OMP_NUM_THREADS=1 PYTHONPATH=$PWD python tests/metrics_pin.py --write`")
    pinned = pin["digests"]
    now = metrics_digests(pd.read_parquet(run_pinned(tmp_path / "run")))
    moved = sorted(k for k in set(pinned) | set(now) if pinned.get(k) != now.get(k) and k != "*")
    assert now["*"] == pinned["*"], (
        f"the pinned tiny-smoke metrics changed in {len(moved)} (variant/mode/layer) groups: {moved[:12]}. A speed "
        "change must keep every bit; if numerics changed on purpose, regenerate the pin (tests/metrics_pin.py) and "
        "say why in the commit.")


def test_the_platform_fingerprint_names_the_processor():
    """Two machines with the same torch and vector ISA but different processors gave different bits (MKL): the
    fingerprint must tell them apart."""
    fingerprint = platform_fingerprint()
    assert set(fingerprint) == {"torch", "cpu_capability", "cpu"}
    assert fingerprint["cpu"] and "?" not in fingerprint["cpu"], fingerprint
