"""`dsv4-drift attribute`: which patch, which phase, which layer first (DESIGN §6)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from harness.attribution.attribute import (ATTRIBUTION_FILE, Execute, pair_pass, resume_attribution, resume_layer,
                                           run_attribution, run_lockstep)
from harness.attribution.plan import attribution_variants
from harness.cli.paths import new_output_dir
from harness.cli.threads import (add_threads_argument, host_processes, narrow_model_processes, narrow_model_threads,
                                 oversubscription_note, torch_threads)
from harness.errors import UsageError
from harness.run.distributed import run_sharded, shared_gpu_note
from harness.run.layer_log import LayerLog
from harness.run.memory import check_fits, placement_note
from harness.run.setup import (Overrides, build_run_spec, default_out_dir, load_registry, manifest_for,
                               resume_problem, shadowing_warnings, spec_from_manifest)
from harness.run.runner import RunSpec, VariantSpec
from harness.scenario import find_scenario, load_scenario
from harness.run.store import RunStore
from harness.cli.console import console


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "attribute", help="blame matrix and verdict: base, each patch alone, all but one, all — one pass",
        description="Runs the reference once and, beside it, the base stack, each patch alone, all but one and "
                    "all; writes attribution.json (patch × layer blame per metric and phase, first divergence per "
                    "patch, ranked verdict), gate.json and report.html into the run directory. Exit codes: 0 "
                    "done (whatever the verdict), 2 usage or input error, 3 a patch's op raised, 4 internal error.")
    p.add_argument("scenario", nargs="?", help="scenario file or shipped name; omit with --resume")
    p.add_argument("--resume", type=Path, metavar="RUN_DIR",
                   help="continue an attribution that stopped (killed, interrupted, failed) from its saved state, "
                        "then conclude it; takes the scenario and patches from the run's manifest")
    p.add_argument("--patches", help="the patches to attribute (default: every patch any scenario variant uses; "
                                     "later patches wrap earlier ones in the all and all-but-one variants)")
    p.add_argument("--patch-module", action="append", default=[], metavar="FILE_OR_MODULE",
                   help="plugin module with Patch objects (repeatable)")
    p.add_argument("--policy", metavar="FILE", help="gate policy file (default: the scenario's gate.policy)")
    p.add_argument("--interactions", choices=["auto", "always", "never"], default=None,
                   help="run every pair of patches in a second pass: when needed (auto, the default), always, or "
                        "never; with --resume, the attribution's own unless given")
    p.add_argument("--device", help="cpu, cuda or cuda:N (default: cpu)")
    add_threads_argument(p)
    p.add_argument("--devices", type=int, metavar="N",
                   help="shard the variants over N processes through torch.distributed (as `run --devices`)")
    p.add_argument("--out", type=Path, metavar="RUN_DIR", help="run directory (default: reports/<scenario>-<UTC time>)")
    p.add_argument("--no-report", action="store_true", help="do not write report.html")
    p.set_defaults(func=run)


def patches_of(spec: RunSpec) -> list:
    """Every patch the scenario's variants use, once each, in first-use order."""
    seen: dict[str, object] = {}
    for v in spec.variants:
        for c in v.choices:
            seen.setdefault(c.id, c)
    return list(seen.values())


def attribute(scenario_ref: str, patches: str | None, patch_modules: tuple[str, ...], policy: str | None,
              device: str | None, out: Path | None, interactions: str = "auto", progress=None,
              devices: int | None = 1, threads: int | None = None, announce_threads: bool = True):
    """Programmatic entry (selftest and tests use it): returns (Attribution, run directory). `devices` > 1 shards
    each pass over that many processes (None: as the CLI without --devices, narrow_model_processes decides);
    `threads` is the --threads asked for (None: a narrow model runs on one).
    `announce_threads`: print the oversubscription note for the thread count the passes will run with (known only
    once the scenario's model is, since a narrow model drops to one thread)."""
    path = find_scenario(scenario_ref)
    scenario = load_scenario(path, load_registry(list(patch_modules)) if patch_modules else None)
    with new_output_dir(out or default_out_dir(scenario), "--out") as run_dir:
        store = RunStore(run_dir)
        if store.exists():
            raise UsageError(f"--out {store.dir} already holds a run; choose another --out")
        overrides = Overrides(device, patches, patch_modules)
        spec, plan = build_run_spec(scenario, overrides)
        choices = patches_of(spec)
        if not choices:
            raise UsageError("nothing to attribute: no patches selected (give --patches or a scenario with patched "
                             "variants)")
        first_pass = _first_pass(spec, choices)
        narrow = narrow_model_threads(threads, spec.source.config.hidden_size, spec.device)
        devices, sharded = _processes(first_pass, devices, threads)
        note = oversubscription_note(torch.get_num_threads(), host_processes(spec.device, devices)) \
            if announce_threads else None
        for line in (narrow, sharded, note):
            if line:
                console(stderr=True).print(f"[yellow]note[/]: {line}", soft_wrap=True)
        for warning in shadowing_warnings(first_pass.variants, first_pass.source.config):
            console(stderr=True).print(f"[yellow]warning[/]: {warning}", soft_wrap=True)
        spec.variants = [VariantSpec("patches", choices)]
        manifest = manifest_for(scenario, path.read_text(), overrides, spec, plan)
        pairs_on_host = _fit(spec, first_pass, devices, choices, interactions)
    return run_attribution(spec, store, manifest, policy, progress, interactions, _executor(devices),
                           pairs_on_host), store.dir


def _fit(spec: RunSpec, first_pass: RunSpec, devices: int, choices: list, interactions: str) -> bool:
    """check_fits on the first pass, refusing what would not fit, and on the pair pass where one may run (three
    patches or more, interactions not 'never') in its largest form, every pair of the patches: two global stacks more
    than the first pass's with six patches. `always` refuses a pair pass that would not fit; `auto` warns, since the
    pair pass runs only when the first pass's findings ask for it. Each pass has its streams placed on the host only
    where it fits only so (the first pass in `spec`; the pair pass's placing is returned, for run_attribution), and
    the command says so for each: a first pass that fits as it is does not pay the copies for a pair pass that may
    never run. A pair pass that fits neither way is placed where that is possible, as the closest."""
    out = console(stderr=True)
    first_pass.streams_on_host = False  # decided afresh: a resume may be on another machine or device
    estimate = check_fits(first_pass, devices)
    spec.streams_on_host = first_pass.streams_on_host
    note = placement_note(first_pass, estimate)
    if note:
        out.print(f"[yellow]note[/]: {note}", soft_wrap=True)
    if interactions == "never" or len(choices) < 3:
        return False
    pairs = pair_pass(first_pass, choices, [c.id for c in choices])
    pairs.streams_on_host = False
    try:
        pair_estimate = check_fits(pairs, devices)
    except UsageError as e:
        if interactions == "always":
            raise UsageError(f"the interactions pass (every pair of the patches): {e}") from None
        out.print(f"[yellow]warning[/]: the interactions pass, if the first pass asks for it, would not fit: {e} "
                  "(give --interactions never to skip it)", soft_wrap=True)
        # it fits neither way: if it runs, its streams on the host come closest (one process on a GPU; a sharded
        # pass is never placed)
        return devices == 1 and torch.device(first_pass.device).type == "cuda"
    note = placement_note(pairs, pair_estimate)
    if note:  # its own numbers: the larger pass pins more than the first pass's note says
        out.print(f"[yellow]note[/]: the interactions pass, if it runs: {note}", soft_wrap=True)
    return pairs.streams_on_host


def _first_pass(spec: RunSpec, choices: list) -> RunSpec:
    """The attribution's first pass (as run_attribution runs it): base, each patch alone, all but one, all; local."""
    return RunSpec(**{**spec.__dict__, "variants": attribution_variants(choices), "local": True})


def _processes(first_pass: RunSpec, devices: int | None, threads: int | None) -> tuple[int, str | None]:
    """The processes a pass shards over and the note saying so (narrow_model_processes and shared_gpu_note, as
    `run`)."""
    cfg = first_pass.source.config
    world, note = narrow_model_processes(devices, threads, cfg.hidden_size, first_pass.device,
                                         cfg.num_hidden_layers * first_pass.n_total, len(first_pass.stacks()))
    return world, note or shared_gpu_note(first_pass.device, world)


def _executor(devices: int) -> Execute:
    """How a pass runs: in this process, or sharded over `devices` processes of this thread count. A sharded pass is
    called as its segment opens (attribute._run_pass), so its rank 0 keeps the segment's seconds and last layer
    current after every layer, as a sharded run's does: a pass killed with its launcher still says what it cost."""
    if devices <= 1:
        return run_lockstep
    threads = torch.get_num_threads()
    return lambda spec, store, _progress, start: run_sharded(devices, spec, store, threads, start,
                                                             segment_started=time.time())


def resume_threads(manifest: dict, threads: int | None) -> int | None:
    """The thread count a resumed attribution runs with: the one asked for, else the run's own (parallel sums
    change with it)."""
    return threads or manifest["overrides"].get("threads") or manifest["environment"].get("torch_threads")


def _attribution_manifest(run_dir: Path) -> dict:
    store = RunStore(run_dir)
    try:
        manifest = store.read_manifest()
    except FileNotFoundError as e:
        raise UsageError(str(e)) from None
    if "attribution" not in manifest or manifest["attribution"].get("pass") == "interactions":
        raise UsageError(f"--resume {run_dir}: not an attribution's run directory (a run's continues with "
                         "`dsv4-drift run --resume`)")
    if (store.dir / ATTRIBUTION_FILE).is_file():
        raise UsageError(f"--resume {run_dir}: the attribution is complete ({ATTRIBUTION_FILE}); there is nothing "
                         "to resume")
    return manifest


def resume(run_dir: Path, manifest: dict, policy: str | None, device: str | None, interactions: str | None = None,
           progress=None, devices: int | None = None, threads: int | None = None):
    """`attribute --resume`: the stopped attribution in `run_dir` (its manifest read by _attribution_manifest),
    rebuilt from its manifest, continued and concluded; returns (Attribution, run directory). `interactions` None:
    the attribution's own setting."""
    store = RunStore(run_dir)
    spec = spec_from_manifest(manifest, device)
    problem = resume_problem(manifest, spec)
    if problem:
        raise UsageError(f"--resume {run_dir}: {problem}; cannot resume")
    choices = patches_of(spec)
    if [c.id for c in choices] != manifest["attribution"]["patches"]:
        raise UsageError(f"--resume {run_dir}: the run attributed {manifest['attribution']['patches']}, its scenario "
                         f"now resolves to {[c.id for c in choices]}; cannot resume")
    first_pass = _first_pass(spec, choices)
    devices, sharded = _processes(first_pass, devices, threads)
    interactions = interactions or manifest["attribution"].get("interactions", "auto")
    # resumed on another machine or device: refused, or its streams placed, as a new one would be
    pairs_on_host = _fit(spec, first_pass, devices, choices, interactions)
    spec.variants = [VariantSpec("patches", choices)]
    first = resume_layer(store)
    console(stderr=True).print(f"resuming {store.dir} " + (f"at layer {first}" if first is not None else
                                                             "after its first pass")
                               + f" with {torch.get_num_threads()} thread(s)")
    if sharded:
        console(stderr=True).print(f"[yellow]note[/]: {sharded}", soft_wrap=True)
    return resume_attribution(spec, store, policy, progress, interactions, _executor(devices),
                              pairs_on_host), store.dir


def run(args: argparse.Namespace) -> int:
    out = console(stderr=True)
    if args.resume is not None and (args.scenario or args.patches or args.patch_module or args.out):
        raise UsageError("--resume takes the scenario, patches and run directory from the run's manifest; give "
                         "no scenario, --patches, --patch-module or --out")
    if args.resume is None and not args.scenario:
        raise UsageError("give a scenario (file or shipped name), or --resume RUN_DIR")
    manifest = _attribution_manifest(args.resume) if args.resume is not None else None
    threads = resume_threads(manifest, args.threads) if manifest is not None else args.threads
    with torch_threads(threads), Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), console=out, transient=True) as bar:
        task = bar.add_task("attribution", total=None)
        log = LayerLog()

        def progress(event: dict) -> None:
            if event["event"] == "stack":
                bar.update(task, description=f"layer {event['layer'] + 1} · {event['stack']} · {event['mode']}")
                bar.advance(task)
            elif event["event"] == "layer_done" and not out.is_terminal:
                # logs (CI, remote jobs) get one line per layer: at Flash width a pass takes tens of minutes, its bar
                # is lost (the time left is the pass's: LayerLog sees a second pass start over)
                out.print(log.line(event))

        if args.devices is not None and args.devices < 1:
            raise UsageError(f"--devices {args.devices}: give at least 1")
        if args.resume is not None:
            result, run_dir = resume(args.resume, manifest, args.policy, args.device, args.interactions, progress,
                                     args.devices, threads)
        else:
            result, run_dir = attribute(args.scenario, args.patches, tuple(args.patch_module), args.policy,
                                        args.device, args.out, args.interactions or "auto", progress, args.devices,
                                        args.threads)
    table = Table(title="attribution: first divergence beyond the gate")
    for col in ("patch", "phase", "first layer", "metric", "value", "bound"):
        table.add_column(col)
    for d in result.ranking():
        table.add_row(d.patch, d.phase, str(d.first_layer), d.metric, f"{d.value:.4g}", f"{d.bound:.4g}")
    out.print(table)
    out.print(f"[bold]verdict[/]: {result.verdict()['summary']}")
    if not args.no_report:
        from harness.report.write import write_report

        out.print(f"report: {write_report(run_dir)}")
    out.print(f"run directory: {run_dir}")
    return 0
