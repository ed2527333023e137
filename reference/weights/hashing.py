"""Counter-based randomness for synthetic weights: identical on every device, in any order of use.

A 32-bit key from (seed, layer, tensor name) and murmur3's 32-bit finaliser over element indices, evaluated in
int64 tensor arithmetic (which wraps identically on CPU and GPU; on a GPU standard_normal runs the same integers as
one Triton kernel in uint32, reference.weights.hashing_triton); normal variates from an Irwin–Hall sum of four
uniform bytes whose integer sum is exact in fp32. No transcendental functions are involved, so no
device-specific libm can change a bit.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import math

import torch

_MASK32 = 0xFFFFFFFF
CHUNK = 1 << 24  # elements generated per step, bounds the int64 temporaries (~128 MB per step)
INV_STD_IH4 = 1.0 / math.sqrt(4 * (256**2 - 1) / 12)  # 1/std of a sum of four uniform bytes


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3 finaliser on values in [0, 2^32) held in int64; exact wrap-around via masking. Works in place on `h`
    (the callers' own temporaries): on the CPU a new int64 temporary per step cost as much as its arithmetic —
    standard_normal of 16.8 M elements on one thread took 2.6 s with them, 1.0–1.2 s in place (measured)."""
    h ^= h >> 16
    h *= 0x85EBCA6B
    h &= _MASK32
    h ^= h >> 13
    h *= 0xC2B2AE35
    h &= _MASK32
    h ^= h >> 16
    return h


def stream_key(seed: int, layer: int | None, name: str) -> int:
    """A 32-bit key from (seed, layer, name); blake2b so the mapping never depends on Python's hash()."""
    tag = f"dsv4-drift/{seed}/{'top' if layer is None else layer}/{name}".encode()
    return int.from_bytes(hashlib.blake2b(tag, digest_size=4).digest(), "little")


def hash_u32(key: int, index: torch.Tensor) -> torch.Tensor:
    """fmix32(index XOR key) for int64 indices < 2^32: a bijection of the index, so one tensor never
    repeats a value by construction, and two keys give two permutations of the same well-mixed sequence."""
    return _fmix32(index ^ key)


def normal_of_hash(h: torch.Tensor) -> torch.Tensor:
    """(b0 + b1 + b2 + b3 − 510) / sqrt(21845) in fp32 for the four bytes of each 32-bit hash (standard_normal's
    Irwin–Hall variate); the integer sum is exact, the one float operation a correctly-rounded multiply. Consumes
    `h` (shifted in place)."""
    s = h >> 24
    s += h & 255
    h >>= 8
    s += h & 255
    h >>= 8
    s += h & 255
    s -= 510
    return s.to(torch.float32).mul_(INV_STD_IH4)


FUSED = True
"""On a GPU, standard_normal runs as one Triton kernel (reference.weights.hashing_triton: the same bits in one pass
instead of ~22); tests/test_gpu_engine.py switches it off to hold the two to each other on the device."""


def _fused_available() -> bool:
    return FUSED and _triton_importable()


@functools.lru_cache(maxsize=None)
def _triton_importable() -> bool:
    """Looked up once (a Flash layer asks ~800 times). optimized.kernels.triton_available answers the same, but the
    reference may not import the optimized side (DESIGN §2)."""
    return importlib.util.find_spec("triton") is not None


def standard_normal(key: int, numel: int, device: torch.device | str, offset: int = 0) -> torch.Tensor:
    """Elements [offset, offset+numel) of the key's stream of approximately N(0, 1) fp32 values.

    Irwin–Hall(4) of the hash's four bytes: S = b0+b1+b2+b3 is an integer in [0, 1020], exact in fp32,
    with mean 510 and variance 4·(256²−1)/12 = 21845; z = (S − 510)/sqrt(21845) has mean 0, variance 1,
    tails at ±3.45 and a resolution of 0.0068σ, far finer than the FP8/FP4/BF16 storage it feeds.
    The one float operation is a correctly-rounded multiply, so every device gives the same bits.
    """
    if torch.device(device).type == "cuda" and offset + numel <= 1 << 32 and _fused_available():
        from reference.weights.hashing_triton import standard_normal_triton

        return standard_normal_triton(key, numel, device, offset, INV_STD_IH4)
    out = torch.empty(numel, dtype=torch.float32, device=device)
    for start in range(0, numel, CHUNK):
        stop = min(numel, start + CHUNK)
        out[start:stop] = normal_of_hash(hash_u32(key, torch.arange(offset + start, offset + stop, dtype=torch.int64,
                                                                    device=device)))
    return out


def uniform_int(key: int, numel: int, device: torch.device | str) -> torch.Tensor:
    """`numel` 32-bit random integers (int64), for discrete draws such as outlier channels."""
    return hash_u32(key, torch.arange(numel, dtype=torch.int64, device=device))


def uniforms(key: int, numel: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """`numel` uniforms in (0, 1), float64: (u + 0.5)/2^32 of the key's 32-bit stream (never exactly 0 or 1)."""
    return (uniform_int(key, numel, device).to(torch.float64) + 0.5) / 2.0**32
