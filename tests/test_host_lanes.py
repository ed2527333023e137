"""A layer's stacks in two host threads (harness.run.host_lanes): the deal keeps every patch call in the caller's
thread and order, and a run gives the sequential run's metrics and findings bit for bit. On a GPU the lanes are on
by default; here the CPU runs them (LockstepRunner.HOST_LANES), which checks the bits, not the speed."""

from __future__ import annotations

import threading

import pandas as pd
import pytest
import torch

from harness.attribution.plan import attribution_variants
from harness.run.host_lanes import blamed_lane, cache_holds_every_copy, deal_lanes
from harness.run.runner import LockstepRunner, VariantSpec
from harness.run.setup import Overrides, build_run_spec
from harness.run.store import RunStore
from harness.scenario import find_scenario, load_scenario
from optimized.patching import Patch, PatchChoice
from optimized.registry import default_registry

LAYERS = 4  # tiny's SWA, SWA, CSA and HCA layers (reference.config.TINY)
PAIRS = [("yardstick", "global"), ("yardstick", "local"), ("base", "global"), ("base", "local"),
         ("all", "global"), ("all", "local")]


def test_the_stock_lane_holds_only_pairs_that_run_no_patch_code():
    patched = {"base": False, "all": True}
    assert deal_lanes(PAIRS, patched, {}) == [PAIRS[4:], PAIRS[:4]]
    # forced mode runs the forcing patch, even for a variant without patches of its own
    assert deal_lanes(PAIRS + [("base", "forced")], patched, {}) == [PAIRS[4:] + [("base", "forced")], PAIRS[:4]]


def test_a_stock_prefill_that_a_patched_pair_continues_from_stays_in_the_patched_lane():
    keys = {("base", "global"): "k-g", ("base", "local"): "k-l", ("all", "global"): "k-g"}
    lanes = deal_lanes(PAIRS, {"base": False, "all": True}, keys)
    assert lanes == [[("base", "global"), ("all", "global"), ("all", "local")],
                     [("yardstick", "global"), ("yardstick", "local"), ("base", "local")]]


def test_a_stock_layer_that_a_patched_pair_takes_stays_in_the_patched_lane():
    """At a layer where only:X's patch does not act, only:X/local computes base/local's layer and takes it
    (harness.run.prefill_sharing), so base/local runs in the patched lane there; elsewhere it keeps the stock lane."""
    lanes = deal_lanes(PAIRS, {"base": False, "all": True}, {}, {("base", "local"): "k", ("all", "local"): "k"})
    assert lanes == [[("base", "local"), ("all", "global"), ("all", "local")],
                     [("yardstick", "global"), ("yardstick", "local"), ("base", "global")]]
    assert deal_lanes(PAIRS, {"base": False, "all": True}, {}, {("base", "local"): "k", ("all", "local"): "j"}) == \
        [PAIRS[4:], PAIRS[:4]]


def test_lanes_share_the_layers_one_thread_shares(tmp_path, monkeypatch):
    """Attribution over hash-topk and nvfp4-experts: nothing continues base's prefill (both patches act in prefill),
    so base ran in the stock lane, and at tiny's non-hash layers 3 and 4 only:hash-topk/local, in the patched lane,
    computed base's layer again instead of taking it. Now two lanes compute the pair-layers one does, with its
    metrics and findings."""
    from optimized import engine

    computed: list[int] = []
    run_layer = engine.OptimizedModel.run_layer

    def counting(self, block, *args, **kwargs):
        computed.append(block.layer)
        return run_layer(self, block, *args, **kwargs)

    monkeypatch.setattr(engine.OptimizedModel, "run_layer", counting)
    variants = attribution_variants(default_registry().choose("hash-topk,nvfp4-experts"))
    threads = _noting_threads(monkeypatch)
    lanes = _run(tmp_path, "lanes", True, monkeypatch, variants)
    assert len(set(threads.values())) == 2
    in_lanes = [computed.count(layer) for layer in range(LAYERS)]
    computed.clear()
    sequential = _run(tmp_path, "sequential", False, monkeypatch, variants)
    assert in_lanes == [computed.count(layer) for layer in range(LAYERS)] == [8, 8, 8, 6]
    pd.testing.assert_frame_equal(lanes.read_metrics().to_pandas(), sequential.read_metrics().to_pandas())
    assert lanes.read_findings() == sequential.read_findings()


def test_one_lane_when_either_would_be_empty():
    assert deal_lanes(PAIRS[:4], {"base": False}, {}) == [PAIRS[:4]]
    assert deal_lanes(PAIRS[4:], {"all": True}, {}) == [PAIRS[4:]]


def test_when_both_lanes_failed_the_error_a_sequential_run_would_have_met_is_raised():
    from optimized.patching import PluginOpError

    harness_bug, plugin = RuntimeError("a bug in the stock lane"), PluginOpError("a plugin op raised")
    device_fault = RuntimeError("CUDA error: an illegal memory access was encountered")
    assert blamed_lane({1: harness_bug}, {1: 3}) == 1  # one failure: that one
    assert blamed_lane({0: plugin, 1: harness_bug}, {0: 4, 1: 3}) == 0  # a plugin's error: the patched lane's
    # a device fault in the stock lane after the patched lane's kernels ran: theirs (a sequential run had finished
    # the stock pairs before any patched kernel)
    assert blamed_lane({0: RuntimeError("boom"), 1: device_fault}, {0: 4, 1: 2}) == 0
    assert blamed_lane({0: RuntimeError("boom"), 1: harness_bug}, {0: 4, 1: 2}) == 1  # else the earlier pair
    assert blamed_lane({0: RuntimeError("boom"), 1: KeyboardInterrupt()}, {0: 1, 1: 2}) == 1  # Ctrl-C wins


def test_the_lanes_rule_predicts_the_layers_fill():
    """The runner runs the lanes when the layer's fill made every fp32 copy before its first stack
    (runner.ReferencePass.filled): a cache that runs out admits whichever thread asks first, and an admitted weight
    may take another GEMM path (DenseCache.bf16_exact). cache_holds_every_copy predicts the fill from the config alone
    (for the memory estimate and bench/lanes_ab.py): the two agree at the budget's edge, at every layer, with
    nvfp4-experts among the patches — its forms need no room of their own (the test below)."""
    from reference.weights.dense_cache import DenseCache, dense_specs, layer_dense_bytes

    spec = build_run_spec(load_scenario(find_scenario("tiny-smoke")), Overrides(patches="all"))[0]
    cfg, cpu = spec.source.config, torch.device("cpu")
    for layer in range(cfg.num_hidden_layers):
        fp32, experts = layer_dense_bytes(cfg, layer)
        assert 0 < experts < fp32
        weights = spec.source.layer(layer, cpu)
        for budget in (fp32, fp32 - 1):
            filled = DenseCache(budget).fill([t.name for t in dense_specs(cfg, layer)], weights.stored, cpu)
            assert filled == cache_holds_every_copy(spec, layer, budget) == (budget == fp32), (layer, budget)


def _noting_threads(monkeypatch) -> dict[str, int]:
    """The thread each engine variant runs in (by name), filled in as the runner runs them."""
    threads = {}
    run_engine = LockstepRunner._run_engine

    def noting_thread(self, name, mode, *args, **kwargs):
        threads[name] = threading.get_ident()
        return run_engine(self, name, mode, *args, **kwargs)

    monkeypatch.setattr(LockstepRunner, "_run_engine", noting_thread)
    return threads


def test_a_dense_cache_too_small_for_every_copy_keeps_one_lane(tmp_path, monkeypatch):
    threads = _noting_threads(monkeypatch)
    _run(tmp_path, "small-cache", True, monkeypatch, cache_bytes=64 << 10)
    assert "base" in threads and len(threads) == 2 and set(threads.values()) == {threading.get_ident()}, threads


def test_with_room_for_the_copies_only_two_lanes_give_a_roomy_sequential_runs_bits(tmp_path, monkeypatch,
                                                                                   tensor_cores_on_cpu):
    """What the lanes rest on: once a layer's fp32 copies are cached, what a lane still puts into the cache changes no
    path. Tensor cores on (the tensor_cores_on_cpu fixture), with every other expert matrix's NVFP4 factor taken as
    not derivable (reference.quant.nvfp4_factors_from_mx's derivable: values below 2^-119 make it so), so that those
    operands are kept forms while there is room, else made as their GEMMs run (base_ops.nvfp4_operand_made), beside
    the copies and factors of the rest. A cache with room for the copies only, in two lanes and in one, gives the
    metrics of a roomy cache in one lane bit for bit, and did make operands on use — and the experts' GEMMs read bf16
    copies kept in the roomy cache, cast per chunk in the tight one; the old fallback (fp32 GEMMs for a matrix kind
    with a form not kept) changes them, so the comparison sees a change of path."""
    from optimized import base_ops, numerics
    from optimized.patches import nvfp4_experts as nv
    from reference.weights.dense_cache import DenseCache, layer_dense_bytes

    tensor_cores_on_cpu()
    factors_from_mx = base_ops.nvfp4_factors_from_mx

    def every_other_not_derivable(*args, **kwargs):
        c, global_scales, derivable = factors_from_mx(*args, **kwargs)
        return c, global_scales, derivable & (torch.arange(len(derivable)) % 2 == 1)
    monkeypatch.setattr(base_ops, "nvfp4_factors_from_mx", every_other_not_derivable)
    made = []
    operand_made = nv.nvfp4_operand_made

    def noting(*args):
        made.append(args[1])
        return operand_made(*args)
    monkeypatch.setattr(nv, "nvfp4_operand_made", noting)
    cfg = build_run_spec(load_scenario(find_scenario("tiny-smoke")), Overrides())[0].source.config
    copies_only = max(layer_dense_bytes(cfg, layer)[0] for layer in range(LAYERS))

    def metrics(name: str, lanes: bool, cache_bytes: int) -> pd.DataFrame:
        return _run(tmp_path, name, lanes, monkeypatch, cache_bytes=cache_bytes).read_metrics().to_pandas()

    # the stock experts' grouped GEMMs too (a GPU's path), which read the experts' bf16 copies where the cache keeps
    # them (DenseCache.bf16_stack) and cast the fp32 copies per chunk where it does not, as nvfp4-experts' block
    # products read the bf16 copies or the fp32 ones
    monkeypatch.setattr(numerics, "grouped_products_apply", lambda x, width: True)
    stacks = []
    bf16_stack = DenseCache.bf16_stack

    def noting_stacks(self, names):
        stack = bf16_stack(self, names)
        stacks.append(stack is not None)
        return stack
    monkeypatch.setattr(DenseCache, "bf16_stack", noting_stacks)
    in_place, bf16_sources = [], []  # groups read where they lie; block products made from bf16 copies
    rows_of_one_stack, scaled = numerics._rows_of_one_stack, numerics.scaled_bf16_products

    def noting_views(ws):
        view = rows_of_one_stack(ws)
        in_place.append(view is not None)
        return view

    def noting_sources(x, weights, *args):
        bf16_sources.extend(w.source_bf16 is not None for w in weights if not callable(w) and w.factor is not None)
        return scaled(x, weights, *args)
    monkeypatch.setattr(numerics, "_rows_of_one_stack", noting_views)
    monkeypatch.setattr(numerics, "scaled_bf16_products", noting_sources)

    roomy = metrics("roomy", False, 1 << 30)
    assert not made, "a roomy cache keeps every form"
    assert stacks and all(stacks), "a roomy cache keeps the experts' bf16 copies"
    assert in_place and all(in_place) and bf16_sources and all(bf16_sources), "…and the GEMMs read them"
    for noted in (stacks, in_place, bf16_sources):
        noted.clear()
    threads = _noting_threads(monkeypatch)
    pd.testing.assert_frame_equal(metrics("tight-lanes", True, copies_only), roomy)
    assert made and len(set(threads.values())) == 2, "operands made on use, in two lanes"
    assert stacks and not any(stacks), "no room for the experts' bf16 copies: cast per chunk"
    assert not any(in_place) and bf16_sources and not any(bf16_sources)
    pd.testing.assert_frame_equal(metrics("tight", False, copies_only), roomy)

    def kept_only(ctx, names):  # the rule before: tensor cores only when every operand is kept, else fp32 GEMMs
        operands = [nv.nvfp4_operand(ctx, name, nv._nvfp4_format(ctx)) for name in names]
        return None if any(o is None for o in operands) else operands
    monkeypatch.setattr(nv, "_tensor_core_operands", kept_only)
    with pytest.raises(AssertionError):
        pd.testing.assert_frame_equal(metrics("fallback", False, copies_only), roomy)


def test_the_stock_lane_admits_nothing_into_the_dense_cache(tmp_path, monkeypatch):
    """Every fp32 copy (and NVFP4 form) a layer's stacks use is admitted from the caller's thread — by the layer's
    fill before its first stack, or by the patched lane's own conversions — never by the stock lane, while a patch
    may write ctx.dense. (The reference reads every weight too, so this holds without the fill; it fails as soon as a
    stock stack reads a form that nothing in the caller's thread made before the lanes started.)"""
    from reference.weights.dense_cache import DenseCache

    threads = _noting_threads(monkeypatch)
    admitted: list[int] = []
    put = DenseCache.put  # every admission goes through it (get, fill, the NVFP4 forms)

    def noting(self, *args, **kwargs):
        admitted.append(threading.get_ident())
        return put(self, *args, **kwargs)
    monkeypatch.setattr(DenseCache, "put", noting)
    _run(tmp_path, "admissions", True, monkeypatch)
    assert len(set(threads.values())) == 2, "the stock lane ran in its own thread"
    assert admitted and set(admitted) == {threading.get_ident()}


def _run(tmp_path, name: str, lanes: bool, monkeypatch, variants=None, device: str = "cpu",
         yardstick: bool = True, cache_bytes: int | None = None) -> RunStore:
    """tiny-smoke's first LAYERS layers with every patch, local on, in two lanes or one (`cache_bytes`: each layer's
    dense-cache budget instead of the device's)."""
    from reference.weights.dense_cache import DenseCache

    spec = build_run_spec(load_scenario(find_scenario("tiny-smoke")), Overrides(patches="all", device=device))[0]
    spec.local, spec.yardstick = True, yardstick
    if variants is not None:
        spec.variants = variants
    store = RunStore(tmp_path / name)
    store.create({})
    with monkeypatch.context() as m:
        m.setattr(LockstepRunner, "HOST_LANES", lanes)
        if cache_bytes is not None:
            m.setattr(DenseCache, "for_device", classmethod(lambda cls, device, sharing=1: cls(cache_bytes)))
        LockstepRunner(spec, store).run(end_layer=LAYERS)
    return store


def _recording_patch(calls: list) -> Patch:
    """A plugin that remembers the thread and the order of its calls, as one with state between calls would see
    them."""
    patch = Patch("recorder", ("prefill", "decode"), "records its calls", source="test")

    @patch.op("router")
    def router(ctx, **inputs):
        calls.append((threading.get_ident(), ctx.layer, ctx.phase, int(ctx.positions[0])))
        return ctx.base(**inputs)
    return patch


def test_two_lanes_give_the_sequential_metrics_findings_and_patch_calls(tmp_path, monkeypatch):
    """Every metric row in the same order, the same findings (one stack with NaN in its decode steps), and the
    plugin called from the caller's thread in the same order."""
    # acting in prefill too, so that base's prefill is its own and base runs in the stock lane
    poison = Patch("nan-in-decode", ("prefill", "decode"), "NaN in every decode step's attention output",
                   source="test")

    @poison.op("sparse_attention")
    def nan_attention(ctx, **inputs):
        out, lse = ctx.base(**inputs)
        return (out * float("nan") if ctx.phase == "decode" else out), lse

    def variants(calls: list) -> list[VariantSpec]:
        return [VariantSpec("base", []), VariantSpec("all", default_registry().choose("all")),
                VariantSpec("recorded", [PatchChoice(_recording_patch(calls), {})]),
                VariantSpec("poisoned", [PatchChoice(poison, {})])]

    from optimized import base_ops

    stock_attention = base_ops.BASE_OPS["sparse_attention"]

    def nan_in_decode(ctx, **inputs):  # the stock op: NaN in decode, so base has findings in the stock lane too
        out, lse = stock_attention(ctx, **inputs)
        return (out * float("nan") if ctx.phase == "decode" else out), lse

    monkeypatch.setitem(base_ops.BASE_OPS, "sparse_attention", nan_in_decode)
    threads = _noting_threads(monkeypatch)
    calls_seq, calls_lanes = [], []
    sequential = _run(tmp_path, "sequential", False, monkeypatch, variants(calls_seq))
    lanes = _run(tmp_path, "lanes", True, monkeypatch, variants(calls_lanes))
    assert threads["base"] != threads["all"] == threading.get_ident()  # base ran in the stock lane's thread
    pd.testing.assert_frame_equal(lanes.read_metrics().to_pandas(), sequential.read_metrics().to_pandas())  # NaN=NaN
    assert lanes.read_findings() == sequential.read_findings()
    # in stack order: base's (global and local) from the stock lane first, then the patched lane's
    found = [f["variant"] for f in lanes.read_findings()]
    assert found[:2] == ["base", "base"] and found.count("poisoned") == 2, found
    assert calls_lanes and [c[1:] for c in calls_lanes] == [c[1:] for c in calls_seq]
    assert {c[0] for c in calls_lanes} == {threading.get_ident()}


def test_a_plugin_error_stops_the_stock_lane_at_its_next_pair(tmp_path, monkeypatch):
    """The patched lane fails (a plugin op raises) while the stock lane runs base/global: the stock lane runs no
    further pair, and the run stops with the plugin's error, naming its pair."""
    from optimized.patching import PluginOpError

    broken = Patch("broken", ("prefill", "decode"), "raises", source="test")
    base_started = threading.Event()

    @broken.op("router")
    def router(ctx, **inputs):
        base_started.wait(60)  # fails while the stock lane is inside base/global
        raise ValueError("a plugin bug")

    ran, stops = [], []
    run_engine, run_pairs = LockstepRunner._run_engine, LockstepRunner._run_pairs

    def noting_stop(self, *args):
        stops.append(args[-1])  # the lanes' stop event
        return run_pairs(self, *args)

    def slow_base_global(self, name, mode, *args, **kwargs):
        ran.append((name, mode))
        if (name, mode) == ("base", "global"):
            base_started.set()
            assert stops[0].wait(60)  # the patched lane has failed: this pair ends, and no other starts
        return run_engine(self, name, mode, *args, **kwargs)

    monkeypatch.setattr(LockstepRunner, "_run_pairs", noting_stop)
    monkeypatch.setattr(LockstepRunner, "_run_engine", slow_base_global)
    with pytest.raises(PluginOpError, match="a plugin bug"):
        _run(tmp_path, "stopped", True, monkeypatch,  # no yardstick: base/global is the stock lane's first pair
             [VariantSpec("base", []), VariantSpec("broken", [PatchChoice(broken, {})])], yardstick=False)
    assert ("base", "global") in ran and ("base", "local") not in ran
    failure = RunStore(tmp_path / "stopped").read_manifest()["failure"]
    assert (failure["layer"], failure["stack"], failure["mode"]) == (0, "broken", "global")


def test_ctrl_c_while_waiting_for_the_stock_lane_stops_it_at_its_next_pair(tmp_path, monkeypatch):
    """Ctrl-C (a real SIGINT) once the patched lane has ended, while this thread waits for the stock lane inside
    base/global: the stock lane starts no further pair and has ended when the run stops; the manifest says
    interrupted, at the pair that was running."""
    import os
    import signal
    import sys
    import time

    main = threading.get_ident()
    patched_done, after = threading.Event(), []
    run_engine, run_pairs = LockstepRunner._run_engine, LockstepRunner._run_pairs

    stops = []

    def noting_end(self, *args):
        stops.append(args[-1])  # the lanes' stop event
        out = run_pairs(self, *args)
        if threading.get_ident() == main:
            patched_done.set()
        return out

    def interrupted_base_global(self, name, mode, *args, **kwargs):
        if threading.get_ident() != main:
            if (name, mode) == ("base", "global"):
                assert patched_done.wait(60)
                while sys._current_frames()[main].f_code.co_name != "wait":  # the caller waits for this lane
                    time.sleep(0.001)
                os.kill(os.getpid(), signal.SIGINT)
                assert stops[0].wait(60)  # the caller's handler has run: this pair ends, and no other starts
            else:
                after.append((name, mode))
        return run_engine(self, name, mode, *args, **kwargs)

    monkeypatch.setattr(LockstepRunner, "_run_pairs", noting_end)
    monkeypatch.setattr(LockstepRunner, "_run_engine", interrupted_base_global)
    # Ctrl-C's own handler, whatever this process inherited: a shell starts a background job with SIGINT ignored,
    # and Python then installs none (pytest run as `cmd &` failed here, the signal never arriving)
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            _run(tmp_path, "interrupted", True, monkeypatch,
                 [VariantSpec("base", []), VariantSpec("recorded", [PatchChoice(_recording_patch([]), {})])],
                 yardstick=False)
    finally:
        signal.signal(signal.SIGINT, inherited)
    assert after == [] and not any(t.name.endswith("stock lane") for t in threading.enumerate())
    manifest = RunStore(tmp_path / "interrupted").read_manifest()
    assert manifest["status"] == "interrupted"
    assert (manifest["failure"]["stack"], manifest["failure"]["mode"]) == ("base", "global")


def test_an_error_in_the_stock_lane_stops_the_run_naming_its_pair(tmp_path, monkeypatch):
    """The stock lane fails (base, local) while the patched lane runs: the run stops after both end, and the
    manifest names the pair that failed."""
    run_engine = LockstepRunner._run_engine

    def failing(self, name, mode, *args, **kwargs):
        if (name, mode) == ("base", "local"):
            raise RuntimeError("kernel fault in the stock lane")
        return run_engine(self, name, mode, *args, **kwargs)

    monkeypatch.setattr(LockstepRunner, "_run_engine", failing)
    with pytest.raises(RuntimeError, match="stock lane"):
        _run(tmp_path, "failed", True, monkeypatch)
    manifest = RunStore(tmp_path / "failed").read_manifest()
    assert manifest["status"] == "failed"
    assert (manifest["failure"]["layer"], manifest["failure"]["stack"], manifest["failure"]["mode"]) == \
        (0, "base", "local")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_two_lanes_give_the_sequential_bits(tmp_path, monkeypatch):
    """On a GPU (where the lanes are on by default) both threads queue on one stream: the same kernels on the same
    inputs, so the same bits — with the CUDA graph replays and the dense cache that both lanes use."""
    with torch.inference_mode():  # as the CLI runs
        lanes = _run(tmp_path, "lanes", True, monkeypatch, device="cuda")
        sequential = _run(tmp_path, "sequential", False, monkeypatch, device="cuda")
    pd.testing.assert_frame_equal(lanes.read_metrics().to_pandas(), sequential.read_metrics().to_pandas())


def test_the_memory_estimate_counts_the_experts_bf16_stacks_that_fit_beside_the_copies(monkeypatch):
    """On a GPU the dense cache may keep one bf16 stack per expert matrix kind (w1, w3, w2: a sixth of the experts'
    fp32 bytes each) beside the fp32 copies, each whole or not at all (DenseCache.bf16_stack): the estimate counts
    as many as the budget has room for — all three, one, none — and none on a CPU."""
    from harness.run.memory import predict_memory
    from reference.weights.dense_cache import DEVICE_BUDGET_FRACTION, layer_dense_bytes

    spec = build_run_spec(load_scenario(find_scenario("tiny-smoke")), Overrides(patches="none"))[0]
    cfg = spec.source.config
    sizes = [layer_dense_bytes(cfg, layer) for layer in range(cfg.num_hidden_layers)]
    dense, experts = max(fp32 for fp32, _ in sizes), max(e for _, e in sizes)
    kind = experts // 6
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    cpu = predict_memory(spec).host_terms["dequantized weights (shared)"]
    assert cpu == dense
    spec.device = "cuda"
    # a few bytes either side of each edge: the budget is int(total_memory · DEVICE_BUDGET_FRACTION), rounded
    for budget, stacks in ((dense + 3 * kind + 5, 3), (dense + kind + 5, 1), (dense + kind - 100, 0)):
        gpu = type("Props", (), {"total_memory": int(budget / DEVICE_BUDGET_FRACTION) + 1})()
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device, gpu=gpu: gpu)
        assert predict_memory(spec).device_terms["dequantized weights (shared)"] == dense + stacks * kind, stacks


def test_the_memory_estimate_counts_the_second_lanes_working_set(monkeypatch):
    """One process on a GPU with stock and patched stacks holds two prefill chunks' temporaries at once; on a CPU, with
    only stock stacks, or sharded (one lane per rank), it holds one."""
    from harness.run.memory import predict_memory

    gpu = type("Props", (), {"total_memory": 10 * 2**40})()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: gpu)
    spec = build_run_spec(load_scenario(find_scenario("tiny-smoke")), Overrides(patches="all"))[0]
    assert "second host lane" not in predict_memory(spec).device_terms  # a CPU run: no device terms at all
    assert "second host lane" not in predict_memory(spec).host_terms
    spec.device = "cuda"
    terms = predict_memory(spec).device_terms
    cfg = spec.source.config
    chunk = min(spec.n_total, spec.chunk_size) * 4 * (
        3 * cfg.num_attention_heads * cfg.head_dim + 2 * cfg.num_experts_per_tok * cfg.hidden_size)
    # the peak holds two chunks' temporaries at once, unless the reference's own pass (alone) needs more
    assert terms["working set"] + terms["second host lane"] == 2 * chunk
    assert "second host lane" not in predict_memory(spec, world=2).device_terms
    spec.variants = [v for v in spec.variants if not v.choices]  # base only: every stack in one lane
    assert "second host lane" not in predict_memory(spec).device_terms
