"""Write synthetic weights as a checkpoint directory in any of the three layouts.

The same (config, seed) gives the same logical weights in every layout, because all three are written
from `SyntheticWeights`, whose stored values are exact FP8/FP4 quantizations:
- `hf`: the exact fp32 dequantization of every tensor under `save_pretrained` names, loadable by
  transformers' `DeepseekV4ForCausalLM.from_pretrained`;
- `official`: the stored bits (FP8 e4m3 + E8M0 block scales, packed e2m1 + E8M0 per-32 scales, BF16, F32, I64);
- `nvfp4`: the official layout with routed experts converted to NVFP4 (`quant.mx32_to_nvfp4`, with the profile's
  global-scale rule: e2m1 codes and block scales exact, the fp32 product within 2^-23 of the FP4 value).
Used by tests and to hand a real-looking checkpoint to a run without downloading one.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from reference.config import ModelConfig
from reference.quant import QuantizedTensor, mx32_to_nvfp4
from reference.weights.layouts import (
    LAYOUTS,
    OFFICIAL_QUANTIZATION_CONFIG,
    nvfp4_part_names,
    scale_name,
    stored_name,
)
from reference.weights.safetensors_index import INDEX_FILE, SINGLE_FILE
from reference.weights.schema import layer_prefix
from reference.weights.source import Stored, TensorBundle
from reference.weights.profiles import DEFAULT_PROFILE
from reference.weights.synthetic import SyntheticWeights

NVFP4_INPUT_SCALE = 1.0
"""Written as every NVFP4 expert's `.input_scale`: synthetic weights have no calibration data, and the value
is the one a ModelOpt change pins NVFP4-expert input scales to (spec §8.4, unconfirmed)."""


def nvfp4_quantization_config(config: ModelConfig) -> dict[str, Any]:
    """A ModelOpt-style block (spec §8.4; exact keys of NVIDIA's release unconfirmed): NVFP4 routed experts,
    everything else left in the official FP8 format."""
    experts = {f"{layer_prefix(L)}ffn.experts.{e}.{w}": {"quant_algo": "NVFP4", "group_size": 16}
               for L in range(config.num_hidden_layers) for e in range(config.n_routed_experts)
               for w in ("w1", "w2", "w3")}
    return {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "producer": {"name": "modelopt"},
            "kv_cache_quant_algo": None, "quantized_layers": experts}


def _encode(name: str, value: Stored, fmt: str, dequantize_wo_a: bool, nvfp4_rule: str) -> dict[str, torch.Tensor]:
    """One tensor (official full name) -> the stored tensors of layout `fmt`, keyed by stored name."""
    if fmt == "hf":
        plain = value.dequantize(torch.float32) if isinstance(value, QuantizedTensor) else value
        if plain.is_floating_point():
            plain = plain.float()
        return {stored_name(name, fmt): plain.contiguous()}
    if not isinstance(value, QuantizedTensor):
        return {name: value.contiguous()}
    if dequantize_wo_a and name.endswith("attn.wo_a.weight"):  # what official convert.py does (spec §8.2)
        return {name: value.dequantize(torch.float32).to(torch.bfloat16)}
    if value.format == "fp8_block128":
        return {name: value.codes, scale_name(name): value.scale.view(torch.float8_e8m0fnu)}
    if fmt == "official":
        return {name: value.codes.view(torch.int8), scale_name(name): value.scale.view(torch.float8_e8m0fnu)}
    nv = mx32_to_nvfp4(value, nvfp4_rule, name)
    parts = nvfp4_part_names(name)
    return {name: nv.codes, parts["scale"]: nv.scale, parts["global_scale"]: nv.global_scale.reshape(()),
            parts["input_scale"]: torch.tensor(NVFP4_INPUT_SCALE, dtype=torch.float32)}


def _config_json(config: ModelConfig, fmt: str) -> dict[str, Any]:
    d = config.to_hf_dict()
    d.pop("quantization_config", None)  # hf: unquantised; a stale fp8 block would make transformers quantize
    if fmt == "official":
        d["quantization_config"] = dict(OFFICIAL_QUANTIZATION_CONFIG)
    elif fmt == "nvfp4":
        d["quantization_config"] = nvfp4_quantization_config(config)
    return d


def write_synthetic_checkpoint(config: ModelConfig, seed: int, out_dir: str | Path, fmt: str = "official",
                               shard_layers: int = 1, dequantize_wo_a: bool = False,
                               profile: str = DEFAULT_PROFILE) -> Path:
    """Write `config.json` and safetensors shards of `SyntheticWeights(config, seed, profile)` in layout `fmt`.

    Shard k holds layers [k·shard_layers, (k+1)·shard_layers), the top-level tensors go with the first; with
    a single shard the file is `model.safetensors` and no index is written (both forms exist in the wild).
    `dequantize_wo_a` stores `attn.wo_a.weight` as BF16, as official convert.py does (official/nvfp4 only).
    Layers are generated and written one shard at a time, so memory stays bounded by one shard.
    """
    if fmt not in LAYOUTS:
        raise ValueError(f"unknown checkpoint layout {fmt!r}; expected one of {LAYOUTS}")
    if shard_layers < 1:
        raise ValueError(f"shard_layers must be >= 1, got {shard_layers}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    source = SyntheticWeights(config, seed, profile)
    n_layers = config.num_hidden_layers
    groups = [list(range(s, min(n_layers, s + shard_layers))) for s in range(0, n_layers, shard_layers)]
    files = [SINGLE_FILE] if len(groups) == 1 else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
                                                     for i in range(len(groups))]
    weight_map: dict[str, str] = {}
    total_size = 0
    for shard, (fname, layers) in enumerate(zip(files, groups)):
        bundles: list[tuple[str, TensorBundle]] = []
        if shard == 0:
            top = source.top_level()
            top.tensors = {"embed.weight": source.embed_rows(torch.arange(config.vocab_size)), **top.tensors}
            bundles.append(("", top))
        bundles += [(layer_prefix(L), source.layer(L)) for L in layers]
        tensors: dict[str, torch.Tensor] = {}
        for prefix, bundle in bundles:
            for name, value in bundle.tensors.items():
                tensors.update(_encode(prefix + name, value, fmt, dequantize_wo_a, source.profile.nvfp4_global_rule))
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in tensors})
        total_size += sum(t.numel() * t.element_size() for t in tensors.values())
    if len(files) > 1:
        index = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(_config_json(config, fmt), indent=2) + "\n")
    return out
