"""Triton kernel of harness.run.stream_sums: one program per row reads the row of a and of b once, forms each term in
fp32 as the torch steps do ((a−b)², b², a², a·b, a−b after a cast of both to fp32) and adds it to fp64 sums; the
row's maximum |a−b| propagates NaN as torch's amax does. Deterministic: each of BLOCK lanes adds its terms in column
order, then the lanes are summed in a fixed tree — no atomics. Launches are serialised
(optimized.kernels.serialized_launch): both host lanes compare."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from optimized.kernels import serialized_launch

BLOCK = 1024
"""Columns per step of a row's program (4 per thread of 8 warps; five fp64 accumulators each). A choice, not tuned."""


@triton.jit
def _max_nan(x, y):
    return tl.maximum(x, y, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _stream_sums_kernel(a_ptr, b_ptr, sums_ptr, max_ptr, rows, n, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    err2 = tl.zeros([BLOCK], dtype=tl.float64)
    ref2 = tl.zeros([BLOCK], dtype=tl.float64)
    var2 = tl.zeros([BLOCK], dtype=tl.float64)
    dot = tl.zeros([BLOCK], dtype=tl.float64)
    diff_sum = tl.zeros([BLOCK], dtype=tl.float64)
    max_abs = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, n, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < n
        a = tl.load(a_ptr + row * n + cols, mask=inside, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + row * n + cols, mask=inside, other=0.0).to(tl.float32)
        d = a - b
        err2 += (d * d).to(tl.float64)
        ref2 += (b * b).to(tl.float64)
        var2 += (a * a).to(tl.float64)
        dot += (a * b).to(tl.float64)
        diff_sum += d.to(tl.float64)
        max_abs = _max_nan(max_abs, tl.abs(d))
    tl.store(sums_ptr + row, tl.sum(err2, axis=0))
    tl.store(sums_ptr + rows + row, tl.sum(ref2, axis=0))
    tl.store(sums_ptr + 2 * rows + row, tl.sum(var2, axis=0))
    tl.store(sums_ptr + 3 * rows + row, tl.sum(dot, axis=0))
    tl.store(sums_ptr + 4 * rows + row, tl.sum(diff_sum, axis=0))
    tl.store(max_ptr + row, tl.reduce(max_abs, 0, _max_nan))


def stream_sums_triton(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(err2, ref2, var2, dot, diff_sum, max_abs) of [B, N] a and b (float dtypes, one device): five fp64 [B] and
    one fp32 [B]."""
    if a.shape != b.shape or a.dim() != 2:
        raise ValueError(f"stream_sums_triton takes two [B, N] tensors of one shape, got {tuple(a.shape)} and "
                         f"{tuple(b.shape)}")
    a, b = a.contiguous(), b.contiguous()
    rows, n = a.shape
    sums = torch.empty(5, rows, dtype=torch.float64, device=a.device)
    max_abs = torch.empty(rows, dtype=torch.float32, device=a.device)
    if rows:
        with serialized_launch(a.device):
            _stream_sums_kernel[(rows,)](a, b, sums, max_abs, rows, n, BLOCK=BLOCK, num_warps=8)
    return (*sums.unbind(0), max_abs)
