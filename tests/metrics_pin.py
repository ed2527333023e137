"""A fixed tiny run's metrics, pinned bit for bit: every speed change must leave them unchanged (issue #14).

The run is `dsv4-drift run tiny-smoke --patches all --local --threads 1` (reference, yardstick, base and every
patch; global and local; every probe) on the CPU. Parallel sums change with the thread count, so the run is pinned
at one thread. Its metrics are sorted by their key columns and each row is written with `float.hex` values, so a
digest changes when any value changes in its last bit. Digests are kept per (variant, mode, layer), so a failing
pin says where the numbers moved.

The bits depend on the platform as well as on the code: the BLAS picks its kernels (and with them the order of its
sums) by the CPU, not only by its vector ISA — MKL takes other paths on AMD than on Intel processors with the same
AVX-512 capability (2026-12-02: the pin made on one 2-core machine moved in 33 groups on an AMD EPYC machine with the
same torch and capability, identically run after run). So a pin is kept per platform (`platform_fingerprint`); on a
platform without one the test skips, naming it. Regenerate this platform's pin only when numerics change on purpose
(a metric, a stack or the synthetic weights), and say so in the commit; add one for a new platform from unchanged
code (every other platform's pin is then stale after a numerics change: drop them, as the writer does with
`--write --only-this-platform`):

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python tests/metrics_pin.py --write
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
PIN_FILE = ROOT / "tests" / "data" / "tiny-smoke-pin.json"
PIN_ARGS = ["run", "tiny-smoke", "--patches", "all", "--local", "--threads", "1", "--no-gate", "--no-report"]
KEY_COLUMNS = ["variant", "mode", "layer", "phase", "chunk", "step", "turn", "pos_bin", "pos_end", "tap", "metric"]


def metrics_digests(metrics: pd.DataFrame) -> dict[str, str]:
    """sha256 per (variant, mode, layer) of the sorted rows, values as float.hex, plus '*' over all rows."""
    rows = metrics.sort_values(KEY_COLUMNS).reset_index(drop=True)
    lines = ["|".join([*(str(r[c]) for c in KEY_COLUMNS), float(r["value"]).hex(), float(r["max"]).hex(),
                       str(int(r["count"]))]) for r in rows.to_dict("records")]
    groups: dict[str, list[str]] = {}
    for r, line in zip(rows.to_dict("records"), lines):
        groups.setdefault(f"{r['variant']}/{r['mode']}/{r['layer']}", []).append(line)
    digests = {k: hashlib.sha256("\n".join(v).encode()).hexdigest() for k, v in sorted(groups.items())}
    digests["*"] = hashlib.sha256("\n".join(lines).encode()).hexdigest()
    return digests


def platform_fingerprint() -> dict[str, str]:
    """What besides the code decides the bits: torch's version, the vector ISA it dispatches to, and the processor
    (vendor, family, model), by which the BLAS chooses its kernels (a BLAS or kernel change re-orders sums). The pin
    held on the GPU machine's torch 2.11 as on the 2.13 here, so one difference alone need not move a bit; a pin is
    kept per fingerprint all the same."""
    import torch

    return {"torch": torch.__version__.split("+")[0], "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu": _processor()}


def _processor() -> str:
    """'vendor family F model M' (x86) or 'Arm implementer I part P' from /proc/cpuinfo (a virtual machine's model
    name is often generic, its family and model are not); the machine type elsewhere."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if not line.strip():
                    break  # the first processor's block
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.machine()
    if "vendor_id" in fields:  # x86
        return f"{fields['vendor_id']} family {fields.get('cpu family', '?')} model {fields.get('model', '?')}"
    if "CPU implementer" in fields:  # Arm
        return f"Arm implementer {fields['CPU implementer']} part {fields.get('CPU part', '?')}"
    return platform.machine()


def read_pins() -> list[dict]:
    """The pins, one per platform: [{"platform": fingerprint, "digests": …}, …]."""
    return json.loads(PIN_FILE.read_text())["pins"] if PIN_FILE.is_file() else []


def pin_for(platform_now: dict[str, str]) -> dict | None:
    return next((p for p in read_pins() if p["platform"] == platform_now), None)


def run_pinned(out_dir: Path, extra_args: tuple[str, ...] = ()) -> Path:
    """Run the pinned scenario in a fresh process (one thread) and return its metrics.parquet."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "harness.cli", *PIN_ARGS, *extra_args, "--out", str(out_dir)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"the pinned run failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return out_dir / "metrics.parquet"


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        digests = metrics_digests(pd.read_parquet(run_pinned(Path(tmp) / "run")))
    if "--write" in sys.argv:
        here = platform_fingerprint()
        others = [] if "--only-this-platform" in sys.argv else [p for p in read_pins() if p["platform"] != here]
        PIN_FILE.write_text(json.dumps({"command": "dsv4-drift " + " ".join(PIN_ARGS),
                                        "pins": others + [{"platform": here, "digests": digests}]}, indent=1) + "\n")
        print(f"wrote {PIN_FILE} for {here} ({len(others)} other platform(s) kept)")
    else:
        print(json.dumps(digests, indent=1))


if __name__ == "__main__":
    main()
