"""`dsv4-drift run` end to end: the run directory, resume after a kill, findings, the CLI's exit codes."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

from harness.cli.main import main
from harness.run.runner import LockstepRunner
from harness.run.store import METRICS_SCHEMA, RunStore

CANONICAL_METRICS = {
    "streams.rel_l2", "streams.cosine", "streams.sqnr_db", "attn.tv", "attn.kl", "attn.js", "attn.out_rel_l2",
    "attn.lse_delta", "indexer.recall", "indexer.mass_recall", "indexer.boundary_recall", "indexer.fp8_boundary_recall", "indexer.flips",
    "mhc.pre_rel_err", "mhc.post_rel_err", "mhc.comb_rel_err", "mhc.ds_residual", "moe.flip_rate", "moe.weight_l1",
    "logits.kl", "logits.top1_agree", "ctx.earlier_turn_mass_ref", "ctx.earlier_turn_mass_opt", "ctx.needle_recall",
}
"""The canonical metric names the report, the gate and users rely on (issue: Probes and metrics)."""


def sorted_metrics(path: Path) -> pd.DataFrame:
    df = pd.read_parquet(path)
    keys = [c for c in METRICS_SCHEMA.names if c not in ("value", "max", "count")]
    return df.sort_values(keys).reset_index(drop=True)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs") / "tiny"
    assert main(["run", "tiny-smoke", "--out", str(out), "--no-report", "--no-gate"]) == 0
    return out


def test_run_directory_holds_manifest_metrics_and_every_canonical_metric(tiny_run):
    manifest = json.loads((tiny_run / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["wall_seconds"] > 0
    assert json.loads((tiny_run / "findings.json").read_text()) == [], "a clean run has no NaN/Inf finding"
    for key in ("scenario", "model", "prompt", "stacks", "environment", "started", "finished"):
        assert key in manifest, key
    env = manifest["environment"]
    assert env["torch"] and "device_name" in env and "compute_capability" in env
    assert manifest["model"]["weights"]["seed"] == 0
    df = pd.read_parquet(tiny_run / "metrics.parquet")
    assert set(METRICS_SCHEMA.names) <= set(df.columns)
    layers = manifest["model"]["config"]["num_hidden_layers"]
    assert set(df["layer"]) == set(range(layers + 1))  # + the final logits row
    assert CANONICAL_METRICS <= set(df["metric"]), CANONICAL_METRICS - set(df["metric"])
    for phase in ("prefill", "decode"):
        assert CANONICAL_METRICS - {"ctx.needle_recall", "indexer.boundary_recall", "indexer.fp8_boundary_recall"} <= set(
            df[df["phase"] == phase]["metric"]), phase
    # every metric can be read against the yardstick at the same place
    assert {"yardstick", "base", "all"} <= set(df["variant"])


def test_killed_run_resumes_to_identical_metrics(tmp_path, tiny_run):
    """Issue: a run killed at a random layer and resumed gives the same metrics.parquet as an uninterrupted run."""
    out = tmp_path / "killed"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "harness.cli.main", "run", "tiny-smoke", "--out", str(out), "--no-report",
                             "--no-gate"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    kill_after = random.Random(1234).randint(1, 4)  # a layer in the middle of the 5-layer model
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if (out / "parts" / f"layer-{kill_after - 1:03d}.parquet").exists():
            break
        time.sleep(0.02)
    assert proc.poll() is None, "the run finished before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    store = RunStore(out)
    done = store.completed_layers()
    assert done and max(done) < 5 and store.read_manifest()["status"] == "running"
    assert main(["run", "--resume", str(out), "--no-report", "--no-gate"]) == 0
    pd.testing.assert_frame_equal(sorted_metrics(out / "metrics.parquet"), sorted_metrics(tiny_run / "metrics.parquet"))
    # the cost of both segments is on record: the killed one's up to its last reported layer (the kill lands
    # between a layer's metrics and its progress event, so one layer earlier at worst)
    manifest = store.read_manifest()
    first, second = manifest["segments"]
    assert first["start_layer"] == 0 and first["last_layer"] >= kill_after - 2 and first["seconds"] > 0
    assert second["start_layer"] <= max(done) + 1 and second["last_layer"] == 4
    assert manifest["wall_seconds"] == pytest.approx(first["seconds"] + second["seconds"], abs=0.02)
    assert "peak_host_rss_gib" in manifest and "peak_host_rss_gib" not in first


def test_resume_from_an_older_state_rewrites_later_layers_identically(tmp_path, tiny_run, monkeypatch):
    """Large runs save their resume state at most once a minute, so a kill can leave metrics of layers past the
    saved state; resuming recomputes them from the state and must write the same numbers."""
    monkeypatch.setattr(LockstepRunner, "STATE_SMALL_BYTES", 0)  # every state counts as large …
    monkeypatch.setattr(LockstepRunner, "STATE_EVERY_S", 1e9)  # … and no minute passes: only the last layer saves
    written = []
    real_write = RunStore.write_layer

    def write_then_die(self, layer, rows, background=False):
        real_write(self, layer, rows, background)
        written.append(layer)
        if layer == 3:
            raise KeyboardInterrupt  # the kill, right after layer 3's metrics reached the disk

    monkeypatch.setattr(RunStore, "write_layer", write_then_die)
    out = tmp_path / "killed"
    assert main(["run", "tiny-smoke", "--out", str(out), "--no-report", "--no-gate"]) == 130  # interrupted
    store = RunStore(out)
    assert store.completed_layers() == [0, 1, 2, 3] and not store.state_path.exists()
    assert set(pd.read_parquet(out / "metrics.parquet")["layer"]) == {0, 1, 2, 3}  # refreshed before it stopped
    manifest = store.read_manifest()
    assert manifest["status"] == "interrupted" and manifest["failure"]["layer"] == 3
    monkeypatch.setattr(RunStore, "write_layer", real_write)
    assert main(["run", "--resume", str(out), "--no-report", "--no-gate"]) == 0
    assert [s["start_layer"] for s in store.read_manifest()["segments"]] == [0, 0]
    pd.testing.assert_frame_equal(sorted_metrics(out / "metrics.parquet"), sorted_metrics(tiny_run / "metrics.parquet"))


def test_a_resumed_run_lets_go_of_its_loaded_state_once_its_streams_are_placed(tmp_path, monkeypatch):
    """A resume loads every stack's streams from state/streams.pt (an attribution's at 30K: ~17 GB of host memory).
    Once the runner has its own (moved to the device, or placed), the loaded copies must not stay referenced by the
    callers for the whole pass: none may be alive when the second resumed layer starts."""
    import weakref

    real_write = RunStore.write_layer

    def write_then_die(self, layer, rows, background=False):
        real_write(self, layer, rows, background)
        if layer == 1:
            raise KeyboardInterrupt

    monkeypatch.setattr(RunStore, "write_layer", write_then_die)
    out = tmp_path / "stopped"
    assert main(["run", "tiny-smoke", "--out", str(out), "--no-report", "--no-gate"]) == 130
    monkeypatch.setattr(RunStore, "write_layer", real_write)
    loaded: list[weakref.ref] = []
    real_load, real_layer = RunStore.load_streams, LockstepRunner.run_layer

    def load(self):
        layer, streams = real_load(self)
        loaded.extend(weakref.ref(t) for t in streams.values())
        return layer, streams

    alive_at: dict[int, int] = {}

    def run_layer(self, layer, streams, weights=None):
        alive_at[layer] = sum(r() is not None for r in loaded)
        return real_layer(self, layer, streams, weights)

    monkeypatch.setattr(RunStore, "load_streams", load)
    monkeypatch.setattr(LockstepRunner, "run_layer", run_layer)
    assert main(["run", "--resume", str(out), "--no-report", "--no-gate"]) == 0
    first = min(alive_at)
    assert loaded and first > 0 and alive_at[first] == len(loaded)  # the first resumed layer reads them (on a CPU)
    assert all(alive_at[layer] == 0 for layer in alive_at if layer > first), alive_at


def test_a_resumed_rank_keeps_only_the_loaded_streams_of_its_own_stacks(tmp_path, monkeypatch):
    """A sharded run's rank (ShardedRunner.own_stacks: its share) resumes from a state that holds every stack's
    streams; it keeps the reference's and its own global stacks' — what its memory estimate counts — not every one
    on its device for the first resumed layer."""
    from harness.run.setup import Overrides, build_run_spec
    from harness.scenario import find_scenario, load_scenario

    spec = build_run_spec(load_scenario(find_scenario("tiny-smoke")), Overrides(patches="all"))[0]
    store = RunStore(tmp_path / "r")
    store.create({})
    runner = LockstepRunner(spec, store)
    loaded = {k: v.clone() for k, v in runner.initial_streams().items()}
    assert {"reference", "yardstick", "base"} <= set(loaded) and len(loaded) >= 4
    monkeypatch.setattr(LockstepRunner, "own_stacks", lambda self: [("base", "global"), ("base", "local")])
    given: list[set[str]] = []
    monkeypatch.setattr(LockstepRunner, "run_layer", lambda self, layer, streams, weights=None: given.append(
        set(streams)) or streams)
    runner.run(1, loaded, end_layer=2)
    assert given == [{"reference", "base"}] and not loaded


def test_metrics_parquet_is_refreshed_in_the_background_and_whole_once_flushed(tmp_path, monkeypatch):
    """A run's thread does not wait for metrics.parquet's rewrite (O(rows so far) per layer): writes made while a
    combine runs are served by one more, flush_metrics() returns with every part in the file, and a combine's
    error is raised in the caller's thread."""
    import threading

    store = RunStore(tmp_path / "r")
    store.create({"format": "dsv4-drift-run/1"})
    release, calls, real_combine = threading.Event(), [], RunStore.combine

    def held_combine(self):
        calls.append(1)
        assert release.wait(30)
        real_combine(self)

    monkeypatch.setattr(RunStore, "combine", held_combine)

    def rows(layer: int) -> list[dict]:
        return [{"variant": "base", "mode": "global", "layer": layer, "phase": "prefill", "chunk": 0, "step": -1,
                 "turn": 0, "pos_bin": 0, "pos_end": 8, "tap": "x", "metric": "m", "value": 1.0, "max": 1.0,
                 "count": 8}]

    for layer in range(3):
        store.write_layer(layer, rows(layer), background=True)  # returns while the first combine is held
    assert store.completed_layers() == [0, 1, 2] and not store.metrics_path.exists()
    release.set()
    store.flush_metrics()
    assert sorted(pd.read_parquet(store.metrics_path)["layer"]) == [0, 1, 2] and len(calls) <= 2

    def failing_combine(self):
        raise OSError("no space left on device")

    monkeypatch.setattr(RunStore, "combine", failing_combine)
    store.write_layer(3, rows(3), background=True)
    with pytest.raises(OSError, match="no space left"):
        store.flush_metrics()
    store.flush_metrics()  # raised once
    store.write_layer(4, rows(4), background=True)  # fails in the background again
    for thread in threading.enumerate():
        if thread.name == "dsv4-drift-metrics":
            thread.join()
    monkeypatch.setattr(RunStore, "combine", real_combine)  # the disk has room again
    with pytest.raises(OSError, match="no space left"):
        store.write_layer(5, rows(5), background=True)  # the error, at the next layer: the run stops there …
    store.flush_metrics()  # … and its stop's flush catches the file up with every part
    assert sorted(pd.read_parquet(store.metrics_path)["layer"]) == [0, 1, 2, 3, 4, 5]


def _findings_with_plugin(out: Path, plugin: Path, patch: str, *args: str) -> list[dict]:
    """Run tiny-smoke with `patch` from the plugin file (no report, no gate; it must finish) and read its findings."""
    assert main(["run", "tiny-smoke", "--out", str(out), "--no-report", "--no-gate", *args, "--patches", patch,
                 "--patch-module", str(plugin)]) == 0
    return json.loads((out / "findings.json").read_text())


def test_nan_in_a_stack_is_recorded_with_layer_tap_and_phase_and_the_run_finishes(tmp_path):
    plugin = tmp_path / "nan_plugin.py"
    plugin.write_text(
        "import torch\n"
        "from optimized.patching import Patch\n"
        "nan = Patch('nan-at-layer-3', phases=('decode',), description='poisons the MoE output in decode')\n"
        "@nan.op('experts')\n"
        "def experts(ctx, y, routing):\n"
        "    out = ctx.base(y=y, routing=routing)\n"
        "    return out * float('nan') if ctx.layer == 3 else out\n")
    out = tmp_path / "nan"
    findings = _findings_with_plugin(out, plugin, "nan-at-layer-3")
    first = [f for f in findings if f["variant"] != "base" and f["mode"] == "global"]
    assert first and first[0]["layer"] == 3 and first[0]["phase"] == "decode" and first[0]["tap"] == "moe.out"
    assert RunStore(out).read_manifest()["status"] == "complete"


def test_the_first_nan_is_the_earliest_in_emission_order_with_decode_comparisons_deferred(tmp_path):
    """Decode emissions of most taps are compared in batches at the end of a stack's layer (ComparingSink); a NaN
    found in such a batch (moe.out at decode step 2) still comes before one an undeferred tap (moe.router) checked
    on arrival at step 3."""
    plugin = tmp_path / "late_nan.py"
    plugin.write_text(
        "from optimized.ops import Routing\n"
        "from optimized.patching import Patch\n"
        "first = {}\n"
        "late = Patch('late-nan', phases=('decode',), description='NaN experts from step 2, NaN routing from 3')\n"
        "def step(ctx):\n"
        "    return int(ctx.positions[0]) - first.setdefault(ctx.layer, int(ctx.positions[0]))\n"
        "@late.op('experts')\n"
        "def experts(ctx, y, routing):\n"
        "    out = ctx.base(y=y, routing=routing)\n"
        "    return out * float('nan') if ctx.layer == 1 and step(ctx) >= 2 else out\n"
        "@late.op('router')\n"
        "def router(ctx, y, token_ids):\n"
        "    r = ctx.base(y=y, token_ids=token_ids)\n"
        "    if ctx.layer == 1 and step(ctx) >= 3:\n"
        "        r = Routing(r.scores, r.expert_ids, r.weights * float('nan'), r.output_scale, r.shared_weight)\n"
        "    return r\n")
    out = tmp_path / "late"
    found = [f for f in _findings_with_plugin(out, plugin, "late-nan", "--no-local") if f["variant"] != "base"]
    first_decode = RunStore(out).read_manifest()["prompt"]["n_prompt"]
    assert len(found) == 1 and found[0]["layer"] == 1 and found[0]["phase"] == "decode"
    assert found[0]["tap"] == "moe.out" and found[0]["position"] == first_decode + 2, found


def test_the_first_nan_in_a_deferred_prefill_block_is_found_at_its_position(tmp_path, monkeypatch):
    """Query-block emissions of prefill are compared in batches across blocks of different sizes (on a GPU; here
    forced on the CPU; tiny-smoke: 256 and 64 per chunk of 320); an LSE poisoned from position 270 on (the chunk's
    second block) is still the first non-finite value, at 270 — before attn.out, which holds no NaN, and before the
    attn.site that carries the same LSE later in the block."""
    from harness.run.probes import ComparingSink

    monkeypatch.setattr(ComparingSink, "DEFER_BLOCKS_ON_CPU", True)
    plugin = tmp_path / "lse_nan.py"
    plugin.write_text(
        "import torch\n"
        "from optimized.patching import Patch\n"
        "p = Patch('lse-nan', phases=('prefill',), description='NaN LSE from position 270 at layer 1')\n"
        "@p.op('sparse_attention')\n"
        "def sparse_attention(ctx, **inputs):\n"
        "    o, lse = ctx.base(**inputs)\n"
        "    query = inputs['window_slots'][:, -1]  # the window ends at the query's own position\n"
        "    if ctx.layer == 1:\n"
        "        lse = torch.where((query >= 270)[:, None], float('nan'), lse)\n"
        "    return o, lse\n")
    found = [f for f in _findings_with_plugin(tmp_path / "lse", plugin, "lse-nan", "--no-local")
             if f["variant"] != "base"]
    assert len(found) == 1, found
    assert (found[0]["layer"], found[0]["tap"], found[0]["field"], found[0]["phase"], found[0]["position"]) == \
        (1, "attn.lse", "lse", "prefill", 270), found


def test_run_cli_input_errors_exit_2(tmp_path, capsys):
    assert main(["run", "no-such-scenario", "--out", str(tmp_path / "x")]) == 2
    assert main(["run", "tiny-smoke", "--patches", "no-such-patch", "--out", str(tmp_path / "y")]) == 2
    assert "no-such-patch" in capsys.readouterr().err
    assert main(["run", "--resume", str(tmp_path / "missing")]) == 2


def test_progress_reports_every_layer(tmp_path):
    from harness.run.setup import Overrides, build_run_spec
    from harness.scenario import find_scenario, load_scenario

    spec, _ = build_run_spec(load_scenario(find_scenario("tiny-smoke")), Overrides(local=False))
    events = []
    store = RunStore(tmp_path / "p")
    store.create({})
    LockstepRunner(spec, store, events.append).run()
    done = [e["layer"] for e in events if e["event"] == "layer_done"]
    assert done == list(range(spec.source.config.num_hidden_layers)) and events[-1]["event"] == "done"
    stacks = {(e["stack"], e["mode"]) for e in events if e["event"] == "stack"}
    assert ("reference", "global") in stacks and ("yardstick", "global") in stacks and ("base", "local") not in stacks
