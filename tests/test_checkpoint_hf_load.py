"""A synthetic checkpoint in the `hf` layout is exactly what transformers' `save_pretrained` writes.

transformers loads it with no missing or unexpected keys, the loaded parameters hold our values
(kv_norm, hash table, fused experts, HC head included), and saving that model again gives the same keys.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from reference.config import TINY
from reference.weights.synth import write_synthetic_checkpoint
from reference.weights.synthetic import SyntheticWeights

transformers = pytest.importorskip("transformers")

SEED = 5


def saved_keys(path) -> set[str]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    keys: set[str] = set()
    for f in path.glob("*.safetensors"):
        with safe_open(f, framework="pt") as s:
            keys.update(s.keys())
    return keys


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    path = write_synthetic_checkpoint(TINY, SEED, tmp_path_factory.mktemp("hf") / "ckpt", "hf", shard_layers=2)
    model, info = transformers.DeepseekV4ForCausalLM.from_pretrained(path, torch_dtype=torch.float32,
                                                                     output_loading_info=True)
    return path, model, info


def test_loads_without_missing_or_unexpected_keys(loaded):
    _, _, info = loaded
    assert not info["missing_keys"], f"missing: {sorted(info['missing_keys'])[:10]}"
    assert not info["unexpected_keys"], f"unexpected: {sorted(info['unexpected_keys'])[:10]}"
    assert not info["mismatched_keys"], f"mismatched: {sorted(info['mismatched_keys'])[:10]}"


def test_loaded_parameters_hold_the_synthetic_values(loaded):
    _, model, _ = loaded
    syn = SyntheticWeights(TINY, SEED)
    top, layer0, layer3 = syn.top_level(), syn.layer(0), syn.layer(3)
    m = model.model
    pairs = [
        (m.embed_tokens.weight, syn.embed_rows(torch.arange(TINY.vocab_size)).float()),
        (model.lm_head.weight, top.dense("head.weight")),
        (m.hc_head.hc_fn, top.dense("hc_head_fn")),
        (m.layers[0].self_attn.kv_norm.weight, layer0.dense("attn.kv_norm.weight")),
        (m.layers[0].mlp.gate.tid2eid, layer0.dense("ffn.gate.tid2eid")),
        (m.layers[3].mlp.gate.e_score_correction_bias, layer3.dense("ffn.gate.bias")),
        (m.layers[3].self_attn.compressor.position_bias, layer3.dense("attn.compressor.ape")),
        (m.layers[3].mlp.experts.gate_up_proj[2],
         torch.cat([layer3.dense("ffn.experts.2.w1.weight"), layer3.dense("ffn.experts.2.w3.weight")])),
        (m.layers[3].mlp.experts.down_proj[2], layer3.dense("ffn.experts.2.w2.weight")),
    ]
    for i, (got, want) in enumerate(pairs):
        assert torch.equal(got.detach().to(want.dtype), want), f"pair {i}: transformers holds different values"


def test_names_are_what_save_pretrained_writes(loaded, tmp_path):
    path, model, _ = loaded
    model.save_pretrained(tmp_path)
    assert saved_keys(path) == saved_keys(tmp_path)


def test_reads_a_checkpoint_written_by_transformers(tmp_path):
    """The reader against the real thing: a sharded `save_pretrained` of a randomised transformers model."""
    from hf_oracle import build_hf_model, hf_weights_state_dict, save_hf_checkpoint, tiny_hf_config

    from reference.weights.checkpoint import CheckpointWeights
    from reference.weights.schema import layer_prefix

    model = build_hf_model(tiny_hf_config(), seed=3)
    source = CheckpointWeights(save_hf_checkpoint(model, tmp_path, max_shard_size="200KB"))
    assert source.layout == "hf" and len(source.files.shards) > 1
    want = hf_weights_state_dict(model)
    got = {name: source.top_level().dense(name) for name in source.top_level().names()}
    got["embed.weight"] = source.embed_rows(torch.arange(source.config.vocab_size))
    for L in range(source.config.num_hidden_layers):
        bundle = source.layer(L)
        got.update({layer_prefix(L) + n: bundle.dense(n) for n in bundle.names()})
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert torch.equal(got[name], value), f"'{name}' differs from the transformers model"
