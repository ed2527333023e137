"""Where a lockstep run spends its time: per-stack seconds per layer and the top functions (cProfile).

    python bench/runner_profile.py --model flash --tokens 8192 --layers 4 --device cuda

Runs the first N layers of a synthetic-weights run (reference, yardstick, base engine; global mode) through
the real runner and probes, so the overhead of recording and comparing taps shows next to the stacks' own
compute (compare with bench/layer_timing.py, which runs the stacks without probes).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time

import torch

from harness.runner import LockstepRunner, RunSpec, VariantSpec
from harness.store import RunStore
from reference.config import get_preset
from reference.weights.synthetic import SyntheticWeights


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="flash-mini")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--decode", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    torch.set_float32_matmul_precision("highest")
    cfg = get_preset(args.model)
    n = args.tokens + args.decode
    ids = torch.randint(min(1000, cfg.vocab_size // 2), min(cfg.vocab_size, 100000), (n,),
                        generator=torch.Generator().manual_seed(0)).tolist()
    turns = [0] * (n // 2) + [1] * (n - n // 2)
    spec = RunSpec(SyntheticWeights(cfg, 0), ids[: args.tokens], ids[args.tokens:], turns, [(100, 120)],
                   [VariantSpec("base", [])], local=False, device=args.device)
    with tempfile.TemporaryDirectory() as tmp:
        store = RunStore(tmp + "/run")
        store.create({})
        runner = LockstepRunner(spec, store)
        x = runner.reference.embed(runner.ids)
        streams = {"reference": x, "yardstick": x.bfloat16(), "base": x.bfloat16()}
        spent: dict[str, float] = {}
        mark = [time.perf_counter(), None]

        def progress(event: dict) -> None:
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            now = time.perf_counter()
            if mark[1]:
                spent[mark[1]] = spent.get(mark[1], 0.0) + now - mark[0]
            mark[0], mark[1] = now, event.get("stack")

        runner.progress = progress
        profile = cProfile.Profile()
        profile.enable()
        for layer in range(args.layers):
            progress({"stack": "weights"})
            streams = runner.run_layer(layer, streams)
            progress({"stack": None})
        profile.disable()
    print("seconds per stack over", args.layers, "layers:", {k: round(v, 2) for k, v in spent.items()})
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
