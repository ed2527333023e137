"""Which rank of a sharded run computes which (stack, mode) pairs: dealt by their cost, so the ranks finish a layer
together.

Every rank waits for the others at the end of each layer (its rows are gathered to rank 0), so a layer takes as
long as its busiest rank. Dealing pair i to rank i mod N ignored that the pairs cost different amounts: in the CPU
demo (2 ranks; reference, yardstick, `base`, `all`, global mode) rank 0 got the yardstick and `all`, 68.1 s of
work over the 43 layers, and rank 1 the reference and `base`, 57.0 s — and waited 18 s in the gathers. The costs
below are the demo's per-stack seconds (flash-mini, 8,002 + 32 tokens, one thread) relative to the yardstick's. A
Flash CSA layer's stacks on an H200 (README, Benchmarks, by region) come in the same order, the engines relatively
dearer there (reference 1.06, `base` 1.96, `all` 2.48): a GPU deal from this table may be less even than the
demo's, never worse ordered. With them the demo deals the yardstick and `base` to rank 0 (62.2 s) and `all` to rank
1 beside the reference (62.9 s; measured after the change: 63.4 s with rank 0's writing, 59.2 s).

A stack's global mode, which carries its own streams from layer to layer, stays on one rank (the deal is fixed for
the run), and pairs that share a prefill or, in local mode, a layer (harness.run.prefill_sharing) are dealt
together, so a sharded run shares what one process shares (attribution over the six built-in patches on 2 ranks
shared 8 of tiny-smoke's 16 local layer shares before the layers counted here). The deal is a longest-first greedy one, then single moves and swaps between the busiest
rank and another while they lower the busiest rank's load: deterministic, and every rank computes the same deal.
"""

from __future__ import annotations

from typing import Any

from harness.run.prefill_sharing import layer_keys, pair_keys

REFERENCE_COST = 0.8
"""The reference's pass over a layer (demo: 20.2 s against the yardstick's 25.4 s), on the reference rank."""
YARDSTICK_COST = 1.0
ENGINE_COST = 1.45
"""An engine pair without patches (demo: `base` 36.8 s)."""
PATCH_COST = 0.04
"""Each patch a variant runs adds its op and its decision sites' stock and twin calls (demo: `all`, six patches,
42.7 s: (42.7 / 25.4 − 1.45) / 6)."""
CONTINUED_SHARE = 0.3
"""A pair that continues another's prefill (prefill_sharing) runs its decode steps and comparisons only: about
this share of a pair in full (the demo's decode stacks, comparisons and finish: ~0.3–0.45 s of a CSA layer's ~1.4 s
per engine pair, one thread)."""


GAIN_FLOOR = 1e-9
"""The least drop of the busiest load a move or swap must make: loads are sums of a few table entries (~1), whose
fp64 rounding (~1e-16 each) must not count as a gain — else equal loads could trade units back and forth."""


def pair_cost(spec: Any, name: str) -> float:
    """The cost of one (stack, mode) pair of stack `name`, relative to the yardstick's (the mode does not change it)."""
    if name == "yardstick":  # runner.YARDSTICK (the runner imports this module)
        return YARDSTICK_COST
    choices = next((v.choices for v in spec.variants if v.name == name), [])
    return ENGINE_COST + PATCH_COST * len(choices)


def _units(spec: Any, pairs: list[tuple[str, str]]) -> list[tuple[list[tuple[str, str]], float]]:
    """The pairs grouped so that a sharded run shares what one process shares: pairs that share a prefill, and local
    pairs that share a layer (prefill_sharing.layer_keys, at any layer), are one group (one per pair that shares
    nothing), in `pairs`' order. Each group's cost is the mean over the layers of what its pairs compute at each, in
    order, as the runner does: nothing for a pair whose layer an earlier one computed, CONTINUED_SHARE of its cost
    for one that continues an earlier one's prefill, else its cost."""
    prefill = pair_keys(spec, pairs)
    n_layers = spec.source.config.num_hidden_layers
    by_layer = [layer_keys(spec, pairs, layer) for layer in range(n_layers)]
    parent = {pair: pair for pair in pairs}

    def root(pair: tuple[str, str]) -> tuple[str, str]:
        while parent[pair] != pair:
            pair = parent[pair]
        return pair

    for keys in [prefill, *by_layer]:
        first: dict[Any, tuple[str, str]] = {}
        for pair, key in keys.items():
            a, b = root(first.setdefault(key, pair)), root(pair)
            if a != b:  # the group's root is its earliest pair
                parent[max(a, b, key=pairs.index)] = min(a, b, key=pairs.index)
    groups: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for pair in pairs:
        groups.setdefault(root(pair), []).append(pair)
    continued = CONTINUED_SHARE if spec.decode_ids else 1.0  # without decode steps nothing is kept to continue from
    units = []
    for members in groups.values():
        total = 0.0
        for keys in by_layer:
            layers_run, prefills_run = set(), set()
            for pair in members:
                if keys.get(pair) is not None and keys[pair] in layers_run:
                    continue
                cost = pair_cost(spec, pair[0])
                total += continued * cost if prefill.get(pair) is not None and prefill[pair] in prefills_run else cost
                layers_run.add(keys.get(pair))
                prefills_run.add(prefill.get(pair))
        units.append((members, total / n_layers))
    return units


def deal(spec: Any, world: int) -> list[list[tuple[str, str]]]:
    """Each rank's pairs (in spec.stacks() order) for a run over `world` ranks whose last rank runs the reference."""
    pairs = spec.stacks()
    if world == 1:
        return [pairs]
    units = _units(spec, pairs)
    owner = [0] * len(units)
    load = [0.0] * world
    load[world - 1] = REFERENCE_COST
    for i in sorted(range(len(units)), key=lambda i: -units[i][1]):  # longest first (stable: stacks() order)
        rank = min(range(world), key=lambda r: (load[r], r))
        owner[i] = rank
        load[rank] += units[i][1]
    while _improve(units, owner, load):
        pass
    order = {pair: i for i, pair in enumerate(pairs)}
    return [sorted((p for i, (members, _) in enumerate(units) if owner[i] == rank for p in members), key=order.get)
            for rank in range(world)]


def _improve(units: list[tuple[list[tuple[str, str]], float]], owner: list[int], load: list[float]) -> bool:
    """One move of a unit off the busiest rank, or one swap of a unit there with a cheaper one elsewhere, that
    lowers the busier of the two ranks' loads below the busiest's (the first such, in a fixed order); whether one
    was made. Each step lowers the sum of squared loads, so the loop ends."""
    busiest = max(range(len(load)), key=lambda r: (load[r], -r))
    top = load[busiest]
    for i in (i for i in range(len(units)) if owner[i] == busiest):
        cost = units[i][1]
        for other in range(len(load)):
            if other == busiest:
                continue
            if load[other] + cost < top - GAIN_FLOOR:  # move it
                owner[i], load[busiest], load[other] = other, top - cost, load[other] + cost
                return True
            for j in (j for j in range(len(units)) if owner[j] == other and units[j][1] < cost):
                delta = cost - units[j][1]
                if max(top - delta, load[other] + delta) < top - GAIN_FLOOR:  # swap them
                    owner[i], owner[j] = other, busiest
                    load[busiest], load[other] = top - delta, load[other] + delta
                    return True
    return False
