"""The engine's named ops: what a patch can override, what each takes and returns, what it may read.

Every computation of the optimized layer that a kernel patch could replace goes through one of these
ops. An implementation is `fn(ctx: OpContext, **inputs)`; the stock engine's implementations live in
`optimized.base_ops`; patches stack on top (see `optimized.patching`). Tensors are fp32 tensors whose
values are what the deployed kernel would hold (bf16-rounded where the deployed tensor is bf16) unless
stated otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable

import torch

from reference.config import ModelConfig
from reference.weights.source import TensorBundle

if TYPE_CHECKING:  # pragma: no cover
    from optimized.engine import EngineState
    from optimized.numerics import DenseCache
    from optimized.patching import PatchChoice


@dataclass(frozen=True)
class OpSpec:
    inputs: tuple[str, ...]
    returns: str
    doc: str


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
                               "Attention of q over its window rows and compressed rows with the per-head sink."),
    "router": OpSpec(("y", "token_ids"), "Routing", "Router scores, expert ids and weights (hash or learned)."),
    "experts": OpSpec(("y", "routing"), "out [S, D]", "Weighted sum of the routed experts (fp32 accumulation)."),
    "chunk_state_carry": OpSpec(("state",), "state",
                                "Called before every prefill chunk and decode step after the first: the state "
                                "(window, compressor and indexer-compressor state, caches) carried across."),
}


@dataclass
class Routing:
    """Routing decision of the optimized engine (the reference's plus where the scaling is applied)."""

    scores: torch.Tensor  # [S, E]
    expert_ids: torch.Tensor  # [S, k]
    weights: torch.Tensor  # [S, k] as applied to the routed experts
    output_scale: float = 1.0  # multiplies the routed+shared MoE output (fused hash_topk puts 1.5 here)
    shared_weight: float = 1.0  # weight of the shared expert before output_scale


@dataclass
class OpContext:
    """What an op implementation may read. `options` are the running patch's options; `base` runs the
    implementation underneath (the stock op or an earlier patch); `call` runs any other op by name."""

    cfg: ModelConfig
    layer: int
    kind: str  # "swa" | "csa" | "hca"
    phase: str  # "prefill" | "decode"
    segment: int  # index of this prefill chunk / decode step within the phase
    positions: torch.Tensor  # absolute positions of the segment's tokens
    state: "EngineState"
    weights: TensorBundle  # stored formats (QuantizedTensor for FP8/FP4/NVFP4)
    dense: "DenseCache"
    device: torch.device
    engine_options: dict[str, Any]
    table: "OpTable"
    options: dict[str, Any] = field(default_factory=dict)
    patch_id: str | None = None
    base: Callable[..., Any] | None = None

    def weight(self, name: str) -> torch.Tensor:
        """Exact fp32 dequantization of a stored tensor of this layer (cached for the layer)."""
        return self.dense.get(name, self.weights.stored(name), self.device)

    def call(self, op: str, **inputs: Any) -> Any:
        """Run op `op` through the full patch chain of this phase."""
        return self.table.call(op, self, inputs)


class OpTable:
    """The op chains of one variant in one phase: base implementation at the bottom, patches on top."""

    def __init__(self, base_impls: dict[str, Callable[..., Any]], choices: "list[PatchChoice]", phase: str) -> None:
        missing = sorted(set(OP_SPECS) - set(base_impls))
        if missing:
            raise ValueError(f"base engine lacks implementations of ops {missing}")
        self.phase = phase
        self.chains: dict[str, list[tuple[Callable[..., Any], "PatchChoice | None"]]] = {
            name: [(fn, None)] for name, fn in base_impls.items()}
        for choice in choices:
            if phase not in choice.patch.active_phases(choice.options):
                continue
            for name, fn in choice.patch.ops.items():
                self.chains[name].append((fn, choice))

    def call(self, name: str, ctx: OpContext, inputs: dict[str, Any]) -> Any:
        return self._invoke(name, len(self.chains[name]) - 1, ctx, inputs)

    def _invoke(self, name: str, level: int, ctx: OpContext, inputs: dict[str, Any]) -> Any:
        from optimized.patching import PluginOpError

        fn, choice = self.chains[name][level]
        if choice is None:
            return fn(replace(ctx, options={}, patch_id=None, base=None), **inputs)
        sub = replace(ctx, options=choice.options, patch_id=choice.id,
                      base=lambda **kw: self._invoke(name, level - 1, ctx, kw))
        try:
            return fn(sub, **inputs)
        except PluginOpError:
            raise
        except Exception as e:  # noqa: BLE001 - a patch's failure must name the patch and the op
            raise PluginOpError(f"patch '{choice.id}' ({choice.patch.source}) failed in op '{name}' at layer "
                                f"{ctx.layer}, {ctx.phase} segment {ctx.segment}: {type(e).__name__}: {e}") from e
