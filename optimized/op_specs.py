"""The names of the engine's overridable ops, what each takes and returns (a table, so `optimized.patching` can
check a patch's op names without importing the engine)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OpSpec:
    inputs: tuple[str, ...]
    returns: str
    doc: str
    optional: tuple[str, ...] = ()
    """Inputs added after the op was first published: passed only to implementations that declare them (a
    parameter of that name, or **kwargs), so plugins written against the older signature keep working."""


OP_SPECS: dict[str, OpSpec] = {
    "linear": OpSpec(("x", "site"), "y",
                     "x @ W(site)ᵀ. Sites: attn.wq_a, attn.wq_b, attn.wkv, attn.wo_a (x [S, G, (H/G)·d], grouped), "
                     "attn.wo_b, attn.indexer.wq_b, attn.indexer.weights_proj, attn.compressor.{wkv,wgate}, "
                     "attn.indexer.compressor.{wkv,wgate}, ffn.gate, ffn.shared_experts.{w1,w3,w2}. Base precision "
                     "per site: FP8 (1×128 act, 128×128 weights), bf16, or fp32 (LINEAR_PRECISION)."),
    "hc_prelinear": OpSpec(("streams", "site"), "mixes [S, (2+n)n]",
                           "mHC pre-linear m = ρ·(fn·x̂) of site 'attn' or 'ffn' (fp32 in the base engine)."),
    "hc_pre": OpSpec(("streams", "site"), "(a [S, D], HCMix)", "HC_pre: mixes → pre/post/Sinkhorn comb; a = Σ pre·X."),
    "hc_post": OpSpec(("f", "streams", "mix"), "streams [S, n, D]", "HC_post: post·f + Cᵀ·X, stored bf16."),
    "compressor": OpSpec(("which", "x", "positions"), "rows [R, d]",
                         "Feed tokens to the 'main' or 'indexer' compressor (ctx.state carries the windows); "
                         "returns the rows completed by this call, normed and rotated."),
    "kv_store": OpSpec(("cache", "rows"), "None", "Append rows to cache 'window', 'compressed' or 'index'."),
    "kv_load": OpSpec(("cache", "slots"), "rows [..., d]",
                      "Read rows of cache 'window' or 'compressed' (bf16 values; slot −1 gives zeros)."),
    "indexer_logits": OpSpec(("q", "weights", "positions"), "logits [B, R]",
                             "Lightning-indexer scores of queries against every row of the 'index' cache; rows not "
                             "visible to a query carry the masked value."),
    "indexer_topk": OpSpec(("logits", "positions", "k"), "(row_ids [B, k'], valid [B, k'])",
                           "Top-k rows per query; valid marks causal picks."),
    "sparse_attention": OpSpec(("q", "window_slots", "comp_slots", "sink"), "(out [B, H, d], lse [B, H])",
                               "Attention of q over its window rows and compressed rows with the per-head sink. "
                               "comp_slots [B, K] are the compressed rows already masked (−1 = no row). What a "
                               "kernel receives is also given: comp_lanes [B, K] are the top-k lanes as the "
                               "indexer wrote them, the valid picks first and then whatever the top-k left in the "
                               "lanes past them (rows not yet visible to the query), and comp_length [B] is the "
                               "number of valid lanes (topk_length). A kernel that reads past comp_length attends "
                               "rows it must not see.",
                               optional=("comp_lanes", "comp_length")),
    "router": OpSpec(("y", "token_ids"), "Routing", "Router scores, expert ids and weights (hash or learned)."),
    "experts": OpSpec(("y", "routing"), "out [S, D]", "Weighted sum of the routed experts (fp32 accumulation)."),
    "shared_expert": OpSpec(("y", "routing"), "out [S, D]",
                            "The shared expert's output, weighted by routing.shared_weight: W2·(silu(min(W1·y, L))·"
                            "clamp(W3·y, ±L)) with L = cfg.swiglu_limit, through the `linear` sites "
                            "ffn.shared_experts.{w1,w3,w2} (the base engine's FP8 GEMMs)."),
    "load_weight": OpSpec(("name", "fmt"), "weight [out, in] fp32",
                          "The fp32 value a kernel computes with, of this layer's stored tensor `name` (e.g. "
                          "'ffn.experts.3.w3.weight'), in format `fmt`: 'stored' (its checkpoint format, dequantized "
                          "exactly), 'nvfp4' (the NVFP4 form an O5 loader builds: the checkpoint's own, or converted "
                          "from FP4 with ModelOpt-style global scales) or 'nvfp4-pow2' (power-of-two global scales). "
                          "ctx.weight(name) is load_weight(name, 'stored'). A loader bug (a wrong scale, a fused "
                          "tensor split wrongly) is one override of this op."),
    "chunk_state_carry": OpSpec(("state",), "state",
                                "Called before every prefill chunk and decode step after the first: the state "
                                "(window, compressor and indexer-compressor state, caches) carried across."),
}
