"""The weight-source interface: one layer's tensors at a time, in their stored formats.

A source hands out a `TensorBundle` for the top-level tensors and for each layer. Tensors keep
their storage format (`QuantizedTensor` for FP8/FP4/NVFP4, plain tensors otherwise): the reference
asks for exact fp32/fp64 dequantizations with `dense()`, the optimized stack reads the stored bits
with `stored()`. Only the bundle a caller holds is resident (DESIGN §8 memory budget).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from reference.config import ModelConfig
from reference.quant import QuantizedTensor

Stored = torch.Tensor | QuantizedTensor


def stored_bytes(value: Stored) -> bytes:
    """The bytes a stored tensor holds — a plain tensor's, or a quantized one's codes and scales in turn — for digests
    that must change with any stored bit (reference.weights.synthetic.generator_fingerprint, the generator pins)."""
    parts = (value,) if isinstance(value, torch.Tensor) else (value.codes, value.scale, value.global_scale,
                                                              value.input_scale)
    return b"".join(p.contiguous().cpu().view(torch.uint8).numpy().tobytes() for p in parts if p is not None)


class WeightError(ValueError):
    """A missing, mis-shaped or mis-typed tensor; the message names the tensor (and file)."""


@dataclass
class TensorBundle:
    """Named tensors of one layer (names without the `layers.{L}.` prefix) or of the top level."""

    where: str  # e.g. "layer 3" or "top level", used in error messages
    tensors: dict[str, Stored] = field(default_factory=dict)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def stored(self, name: str) -> Stored:
        try:
            return self.tensors[name]
        except KeyError:
            raise WeightError(f"{self.where}: tensor '{name}' is missing") from None

    def dense(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The exact dequantized value in `dtype` (float32 or float64 for the reference)."""
        t = self.stored(name)
        if isinstance(t, QuantizedTensor):
            return t.dequantize(torch.float32).to(dtype)
        if t.dtype in (torch.int64, torch.int32):
            return t
        return t.to(dtype)

    def names(self) -> list[str]:
        return list(self.tensors)

    def to(self, device: torch.device | str) -> "TensorBundle":
        return TensorBundle(self.where, {k: v.to(device) for k, v in self.tensors.items()})


@runtime_checkable
class WeightSource(Protocol):
    """Anything that yields DeepSeek-V4 weights one layer at a time."""

    config: ModelConfig

    def top_level(self, device: torch.device | str = "cpu") -> TensorBundle:
        """head.weight, norm.weight, hc_head_fn/base/scale (embed.weight is served by rows, below)."""
        ...

    def embed_rows(self, token_ids: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
        """Rows of embed.weight for the given ids, in the stored dtype: [n, D]. Sources need not
        materialise the whole [vocab, D] table (2 GB at Flash widths in fp32)."""
        ...

    def layer(self, layer: int, device: torch.device | str = "cpu") -> TensorBundle:
        """All tensors of `layers.{layer}.` (prefix stripped)."""
        ...

    def describe(self) -> dict[str, object]:
        """A JSON-able description for run manifests (kind, path or seed, layout)."""
        ...
