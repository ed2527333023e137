"""Faults of known classes, written only with the public plugin API (`optimized.patching.Patch`), exactly as a
user would write a patch — `dsv4-drift selftest` injects each and checks that the gate fails and attribution
names it, and that a benign change passes. Each fault is a real failure mode of optimized-stack §1's table.
"""

from __future__ import annotations

import torch

from optimized.ops import OpContext, Routing
from optimized.patching import Patch

chunk_carry_fault = Patch(
    "fault-chunk-carry", phases=("prefill",),
    description="zeroes the compressors' carried window state at every prefill chunk boundary (O6 failure mode)",
    source="selftest")


@chunk_carry_fault.op("chunk_state_carry")
def _zero_carried_windows(ctx: OpContext, state):
    state = ctx.base(state=state)
    for comp in (state.compressor, state.indexer_compressor):
        if comp is not None:
            comp.pending_kv = torch.zeros_like(comp.pending_kv)
            comp.pending_gate = torch.zeros_like(comp.pending_gate)
            if comp.prev_kv is not None:
                comp.prev_kv = torch.zeros_like(comp.prev_kv)
                comp.prev_gate = torch.zeros_like(comp.prev_gate)
    return state


indexer_fault = Patch(
    "fault-indexer-topk", phases=("decode",),
    description="drops the better-scoring half of the indexer's top-k picks in decode (O2 boundary failure)",
    source="selftest")


@indexer_fault.op("indexer_topk")
def _drop_best_half(ctx: OpContext, logits: torch.Tensor, positions: torch.Tensor, k: int):
    row_ids, valid = ctx.base(logits=logits, positions=positions, k=k)
    picked = torch.where(valid, logits.gather(-1, row_ids), torch.full_like(logits[:, :1], float("-inf")))
    order = torch.argsort(picked, dim=-1, descending=True)
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(order.shape[-1], device=order.device).expand_as(order))
    n_valid = valid.sum(-1, keepdim=True)
    return row_ids, valid & (rank >= n_valid // 2)


merge_fault = Patch(
    "fault-split-merge", phases=("decode",),
    description="merges the window and compressed partial outputs with equal weights instead of by their LSE "
                "in decode (O1 merge failure)",
    source="selftest")


def _two_partials(ctx: OpContext, q, window_slots, comp_slots, sink):
    """The window and the compressed rows attended separately, as two split partials — each (out, lse) with the
    sink in its own denominator, as the stock op computes any set of keys; None when there are no compressed rows."""
    if comp_slots.shape[-1] == 0 or not bool((comp_slots >= 0).any()):
        return None
    window = ctx.base(q=q, window_slots=window_slots, comp_slots=torch.full_like(comp_slots, -1), sink=sink)
    compressed = ctx.base(q=q, window_slots=torch.full_like(window_slots, -1), comp_slots=comp_slots, sink=sink)
    return window, compressed


@merge_fault.op("sparse_attention")
def _equal_weight_merge(ctx: OpContext, q, window_slots, comp_slots, sink):
    parts = _two_partials(ctx, q, window_slots, comp_slots, sink)
    if parts is None:
        return ctx.base(q=q, window_slots=window_slots, comp_slots=comp_slots, sink=sink)
    (out_w, lse_w), (out_c, lse_c) = parts
    return 0.5 * (out_w + out_c), torch.logaddexp(lse_w, lse_c)


routing_fault = Patch(
    "fault-routing-scale", phases=("prefill", "decode"),
    description="forgets routed_scaling_factor on the hash layers (O4 failure mode: 1.5× under-scaled experts)",
    source="selftest")


@routing_fault.op("router")
def _forget_scaling(ctx: OpContext, y, token_ids) -> Routing:
    routing = ctx.base(y=y, token_ids=token_ids)
    if ctx.cfg.is_hash_layer(ctx.layer):
        routing.weights = routing.weights / ctx.cfg.routed_scaling_factor
    return routing


mhc_fault = Patch(
    "fault-mhc-fp8", phases=("prefill", "decode"),
    description="runs the mHC pre-linear on FP8 e4m3 operands (an O3 precision fault two formats too low)",
    source="selftest")


@mhc_fault.op("hc_prelinear")
def _fp8_prelinear(ctx: OpContext, streams, site):
    flat = streams.float().flatten(-2)
    fp8 = lambda t: t.to(torch.float8_e4m3fn).float()  # noqa: E731
    rho = torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + ctx.cfg.rms_norm_eps)
    return (fp8(flat) @ fp8(ctx.weight(f"hc_{site}_fn")).T) * rho


sink_per_partial_fault = Patch(
    "fault-sink-per-partial", phases=("decode",),
    description="counts the attention sink in each partial (window and compressed) before the LSE merge, so it "
                "enters the denominator twice in decode (O1 merge failure: sink applied per partial, not once)",
    source="selftest")


@sink_per_partial_fault.op("sparse_attention")
def _sink_in_each_partial(ctx: OpContext, q, window_slots, comp_slots, sink):
    parts = _two_partials(ctx, q, window_slots, comp_slots, sink)
    if parts is None:
        return ctx.base(q=q, window_slots=window_slots, comp_slots=comp_slots, sink=sink)
    (out_w, lse_w), (out_c, lse_c) = parts
    lse = torch.logaddexp(lse_w, lse_c)  # a correct LSE merge of two partials that each already hold the sink
    weight_w = torch.exp(lse_w - lse)[..., None]
    return weight_w * out_w + (1 - weight_w) * out_c, lse


bf16_router_fault = Patch(
    "fault-bf16-router", phases=("prefill", "decode"),
    description="computes the router's logits and scores in bf16 (DeepSeek keeps gate scores in fp32; vllm-ascend "
                "PRs #9676, #9831: bf16 routing perturbs near-ties)",
    source="selftest")


@bf16_router_fault.op("router")
def _bf16_router(ctx: OpContext, y, token_ids) -> Routing:
    cfg = ctx.cfg
    bf = lambda t: t.to(torch.bfloat16).float()  # noqa: E731
    scores = bf(torch.sqrt(torch.nn.functional.softplus(bf(bf(y) @ bf(ctx.weight("ffn.gate.weight")).T))))
    if cfg.is_hash_layer(ctx.layer):
        expert_ids = ctx.weights.stored("ffn.gate.tid2eid").to(ctx.device)[token_ids]
    else:
        expert_ids = torch.topk(bf(scores + ctx.weight("ffn.gate.bias")), cfg.num_experts_per_tok, dim=-1).indices
    w = scores.gather(-1, expert_ids)
    return Routing(scores, expert_ids, w / w.sum(-1, keepdim=True) * cfg.routed_scaling_factor)


lanes_past_length_fault = Patch(
    "fault-lanes-past-length", phases=("prefill", "decode"),
    description="sparse attention reads every top-k lane instead of the first topk_length, so while the indexer has "
                "fewer than k rows the kernel attends rows the query must not see (optimized-stack §2.5: lanes "
                "beyond topk_length must be −1)",
    source="selftest")


@lanes_past_length_fault.op("sparse_attention")
def _read_every_lane(ctx: OpContext, q, window_slots, comp_slots, sink, comp_lanes=None):
    if ctx.kind != "csa" or comp_lanes is None:
        return ctx.base(q=q, window_slots=window_slots, comp_slots=comp_slots, sink=sink)
    return ctx.base(q=q, window_slots=window_slots, comp_slots=comp_lanes, sink=sink)


one_chunk_fault = Patch(
    "fault-one-chunk", phases=("prefill",),
    description="in the second prefill chunk only, sparse attention skips the compressed rows (a kernel regime "
                "switch that drops the extra cache for one chunk size; optimized-stack §7.1)",
    source="selftest")


@one_chunk_fault.op("sparse_attention")
def _no_compressed_rows_in_chunk_one(ctx: OpContext, q, window_slots, comp_slots, sink):
    if ctx.segment == 1:
        comp_slots = torch.full_like(comp_slots, -1)
    return ctx.base(q=q, window_slots=window_slots, comp_slots=comp_slots, sink=sink)


benign_change = Patch(
    "benign-sum-order", phases=("prefill", "decode"),
    description="the mHC pre-linear in fp32 summed in four K-partials (a different order, the same precision)",
    source="selftest")


@benign_change.op("hc_prelinear")
def _split_k_fp32(ctx: OpContext, streams, site):
    """An fp32 GEMM over K = hc·D products of bf16 streams and fp32 weights: its sums round, so another order changes
    low bits, and the bf16 streams downstream flip now and then — the numbers change, the precision does not.
    (A split of a bf16 or FP8 GEMM would be bit-identical at these widths, its fp32 sums being exact, and the
    projections into bf16 tensors round a re-association away.) The selftest lists it before the fault, so a fault
    on the same op replaces it in the variant with both, never the other way round."""
    flat = streams.float().flatten(-2)
    fn = ctx.weight(f"hc_{site}_fn")
    parts = [x @ w.T for x, w in zip(flat.chunk(4, -1), fn.chunk(4, -1))]
    rho = torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + ctx.cfg.rms_norm_eps)
    return torch.stack(parts).sum(0) * rho


FAULTS: dict[str, tuple[Patch, str]] = {
    "chunk-boundary state carry": (chunk_carry_fault, "prefill"),
    "indexer selection": (indexer_fault, "decode"),
    "attention split merge": (merge_fault, "decode"),
    "routing scale": (routing_fault, "prefill"),
    "mHC precision": (mhc_fault, "prefill"),
    "sink counted per partial": (sink_per_partial_fault, "decode"),
    "router in bf16": (bf16_router_fault, "prefill"),
    "loss confined to early positions": (lanes_past_length_fault, "prefill"),
    "fault in one chunk": (one_chunk_fault, "prefill"),
}
"""Fault class -> (patch, the phase attribution must name). Faults active in both phases are named by their
first divergence, which a prefill of hundreds of tokens reaches before the decode steps."""
