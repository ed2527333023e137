"""`dsv4-drift run`: the main job — a scenario through the reference, yardstick and variants, layer by layer,
then judged by the scenario's gate policy (one verdict for the console, gate.json and report.html)."""

from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from harness.errors import UsageError
from harness.run.distributed import (Group, RankFailed, RunRecipe, first_reported_failure, from_environment,
                                     record_rank_failure, run_share, run_sharded, shared_gpu_note)
from harness.run.layer_log import LayerLog
from harness.run.memory import check_fits, placement_note
from harness.run.setup import (Overrides, build_run_spec, default_out_dir, load_registry, manifest_for,
                               resume_problem, shadowing_warnings, spec_from_manifest)
from harness.run.runner import LockstepRunner, RunSpec
from harness.scenario import find_scenario, load_scenario
from harness.run.store import RunStore
from harness.cli.paths import new_output_dir
from harness.cli.summary import summary_table
from harness.cli.console import console
from harness.cli.threads import (add_threads_argument, host_processes, narrow_model_processes, narrow_model_threads,
                                 oversubscription_note, torch_threads)
from optimized.patching import PluginOpError

DEFAULT_SCENARIO = "demo-cpu"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run", help="run a scenario: reference vs yardstick vs optimized variants, per-layer drift to a run directory",
        description="Runs the scenario layer-major (reference, yardstick and every variant in lockstep), writing "
                    "manifest.json and metrics.parquet (layer by layer) to the run directory, prints a summary, "
                    "gates the run with the scenario's policy (gate.json) and writes report.html from that verdict. "
                    "Exit codes: 0 the gate passes (or --no-gate), 1 it fails, 2 usage or input error, 3 a patch's "
                    "op raised (the run is marked failed and can be resumed), 4 an internal error.")
    p.add_argument("scenario", nargs="?", default=None,
                   help=f"scenario file or shipped name (default: {DEFAULT_SCENARIO}); omit with --resume")
    p.add_argument("--out", type=Path, metavar="RUN_DIR", help="run directory (default: reports/<scenario>-<UTC time>)")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cpu)")
    p.add_argument("--patches", help="replace the scenario's variants by 'base' and one variant with these patches "
                                     "(comma list, 'all'; inline options as id:key=value; later patches wrap earlier "
                                     "ones)")
    p.add_argument("--patch-module", action="append", default=[], metavar="FILE_OR_MODULE",
                   help="plugin module with Patch objects (repeatable)")
    p.add_argument("--local", action=argparse.BooleanOptionalAction, default=None,
                   help="override the scenario's measure.local (shadow runs of every layer on the reference's input)")
    p.add_argument("--resume", type=Path, metavar="RUN_DIR",
                   help="complete an interrupted or failed run with identical numbers (its scenario, options and "
                        "thread count come from its manifest)")
    add_threads_argument(p)
    p.add_argument("--devices", type=int, metavar="N",
                   help="shard the stacks over N processes through torch.distributed: NCCL with --device cuda (one "
                        "GPU each; ranks share GPUs when there are fewer), gloo on the CPU; the reference runs once "
                        "per layer and rank 0 writes the run directory, which equals a one-process run's. Under "
                        "torchrun, its WORLD_SIZE ranks instead (give --out)")
    p.add_argument("--no-gate", action="store_true",
                   help="do not gate the run (no gate.json; the report is then not gated and not coloured)")
    p.add_argument("--keep-state", action="store_true",
                   help="keep state/streams.pt, the streams --resume restarts from, after the run completes")
    p.add_argument("--no-report", action="store_true", help="do not write report.html")
    p.add_argument("--no-triage", action="store_true",
                   help="when a patched variant fails the gate, do not run the triage pass (each of its patches alone, "
                        "local mode, up to its first failing layer) that names the patch, phase and layer")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    out = console(stderr=True)
    if args.devices is not None and args.devices < 1:
        raise UsageError(f"--devices {args.devices}: give at least 1")
    group = from_environment(args.device or "cpu")  # under torchrun: this process's rank
    if group is not None and group.rank != 0:
        return _follow(group)
    if group is not None and not (args.out or args.resume):
        _lead(group, None)
        raise UsageError("under torchrun, give --out RUN_DIR (every rank needs the same run directory)")
    try:
        threads, store, manifest = _resume_inputs(args) if args.resume else (args.threads, None, None)
    except BaseException:
        if group is not None:
            _lead(group, None)
        raise
    with torch_threads(threads):
        try:
            if args.resume:
                spec, store, start, streams = _resume(store, manifest, args)
                world, sharded = _ranks(args, spec, group.world if group is not None else None)
                if sharded:
                    out.print(f"[yellow]note[/]: {sharded}", soft_wrap=True)
                # a run may be resumed on another machine or device: refused, or its streams placed, as a new one
                note = placement_note(spec, check_fits(spec, world))
                if note:
                    out.print(f"[yellow]note[/]: {note}", soft_wrap=True)
            else:
                # may narrow the thread count (narrow_model_threads) and shard a narrow model's long run
                spec, store, world = _start(args, group.world if group is not None else None)
                start, streams = 0, None
        except BaseException:
            if group is not None:  # the other ranks wait for the run: tell them there is none
                _lead(group, None)
            raise
        # for the count the layers will run with
        note = oversubscription_note(torch.get_num_threads(), host_processes(spec.device, world))
        if note:  # once, when the inputs are known to be good and the layers start
            out.print(f"[yellow]note[/]: {note}", soft_wrap=True)
        threads_now = torch.get_num_threads()
        execute = None
        if group is not None:
            recipe = _lead(group, RunRecipe.of(spec, store.dir, threads_now, start))
            execute = lambda started: _share_as_rank_zero(group, recipe, store)  # noqa: E731 - torchrun
        elif world > 1:
            execute = lambda started: run_sharded(world, spec, store, threads_now, start, started)  # noqa: E731
        if execute is not None:  # the ranks load the state themselves: this process need not hold it meanwhile
            streams = None
        try:
            segments, seconds, peaks = _run_layers(spec, store, start, streams, out, execute, world)
        except (PluginOpError, RankFailed) as e:
            hint = (f" — {store.dir} is marked failed and keeps the layers it finished; fix the patch and continue "
                    f"with `dsv4-drift run --resume {store.dir}`")
            if isinstance(e, PluginOpError):
                raise PluginOpError(f"{e}{hint}") from e
            if e.plugin_fault:  # a patch's op raised on one of the ranks
                raise RankFailed(e.rank, f"{e}{hint}") from e
            raise
    if not args.keep_state:
        store.delete_state()
    out.print(summary_table(store.read_metrics().to_pandas()))
    for f in store.read_findings():
        out.print(f"[red]non-finite values[/]: {f['variant']} ({f['mode']}) first at layer {f['layer']}, "
                  f"tap {f['tap']}.{f['field']}, {f['phase']} position {f['position']}")
    exit_code = 0
    if not args.no_gate:
        gate = _gate(store, out)
        exit_code = gate.exit_code
        if not gate.passed and not args.no_triage:
            with torch_threads(threads):
                _triage(spec, store, gate, out)
    if not args.no_report:
        from harness.report.write import write_report

        out.print(f"report: {write_report(store.dir)}")
    waits = segments[-1].get("rank_wait_s")
    if waits:
        out.print(rank_waits_line(waits, seconds), soft_wrap=True)
    resumed = f" this segment, {len(segments)} segments" if len(segments) > 1 else ""
    out.print(f"run directory: {store.dir}  ({seconds:.1f} s{resumed}, "
              + ", ".join(f"{k} {v}" for k, v in peaks.items()) + ")")
    return exit_code


def rank_waits_line(waits: list[dict[str, float]], seconds: float) -> str:
    """A sharded run's ranks' seconds in the layers' collectives, one clause per rank: what a rank waits is time the
    deal gave it less work than the slowest rank (README, Several GPUs or processes)."""
    parts = [f"rank {rank} {w['reference_s'] + w['rows_s']:.1f} s ({w['reference_s']:.1f} for the reference, "
             f"{w['rows_s']:.1f} for the rows)" for rank, w in enumerate(waits)]
    return f"ranks waited for one another: {'; '.join(parts)} — of {seconds:.1f} s"


def _resume_inputs(args: argparse.Namespace) -> tuple[int | None, RunStore, dict]:
    """For --resume: the thread count (asked for, else the run's own), the run's store and its manifest."""
    if args.scenario or args.patches or args.patch_module or args.local is not None:
        raise UsageError("--resume takes the scenario and options from the run's manifest; give nothing else")
    store = RunStore(args.resume)
    try:
        manifest = store.read_manifest()
    except FileNotFoundError as e:
        raise UsageError(str(e)) from None
    if manifest.get("status") == "complete":
        raise UsageError(f"--resume {args.resume}: the run is complete; there is nothing to resume")
    threads = args.threads or manifest["overrides"].get("threads") or manifest["environment"].get("torch_threads")
    return threads, store, manifest


def _start(args: argparse.Namespace, group_world: int | None) -> tuple[RunSpec, RunStore, int]:
    """A new run: the scenario and overrides resolved, the number of ranks chosen (torchrun's group, else --devices,
    else narrow_model_processes), the memory checked, the run directory created (and proven writable before the
    prompt is built, as that may already compute: a greedy decode). Returns the spec, the store and the ranks."""
    out = console(stderr=True)
    path = find_scenario(args.scenario or DEFAULT_SCENARIO)
    scenario = load_scenario(path, load_registry(list(args.patch_module)) if args.patch_module else None)
    with new_output_dir(args.out or default_out_dir(scenario), "--out") as run_dir:
        store = RunStore(run_dir)
        if store.exists():
            raise UsageError(f"--out {store.dir} already holds a run (use --resume to continue it, or another --out)")
        overrides = Overrides(args.device, args.patches, tuple(args.patch_module), args.local, args.threads)
        spec, plan = build_run_spec(scenario, overrides)
        narrow = narrow_model_threads(args.threads, spec.source.config.hidden_size, spec.device)
        world, sharded = _ranks(args, spec, group_world)
        for note in (narrow, sharded):
            if note:
                out.print(f"[yellow]note[/]: {note}", soft_wrap=True)
        for warning in shadowing_warnings(spec.variants, spec.source.config):
            out.print(f"[yellow]warning[/]: {warning}", soft_wrap=True)
        estimate = check_fits(spec, world)  # refused here, with the numbers, if it would not fit
        note = placement_note(spec, estimate)
        if note:
            out.print(f"[yellow]note[/]: {note}", soft_wrap=True)
        store.create({**manifest_for(scenario, path.read_text(), overrides, spec, plan),
                      "memory_estimate": estimate.to_dict()})
    out.print(f"[bold]{scenario.name}[/]: {spec.n_prompt} prompt + {len(spec.decode_ids)} decode tokens, "
              f"{spec.source.config.num_hidden_layers} layers, variants "
              f"{', '.join(v.name for v in spec.variants)}, "
              + (f"{world} processes × " if world > 1 else "") + f"{torch.get_num_threads()} thread(s) → {store.dir}")
    return spec, store, world


def _ranks(args: argparse.Namespace, spec: RunSpec, group_world: int | None) -> tuple[int, str | None]:
    """The processes a new or resumed run shards over: torchrun's (group_world), else --devices, else one, or several
    for a long CPU run of a narrow model (narrow_model_processes); and the note saying so (or, when ranks share a
    GPU, whether MPS lets them overlap: shared_gpu_note)."""
    if group_world is not None:
        return group_world, shared_gpu_note(spec.device, group_world)
    cfg = spec.source.config
    world, note = narrow_model_processes(args.devices, args.threads, cfg.hidden_size, spec.device,
                                         cfg.num_hidden_layers * spec.n_total, len(spec.stacks()))
    return world, note or shared_gpu_note(spec.device, world)


def _resume(store: RunStore, manifest: dict, args: argparse.Namespace
            ) -> tuple[RunSpec, RunStore, int, dict[str, torch.Tensor] | None]:
    """An interrupted or failed run, rebuilt from its manifest, from the layer after its saved state."""
    spec = spec_from_manifest(manifest, args.device)
    problem = resume_problem(manifest, spec)
    if problem:
        raise UsageError(f"--resume {store.dir}: {problem}; cannot resume")
    start, streams = 0, None
    if store.state_path.is_file():
        done, streams = store.load_streams()
        start = done + 1
    out = console(stderr=True)
    out.print(f"resuming {store.dir} at layer {start} with {torch.get_num_threads()} thread(s)")
    first = manifest["environment"].get("torch_threads")
    if first is not None and first != torch.get_num_threads():
        out.print(f"[yellow]note[/]: the run started with {first} thread(s): parallel sums can differ in their last "
                  "digits, so later layers may not match an uninterrupted run exactly", soft_wrap=True)
    return spec, store, start, streams


def _run_layers(spec: RunSpec, store: RunStore, start: int, streams: dict[str, torch.Tensor] | None,
                out: Console, sharded: Callable[[float], None] | None = None, ranks: int = 1
                ) -> tuple[list[dict], float, dict[str, float]]:
    """The lockstep pass with a progress bar (one line per layer in logs), or `sharded(started)`, a sharded run whose
    rank 0 prints a line per layer over `ranks` processes (and, given the segment's start as time.time(), keeps its
    seconds and last layer current in the manifest); each segment's time and peak memory go into the manifest (the
    host's: the largest process's RSS, this one's or a rank's it started; the device's: this process's — a sharded
    run's ranks keep their own). Returns the segments, this segment's seconds and its peaks."""
    n_layers = spec.source.config.num_hidden_layers
    stacks = 1 + len(spec.stacks())
    if spec.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    segments = store.new_segment(start, spec.device, ranks=ranks)
    if sharded is not None:
        store.update_manifest(segments=segments)  # open: rank 0 records its time and last layer after every layer
        try:
            sharded(time.time() - (time.perf_counter() - t0))
        except BaseException:  # the segment's time up to the failure
            segments = store.read_manifest().get("segments", segments)
            segments[-1].update(seconds=round(time.perf_counter() - t0, 2))
            store.update_manifest(segments=segments)
            raise
        segments = store.read_manifest().get("segments", segments)  # with rank 0's last layer
    else:
        _run_with_bar(spec, store, start, streams, out, segments, t0, stacks, n_layers)
    seconds = time.perf_counter() - t0
    # a sharded run's ranks are this process's children: the largest of them (RUSAGE_CHILDREN counts every child
    # waited for, so only when this segment started some)
    whose = (resource.RUSAGE_SELF,) + ((resource.RUSAGE_CHILDREN,) if sharded is not None else ())
    rss_kib = max(resource.getrusage(who).ru_maxrss for who in whose)
    peaks = {"peak_host_rss_gib": round(rss_kib / 2**20, 2)}
    if spec.device.startswith("cuda"):
        peaks["peak_device_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    segments[-1].update(seconds=round(seconds, 2), **peaks)
    # wall_seconds: every segment of a resumed run (the layers a kill interrupted mid-way are not counted)
    store.update_manifest(segments=segments, wall_seconds=round(sum(s["seconds"] for s in segments), 2),
                          **_max_peaks(segments))
    return segments, seconds, peaks


def _run_with_bar(spec: RunSpec, store: RunStore, start: int, streams: dict[str, torch.Tensor] | None, out: Console,
                  segments: list[dict], t0: float, stacks: int, n_layers: int) -> None:
    """The one-process lockstep with a live bar; after every layer its segment's seconds go into the manifest."""
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), console=out, transient=True) as bar:
        task = bar.add_task("starting", total=(n_layers - start) * stacks)
        log = LayerLog(t0=t0)

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
                    out.print(log.line(event))

        LockstepRunner(spec, store, progress).run(start, streams)


def _share_as_rank_zero(group: Group, recipe: RunRecipe, store: RunStore) -> None:
    """Rank 0 under torchrun (this process) runs its share. When another rank stopped first and said where
    (distributed.failure_path), the run fails with that rank's error and place — in the manifest and the exit code —
    not with the broken collective rank 0 saw; an error of rank 0's own kind (a patch, an input, a file) stands."""
    try:
        run_share(group, recipe)
        group.leave()  # with the other ranks, once every share is done
    except (PluginOpError, UsageError, OSError, KeyboardInterrupt):
        raise
    except Exception as e:
        first = first_reported_failure(store.dir, group.world, before_ns=store.manifest_path.stat().st_mtime_ns)
        if first is None:
            raise
        rank, where = first
        message = f"rank {rank} of {group.world} failed: {where.get('error', 'no error recorded')}"
        record_rank_failure(store, group.world, rank, where, message)
        raise RankFailed(rank, message) from e


def _lead(group: Group, recipe: RunRecipe | None) -> RunRecipe | None:
    """Rank 0 under torchrun: send every rank the run to share (None: the run does not start)."""
    sent = [recipe]
    dist.broadcast_object_list(sent, src=0)
    return recipe


def _follow(group: Group) -> int:
    """Rank > 0 under torchrun: run its share of what rank 0 sends (rank 0 reports; 2 when it never starts)."""
    received: list[RunRecipe | None] = [None]
    dist.broadcast_object_list(received, src=0)
    if received[0] is None:
        return 2
    run_share(group, received[0])
    group.leave()  # with rank 0, once both shares are done
    return 0


def _gate(store: RunStore, out: Console):
    """Judge the finished run with its scenario's policy, write gate.json, print the verdict (a GateResult)."""
    from harness.gate.gate_run import gate_run
    from harness.gate.outputs import print_verdict

    result = gate_run(store.dir)
    print_verdict(result, out, max_failures=8)
    return result


def _triage(spec: RunSpec, store: RunStore, gate, out: Console) -> None:
    """Name the patch, phase and first layer behind a failing patched variant (harness.attribution.triage) and put
    the verdict in attribution.json, which the report's banner shows."""
    from harness.attribution.triage import triage

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=out, transient=True) as bar:
        task = bar.add_task("triage", total=None)

        def progress(event: dict) -> None:
            if event["event"] == "stack":
                bar.update(task, description=f"triage · layer {event['layer']} · {event['stack']}")
                bar.advance(task)

        verdict = triage(spec, store.dir, gate, store.read_manifest(), progress)
    if verdict is not None:
        out.print(f"[bold]triage verdict[/]: {verdict['summary']}", soft_wrap=True)


def _max_peaks(segments: list[dict]) -> dict[str, float]:
    """The run's peak memory: the largest over the segments that recorded one (a killed segment did not)."""
    keys = {k for seg in segments for k in seg if k.startswith("peak_")}
    return {k: max(seg[k] for seg in segments if k in seg) for k in sorted(keys)}
