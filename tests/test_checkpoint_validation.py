"""A broken checkpoint fails at construction, from headers alone, naming the tensor and its shard file.

Each test damages one thing in a valid synthetic official-layout checkpoint (tiny config, 3 shards) and
checks that `CheckpointWeights(path)` refuses it before any tensor data is read.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import reference.weights.checkpoint as checkpoint_module
from reference.config import TINY
from reference.weights.checkpoint import CheckpointWeights
from reference.weights.source import WeightError
from reference.weights.synth import write_synthetic_checkpoint
from reference.weights.synthetic import SyntheticWeights

SEED = 11
INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return write_synthetic_checkpoint(TINY, SEED, tmp_path_factory.mktemp("pristine") / "ckpt", "official",
                                      shard_layers=2)


@pytest.fixture
def ckpt(tmp_path, pristine) -> Path:
    """A private copy to damage."""
    return Path(shutil.copytree(pristine, tmp_path / "ckpt"))


@pytest.fixture
def no_data_reads(monkeypatch):
    """Fail the test if tensor data is read: validation must work from headers alone."""
    def forbidden(*args, **kwargs):
        raise AssertionError("tensor data was read during validation")
    monkeypatch.setattr(checkpoint_module, "safe_open", forbidden)


def shard_of(path: Path, name: str) -> str:
    return json.loads((path / INDEX).read_text())["weight_map"][name]


def rewrite_shard(path: Path, name: str, edit: Callable[[dict[str, torch.Tensor]], None],
                  update_index: bool = False) -> str:
    """Apply `edit` to the tensors of the shard holding `name`; optionally make the index follow."""
    fname = shard_of(path, name)
    tensors = load_file(str(path / fname))
    edit(tensors)
    save_file(tensors, str(path / fname), metadata={"format": "pt"})
    if update_index:
        index = json.loads((path / INDEX).read_text())
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != fname}
        index["weight_map"].update({k: fname for k in tensors})
        (path / INDEX).write_text(json.dumps(index))
    return fname


def refused(path: Path, *fragments: str, **kwargs) -> str:
    with pytest.raises(WeightError) as info:
        CheckpointWeights(path, **kwargs)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"expected {fragment!r} in the error, got:\n{message}"
    return message


def test_pristine_checkpoint_validates_without_reading_data(pristine, no_data_reads):
    CheckpointWeights(pristine)


def test_missing_tensor(ckpt, no_data_reads):
    name = "layers.3.ffn.gate.bias"
    rewrite_shard(ckpt, name, lambda t: t.pop(name), update_index=True)
    message = refused(ckpt, f"'{name}' is missing")
    assert "\n" not in message, "a single problem is reported on one line"


def test_tensor_listed_in_index_but_absent_from_its_shard(ckpt, no_data_reads):
    name = "layers.1.attn.wq_b.weight"
    fname = rewrite_shard(ckpt, name, lambda t: t.pop(name))
    refused(ckpt, f"'{name}'", fname, "does not declare it")


def test_missing_scale_names_the_weight_and_its_shard(ckpt, no_data_reads):
    name = "layers.2.ffn.experts.4.w3.scale"
    fname = rewrite_shard(ckpt, name, lambda t: t.pop(name), update_index=True)
    refused(ckpt, f"'{name}' is missing", f"'layers.2.ffn.experts.4.w3.weight' in {fname}")


def test_misshaped_tensor(ckpt, no_data_reads):
    name = "layers.2.attn.wkv.weight"

    def cut(t):
        t[name] = t[name][:-1].contiguous()
    fname = rewrite_shard(ckpt, name, cut)
    refused(ckpt, f"'{name}' in {fname}", f"shape [{TINY.head_dim - 1}, {TINY.hidden_size}]",
            f"expected [{TINY.head_dim}, {TINY.hidden_size}]")


def test_misshaped_scale(ckpt, no_data_reads):
    name = "layers.4.ffn.experts.0.w2.scale"

    def widen(t):
        t[name] = torch.cat([t[name], t[name][:, :1]], 1).contiguous()
    fname = rewrite_shard(ckpt, name, widen)
    refused(ckpt, f"'{name}' in {fname}", "shape", "the scale of 'layers.4.ffn.experts.0.w2.weight'")


def test_wrong_dtype(ckpt, no_data_reads):
    name = "layers.1.attn_norm.weight"

    def to_fp8(t):
        t[name] = t[name].to(torch.float8_e4m3fn)
    fname = rewrite_shard(ckpt, name, to_fp8)
    refused(ckpt, f"'{name}' in {fname}", "dtype F8_E4M3", "expected F32 or BF16 or F16")


def test_wrong_dtype_for_an_fp8_weight(ckpt, no_data_reads):
    name = "layers.0.attn.wq_a.weight"

    def to_int8(t):
        t[name] = t[name].view(torch.int8)
    fname = rewrite_shard(ckpt, name, to_int8)
    refused(ckpt, f"'{name}' in {fname}", "dtype I8")


def test_truncated_shard(ckpt, no_data_reads):
    fname = shard_of(ckpt, "layers.4.ffn.gate.weight")
    shard = ckpt / fname
    os.truncate(shard, shard.stat().st_size - 100)
    refused(ckpt, fname, "truncated shard", "tensor '")


def test_truncated_shard_read_without_validation_names_the_tensor(ckpt):
    fname = shard_of(ckpt, "layers.4.ffn.gate.weight")
    os.truncate(ckpt / fname, (ckpt / fname).stat().st_size - 100)
    source = CheckpointWeights(ckpt, validate=False)
    source.layer(0)  # other shards still read
    with pytest.raises(WeightError, match=rf"tensor '[^']+' in {fname}: cannot read"):
        source.layer(4)


def test_header_that_disagrees_with_its_data_offsets(ckpt, no_data_reads):
    name = "layers.3.attn.attn_sink"
    fname = shard_of(ckpt, name)
    raw = (ckpt / fname).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header[name]["shape"] = [TINY.num_attention_heads + 1]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    (ckpt / fname).write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n:])
    refused(ckpt, f"'{name}' in {fname}", "header mismatch")


def test_nan_e8m0_scale_fails_when_the_layer_is_read(ckpt):
    name = "layers.3.attn.wq_a.scale"

    def poison(t):
        u = t[name].view(torch.uint8).clone()
        u[0, 0] = 255
        t[name] = u.view(torch.float8_e8m0fnu)
    fname = rewrite_shard(ckpt, name, poison)
    source = CheckpointWeights(ckpt)  # headers are fine: E8M0 NaN is only visible in the data
    source.layer(2)
    with pytest.raises(WeightError, match=rf"'{name}' in {fname}: E8M0 scale byte 255"):
        source.layer(3)


def test_config_that_does_not_describe_the_checkpoint(pristine, no_data_reads):
    wrong = TINY.replace(layer_kinds=("swa", "swa", "csa", "swa", "csa"))  # layer 3 is HCA on disk
    message = refused(pristine, "'layers.3.attn.compressor.wkv.weight'", "the config describes layer 3 as SWA", config=wrong)
    assert "model-00002-of-00003.safetensors" in message


def test_harmless_extra_tensor_is_listed_not_fatal(ckpt):
    name = "layers.0.attn.wq_a.weight"
    rewrite_shard(ckpt, name, lambda t: t.update({"layers.0.attn.rotary_emb.inv_freq": torch.ones(4)}),
                  update_index=True)
    source = CheckpointWeights(ckpt)
    assert source.check.unexpected == ["layers.0.attn.rotary_emb.inv_freq"]


def test_without_validation_only_the_broken_layer_fails(ckpt):
    name = "layers.3.ffn.experts.1.w1.weight"
    rewrite_shard(ckpt, name, lambda t: t.pop(name), update_index=True)
    source = CheckpointWeights(ckpt, validate=False)
    source.layer(2)
    with pytest.raises(WeightError, match=rf"'{name}' is missing"):
        source.layer(3)


def test_packed_fp4_as_float4_dtype_is_accepted(ckpt):
    """torch.float4_e2m1fn_x2 (safetensors F4, shape counted in fp4 elements) holds the same bytes as I8."""
    names = [f"layers.3.ffn.experts.{e}.{w}.weight" for e in range(TINY.n_routed_experts) for w in ("w1", "w2", "w3")]

    def to_f4(t):
        for n in names:
            t[n] = t[n].view(torch.uint8).view(torch.float4_e2m1fn_x2)
    rewrite_shard(ckpt, names[0], to_f4)
    got, want = CheckpointWeights(ckpt).layer(3), SyntheticWeights(TINY, SEED).layer(3)
    for n in names:
        assert torch.equal(got.dense(n.removeprefix("layers.3.")), want.dense(n.removeprefix("layers.3.")))


def test_missing_shard_file(ckpt, no_data_reads):
    fname = shard_of(ckpt, "layers.4.ffn.gate.weight")
    (ckpt / fname).unlink()
    refused(ckpt, fname, "does not exist")
