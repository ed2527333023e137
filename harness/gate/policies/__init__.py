"""The policies shipped with the gate: default.yaml, and policy.schema.json (the JSON Schema of harness.gate.policy,
which every policy may name on its first line: `# yaml-language-server: $schema=policy.schema.json`)."""
