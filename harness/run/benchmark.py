"""Where a run's time goes, per layer (issue #14; DESIGN §8): what `dsv4-drift bench` measures.

For each layer asked for, on deterministic synthetic weights and a synthetic prompt of the given length:

- **weights**: the seconds to produce the layer's weights (during a run they are made in the background while the
  layer before computes: reference.weights.prefetch);
- **stacks alone**: the reference (fp32), the yardstick (bf16) and the engine without (`base`) and with every
  patch (`all`) over the layer's prefill chunks and decode steps, without probes;
- **through the runner**: the same layer in the layer-major lockstep with every probe — reference, then
  yardstick, base and all, each global and local — so *probes* = runner time − the stack alone;
- **store**: writing the layer's metrics;
- peak device memory per layer, the process's peak host memory, tokens/s, and the reference's achieved FLOP/s
  against the device's fp32 matmul rate measured in the same process (`measure_fp32_peak`);
- on a GPU, **device-busy seconds** (harness.run.device_time): once every layer is timed, each layer's weights,
  stacks alone and lockstep run once more, traced, and the seconds the GPU computed are counted. Their sum over a
  run is the floor that removing the launches' host cost cannot go under: a layer whose wall time is far above it is
  host-bound; one near it needs faster or fewer kernels.

Every timed region ends with a device synchronisation, so GPU work is charged to the region that queued it, and
the engines first run untimed over a short prompt, so that compiling the patches' kernels (Triton) is not timed.
"""

from __future__ import annotations

import resource
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from harness.run.device_time import DeviceBusy, device_busy
from harness.run.memory import check_fits, placement_note
from harness.run.prefill_sharing import kept_global_prefills
from harness.run.runner import LockstepRunner, RunSpec, VariantSpec
from harness.run.store import RunStore
from harness.run.stream_placement import to_device
from optimized.engine import OptimizedModel
from optimized.registry import default_registry
from reference.config import ModelConfig
from reference.layer import ReferenceLayer
from reference.model import ReferenceModel, segment_lengths
from reference.weights.dense_cache import DenseCache
from reference.weights.source import TensorBundle
from reference.weights.synthetic import SyntheticWeights

STACKS = ("reference", "yardstick", "base", "all")
TOP_KERNELS = 12
"""Kernels listed per layer (bench's JSON and its console): the lockstep's busiest by device seconds."""
TRACED_DEVICE_TYPES = ("cuda",)
"""Devices whose busy seconds are traced (harness.run.device_time: a CPU's wall time is its busy time)."""


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Callable[[], Any]) -> tuple[Any, float]:
    """fn's result and its seconds, the device's queue drained before and after."""
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return result, time.perf_counter() - start


def traced(device: torch.device, fn: Callable[[], Any]) -> tuple[Any, DeviceBusy]:
    """fn's result and what the device ran meanwhile (as `timed`; busy seconds None on a CPU: nothing is traced)."""
    with device_busy(device) as busy:
        result = fn()
    return result, busy


def measure_fp32_peak(device: torch.device, size: int | None = None, repeats: int = 5) -> float:
    """The device's fp32 matmul rate in FLOP/s, measured: the best of `repeats` products of two size×size fp32
    matrices (TF32 off, as the reference runs). 8192 on a GPU (1.1 TFLOP a product, ~20 ms on an H200), 1024 on a
    CPU."""
    size = size or (8192 if device.type == "cuda" else 1024)
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    a @ b  # warm-up: library load, kernel choice
    best = min(timed(device, lambda: a @ b)[1] for _ in range(repeats))
    return 2 * size**3 / best


def reference_flops(cfg: ModelConfig, layer: int, n_tokens: int) -> float:
    """The FLOPs the model's math needs for one layer over n_tokens causal positions (not what the reference's
    blocking adds): 2 per multiply-add of every per-token projection (attention, compressors, indexer, mHC
    pre-linears, router, shared expert), top-k routed experts, and per query the attention core over its keys —
    QK and PV over min(W, t+1) window rows plus its compressed rows (CSA: min(top-k, visible), HCA: every visible
    row) — and the indexer's scores over its visible rows (CSA)."""
    D, H, d = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    kind, ratio = cfg.layer_kind(layer), cfg.compress_ratio(layer)
    mix = (2 + cfg.hc_mult) * cfg.hc_mult
    per_token = 2 * (2 * mix * cfg.hc_mult * D)  # hc_pre pre-linears, attention and ffn sites
    per_token += 2 * (D * cfg.q_lora_rank + cfg.q_lora_rank * H * d + D * d)  # wq_a, wq_b, wkv
    per_token += 2 * (H * d * cfg.o_lora_rank + cfg.o_groups * cfg.o_lora_rank * D)  # wo_a (grouped), wo_b
    if kind != "swa":
        per_token += 2 * 2 * D * d * (2 if kind == "csa" else 1)  # compressor wkv, wgate
    if kind == "csa":
        per_token += 2 * 2 * D * cfg.index_head_dim * 2  # indexer compressor
        per_token += 2 * (cfg.q_lora_rank * cfg.index_n_heads * cfg.index_head_dim + D * cfg.index_n_heads)
    per_token += 2 * D * cfg.n_routed_experts  # router
    per_token += 2 * 3 * D * cfg.moe_intermediate_size * (cfg.num_experts_per_tok + cfg.n_shared_experts)
    t = torch.arange(n_tokens, dtype=torch.float64)
    keys = torch.clamp(t + 1, max=cfg.sliding_window)
    if kind == "csa":
        visible = torch.div(t + 1, ratio, rounding_mode="floor")
        keys = keys + torch.clamp(visible, max=cfg.index_topk)
        per_query_extra = 2 * cfg.index_n_heads * cfg.index_head_dim * visible
    elif kind == "hca":
        keys = keys + torch.div(t + 1, ratio, rounding_mode="floor")
        per_query_extra = torch.zeros_like(t)
    else:
        per_query_extra = torch.zeros_like(t)
    attention = float((4 * H * d * keys + per_query_extra).sum())
    return per_token * n_tokens + attention


@dataclass
class LayerBench:
    """One layer's seconds (and peak device memory in GiB, None on the CPU)."""

    layer: int
    kind: str
    weights_s: float
    alone_s: dict[str, float]  # stack → seconds without probes
    runner_s: dict[str, float]  # "stack/mode" → seconds through the runner, probes included
    store_s: float
    reference_flop: float
    peak_device_gib: float | None
    busy_s: dict[str, float] | None = None
    """Device-busy seconds (a GPU only): 'weights', each stack alone by name, and 'run', the lockstep layer with
    its probes and store — each from a traced pass of its own, apart from the timed one."""
    top_kernels: list[tuple[str, float]] = field(default_factory=list)
    """The lockstep layer's kernels (and copies) with the most device seconds, summed per name (a GPU only)."""

    @property
    def probes_s(self) -> float:
        """Runner time beyond the stacks' own: recording, comparing, binning (each mode runs the stack once), of the
        stacks timed alone (the attribution's other variants are not); with the streams placed on the host, the
        global stacks' copies out and in too (the stacks alone read base's streams untimed)."""
        timed = {key: s for key, s in self.runner_s.items() if key.split("/")[0] in self.alone_s}
        return sum(timed.values()) - sum(self.alone_s[key.split("/")[0]] for key in timed)

    @property
    def other_variants_s(self) -> float:
        """Runner time of the variants not timed alone (with --attribution: each patch alone, all but one)."""
        return sum(s for key, s in self.runner_s.items() if key.split("/")[0] not in self.alone_s)

    @property
    def run_s(self) -> float:
        """This layer's seconds in a run: the lockstep with probes and the store (weights overlap it)."""
        return sum(self.runner_s.values()) + self.store_s


@dataclass
class BenchResult:
    model: str
    tokens: int
    decode: int
    chunk: int
    device: str
    device_name: str
    threads: int
    fp32_peak_flops: float
    layers: list[LayerBench] = field(default_factory=list)
    peak_host_gib: float = 0.0
    predicted: dict[str, Any] = field(default_factory=dict)  # harness.run.memory's estimate for this shape
    streams_on_host: bool = False  # the global stacks' streams waited on the host between layers (check_fits)

    def _over_all_layers(self, cfg: ModelConfig, seconds: Callable[[LayerBench], float]) -> float | None:
        """`seconds` of a measured layer, projected over every layer of the model: the mean of the measured layers
        of each layer kind times the number of layers of that kind. None when some kind was not measured."""
        by_kind: dict[str, list[float]] = {}
        for lb in self.layers:
            by_kind.setdefault(lb.kind, []).append(seconds(lb))
        kinds = [cfg.layer_kind(i) for i in range(cfg.num_hidden_layers)]
        if not self.layers or any(k not in by_kind for k in kinds):
            return None
        return sum(sum(by_kind[k]) / len(by_kind[k]) for k in kinds)

    def projected_run_s(self, cfg: ModelConfig) -> float | None:
        """A whole run of this shape, all layers, plus the first layer's weights (later layers' are made in the
        background). None when some kind was not measured."""
        total = self._over_all_layers(cfg, lambda lb: lb.run_s)
        return None if total is None else total + self.layers[0].weights_s

    def projected_busy_s(self, cfg: ModelConfig) -> float | None:
        """The device-busy seconds of a whole run of this shape: each layer's lockstep and its weights, which a run
        makes on the same device — the floor under the run's wall time that removing host cost cannot go below.
        None on a CPU or when some layer kind was not measured."""
        if any(lb.busy_s is None for lb in self.layers):
            return None
        return self._over_all_layers(cfg, lambda lb: lb.busy_s["run"] + lb.busy_s["weights"])

    def to_dict(self, cfg: ModelConfig) -> dict[str, Any]:
        out = asdict(self)
        for row, lb in zip(out["layers"], self.layers):
            row.update(probes_s=lb.probes_s, other_variants_s=lb.other_variants_s, run_s=lb.run_s,
                       tokens_per_s=(self.tokens + self.decode) / lb.run_s,
                       reference_flops_per_s=lb.reference_flop / lb.alone_s["reference"],
                       reference_share_of_peak=lb.reference_flop / lb.alone_s["reference"] / self.fp32_peak_flops)
        out["projected_run_s"] = self.projected_run_s(cfg)
        out["projected_busy_s"] = self.projected_busy_s(cfg)
        out["layers_total"] = cfg.num_hidden_layers
        return out


def _stacks_alone(cfg: ModelConfig, layer: int, weights: TensorBundle, dev: torch.device,
                  x_ref: torch.Tensor, x_base: torch.Tensor, ids: torch.Tensor, ref_segments: list[int],
                  yard_segments: list[int], segments: list[int], tokens: int, reference: ReferenceModel,
                  yardstick: ReferenceModel, engines: dict[str, OptimizedModel],
                  measure: Callable[[Callable[[], Any]], Any]) -> dict[str, Any]:
    """`measure` of each stack over the layer without probes (its wall seconds: timed; its device-busy seconds:
    traced). They share one dequantized-weight cache, as in a run (the first to read a weight pays for it), freed
    on return, before the lockstep pass makes its own."""
    dense = DenseCache.for_device(dev)
    alone = {
        "reference": measure(lambda: reference.run_layer(
            ReferenceLayer(cfg, layer, weights, device=dev, dense=dense), x_ref, ids, ref_segments)),
        "yardstick": measure(lambda: yardstick.run_layer(
            ReferenceLayer(cfg, layer, weights, torch.bfloat16, device=dev, dense=dense), x_base, ids,
            yard_segments)),
    }
    for name, engine in engines.items():
        alone[name] = measure(lambda: engine.run_layer(engine.layer(layer, weights, dense), x_base, ids,
                                                       segments, tokens))
    return alone


class _TimedStore(RunStore):
    """A run store that adds up the seconds the run's thread spends writing layers (metrics.parquet's refresh in
    the background is not theirs)."""

    seconds = 0.0

    def write_layer(self, layer: int, rows: list[dict[str, Any]], background: bool = False) -> None:
        start = time.perf_counter()
        super().write_layer(layer, rows, background)
        self.seconds += time.perf_counter() - start


def bench_prompt(cfg: ModelConfig, tokens: int, decode: int) -> tuple[list[int], list[int], list[int]]:
    """Prompt and decode ids drawn (seed 0) from ordinary vocabulary ids clear of special tokens, and four equal
    turns (earlier-turn probes need some)."""
    ids = torch.randint(min(1000, cfg.vocab_size // 2), min(cfg.vocab_size, 100000), (tokens + decode,),
                        generator=torch.Generator().manual_seed(0)).tolist()
    turns = [min(3, 4 * p // tokens) for p in range(tokens + decode)]
    return ids[:tokens], ids[tokens:], turns


def run_bench(cfg: ModelConfig, tokens: int, decode: int, layers: list[int], device: str, chunk: int = 8192,
              progress: Callable[[str], None] = lambda line: None,
              variants: list[VariantSpec] | None = None, trace: bool = True) -> BenchResult:
    """`variants`: the lockstep's (default base and all; `bench --attribution` gives `dsv4-drift attribute`'s: base,
    each patch alone, all but one, all). Base and all are also timed alone. `trace`: on a GPU, once every layer is
    timed, run each layer's parts once more, traced, for their device-busy seconds (LayerBench.busy_s)."""
    dev = torch.device(device)
    source = SyntheticWeights(cfg, 0)
    prompt, decode_ids, turns = bench_prompt(cfg, tokens, decode)
    all_patches = default_registry().choose("all")
    variants = variants or [VariantSpec("base", []), VariantSpec("all", all_patches)]
    # the reference prefills in chunks of `chunk` as a scenario's does by default (prefill.reference_chunk_size)
    spec = RunSpec(source, prompt, decode_ids, turns, [(tokens // 8, tokens // 8 + 16)], variants, chunk_size=chunk,
                   reference_chunk_size=chunk, local=True, device=device)
    estimate = check_fits(spec)  # refused with the numbers, or its streams placed on the host, as `run` would be
    result = BenchResult(cfg.name, tokens, decode, chunk, str(dev),
                         torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", torch.get_num_threads(),
                         measure_fp32_peak(dev), predicted=estimate.to_dict(), streams_on_host=spec.streams_on_host)
    note = placement_note(spec, estimate)
    if note:
        progress(f"note: {note}")
    progress(f"fp32 matmul peak: {result.fp32_peak_flops / 1e12:.2f} TFLOP/s")
    ids = torch.tensor(prompt + decode_ids, device=dev)
    reference, yardstick = ReferenceModel(source, device=dev), ReferenceModel(source, torch.bfloat16, dev)
    engines = {"base": OptimizedModel(source, [], dev), "all": OptimizedModel(source, all_patches, dev)}
    together = LockstepRunner.decodes_together(spec)  # the reference and yardstick as the lockstep runs them
    ref_segments = yard_segments = segment_lengths(tokens, decode, chunk, together)
    # base and all as the lockstep runs them too: the built-ins declare Patch.decode_together
    segments = segment_lengths(tokens, decode, chunk, LockstepRunner.engines_decode_together(spec))
    # compile the patches' kernels (Triton) before anything is timed: a short prefill and up to 2 decode steps (no
    # more than the run has: a step past the ids would be empty)
    warm, warm_steps = min(tokens, 256), min(decode, 2)
    for engine in engines.values():
        engine.run_layer(engine.layer(layers[0]), engine.embed(ids[: warm + warm_steps]), ids[: warm + warm_steps],
                         segment_lengths(warm, warm_steps, chunk), warm)
    with tempfile.TemporaryDirectory() as tmp:
        store = _TimedStore(tmp + "/run")
        store.create({})
        runner_s: dict[str, float] = {}
        mark: list[Any] = [0.0, None]

        def on_event(event: dict[str, Any]) -> None:  # charge the time since the last event to the stack running
            sync(dev)
            now = time.perf_counter()
            if mark[1] is not None:
                runner_s[mark[1]] = runner_s.get(mark[1], 0.0) + now - mark[0]
            mark[0], mark[1] = now, f"{event['stack']}/{event['mode']}" if event.get("event") == "stack" else None

        runner = LockstepRunner(spec, store, on_event)
        runner.HOST_LANES = False  # one stack at a time, so that each column is one stack's (harness.run.host_lanes)
        x = runner.initial_streams()
        if spec.streams_on_host and dev.type == "cuda":
            _lock_host_blocks(spec, x)

        def stacks_alone(layer: int, weights: TensorBundle, measure: Callable[[Callable[[], Any]], Any]
                         ) -> dict[str, Any]:  # base's streams back on the device if they were placed, untimed
            return _stacks_alone(cfg, layer, weights, dev, x["reference"], to_device(x["base"], dev), ids,
                                 ref_segments, yard_segments, segments, tokens, reference, yardstick, engines, measure)
        for layer in layers:
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            weights, weights_s = timed(dev, lambda: source.layer(layer, dev))
            alone = stacks_alone(layer, weights, lambda fn: timed(dev, fn)[1])
            runner_s.clear()
            store.seconds = 0.0
            mark[:] = [time.perf_counter(), None]
            sync(dev)
            runner.run_layer(layer, x, weights=weights)
            on_event({"event": "layer_done"})
            runner_s[next(reversed(runner_s))] -= store.seconds  # the last stack's time ran up to the store's end
            peak = torch.cuda.max_memory_allocated(dev) / 2**30 if dev.type == "cuda" else None
            lb = LayerBench(layer, cfg.layer_kind(layer), weights_s, alone, dict(runner_s), store.seconds,
                            reference_flops(cfg, layer, tokens + decode), peak)
            result.layers.append(lb)
            progress(f"layer {layer} ({lb.kind}): weights {weights_s:.2f} s, run {lb.run_s:.2f} s "
                     f"(probes {lb.probes_s:.2f} s, store {lb.store_s:.2f} s)")
            del weights  # the next layer's are made next; a traced pass makes this one's again
        if trace and dev.type in TRACED_DEVICE_TYPES:
            # after every timed pass: a process keeps CUPTI set up once it has traced, which may slow what runs
            # after (pytorch/pytorch#144455). The runner is reused (its LM head and caches are built), with a store
            # of its own, so the traced layer does the timed one's work and no more
            runner.store, runner.progress = RunStore(tmp + "/traced"), lambda event: None
            runner.store.create({})
            for lb in result.layers:
                lb.busy_s, lb.top_kernels = _trace_layer(runner, lb.layer, x, source, stacks_alone)
                progress(f"layer {lb.layer} ({lb.kind}), traced: the GPU busy {lb.busy_s['run']:.2f} s of the "
                         f"lockstep's {lb.run_s:.2f} s")
        for written in {store, runner.store}:  # metrics.parquet is refreshed in the background: done before
            written.flush_metrics()              # the folder goes
    result.peak_host_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return result


def _lock_host_blocks(spec: RunSpec, x: dict[str, torch.Tensor]) -> None:
    """Page-lock, untimed, the host blocks a layer's placed outputs and kept global prefill rows take, and free them
    to torch's page-locked cache. A run's later layers reuse the blocks of the streams before them; a bench layer
    would lock fresh ones — 0.34 s per GiB on an H100 host against ~0 reused (thirty-fifth session), ~6 s of an
    attribution-shaped layer at 30K that no run's layer after its first pays."""
    placed = [v for k, v in x.items() if k != "reference"]
    if not placed:
        return
    rows = (spec.n_prompt, *placed[0].shape[1:])
    kept = kept_global_prefills(spec, spec.stacks())
    try:
        blocks = [torch.empty(v.shape, dtype=v.dtype, pin_memory=True) for v in placed]
        blocks += [torch.empty(rows, dtype=placed[0].dtype, pin_memory=True) for _ in range(2 * kept)]
    except RuntimeError:  # the host refuses to lock that much: the run's to_host copies to ordinary memory then
        return
    del blocks


def _trace_layer(runner: LockstepRunner, layer: int, x: dict[str, torch.Tensor], source: SyntheticWeights,
                 stacks_alone: Callable[..., dict[str, Any]], top: int = TOP_KERNELS
                 ) -> tuple[dict[str, float], list[tuple[str, float]]]:
    """The layer's parts once more, traced: the device-busy seconds of its weights, of each stack alone
    (`stacks_alone(layer, weights, measure)`) and of the lockstep layer, and the lockstep's `top` kernels."""
    dev = runner.device
    weights, made = traced(dev, lambda: source.layer(layer, dev))
    out: dict[str, float] = {"weights": made.seconds}
    out.update(stacks_alone(layer, weights, lambda fn: traced(dev, fn)[1].seconds))
    _, run = traced(dev, lambda: runner.run_layer(layer, x, weights=weights))
    out["run"] = run.seconds
    return out, run.top(top)
