"""`dsv4-drift bench`: where a run's time goes, per layer, on this machine (issue #14; DESIGN §8)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from rich.table import Table

from harness.attribution.plan import attribution_variants
from harness.cli.console import console
from harness.cli.paths import writable_file
from harness.cli.threads import add_threads_argument, torch_threads
from harness.errors import UsageError
from harness.run.benchmark import STACKS, BenchResult, run_bench
from harness.run.environment import environment_record
from harness.run.setup import check_device
from optimized.registry import default_registry
from reference.config import PRESETS, get_preset


KERNEL_NAME_CHARS = 90
"""Characters of a kernel's name printed: CUDA kernel names are whole C++ template instantiations (hundreds of
characters); their first 90 name the library, operation and tile shape. The JSON keeps them whole."""
PLACED = "the streams placed on the host between layers"
"""What the memory lines add when check_fits placed the streams (BenchResult.streams_on_host)."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench", help="per-layer time of weights, each stack and mode, probes and store; tokens/s, peak memory, FLOP/s",
        description="Runs the chosen layers of a synthetic-weights run of the given shape: each layer's weights, "
                    "each stack alone (reference, yardstick, base, all), then the layer through the lockstep runner "
                    "with every probe (reference, then yardstick, base and all, global and local) and the store. "
                    "Prints a table and, with --json, writes every number with the device, threads and versions. "
                    "The reference's achieved FLOP/s is set against the device's fp32 matmul rate, measured first. "
                    "On a GPU, once every layer is timed, each layer runs once more under the profiler for the "
                    "seconds the GPU was busy: the floor under the run's wall time that removing host cost cannot "
                    "go below.")
    p.add_argument("--model", default="flash-mini", choices=sorted(PRESETS), metavar="PRESET",
                   help="model preset (default flash-mini; flash is the full width)")
    p.add_argument("--tokens", type=int, default=8192, metavar="N", help="prompt tokens (default 8192)")
    p.add_argument("--decode", type=int, default=8, metavar="N", help="teacher-forced decode steps (default 8)")
    p.add_argument("--chunk-size", type=int, default=8192, metavar="N",
                   help="prefill chunk of the engines and the reference, as a scenario's default "
                        "(prefill.reference_chunk_size = chunk_size; default 8192)")
    p.add_argument("--layers", default="0-3", metavar="LIST",
                   help="layers to measure: comma list and ranges, e.g. 0-3 or 2,3 (default 0-3: SWA, CSA and HCA)")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cpu)")
    add_threads_argument(p)
    p.add_argument("--attribution", action="store_true",
                   help="run the lockstep with `attribute`'s variants of the built-in patches (base, each alone, all "
                        "but one, all) instead of base and all: what an attribution costs per layer")
    p.add_argument("--no-trace", action="store_true",
                   help="on a GPU, skip the traced passes that measure each part's device-busy seconds (the run's "
                        "floor under its wall time); each layer then runs once less")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the numbers as JSON")
    p.add_argument("--markdown", type=Path, metavar="FILE",
                   help="also write the table as Markdown, as README's Benchmarks section shows it "
                        "(bench/readme_table.py makes the same from a --json file and puts it into README.md)")
    p.set_defaults(func=run)


def parse_layers(text: str, n_layers: int) -> list[int]:
    """'0-3,7' → [0, 1, 2, 3, 7]; a layer outside the model is a usage error naming the flag."""
    layers: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            layers += range(int(lo), int(hi or lo) + 1)
    except ValueError:
        raise UsageError(f"--layers {text!r}: expected a comma list of layers and ranges, e.g. 0-3 or 2,5") from None
    bad = [x for x in layers if not 0 <= x < n_layers]
    if bad or not layers:
        raise UsageError(f"--layers {text!r}: layers run from 0 to {n_layers - 1}")
    return layers


def run(args: argparse.Namespace) -> int:
    out = console(stderr=True)
    cfg = get_preset(args.model)
    layers = parse_layers(args.layers, cfg.num_hidden_layers)
    if args.tokens < 1 or args.decode < 0 or args.chunk_size < 1:
        raise UsageError("--tokens and --chunk-size must be positive and --decode not negative")
    device = check_device(args.device)
    for path, flag in ((args.json, "--json"), (args.markdown, "--markdown")):
        if path:
            writable_file(path, flag)
    with torch_threads(args.threads) as note:
        if note:
            out.print(f"[yellow]note[/]: {note}", soft_wrap=True)
        out.print(f"[bold]bench[/]: {cfg.name}, {args.tokens} prompt + {args.decode} decode tokens, chunk "
                  f"{args.chunk_size}, layers {layers}, {device}, {torch.get_num_threads()} thread(s)")
        variants = attribution_variants(default_registry().choose("all")) if args.attribution else None
        result = run_bench(cfg, args.tokens, args.decode, layers, device, args.chunk_size, out.print, variants,
                           trace=not args.no_trace)
        environment = environment_record(device)  # inside: the thread count it ran with, not the caller's
    console().print(bench_table(result))
    for lb in result.layers:
        if lb.top_kernels:
            console().print(f"layer {lb.layer}: the lockstep's busiest kernels (device seconds, summed per name): "
                            + "; ".join(f"{seconds:.3f} {name[:KERNEL_NAME_CHARS]}"
                                        for name, seconds in lb.top_kernels),
                            soft_wrap=True, markup=False)
    record = {**result.to_dict(cfg), "environment": environment}
    projected = record["projected_run_s"]
    if projected is not None:
        console().print(f"projected run of all {cfg.num_hidden_layers} layers: {projected:.0f} s "
                        "(mean measured layer per layer kind; weights overlapped)")
    floor = record["projected_busy_s"]
    if floor is not None:
        console().print(f"device busy over such a run: {floor:.0f} s (the lockstep's and the weights' kernels, "
                        "traced): the floor that removing the launches' host cost cannot go under; faster or "
                        "fewer kernels lower it")
    predicted = result.predicted["device_gib" if device.startswith("cuda") else "host_gib"]
    measured = max((lb.peak_device_gib or 0.0) for lb in result.layers) if device.startswith("cuda") \
        else result.peak_host_gib
    terms = result.predicted["device_terms_gib" if device.startswith("cuda") else "host_terms_gib"]
    placed = f"; {PLACED}" if result.streams_on_host else ""
    console().print(f"peak memory: {measured:.1f} GiB measured, {predicted:.1f} GiB predicted (harness.run.memory: "
                    + ", ".join(f"{k} {v:.1f}" for k, v in terms.items()) + f"){placed}")
    if args.json:
        args.json.write_text(json.dumps(record, indent=1) + "\n")
        out.print(f"wrote {args.json}")
    if args.markdown:
        args.markdown.write_text(bench_markdown(record))
        out.print(f"wrote {args.markdown}")
    return 0


def _peak_memory(record: dict[str, Any]) -> str:
    """The run's peak memory, measured and predicted (harness.run.memory): the device's on a GPU, else the host's."""
    predicted = record.get("predicted", {})
    if record["device"].startswith("cuda"):
        measured = max((row.get("peak_device_gib") or 0.0) for row in record["layers"])
        placed = f", {PLACED}" if record.get("streams_on_host") else ""
        return f"peak device memory {measured:.1f} GiB, {predicted.get('device_gib', 0.0):.1f} GiB predicted{placed}"
    return (f"peak host memory {record.get('peak_host_gib', 0.0):.2f} GiB, {predicted.get('host_gib', 0.0):.2f} GiB "
            "predicted")


def bench_markdown(record: dict[str, Any]) -> str:
    """The numbers of `bench --json` as README's Benchmarks table (Markdown): per layer the weights, each stack alone,
    each stack and mode in the lockstep with its probes, what the probes add, the lockstep's total with the seconds
    the device was busy and their share, tokens/s, peak device memory and the reference's share of the fp32 rate
    measured in the same run; then a line with the run's shape, device, threads, versions and projections. Made from
    the JSON (not the live result) so that a file brought back from a GPU machine renders the same table."""
    stacks = ("reference", "yardstick", "base", "all")
    lines = ["| layer | weights | alone: ref / yard / base / all | lockstep: ref · yard g/l · base g/l · all g/l"
             " | probes | lockstep (GPU busy) | tok/s | peak GiB | reference / fp32 rate |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in record["layers"]:
        busy = row.get("busy_s") or {}
        runner = row["runner_s"]
        lockstep = f"{runner.get('reference/global', 0.0):.2f} · " + " · ".join(
            f"{runner.get(f'{s}/global', 0.0):.2f}/{runner.get(f'{s}/local', 0.0):.2f}" for s in stacks[1:])
        if row.get("other_variants_s"):
            lockstep += f" · others {row['other_variants_s']:.2f}"
        total = f"**{row['run_s']:.2f}**" + (f" ({busy['run']:.2f}: {100 * busy['run'] / row['run_s']:.0f}%)"
                                              if "run" in busy else "")
        peak = "—" if row.get("peak_device_gib") is None else f"{row['peak_device_gib']:.1f}"
        lines.append(f"| {row['layer']} ({row['kind'].upper()}) | "
                     f"{_with_busy(row['weights_s'], busy.get('weights'))} | "
                     + " / ".join(_with_busy(row["alone_s"][s], busy.get(s)) for s in stacks)
                     + f" | {lockstep} | {row['probes_s']:.2f} | {total} | {row['tokens_per_s']:,.0f} | {peak} | "
                     f"{100 * row['reference_share_of_peak']:.0f}% |")
    env = record.get("environment", {})
    versions = ", ".join(f"{k} {env[k]}" for k in ("torch", "triton") if env.get(k))
    shape = (f"{record['model']}, {record['tokens']:,} + {record['decode']} tokens, chunk {record['chunk']:,}, on "
             f"{record['device_name']} ({record['threads']} thread(s){', ' + versions if versions else ''}); fp32 "
             f"matmul rate measured in the run: {record['fp32_peak_flops'] / 1e12:.2f} TFLOP/s")
    projected = [f"projected run of all {record['layers_total']} layers {record['projected_run_s']:.0f} s"
                 if record.get("projected_run_s") is not None else None,
                 f"device busy over it {record['projected_busy_s']:.0f} s" if record.get("projected_busy_s") else None,
                 _peak_memory(record)]
    footer = "; ".join([shape, *(p for p in projected if p)])
    return "\n".join([*lines, "", f"Seconds per layer ({footer}). Made by `dsv4-drift bench --markdown` or "
                       "`bench/readme_table.py` from `bench --json`."]) + "\n"


def _with_busy(seconds: float, busy: float | None) -> str:
    """'wall' or, where the device's busy seconds were traced, 'wall (busy)'."""
    return f"{seconds:.2f}" if busy is None else f"{seconds:.2f} ({busy:.2f})"


def bench_table(result: BenchResult) -> Table:
    """One row per layer, seconds: weights, each stack alone (no probes), each stack and mode in the lockstep with
    its probes, what the probes add, the store; then tokens/s, peak device memory and the reference's achieved
    share of the measured fp32 peak. On a GPU the weights, the stacks alone and the total also show the device's
    busy seconds in parentheses, and 'GPU busy' their share of the lockstep's wall time."""
    modes = [("reference", "global")] + [(s, m) for s in ("yardstick", "base", "all") for m in ("global", "local")]
    short = {"reference": "ref", "yardstick": "yard", "base": "base", "all": "all"}
    traced = any(lb.busy_s is not None for lb in result.layers)
    table = Table(title=f"{result.model}: {result.tokens}+{result.decode} tokens on {result.device_name} "
                        f"({result.threads} thread(s)); seconds per layer; 'g'/'l' = global/local in the lockstep"
                        + ("; (…) = the device's busy seconds, traced" if traced else ""))
    others = any(lb.other_variants_s for lb in result.layers)  # --attribution: the variants not timed alone
    for col in ["layer", "kind", "weights", *(f"{short[s]} alone" for s in STACKS),
                *(short[s] + (" g" if m == "global" else " l") for s, m in modes), *(["others g+l"] if others else []),
                "probes", "store", "total", *(["GPU busy"] if traced else []), "tok/s", "peak GiB", "ref/fp32 peak"]:
        table.add_column(col, justify="right", overflow="fold")
    for lb in result.layers:
        share = lb.reference_flop / lb.alone_s["reference"] / result.fp32_peak_flops
        busy = lb.busy_s or {}
        table.add_row(str(lb.layer), lb.kind, _with_busy(lb.weights_s, busy.get("weights")),
                      *(_with_busy(lb.alone_s[s], busy.get(s)) for s in STACKS),
                      *(f"{lb.runner_s.get(f'{s}/{m}', 0.0):.2f}" for s, m in modes),
                      *([f"{lb.other_variants_s:.2f}"] if others else []), f"{lb.probes_s:.2f}",
                      f"{lb.store_s:.2f}", _with_busy(lb.run_s, busy.get("run")),
                      *([f"{100 * busy['run'] / lb.run_s:.0f}%" if busy else "—"] if traced else []),
                      f"{(result.tokens + result.decode) / lb.run_s:,.0f}",
                      "—" if lb.peak_device_gib is None else f"{lb.peak_device_gib:.1f}", f"{100 * share:.0f}%")
    return table
