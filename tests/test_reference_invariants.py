"""Invariants of the reference that need no oracle (DESIGN §9, spec §10.3, §12).

Mostly on the `tiny` preset (SWA, SWA, CSA, HCA, CSA; hash routing on 0-2; index_topk 16) with
deterministic synthetic weights; the chunking check is repeated on the flash-like transformers
weights, where 1101 tokens give 275 compressed rows per CSA layer.

Tolerances for "the same computation done differently" (chunked, token by token, a prefix) are
derived, not guessed: `NOISE_FACTOR` times the reference's own fp32 rounding noise on the same prompt,
measured per layer as fp32 vs fp64 (`noise_floor`). Two fp32 evaluations that differ only in
rounding order each sit ~one floor from the exact result, so they differ by ~1-1.4 floors
(measured 0.95-1.15 here); a chunking or causality bug is orders of magnitude larger. Discrete
choices are compared first with `compare_choices` (near-tie flips judged, the run forced onto the
baseline's choices where they differ), so a legitimate near tie cannot masquerade as a stream error.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict

import pytest
import torch

from test_reference_selections import Choices, compare_choices, rel_l2, run_reference

import reference.layer
from reference.config import TINY, YarnConfig
from reference.layer import ParityOptions
from reference.model import ReferenceModel, ensure_no_tf32, segment_lengths
from reference.ops.compressor import CompressorState, CompressorWeights, compress
from reference.ops.indexer import select_rows
from reference.ops.mhc import HCMix, hc_post, hc_pre, sinkhorn
from reference.ops.moe import route
from reference.ops.norms import rms_norm
from reference.ops.rope import apply_rope, cos_sin, inverse_frequencies, layer_inverse_frequencies
from reference.ops.topk import stable_topk_indices, stable_topk_set
from reference.quant import hadamard_matrix
from reference.weights.synthetic import SyntheticWeights

NOISE_FACTOR = 3.0
"""Allowed difference between two fp32 runs of the same math, in units of the fp32-vs-fp64 noise floor
of the same layer (see the module docstring; measured ratio <= 1.15 for token-by-token decode)."""

PROMPT_TOKENS = 301  # 75 CSA rows (> index_topk 16 from position 67 on), 2 HCA rows; 301 % 4 = 1, % 128 = 45
WEIGHT_SEED, IDS_SEED = 0, 1  # no near-tie flip between any two chunkings on the writing machine


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: on 2 busy cores intra-op threads only add overhead (token-by-token decode was 7x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def random_ids(n: int, seed: int, vocab: int = 512) -> list[int]:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@functools.lru_cache(maxsize=None)
def tiny_model(dtype: torch.dtype = torch.float32, parity: ParityOptions = ParityOptions()) -> ReferenceModel:
    return ReferenceModel(SyntheticWeights(TINY, seed=WEIGHT_SEED), dtype=dtype, parity=parity)


@functools.lru_cache(maxsize=None)
def tiny_baseline():
    """(ids, one-shot fp32 run, per-layer + logits fp32-vs-fp64 noise floor) for the tiny model."""
    ids = random_ids(PROMPT_TOKENS, IDS_SEED)
    one = run_reference(tiny_model(), ids, [len(ids)])
    return ids, one, noise_floor(tiny_model(torch.float64), ids, one)


def noise_floor(fp64_model: ReferenceModel, ids: list[int], fp32_run) -> list[float]:
    """Relative L2 of an fp32 run against the same run in fp64: per layer, then the logits.

    The fp64 run is forced onto the fp32 run's discrete choices (a near-tie flip between the two would
    measure a selection, not rounding) after checking that every difference is a near tie."""
    exact = run_reference(fp64_model, ids, [len(ids)], forced=fp32_run.choices)
    compare_choices(exact.choices, fp32_run.choices).assert_agree("fp64 vs fp32 reference choices")
    floor = [rel_l2(a, b) for a, b in zip(fp32_run.layer_outputs, exact.layer_outputs, strict=True)]
    return floor + [rel_l2(fp32_run.logits, exact.logits)]


def assert_same_run(run, baseline, floor: list[float], what: str, positions: int | None = None,
                    cfg=TINY) -> None:
    """Choices first (near ties judged), then every layer's streams and the logits within NOISE_FACTOR floors."""
    n = positions or baseline.logits.shape[0]
    cmp = compare_choices(run.choices, _first(baseline.choices, n))
    cmp.assert_agree(what)
    errors = [rel_l2(a[:n], b[:n]) for a, b in zip(run.layer_outputs, baseline.layer_outputs, strict=True)]
    errors.append(rel_l2(run.logits[:n], baseline.logits[:n]))
    names = [f"layer {L} ({cfg.layer_kind(L)})" for L in range(len(run.layer_outputs))] + ["logits"]
    print(f"\n{what}: {cmp.summary()}")
    for name, err, fl in zip(names, errors, floor, strict=True):
        print(f"  {name}: rel L2 {err:.2e} = {err / fl:.2f} x the fp32 noise floor {fl:.2e}")
    for name, err, fl in zip(names, errors, floor, strict=True):
        assert err <= NOISE_FACTOR * fl, (f"{what}: {name} differs by {err:.2e} relative L2, expected <= "
                                          f"{NOISE_FACTOR} x the fp32 noise floor {fl:.2e} = {NOISE_FACTOR * fl:.2e}")


def _first(c: Choices, n: int) -> Choices:
    """The choices of the first n positions (a prompt prefix)."""
    return Choices(n, c.index_topk, c.experts_per_tok, c.hash_layers,
                   {L: v[:n] for L, v in c.indexer.items()}, {L: v[:n] for L, v in c.indexer_scores.items()},
                   {L: v[:n] for L, v in c.experts.items()}, {L: v[:n] for L, v in c.router_scores.items()})


# ------------------------------------------------------------------------------------------------
# fp64 vs fp32: the reference's own noise floor
# ------------------------------------------------------------------------------------------------

def test_fp64_vs_fp32_is_the_noise_floor():
    _ids, one, floor = tiny_baseline()
    print("\nreference fp32 vs fp64 (tiny, 301 tokens): " + ", ".join(
        f"layer {L} {f:.2e}" for L, f in enumerate(floor[:-1])) + f"; logits {floor[-1]:.2e}")
    # non-zero beyond the final fp64->fp32 cast (<= 6e-8): the fp64 run really computed in fp64
    assert floor[-1] > 1e-7, f"fp32 and fp64 logits differ by only {floor[-1]:.2e}: was fp64 honoured?"
    # fp32 rounding (2^-24 ~ 6e-8 per op) over five layers: measured 1.8e-6
    assert floor[-1] < 1e-5, f"fp32 vs fp64 logits differ by {floor[-1]:.2e}, expected < 1e-5 (pure fp32 noise)"
    assert all(0 < f < 1e-5 for f in floor), floor
    # noise grows with depth, never shrinks by much
    assert floor[-2] > floor[0]


# ------------------------------------------------------------------------------------------------
# Chunk invariance (spec §10.3 rule 5)
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("chunk", [3, 7, 127, 129, 200])
def test_chunked_prefill_matches_one_shot(chunk):
    """Chunks of 3 and 7 split every 4-token window at varying offsets; 127 and 129 end one token before
    and after the 128-token window / HCA edge; 200 leaves a 101-token tail."""
    ids, one, floor = tiny_baseline()
    segments = segment_lengths(len(ids), 0, chunk)
    run = run_reference(tiny_model(), ids, segments, forced=one.choices)
    assert_same_run(run, one, floor, f"tiny, chunks of {chunk}")


@pytest.mark.slow
def test_token_by_token_decode_matches_one_shot():
    """The whole 301-token prompt as one-token decode steps (every window, row and cache filled one token
    at a time), against the one-shot prefill."""
    ids, one, floor = tiny_baseline()
    run = run_reference(tiny_model(), ids, segment_lengths(1, len(ids) - 1, None), forced=one.choices)
    assert_same_run(run, one, floor, "tiny, token by token")


def test_forward_entry_points_agree():
    """ReferenceModel.forward: chunk_size and decode_ids are just segmentations of the same computation."""
    ids, one, floor = tiny_baseline()
    segments = segment_lengths(250, 51, 97)
    assert segments == [97, 97, 56] + [1] * 51
    prefill_then_decode = tiny_model().forward(ids[:250], decode_ids=ids[250:], chunk_size=97)
    assert prefill_then_decode.logits.shape == (len(ids), TINY.vocab_size)
    run = run_reference(tiny_model(), ids, segments, forced=one.choices)
    assert_same_run(run, one, floor, "tiny, 250-token prefill in chunks of 97 + 51 decode steps")
    if run.forced_count == 0:  # nothing forced: the same computation as forward()
        assert torch.equal(prefill_then_decode.logits, run.logits)


@pytest.mark.slow
def test_chunk_invariance_on_flash_like_weights():
    """The flash-like transformers weights (7 layers, index_topk 24): 1101 prompt tokens in chunks of 1, 3,
    127, 129, then 367, followed by 20 decode steps, against one-shot over all 1121 tokens."""
    pytest.importorskip("transformers")
    from hf_oracle import _chunk_plan, build_hf_model, hf_weights_state_dict, tiny_hf_config

    from reference.config import config_from_hf_dict
    from reference.weights.memory import InMemoryWeights

    hf_config = tiny_hf_config("flash-like")
    weights = hf_weights_state_dict(build_hf_model(hf_config, seed=1))
    cfg = config_from_hf_dict(hf_config.to_dict(), name="hf-flash-like")
    ids = random_ids(1121, 101)
    one = run_reference(ReferenceModel(InMemoryWeights(cfg, weights)), ids, [len(ids)])
    floor = noise_floor(ReferenceModel(InMemoryWeights(cfg, weights), dtype=torch.float64), ids, one)
    segments = _chunk_plan(1101, [1, 3, 127, 129, 367]) + [1] * 20
    run = run_reference(ReferenceModel(InMemoryWeights(cfg, weights)), ids, segments, forced=one.choices)
    assert_same_run(run, one, floor, "flash-like, chunks 1/3/127/129/367 + 20 decode steps", cfg=cfg)


# ------------------------------------------------------------------------------------------------
# Causality (spec §4.4, §5.1): no output depends on a later token
# ------------------------------------------------------------------------------------------------

def test_appending_tokens_changes_no_earlier_output():
    """A 173-token prefix run alone vs inside the 301-token prompt: every layer (SWA, CSA, HCA) and the
    logits agree on the prefix. 173 is mid-window for both compressors (173 = 4*43 + 1 = 128 + 45)."""
    ids, one, floor = tiny_baseline()
    assert set(TINY.layer_kinds) == {"swa", "csa", "hca"}
    n = 173
    prefix = run_reference(tiny_model(), ids[:n], [n], forced=_first(one.choices, n))
    assert_same_run(prefix, one, floor, "tiny, 173-token prefix vs 301-token prompt", positions=n)


def test_changing_later_tokens_changes_no_earlier_output():
    """Same 173-token prefix, two different 128-token continuations: positions < 173 must not notice.
    Identical shapes make every row's arithmetic identical, so this holds bit for bit on the writing
    machine; the assertion allows the fp32 noise floor in case a BLAS picks kernels by the per-expert
    token count (which does differ between the two runs). A leak of a later token is far larger."""
    _ids, _one, floor = tiny_baseline()
    prefix = random_ids(173, 7)
    a = tiny_model().forward(prefix + random_ids(128, 8), keep_layer_outputs=True)
    b = tiny_model().forward(prefix + random_ids(128, 9), keep_layer_outputs=True)
    for layer, (out_a, out_b) in enumerate(zip(a.layer_outputs, b.layer_outputs, strict=True)):
        before = rel_l2(out_a[:173], out_b[:173])
        after = rel_l2(out_a[173:], out_b[173:])
        print(f"layer {layer} ({TINY.layer_kind(layer)}): prefix positions differ by {before:.1e} "
              f"(bit-identical: {torch.equal(out_a[:173], out_b[:173])}), later positions by {after:.2f}")
        assert before <= NOISE_FACTOR * floor[layer], (
            f"layer {layer} ({TINY.layer_kind(layer)}): outputs at positions < 173 changed by {before:.2e} when "
            "only tokens >= 173 changed; expected no change")
        assert after > 0.1, f"layer {layer}: the continuation changed nothing after it ({after:.2e}): test is void"
    assert rel_l2(a.logits[:173], b.logits[:173]) <= NOISE_FACTOR * floor[-1]


# ------------------------------------------------------------------------------------------------
# Compressors (spec §5.1, §10.3, §12), on reference/ops/compressor.py directly, in fp64
# ------------------------------------------------------------------------------------------------

D_MODEL, WIDTH, ROPE = 24, 16, 8


def _compressor(ratio: int, seed: int = 0) -> tuple[CompressorWeights, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    c = 2 if ratio == 4 else 1
    w = CompressorWeights(torch.randn(c * WIDTH, D_MODEL, generator=g, dtype=torch.float64) / D_MODEL**0.5,
                          torch.randn(c * WIDTH, D_MODEL, generator=g, dtype=torch.float64),
                          torch.randn(ratio, c * WIDTH, generator=g, dtype=torch.float64),
                          1 + 0.1 * torch.randn(WIDTH, generator=g, dtype=torch.float64))
    inv_freq = inverse_frequencies(ROPE, 160000.0, None)
    return w, inv_freq


def _rows(ratio: int, x: torch.Tensor, pieces: list[int] | None = None, w=None, inv_freq=None) -> torch.Tensor:
    """Feed x [S, D] through a fresh compressor state, in `pieces` (default one call); all rows."""
    if w is None:
        w, inv_freq = _compressor(ratio)
    state = CompressorState.empty(ratio, ratio == 4, WIDTH, torch.float64, "cpu")
    start = 0
    for n in pieces or [x.shape[0]]:
        compress(state, x[start : start + n], torch.arange(start, start + n), w, 1e-6, inv_freq)
        start += n
    return state.rows


def _tokens(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, D_MODEL, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_csa_row_0_pools_only_its_own_window():
    """Row 0 = softmax-pooled Cb half of tokens 0..3 (no window −1 slots), normed, RoPE at position 0
    (the identity). The Ca half of the weights, which only feeds row 1 onward, cannot touch it."""
    w, inv_freq = _compressor(4)
    x = _tokens(9)
    rows = _rows(4, x, w=w, inv_freq=inv_freq)
    assert rows.shape == (2, WIDTH)  # 9 tokens: windows 0 and 1 complete, token 8 waits
    v = x[:4] @ w.wkv.T
    z = x[:4] @ w.wgate.T + w.ape
    own = (torch.softmax(z[:, WIDTH:], dim=0) * v[:, WIDTH:]).sum(0)
    expected = rms_norm(own, w.norm, 1e-6)
    assert torch.allclose(rows[0], expected, rtol=0, atol=1e-12), (rows[0] - expected).abs().max()

    w2 = CompressorWeights(w.wkv.clone(), w.wgate.clone(), w.ape.clone(), w.norm)
    w2.wkv[:WIDTH] *= -3.0  # Ca values
    w2.wgate[:WIDTH] += 5.0  # Ca gates
    w2.ape[:, :WIDTH] = 100.0
    other = _rows(4, x, w=w2, inv_freq=inv_freq)
    assert torch.equal(other[0], rows[0]), "CSA row 0 changed with the overlap (window −1) half of the weights"
    assert not torch.allclose(other[1], rows[1]), "row 1 must pool the Ca half of window 0: test is void"


@pytest.mark.parametrize("ratio", [4, 128])
def test_compressed_row_depends_only_on_its_tokens(ratio):
    """Perturb one token p: CSA changes exactly rows p//4 and p//4+1 (row w pools tokens 4w−4..4w+3);
    HCA exactly row p//128 (row w pools 128w..128w+127). Other rows stay bit-identical."""
    n = 4 * 37 + 3 if ratio == 4 else 128 * 3 + 77
    x = _tokens(n)
    base = _rows(ratio, x)
    assert base.shape[0] == n // ratio
    probes = [0, 3, 4, 57, 143, n - 4, n - 1] if ratio == 4 else [0, 127, 128, 200, 383, n - 1]
    for p in probes:
        y = x.clone()
        y[p] += 1.0
        changed = (_rows(ratio, y) != base).any(-1).nonzero().flatten().tolist()
        span = {p // ratio, p // ratio + 1} if ratio == 4 else {p // ratio}
        expected = sorted(w for w in span if w < n // ratio)
        assert changed == expected, f"m={ratio}: perturbing token {p} changed rows {changed}, expected {expected}"


@pytest.mark.parametrize("ratio", [4, 128])
def test_rows_do_not_change_when_tokens_are_appended_or_chunked(ratio):
    """Row w is final once token (w+1)m−1 is seen: a prefix yields the same rows, and any chunking of
    the stream (pieces that split windows, single tokens) yields the same rows (spec §10.3)."""
    x = _tokens(128 * 2 + 45)
    full = _rows(ratio, x)
    for n in (5, 127, 130, 250):
        prefix = _rows(ratio, x[:n])
        assert prefix.shape[0] == n // ratio
        assert torch.allclose(prefix, full[: n // ratio], rtol=0, atol=1e-12), f"m={ratio}, prefix of {n} tokens"
    for pieces in ([1] * 10 + [3, 7, 129, 100, 52], [127, 1, 1, 172]):
        chunked = _rows(ratio, x, pieces)
        assert torch.allclose(chunked, full, rtol=0, atol=1e-12), f"m={ratio}, pieces {pieces}"


@pytest.mark.parametrize("ratio", [4, 128])
def test_rows_are_rotated_at_their_window_start(ratio):
    """Spec §5.1 step 2: row w carries RoPE at position w·m (its own window's first token), on the last r dims."""
    w, inv_freq = _compressor(ratio)
    x = _tokens(128 * 3 + 5)
    rotated = _rows(ratio, x, w=w, inv_freq=inv_freq)
    plain = _rows(ratio, x, w=w, inv_freq=torch.zeros_like(inv_freq))  # angle 0: no rotation
    starts = torch.arange(rotated.shape[0]) * ratio
    cos, sin = cos_sin(inv_freq, starts, torch.float64)
    assert torch.allclose(rotated, apply_rope(plain, cos, sin), rtol=0, atol=1e-12)
    assert torch.equal(rotated[:, :-ROPE], plain[:, :-ROPE]), "the nope dims must not be rotated"


# ------------------------------------------------------------------------------------------------
# mHC (spec §3)
# ------------------------------------------------------------------------------------------------

SINKHORN_COLUMN_TOL = 1e-6 + 4 * 2**-23
"""Column sums after the final column normalisation C/(ΣC + eps) are 1 − eps/(ΣC + eps) ≈ 1 − hc_eps
exactly, plus fp32 rounding of a 4-term sum and a division (< 4 ulp of 1); measured 1.13e-6..1.19e-6."""


def test_sinkhorn_is_doubly_stochastic():
    g = torch.Generator().manual_seed(0)
    for std in (1.0, 3.0, 10.0):  # realistic mixes are ~N(0, 1); larger ones are peaky
        comb = sinkhorn(torch.randn(4096, 4, 4, generator=g) * std, iters=20, eps=1e-6)
        column_dev = float((comb.sum(-2) - 1).abs().max())
        assert column_dev <= SINKHORN_COLUMN_TOL, f"std {std}: column sums off by {column_dev:.2e}"
        assert float(comb.min()) > 0, f"std {std}: an entry is {float(comb.min())}, expected > 0"
        if std == 1.0:
            row_dev = float((comb.sum(-1) - 1).abs().max())
            assert row_dev < 1e-2, f"rows of a 20-iteration Sinkhorn on N(0,1) logits off by {row_dev:.2e}"
    # and on the tiny model's real mixes, layer by layer
    model = tiny_model()
    ids = torch.tensor(random_ids(200, 3))
    streams = model.embed(ids)
    for layer in range(TINY.num_hidden_layers):
        block = model.layer(layer)
        _a, mix = hc_pre(streams, block.w["hc_attn_fn"], block.w["hc_attn_base"], block.w["hc_attn_scale"],
                         TINY.rms_norm_eps, TINY.hc_eps, TINY.hc_sinkhorn_iters)
        column_dev = float((mix.comb.sum(-2) - 1).abs().max())
        row_dev = float((mix.comb.sum(-1) - 1).abs().max())
        assert column_dev <= SINKHORN_COLUMN_TOL and row_dev < 1e-2 and float(mix.comb.min()) > 0, (
            f"layer {layer}: comb column sums off by {column_dev:.2e}, rows by {row_dev:.2e} (measured <= 1e-3), "
            f"min entry {float(mix.comb.min()):.2e}")
        streams = model.run_layer(block, streams, ids, [len(ids)])


def test_hc_post_with_identity_comb_is_a_plain_residual():
    """Spec §12: post = 1 and comb = I reduce HC_post to X'[k] = f + X[k]; comb is contracted over its FIRST index."""
    g = torch.Generator().manual_seed(0)
    x, f = torch.randn(5, 4, 8, generator=g), torch.randn(5, 8, generator=g)
    ident = HCMix(torch.full((5, 4), 0.25), torch.ones(5, 4), torch.eye(4).expand(5, 4, 4))
    assert torch.allclose(hc_post(f, x, ident), x + f[:, None], rtol=0, atol=1e-6)
    move = torch.zeros(4, 4)
    move[0, 1] = 1.0  # C[j=0, k=1]: stream 0 feeds output stream 1
    out = hc_post(torch.zeros(5, 8), x, HCMix(ident.pre, torch.zeros(5, 4), move.expand(5, 4, 4)))
    assert torch.equal(out[:, 1], x[:, 0]) and float(out[:, 0].abs().max()) == 0.0


# ------------------------------------------------------------------------------------------------
# RoPE (spec §4.3)
# ------------------------------------------------------------------------------------------------

def test_rope_rotation_back_by_minus_t_is_identity():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 4, 64, generator=g)
    positions = torch.tensor([0, 1, 127, 4096, 65535, 1_000_000])
    for inv_freq in (layer_inverse_frequencies(TINY, 0), layer_inverse_frequencies(TINY, 2)):
        cos, sin = cos_sin(inv_freq, positions, torch.float32)
        there = apply_rope(x, cos[:, None], sin[:, None])
        back = apply_rope(there, cos[:, None], sin[:, None], inverse=True)
        err = rel_l2(back, x)
        assert err < 1e-6, f"rotating by +t then −t is off by {err:.2e} relative (fp32 rounding is ~1e-7)"
        assert torch.equal(there[..., :-TINY.qk_rope_head_dim], x[..., :-TINY.qk_rope_head_dim])
        assert abs(float(there.norm() / x.norm()) - 1) < 1e-6, "a rotation preserves the norm"
        assert torch.equal(there[0], x[0]), "position 0 (cos 1, sin 0) must not rotate"


def test_rope_rotates_adjacent_pairs_of_the_last_dims():
    """(a, b) at dims (d−r+2i, d−r+2i+1) → (a cosφ − b sinφ, a sinφ + b cosφ), φ = t·θ_i: interleaved
    pairs, not half-split (spec §4.3: half-split changes logits by 70-95%)."""
    d, r = 64, 16
    inv_freq = inverse_frequencies(r, 10000.0, None)
    t = torch.tensor([5])
    cos, sin = cos_sin(inv_freq, t, torch.float64)
    for i in (0, 3, 7):
        x = torch.zeros(1, d, dtype=torch.float64)
        x[0, d - r + 2 * i] = 1.0
        y = apply_rope(x, cos, sin)
        phi = 5 * float(inv_freq[i])
        want = torch.zeros(1, d, dtype=torch.float64)
        want[0, d - r + 2 * i], want[0, d - r + 2 * i + 1] = math.cos(phi), math.sin(phi)
        assert torch.allclose(y, want, atol=1e-6), f"pair {i}: got {y[0, d - r:].tolist()}"


def test_yarn_table_check_values():
    """Spec §4.3 check values for Flash (r 64, θ 160000, YaRN factor 16, L0 65536, β 32/1)."""
    flash_yarn = YarnConfig(factor=16.0, original_max_position_embeddings=65536, beta_fast=32.0, beta_slow=1.0)
    inv = inverse_frequencies(64, 160000.0, flash_yarn)
    plain = inverse_frequencies(64, 160000.0, None)
    assert inv.dtype == torch.float32 and inv.shape == (32,)
    assert float(inv[0]) == 1.0
    assert float(inv[1]) == pytest.approx(0.687656, abs=5e-7), float(inv[1])
    assert float(inv[31]) == pytest.approx(5.6805e-7, abs=5e-12), float(inv[31])
    # ramp: i <= 15 unchanged, i >= 25 divided by the factor, a blend between
    assert torch.equal(inv[:16], plain[:16])
    assert torch.allclose(inv[25:], plain[25:] / 16, rtol=1e-6, atol=0)
    assert bool(((inv[16:25] < plain[16:25]) & (inv[16:25] > plain[16:25] / 16)).all())
    # SWA layers: θ = 10000, never YaRN (spec §1.2)
    swa = inverse_frequencies(64, 10000.0, None)
    assert torch.allclose(swa, 10000.0 ** (-torch.arange(32, dtype=torch.float64) / 32).float(), rtol=1e-6)


def test_fp64_reference_uses_the_fp32_rope_tables():
    """The tables are part of the model's definition (spec §4.3): an fp64 angle flips indexer near-ties."""
    inv_freq = layer_inverse_frequencies(TINY, 2)
    positions = torch.arange(0, 300_000, 997)
    cos64, sin64 = cos_sin(inv_freq, positions, torch.float64)
    cos32, sin32 = cos_sin(inv_freq, positions, torch.float32)
    assert torch.equal(cos64, cos32.double()) and torch.equal(sin64, sin32.double())


# ------------------------------------------------------------------------------------------------
# Indexer selection and tie order (spec §5.3, DESIGN §10)
# ------------------------------------------------------------------------------------------------

def test_indexer_takes_every_causal_row_when_there_are_few():
    """Spec §12: with <= index_topk visible rows every one is attended; with more, exactly index_topk, all causal."""
    k, m = TINY.index_topk, TINY.compress_rate_csa
    _ids, one, _floor = tiny_baseline()
    for layer, picks in one.choices.indexer.items():
        for t, rows in enumerate(picks):
            visible = (t + 1) // m
            if visible <= k:
                assert rows == frozenset(range(visible)), f"layer {layer} position {t}: picked {sorted(rows)}"
            else:
                assert len(rows) == k and max(rows) < visible, f"layer {layer} position {t}: picked {sorted(rows)}"
    # and at the op level, for any scores (negative, tied, huge)
    scores = torch.tensor([[5.0, -1.0, 0.0, 0.0, 1e9, 3.0]] * 3)
    chosen, valid = select_rows(scores, torch.tensor([3, 7, 11]), m, topk=4)  # 1, 2, 3 visible rows
    assert [sorted(c[v].tolist()) for c, v in zip(chosen, valid)] == [[0], [0, 1], [0, 1, 2]]


def test_top_k_ties_go_to_the_lower_index_whatever_the_number_of_candidates():
    """DESIGN §10: on the ReLU zero plateau, the rows picked for a query must not depend on how many rows
    exist beyond what the query can see (a prompt prefix vs the whole prompt)."""
    g = torch.Generator().manual_seed(0)
    for n_rows in (20, 64, 300, 3000):
        plateau = torch.randint(-2, 3, (8, n_rows), generator=g).float().clamp_min(0)  # mostly exact zeros
        order = stable_topk_indices(plateau, 12)
        for row, picked in zip(plateau.tolist(), order.tolist()):
            assert picked == sorted(range(n_rows), key=lambda i: (-row[i], i))[:12]
    scores = torch.randint(0, 3, (1, 3000), generator=g).float()
    positions = torch.tensor([4 * 60 - 1])  # sees rows 0..59
    picks = []
    for n_rows in (60, 61, 200, 3000):
        chosen, valid = select_rows(scores[:, :n_rows], positions, 4, topk=16)
        picks.append(chosen[valid].tolist())
    assert all(p == picks[0] for p in picks), f"picks changed with the number of candidate rows: {picks}"
    # experts: two identical gate rows tie exactly; the lower id wins
    y = torch.randn(32, 8, generator=g)
    gate = torch.randn(6, 8, generator=g)
    gate[4] = gate[1]
    ids = route(y, gate, 2, 1.5, bias=torch.zeros(6)).expert_ids
    has_1, has_4 = (ids == 1).any(-1), (ids == 4).any(-1)
    assert not bool((has_4 & ~has_1).any()), "expert 4 won an exact tie against expert 1"
    assert bool((has_1 & ~has_4).any()), "the tie never fell on the top-k boundary: test is void"


@pytest.mark.parametrize("stall", [False, True], ids=["cpu-path", "gpu-path"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_top_k_set_is_the_ranked_top_k_in_index_order(dtype, stall, monkeypatch):
    """stable_topk_set (the indexer's) picks exactly the rows of the stable ranked top-k: plateaus of exact ties
    wider than the places left, −0.0 next to +0.0, −inf padding beyond the visible rows, and NaN — by either path
    (the CPU's unranked top-k with host reads, the GPU's ranked form without: reference.ops.topk.reads_stall)."""
    import reference.ops.topk

    monkeypatch.setattr(reference.ops.topk, "reads_stall", lambda device: stall)
    g = torch.Generator().manual_seed(3)
    plateau = torch.randint(-2, 3, (64, 700), generator=g).to(dtype).clamp_min(0)  # mostly exact zeros
    signed_zeros = torch.where(torch.rand(64, 700, generator=g) < 0.5, -0.0, 0.0).to(dtype)
    hidden = torch.randn(64, 700, generator=g).to(dtype).masked_fill(torch.arange(700) >= 100, float("-inf"))
    with_nan = torch.randn(64, 700, generator=g).to(dtype)
    with_nan[3, 17] = float("nan")
    for scores in (plateau, signed_zeros, hidden, with_nan, torch.randn(64, 700, generator=g).to(dtype)):
        ranked = stable_topk_indices(scores, 512)
        assert torch.equal(stable_topk_set(scores, 512), ranked.sort(-1).values)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_every_nan_ranks_first_whatever_its_sign(dtype):
    """A NaN's sign is the arithmetic's, not the scores': the CPU casts float("nan") to a negative bf16 NaN and keeps
    its sign, an H100 ranked the same bits as a positive NaN (2026-12-07), so ranked by its bits the same scores
    picked differently on the two devices.
    Every NaN ranks above +inf, lower index first among them, as the float64 path's torch.sort puts it."""
    scores = torch.tensor([[1.0, float("inf"), 0.0, 2.0, 0.5, 3.0]], dtype=dtype).repeat(2, 1)
    # a quiet NaN with the sign bit set, written as bits (a conversion may drop the sign): 0xFFC00000 in fp32
    bits_dtype, negative_nan_bits = {torch.float32: (torch.int32, -(2**22)), torch.bfloat16: (torch.int16, -(2**6)),
                                     torch.float64: (torch.int64, -(2**51))}[dtype]
    scores.view(bits_dtype)[0, 4] = scores.view(bits_dtype)[1, 2] = negative_nan_bits
    scores[0, 2] = scores[1, 4] = float("nan")
    assert bool(torch.isnan(scores[:, [2, 4]]).all()) and int(scores.view(bits_dtype)[0, 4]) < 0
    for row in range(2):
        assert stable_topk_indices(scores[row:row + 1], 4).tolist() == [[2, 4, 1, 5]]
    assert stable_topk_set(scores, 3).tolist() == [[1, 2, 4], [1, 2, 4]]


# ------------------------------------------------------------------------------------------------
# TF32 guard (DESIGN §10)
# ------------------------------------------------------------------------------------------------

def test_tf32_is_refused():
    before = torch.get_float32_matmul_precision()
    assert before == "highest"
    try:
        torch.set_float32_matmul_precision("high")
        with pytest.raises(RuntimeError, match="TF32"):
            ensure_no_tf32()
        with pytest.raises(RuntimeError, match="TF32"):
            tiny_model().forward([5, 6, 7])
    finally:
        torch.set_float32_matmul_precision(before)
    ensure_no_tf32()  # restored: fine again


@pytest.mark.parametrize("backend, setting", [("cuda", "tf32"), ("mkldnn", "bf16")])
def test_reduced_precision_fp32_matmul_through_the_new_torch_api_is_refused(backend, setting):
    """torch >= 2.9 also spells it `torch.backends.<backend>.matmul.fp32_precision` ("bf16" on CPU oneDNN
    makes fp32 GEMMs bf16x3). Today the refusal comes from torch itself (get_float32_matmul_precision()
    raises once the new API is used), not from ensure_no_tf32's own checks; either way the run must stop."""
    matmul = getattr(torch.backends, backend).matmul
    before = matmul.fp32_precision
    try:
        matmul.fp32_precision = setting
        with pytest.raises(RuntimeError):
            ensure_no_tf32()
    finally:
        matmul.fp32_precision = before
    ensure_no_tf32()


# ------------------------------------------------------------------------------------------------
# Official-parity QAT switches (spec §7)
# ------------------------------------------------------------------------------------------------

class _Taps:
    """A ProbeSink keeping the tensors of chosen taps (reference/probes.py)."""

    def __init__(self, *taps: str) -> None:
        self.taps, self.values = set(taps), defaultdict(list)

    def wants(self, tap: str) -> bool:
        return tap in self.taps

    def emit(self, tap: str, positions: torch.Tensor, **values: torch.Tensor) -> None:
        self.values[tap].append({k: v.clone() for k, v in values.items()})

    def sampled(self, positions: torch.Tensor) -> torch.Tensor:
        return torch.ones_like(positions, dtype=torch.bool)

    def cat(self, tap: str, name: str) -> torch.Tensor:
        return torch.cat([v[name] for v in self.values[tap]], 0)


def _run_layer_tapped(parity: ParityOptions, layer: int, *taps: str, n: int = 150) -> _Taps:
    model = tiny_model(parity=parity)
    ids = torch.tensor(random_ids(n, 4))
    sink = _Taps(*taps)
    model.run_layer(model.layer(layer), model.embed(ids), ids, [n], sink)
    return sink


def _attention_by_key(sink: _Taps) -> list[dict[tuple[str, int], torch.Tensor]]:
    """Per query of an attn.probs tap: {(window|row, key id): per-head probability}, from the tap's own key lists."""
    out = []
    for entry in sink.values["attn.probs"]:
        for b in range(entry["probs"].shape[0]):
            keys = [("window", int(p)) for p in entry["window_pos"][b]] + [("row", int(r)) for r in entry["comp_rows"][b]]
            probs = entry["probs"][b]  # [H, ΣK]
            out.append({key: probs[:, j] for j, key in enumerate(keys) if key[1] >= 0})
    return out


def test_sampled_taps_give_their_positions_on_the_host(monkeypatch):
    """attn.probs and indexer.scores are emitted with the positions sampled_positions_on_host makes on the host — the
    sampled ones, first + offset, over several segments (prefill chunks, then decode steps) and query blocks of 16 —
    not device positions a sink would wait for the device to read (on a GPU, one wait per query block and tap:
    issue #14); each emission's values have a row per position."""
    monkeypatch.setattr(reference.layer, "query_block_size", lambda *args, **kwargs: 16)
    made = []

    def recorded(sink, first, count):
        out = sampled_positions_on_host(sink, first, count)
        made.append(out)
        return out

    from reference.probes import sampled_positions_on_host
    monkeypatch.setattr(reference.layer, "sampled_positions_on_host", recorded)

    class EveryThird(_Taps):
        def __init__(self) -> None:
            super().__init__("attn.probs", "indexer.scores")
            self.positions = defaultdict(list)

        def emit(self, tap: str, positions: torch.Tensor, **values: torch.Tensor) -> None:
            assert all(v.shape[0] == positions.numel() for v in values.values())
            self.positions[tap].append(positions)

        def sampled(self, positions: torch.Tensor) -> torch.Tensor:
            return positions % 3 == 0

    model, n = tiny_model(), 150
    ids = torch.tensor(random_ids(n, 4))
    sink = EveryThird()
    model.run_layer(model.layer(TINY.layer_kinds.index("csa")), model.embed(ids), ids, [40, 50, 57, 1, 1, 1], sink)
    for tap in ("attn.probs", "indexer.scores"):
        assert len(sink.positions[tap]) >= 10 and all(any(p is m for m in made) for p in sink.positions[tap])
        assert all(p.device.type == "cpu" for p in sink.positions[tap])
        assert torch.cat(sink.positions[tap]).tolist() == list(range(0, n, 3))


def test_attention_tap_names_the_keys_its_probabilities_belong_to(monkeypatch):
    """attn.probs at a CSA layer must pair each probability with the key it weighs, whether the compressed
    rows are evaluated shared (all rows, picks masked) or gathered per query: the same distribution over
    the same keys either way. (A shared evaluation once paired the dense columns with the picks' ids.)"""
    layer = TINY.layer_kinds.index("csa")
    runs = []
    for shared in (True, False):
        monkeypatch.setattr(reference.layer, "share_rows", lambda *args, shared=shared: shared)
        runs.append(_attention_by_key(_run_layer_tapped(ParityOptions(), layer, "attn.probs")))
    assert len(runs[0]) == len(runs[1]) == 150
    for q, (shared, gathered) in enumerate(zip(*runs)):
        assert shared.keys() == gathered.keys(), f"query {q}: different keys"
        for key, p in gathered.items():
            # one softmax over the same logits, denominators summed in a different order: fp32 rounding only
            assert torch.allclose(shared[key], p, rtol=1e-5, atol=1e-7), f"query {q}, key {key}"


def _representable(x: torch.Tensor, block: int, fmt_max: float, fmt: str) -> bool:
    """Is every block of `block` values along the last dim an exact code·2^k with the block's UE8M0 scale
    2^ceil(log2(amax/fmt_max))? Written from spec §7 independently of reference/quant.py."""
    x = x.double().reshape(-1, x.shape[-1])
    for start in range(0, x.shape[-1], block):
        part = x[:, start : start + block]
        amax = part.abs().amax(-1, keepdim=True).clamp_min(1e-30)
        scaled = part / torch.exp2(torch.ceil(torch.log2(amax / fmt_max)))
        if fmt == "e2m1":
            grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=torch.float64)
            ok = (scaled.abs()[..., None] == grid).any(-1)
        else:
            ok = scaled.float().to(torch.float8_e4m3fn).double() == scaled
        if not bool(ok.all()):
            return False
    return True


def test_parity_switches_are_off_by_default_and_each_changes_the_output():
    assert ParityOptions() == ParityOptions(fp8_kv=False, indexer_fp4=False)
    assert ReferenceModel(SyntheticWeights(TINY, seed=0)).parity == ParityOptions()
    ids = random_ids(200, 5)
    plain = tiny_model().forward(ids).logits
    assert torch.equal(plain, ReferenceModel(SyntheticWeights(TINY, seed=WEIGHT_SEED)).forward(ids).logits)
    for parity in (ParityOptions(fp8_kv=True), ParityOptions(indexer_fp4=True)):
        changed = rel_l2(tiny_model(parity=parity).forward(ids).logits, plain)
        print(f"{parity}: logits move by {changed:.2e} relative L2")
        assert changed > 1e-4, f"{parity} changed the logits by only {changed:.2e}: the switch does nothing"


def test_fp8_kv_rounds_only_the_nope_dims():
    """Window kv rows (SWA layer 0) and main-compressor rows (CSA layer 2, HCA layer 3): the last r (rope)
    dims are untouched, the nope dims become FP8 e4m3 values with a UE8M0 scale per 64 elements."""
    nope = TINY.nope_head_dim
    for layer, tap, name in ((0, "attn.kv", "kv"), (2, "compressor.rows", "rows"), (3, "compressor.rows", "rows")):
        plain = _run_layer_tapped(ParityOptions(), layer, tap, n=300).cat(tap, name)
        fp8 = _run_layer_tapped(ParityOptions(fp8_kv=True), layer, tap, n=300).cat(tap, name)
        assert plain.shape == fp8.shape and plain.shape[0] > 0
        assert torch.equal(fp8[:, nope:], plain[:, nope:]), f"layer {layer} {tap}: fp8_kv touched the rope dims"
        assert _representable(fp8[:, :nope], 64, 448.0, "e4m3"), f"layer {layer} {tap}: nope dims are not FP8 values"
        assert not _representable(plain[:, :nope], 64, 448.0, "e4m3")
        err = rel_l2(fp8[:, :nope], plain[:, :nope])
        assert 1e-3 < err < 0.1, f"layer {layer} {tap}: FP8 rounding changed the nope dims by {err:.2e}"


def test_indexer_fp4_makes_q_and_k_fp4_values_after_the_hadamard_rotation(monkeypatch):
    captured = {}

    def capture(q, weights, keys):
        captured.setdefault("q", []).append(q.clone())
        captured["k"] = keys.clone()
        return original(q, weights, keys)

    original = reference.layer.indexer_scores
    monkeypatch.setattr(reference.layer, "indexer_scores", capture)
    _run_layer_tapped(ParityOptions(indexer_fp4=True), 2)
    q_fp4, k_fp4 = torch.cat(captured.pop("q")), captured.pop("k")
    _run_layer_tapped(ParityOptions(), 2)
    q, k = torch.cat(captured.pop("q")), captured.pop("k")

    assert _representable(q_fp4, 32, 6.0, "e2m1") and _representable(k_fp4, 32, 6.0, "e2m1")
    assert not _representable(q, 32, 6.0, "e2m1") and not _representable(k, 32, 6.0, "e2m1")
    # the values are FP4 roundings of the ROTATED vectors: undoing the (symmetric, orthonormal) rotation
    # lands near the plain ones, while the rotated vectors themselves are far from them
    h = hadamard_matrix(TINY.index_head_dim)
    for name, rounded, exact in (("q", q_fp4, q), ("k", k_fp4, k)):
        assert rel_l2(rounded @ h, exact) < 0.3, f"indexer {name}: FP4 of the rotation is not close after un-rotating"
        assert rel_l2(rounded, exact) > 0.5, f"indexer {name}: no Hadamard rotation was applied"
