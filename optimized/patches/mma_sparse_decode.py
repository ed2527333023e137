"""O1 (optimized-stack §2.4): split-K sparse-MLA decode kernel (FlashInfer SM120 `decode_dsv4` semantics).

Decode steps only (query shape (1, …)). The window rows and the compressed rows are split into
64-candidate tiles; each split computes bf16 Q·K with fp32 accumulation, its own softmax statistics,
bf16 probabilities for P·V and a **bf16 partial output** with an fp32 LSE; a merge kernel combines the
splits by LSE weighting in fp32 and applies the attention sink once, after the merge. The kernel reads
the paged FP8 caches directly (`optimized.kernels.sparse_decode`): Triton on the GPU, its torch emulation
(the same numeric recipe) elsewhere.

Options:
  split: candidates per split (16, 32, 64 (default), 128)
  impl:  "auto" (Triton on CUDA, else the emulation), "torch" or "triton"
"""

from __future__ import annotations

import torch

from optimized.kernels import IMPLS
from optimized.kernels.sparse_decode import SPLIT_SIZES, PagedLatentRows, sparse_decode_splitk
from optimized.ops import OpContext
from optimized.patching import Patch

PATCH = Patch(
    "mma-sparse-decode",
    phases=("decode",),
    description="split-K MMA sparse attention decode: bf16 QK/PV, 64-candidate splits with bf16 partials, "
                "LSE merge, sink once",
    defaults={"split": 64, "impl": "auto"},
    choices={"split": SPLIT_SIZES, "impl": IMPLS},
    spec="optimized-stack §2 (O1)",
    decode_together=True,  # its decode ops compute each query alone (Patch.decode_together)
)


@PATCH.op("sparse_attention")
def sparse_attention(ctx: OpContext, q: torch.Tensor, window_slots: torch.Tensor, comp_slots: torch.Tensor,
                     sink: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    state = ctx.state
    has_extra = state.compressed is not None and comp_slots.shape[-1] > 0
    out, lse = sparse_decode_splitk(
        q.to(torch.bfloat16), PagedLatentRows.of(state.window), window_slots.to(torch.int32),
        PagedLatentRows.of(state.compressed) if has_extra else None,
        comp_slots.to(torch.int32) if has_extra else None,
        sink.float(), ctx.cfg.head_dim**-0.5, split=int(ctx.options["split"]), impl=ctx.options["impl"])
    return out.float(), lse
