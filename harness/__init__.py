"""dsv4-drift's harness: the packages follow the data path

    scenario ─► tokens ─► layer-major lockstep ─► probe stream ─► metrics ─► run store ─► report / gate / attribution

- `harness.scenario`    what to run: the scenario schema and YAML reader, prompts, chat encoding, tokenizers
- `harness.run`         running it: the lockstep runner, probes, metrics, bins, the run store
- `harness.gate`        judging it: policies, per-unit evaluation, baselines, outputs (reads numbers, never pages)
- `harness.report`      showing it: the self-contained HTML report
- `harness.attribution` blaming it: which patch, which phase, which first layer; the selftest's fault catalogue
- `harness.cli`         the `dsv4-drift` commands and the pytest plugin

Dependency rules (tests/test_dependencies.py reads every import to enforce them): `reference/` imports nothing
of ours; `optimized/` imports only `reference/`; `harness.scenario` imports neither `run` nor `report`;
`harness.gate` never imports `report`; only `harness.cli` imports `harness.cli`; no import cycles.
"""
