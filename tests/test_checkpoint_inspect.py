"""`inspect_checkpoint` reads only headers: it must work on shards that hold a header and no data.

The main fixture is the real DeepSeek-V4-Flash layout at full size (spec §8.3: names, dtypes, shapes of
the top-level tensors and layers 0-3, plus a few MTP tensors) written as header-only safetensors files,
with the FLASH preset's config.json; the expected dtype counts and per-layer memory are worked out here
from the spec's shape table, independently of the schema module.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
import torch

from reference.config import FLASH, TINY
from reference.quant import QuantizedTensor
from reference.weights.checkpoint import CheckpointWeights
from reference.weights.inspect import format_inspection, inspect_checkpoint
from reference.weights.layouts import OFFICIAL_QUANTIZATION_CONFIG
from reference.weights.schema import layer_specs, top_level_specs
from reference.weights.source import WeightError
from reference.weights.synth import write_synthetic_checkpoint

BYTES = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "I64": 8}

# Flash dimensions (spec §1.1)
D, H, HD, QL, G, RO = 4096, 64, 512, 1024, 8, 1024
E, I, V, K, N_HC, MIX = 256, 2048, 129280, 6, 4, 24
NI, DI = 64, 128

MTP = {  # a few tensors of the MTP block, which the inspection counts and skips
    "mtp.0.e_proj.weight": ("F8_E4M3", [D, D]),
    "mtp.0.e_proj.scale": ("F8_E8M0", [32, 32]),
    "mtp.0.enorm.weight": ("BF16", [D]),
    "mtp.0.hc_head_fn": ("F32", [N_HC, N_HC * D]),
    "mtp.0.ffn.experts.0.w1.weight": ("I8", [I, D // 2]),
    "mtp.0.ffn.experts.0.w1.scale": ("F8_E8M0", [I, D // 32]),
}


def write_header_only(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A safetensors file holding only its header: 8-byte little-endian length, JSON, no data region."""
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        size = math.prod(shape) * BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text)


def official_entries(name: str, shape: tuple[int, ...], storage: str) -> dict[str, tuple[str, list[int]]]:
    """How deepseek-ai stores one tensor (spec §8.2-8.3)."""
    if storage == "fp8_block128":
        out, inp = shape
        return {name: ("F8_E4M3", [out, inp]),
                name.removesuffix("weight") + "scale": ("F8_E8M0", [math.ceil(out / 128), math.ceil(inp / 128)])}
    if storage == "fp4_mx32":
        out, inp = shape
        return {name: ("I8", [out, inp // 2]), name.removesuffix("weight") + "scale": ("F8_E8M0", [out, inp // 32])}
    return {name: ({"bf16": "BF16", "f32": "F32", "i64": "I64"}[storage], list(shape))}


@pytest.fixture(scope="module")
def flash_headers(tmp_path_factory) -> Path:
    """Header-only Flash checkpoint: top level + layers 0-1 in shard 1, layers 2-3 in shard 2, MTP in shard 3."""
    root = tmp_path_factory.mktemp("flash_headers")
    shards: list[dict[str, tuple[str, list[int]]]] = [{}, {}, dict(MTP)]
    for spec in top_level_specs(FLASH):
        shards[0].update(official_entries(spec.name, spec.shape, spec.storage))
    for L in range(4):
        for spec in layer_specs(FLASH, L):
            shards[L // 2].update(official_entries(f"layers.{L}.{spec.name}", spec.shape, spec.storage))
    weight_map = {}
    for i, tensors in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-00003.safetensors"
        write_header_only(root / fname, tensors)
        weight_map.update({k: fname for k in tensors})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (root / "config.json").write_text(json.dumps(FLASH.to_hf_dict()))
    return root


def test_fixture_matches_the_spec_shape_table(flash_headers):
    """Anchor the fixture to spec §8.3's literal entries, so it is the real layout and not just the schema's."""
    index = json.loads((flash_headers / "model.safetensors.index.json").read_text())["weight_map"]
    assert FLASH.to_hf_dict()["quantization_config"] == OFFICIAL_QUANTIZATION_CONFIG
    expected = {
        "layers.0.attn.wq_b.scale": ("F8_E8M0", [256, 8]),
        "layers.1.attn.wo_a.weight": ("F8_E4M3", [8192, 4096]),
        "layers.2.attn.compressor.ape": ("F32", [4, 1024]),
        "layers.2.attn.indexer.wq_b.scale": ("F8_E8M0", [64, 8]),
        "layers.2.attn.indexer.compressor.wkv.weight": ("BF16", [256, 4096]),
        "layers.3.attn.compressor.ape": ("F32", [128, 512]),
        "layers.3.ffn.experts.255.w2.weight": ("I8", [4096, 1024]),
        "layers.3.ffn.experts.255.w2.scale": ("F8_E8M0", [4096, 64]),
        "layers.0.ffn.gate.tid2eid": ("I64", [129280, 6]),
        "hc_head_fn": ("F32", [4, 16384]),
    }
    for name, (dtype, shape) in expected.items():
        raw = (flash_headers / index[name]).read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        entry = json.loads(raw[8:8 + n])[name]
        assert (entry["dtype"], entry["shape"]) == (dtype, shape), name


def expected_layer_bytes(kind: str, hash_routing: bool) -> tuple[int, int]:
    """(reference fp32 bytes, stored bytes) of one Flash layer, from the spec §8.3 table."""
    bf16 = 2 * D + QL + HD + E * D  # attn/ffn norms, q_norm, kv_norm, gate.weight
    f32 = 2 * MIX * N_HC * D + 2 * MIX + 2 * 3 + H  # hc_attn/hc_ffn fn, base, scale; attn_sink
    fp8 = QL * D + H * HD * QL + HD * D + (G * RO) * (H // G * HD) + D * G * RO + 3 * I * D
    fp8_scales = 8 * 32 + 256 * 8 + 4 * 32 + 64 * 32 + 32 * 64 + 3 * 16 * 32
    fp4 = E * 3 * I * D
    fp4_stored = E * 3 * (I * D // 2 + I * D // 32)
    if kind == "csa":
        bf16 += 2 * (2 * HD * D) + HD  # compressor wkv, wgate (c = 2), norm
        f32 += 4 * 2 * HD  # compressor ape
        fp8 += NI * DI * QL  # indexer wq_b
        fp8_scales += 64 * 8
        bf16 += NI * D + 2 * (2 * DI * D) + DI  # weights_proj, indexer compressor wkv, wgate, norm
        f32 += 4 * 2 * DI  # indexer compressor ape
    if kind == "hca":
        bf16 += 2 * HD * D + HD
        f32 += 128 * HD
    table = V * K * 8 if hash_routing else 0  # tid2eid stays int64 in both stacks
    f32 += 0 if hash_routing else E  # gate.bias
    reference = 4 * (bf16 + f32 + fp8 + fp4) + table
    stored = 2 * bf16 + 4 * f32 + fp8 + fp8_scales + fp4_stored + table
    return reference, stored


def test_inspect_header_only_flash(flash_headers):
    report = inspect_checkpoint(flash_headers)
    assert report["layout"] == "official"
    assert report["quantization_config"]["quant_method"] == "fp8"
    assert report["shards"] == 3
    assert report["layers_present"] == [0, 1, 2, 3] and report["num_layers"] == 4
    assert report["config_layers"] == 43
    assert report["missing_layers"] == list(range(4, 43)), "layers absent from the files are reported as missing"
    assert report["missing"] == [] and report["errors"] == [] and report["unexpected"] == []
    assert report["mtp_tensors"] == len(MTP)
    assert report["tensors_without_data"] == report["tensors"], "the fixture holds headers only"
    # per layer (0-3) + top level (3 BF16, 3 F32) + MTP; cf. the full checkpoint's counts in spec §8.1
    assert report["dtype_counts"] == {
        "BF16": 5 + 5 + 12 + 8 + 3 + 1,
        "F32": 7 + 7 + 9 + 9 + 3 + 1,
        "F8_E4M3": 4 * 8 + 1 + 1,
        "F8_E8M0": 4 * 8 + 1 + 4 * 3 * E + 2,
        "I8": 4 * 3 * E + 1,
        "I64": 3,
    }
    assert report["tensors"] == sum(report["dtype_counts"].values())

    per_layer = {row["layer"]: row for row in report["memory"]["per_layer"]}
    assert sorted(per_layer) == [0, 1, 2, 3]
    for L, kind, hash_routing in [(0, "swa", True), (1, "swa", True), (2, "csa", True), (3, "hca", False)]:
        reference, stored = expected_layer_bytes(kind, hash_routing)
        row = per_layer[L]
        assert row["type"] == f"{kind}/{'hash' if hash_routing else 'learned'}"
        assert row["reference_fp32_bytes"] == reference, f"layer {L}: reference bytes"
        assert row["optimized_bytes"] == stored, f"layer {L}: stored bytes"
    assert report["memory"]["per_type"]["swa/hash"]["layers"] == [0, 1]
    assert report["memory"]["peak_layer"]["reference_fp32_bytes"] == expected_layer_bytes("csa", True)[0]
    top = report["memory"]["top_level"]
    assert top["reference_fp32_bytes"] == 4 * (V * D + D + N_HC * N_HC * D + N_HC + 1)
    assert top["optimized_bytes"] == 2 * (V * D + D) + 4 * (N_HC * N_HC * D + N_HC + 1)
    assert report["memory"]["embed"] == {"tensors": 1, "reference_fp32_bytes": 4 * V * D,
                                         "optimized_bytes": 2 * V * D}


def test_layer_filter(flash_headers):
    report = inspect_checkpoint(flash_headers, layers=range(4))
    assert report["layers_checked"] == [0, 1, 2, 3]
    assert report["missing_layers"] == [] and report["missing"] == [] and report["errors"] == []
    assert len(report["memory"]["per_layer"]) == 4


def test_format_inspection(flash_headers):
    text = format_inspection(inspect_checkpoint(flash_headers))
    assert "layout official" in text
    assert "layers present: 4 of 43 (0-3)" in text
    assert "missing layers: 4-42" in text
    assert "MTP tensors (skipped): 6" in text
    assert "hca/learned" in text and "GiB" in text


def test_checkpoint_weights_refuses_a_header_only_checkpoint(flash_headers):
    with pytest.raises(WeightError, match="truncated shard"):
        CheckpointWeights(flash_headers)


@pytest.mark.parametrize("fmt", ["official", "nvfp4", "hf"])
def test_memory_numbers_match_what_is_loaded(tmp_path, fmt):
    """On a real (tiny) checkpoint the header-only estimate equals the bytes of the tensors actually read."""
    path = write_synthetic_checkpoint(TINY, 0, tmp_path, fmt, shard_layers=3)
    report = inspect_checkpoint(path)
    assert report["layout"] == fmt and report["tensors_without_data"] == 0
    source = CheckpointWeights(path)
    for row in report["memory"]["per_layer"]:
        bundle = source.layer(row["layer"])
        dense = sum(bundle.dense(n).numel() * bundle.dense(n).element_size() for n in bundle.names())
        stored = 0
        for n in bundle.names():
            t = bundle.stored(n)
            parts = [t.codes, t.scale, t.global_scale, t.input_scale] if isinstance(t, QuantizedTensor) else [t]
            stored += sum(p.numel() * p.element_size() for p in parts if isinstance(p, torch.Tensor))
        assert (row["reference_fp32_bytes"], row["optimized_bytes"]) == (dense, stored), f"layer {row['layer']}"
