"""Serving-stack bugs of classes the selftest does not inject, written with the public plugin API as a user would
(tests/test_serving_bugs.py runs each through `dsv4-drift run tiny-smoke`). Each is a real kind of mistake: a
window one row short, router weights not renormalised, a cache write that drops part of a row, a cache write one
slot off, an expert-parallel MoE that drops the pairs past its capacity, a loader that scales one expert wrongly,
a decode kernel given the wrong softmax scale, a router that ignores its selection bias, a chunked prefill whose
indexer masks by chunk-local positions, a decode top-k length two short, a chunk boundary that drops the CSA
compressor's overlap half, a compressed row stored a decode step late, a boundary tile whose first query misses
the token before it, a tiled prefill kernel one row of whose every tile misses its own key, a tiled prefill
indexer one row of whose every tile scores the row before's query — and two changes that must pass: one that
moves no decision (the indexer's head weights scaled uniformly), and attention visiting its keys in reverse order
(the same sums in another order, at every query the attention site now checks)."""

import dataclasses
import math

import torch

from optimized.patching import Patch

window_short = Patch("window-short", phases=("decode",),
                     description="decode attention drops the newest window row (a sliding window one row short)")


@window_short.op("sparse_attention")
def _window_one_short(ctx, q, window_slots, comp_slots, sink):
    newest = window_slots.max(-1, keepdim=True).values
    slots = torch.where(window_slots == newest, torch.full_like(window_slots, -1), window_slots)
    return ctx.base(q=q, window_slots=slots, comp_slots=comp_slots, sink=sink)


no_renorm = Patch("no-renorm", phases=("prefill", "decode"),
                  description="router weights not renormalised over the top-k (norm_topk_prob ignored)")


@no_renorm.op("router")
def _unnormalised(ctx, y, token_ids):
    routing = ctx.base(y=y, token_ids=token_ids)
    weights = routing.scores.gather(-1, routing.expert_ids) * ctx.cfg.routed_scaling_factor
    return dataclasses.replace(routing, weights=weights)


rope_dropped = Patch("kv-rope-dropped", phases=("decode",),
                     description="decode writes only the nope part of a new window row; its rope dims stay zero")


@rope_dropped.op("kv_store")
def _nope_only(ctx, cache, rows):
    if cache == "window" and rows.shape[0]:
        rows = rows.clone()
        rows[:, ctx.cfg.head_dim - ctx.cfg.qk_rope_head_dim:] = 0
    return ctx.base(cache=cache, rows=rows)


kv_overwrite = Patch("kv-overwrite", phases=("decode",),
                     description="decode writes each new window row over the previous one (a write index one slot "
                                 "behind), leaving the new slot unwritten")


@kv_overwrite.op("kv_store")
def _one_slot_behind(ctx, cache, rows):
    if cache != "window" or not rows.shape[0] or ctx.segment == 0:
        return ctx.base(cache=cache, rows=rows)
    stored = ctx.state.cache(cache)
    stored.length -= 1
    ctx.base(cache=cache, rows=rows)
    stored.length += 1
    return None


capacity_drop = Patch("capacity-drop", phases=("prefill", "decode"),
                      description="expert-parallel MoE drops each expert's pairs past capacity factor 1.25 "
                                  "(in token order), as a dispatch with a fixed buffer per expert does")


@capacity_drop.op("experts")
def experts_with_capacity(ctx, y, routing):
    ids = routing.expert_ids
    tokens, k = ids.shape
    capacity = math.ceil(1.25 * tokens * k / ctx.cfg.n_routed_experts)
    onehot = torch.nn.functional.one_hot(ids.flatten(), ctx.cfg.n_routed_experts)
    place = (onehot.cumsum(0) * onehot).sum(-1) - 1  # each pair's place among its expert's pairs
    kept = (place < capacity).view(tokens, k)
    return ctx.base(y=y, routing=dataclasses.replace(routing, weights=routing.weights * kept))


expert_scale = Patch("expert-scale", phases=("prefill", "decode"),
                     description="the loader dequantizes expert 0's w2 with half its scale (a scale read for another "
                                 "block): one expert of many, a few tokens of each layer")


@expert_scale.op("load_weight")
def load_with_one_scale_wrong(ctx, name, fmt):
    weight = ctx.base(name=name, fmt=fmt)
    return weight * 0.5 if name == "ffn.experts.0.w2.weight" else weight


decode_sm_scale = Patch("decode-sm-scale", phases=("decode",),
                        description="decode attention with its softmax scale 0.9× (a kernel given the wrong sm_scale)")


@decode_sm_scale.op("sparse_attention")
def _scaled_queries(ctx, q, window_slots, comp_slots, sink):
    return ctx.base(q=q * 0.9, window_slots=window_slots, comp_slots=comp_slots, sink=sink)


router_bias_dropped = Patch("router-bias-dropped", phases=("prefill", "decode"),
                            description="learned routing picks the top-k of the unbiased scores (a fused top-k kernel "
                                        "that ignores noaux_tc's selection bias)")


@router_bias_dropped.op("router")
def _unbiased_picks(ctx, y, token_ids):
    routing = ctx.base(y=y, token_ids=token_ids)
    if ctx.cfg.is_hash_layer(ctx.layer):
        return routing
    ids = torch.topk(routing.scores, routing.expert_ids.shape[-1], dim=-1).indices
    picked = routing.scores.gather(-1, ids)
    return dataclasses.replace(routing, expert_ids=ids,
                               weights=picked / picked.sum(-1, keepdim=True) * ctx.cfg.routed_scaling_factor)


indexer_chunk_positions = Patch("indexer-chunk-positions", phases=("prefill",),
                                description="in prefill chunks after the first, the indexer's causal mask uses "
                                            "chunk-local positions (each query sees the rows of as many tokens as "
                                            "lie before it in its chunk)")


@indexer_chunk_positions.op("indexer_logits")
def _chunk_local(ctx, q, weights, positions):
    start = int(ctx.positions[0]) if ctx.segment else 0
    return ctx.base(q=q, weights=weights, positions=positions - start)


topk_short = Patch("topk-short", phases=("decode",),
                   description="decode attends two fewer indexer picks than the top-k made (topk_length off by two)")


@topk_short.op("indexer_topk")
def _two_short(ctx, logits, positions, k):
    row_ids, valid = ctx.base(logits=logits, positions=positions, k=k)
    lane = torch.arange(valid.shape[-1], device=valid.device)
    return row_ids, valid & (lane < valid.sum(-1, keepdim=True) - 2)


uniform_index_weights = Patch("uniform-index-weights", phases=("prefill", "decode"),
                              description="the indexer's per-head weights doubled: every score doubles (exactly), "
                                          "no ranking changes")


@uniform_index_weights.op("indexer_logits")
def _doubled(ctx, q, weights, positions):
    return ctx.base(q=q, weights=weights * 2, positions=positions)


overlap_lost = Patch("overlap-lost", phases=("prefill",),
                     description="each prefill chunk boundary resets the CSA compressors' previous-window half (the "
                                 "overlap state not carried), so the first row after it pools its own window only")


@overlap_lost.op("chunk_state_carry")
def _reset_overlap(ctx, state):
    state = ctx.base(state=state)
    for compressor in (state.compressor, state.indexer_compressor):
        if compressor is not None and compressor.overlap:
            compressor.prev_kv = compressor.prev_gate = None
    return state


row_late = Patch("comp-row-late", phases=("decode",),
                 description="decode stores each completed compressed row one step late (the compressor's output "
                             "queued behind the step's attention), so the query that completes a window misses its "
                             "row, and the last one is never stored")


@row_late.op("compressor")
def _one_step_late(ctx, which, x, positions):
    rows = ctx.base(which=which, x=x, positions=positions)
    held = ctx.state.extras.pop(f"row-late-{which}", None)
    ctx.state.extras[f"row-late-{which}"] = rows
    return rows[:0] if held is None else held


first_query_edge = Patch("first-query-edge", phases=("prefill",),
                         description="in prefill chunks after the first, the chunk's first query does not attend the "
                                     "token before it (a boundary tile's window mask starting one row late)")


@first_query_edge.op("sparse_attention")
def _first_query_misses_previous_token(ctx, q, window_slots, comp_slots, sink):
    if ctx.segment:
        start = int(ctx.positions[0])
        first = window_slots.max(-1, keepdim=True).values == start  # the query whose newest row is the chunk's first
        window_slots = torch.where(first & (window_slots == start - 1), torch.full_like(window_slots, -1),
                                   window_slots)
    return ctx.base(q=q, window_slots=window_slots, comp_slots=comp_slots, sink=sink)


tile_row_self = Patch("tile-row-self", phases=("prefill",),
                      description="prefill attention in 64-query tiles whose row 37 does not attend its own token (a "
                                  "diagonal mask off by one in one row of every tile)")


@tile_row_self.op("sparse_attention")
def _tile_row_misses_its_own_token(ctx, q, window_slots, comp_slots, sink):
    newest = window_slots.max(-1, keepdim=True).values  # a query's own row is its newest window row
    own = (newest % 64 == 37) & (window_slots == newest)
    return ctx.base(q=q, window_slots=torch.where(own, torch.full_like(window_slots, -1), window_slots),
                    comp_slots=comp_slots, sink=sink)


index_tile_row = Patch("index-tile-row", phases=("prefill",),
                       description="prefill indexer logits in 64-query tiles whose row 37 scores the keys with the "
                                   "previous row's query and head weights (a tile's row offset off by one)")


@index_tile_row.op("indexer_logits")
def _tile_row_scores_the_row_before(ctx, q, weights, positions):
    rows = torch.arange(q.shape[0], device=q.device)
    source = torch.where(positions % 64 == 37, (rows - 1).clamp(min=0), rows)
    return ctx.base(q=q[source], weights=weights[source], positions=positions)


keys_reversed = Patch("keys-reversed", phases=("prefill", "decode"),
                      description="attention visits its keys in reverse order (the window's and the compressed slots "
                                  "flipped): the same sums in another order")


@keys_reversed.op("sparse_attention")
def _keys_in_reverse(ctx, q, window_slots, comp_slots, sink):
    return ctx.base(q=q, window_slots=window_slots.flip(-1), comp_slots=comp_slots.flip(-1), sink=sink)
