"""O1/O2 kernel emulations against straightforward fp64 math (derived bounds), invariances that must hold
bit for bit, edge cases, and Triton-interpreter runs that check indexing and masking (DESIGN §9–§10).

Bounds are derived in optimized/kernels/testing.py (decode_out_bound, decode_lse_bound, indexer_bound).
"""

from __future__ import annotations

import os

import torch

# The Triton interpreter is chosen when a kernel is decorated, i.e. when its module is first imported: set it
# before anything imports triton. Only without CUDA, so a GPU box running every test file keeps real kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from optimized.kernels import triton_available, triton_interpreting  # noqa: E402
from optimized.kernels.indexer_logits import fp8_paged_mqa_logits  # noqa: E402
from optimized.kernels.sparse_decode import (PagedLatentRows, num_splits, sparse_decode_partials,  # noqa: E402
                                             sparse_decode_splitk)
from optimized.kernels.testing import (U_BF16, decode_lse_bound, decode_out_bound,  # noqa: E402
                                       dense_decode_reference, indexer_bound, indexer_reference,
                                       make_decode_case, make_indexer_case, partial_straddle_bound,
                                       recipe_partials_fp64)
from optimized.paged_cache import IndexKeyCache, LatentCache  # noqa: E402

# small shapes: nope 56 (one partial 64-wide scale block), rope 8, 4 heads; Kc not a multiple of 64
SMALL = dict(batch=5, heads=4, nope=56, rope=8, n_main=128, n_extra=200)

interpreter = pytest.mark.skipif(not (triton_available() and triton_interpreting()),
                                 reason="needs triton and TRITON_INTERPRET=1 (CPU-only process)")


def assert_within(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    err = (actual.double() - expected.double()).abs()
    excess = err - bound
    if excess.numel() == 0:
        return
    worst = int(excess.flatten().argmax())
    assert bool((excess <= 0).all()), (
        f"{what}: {int((excess > 0).sum())} elements outside the derived bound; worst at flat index {worst}: "
        f"|err| = {err.flatten()[worst]:.3e} > bound {bound.flatten()[worst]:.3e}")


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.double() - expected.double()).norm() / expected.double().norm().clamp(min=1e-300))


# ---------------------------------------------------------------------------------------------
# O1 emulation
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_splitk_matches_dense_softmax_with_sink(seed):
    case = make_decode_case(**SMALL, seed=seed)
    out, lse = sparse_decode_splitk(*case.args(), impl="torch")
    ref = dense_decode_reference(case)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert_within(out, ref.out, decode_out_bound(ref), "split-K out vs fp64 dense softmax with sink")
    assert_within(lse, ref.lse, decode_lse_bound(ref), "split-K lse vs fp64 dense")
    # typical error: two bf16 roundings of RMS ~2^-9.5 each and averaged P error -> well below 2^-8
    assert rel_l2(out, ref.out) <= U_BF16, f"relative L2 {rel_l2(out, ref.out):.2e} > 2^-8"


def test_partials_are_per_tile_softmax():
    """Each split is the exact softmax of its 64 lanes (up to the bf16 roundings), empty tiles are (0, −inf)."""
    case = make_decode_case(**SMALL, seed=3)
    mid_out, mid_lse = sparse_decode_partials(*case.args()[:5], case.softmax_scale, impl="torch")
    assert mid_out.shape[2] == num_splits(128, 200) == 6
    main_tiles = case.main_slots.view(case.q.shape[0], 2, 64)
    extra_pad = torch.cat([case.extra_slots, case.extra_slots.new_full((case.q.shape[0], 56), -1)], 1)
    tiles = [(case.main_cache, main_tiles[:, i]) for i in range(2)] + \
            [(case.extra_cache, extra_pad.view(case.q.shape[0], 4, 64)[:, i]) for i in range(4)]
    for s, (cache, slots) in enumerate(tiles):
        rows = cache.load(slots).double()
        valid = slots >= 0
        logits = (torch.einsum("bhd,bkd->bhk", case.q.double(), rows) * case.softmax_scale).masked_fill(
            ~valid[:, None], float("-inf"))
        empty = ~valid.any(-1)
        probs = torch.softmax(logits, -1).nan_to_num(0.0)
        expected = torch.einsum("bhk,bkd->bhd", probs, rows)
        v_absmax = (rows.abs() * valid[..., None]).amax(1)[:, None, :]
        # P rounding and the partial's own bf16 store: 2 roundings of 2^-8, plus 2^-10 for fp32 noise
        assert_within(mid_out[:, :, s], expected, (2 * U_BF16 + 2.0**-10) * v_absmax, f"partial out of split {s}")
        assert bool((mid_lse[empty, :, s] == float("-inf")).all()) and bool((mid_out[empty, :, s] == 0).all())
        lse_ref = torch.logsumexp(logits, -1)
        assert torch.allclose(mid_lse[~empty, :, s].double(), lse_ref[~empty], rtol=0, atol=1e-4), \
            f"partial lse of split {s}"
    assert bool(torch.isinf(mid_lse[0, :, 0]).all()), "row 0's first window tile is empty by construction"


def test_partials_follow_every_bf16_rounding_of_the_recipe():
    """Against the recipe in fp64 with explicit bf16 roundings: bit-identical except at rare rounding-boundary
    straddles (fp32 vs fp64 intermediates, ~1e-7 relative apart, straddle a 2^-8-wide bf16 step with probability
    ~3e-5), bounded by partial_straddle_bound. Skipping the P cast or the bf16 partial store makes far more than
    1% of the elements differ (checked by mutating the emulation)."""
    case = make_decode_case(**{**SMALL, "batch": 16}, seed=12)
    mid_out, mid_lse = sparse_decode_partials(*case.args()[:5], case.softmax_scale, impl="torch")
    assert mid_out.dtype == torch.bfloat16 and mid_lse.dtype == torch.float32
    model_out, model_lse, abs_out = recipe_partials_fp64(case)
    differ = mid_out.double() != model_out
    assert float(differ.float().mean()) <= 0.01, f"{float(differ.float().mean()):.2%} of partial elements differ"
    assert_within(mid_out, model_out, partial_straddle_bound(model_out, abs_out), "partial out vs fp64 recipe model")
    assert torch.equal(torch.isneginf(mid_lse), torch.isneginf(model_lse))


def test_page_table_scrambling_is_invisible_bit_for_bit():
    case = make_decode_case(**SMALL, seed=4)
    out, lse = sparse_decode_splitk(*case.args(), impl="torch")
    # the same logical rows stored through a different page table
    for cache in (case.main_cache, case.extra_cache):
        logical = cache.load(torch.arange(cache.length, dtype=torch.int32)).float()
        fresh = LatentCache(cache.length, cache.nope, cache.rope, "cpu")
        fresh.page_table = torch.arange(fresh.page_table.shape[0], dtype=torch.int32)  # identity
        fresh.append(logical)
        cache.codes, cache.scales, cache.rope_part, cache.page_table = (fresh.codes, fresh.scales, fresh.rope_part,
                                                                        fresh.page_table)
    out2, lse2 = sparse_decode_splitk(*case.args(), impl="torch")
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


def test_main_extra_partition_at_tile_boundary_is_bit_exact():
    """main 128 + extra 128 lanes of one cache = main 256 lanes: the same four splits, the same merge."""
    case = make_decode_case(**SMALL, seed=5)
    extra_from_main = torch.randint(0, 256, (5, 128), dtype=torch.int32, generator=torch.Generator().manual_seed(9))
    extra_from_main[2, 30:] = -1
    split_in_two = sparse_decode_splitk(case.q, case.main, case.main_slots, case.main, extra_from_main, case.sink,
                                        case.softmax_scale, impl="torch")
    one_list = sparse_decode_splitk(case.q, case.main, torch.cat([case.main_slots, extra_from_main], 1), None, None,
                                    case.sink, case.softmax_scale, impl="torch")
    assert torch.equal(split_in_two[0], one_list[0]) and torch.equal(split_in_two[1], one_list[1])


def test_no_extra_list_equals_dense_over_window():
    case = make_decode_case(**{**SMALL, "n_extra": 0}, seed=6)
    out, lse = sparse_decode_splitk(case.q, case.main, case.main_slots, None, None, case.sink, case.softmax_scale,
                                    impl="torch")
    ref = dense_decode_reference(case)
    assert_within(out, ref.out, decode_out_bound(ref), "Kc = 0")
    assert_within(lse, ref.lse, decode_lse_bound(ref), "Kc = 0 lse")
    mid_out, _ = sparse_decode_partials(*case.args()[:5], case.softmax_scale, impl="torch")
    assert mid_out.shape[2] == 2


def test_every_lane_invalid_gives_zero_and_the_sink():
    case = make_decode_case(**SMALL, seed=7)
    case.main_slots[3] = -1
    case.extra_slots[3] = -1
    out, lse = sparse_decode_splitk(*case.args(), impl="torch")
    assert bool((out[3] == 0).all()), "no valid lane: out must be exactly 0"
    assert torch.equal(lse[3], case.sink), f"no valid lane: lse must be the sink, got {lse[3]} vs {case.sink}"
    assert bool(torch.isfinite(out.float()).all()) and not bool(torch.isnan(lse).any())


def test_sink_is_applied_once():
    """With one valid lane the answer is closed-form: out = v·sigmoid(logit − sink), lse = logaddexp(logit, sink)."""
    case = make_decode_case(**SMALL, seed=8)
    case.main_slots.fill_(-1)
    case.extra_slots.fill_(-1)
    case.extra_slots[:, 77] = torch.arange(5, dtype=torch.int32) * 11
    out, lse = sparse_decode_splitk(*case.args(), impl="torch")
    v = case.extra_cache.load(case.extra_slots[:, 77]).double()  # [B, d]
    logit = torch.einsum("bhd,bd->bh", case.q.double(), v) * case.softmax_scale
    expected = v[:, None, :] * torch.sigmoid(logit - case.sink.double())[..., None]
    # one valid lane: p = 1 and l = 1 exactly, the partial is v exactly; only the final bf16 cast remains
    assert_within(out, expected, U_BF16 * expected.abs() + 1e-6 * v.abs().amax(-1)[:, None, None], "one lane")
    assert torch.allclose(lse.double(), torch.logaddexp(logit, case.sink.double()), rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# O2 emulation
# ---------------------------------------------------------------------------------------------

SMALL_INDEXER = dict(batch=9, heads=4, dim=32, n_keys=300)


@pytest.mark.parametrize("dot_precision", ["fp32", "bf16", "tf32"])
def test_indexer_logits_match_exact_math(dot_precision):
    case = make_indexer_case(**SMALL_INDEXER, seed=0)
    logits = fp8_paged_mqa_logits(*case.args(), dot_precision=dot_precision, impl="torch")
    ref = indexer_reference(case)
    assert logits.shape == (9, case.n_cols) and logits.dtype == torch.float32
    assert torch.equal(torch.isneginf(logits), ~ref.visible), "masked columns must be exactly t >= context_len"
    vis = ref.visible
    assert_within(logits[vis], ref.logits[vis], indexer_bound(case, ref, dot_precision)[vis],
                  f"indexer logits ({dot_precision}) vs exact")


def test_indexer_bf16_dots_are_rounded_to_nearest_even():
    """q·k = 1 + 2^-8 + 2^-9 is not a bf16 value; RNE gives 1 + 2^-7, truncation would give 1, fp32 keeps it."""
    key_codes = torch.zeros(1, 64, 32, dtype=torch.float8_e4m3fn)
    key_codes[:, :, :3] = 1.0
    q_codes = torch.zeros(1, 1, 32, dtype=torch.float8_e4m3fn)
    q_codes[0, 0, :3] = torch.tensor([1.0, 2.0**-8, 2.0**-9])  # a normal and two e4m3 subnormals, exact
    args = (q_codes, torch.ones(1, 1), key_codes, torch.ones(1, 64), torch.zeros(1, dtype=torch.int32),
            torch.tensor([64], dtype=torch.int32), 64)
    assert float(fp8_paged_mqa_logits(*args, dot_precision="fp32", impl="torch")[0, 0]) == 1 + 2.0**-8 + 2.0**-9
    assert float(fp8_paged_mqa_logits(*args, dot_precision="bf16", impl="torch")[0, 0]) == 1 + 2.0**-7
    if triton_available() and triton_interpreting():  # the kernel's own rounding, not the interpreter's cast
        assert float(fp8_paged_mqa_logits(*args, dot_precision="bf16", impl="triton")[0, 0]) == 1 + 2.0**-7


def test_indexer_bf16_logits_of_one_head_are_bf16_values():
    case = make_indexer_case(batch=4, heads=1, dim=32, n_keys=256, seed=1)
    case.weights.fill_(1.0)
    case.cache.scale.fill_(1.0)
    bf16 = fp8_paged_mqa_logits(*case.args(), dot_precision="bf16", impl="torch")
    fp32 = fp8_paged_mqa_logits(*case.args(), dot_precision="fp32", impl="torch")
    vis = torch.isfinite(bf16)
    assert torch.equal(bf16[vis], bf16[vis].to(torch.bfloat16).float()), "bf16 head dots must be bf16 values"
    assert not torch.equal(fp32[vis], fp32[vis].to(torch.bfloat16).float()), "fp32 dots should not all be bf16"


def test_indexer_masked_value_zero_only_changes_masked_columns():
    case = make_indexer_case(**SMALL_INDEXER, seed=2)
    neg_inf = fp8_paged_mqa_logits(*case.args(), masked_value=float("-inf"), impl="torch")
    zero = fp8_paged_mqa_logits(*case.args(), masked_value=0.0, impl="torch")
    visible = torch.arange(case.n_cols)[None, :] < case.context_lens[:, None]
    assert torch.equal(neg_inf[visible], zero[visible])
    assert bool((zero[~visible] == 0).all()) and bool(torch.isneginf(neg_inf[~visible]).all())
    # the edge context lengths 0, 1, 63, 64, 65 and n_keys are in the first rows
    assert [int(visible[i].sum()) for i in range(6)] == [0, 1, 63, 64, 65, 300]


def test_indexer_page_table_scrambling_is_invisible_bit_for_bit():
    scrambled = make_indexer_case(**SMALL_INDEXER, seed=3, scrambled=True)
    identity = make_indexer_case(**SMALL_INDEXER, seed=3, scrambled=False)
    assert not torch.equal(scrambled.cache.page_table, identity.cache.page_table)
    for precision in ("fp32", "bf16"):
        a = fp8_paged_mqa_logits(*scrambled.args(), dot_precision=precision, impl="torch")
        b = fp8_paged_mqa_logits(*identity.args(), dot_precision=precision, impl="torch")
        assert torch.equal(a, b)


def test_indexer_per_row_page_tables():
    """A [B, n_pages] table: row b reads its own pages (here: row-specific permutations of the same pages)."""
    case = make_indexer_case(**SMALL_INDEXER, seed=4)
    ref = fp8_paged_mqa_logits(*case.args(), dot_precision="fp32", impl="torch")
    n_pages = case.cache.page_table.shape[0]
    g = torch.Generator().manual_seed(0)
    # move every row's logical pages to fresh physical pages, differently per row
    tables, codes, scales = [], [case.cache.codes], [case.cache.scale]
    for b in range(case.q_codes.shape[0]):
        perm = torch.randperm(n_pages, generator=g)
        base = sum(c.shape[0] for c in codes)
        phys = torch.empty(n_pages, dtype=torch.long)
        phys[perm] = torch.arange(n_pages)
        codes.append(case.cache.codes[case.cache.page_table.long()][perm])
        scales.append(case.cache.scale[case.cache.page_table.long()][perm])
        tables.append((base + phys).to(torch.int32))
    args = (case.q_codes, case.weights, torch.cat(codes), torch.cat(scales), torch.stack(tables),
            case.context_lens, case.n_cols)
    per_row = fp8_paged_mqa_logits(*args, dot_precision="fp32", impl="torch")
    ref_case = indexer_reference(case)
    both = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(per_row), both)
    assert_within(per_row[both], ref[both], 2 * indexer_bound(case, ref_case, "fp32")[both], "per-row page tables")


def test_tf32_emulation_is_the_fp32_value_recipe():
    case = make_indexer_case(**SMALL_INDEXER, seed=5)
    assert torch.equal(fp8_paged_mqa_logits(*case.args(), dot_precision="tf32", impl="torch"),
                       fp8_paged_mqa_logits(*case.args(), dot_precision="fp32", impl="torch"))


# ---------------------------------------------------------------------------------------------
# Triton interpreter: indexing and masking (numerics are checked on the GPU, DESIGN §10)
# ---------------------------------------------------------------------------------------------


@interpreter
def test_interpreter_decode_one_valid_lane_per_row_reads_the_right_row():
    """One valid lane per row, in a different split each row: p = l = 1, so the right partial must hold the
    cache row exactly, every other split (0, −inf), and the final answer v·sigmoid(logit − sink)."""
    case = make_decode_case(**SMALL, seed=10)
    case.main_slots.fill_(-1)
    case.extra_slots.fill_(-1)
    lanes = [(0, 5, 17), (0, 100, 255), (1, 0, 3), (1, 131, 699), (1, 199, 64)]  # (list, lane, slot)
    for b, (which, lane, slot) in enumerate(lanes):
        (case.main_slots if which == 0 else case.extra_slots)[b, lane] = slot
    mid_out, mid_lse = sparse_decode_partials(*case.args()[:5], case.softmax_scale, impl="triton")
    for b, (which, lane, slot) in enumerate(lanes):
        split = lane // 64 + (2 if which else 0)
        cache = case.extra_cache if which else case.main_cache
        row = cache.load(torch.tensor([slot], dtype=torch.int32))[0]
        assert torch.equal(mid_out[b, :, split], row.expand(4, -1)), f"row {b}: split {split} must be the row"
        others = [s for s in range(6) if s != split]
        assert bool((mid_out[b, :, others] == 0).all()) and bool(torch.isneginf(mid_lse[b, :, others]).all())
    out, lse = sparse_decode_splitk(*case.args(), impl="triton")
    emu_out, emu_lse = sparse_decode_splitk(*case.args(), impl="torch")
    assert torch.allclose(out.float(), emu_out.float(), rtol=2 * U_BF16, atol=0)
    assert torch.allclose(lse, emu_lse, rtol=0, atol=1e-5)


@interpreter
@pytest.mark.parametrize("n_extra", [0, 200])
def test_interpreter_decode_matches_emulation(n_extra):
    """Random lanes with empty tiles, a row without extra lanes, a row without any lane; loose tolerance."""
    case = make_decode_case(**{**SMALL, "n_extra": n_extra}, seed=11)
    case.main_slots[4] = -1
    case.extra_slots[4] = -1
    tri_mid = sparse_decode_partials(*case.args()[:5], case.softmax_scale, impl="triton")
    emu_mid = sparse_decode_partials(*case.args()[:5], case.softmax_scale, impl="torch")
    assert torch.equal(torch.isneginf(tri_mid[1]), torch.isneginf(emu_mid[1])), "empty splits differ"
    out, lse = sparse_decode_splitk(*case.args(), impl="triton")
    ref = dense_decode_reference(case)
    assert_within(out, ref.out, decode_out_bound(ref), "interpreter out vs fp64 dense")
    assert_within(lse, ref.lse, decode_lse_bound(ref), "interpreter lse vs fp64 dense")
    assert bool((out[4] == 0).all()) and torch.equal(lse[4], case.sink)


@interpreter
@pytest.mark.parametrize("masked_value", [float("-inf"), 0.0])
@pytest.mark.parametrize("dot_precision", ["fp32", "bf16", "tf32"])
def test_interpreter_indexer_masks_exactly_the_columns_past_context(masked_value, dot_precision):
    case = make_indexer_case(**SMALL_INDEXER, seed=12)
    tri = fp8_paged_mqa_logits(*case.args(), dot_precision=dot_precision, masked_value=masked_value,
                               impl="triton")
    emu = fp8_paged_mqa_logits(*case.args(), dot_precision=dot_precision, masked_value=masked_value, impl="torch")
    visible = torch.arange(case.n_cols)[None, :] < case.context_lens[:, None]
    assert bool((tri[~visible] == masked_value).all()), "columns >= context_len must hold masked_value"
    ref = indexer_reference(case)
    assert_within(tri[visible], ref.logits[visible], indexer_bound(case, ref, dot_precision)[visible],
                  "interpreter logits vs exact")
    assert_within(tri[visible], emu[visible], 2 * indexer_bound(case, ref, dot_precision)[visible],
                  "interpreter vs emulation")


@interpreter
def test_interpreter_indexer_reads_pages_through_the_table():
    """Each key page holds one distinct constant key; one head, w = 1: the logit names the page it came from."""
    cache = IndexKeyCache(256, 32, "cpu")
    cache.page_table = torch.tensor([2, 0, 3, 1], dtype=torch.int32)
    keys = torch.zeros(256, 32)
    keys[:, 0] = torch.arange(256, dtype=torch.float32) // 64 + 1  # logical page p -> key (p+1, 0, ...)
    cache.append(keys)
    q_codes = torch.zeros(2, 1, 32, dtype=torch.float8_e4m3fn)
    q_codes[:, 0, 0] = 1.0
    ctx = torch.tensor([256, 130], dtype=torch.int32)
    logits = fp8_paged_mqa_logits(q_codes, torch.ones(2, 1), cache.codes, cache.scale, cache.page_table, ctx, 256,
                                  impl="triton")
    expected = (torch.arange(256) // 64 + 1).float()
    assert torch.equal(logits[0], expected)
    assert torch.equal(logits[1, :130], expected[:130]) and bool(torch.isneginf(logits[1, 130:]).all())


@interpreter
def test_interpreter_indexer_per_row_page_tables():
    """Row b reads logical page p at page_table[b, p]: rows with reversed tables see the pages reversed."""
    cache = IndexKeyCache(256, 32, "cpu")
    cache.page_table = torch.arange(4, dtype=torch.int32)
    keys = torch.zeros(256, 32)
    keys[:, 0] = torch.arange(256, dtype=torch.float32) // 64 + 1
    cache.append(keys)
    tables = torch.stack([torch.arange(4), torch.arange(4).flip(0)]).to(torch.int32)
    q_codes = torch.zeros(2, 1, 32, dtype=torch.float8_e4m3fn)
    q_codes[:, 0, 0] = 1.0
    args = (q_codes, torch.ones(2, 1), cache.codes, cache.scale, tables, torch.tensor([256, 200], dtype=torch.int32),
            256)
    tri = fp8_paged_mqa_logits(*args, impl="triton")
    assert torch.equal(tri, fp8_paged_mqa_logits(*args, impl="torch"))
    assert torch.equal(tri[1, :192], (4 - torch.arange(192) // 64).float())


def test_impl_triton_without_interpreter_on_cpu_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if not triton_available() or torch.cuda.is_available():
        pytest.skip("needs triton and no CUDA")
    case = make_decode_case(**SMALL, seed=0)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        sparse_decode_splitk(*case.args(), impl="triton")


def test_paged_latent_rows_of_cache_are_views():
    cache = LatentCache(64, 56, 8, "cpu")
    rows = PagedLatentRows.of(cache)
    assert rows.codes is cache.codes and rows.page_table is cache.page_table and rows.nope == 56


def test_a_latent_rows_stored_form_is_what_its_slots_read_back():
    """LatentCache.stored_form (the kv cache site's expectation) is bit for bit what load() gives after append: FP8
    nope with its power-of-two block scales, bf16 rope; and it stores nothing."""
    cache = LatentCache(200, 56, 8, "cpu")
    rows = torch.randn(130, 64, generator=torch.Generator().manual_seed(3)) * torch.logspace(-3, 2, 64)
    expected = cache.stored_form(rows)
    assert cache.length == 0
    cache.append(rows[:70])
    cache.append(rows[70:])
    assert torch.equal(cache.load(torch.arange(130)), expected) and expected.dtype == torch.bfloat16


@pytest.mark.parametrize("fp4", [False, True])
def test_an_index_keys_stored_form_is_what_its_slots_read_back(fp4):
    """IndexKeyCache.stored_form against rows_at() after append, for the FP8 layout and the FP4 one."""
    cache = IndexKeyCache(200, 64, "cpu", fp4=fp4)
    rows = torch.randn(130, 64, generator=torch.Generator().manual_seed(4)) * torch.logspace(-3, 2, 64)
    expected = cache.stored_form(rows)
    cache.append(rows[:70])
    cache.append(rows[70:])
    assert torch.equal(cache.rows_at(torch.arange(130)), expected) and torch.equal(cache.dense(), expected)


@interpreter
@pytest.mark.parametrize("key,offset,numel", [(0, 0, 1), (0xDEADBEEF, 0, 5000), (0x7FFFFFFF, 2**31 - 100, 2000),
                                              (0xFFFFFFFF, 2**32 - 3000, 3000), (12345, 1 << 24, 1025)])
def test_interpreter_fused_standard_normal_is_the_torch_streams_bits(key, offset, numel):
    """reference.weights.hashing_triton against hashing.standard_normal's torch path (the definition): the same
    fp32 bits for keys across the whole 32-bit range (below and above 2^31, where Triton types an int argument
    differently), offsets up to the last index below 2^32, and a length that is not a multiple of the block."""
    from reference.weights import hashing
    from reference.weights.hashing_triton import standard_normal_triton

    torch_path = hashing.standard_normal(key, numel, "cpu", offset)  # the CPU never takes the kernel
    fused = standard_normal_triton(key, numel, "cpu", offset, hashing.INV_STD_IH4)
    assert torch.equal(fused.view(torch.int32), torch_path.view(torch.int32))


# optimized.kernels.rounding: the engine's bf16 round trip and FP8 activation quantizer in one pass. The kernels
# round in integer arithmetic, so the interpreter runs the GPU's rounding and every bit is compared here.


@interpreter
def test_interpreter_bf16_round_is_the_torch_round_trip_bit_for_bit():
    """Random fp32 bit patterns over every exponent, every tie between bf16 values at eight exponents (bf16
    subnormals to the largest) with its neighbours, ±0, ±inf and the largest finite fp32: the same bits as
    `x.to(bfloat16).float()`, a NaN still a NaN."""
    from optimized.kernels.rounding import bf16_round
    from optimized.kernels.testing import bf16_round_cases, same_bits

    x = bf16_round_cases()
    fused = bf16_round(x, impl="triton")
    expected = x.to(torch.bfloat16).float()
    assert bool(same_bits(fused, expected).all()), int((~same_bits(fused, expected)).sum())
    assert bool(torch.isinf(fused[-2:]).all()), "the largest finite fp32 rounds to ±inf in bf16"


@interpreter
@pytest.mark.parametrize("block", [128, 64])
def test_interpreter_fp8_block_quant_is_the_reference_fake_quant_bit_for_bit(block):
    """Every e4m3 midpoint and its neighbours (normal and subnormal, both signs) under scales 2^-20 … 2^100, block
    maxima one ulp either side of 448·2^k, the amax floor, signed zeros, inf and NaN blocks, random blocks of many
    magnitudes: the same bits as reference.quant.fp8_fake_quant."""
    from optimized.kernels.rounding import fp8_block_quant
    from optimized.kernels.testing import fp8_block_quant_cases, same_bits
    from reference.quant import fp8_fake_quant

    x = fp8_block_quant_cases(block)
    fused = fp8_block_quant(x, block, 1e-4, impl="triton")
    expected = fp8_fake_quant(x, block=block, amax_floor=1e-4)
    assert bool(same_bits(fused, expected).all()), int((~same_bits(fused, expected)).sum())
    assert bool(torch.signbit(fused[x.signbit() & (x == 0)]).all()), "−0 stays −0"


def test_fp8_block_quant_cases_hold_the_hard_decisions():
    """The cases above are only as good as what they hold: ties of e4m3 values that round up and down (to the even
    code), e4m3 subnormal results, the saturation of an inf (to 448 at scale 1, as torch's clamp does), and scales on
    both sides of an exponent flip."""
    from optimized.kernels.testing import fp8_block_quant_cases
    from reference.quant import fp8_fake_quant, ue8m0_scale_for

    x = fp8_block_quant_cases(128)
    q = fp8_fake_quant(x, block=128, amax_floor=1e-4)
    unit = (x.abs() == 448.0)  # blocks at scale 1: their values are their e4m3 codes' values
    rows = unit.any(1)
    vals, outs = x[rows].flatten(), q[rows].flatten()
    assert bool(((vals == 2.5 * 2.0**-9) & (outs == 2.0 * 2.0**-9)).any()), "a subnormal tie to even (down)"
    assert bool(((vals == 3.5 * 2.0**-9) & (outs == 4.0 * 2.0**-9)).any()), "a subnormal tie to even (up)"
    assert bool(((vals == 1.0625) & (outs == 1.0)).any()) and bool(((vals == 1.1875) & (outs == 1.25)).any())
    assert q[x == float("inf")].tolist() == [448.0], "an inf in a block: scale 1 (frexp's exponent 0), clamped"
    top = torch.tensor(448.0).view(torch.int32)
    amax = x.reshape(-1, 128).abs().amax(1)
    exponents = ue8m0_scale_for(amax, 448.0, 1e-4)
    for k in (-10, 0, 10):  # a block maximum of exactly 448·2^k has scale 2^k, one ulp more 2^(k+1)
        at = torch.tensor(448.0 * 2.0**k).view(torch.int32)
        assert set(exponents[amax.view(torch.int32) == at].tolist()) == {k}
        assert exponents[amax.view(torch.int32) == at + 1].tolist() == [k + 1]



@pytest.mark.parametrize("fn", ["bf16_round", "fp8_block_quant"])
def test_rounding_kernels_refuse_what_they_cannot_read(fn, monkeypatch):
    """The Triton path reads a contiguous fp32 tensor and, for the quantizer, whole blocks and an amax floor of at
    least 2^-118 (its scale-exponent arithmetic needs a normal block maximum): asked for by name, anything else is a
    clear error naming the function, not a wrong answer (the engine routes only what fused_rounding_applies
    admits)."""
    if not triton_available():
        pytest.skip("needs triton")
    from optimized.kernels import rounding
    from reference.quant import fp8_fake_quant

    call = (lambda x: rounding.bf16_round(x, impl="triton")) if fn == "bf16_round" else \
        (lambda x: rounding.fp8_block_quant(x, 128, 1e-4, impl="triton"))
    if not triton_interpreting():
        pytest.skip("the Triton path on CPU tensors needs the interpreter")
    with pytest.raises(ValueError, match=fn):
        call(torch.ones(4, 256).T)
    with pytest.raises(ValueError, match=fn):
        call(torch.ones(4, 256, dtype=torch.float64))
    if fn == "fp8_block_quant":
        with pytest.raises(ValueError, match="multiple of the block"):
            call(torch.ones(4, 200))
        with pytest.raises(ValueError, match="amax floor of at least 2\\^-118"):
            rounding.fp8_block_quant(torch.ones(4, 256), 128, 1e-40, impl="triton")
        # where "auto" resolves to Triton (a GPU; here forced), what the kernel cannot read takes the torch path
        monkeypatch.setattr(rounding, "resolve_impl", lambda impl, device: "triton")
        x = torch.full((4, 256), 2.0**-130)
        assert torch.equal(rounding.fp8_block_quant(x, 128, 0.0), fp8_fake_quant(x, block=128, amax_floor=0.0))
        assert torch.equal(rounding.fp8_block_quant(x.T, 4, 1e-4), fp8_fake_quant(x.T, block=4, amax_floor=1e-4))
    else:
        monkeypatch.setattr(rounding, "resolve_impl", lambda impl, device: "triton")
        x = torch.randn(4, 256)
        assert torch.equal(rounding.bf16_round(x.T), x.T.to(torch.bfloat16).float())


def test_the_cpu_engine_never_takes_the_fused_rounding(monkeypatch):
    """numerics.bf16 and fp8_activation keep the torch ops for CPU tensors (whose bits tests/test_metrics_pin.py
    pins): the one-pass kernels are for a GPU's prefill-sized tensors only."""
    from optimized import numerics
    from optimized.kernels.rounding import fused_rounding_applies
    from reference.quant import fp8_fake_quant

    def refuse(*args, **kwargs):
        raise AssertionError("the fused rounding ran on a CPU tensor")

    monkeypatch.setattr(numerics, "bf16_round", refuse)
    monkeypatch.setattr(numerics, "fp8_block_quant", refuse)
    x = torch.randn(1024, 512)  # larger than a replayed graph's inputs
    assert not fused_rounding_applies(x)
    assert torch.equal(numerics.bf16(x), x.to(torch.bfloat16).float())
    assert torch.equal(numerics.fp8_activation(x), fp8_fake_quant(x, block=128, amax_floor=1e-4))


@interpreter
def test_a_device_whose_kernels_round_otherwise_keeps_the_torch_ops(monkeypatch):
    """kernels_match_torch: True where the kernels give the torch ops' bits (the interpreter here); a kernel that
    rounds otherwise (truncating, as the interpreter's own cast would) or fails makes it False with a warning that
    says so, and the engine then never takes the one-pass path on that device."""
    from optimized.kernels import rounding, rounding_triton

    check = rounding._kernels_match_torch.__wrapped__  # uncached, so each call checks again
    assert check(torch.device("cpu"))
    truncating = lambda x: (x.view(torch.int32) & -65536).view(torch.float32)  # noqa: E731
    monkeypatch.setattr(rounding_triton, "bf16_round_triton", truncating)
    with pytest.warns(RuntimeWarning, match=r"differ from the torch ops .*'bf16_round': [1-9]"):
        assert not check(torch.device("cpu"))

    def broken(*args):
        raise RuntimeError("no such instruction")

    monkeypatch.setattr(rounding_triton, "fp8_block_quant_triton", broken)
    with pytest.warns(RuntimeWarning, match="failed on cpu.*no such instruction"):
        assert not check(torch.device("cpu"))
