"""The stock low-precision engine's op implementations (spec §7.1, optimized-stack §0.1).

This is the deployed path before the mission's patches: bf16 activations and residual streams, FP8
linears with 1×128 activation quantization, FP4 experts, FP8 paged KV (nope) with bf16 rope dims,
FP8 indexer keys with per-row scales, fp32 logits/softmax statistics with bf16 probabilities for P·V.
Each function's docstring names the deployed numerics it emulates.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from optimized import numerics
from optimized.numerics import Nvfp4Operand, bf16, bf16_linear, constant, exact_matmul, exact_product, \
    fp8_activation, fp8_linear, fp32_linear, rms_norm_bf16, tensor_core_queries
from optimized.ops import OpContext, Routing
from optimized.kernels import resolve_impl
from optimized.paged_cache import IndexKeyCache, quantize_fp8_per_row
from reference.graphs import replay
from reference.quant import QuantizedTensor, mx32_to_nvfp4, mx32_to_nvfp4_forms, nvfp4_factors_from_mx
from reference.layer import share_rows
from reference.ops.attention import KeySet
from reference.ops.compressor import pool_new_windows, visible_rows
from reference.ops.mhc import SINKHORN_GRAPH_ELEMENTS, HCMix, sinkhorn
from reference.ops.moe import expert_groups
from reference.ops.rope import apply_rope, cos_sin

LINEAR_PRECISION = {
    "attn.wq_a": "fp8", "attn.wq_b": "fp8", "attn.wkv": "fp8", "attn.wo_b": "fp8", "attn.indexer.wq_b": "fp8",
    "ffn.shared_experts.w1": "fp8", "ffn.shared_experts.w3": "fp8", "ffn.shared_experts.w2": "fp8",
    "attn.wo_a": "bf16", "attn.indexer.weights_proj": "bf16",
    "attn.compressor.wkv": "fp32", "attn.compressor.wgate": "fp32",
    "attn.indexer.compressor.wkv": "fp32", "attn.indexer.compressor.wgate": "fp32", "ffn.gate": "fp32",
}
"""Base precision per linear site (spec §7.1): FP8 GEMMs, plain bf16 (wo_a on dequantized weights,
indexer weights_proj), fp32 (compressor projections and router)."""


def linear(ctx: OpContext, x: torch.Tensor, site: str) -> torch.Tensor:
    precision = LINEAR_PRECISION.get(site)
    if precision is None:
        raise KeyError(f"unknown linear site '{site}'")
    if site == "attn.wo_a":  # grouped: x [S, G, (H/G)·d], wo_a viewed [G, R_o, (H/G)·d] (spec §4.6)
        w = rounded_weight(ctx, site + ".weight")
        return bf16(grouped_bf16_product(bf16(x), w.unflatten(0, (ctx.cfg.o_groups, -1))))
    if precision == "bf16":
        return bf16_linear(x, rounded_weight(ctx, site + ".weight"), weight_rounded=True)
    w = ctx.weight(site + ".weight")
    if precision == "fp8":
        return fp8_linear(x, w, lambda: ctx.dense.bf16_exact(site + ".weight", w))
    return fp32_product(ctx, x.float(), w)


def rounded_weight(ctx: OpContext, name: str, rounding: Callable[[torch.Tensor], torch.Tensor] = bf16,
                   label: str = "bf16") -> torch.Tensor:
    """ctx.weight(name) rounded as a low-precision GEMM reads it (bf16 by default; `label` names another rounding,
    one label per rounding function), made once per layer instead of at every call (a Flash attn.wo_a is 33 M
    values: ~0.4 GB of traffic and two launches per decode step): the weight itself when every value is a bf16
    already and the rounding is bf16 (FP8 and bf16 checkpoint tensors: DenseCache.bf16_exact, which on the CPU
    scans the weight once per layer; rounding a bf16 value changes no bit), else its rounded copy kept in the
    layer's dense cache while there is room. A weight other than the cached one (a patch's load_weight) is rounded at
    every call, as it may change between calls."""
    w = ctx.weight(name)
    if label == "bf16" and ctx.dense.bf16_exact(name, w):
        return w
    if ctx.dense.holds(name, w):
        return ctx.dense.get(f"{name}#rounded:{label}", lambda: rounding(w), ctx.device)
    return rounding(w)


def grouped_bf16_product(x: torch.Tensor, wg: torch.Tensor) -> torch.Tensor:
    """x [S, G, I] by wg [G, R, I] (bf16 values both) -> [S, G, R] in fp32: each group's rows times its own matrix.
    On a GPU over many rows each group's product runs on tensor cores (numerics.exact_product), else one einsum."""
    if numerics.on_tensor_cores(x[:, 0]):
        return torch.stack([exact_product(x[:, g], wg[g]) for g in range(wg.shape[0])], 1)
    return torch.einsum("sgi,gri->sgr", x, wg)


def reassociated(ctx: OpContext) -> bool:
    """The benign twin (engine option `reassociate`): fp32 sums in a different order, the same precision."""
    return bool(ctx.engine_options.get("reassociate"))


def fp32_product(ctx: OpContext, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ wᵀ in fp32 (optimized.numerics.fp32_linear); the twin sums the two halves of K separately and adds them,
    so every output is the same sum in another order: its difference is fp32 re-association noise alone."""
    if not reassociated(ctx):
        return fp32_linear(x, w)
    half = x.shape[-1] // 2
    return x[..., :half] @ w[:, :half].T + x[..., half:] @ w[:, half:].T


def hc_prelinear(ctx: OpContext, streams: torch.Tensor, site: str) -> torch.Tensor:
    """fp32 SIMT GEMM on the bf16 streams: m = (x̂ · fnᵀ) · rsqrt(mean(x̂²) + eps) (optimized-stack §4.1 Ref)."""
    flat = streams.float().flatten(-2)
    rho = torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + ctx.cfg.rms_norm_eps)
    return fp32_product(ctx, flat, ctx.weight(f"hc_{site}_fn")) * rho


def hc_pre(ctx: OpContext, streams: torch.Tensor, site: str) -> tuple[torch.Tensor, HCMix]:
    """HC math in fp32 (sigmoid, Sinkhorn, weighted sum of the bf16 streams); a stored as bf16."""
    cfg = ctx.cfg
    m = ctx.call("hc_prelinear", streams=streams, site=site)
    a, pre, post, comb = replay(hc_mix, m, streams, ctx.weight(f"hc_{site}_base"), ctx.weight(f"hc_{site}_scale"),
                                n=cfg.hc_mult, iters=cfg.hc_sinkhorn_iters, eps=cfg.hc_eps)  # a graph in decode
    return a, HCMix(pre, post, comb)


def hc_mix(m: torch.Tensor, streams: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int,
           eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """From the mixes m: pre = σ(·) + eps, post = 2σ(·), comb = Sinkhorn(·), and a = bf16(Σ pre·X)."""
    pre = torch.sigmoid(m[..., :n] * scale[0] + base[:n]) + eps
    post = 2 * torch.sigmoid(m[..., n : 2 * n] * scale[1] + base[n : 2 * n])
    # a graph of its own when hc_mix runs eagerly (a prefill chunk: the streams are too large for hc_mix's graph)
    comb = replay(sinkhorn, (m[..., 2 * n :] * scale[2] + base[2 * n :]).unflatten(-1, (n, n)), iters=iters, eps=eps,
                  max_elements=SINKHORN_GRAPH_ELEMENTS)
    a = bf16((pre.unsqueeze(-1) * streams.float()).sum(-2))
    return a, pre, post, comb


def hc_post(ctx: OpContext, f: torch.Tensor, streams: torch.Tensor, mix: HCMix) -> torch.Tensor:
    """X' = post·f + Cᵀ·X in fp32, stored bf16 (the residual streams are bf16 between sub-layers)."""
    mixed = mix.comb.transpose(-1, -2) @ streams.float()  # Cᵀ X
    return (mix.post.unsqueeze(-1) * f.float().unsqueeze(-2) + mixed).to(torch.bfloat16)


def compressor(ctx: OpContext, which: str, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """fp32 projections and pooling (official Compressor), the pooled row cast to bf16 before its norm;
    norm and RoPE write bf16."""
    prefix = "attn.compressor" if which == "main" else "attn.indexer.compressor"
    state = ctx.state.compressor if which == "main" else ctx.state.indexer_compressor
    kv = ctx.call("linear", x=x, site=f"{prefix}.wkv").float()
    gate = ctx.call("linear", x=x, site=f"{prefix}.wgate").float() + ctx.weight(f"{prefix}.ape")[positions % state.ratio]
    first = state.n_rows
    pooled = bf16(pool_new_windows(state, kv, gate, positions))
    if pooled.shape[0] == 0:  # no window completed (3 decode steps in 4 of CSA): no row to normalise and rotate
        return pooled
    rows = rms_norm_bf16(pooled, ctx.weight(f"{prefix}.norm.weight"), ctx.cfg.rms_norm_eps)
    ids = torch.arange(first, first + rows.shape[0], device=rows.device)
    cos, sin = cos_sin(ctx.state.inv_freq, ids * state.ratio, torch.float32)
    rows = bf16(apply_rope(rows, cos, sin))
    state.rows = torch.cat([state.rows, rows], 0)
    return rows


NVFP4_FORMATS = {"nvfp4": "modelopt", "nvfp4-pow2": "pow2"}
"""load_weight's NVFP4 formats and the global-scale rule of each (reference.quant.NVFP4_GLOBAL_RULES)."""


def _nvfp4_key(name: str, fmt: str) -> str:
    """The dense cache's name for a weight's NVFP4 form (load_weight and prepare_nvfp4_forms must agree on it)."""
    return f"{name}#{fmt}"


def _nvfp4_global_key(name: str, fmt: str) -> str:
    """The dense cache's name for the fp32 global scale of a weight's NVFP4 form (a 0-dim tensor on the device)."""
    return f"{name}#{fmt}#global"


def _nvfp4_factor_key(name: str, fmt: str) -> str:
    """The dense cache's name for the fp32 factor c that makes a weight's NVFP4 block products from its cached fp32
    copy (reference.quant.nvfp4_factors_from_mx; a 0-dim tensor on the host: kernels take it as a scalar argument)."""
    return f"{name}#{fmt}#factor"


def nvfp4_operand(ctx: OpContext, name: str, fmt: str) -> Nvfp4Operand | None:
    """The tensor-core operand of `name`'s NVFP4 form from what the layer's dense cache keeps — the fp32 copy and its
    factor (prepare_nvfp4_forms), the fp32 copy of a checkpoint's own NVFP4 weight (which is its form: the same
    dequantization), else the form load_weight converted — with its global scale, without converting or dequantizing
    anything; None when the cache keeps none of them (nvfp4_operand_made then makes the operand on use)."""
    factor, global_key = _nvfp4_factor_key(name, fmt), _nvfp4_global_key(name, fmt)
    if global_key not in ctx.dense:
        return None
    g = ctx.dense.get(global_key, None, ctx.device)
    if name in ctx.dense:
        if factor in ctx.dense:
            return Nvfp4Operand(ctx.dense.get(name, None, ctx.device), ctx.dense.get(factor, None, ctx.device), g,
                                ctx.dense.bf16_copy(name))
        if _stored_as_nvfp4(ctx, name):
            return Nvfp4Operand(ctx.dense.get(name, None, ctx.device), None, g)
    if _nvfp4_key(name, fmt) in ctx.dense:
        return Nvfp4Operand(ctx.dense.get(_nvfp4_key(name, fmt), None, ctx.device), None, g)
    return None


def _stored_as_nvfp4(ctx: OpContext, name: str) -> bool:
    """Whether `name` is stored as NVFP4 (a ModelOpt checkpoint's expert): its fp32 copy is then its NVFP4 form."""
    stored = ctx.weights.stored(name)
    return isinstance(stored, QuantizedTensor) and stored.format == "nvfp4"


def nvfp4_operand_made(ctx: OpContext, name: str, fmt: str) -> Nvfp4Operand:
    """The tensor-core operand of `name`'s NVFP4 form when nvfp4_operand finds none kept: the form load_weight gives
    (kept while the cache has room, else made for this use only) and its global scale, which load_weight keeps on its
    miss. The same block products as a kept operand's (numerics.scaled_bf16_products), so a GEMM takes the tensor-core
    path whatever the cache kept: its bits do not follow admission, which the host lanes need
    (harness.run.host_lanes)."""
    form = load_weight(ctx, name, fmt)
    global_key = _nvfp4_global_key(name, fmt)
    if global_key not in ctx.dense:  # load_weight keeps it with every form it gives
        raise RuntimeError(f"{name}: load_weight gave its {fmt} form without keeping the form's global scale")
    return Nvfp4Operand(form, None, ctx.dense.get(global_key, None, ctx.device))


def _keep_global_scale(ctx: OpContext, name: str, fmt: str, global_scale: torch.Tensor) -> None:
    """Keep the fp32 global scale of `name`'s NVFP4 form beside it (4 bytes: put without asking for room), unless it
    is kept already."""
    key = _nvfp4_global_key(name, fmt)
    if key not in ctx.dense:
        ctx.dense.put(key, global_scale.reshape(()).float().to(ctx.device))


def _derived_nvfp4_form(ctx: OpContext, name: str, fmt: str) -> torch.Tensor | None:
    """fl(fl(mx·c)·g) — the NVFP4 form's bits (reference.quant.nvfp4_factors_from_mx) — from the cached fp32 copy mx
    of `name` and its kept factor c and global scale g: one pass over the copy instead of a conversion from the codes
    (~70 launches and three host reads); None when they are not kept."""
    operand = nvfp4_operand(ctx, name, fmt)
    if operand is None or operand.factor is None:
        return None
    return (operand.source * operand.factor).mul_(operand.global_scale)


def load_weight(ctx: OpContext, name: str, fmt: str) -> torch.Tensor:
    """Exact fp32 dequantization of the stored tensor (cached for the layer); 'nvfp4' / 'nvfp4-pow2' give the NVFP4
    form of an FP4 expert weight (the checkpoint's own when it is stored as NVFP4), reference.quant.mx32_to_nvfp4:
    derived from the weight's cached fp32 copy when prepare_nvfp4_forms kept its factors, the same bits."""
    stored = ctx.weights.stored(name)
    if fmt == "stored":
        return ctx.dense.get(name, stored, ctx.device)
    if fmt not in NVFP4_FORMATS:
        raise ValueError(f"load_weight: unknown format {fmt!r} for '{name}' (stored, nvfp4 or nvfp4-pow2)")
    if not isinstance(stored, QuantizedTensor) or stored.format not in ("fp4_mx32", "nvfp4"):
        raise ValueError(f"'{name}' is not an FP4 or NVFP4 weight; it has no NVFP4 form")
    if stored.format == "nvfp4":  # the checkpoint's own form: its fp32 copy, the same dequantization, serves as both
        _keep_global_scale(ctx, name, fmt, stored.global_scale)
        return ctx.dense.get(name, stored, ctx.device)
    rule = NVFP4_FORMATS[fmt]

    def as_nvfp4() -> torch.Tensor | QuantizedTensor:  # on a miss only; its global scale kept beside the form
        derived = _derived_nvfp4_form(ctx, name, fmt)
        if derived is not None:
            return derived
        q = mx32_to_nvfp4(stored, rule, name)
        _keep_global_scale(ctx, name, fmt, q.global_scale)
        return q
    return ctx.dense.get(_nvfp4_key(name, fmt), as_nvfp4, ctx.device)


NVFP4_GROUP = 8
"""FP4 expert matrices converted to their NVFP4 form from their codes together (prepare_nvfp4_forms, when the cache
does not hold their fp32 copies): at Flash width a group's temporaries are at most 5 fp32 copies of its matrices
(e2m1 values, |values|, expanded block scales, the product, the dense forms: harness.run.memory counts them),
8 × 2048 × 4096 × 4 B × 5 = 1.3 GB (two ranks sharing an H200 have a few GB to spare), and a layer's 768 take 96
groups instead of 768 conversions of ~70 launches and three host reads each."""

NVFP4_FACTOR_GROUP = 128
"""FP4 expert matrices whose NVFP4 factors are found together from their cached fp32 copies (prepare_nvfp4_forms:
one host read per group). The temporaries are their block maxima and block exponents, a few 1/32 copies: at Flash
width 128 × 2048 × 128 × 4 B = 128 MB each, and a layer's 768 matrices take 6 host reads."""


def prepare_nvfp4_forms(ctx: OpContext, names: list[str], fmt: str) -> None:
    """Make the NVFP4 forms of `names` cheap for load_weight(name, fmt) and the tensor-core path (nvfp4_operand), a
    layer's 768 Flash expert matrices at once instead of a conversion from the codes on each use:

    - FP4-stored names whose fp32 copies the layer's dense cache holds: their factors and global scales are kept (two
      numbers per matrix, NVFP4_FACTOR_GROUP at a time): load_weight derives each form from the copy on use, and the
      tensor-core path reads the block products from the copy — no second fp32 copy of every expert is needed, so a
      GPU whose cache holds the layer's copies but not a second copy of its experts (an H100's) converts no form
      from its codes;
    - other FP4-stored names: converted from their codes in groups of NVFP4_GROUP (reference.quant.
      mx32_to_nvfp4_forms) into the cache, while the cache has room for a whole group; what does not fit is
      converted on use, as before;
    - NVFP4-stored names (a checkpoint's own forms): their global scales are kept; the form is the weight's fp32 copy
      (load_weight), which the cache holds like any other weight's — not a second copy of it.

    The same bits every way. Only names without a kept form or factor are handled. Nothing is prepared when a patch
    overrides load_weight in this phase (it may never ask the stock op for these forms), and a tensor that cannot be
    converted (scales spanning too many binades) is left to its use, which raises for it: alone among copies
    (_keep_nvfp4_factors), with its group of NVFP4_GROUP among codes."""
    if fmt not in NVFP4_FORMATS:
        raise ValueError(f"prepare_nvfp4_forms: unknown format {fmt!r} (nvfp4 or nvfp4-pow2)")
    if ctx.table.patched("load_weight"):
        return
    rule = NVFP4_FORMATS[fmt]
    todo: dict[tuple, list[str]] = {}  # by shape (w1/w3 and w2 differ) and device: a group is one stack
    derivable: dict[tuple, list[str]] = {}
    checkpoint_forms: list[str] = []  # NVFP4-stored without a kept global scale
    for name in dict.fromkeys(names):
        stored = ctx.weights.stored(name)
        if _nvfp4_key(name, fmt) in ctx.dense or _nvfp4_factor_key(name, fmt) in ctx.dense \
                or not isinstance(stored, QuantizedTensor):
            continue
        if stored.format == "fp4_mx32":
            (derivable if name in ctx.dense else todo).setdefault((stored.shape, stored.device), []).append(name)
        elif stored.format == "nvfp4" and _nvfp4_global_key(name, fmt) not in ctx.dense:
            checkpoint_forms.append(name)  # the form is its fp32 copy (load_weight): only its global is kept
    if checkpoint_forms:  # one copy to the device for the layer's global scales, not one per matrix
        global_scales = torch.stack([ctx.weights.stored(n).global_scale.reshape(()).float()
                                     for n in checkpoint_forms]).to(ctx.device)
        for name, global_scale in zip(checkpoint_forms, global_scales):
            _keep_global_scale(ctx, name, fmt, global_scale)
    for key, same in derivable.items():
        for i in range(0, len(same), NVFP4_FACTOR_GROUP):
            todo.setdefault(key, []).extend(_keep_nvfp4_factors(ctx, same[i:i + NVFP4_FACTOR_GROUP], fmt))
    for (shape, _), same in todo.items():
        for i in range(0, len(same), NVFP4_GROUP):
            group = same[i:i + NVFP4_GROUP]
            if not ctx.dense.room_for(len(group) * shape[0] * shape[1] * 4):
                break  # a smaller group of the other shape may still fit
            qs = [ctx.weights.stored(n) for n in group]
            try:
                dense, global_scales = mx32_to_nvfp4_forms(qs, rule, group)
            except ValueError:
                continue
            global_scales = global_scales.float().to(ctx.device)  # one copy for the group
            for name, value, global_scale in zip(group, dense.to(ctx.device), global_scales):
                _keep_global_scale(ctx, name, fmt, global_scale)  # first: a kept form is read with its global
                ctx.dense.put(_nvfp4_key(name, fmt), value)


def _keep_nvfp4_factors(ctx: OpContext, group: list[str], fmt: str) -> list[str]:
    """Keep the factor and global scale of each of `group` (FP4 names of one shape whose fp32 copies the dense cache
    holds), found with one host read; return the names whose forms must come from their codes instead (a factor past
    fp32's range: values below ~2^-119). A group holding a tensor with no lossless NVFP4 form (the pow2 rule's scales
    spanning more than 17 binades) is found again tensor by tensor, so that only that tensor is left to its use,
    which raises for it."""
    qs = [ctx.weights.stored(n) for n in group]
    try:
        c, global_scales, derivable = nvfp4_factors_from_mx([ctx.dense.get(n, q, ctx.device) for n, q in
                                                             zip(group, qs)], qs, NVFP4_FORMATS[fmt], group)
    except ValueError:
        return [] if len(group) == 1 else [n for one in group for n in _keep_nvfp4_factors(ctx, [one], fmt)]
    global_scales = global_scales.float().to(ctx.device)  # one copy for the group; c stays on the host (Nvfp4Operand)
    from_codes = []
    for name, factor, global_scale, kept in zip(group, c, global_scales, derivable.tolist()):
        if kept:  # the global scale first: a form counts as derivable once its factor is kept
            _keep_global_scale(ctx, name, fmt, global_scale)
            ctx.dense.put(_nvfp4_factor_key(name, fmt), factor)
        else:
            from_codes.append(name)
    return from_codes


def kv_store(ctx: OpContext, cache: str, rows: torch.Tensor) -> None:
    ctx.state.cache(cache).append(rows)


def kv_load(ctx: OpContext, cache: str, slots: torch.Tensor) -> torch.Tensor:
    """Dequantized rows: FP8 nope · 2^(u−127) → bf16 (exact), rope dims as stored bf16."""
    return ctx.state.cache(cache).load(slots).float()


def quantize_indexer_q(q: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 q with one fp32 scale per (row, head), the scale folded into the head weights
    (sglang's fused q kernel + DeepGEMM convention, optimized-stack §3.1)."""
    codes, scale = quantize_fp8_per_row(q)
    return codes, weights * scale


def indexer_logits(ctx: OpContext, q: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """DeepGEMM fp8_paged_mqa_logits semantics: Σ_h w'_h·ReLU(q8_h·k8)·k_scale with exact fp32 accumulation
    of FP8 products; rows not yet visible get −inf. A prefill block on a GPU runs it as one fused kernel
    (paged_logits_apply); elsewhere as the torch steps below."""
    keys = ctx.state.index_keys
    q8, w = quantize_indexer_q(q, weights)
    if paged_logits_apply(ctx, q, keys):
        from optimized.kernels.indexer_logits_triton import fp8_paged_mqa_logits_triton
        context = visible_rows(positions, ctx.state.ratio).to(torch.int32)
        return fp8_paged_mqa_logits_triton(q8, w, keys.codes, keys.scale, keys.page_table, context, keys.length,
                                           "tf32", float("-inf"))
    if keys.fp4:
        k, k_scale = keys.dense(), torch.ones(keys.length, device=q.device)
    else:
        k, k_scale = keys.shared_dense_codes()  # read only
    # FP8 (or FP4) codes both: exact products, on tensor cores for a prefill block (DeepGEMM's FP8 MMA likewise)
    dots = exact_matmul(q8.float(), k.T, tensor_core_queries(q))
    weighted = w.unsqueeze(-1) * torch.relu(dots)  # [B, heads, R]: the fp32 weighted head-sum (optimized-stack §3.1)
    if reassociated(ctx):
        half = weighted.shape[1] // 2
        summed = weighted[:, :half].sum(1) + weighted[:, half:].sum(1)
    else:
        summed = weighted.sum(1)
    logits = summed * k_scale[None, :]
    hidden = torch.arange(keys.length, device=q.device)[None, :] >= visible_rows(positions, ctx.state.ratio)[:, None]
    return logits.masked_fill(hidden, float("-inf"))


def paged_logits_apply(ctx: OpContext, q: torch.Tensor, keys: IndexKeyCache) -> bool:
    """Whether the stock indexer's logits for queries `q` run as the FP8 paged logits kernel
    (optimized.kernels.indexer_logits_triton at dot precision "tf32": e4m3 codes are exact in tf32, so its
    per-head dots are the same exact products summed in fp32, the head sum and the key scale in the recipe's order —
    DeepGEMM's semantics, which the torch steps emulate; only the fp32 accumulation order differs, as it already did
    between the CPU's fp32 GEMM and the GPU's tensor cores): TENSOR_CORE_MIN_ROWS queries or more on a GPU
    (tensor_core_queries: a prefill block, or decode steps computed together) with FP8 keys, not the benign twin
    (whose head sum is split in two), and Triton picked for the device (optimized.kernels.resolve_impl, so
    DSV4_DRIFT_KERNEL_IMPL=torch keeps the torch steps).

    Why: the torch steps write the [queries, heads, rows] fp32 dots and pass over them three times more (ReLU, the
    head weights, the head sum) — 0.29 s of device time per Flash CSA layer at 30,720 tokens over the four engine
    runs of base and all (the forty-second session's H100 profile, bench/results/flash-30k-layer-2-h100-2026-12-07-
    kernel-lines.txt: 0.237 s on the ReLU and head weights' line, 0.056 s on the head sum's) — where
    the kernel reads the FP8 codes and writes only the [queries, rows] logits. A single decode step's query keeps
    the torch steps: its products are microseconds either way."""
    return tensor_core_queries(q) and not keys.fp4 and not reassociated(ctx) \
        and resolve_impl("auto", q.device) == "triton"


def indexer_topk(ctx: OpContext, logits: torch.Tensor, positions: torch.Tensor, k: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Unsorted torch.topk over min(k, rows) columns (neither the order nor the choice among ties is
    specified, as on the GPU; only the set is used), then re-masked by causal length."""
    k = min(k, logits.shape[-1])
    if k == logits.shape[-1]:  # every row fits: nothing to select
        row_ids = torch.arange(k, device=logits.device).expand(logits.shape[0], k)
    else:
        row_ids = torch.topk(logits, k, dim=-1, sorted=False).indices
    valid = row_ids < visible_rows(positions, ctx.state.ratio)[:, None]
    return row_ids, valid


def _valid_ranges(*slots: torch.Tensor) -> list[tuple[int, int] | None]:
    """Per slots tensor, its smallest and largest valid (≥ 0) slot, or None when none is valid (or it is empty): two
    reductions each, all read in one transfer. On a GPU each read waits for every queued kernel, and a prefill chunk
    asks for the window's and the compressed rows' ranges of every 256-query block: one read per block, not two."""
    stats = []
    for s in slots:
        if s.numel():
            hi = s.max()
            stats += [torch.where(s >= 0, s, hi).min(), hi]  # invalid slots count as the largest
    read = iter(torch.stack(stats).tolist() if stats else [])
    out: list[tuple[int, int] | None] = []
    for s in slots:
        lo, hi = (next(read), next(read)) if s.numel() else (-1, -1)
        out.append(None if hi < 0 else (int(lo), int(hi)))
    return out


def _slots_as_shared(ctx: OpContext, cache: str, slots: torch.Tensor, span: tuple[int, int] | None
                     ) -> tuple[KeySet, torch.Tensor]:
    """Rows for per-query slots [B, K] loaded once over their distinct range span = (lo, hi) and shared by the
    block, with a [B, hi−lo+1] mask of which query uses which row. Returns the key set and the row slots."""
    if span is None:
        empty = torch.zeros(0, ctx.cfg.head_dim, device=slots.device)
        return KeySet(empty, torch.zeros(slots.shape[0], 0, dtype=torch.bool, device=slots.device)), slots[:, :0]
    lo, hi = span
    row_slots = torch.arange(lo, hi + 1, device=slots.device)
    # column 0 collects the invalid slots (< 0 <= lo: slot − lo + 1 <= 0, clamped to 0) and is dropped
    mask = torch.zeros(slots.shape[0], hi - lo + 2, dtype=torch.bool, device=slots.device)
    mask.scatter_(1, (slots - (lo - 1)).clamp_(min=0), True)
    return KeySet(ctx.call("kv_load", cache=cache, slots=row_slots), mask[:, 1:]), row_slots


def candidate_key_sets(ctx: OpContext, window_slots: torch.Tensor, comp_slots: torch.Tensor) -> list[KeySet]:
    """The block's keys: window rows as one shared band; compressed rows shared too when the block uses most of
    a contiguous range (HCA: all complete blocks), else gathered per query (CSA: a top-k of many rows)."""
    window_span, span = _valid_ranges(window_slots, comp_slots)
    band, _ = _slots_as_shared(ctx, "window", window_slots, window_span)
    if comp_slots.shape[-1] == 0:
        return [band]
    n_rows = span[1] - span[0] + 1 if span else 0
    if share_rows(n_rows, comp_slots.shape[-1], ctx.cfg.num_attention_heads, ctx.device):
        return [band, _slots_as_shared(ctx, "compressed", comp_slots, span)[0]]
    return [band, KeySet(ctx.call("kv_load", cache="compressed", slots=comp_slots), comp_slots >= 0)]


def sparse_attention(ctx: OpContext, q: torch.Tensor, window_slots: torch.Tensor, comp_slots: torch.Tensor,
                     sink: torch.Tensor, comp_lanes: torch.Tensor | None = None,
                     comp_length: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA-style single pass over window + compressed rows: bf16 q·k with fp32 accumulation, fp32
    softmax statistics with the sink in the denominator, P cast to bf16 for P·V, bf16 output. (The stock kernel
    reads the masked comp_slots; comp_lanes/comp_length are what a kernel of its own would be given.)"""
    key_sets = candidate_key_sets(ctx, window_slots, comp_slots)
    qb = bf16(q)

    def dots(keys: torch.Tensor) -> torch.Tensor:  # the twin sums each q·k over two halves of d (fp32_product)
        if not reassociated(ctx):
            return qb @ keys.transpose(-1, -2)
        half = qb.shape[-1] // 2
        return (qb[..., :half] @ keys[..., :half].transpose(-1, -2)
                + qb[..., half:] @ keys[..., half:].transpose(-1, -2))

    def scores(ks: KeySet) -> torch.Tensor:
        d = dots(ks.keys)
        return torch.where(ks.valid[:, None, :], d, constant(float("-inf"), d.dtype, d.device))

    logits = torch.cat([scores(ks) for ks in key_sets], -1).mul_(ctx.cfg.head_dim**-0.5)
    m = torch.maximum(logits.amax(-1), sink[None, :])
    e = logits.sub_(m[..., None]).exp_()
    denom = e.sum(-1) + torch.exp(sink[None, :] - m)  # fp32 statistics
    p = bf16(e)  # P rounded to bf16 for the P·V MMA
    acc = torch.zeros_like(qb)
    for ks, part in zip(key_sets, p.split([ks.valid.shape[-1] for ks in key_sets], -1)):
        acc = acc + part @ ks.keys
    return bf16(acc / denom[..., None]), m + torch.log(denom)


def router(ctx: OpContext, y: torch.Tensor, token_ids: torch.Tensor) -> Routing:
    """fp32 router (official Gate): s = sqrt(softplus(y·Wᵀ)); hash ids or top-k(s + bias) with the GPU's
    torch.topk; weights s[ids]/Σ · routed_scaling_factor."""
    cfg = ctx.cfg
    scores = torch.sqrt(F.softplus(ctx.call("linear", x=y, site="ffn.gate").float()))
    if cfg.is_hash_layer(ctx.layer):
        expert_ids = ctx.weights.stored("ffn.gate.tid2eid").to(ctx.device)[token_ids]
    else:
        expert_ids = torch.topk(scores + ctx.weight("ffn.gate.bias"), cfg.num_experts_per_tok, dim=-1).indices
    w = scores.gather(-1, expert_ids)
    return Routing(scores, expert_ids, w / w.sum(-1, keepdim=True) * cfg.routed_scaling_factor)


def swiglu_fp32(g: torch.Tensor, u: torch.Tensor, limit: float) -> torch.Tensor:
    if limit > 0:
        g, u = torch.clamp(g, max=limit), torch.clamp(u, -limit, limit)
    return F.silu(g) * u


@dataclass(frozen=True)
class PairLayout:
    """The (token, slot) pairs of a routing laid out expert by expert: row i holds pair `order[i]` (token
    order[i] // k); `spans` gives each picked expert its contiguous rows, tokens ascending. Experts ops compute over
    these rows — each expert's GEMMs on its own slice, the element-wise steps between them once over all rows — and
    `sum_slots` puts the rows back in (token, slot) order and sums each token's slots in slot order."""

    order: torch.Tensor
    spans: list[tuple[int, slice]]
    k: int

    @classmethod
    def of(cls, expert_ids: torch.Tensor) -> "PairLayout":
        groups = expert_groups(expert_ids)
        order = torch.cat([pairs for _, _, pairs in groups]) if groups else expert_ids.flatten()[:0]
        spans, start = [], 0
        for e, tokens, _ in groups:
            spans.append((e, slice(start, start + tokens.numel())))
            start += tokens.numel()
        return cls(order, spans, expert_ids.shape[-1])

    @property
    def tokens(self) -> torch.Tensor:
        return self.order // self.k

    def per_slot(self, rows: torch.Tensor, n_tokens: int) -> torch.Tensor:
        """[pairs, D] rows (fp32) -> [tokens, k, D] in (token, slot) order, bf16 per pair (official)."""
        out = torch.empty(n_tokens * self.k, rows.shape[-1], dtype=torch.float32, device=rows.device)
        out[self.order] = bf16(rows)  # every pair is written once
        return out.view(n_tokens, self.k, -1)

    def sum_slots(self, rows: torch.Tensor, n_tokens: int) -> torch.Tensor:
        """[pairs, D] rows (fp32) -> [tokens, D]: bf16 per pair, summed over each token's slots in fp32."""
        return self.per_slot(rows, n_tokens).sum(1)


def experts(ctx: OpContext, y: torch.Tensor, routing: Routing) -> torch.Tensor:
    """The weighted sum of expert_pairs over each token's slots, in fp32."""
    return expert_pairs(ctx, y, routing).sum(1)


def expert_pairs(ctx: OpContext, y: torch.Tensor, routing: Routing) -> torch.Tensor:
    """Each routed pair's weighted output [S, k, D] in (token, slot) order, what `experts` sums (the engine's pair
    site reads them one by one): FP4 experts (e2m1, per-32 UE8M0) with FP8 1×128 activations, fp32 accumulation;
    SwiGLU and the routing weight in fp32, cast to bf16 before W2 (official), each pair's output rounded to bf16.

    The pairs are laid out expert by expert once (PairLayout), so each expert's GEMMs read and write contiguous
    row ranges and the element-wise steps between them (bf16 rounding, SwiGLU, routing weight, the FP8 quantizer,
    whose 1×128 blocks lie within a row) run once over all pairs instead of once per expert: the same operations
    on the same values, so the same bits, with a few hundred fewer kernel launches per prefill chunk."""
    return expert_pairs_at_limits(ctx, y, routing, (ctx.cfg.swiglu_limit,))[0]


def expert_pairs_at_limits(ctx: OpContext, y: torch.Tensor, routing: Routing, limits: Sequence[float]
                           ) -> list[torch.Tensor]:
    """expert_pairs with each SwiGLU clamp limit in `limits` (≤ 0: no clamp), in that order. The clamp acts after
    the gate and up GEMMs, so their products are made once for all the limits: each result has the bits of its own
    expert_pairs call with that limit (the same operations on the same values). The engine's clamp site reads the
    stock experts with and without the clamp; the gate and up GEMMs it no longer repeats are two of an experts call's
    three GEMMs of equal size (each pairs × hidden × intermediate), about two thirds of its work per prefill chunk."""
    layout = PairLayout.of(routing.expert_ids)
    x = fp8_activation(y)[layout.tokens]  # pair rows, expert by expert
    g = bf16(_per_expert(ctx, x, layout, "w1"))
    u = bf16(_per_expert(ctx, x, layout, "w3"))
    del x  # [pairs, hidden]: not held through the W2 GEMMs
    weights = routing.weights.flatten()[layout.order, None]
    hs = [fp8_activation(bf16(swiglu_fp32(g, u, limit) * weights)) for limit in limits]
    del g, u
    n_tokens, out = routing.expert_ids.shape[0], []
    while hs:  # each intermediate freed once its W2 product is made
        out.append(layout.per_slot(_per_expert(ctx, hs.pop(0), layout, "w2"), n_tokens))
    return out


def shared_expert(ctx: OpContext, y: torch.Tensor, routing: Routing) -> torch.Tensor:
    """The shared expert (spec §6.2: the same clamped SwiGLU as the routed ones, unweighted by the router) through
    the `linear` sites: SwiGLU in fp32 on the GEMMs' outputs, times routing.shared_weight, cast to bf16 before W2.
    Its own op because serving stacks run it apart from the routed experts (a dense MLP beside the fused MoE), and
    that path is where they have dropped the clamp (sgl-project/sglang PR #23776, vllm-project/vllm PR #40950)."""
    return shared_expert_at_limits(ctx, y, routing, (ctx.cfg.swiglu_limit,))[0]


def shared_expert_at_limits(ctx: OpContext, y: torch.Tensor, routing: Routing, limits: Sequence[float]
                            ) -> list[torch.Tensor]:
    """shared_expert with each SwiGLU clamp limit in `limits` (≤ 0: no clamp), the gate and up GEMMs made once, as
    expert_pairs_at_limits: each result the bits of its own shared_expert call with that limit."""
    g = ctx.call("linear", x=y, site="ffn.shared_experts.w1")
    u = ctx.call("linear", x=y, site="ffn.shared_experts.w3")
    out = []
    for limit in limits:
        h = swiglu_fp32(g, u, limit)
        h = bf16(h if routing.shared_weight == 1.0 else h * routing.shared_weight)  # x·1 = x: no launch for it
        out.append(ctx.call("linear", x=h, site="ffn.shared_experts.w2"))
    return out


FEW_PAIRS = 64
"""Pair rows up to which _per_expert joins the experts' products with one cat: a decode step has top-k (6) of them,
and the cat holds the products twice for a moment — at most 64 rows × 4096 fp32 (Flash's hidden size) = 1 MB."""


def _per_expert(ctx: OpContext, x: torch.Tensor, layout: "PairLayout", matrix: str) -> torch.Tensor:
    """x's rows (laid out expert by expert) times their expert's `matrix`ᵀ, in the same row order, for callers that
    round them to bf16 next (the experts' GEMM outputs are bf16, spec §7.1). On a GPU over a prefill chunk's rows,
    when every expert's weight is bf16-valued, as grouped GEMMs (numerics.grouped_bf16_products: the same exact
    products, rounded to bf16 already); else one GEMM per expert (numerics.exact_product), as on the CPU."""
    names = {e: f"ffn.experts.{e}.{matrix}.weight" for e, _ in layout.spans}
    width = ctx.cfg.moe_intermediate_size if matrix != "w2" else ctx.cfg.hidden_size
    # only the dense cache's own weights (none made here: a weight past the budget, or one a load_weight patch gives,
    # would be a fresh copy per expert, 8 GB for a Flash chunk's 256 at once)
    if layout.order.numel() > FEW_PAIRS and numerics.grouped_products_apply(x, width) \
            and not ctx.table.patched("load_weight") and all(names[e] in ctx.dense for e, _ in layout.spans):
        weights = [ctx.weight(names[e]) for e, _ in layout.spans]
        if all(ctx.dense.bf16_exact(names[e], w) for (e, _), w in zip(layout.spans, weights)):
            stack = keep_expert_bf16_copies(ctx, matrix)
            if stack is not None:  # read in bf16 where they lie: no cast per chunk and stack
                weights = [stack[e] for e, _ in layout.spans]
            return numerics.grouped_bf16_products(x, weights, [rows for _, rows in layout.spans])

    def product(e: int, rows: slice) -> torch.Tensor:  # x: FP8 activations, bf16 values (numerics.exact_product)
        w = ctx.weight(names[e])
        return exact_product(x[rows], w, lambda: ctx.dense.bf16_exact(names[e], w))

    return joined_products(layout, product, width, x.device)


def keep_expert_bf16_copies(ctx: OpContext, matrix: str) -> torch.Tensor | None:
    """The layer's dense cache's bf16 copy of every routed expert's `matrix` (w1, w3 or w2) as one [E, N, K] stack in
    expert order (DenseCache.bf16_stack), made here on the first ask if the fp32 copies are all cached, bf16-exact
    and the stack fits; None otherwise. The experts' tensor-core GEMMs read them (grouped_bf16_products, and
    nvfp4-experts' block products through nvfp4_operand) instead of casting the fp32 copies per prefill chunk."""
    if ctx.table.patched("load_weight"):  # its weights may be anything: nothing read from the cache's copies
        return None
    return ctx.dense.bf16_stack([f"ffn.experts.{e}.{matrix}.weight" for e in range(ctx.cfg.n_routed_experts)])


def joined_products(layout: "PairLayout", product: Callable[[int, slice], torch.Tensor], width: int,
                    device: torch.device) -> torch.Tensor:
    """product(e, rows) of every expert's rows, in the layout's row order. The products are the same GEMMs either way;
    few rows (a decode step) are joined with one cat instead of a copy per expert into a buffer; many (a prefill
    chunk) are written into one buffer, so that no two copies of all of them exist."""
    if layout.spans and layout.order.numel() <= FEW_PAIRS:
        parts = [product(e, rows) for e, rows in layout.spans]
        return parts[0] if len(parts) == 1 else torch.cat(parts)
    out = torch.empty(layout.order.numel(), width, dtype=torch.float32, device=device)
    for e, rows in layout.spans:
        out[rows] = product(e, rows)
    return out


def chunk_state_carry(ctx: OpContext, state: Any) -> Any:
    """The deployed engine carries the whole state across chunk boundaries unchanged."""
    return state


BASE_OPS = {
    "linear": linear, "hc_prelinear": hc_prelinear, "hc_pre": hc_pre, "hc_post": hc_post,
    "compressor": compressor, "kv_store": kv_store, "kv_load": kv_load, "load_weight": load_weight,
    "indexer_logits": indexer_logits,
    "indexer_topk": indexer_topk, "sparse_attention": sparse_attention, "router": router, "experts": experts,
    "shared_expert": shared_expert,
    "chunk_state_carry": chunk_state_carry,
}
