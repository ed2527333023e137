"""How a sharded run deals its (stack, mode) pairs over its ranks (harness.run.deal)."""

from __future__ import annotations

import pytest

from harness.attribution.plan import attribution_variants
from harness.run.deal import REFERENCE_COST, _units, deal, pair_cost
from harness.run.prefill_sharing import pair_keys
from harness.run.setup import Overrides, build_run_spec
from harness.scenario import find_scenario, load_scenario


def _spec(name: str, patches: str | None = "all", attribution: bool = False, **decode):
    spec = build_run_spec(load_scenario(find_scenario(name)), Overrides(patches=patches), **decode)[0]
    if attribution:
        spec.variants = attribution_variants(spec.variants[-1].choices)
    return spec


def _loads(spec, shares: list[list[tuple[str, str]]]) -> list[float]:
    """Each rank's cost by the deal's own table: its units' costs, the last rank's plus the reference's."""
    cost = {tuple(members): c for members, c in _units(spec, spec.stacks())}
    return [sum(c for members, c in cost.items() if members[0] in share) + REFERENCE_COST * (r == len(shares) - 1)
            for r, share in enumerate(shares)]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("attribution", [False, True])
def test_every_pair_runs_once_in_stack_order_and_shared_prefills_stay_together(world, attribution):
    spec = _spec("tiny-smoke", attribution=attribution)
    shares = deal(spec, world)
    assert len(shares) == world
    assert sorted(p for share in shares for p in share) == sorted(spec.stacks())
    order = {pair: i for i, pair in enumerate(spec.stacks())}
    for share in shares:
        assert [order[p] for p in share] == sorted(order[p] for p in share)
    if world == 1:
        assert shares == [spec.stacks()]
    rank_of = {p: r for r, share in enumerate(shares) for p in share}
    assert deal(spec, world) == shares  # every rank computes it on its own: the same each time
    keys = pair_keys(spec, spec.stacks())
    assert attribution == any(list(keys.values()).count(k) > 1 for k in keys.values())  # the attribution shares
    for pair, key in keys.items():  # pairs that share a prefill are on one rank, so a sharded run shares it too
        assert all(rank_of[other] == rank_of[pair] for other, k in keys.items() if k == key)


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_the_deal_is_no_busier_than_dealing_pair_i_to_rank_i_mod_n(world):
    """The old deal (pair i on rank i mod N) ignored the pairs' costs; by the same cost table the new deal's busiest
    rank never carries more. Specs where no pairs share a prefill, so each unit is one pair as in the old deal."""
    for spec in (_spec("tiny-smoke"), _spec("tiny-smoke", "none"), _spec("demo-cpu", None, decode_ids=[1000] * 32)):
        assert all(len(members) == 1 for members, _ in _units(spec, spec.stacks()))
        new = max(_loads(spec, deal(spec, world)))
        old = max(_loads(spec, [spec.stacks()[r::world] for r in range(world)]))
        assert new <= old + 1e-9


def test_the_demo_deals_the_yardstick_and_base_against_all_beside_the_reference():
    """The measured case (harness.run.deal): pair i mod 2 gave rank 0 the yardstick and `all` (68.1 s of the
    demo's work) and rank 1 `base` and the reference (57.0 s); by cost, 62.2 s and 62.9 s."""
    spec = _spec("demo-cpu", None, decode_ids=[1000] * 32)
    assert deal(spec, 2) == [[("yardstick", "global"), ("base", "global")], [("all", "global")]]
    loads = _loads(spec, deal(spec, 2))
    assert max(loads) / min(loads) < 1.05  # by the table 2.45 against 2.49; round-robin's were 2.69 against 2.25


def test_without_decode_steps_a_shared_prefill_costs_each_pair_in_full():
    """Nothing is kept to continue from without decode steps (prefill_sharing.kept_prefill_keys), so every pair of a
    group runs in full and is costed so."""
    spec = _spec("tiny-smoke", attribution=True)
    grouped = {tuple(m): c for m, c in _units(spec, spec.stacks()) if len(m) > 1}
    spec.decode_ids, spec.turn_of_position = [], spec.turn_of_position[: spec.n_prompt]
    full = {tuple(m): c for m, c in _units(spec, spec.stacks()) if len(m) > 1}
    assert grouped.keys() == full.keys() and all(full[k] > grouped[k] for k in full)
    for members, c in full.items():  # global groups: every pair in full; local ones: the layers a pair shares cost 0
        if members[0][1] == "global":
            assert abs(c - sum(pair_cost(spec, name) for name, _ in members)) < 1e-12


def test_local_pairs_that_share_a_layer_are_dealt_together_and_costed_by_the_layers_they_compute():
    """Attribution on tiny (SWA, SWA hash-routed; CSA hash-routed; HCA; CSA): triton-indexer and bf16-indexer-gemm
    act on CSA layers only, hash-topk on hash layers only (Patch.layers_for), so in local mode only:<each of them>
    computes base's layer elsewhere, and one group holds base, only:mma-sparse-decode and those three. Its cost by
    layer, with the table's costs (base 1.45, one patch 1.49, a continued prefill 0.3 of that): layers 0 and 1 base
    + only:mma continued + only:hash 1.45 + 0.447 + 1.49; layer 2 base + only:mma and only:triton continued +
    only:bf16 + only:hash 1.45 + 2 · 0.447 + 2 · 1.49; layer 3 base + only:mma; layer 4 as layer 2 without hash."""
    spec = _spec("tiny-smoke", attribution=True)
    units = {tuple(m): c for m, c in _units(spec, spec.stacks())}
    group = next(m for m in units if ("base", "local") in m)
    assert {name for name, _ in group} == {"base", "only:mma-sparse-decode", "only:triton-indexer",
                                          "only:bf16-indexer-gemm", "only:hash-topk"}
    full, continued = pair_cost(spec, "only:hash-topk"), 0.3 * pair_cost(spec, "only:hash-topk")
    base = pair_cost(spec, "base")
    by_layer = [base + continued + full] * 2 + [base + 2 * continued + 2 * full, base + continued,
                                                 base + 2 * continued + full]
    assert abs(units[group] - sum(by_layer) / 5) < 1e-12
    for world in (2, 3):
        rank_of = {p: r for r, share in enumerate(deal(spec, world)) for p in share}
        assert len({rank_of[p] for p in group}) == 1
