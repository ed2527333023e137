"""Where a lockstep run spends its time: per-stack seconds per layer and the top functions (cProfile).

    python bench/runner_profile.py --model flash --tokens 8192 --layers 4 --device cuda

Runs the first N layers of a synthetic-weights run (reference, yardstick, base engine; global mode) through
the real runner and probes, so the overhead of recording and comparing taps shows next to the stacks' own
compute (`dsv4-drift bench` times each stack alone and in the lockstep, without a profiler).
"""

from __future__ import annotations

import cProfile
import pstats
import tempfile
import time

import torch

from bench_common import bench_parser, bench_setup
from harness.run.runner import LockstepRunner, RunSpec, VariantSpec
from harness.run.store import RunStore
from reference.weights.synthetic import SyntheticWeights


def main() -> None:
    ap = bench_parser(__doc__, tokens=8192)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    cfg, ids = bench_setup(args)
    ids = ids.tolist()
    n = len(ids)
    turns = [0] * (n // 2) + [1] * (n - n // 2)
    spec = RunSpec(SyntheticWeights(cfg, 0), ids[: args.tokens], ids[args.tokens:], turns, [(100, 120)],
                   [VariantSpec("base", [])], local=False, device=args.device)
    spent: dict[str, float] = {}
    mark = [time.perf_counter(), None]

    def progress(event: dict) -> None:  # charge the time since the last event to the stack that was running
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        now = time.perf_counter()
        if mark[1]:
            spent[mark[1]] = spent.get(mark[1], 0.0) + now - mark[0]
        mark[0], mark[1] = now, event.get("stack")

    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():  # as the CLI runs (harness.cli.main.run_command)
        store = RunStore(tmp + "/run")
        store.create({})
        runner = LockstepRunner(spec, store, progress)
        runner.HOST_LANES = False  # cProfile sees this thread only: one stack at a time
        streams = runner.initial_streams()
        profile = cProfile.Profile()
        profile.enable()
        for layer in range(args.layers):
            progress({"stack": "weights"})
            streams = runner.run_layer(layer, streams)
            progress({"stack": None})
        profile.disable()
        store.flush_metrics()  # metrics.parquet is refreshed in the background: done before the folder goes
    print("seconds per stack over", args.layers, "layers:", {k: round(v, 2) for k, v in spent.items()})
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
