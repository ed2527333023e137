"""One lockstep layer with its stacks in one host thread and in two (harness.run.host_lanes), alternating in one
process: each run's wall seconds, the medians and their ratio, and whether every metric row came out the same.

    python bench/lanes_ab.py --model flash --tokens 30720 --decode 64 --layer 2 --device cuda --rounds 3

The two threads queue on one CUDA stream, so the rows must be identical bit for bit: the script exits 1 when they are
not. Runs alternate (one thread, two threads, …) after an untimed warm-up run, because an H200 lease drifts by
±20% between processes and within one: only a ratio of medians over interleaved runs shows a change of ~10%.
On a CPU the second thread shares the cores with the kernels; it is measurable there, not useful (the runner keeps
one thread on a CPU).
"""

from __future__ import annotations

import math
import statistics
import sys
import tempfile
import time
from typing import Any

import torch

from bench_common import bench_parser, bench_run_spec, bench_setup
from harness.run.host_lanes import cache_holds_every_copy, lanes_of
from harness.run.runner import LockstepRunner
from harness.run.store import RunStore
from reference.weights.dense_cache import DenseCache


class _KeepingRunner(LockstepRunner):
    """The lockstep runner, keeping the rows of the layer it writes (NaN as a string, so that NaN rows compare)."""

    rows: dict[Any, list[dict]] = {}

    def _write_layer(self, layer: int, rows: dict, dumped: dict) -> None:
        self.rows = {pair: [{k: "nan" if isinstance(v, float) and math.isnan(v) else v for k, v in r.items()}
                            for r in pair_rows] for pair, pair_rows in rows.items()}
        super()._write_layer(layer, rows, dumped)


def main() -> None:
    ap = bench_parser(__doc__, tokens=8192)
    ap.add_argument("--layer", type=int, default=2, help="the layer timed (default 2: CSA in every preset)")
    ap.add_argument("--variants", default="base,all",
                    help="comma-separated patch sets, or attribution (default base,all)")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each way, alternating (default 3)")
    args = ap.parse_args()
    cfg, ids = bench_setup(args)
    spec = bench_run_spec(args, cfg, ids, args.variants)
    device = torch.device(args.device)
    lanes = lanes_of(spec, spec.stacks(), layer=args.layer)
    if len(lanes) < 2:
        sys.exit(f"lanes_ab: variants {args.variants} give one lane at layer {args.layer} (stock stacks only, or "
                 "patched only): nothing to compare")
    print("lanes:", " | ".join(", ".join(f"{name}/{mode}" for name, mode in lane) for lane in lanes))
    if not cache_holds_every_copy(spec, args.layer, DenseCache.for_device(device).budget_bytes):
        sys.exit(f"lanes_ab: layer {args.layer}'s dense cache cannot hold every weight's fp32 copy on {device}, so "
                 "the runner keeps one lane (harness.run.host_lanes.cache_holds_every_copy): nothing to compare")
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    print(f"{args.model} layer {args.layer} ({cfg.layer_kind(args.layer)}), {args.tokens} + {args.decode} tokens, "
          f"variants {args.variants}, {device}, {torch.get_num_threads()} torch threads", flush=True)
    walls: dict[bool, list[float]] = {False: [], True: []}
    first_rows = None
    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():  # as the CLI runs
        weights = spec.source.layer(args.layer, device)
        for i, lanes in enumerate([False] + [False, True] * args.rounds):
            store = RunStore(f"{tmp}/{i}")
            store.create({})
            runner = _KeepingRunner(spec, store)
            runner.HOST_LANES = lanes
            streams = runner.initial_streams()
            sync()
            t = time.perf_counter()
            runner.run_layer(args.layer, streams, weights=weights)
            sync()
            wall = time.perf_counter() - t
            store.flush_metrics()  # metrics.parquet is refreshed in the background: done before the folder goes
            if first_rows is None:
                first_rows = runner.rows
            same = runner.rows == first_rows
            print(f"{'warm-up' if i == 0 else f'round {(i + 1) // 2}'} {'two threads' if lanes else 'one thread'}: "
                  f"{wall:.2f} s, rows {'identical' if same else 'DIFFER'}", flush=True)
            if not same:
                sys.exit(f"lanes_ab: the rows of the {'two' if lanes else 'one'}-thread run differ from the first "
                         "run's (the threads must not change a bit)")
            if i:
                walls[lanes].append(wall)
    one, two = statistics.median(walls[False]), statistics.median(walls[True])
    print(f"medians: one thread {one:.2f} s, two threads {two:.2f} s; one/two: {one / two:.3f}; "
          f"{sum(len(r) for r in first_rows.values())} rows identical in every run")


if __name__ == "__main__":
    main()
