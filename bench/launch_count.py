"""How many tensor operations one layer of the lockstep launches, and where: the GPU run's host cost, counted anywhere.

    python bench/launch_count.py --model flash-mini --tokens 30720 --decode 64 --layer 2

At Flash width a layer is host-bound on an H200: a `torch.profiler` trace of a CSA layer at 30,720 + 64 tokens
counted ~895,000 kernel launches, whose kernels kept the GPU busy 7.8 s of the layer's 26.8 s (README,
Benchmarks). Every tensor operation that is not a view launches at least one kernel on a GPU, so counting them on
the CPU (a TorchDispatchMode; flash-mini has Flash's structure: the same stacks, blocks, decode steps and probes)
shows where launches come from without a GPU, and whether a change removed some. Host reads (`.item()`, `int()`,
`nonzero`, and every `.tolist()` and `.cpu()` call: on a GPU each waits for the queue) are counted too.

The count follows a GPU's where the code differs by device: a function `reference.graphs.replay` would replay from a
CUDA graph on a GPU counts as its input copies, one launch and its output copies (`--eager` counts its operations,
as the CPU runs them); the engine's bf16 round trip and FP8 activation quantizer count as the one Triton kernel a
GPU runs for a prefill-sized tensor (optimized.kernels.rounding: one launch, one read and one write per element;
`--eager` counts the torch ops); the indexer's top-k set takes the ranked form a GPU takes (reference.ops.topk:
no host reads; `--eager` too); the comparisons of prefill query blocks are batched on a GPU only (`--defer-blocks`
batches them here too: probes.ComparingSink.DEFER_BLOCKS_ON_CPU). It still differs in the query block size (a GPU's from
its memory). Regions: `reference` / `yardstick/MODE` / `VARIANT/MODE`, then `prefill` or `decode`,
then what ran — `stack` (the layer's own computation), `sites` (the stock op and its twin beside a variant's,
held sites' joined calls included, and since the thirty-first session the experts sites' stock calls, charged to
`stack` before),
`compare` (the comparing sink, as taps arrive), `finish compare` (what the sink held until the stack finished: the
deferred and sampled comparisons, of both phases), `record` (the reference's taps).
"""

from __future__ import annotations

import bisect
import collections
import os
import sys
import tempfile
import time
from typing import Any, Callable, Iterator

import torch
from torch.autograd import DeviceType
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from bench_common import bench_parser, bench_run_spec, bench_setup
from harness.run import probes
from harness.run.runner import LockstepRunner, RunSpec
from harness.run.store import RunStore
from optimized import engine, ops
from reference import graphs
from reference.weights import dense_cache
from reference import layer as reference_layer

NO_LAUNCH = frozenset({
    "view", "_unsafe_view", "as_strided", "slice", "select", "unsqueeze", "squeeze", "expand", "t", "transpose",
    "permute", "detach", "alias", "unflatten", "split", "split_with_sizes", "unbind", "empty", "empty_strided",
    "empty_like", "_local_scalar_dense", "reshape", "flatten", "_reshape_alias", "resolve_conj", "resolve_neg",
    "lift_fresh", "narrow", "diagonal", "chunk", "expand_as", "view_as"})
"""ATen operations that only make views or read metadata: no kernel on a GPU."""
HOST_READS = frozenset({"_local_scalar_dense", "nonzero"})
"""Operations that wait for the device: a scalar read (`.item()`, `int()`, `.tolist()` per element) and nonzero."""


class LaunchCounter(TorchDispatchMode):
    """Counts operations that launch and host reads per region (the innermost label on `labels`). `.tolist()` and
    `.cpu()` do not reach the dispatcher on a CPU tensor: they are wrapped while the counter is active."""

    def __init__(self) -> None:
        super().__init__()
        self.labels = ["(outside)"]
        self.launches: collections.Counter[str] = collections.Counter()
        self.reads: collections.Counter[str] = collections.Counter()
        self.ops: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self._unwrapped: dict[str, Callable[..., Any]] = {}
        self.paused = False  # inside a function counted as a graph replay
        self.callers: dict[str, collections.Counter[str]] | None = None  # per region, when asked (--callers)
        self.read_callers: dict[str, collections.Counter[str]] = {}  # per region, the host reads' lines (--callers)
        self.bytes_by_line: dict[str, collections.Counter[str]] | None = None  # per line per op, when asked (--bytes)

    def __enter__(self) -> "LaunchCounter":
        for method in ("tolist", "cpu"):
            original = self._unwrapped[method] = getattr(torch.Tensor, method)

            def read(tensor: torch.Tensor, *args: Any, _original: Callable[..., Any] = original, **kwargs: Any) -> Any:
                self._read()
                return _original(tensor, *args, **kwargs)
            setattr(torch.Tensor, method, read)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        for method, original in self._unwrapped.items():
            setattr(torch.Tensor, method, original)
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        name = func.__name__.split(".")[0]
        if self.paused:
            return func(*args, **(kwargs or {}))
        if name in HOST_READS:
            self._read()
        out = func(*args, **(kwargs or {}))
        if name not in NO_LAUNCH:
            self.launches[self.labels[-1]] += 1
            self.ops[self.labels[-1]][name] += 1
            if self.callers is not None:
                self.callers.setdefault(self.labels[-1], collections.Counter())[caller()] += 1
            if self.bytes_by_line is not None:
                self.bytes_by_line[caller()][name] += bytes_moved(name, args, kwargs, out)
        return out

    def _read(self) -> None:
        self.reads[self.labels[-1]] += 1
        if self.callers is not None:
            self.read_callers.setdefault(self.labels[-1], collections.Counter())[caller()] += 1


def bytes_moved(name: str, args: Any, kwargs: Any, out: Any) -> int:
    """Bytes an operation reads and writes, from its tensor arguments and results: each counted whole, but for an
    indexed write (`index_put_`: `x[idx] = v`), which reads and writes the rows of v, not the whole of x (the
    result is x itself)."""
    if name == "index_put_":
        args, out = args[1:], args[2]
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves((args, kwargs, out))
               if isinstance(t, torch.Tensor))


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = tuple(os.path.join(REPO, p) + os.sep for p in ("reference", "optimized", "harness"))


CALLER_DEPTH = 1
"""Lines of this repository's packages named per operation (--caller-depth): 1, the innermost; 2 adds the line
that called it (a helper such as numerics.bf16 is called from dozens of places), and so on."""


def caller() -> str:
    """The innermost CALLER_DEPTH lines of this repository's packages on the stack ('path:line function', joined by
    ' <- '): where an operation was asked for, below torch's own frames and this counter's."""
    frame, lines = sys._getframe(2), []
    while frame is not None and len(lines) < CALLER_DEPTH:
        path = frame.f_code.co_filename
        if path.startswith(PACKAGES):
            lines.append(f"{os.path.relpath(path, REPO)}:{frame.f_lineno} {frame.f_code.co_name}")
        frame = frame.f_back
    return " <- ".join(lines) or "(elsewhere)"


def count_replays_as_graphs(counter: LaunchCounter) -> None:
    """Count each call `reference.graphs.replay` would replay on a GPU as a GPU runs it: a copy per input, the graph's
    launch and the copies of its outputs (graphs._Graph.__call__: one when it packs them, else one per output), not
    the operations inside. Patched where it is imported."""
    def replay(fn: Callable[..., Any], *tensors: torch.Tensor, max_elements: int = graphs.MAX_ELEMENTS,
               **static: Any) -> Any:
        if not graphs.small_enough(tensors, max_elements) or counter.paused:
            return fn(*tensors, **static)
        counter.paused = True
        try:
            out = fn(*tensors, **static)
        finally:
            counter.paused = False
        copies = len(tensors) + (1 if isinstance(out, torch.Tensor) or graphs.packs_outputs(out) else len(out))
        counter.launches[counter.labels[-1]] += copies + 1
        counter.ops[counter.labels[-1]]["graph replay"] += 1
        counter.ops[counter.labels[-1]]["copy_ (graph in/out)"] += copies
        return out
    replay.counts_graphs = True  # type: ignore[attr-defined]  # a later counter replaces this one's wrapper
    for module in list(sys.modules.values()):
        current = module.__dict__.get("replay") if isinstance(getattr(module, "__dict__", None), dict) else None
        if module is not graphs and (current is graphs.replay or getattr(current, "counts_graphs", False)):
            module.replay = replay


def count_fused_rounding(counter: LaunchCounter) -> None:
    """Count each rounding optimized.numerics gives a GPU's one-pass kernels (optimized.kernels.rounding) as the GPU
    runs it: one launch that reads and writes each element once — where the GPU would take them (an fp32, contiguous
    tensor past a replayed graph's inputs), not inside a function counted as a graph replay (a capture keeps the
    torch ops), and nowhere under DSV4_DRIFT_KERNEL_IMPL=torch (as on a GPU). The values are the torch ops' (the
    kernels' bits), computed uncounted. optimized.numerics stays patched for the rest of the process (this
    script's)."""
    from optimized import numerics
    from optimized.kernels import rounding

    from optimized.kernels import IMPL_ENV

    def applies(x: torch.Tensor) -> bool:  # DSV4_DRIFT_KERNEL_IMPL=torch keeps a GPU on the torch ops: counted so
        return not counter.paused and rounding.prefill_sized(x) and os.environ.get(IMPL_ENV, "auto") != "torch"

    def one_pass(name: str, torch_op: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def run(x: torch.Tensor, *args: Any, impl: str = "auto") -> torch.Tensor:
            counter.paused = True
            try:
                out = torch_op(x, *args, impl="torch")
            finally:
                counter.paused = False
            counter.launches[counter.labels[-1]] += 1
            counter.ops[counter.labels[-1]][f"{name} (one pass)"] += 1
            if counter.callers is not None:
                counter.callers.setdefault(counter.labels[-1], collections.Counter())[caller()] += 1
            if counter.bytes_by_line is not None:
                counter.bytes_by_line[caller()][name] += 2 * x.numel() * x.element_size()
            return out
        return run

    numerics.fused_rounding_applies = applies
    numerics.bf16_round = one_pass("bf16_round", rounding.bf16_round)
    numerics.fp8_block_quant = one_pass("fp8_block_quant", rounding.fp8_block_quant)


def count_reads_as_on_a_gpu() -> None:
    """Take the paths a GPU takes where a host read would stall it (reference.ops.topk.reads_stall: the ranked top-k
    set), so that the counts are a GPU's. reference.ops.topk stays patched for the rest of the process."""
    from reference.ops import topk

    topk.reads_stall = lambda device: True


class RegionTimer:
    """Wall seconds per region, each charged to the innermost label running (`--time`): no dispatch mode, so the
    stacks run at their own speed (on a GPU, host-bound, the host's time in a region is the region's cost; a host
    read charges its wait for the queue to the region that reads). `labels` as LaunchCounter's. `marked`: each region
    also opens a profiler range named REGION_MARK + its label (`--kernels`: kernels_by_region charges them)."""

    def __init__(self, sync: Callable[[], None] = lambda: None) -> None:
        self.labels = ["(outside)"]
        self.seconds: collections.Counter[str] = collections.Counter()
        self._since = time.perf_counter()
        self._sync = sync
        self.marked = False
        self._ranges: list[Any] = []

    def _charge(self) -> None:
        self._sync()
        now = time.perf_counter()
        self.seconds[self.labels[-1]] += now - self._since
        self._since = now

    def enter_region(self, label: str) -> None:
        self._charge()
        self.labels.append(label)
        if self.marked:
            self._ranges.append(torch.profiler.record_function(REGION_MARK + label))
            self._ranges[-1].__enter__()

    def leave_region(self) -> None:
        if self.marked and self._ranges:
            self._ranges.pop().__exit__(None, None, None)
        self._charge()
        self.labels.pop()


REGION_MARK = "region|"
"""Prefix of the profiler ranges RegionTimer opens per region (`--kernels`)."""


def launch_sites(events: list[Any]) -> Iterator[tuple[Any, str, str]]:
    """Each event of a profile (torch.profiler's FunctionEvent trees) with the innermost REGION_MARK range around it
    ("(outside)" when none) and the innermost LINE_MARK range's lines of this repository's code ("(no line)" when
    none: a profile made without LineMarks, or a launch that is no ATen operation, such as a Triton kernel's)."""
    todo: list[tuple[Any, str, str]] = [(e, "(outside)", "(no line)") for e in events if e.cpu_parent is None]
    while todo:
        event, region, line = todo.pop()
        if event.name.startswith(REGION_MARK):
            region = event.name[len(REGION_MARK):]
        elif event.name.startswith(LINE_MARK):
            line = event.name[len(LINE_MARK):]
        yield event, region, line
        todo += [(child, region, line) for child in event.cpu_children]


def kernels_by_region(events: list[Any]) -> tuple[collections.Counter[str], dict[str, collections.Counter[str]],
                                                   dict[str, collections.Counter[str]]]:
    """Device seconds of the kernels each region launched, per region per kernel name, and per line of this
    repository's code per kernel name (launch_sites: a kernel belongs to the CPU event that launched it)."""
    busy: collections.Counter[str] = collections.Counter()
    by_name: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    by_line: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for event, region, line in launch_sites(events):
        for kernel in event.kernels:
            busy[region] += kernel.duration / 1e6
            by_name[region][kernel.name] += kernel.duration / 1e6
            by_line[line][kernel.name] += kernel.duration / 1e6
    return busy, by_name, by_line


def idle_before_launches(events: list[Any]) -> tuple[float, collections.Counter[str], collections.Counter[str],
                                                     collections.Counter[str]]:
    """Seconds the device sat idle between its first and last activity, charged per region, per line and per
    operation (the CPU event's name, such as aten::copy_ or cudaLaunchKernel) to the CPU event that launched the
    activity ending each gap: the device waited for the host to ask for it (a host
    read that drained the queue, Python between launches, a launch slower than its kernel). Device activities are
    the events on a non-CPU device (kernels, copies, memsets); overlapping ones (two streams) count once. Not
    activities: the device-side spans the profiler draws for record_function ranges (user annotations, such as
    REGION_MARK's and LINE_MARK's), which would cover every gap inside a region.

    The launcher is the CPU event whose `id` is the activity's `linked_correlation_id` where this torch records it;
    else (the GPU machine's torch 2.11 does not: every gap came out unlinked) the last CPU event with kernels that
    began before the activity did — with the device idle, an activity starts microseconds after its launch, sooner
    than the host launches again, and one host thread launches at a time (launch_count turns the runner's host
    lanes off). "(unlinked)" when neither is found.

    What is charged is the launch that ended the wait, not its cause: after a host read drained the queue, the line
    charged is the next one to launch (the read itself launches nothing, or a copy of its own), so read a charged
    line together with what ran just before it; a Triton kernel or graph replay, which no ATen event launches, is
    charged to the ATen operation before it."""
    sites = [(event, region, line, event.name) for event, region, line in launch_sites(events) if event.kernels]
    by_id = {site[0].id: site[1:] for site in sites}
    sites.sort(key=lambda site: site[0].time_range.start)
    starts = [site[0].time_range.start for site in sites]
    device = sorted((e for e in events if e.device_type != DeviceType.CPU
                     and not getattr(e, "is_user_annotation", False)
                     and not e.name.startswith((REGION_MARK, LINE_MARK))),
                    key=lambda e: e.time_range.start)
    by_region: collections.Counter[str] = collections.Counter()
    by_line: collections.Counter[str] = collections.Counter()
    by_op: collections.Counter[str] = collections.Counter()
    total, busy_until = 0.0, None
    for e in device:
        if busy_until is not None and e.time_range.start > busy_until:
            gap = (e.time_range.start - busy_until) / 1e6
            where = by_id.get(getattr(e, "linked_correlation_id", None))
            if where is None:
                i = bisect.bisect_right(starts, e.time_range.start) - 1
                where = sites[i][1:] if i >= 0 else ("(unlinked)",) * 3
            total += gap
            by_region[where[0]] += gap
            by_line[where[1]] += gap
            by_op[where[2]] += gap
        busy_until = e.time_range.end if busy_until is None else max(busy_until, e.time_range.end)
    return total, by_region, by_line, by_op


LINE_MARK = "line|"
"""Prefix of the profiler ranges LineMarks opens around each launching operation (`--kernel-lines`)."""


class LineMarks(TorchDispatchMode):
    """Opens a profiler range named LINE_MARK + caller() around each ATen operation that launches, so that a traced
    run's kernels can be charged to the lines of this repository's code that asked for them (launch_sites). Not the
    profiler's with_stack: the GPU machine's torch (2.11) records no Python frames with it (an H100 profile of
    2026-12-07 charged every kernel to no line). Slows the host, so the idle seconds of a run marked so are not the
    run's."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        # the profiler's own operations (a region's record_function opening) are no launch: a mark around one
        # would overlap the region's range without nesting in it
        if func.__name__.split(".")[0] in NO_LAUNCH or func.namespace == "profiler":
            return func(*args, **(kwargs or {}))
        with torch.profiler.record_function(LINE_MARK + caller()):
            return func(*args, **(kwargs or {}))


def labelled(counter: LaunchCounter | RegionTimer, fn: Callable[..., Any], label: Callable[..., str]
             ) -> Callable[..., Any]:
    """fn, counting what it launches (or timing it) under label(*args) while it runs."""
    push = counter.enter_region if isinstance(counter, RegionTimer) else counter.labels.append
    pop = counter.leave_region if isinstance(counter, RegionTimer) else counter.labels.pop

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        push(label(*args))
        try:
            return fn(*args, **kwargs)
        finally:
            pop()
    return wrapper


def instrument(counter: LaunchCounter | RegionTimer, where: dict[str, str], n_prompt: int, by_tap: bool = False,
               by_op: bool = False) -> None:
    """Wrap the stacks' forwards, the engine's site computations and the sinks; `where['stack']` follows the
    runner's progress events; `by_tap`: each tap's comparisons get a region of their own (both phases); `by_op`:
    each engine op call gets one (STACK PHASE op NAME; nested calls charged to the innermost, so a patch's op that
    calls the stock one is split between them). A forward's phase is that of its first position (the layer state's
    position: the reference and the yardstick may run the decode tokens as one segment)."""
    def stack_label(_self: Any, streams: torch.Tensor, token_ids: torch.Tensor, state: Any, *_: Any) -> str:
        where["phase"] = "prefill" if state.position < n_prompt else "decode"
        return f"{where['stack']} {where['phase']} stack"

    engine.OptimizedLayer.forward = labelled(counter, engine.OptimizedLayer.forward, stack_label)
    reference_layer.ReferenceLayer.forward = labelled(counter, reference_layer.ReferenceLayer.forward, stack_label)
    for method in ("_emit_site", "_emit_held_sites", "_emit_indexer_site", "_emit_probs", "_judge_experts"):
        setattr(engine.OptimizedLayer, method, labelled(counter, getattr(engine.OptimizedLayer, method),
                                                        lambda *_: f"{where['stack']} {where['phase']} sites"))
    probes.ComparingSink.emit = labelled(counter, probes.ComparingSink.emit,
                                         lambda *_: f"{where['stack']} {where['phase']} compare")
    probes.ComparingSink.finish = labelled(counter, probes.ComparingSink.finish,
                                           lambda *_: f"{where['stack']} finish compare")
    probes.RecordingSink.emit = labelled(counter, probes.RecordingSink.emit, lambda *_: "reference record")
    if by_op:
        ops.OpTable.call = labelled(counter, ops.OpTable.call,
                                    lambda _self, name, *_: f"{where['stack']} {where['phase']} op {name}")
    if by_tap:  # each tap's comparisons apart, wherever they run (on arrival, deferred, held, at finish)
        probes.ComparingSink._compare = labelled(counter, probes.ComparingSink._compare,
                                                 lambda _self, tap, *_: f"{where['stack']} compare {tap}")
        probes.ComparingSink._compare_held = labelled(counter, probes.ComparingSink._compare_held,
                                                      lambda _self, tap: f"{where['stack']} compare {tap} (sampled)")


def main() -> None:
    ap = bench_parser(__doc__, tokens=8192)
    ap.add_argument("--layer", type=int, default=2, help="the layer counted (default 2: CSA in every preset)")
    ap.add_argument("--variants", default="base,all",
                    help="comma-separated patch sets, or attribution (default base,all)")
    ap.add_argument("--top", type=int, default=30, help="regions listed (default 30)")
    ap.add_argument("--defer-blocks", action="store_true", help="batch prefill blocks' comparisons, as on a GPU")
    ap.add_argument("--ops", type=int, default=0, help="also list each region's N most frequent operations")
    ap.add_argument("--callers", type=int, default=0,
                    help="also list each region's N busiest lines of code, for its launches and its host reads")
    ap.add_argument("--caller-depth", type=int, default=1,
                    help="with --callers, name each line's callers too, up to N lines of this repository (default 1)")
    ap.add_argument("--bytes", type=int, default=0,
                    help="also list the N lines of this repository's code whose operations move the most bytes (each "
                         "launching operation's tensor arguments and results, read and written, summed over the "
                         "layer): a GPU's element-wise and copy kernels are bound by them, so this ranks lines by "
                         "their memory traffic on any machine (GEMMs' traffic is counted too, not their FLOPs)")
    ap.add_argument("--eager", action="store_true", help="count what a GPU replays from CUDA graphs op by op")
    ap.add_argument("--time", action="store_true",
                    help="time each region (host wall seconds, exclusive) instead of counting its operations")
    ap.add_argument("--sync", action="store_true",
                    help="with --time, wait for the GPU at every region's edge: each region's seconds include the "
                         "kernels it queued (and the syncs' own cost)")
    ap.add_argument("--kernels", action="store_true",
                    help="with --time on a GPU, also trace the timed run (torch.profiler) and list each region's "
                         "device-busy seconds and busiest kernels (tracing slows the host: its wall seconds are "
                         "not the untraced run's)")
    ap.add_argument("--by-tap", action="store_true",
                    help="charge each tap's comparisons to a region of its own (STACK compare TAP), both phases; "
                         "their NaN/Inf checks stay with the emission or finish that makes them")
    ap.add_argument("--by-op", action="store_true",
                    help="charge each engine op call (linear, experts, sparse_attention, …) to a region of its own "
                         "(STACK PHASE op NAME), the innermost when ops nest")
    ap.add_argument("--kernels-listed", type=int, default=3,
                    help="with --kernels, the busiest kernels listed per region (default 3)")
    ap.add_argument("--kernel-lines", type=int, default=0,
                    help="with --kernels, also list the N lines of this repository's code whose kernels kept the "
                         "device busiest, and those that launched after the device's idle gaps, over all regions "
                         "(each operation is marked in the trace: slower still; --caller-depth names their callers "
                         "too)")
    ap.add_argument("--cache-fraction", type=float,
                    help="the layer's dense cache takes this share of the GPU's memory instead of the runner's "
                         "(reference.weights.dense_cache.DEVICE_BUDGET_FRACTION): an H100 given an H200's room, "
                         "to measure there what that room changes")
    ap.add_argument("--decode-steps", action="store_true",
                    help="the reference, the yardstick and the engines decode one pass per step, and the engines "
                         "compute their decode sites once per step, as on the CPU (default: as on a GPU)")
    args = ap.parse_args()
    if args.kernels and not args.time:
        ap.error("--kernels traces the timed run: give --time too")
    if args.kernel_lines and not args.kernels:
        ap.error("--kernel-lines charges the traced run's kernels: give --kernels too")
    global CALLER_DEPTH
    CALLER_DEPTH = max(1, args.caller_depth)
    probes.ComparingSink.DEFER_BLOCKS_ON_CPU = args.defer_blocks
    if args.cache_fraction is not None:
        dense_cache.DEVICE_BUDGET_FRACTION = args.cache_fraction
    torch.set_num_threads(1)
    cfg, ids = bench_setup(args)
    spec = bench_run_spec(args, cfg, ids, args.variants, reference_decode_together=not args.decode_steps,
                          decode_sites_together=not args.decode_steps, engine_decode_together=not args.decode_steps)
    where = {"stack": "reference", "phase": "prefill"}
    if args.time:
        return time_regions(spec, args, where)
    counter = LaunchCounter()
    if args.callers:
        counter.callers = {}
    if args.bytes:
        counter.bytes_by_line = collections.defaultdict(collections.Counter)
    instrument(counter, where, args.tokens, args.by_tap, args.by_op)
    count_reads_as_on_a_gpu()
    if not args.eager:
        count_replays_as_graphs(counter)
        count_fused_rounding(counter)

    def progress(event: dict) -> None:
        if event.get("event") == "stack":
            where["stack"] = "reference" if event["stack"] == "reference" else f"{event['stack']}/{event['mode']}"

    with tempfile.TemporaryDirectory() as tmp:
        store = RunStore(tmp + "/run")
        store.create({})
        runner = LockstepRunner(spec, store, progress)
        runner.HOST_LANES = False  # regions follow one thread's events: one stack at a time
        streams = runner.initial_streams()
        weights = spec.source.layer(args.layer, torch.device(args.device))
        with counter:
            runner.run_layer(args.layer, streams, weights=weights)
        store.flush_metrics()  # metrics.parquet is refreshed in the background: done before the folder goes
    total, reads = sum(counter.launches.values()), sum(counter.reads.values())
    print(f"{args.model} layer {args.layer} ({cfg.layer_kind(args.layer)}), {args.tokens} + {args.decode} tokens, "
          f"variants {args.variants}, {args.device}: {total:,} launching operations, {reads:,} host reads")
    for region, n in counter.launches.most_common(args.top):
        steps = " decode " in region and args.decode
        per_step = f"  ({n / args.decode:,.0f} per decode step)" if steps else ""
        print(f"  {n:9,d}  {counter.reads[region]:6,d} reads  {region}{per_step}")
        if args.ops:
            print("             " + ", ".join(f"{op} {k:,}" for op, k in counter.ops[region].most_common(args.ops)))
        for line, k in (counter.callers or {}).get(region, collections.Counter()).most_common(args.callers):
            print(f"             {k:8,d}  {line}")
        for line, k in counter.read_callers.get(region, collections.Counter()).most_common(args.callers):
            print(f"             {k:8,d}  read: {line}")
    if args.bytes:
        moved = collections.Counter({line: sum(ops.values()) for line, ops in counter.bytes_by_line.items()})
        print(f"bytes moved per line of this repository's code ({sum(moved.values()) / 2**30:,.1f} GiB in all; the "
              f"{args.bytes} most):")
        for line, n in moved.most_common(args.bytes):
            ops_here = ", ".join(f"{op} {k / 2**30:.2f}" for op, k in counter.bytes_by_line[line].most_common(3))
            print(f"  {n / 2**30:9.2f} GiB  {line}  [{ops_here}]")


def time_regions(spec: RunSpec, args: Any, where: dict[str, str]) -> None:
    """`--time`: the layer once untimed (Triton compiles, graph captures, allocator growth), then timed per region."""
    device = torch.device(args.device)
    timer = RegionTimer(lambda: torch.cuda.synchronize(device)) if args.sync and device.type == "cuda" \
        else RegionTimer()
    if args.kernels and device.type != "cuda":
        raise SystemExit("--kernels: device-busy seconds need a CUDA device (--device cuda)")
    instrument(timer, where, args.tokens, args.by_tap, args.by_op)

    def progress(event: dict) -> None:
        if event.get("event") == "stack":
            timer.enter_region("(runner)")  # the stack's label is known from here on: charge what ran before it
            where["stack"] = "reference" if event["stack"] == "reference" else f"{event['stack']}/{event['mode']}"
            timer.leave_region()

    with tempfile.TemporaryDirectory() as tmp, torch.inference_mode():
        weights = spec.source.layer(args.layer, device)
        for run in ("warm-up", "timed"):
            store = RunStore(f"{tmp}/{run}")
            store.create({})
            runner = LockstepRunner(spec, store, progress)
            runner.HOST_LANES = False
            streams = runner.initial_streams()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            timer.seconds.clear()
            traced = args.kernels and run == "timed"
            profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                         torch.profiler.ProfilerActivity.CUDA]) if traced else None
            marks = LineMarks() if traced and args.kernel_lines else None
            if profile is not None:
                profile.__enter__()
                timer.marked = True
            if marks is not None:
                marks.__enter__()
            start = timer._since = time.perf_counter()
            try:
                runner.run_layer(args.layer, streams, weights=weights)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                timer.enter_region("(end)")
                timer.leave_region()
                wall = time.perf_counter() - start
            finally:
                if marks is not None:
                    marks.__exit__(None, None, None)
                if profile is not None:
                    timer.marked = False
                    profile.__exit__(None, None, None)
            store.flush_metrics()  # metrics.parquet is refreshed in the background: done before the folder goes
    print(f"{args.model} layer {args.layer} ({spec.source.config.layer_kind(args.layer)}), {args.tokens} + "
          f"{args.decode} tokens, variants {args.variants}, {args.device}, {torch.get_num_threads()} threads: "
          f"{wall:.2f} s wall (second run of the layer), host seconds per region:")
    for region, seconds in timer.seconds.most_common(args.top):
        steps = " decode " in region and args.decode
        per_step = f"  ({1e3 * seconds / args.decode:,.2f} ms per decode step)" if steps else ""
        print(f"  {seconds:8.3f} s  {region}{per_step}")
    if args.kernels:
        events = list(profile.events())
        busy, by_name, by_line = kernels_by_region(events)
        print(f"device-busy seconds per region (traced run: {sum(busy.values()):.3f} s of kernels), busiest kernels:")
        for region, seconds in busy.most_common(args.top):
            print(f"  {seconds:8.3f} s  {region}")
            for name, k in by_name[region].most_common(args.kernels_listed):
                print(f"               {k:7.3f} s  {name[:100]}")
        idle, idle_regions, idle_lines, idle_ops = idle_before_launches(events)
        print(f"device idle between its first and last activity: {idle:.3f} s (traced: the tracer slows the host, "
              "--kernel-lines most), charged to what launched the activity after each gap, per region:")
        for region, seconds in idle_regions.most_common(args.top):
            print(f"  {seconds:8.3f} s  {region}")
        print("device idle per operation that launched the activity after each gap:")
        for op, seconds in idle_ops.most_common(args.kernels_listed * 4):
            print(f"  {seconds:8.3f} s  {op}")
        if args.kernel_lines:
            print(f"device idle per line that launched the activity after each gap (the {args.kernel_lines} most; "
                  "the host slowed by the line marks):")
            for line, seconds in idle_lines.most_common(args.kernel_lines):
                print(f"  {seconds:8.3f} s  {line}")
            overall = sum(by_name.values(), collections.Counter())
            print(f"device-busy seconds per kernel over all regions (the {args.kernel_lines} busiest):")
            for name, seconds in overall.most_common(args.kernel_lines):
                print(f"  {seconds:8.3f} s  {name[:140]}")
            innermost: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
            for line, kernels in by_line.items():
                innermost[line.split(" <- ")[0]].update(kernels)
            listings = [("line", innermost)] + ([("line and its callers", by_line)] if CALLER_DEPTH > 1 else [])
            for what, table in listings:
                seconds_of = collections.Counter({line: sum(k.values()) for line, k in table.items()})
                print(f"device-busy seconds per {what} of this repository's code (the {args.kernel_lines} busiest):")
                for line, seconds in seconds_of.most_common(args.kernel_lines):
                    kernels = ", ".join(f"{name[:50]} {k:.3f}" for name, k in table[line].most_common(2))
                    print(f"  {seconds:8.3f} s  {line}  [{kernels}]")


if __name__ == "__main__":
    main()
