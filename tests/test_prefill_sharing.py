"""Variants that differ only in decode share one prefill (harness.run.prefill_sharing): the same metrics and findings
bit for bit as running each in full, with fewer prefill chunks computed."""

from __future__ import annotations

import pandas as pd
import pytest

from harness.attribution.plan import attribution_variants
from harness.run.prefill_sharing import kept_prefill_keys, prefill_key
from harness.run.probes import ComparingSink
from harness.run.runner import LockstepRunner
from harness.run.setup import Overrides, build_run_spec
from harness.run.store import RunStore
from harness.scenario import find_scenario, load_scenario
from optimized import engine
from optimized.registry import default_registry

LAYERS = 4  # tiny's first four layers: SWA, SWA, CSA, HCA (reference.config.TINY), so every attention kind decodes


def _run(tmp_path, name: str, share: bool, monkeypatch, variants=None, share_layers: bool = False
         ) -> tuple[RunStore, int]:
    """tiny-smoke's first LAYERS layers with the attribution variants of every built-in patch; the number of prefill
    chunks the engines computed. `share_layers`: local pairs with the same patches acting at a layer share it too
    (off by default here, so the counts are the prefill sharing's alone)."""
    spec = build_run_spec(load_scenario(find_scenario("tiny-smoke")), Overrides(patches="all"))[0]
    spec.variants = variants or attribution_variants(default_registry().choose("all"))
    store = RunStore(tmp_path / name)
    store.create({})
    chunks = []
    forward = engine.OptimizedLayer.forward

    def counting(self, streams, token_ids, state, phase, *args, **kwargs):
        chunks.append(phase)
        return forward(self, streams, token_ids, state, phase, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(engine.OptimizedLayer, "forward", counting)
        m.setattr(LockstepRunner, "SHARE_PREFILL", share)
        m.setattr(LockstepRunner, "SHARE_LAYERS", share_layers)
        LockstepRunner(spec, store).run(end_layer=LAYERS)
    return store, chunks.count("prefill")


@pytest.mark.parametrize("defer_blocks", [False, True], ids=["cpu-path", "gpu-path"])
def test_decode_only_variants_reuse_the_prefill_of_their_peers_bit_for_bit(tmp_path, monkeypatch, defer_blocks):
    """Also with the prefill blocks' comparisons deferred, as on a GPU: then the sink a member continues from still
    holds the leader's last prefill blocks, not yet compared."""
    monkeypatch.setattr(ComparingSink, "DEFER_BLOCKS_ON_CPU", defer_blocks)
    variants = attribution_variants(default_registry().choose("all"))
    decode_only = {c.id for c in default_registry().choose("all") if "prefill" not in c.patch.active_phases(c.options)}
    assert decode_only == {"mma-sparse-decode", "triton-indexer"}  # the built-in patches acting in decode only
    # base, only:<each>, all-but:<each>, all: 14 variants, 10 distinct prefills (base = only:mma = only:triton,
    # all = all-but:mma = all-but:triton)
    assert len(variants) == 14
    assert len({prefill_key(v.choices, "global") for v in variants}) == 10

    shared, n_shared = _run(tmp_path, "shared", True, monkeypatch)
    full, n_full = _run(tmp_path, "full", False, monkeypatch)
    assert n_shared == n_full * 10 // 14  # each mode's prefill chunks computed by 10 variants instead of 14
    a, b = shared.read_metrics(), full.read_metrics()
    assert a.num_rows == b.num_rows > 0
    assert a.equals(b)  # every value, every row, in the same order
    assert shared.read_findings() == full.read_findings()


def test_a_variant_is_not_shared_from_a_prefill_that_differs_from_its_own(tmp_path, monkeypatch):
    """A decode-only patch that puts NaN into its decode steps gives its variant a finding at layer 0; from then on
    its sink notes no more non-finite values, unlike base's, so from layer 1 on it runs its own prefill (in global
    mode its input differs too). The findings and metrics are those of the full run."""
    from optimized.patching import Patch, PatchChoice

    poison = Patch("nan-in-decode", ("decode",), "NaN in every decode step's attention output", source="test")

    @poison.op("sparse_attention")
    def nan_attention(ctx, **inputs):
        out, lse = ctx.base(**inputs)
        return out * float("nan"), lse

    from harness.run.runner import VariantSpec
    variants = [VariantSpec("base", []), VariantSpec("poisoned", [PatchChoice(poison, {})])]
    shared, n_shared = _run(tmp_path, "shared", True, monkeypatch, variants)
    full, n_full = _run(tmp_path, "full", False, monkeypatch, variants)
    assert shared.read_findings() == full.read_findings()
    assert any(f["variant"] == "poisoned" and f["layer"] == 0 and f["phase"] == "decode"
               for f in full.read_findings())
    pd.testing.assert_frame_equal(shared.read_metrics().to_pandas(), full.read_metrics().to_pandas())  # NaN = NaN
    assert n_full // 2 < n_shared < n_full  # layer 0 shared (both modes), the later layers not


def test_the_memory_estimate_counts_the_prefills_a_process_keeps():
    """Local-mode shares hold the leader's output rows during the layer, every share a copy of the state: counted on
    the busiest rank, where pairs share a prefill, when there are decode steps to share it with."""
    from harness.run.memory import predict_memory

    spec = build_run_spec(load_scenario(find_scenario("tiny-smoke")), Overrides(patches="all"))[0]
    assert "shared prefills" not in predict_memory(spec).host_terms  # base and all: nothing shared
    spec.variants = attribution_variants(default_registry().choose("all"))
    term = predict_memory(spec).host_terms["shared prefills"]
    cfg = spec.source.config
    rows = spec.n_total * cfg.hc_mult * cfg.hidden_size * 2  # the bf16 output rows one local share holds
    spec.local = False
    state_copies = predict_memory(spec).host_terms["shared prefills"]  # global: base's and all's, the states only
    assert term == 2 * rows + 2 * state_copies  # local adds two more states and each one's rows
    spec.local = True  # two ranks: each keeps the shares of the groups the deal gives it whole (harness.run.deal)
    state = state_copies / 2
    kept = [kept_prefill_keys(spec, spec.stacks_of_rank(rank, 2)) for rank in range(2)]
    assert sorted(k for keys in kept for k in keys) == sorted(kept_prefill_keys(spec, spec.stacks()))  # none split
    busiest = max(sum(rows * (mode == "local") + state for mode, _ in keys) for keys in kept)
    # the deal puts base's local group (with the pairs that share its layers) on one rank and all's on the other,
    # each beside one global group: one local and one global share per rank
    assert [sorted(mode for mode, _ in keys) for keys in kept] == [["global", "local"]] * 2
    assert predict_memory(spec, world=2).host_terms["shared prefills"] == busiest == rows + 2 * state < term
    spec.decode_ids, spec.turn_of_position = [], spec.turn_of_position[: spec.n_prompt]
    assert "shared prefills" not in predict_memory(spec).host_terms  # nothing is shared without decode steps


def test_a_state_that_cannot_be_copied_is_not_shared(tmp_path, monkeypatch):
    """A plugin that keeps an object deepcopy refuses (a lock) in ctx.state.extras: its variants run in full."""
    import threading

    from harness.run.runner import VariantSpec
    from optimized.patching import Patch, PatchChoice

    keeper = Patch("keeps-a-lock", ("prefill", "decode"), "keeps a lock in the layer's state", source="test")

    @keeper.op("chunk_state_carry")
    def carry(ctx, state):
        state.extras.setdefault("lock", threading.Lock())
        return ctx.base(state=state)

    mma = next(c for c in default_registry().choose("all") if c.id == "mma-sparse-decode")
    variants = [VariantSpec("locked", [PatchChoice(keeper, {})]), VariantSpec("locked+mma", [PatchChoice(keeper, {}), mma])]
    assert prefill_key(variants[0].choices, "local") == prefill_key(variants[1].choices, "local")
    shared, n_shared = _run(tmp_path, "shared", True, monkeypatch, variants)
    full, n_full = _run(tmp_path, "full", False, monkeypatch, variants)
    assert n_shared == n_full
    pd.testing.assert_frame_equal(shared.read_metrics().to_pandas(), full.read_metrics().to_pandas())


def test_a_nan_in_a_shared_prefill_is_each_members_own_finding(tmp_path, monkeypatch):
    """A patch that puts NaN into the MoE output in both phases, alone and with a decode-only patch: the second
    continues from the first's prefill and records the prefill finding as its own, as its full run does."""
    from harness.run.runner import VariantSpec
    from optimized.patching import Patch, PatchChoice

    poison = Patch("nan-moe", ("prefill", "decode"), "NaN in the experts' output", source="test")

    @poison.op("experts")
    def experts(ctx, **inputs):
        return ctx.base(**inputs) * float("nan")

    mma = next(c for c in default_registry().choose("all") if c.id == "mma-sparse-decode")
    variants = [VariantSpec("nan", [PatchChoice(poison, {})]), VariantSpec("nan+mma", [PatchChoice(poison, {}), mma])]
    shared, n_shared = _run(tmp_path, "shared", True, monkeypatch, variants)
    full, n_full = _run(tmp_path, "full", False, monkeypatch, variants)
    findings = full.read_findings()
    assert shared.read_findings() == findings
    assert {(f["variant"], f["mode"]) for f in findings if f["layer"] == 0 and f["phase"] == "prefill"} == {
        (v, m) for v in ("nan", "nan+mma") for m in ("global", "local")}
    pd.testing.assert_frame_equal(shared.read_metrics().to_pandas(), full.read_metrics().to_pandas())
    assert n_shared < n_full  # layer 0 was shared in both modes (from layer 1 on each has a finding: shared again)


def _layers_run(tmp_path, name: str, share_layers: bool, monkeypatch, variants=None) -> tuple[RunStore, list[int]]:
    """As _run, prefill sharing on; the layer of every pair whose layer the engines computed (run_layer calls: a
    pair continuing from a shared prefill counts, one taking a shared layer does not)."""
    layers: list[int] = []
    run_layer = engine.OptimizedModel.run_layer

    def counting(self, block, *args, **kwargs):
        layers.append(block.layer)
        return run_layer(self, block, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(engine.OptimizedModel, "run_layer", counting)
        store, _ = _run(tmp_path, name, True, m, variants, share_layers)
    return store, layers


def _shared_against_full(tmp_path, monkeypatch, variants) -> tuple[list[dict], list[int]]:
    """Runs `variants` with layers shared and with every pair run; asserts the same metrics (NaN = NaN) and
    findings; returns the findings and, per layer, how many pairs the sharing did not compute."""
    shared, computed = _layers_run(tmp_path, "shared", True, monkeypatch, variants)
    full, computed_full = _layers_run(tmp_path, "full", False, monkeypatch, variants)
    findings = full.read_findings()
    assert shared.read_findings() == findings
    pd.testing.assert_frame_equal(shared.read_metrics().to_pandas(), full.read_metrics().to_pandas())
    return findings, [computed_full.count(layer) - computed.count(layer) for layer in range(LAYERS)]


def _nan_experts(pid: str, layers_for):
    """A patch choice putting NaN into the experts' output at the layers `layers_for` names."""
    from optimized.patching import Patch, PatchChoice

    patch = Patch(pid, ("prefill", "decode"), "NaN in the experts' output", source="test", layers_for=layers_for)
    patch.op("experts")(lambda ctx, **inputs: ctx.base(**inputs) * float("nan"))
    return PatchChoice(patch, {})


def test_local_pairs_with_the_same_patches_acting_at_a_layer_share_it_bit_for_bit(tmp_path, monkeypatch):
    """Attribution over the built-in patches on tiny's SWA, SWA, CSA, HCA layers (hash-routed: 0-2): triton-indexer
    and bf16-indexer-gemm act only on CSA layers, hash-topk only on hash layers (Patch.layers_for), so in local mode
    only:<those> compute base's layer and all-but:<those> all's — 2 + 2 pairs on each SWA layer, none on the CSA
    one, 3 + 3 on the HCA one. The metrics and findings are those of every pair run."""
    registry = default_registry()
    cfg = build_run_spec(load_scenario(find_scenario("tiny-smoke")), Overrides())[0].source.config
    acting = {layer: {c.id for c in registry.choose("all") if c.patch.acts_at(cfg, layer, c.options)}
              for layer in range(LAYERS)}
    inert = {layer: len(registry.choose("all")) - len(ids) for layer, ids in acting.items()}
    assert inert == {0: 2, 1: 2, 2: 0, 3: 3}
    shared, computed = _layers_run(tmp_path, "shared", True, monkeypatch)
    full, computed_full = _layers_run(tmp_path, "full", False, monkeypatch)
    for layer in range(LAYERS):  # the only:<inert> and all-but:<inert> pairs, local mode only
        assert computed_full.count(layer) - computed.count(layer) == 2 * inert[layer]
    a, b = shared.read_metrics(), full.read_metrics()
    assert a.num_rows == b.num_rows > 0
    assert a.equals(b)
    assert shared.read_findings() == full.read_findings()


def test_a_patch_runs_only_at_the_layers_it_declares(tmp_path, monkeypatch):
    """Patch.layers_for is enforced: the engine leaves the patch out of the other layers' op chains, whatever its
    op would do there."""
    from harness.run.runner import VariantSpec
    from optimized.patching import Patch, PatchChoice

    called: list[int] = []
    hca_only = Patch("hca-only", ("prefill", "decode"), "notes where its op runs", source="test",
                     layers_for=lambda cfg, layer, options: cfg.layer_kind(layer) == "hca")

    @hca_only.op("hc_prelinear")
    def noting(ctx, **inputs):
        called.append(ctx.layer)
        return ctx.base(**inputs)

    _run(tmp_path, "run", True, monkeypatch, [VariantSpec("v", [PatchChoice(hca_only, {})])])
    assert set(called) == {3}  # tiny's only HCA layer among the first LAYERS


def test_a_shared_layer_keeps_each_pairs_own_nan_history(tmp_path, monkeypatch):
    """`early` puts NaN into the experts' output on SWA layers, `late` from layer 2 on. Local mode: `early+late`
    finds NaN at layer 0, `late` at layer 2 — where both have only `late` acting, but the first already has its
    finding and notes no more, so `late` runs its own layer 2 and finds it; at layer 3 both have their findings and
    `late` takes `early+late`'s layer. The findings and metrics are those of every pair run."""
    from harness.run.runner import VariantSpec

    early = _nan_experts("early", lambda cfg, layer, options: cfg.layer_kind(layer) == "swa")
    late = _nan_experts("late", lambda cfg, layer, options: layer >= 2)
    variants = [VariantSpec("early+late", [early, late]), VariantSpec("late", [late])]
    findings, saved = _shared_against_full(tmp_path, monkeypatch, variants)
    assert {(f["variant"], f["layer"]) for f in findings if f["mode"] == "local"} == {("early+late", 0), ("late", 2)}
    assert saved == [0, 0, 0, 1]


def test_a_nan_first_found_in_a_shared_layer_is_each_takers_own_finding(tmp_path, monkeypatch):
    """`late` puts NaN into the experts' output from layer 2 on; `late+swa` adds a benign patch acting on SWA layers
    only. At layer 2 both have only `late` acting and neither has a finding yet: `late+swa` takes `late`'s local layer
    and its first non-finite value as its own, as its own run finds it. A layers_for that raises names its patch."""
    from harness.run.runner import VariantSpec
    from optimized.patching import Patch, PatchChoice, PluginOpError

    late = _nan_experts("late", lambda cfg, layer, options: layer >= 2)
    swa = Patch("swa", ("prefill", "decode"), "passes the router through", source="test",
                layers_for=lambda cfg, layer, options: cfg.layer_kind(layer) == "swa")
    swa.op("router")(lambda ctx, **inputs: ctx.base(**inputs))
    variants = [VariantSpec("late", [late]), VariantSpec("late+swa", [late, PatchChoice(swa, {})])]
    findings, saved = _shared_against_full(tmp_path, monkeypatch, variants)
    assert {(f["variant"], f["layer"]) for f in findings if f["mode"] == "local"} == {("late", 2), ("late+swa", 2)}
    assert saved == [0, 0, 1, 1]

    broken = Patch("broken", ("decode",), "its layers_for raises", source="test",
                   layers_for=lambda cfg, layer, options: 1 / 0)
    with pytest.raises(PluginOpError, match="patch 'broken' .* layers_for at layer 0: ZeroDivisionError"):
        broken.acts_at(None, 0, {})


def test_a_pair_that_takes_a_layer_keeps_no_prefill_for_it(tmp_path, monkeypatch):
    """Attribution over triton-indexer (decode only, CSA layers) and hash-topk (hash layers): at tiny's HCA layer 3
    every local variant computes base's layer, so base keeps no local prefill share there for only:triton-indexer,
    which takes the whole layer instead (before, base copied its state for it all the same). The rows are those of
    every pair run."""
    from harness.run import prefill_sharing

    registry = default_registry()
    variants = attribution_variants(registry.choose("triton-indexer,hash-topk"))
    kept: list[tuple[str, str, int]] = []
    at_decode = prefill_sharing.PrefillShare.at_decode.__func__

    def noting(cls, state, sink):
        kept.append((sink.variant, sink.mode, sink.layer))
        return at_decode(cls, state, sink)

    monkeypatch.setattr(prefill_sharing.PrefillShare, "at_decode", classmethod(noting))
    shared, _ = _layers_run(tmp_path, "shared", True, monkeypatch, variants)
    assert ("base", "local", 3) not in kept and ("base", "global", 3) in kept
    assert ("base", "local", 2) in kept  # the CSA layer: only:triton-indexer continues base's prefill there
    # the memory estimate's count (kept_prefill_keys at each layer) is what the runner kept, layer by layer
    spec = build_run_spec(load_scenario(find_scenario("tiny-smoke")), Overrides(patches="all"))[0]
    spec.variants = variants
    keys = prefill_sharing.pair_keys(spec, spec.stacks())
    leader = {key: next(p for p, k in keys.items() if k == key) for key in keys.values()}
    for layer in range(LAYERS):
        predicted = sorted(leader[key] for key in kept_prefill_keys(spec, spec.stacks(), layer))
        assert predicted == sorted((v, m) for v, m, at in kept if at == layer), layer
    assert len(kept_prefill_keys(spec, spec.stacks(), 3)) < len(kept_prefill_keys(spec, spec.stacks()))
    full, _ = _layers_run(tmp_path, "full", False, monkeypatch, variants)
    pd.testing.assert_frame_equal(shared.read_metrics().to_pandas(), full.read_metrics().to_pandas())
    assert shared.read_findings() == full.read_findings()
