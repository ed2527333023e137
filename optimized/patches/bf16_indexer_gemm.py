"""O3 (optimized-stack §4.2): the indexer's projections as bf16 tensor-core GEMMs instead of fp32 SIMT.

sglang's `linear_bf16_fp32` path: the bf16-stored weights and the activations enter a cuBLAS bf16 GEMM
with fp32 accumulation; the result comes back as bf16 (or fp32). In the stock engine the indexer
compressor's wkv/wgate run in fp32 on fp32 inputs (official Compressor). Rounding the compressor's
gate and value projections shifts the softmax pooling and so every indexer key, which moves scores near
the rank-k boundary.

Options:
  sites:  "indexer" (indexer compressor wkv+wgate and weights_proj), "indexer+compressor" (also the main
          compressor of CSA/HCA layers), "indexer+router" (also the MoE router) or "indexer+compressor+router"
  output: "bf16" (default; the GEMM writes bf16) or "fp32"
"""

from __future__ import annotations

import torch

from optimized.base_ops import rounded_weight
from optimized.numerics import bf16_linear
from optimized.ops import OpContext
from optimized.patching import Patch

_SITE_GROUPS = {
    "indexer": ("attn.indexer.compressor.wkv", "attn.indexer.compressor.wgate", "attn.indexer.weights_proj"),
    "compressor": ("attn.compressor.wkv", "attn.compressor.wgate"),
    "router": ("ffn.gate",),
}

PATCH = Patch(
    "bf16-indexer-gemm",
    phases=("prefill", "decode"),
    description="indexer projections (compressor wkv/wgate, weights_proj) as bf16 GEMMs with fp32 accumulation",
    defaults={"sites": "indexer", "output": "bf16"},
    choices={"sites": ("indexer", "indexer+compressor", "indexer+router", "indexer+compressor+router"),
             "output": ("bf16", "fp32")},
    spec="optimized-stack §4.2 (O3)",
    decode_together=True,  # its decode ops compute each query alone (Patch.decode_together)
    layers_for=lambda cfg, layer, options: _acts_at(cfg.layer_kind(layer), options["sites"]),
)


def _sites(option: str) -> set[str]:
    return {site for group in option.split("+") for site in _SITE_GROUPS[group]}


def _acts_at(kind: str, sites: str) -> bool:
    """Whether a layer of `kind` has any of the sites: the indexer's only on CSA layers, the main compressor's on
    CSA and HCA layers, the router's on every layer."""
    groups = set(sites.split("+"))
    return "router" in groups or kind == "csa" or ("compressor" in groups and kind == "hca")


@PATCH.op("linear")
def linear(ctx: OpContext, x: torch.Tensor, site: str) -> torch.Tensor:
    if site not in _sites(ctx.options["sites"]):
        return ctx.base(x=x, site=site)
    return bf16_linear(x, rounded_weight(ctx, site + ".weight"), out_bf16=ctx.options["output"] == "bf16",
                       weight_rounded=True)
