"""`dsv4-drift checkpoint inspect|synth`: look inside a checkpoint (headers only) or write a synthetic one."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from harness.cli.console import console
from harness.cli.paths import writable_dir
from reference.weights.profiles import DEFAULT_PROFILE, PROFILES

from harness.errors import UsageError
from reference.config import ConfigError, get_preset
from reference.weights.source import WeightError


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("checkpoint", help="inspect a checkpoint directory, or write a synthetic one")
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    ins = verbs.add_parser("inspect", help="layout, layers, dtype counts, missing/unexpected tensors, memory per "
                                           "layer per stack — from safetensors headers only (seconds on 160 GB)")
    ins.add_argument("dir", type=Path)
    ins.add_argument("--layers", help="only these layers, e.g. '0-3' or '0,2,5'")
    ins.add_argument("--json", action="store_true", help="print the full report as JSON")
    ins.add_argument("--headers-only", action="store_true",
                     help="the shards hold headers without tensor data (a fixture, a header download): do not count "
                          "the missing data as a problem")
    ins.epilog = "Exit code 2 when the checkpoint has a problem that would stop `dsv4-drift run` (listed)."
    ins.set_defaults(func=run_inspect)
    syn = verbs.add_parser("synth", help="write synthetic weights as a checkpoint in the hf, official or nvfp4 layout")
    syn.add_argument("--format", choices=["hf", "official", "nvfp4"], required=True)
    syn.add_argument("--model", required=True, help="model preset: flash, flash-mini, tiny")
    syn.add_argument("--seed", type=int, default=0)
    syn.add_argument("--profile", choices=sorted(PROFILES), default=DEFAULT_PROFILE,
                     help=f"synthetic weight statistics (default {DEFAULT_PROFILE}; uncalibrated reproduces runs "
                          "before 2026-12-01)")
    syn.add_argument("--out", type=Path, required=True)
    syn.set_defaults(func=run_synth)


def _layers(text: str | None) -> list[int] | None:
    if not text:
        return None
    out: list[int] = []
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            out += list(range(int(lo), int(hi) + 1)) if hi else [int(lo)]
    except ValueError:
        raise UsageError(f"--layers {text!r}: expected numbers and ranges like '0-3,5'") from None
    return out


def run_inspect(args: argparse.Namespace) -> int:
    from reference.weights.inspect import format_inspection, inspect_checkpoint

    if not args.dir.is_dir():
        raise UsageError(f"checkpoint directory {args.dir} does not exist")
    try:
        report = inspect_checkpoint(args.dir, layers=_layers(args.layers))
    except (ConfigError, WeightError) as e:
        raise UsageError(str(e)) from None
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        console().print(format_inspection(report))
    problems = [p for p in report["stops_a_run"] if not (args.headers_only and p in report["truncated"])]
    if problems:
        raise UsageError(f"checkpoint {args.dir}: {len(problems)} problem(s) would stop a run on it (listed above); "
                         f"the first: {problems[0]}")
    return 0


def run_synth(args: argparse.Namespace) -> int:
    from reference.weights.synth import write_synthetic_checkpoint

    try:
        config = get_preset(args.model)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    writable_dir(args.out, "--out")
    path = write_synthetic_checkpoint(config, args.seed, args.out, fmt=args.format, profile=args.profile)
    print(f"wrote {args.format} checkpoint of {args.model} (seed {args.seed}) to {path}")
    return 0
