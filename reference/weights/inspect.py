"""`checkpoint inspect`: what a checkpoint holds and what it will cost, from safetensors headers only.

Never reads tensor data, so it answers in about a second for the 160 GB Flash checkpoint and works on
a partial download or on header-only fixtures. It reports the detected layout, layers present, dtype counts,
missing / unexpected / invalid tensors, the skipped MTP tensors, and the weight memory of one resident layer
per stack family (DESIGN §8): the reference holds every tensor dequantized to fp32, the optimized stack holds
the stored bytes (FP8/FP4 codes plus scales).

Layers absent from the files are reported in `missing_layers` (a partial download of the first layers shows the
rest there, not as tens of thousands of missing tensors); `layers=` restricts the check to chosen layers.
`stops_a_run` lists what `run` would refuse the checkpoint for (the same check), shards whose data region is
cut short (`truncated`) included; `checkpoint inspect` exits 2 when it is not empty.
"""

from __future__ import annotations

import io
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from reference.config import ModelConfig, load_config_json
from reference.weights.layouts import (
    TOP_LEVEL,
    TensorPlan,
    check_checkpoint,
    format_ranges,
    layer_index,
    official_name,
)
from reference.weights.safetensors_index import read_checkpoint_files
from reference.weights.schema import layer_specs

MAX_LISTED = 10


def layer_type(config: ModelConfig, layer: int) -> str:
    """Attention kind and routing, the two things that decide a layer's tensors: e.g. "csa/hash"."""
    return f"{config.layer_kind(layer)}/{'hash' if config.is_hash_layer(layer) else 'learned'}"


def _memory(plans: Iterable[TensorPlan]) -> dict[str, int]:
    plans = list(plans)
    return {"tensors": len(plans),
            "reference_fp32_bytes": sum(p.reference_bytes for p in plans),
            "optimized_bytes": sum(p.stored_bytes for p in plans)}


def inspect_checkpoint(path: str | Path, config: ModelConfig | None = None,
                       layers: Iterable[int] | None = None) -> dict[str, Any]:
    """A JSON-able report of the checkpoint in `path` (config from its config.json unless given).

    Memory numbers: `per_layer` for every checked layer whose tensors all resolved; `per_type` the largest of
    those per layer type; `peak_layer` the largest over all; `top_level` the resident head, norm and HC head;
    `embed` the embedding table (read by rows, never resident as a whole).
    """
    root = Path(path)
    config = config if config is not None else load_config_json(root)
    files = read_checkpoint_files(root)
    check = check_checkpoint(files, config, layers=None if layers is None else list(layers))

    present = sorted({L for name in files.tensors
                      if (L := layer_index(official_name(name, check.layout))) is not None
                      and L < config.num_hidden_layers})
    missing = [m.name for key, group in check.missing.items() if key not in check.absent_layers for m in group]

    per_layer = [{"layer": L, "type": layer_type(config, L), **_memory(check.plans[L].values())}
                 for L in check.layers if len(check.plans[L]) == len(layer_specs(config, L))]
    per_type: dict[str, dict[str, Any]] = {}
    for row in per_layer:
        t = per_type.setdefault(row["type"], {"layers": [], "tensors": 0, "reference_fp32_bytes": 0,
                                              "optimized_bytes": 0})
        t["layers"].append(row["layer"])
        for k in ("tensors", "reference_fp32_bytes", "optimized_bytes"):
            t[k] = max(t[k], row[k])
    top = check.plans[TOP_LEVEL]
    formats = Counter(p.format for group in check.plans.values() for p in group.values())

    return {
        "path": str(root),
        "layout": check.layout,
        "model": config.name,
        "quantization_config": config.quantization_config,
        "shards": len(files.shards),
        "tensors": len(files.tensors),
        "dtype_counts": dict(sorted(Counter(e.dtype for e in files.tensors.values()).items())),
        "formats": dict(sorted(formats.items())),
        "config_layers": config.num_hidden_layers,
        "layers_checked": check.layers,
        "layers_present": present,
        "num_layers": len(present),
        "missing_layers": check.absent_layers,
        "missing": missing,
        "errors": check.errors,
        "unexpected": check.unexpected,
        "mtp_tensors": len(check.mtp),
        "tensors_without_data": sum(len(shard.truncated()) for shard in files.shards.values()),
        "truncated": check.truncated,
        "stops_a_run": check.fatal(require_data=True),
        "memory": {
            "per_layer": per_layer,
            "per_type": per_type,
            "peak_layer": {k: max((r[k] for r in per_layer), default=0)
                           for k in ("reference_fp32_bytes", "optimized_bytes")},
            "top_level": _memory(p for n, p in top.items() if n != "embed.weight"),
            "embed": _memory(p for n, p in top.items() if n == "embed.weight"),
        },
    }


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _listing(title: str, items: list[Any]) -> str:
    shown = ", ".join(str(x) for x in items[:MAX_LISTED])
    more = f", ... ({len(items)} in all)" if len(items) > MAX_LISTED else ""
    return f"{title}: {shown}{more}"


def format_inspection(report: dict[str, Any], width: int = 110) -> str:
    """The report as text: a summary, problems, and a memory table per layer type (rich)."""
    console = Console(file=io.StringIO(), width=width, force_terminal=False, color_system=None)
    quant = report["quantization_config"].get("quant_method", "none")
    console.print(f"[bold]{report['path']}[/bold]  layout [bold]{report['layout']}[/bold]  "
                  f"quantization {quant}  {report['shards']} shard(s), {report['tensors']} tensors")
    console.print(f"layers present: {report['num_layers']} of {report['config_layers']} "
                  f"({format_ranges(report['layers_present']) or 'none'})")
    console.print("dtypes: " + ", ".join(f"{k} {v}" for k, v in report["dtype_counts"].items()))
    console.print("formats: " + ", ".join(f"{k} {v}" for k, v in report["formats"].items()))
    console.print(f"MTP tensors (skipped): {report['mtp_tensors']}")
    if report["missing_layers"]:
        console.print(f"[red]missing layers[/red]: {format_ranges(report['missing_layers'])}")
    for key in ("missing", "errors", "unexpected"):
        if report[key]:
            console.print(_listing(key, report[key]))
    if report["tensors_without_data"]:
        console.print(f"tensors whose data is absent from their shard: {report['tensors_without_data']}")
        for line in report["truncated"]:
            console.print(f"[red]truncated[/red]: {line}")

    mem = report["memory"]
    table = Table(title="weight memory of one resident layer")
    for col in ("layer type", "layers", "tensors", "reference (fp32)", "optimized (stored)", "ratio"):
        table.add_column(col, justify="left" if col in ("layer type", "layers") else "right")

    def row(label: str, layers: str, m: dict[str, int]) -> None:
        ref, opt = m["reference_fp32_bytes"], m["optimized_bytes"]
        table.add_row(label, layers, str(m.get("tensors", "")), _bytes(ref), _bytes(opt),
                      f"{ref / opt:.2f}x" if opt else "-")

    for label, t in mem["per_type"].items():
        row(label, format_ranges(t["layers"]), t)
    if mem["per_layer"]:
        row("peak layer", "", mem["peak_layer"])
    row("top level (head, norm, hc_head)", "", mem["top_level"])
    row("embed (read by rows)", "", mem["embed"])
    console.print(table)
    return console.file.getvalue()
