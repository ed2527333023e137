"""One-thread warm-up of MKL's vector math, so the same inputs give the same bits in every process.

On CPU, torch evaluates float cos, sin, exp, log, tanh, … through MKL VML, splitting tensors of more than
2048 elements across its OpenMP threads. MKL sets up each function lazily, on its first call; when that
first call is made by two threads at once, one thread's chunk can come out of another code path whose
results differ in the last bit. Measured on 2 cores: the fp32 reference's RoPE cos table of the tiny-smoke
scenario differed in ~1 process in 5, and with it every metric of the run's first layer. Calling every
such function once on a tensor too small to be split takes the setup out of any parallel region (the
2048-element grain is torch's, in aten/src/ATen/cpu/vml.h). The warm-up runs when `reference` is imported;
it costs ~0.2 ms (measured).
"""

from __future__ import annotations

import torch

VML_FUNCTIONS = ("cos", "sin", "tan", "acos", "asin", "atan", "exp", "expm1", "log", "log10", "log1p", "log2",
                 "sqrt", "rsqrt", "tanh", "sinh", "cosh", "erf", "erfc", "erfinv", "lgamma", "sigmoid")
"""A superset of the unary functions torch may route to MKL VML; warming one MKL does not use is harmless."""


def warm_up_vector_math() -> None:
    """Call each function once per float dtype on 8 elements (below torch's 2048-element split: one thread)."""
    for dtype in (torch.float32, torch.float64):
        x = torch.linspace(0.1, 0.9, 8, dtype=dtype)
        for name in VML_FUNCTIONS:
            getattr(torch, name)(x)
