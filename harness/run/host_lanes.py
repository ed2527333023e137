"""A layer's stacks dealt into two host threads on a GPU, so that one stack's Python runs while another's kernels
keep the device busy (issue #14).

At Flash width a lockstep layer is neither host- nor GPU-bound throughout: the engines' prefills are mostly GPU
time, their decode steps and the comparisons mostly host time, one after the other. Two host threads queue kernels
on the same CUDA stream, so the device runs every kernel in the order it was queued and computes the same bits as
one thread would; only the interleaving of the two threads' kernels changes.

What must not change is what a patch sees. Patches are Python (plugins among them) and may keep state between
calls, so every pair that runs patch code stays in one thread — the caller's — in the order of a sequential run:
the *patched lane*. The other lane holds only the pairs that run no patch code: the yardstick and the variants
without patches (the stock engine). A stock pair whose prefill a patched pair continues from
(harness.run.prefill_sharing) joins the patched lane, ahead of it as before, so no share crosses threads.
"""

from __future__ import annotations

from typing import Any, Sequence

from harness.run.prefill_sharing import pair_keys

Pair = tuple[str, str]


def lanes_of(spec: Any, pairs: Sequence[Pair], share_prefill: bool = True) -> list[list[Pair]]:
    """deal_lanes for run spec `spec`'s pairs `pairs` (share_prefill: whether its variants share prefills). One lane
    when the run dumps tensors: its dump sink names the stack running by a field that both threads would set."""
    if spec.dump_taps:
        return [list(pairs)]
    patched = {v.name: bool(v.choices) for v in spec.variants}
    return deal_lanes(pairs, patched, pair_keys(spec, list(pairs)) if share_prefill else {})


def deal_lanes(pairs: Sequence[Pair], patched: dict[str, bool], prefill_keys: dict[Pair, Any]) -> list[list[Pair]]:
    """[patched lane, stock lane], each in the order of `pairs`; one lane (all of `pairs`) when either would be
    empty. `patched[name]`: whether stack `name` runs any patch (the yardstick and a variant without patches do not;
    forced mode adds the forcing patch, so a pair in mode 'forced' is patched); `prefill_keys`: the prefill key of
    each pair that may share its prefill."""
    def runs_patches(pair: Pair) -> bool:
        return pair[1] == "forced" or patched.get(pair[0], False)

    patched_keys = {prefill_keys[p] for p in pairs if runs_patches(p) and p in prefill_keys}
    stock = [p for p in pairs if not runs_patches(p) and prefill_keys.get(p) not in patched_keys]
    rest = [p for p in pairs if p not in stock]
    return [list(pairs)] if not stock or not rest else [rest, stock]
