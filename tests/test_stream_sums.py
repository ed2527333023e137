"""harness.run.stream_sums: layer.out's per-row sums by one-pass kernel (GPU, prefill-sized) or by the torch steps
(CPU, decode steps). The kernel forms every term in fp32 as the torch steps do and differs only in the order of the
fp64 sums: |Δ| ≤ 2·n·2^-53·Σ|term| per row (n terms, two sums of n fp64 additions each, each within n·2^-53 of
exact relative to Σ|term|); the maximum is the same number, NaN included."""

from __future__ import annotations

import os

import torch

# The Triton interpreter is chosen when a kernel is decorated (its module's first import): set it before anything
# imports triton, and only without CUDA, as tests/test_kernels_cpu.py does.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from harness.run.stream_sums import StreamSums, kernel_applies, stream_sums  # noqa: E402
from optimized.kernels import triton_available, triton_interpreting  # noqa: E402

U64 = 2.0**-53


def _terms(a: torch.Tensor, b: torch.Tensor) -> list[torch.Tensor]:
    """|term| per element of each fp64 sum, in StreamSums' order (fp32 terms, as both paths form them)."""
    af, bf = a.float().flatten(1), b.float().flatten(1)
    d = af - bf
    return [x.abs().double() for x in (d * d, bf * bf, af * af, af * bf, d)]


def assert_sums_agree(got: StreamSums, want: StreamSums, a: torch.Tensor, b: torch.Tensor) -> None:
    n = a.flatten(1).shape[1]
    for name, g, w, t in zip(StreamSums._fields, got, want, _terms(a, b)):
        bound = 2 * n * U64 * t.nan_to_num(0.0, 0.0, 0.0).sum(1)
        finite = torch.isfinite(w)
        assert torch.equal(torch.isnan(g), torch.isnan(w)) and torch.equal(torch.isinf(g), torch.isinf(w)), name
        assert torch.equal(g[~finite & ~torch.isnan(w)], w[~finite & ~torch.isnan(w)]), f"{name}: ±inf differs"
        err = (g[finite].double() - w[finite].double()).abs()
        assert bool((err <= bound[finite]).all()), f"{name}: {float(err.max()):.3e} past the order-of-sums bound"
    assert torch.equal(got.max_abs.isnan(), want.max_abs.isnan())
    assert torch.equal(got.max_abs.nan_to_num(0.0), want.max_abs.nan_to_num(0.0)), "a maximum is order-free"


def _pair(rows: int, n: int, device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 variant and an fp32 reference that differ by ~1e-2 relative, rows of widely different scales."""
    g = torch.Generator(device=device).manual_seed(seed)
    scale = torch.exp(3 * torch.randn(rows, 1, device=device, generator=g))
    b = torch.randn(rows, n, device=device, generator=g) * scale
    a = (b + 1e-2 * torch.randn(rows, n, device=device, generator=g) * scale).bfloat16()
    return a, b


@pytest.mark.skipif(not (triton_available() and triton_interpreting()),
                    reason="needs triton and TRITON_INTERPRET=1 (CPU-only process)")
def test_the_kernel_gives_the_torch_steps_sums_in_the_interpreter():
    """Rows not a multiple of the kernel's block, one row with NaN, one with inf, one exactly equal, one all zero."""
    from harness.run.stream_sums_triton import stream_sums_triton

    a, b = _pair(6, 2500, "cpu", 0)
    b[1, 7] = float("nan")
    a[2, 2499] = float("inf")
    a[3] = b[3].bfloat16()
    b[3] = a[3].float()
    a[4], b[4] = 0.0, 0.0
    got = StreamSums(*stream_sums_triton(a, b))
    want = stream_sums(a, b)  # CPU: the torch steps
    assert_sums_agree(got, want, a, b)
    assert float(got.err2[3]) == 0.0 and float(got.max_abs[3]) == 0.0 and bool(got.max_abs[1].isnan())


def test_the_cpu_keeps_the_torch_steps():
    """Whatever the size (the CPU's bits are what tests/test_metrics_pin.py pins)."""
    a, b = _pair(2, 64, "cpu", 1)
    assert not kernel_applies(a, b) and not kernel_applies(*_pair(64, 1 << 15, "cpu", 3))
    af, bf = a.float(), b.float()
    s = stream_sums(a[:, None], b[:, None])  # [B, 1, N]: flattened past the first dim
    assert torch.equal(s.err2, (af - bf).pow(2).sum(1, dtype=torch.float64))
    assert torch.equal(s.max_abs, (af - bf).abs().amax(1))


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs CUDA + triton")
def test_a_prefill_chunks_streams_are_summed_by_the_kernel_on_the_gpu(monkeypatch):
    """Flash's streams for 2,048 tokens ([2048, 4, 4096]: bf16 variant, fp32 reference) take the kernel and agree with
    the torch steps within the order-of-sums bound; a decode step's and DSV4_DRIFT_KERNEL_IMPL=torch keep the steps."""
    a, b = _pair(2048, 4 * 4096, "cuda", 2)
    a, b = a.view(2048, 4, 4096), b.view(2048, 4, 4096)
    assert kernel_applies(a, b) and not kernel_applies(a[:1], b[:1])
    got = stream_sums(a, b)
    monkeypatch.setenv("DSV4_DRIFT_KERNEL_IMPL", "torch")
    assert not kernel_applies(a, b)
    want = stream_sums(a, b)
    assert_sums_agree(got, want, a, b)
    same = float((got.err2 == want.err2).float().mean())
    print(f"\n[stream sums] rows identical to the torch steps (err2): {same:.2%}")
