"""Which variants an attribution pass runs (DESIGN §6): base, each patch alone, all but one, all.

All of them run in ONE layer-major pass beside a single reference computation, so the reference cost
is paid once however many variants there are. Names are stable and parseable:
`base`, `only:<id>`, `all-but:<id>`, `all`, and for the interaction pass `pair:<id>+<id>`.
"""

from __future__ import annotations

from itertools import combinations

from harness.run.runner import VariantSpec
from optimized.patching import PatchChoice

BASE, ALL = "base", "all"


def only(patch_id: str) -> str:
    return f"only:{patch_id}"


def all_but(patch_id: str) -> str:
    return f"all-but:{patch_id}"


def pair(a: str, b: str) -> str:
    return f"pair:{a}+{b}"


def attribution_variants(choices: list[PatchChoice]) -> list[VariantSpec]:
    """base, only:p for each patch, all-but:p for each patch (when there are ≥ 3 patches; with two,
    all-but:a is only:b), and all."""
    variants = [VariantSpec(BASE, [])]
    variants += [VariantSpec(only(c.id), [c]) for c in choices]
    if len(choices) >= 3:
        variants += [VariantSpec(all_but(c.id), [o for o in choices if o.id != c.id]) for c in choices]
    if len(choices) >= 2:
        variants.append(VariantSpec(ALL, list(choices)))
    return variants


def leave_one_out_name(patch_ids: list[str], patch_id: str) -> str:
    """The variant that has every patch but `patch_id` (for two patches, that is the other one alone)."""
    if len(patch_ids) == 1:
        return BASE
    if len(patch_ids) == 2:
        return only(next(p for p in patch_ids if p != patch_id))
    return all_but(patch_id)


def full_name(patch_ids: list[str]) -> str:
    """The variant with every patch."""
    return ALL if len(patch_ids) >= 2 else only(patch_ids[0])


def pair_variants(choices: list[PatchChoice], ids: list[str]) -> list[VariantSpec]:
    """Every pair among `ids` (the interaction pass of delta debugging, depth two)."""
    by_id = {c.id: c for c in choices}
    return [VariantSpec(pair(a, b), [by_id[a], by_id[b]]) for a, b in combinations(ids, 2)]
