"""`dsv4-drift run`: the main job — a scenario through the reference, yardstick and variants, layer by layer."""

from __future__ import annotations

import argparse
import resource
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from harness.errors import UsageError
from harness.run.setup import Overrides, build_run_spec, default_out_dir, manifest_for, prompt_digest
from harness.run.runner import LockstepRunner
from harness.scenario import find_scenario, load_scenario, parse_scenario
from harness.run.store import RunStore
from harness.cli.summary import summary_table
from harness.cli.console import console

DEFAULT_SCENARIO = "demo-cpu"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run", help="run a scenario: reference vs yardstick vs optimized variants, per-layer drift to a run directory",
        description="Runs the scenario layer-major (reference, yardstick and every variant in lockstep), writing "
                    "manifest.json and metrics.parquet (layer by layer) to the run directory, then prints a summary.")
    p.add_argument("scenario", nargs="?", default=None,
                   help=f"scenario file or shipped name (default: {DEFAULT_SCENARIO}); omit with --resume")
    p.add_argument("--out", type=Path, help="run directory (default: reports/<scenario>-<UTC time>)")
    p.add_argument("--device", help="cpu or cuda (default: cpu)")
    p.add_argument("--patches", help="replace the scenario's variants by 'base' and one variant with these patches "
                                     "(comma list, 'all'; inline options as id:key=value)")
    p.add_argument("--patch-module", action="append", default=[], metavar="FILE_OR_MODULE",
                   help="plugin module with Patch objects (repeatable)")
    p.add_argument("--local", action=argparse.BooleanOptionalAction, default=None,
                   help="override the scenario's measure.local (shadow runs of every layer on the reference's input)")
    p.add_argument("--resume", type=Path, metavar="RUN_DIR", help="complete an interrupted run with identical numbers")
    p.add_argument("--no-report", action="store_true", help="do not write report.html")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    out = console(stderr=True)
    if args.resume:
        if args.scenario or args.patches or args.patch_module or args.local is not None:
            raise UsageError("--resume takes the scenario and options from the run's manifest; give nothing else")
        store = RunStore(args.resume)
        try:
            manifest = store.read_manifest()
        except FileNotFoundError as e:
            raise UsageError(str(e)) from None
        sc = manifest["scenario"]
        scenario = parse_scenario(sc["text"], sc["file"], Path(sc["file"]).parent if sc["file"] != "<string>" else None)
        ov = manifest["overrides"]
        overrides = Overrides(args.device or ov["device"], ov["patches"], tuple(ov["patch_modules"]), ov.get("local"))
        spec, plan = build_run_spec(scenario, overrides, decode_ids=manifest["prompt"]["decode_ids"])
        if prompt_digest(spec.prompt_ids) != manifest["prompt"]["digest"]:
            raise UsageError(f"{args.resume}: the scenario now resolves to a different prompt; cannot resume")
        start = 0
        streams = None
        if store.state_path.is_file():
            done, streams = store.load_streams()
            start = done + 1
        out.print(f"resuming {args.resume} at layer {start}")
    else:
        path = find_scenario(args.scenario or DEFAULT_SCENARIO)
        scenario = load_scenario(path)
        overrides = Overrides(args.device, args.patches, tuple(args.patch_module), args.local)
        spec, plan = build_run_spec(scenario, overrides)
        store = RunStore(args.out or default_out_dir(scenario))
        try:
            store.create(manifest_for(scenario, path.read_text(), overrides, spec, plan))
        except FileExistsError as e:
            raise UsageError(str(e)) from None
        start, streams = 0, None
        out.print(f"[bold]{scenario.name}[/]: {spec.n_prompt} prompt + {len(spec.decode_ids)} decode tokens, "
                      f"{spec.source.config.num_hidden_layers} layers, variants "
                      f"{', '.join(v.name for v in spec.variants)} → {store.dir}")

    n_layers = spec.source.config.num_hidden_layers
    stacks = 1 + len(spec.stacks())
    if spec.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    segments = store.read_manifest().get("segments", [])
    segments.append({"start_layer": start, "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                     "seconds": 0.0, "device": spec.device})
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), console=out, transient=True) as bar:
        task = bar.add_task("starting", total=(n_layers - start) * stacks)

        def progress(event: dict) -> None:
            if event["event"] == "stack":
                if event["stack"] != "reference" or event["layer"] > start:
                    bar.advance(task)
                bar.update(task, description=f"layer {event['layer'] + 1}/{n_layers} · {event['stack']} "
                                             f"· {event['mode']}")
            elif event["event"] == "layer_done":
                bar.update(task, completed=(event["layer"] + 1 - start) * stacks)
                # each segment's time is on disk after every layer, so a killed run still knows what it cost
                segments[-1].update(seconds=round(time.perf_counter() - t0, 2), last_layer=event["layer"])
                store.update_manifest(segments=segments)
                if not out.is_terminal:  # logs (CI, remote jobs) get one line per layer instead of a live bar
                    out.print(f"layer {event['layer'] + 1}/{n_layers} done in {event['seconds']:.1f} s "
                              f"({time.perf_counter() - t0:.0f} s elapsed)")

        LockstepRunner(spec, store, progress).run(start, streams)
    seconds = time.perf_counter() - t0
    peaks = {"peak_host_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}
    if spec.device.startswith("cuda"):
        peaks["peak_device_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    segments[-1].update(seconds=round(seconds, 2), **peaks)
    # wall_seconds: every segment of a resumed run (the layers a kill interrupted mid-way are not counted)
    store.update_manifest(status="complete", finished=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                          segments=segments, wall_seconds=round(sum(s["seconds"] for s in segments), 2),
                          **_max_peaks(segments))
    metrics = store.read_metrics().to_pandas()
    out.print(summary_table(metrics))
    findings = store.read_findings()
    for f in findings:
        out.print(f"[red]non-finite values[/]: {f['variant']} ({f['mode']}) first at layer {f['layer']}, "
                      f"tap {f['tap']}.{f['field']}, {f['phase']} position {f['position']}")
    if not args.no_report:
        try:
            from harness.report.write import write_report
        except ImportError:
            write_report = None
        if write_report is not None:
            out.print(f"report: {write_report(store.dir)}")
    resumed = f" this segment, {len(segments)} segments" if len(segments) > 1 else ""
    out.print(f"run directory: {store.dir}  ({seconds:.1f} s{resumed}, "
              + ", ".join(f"{k} {v}" for k, v in peaks.items()) + ")")
    return 0


def _max_peaks(segments: list[dict]) -> dict[str, float]:
    """The run's peak memory: the largest over the segments that recorded one (a killed segment did not)."""
    keys = {k for seg in segments for k in seg if k.startswith("peak_")}
    return {k: max(seg[k] for seg in segments if k in seg) for k in sorted(keys)}
