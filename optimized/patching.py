"""Patches: switchable overrides of the engine's named ops, built in or loaded from user plugins.

A patch has an id, the phases it touches, a one-line description, default options (with the values each
accepts) and, per op name, an implementation `fn(ctx, **inputs)`. Inside, `ctx.base(**inputs)` runs whatever
the patch replaced (the stock engine op, or an earlier patch), so a plugin can wrap an op as easily as replace it.

Order rule: patches stack in the order they are listed, each later one on top of the earlier ones. A later
patch whose op never calls `ctx.base` replaces everything beneath it on that op, so an earlier patch there
never runs; `shadowed_patches` finds such pairs before any compute, and run/attribute/forward print them.

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
from types import CodeType, FunctionType
from typing import Any, Callable

from optimized.op_specs import OP_SPECS
from reference.weights.layouts import format_ranges

PHASES = ("prefill", "decode")
HARNESS_SOURCE = "harness"
"""`Patch.source` of a patch the harness adds to a variant itself (decision forcing hands down the reference's
picks): no kernel of the variant's, so no site judges it (OpTable.patched_beyond_harness)."""


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
    choices: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    """Per option, the values it accepts: literal values, types (`float` admits integers) and `range`s of
    integers. An option without an entry accepts values of its default's type (bool, int, float or str), so a
    bad value is refused when the patch is chosen, before any compute, rather than layers into a run."""
    spec: str = ""  # the spec section it implements (optimized-stack §…)
    source: str = "built-in"
    ops: dict[str, Callable[..., Any]] = field(default_factory=dict)
    phases_for: Callable[[dict[str, Any]], tuple[str, ...]] | None = None
    """Optional: phases as a function of the options (e.g. triton-indexer's prefill_rows)."""
    layers_for: Callable[[Any, int, dict[str, Any]], bool] | None = None
    """Optional: `layers_for(cfg, layer, options)`, whether the patch acts at layer `layer` of model config `cfg`
    (e.g. only where the layer has an indexer, or only on hash-routed layers); without it, at every layer. At
    the other layers the engine leaves the patch out of the layer's op chains, so it cannot act there: what a
    patch declares here is enforced, not trusted. Variants that then differ only by patches left out compute the
    same layer on the same input, which a local-mode run computes once (harness.run.prefill_sharing)."""
    decode_together: bool = False
    """Whether the patch's decode ops may be given a layer's teacher-forced decode steps in one call: each query
    computed from its own inputs and the caches' rows up to its position, as in a step of its own, whatever the
    number of queries a call holds (no state kept between calls, no behaviour keyed on the call's size or on
    ctx.segment). On a GPU a run then decodes each layer where every patch acting in its variants' decode says so
    as one segment (harness.run.runner.LockstepRunner.engines_decode_together): ~64× fewer launches for the decode.
    Off by default: a plugin's decode ops are called once per step, one query each, as a serving stack's decode
    kernels are — and every variant decodes step by step at the layers where it acts. The built-ins declare it."""

    def __post_init__(self) -> None:
        self.phases = tuple(self.phases)
        if not isinstance(self.decode_together, bool):
            raise PatchError(f"patch '{self.id}': decode_together must be True or False, got {self.decode_together!r}")
        bad = [p for p in self.phases if p not in PHASES]
        if not self.id or not isinstance(self.id, str):
            raise PatchError(f"patch id must be a non-empty string, got {self.id!r}")
        if bad or not self.phases:
            raise PatchError(f"patch '{self.id}': phases must be a non-empty subset of {PHASES}, got {self.phases}")
        undeclared = sorted(set(self.choices) - set(self.defaults))
        if undeclared:
            raise PatchError(f"patch '{self.id}': choices for option(s) {undeclared} that have no default")
        for name, default in self.defaults.items():
            problem = self.option_problem(name, default)
            if problem:
                raise PatchError(f"patch '{self.id}': the default {problem}")

    def op(self, name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """Decorator registering `fn(ctx, **inputs)` as this patch's implementation of op `name`."""
        if name not in OP_SPECS:
            raise PatchError(f"patch '{self.id}': unknown op '{name}'; known ops: {sorted(OP_SPECS)}")

        def register(fn: Callable[..., Any]) -> Callable[..., Any]:
            self.ops[name] = fn
            return fn

        return register

    def option_problem(self, name: str, value: Any) -> str | None:
        """None when option `name` (a declared one) accepts `value`, else what is wrong, e.g.
        `option dot_precision='fp99' is not one of 'bf16', 'fp32', 'tf32'`."""
        accepted = self.choices.get(name) or _type_of(self.defaults[name])
        if not accepted or any(_accepts(choice, value) for choice in accepted):
            return None
        return f"option {name}={value!r} is not {_describe_choices(accepted)}"

    def resolve_options(self, given: dict[str, Any] | None) -> dict[str, Any]:
        """The defaults overridden by `given`; unknown options and values outside an option's choices raise."""
        given = dict(given or {})
        unknown = sorted(set(given) - set(self.defaults))
        if unknown:
            raise PatchError(f"patch '{self.id}': unknown option(s) {unknown}; options: {sorted(self.defaults) or 'none'}")
        problems = [p for p in (self.option_problem(k, v) for k, v in given.items()) if p]
        if problems:
            raise PatchError(f"patch '{self.id}': " + "; ".join(problems))
        return {**self.defaults, **given}

    def active_phases(self, options: dict[str, Any]) -> tuple[str, ...]:
        return self.phases_for(options) if self.phases_for else self.phases

    def acts_at(self, cfg: Any, layer: int, options: dict[str, Any]) -> bool:
        """Whether the patch is in layer `layer`'s op chains (layers_for; every layer without it). A layers_for that
        raises fails as a patch's op does: naming the patch (PluginOpError)."""
        if self.layers_for is None:
            return True
        try:
            return bool(self.layers_for(cfg, layer, options))
        except Exception as e:  # noqa: BLE001 - a plugin's failure must name the plugin
            raise PluginOpError(f"patch '{self.id}' ({self.source}) failed in layers_for at layer {layer}: "
                                f"{type(e).__name__}: {e}") from e


def decodes_together(choices: list["PatchChoice"], cfg: Any, layer: int) -> bool:
    """Whether every patch of `choices` that acts in decode at layer `layer` declares Patch.decode_together (true
    when none does: the stock engine's ops compute each query from its own inputs)."""
    return all(c.patch.decode_together for c in choices
               if "decode" in c.patch.active_phases(c.options) and c.patch.acts_at(cfg, layer, c.options))


def _type_of(default: Any) -> tuple[type, ...]:
    """The values an option accepts when it declares no choices: its default's type (none for a None default)."""
    for kind in (bool, int, float, str):
        if isinstance(default, kind):
            return (kind,)
    return ()


def _accepts(choice: Any, value: Any) -> bool:
    """One entry of an option's choices: a type (bool is not a number; float admits int), a range of integers,
    or a literal value of the same type (so True is not 1)."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if isinstance(choice, type):
        if choice is float:
            return is_int or isinstance(value, float)
        if choice is int:
            return is_int
        return isinstance(value, choice)
    if isinstance(choice, range):
        return is_int and value in choice
    return type(value) is type(choice) and value == choice


_TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _describe_choices(accepted: tuple[Any, ...]) -> str:
    """`one of 'bf16', 'fp32', 'tf32'`, `'-inf' or a number`, `an integer from 1 to 4096`."""
    words = [_TYPE_WORDS.get(c, f"a {c.__name__}") if isinstance(c, type)
             else f"an integer from {c.start} to {c.stop - 1}" if isinstance(c, range) else repr(c) for c in accepted]
    literals = [c for c in accepted if not isinstance(c, (type, range))]
    if len(literals) == len(accepted) and len(accepted) > 1:
        return "one of " + ", ".join(words)
    return " or ".join(words) if len(words) <= 2 else ", ".join(words[:-1]) + " or " + words[-1]


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


@dataclass(frozen=True)
class Shadowing:
    """Patch `hidden` never runs on `op` in `phases`: `by`, listed after it, replaces the op without `ctx.base`."""

    op: str
    hidden: str
    by: str
    phases: tuple[str, ...]
    by_some_layers: bool = False  # `by` declares the layers it acts at (Patch.layers_for): hidden at those only
    layers: tuple[int, ...] | None = None
    """The layers where it is hidden, when the model config was given and they are not all of them."""

    def message(self) -> str:
        if self.layers is not None:
            where = f" at layer{'s' if len(self.layers) > 1 else ''} {format_ranges(list(self.layers))}"
        else:
            where = f" at the layers where '{self.by}' acts" if self.by_some_layers else ""
        return (f"patch '{self.by}' replaces op '{self.op}' without calling ctx.base, so '{self.hidden}' (listed "
                f"before it) never runs on that op in {' and '.join(self.phases)}{where}; later patches wrap earlier "
                f"ones: list '{self.hidden}' after '{self.by}' to wrap it")


def may_call_base(fn: Callable[..., Any]) -> bool:
    """Whether an op implementation can reach `ctx.base`, read statically: code that never names `base` (as an
    attribute, a global or a string constant) cannot call it. Nested functions, closures and functions of the
    implementation's own module that it names are read too; a callable without Python code counts as calling it."""
    functions: list[Any] = [fn]
    seen: set[CodeType] = set()
    while functions:
        f = functions.pop()
        if not isinstance(getattr(f, "__code__", None), CodeType):
            return True
        codes = [f.__code__]
        while codes:
            code = codes.pop()
            if code in seen:
                continue
            seen.add(code)
            if "base" in code.co_names or "base" in code.co_consts:
                return True
            codes += [c for c in code.co_consts if isinstance(c, CodeType)]
            named = (f.__globals__.get(n) for n in code.co_names)
            functions += [g for g in named if isinstance(g, FunctionType) and g.__module__ == f.__module__]
        for cell in f.__closure__ or ():
            try:
                if isinstance(cell.cell_contents, FunctionType):
                    functions.append(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
    return False


def shadowed_patches(choices: list[PatchChoice], cfg: Any = None) -> list[Shadowing]:
    """Every patch of a variant that never runs on some op because a later one replaces that op without calling
    `ctx.base` (the order rule: each patch wraps the ones listed before it), per op, in the phases both are on. With
    the model config `cfg`, per layer as the engine builds the layers' op chains (only the patches acting at a layer:
    Patch.layers_for), naming the layers where it is hidden unless that is every layer; without it, the patches'
    declared layers are not known, and a replacer that declares some says so."""
    if cfg is None:
        found = _shadowed_in(choices)
        some_layers = {c.id for c in choices if c.patch.layers_for is not None}
        return [Shadowing(op, hidden, by, phases, by in some_layers) for (op, hidden, by), phases in found.items()]
    at: dict[tuple[str, str, str], dict[int, tuple[str, ...]]] = {}
    n_layers = cfg.num_hidden_layers
    for layer in range(n_layers):
        acting = [c for c in choices if c.patch.acts_at(cfg, layer, c.options)]
        for key, phases in _shadowed_in(acting).items():
            at.setdefault(key, {})[layer] = phases
    shadowings = []
    for (op, hidden, by), by_layer in at.items():
        phases = tuple(p for p in PHASES if any(p in ph for ph in by_layer.values()))
        layers = tuple(sorted(by_layer))
        shadowings.append(Shadowing(op, hidden, by, phases, layers=None if len(layers) == n_layers else layers))
    return shadowings


def _shadowed_in(choices: list[PatchChoice]) -> dict[tuple[str, str, str], tuple[str, ...]]:
    """(op, hidden, replacer) -> phases, over the op chains these choices make (each op's patches in order)."""
    found: dict[tuple[str, str, str], list[str]] = {}
    for phase in PHASES:
        active = [c for c in choices if phase in c.patch.active_phases(c.options)]
        for op in OP_SPECS:
            chain = [c for c in active if op in c.patch.ops]
            for i, lower in enumerate(chain):
                replacer = next((c for c in chain[i + 1:] if not may_call_base(c.patch.ops[op])), None)
                if replacer is not None:
                    found.setdefault((op, lower.id, replacer.id), []).append(phase)
    return {key: tuple(phases) for key, phases in found.items()}


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

