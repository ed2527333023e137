"""Blaming a patch: base, each patch alone, all but one and all in one layer-major pass; a patch × layer blame
matrix and a verdict {patch, phase, first layer, metric} (DESIGN §6).

    from harness.attribution.attribute import run_attribution

Modules: `plan` (the variants an attribution runs), `attribute` (running and judging them), `faults` (the
selftest's catalogue of injected faults, written through the public patch API like any plugin).
"""
