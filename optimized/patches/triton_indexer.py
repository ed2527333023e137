"""O2 (optimized-stack §3): FP8 paged MQA logits for the lightning indexer, then top-k.

logit[b, t] = Σ_h w'_h · ReLU(q8_h · k8_t) · k_scale_t over 64-token pages of the FP8 index cache, with
programs whose page tile starts past the row's context length exiting early and writing the masked
value. The per-head dot precision is the deployed variants' choice: "bf16" (default; sglang's
capture-safe bmm rounds each per-head dot to bf16, which creates new ties at the rank-k boundary),
"fp32" (SIMT) or "tf32". Masked columns get −inf, or 0.0 (safe only because the top-k stage re-masks by
length — and wrong when real logits are negative, §3.3). Decode steps by default; `prefill_rows` also
serves every prefill token as its own row, as the deployed stack does for chunks below 8192 rows.

Options:
  dot_precision: "bf16" (default), "fp32" or "tf32"
  masked_value:  "-inf" (default) or a number (e.g. 0)
  prefill_rows:  false (default) / true
  impl:          "auto", "torch" or "triton"
"""

from __future__ import annotations

import torch

from optimized.base_ops import quantize_indexer_q
from optimized.kernels import IMPLS
from optimized.kernels.indexer_logits import DOT_PRECISIONS, fp8_paged_mqa_logits
from optimized.ops import OpContext
from optimized.patching import Patch
from reference.ops.compressor import visible_rows


def _phases(options: dict) -> tuple[str, ...]:
    return ("prefill", "decode") if options.get("prefill_rows") else ("decode",)


PATCH = Patch(
    "triton-indexer",
    phases=("decode",),
    description="Triton FP8 paged MQA indexer logits (64-token pages, early exit, per-head dot precision), then top-k",
    defaults={"dot_precision": "bf16", "masked_value": "-inf", "prefill_rows": False, "impl": "auto"},
    choices={"dot_precision": DOT_PRECISIONS, "masked_value": ("-inf", float), "impl": IMPLS},
    spec="optimized-stack §3 (O2)",
    decode_together=True,  # its decode ops compute each query alone (Patch.decode_together)
    phases_for=_phases,
    layers_for=lambda cfg, layer, options: cfg.layer_kind(layer) == "csa",  # the only layers with an indexer
)


@PATCH.op("indexer_logits")
def indexer_logits(ctx: OpContext, q: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    keys = ctx.state.index_keys
    if keys.fp4:
        raise ValueError("triton-indexer reads the FP8 index-key cache; the engine option indexer_fp4 is on")
    q8, w = quantize_indexer_q(q, weights)
    context = visible_rows(positions, ctx.state.ratio).to(torch.int32)
    return fp8_paged_mqa_logits(q8, w.float(), keys.codes, keys.scale, keys.page_table, context, keys.length,
                                dot_precision=ctx.options["dot_precision"],
                                masked_value=float(ctx.options["masked_value"]), impl=ctx.options["impl"])
