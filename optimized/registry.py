"""The patch registry a run uses: the built-in patches (optimized-stack O1–O5) plus plugin modules.

Kept apart from `optimized.patching` because the built-in patches themselves import `optimized.patching`."""

from __future__ import annotations

from optimized.patches import BUILT_IN_PATCHES
from optimized.patching import PatchRegistry, load_plugin


def default_registry(plugins: list[str] | None = None) -> PatchRegistry:
    """The built-in patches (optimized-stack O1–O5) plus the given plugin modules."""
    registry = PatchRegistry()
    for patch in BUILT_IN_PATCHES:
        registry.add(patch)
    for spec in plugins or []:
        load_plugin(registry, spec)
    return registry
