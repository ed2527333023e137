"""A run sharded over several processes (torch.distributed, gloo on the CPU) writes what one process writes
(issue #14): the same metrics.parquet, row for row and bit for bit, and the same findings; a rank that dies fails the
run with a message naming it, and the layers written before stay."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from harness.run.distributed import free_port
from metrics_pin import PIN_ARGS, ROOT, run_pinned

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    return run_pinned(tmp_path_factory.mktemp("one") / "run").parent


def assert_same_run(sharded: Path, one: Path) -> None:
    a, b = pq.read_table(one / "metrics.parquet"), pq.read_table(sharded / "metrics.parquet")
    assert a.num_rows == b.num_rows and a.equals(b), (
        f"{sharded} differs from the one-process run: {b.num_rows} rows against {a.num_rows}")
    assert (sharded / "findings.json").read_text() == (one / "findings.json").read_text()
    assert json.loads((sharded / "manifest.json").read_text())["status"] == "complete"


@pytest.mark.parametrize("ranks", [2, 3])
def test_a_sharded_run_writes_the_one_process_runs_metrics(one_process, tmp_path, ranks):
    sharded = run_pinned(tmp_path / "run", ("--devices", str(ranks))).parent
    assert_same_run(sharded, one_process)
    # each rank's seconds in the layers' collectives, for the user to see how evenly the deal loaded the ranks
    segment = json.loads((sharded / "manifest.json").read_text())["segments"][-1]
    waits = segment["rank_wait_s"]
    assert len(waits) == ranks and all(set(w) == {"reference_s", "rows_s"} for w in waits), waits
    assert all(0 <= v <= segment["seconds"] for w in waits for v in w.values()), (waits, segment["seconds"])


def test_torchrun_ranks_write_the_one_process_runs_metrics(one_process, tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), "-m", "harness.cli", "--", *PIN_ARGS, "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, start_new_session=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_run(out, one_process)


DYING_PLUGIN = '''
import os
import torch.distributed as dist
from optimized.patching import Patch

dies = Patch("dies-on-rank-1", phases=("prefill", "decode"), description="rank 1 exits at layer 2")

@dies.op("hc_post")
def hc_post(ctx, f, streams, mix):
    if ctx.layer == 2 and dist.is_initialized() and dist.get_rank() == 1:
        os._exit(7)
    return ctx.base(f=f, streams=streams, mix=mix)
'''


def test_a_rank_that_dies_fails_the_run_naming_it_and_the_written_layers_stay(tmp_path):
    plugin = tmp_path / "dies.py"
    plugin.write_text(DYING_PLUGIN)
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "harness.cli", "run", "tiny-smoke", "--patches", "dies-on-rank-1",
                           "--patch-module", str(plugin), "--local", "--threads", "1", "--no-gate", "--no-report",
                           "--devices", "2", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 4, done.stderr[-3000:]
    assert "rank 1 of 2 died (exit code 7)" in done.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["status"] == "failed" and manifest["failure"]["rank"] == 1, manifest.get("failure")
    written = pq.read_table(out / "metrics.parquet").column("layer").to_pylist()
    assert set(written) == {0, 1}, f"expected layers 0 and 1 written before the rank died, found {sorted(set(written))}"


AUTO_SHARD = ("import sys, harness.cli.threads as t; t.SHARD_MIN_TOKEN_LAYERS = 0; t.default_threads = lambda: 2; "
              "from harness.cli.main import main; sys.exit(main(sys.argv[1:]))")
"""The CLI on a 2-core machine with the length rule lowered to tiny-smoke's size (the ranks it starts decide
nothing: they run what the manifest and the recipe say)."""


def test_a_long_narrow_cpu_run_deals_its_stacks_over_the_cores_by_itself(one_process, tmp_path):
    """Without --devices or --threads, a long CPU run of a narrow model shards over the cores (one thread each) and
    writes the one-process run's metrics; the manifest's segment records the ranks."""
    out = tmp_path / "run"
    args = [a for i, a in enumerate(PIN_ARGS) if a != "--threads" and PIN_ARGS[i - 1] != "--threads"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", AUTO_SHARD, *args, "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 processes of 1 thread" in done.stderr and "2 processes × 1 thread(s)" in done.stderr, done.stderr
    assert "2 ranks)" in done.stdout, "rank 0's line per layer: the run was sharded"
    assert_same_run(out, one_process)
    segment = json.loads((out / "manifest.json").read_text())["segments"][0]
    assert segment["ranks"] == 2 and segment["threads"] == 1, segment
    assert segment["last_layer"] == 4, "rank 0 records each layer in the open segment, as one process does"


FAILING_REFERENCE_PLUGIN = '''
import torch
import torch.distributed as dist
from optimized.patching import Patch
from reference.model import ReferenceModel

noop = Patch("reference-fails-at-layer-2", phases=("prefill", "decode"), description="the reference raises at layer 2")
_run_layer = ReferenceModel.run_layer


def run_layer(self, block, *args, **kwargs):  # the fp32 reference only (the yardstick is bf16)
    if block.layer == 2 and block.dtype == torch.float32 and dist.is_initialized():
        raise RuntimeError(f"reference failed at layer 2 on rank {dist.get_rank()}")
    return _run_layer(self, block, *args, **kwargs)


ReferenceModel.run_layer = run_layer
'''


def test_under_torchrun_the_manifest_names_the_rank_that_failed_not_rank_0s_broken_collective(tmp_path):
    """Under torchrun no launcher collects the ranks' reports: rank 0 sees only that rank 1 went away. It reads rank 1's
    report (failure_path) and fails the run with it: the manifest names rank 1, layer 2 and the reference, the exit
    code is the reference's error's (4: a RuntimeError), and the report is merged and removed."""
    plugin = tmp_path / "ref_fails.py"
    plugin.write_text(FAILING_REFERENCE_PLUGIN)
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(free_port()), "-m", "harness.cli", "--", "run", "tiny-smoke", "--patches",
                           "reference-fails-at-layer-2", "--patch-module", str(plugin), "--threads", "1", "--no-gate",
                           "--no-report", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, start_new_session=True)
    assert done.returncode != 0
    assert "rank 1 of 2 failed: RuntimeError: reference failed at layer 2 on rank 1" in done.stderr, done.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    failure = manifest["failure"]
    assert manifest["status"] == "failed" and (failure["rank"], failure["layer"], failure["stack"]) == (
        1, 2, "reference"), failure
    assert not list(out.glob("failure-rank-*.json"))
    assert set(pq.read_table(out / "metrics.parquet").column("layer").to_pylist()) == {0, 1}


def test_a_rank_that_cannot_write_a_file_exits_2_like_one_process(tmp_path):
    """An OSError on a rank (disk full while rank 1 runs layer 2's reference) is the user's to fix, not a bug: the
    run exits 2, as the same error in one process does (harness.cli.main), and still names the rank."""
    plugin = tmp_path / "disk_full.py"
    plugin.write_text(FAILING_REFERENCE_PLUGIN.replace(
        'raise RuntimeError(f"reference failed at layer 2 on rank {dist.get_rank()}")',
        'raise OSError(28, "No space left on device", "/full/disk")'))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "harness.cli", "run", "tiny-smoke", "--patches",
                           "reference-fails-at-layer-2", "--patch-module", str(plugin), "--threads", "1", "--no-gate",
                           "--no-report", "--devices", "2", "--out", str(tmp_path / "run")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "rank 1 of 2 failed" in done.stderr and "No space left on device" in done.stderr


def test_a_reference_run_ahead_that_fails_is_reported_at_its_layer_after_the_layer_before_is_written(tmp_path):
    """The last rank runs later layers' references while the others finish layer L (two ahead on a CPU); if one
    raises, the layers before it are still written and the run fails at its layer naming that rank."""
    plugin = tmp_path / "ref_fails.py"
    plugin.write_text(FAILING_REFERENCE_PLUGIN)
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "harness.cli", "run", "tiny-smoke", "--patches",
                           "reference-fails-at-layer-2", "--patch-module", str(plugin), "--threads", "1", "--no-gate",
                           "--no-report", "--devices", "2", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 4, done.stderr[-3000:]
    assert "rank 1 of 2 failed" in done.stderr and "reference failed at layer 2 on rank 1" in done.stderr
    written = pq.read_table(out / "metrics.parquet").column("layer").to_pylist()
    assert set(written) == {0, 1}, f"expected layers 0 and 1 written, found {sorted(set(written))}"
    failure = json.loads((out / "manifest.json").read_text())["failure"]
    assert (failure["rank"], failure["layer"], failure["stack"]) == (1, 2, "reference"), failure
    assert not list(out.glob("failure-rank-*.json")), "the rank's report is moved into the manifest"
    segments = json.loads((out / "manifest.json").read_text())["segments"]
    assert len(segments) == 1 and segments[0]["ranks"] == 2 and segments[0]["seconds"] > 0, segments
    assert segments[0]["last_layer"] == 1, "the last layer rank 0 finished is kept with the failed segment"


def test_a_sharded_attribution_keeps_its_segment_current_after_every_layer(tmp_path):
    """A sharded attribution pass's segment says what it cost and how far it got, layer by layer, as a sharded run's
    does (rank 0 records it): when the pass stops at layer 2, the segment holds its seconds and layer 1."""
    plugin = tmp_path / "ref_fails.py"
    plugin.write_text(FAILING_REFERENCE_PLUGIN)
    out = tmp_path / "attr"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "harness.cli", "attribute", "tiny-smoke", "--patches",
                           "reference-fails-at-layer-2", "--patch-module", str(plugin), "--threads", "1",
                           "--interactions", "never", "--no-report", "--devices", "2", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 4, done.stderr[-3000:]
    segments = json.loads((out / "manifest.json").read_text())["segments"]
    assert len(segments) == 1 and segments[0]["seconds"] > 0, segments
    assert segments[0].get("last_layer") == 1, segments


def test_a_rank_that_stopped_first_is_blamed_whichever_failure_the_launcher_names(tmp_path, monkeypatch):
    """When rank 1 stops, rank 0's collective breaks and rank 0 fails too; torch.multiprocessing names whichever
    failed process it notices first (a race: the test above once saw rank 0's gloo error named). The rank whose
    report was written before rank 0 recorded its own stop is the cause; a report written after it is not."""
    from harness.run import distributed
    from harness.run.store import RunStore

    store = RunStore(tmp_path / "run")
    store.create({})
    where = {"layer": 2, "stack": "reference", "mode": "global", "error": "RuntimeError: reference failed"}

    def rank_one_then_rank_zero(*_args):
        distributed.failure_path(store.dir, 1).write_text(json.dumps(where))
        os.utime(distributed.failure_path(store.dir, 1), ns=(1, 1))  # written well before rank 0 stopped
        store.update_manifest(status="failed", failure={"layer": 2, "stack": "base", "error": "gloo: peer closed"})
        raise distributed.RankFailed(0, "rank 0 of 2 failed: RuntimeError: Connection closed by peer")

    monkeypatch.setattr(distributed.RunRecipe, "of", lambda *_args: None)
    monkeypatch.setattr(distributed, "launch", rank_one_then_rank_zero)
    with pytest.raises(distributed.RankFailed) as raised:
        distributed.run_sharded(2, None, store, 1)
    assert raised.value.rank == 1 and "reference failed" in str(raised.value)
    failure = store.read_manifest()["failure"]
    assert (failure["rank"], failure["layer"], failure["stack"]) == (1, 2, "reference"), failure

    # rank 0 stopped first (its own error); rank 1 reported its broken collective afterwards: rank 0 stays blamed
    def rank_zero_then_rank_one(*_args):
        store.update_manifest(status="failed", failure={"layer": 3, "stack": "base", "error": "ValueError: own"})
        os.utime(store.manifest_path, ns=(1, 1))
        distributed.failure_path(store.dir, 1).write_text(json.dumps({**where, "error": "RuntimeError: gloo"}))
        raise distributed.RankFailed(0, "rank 0 of 2 failed: ValueError: own")

    monkeypatch.setattr(distributed, "launch", rank_zero_then_rank_one)
    with pytest.raises(distributed.RankFailed) as raised:
        distributed.run_sharded(2, None, store, 1)
    assert raised.value.rank == 0
    failure = store.read_manifest()["failure"]
    assert (failure["layer"], failure["error"]) == (3, "ValueError: own"), failure  # rank 0's own record stands


def test_ranks_sharing_a_gpu_are_told_whether_mps_lets_them_overlap(tmp_path, monkeypatch):
    """Two ranks on one GPU time-slice it unless an MPS daemon runs (README, Several GPUs or processes): the note
    says which, from the control pipe a CUDA process would connect through; one rank per GPU or the CPU: no note."""
    import torch
    from harness.run.distributed import shared_gpu_note

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    missing = shared_gpu_note("cuda", 2, env)
    assert missing is not None and "no NVIDIA MPS daemon" in missing and str(tmp_path / "control") in missing
    (tmp_path / "control").touch()
    running = shared_gpu_note("cuda", 2, env)
    assert running is not None and "through NVIDIA MPS" in running and "2 ranks" in running
    assert shared_gpu_note("cuda", 1, env) is None
    assert shared_gpu_note("cpu", 2, env) is None
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert shared_gpu_note("cuda:0", 2, env) is None


def _reference_rank_stub(device: str, until: int, fails_at: int | None = None):
    """A ShardedRunner as the reference rank (rank 1 of 2) whose reference passes only record which layer ran from
    which input: _between_layers' bookkeeping without a model."""
    from types import SimpleNamespace

    from harness.run.distributed import Group, ShardedRunner

    runner = ShardedRunner.__new__(ShardedRunner)
    runner.group = Group(rank=1, world=2, device=device, ranks_per_device=1)
    runner.device = torch.device(device)
    runner.weights = SimpleNamespace(until=until)
    runner._ahead = {}
    runner.ran = []
    runner.where = {"layer": 0, "stack": "base", "mode": "global"}

    def prepare(layer, weights=None):
        return SimpleNamespace(layer=layer, out=None)

    def run_reference(ref, ref_in):
        runner.where = {"layer": ref.layer, "stack": "reference", "mode": "global"}  # as _enter does
        if ref.layer == fails_at:
            raise RuntimeError(f"reference failed at layer {ref.layer}")
        runner.ran.append((ref.layer, ref_in))
        ref.out = f"out{ref.layer}"

    runner._prepare_layer, runner._run_reference = prepare, run_reference
    return runner


def test_the_reference_rank_runs_two_layers_ahead_on_a_cpu_and_one_on_a_gpu():
    """CSA and HCA layers alternate and their references differ ~3× in cost (ShardedRunner.reference_lead): two
    layers ahead, each layer's stacks run beside a reference of their own kind. Each pass starts from the output of
    the pass before it, none runs twice, none past the run's last layer, and none past one that failed."""
    cpu = _reference_rank_stub("cpu", until=5)
    cpu._between_layers(0, {"reference": "in0"}, "out0")
    assert cpu.ran == [(1, "out0"), (2, "out1")] and sorted(cpu._ahead) == [1, 2]
    assert cpu.where == {"layer": 0, "stack": "base", "mode": "global"}, "a failure in layer 0's gather names layer 0"
    cpu._ahead.pop(1)
    cpu._between_layers(1, {}, "out1")
    assert cpu.ran[2:] == [(3, "out2")] and sorted(cpu._ahead) == [2, 3]
    for layer in (2, 3):
        cpu._ahead.pop(layer)
        cpu._between_layers(layer, {}, f"out{layer}")
    assert [layer for layer, _ in cpu.ran] == [1, 2, 3, 4], "no pass past the last layer (until=5)"

    gpu = _reference_rank_stub("cuda", until=5)
    gpu._between_layers(0, {}, "out0")
    assert gpu.ran == [(1, "out0")] and sorted(gpu._ahead) == [1]

    failing = _reference_rank_stub("cpu", until=6, fails_at=2)
    failing._between_layers(0, {}, "out0")
    assert [layer for layer, _ in failing.ran] == [1] and isinstance(failing._ahead[2], RuntimeError)
    failing._ahead.pop(1)
    failing._between_layers(1, {}, "out1")
    assert [layer for layer, _ in failing.ran] == [1], "nothing runs ahead past the failed layer"


def test_tensors_travel_as_one_buffer_and_come_back_equal():
    """broadcast_tensors' byte buffer (distributed._pack/_unpack): every leaf back with its dtype, shape and bits —
    bool, bf16, 0-dim, empty and non-contiguous ones too — as views of the received buffer or as copies of a mapped
    one (the copies must not share its memory)."""
    from harness.run.distributed import ALIGN, _pack, _unpack

    leaves = [torch.arange(5, dtype=torch.int64), torch.tensor([True, False, True]), torch.randn(3, 4)[:, ::2],
              torch.tensor(2.5), torch.zeros(0, 7, dtype=torch.bfloat16), torch.randn(2, 3).to(torch.bfloat16),
              torch.tensor([float("nan"), -0.0, float("inf")])]
    buffer = _pack(leaves, "cpu")
    shapes = [(tuple(t.shape), t.dtype) for t in leaves]
    assert buffer.numel() % ALIGN == 0
    for copy in (False, True):
        out = _unpack(buffer, shapes, copy=copy)
        for a, b in zip(leaves, out):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a.contiguous().view(-1).view(torch.uint8) if a.numel() else a,
                               b.contiguous().view(-1).view(torch.uint8) if b.numel() else b), (a, b)
        shares = [o.numel() > 0 and o.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
                  for o in out]
        assert (not any(shares)) if copy else all(s for s, o in zip(shares, out) if o.numel()), shares
