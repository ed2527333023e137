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

import functools
from typing import Callable

import torch

from optimized import numerics
from optimized.base_ops import FEW_PAIRS, PairLayout, joined_products, keep_expert_bf16_copies, nvfp4_operand, \
    nvfp4_operand_made, prepare_nvfp4_forms, swiglu_fp32
from optimized.numerics import Nvfp4Operand, bf16
from optimized.ops import OpContext, Routing
from optimized.patching import Patch
from reference.graphs import replay
from reference.quant import FP4_MAX, QuantizedTensor, blocks_last, round_to_e2m1, round_to_e4m3

PATCH = Patch(
    "nvfp4-experts",
    phases=("prefill", "decode"),
    description="routed experts as NVFP4 (e2m1 + e4m3/16 + fp32 global) with W4A4 activation quantization",
    defaults={"activations": "w4a4", "input_scale": "checkpoint", "global_scale": "modelopt"},
    choices={"activations": ("w4a4", "w4a16"), "input_scale": ("checkpoint", float),
             "global_scale": ("modelopt", "pow2")},
    spec="optimized-stack §6 (O5)",
    decode_together=True,  # its decode ops compute each query alone (Patch.decode_together)
)


def nvfp4_activation(x: torch.Tensor, input_scale: float) -> torch.Tensor:
    """Quantize to NVFP4 and back: per-16 e4m3 block scales relative to the global input_scale (~40 element-wise
    kernels: a decode step's few rows replay them from a CUDA graph, reference.graphs.replay)."""
    return replay(_nvfp4_activation, x, input_scale=input_scale)


def _nvfp4_activation(x: torch.Tensor, input_scale: float) -> torch.Tensor:
    """Computed over x viewed as [..., blocks, 16]: each block's scale is broadcast over its 16 elements instead of
    repeated into an element-sized copy, and the scale's own steps run per block — the same fp32 operations on the
    same operands per element, so the same bits (a prefill chunk's pair rows: several fewer element-sized passes)."""
    n = x.shape[-1]
    xb = blocks_last(x.float(), 16)  # a partial last block is padded with zeros, which change no block's maximum
    block = round_to_e4m3(xb.abs().amax(-1, keepdim=True) / FP4_MAX / input_scale)
    scale = block * input_scale
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    out = torch.where(scale > 0, round_to_e2m1(xb / safe) * scale, torch.zeros_like(xb))
    return out.flatten(-2)[..., :n].contiguous()  # a partial last block's padding sliced off: contiguous again


def _input_scale(ctx: OpContext, name: str) -> float | None:
    """The stored input_scale of an expert weight (None when the checkpoint has none)."""
    stored = ctx.weights.stored(name)
    if not isinstance(stored, QuantizedTensor):
        raise ValueError(f"expert weight '{name}' is not quantized; nvfp4-experts needs FP4 or NVFP4 storage")
    return None if stored.input_scale is None else float(stored.input_scale)


def _nvfp4_format(ctx: OpContext) -> str:
    """load_weight's format for the patch's global-scale option."""
    return "nvfp4" if ctx.options["global_scale"] == "modelopt" else "nvfp4-pow2"


def _nvfp4_weight(ctx: OpContext, name: str) -> torch.Tensor:
    """Dense fp32 value of the NVFP4 form of an expert weight (through the load_weight op)."""
    return ctx.call("load_weight", name=name, fmt=_nvfp4_format(ctx))


def _act_rows(act, x: torch.Tensor, scales: list[float | None], spans: list[slice]) -> torch.Tensor:
    """act(x[span_e], scales[e]) for every expert e, over all rows at once where the experts share a scale (the
    quantizer works within a row, with the scale as the same Python number, so the bits are those of one call per
    expert), else one call per distinct scale over that scale's rows."""
    distinct = list(dict.fromkeys(scales))
    if len(distinct) == 1:
        return act(x, distinct[0])
    out = torch.empty_like(x, dtype=torch.float32)
    for scale in distinct:
        idx = torch.cat([torch.arange(r.start, r.stop, device=x.device) for r, s in zip(spans, scales) if s == scale])
        out[idx] = act(x[idx], scale).float()
    return out


def _tensor_core_operands(ctx: OpContext, names: list[str]) -> list[Nvfp4Operand | Callable[[], Nvfp4Operand]] | None:
    """The tensor-core operands of `names`' NVFP4 forms — what numerics.scaled_bf16_products needs to put the products
    on tensor cores: each the fp32 copy and its factor, or the form, that the dense cache keeps (base_ops.nvfp4_operand),
    else a callable that makes it when its GEMM runs (base_ops.nvfp4_operand_made: the form load_weight gives). None
    when load_weight is patched: its forms may be anything, so the products stay fp32 GEMMs of them."""
    if ctx.table.patched("load_weight"):
        return None
    fmt = _nvfp4_format(ctx)
    return [nvfp4_operand(ctx, name, fmt) or functools.partial(nvfp4_operand_made, ctx, name, fmt) for name in names]


@PATCH.op("experts")
def experts(ctx: OpContext, y: torch.Tensor, routing: Routing) -> torch.Tensor:
    """The pairs are laid out expert by expert once (PairLayout, as the stock experts op does), so the quantizers,
    SwiGLU and the routing weight run once over all pairs instead of once per expert; each expert's GEMMs read and
    write its own contiguous rows, the shapes the per-expert loop gave them: the same bits, fewer kernel launches."""
    mode, opt_scale = ctx.options["activations"], ctx.options["input_scale"]

    def scale_of(stored_scale: float | None) -> float | None:
        """The global input_scale the activations are quantized with (None under w4a16: bf16 activations)."""
        if mode == "w4a16":
            return None
        return (stored_scale if stored_scale is not None else 1.0) if opt_scale == "checkpoint" else float(opt_scale)

    def act(x: torch.Tensor, scale: float | None) -> torch.Tensor:
        return bf16(x) if scale is None else nvfp4_activation(x, scale)

    layout = PairLayout.of(routing.expert_ids)
    tokens = layout.tokens
    names = {e: [f"ffn.experts.{e}.{p}.weight" for p in ("w1", "w3", "w2")] for e, _ in layout.spans}
    scales = {e: [scale_of(_input_scale(ctx, n)) for n in names[e]] for e in names}
    prepare_nvfp4_forms(ctx, [n for e in names for n in names[e]], _nvfp4_format(ctx))  # factors, or forms in groups
    # weights are loaded inside the GEMM loops, one at a time: the NVFP4 forms the dense cache does not hold are
    # derived from its fp32 copies or converted on use, and a whole layer's at once is 25.8 GB
    # the routed input is quantized per token, independent of the expert: once per input scale, and gathered into
    # pair rows once (for w1 and w3 together) when every expert shares that scale — each expert's GEMM then reads a
    # slice of them, and the stock experts op's working set is not exceeded
    quantized: dict[float | None, torch.Tensor] = {}
    pair_rows: dict[float | None, torch.Tensor] = {}

    def rows_of(scale: float | None) -> torch.Tensor:
        if scale not in quantized:
            quantized[scale] = act(y, scale)
        return quantized[scale]

    if layout.order.numel() > FEW_PAIRS and numerics.on_tensor_cores(y):  # a prefill chunk on a GPU
        out = _on_tensor_cores(ctx, y, routing, layout, names, scales, act)
        if out is not None:
            return out
    gate_up = []
    for which in (0, 1):  # w1, w3
        distinct = {scales[e][which] for e in names}
        if len(distinct) == 1:
            (scale,) = distinct
            if scale not in pair_rows:
                pair_rows[scale] = rows_of(scale)[tokens]

        def product(e: int, rows: slice) -> torch.Tensor:  # called within this pass: `which` is this pass's
            scale = scales[e][which]
            x = pair_rows[scale][rows] if len(distinct) == 1 else rows_of(scale)[tokens[rows]]
            return x @ _nvfp4_weight(ctx, names[e][which]).T

        gate_up.append(joined_products(layout, product, ctx.cfg.moe_intermediate_size, y.device))
    pair_rows.clear()  # free the gathered inputs before the W2 GEMMs
    quantized.clear()
    h = bf16(swiglu_fp32(bf16(gate_up[0]), bf16(gate_up[1]), ctx.cfg.swiglu_limit)
             * routing.weights.flatten()[layout.order, None])
    h = _act_rows(act, h, [scales[e][2] for e, _ in layout.spans], [rows for _, rows in layout.spans])
    out = joined_products(layout, lambda e, rows: h[rows] @ _nvfp4_weight(ctx, names[e][2]).T, y.shape[-1], y.device)
    return layout.sum_slots(out, routing.expert_ids.shape[0])


def _on_tensor_cores(ctx: OpContext, y: torch.Tensor, routing: Routing, layout: PairLayout,
                     names: dict[int, list[str]], scales: dict[int, list[float | None]], act) -> torch.Tensor | None:
    """The experts op over a prefill chunk with its GEMMs on bf16 tensor cores (numerics.scaled_bf16_products: the
    NVFP4 operands' exact block products, one fp32 alpha per expert) — from what the dense cache keeps, or made on
    use, the same bits (_tensor_core_operands); None when load_weight is patched. The same quantizers, SwiGLU,
    routing weight and roundings as the fp32 path, over the same pair rows; only the GEMMs' fp32 rounding differs."""
    experts_in_order = [e for e, _ in layout.spans]
    spans = [rows for _, rows in layout.spans]
    for matrix in ("w1", "w3", "w2"):  # the block products from bf16 copies where the cache keeps them (half the reads)
        keep_expert_bf16_copies(ctx, matrix)
    operands = [_tensor_core_operands(ctx, [names[e][m] for e in experts_in_order]) for m in range(3)]
    if any(o is None for o in operands):
        return None

    def products(x: torch.Tensor, m: int) -> torch.Tensor:
        x_scales = [1.0 if scales[e][m] is None else scales[e][m] for e in experts_in_order]
        return numerics.scaled_bf16_products(x, operands[m], spans, x_scales)

    def quantized_pairs(m: int) -> torch.Tensor:
        """The pair rows of matrix m's input: quantized per token once and gathered (the quantizer works within a
        row), as the fp32 path does, when every expert shares m's input scale; else per expert's scale."""
        m_scales = [scales[e][m] for e in experts_in_order]
        if len(set(m_scales)) == 1:
            return act(y, m_scales[0])[layout.tokens]
        return _act_rows(act, y[layout.tokens], m_scales, spans)

    x = quantized_pairs(0)
    g = products(x, 0)
    if [scales[e][1] for e in experts_in_order] != [scales[e][0] for e in experts_in_order]:
        x = quantized_pairs(1)
    u = products(x, 1)
    del x
    h = bf16(swiglu_fp32(bf16(g), bf16(u), ctx.cfg.swiglu_limit) * routing.weights.flatten()[layout.order, None])
    h = _act_rows(act, h, [scales[e][2] for e in experts_in_order], spans)
    return layout.sum_slots(products(h, 2), routing.expert_ids.shape[0])
