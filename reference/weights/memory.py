"""A WeightSource over tensors already in memory, keyed by official names (tests, conversions)."""

from __future__ import annotations

import torch

from reference.config import ModelConfig
from reference.weights.schema import layer_prefix, layer_specs, top_level_specs
from reference.weights.source import Stored, TensorBundle, WeightError


class InMemoryWeights:
    """Serves `tensors` (official names, e.g. `layers.3.attn.wq_a.weight`, `embed.weight`) one layer at a time.

    Every tensor the schema expects must be present with its shape; extra names are rejected, so a
    mapping mistake surfaces here rather than as a wrong number later.
    """

    def __init__(self, config: ModelConfig, tensors: dict[str, Stored], label: str = "in-memory") -> None:
        self.config, self.label = config, label
        self._tensors = dict(tensors)
        expected = {s.name: s.shape for s in top_level_specs(config)}
        for layer in range(config.num_hidden_layers):
            expected.update({layer_prefix(layer) + s.name: s.shape for s in layer_specs(config, layer)})
        missing = sorted(set(expected) - set(self._tensors))
        extra = sorted(set(self._tensors) - set(expected))
        if missing:
            raise WeightError(f"{label}: missing tensors {missing[:8]}{' …' if len(missing) > 8 else ''}")
        if extra:
            raise WeightError(f"{label}: unexpected tensors {extra[:8]}{' …' if len(extra) > 8 else ''}")
        for name, shape in expected.items():
            got = tuple(self._tensors[name].shape)
            if got != tuple(shape):
                raise WeightError(f"{label}: tensor '{name}' has shape {got}, expected {tuple(shape)}")

    def describe(self) -> dict[str, object]:
        return {"kind": "in-memory", "label": self.label, "model": self.config.name}

    def top_level(self, device: torch.device | str = "cpu") -> TensorBundle:
        names = [s.name for s in top_level_specs(self.config) if s.name != "embed.weight"]
        return TensorBundle(f"{self.label} top level", {n: self._tensors[n] for n in names}).to(device)

    def embed_rows(self, token_ids: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
        return self._tensors["embed.weight"][torch.as_tensor(token_ids, dtype=torch.int64).cpu()].to(device)

    def layer(self, layer: int, device: torch.device | str = "cpu") -> TensorBundle:
        prefix = layer_prefix(layer)
        specs = layer_specs(self.config, layer)
        return TensorBundle(f"{self.label} layer {layer}",
                            {s.name: self._tensors[prefix + s.name] for s in specs}).to(device)
