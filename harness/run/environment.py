"""What a run ran on: project, torch and triton versions, device name and compute capability."""

from __future__ import annotations

import platform
import re
from importlib import metadata
from pathlib import Path

import torch


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _project_version() -> str | None:
    """The installed distribution's version, or — run from a source tree without installing (PYTHONPATH, as on
    the GPU machine) — the version in the tree's pyproject.toml, marked as such."""
    installed = _version("dsv4-drift")
    if installed:
        return installed
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    if pyproject.is_file():
        match = re.search(r'^version\s*=\s*"([^"]+)"', pyproject.read_text(), re.MULTILINE)
        if match:
            return f"{match.group(1)} (source tree)"
    return None


def environment_record(device: str | torch.device = "cpu") -> dict[str, object]:
    """Recorded in every manifest and output file: results are only comparable with this context."""
    dev = torch.device(device)
    record: dict[str, object] = {
        "dsv4_drift": _project_version(),
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
