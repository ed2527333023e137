"""The engine's two most frequent rounding steps, each in one pass over memory on a GPU (issue #14).

Not kernels of the deployed stack (those are sparse_decode and indexer_logits) but of its emulation: every bf16
store the engine models is `x.to(bfloat16).float()`, and every FP8 activation is the official act_quant's block
fake-quant (reference.quant.fp8_fake_quant, ~17 launches). On a GPU at a prefill chunk's sizes these are
memory-bound element-wise passes — the round trip reads 4 bytes, writes 2, reads 2 and writes 4 per element where
one pass reads 4 and writes 4; the quantizer makes about seven full passes (|x|, the block maxima, x / s, the clamp,
the e4m3 cast, its widening, · s) where one reads and writes each element once.

- `bf16_round(x)` = `x.to(torch.bfloat16).float()`.
- `fp8_block_quant(x, block, amax_floor)` = `reference.quant.fp8_fake_quant(x, block, amax_floor)`.

Both give those functions' values bit for bit (the "torch" implementation IS them; the Triton kernels compute the
same roundings in integer arithmetic on the fp32 bits — see `rounding_triton.py` — so the Triton interpreter on a
CPU runs the GPU's arithmetic, and tests/test_kernels_cpu.py compares every bit there). A NaN stays a NaN, its sign
and payload passed through (torch's casts make their own NaN, not the same on every device: a CPU gave 0xFFFF0000
for both signs); every other value, ±0 and ±inf included, is the same bits. A NaN is a failure the probes' finite
checks report wherever it arises; which NaN it is carries nothing.

`impl` as for the other kernels (optimized.kernels.resolve_impl). The engine calls them through
optimized.numerics only where `fused_rounding_applies`: fp32, contiguous CUDA tensors larger than a replayed
graph's inputs (reference.graphs.MAX_ELEMENTS: a prefill chunk's, or a layer's decode steps computed together),
outside a graph capture — one decode step's small tensors keep the torch ops, which its graphs replay (a Triton
launch costs more host time than two small torch launches) — and on a
device where the kernels gave the torch ops' bits on the hard cases (`kernels_match_torch`, checked once per
device and process): a run's values must not depend on which path rounded them, and a compiler that rounded
differently (or failed) would otherwise move every GPU metric silently; there the torch ops run, with a warning.
"""

from __future__ import annotations

import functools
import threading
import warnings

import torch

from optimized.kernels import resolve_impl, triton_available
from reference import graphs
from reference.quant import fp8_fake_quant

MIN_AMAX_FLOOR = 2.0**-118
"""The smallest amax floor the quantizer's kernel takes: max(amax, floor) must be a normal fp32 whose scale
exponent (k − 8 or k − 7 for a = m·2^k) builds a normal 2^e (e ≥ −126; rounding_triton.py). The engine's is 1e−4."""

MAX_GRID_Y = 65535
"""CUDA's limit on a grid's second dimension, along which the quantizer's kernel lays a row's blocks."""

_CHECK_LOCK = threading.Lock()


def prefill_sized(x: torch.Tensor) -> bool:
    """An fp32, contiguous tensor of more than graphs.MAX_ELEMENTS elements: what a GPU rounds with the one-pass
    kernels (smaller ones are a decode step's, whose graphs replay the torch ops). bench/launch_count.py counts by
    the same rule."""
    return x.dtype == torch.float32 and x.numel() > graphs.MAX_ELEMENTS and x.is_contiguous()


def fused_rounding_applies(x: torch.Tensor) -> bool:
    """Whether optimized.numerics rounds x with the one-pass kernels: a prefill-sized CUDA tensor, not while a CUDA
    graph is being captured (a kernel's first launch compiles and loads it), and "auto" resolving to Triton
    (DSV4_DRIFT_KERNEL_IMPL=torch keeps the torch ops, as it does for every kernel here: the same bits) on a device
    where the kernels gave the torch ops' bits."""
    return (x.is_cuda and prefill_sized(x) and triton_available() and not torch.cuda.is_current_stream_capturing()
            and resolve_impl("auto", x.device) == "triton" and kernels_match_torch(x.device))


def kernels_match_torch(device: torch.device) -> bool:
    """Whether both Triton kernels give the torch ops' bits on `device` for the hard cases of
    optimized.kernels.testing (every tie, scale flip, floor, ±0, inf, NaN; ~0.1 M elements, once per device and
    process, after the kernels' first compile; under a lock, as both host lanes may ask at once). False, with a
    warning naming what differed or failed, keeps the engine on the torch ops there."""
    with _CHECK_LOCK:
        return _kernels_match_torch(device)


@functools.cache
def _kernels_match_torch(device: torch.device) -> bool:
    from optimized.kernels.testing import bf16_round_cases, fp8_block_quant_cases, same_bits

    try:
        x = bf16_round_cases(n_random=1 << 16, device=str(device))
        wrong = {"bf16_round": int((~same_bits(bf16_round(x, impl="triton"), x.to(torch.bfloat16).float())).sum())}
        for block in (128, 64):
            y = fp8_block_quant_cases(block, device=str(device))
            fused = fp8_block_quant(y, block, 1e-4, impl="triton")
            wrong[f"fp8_block_quant/{block}"] = int((~same_bits(fused, fp8_fake_quant(y, block, 1e-4))).sum())
    except Exception as error:  # a kernel that does not compile or launch here: the torch ops still round right
        warnings.warn(f"optimized.kernels.rounding: the one-pass rounding kernels failed on {device} ({error!r}); "
                      "the engine keeps the torch ops there (the same values, slower)", RuntimeWarning, stacklevel=2)
        return False
    if any(wrong.values()):
        warnings.warn(f"optimized.kernels.rounding: the one-pass rounding kernels differ from the torch ops on "
                      f"{device} (elements differing per kernel: {wrong}); the engine keeps the torch ops there",
                      RuntimeWarning, stacklevel=2)
        return False
    return True


def bf16_round(x: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """x rounded to bf16 (round to nearest, ties to even) and returned in fp32: `x.to(torch.bfloat16).float()`.
    The Triton path reads an fp32 contiguous x and returns a new contiguous tensor; "auto" takes it only for such
    an x, "triton" refuses any other."""
    if _use_triton(impl, x, "bf16_round", _layout_problem(x)):
        from optimized.kernels.rounding_triton import bf16_round_triton
        return bf16_round_triton(x)
    return x.to(torch.bfloat16).float()


def fp8_block_quant(x: torch.Tensor, block: int, amax_floor: float, impl: str = "auto") -> torch.Tensor:
    """FP8 e4m3 fake-quant with one UE8M0 scale per `block` elements of the last dim (optimized-stack §0.1; spec
    §7): s = 2^ceil(log2(max(amax, amax_floor) / 448)), x ← e4m3_RNE(clamp(x / s, ±448)) · s — the value of
    reference.quant.fp8_fake_quant. The Triton path reads an fp32 contiguous x whose last dim is a multiple of
    `block` (a power of two, at most MAX_GRID_Y blocks a row) with amax_floor ≥ MIN_AMAX_FLOOR, and returns a new
    contiguous tensor; "auto" takes it only for such an x, "triton" refuses any other."""
    problem = _layout_problem(x)
    width = x.shape[-1]
    if problem is None and (block <= 0 or width % block or block & (block - 1) or width // block > MAX_GRID_Y):
        problem = (f"the last dim ({width}) must be a multiple of the block ({block}), a power of two, and "
                   f"hold at most {MAX_GRID_Y} blocks")
    if problem is None and not amax_floor >= MIN_AMAX_FLOOR:
        problem = f"the Triton path takes an amax floor of at least 2^-118, got {amax_floor!r} (the torch path any)"
    if _use_triton(impl, x, "fp8_block_quant", problem):
        from optimized.kernels.rounding_triton import fp8_block_quant_triton
        return fp8_block_quant_triton(x, block, amax_floor)
    return fp8_fake_quant(x, block=block, amax_floor=amax_floor)


def _layout_problem(x: torch.Tensor) -> str | None:
    """Why a kernel here cannot read x (None: it can): it reads contiguous fp32 tensors."""
    if x.dtype != torch.float32 or not x.is_contiguous():
        return f"the Triton path takes a contiguous fp32 tensor, got {x.dtype} with strides {tuple(x.stride())}"
    return None


def _use_triton(impl: str, x: torch.Tensor, name: str, problem: str | None) -> bool:
    """Whether to run the Triton kernel: when `impl` resolves to Triton and the kernel can read x (`problem` is
    None). Asked for by name ("triton") for an x it cannot read: a ValueError naming the function and why; "auto"
    then keeps the torch path."""
    if resolve_impl(impl, x.device) != "triton":
        return False
    if problem is not None and impl == "triton":
        raise ValueError(f"{name}: {problem}")
    return problem is None
