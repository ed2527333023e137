"""O5 (optimized-stack §6): routed experts as ModelOpt NVFP4 with W4A4 activation quantization.

Weights: e2m1 with one e4m3 scale per 16 inputs and one fp32 global scale per tensor — the checkpoint's
own NVFP4 data when it has it, else converted from the FP4 (per-32 UE8M0) source with the same e2m1 codes and
block scales, the fp32 product block·global within 2^-23 of the FP4 value (reference.quant.mx32_to_nvfp4). Activations (W4A4): every expert GEMM input is quantized at run time
to e2m1 with a dynamic e4m3 scale per 16 elements relative to a global `input_scale`
(block scale = e4m3(amax/6/input_scale); x_q = e2m1(x / (block scale · input_scale))). The SwiGLU clamp
is applied before the intermediate is re-quantized for W2.

Options:
  activations: "w4a4" (default) or "w4a16" (bf16 activations, Marlin-style weight-only)
  input_scale: "checkpoint" (use the stored input_scale, 1.0 where absent) or a number
  global_scale: "modelopt" (default: per-tensor global scales near amax/(6·448), as ModelOpt writes them, so a
                gate/up pair's scales differ as in real checkpoints) or "pow2" (power-of-two globals, the rule
                before 2026-12-01: with profile uncalibrated it reproduces an earlier run bit for bit); pow2 is
                exact, modelopt within 2^-23 relative of the FP4 value (reference.quant.mx32_to_nvfp4)
"""

from __future__ import annotations

import torch

from optimized.base_ops import swiglu_fp32
from optimized.numerics import bf16
from optimized.ops import OpContext, Routing
from optimized.patching import Patch
from reference.ops.moe import expert_groups
from reference.quant import FP4_MAX, QuantizedTensor, blockwise_amax_last, expand_blocks_last, round_to_e2m1, \
    round_to_e4m3

PATCH = Patch(
    "nvfp4-experts",
    phases=("prefill", "decode"),
    description="routed experts as NVFP4 (e2m1 + e4m3/16 + fp32 global) with W4A4 activation quantization",
    defaults={"activations": "w4a4", "input_scale": "checkpoint", "global_scale": "modelopt"},
    choices={"activations": ("w4a4", "w4a16"), "input_scale": ("checkpoint", float),
             "global_scale": ("modelopt", "pow2")},
    spec="optimized-stack §6 (O5)",
)


def nvfp4_activation(x: torch.Tensor, input_scale: float) -> torch.Tensor:
    """Quantize to NVFP4 and back: per-16 e4m3 block scales relative to the global input_scale."""
    block = round_to_e4m3(blockwise_amax_last(x.float(), 16) / FP4_MAX / input_scale)
    scale = expand_blocks_last(block, 16, x.shape[-1]) * input_scale
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.where(scale > 0, round_to_e2m1(x.float() / safe) * scale, torch.zeros_like(scale))


def _nvfp4_weight(ctx: OpContext, name: str) -> tuple[torch.Tensor, float | None]:
    """Dense fp32 value of the NVFP4 form of an expert weight (through the load_weight op) and its input_scale."""
    stored = ctx.weights.stored(name)
    if not isinstance(stored, QuantizedTensor):
        raise ValueError(f"expert weight '{name}' is not quantized; nvfp4-experts needs FP4 or NVFP4 storage")
    rule = ctx.options["global_scale"]
    w = ctx.call("load_weight", name=name, fmt="nvfp4" if rule == "modelopt" else "nvfp4-pow2")
    return w, None if stored.input_scale is None else float(stored.input_scale)


@PATCH.op("experts")
def experts(ctx: OpContext, y: torch.Tensor, routing: Routing) -> torch.Tensor:
    mode, opt_scale = ctx.options["activations"], ctx.options["input_scale"]

    def act(x: torch.Tensor, stored_scale: float | None) -> torch.Tensor:
        if mode == "w4a16":
            return bf16(x)
        scale = (stored_scale if stored_scale is not None else 1.0) if opt_scale == "checkpoint" else float(opt_scale)
        return nvfp4_activation(x, scale)

    # the routed input is quantized per token, independent of the expert, so it is quantized once per global
    # input_scale (experts sharing one scale, e.g. the pinned 1.0, share the result)
    quantized_input: dict[float | None, torch.Tensor] = {}

    def act_input(stored_scale: float | None, tok: torch.Tensor) -> torch.Tensor:
        if stored_scale not in quantized_input:
            quantized_input[stored_scale] = act(y, stored_scale)
        return quantized_input[stored_scale][tok]

    S, k = routing.expert_ids.shape
    per_slot = torch.empty(S * k, y.shape[-1], dtype=torch.float32, device=y.device)  # every pair is written once
    weights = routing.weights.flatten()
    for e, tok, pairs in expert_groups(routing.expert_ids):
        (w1, s1), (w3, s3), (w2, s2) = (_nvfp4_weight(ctx, f"ffn.experts.{e}.{p}.weight") for p in ("w1", "w3", "w2"))
        h = swiglu_fp32(bf16(act_input(s1, tok) @ w1.T), bf16(act_input(s3, tok) @ w3.T), ctx.cfg.swiglu_limit)
        h = bf16(h * weights[pairs, None])
        per_slot[pairs] = bf16(act(h, s2) @ w2.T)
    return per_slot.view(S, k, -1).sum(1)
