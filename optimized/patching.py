"""Patches: switchable overrides of the engine's named ops, built in or loaded from user plugins.

A patch has an id, the phases it touches, a one-line description, default options and, per op name,
an implementation `fn(ctx, **inputs)`. Inside, `ctx.base(**inputs)` runs whatever the patch replaced
(the stock engine op, or an earlier patch), so a plugin can wrap an op as easily as replace it.

    from optimized.patching import Patch

    drop_far = Patch("drop-far-rows", phases=("decode",), description="forget indexer rows older than 1K tokens")

    @drop_far.op("indexer_topk")
    def topk(ctx, logits, positions, k):
        row_ids, valid = ctx.base(logits=logits, positions=positions, k=k)
        return row_ids, valid & (row_ids * 4 >= positions[:, None] - 1024)

A plugin module (a .py file or an importable module given to `--patch-module`) exposes its patches
as module-level `Patch` objects. Op names and their inputs are listed in `optimized.ops.OP_SPECS`; `optimized.registry.default_registry`
builds the registry of built-in and plugin patches.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from optimized.op_specs import OP_SPECS

PHASES = ("prefill", "decode")


class PatchError(ValueError):
    """A bad patch definition, unknown patch id or option, or a plugin that failed to load."""


class PluginOpError(RuntimeError):
    """A patch's op raised while running; names the patch, the op, the layer and the phase."""


@dataclass
class Patch:
    id: str
    phases: tuple[str, ...]
    description: str
    defaults: dict[str, Any] = field(default_factory=dict)
    spec: str = ""  # the spec section it implements (optimized-stack §…)
    source: str = "built-in"
    ops: dict[str, Callable[..., Any]] = field(default_factory=dict)
    phases_for: Callable[[dict[str, Any]], tuple[str, ...]] | None = None
    """Optional: phases as a function of the options (e.g. triton-indexer's prefill_rows)."""

    def __post_init__(self) -> None:
        self.phases = tuple(self.phases)
        bad = [p for p in self.phases if p not in PHASES]
        if not self.id or not isinstance(self.id, str):
            raise PatchError(f"patch id must be a non-empty string, got {self.id!r}")
        if bad or not self.phases:
            raise PatchError(f"patch '{self.id}': phases must be a non-empty subset of {PHASES}, got {self.phases}")

    def op(self, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator registering `fn(ctx, **inputs)` as this patch's implementation of op `name`."""
        if name not in OP_SPECS:
            raise PatchError(f"patch '{self.id}': unknown op '{name}'; known ops: {sorted(OP_SPECS)}")

        def register(fn: Callable[..., Any]) -> Callable[..., Any]:
            self.ops[name] = fn
            return fn

        return register

    def resolve_options(self, given: dict[str, Any] | None) -> dict[str, Any]:
        given = dict(given or {})
        unknown = sorted(set(given) - set(self.defaults))
        if unknown:
            raise PatchError(f"patch '{self.id}': unknown option(s) {unknown}; options: {sorted(self.defaults) or 'none'}")
        return {**self.defaults, **given}

    def active_phases(self, options: dict[str, Any]) -> tuple[str, ...]:
        return self.phases_for(options) if self.phases_for else self.phases


@dataclass(frozen=True)
class PatchChoice:
    """One patch switched on in a variant, with its resolved options."""

    patch: Patch
    options: dict[str, Any]

    @property
    def id(self) -> str:
        return self.patch.id

    def label(self) -> str:
        changed = {k: v for k, v in self.options.items() if self.patch.defaults.get(k) != v}
        return self.id + ("" if not changed else "{" + ",".join(f"{k}={v}" for k, v in sorted(changed.items())) + "}")


class PatchRegistry:
    """Known patches by id: the built-ins plus whatever plugins registered."""

    def __init__(self) -> None:
        self._patches: dict[str, Patch] = {}

    def add(self, patch: Patch) -> None:
        if patch.id in self._patches and self._patches[patch.id] is not patch:
            raise PatchError(f"patch id '{patch.id}' from {patch.source} is already registered by "
                             f"{self._patches[patch.id].source}")
        self._patches[patch.id] = patch

    def get(self, patch_id: str) -> Patch:
        try:
            return self._patches[patch_id]
        except KeyError:
            raise PatchError(f"unknown patch '{patch_id}'; known: {', '.join(self.ids())}") from None

    def ids(self) -> list[str]:
        return list(self._patches)

    def all(self) -> list[Patch]:
        return list(self._patches.values())

    def built_in_ids(self) -> list[str]:
        return [p.id for p in self._patches.values() if p.source == "built-in"]

    def choose(self, spec: str | list[str] | None, options: dict[str, dict[str, Any]] | None = None) -> list[PatchChoice]:
        """Parse a patch selection: 'all', 'none', a comma list or list of ids; `options` per id.

        Ids may carry inline options: `triton-indexer:prefill_rows=true`.
        """
        options = dict(options or {})
        if spec is None or spec == "none" or spec == []:
            return []
        items = spec.split(",") if isinstance(spec, str) else list(spec)
        if items == ["all"]:
            items = self.built_in_ids()
        chosen: list[PatchChoice] = []
        for item in (i.strip() for i in items if i.strip()):
            pid, _, inline = item.partition(":")
            opts = dict(options.pop(pid, {}))
            for kv in filter(None, inline.split(";")):
                key, eq, value = kv.partition("=")
                if not eq:
                    raise PatchError(f"patch option '{kv}' in '{item}' must look like key=value")
                opts[key.strip()] = _parse_option_value(value.strip())
            patch = self.get(pid)
            if any(c.id == pid for c in chosen):
                raise PatchError(f"patch '{pid}' is selected twice")
            chosen.append(PatchChoice(patch, patch.resolve_options(opts)))
        if options:
            raise PatchError(f"options given for patches that are not selected: {sorted(options)}")
        return chosen


def _parse_option_value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def load_plugin(registry: PatchRegistry, spec: str) -> list[Patch]:
    """Import a plugin (a .py path or a module name) and register every module-level `Patch` in it."""
    path = Path(spec)
    try:
        if spec.endswith(".py") or path.exists():
            if not path.is_file():
                raise PatchError(f"patch module file {spec} does not exist")
            name = f"dsv4_drift_plugin_{path.stem}"
            module_spec = importlib.util.spec_from_file_location(name, path)
            if module_spec is None or module_spec.loader is None:
                raise PatchError(f"cannot load patch module {spec}")
            module = importlib.util.module_from_spec(module_spec)
            sys.modules[name] = module
            module_spec.loader.exec_module(module)
        else:
            module = importlib.import_module(spec)
    except PatchError:
        raise
    except Exception as e:  # noqa: BLE001 - any import-time failure of user code becomes a clear error
        raise PatchError(f"patch module '{spec}' failed to import: {type(e).__name__}: {e}") from e
    found = [v for v in vars(module).values() if isinstance(v, Patch)]
    if not found:
        raise PatchError(f"patch module '{spec}' defines no module-level Patch objects")
    for patch in found:
        if patch.source == "built-in":
            patch.source = f"plugin {spec}"
        registry.add(patch)
    return found

