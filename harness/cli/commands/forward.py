"""`dsv4-drift forward`: golden outputs — logits for every prompt and decode position (and layer outputs)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from harness.cli.paths import writable_file
from harness.cli.threads import add_threads_argument, torch_threads
from harness.run.environment import environment_record
from harness.run.setup import check_device, choose_patches, load_registry
from harness.errors import UsageError
from harness.run.safetensors_stream import write_streamed
from harness.scenario.weights import open_weights
from harness.scenario.token_files import read_token_file
from reference.layer import ParityOptions
from reference.model import ReferenceModel
from reference.weights.profiles import DEFAULT_PROFILE, PROFILES

PARITY_SWITCHES = {"fp8-kv": "fp8_kv", "indexer-fp4": "indexer_fp4"}
LOGITS_BLOCK_ROWS = 1024  # logits rows computed and written at a time (1024 × 129,280 fp32 = 0.5 GB)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "forward",
        help="run one stack over a token file and write logits (and layer outputs) to safetensors",
        description="Golden outputs: logits float32 [n_prompt + n_decode, vocab], one row per position, decode "
                    "tokens fed one at a time after the prompt (teacher-forced); with --dump-layers also "
                    "layers.{L}.out [T, hc_mult, hidden] for every layer.",
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", metavar="PRESET", help="model preset for synthetic weights: flash, flash-mini (default), "
                                                         "tiny")
    src.add_argument("--checkpoint", type=Path, metavar="DIR", help="checkpoint directory (config.json + safetensors)")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="synthetic weight seed (default 0)")
    p.add_argument("--profile", choices=sorted(PROFILES), default=DEFAULT_PROFILE,
                   help=f"synthetic weight statistics (default {DEFAULT_PROFILE}; uncalibrated reproduces runs before "
                        "2026-12-01)")
    p.add_argument("--tokens", type=Path, required=True, metavar="FILE", help="JSON list of prompt token ids")
    p.add_argument("--decode-tokens", type=Path, metavar="FILE", help="JSON list of decode token ids, fed one at a time")
    p.add_argument("--chunk-size", type=int, metavar="N", help="prefill chunk size in tokens (default: the whole prompt at once "
                                                 "for the reference and yardstick, 8192 for the optimized stack)")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32", help="reference precision")
    p.add_argument("--parity", default="", help="official QAT simulation steps to switch on, comma separated: "
                                                 + ", ".join(PARITY_SWITCHES))
    p.add_argument("--stack", choices=["reference", "optimized", "yardstick"], default="reference",
                   help="reference (fp32/fp64), optimized (the serving engine with --patches) or yardstick (the "
                        "reference graph naively in bf16)")
    p.add_argument("--patches", default="none", help="optimized stack: comma list of patch ids, 'all' or 'none' "
                                                     "(inline options as id:key=value)")
    p.add_argument("--patch-module", action="append", default=[], metavar="FILE_OR_MODULE",
                   help="optimized stack: plugin module with Patch objects (repeatable)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    add_threads_argument(p)
    p.add_argument("--dump-layers", action="store_true", help="also write layers.{L}.out for every layer")
    p.add_argument("--out", type=Path, required=True, metavar="FILE", help="output .safetensors file")
    p.set_defaults(func=run)


def parse_parity(text: str) -> ParityOptions:
    names = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [n for n in names if n not in PARITY_SWITCHES]
    if unknown:
        raise UsageError(f"--parity: unknown switch(es) {unknown}; known: {sorted(PARITY_SWITCHES)}")
    return ParityOptions(**{PARITY_SWITCHES[n]: True for n in names})


def build_stack(args: argparse.Namespace, source) -> tuple[object, int | None, str]:
    """The model object for --stack, the prefill chunk size it runs with, and a progress label."""
    if args.stack != "optimized" and (args.patches != "none" or args.patch_module):
        raise UsageError("--patches/--patch-module apply to --stack optimized only")
    if args.stack == "reference":
        dtype = getattr(torch, args.dtype)
        return ReferenceModel(source, dtype, args.device, parse_parity(args.parity)), args.chunk_size, \
            f"reference {args.dtype}"
    if args.parity or args.dtype != "float32":
        raise UsageError("--parity and --dtype apply to --stack reference only")
    if args.stack == "yardstick":
        return ReferenceModel(source, torch.bfloat16, args.device), args.chunk_size, "yardstick bf16"
    from optimized.engine import DEFAULT_CHUNK_SIZE, OptimizedModel
    from optimized.patching import shadowed_patches

    choices = choose_patches(load_registry(args.patch_module), args.patches)
    for shadowing in shadowed_patches(choices, source.config):
        print(f"warning: {shadowing.message()}", file=sys.stderr)
    label = "optimized " + ("+".join(c.id for c in choices) or "base")
    return OptimizedModel(source, choices, args.device), args.chunk_size or DEFAULT_CHUNK_SIZE, label


def run(args: argparse.Namespace) -> int:
    with torch_threads(args.threads) as note:
        return _forward(args, note)


def _forward(args: argparse.Namespace, note: str | None) -> int:
    from rich.progress import Progress

    writable_file(args.out, "--out")
    check_device(args.device)
    source = open_weights(args.model, args.seed, args.checkpoint, args.profile)
    cfg = source.config
    prompt = read_token_file(args.tokens, cfg.vocab_size, "--tokens file")
    decode = read_token_file(args.decode_tokens, cfg.vocab_size, "--decode-tokens file") if args.decode_tokens else []
    if not prompt:
        raise UsageError(f"--tokens file {args.tokens} holds no tokens")
    if args.chunk_size is not None and args.chunk_size <= 0:
        raise UsageError(f"--chunk-size must be positive, got {args.chunk_size}")
    model, chunk_size, label = build_stack(args, source)
    if note:  # once, when the inputs are known to be good
        print(f"note: {note}", file=sys.stderr)
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    with Progress(transient=True) as bar:
        task = bar.add_task(label, total=cfg.num_hidden_layers)
        result = model.forward(prompt, decode, chunk_size, keep_layer_outputs=args.dump_layers,
                               progress=lambda done, total: bar.update(task, completed=done), compute_logits=False)

    streams, n_total = result.final_streams, len(prompt) + len(decode)

    def logit_blocks():  # LOGITS_BLOCK_ROWS positions at a time: the full table is [T, vocab] fp32
        for start in range(0, n_total, LOGITS_BLOCK_ROWS):
            yield model.logits(streams[start : start + LOGITS_BLOCK_ROWS]).float()

    entries = [("logits", torch.float32, (n_total, cfg.vocab_size), logit_blocks)]
    entries += [(f"layers.{layer}.out", out.dtype, tuple(out.shape), lambda out=out: [out])
                for layer, out in enumerate(result.layer_outputs)]
    meta = {
        "stack": args.stack,
        "dtype": args.dtype if args.stack == "reference" else ("bfloat16" if args.stack == "yardstick" else "mixed"),
        "patches": args.patches if args.stack == "optimized" else "",
        "chunk_size": str(chunk_size or len(prompt)),
        "n_prompt": str(len(prompt)),
        "n_decode": str(len(decode)),
        "parity": args.parity,
        "weights": json.dumps(source.describe()),
        "config": json.dumps(cfg.to_dict()),
        "environment": json.dumps(environment_record(args.device)),
    }
    write_streamed(args.out, entries, meta)
    seconds = time.perf_counter() - started
    peak = f", peak device memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB" if args.device.startswith("cuda") else ""
    print(f"wrote {args.out}: logits {(n_total, cfg.vocab_size)}"
          + (f" and {len(result.layer_outputs)} layer outputs" if result.layer_outputs else "")
          + f" ({label}, {seconds:.1f} s{peak})")
    return 0
