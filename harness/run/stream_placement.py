"""Where a global stack's streams wait between layers: on the device, or in page-locked host memory.

A global-mode stack carries its own streams [T, hc, D] from one layer to the next, and during a layer a process
holds every stack's input and output streams at once: at Flash width and 30,784 tokens 1 GB per stack and copy in
bf16, 31.9 GiB for an attribution's 15 global stacks and the reference (harness.run.memory: "streams") — more than
an 80 GB GPU has left beside a layer's weights. Kept on the host between layers, only the pairs that are running hold
their streams on the device (RunSpec.streams_on_host; harness.run.memory.check_fits turns it on when a run on one GPU
fits only so). A prefill that later variants continue from (harness.run.prefill_sharing) then keeps host copies of
its global input and output rows too.

The copies are exact, so the metrics are those of a run that keeps the streams on the device. The copy out waits for
the work queued before it (the stack's pair is over: its rows have read the device already) and the host tensor is
never written again, so a later copy in from it, queued without waiting (page-locked memory), reads what the stack
wrote; torch's page-locked host allocator keeps a freed block from being reused until the copies queued from it are
done. It rounds each block up to a power of two (a Flash stream of 1.009 GB at 30,784 tokens takes 1 GiB), which the
memory estimate counts. On a CPU both placements are the same memory: nothing moves.
"""

from __future__ import annotations

import torch


def to_host(streams: torch.Tensor) -> torch.Tensor:
    """`streams` in page-locked host memory, complete when this returns (a CPU tensor is returned as it is)."""
    if streams.device.type != "cuda":
        return streams
    try:
        host = torch.empty(streams.shape, dtype=streams.dtype, pin_memory=True)
    except RuntimeError:  # the host refused to lock more memory: an ordinary copy (slower both ways; it waits)
        return streams.to("cpu")
    host.copy_(streams, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(streams.device))
    done.synchronize()  # the bytes are on the host: the tensor may be read, saved or copied back
    return host


def to_device(streams: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`streams` on `device`: a copy queued on the current stream when they wait on the host, else themselves."""
    device = torch.device(device)
    if streams.device.type == device.type and device.index in (None, streams.device.index):
        return streams
    return streams.to(device, non_blocking=streams.is_pinned())


def host_block_bytes(nbytes: int) -> int:
    """The page-locked bytes torch's host allocator takes for `nbytes`: the next power of two."""
    return 1 << max(0, (int(nbytes) - 1).bit_length())
