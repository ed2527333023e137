"""Write a safetensors file tensor by tensor and block by block, so memory holds one block, not the file.

`dsv4-drift forward` writes logits for every position: [30,720, 129,280] fp32 is 15.9 GB at the real
vocabulary, which a whole-file writer must first hold in memory (twice, as tensor and as bytes). The
format is simple enough to stream: an 8-byte little-endian header length, a JSON header with each
tensor's dtype, shape and byte range (padded with spaces to a multiple of 8), then the raw bytes in order.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Callable, Iterable

import torch

_DTYPES = {torch.float32: "F32", torch.float64: "F64", torch.bfloat16: "BF16", torch.float16: "F16",
           torch.int64: "I64", torch.int32: "I32"}

Producer = Callable[[], Iterable[torch.Tensor]]


def write_streamed(path: str | Path, tensors: list[tuple[str, torch.dtype, tuple[int, ...], Producer]],
                   metadata: dict[str, str] | None = None) -> None:
    """tensors: (name, dtype, shape, producer) — the producer yields row blocks whose concatenation along dim 0
    is the tensor. The file is written to a temporary name and renamed when complete."""
    header: dict[str, object] = {"__metadata__": dict(metadata or {})}
    offset = 0
    for name, dtype, shape, _ in tensors:
        if dtype not in _DTYPES:
            raise ValueError(f"tensor '{name}': dtype {dtype} is not supported by the streamed writer")
        size = torch.empty((), dtype=dtype).element_size()
        for s in shape:
            size *= s
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * ((-len(blob)) % 8)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, dtype, shape, produce in tensors:
            rows = 0
            for block in produce():
                block = block.detach().to("cpu", dtype).contiguous()
                if tuple(block.shape[1:]) != tuple(shape[1:]):
                    raise ValueError(f"tensor '{name}': block of shape {tuple(block.shape)} for shape {shape}")
                f.write(block.numpy().tobytes() if dtype != torch.bfloat16 else block.view(torch.int16).numpy().tobytes())
                rows += block.shape[0]
            if rows != shape[0]:
                raise ValueError(f"tensor '{name}': wrote {rows} rows of {shape[0]}")
    os.replace(tmp, path)
