"""What a layer of the optimized engine carries between prefill chunks and decode steps (spec §10.3): its paged
caches and the compressors' pending windows. Ops read and write it through `OpContext.state`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from optimized.paged_cache import IndexKeyCache, LatentCache
from reference.ops.compressor import CompressorState


@dataclass
class EngineState:
    """Per-layer serving state: paged caches plus the compressors' pending windows (spec §10.3)."""

    position: int
    segment: int  # segments processed so far
    ratio: int
    inv_freq: torch.Tensor
    window: LatentCache  # every token's kv row; window attention reads the last W
    compressed: LatentCache | None
    index_keys: IndexKeyCache | None
    compressor: CompressorState | None
    indexer_compressor: CompressorState | None
    extras: dict[str, Any] = field(default_factory=dict)  # free room for plugins' own state

    def cache(self, name: str) -> LatentCache | IndexKeyCache:
        cache = {"window": self.window, "compressed": self.compressed, "index": self.index_keys}.get(name)
        if cache is None:
            raise KeyError(f"layer has no '{name}' cache")
        return cache
