"""Tests of the transformers oracle itself (tests/hf_oracle.py).

If the oracle is wrong, every reference-vs-HF comparison built on it is meaningless, so each test
here checks one promise of the oracle in a way that fails when the promise is broken:
tie order of top-k (torch level and inside the HF model), chunk/decode invariance of the cached
path, non-trivial randomised weights, and the checkpoint/official-name round trip.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
from safetensors.torch import save_file  # noqa: E402
from transformers import DeepseekV4ForCausalLM  # noqa: E402

from hf_oracle import (  # noqa: E402
    build_hf_model,
    flash_layer_types,
    hf_layer_outputs,
    hf_logits,
    hf_run,
    hf_weights_state_dict,
    official_name,
    save_hf_checkpoint,
    stable_topk,
    tiny_hf_config,
)

N_TOKENS = 1100
CHUNK = 367  # splits 4- and 128-token windows and crosses the 128-token window edge
SEED = 0


def _ids(n: int, seed: int, vocab: int = 512) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _expected_topk_indices(x: torch.Tensor, k: int, largest: bool = True) -> list[list[int]]:
    """Lower-index-wins top-k computed with plain Python sorting (independent of torch.sort)."""
    out = []
    for row in x.reshape(-1, x.shape[-1]).tolist():
        order = sorted(range(len(row)), key=lambda i: ((-row[i] if largest else row[i]), i))
        out.append(order[:k])
    return out


@pytest.fixture(scope="module")
def flash():
    """Flash-like tiny model and one-shot (cached, stable-tie) run over 1100 random tokens, with the
    CSA layers' indexer scores/selections and every router's inputs/outputs captured by hooks."""
    cfg = tiny_hf_config("flash-like")
    model = build_hf_model(cfg, seed=SEED)
    ids = _ids(N_TOKENS, seed=10)
    captured: dict[str, list] = {"scores": [], "router": []}
    hooks = []
    for layer, kind in enumerate(cfg.layer_types):
        if kind == "compressed_sparse_attention":
            idx = model.model.layers[layer].self_attn.compressor.indexer
            hooks.append(idx.scorer.register_forward_hook(
                lambda _m, _a, out, L=layer: captured["scores"].append((L, out[0].clone()))))
        if cfg.mlp_layer_types[layer] == "moe":
            gate = model.model.layers[layer].mlp.gate
            hooks.append(gate.register_forward_hook(
                lambda mod, args, out, L=layer: captured["router"].append(
                    (L, out[0].clone(), out[2].clone(), mod.e_score_correction_bias.clone()))))
    try:
        run = hf_run(model, ids, layer_outputs=True, record_selections=True)
    finally:
        for h in hooks:
            h.remove()
    return cfg, model, ids, run, captured


# ------------------------------------------------------------------------------------------------
# stable_topk
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [7, 64, 1000, 3000, 20000])
def test_stable_topk_lower_index_wins_regardless_of_length(n):
    g = torch.Generator().manual_seed(n)
    # big zero plateaus (like the indexer's ReLU) plus repeated non-zero values
    x = torch.randint(-3, 4, (3, n), generator=g).float().clamp_min(0) * 0.25
    k = min(n, 40)
    native_fn, native_method = torch.topk, torch.Tensor.topk
    with stable_topk():
        via_fn = torch.topk(x, k, dim=-1)
        via_method = x.topk(k, dim=-1, sorted=False)
        v_small, i_small = torch.topk(x, k, largest=False)
        along0 = torch.topk(x.T.contiguous(), 2, dim=0)
    expected = _expected_topk_indices(x, k)
    assert via_fn.indices.tolist() == expected
    assert via_method.indices.tolist() == expected  # the Tensor method (used by HF's indexer) too
    assert torch.equal(via_fn.values, torch.gather(x, 1, via_fn.indices))
    assert via_fn.values.dtype == x.dtype and via_fn.indices.dtype == torch.long
    assert i_small.tolist() == _expected_topk_indices(x, k, largest=False)
    assert torch.equal(v_small, torch.gather(x, 1, i_small))
    assert along0.indices.T.tolist() == _expected_topk_indices(x, 2)
    # restored on exit
    assert torch.topk is native_fn and torch.Tensor.topk is native_method


def test_native_topk_is_not_stable_so_the_patch_matters():
    """Documents why stable_topk exists: torch.topk's tie order is not lower-index-first."""
    x = torch.zeros(3000)
    native = torch.topk(x, 5).indices.tolist()
    with stable_topk():
        stable = torch.topk(x, 5).indices.tolist()
    assert stable == [0, 1, 2, 3, 4]
    if native == stable:  # pragma: no cover - depends on the torch build
        pytest.skip("this torch build happens to order these ties by index")


def test_stable_topk_reaches_hf_indexer(flash):
    """Every CSA query's selected rows are exactly the lower-index-wins top-k of its causal scores,
    and the checked set contains real ties at the top-k boundary (so the check has teeth)."""
    cfg, _model, _ids_, run, captured = flash
    k_I, m = cfg.index_topk, cfg.compress_rates["compressed_sparse_attention"]
    boundary_ties = 0
    assert sorted(run.indexer_topk) == [L for L, _ in captured["scores"]] == [2, 4, 6]
    for layer, scores in captured["scores"]:
        picked = run.indexer_topk[layer]
        assert picked.shape == (N_TOKENS, k_I)
        n_rows = scores.shape[-1]
        assert n_rows == N_TOKENS // m and n_rows > 5 * k_I  # far more candidates than top-k
        for t in range(3, N_TOKENS, 5):
            valid = (t + 1) // m
            row = scores[t, :valid]
            k = min(k_I, valid)
            want = _expected_topk_indices(row, k)[0]
            got = [int(i) for i in picked[t].tolist() if i >= 0]
            assert sorted(got) == sorted(want), f"layer {layer} query {t}"
            if valid > k_I:
                kth = row.sort(descending=True).values[k_I - 1]
                boundary_ties += int((row == kth).sum() > 1)
    assert boundary_ties > 0, "no exact ties at the top-k boundary: the tie test proves nothing"


def test_stable_topk_reaches_hf_router():
    """Two experts made identical (same gate row, same bias) tie exactly; the lower one must win."""
    cfg = tiny_hf_config("flash-like", num_hidden_layers=4)
    model = build_hf_model(cfg, seed=3)
    gate = model.model.layers[3].mlp.gate
    lo, hi = 2, 7
    with torch.no_grad():
        gate.weight[hi] = gate.weight[lo]
        gate.e_score_correction_bias[hi] = gate.e_score_correction_bias[lo]
    picks = []
    h = gate.register_forward_hook(lambda _m, _a, out: picks.append(out[2].clone()))
    try:
        hf_logits(model, _ids(300, seed=5))
    finally:
        h.remove()
    sel = picks[0]
    has_lo, has_hi = (sel == lo).any(-1), (sel == hi).any(-1)
    assert int((has_lo & ~has_hi).sum()) > 0, "the tie never fell on the top-k boundary; pick other experts"
    assert int((has_hi & ~has_lo).sum()) == 0, "the higher expert index won an exact tie"


def test_router_selection_is_topk_of_biased_scores(flash):
    _cfg, _model, _ids_, _run, captured = flash
    assert captured["router"]
    for layer, logits, picked, bias in captured["router"]:
        biased = torch.sqrt(F.softplus(logits)) + bias
        want = [sorted(r) for r in _expected_topk_indices(biased, picked.shape[-1])]
        assert [sorted(r) for r in picked.tolist()] == want, f"layer {layer}"


# ------------------------------------------------------------------------------------------------
# chunk / decode invariance of the cached path
# ------------------------------------------------------------------------------------------------

def _assert_same_selections(run, ref) -> None:
    """Identical indexer rows and expert ids at every position, else name the first flip.

    fp32 noise (~1e-6) legitimately swaps two indexer rows whose scores differ by ~1e-5 relative
    (measured on this model: roughly one such near-tie flip per 1100-token run for some seeds and
    chunkings, e.g. chunk 500 here flips layer 4 at position 258). The seeds/chunking of these tests
    are flip-free on the machine they were written on; a flip on other hardware shows up here.
    """
    for name in ("indexer_topk", "expert_ids"):
        got, want = getattr(run, name), getattr(ref, name)
        assert got.keys() == want.keys()
        for layer in want:
            g, w = got[layer].sort(dim=-1).values, want[layer].sort(dim=-1).values
            bad = (g != w).any(-1).nonzero().flatten()
            assert bad.numel() == 0, (
                f"{name} differs at layer {layer}, first position {int(bad[0])}: a near-tie flip (fp32 noise) "
                "or a chunking bug; if it is a near tie, pick another seed")


def test_chunked_prefill_matches_one_shot(flash):
    _cfg, model, ids, one, _ = flash
    chunked = hf_run(model, ids, chunk_sizes=[CHUNK], record_selections=True)
    assert [s for s in chunked.segments] == [("prefill", 0, 367), ("prefill", 367, 734), ("prefill", 734, 1100)]
    assert chunked.logits.shape == one.logits.shape == (N_TOKENS, 512)
    assert torch.isfinite(chunked.logits).all()
    _assert_same_selections(chunked, one)
    err = _rel(chunked.logits, one.logits)
    print(f"chunked({CHUNK}) vs one-shot relative L2: {err:.3e}")
    # measured 2.4e-6 (spec §10.2 saw <= 1.6e-6 on another tiny model); a chunking bug is >= 1e-2
    assert err <= 3e-6, err


def test_decode_steps_match_one_shot(flash):
    _cfg, model, ids, one, _ = flash
    n_dec = 10  # positions 1090..1099: three CSA windows complete during decode
    dec = hf_run(model, ids, chunk_sizes=[CHUNK], decode_steps=n_dec, record_selections=True)
    assert dec.segments[-n_dec:] == [("decode", t, t + 1) for t in range(N_TOKENS - n_dec, N_TOKENS)]
    assert dec.logits.shape == one.logits.shape
    _assert_same_selections(dec, one)
    err = _rel(dec.logits, one.logits)
    print(f"chunked({CHUNK}) + {n_dec} decode steps vs one-shot relative L2: {err:.3e}")
    assert err <= 3e-6, err
    # the two spellings of teacher-forced decode feed identical calls
    dec2 = hf_logits(model, ids[:-n_dec], chunk_sizes=[CHUNK], decode_ids=ids[-n_dec:])
    assert torch.equal(dec.logits, dec2)


def test_layer_outputs_are_the_streams_that_produce_the_logits(flash):
    cfg, model, ids, one, _ = flash
    outs = one.layer_outputs
    assert len(outs) == cfg.num_hidden_layers
    assert all(o.shape == (N_TOKENS, cfg.hc_mult, cfg.hidden_size) for o in outs)
    with torch.no_grad():
        logits = model.lm_head(model.model.norm(model.model.hc_head(outs[-1][None])))[0]
    assert _rel(logits, one.logits) <= 1e-6
    # layer outputs of a chunked run line up position by position
    short = hf_layer_outputs(model, ids[:300], chunk_sizes=[130])
    assert _rel(short[3], outs[3][:300]) <= 3e-6


def test_yarn_kind_has_no_mscale_and_only_on_compressed_layers():
    plain = build_hf_model(tiny_hf_config("flash-like", num_hidden_layers=3), seed=0).model.rotary_emb
    yarn_model = build_hf_model(tiny_hf_config("yarn", num_hidden_layers=3), seed=0)
    rot = yarn_model.model.rotary_emb
    assert rot.compress_attention_scaling == 1.0 and rot.main_attention_scaling == 1.0
    assert torch.equal(rot.main_inv_freq, plain.main_inv_freq)
    assert not torch.allclose(rot.compress_inv_freq, plain.compress_inv_freq)
    assert torch.equal(rot.compress_inv_freq[0], plain.compress_inv_freq[0])  # high frequency untouched
    assert torch.allclose(rot.compress_inv_freq[-1], plain.compress_inv_freq[-1] / 4)  # low frequency / s
    c = yarn_model.config
    assert yarn_model.model.layers[2].self_attn.compressor.rotary_emb.compress_attention_scaling == 1.0
    assert tiny_hf_config("stress").swiglu_limit == 0.3
    e = tiny_hf_config("distinct-eps")
    assert e.rms_norm_eps != e.hc_eps
    assert c.layer_types == flash_layer_types(3) == [
        "sliding_attention", "sliding_attention", "compressed_sparse_attention"]


# ------------------------------------------------------------------------------------------------
# randomised parameters
# ------------------------------------------------------------------------------------------------

def test_hf_zero_initialised_tensors_are_randomised(flash):
    cfg, model, _ids_, _run, _ = flash
    default = DeepseekV4ForCausalLM(cfg).eval()  # what transformers leaves behind
    sd, d0 = model.state_dict(), default.state_dict()
    patterns = ["self_attn.sinks", "compressor.position_bias", "indexer.position_bias",
                "e_score_correction_bias", "tid2eid", "attn_hc.base", "ffn_hc.base", "hc_head.hc_base",
                "attn_hc.scale", "ffn_hc.scale", "hc_head.hc_scale", "layernorm.weight", "kv_norm.weight",
                "q_a_norm.weight", "model.norm.weight"]
    for pat in patterns:
        names = [n for n in sd if pat in n]
        assert names, pat
        for n in names:
            t, t0 = sd[n], d0[n]
            assert bool((t0 == t0.reshape(-1)[0]).all()), f"{n}: HF no longer inits it constant; update the list"
            assert t.numel() == 1 or not bool((t == t.reshape(-1)[0]).all()), f"{n} still constant"
            if t.is_floating_point():
                assert not bool((t == t0).any()), f"{n} kept some of transformers' init values"
    # hash tables: valid, distinct expert ids per row, and all experts used
    for layer, kind in enumerate(cfg.mlp_layer_types):
        if kind != "hash_moe":
            continue
        tab = sd[f"model.layers.{layer}.mlp.gate.tid2eid"]
        assert tab.dtype == torch.long and tab.shape == (cfg.vocab_size, cfg.num_experts_per_tok)
        assert int(tab.min()) >= 0 and int(tab.max()) < cfg.n_routed_experts
        assert all(len(set(r)) == len(r) for r in tab.tolist())
        assert set(tab.flatten().tolist()) == set(range(cfg.n_routed_experts))
    # deterministic per seed, different across seeds
    again = build_hf_model(tiny_hf_config("flash-like"), seed=SEED).state_dict()
    other = build_hf_model(tiny_hf_config("flash-like"), seed=SEED + 1).state_dict()
    assert all(torch.equal(sd[k], again[k]) for k in sd)
    assert not torch.equal(sd["model.layers.2.self_attn.sinks"], other["model.layers.2.self_attn.sinks"])


# ------------------------------------------------------------------------------------------------
# checkpoints and official names
# ------------------------------------------------------------------------------------------------

def _official_keys(cfg) -> set[str]:
    """The official key set (spec §8.3) for an unquantised fp32 model, written from the spec."""
    keys = {"embed.weight", "head.weight", "norm.weight", "hc_head_fn", "hc_head_base", "hc_head_scale"}
    for L, kind in enumerate(cfg.layer_types):
        p = f"layers.{L}."
        keys |= {p + s for s in ("attn_norm.weight", "ffn_norm.weight", "hc_attn_fn", "hc_attn_base",
                                  "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale",
                                  "attn.attn_sink", "attn.wq_a.weight", "attn.q_norm.weight",
                                  "attn.wq_b.weight", "attn.wkv.weight", "attn.kv_norm.weight",
                                  "attn.wo_a.weight", "attn.wo_b.weight", "ffn.gate.weight",
                                  "ffn.shared_experts.w1.weight", "ffn.shared_experts.w2.weight",
                                  "ffn.shared_experts.w3.weight")}
        keys.add(p + ("ffn.gate.tid2eid" if cfg.mlp_layer_types[L] == "hash_moe" else "ffn.gate.bias"))
        keys |= {f"{p}ffn.experts.{e}.w{i}.weight" for e in range(cfg.n_routed_experts) for i in (1, 2, 3)}
        if kind != "sliding_attention":
            keys |= {p + "attn.compressor." + s for s in ("wkv.weight", "wgate.weight", "ape", "norm.weight")}
        if kind == "compressed_sparse_attention":
            keys |= {p + "attn.indexer." + s for s in (
                "wq_b.weight", "weights_proj.weight", "compressor.wkv.weight", "compressor.wgate.weight",
                "compressor.ape", "compressor.norm.weight")}
    return keys


def test_checkpoint_round_trip_and_official_names(flash, tmp_path):
    cfg, model, ids, one, _ = flash
    official = hf_weights_state_dict(model)
    assert set(official) == _official_keys(cfg)
    assert len(official) == 401  # spec §8.3: 7 layers, 10 experts
    sd = model.state_dict()
    # spot checks: the renamed places carry the right tensors
    assert torch.equal(official["layers.0.attn.kv_norm.weight"], sd["model.layers.0.self_attn.kv_norm.weight"])
    assert torch.equal(official["layers.2.attn.compressor.norm.weight"],
                       sd["model.layers.2.self_attn.compressor.kv_norm.weight"])
    assert torch.equal(official["layers.2.attn.indexer.compressor.ape"],
                       sd["model.layers.2.self_attn.compressor.indexer.position_bias"])
    assert torch.equal(official["layers.0.ffn.gate.tid2eid"], sd["model.layers.0.mlp.gate.tid2eid"])
    assert official["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    assert torch.equal(official["embed.weight"], sd["model.embed_tokens.weight"])
    assert torch.equal(official["head.weight"], sd["lm_head.weight"])
    assert torch.equal(official["hc_head_fn"], sd["model.hc_head.hc_fn"])
    gu = sd["model.layers.3.mlp.experts.gate_up_proj"][7]  # gate rows first, then up
    assert torch.equal(official["layers.3.ffn.experts.7.w1.weight"], gu[: cfg.moe_intermediate_size])
    assert torch.equal(official["layers.3.ffn.experts.7.w3.weight"], gu[cfg.moe_intermediate_size:])
    assert official_name("model.layers.5.attn.compressor.norm.weight") == "layers.5.attn.compressor.norm.weight"

    # sharded save_pretrained re-loads bit-for-bit and computes the same logits
    ckpt = save_hf_checkpoint(model, tmp_path / "hf", max_shard_size="200KB")
    assert len(list(ckpt.glob("*.safetensors"))) > 1 and (ckpt / "model.safetensors.index.json").exists()
    saved_cfg = json.loads((ckpt / "config.json").read_text())
    assert saved_cfg["layer_types"] == cfg.layer_types
    reloaded = DeepseekV4ForCausalLM.from_pretrained(ckpt).eval()
    assert reloaded.dtype == torch.float32
    again = hf_weights_state_dict(reloaded)
    assert again.keys() == official.keys() and all(torch.equal(again[k], official[k]) for k in official)
    assert torch.equal(hf_logits(reloaded, ids[:200]), hf_logits(model, ids[:200]))

    # the official-named tensors load into transformers as the same parameters
    off_dir = tmp_path / "official"
    off_dir.mkdir()
    cfg.save_pretrained(off_dir)
    save_file(official, str(off_dir / "model.safetensors"))
    from_official = DeepseekV4ForCausalLM.from_pretrained(off_dir).state_dict()
    assert from_official.keys() == sd.keys()
    assert all(torch.equal(from_official[k], sd[k]) for k in sd)
