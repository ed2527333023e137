"""Ranks that share one GPU pass tensors by CUDA IPC (harness.run.distributed.Group.broadcast_tensors), and a run
sharded that way writes the one-process run's metrics (run on the H200: `python -m pytest -m gpu`); skipped
without CUDA."""

from __future__ import annotations

import os
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import torch

from harness.run.distributed import free_port, join_group
from metrics_pin import PIN_ARGS, ROOT

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _tree(seed: int) -> dict:
    """Leaves of every size class the runner sends: odd byte counts (bool, fp8), fp32 and int64, empty, nested."""
    g = torch.Generator().manual_seed(seed)
    return {"out": torch.randn(5, 4, 7, generator=g), "ids": torch.randint(0, 9, (3, 11), generator=g),
            "mask": torch.rand(13, generator=g) > 0.5, "fp8": torch.randn(6, generator=g).to(torch.float8_e4m3fn),
            "empty": torch.zeros(0, 4), "nested": [{"x": torch.randn(2, 3, generator=g)}, "label", 3]}


def _same_tree(a, b) -> bool:
    if isinstance(a, torch.Tensor):  # bits, whatever the dtype (fp8 has no torch.equal)
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu().view(torch.uint8),
                                                                         b.cpu().view(torch.uint8))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_tree(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same_tree(x, y) for x, y in zip(a, b))
    return a == b


def _on(tree, device: str):
    if isinstance(tree, torch.Tensor):
        return tree.to(device)
    if isinstance(tree, dict):
        return {k: _on(v, device) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_on(v, device) for v in tree]
    return tree


def _rank(rank: int, world: int, port: int, failures) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    group = join_group(rank, world, "cuda")
    assert group.one_gpu
    for round_, src in enumerate((0, world - 1, 0)):  # both ways, and a buffer the allocator may place where one was
        sent = _on(_tree(round_), group.device)
        got = group.broadcast_tensors(sent if rank == src else None, src)
        if not _same_tree(got, _tree(round_)) or got["out"].device != torch.device(group.device):
            failures.put(f"rank {rank}, round {round_} (from rank {src}): received tensors differ")
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])  # 3: two receivers release the one IPC share (not yet run on a GPU)
def test_ranks_on_one_gpu_broadcast_through_ipc(world):
    ctx = torch.multiprocessing.get_context("spawn")
    failures = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, failures)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    assert failures.empty(), failures.get()


def test_two_ranks_on_one_gpu_write_the_one_process_runs_metrics(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    runs = {}
    for name, extra in (("one", ()), ("two", ("--devices", "2"))):
        out = tmp_path / name
        done = subprocess.run([sys.executable, "-m", "harness.cli", *PIN_ARGS, "--device", "cuda", *extra, "--out",
                               str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[name] = pq.read_table(out / "metrics.parquet")
    assert runs["one"].num_rows == runs["two"].num_rows and runs["one"].equals(runs["two"])
