"""Running a scenario: the layer-major lockstep of reference, yardstick and variants, probes compared as the
tensors stream past, metrics binned per layer and written to the run store (DESIGN §3, §4).

    from harness.run.setup import build_run_spec      # a Scenario → RunSpec (weights, tokens, variants)
    from harness.run.runner import LockstepRunner     # runs it, layer by layer
    from harness.run.store import RunStore            # manifest.json, metrics.parquet, findings.json, resume state

Modules: `setup`, `runner`, `probes` (recording and comparing sinks), `metrics` (the comparators),
`bins` and `aggregate` (where a position's values land), `store`, `greedy` (greedy decode ids),
`environment` (what the manifest records about the machine), `safetensors_stream` (`forward`'s logits writer),
`host_allocator` (glibc keeps freed host memory for reuse), `deal` (which rank of a sharded run computes which
stack and mode).
Nothing here reads a report or a gate: those read what the store wrote.
"""
