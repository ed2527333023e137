"""A layer's stacks dealt into two host threads on a GPU, so that one stack's Python runs while another's kernels
keep the device busy (issue #14).

At Flash width a lockstep layer is neither host- nor GPU-bound throughout: the engines' prefills are mostly GPU
time, their decode steps and the comparisons mostly host time, one after the other. Two host threads queue kernels
on the same CUDA stream, so the device runs every kernel in the order it was queued and computes the same bits as
one thread would; only the interleaving of the two threads' kernels changes.

What must not change is what a patch sees. Patches are Python (plugins among them) and may keep state between
calls, so every pair that runs patch code stays in one thread — the caller's — in the order of a sequential run:
the *patched lane*. The other lane holds only the pairs that run no patch code: the yardstick and the variants
without patches (the stock engine). A stock pair whose prefill a patched pair continues from, or whose local layer a
patched pair takes (harness.run.prefill_sharing: `only:hash-topk` computes `base`'s layer where hash-topk does not
act), joins the patched lane, ahead of it as before, so no share crosses threads.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from harness.run.prefill_sharing import layer_keys, pair_keys
from optimized.patching import PluginOpError
from reference.weights.dense_cache import layer_dense_bytes

Pair = tuple[str, str]


def cache_holds_every_copy(spec: Any, layer: int, budget_bytes: float) -> bool:
    """Whether layer `layer`'s dense cache (reference.weights.dense_cache, `budget_bytes`) holds the fp32 copy of every
    tensor of the layer — then the runner makes them all before the layer's first stack (DenseCache.fill), before the
    second thread starts. The runner runs the lanes on the fill's own answer (runner.ReferencePass.filled); this
    predicts it for the memory estimate and bench/lanes_ab.py.

    The lanes need it: a cache that runs out admits whichever thread asks first, and a weight it did not admit is
    multiplied on another path (DenseCache.bf16_exact: fp32 GEMMs instead of tensor cores; the per-expert loop instead
    of grouped GEMMs), so the bits would follow the threads' interleaving. What a lane may still put into the cache
    while the other runs gives the same bits kept or not: a bf16-rounded copy (optimized.base_ops.rounded_weight), the
    experts' bf16 stacks (DenseCache.bf16_stack: the grouped GEMMs read them or cast the fp32 copies, the same
    values), an NVFP4 form load_weight derives or converts, and nvfp4-experts' tensor-core operands, made on use when
    the cache did not keep them (base_ops.nvfp4_operand_made). So the forms need no room of their own (until the
    twenty-ninth session they were counted: an H100, whose cache holds a Flash layer's copies but not their 25.8 GB
    of forms as well, ran one lane with nvfp4-experts)."""
    fp32, _ = layer_dense_bytes(spec.source.config, layer)
    return fp32 <= budget_bytes


_NONE = object()
"""A key no pair has: a pair without a key shares with none."""


def lanes_of(spec: Any, pairs: Sequence[Pair], share_prefill: bool = True, layer: int | None = None,
             share_layers: bool = True) -> list[list[Pair]]:
    """deal_lanes for run spec `spec`'s pairs `pairs` (share_prefill / share_layers: whether its variants share
    prefills and, at layer `layer`, local layers; None: no layer's). One lane when the run dumps tensors: its dump
    sink names the stack running by a field that both threads would set."""
    if spec.dump_taps:
        return [list(pairs)]
    patched = {v.name: bool(v.choices) for v in spec.variants}
    prefill = pair_keys(spec, list(pairs)) if share_prefill else {}
    shared_layers = layer_keys(spec, list(pairs), layer) if share_layers and layer is not None else {}
    return deal_lanes(pairs, patched, prefill, shared_layers)


def deal_lanes(pairs: Sequence[Pair], patched: dict[str, bool], prefill: dict[Pair, Any],
               layers: dict[Pair, Any] | None = None) -> list[list[Pair]]:
    """[patched lane, stock lane], each in the order of `pairs`; one lane (all of `pairs`) when either would be
    empty. `patched[name]`: whether stack `name` runs any patch (the yardstick and a variant without patches do not;
    forced mode adds the forcing patch, so a pair in mode 'forced' is patched); `prefill` / `layers`: the prefill key
    and the layer's local layer key of each pair that may share one — a stock pair with the key of a
    patched pair stays in the patched lane, so that the patched pair can continue from its prefill or take its layer
    (harness.run.prefill_sharing: no share crosses threads)."""
    layers = layers or {}

    def runs_patches(pair: Pair) -> bool:
        return pair[1] == "forced" or patched.get(pair[0], False)

    patched_prefills = {prefill[p] for p in pairs if runs_patches(p) and p in prefill}
    patched_layers = {layers[p] for p in pairs if runs_patches(p) and p in layers}
    stock = [p for p in pairs if not runs_patches(p) and prefill.get(p, _NONE) not in patched_prefills
             and layers.get(p, _NONE) not in patched_layers]
    rest = [p for p in pairs if p not in stock]
    return [list(pairs)] if not stock or not rest else [rest, stock]


class LaneStopped(Exception):
    """Raised in a lane, between two pairs, once the other lane has failed: it stops without an error of its own."""


def is_device_fault(error: BaseException) -> bool:
    """A CUDA error: sticky on its device, so every later CUDA call of either thread fails with it, wherever the
    fault came from."""
    accelerator_error = getattr(torch, "AcceleratorError", None)
    return (accelerator_error is not None and isinstance(error, accelerator_error)) or "CUDA error" in str(error)


def blamed_lane(errors: dict[int, BaseException], pair_index: dict[int, int]) -> int:
    """Which lane's error stops the run when both failed (0: patched, 1: stock; `pair_index`: the position in the
    run's stack order of the pair each failed in). The patched lane's when its error is a plugin's (PluginOpError)
    or when the stock lane's is a device fault, which the patched lane's kernels may have caused (a sequential run
    finishes the stock pairs before any patched kernel runs); a KeyboardInterrupt over either; else the earlier
    pair, as a sequential run would have met it first."""
    if len(errors) == 1:
        return next(iter(errors))
    interrupted = [i for i, e in errors.items() if isinstance(e, KeyboardInterrupt)]
    if interrupted:  # Ctrl-C: the run is interrupted, whatever else failed meanwhile
        return interrupted[0]
    if isinstance(errors[0], PluginOpError) or is_device_fault(errors[1]):
        return 0
    return min(errors, key=lambda i: pair_index[i])
