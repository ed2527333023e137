"""Built-in patches: the mission's deployed optimizations O1–O5 (optimized-stack §2–§6), one module each.

O6 (chunked prefill at 8192) is not an op override but the engine's prefill schedule: the scenario's
`prefill_chunk_size` (default 8192) decides it for every stack.
"""

from __future__ import annotations

from optimized.patches import (bf16_indexer_gemm, bf16_mhc_prelinear, hash_topk, mma_sparse_decode, nvfp4_experts,
                               triton_indexer)
from optimized.patching import Patch

BUILT_IN_PATCHES: list[Patch] = [
    mma_sparse_decode.PATCH,
    triton_indexer.PATCH,
    bf16_indexer_gemm.PATCH,
    bf16_mhc_prelinear.PATCH,
    hash_topk.PATCH,
    nvfp4_experts.PATCH,
]
