"""What a run ran on: project, torch and triton versions, device name and compute capability."""

from __future__ import annotations

import platform
from importlib import metadata

import torch


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def environment_record(device: str | torch.device = "cpu") -> dict[str, object]:
    """Recorded in every manifest and output file: results are only comparable with this context."""
    dev = torch.device(device)
    record: dict[str, object] = {
        "dsv4_drift": _version("dsv4-drift"),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "device": str(dev),
        "torch_threads": torch.get_num_threads(),
    }
    if dev.type == "cuda" and torch.cuda.is_available():
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        record["device_name"] = torch.cuda.get_device_name(idx)
        record["compute_capability"] = ".".join(map(str, torch.cuda.get_device_capability(idx)))
        record["cuda"] = torch.version.cuda
    else:
        record["device_name"] = platform.processor() or platform.machine()
        record["compute_capability"] = None
    return record
