"""The reference against transformers' DeepseekV4, layer by layer, in fp32 (DESIGN §9: the ruler is checked).

Both models get the same weights: `hf_oracle.build_hf_model` fills a tiny transformers model with
non-trivial random values, `hf_weights_state_dict` exports them under the official names, and the
reference reads them through `InMemoryWeights`. The tiny "flash-like" config has Flash's schedule
(SWA, SWA, CSA, HCA, CSA, HCA, CSA), hash routing on layers 0-2 and learned routing after, and
index_topk 24 — a 1101-token prompt gives 275 compressed rows per CSA layer, >10x the top-k.

What is compared: every layer's output streams [T, hc, D] and the logits (relative L2) at every
position, plus every discrete choice (indexer rows, expert ids). The reference runs with decision
forcing (`test_reference_selections.run_reference`): where its own pick differs from transformers',
it records its pick and continues with transformers', and `compare_choices` then requires each such
difference to be a near-tie flip (fp32 noise, spec §11.13) and such flips to be rare. The seeds of
the main tests were picked so that no flip happens on the machine they were written on (nothing is
forced there); `test_near_tie_flips_are_rare_and_judged_by_score_gap` runs a seed that flips.

HF always runs with stable ties (lower index wins, spec §5.3) and through its cache (`hf_run`).
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")

from hf_oracle import _chunk_plan, build_hf_model, hf_run, hf_weights_state_dict, tiny_hf_config  # noqa: E402
from test_reference_selections import (  # noqa: E402
    choices_from_hf,
    compare_choices,
    rel_l2,
    run_reference,
)

from reference.config import config_from_hf_dict  # noqa: E402
from reference.model import ReferenceModel  # noqa: E402
from reference.ops.rope import cos_sin, layer_inverse_frequencies  # noqa: E402
from reference.weights.memory import InMemoryWeights  # noqa: E402
import reference.ops.indexer  # noqa: E402

MAX_REL_L2 = 1e-5
"""Per-layer streams and logits, fp32 vs fp32. Spec §2 measured <= 2.2e-6 relative L2 for an
independent implementation on two tiny configs (1108-4500 tokens); this reference measures 2.1e-6 ..
3.3e-6 on the logits and <= 3.3e-6 per layer here (<= 4.4e-6 with an earlier blocking of its attention;
drift grows with depth). 1e-5 leaves >= 2x; a one-ulp-class bug (fp64 RoPE angles, spec §4.3) shows as
~8e-6 per layer only at long prompts (hence the exact table check below), real bugs as >= 1e-3."""

PROMPT_TOKENS = 1101  # not a multiple of 4 (CSA) nor 128 (HCA, window): 1101 = 4*275 + 1 = 128*8 + 77
FLASH_LIKE_SEED, FLASH_LIKE_IDS_SEED = 1, 101  # no near-tie flip on the writing machine


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: on 2 busy cores intra-op threads only add overhead (token-by-token runs were 7x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.lru_cache(maxsize=None)
def oracle(kind: str, seed: int):
    """(transformers model, reference model) with identical weights."""
    hf_config = tiny_hf_config(kind)
    hf_model = build_hf_model(hf_config, seed=seed)
    cfg = config_from_hf_dict(hf_config.to_dict(), name=f"hf-{kind}")
    return hf_model, ReferenceModel(InMemoryWeights(cfg, hf_weights_state_dict(hf_model), label=f"hf {kind}"))


def random_ids(n: int, seed: int, vocab: int = 512) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def compare_with_hf(model: ReferenceModel, hf_model, ids: list[int], chunk_sizes=None, decode_steps: int = 0,
                    label: str = ""):
    """Run both sides with the same chunking, the reference forced to transformers' choices where its own
    differ; judge those differences, then compare every layer's streams and the logits at every position.

    Returns (per-layer rel L2, logits rel L2, the choice comparison, the reference run).
    """
    cfg = model.cfg
    hf = hf_run(hf_model, ids, chunk_sizes=chunk_sizes, decode_steps=decode_steps, layer_outputs=True,
                record_selections=True)
    segments = _chunk_plan(len(ids) - decode_steps, chunk_sizes) + [1] * decode_steps
    assert [b - a for _phase, a, b in hf.segments] == segments  # both sides see the same calls
    hash_layers = [L for L in range(cfg.num_hidden_layers) if cfg.is_hash_layer(L)]
    hf_choices = choices_from_hf(hf, cfg.index_topk, cfg.num_experts_per_tok, hash_layers)
    ref = run_reference(model, ids, segments, forced=hf_choices)
    cmp = compare_choices(ref.choices, hf_choices)

    per_layer = [rel_l2(mine, theirs) for mine, theirs in zip(ref.layer_outputs, hf.layer_outputs, strict=True)]
    logits_err = rel_l2(ref.logits, hf.logits)
    print(f"\n{label}: reference vs transformers, {len(ids)} tokens, "
          f"segments {segments[:7]}{' + decode steps' if decode_steps else ''}")
    for layer, err in enumerate(per_layer):
        print(f"  layer {layer} ({cfg.layer_kind(layer)}, {'hash' if cfg.is_hash_layer(layer) else 'learned'} "
              f"routing): rel L2 {err:.2e}")
    print(f"  logits: rel L2 {logits_err:.2e}; {cmp.summary()}")

    cmp.assert_agree(f"{label}: reference vs transformers choices")
    for layer, err in enumerate(per_layer):
        assert err <= MAX_REL_L2, (f"{label}: layer {layer} ({cfg.layer_kind(layer)}) output streams differ from "
                                   f"transformers by {err:.2e} relative L2, expected <= {MAX_REL_L2:.0e}")
    assert logits_err <= MAX_REL_L2, (f"{label}: logits differ from transformers by {logits_err:.2e} relative L2, "
                                      f"expected <= {MAX_REL_L2:.0e}")
    return per_layer, logits_err, cmp, ref


def test_flash_like_one_shot_layer_by_layer():
    hf_model, model = oracle("flash-like", FLASH_LIKE_SEED)
    cfg = model.cfg
    # the config covers every path this test claims to cover
    assert set(cfg.layer_kinds) == {"swa", "csa", "hca"}
    assert any(cfg.hash_layers) and not all(cfg.hash_layers)
    assert PROMPT_TOKENS % 4 and PROMPT_TOKENS % 128
    assert PROMPT_TOKENS // cfg.compress_rate_csa > 10 * cfg.index_topk
    ids = random_ids(PROMPT_TOKENS, FLASH_LIKE_IDS_SEED)

    _per_layer, _logits_err, cmp, ref = compare_with_hf(model, hf_model, ids, label="flash-like one-shot")
    assert cmp.n_decisions > 3000  # 3 CSA layers x ~1000 queries with more candidates than top-k, + routers

    # the public entry point computes exactly what the layer-by-layer helper computed (without flips,
    # nothing was forced and the runs are bit-identical)
    if ref.forced_count == 0:
        forward = model.forward(ids, keep_layer_outputs=True)
        assert torch.equal(forward.logits, ref.logits)
        assert all(torch.equal(a, b) for a, b in zip(forward.layer_outputs, ref.layer_outputs, strict=True))


@pytest.mark.slow
def test_flash_like_chunked_prefill_and_decode():
    """Chunks 1, 3, 127, 129, then 367 each: boundaries at 1, 4, 131, 260, 627, 994 split CSA windows
    (1, 131, 627, 994) and cross the 128-token window edge; 60 teacher-forced decode steps follow
    (positions 1101-1160), during which 15 CSA rows and HCA row 8 (tokens 1024-1151, emitted at 1151) complete."""
    hf_model, model = oracle("flash-like", FLASH_LIKE_SEED)
    ids = random_ids(PROMPT_TOKENS + 60, FLASH_LIKE_IDS_SEED)
    chunks = [1, 3, 127, 129, 367]
    plan = _chunk_plan(PROMPT_TOKENS, chunks)
    boundaries = torch.tensor(plan).cumsum(0)[:-1]
    assert plan == [1, 3, 127, 129, 367, 367, 107]
    assert bool((boundaries % 4 != 0).any()) and bool((boundaries % 128 != 0).all())
    assert any(a < 128 <= b for a, b in zip([0, *boundaries.tolist()], boundaries.tolist()))
    compare_with_hf(model, hf_model, ids, chunk_sizes=chunks, decode_steps=60, label="flash-like chunked + decode")


@pytest.mark.parametrize("kind, seed, ids_seed", [
    ("yarn", 0, 11),  # YaRN (factor 4) on the compressed layers only, no mscale (spec §4.3)
    ("distinct-eps", 0, 12),  # rms_norm_eps 5e-3 != hc_eps 2e-2: each eps in its place (spec §3.1)
    ("swiglu-clamp", 1, 13),  # swiglu_limit 0.3: one-sided gate clamp, two-sided up clamp (spec §6.2)
    ("stress", 0, 14),  # all three at once
])
def test_other_config_kinds(kind, seed, ids_seed):
    hf_model, model = oracle(kind, seed)
    cfg = model.cfg
    if kind in ("yarn", "stress"):
        assert cfg.yarn is not None and cfg.yarn.factor == 4.0
    if kind in ("distinct-eps", "stress"):
        assert (cfg.rms_norm_eps, cfg.hc_eps) == (5e-3, 2e-2)
    if kind in ("swiglu-clamp", "stress"):
        assert cfg.swiglu_limit == 0.3
    n = 701  # 175 compressed rows per CSA layer vs index_topk 24; not a multiple of 4 or 128
    compare_with_hf(model, hf_model, random_ids(n, ids_seed), chunk_sizes=[257], decode_steps=3, label=kind)


def test_near_tie_flips_are_rare_and_judged_by_score_gap():
    """A seed that flips. On the writing machine (1 thread) seed 4 flips 1-3 picks per run, which ones
    depending on the reference revision and thread count (rounding order): e.g. an indexer pick in layer 2
    at position 793 whose two rows score within 7.8e-7 of the top score (or exactly equal in the
    reference, where the lower row wins), a router pick in layer 4 at 237 (gap 1.3e-7). Without forcing,
    that layer-2 flip alone made layers 4 and 6 pick differently at ~60 later positions with gaps up to
    5e-2 and moved the logits by 1e-2; forced to transformers' pick at each flip, the reference stays
    within fp32 noise everywhere, and every difference it saw is a near tie."""
    hf_model, model = oracle("flash-like", 4)
    _per_layer, _logits_err, cmp, ref = compare_with_hf(model, hf_model, random_ids(PROMPT_TOKENS, 104),
                                                        label="flash-like seed 4")
    assert ref.forced_count == len(cmp.flips)
    for flip in cmp.flips:
        assert flip.gap <= 1e-5, (
            f"measured near-tie gaps were <= 5.1e-6; this one is larger: {flip.describe()}")
    if not cmp.flips:
        print("  (no near-tie flip on this machine: nothing was forced)")


@pytest.mark.parametrize("kind, seed", [("flash-like", FLASH_LIKE_SEED), ("yarn", 0)])
def test_rope_tables_are_bit_identical_to_transformers(kind, seed):
    """Spec §4.3: fp32 inverse frequencies (YaRN blend in fp32) and fp32 angles float32(p)·θ_i. Bit-identical
    to HF's buffers and cos/sin, at positions up to 70,000. An fp64 angle is off by up to |φ|·2^-24 rad: too
    little to exceed MAX_REL_L2 at 1101 tokens, but it flips indexer near-ties at long prompts (spec §11.13),
    so it is checked here exactly."""
    hf_model, model = oracle(kind, seed)
    cfg = model.cfg
    positions = torch.arange(0, 70_000, 7)
    probe = torch.zeros(1, dtype=torch.float32)
    for layer in range(cfg.num_hidden_layers):
        layer_type = "main" if cfg.layer_kind(layer) == "swa" else "compress"
        inv_freq = layer_inverse_frequencies(cfg, layer)
        rotary = [hf_model.model.rotary_emb]
        compressor = hf_model.model.layers[layer].self_attn.compressor
        if compressor is not None:  # the compressor and the indexer own rotary modules too
            rotary.append(compressor.rotary_emb)
            if getattr(compressor, "indexer", None) is not None:
                rotary.append(compressor.indexer.rotary_emb)
        for rot in rotary:
            assert torch.equal(inv_freq, getattr(rot, f"{layer_type}_inv_freq")), (
                f"layer {layer}: inverse frequencies {inv_freq.tolist()} differ from transformers' "
                f"{getattr(rot, f'{layer_type}_inv_freq').tolist()}")
            cos, sin = cos_sin(inv_freq, positions, torch.float32)
            hf_cos, hf_sin = rot(probe, positions[None], layer_type=layer_type)
            bad = (cos != hf_cos[0]) | (sin != hf_sin[0])
            assert not bool(bad.any()), (f"layer {layer}: cos/sin differ from transformers at positions "
                                         f"{positions[bad.any(-1)][:5].tolist()}")


def _higher_index_wins(scores: torch.Tensor, k: int) -> torch.Tensor:
    flipped = torch.sort(scores.flip(-1), dim=-1, descending=True, stable=True).indices
    return scores.shape[-1] - 1 - flipped[..., :k]


def test_a_wrong_tie_rule_is_a_genuine_disagreement(monkeypatch):
    """The comparison has teeth: breaking exact ties the other way (spec §5.3: 4.4% logits change) is
    not excused as noise — it flips picks on the ReLU zero plateau far more often than fp32 noise can."""
    hf_model, model = oracle("flash-like", FLASH_LIKE_SEED)
    monkeypatch.setattr(reference.ops.indexer, "stable_topk_set", _higher_index_wins)
    with pytest.raises(AssertionError, match="near-tie flips|beyond a near tie|differ from transformers"):
        compare_with_hf(model, hf_model, random_ids(400, FLASH_LIKE_IDS_SEED), label="higher index wins")
