"""The engine's named ops: what a patch can override, what each takes and returns, what it may read.

Every computation of the optimized layer that a kernel patch could replace goes through one of these
ops. An implementation is `fn(ctx: OpContext, **inputs)`; the stock engine's implementations live in
`optimized.base_ops`; patches stack on top (see `optimized.patching`). Tensors are fp32 tensors whose
values are what the deployed kernel would hold (bf16-rounded where the deployed tensor is bf16) unless
stated otherwise.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from reference.weights.dense_cache import DenseCache
from optimized.op_specs import OP_SPECS, OpSpec
from optimized.patching import HARNESS_SOURCE, PatchChoice, PluginOpError
from optimized.state import EngineState
from reference.config import ModelConfig
from reference.weights.source import TensorBundle

__all__ = ["OP_SPECS", "OpContext", "OpSpec", "OpTable", "Routing"]




@dataclass
class Routing:
    """Routing decision of the optimized engine (the reference's plus where the scaling is applied)."""

    scores: torch.Tensor  # [S, E]
    expert_ids: torch.Tensor  # [S, k]
    weights: torch.Tensor  # [S, k] as applied to the routed experts
    output_scale: float = 1.0  # multiplies the routed+shared MoE output (fused hash_topk puts 1.5 here)
    shared_weight: float = 1.0  # weight of the shared expert before output_scale


@dataclass
class OpContext:
    """What an op implementation may read. `options` are the running patch's options; `base` runs the
    implementation underneath (the stock op or an earlier patch); `call` runs any other op by name."""

    cfg: ModelConfig
    layer: int
    kind: str  # "swa" | "csa" | "hca"
    phase: str  # "prefill" | "decode"
    segment: int  # index of this prefill chunk / decode step within the phase
    positions: torch.Tensor  # absolute positions of the segment's tokens
    state: EngineState
    weights: TensorBundle  # stored formats (QuantizedTensor for FP8/FP4/NVFP4)
    dense: DenseCache
    device: torch.device
    engine_options: dict[str, Any]
    table: "OpTable"
    options: dict[str, Any] = field(default_factory=dict)
    patch_id: str | None = None
    base: Callable[..., Any] | None = None

    def with_fields(self, **changes: Any) -> "OpContext":
        """dataclasses.replace(self, **changes) without its __init__ call: a shallow copy with the given fields
        changed, made for every patched op call and every stock op a patch calls (~45 per decode step of `all`,
        ~2 µs each through replace, ~0.7 µs this way on one CPU core). The same object replace would build:
        OpContext has no __post_init__, no field init=False and no InitVar."""
        new = object.__new__(OpContext)
        new.__dict__.update(self.__dict__)
        new.__dict__.update(changes)
        return new

    def weight(self, name: str) -> torch.Tensor:
        """The fp32 value of a stored tensor of this layer, through the `load_weight` op (exact dequantization in
        the stock engine, cached for the layer)."""
        return self.table.call("load_weight", self, {"name": name, "fmt": "stored"})

    def call(self, op: str, **inputs: Any) -> Any:
        """Run op `op` through the full patch chain of this phase."""
        return self.table.call(op, self, inputs)

    def call_noting_patches(self, op: str, **inputs: Any) -> tuple[Any, bool]:
        """call(op), and whether it ran the stock implementations only (no patch, at any depth): then the result is
        the stock op's on these inputs (the engine's site taps reuse it instead of computing it again)."""
        before = self.table.patched_calls
        result = self.call(op, **inputs)
        return result, self.table.patched_calls == before


def kernel_lanes(row_ids: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-k lanes as a sparse-attention kernel receives them: each query's valid picks first (stable order),
    then the lanes past topk_length holding what the top-k left there (its non-causal picks); and topk_length."""
    order = torch.argsort((~valid).to(torch.int8), dim=-1, stable=True)
    return row_ids.gather(-1, order), valid.sum(-1)


def _lanes_of_slots(inputs: dict[str, Any]) -> dict[str, Any]:
    """sparse_attention's kernel lanes when the caller gave none (a plugin written before they existed, wrapping a
    newer one): the lanes of the comp_slots it passed, their valid rows first; past topk_length they hold −1, since
    what the top-k left there was not handed down."""
    lanes, length = kernel_lanes(inputs["comp_slots"], inputs["comp_slots"] >= 0)
    return {"comp_lanes": lanes, "comp_length": length}


OPTIONAL_FROM_REQUIRED: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {"sparse_attention": _lanes_of_slots}
"""Per op, how its optional inputs follow from the required ones, for an implementation that declares them when
its caller passed none."""


def _declared(fn: Callable[..., Any], name: str, inputs: dict[str, Any]) -> dict[str, Any]:
    """`inputs` without the optional ones `fn` does not declare (OpSpec.optional), and with the ones it declares but
    was not given derived from the required inputs (OPTIONAL_FROM_REQUIRED)."""
    optional = OP_SPECS[name].optional
    if not optional:
        return inputs
    accepted = _parameters(fn)
    if accepted is None:  # **kwargs: takes everything given
        return inputs
    missing = [k for k in optional if k in accepted and k not in inputs]
    if missing and name in OPTIONAL_FROM_REQUIRED:
        derived = OPTIONAL_FROM_REQUIRED[name](inputs)
        inputs = {**inputs, **{k: derived[k] for k in missing}}
    return {k: v for k, v in inputs.items() if k not in optional or k in accepted}


@functools.lru_cache(maxsize=None)
def _parameters(fn: Callable[..., Any]) -> frozenset[str] | None:
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params)


class OpTable:
    """The op chains of one variant in one phase: base implementation at the bottom, patches on top."""

    def __init__(self, base_impls: dict[str, Callable[..., Any]], choices: list[PatchChoice], phase: str) -> None:
        missing = sorted(set(OP_SPECS) - set(base_impls))
        if missing:
            raise ValueError(f"base engine lacks implementations of ops {missing}")
        self.phase = phase
        self.patched_calls = 0
        """How many patch implementations have run through this table: a call during which it did not grow ran the
        stock implementations only, so its result is the stock op's (the engine's site taps reuse it)."""
        self.chains: dict[str, list[tuple[Callable[..., Any], PatchChoice | None]]] = {
            name: [(fn, None)] for name, fn in base_impls.items()}
        for choice in choices:
            if phase not in choice.patch.active_phases(choice.options):
                continue
            for name, fn in choice.patch.ops.items():
                self.chains[name].append((fn, choice))

    def call(self, name: str, ctx: OpContext, inputs: dict[str, Any]) -> Any:
        return self._invoke(name, len(self.chains[name]) - 1, ctx, inputs)

    def patched(self, name: str) -> bool:
        """Whether a patch implements op `name` in this phase (the stock implementation may then never run)."""
        return len(self.chains[name]) > 1

    def patched_beyond_harness(self, *names: str) -> bool:
        """Whether a patch other than the harness's own (decision forcing, which hands down the reference's picks)
        implements one of ops `names` in this phase: a built-in's or a plugin's, whose kernel a site must judge."""
        return any(choice is not None and choice.patch.source != HARNESS_SOURCE
                   for name in names for _, choice in self.chains[name])

    def _invoke(self, name: str, level: int, ctx: OpContext, inputs: dict[str, Any]) -> Any:
        fn, choice = self.chains[name][level]
        inputs = _declared(fn, name, inputs)
        if choice is None:
            if not ctx.options and ctx.patch_id is None and ctx.base is None:  # already a stock op's view
                return fn(ctx, **inputs)
            return fn(ctx.with_fields(options={}, patch_id=None, base=None), **inputs)
        self.patched_calls += 1
        sub = ctx.with_fields(options=choice.options, patch_id=choice.id,
                              base=lambda **kw: self._invoke(name, level - 1, ctx, kw))
        try:
            return fn(sub, **inputs)
        except PluginOpError:
            raise
        except Exception as e:  # noqa: BLE001 - a patch's failure must name the patch and the op
            raise PluginOpError(f"patch '{choice.id}' ({choice.patch.source}) failed in op '{name}' at layer "
                                f"{ctx.layer}, {ctx.phase} segment {ctx.segment}: {type(e).__name__}: {e}") from e
