"""harness.run.stream_placement: a global stack's streams may wait in host memory between layers
(RunSpec.streams_on_host, set by check_fits when a run on one GPU fits only so). The copies are exact, so every
metric must be the one of a run that keeps them on the device, and nothing may read a placed stream except through
to_device."""

from __future__ import annotations

from typing import Callable

import pandas as pd
import pytest
import torch

from harness.attribution.plan import attribution_variants
from harness.run import benchmark
from harness.run import prefill_sharing
from harness.run import runner as runner_module
from harness.run.memory import predict_memory
from harness.run.prefill_sharing import kept_prefill_keys
from harness.run.runner import LockstepRunner
from harness.run.setup import Overrides, build_run_spec
from harness.run.store import RunStore
from harness.run.stream_placement import host_block_bytes, to_device, to_host
from harness.scenario import find_scenario, load_scenario
from reference.config import get_preset


def _run(tmp_path, name: str, on_host: bool, device: str = "cpu", lanes: bool | None = None) -> RunStore:
    """tiny-smoke, local on, to its logits, with the global stacks' streams placed as asked: base, all, and a variant
    that continues base's prefill (harness.run.prefill_sharing: its decode-only patch), so shares are kept too."""
    spec = build_run_spec(load_scenario(find_scenario("tiny-smoke")), Overrides(patches="all", device=device))[0]
    variants = {v.name: v for v in attribution_variants([c for v in spec.variants for c in v.choices])}
    spec.variants = [variants["base"], variants["only:mma-sparse-decode"], variants["all"]]
    assert len(kept_prefill_keys(spec, spec.stacks())) == 2  # base's prefill, kept in each mode
    spec.streams_on_host = on_host
    store = RunStore(tmp_path / name)
    store.create({})
    runner = LockstepRunner(spec, store)
    runner.HOST_LANES = lanes
    runner.run()
    return store


def _stand_ins(monkeypatch, *readers) -> tuple[dict[int, torch.Tensor], Callable[..., torch.Tensor]]:
    """The runner places a stream as a stand-in without data (the meta device), and `readers`' to_device turns only
    a stand-in back into its stream: any read of a placed stream that bypasses to_device fails. Returns the placed
    streams (by their stand-in's id) and the copy back."""
    placed_streams: dict[int, torch.Tensor] = {}

    def placed(streams: torch.Tensor) -> torch.Tensor:
        stand_in = torch.empty_like(streams, device="meta")
        placed_streams[id(stand_in)] = streams
        return stand_in

    def back(streams: torch.Tensor, device) -> torch.Tensor:
        return placed_streams[id(streams)] if streams.is_meta else to_device(streams, device)

    monkeypatch.setattr(runner_module, "to_host", placed)
    for module in readers:
        monkeypatch.setattr(module, "to_device", back)
    return placed_streams, back


def test_streams_placed_off_the_device_give_the_same_metrics_and_are_read_only_through_to_device(tmp_path,
                                                                                              monkeypatch):
    """Stand-ins make a placed stream a tensor without data (the meta device) that only to_device turns back into
    the stream: any read of a placed stream that bypasses to_device fails, and the metrics (every layer, both lanes,
    the final logits) are those of the run that keeps its streams."""
    kept = _run(tmp_path, "kept", on_host=False, lanes=True)
    placed_streams, back = _stand_ins(monkeypatch, runner_module, prefill_sharing)
    save = RunStore.save_streams
    monkeypatch.setattr(RunStore, "save_streams", lambda self, layer, streams, background=False: save(
        self, layer, {k: back(v, "cpu") for k, v in streams.items()}, background))
    moved = _run(tmp_path, "moved", on_host=True, lanes=True)
    rows = sorted({tuple(v.shape) for v in placed_streams.values()})
    # the three global stacks' streams (every position), at the start and after every layer, and base's global prefill
    # rows (its input and output: the prompt positions), kept on the host for the variant that continues from them
    assert len(rows) == 2 and rows[0][0] < rows[1][0]
    assert sum(v.shape[0] == rows[0][0] for v in placed_streams.values()) >= 2
    pd.testing.assert_frame_equal(pd.read_parquet(moved.metrics_path), pd.read_parquet(kept.metrics_path))


def test_on_a_cpu_placing_moves_nothing_and_the_allocator_rounds_to_powers_of_two():
    x = torch.randn(3, 4)
    assert to_host(x) is x and to_device(x, "cpu") is x
    assert [host_block_bytes(n) for n in (1, 2, 3, 1000, 1024, 1025)] == [1, 2, 4, 1024, 1024, 2048]
    assert host_block_bytes(30784 * 4 * 4096 * 2) == 2**30  # a Flash stream at 30K tokens (1.009 GB): 1 GiB
    assert host_block_bytes(2**30 + 1) == 2**31


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_placed_streams_wait_page_locked_on_the_host_and_give_the_same_metrics(tmp_path, monkeypatch):
    """The same metrics row for row, and between layers every global stack's streams on the host, page-locked (the
    copy in is queued without waiting), the reference's on the device."""
    kept = _run(tmp_path, "kept", on_host=False, device="cuda")
    seen: list[dict[str, tuple[str, bool]]] = []
    run_layer = LockstepRunner.run_layer

    def noting(self, layer, streams, weights=None):
        out = run_layer(self, layer, streams, weights)
        seen.append({k: (v.device.type, v.is_pinned() if v.device.type == "cpu" else False) for k, v in out.items()})
        return out

    monkeypatch.setattr(LockstepRunner, "run_layer", noting)
    moved = _run(tmp_path, "moved", on_host=True, device="cuda")
    assert seen and all(places.pop("reference")[0] == "cuda" for places in seen)
    assert all(places and set(places.values()) == {("cpu", True)} for places in seen)
    pd.testing.assert_frame_equal(pd.read_parquet(moved.metrics_path), pd.read_parquet(kept.metrics_path))
    # the resume state holds the placed streams themselves (RunStore._host_copy): saved once their copies arrived
    (kept_layer, kept_state), (moved_layer, moved_state) = kept.load_streams(), moved.load_streams()
    assert kept_layer == moved_layer and kept_state.keys() == moved_state.keys()
    assert all(torch.equal(kept_state[k], moved_state[k]) for k in kept_state)


def _placing_bench(monkeypatch) -> None:
    """bench's memory check places the streams whatever the device holds (as check_fits does on a GPU too small)."""
    def place(spec, world=1):
        spec.streams_on_host = True
        return predict_memory(spec, world)

    monkeypatch.setattr(benchmark, "check_fits", place)


def test_bench_whose_streams_are_placed_reads_them_only_through_to_device(monkeypatch):
    """`bench` on a GPU its shape fits only with the streams on the host (an attribution-shaped bench at 30K on an
    80 GB card) places them as `run` does: its stacks-alone timing and its lockstep read them back through
    to_device (stand-ins without data fail any other read), and the record says so."""
    _placing_bench(monkeypatch)
    placed_streams, _ = _stand_ins(monkeypatch, runner_module, prefill_sharing, benchmark)
    lines: list[str] = []
    result = benchmark.run_bench(get_preset("tiny"), 200, 2, [1, 2], "cpu", 128, lines.append, trace=False)
    assert result.streams_on_host and placed_streams
    assert any("wait in host memory between layers" in line for line in lines)
    assert [lb.layer for lb in result.layers] == [1, 2] and all(lb.run_s > 0 for lb in result.layers)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_a_bench_with_placed_streams_runs_and_says_so(monkeypatch):
    """The placed bench on a GPU: the page-locked copies (and the blocks locked before timing) for real, traced."""
    _placing_bench(monkeypatch)
    lines: list[str] = []
    result = benchmark.run_bench(get_preset("tiny"), 200, 2, [1, 2], "cuda", 128, lines.append, trace=True)
    assert result.streams_on_host and any("wait in host memory between layers" in line for line in lines)
    assert all(0 < lb.busy_s["run"] < lb.run_s for lb in result.layers)


def test_bench_locks_as_many_host_blocks_as_its_layer_places_before_timing(tmp_path, monkeypatch):
    """_lock_host_blocks: one page-locked block per placed global stream and two (input and output rows) per kept
    global prefill, of their shapes, all freed again (to torch's page-locked cache); nothing without placed streams,
    and nothing when the host refuses to lock memory (to_host copies to ordinary memory then)."""
    spec = build_run_spec(load_scenario(find_scenario("tiny-smoke")), Overrides(patches="all"))[0]
    variants = {v.name: v for v in attribution_variants([c for v in spec.variants for c in v.choices])}
    spec.variants = [variants["base"], variants["only:mma-sparse-decode"], variants["all"]]
    x = LockstepRunner(spec, RunStore(tmp_path / "r")).initial_streams()
    made: list[tuple[tuple[int, ...], bool]] = []
    empty = torch.empty

    def recording(*shape, **kwargs):
        made.append((tuple(shape[0]) if len(shape) == 1 else shape, kwargs.get("pin_memory", False)))
        return empty(*shape, **{k: v for k, v in kwargs.items() if k != "pin_memory"})

    monkeypatch.setattr(torch, "empty", recording)
    benchmark._lock_host_blocks(spec, x)
    stream, rows = tuple(x["base"].shape), (spec.n_prompt, *x["base"].shape[1:])
    globals_ = sum(mode == "global" for _, mode in spec.stacks())
    kept = sum(mode == "global" for mode, _ in kept_prefill_keys(spec, spec.stacks()))
    assert kept == 1 and globals_ == 4  # yardstick, base, only:mma-sparse-decode, all; base's prefill kept
    assert made == [(stream, True)] * globals_ + [(rows, True)] * 2 * kept
    made.clear()
    benchmark._lock_host_blocks(spec, {"reference": x["reference"]})
    assert made == []

    def refusing(*shape, **kwargs):
        raise RuntimeError("cudaHostAlloc failed")

    monkeypatch.setattr(torch, "empty", refusing)
    benchmark._lock_host_blocks(spec, x)  # returns: the run copies to ordinary memory


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_a_stream_copied_out_behind_queued_work_holds_what_that_work_wrote():
    """to_host copies behind the work queued before it: the host tensor, and a copy straight back, hold the values
    that work wrote (not the page-locked buffer's earlier bytes)."""
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(8):  # work queued before the copy out
        x = x * 1.0001 + 1.0
    host = to_host(x)
    assert host.is_pinned() and torch.equal(host, x.cpu())
    assert torch.equal(to_device(host, "cuda"), x)
