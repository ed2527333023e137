"""Safetensors headers and checkpoint directories, read without touching tensor data.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
(`{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}`), then the data region;
offsets are relative to the start of the data region. Parsing the header ourselves lets validation and
`checkpoint inspect` run on the 160 GB Flash checkpoint in well under a second, and on test fixtures whose
shards hold a header and no data at all. Every problem names the tensor and the shard file.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from reference.weights.source import WeightError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_HEADER_BYTES = 100_000_000  # the limit the safetensors library itself enforces

DTYPE_BITS: dict[str, int] = {
    "F64": 64, "F32": 32, "F16": 16, "BF16": 16,
    "I64": 64, "I32": 32, "I16": 16, "I8": 8,
    "U64": 64, "U32": 32, "U16": 16, "U8": 8, "BOOL": 8,
    "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "F4": 4,  # float4_e2m1fn_x2: the header counts fp4 elements, two per byte
    "C64": 64,
}
"""Bits per element of every safetensors dtype string."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as a shard header declares it."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offsets relative to the data region
    end: int
    data_start: int  # absolute file offset of the data region (8 + header length)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    def where(self) -> str:
        """`'name' in model-00002-of-00046.safetensors`, the suffix of every message about this tensor."""
        return f"'{self.name}' in {self.file.name}"


@dataclass
class ShardHeader:
    path: Path
    data_start: int
    file_size: int
    entries: dict[str, TensorEntry]

    def truncated(self) -> list[TensorEntry]:
        """Tensors whose declared bytes lie (partly) beyond the end of the file."""
        return [e for e in self.entries.values() if e.data_start + e.end > self.file_size]


def _entry(path: Path, name: str, info: object, data_start: int) -> TensorEntry:
    where = f"tensor '{name}' in {path.name}"
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise WeightError(f"{where}: header entry must hold dtype, shape and data_offsets, got {info!r}")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if dtype not in DTYPE_BITS:
        raise WeightError(f"{where}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise WeightError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise WeightError(f"{where}: data_offsets must be [begin, end] with 0 <= begin <= end, got {offsets!r}")
    entry = TensorEntry(name, path, dtype, tuple(shape), offsets[0], offsets[1], data_start)
    bits = entry.numel * DTYPE_BITS[dtype]
    if bits % 8 or bits // 8 != entry.nbytes:
        raise WeightError(f"{where}: header mismatch: {dtype} {list(shape)} needs {bits / 8:g} bytes but "
                          f"data_offsets {offsets} span {entry.nbytes}")
    return entry


def read_header(path: str | Path) -> ShardHeader:
    """Parse one shard's header; the data region need not exist (header-only fixtures)."""
    path = Path(path)
    try:
        file_size = path.stat().st_size
        with path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise WeightError(f"{path.name}: not a safetensors file ({file_size} bytes, no header length)")
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER_BYTES or 8 + n > file_size:
                raise WeightError(f"{path.name}: header length {n} does not fit a {file_size}-byte file "
                                  "(truncated or not safetensors)")
            raw = f.read(n)
    except OSError as e:
        raise WeightError(f"{path.name}: cannot read ({e})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WeightError(f"{path.name}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise WeightError(f"{path.name}: header must be a JSON object")
    header.pop("__metadata__", None)
    entries = {name: _entry(path, name, info, 8 + n) for name, info in header.items()}
    # The format requires the tensors to tile the data region exactly: no gaps, no overlaps.
    position = 0
    for e in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if e.begin != position:
            raise WeightError(f"tensor {e.where()}: header mismatch: data starts at byte {e.begin}, "
                              f"expected {position} (tensors overlap or leave a gap)")
        position = e.end
    return ShardHeader(path, 8 + n, file_size, entries)


@dataclass
class CheckpointFiles:
    """All shard headers of a checkpoint directory and the tensor -> entry table."""

    root: Path
    shards: dict[str, ShardHeader]  # file name -> header
    tensors: dict[str, TensorEntry]  # stored tensor name -> entry


def read_checkpoint_files(root: str | Path) -> CheckpointFiles:
    """Headers of `model.safetensors.index.json`'s shards, else of every `*.safetensors` in `root`.

    Consistency checked here: every shard the index names exists, each tensor the index maps to a shard is
    declared by that shard's header, and no tensor is declared twice.
    """
    root = Path(root)
    index_path = root / INDEX_FILE
    weight_map: dict[str, str] | None = None
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text())
            weight_map = index["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise WeightError(f"{index_path.name}: not a safetensors index with a weight_map ({e!r})") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise WeightError(f"{index_path.name}: weight_map must map tensor names to shard file names")
        files = sorted(set(weight_map.values()))
        for fname in files:
            if not (root / fname).is_file():
                example = next(k for k, v in weight_map.items() if v == fname)
                raise WeightError(f"tensor '{example}' (and every other tensor mapped to it): shard file {fname} "
                                  f"named in {INDEX_FILE} does not exist in {root}")
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
        if not files:
            raise WeightError(f"{root}: no {INDEX_FILE} and no *.safetensors files")

    shards = {fname: read_header(root / fname) for fname in files}
    tensors: dict[str, TensorEntry] = {}
    for fname, shard in shards.items():
        for name, entry in shard.entries.items():
            if name in tensors:
                raise WeightError(f"tensor '{name}' is declared twice: in {tensors[name].file.name} and in {fname}")
            tensors[name] = entry
    if weight_map is not None:
        for name, fname in weight_map.items():
            if name not in shards[fname].entries:
                raise WeightError(f"tensor '{name}': {INDEX_FILE} places it in {fname}, whose header does not "
                                  "declare it")
    return CheckpointFiles(root, shards, tensors)
