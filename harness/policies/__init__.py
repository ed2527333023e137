"""The policies shipped with the gate: default.yaml (see harness.gate_policy for the schema)."""
