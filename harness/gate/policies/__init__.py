"""The policies shipped with the gate: default.yaml (see harness.gate.policy for the schema)."""
