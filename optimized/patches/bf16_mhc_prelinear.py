"""O3 (optimized-stack §4.1): the mHC pre-linear `fn` [(2+n)n, n·D] as a bf16 GEMM with fp32 accumulation.

The stock path is an fp32 SIMT GEMM of the flattened bf16 streams with the fp32 `fn`. The patch rounds
`fn` to bf16 (relative error up to 2^-9 per weight), keeps the K = n·D accumulation in fp32 and the RMS
factor ρ in fp32. Errors in the 24 mixes move pre (the layer input scale), post (the new contribution)
and comb (the stream mixing) — 2 calls per layer, 86 per token through 43 layers.

Options:
  precision: "bf16" (default) or "tf32" (DeepGEMM's tf32_hc_prenorm_gemm: operands rounded to 10-bit mantissas)
  split_k:   number of K partitions (1 to 4096) summed as separate fp32 partials (split-K order; 1 = none)
"""

from __future__ import annotations

import torch

from optimized.base_ops import rounded_weight
from optimized.numerics import bf16
from optimized.ops import OpContext
from optimized.patching import Patch

PATCH = Patch(
    "bf16-mhc-prelinear",
    phases=("prefill", "decode"),
    description="mHC pre-linear fn (24×(hc·D)) in bf16 (or tf32) with fp32 accumulation",
    defaults={"precision": "bf16", "split_k": 1},
    choices={"precision": ("bf16", "tf32"), "split_k": (range(1, 4097),)},
    spec="optimized-stack §4.1 (O3)",
    decode_together=True,  # its decode ops compute each query alone (Patch.decode_together)
)


def round_tf32(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 to TF32 (10 explicit mantissa bits), nearest-even, by integer arithmetic on the bits."""
    bits = x.float().contiguous().view(torch.int32)
    lsb = (bits >> 13) & 1
    rounded = (bits + 0x0FFF + lsb) & ~0x1FFF
    return rounded.view(torch.float32)


@PATCH.op("hc_prelinear")
def hc_prelinear(ctx: OpContext, streams: torch.Tensor, site: str) -> torch.Tensor:
    precision, split_k = ctx.options["precision"], ctx.options["split_k"]
    rnd = bf16 if precision == "bf16" else round_tf32
    flat = streams.float().flatten(-2)  # the streams are bf16 already
    fn = rounded_weight(ctx, f"hc_{site}_fn", rnd, precision)
    x = rnd(flat)
    parts = [xp @ fp.T for xp, fp in zip(x.chunk(split_k, -1), fn.chunk(split_k, -1))]
    mixes = torch.stack(parts, 0).sum(0)
    rho = torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + ctx.cfg.rms_norm_eps)
    return mixes * rho
