"""Synthetic weights written in each checkpoint layout read back bit-identically (DESIGN §3, Weights).

The same (config, seed) must give the same fp32 master values whether the weights come from
`SyntheticWeights` or from a checkpoint in the transformers, official or NVFP4 layout; otherwise a run
on a checkpoint would measure the weight format instead of the stacks.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from reference.config import TINY
from reference.quant import QuantizedTensor, mx32_to_nvfp4
from reference.weights.checkpoint import CheckpointWeights
from reference.weights.inspect import inspect_checkpoint
from reference.weights.source import WeightSource
from reference.weights.synth import write_synthetic_checkpoint
from reference.weights.synthetic import SyntheticWeights

SEED = 7
LAYOUTS = ("hf", "official", "nvfp4")


@pytest.fixture(scope="module")
def synthetic() -> SyntheticWeights:
    return SyntheticWeights(TINY, SEED)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, CheckpointWeights]:
    root = tmp_path_factory.mktemp("ckpt")
    return {fmt: CheckpointWeights(write_synthetic_checkpoint(TINY, SEED, root / fmt, fmt, shard_layers=2))
            for fmt in LAYOUTS}


@pytest.mark.parametrize("fmt", LAYOUTS)
def test_every_tensor_dequantizes_bit_identically(fmt, checkpoints, synthetic):
    ckpt = checkpoints[fmt]
    assert isinstance(ckpt, WeightSource)
    assert ckpt.layout == fmt
    pairs = [(ckpt.top_level(), synthetic.top_level())]
    pairs += [(ckpt.layer(L), synthetic.layer(L)) for L in range(TINY.num_hidden_layers)]
    for got, want in pairs:
        assert got.names() == want.names(), f"{got.where}: tensor names differ from {want.where}"
        for name in want.names():
            a, b = got.dense(name), want.dense(name)
            assert a.dtype == b.dtype, f"{fmt} {got.where}: '{name}' has dtype {a.dtype}, expected {b.dtype}"
            if fmt == "nvfp4" and name.startswith("ffn.experts."):
                # ModelOpt-style global scales (quant.mx32_to_nvfp4): e2m1 codes and e4m3 block scales are the FP4
                # source's exactly; block·global is 2^e up to one fp32 rounding of 2^k/f and one of the product:
                # ≤ 2·2^-24 relative
                assert torch.allclose(a, b, rtol=2.0**-23, atol=0), f"{fmt} {got.where}: '{name}' differs beyond 2^-23"
            else:
                assert torch.equal(a, b), f"{fmt} {got.where}: '{name}' differs after dequantization"


@pytest.mark.parametrize("fmt", LAYOUTS)
def test_embed_rows_match(fmt, checkpoints, synthetic):
    ids = torch.tensor([[5, 3, 4], [5, TINY.vocab_size - 1, 0]])
    got, want = checkpoints[fmt].embed_rows(ids), synthetic.embed_rows(ids)
    assert got.shape == (6, TINY.hidden_size)
    assert torch.equal(got.float(), want.float())
    assert checkpoints[fmt].embed_rows(torch.tensor([], dtype=torch.int64)).shape == (0, TINY.hidden_size)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        checkpoints[fmt].embed_rows(torch.tensor([TINY.vocab_size]))


def test_official_layout_keeps_the_stored_bits(checkpoints, synthetic):
    ckpt = checkpoints["official"]
    for L in range(TINY.num_hidden_layers):
        got, want = ckpt.layer(L), synthetic.layer(L)
        for name in want.names():
            a, b = got.stored(name), want.stored(name)
            if isinstance(b, QuantizedTensor):
                assert isinstance(a, QuantizedTensor) and a.format == b.format, f"layer {L} '{name}'"
                assert torch.equal(a.codes.view(torch.uint8), b.codes.view(torch.uint8)), f"layer {L} '{name}' codes"
                assert a.scale.dtype == torch.uint8 and torch.equal(a.scale, b.scale), f"layer {L} '{name}' scales"
            else:
                assert a.dtype == b.dtype and torch.equal(a, b), f"layer {L} '{name}'"


def test_nvfp4_layout_holds_lossless_nvfp4_experts(checkpoints, synthetic):
    got, want = checkpoints["nvfp4"].layer(3), synthetic.layer(3)
    expert, mx = got.stored("ffn.experts.5.w2.weight"), want.stored("ffn.experts.5.w2.weight")
    converted = mx32_to_nvfp4(mx)
    assert expert.format == "nvfp4"
    assert torch.equal(expert.codes, mx.codes)
    assert expert.scale.dtype == torch.float8_e4m3fn and torch.equal(expert.scale.float(), converted.scale.float())
    assert torch.equal(expert.global_scale, converted.global_scale)
    assert expert.input_scale is not None and float(expert.input_scale) == 1.0
    assert got.stored("ffn.shared_experts.w1.weight").format == "fp8_block128"
    assert checkpoints["nvfp4"].config.quantization_config["quant_method"] == "modelopt"


def test_hf_layout_holds_plain_fp32(checkpoints):
    bundle = checkpoints["hf"].layer(2)
    for name in bundle.names():
        t = bundle.stored(name)
        assert isinstance(t, torch.Tensor), f"'{name}' should be a plain tensor in the hf layout"
        assert t.dtype == (torch.int64 if name == "ffn.gate.tid2eid" else torch.float32), name


def test_single_file_with_bf16_wo_a(tmp_path, synthetic):
    """One `model.safetensors` without an index, and `wo_a` pre-dequantized to BF16 as official convert.py does."""
    path = write_synthetic_checkpoint(TINY, SEED, tmp_path, "official", shard_layers=TINY.num_hidden_layers,
                                      dequantize_wo_a=True)
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "model.safetensors"]
    ckpt = CheckpointWeights(path)
    wo_a = ckpt.layer(4).stored("attn.wo_a.weight")
    assert isinstance(wo_a, torch.Tensor) and wo_a.dtype == torch.bfloat16
    assert torch.equal(ckpt.layer(4).dense("attn.wo_a.weight"), synthetic.layer(4).dense("attn.wo_a.weight"))
    assert ckpt.layer(4).stored("attn.wo_b.weight").format == "fp8_block128"


def test_mtp_tensors_are_skipped_and_counted(tmp_path, checkpoints, synthetic):
    path = tmp_path / "with_mtp"
    shutil.copytree(checkpoints["official"].path, path)
    mtp = {"mtp.0.e_proj.weight": torch.zeros(TINY.hidden_size, TINY.hidden_size, dtype=torch.float8_e4m3fn),
           "mtp.0.e_proj.scale": torch.full((1, 1), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu),
           "mtp.0.enorm.weight": torch.ones(TINY.hidden_size, dtype=torch.bfloat16)}
    save_file(mtp, str(path / "model-mtp.safetensors"))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"].update({k: "model-mtp.safetensors" for k in mtp})
    (path / "model.safetensors.index.json").write_text(json.dumps(index))

    ckpt = CheckpointWeights(path)
    assert ckpt.describe()["mtp_tensors_skipped"] == 3
    assert ckpt.describe()["unexpected_tensors"] == 0
    assert torch.equal(ckpt.layer(0).dense("hc_attn_fn"), synthetic.layer(0).dense("hc_attn_fn"))
    assert inspect_checkpoint(path)["mtp_tensors"] == 3


def test_describe(checkpoints):
    d = checkpoints["official"].describe()
    assert d["kind"] == "checkpoint" and d["layout"] == "official" and d["shards"] == 3
    assert d["quantization"] == "fp8"
    json.dumps(d)  # goes into run manifests
