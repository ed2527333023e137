"""One DeepSeek-V4 block in pure fp32 (or fp64), with the state that lets it run in pieces.

`ReferenceLayer.forward` takes the hyper-connection streams of a run of consecutive tokens (a whole
prompt, a prefill chunk of any size, or one decode token) and the layer's `LayerState`, and returns
the output streams. The state carries exactly what spec §10.3 lists — the last W−1 window kv rows,
each compressor's incomplete window (and CSA's previous Ca half), the compressed caches — so a prompt
split anywhere gives the same result as one pass, and decode steps continue from a prefill.

Read against spec §2 (block), §3 (mHC), §4 (attention), §5 (compressors, indexer), §6 (MoE), §7 (QAT
switches). Queries are processed in blocks sized from a memory budget: no T×T buffer ever exists.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reference.config import ModelConfig
from reference.ops.attention import (KeySet, kv_path, output_path, query_path, sparse_attention_with_sink,
                                     window_band)
from reference.ops.compressor import CompressorState, CompressorWeights, compress, visible_rows
from reference.ops.indexer import indexer_scores, select_rows
from reference.ops.mhc import hc_post, hc_pre
from reference.ops.moe import moe_forward, route
from reference.ops.norms import rms_norm
from reference.ops.rope import apply_rope, cos_sin, layer_inverse_frequencies
from reference.probes import NULL_SINK, ProbeSink, sampled_offsets, sampled_positions_on_host
from reference.quant import fp4_fake_quant, fp8_fake_quant, hadamard_matrix
from reference.weights.dense_cache import DenseCache
from reference.weights.source import TensorBundle

QUERY_BLOCK_BUDGET_ELEMENTS = 1 << 25
"""Temporaries per query block on the CPU, in elements (~128 MB in fp32): bounds memory at any sequence length."""

QUERY_BLOCK_DEVICE_FRACTION = 1 / 16
"""On a GPU, a query block's temporaries may take this share of the device's memory (8.8 GB of an H200's 141 GB).
The share is of the device's total memory, not of what is free when the block starts: free memory depends on what
the caching allocator holds at that moment, and a block size that moved with it would move the bits of every
blocked reduction between runs, and between the ranks of a sharded run (harness.run.distributed)."""


MAX_QUERY_BLOCK = 256
"""Window keys are a band shared by a block: B queries see B+W−1 rows, so blocks much longer than the
window waste work on masked band entries; 256 keeps the band under 3× the window. (Measured on an H200, Flash at
30K tokens: 1024-query blocks made the yardstick ~1.8× slower and the attention probes ~2.6× slower, the band's
masked entries travelling into every sampled attention row.)"""

def query_block_size(cfg: ModelConfig, kind: str, main_rows: int, index_rows: int, device: torch.device,
                     band: int | None = None) -> int:
    """Queries per block so that a block's temporaries stay within the device's budget: a fixed element budget
    on the CPU, a share of the device's memory on a GPU. `band`: the window rows a block's queries share (default
    W + MAX_QUERY_BLOCK, a block of consecutive queries; queries spread over a chunk share the chunk's)."""
    n_keys = (cfg.sliding_window + MAX_QUERY_BLOCK) if band is None else band
    per_query = 0
    if kind == "csa":
        n_keys += cfg.index_topk
        per_query += cfg.index_topk * cfg.head_dim  # gathered compressed rows
        per_query += cfg.index_n_heads * (index_rows + 1) * 2  # per-head dots and their ReLU
    elif kind == "hca":
        n_keys += main_rows + 1
    per_query += n_keys * 3 * cfg.num_attention_heads  # logits, exp, probs
    if device.type == "cuda":
        budget = int(torch.cuda.get_device_properties(device).total_memory * QUERY_BLOCK_DEVICE_FRACTION) // 4
    else:
        budget = QUERY_BLOCK_BUDGET_ELEMENTS
    return max(1, min(MAX_QUERY_BLOCK, budget // per_query))


def share_rows(n_rows: int, picks: int, heads: int, device: torch.device) -> bool:
    """Evaluate a CSA block's attention against all n_rows compressed rows with a mask of the picked ones
    (True) instead of gathering each query's picks (False). Same key set and result, different cost:
    dense costs ~4·H·n_rows·d FLOPs per query, gathering ~8·picks·d bytes plus 4·H·picks·d FLOPs. With
    F FLOP/s and M bytes/s, dense wins when n_rows < picks·(1 + 2F/(H·M)): on a CPU core (F ≈ 5e10,
    M ≈ 5e9) that is ~6× the picks for H = 4; on an H200 (F ≈ 5e13, M ≈ 3e12) and H = 64, ~1.5×."""
    ratio = 1 + (2 * 5e13 / (heads * 3e12) if device.type == "cuda" else 2 * 5e10 / (heads * 5e9))
    return n_rows <= picks * ratio


@dataclass(frozen=True)
class ParityOptions:
    """The official code's QAT rounding steps (spec §7); the pure reference leaves them off.

    fp8_kv:      round the nope dims of every window kv row and every main-compressor row through FP8
                 e4m3 with a UE8M0 scale per 64 elements (scale = 2^ceil(log2(max(amax,1e-4)/448))).
    indexer_fp4: rotate indexer q (after RoPE) and indexer-compressor rows (after norm and RoPE) by the
                 orthonormal Hadamard matrix, then round through FP4 e2m1 with a UE8M0 scale per 32.
                 Without the FP4 step the rotation would cancel in q·k.
    """

    fp8_kv: bool = False
    indexer_fp4: bool = False


@dataclass
class LayerState:
    """Everything layer L remembers about the tokens it has already processed (spec §10.3)."""

    position: int  # absolute position of the next token
    window_kv: torch.Tensor  # [≤ W−1, d] kv rows of the most recent tokens
    compressor: CompressorState | None  # main KV compressor (CSA, HCA)
    indexer: CompressorState | None  # indexer compressor (CSA)


class ReferenceLayer:
    """Block `layer` of the model, its weights dequantized to `dtype` once at construction.

    dtype is float32 (the reference) or float64 (its own noise floor); bfloat16 re-executes the same graph
    naively in bf16 — the *yardstick* of DESIGN §3, never the reference.
    """

    def __init__(self, cfg: ModelConfig, layer: int, weights: TensorBundle, dtype: torch.dtype = torch.float32,
                 parity: ParityOptions = ParityOptions(), device: torch.device | str = "cpu",
                 dense: DenseCache | None = None) -> None:
        """`dense`: the layer's dequantized fp32 weights shared with the other stacks (a new cache when None); the
        experts are read from it, one at a time, and converted to `dtype` when used (the yardstick on a GPU reads the
        cache's bf16 copies of them instead, where it keeps them: _bf16_experts)."""
        if dtype not in (torch.float32, torch.float64, torch.bfloat16):
            raise ValueError(f"the reference graph runs in float32, float64 or (yardstick) bfloat16, not {dtype}")
        self.cfg, self.layer, self.dtype, self.parity, self.device = cfg, layer, dtype, parity, torch.device(device)
        self.kind = cfg.layer_kind(layer)
        self.ratio = cfg.compress_ratio(layer)
        self.weights = weights
        w = lambda name: weights.dense(name, dtype).to(self.device)  # noqa: E731
        self.w = {name: w(name) for name in weights.names() if not name.startswith("ffn.experts.")}
        self.dense = dense if dense is not None else DenseCache()
        self._bf16_expert_stacks: dict[str, torch.Tensor | None] = {}  # the yardstick's, asked once per layer
        self.inv_freq = layer_inverse_frequencies(cfg, layer).to(self.device)
        if self.kind != "swa":
            self.compressor_w = self._compressor_weights("attn.compressor")
        if self.kind == "csa":
            self.indexer_compressor_w = self._compressor_weights("attn.indexer.compressor")
            self.hadamard = hadamard_matrix(cfg.index_head_dim, dtype, self.device) if parity.indexer_fp4 else None

    def _compressor_weights(self, prefix: str) -> CompressorWeights:
        return CompressorWeights(self.w[f"{prefix}.wkv.weight"], self.w[f"{prefix}.wgate.weight"],
                                 self.w[f"{prefix}.ape"], self.w[f"{prefix}.norm.weight"])

    def new_state(self) -> LayerState:
        cfg, dt, dev = self.cfg, self.dtype, self.device
        comp = idx = None
        if self.kind != "swa":
            comp = CompressorState.empty(self.ratio, self.kind == "csa", cfg.head_dim, dt, dev)
        if self.kind == "csa":
            idx = CompressorState.empty(self.ratio, True, cfg.index_head_dim, dt, dev)
        return LayerState(0, torch.zeros(0, cfg.head_dim, dtype=dt, device=dev), comp, idx)

    # ------------------------------------------------------------------------------------------
    def forward(self, streams: torch.Tensor, token_ids: torch.Tensor, state: LayerState,
                sink: ProbeSink = NULL_SINK) -> torch.Tensor:
        """Block_l (spec §2) over tokens at positions state.position … state.position+S−1.

        streams [S, n, D] in self.dtype; token_ids [S] (hash routing reads them). Mutates `state`.
        """
        cfg, w = self.cfg, self.w
        positions = torch.arange(state.position, state.position + streams.shape[0], device=self.device)
        if sink.wants("layer.in"):
            sink.emit("layer.in", positions, streams=streams)

        a, mix = hc_pre(streams, w["hc_attn_fn"], w["hc_attn_base"], w["hc_attn_scale"],
                        cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)
        if sink.wants("attn.hc"):
            sink.emit("attn.hc", positions, pre=mix.pre, post=mix.post, comb=mix.comb, mixed=a)
        attn_out = self._attention(rms_norm(a, w["attn_norm.weight"], cfg.rms_norm_eps), positions, state, sink)
        if sink.wants("attn.out"):
            sink.emit("attn.out", positions, out=attn_out)
        streams = hc_post(attn_out, streams, mix)

        a, mix = hc_pre(streams, w["hc_ffn_fn"], w["hc_ffn_base"], w["hc_ffn_scale"],
                        cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)
        if sink.wants("ffn.hc"):
            sink.emit("ffn.hc", positions, pre=mix.pre, post=mix.post, comb=mix.comb, mixed=a)
        moe_out = self._moe(rms_norm(a, w["ffn_norm.weight"], cfg.rms_norm_eps), token_ids, positions, sink)
        if sink.wants("moe.out"):
            sink.emit("moe.out", positions, out=moe_out)
        streams = hc_post(moe_out, streams, mix)

        if sink.wants("layer.out"):
            sink.emit("layer.out", positions, streams=streams)
        state.position += streams.shape[0]
        return streams

    # ------------------------------------------------------------------------------------------
    def _attention(self, x: torch.Tensor, positions: torch.Tensor, state: LayerState, sink: ProbeSink) -> torch.Tensor:
        cfg, w, nope = self.cfg, self.w, self.cfg.nope_head_dim
        cos, sin = cos_sin(self.inv_freq, positions, self.dtype)
        q_lat, q = query_path(x, w["attn.wq_a.weight"], w["attn.q_norm.weight"], w["attn.wq_b.weight"],
                              cfg.num_attention_heads, cos, sin, cfg.rms_norm_eps)
        kv = kv_path(x, w["attn.wkv.weight"], w["attn.kv_norm.weight"], cos, sin, cfg.rms_norm_eps)
        if self.parity.fp8_kv:
            kv = self._fp8_nope(kv)
        if sink.wants("attn.q"):
            sink.emit("attn.q", positions, q=q)
        if sink.wants("attn.kv"):
            sink.emit("attn.kv", positions, kv=kv)

        history = torch.cat([state.window_kv, kv], 0)
        history_start = state.position - state.window_kv.shape[0]

        if self.kind != "swa":
            rows = compress(state.compressor, x, positions, self.compressor_w, cfg.rms_norm_eps, self.inv_freq,
                            self._fp8_nope if self.parity.fp8_kv else None)
            self._emit_rows(sink, "compressor.rows", rows, state.compressor)
        if self.kind == "csa":
            rows = compress(state.indexer, x, positions, self.indexer_compressor_w, cfg.rms_norm_eps,
                            self.inv_freq, self._indexer_fp4 if self.parity.indexer_fp4 else None)
            self._emit_rows(sink, "indexer.rows", rows, state.indexer)
            q_idx = (q_lat @ w["attn.indexer.wq_b.weight"].T).unflatten(-1, (cfg.index_n_heads, cfg.index_head_dim))
            q_idx = apply_rope(q_idx, cos[:, None], sin[:, None])
            if self.parity.indexer_fp4:
                q_idx = self._indexer_fp4(q_idx)
            idx_weights = (x @ w["attn.indexer.weights_proj.weight"].T) * (
                cfg.index_head_dim**-0.5 * cfg.index_n_heads**-0.5)

        out = torch.empty_like(q)
        block = self._query_block(state)
        no_rows = torch.zeros(0, cfg.head_dim, dtype=self.dtype, device=self.device)
        for start in range(0, positions.numel(), block):
            blk = slice(start, start + block)
            pos = positions[blk]
            first, last = state.position + start, state.position + start + pos.numel() - 1  # known here: no read
            band, band_pos, band_valid = window_band(history, history_start, pos, cfg.sliding_window, (first, last))
            visible = visible_rows(pos, self.ratio) if self.ratio else None
            n_vis = (last + 1) // self.ratio if self.ratio else 0  # visible_rows of the block's last query
            sampled, sampled_pos = (sampled_offsets(sink, first, pos.numel(), self.device),  # no device read
                                    sampled_positions_on_host(sink, first, pos.numel())) \
                if sink.wants("attn.probs") or sink.wants("indexer.scores") else (None, None)
            comp = KeySet(no_rows, torch.zeros(pos.numel(), 0, dtype=torch.bool, device=self.device))
            comp_rows = torch.zeros(pos.numel(), 0, dtype=torch.int64, device=self.device)
            if self.kind == "hca":  # every complete block is a key: the rows shared by the whole query block
                rows = state.compressor.rows[:n_vis]
                ids = torch.arange(rows.shape[0], device=self.device)
                comp = KeySet(rows, ids[None, :] < visible[:, None])
                comp_rows = torch.where(comp.valid, ids[None, :], -1)
            elif self.kind == "csa":  # the indexer's top-k rows, gathered per query
                scores = indexer_scores(q_idx[blk], idx_weights[blk], state.indexer.rows[:n_vis])
                chosen, chosen_valid = select_rows(scores, pos, self.ratio, cfg.index_topk)
                if sink.wants("indexer.scores"):
                    hidden = torch.arange(scores.shape[1], device=self.device)[None] >= visible[sampled][:, None]
                    sink.emit("indexer.scores", sampled_pos, scores=scores[sampled].masked_fill(hidden, float("-inf")))
                if sink.wants("indexer.selected"):
                    sink.emit("indexer.selected", pos, row_ids=chosen, valid=chosen_valid)
                if share_rows(n_vis, chosen.shape[-1], cfg.num_attention_heads, self.device):
                    picked = torch.zeros(pos.numel(), n_vis + 1, dtype=torch.bool, device=self.device)
                    picked.scatter_(1, torch.where(chosen_valid, chosen, n_vis), True)
                    comp = KeySet(state.compressor.rows[:n_vis], picked[:, :n_vis])
                    # the probabilities' columns are rows 0 … n_vis−1 here, not the picks in pick order
                    ids = torch.arange(n_vis, device=self.device)
                    comp_rows = torch.where(comp.valid, ids[None, :], -1)
                else:
                    comp = KeySet(state.compressor.rows[chosen], chosen_valid)
                    comp_rows = torch.where(chosen_valid, chosen, -1)
            res = sparse_attention_with_sink(q[blk], [KeySet(band, band_valid), comp], w["attn.attn_sink"])
            if sink.wants("attn.probs"):
                window_pos = torch.where(band_valid, band_pos[None, :], -1)
                sink.emit("attn.probs", sampled_pos, window_pos=window_pos[sampled], comp_rows=comp_rows[sampled],
                          probs=res.probs[sampled], sink_prob=res.sink_prob[sampled], max_logit=res.max_logit[sampled])
            if sink.wants("attn.lse"):
                sink.emit("attn.lse", pos, lse=res.lse)
            out[blk] = res.out

        state.window_kv = history[max(0, history.shape[0] - (cfg.sliding_window - 1)):]
        return output_path(out, cos, sin, w["attn.wo_a.weight"], w["attn.wo_b.weight"], cfg.o_groups)

    def _query_block(self, state: LayerState) -> int:
        return query_block_size(self.cfg, self.kind, state.compressor.n_rows if state.compressor else 0,
                                state.indexer.n_rows if state.indexer else 0, self.device)

    def _fp8_nope(self, rows: torch.Tensor) -> torch.Tensor:
        nope = self.cfg.nope_head_dim
        return torch.cat([fp8_fake_quant(rows[..., :nope], block=64), rows[..., nope:]], -1)

    def _indexer_fp4(self, x: torch.Tensor) -> torch.Tensor:
        return fp4_fake_quant(x @ self.hadamard, block=32)

    @staticmethod
    def _emit_rows(sink: ProbeSink, tap: str, rows: torch.Tensor, state: CompressorState) -> None:
        if sink.wants(tap):
            ids = torch.arange(state.n_rows - rows.shape[0], state.n_rows, device=rows.device)
            sink.emit(tap, ids * state.ratio, rows=rows, row_ids=ids)

    # ------------------------------------------------------------------------------------------
    def _moe(self, y: torch.Tensor, token_ids: torch.Tensor, positions: torch.Tensor, sink: ProbeSink) -> torch.Tensor:
        cfg, w = self.cfg, self.w
        hashed = cfg.is_hash_layer(self.layer)
        routing = route(y, w["ffn.gate.weight"], cfg.num_experts_per_tok, cfg.routed_scaling_factor,
                        bias=None if hashed else w["ffn.gate.bias"],
                        tid2eid=w["ffn.gate.tid2eid"] if hashed else None, token_ids=token_ids.to(self.device))
        if sink.wants("moe.router"):
            sink.emit("moe.router", positions, scores=routing.scores, expert_ids=routing.expert_ids,
                      weights=routing.weights)
        shared = None
        if cfg.n_shared_experts:
            shared = tuple(w[f"ffn.shared_experts.{p}.weight"] for p in ("w1", "w3", "w2"))
        return moe_forward(y, routing, self._expert, shared, cfg.swiglu_limit)

    def _expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expert e's dequantized weights in the layer's dtype, through the layer's shared cache (a full-width layer's
        256 experts are 25.8 GB in fp32: the cache keeps what its budget allows and dequantizes the rest on use)."""
        stacks = [self._bf16_experts(m) for m in ("w1", "w3", "w2")]
        if all(s is not None for s in stacks):
            return stacks[0][e], stacks[1][e], stacks[2][e]
        names = (f"ffn.experts.{e}.{p}.weight" for p in ("w1", "w3", "w2"))
        return tuple(self.dense.get(n, self.weights.stored(n), self.device).to(self.dtype) for n in names)

    def _bf16_experts(self, matrix: str) -> torch.Tensor | None:
        """The yardstick's experts on a GPU: the shared cache's bf16 copy of every expert's `matrix`
        (DenseCache.bf16_stack, made on the first ask when the fp32 copies are all cached, bf16-exact and fit; the
        engines' grouped GEMMs read the same copy), asked once per layer; None for fp32 and fp64, on a CPU, or when
        there is no such copy. Its rows are what `.to(bfloat16)` makes of each expert, exactly (bf16-exact values),
        without three casts per expert and prefill chunk: 256 × 3 × 4 chunks of 8.4 M elements read in fp32 and
        written in bf16, ~0.05 s at an H100's bandwidth per Flash layer and mode (a traced CSA layer at 30,720 tokens
        put all the yardstick's bf16 casts at 0.051 s, thirty-third session)."""
        if self.dtype != torch.bfloat16 or self.device.type != "cuda":
            return None
        if matrix not in self._bf16_expert_stacks:
            self._bf16_expert_stacks[matrix] = self.dense.bf16_stack(
                [f"ffn.experts.{i}.{matrix}.weight" for i in range(self.cfg.n_routed_experts)])
        return self._bf16_expert_stacks[matrix]
