"""The layer-major lockstep run (DESIGN §3, Execution): reference, yardstick and variants, layer by layer.

For layer L: its weights are produced once; the reference processes every token (prefill, then the
teacher-forced decode tokens) recording its taps; the yardstick and every optimized variant then run
layer L over their prefill chunks and decode steps — *global* on their own previous output (accumulated
drift) and *local* on the reference's layer-L input (the error this layer adds by itself), and with
decision forcing on request — each through a comparing sink; the bins are written; then layer L+1.
Metrics land on disk after every layer, and so do the streams needed to resume.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable

import torch

from harness.errors import UsageError
from harness.run.aggregate import LayerAccumulator
from harness.run.bins import BinPlan
from harness.run.deal import deal
from harness.run.host_lanes import LaneStopped, blamed_lane, lanes_of
from harness.run.metrics import CompareContext, compare_logits
from harness.run.needles import AnswerLens, needle_queries
from harness.run.prefill_sharing import (PrefillKey, SharedLayers, SharedPrefills, layer_keys, pair_keys,
                                         without_takers)
from harness.run.probes import ComparingSink, DumpSink, Finding, RecordingSink
from harness.run.store import RunStore
from harness.run.stream_placement import to_device, to_host
from optimized.engine import EngineOptions, OptimizedLayer, OptimizedModel
from optimized.ops import OpContext, Routing
from optimized.patching import HARNESS_SOURCE, Patch, PatchChoice, decodes_together
from reference.layer import ParityOptions, ReferenceLayer
from reference.model import ReferenceModel, ensure_no_tf32, segment_lengths
from reference.weights.dense_cache import DenseCache, dense_specs
from reference.weights.prefetch import PrefetchingSource
from reference.weights.source import TensorBundle, WeightSource

YARDSTICK = "yardstick"
ANSWER_TAP = "needle.lens"
"""The needle answer read through a stack's own HC head, norm and LM head after each layer (harness.run.needles);
after the last layer it is the answer itself, also recorded on the logits row."""


@dataclass
class ReferencePass:
    """One layer's reference in this process: the layer's weights and the cache of their dequantized copies (the
    layer's stacks share both), the sinks holding the reference's taps, and its output streams once it has run."""

    layer: int
    weights: TensorBundle
    dense: DenseCache
    record: RecordingSink
    dump: DumpSink | None
    out: torch.Tensor | None = None
    filled: bool = False  # every fp32 copy made before the layer's first stack (DenseCache.fill): the lanes need it


@dataclass
class VariantSpec:
    name: str
    choices: list[PatchChoice]


@dataclass
class RunSpec:
    """Everything the runner needs, already resolved from a scenario."""

    source: WeightSource
    prompt_ids: list[int]
    decode_ids: list[int]
    turn_of_position: list[int]  # per prompt+decode position
    needle_spans: list[tuple[int, int]]
    variants: list[VariantSpec]
    needle_names: list[str] = field(default_factory=list)  # one per needle span (default: needle-0, needle-1, …)
    chunk_size: int = 8192
    reference_chunk_size: int | None = None  # None: the whole prompt in one query-blocked pass
    reference_decode_together: bool | None = None
    """The reference and the yardstick run the decode tokens as one segment (None: on a GPU only); see
    LockstepRunner.decodes_together."""
    decode_sites_together: bool | None = None
    """The engines compute their decode steps' sites (the stock op and its twin on each step's inputs) once over all
    the steps, and a prefill chunk's attention sites once over its blocks (None: on a GPU only); see
    LockstepRunner.sites_together."""
    engine_decode_together: bool | None = None
    """The engines run a layer's decode steps as one segment where every variant's decode patches there declare
    Patch.decode_together (None: on a GPU only); see LockstepRunner.engines_decode_together."""
    reference_dtype: torch.dtype = torch.float32
    parity: ParityOptions = ParityOptions()
    yardstick: bool = True
    engine: EngineOptions = EngineOptions()
    local: bool = True
    global_mode: bool = True  # False: only local (and forced) modes, e.g. a triage pass that blames layers by what each adds
    force_decisions: bool = False
    bin_size: int = 512
    attn_sample_every: int = 64
    logits_sample_every: int = 256
    dump_taps: list[str] = field(default_factory=list)
    dump_positions: list[int] = field(default_factory=list)
    device: str = "cpu"
    streams_on_host: bool = False
    """Each global stack's streams wait in page-locked host memory between layers (harness.run.stream_placement): on
    one GPU, set by harness.run.memory.check_fits when the run fits only so. The same numbers either way."""

    @property
    def n_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def n_total(self) -> int:
        return len(self.prompt_ids) + len(self.decode_ids)

    def stacks(self) -> list[tuple[str, str]]:
        """(stack, mode) pairs run after the reference at every layer."""
        names = ([YARDSTICK] if self.yardstick else []) + [v.name for v in self.variants]
        modes = (["global"] if self.global_mode else []) + (["local"] if self.local or not self.global_mode else [])
        out = [(n, m) for n in names for m in modes]
        if self.force_decisions:
            out += [(v.name, "forced") for v in self.variants]
        return out

    def stacks_of_rank(self, rank: int, world: int) -> list[tuple[str, str]]:
        """The (stack, mode) pairs rank `rank` of `world` runs, in stacks() order: dealt by their cost, the last rank's
        share leaving room for the reference (harness.run.deal); a stack's global mode, which carries its streams
        from layer to layer, always runs on the same rank. The one place the deal is asked for, so the sharded
        runner and the memory estimate (harness.run.memory) agree about it."""
        return deal(self, world)[rank]


ProgressFn = Callable[[dict[str, Any]], None]


def sampled_positions(spec: RunSpec, every: int, chunk_edges: bool = False) -> torch.Tensor:
    """Positions whose expensive taps are compared: every `every`-th prompt position, the prompt's last
    position, every decode position and every dump position; with `chunk_edges`, also the first and last query
    of every prefill chunk — where chunked prefill and tiled kernels go wrong (a mask or window computed from the
    chunk's start, a boundary tile), and where the attention site, which runs the stock op on the variant's own
    inputs at these queries (at every prefill query only where a patch computed the attention), must look: the
    stride takes the last query of every group of `every`, so a chunk of a multiple of `every` tokens has its last
    query on it and never its first."""
    mask = torch.zeros(spec.n_total, dtype=torch.bool)
    if every > 0:
        mask[every - 1 : spec.n_prompt : every] = True
    if chunk_edges:
        starts = torch.arange(0, spec.n_prompt, spec.chunk_size)
        mask[starts] = True
        mask[(starts + spec.chunk_size).clamp(max=spec.n_prompt) - 1] = True
    mask[spec.n_prompt - 1] = True
    mask[spec.n_prompt :] = True
    for p in spec.dump_positions:
        mask[p] = True
    return mask


def turn_starts(turn_of_position: list[int]) -> torch.Tensor:
    """First position of the turn each position belongs to."""
    starts, current, begin = [], None, 0
    for i, t in enumerate(turn_of_position):
        if t != current:
            current, begin = t, i
        starts.append(begin)
    return torch.tensor(starts, dtype=torch.int64)


def forcing_patch(record: RecordingSink) -> Patch:
    """Decision forcing (DESIGN §3): the variant computes everything itself but uses the reference's indexer
    picks and expert ids, so its remaining drift is arithmetic, not selection."""
    patch = Patch("force-reference-decisions", ("prefill", "decode"),
                  "use the reference's indexer top-k rows and expert ids", source=HARNESS_SOURCE,
                  decode_together=True)  # the reference's picks at each query's own position

    @patch.op("indexer_topk")
    def topk(ctx: OpContext, logits: torch.Tensor, positions: torch.Tensor, k: int):
        ref = record.at("indexer.selected", positions)
        return ref["row_ids"].to(logits.device).long(), ref["valid"].to(logits.device)

    @patch.op("router")
    def router(ctx: OpContext, y: torch.Tensor, token_ids: torch.Tensor) -> Routing:
        own = ctx.base(y=y, token_ids=token_ids)
        ids = record.at("moe.router", ctx.positions)["expert_ids"].to(y.device).long()
        w = own.scores.gather(-1, ids)
        w = w / w.sum(-1, keepdim=True)
        if own.output_scale == 1.0:
            w = w * ctx.cfg.routed_scaling_factor
        return Routing(own.scores, ids, w, own.output_scale, own.shared_weight)

    return patch


SIGNAL_POLL_S = 0.1
"""How often the caller's thread wakes while it waits for the stock lane: Python runs signal handlers (Ctrl-C) in the
main thread only, and a SIGINT the kernel hands to another thread does not wake a blocked wait."""


def _on_a_gpu_unless_set(setting: bool | None, device: str) -> bool:
    """A decode-step batching switch of the spec: its value when set, else on any device but the CPU (whose metrics
    are the pinned bits, tests/test_metrics_pin.py)."""
    return setting if setting is not None else torch.device(device).type != "cpu"


class LockstepRunner:
    def __init__(self, spec: RunSpec, store: RunStore, progress: ProgressFn | None = None) -> None:
        self.spec, self.store = spec, store
        self.progress = progress or (lambda event: None)
        self.cfg = spec.source.config
        self.device = torch.device(spec.device)
        self.weights = PrefetchingSource(spec.source)  # layer L+1's weights are made while layer L computes
        self.ids = torch.tensor(spec.prompt_ids + spec.decode_ids, dtype=torch.int64, device=self.device)
        together = self.decodes_together(spec)
        self.variant_segments = segment_lengths(spec.n_prompt, len(spec.decode_ids), spec.chunk_size)
        self.engines_together = self.engines_decode_together(spec)
        self.variant_segments_together = segment_lengths(spec.n_prompt, len(spec.decode_ids), spec.chunk_size, True)
        self.reference_segments = segment_lengths(spec.n_prompt, len(spec.decode_ids), spec.reference_chunk_size,
                                                  together)
        self.yardstick_segments = segment_lengths(spec.n_prompt, len(spec.decode_ids), spec.chunk_size, together)
        self.hold_sites = self.sites_together(spec)
        self.plan = BinPlan(spec.n_prompt, len(spec.decode_ids), spec.chunk_size, spec.turn_of_position, spec.bin_size)
        self.sampled = sampled_positions(spec, spec.attn_sample_every, chunk_edges=True)
        self.phase_of = torch.zeros(spec.n_total, dtype=torch.bool)
        self.phase_of[spec.n_prompt :] = True
        self.turn_start = turn_starts(spec.turn_of_position)
        self.reference = ReferenceModel(self.weights, spec.reference_dtype, self.device, spec.parity)
        self.yardstick = ReferenceModel(self.weights, torch.bfloat16, self.device)
        self.head = DenseCache()  # the engines' fp32 head weights, made once for all of them
        self.engines = {v.name: OptimizedModel(self.weights, v.choices, self.device, spec.engine, self.head)
                        for v in spec.variants}
        self.findings: list[Finding] = []
        self.where: dict[str, Any] = {"layer": 0, "stack": "reference", "mode": "global"}
        """The layer, stack and mode running now: recorded in the manifest when the run stops on an error."""
        names = spec.needle_names or [f"needle-{i}" for i in range(len(spec.needle_spans))]
        self.lens = AnswerLens(needle_queries(spec.prompt_ids, spec.decode_ids, dict(zip(names, spec.needle_spans))))

    @staticmethod
    def decodes_together(spec: RunSpec) -> bool:
        """Whether the reference and the yardstick run the decode tokens as one segment rather than one pass per
        step (spec.reference_decode_together; None: on a GPU only). Their graph gives the same values either way
        up to the rounding of differently shaped products (reference.model.segment_lengths), and their taps are
        compared by position, so the variants' metrics move by that rounding only. On a GPU a Flash decode step is
        ~330–370 launches of host time: in the lockstep of a Flash CSA layer at 30,720 + 64 tokens (H200) the
        reference's 64 steps and the yardstick's two modes' took 1.08 s, one segment each 0.18 s. The CPU keeps one
        pass per step so that its metrics stay bit-identical to the pinned ones (tests/test_metrics_pin.py); there a
        step costs its arithmetic."""
        return _on_a_gpu_unless_set(spec.reference_decode_together, spec.device)

    @staticmethod
    def engines_decode_together(spec: RunSpec) -> bool:
        """Whether the engines run a layer's teacher-forced decode steps as one segment, their queries computed
        together as a prefill chunk's are, where every variant's decode patches at the layer declare
        Patch.decode_together (the built-ins do; the stock engine has none) (spec.engine_decode_together; None: on a
        GPU only; _engine_segments). Each query reads its own inputs and the caches up to its position either way —
        the window rows of the later steps are stored before it runs, but a query's window and the indexer's causal
        mask stop at its position — so the metrics move by the rounding of differently shaped products only
        (tests/test_speed.py). On a GPU a
        layer is host-bound and the engines' decode steps were ≈ 83% of an attribution layer's operations (~7,400
        launches per step over its 28 pairs, README Benchmarks); one segment costs about one prefill block's. Where a
        plugin does not declare it, every variant keeps one call per step, one query each: the plugin's ops may keep
        state between steps or depend on the call's size, as serving kernels do. The CPU keeps one step at a time:
        its metrics are the pinned bits (tests/test_metrics_pin.py)."""
        return _on_a_gpu_unless_set(spec.engine_decode_together, spec.device)

    def _engine_segments(self, layer: int) -> list[int]:
        """The segments every variant runs layer `layer` in: the decode steps as one segment when
        engines_decode_together and every variant's decode patches at the layer declare Patch.decode_together, else
        one per step — for all of them, so that the variants a gate compares with one another (a plugin's with
        base's) decode the same way: a plugin that only passes an op through gives base's bits, as before."""
        together = self.engines_together and all(decodes_together(v.choices, self.cfg, layer)
                                                 for v in self.spec.variants)
        return self.variant_segments_together if together else self.variant_segments

    @staticmethod
    def sites_together(spec: RunSpec) -> bool:
        """Whether the engines compute their decode steps' sites — the mHC mix, the router and the sampled steps'
        attention, the stock op and its twin on the step's inputs — once over all the steps (spec.decode_sites_together;
        None: on a GPU only; OptimizedLayer._emit_held_sites). Each step's row is the op on that step's inputs up to
        the rounding of a differently shaped call, so the site metrics move by that fp32 rounding and no other metric
        moves (tests/test_speed.py). On an H200 a step's sites were ~3–4 ms of host time per stack and mode (Flash CSA
        layer, 30,720 + 64 tokens): ~1 s of an ~11 s layer over the four engine stacks and modes. Likewise a prefill
        chunk's attention sites, once over its blocks' sampled queries (OptimizedLayer._attention's join_sites: the
        chunk's caches are whole before its first block). The CPU keeps one call per step and block: its metrics stay
        the pinned bits (tests/test_metrics_pin.py)."""
        return _on_a_gpu_unless_set(spec.decode_sites_together, spec.device)

    # ------------------------------------------------------------------------------------------
    def run(self, start_layer: int = 0, streams: dict[str, torch.Tensor] | None = None,
            end_layer: int | None = None) -> None:
        """Layers start_layer … n−1, then the logits (with `end_layer`, layers up to end_layer − 1 only and no
        logits: a partial pass, recorded as `end_layer` in the manifest). A resume's `streams` are taken: the dict
        is left empty. The manifest's status ends `complete`, or `failed` / `interrupted` with where and why
        (`failure`) when the run stops on an exception: the layers already written stay, and `run --resume`
        continues from the last saved state."""
        ensure_no_tf32()
        n_layers = self.cfg.num_hidden_layers if end_layer is None else min(end_layer, self.cfg.num_hidden_layers)
        self.weights.until = n_layers
        if streams is None:
            streams = self.initial_streams()  # placed as each is made
        else:  # a saved state's, on the host: one at a time to the device, and placed. The caller's dict is
            # emptied as they go, so the loaded copies (an attribution's at 30K: ~17 GB) are not held for the pass;
            # a sharded run's rank keeps the reference's and its own stacks' (what its memory estimate counts)
            keep = {"reference", *(name for name, mode in self.own_stacks() if mode == "global")}
            loaded, streams = streams, {}
            for k in list(loaded):  # (no local name may hold one after the loop)
                if k in keep:
                    streams[k] = self._placed(k, loaded.pop(k).to(self.device))
                else:
                    del loaded[k]
        self.findings = [Finding(**f) for f in self.store.read_findings() if f["layer"] < start_layer]
        last_save = time.perf_counter()
        try:
            for layer in range(start_layer, n_layers):
                t0 = time.perf_counter()
                streams = self.run_layer(layer, streams)
                self.store.write_findings([f.to_dict() for f in self.findings])
                last_save = self._save_state(layer, streams, last_save)
                self.progress({"event": "layer_done", "layer": layer, "layers": n_layers,
                               "seconds": time.perf_counter() - t0, "kinds": self.cfg.layer_kinds})
            if end_layer is None:
                self.where = {"layer": n_layers, "stack": "logits", "mode": "global"}
                self.compare_logits(streams)
            else:
                self.store.update_manifest(end_layer=n_layers)
            self.store.wait_for_state()  # the last layer's resume state is on disk before the run is complete
            self.store.flush_metrics()  # and metrics.parquet holds every layer
        except BaseException as e:
            self._record_stop(e)
            raise
        self.store.update_manifest(status="complete", failure=None,
                                   finished=datetime.now(timezone.utc).isoformat(timespec="seconds"))
        self.progress({"event": "done"})

    def _placed(self, name: str, streams: torch.Tensor) -> torch.Tensor:
        """A stack's streams where they wait for its next layer: the reference's on the device (every local pair reads
        them), a global stack's in page-locked host memory with spec.streams_on_host."""
        return to_host(streams) if self.spec.streams_on_host and name != "reference" else streams

    def _record_stop(self, error: BaseException) -> None:
        """Mark the manifest `interrupted` (Ctrl-C, SIGTERM) or `failed`, with the layer and stack that stopped
        and the error, unless the run directory itself cannot be written or its manifest is damaged (UsageError):
        raising here, inside the caller's handler, would hide the error that stopped the run."""
        status = "interrupted" if isinstance(error, KeyboardInterrupt) else "failed"
        for finish in (self.store.wait_for_state, self.store.flush_metrics):  # what a resume and a reader will read
            try:
                finish()
            except Exception:  # noqa: BLE001 — the error that stopped the run is the one to report
                pass
        try:
            saved = self.store.read_manifest().get("state_layer") if self.store.state_path.is_file() else None
            self.store.update_manifest(status=status, failure={**self.where, "error": f"{type(error).__name__}: "
                                                                                       f"{error}", "state_layer": saved})
        except (OSError, ValueError, UsageError):
            pass

    def initial_streams(self) -> dict[str, torch.Tensor]:
        """The input to layer 0 of the reference and of each global stack this process runs (the only stacks that
        read their own streams; a sharded run's other stacks are other ranks'): the embedding, fp32 for the reference
        and bf16 for the others."""
        x = self.reference.embed(self.ids)
        streams = {"reference": x}
        for name, mode in self.own_stacks():
            if mode == "global":
                streams[name] = self._placed(name, x.to(torch.bfloat16))
        return streams

    # Resume state: a few hundred MB write in a fraction of a second (the demo's is 28 MB), so save every layer;
    # beyond that, at most once a minute.
    STATE_SMALL_BYTES = 256 * 2**20
    STATE_EVERY_S = 60.0

    def _save_state(self, layer: int, streams: dict[str, torch.Tensor], last_save: float) -> float:
        """Save the resume state after this layer when it is due (_should_save_streams); when it was last saved."""
        if not self._should_save_streams(streams, layer, last_save):
            return last_save
        self.store.save_streams(layer, streams, background=True)  # written while the next layers run
        return time.perf_counter()

    def _should_save_streams(self, streams: dict[str, torch.Tensor], layer: int, last_save: float) -> bool:
        """Resume state after this layer? Always when it is small (the demo's 28 MB); for large ones (Flash at
        27K tokens: fp32 reference + bf16 stacks ≈ 27K·4·4096·(4+2+2) B = 3.5 GB, seconds to write) at most once
        a minute, so a killed run recomputes ≤ 60 s of layers. Metrics of every finished layer are on disk
        either way; a resume from an earlier layer rewrites them with identical numbers."""
        size = sum(t.numel() * t.element_size() for t in streams.values())
        return (size <= self.STATE_SMALL_BYTES or layer == self.cfg.num_hidden_layers - 1
                or time.perf_counter() - last_save >= self.STATE_EVERY_S)

    def run_layer(self, layer: int, streams: dict[str, torch.Tensor], weights: TensorBundle | None = None
                  ) -> dict[str, torch.Tensor]:
        """Every stack and mode over layer `layer`; its rows written. `weights`: the layer's, when the caller has
        them (a benchmark that timed their making), else from the (prefetching) source."""
        ref = self._reference_pass(layer, streams["reference"], weights)
        rows, new_streams = self._run_stacks(layer, streams, ref)
        dumped = ref.dump.tensors if ref.dump else {}
        del ref  # the layer's weights, their dequantized copies and the taps: not needed past its stacks
        self._between_layers(layer, streams, new_streams["reference"])
        self._write_layer(layer, rows, dumped)
        return new_streams

    HOST_LANES: bool | None = None
    """Whether a layer's stacks run in two host threads (harness.run.host_lanes): None, on a CUDA device only (on a
    CPU the threads would share its cores with the kernels themselves); tests set True to check the CPU's bits. Either
    way, only when the layer's fp32 copies were all made before its first stack (ReferencePass.filled; what
    host_lanes.cache_holds_every_copy predicts)."""

    def _run_stacks(self, layer: int, streams: dict[str, torch.Tensor], ref: ReferencePass
                    ) -> tuple[dict[tuple[str, str], list[dict]], dict[str, torch.Tensor]]:
        """This process's (stack, mode) pairs over the layer, compared with the reference's taps: their rows, and
        the new streams (the reference's and each global stack's). On a GPU the pairs that run no patch code run
        in a second host thread beside the others (harness.run.host_lanes)."""
        own = self.own_stacks()
        on = self.device.type == "cuda" if self.HOST_LANES is None else self.HOST_LANES
        lanes = lanes_of(self.spec, own, self.SHARE_PREFILL, layer, self.SHARE_LAYERS) if on and ref.filled else [own]
        ref_answers = self.lens.read(self.reference.logits, ref.out) if self.lens else None
        if len(lanes) == 1:
            return self._run_pairs(layer, own, streams, ref, ref_answers, self.findings)
        return self._run_lanes(layer, own, lanes, streams, ref, ref_answers)

    def _run_lanes(self, layer: int, own: list[tuple[str, str]], lanes: list[list[tuple[str, str]]],
                   streams: dict[str, torch.Tensor], ref: ReferencePass, ref_answers: dict[str, torch.Tensor] | None
                   ) -> tuple[dict[tuple[str, str], list[dict]], dict[str, torch.Tensor]]:
        """_run_pairs over the patched lane (lanes[0]) in this thread and the stock lane in a worker on this thread's
        CUDA stream; rows, streams and new findings merged in the order of `own`, as a sequential run gives them. A
        lane that fails (or is interrupted) stops the other at its next pair; the run stops once both have ended,
        with the error host_lanes.blamed_lane picks and the pair it names."""
        findings = [list(self.findings) for _ in lanes]
        known = len(self.findings)
        results: list[Any] = [None] * len(lanes)
        failed: dict[int, tuple[BaseException, dict[str, Any]]] = {}
        stop = threading.Event()
        inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        wheres = [{"layer": layer, "stack": lane[0][0], "mode": lane[0][1]} for lane in lanes]
        self.where = wheres[0]
        ended = threading.Event()  # the worker's lane has ended (Thread.join may not say so once interrupted)

        def run(i: int) -> None:  # lane 0 in this thread (self.where, progress events), lane 1 in the worker
            try:
                with contextlib.ExitStack() as scope:
                    if i and stream is not None:  # thread-local: the device, the stream, inference and grad mode
                        torch.cuda.set_device(stream.device)
                        scope.enter_context(torch.cuda.stream(stream))  # one queue: the sequential run's kernels
                    scope.enter_context(torch.inference_mode(inference))
                    scope.enter_context(torch.set_grad_enabled(grad))
                    results[i] = self._run_pairs(layer, lanes[i], streams, ref, ref_answers, findings[i],
                                                 wheres[i] if i else None, stop)
            except LaneStopped:
                pass
            except BaseException as e:  # noqa: BLE001 — re-raised below, after both lanes ended
                stop.set()
                failed[i] = (e, dict(wheres[i] if i else self.where))
            finally:
                if i:
                    ended.set()

        # the layer's fp32 copies were all made before its first stack (_run_reference's fill: ref.filled); what
        # either lane still puts into ctx.dense gives the same bits kept or not, so no path depends on which thread
        # asks first (host_lanes.cache_holds_every_copy)
        worker = threading.Thread(target=run, args=(1,), name=f"dsv4-drift layer {layer} stock lane", daemon=True)
        worker.start()
        try:
            run(0)  # records its own failures, Ctrl-C included
            while not ended.wait(SIGNAL_POLL_S):
                pass
        except KeyboardInterrupt as e:  # while waiting for the stock lane: it stops at its next pair, named as running
            stop.set()
            failed.setdefault(0, (e, dict(wheres[1])))
            while not ended.wait(SIGNAL_POLL_S):  # (a second Ctrl-C leaves the daemon thread to the interpreter's exit)
                pass
        worker.join()
        if failed:
            errors = {i: e for i, (e, _) in failed.items()}
            positions = {i: own.index((at["stack"], at["mode"])) for i, (_, at) in failed.items()}
            error, self.where = failed[blamed_lane(errors, positions)]
            raise error
        rows = {pair: r for result in results for pair, r in result[0].items()}
        new_streams = {name: s for result in results for name, s in result[1].items()}
        order = {pair: i for i, pair in enumerate(own)}
        new = [f for lane in findings for f in lane[known:]]
        self.findings.extend(sorted(new, key=lambda f: order.get((f.variant, f.mode), len(order))))  # stable
        return {pair: rows[pair] for pair in own}, new_streams

    def _run_pairs(self, layer: int, own: list[tuple[str, str]], streams: dict[str, torch.Tensor],
                   ref: ReferencePass, ref_answers: dict[str, torch.Tensor] | None, findings: list[Finding],
                   where: dict[str, Any] | None = None, stop: threading.Event | None = None
                   ) -> tuple[dict[tuple[str, str], list[dict]], dict[str, torch.Tensor]]:
        """The pairs `own` over the layer in order, with the reference's needle answers `ref_answers` (None: no
        needles); new findings go to `findings`, and the pair running now to `where` (a lane's own; None:
        self.where). Raises host_lanes.LaneStopped before a pair once `stop` is set (the other lane failed)."""
        spec, cfg = self.spec, self.cfg
        weights, dense, record, dump = ref.weights, ref.dense, ref.record, ref.dump
        ref_in, ref_out = streams["reference"], ref.out
        ctx = CompareContext(cfg.layer_kind(layer), cfg.compress_ratio(layer), cfg.sliding_window,
                             torch.tensor(spec.turn_of_position), self.turn_start, spec.needle_spans)
        rows: dict[tuple[str, str], list[dict]] = {}
        new_streams = {"reference": ref_out}
        yard_layer = ReferenceLayer(cfg, layer, weights, torch.bfloat16, ParityOptions(), self.device, dense) \
            if any(name == YARDSTICK for name, _ in own) else None  # built (weights dequantized) where it runs
        engine_layers: dict[str, OptimizedLayer] = {}
        layers = SharedLayers(layer_keys(spec, own, layer) if self.SHARE_LAYERS else {})
        keys = without_takers(self._prefill_keys(own), layers)
        shares = SharedPrefills(keys)
        for name, mode in own:
            if stop is not None and stop.is_set():
                raise LaneStopped
            self._enter(layer, name, mode, where)
            taken = layers.take((name, mode), findings)
            if taken is not None:  # an earlier pair computed this pair's layer: harness.run.prefill_sharing
                rows[(name, mode)] = taken
                shares.done(keys.get((name, mode)))
                layers.done((name, mode))
                continue
            if dump:
                dump.prefix = f"{name}.{mode}/"
            sink = ComparingSink(record, LayerAccumulator(self.plan), ctx, name, mode, layer, self.phase_of,
                                 findings, dump)
            had_finding = sink.has_finding()
            x_in = to_device(streams[name], self.device) if mode == "global" else ref_in.to(torch.bfloat16)
            if name == YARDSTICK:
                out = self.yardstick.run_layer(yard_layer, x_in, self.ids, self.yardstick_segments, sink)
            else:
                if mode == "forced":
                    engine = OptimizedModel(self.weights, self._choices(name) + [PatchChoice(forcing_patch(record), {})],
                                            self.device, spec.engine, self.head)
                    block = engine.layer(layer, weights, dense)
                else:
                    block = engine_layers.get(name) or self.engines[name].layer(layer, weights, dense)
                    engine_layers[name] = block
                out, sink = self._run_engine(name, mode, block, x_in, sink, keys.get((name, mode)), shares)
                shares.done(keys.get((name, mode)))
            sink.finish()
            if ref_answers is not None:  # the needle answer through this stack's own head, after this layer
                model = self.yardstick if name == YARDSTICK else self.engines[name]
                for mv in self.lens.compare(ref_answers, self.lens.read(model.logits, out)):
                    sink.acc.add(ANSWER_TAP, mv)
            rows[(name, mode)] = sink.acc.rows(name, mode, layer)
            layers.keep((name, mode), rows[(name, mode)], had_finding, findings, layer)
            layers.done((name, mode))
            if mode == "global":
                new_streams[name] = self._placed(name, out)
            out = x_in = None  # placed or not, the next pair does not hold this one's device streams while it runs
        return rows, new_streams

    SHARE_PREFILL = True
    """Variants with the same patches in prefill compute their prefill once per mode (harness.run.prefill_sharing);
    False runs every variant in full (tests compare the two)."""
    SHARE_LAYERS = True
    """Local pairs with the same patches acting at a layer compute it once (harness.run.prefill_sharing); False
    runs each (tests compare the two)."""

    def _prefill_keys(self, pairs: list[tuple[str, str]]) -> dict[tuple[str, str], PrefillKey]:
        """The prefill key of each engine pair that may share its prefill (none when sharing is off)."""
        return pair_keys(self.spec, pairs) if self.SHARE_PREFILL else {}

    def _run_engine(self, name: str, mode: str, block: OptimizedLayer, x_in: torch.Tensor, sink: ComparingSink,
                    key: PrefillKey | None, shares: SharedPrefills) -> tuple[torch.Tensor, ComparingSink]:
        """Variant `name` in `mode` over the layer: its output and the sink that compared it — from the prefill of
        an earlier variant with the same patches in prefill when one ran in this layer and fits, else in full (the
        first of a prefill that later pairs share keeps its state at its first decode step). `key`: its prefill's."""
        spec, engine = self.spec, self.engines[name]
        share = shares.get(key)
        if share is not None and share.fits(x_in, sink, spec.n_prompt):
            state, sink = share.continue_as(name)
            decode = engine.run_layer(block, x_in, self.ids, self._engine_segments(block.layer), spec.n_prompt, sink,
                                      state=state, hold_sites=self.hold_sites)
            return torch.cat([to_device(share.prefill_out, self.device), decode]), sink
        keep = shares.keeper(key, sink)
        out = engine.run_layer(block, x_in, self.ids, self._engine_segments(block.layer), spec.n_prompt, sink,
                               at_decode=keep, hold_sites=self.hold_sites)
        rows_out, rows_in = out[: spec.n_prompt], (x_in[: spec.n_prompt] if mode == "global" else None)
        if mode == "global" and spec.streams_on_host and keep is not None and shares.get(key) is not None:
            # a global share's rows would hold this pair's device input and output (views) until its last continuer
            # ran: with the streams placed, it keeps host copies of them (harness.run.memory counts them there)
            rows_out, rows_in = to_host(rows_out), to_host(rows_in)
        shares.finish(key, rows_out, rows_in)
        return out, sink

    # The steps a sharded run (harness.run.distributed) does differently: which stacks this process runs, where
    # the reference's taps come from, and who writes what the stacks measured.
    ranks_per_device = 1
    """Processes sharing this process's device (their caches split its memory)."""

    def own_stacks(self) -> list[tuple[str, str]]:
        """The (stack, mode) pairs this process runs: all of them."""
        return self.spec.stacks_of_rank(0, 1)

    def _reference_pass(self, layer: int, ref_in: torch.Tensor, weights: TensorBundle | None) -> ReferencePass:
        """The reference over layer `layer`, its taps recorded."""
        ref = self._prepare_layer(layer, weights)
        self._run_reference(ref, ref_in)
        return ref

    def _prepare_layer(self, layer: int, weights: TensorBundle | None = None) -> ReferencePass:
        """The layer's weights (from the prefetching source unless given), a cache for their dequantized copies
        shared by every stack, and empty sinks for the reference's taps."""
        spec = self.spec
        dump = DumpSink(spec.dump_taps, spec.dump_positions) if spec.dump_taps else None
        if dump:
            dump.prefix = "reference/"
        return ReferencePass(layer, weights if weights is not None else self.weights.layer(layer, self.device),
                             DenseCache.for_device(self.device, self.ranks_per_device),
                             RecordingSink(spec.n_total, self.sampled, dump), dump)

    def _run_reference(self, ref: ReferencePass, ref_in: torch.Tensor) -> None:
        """Run the reference over ref.layer from `ref_in`, recording its taps; its output in ref.out."""
        spec = self.spec
        self._enter(ref.layer, "reference", "global")
        # every stack reads every weight of the layer: their fp32 copies are made first, in stacks, when the layer fits
        # the cache whole (DenseCache.fill), charged to the reference, which would have made them one at a time
        ref.filled = ref.dense.fill([t.name for t in dense_specs(self.cfg, ref.layer)], ref.weights.stored,
                                    self.device)
        block = ReferenceLayer(self.cfg, ref.layer, ref.weights, spec.reference_dtype, spec.parity, self.device,
                               ref.dense)
        ref.out = self.reference.run_layer(block, ref_in, self.ids, self.reference_segments, ref.record)

    def _between_layers(self, layer: int, inputs: dict[str, torch.Tensor], ref_out: torch.Tensor) -> None:
        """After this process's stacks of `layer` (which read `inputs`, the layer's input streams), before its rows
        are written: nothing here (a sharded run's reference rank runs later layers' references while the other
        ranks finish theirs: ShardedRunner.reference_lead)."""

    def _write_layer(self, layer: int, rows: dict[tuple[str, str], list[dict]], dumped: dict[str, torch.Tensor]
                     ) -> None:
        """The layer's rows, in stack order, and its dumped tensors, to the store."""
        self.store.write_layer(layer, [r for key in self.spec.stacks() if key in rows for r in rows[key]],
                               background=True)  # the run's end (run, _record_stop) waits for metrics.parquet
        if dumped:
            self.store.write_dump(f"layer-{layer:03d}", dumped)

    def _enter(self, layer: int, stack: str, mode: str, where: dict[str, Any] | None = None) -> None:
        """The pair about to run, in `where` (a host lane's; None: self.where, reported when the run stops on an
        error); the progress event is sent from the caller's thread only (the stock lane's pairs send none)."""
        if where is not None:
            where.update(layer=layer, stack=stack, mode=mode)
            return
        self.where = {"layer": layer, "stack": stack, "mode": mode}
        self.progress({"event": "stack", **self.where})

    def _choices(self, name: str) -> list[PatchChoice]:
        return next(v.choices for v in self.spec.variants if v.name == name)

    def compare_logits(self, streams: dict[str, torch.Tensor]) -> None:
        """Final logits at sampled positions (every logits_sample_every-th prompt position, the last prompt
        position and all decode positions); rows at layer = num_hidden_layers, tap 'logits'."""
        spec = self.spec
        pos = torch.nonzero(sampled_positions(spec, spec.logits_sample_every)).flatten()
        ref_logits = self.reference.logits(streams["reference"][pos.to(self.device)])
        ref_answers = self.lens.read(self.reference.logits, streams["reference"]) if self.lens else None
        rows: dict[tuple[str, str], list[dict]] = {}
        for name in ([YARDSTICK] if spec.yardstick else []) + [v.name for v in spec.variants]:
            if (name, "global") not in self.own_stacks():
                continue
            model = self.yardstick if name == YARDSTICK else self.engines[name]
            own = to_device(streams[name], self.device)
            logits = model.logits(own[pos.to(self.device)]).float()
            acc = LayerAccumulator(self.plan)
            for mv in compare_logits(pos, ref_logits, logits):
                acc.add("logits", mv)
            if ref_answers is not None:
                for mv in self.lens.compare(ref_answers, self.lens.read(model.logits, own)):
                    acc.add("logits", mv)
            if not bool(torch.isfinite(logits).all()) and not any(f.variant == name for f in self.findings):
                bad = int(pos[torch.nonzero(~torch.isfinite(logits).all(-1)).flatten()[0]])
                self.findings.append(Finding(name, "global", self.cfg.num_hidden_layers, "logits", "logits",
                                             "decode" if bad >= spec.n_prompt else "prefill", bad))
            rows[(name, "global")] = acc.rows(name, "global", self.cfg.num_hidden_layers)
        self._write_layer(self.cfg.num_hidden_layers, rows, {})
        self.store.write_findings([f.to_dict() for f in self.findings])
