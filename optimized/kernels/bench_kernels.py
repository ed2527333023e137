"""Time the O1/O2 Triton kernels (and their torch emulations) at DeepSeek-V4-Flash shapes.

    PYTHONPATH=. python3 optimized/kernels/bench_kernels.py [--quick]

Times are triton.testing.do_bench medians (ms, CUDA events, L2 flushed between runs), which for these
microsecond kernels include the host's launch overhead (argument checks, allocations, 1-3 Triton launches);
the "graph" column replays the same call captured in a CUDA graph (triton.testing.do_bench_cudagraph, median),
i.e. GPU time alone. Prints the device, a table and the compiled kernels' registers and shared memory
(sm_120 allows at most 99 KB per program).
"""

from __future__ import annotations

import argparse
import sys

import torch


def _bench(fn, quick: bool, graph: bool) -> tuple[float, float]:
    """(do_bench median ms, do_bench_cudagraph median ms; nan without graph). The torch emulations are not
    graph-captured: they copy host scalars to the device, and a failed capture can spoil the CUDA context."""
    from triton.testing import do_bench, do_bench_cudagraph
    eager = do_bench(fn, warmup=10 if quick else 25, rep=30 if quick else 100, return_mode="median")
    if not graph:
        return eager, float("nan")
    try:
        graph_ms = do_bench_cudagraph(fn, rep=10 if quick else 30, return_mode="median")
    except Exception as exc:  # noqa: BLE001 - e.g. a host sync inside the call
        print(f"  (no CUDA-graph timing: {type(exc).__name__}: {str(exc)[:80]})")
        graph_ms = float("nan")
    return eager, graph_ms


def bench_decode(quick: bool) -> list[tuple]:
    from optimized.kernels.sparse_decode import sparse_decode_partials, sparse_decode_splitk
    from optimized.kernels.testing import make_decode_case
    rows = []
    for batch, n_extra in ((1, 512), (8, 512), (64, 512), (64, 0)):
        case = make_decode_case(batch=batch, heads=64, nope=448, rope=64, n_main=128, n_extra=n_extra, device="cuda",
                                main_rows=2048, extra_rows=8192, seed=batch)
        g = torch.Generator(device="cuda").manual_seed(0)
        case.main_slots = torch.randint(0, 2048, (batch, 128), device="cuda", dtype=torch.int32, generator=g)
        case.extra_slots = torch.randint(0, 8192, (batch, n_extra), device="cuda", dtype=torch.int32, generator=g)
        shape = f"B={batch} H=64 d=512 Kw=128 Kc={n_extra}"
        cache_bytes = batch * (128 + n_extra) * (448 + 2 * 64 + 7)  # 583 stored bytes per candidate row
        for impl, what, fn in (
                ("triton", "splits+merge", lambda: sparse_decode_splitk(*case.args(), impl="triton")),
                ("triton", "splits only", lambda: sparse_decode_partials(*case.args()[:5], case.softmax_scale,
                                                                         impl="triton")),
                ("torch", "emulation", lambda: sparse_decode_splitk(*case.args(), impl="torch"))):
            ms, graph_ms = _bench(fn, quick, graph=impl == "triton")
            rows.append(("O1 sparse decode", shape, f"{impl} {what}", ms, graph_ms,
                         f"{cache_bytes / (graph_ms if graph_ms == graph_ms else ms) / 1e6:.0f} GB/s of cache rows"))
    return rows


def bench_indexer(quick: bool) -> list[tuple]:
    from optimized.kernels.indexer_logits import fp8_paged_mqa_logits
    from optimized.kernels.testing import make_indexer_case
    rows = []
    n_keys = 8192
    for batch, causal in ((1, False), (64, False), (8192, True)):
        case = make_indexer_case(batch=batch, heads=64, dim=128, n_keys=n_keys, device="cuda", seed=batch,
                                 n_cols=n_keys, causal=causal)
        case.context_lens = case.context_lens if causal else torch.full_like(case.context_lens, n_keys)
        visible = int(case.context_lens.long().sum())
        shape = f"B={batch} nI=64 dI=128 T={n_keys}" + (" causal" if causal else "")
        impls = [("triton", p) for p in ("bf16", "tf32", "fp32")] + ([("torch", "bf16")] if batch <= 64 else [])
        for impl, precision in impls:
            ms, graph_ms = _bench(lambda: fp8_paged_mqa_logits(*case.args(), dot_precision=precision, impl=impl),
                                  quick, graph=impl == "triton")
            tflops = 2 * 64 * 128 * visible / min(ms, graph_ms if graph_ms == graph_ms else ms) / 1e9
            rows.append(("O2 indexer logits", shape, f"{impl} {precision}", ms, graph_ms, f"{tflops:.1f} TFLOP/s"))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="shorter do_bench runs")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_kernels: needs a CUDA device", file=sys.stderr)
        return 1
    import triton
    props = torch.cuda.get_device_properties(0)
    print(f"device: {props.name}, compute capability {props.major}.{props.minor}, {props.multi_processor_count} SMs;"
          f" torch {torch.__version__}, triton {triton.__version__}")
    rows = bench_decode(args.quick) + bench_indexer(args.quick)
    print("\n| kernel | shape | implementation | do_bench median ms | graph median ms | throughput |\n"
          "|---|---|---|---|---|---|")
    for kernel, shape, impl, ms, graph_ms, rate in rows:
        print(f"| {kernel} | {shape} | {impl} | {ms:.4f} | {graph_ms:.4f} | {rate} |")

    from optimized.kernels import indexer_logits_triton, sparse_decode_triton
    print("\n| compiled kernel (last launch) | registers/thread | spills | shared memory bytes | warps |\n|---|---|---|---|---|")
    for name, compiled in {**{f"O1 {k}": v for k, v in sparse_decode_triton.LAST_COMPILED.items()},
                           **{f"O2 {k}": v for k, v in indexer_logits_triton.LAST_COMPILED.items()}}.items():
        meta = getattr(compiled, "metadata", None)
        print(f"| {name} | {getattr(compiled, 'n_regs', '?')} | {getattr(compiled, 'n_spills', '?')} | "
              f"{getattr(meta, 'shared', '?')} | {getattr(meta, 'num_warps', '?')} |")
    print("\nevery compiled variant (one per block config / precision):")
    for kernel_fn in (sparse_decode_triton._split_kernel, sparse_decode_triton._merge_kernel,
                      indexer_logits_triton._logits_kernel):
        try:  # best effort: the compiled-kernel cache layout differs across triton versions
            for cache in kernel_fn.device_caches.values():
                for compiled in cache[0].values():
                    print(f"  {kernel_fn.fn.__name__}: shared {compiled.metadata.shared} B, regs "
                          f"{getattr(compiled, 'n_regs', '?')}, spills {getattr(compiled, 'n_spills', '?')}, "
                          f"{_constants(compiled)}")
        except Exception as exc:  # noqa: BLE001
            print(f"  {kernel_fn.fn.__name__}: cache not introspectable ({type(exc).__name__}: {exc})")
    return 0


def _constants(compiled) -> str:
    try:
        constants = compiled.src.constants
        return ", ".join(f"{k}={v}" for k, v in constants.items() if str(k).isupper() or isinstance(k, tuple))[:200]
    except Exception:  # noqa: BLE001
        return ""


if __name__ == "__main__":
    raise SystemExit(main())
