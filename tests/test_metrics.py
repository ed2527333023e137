"""Comparators of harness.run.metrics on hand-built taps whose answers can be counted by hand."""

from __future__ import annotations

import pytest
import torch

from harness.run.metrics import CompareContext, compare_selected


def cut(values):
    """A comparator's values as the layer's rows take them: masks applied (MetricValues.cut), empty ones dropped."""
    return [mv for mv in (v.cut() for v in values) if mv.positions.numel()]
from harness.run.probes import stack_samples


def test_selection_recalls_and_the_subset_pick_share():
    """HCA layer (m = 128, rows pool [128r, 128r + 128)); two queries in turn 1 (which starts at token 512), each
    with 4 reference picks. Rows 0–3 lie before the turn (earlier-turn subset); a needle at tokens [130, 300)
    touches rows 1 and 2. The variant drops row 2 at query 0 and row 3 at query 1."""
    ctx = CompareContext("hca", 128, 128, torch.ones(700, dtype=torch.int64),
                         torch.full((700,), 512, dtype=torch.int64), [(130, 300)])
    pos = torch.tensor([600, 601])
    ref = {"row_ids": torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]]), "valid": torch.ones(2, 4, dtype=torch.bool)}
    var = {"row_ids": torch.tensor([[0, 1, 3, 4], [0, 1, 2, 4]]), "valid": torch.ones(2, 4, dtype=torch.bool)}
    got = {m.metric: m.value.tolist() for m in cut(compare_selected(pos, ref, var, ctx))}
    assert got["indexer.recall"] == [0.75, 0.75]
    assert got["indexer.flips"] == [1, 1]
    assert got["ctx.earlier_turn_recall"] == [0.75, 0.75] and got["ctx.earlier_turn_pick_share"] == [0.25, 0.25]
    # needle picks are rows 1 and 2: query 0 lost one of its two (recall 1/2; one pick is worth 1/2), query 1 none
    assert got["ctx.needle_recall"] == [0.5, 1.0] and got["ctx.needle_pick_share"] == [0.5, 0.5]


def _selection_by_sets(pos, ref, var, ctx) -> dict[str, list[float]]:
    """compare_selected's metrics written out per query with Python sets, for the randomized test below."""
    m, csa = ctx.ratio, ctx.layer_kind == "csa"
    out: dict[str, list[float]] = {}
    for i, p in enumerate(pos.tolist()):
        picks = {r for r, ok in zip(ref["row_ids"][i].tolist(), ref["valid"][i].tolist()) if ok}
        kept = picks & {r for r, ok in zip(var["row_ids"][i].tolist(), var["valid"][i].tolist()) if ok}
        out.setdefault("indexer.recall", []).append(len(kept) / len(picks) if picks else 1.0)
        out.setdefault("indexer.flips", []).append(len(picks) - len(kept))
        turn = int(ctx.turn_start[p])
        spans = {r: (max(r * m - (m if csa else 0), 0), (r + 1) * m) for r in picks}
        for name, subset in (("earlier_turn", {r for r in picks if spans[r][1] <= turn}),
                             ("needle", {r for r in picks if any(spans[r][0] < e and spans[r][1] > s
                                                                for s, e in ctx.needle_spans)})):
            if subset:
                out.setdefault(f"ctx.{name}_recall", []).append(len(subset & kept) / len(subset))
                out.setdefault(f"ctx.{name}_pick_share", []).append(1 / len(subset))
    return out


@pytest.mark.parametrize("seed", range(12))
def test_selection_metrics_are_the_set_definitions_at_random(seed):
    """compare_selected finds earlier-turn picks from one bound per query (r < ⌊t/m⌋) and sizes its tables from the
    sequence (CompareContext.row_bound), not from the ids: the same values as the set definitions, whatever the
    ratio and kind, turn starts off the row grid, needles on row edges, invalid picks holding any id (−1 or one past
    the bound) and variant ids far past the bound (they match nothing)."""
    gen = torch.Generator().manual_seed(seed)
    kind, m = ("csa", 4) if seed % 2 else ("hca", 16)
    T = 700
    turn_start = torch.zeros(T, dtype=torch.int64)
    for start in sorted(torch.randint(1, T, (3,), generator=gen).tolist()):
        turn_start[start:] = start
    needles = [(4 * m, 5 * m), (int(torch.randint(0, T - 40, (1,), generator=gen)), 0)]
    needles[1] = (needles[1][0], needles[1][0] + int(torch.randint(1, 40, (1,), generator=gen)))
    ctx = CompareContext(kind, m, 128, torch.zeros(T, dtype=torch.int64), turn_start, needles)
    pos = torch.randint(m, T, (40,), generator=gen)
    k = 8
    visible = (pos + 1) // m  # rows complete by each query

    def picks() -> dict[str, torch.Tensor]:
        ids = torch.stack([torch.randperm(max(v, k), generator=gen)[:k] for v in visible.tolist()])  # distinct
        valid = (torch.rand(40, k, generator=gen) < 0.8) & (ids < visible[:, None])
        junk = torch.where(torch.rand(40, k, generator=gen) < 0.5, -1, ctx.row_bound())  # what an invalid slot holds
        return {"row_ids": torch.where(valid, ids, junk).int(), "valid": valid}

    ref, var = picks(), picks()
    var["row_ids"][::7, 0] = 10**6  # a wild id of a broken variant: valid, matches nothing
    var["valid"][::7, 0] = True
    got = {mv.metric: mv.value.tolist() for mv in cut(compare_selected(pos, ref, var, ctx))}
    expected = _selection_by_sets(pos, ref, var, ctx)
    assert got.keys() == expected.keys()
    for name, values in expected.items():
        assert got[name] == pytest.approx(values, abs=0), name  # counts and their ratios: exact


def test_a_row_id_past_the_sequence_matches_nothing_and_a_context_copy_keeps_no_cache():
    """compare_selected sizes its tables from the sequence (CompareContext.row_bound): a valid id at or past the
    bound — which no correct stack emits — counts as a lost pick, never as a match or a needle pick through a clamp;
    and a context copied for another ratio (dataclasses.replace) builds its own needle table."""
    import dataclasses

    T, m = 64, 4
    ctx = CompareContext("csa", m, 128, torch.zeros(T, dtype=torch.int64), torch.full((T,), 40, dtype=torch.int64),
                         [(60, 64)])  # the needle covers the last rows: rows 14 and 15 (and CSA's reach-back, 16)
    bound = ctx.row_bound()
    assert bound == T // m + 1
    pos = torch.tensor([63])
    ref = {"row_ids": torch.tensor([[2, 15, bound]]), "valid": torch.ones(1, 3, dtype=torch.bool)}
    got = {mv.metric: mv.value.tolist() for mv in cut(compare_selected(pos, ref, dict(ref), ctx))}
    assert got["indexer.recall"] == [2 / 3] and got["indexer.flips"] == [1]  # the wild id is lost, not matched
    assert got["ctx.needle_pick_share"] == [1.0]  # row 15 only: the wild id is no needle pick
    assert got["ctx.earlier_turn_pick_share"] == [1.0]  # row 2 only (rows below 40 / 4 = 10)
    hca = dataclasses.replace(ctx, ratio=16, layer_kind="hca")
    assert hca.needle_rows_on(torch.device("cpu")).numel() == T // 16 + 2
    assert ctx.needle_rows_on(torch.device("cpu")).numel() == bound + 1


def test_stacked_attention_rows_keep_each_probability_next_to_its_key():
    """Sampled attn.probs entries of different band widths are stacked for one comparison: the window part and
    the compressed part of each row are padded separately (probability 0, key −1), so no probability moves
    onto another key's column."""
    narrow = {"window_pos": torch.tensor([5, 6]), "comp_rows": torch.tensor([0]),
              "probs": torch.tensor([[0.1, 0.2, 0.7]]), "sink_prob": torch.tensor([0.0]), "max_logit": torch.tensor([1.0])}
    wide = {"window_pos": torch.tensor([4, 5, 6]), "comp_rows": torch.tensor([0, 1]),
            "probs": torch.tensor([[0.1, 0.1, 0.1, 0.3, 0.4]]), "sink_prob": torch.tensor([0.0]),
            "max_logit": torch.tensor([2.0])}
    s = stack_samples([narrow, wide])
    assert s["window_pos"].tolist() == [[5, 6, -1], [4, 5, 6]]
    assert s["comp_rows"].tolist() == [[0, -1], [0, 1]]
    assert torch.equal(s["probs"][0], torch.tensor([[0.1, 0.2, 0.0, 0.7, 0.0]]))  # row 0's 0.7 stays on comp row 0
    assert torch.equal(s["probs"][1], wide["probs"])


def test_the_indexer_site_counts_a_lost_pick_that_was_no_tie():
    """indexer.site_margin_loss counts the stock picks the variant lost whose score led the k-th by more than
    TIE_NOISE_MULTIPLE × the twin's largest score change; a swap at the k-th pick (a tie) is not counted."""
    from harness.run.metrics import TIE_NOISE_MULTIPLE, compare_indexer_site

    stock = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]])
    valid = torch.ones(2, 4, dtype=torch.bool)
    margin = torch.tensor([[3.0, 2.0, 1.0, 0.0], [3.0, 2.0, 1.0, 0.0]])  # row 3 is the k-th pick of both queries
    noise = torch.tensor([1e-3, 1e-3])
    var = {"row_ids": torch.tensor([[0, 1, 2, 9], [0, 9, 2, 3]]), "valid": valid,  # query 0 swaps the k-th pick,
           "stock_row_ids": stock, "stock_valid": valid,                         # query 1 drops a leading one
           "twin_row_ids": stock, "twin_valid": valid, "stock_margin": margin, "twin_noise": noise,
           "visible": torch.tensor([10, 10])}
    out = {m.metric: m.value for m in cut(compare_indexer_site(torch.tensor([10, 11]), None, var, None))}
    assert out["indexer.site_recall"].tolist() == [0.75, 0.75]
    assert out["indexer.site_margin_loss"].tolist() == [0.0, 0.25]
    assert out["indexer.site_future"].tolist() == [0.0, 0.0]
    var["twin_noise"] = torch.tensor([1e-3, 2.0 / TIE_NOISE_MULTIPLE])  # a lead of 2 is now within the twin's noise
    out = {m.metric: m.value for m in cut(compare_indexer_site(torch.tensor([10, 11]), None, var, None))}
    assert out["indexer.site_margin_loss"].tolist() == [0.0, 0.0]


def test_the_indexer_site_counts_every_pick_of_a_row_the_query_may_not_see():
    """indexer.site_future: the share of the variant's valid picks at rows past the query's visible rows (from its
    position alone), also at a query before the first complete row, where the stock op picks nothing and the recall
    has no value; an invalid lane past them is not a pick."""
    from harness.run.metrics import compare_indexer_site

    stock = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3]])
    stock_valid = torch.tensor([[True] * 4, [True] * 4, [False] * 4])
    var = {"row_ids": torch.tensor([[0, 1, 2, 3], [0, 1, 2, 4], [0, 1, 2, 3]]),
           "valid": torch.tensor([[True, True, True, False], [True] * 4, [True, False, False, False]]),
           "stock_row_ids": stock, "stock_valid": stock_valid, "twin_row_ids": stock, "twin_valid": stock_valid,
           "stock_margin": torch.zeros(3, 4), "twin_noise": torch.ones(3), "visible": torch.tensor([3, 4, 0])}
    out = {m.metric: (m.positions.tolist(), m.value.tolist())
           for m in cut(compare_indexer_site(torch.tensor([15, 19, 2]), None, var, None))}
    assert out["indexer.site_future"] == ([15, 19, 2], [0.0, 0.25, 1.0])  # row 3 of query 0 is an invalid lane
    assert out["indexer.site_recall"][0] == [15, 19]


def test_the_attention_site_compares_lse_with_the_stock_ops():
    from harness.run.metrics import compare_attn_site

    lse = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    var = {"lse": lse + torch.tensor([[0.0, 0.002], [0.0, 0.0]]), "stock_lse": lse, "twin_lse": lse + 2**-20}
    out = {m.metric: m.value for m in cut(compare_attn_site(torch.tensor([5, 6]), None, var, None))}
    # 2 + 0.002 is stored in fp32: exact to 2^-23·2 ≈ 2.4e-7, 1e-4 of the 0.001 mean
    assert torch.allclose(out["attn.site_lse_err"], torch.tensor([0.001, 0.0], dtype=torch.float64), rtol=1e-4)
    # 2^-20 is exact on values of 1-4 (their fp32 ulp is at most 2^-21)
    assert out["attn.twin_lse_err"].tolist() == [2**-20, 2**-20]


def test_the_router_site_compares_effective_weights_where_the_expert_sets_agree():
    """Weights line up by expert whatever the slot order; the scaling factor may sit on the weights or on the output
    (the effective weights agree); a token whose expert set flipped is left to moe.site_flip_rate."""
    from harness.run.metrics import compare_router_site

    ids = torch.tensor([[1, 4], [2, 3]])
    w = torch.tensor([[0.9, 0.6, 1.0], [0.75, 0.75, 1.0]])  # routed × output_scale, then the shared expert's
    var = {"stock_expert_ids": ids, "stock_weights": w,
           "expert_ids": torch.tensor([[4, 1], [2, 5]]), "weights": torch.tensor([[0.6, 0.9 * 1.01, 1.0], [0.7, 0.8, 1.0]]),
           "twin_expert_ids": ids, "twin_weights": w}
    out = {m.metric: m for m in cut(compare_router_site(torch.tensor([7, 8]), None, var, None))}
    assert out["moe.site_flip_rate"].value.tolist() == [0.0, 0.5]
    site = out["moe.site_weight_err"]
    assert site.positions.tolist() == [7], "the flipped token is not compared"
    assert site.value.item() == pytest.approx(0.009 / 2.5)  # |0.909 − 0.9| over the L1 of (0.9, 0.6, 1.0)
    assert out["moe.twin_weight_err"].value.tolist() == [0.0, 0.0]


def _fp8_indexer_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The stock indexer's arithmetic (optimized-stack §3.1), the thing the noise model must describe: e4m3 q with
    one scale per (row, head), e4m3 keys with one scale per row (the engine's quantizer), fp64 sums."""
    from optimized.paged_cache import quantize_fp8_per_row

    def fp8(x: torch.Tensor) -> torch.Tensor:
        codes, scale = quantize_fp8_per_row(x)
        return codes.double() * scale.double()[..., None]

    return (weights.double().unsqueeze(-1) * torch.relu(fp8(q) @ fp8(keys).T)).sum(1)


def test_the_fp8_score_noise_scales_the_real_fp8_error_where_the_terms_cancel():
    """fp8_score_noise is the standard deviation of the stock FP8 indexer's score error (one rounding of q and of
    k here: Q_ROUNDINGS = 1), including scores whose head terms cancel (signed head weights, Flash's 64 heads ×
    128 dims) and values in e4m3's subnormal range. Measured over 64 queries × 256 rows, three seeds: the error
    in units of σ has a spread of 0.71 (σ is an upper estimate: it takes every ulp as 2^-3·|x|) and never
    reaches FP8_NOISE_MULTIPLE; one e4m3 ulp of the score itself (the former window, 2^-3·|I|) is crossed by
    ~17% of the scores. Bounds: spread in [0.5, 1] (an estimate off by 2× either way fails), maximum below 4."""
    from harness.run.metrics import FP8_NOISE_MULTIPLE
    from reference.ops import indexer

    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(64, 64, 128, generator=g)
        q[:, :, :8] *= 1e-5  # subnormal after scaling by amax/448
        keys = torch.randn(256, 128, generator=g)
        weights = torch.randn(64, 64, generator=g)
        exact = indexer.indexer_scores(q.double(), weights.double(), keys.double())
        moved = _fp8_indexer_scores(q, weights, keys) - exact
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(indexer, "Q_ROUNDINGS", 1)
            sigma = indexer.fp8_score_noise(q, weights, keys).double()
        z = moved / sigma
        assert 0.5 < float(z.std()) < 1.0 and float(z.abs().max()) < FP8_NOISE_MULTIPLE
        assert float((moved.abs() > 2.0**-3 * exact.abs()).double().mean()) > 0.05


def test_the_fp8_score_noise_counts_an_upstream_rounding_through_a_gemm():
    """The query's upstream roundings (the activations of wq_a and wq_b) reach q through a GEMM. Simulated: x with
    outlier channels rounded to FP8 in 1×128 blocks (the stock activation quantizer), q = W·x̂, then q and k
    rounded as the stock indexer rounds them; σ with Q_ROUNDINGS = 2 (one upstream, q's own). 32 queries × 64
    heads × 256 rows: the error in units of σ spreads 0.73 and stays below FP8_NOISE_MULTIPLE (bounds as above)."""
    from harness.run.metrics import FP8_NOISE_MULTIPLE
    from reference.ops import indexer
    from reference.quant import fp8_fake_quant

    g = torch.Generator().manual_seed(0)
    weight = torch.randn(64 * 128, 1024, generator=g) / 1024**0.5
    x = torch.randn(32, 1024, generator=g)
    x[:, :7] *= 20  # outlier channels: one element of a 1×128 block sets its scale
    keys = torch.randn(256, 128, generator=g)
    head_weights = torch.randn(32, 64, generator=g)
    q = (x @ weight.T).view(32, 64, 128)
    exact = indexer.indexer_scores(q.double(), head_weights.double(), keys.double())
    moved = _fp8_indexer_scores((fp8_fake_quant(x, 128) @ weight.T).view(32, 64, 128), head_weights, keys) - exact
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(indexer, "Q_ROUNDINGS", 2)
        z = moved / indexer.fp8_score_noise(q, head_weights, keys).double()
    assert 0.5 < float(z.std()) < 1.0 and float(z.abs().max()) < FP8_NOISE_MULTIPLE


def test_the_post_site_allows_any_fp32_order_and_no_more():
    """post_site_excess: hc_post's outputs further from the stock op's than two fp32 implementations with the bf16
    store can be. Summed in reverse with fused multiply-adds: none; the comb's other index contracted, or the
    products summed in bf16: some."""
    from optimized.base_ops import hc_post
    from optimized.engine import post_site_excess
    from reference.ops.mhc import HCMix

    g = torch.Generator().manual_seed(0)
    s, n, d = 64, 4, 256
    streams = (torch.randn(s, n, d, generator=g) * (1 + torch.arange(n)[:, None])).to(torch.bfloat16)
    f = torch.randn(s, d, generator=g).to(torch.bfloat16)
    post = 2 * torch.rand(s, n, generator=g)
    comb = torch.softmax(torch.randn(s, n, n, generator=g), -1)  # rows sum to 1; any comb will do here
    mix = HCMix(torch.rand(s, n, generator=g), post, comb)
    stock = hc_post(None, f, streams, mix)
    acc = torch.zeros(s, n, d)
    for j in reversed(range(n)):
        acc = torch.addcmul(acc, comb[:, j, :, None], streams.float()[:, j:j + 1, :])
    reordered = torch.addcmul(acc, post[..., None], f.float()[:, None, :]).to(torch.bfloat16)
    assert torch.equal(post_site_excess(reordered, stock, f, streams, post, comb), torch.zeros(s))
    assert not torch.equal(reordered, stock)  # the orders differ somewhere: the test compares two roundings
    transposed = hc_post(None, f, streams, HCMix(mix.pre, post, comb.transpose(-1, -2)))
    assert post_site_excess(transposed, stock, f, streams, post, comb).min() > 0.1
    in_bf16 = (post[..., None] * f.float()[:, None, :]).to(torch.bfloat16)
    for j in range(n):
        in_bf16 = (in_bf16.float() + (comb[:, j, :, None] * streams.float()[:, j:j + 1, :]).to(torch.bfloat16)
                   ).to(torch.bfloat16)
    assert post_site_excess(in_bf16, stock, f, streams, post, comb).mean() > 0.01
    poisoned = stock.clone()
    poisoned[0, 0, 0] = float("nan")  # a NaN where the stock op has a number is beyond any rounding
    assert post_site_excess(poisoned, stock, f, streams, post, comb)[0] == 1 / (n * d)
    assert post_site_excess(poisoned, poisoned, f, streams, post, comb)[0] == 0  # NaN on both sides: the input's
    tiny = stock.float() * 2.0**-140  # subnormal outputs: a kernel that flushes them to zero stays within
    assert post_site_excess(torch.zeros_like(tiny), tiny, f * 0, streams * 0, post, comb).max() == 0
