"""A run's peak memory, predicted from its config, prompt length and stacks before it starts (issue #14).

The prediction adds up what a layer-major run holds at its busiest moment (DESIGN §8: one layer's weights per
stack family, no T×T buffers, activations O(T·hc·D)); each term is named, so the message that refuses a run says
what would not fit and which setting changes it:

- **weights**: two layers in their stored formats (the one in use and the next, made in the background);
- **dequantized weights**: the layer's fp32 copies shared by every stack (reference.weights.dense_cache), up to
  the cache's budget (a GPU's share is split between the ranks on it); when the layer fits whole they are made
  before its first stack, in stacks whose temporaries (dense_cache.STACK_BYTES: ~0.8 GB) come and go before any
  working set exists, so they add no term; on a GPU also the routed experts' bf16 copies (DenseCache.bf16_stack:
  half their fp32 bytes), which the experts' grouped GEMMs read, where the budget has room for them;
- **reference layers**: the reference's non-expert weights in its dtype and the yardstick's in bf16;
- **output heads**: the LM head stored, and in the reference's, the yardstick's and the engines' dtypes (the needle
  lens reads logits after every layer);
- **streams**: every stack's input and output streams [T, hc, D] (fp32 or fp64 for the reference, bf16 else); with
  RunSpec.streams_on_host (one GPU, turned on by check_fits when the run fits only so), the reference's and those of
  the pairs running at once (one per host lane), the global stacks' waiting in page-locked host memory between
  layers (**streams (page-locked, between layers)**: each stack's input and output, a third set while the resume
  state holds an earlier layer's, and each kept global prefill's input and output rows, rounded up to a power of two
  as torch's page-locked allocator rounds them: harness.run.stream_placement);
- **recorded taps**: the reference's dense taps of one layer, per position (probes.DENSE_TAPS);
- **tap broadcast buffer** (sharded runs): the reference's rank sends those taps as one byte buffer, as large again (with the
  row and sampled taps, which are small beside them);
- **reference run ahead** (sharded runs on a CPU): the reference's rank runs two layers ahead
  (distributed.ShardedRunner.reference_lead), so it holds one more layer's stored weights, dequantized copies, taps
  and output streams;
- **working set**: the largest temporaries of one pass — the reference's whole-prompt projections and MoE
  buffers ([T, H·d] queries three times, [T·k, D] expert slots twice), or an engine chunk's;
- **shared prefills**: a prefill that variants differing only in decode share (harness.run.prefill_sharing) is kept
  during the layer — in local mode its output rows, in either mode a copy of the engine state (the paged caches);
- **second host lane** (one process on a GPU, when stock and patched stacks run and a layer's dense cache holds the
  fp32 copy of every weight): a stock stack's prefill chunk computes in a second host thread while a patched stack
  computes its own (harness.run.host_lanes): two chunks' working sets, less the working set counted above;
- **expert GEMM operands** (on a GPU): the bf16 operands of the experts' tensor-core GEMMs — one group of expert
  matrices' bf16 copies (optimized.numerics.grouped_bf16_products) and a chunk's pair rows and products
  (scaled_bf16_products too, with one expert's NVFP4 form made on use, which is smaller than a group) — in each
  host lane;
- **experts site** (a variant with patches): the stock experts' output and the variant's, held while the pair and
  clamp sites are judged (optimized.engine.OptimizedLayer._judge_experts). Not a term: the attention site at every
  query of a block whose prefill attention a patch computed (OptimizedLayer._attention) runs the stock op and its
  twin on that block after the variant's call, one at a time, each within the block's budget
  (reference.layer.query_block_size); what they add is the stock call's output held during the twin's, one block's
  [B, H, d] fp32 (256 × 64 × 512 × 4 B = 32 MiB at Flash width), below the estimate's rounding;
- **NVFP4 conversion** (with `nvfp4-experts`): the temporaries of one group of expert matrices converted together
  from their codes (optimized.base_ops.prepare_nvfp4_forms; a group whose fp32 copies the cache holds only finds two
  numbers per matrix, from block maxima of 1/32 its size: NVFP4_FACTOR_GROUP, less than this term).

On a GPU the device holds all of it and the host a copy of the streams when the resume state is saved; on a CPU
the host holds everything. The estimate is checked against a measured peak in `dsv4-drift bench`'s output.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from harness.run.distributed import ranks_per_device, reference_lead
from harness.run.host_lanes import cache_holds_every_copy, lanes_of
from harness.run.prefill_sharing import kept_global_prefills, kept_prefill_keys
from harness.run.runner import RunSpec
from harness.run.stream_placement import host_block_bytes
from optimized.base_ops import NVFP4_GROUP
from optimized.numerics import GROUPED_EXPERTS
from reference.config import ModelConfig
from reference.weights.dense_cache import DenseCache, layer_dense_bytes
from reference.weights.schema import layer_specs

STORED_BYTES_PER_ELEMENT = {"fp8_block128": 1 + 1 / 128**2, "fp4_mx32": 0.5 + 1 / 32, "bf16": 2, "f32": 4, "i64": 8}
"""Bytes per element in each storage format, scales included (spec §8.3)."""

PROCESS_BYTES = {"cpu": 0.4 * 2**30, "cuda": 1.8 * 2**30}
"""Host memory of the process before any tensor: the Python interpreter, torch and (with CUDA) its libraries and
context (measured: tiny-smoke's peak RSS, 0.4 GiB on a CPU here and 1.8 GiB on an H200)."""

HEADROOM = 0.92
"""Share of a device's (or the host's available) memory a run may plan to use: the CUDA context, the caching
allocator's fragmentation and the other processes on the machine need the rest."""


@dataclass
class MemoryEstimate:
    """Predicted peak bytes per named term, on the run's device and on the host."""

    device: str
    device_terms: dict[str, float]
    host_terms: dict[str, float]

    @property
    def device_bytes(self) -> float:
        return sum(self.device_terms.values())

    @property
    def host_bytes(self) -> float:
        return sum(self.host_terms.values())

    def to_dict(self) -> dict[str, object]:
        gib = 2.0**30
        return {"device": self.device, "device_gib": round(self.device_bytes / gib, 2),
                "host_gib": round(self.host_bytes / gib, 2),
                "device_terms_gib": {k: round(v / gib, 2) for k, v in self.device_terms.items()},
                "host_terms_gib": {k: round(v / gib, 2) for k, v in self.host_terms.items()}}


def _layer_bytes(cfg: ModelConfig, layer: int) -> tuple[float, float, float]:
    """(stored bytes, fp32 bytes of every float tensor, fp32 bytes of the routed experts) of one layer."""
    stored = sum(spec.numel * STORED_BYTES_PER_ELEMENT[spec.storage] for spec in layer_specs(cfg, layer))
    return (float(stored), *(float(b) for b in layer_dense_bytes(cfg, layer)))


def _global_stacks_per_rank(spec: RunSpec, world: int) -> int:
    """The most global-mode stacks (each holding its own streams) any rank of `world` runs, as the runner deals
    them (RunSpec.stacks_of_rank: by cost, so a rank may hold several)."""
    return max(sum(mode == "global" for _, mode in spec.stacks_of_rank(rank, world)) for rank in range(world))


def predict_memory(spec: RunSpec, world: int = 1) -> MemoryEstimate:
    """The estimate for the busiest process of a run sharded over `world` (each holds the streams of its share of
    the stacks, and all the rest; rank 0 also gathers every stack's streams when it saves the resume state)."""
    cfg = spec.source.config
    T, n, D, H, hd = spec.n_total, cfg.hc_mult, cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    ref_size = torch.empty(0, dtype=spec.reference_dtype).element_size()
    layers = [_layer_bytes(cfg, layer) for layer in range(cfg.num_hidden_layers)]
    stored = max(s for s, _, _ in layers)
    dense = max(d for _, d, _ in layers)
    experts = max(e for _, _, e in layers)
    nvfp4 = any(c.id == "nvfp4-experts" for v in spec.variants for c in v.choices)
    device = torch.device(spec.device)
    # the runner's own cache budget (LockstepRunner.run_layer), split between the ranks that share a GPU
    budget = DenseCache.for_device(device, ranks_per_device(spec.device, world)).budget_bytes
    global_stacks = _global_stacks_per_rank(spec, world)
    all_global_stacks = _global_stacks_per_rank(spec, 1)
    taps_per_token = (ref_size * (2 * D + 2 * D + n * D + n * D + H + 2 * n + n * n)  # attn/moe out, mixed, streams
                      + 4 * cfg.n_routed_experts + 12 * cfg.num_experts_per_tok  # router
                      + 9 * cfg.index_topk)  # indexer.selected: int64 ids + bool
    reference_pass = T if spec.reference_chunk_size is None else min(T, spec.reference_chunk_size)
    chunk_working = min(T, spec.chunk_size) * 4 * (3 * H * hd + 2 * cfg.num_experts_per_tok * D)
    working = max(reference_pass * ref_size * (3 * H * hd + 2 * cfg.num_experts_per_tok * D), chunk_working)
    non_expert = dense - experts
    # on a GPU the experts' bf16 copies too: one stack per matrix kind (w1, w3, w2: a sixth of their fp32 bytes each),
    # kept whole or not at all, while the budget has room beside the fp32 copies (DenseCache.bf16_stack)
    kind_stack = experts // 6
    bf16_stacks = min(3, max(0, budget - dense) // kind_stack) * kind_stack if device.type == "cuda" and kind_stack \
        else 0
    vocab = cfg.vocab_size * D
    terms = {
        "weights (2 layers, stored)": 2 * stored,
        "dequantized weights (shared)": min(budget, dense + bf16_stacks + (experts if nvfp4 else 0)),
        "reference layers": non_expert * (ref_size / 4) + non_expert / 2,
        "output heads": vocab * (2 + ref_size + 2 + 4),  # stored; reference, yardstick and engines (shared)
        "streams": 2 * T * n * D * (ref_size + 2 * global_stacks),  # input and output of each
        "recorded taps": T * taps_per_token,
        "working set": working,
    }
    placed = spec.streams_on_host and device.type == "cuda"
    # local: the leader's bf16 output rows (global: views of streams counted above, or with the streams placed, host
    # copies of them: below); both: a copy of the state's caches (~3 bytes per latent dimension and token); at the
    # layer that keeps the most, on the busiest rank, as stacks_of_rank deals the pairs (a local pair taking an
    # earlier one's whole layer keeps no share there: prefill_sharing.SharedLayers)
    ranks = [spec.stacks_of_rank(rank, world) for rank in range(world)]
    shared = max(sum(T * n * D * 2 * (mode == "local") + T * 3 * (hd + cfg.index_head_dim)
                     for mode, _ in kept_prefill_keys(spec, pairs, layer))
                 for pairs in ranks for layer in range(cfg.num_hidden_layers))
    if shared:
        terms["shared prefills"] = shared
    # two host lanes (one process on a GPU, stock and patched stacks, a layer's dense cache holding every fp32 copy):
    # two pairs compute at once, a stock one in the second host thread (ranks run one lane each)
    lanes = 2 if (device.type == "cuda" and world == 1 and len(lanes_of(spec, spec.stacks())) > 1
                  and any(cache_holds_every_copy(spec, layer, budget) for layer in range(cfg.num_hidden_layers))) else 1
    if lanes == 2 and 2 * chunk_working > working:
        # two engine chunks' working sets; the reference's pass, which runs alone, may already need more
        terms["second host lane"] = 2 * chunk_working - working
    if device.type == "cuda":  # the expert GEMMs' bf16 operands on tensor cores (numerics.grouped_bf16_products,
        # scaled_bf16_products): one group's weights, the chunk's pair rows and products — in each host lane
        pairs = min(T, spec.chunk_size) * cfg.num_experts_per_tok
        terms["expert GEMM operands (bf16)"] = lanes * 2 * (GROUPED_EXPERTS * cfg.moe_intermediate_size * D
                                                            + pairs * (D + cfg.moe_intermediate_size))
    if any(v.choices for v in spec.variants):
        # the experts site (optimized.engine.OptimizedLayer._judge_experts) of a patched variant's prefill chunk:
        # the stock op's output and the variant's are held while the sites are judged. The stock pairs with and
        # without the clamp come from one call (base_ops.expert_pairs_at_limits: the gate and up products shared, the
        # input's pair rows freed before the two intermediates), whose temporaries stay within a chunk's working set
        # (counted above), as one stock experts call's do: two [chunk, D] fp32 here
        terms["experts site (stock outputs)"] = 2 * min(T, spec.chunk_size) * D * 4
    if nvfp4:  # prepare_nvfp4_forms: a group's e2m1 values, scales, products and dense forms (5 copies, fp32)
        terms["NVFP4 conversion (one group)"] = NVFP4_GROUP * 5 * 4 * cfg.moe_intermediate_size * D
    if world > 1:  # the reference's rank packs its taps into one byte buffer to broadcast them (distributed.Group)
        terms["tap broadcast buffer"] = T * taps_per_token
        held_ahead = reference_lead(device) - 1  # references held beyond the next layer's, run ahead
        if held_ahead:  # each: its layer's weights, dequantized copies, taps and output stream
            terms["reference run ahead (one more layer)"] = held_ahead * (
                stored + min(budget, dense) + T * taps_per_token + T * n * D * ref_size)
    state_copy = T * n * D * (ref_size + 2 * all_global_stacks)  # the resume state, gathered on rank 0's host
    host = {"process (torch and its libraries)": PROCESS_BYTES[device.type], "resume state copy": state_copy}
    if placed:
        # the device: the reference's input and output and those of the pairs running at once (one per host lane).
        # The host, in blocks rounded up to a power of two: each global stack's input and output, a third set while
        # the resume state of an earlier layer is written (it holds the placed streams instead of copies:
        # RunStore._host_copy), and each kept global prefill's input and output rows (runner._run_engine)
        block = host_block_bytes(T * n * D * 2)
        terms["streams"] = 2 * T * n * D * (ref_size + 2 * lanes)
        global_keys = max(kept_global_prefills(spec, spec.stacks_of_rank(r, world)) for r in range(world))
        host["streams (page-locked, between layers)"] = (3 * global_stacks + 2 * global_keys) * block
        host["resume state copy"] = T * n * D * ref_size
    if device.type == "cuda":
        return MemoryEstimate(spec.device, terms, host)
    return MemoryEstimate(spec.device, {}, {**terms, **host})


def available_host_bytes() -> float:
    """MemAvailable from /proc/meminfo (what the host can give without swapping); physical memory elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def fit_problem(estimate: MemoryEstimate, device_capacity: float | None, host_capacity: float) -> str | None:
    """Why the run would not fit (with the numbers and the setting to change), or None when it fits."""
    gib = 2.0**30
    for where, total, capacity, terms in (("device", estimate.device_bytes, device_capacity, estimate.device_terms),
                                          ("host", estimate.host_bytes, host_capacity, estimate.host_terms)):
        if capacity is None or total <= HEADROOM * capacity:
            continue
        largest = sorted(terms.items(), key=lambda kv: -kv[1])[:3]
        advice = {
            "streams": "a shorter prompt, fewer variants, or --devices N to shard them (one process on a GPU keeps "
                       "them on the host between layers when that is enough)",
            "working set": "prefill.reference_chunk_size (e.g. 8192) to run the reference's prompt in chunks",
            "recorded taps": "a shorter prompt",
            "tap broadcast buffer": "a shorter prompt, or fewer --devices on one GPU",
            "weights (2 layers, stored)": "a device with more memory",
            "dequantized weights (shared)": "a device with more memory",
            "reference run ahead (one more layer)": "a shorter prompt, or --devices 1 (one process runs no reference "
                                                    "ahead)",
        }
        hints = "; ".join(f"{name}: {advice.get(name, 'fewer stacks')}" for name, _ in largest)
        return (f"predicted peak {where} memory {total / gib:.1f} GiB exceeds {HEADROOM:.0%} of the "
                f"{capacity / gib:.1f} GiB available (largest: "
                + ", ".join(f"{name} {value / gib:.1f} GiB" for name, value in largest)
                + f"). To fit, change — {hints}")
    return None


def check_fits(spec: RunSpec, world: int = 1) -> MemoryEstimate:
    """The run's estimate; a UsageError naming the numbers and the setting to change when it would not fit. The
    estimate is one process's, so it is checked against that process's share of a GPU its ranks share.

    One process on a GPU that the run fits only with its global stacks' streams waiting on the host between layers
    gets spec.streams_on_host set (the same numbers; a copy out and in per stack and layer: a Flash stream at 30,784
    tokens is 1.0 GB, 0.02 s each way on an H100 host, and the first layer page-locks fresh blocks, 0.34 s per GiB,
    which later layers reuse: thirty-fifth session, README Memory); the caller says so. A sharded run holds only its
    share of the streams already."""
    from harness.errors import UsageError

    device = torch.device(spec.device)
    capacity = (torch.cuda.get_device_properties(device).total_memory / ranks_per_device(spec.device, world)
                if device.type == "cuda" else None)
    host_capacity = available_host_bytes() / (1 if capacity else world)
    estimate = predict_memory(spec, world)
    problem = fit_problem(estimate, capacity, host_capacity)
    if problem and capacity is not None and world == 1 and not spec.streams_on_host:
        spec.streams_on_host = True
        try:
            placed = predict_memory(spec, world)
            fits = fit_problem(placed, capacity, host_capacity) is None
        finally:
            spec.streams_on_host = False  # unless it fits so; else the first estimate's problem is the one to report
        if fits:
            spec.streams_on_host = True
            return placed
    if problem:
        raise UsageError(problem)
    return estimate


def placement_note(spec: RunSpec, estimate: MemoryEstimate) -> str | None:
    """What the command prints when check_fits placed the streams on the host: why, and what it costs."""
    if not spec.streams_on_host:
        return None
    gib = 2.0**30
    host = estimate.host_terms.get("streams (page-locked, between layers)", 0.0)
    return (f"the global stacks' streams wait in host memory between layers ({host / gib:.1f} GiB page-locked): "
            f"the run fits this GPU only so ({estimate.device_bytes / gib:.1f} GiB predicted); the same numbers, a "
            "copy out and in per stack and layer (README: Memory)")
