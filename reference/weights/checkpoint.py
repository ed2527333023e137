"""A checkpoint directory as a `WeightSource`: official, NVFP4 or transformers layout, one layer at a time.

The directory holds `config.json` and safetensors shards (with `model.safetensors.index.json`, or a single
`model.safetensors`). Construction reads only the shard headers, detects the layout, and validates every
tensor the config needs (names, dtypes, shapes, scale shapes, file sizes) before any compute, so a bad
checkpoint fails in a second with the tensor and shard named, not 20 layers into a run. Tensor data is
then read per layer through `safetensors.safe_open` (memory-mapped): host memory holds about one layer.

Stored formats are kept: FP8 blocks, MXFP4 and NVFP4 experts come back as `QuantizedTensor`, everything else
as the stored tensor; the reference dequantizes exactly with `TensorBundle.dense()`.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open

from reference.config import ModelConfig, load_config_json
from reference.quant import QuantizedTensor
from reference.weights.layouts import TOP_LEVEL, TensorPlan, check_checkpoint, plan_tensor
from reference.weights.safetensors_index import TensorEntry, read_checkpoint_files
from reference.weights.schema import layer_prefix, layer_specs, top_level_specs
from reference.weights.source import Stored, TensorBundle, WeightError

MAX_LISTED_PROBLEMS = 20


def _e8m0_bytes(entry: TensorEntry, t: torch.Tensor) -> torch.Tensor:
    """E8M0 scale bytes as uint8; 255 encodes NaN and never occurs in a sound checkpoint (spec §8.2)."""
    u = t.view(torch.uint8)
    bad = (u == 255).nonzero()
    if bad.numel():
        raise WeightError(f"tensor {entry.where()}: E8M0 scale byte 255 (NaN) at index {bad[0].tolist()}")
    return u


def _decode(plan: TensorPlan, raw: dict[str, torch.Tensor]) -> Stored:
    """Stored parts -> the value a TensorBundle holds (a plain tensor or a QuantizedTensor)."""
    w = raw["weight"]
    if plan.format == "plain":
        return w
    if plan.format == "fp8_block128":
        return QuantizedTensor("fp8_block128", w, _e8m0_bytes(plan.parts["scale"], raw["scale"]))
    codes = w.view(torch.uint8)  # I8 / U8 / float4_e2m1fn_x2: the same packed bytes, low nibble first
    if plan.format == "fp4_mx32":
        return QuantizedTensor("fp4_mx32", codes, _e8m0_bytes(plan.parts["scale"], raw["scale"]))
    scale, global_scale = raw["scale"], raw["global_scale"].reshape(())
    if bool(torch.isnan(scale.float()).any()) or not bool(torch.isfinite(global_scale)):
        raise WeightError(f"tensor {plan.parts['weight'].where()}: NVFP4 scales hold NaN or Inf")
    input_scale = raw["input_scale"].reshape(()) if "input_scale" in raw else None
    return QuantizedTensor("nvfp4", codes, scale, global_scale, input_scale)


ALIGN_BYTES = 64
"""What PyTorch's CPU allocator aligns every tensor to (c10's gAlignment: one AVX-512 register)."""


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """`t`, copied when it does not start on an ALIGN_BYTES boundary. safetensors hands back tensors at their offsets in
    the file, and MKL sums an unaligned operand's products in another order on some CPUs (AMD EPYC, 2026-12-02): the
    same weights read from the hf layout (stored as fp32/bf16, used in place) and from the official one (dequantized
    into fresh tensors) gave logits differing in their last bits. Aligned, a weight gives the same bits however it
    was stored. Only for a layer kept on the CPU: moving it to a GPU copies it into an aligned block anyway."""
    return t if t.data_ptr() % ALIGN_BYTES == 0 else t.clone()


def _on_cpu(device: torch.device | str) -> bool:
    return torch.device(device).type == "cpu"


class CheckpointWeights:
    """A `WeightSource` over a checkpoint directory in the `hf`, `official` or `nvfp4` layout."""

    def __init__(self, path: str | Path, config: ModelConfig | None = None, validate: bool = True) -> None:
        self.path = Path(path)
        self.config = config if config is not None else load_config_json(self.path)
        self.files = read_checkpoint_files(self.path)
        self.check = check_checkpoint(self.files, self.config)
        self.layout = self.check.layout
        if validate:
            self.validate()

    def validate(self) -> None:
        """Raise one WeightError listing every problem found in the headers (no tensor data is read)."""
        problems = self.check.fatal(require_data=True)
        if not problems:
            return
        head = f"checkpoint {self.path} ({self.layout} layout) does not match config '{self.config.name}': "
        if len(problems) == 1:
            raise WeightError(head + problems[0])
        listed = "\n  ".join(problems[:MAX_LISTED_PROBLEMS])
        more = len(problems) - MAX_LISTED_PROBLEMS
        raise WeightError(f"{head}{len(problems)} problem(s):\n  {listed}" + (f"\n  ... and {more} more" if more > 0 else ""))

    def describe(self) -> dict[str, object]:
        return {
            "kind": "checkpoint",
            "path": str(self.path.resolve()),
            "layout": self.layout,
            "model": self.config.name,
            "shards": len(self.files.shards),
            "quantization": self.config.quantization_config.get("quant_method"),
            "mtp_tensors_skipped": len(self.check.mtp),
            "unexpected_tensors": len(self.check.unexpected),
        }

    # --- WeightSource -------------------------------------------------------------------------------
    def top_level(self, device: torch.device | str = "cpu") -> TensorBundle:
        plans = {n: p for n, p in self._plans(TOP_LEVEL).items() if n != "embed.weight"}
        return self._read(f"top level ({self.path.name})", plans, _on_cpu(device)).to(device)

    def layer(self, layer: int, device: torch.device | str = "cpu") -> TensorBundle:
        if not 0 <= layer < self.config.num_hidden_layers:
            raise IndexError(f"layer {layer} outside 0..{self.config.num_hidden_layers - 1}")
        return self._read(f"layer {layer} ({self.path.name})", self._plans(layer), _on_cpu(device)).to(device)

    def embed_rows(self, token_ids: torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
        """Rows of embed.weight in the stored dtype, read by contiguous runs of ids (never the whole table)."""
        V = self.config.vocab_size
        ids = torch.as_tensor(token_ids, dtype=torch.int64).flatten().cpu()
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= V):
            raise ValueError(f"token id outside the vocabulary [0, {V}): min {int(ids.min())}, max {int(ids.max())}")
        entry = self._plans(TOP_LEVEL)["embed.weight"].parts["weight"]
        unique, inverse = torch.unique(ids, return_inverse=True)
        u = unique.tolist()
        starts = [i for i in range(len(u)) if i == 0 or u[i] != u[i - 1] + 1]
        bounds = zip(starts, starts[1:] + [len(u)])
        try:
            with safe_open(entry.file, framework="pt") as f:
                table = f.get_slice(entry.name)
                rows = [table[u[a]: u[b - 1] + 1] for a, b in bounds] or [table[0:0]]
        except Exception as e:  # safetensors raises its own error types; name the tensor and file instead
            raise WeightError(f"tensor {entry.where()}: cannot read rows ({e})") from e
        return torch.cat(rows, 0)[inverse].to(device)

    # --- internals ----------------------------------------------------------------------------------
    def _plans(self, layer: int | None) -> dict[str, TensorPlan]:
        """The resolved tensors of a layer; refuses an incomplete layer even when validation was skipped."""
        plans = self.check.plans[layer]
        specs = top_level_specs(self.config) if layer is TOP_LEVEL else layer_specs(self.config, layer)
        broken = [s for s in specs if s.name not in plans]
        if broken:
            prefix = "" if layer is TOP_LEVEL else layer_prefix(layer)
            problems = []
            for spec in broken:
                _, missing, errors = plan_tensor(prefix + spec.name, spec, self.layout, self.files.tensors)
                problems += [m.message(len(self.files.shards)) for m in missing] + errors
            raise WeightError(f"{'top level' if layer is TOP_LEVEL else f'layer {layer}'} of {self.path} cannot "
                              "be read:\n  " + "\n  ".join(problems))
        return plans

    def _read(self, where: str, plans: dict[str, TensorPlan], align: bool) -> TensorBundle:
        """Read every part of `plans`, one shard file open at a time, and decode to stored values (`align`: each
        part copied to an aligned block where it is not, for a layer the CPU computes with: _aligned)."""
        wanted: dict[Path, list[tuple[str, str, TensorEntry]]] = defaultdict(list)
        for name, plan in plans.items():
            for role, entry in plan.parts.items():
                wanted[entry.file].append((name, role, entry))
        raw: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
        for file, items in wanted.items():
            entry = items[0][2]  # the tensor named if the file cannot even be opened
            try:
                with safe_open(file, framework="pt") as f:
                    for name, role, entry in items:
                        t = f.get_tensor(entry.name)
                        raw[name][role] = _aligned(t) if align else t
            except Exception as e:  # safetensors raises its own error types; name the tensor and file instead
                raise WeightError(f"tensor {entry.where()}: cannot read ({e})") from e
        return TensorBundle(where, {name: _decode(plan, raw[name]) for name, plan in plans.items()})
