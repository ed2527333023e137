"""Checkpoint layouts: how official tensor names are spelled on disk and how each tensor is encoded.

Three layouts are recognised (spec §8):
- `official` (deepseek-ai): official names; FP8 e4m3 weights with a `.scale` E8M0 tensor per 128x128 block,
  routed experts as packed e2m1 (I8) with a `.scale` E8M0 tensor per 32 inputs, BF16/F32 elsewhere.
- `nvfp4` (NVIDIA ModelOpt): the official layout, but routed experts as U8 packed e2m1 + `.weight_scale`
  F8_E4M3 per 16 inputs + `.weight_scale_2` F32 global (+ optional `.input_scale`).
- `hf` (transformers `save_pretrained`): unquantised tensors under official names with four spelling
  differences (spec §8.3, §11.16): `model.` prefix, `model.embed_tokens.weight`, `model.hc_head.hc_*`, and
  kv_norm saved as `attn.norm.weight`.

Naming (per layout) and encoding (per tensor, read off the stored dtype) are independent, so a tensor that
a converter already dequantized (official convert.py writes `wo_a` as BF16) or re-encoded (FP4 experts
re-encoded to FP8 blocks with `--expert-dtype fp8`) is read correctly in any layout. Everything here works
from safetensors headers alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from reference.config import ModelConfig
from reference.weights.safetensors_index import DTYPE_BITS, CheckpointFiles, TensorEntry
from reference.weights.schema import TensorSpec, layer_prefix, layer_specs, top_level_specs

LAYOUTS = ("hf", "official", "nvfp4")

OFFICIAL_QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}
"""The released Flash `config.json` quantization block (spec §1.1)."""

FLOAT_DTYPES = ("F32", "BF16", "F16")
INT_DTYPES = ("I64", "I32")
PACKED_FP4_DTYPES = ("I8", "U8", "F4")  # F4: torch.float4_e2m1fn_x2, whose header counts unpacked elements
SCALAR_SHAPES = ((), (1,))

# --------------------------------------------------------------------------------------------
# names
# --------------------------------------------------------------------------------------------

_HF_TOP_LEVEL = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
_OFFICIAL_TOP_LEVEL = {v: k for k, v in _HF_TOP_LEVEL.items()}
_KV_NORM = re.compile(r"^(layers\.\d+\.attn\.)kv_norm\.weight$")
_HF_KV_NORM = re.compile(r"^model\.(layers\.\d+\.attn\.)norm\.weight$")
_LAYER_NAME = re.compile(r"^layers\.(\d+)\.(.+)$")

# Tensors that exist only in some layer types (compressor, indexer), routings (gate bias vs hash table) or for
# some expert counts: finding one the config does not expect means config.json does not describe the checkpoint.
_SCHEDULE_DEPENDENT = re.compile(
    r"^(attn\.(indexer\.)?compressor\.(wkv\.weight|wgate\.weight|ape|norm\.weight)"
    r"|attn\.indexer\.(wq_b|weights_proj)\.weight"
    r"|ffn\.gate\.(bias|tid2eid)"
    r"|ffn\.experts\.\d+\.w[123]\.weight)$")


def stored_name(official: str, layout: str) -> str:
    """The key under which `layout` stores the tensor with this official name."""
    if layout != "hf":
        return official
    if official in _HF_TOP_LEVEL:
        return _HF_TOP_LEVEL[official]
    m = _KV_NORM.match(official)
    if m:
        return f"model.{m.group(1)}norm.weight"
    return "model." + official


def official_name(stored: str, layout: str) -> str:
    """Inverse of `stored_name`."""
    if layout != "hf":
        return stored
    if stored in _OFFICIAL_TOP_LEVEL:
        return _OFFICIAL_TOP_LEVEL[stored]
    m = _HF_KV_NORM.match(stored)
    if m:
        return f"{m.group(1)}kv_norm.weight"
    return stored.removeprefix("model.")


def scale_name(weight: str) -> str:
    """`x.weight` -> `x.scale`: the official block-scale tensor (FP8 128x128 or FP4 per-32)."""
    return weight.removesuffix("weight") + "scale"


def nvfp4_part_names(weight: str) -> dict[str, str]:
    """ModelOpt's names for an NVFP4 linear's per-16 scale, global scale and activation scale (spec §8.4)."""
    return {"scale": weight + "_scale", "global_scale": weight + "_scale_2",
            "input_scale": weight.removesuffix("weight") + "input_scale"}


def layer_index(official: str) -> int | None:
    """L for `layers.{L}.*`, None for top-level and MTP names."""
    m = _LAYER_NAME.match(official)
    return int(m.group(1)) if m else None


def is_mtp(official: str) -> bool:
    """The multi-token-prediction block (`mtp.0.*`): recognised and skipped, the reference does not run it."""
    return official.startswith("mtp.")


def detect_layout(stored_names: list[str]) -> str:
    """`hf` if any key has the `model.` prefix, `nvfp4` if any is a ModelOpt `.weight_scale`, else `official`."""
    if any(n.startswith("model.") for n in stored_names):
        return "hf"
    if any(n.endswith((".weight_scale", ".weight_scale_2")) for n in stored_names):
        return "nvfp4"
    return "official"


# --------------------------------------------------------------------------------------------
# encodings
# --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorPlan:
    """How one logical tensor is stored: `format` is "plain" or a QuantizedTensor format, `parts` its entries."""

    spec: TensorSpec
    format: str
    parts: dict[str, TensorEntry]  # "weight"; "scale"; nvfp4 also "global_scale" and maybe "input_scale"

    @property
    def stored_bytes(self) -> int:
        """Bytes as stored: what a stack computing on the stored formats holds."""
        return sum(e.nbytes for e in self.parts.values())

    @property
    def reference_bytes(self) -> int:
        """Bytes once dequantized to fp32 (integer tables such as tid2eid stay as stored)."""
        weight = self.parts["weight"]
        bits = DTYPE_BITS[weight.dtype] if weight.dtype in INT_DTYPES else 32
        return self.spec.numel * bits // 8


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _check_entry(entry: TensorEntry, dtypes: tuple[str, ...], shapes: tuple[tuple[int, ...], ...],
                 role: str) -> list[str]:
    if entry.dtype not in dtypes:
        return [f"tensor {entry.where()}: dtype {entry.dtype}, expected {' or '.join(dtypes)} for {role}"]
    if entry.shape not in shapes:
        want = " or ".join(str(list(s)) for s in shapes)
        return [f"tensor {entry.where()}: shape {list(entry.shape)}, expected {want} for {role}"]
    return []


@dataclass(frozen=True)
class MissingTensor:
    """A tensor the config needs that no shard declares; `needed_by` is set for a missing scale tensor."""

    name: str  # stored name
    needed_by: TensorEntry | None = None

    def message(self, n_shards: int) -> str:
        if self.needed_by is not None:
            return f"tensor '{self.name}' is missing: {self.needed_by.where()} needs it"
        return f"tensor '{self.name}' is missing: none of the {n_shards} shard file(s) declares it"


def plan_tensor(name: str, spec: TensorSpec, layout: str,
                tensors: dict[str, TensorEntry]) -> tuple[TensorPlan | None, list[MissingTensor], list[str]]:
    """Resolve one tensor from headers: (plan or None, missing tensors, error messages).

    Accepted encodings per schema storage kind:
    - bf16 / f32: any float dtype; i64: I64 or I32; exact logical shape.
    - fp8_block128 (attention, shared experts): F8_E4M3 + `.scale` F8_E8M0 [ceil(out/128), ceil(in/128)],
      or a float dtype (already dequantized, e.g. convert.py's BF16 `wo_a`).
    - fp4_mx32 (routed experts): packed e2m1 (I8/U8 [out, in/2], F4 [out, in]) + `.scale` F8_E8M0 [out, in/32];
      the same codes + NVFP4 `.weight_scale` F8_E4M3 [out, in/16] + `.weight_scale_2` F32 scalar
      (+ `.input_scale` F32 scalar); FP8 blocks as above; or a float dtype.
    """
    main = tensors.get(stored_name(name, layout))
    if main is None:
        return None, [MissingTensor(stored_name(name, layout))], []
    parts = {"weight": main}
    missing: list[MissingTensor] = []
    errors: list[str] = []

    def part(role: str, official: str, dtypes: tuple[str, ...], shapes: tuple[tuple[int, ...], ...],
             optional: bool = False) -> None:
        entry = tensors.get(stored_name(official, layout))
        if entry is None:
            if not optional:
                missing.append(MissingTensor(stored_name(official, layout), main))
            return
        parts[role] = entry
        errors.extend(_check_entry(entry, dtypes, shapes, f"the {role} of {main.where()}"))

    dtype, shape = main.dtype, spec.shape
    if spec.storage == "i64":
        fmt = "plain"
        errors += _check_entry(main, INT_DTYPES, (shape,), f"a {spec.storage} tensor")
    elif spec.storage in ("bf16", "f32") or dtype in FLOAT_DTYPES:
        fmt = "plain"
        errors += _check_entry(main, FLOAT_DTYPES, (shape,), f"a {spec.storage} tensor")
    elif dtype == "F8_E4M3":
        fmt = "fp8_block128"
        out, inp = shape
        errors += _check_entry(main, ("F8_E4M3",), (shape,), "an FP8 weight")
        part("scale", scale_name(name), ("F8_E8M0",), ((_ceil_div(out, 128), _ceil_div(inp, 128)),))
    elif dtype in PACKED_FP4_DTYPES and spec.storage == "fp4_mx32":
        out, inp = shape
        codes_shape = (out, inp) if dtype == "F4" else (out, inp // 2)
        nv = nvfp4_part_names(name)
        if stored_name(nv["scale"], layout) in tensors:
            fmt = "nvfp4"
            errors += _check_entry(main, PACKED_FP4_DTYPES, (codes_shape,), "NVFP4 codes")
            part("scale", nv["scale"], ("F8_E4M3",), ((out, inp // 16),))
            part("global_scale", nv["global_scale"], ("F32",), SCALAR_SHAPES)
            part("input_scale", nv["input_scale"], ("F32",), SCALAR_SHAPES, optional=True)
        else:
            fmt = "fp4_mx32"
            errors += _check_entry(main, PACKED_FP4_DTYPES, (codes_shape,), "packed FP4 codes")
            part("scale", scale_name(name), ("F8_E8M0",), ((out, inp // 32),))
    else:
        accepted = "F8_E4M3 (+ .scale F8_E8M0)"
        if spec.storage == "fp4_mx32":
            accepted += ", I8/U8/F4 packed e2m1 (+ .scale F8_E8M0, or NVFP4 .weight_scale/.weight_scale_2)"
        return None, [], [f"tensor {main.where()}: dtype {dtype}, expected {accepted} or a float dtype "
                          f"for this {spec.storage} weight"]
    if missing or errors:
        return None, missing, errors
    return TensorPlan(spec, fmt, parts), [], []


# --------------------------------------------------------------------------------------------
# whole-checkpoint check
# --------------------------------------------------------------------------------------------

def format_ranges(values: list[int]) -> str:
    """[4, 5, 6, 9] -> "4-6, 9"."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][-1] + 1:
            runs[-1].append(v)
        else:
            runs.append([v])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


TOP_LEVEL = None  # key of the top-level tensors in per-layer dictionaries


@dataclass
class CheckpointCheck:
    """Everything known about a checkpoint from its headers, checked against a config.

    `plans[layer][name]` (layer None = top level, names without the `layers.{L}.` prefix) for each tensor
    that resolved; `missing[layer]` the tensors not found; `absent_layers` the checked layers of which no
    tensor at all is present (a partial download); `errors` fatal problems (dtype, shape, schedule
    mismatch, layers beyond the config's num_hidden_layers); `unexpected` stored names nothing claims (listed, not fatal); `mtp` the skipped MTP tensors;
    `truncated` one message per shard whose data region ends before its header says.
    """

    layout: str
    layers: list[int]
    n_shards: int
    plans: dict[int | None, dict[str, TensorPlan]] = field(default_factory=dict)
    missing: dict[int | None, list[MissingTensor]] = field(default_factory=dict)
    absent_layers: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mtp: list[str] = field(default_factory=list)
    truncated: list[str] = field(default_factory=list)

    def fatal(self, require_data: bool) -> list[str]:
        """Messages that must stop a run; truncation counts only when tensor data is going to be read."""
        out = []
        if self.absent_layers:
            out.append(f"layers {format_ranges(self.absent_layers)} are missing entirely: none of the "
                       f"{self.n_shards} shard file(s) declares any of their tensors")
        out += [m.message(self.n_shards) for layer, group in self.missing.items()
                if layer not in self.absent_layers for m in group]
        return out + self.errors + (self.truncated if require_data else [])


def check_checkpoint(files: CheckpointFiles, config: ModelConfig, layout: str | None = None,
                     layers: list[int] | None = None) -> CheckpointCheck:
    """Resolve every tensor the config needs (top level and `layers`, default all) from headers only."""
    layout = layout or detect_layout(list(files.tensors))
    if layout not in LAYOUTS:
        raise ValueError(f"unknown checkpoint layout {layout!r}; expected one of {LAYOUTS}")
    checked = list(range(config.num_hidden_layers)) if layers is None else sorted(set(layers))
    out = CheckpointCheck(layout, checked, len(files.shards))
    claimed: set[str] = set()

    groups: list[tuple[int | None, str, list[TensorSpec]]] = [(TOP_LEVEL, "", top_level_specs(config))]
    groups += [(L, layer_prefix(L), layer_specs(config, L)) for L in checked]
    for layer, prefix, specs in groups:
        out.plans[layer], out.missing[layer] = {}, []
        for spec in specs:
            plan, missing, errors = plan_tensor(prefix + spec.name, spec, layout, files.tensors)
            out.missing[layer] += missing
            out.errors += errors
            if plan is not None:
                out.plans[layer][spec.name] = plan
                claimed.update(e.name for e in plan.parts.values())
            else:  # claim what exists, so a broken tensor is reported once, not again as unexpected
                name = prefix + spec.name
                related = [name, scale_name(name), *nvfp4_part_names(name).values()]
                claimed.update(stored_name(n, layout) for n in related)

    present = {layer_index(official_name(stored, layout)) for stored in files.tensors}
    out.absent_layers = [L for L in checked if L not in present]
    beyond: list[str] = []  # tensors of layers the config does not have: the model would silently lose them
    for stored in files.tensors:
        if stored in claimed:
            continue
        official = official_name(stored, layout)
        if is_mtp(official):
            out.mtp.append(stored)
            continue
        L = layer_index(official)
        if L is not None and L >= config.num_hidden_layers:
            beyond.append(stored)
            continue
        if L is not None and L not in checked:
            continue  # outside the requested layer filter: not examined
        if L is not None and _SCHEDULE_DEPENDENT.match(official.removeprefix(layer_prefix(L))):
            routing = "hash" if config.is_hash_layer(L) else "learned"
            out.errors.append(
                f"tensor {files.tensors[stored].where()}: the config describes layer {L} as "
                f"{config.layer_kind(L).upper()} with {routing} routing and {config.n_routed_experts} routed "
                "experts, which has no such tensor: the config does not describe this checkpoint")
            continue
        out.unexpected.append(stored)
    if beyond:
        layers = sorted({layer_index(official_name(stored, layout)) for stored in beyond})
        out.errors.append(
            f"tensor {files.tensors[beyond[0]].where()} and {len(beyond) - 1} more belong to layer(s) "
            f"{format_ranges(layers)}, beyond the config's num_hidden_layers = {config.num_hidden_layers} (layers "
            f"0-{config.num_hidden_layers - 1}): the config does not describe this checkpoint")

    for shard in files.shards.values():
        cut = shard.truncated()
        if cut:
            first = min(cut, key=lambda e: e.begin)
            out.truncated.append(
                f"tensor {first.where()}" + (f" and {len(cut) - 1} more" if len(cut) > 1 else "")
                + f": data ends at byte {first.data_start + first.end} but the file has {shard.file_size} bytes "
                  "(truncated shard)")
    return out
