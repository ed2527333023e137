"""The per-row sums that layer.out's comparison reads from a variant's and the reference's residual streams
(harness.run.metrics.compare_streams): Σ(a−b)², Σb², Σa², Σa·b and Σ(a−b) in fp64 and max|a−b|, every term formed in
fp32 as the torch steps form it.

Why a kernel: the torch steps pass over a prefill chunk's streams (8,192 × 4 × 4,096 elements, 0.5 GB in fp32) about
twenty times — the fp32 copy, the difference, each square and product, each sum — and a Flash layer compares them
for every variant and mode and chunk: ~0.16 s of device time per Flash CSA layer at 30,720 tokens on an H100 (three
variants, two modes; the forty-second session's profile, bench/results/flash-30k-layer-2-h100-2026-12-07-kernel-
lines.txt: metrics.py's compare_streams lines 0.060 + 0.034 + 0.030 + 0.022 s and _flat32's 0.018 s). The kernel
reads both once. On a GPU, for a prefill-sized pair, it runs (stream_sums_triton); elsewhere the torch steps do,
so the CPU's bits — what tests/test_metrics_pin.py pins — do not change. The two differ only in the order of the
fp64 sums (each term is the same fp32 value either way): by at most 2·n·2^-53 of the sum of the n terms'
magnitudes; the maximum, whose order does not matter, not at all.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from optimized.kernels import resolve_impl

KERNEL_MIN_ELEMENTS = 1 << 20
"""Elements from which a pair on a GPU is summed by the kernel: a prefill chunk's streams (8,192 × 4 × 4,096 at
Flash width) and a full batch of decode steps compared together (harness.run.probes' DEFER_EMISSIONS = 64 steps ×
4 × 4,096 = 2^20) take it; a single decode step's streams, or a shorter batch, stay the torch steps, a few small
launches either way."""


class StreamSums(NamedTuple):
    """Per row of [B, N] pairs a (variant) and b (reference): fp64 [B] each but max_abs (fp32 [B])."""

    err2: torch.Tensor  # Σ (a−b)²
    ref2: torch.Tensor  # Σ b²
    var2: torch.Tensor  # Σ a²
    dot: torch.Tensor  # Σ a·b
    diff_sum: torch.Tensor  # Σ (a−b)
    max_abs: torch.Tensor  # max |a−b|


def stream_sums(a: torch.Tensor, b: torch.Tensor) -> StreamSums:
    """The sums of a and b ([B, ...], any float dtypes, one shape) over all but the first dim."""
    if kernel_applies(a, b):
        from harness.run.stream_sums_triton import stream_sums_triton
        return StreamSums(*stream_sums_triton(a.flatten(1), b.flatten(1)))
    af, bf, diff = flat32_pair(a, b)
    return StreamSums(diff.pow(2).sum(1, dtype=torch.float64), bf.pow(2).sum(1, dtype=torch.float64),
                      af.pow(2).sum(1, dtype=torch.float64), (af * bf).sum(1, dtype=torch.float64),
                      diff.sum(1, dtype=torch.float64), diff.abs().amax(1))


def flat32_pair(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both sides as fp32 rows [B, N] and their difference formed in fp32 (the fp32 difference of two fp32/bf16
    tensors is within 2^-24 relative of exact, far below any drift measured; sums of it accumulate in fp64): the
    torch steps' operands here and in harness.run.metrics.ratio_metric."""
    af, bf = a.float().flatten(1), b.float().flatten(1)
    return af, bf, af - bf


def kernel_applies(a: torch.Tensor, b: torch.Tensor) -> bool:
    """A prefill-sized pair on a GPU with Triton, not forced onto torch (DSV4_DRIFT_KERNEL_IMPL=torch, the switch of
    optimized.kernels, keeps the torch steps here too)."""
    return a.is_cuda and b.is_cuda and a.numel() >= KERNEL_MIN_ELEMENTS and resolve_impl("auto", a.device) == "triton"
