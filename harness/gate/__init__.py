"""Judging a run: a policy (YAML, every bound derived) evaluated on a run directory's numbers (DESIGN §5).

    from harness.gate.gate_run import gate_run
    result = gate_run("reports/flash-27k-…", policy="default")
    result.exit_code          # 0 pass, 1 regression
    result.failure_lines()    # what failed, where first, by how much

Modules: `policy` (the policy file, as pydantic models), `metric_rules` (how the gate reads each metric),
`expressions` (a policy's numbers: arithmetic over the run's config), `evaluate` (per-unit evaluation),
`baseline` (baselines and the ratchet), `outputs` (console, JSON, JUnit, markdown), `gate_run` (one call),
`policies/` (the shipped default and the policy JSON Schema). The gate reads numbers (metrics.parquet,
findings.json, manifest.json), never pages: nothing here imports `harness.report`.
"""
