"""How long a GPU actually computed while a region ran: its busy seconds, the floor under its wall time that removing
the launches' host cost cannot go below (fewer or faster kernels can).

A Flash layer of the lockstep is host-bound on an H200 (README, Benchmarks): its wall time is the host's, launching
small kernels, and the GPU idles between them. Whether a run can still get faster by removing host work, or only
with faster or fewer kernels, is the ratio of the two. `device_busy` records the device's own activity (kernels,
copies, fills) through the profiler's CUPTI tracing (torch.profiler, CUDA activity only: host-side runtime calls are
tagged CPU and left out, as are user annotations, whose spans cover the gaps between kernels) and measures the union
of their intervals — busy time, counted once where kernels of two streams overlap. CUPTI's instrumentation lengthens
each kernel a little, so the figure errs high, never low.

Tracing costs host time per launch and may slow what a process runs after it (CUPTI stays set up; pytorch/pytorch
#144455), so the benchmark times every layer first and traces them afterwards (harness.run.benchmark).
"""

from __future__ import annotations

import contextlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch


def busy_seconds(intervals: Iterable[tuple[int, int]]) -> float:
    """Seconds covered by the union of [start, end) intervals given in nanoseconds (unsorted, overlapping, empty
    ones allowed): each instant on which the device ran something counts once."""
    covered, reach = 0, None
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if reach is None or start >= reach:
            covered += end - start
            reach = end
        elif end > reach:
            covered += end - reach
            reach = end
    return covered / 1e9


@dataclass
class DeviceBusy:
    """The outcome of a `device_busy` region: `seconds` the device was busy (None where nothing was traced: a CPU),
    `events` the device activities counted (kernels, memory copies and fills), and `by_name` each activity name's
    summed seconds (not a union: kernels of two streams that overlap both count) — which kernels make the floor."""

    seconds: float | None = None
    events: int = 0
    by_name: dict[str, float] = field(default_factory=dict)

    def top(self, n: int) -> list[tuple[str, float]]:
        """The n names with the most seconds, most first."""
        return sorted(self.by_name.items(), key=lambda item: -item[1])[:n]


@contextlib.contextmanager
def device_busy(device: torch.device) -> Iterator[DeviceBusy]:
    """Measure the device's busy seconds over the `with` block (filled in when it ends, after a synchronisation, so
    every kernel the block queued is counted). On a CPU nothing is traced and `seconds` stays None: there the host
    is the device, and wall seconds are its busy time. None too when the trace holds no device activity at all
    (CUPTI unavailable): an unmeasured region is not an idle one."""
    out = DeviceBusy()
    if device.type != "cuda":
        yield out
        return
    from torch.profiler import ProfilerActivity, profile  # imported here: only a GPU bench traces

    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        yield out
        torch.cuda.synchronize(device)
    events = [e for e in prof.profiler.kineto_results.events()
              if e.device_type() == torch.autograd.DeviceType.CUDA and e.device_index() == index
              and not e.is_user_annotation()]
    if not events:
        return
    names: Counter[str] = Counter()
    for e in events:
        names[e.name()] += e.duration_ns() / 1e9
    out.seconds, out.events = busy_seconds((e.start_ns(), e.end_ns()) for e in events), len(events)
    out.by_name = dict(names)
