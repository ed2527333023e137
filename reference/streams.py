"""Side streams of our own roles, never one another's: the CUDA graph capture's and the weight prefetcher's.

`torch.cuda.Stream()` creates nothing: it hands out the next of 32 streams preallocated per device and priority,
round-robin (pytorch/pytorch#9938), so two calls 32 draws apart return the same CUDA stream. That matters for a
stream that captures a CUDA graph (reference.graphs): kernels another thread queues on that stream during the capture
are recorded into the graph instead of being run (a capture mode only governs calls such as synchronize and malloc,
never a kernel launch). The weight prefetcher used to draw a fresh pool stream per layer on its own thread; when it
drew the capture stream, its layer's weights were captured and never computed (garbage: "per-32 scales span more
than 17 binades"), its host-to-device copies failed the capture ("Cannot copy between CPU and CUDA tensors during
CUDA graph capture"), and the graph's replays later wrote into memory freed since (device-side asserts, segfaults).
Which draw aliases which depends on how many captures came before, so it showed as a crash of two ranks sharing one
GPU after an unrelated change (README, Several GPUs).

Here each role gets one stream per device for the whole process, drawn so that its CUDA stream is none of the other
roles' (`private_stream`). That is all it guarantees: other code's pool draws (a library's side streams, such as
the NCCL process group's, drawn when the group starts) may still be handed the same stream. None of them queues
work from another thread while a graph is captured; within this repository nothing else draws a pool stream.
"""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

import torch

POOL_SIZE = 32
"""Streams per device and priority in torch's pool: at most this many draws are needed to leave the ones taken."""

_streams: dict[tuple[str, torch.device], torch.cuda.Stream] = {}
_lock = threading.Lock()

S = TypeVar("S")


def distinct_draw(draw: Callable[[], S], handle: Callable[[S], int], taken: set[int], pool_size: int = POOL_SIZE) -> S:
    """The first of `draw()`'s results whose `handle` is not in `taken`; `draw` cycles through a pool of `pool_size`
    (torch's stream pool), so if no such result comes in that many draws there is none."""
    for _ in range(pool_size):
        candidate = draw()
        if handle(candidate) not in taken:
            return candidate
    raise RuntimeError(f"no stream outside the {len(taken)} already taken in a pool of {pool_size}")


def private_stream(device: torch.device | str, role: str) -> torch.cuda.Stream:
    """The stream of `role` ("capture", "weights") on a CUDA `device`: the same one at every call, and a different
    CUDA stream from every other role's on that device."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (role, device)
    with _lock:
        if key not in _streams:
            taken = {s.cuda_stream for (_, d), s in _streams.items() if d == device}
            try:
                _streams[key] = distinct_draw(lambda: torch.cuda.Stream(device), lambda s: s.cuda_stream, taken)
            except RuntimeError as e:
                raise RuntimeError(f"the {role!r} stream on {device}: {e}") from None
        return _streams[key]
