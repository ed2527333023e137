"""Per-layer timing of every stack at a chosen width and prompt length (DESIGN §8: `bench` numbers).

    python bench/layer_timing.py --model flash --tokens 4096 --device cuda --layers 0 2 3

Prints, per layer, the seconds spent producing the layer's synthetic weights and running the reference (fp32),
the yardstick (bf16), the base engine and the engine with every patch, plus tokens/s and peak device memory.
"""

from __future__ import annotations

import time

import torch

from bench_common import bench_parser, bench_setup
from optimized.engine import OptimizedModel
from optimized.registry import default_registry
from reference.layer import ReferenceLayer
from reference.model import ReferenceModel, segment_lengths
from reference.weights.synthetic import SyntheticWeights


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = bench_parser(__doc__, tokens=4096)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--layers", type=int, nargs="+", default=[0, 2, 3])
    args = ap.parse_args()
    device = torch.device(args.device)
    cfg, ids = bench_setup(args)
    ids = ids.to(device)
    src = SyntheticWeights(cfg, 0)
    segs = segment_lengths(args.tokens, args.decode, args.chunk)
    ref = ReferenceModel(src, device=device)
    yard = ReferenceModel(src, torch.bfloat16, device)
    registry = default_registry()
    engines = {"base": OptimizedModel(src, [], device), "all": OptimizedModel(src, registry.choose("all"), device)}
    x = ref.embed(ids)
    print(f"{cfg.name}: {args.tokens} prompt + {args.decode} decode tokens, chunk {args.chunk}, device "
          f"{torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}")
    print(f"{'layer':>5} {'kind':>4} {'weights':>8} {'ref':>7} {'yard':>7} {'base':>7} {'all':>7}   tok/s(ref)  peak GB")
    for layer in args.layers:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = {}
        sync(device); t = time.perf_counter()
        w = src.layer(layer, device)
        sync(device); times["weights"] = time.perf_counter() - t
        t = time.perf_counter()
        ref.run_layer(ReferenceLayer(cfg, layer, w, device=device), x, ids, [args.tokens] + [1] * args.decode)
        sync(device); times["ref"] = time.perf_counter() - t
        t = time.perf_counter()
        yard.run_layer(ReferenceLayer(cfg, layer, w, torch.bfloat16, device=device), x.bfloat16(), ids, segs)
        sync(device); times["yard"] = time.perf_counter() - t
        for name, eng in engines.items():
            t = time.perf_counter()
            eng.run_layer(eng.layer(layer, w), x.bfloat16(), ids, segs, args.tokens)
            sync(device); times[name] = time.perf_counter() - t
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
        print(f"{layer:>5} {cfg.layer_kind(layer):>4} {times['weights']:>8.2f} {times['ref']:>7.2f} {times['yard']:>7.2f} "
              f"{times['base']:>7.2f} {times['all']:>7.2f}   {args.tokens / times['ref']:>10.0f}  {peak:>7.1f}",
              flush=True)
        del w


if __name__ == "__main__":
    main()
