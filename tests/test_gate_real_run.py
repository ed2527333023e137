"""The gate on a real run: a ~150-token, 2-turn chat on the `tiny` preset (all layer kinds, hash layers 0-2),
with a known fault injected — hash-topk with `scale_on: none`, the runner that never applies
routed_scaling_factor (optimized-stack §5.2). The expert ids stay exact (tid2eid), the MoE output of the hash
layers shrinks by 1/1.5. The gate must keep the routing check green and localise the output error to exactly
the hash layers. About 10 s on one CPU core.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from harness.cli.main import main
from harness.cli.pytest_plugin import DriftHarness

SCENARIO = {
    "name": "gate-real-run",
    "model": {"preset": "tiny", "seed": 0},
    "prompt": {"messages": [
        {"role": "user", "content": "Remember the code word falcon-2291 for later. Then read the file and tell me "
                                    "what the function returns when the list is empty, and why the loop stops early.",
         "needles": {"code": "falcon-2291"}},
        {"role": "assistant", "content": "The function returns None for an empty list because the loop body never "
                                         "runs; it stops early at the first negative value."},
        {"role": "user", "content": "Good. Now, what was the code word I gave you at the start?"},
        {"role": "assistant", "content": "The code word is falcon-2291."},
    ]},
    "tokenizer": "fallback",
    "prefill": {"chunk_size": 96},
    # 8 steps into "The code word is falcon-2291.": steps 5 and 6 can only be answered from the needle (needle queries)
    "decode": {"steps": 8, "tokens": "continuation"},
    "stacks": {"reference": {"dtype": "float32"}, "yardstick": True,
               "variants": [{"name": "base", "patches": []}]},
    "measure": {"local": True, "force_decisions": False},
    "probes": {"bin_size": 32, "attn_sample_every": 4, "logits_sample_every": 8},
}

FAULT_POLICY = """\
description: localise a MoE output scale fault
checks:
  - name: hash-routing-exact
    metric: moe.flip_rate
    layers: hash
    modes: [global, local]
    bound: {absolute: 0}
  - name: moe-out-local-patch
    description: "the error each layer's MoE adds by itself (local mode), over the stock engine's"
    metric: moe.out_rel_l2
    modes: [local]
    aggregate: mean
    bound: {base: 2}
"""


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory):
    drift = DriftHarness(tmp_path_factory)
    return drift.run(SCENARIO, patches="hash-topk:scale_on=none")


@pytest.mark.slow
def test_gate_localises_a_missing_routed_scale_to_the_hash_layers(faulty_run, tmp_path):
    policy = tmp_path / "policy.yaml"
    policy.write_text(FAULT_POLICY)
    assert main(["gate", str(faulty_run), "--policy", str(policy), "--junit", str(tmp_path / "gate.xml")]) == 1
    gate = json.loads((faulty_run / "gate.json").read_text())
    assert gate["nonfinite"] == []
    checks = {c["name"]: c for c in gate["checks"]}
    assert checks["hash-routing-exact"]["status"] == "pass"  # ids come from tid2eid: exact whatever the scale
    (patched,) = checks["moe-out-local-patch"]["variants"]
    assert patched["variant"] == "hash-topk"
    failing_layers = sorted({u["layer"] for u in patched["units"] if u["status"] == "fail"})
    assert failing_layers == [0, 1, 2]  # the hash layers, and only they
    assert patched["phases"]["prefill"]["first_failing_layer"] == 0
    cases = list(ET.parse(tmp_path / "gate.xml").getroot().iter("testcase"))
    failed = [(c.get("classname"), c.get("name")) for c in cases if c.find("failure") is not None]
    assert failed == [("dsv4-drift.moe-out-local-patch", "hash-topk")]


@pytest.mark.slow
def test_default_policy_has_data_for_every_check_on_a_real_run(faulty_run):
    """Every check of the shipped policy names a metric, tap and layers the runner really emits."""
    result = DriftHarness().gate(faulty_run, policy="default")
    statuses = {(c.check.name, v.variant): v.status for c in result.checks for v in c.variants}
    assert not [k for k, s in statuses.items() if s in ("no_data", "skipped")], statuses
    assert statuses[("hash-routing-exact", "hash-topk")] == "pass"
    assert statuses[("mhc-doubly-stochastic", "hash-topk")] == "pass"
    assert statuses[("moe-out-rel-l2-patch", "hash-topk")] == "fail"
