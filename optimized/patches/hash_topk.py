"""O4 (optimized-stack §5.2): the fused hash_topk routing path of the hash layers (0-2).

The fused kernel reads ids = tid2eid[token], computes a numerically stable softplus
max(x,0) + log1p(exp(−|x|)), takes sqrt, renormalises the six gathered scores by their sum with a floor,
and does NOT put routed_scaling_factor (1.5) on the weights: it goes on the MoE output instead, with the
fused shared-expert slot weighted 1/1.5 so the global ×1.5 restores weight 1 for the shared expert.
Learned-routing layers keep the stock router.

Options:
  scale_on:      "output" (default, fused kernel + post-permute ×1.5), "weights" (apply-on-weights mode),
                 or "none" (a runner that never applies the 1.5 — the failure mode the spec warns about)
  floor:         lower bound of the renormalisation denominator (default 1e-20; 0 reproduces the 0/0 NaN
                 of older kernels when all six scores underflow)
  weights_dtype: "fp32" (default) or "bf16" (weights rounded to bf16 before use)
"""

from __future__ import annotations

import torch

from optimized.ops import OpContext, Routing
from optimized.patching import Patch

PATCH = Patch(
    "hash-topk",
    phases=("prefill", "decode"),
    description="fused hash routing on hash layers: stable softplus, renormalise with a floor, 1.5 on the MoE output",
    defaults={"scale_on": "output", "floor": 1e-20, "weights_dtype": "fp32"},
    choices={"scale_on": ("output", "weights", "none"), "weights_dtype": ("fp32", "bf16")},
    spec="optimized-stack §5 (O4)",
    decode_together=True,  # its decode ops compute each query alone (Patch.decode_together)
    layers_for=lambda cfg, layer, options: cfg.is_hash_layer(layer),  # learned-routing layers: the stock router
)


def stable_softplus(x: torch.Tensor) -> torch.Tensor:
    return torch.clamp(x, min=0) + torch.log1p(torch.exp(-x.abs()))


@PATCH.op("router")
def router(ctx: OpContext, y: torch.Tensor, token_ids: torch.Tensor) -> Routing:
    scale_on, floor, wdt = ctx.options["scale_on"], float(ctx.options["floor"]), ctx.options["weights_dtype"]
    logits = ctx.call("linear", x=y, site="ffn.gate").float()
    scores = torch.sqrt(stable_softplus(logits))
    expert_ids = ctx.weights.stored("ffn.gate.tid2eid").to(ctx.device)[token_ids]
    picked = scores.gather(-1, expert_ids)
    weights = picked / torch.clamp(picked.sum(-1, keepdim=True), min=floor)
    rsf = ctx.cfg.routed_scaling_factor
    if scale_on == "weights":
        weights = weights * rsf
    if wdt == "bf16":
        weights = weights.to(torch.bfloat16).float()
    if scale_on == "output":
        return Routing(scores, expert_ids, weights, output_scale=rsf, shared_weight=1.0 / rsf)
    return Routing(scores, expert_ids, weights)
