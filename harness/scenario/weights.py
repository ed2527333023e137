"""Resolve where weights come from: a preset with a seed (synthetic) or a checkpoint directory."""

from __future__ import annotations

from pathlib import Path

from harness.errors import UsageError
from reference.config import ConfigError, get_preset
from reference.weights.source import WeightError, WeightSource
from reference.weights.profiles import DEFAULT_PROFILE
from reference.weights.synthetic import SyntheticWeights


def open_weights(model: str | None = None, seed: int = 0, checkpoint: str | Path | None = None,
                 profile: str = DEFAULT_PROFILE) -> WeightSource:
    """Synthetic weights for a preset (with a statistics profile, reference.weights.profiles), or a validated
    checkpoint (validation reads headers only)."""
    if checkpoint is not None and model is not None:
        raise UsageError("give either a model preset (with a seed) or a checkpoint directory, not both")
    try:
        if checkpoint is not None:
            from reference.weights.checkpoint import CheckpointWeights

            path = Path(checkpoint)
            if not path.is_dir():
                raise UsageError(f"checkpoint directory {path} does not exist")
            return CheckpointWeights(path)
        return SyntheticWeights(get_preset(model or "flash-mini"), seed, profile)
    except (ConfigError, WeightError, ValueError) as e:
        raise UsageError(str(e)) from None
