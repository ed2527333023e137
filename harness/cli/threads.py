"""`--threads N`: how many CPU threads torch uses, and a note when other processes compete for the same cores.

torch defaults to one thread per core of the machine. On a machine shared with other jobs those threads wait
for each other at every parallel region (tiny-smoke on two cores with a load average near 6: 111-147 s with 2
threads, 11 s with 1), so the default here is the cores this process may run on (`os.sched_getaffinity`; fewer
when OMP_NUM_THREADS says so), and a run that starts on a loaded machine says so once, with the thread count
likely to be faster.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from harness.errors import UsageError


def available_cores() -> int:
    """The CPU cores this process may run on (its affinity mask: what a container or `taskset` allows)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_threads() -> int:
    """The cores this process may run on, or fewer when OMP_NUM_THREADS asks for fewer: a limit someone set on
    purpose (a CI job, a test session) is kept, never raised."""
    cores = available_cores()
    try:
        return max(1, min(cores, int(os.environ["OMP_NUM_THREADS"])))
    except (KeyError, ValueError):
        return cores


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, metavar="N",
                        help=f"CPU threads for torch (default: the cores this process may use, or OMP_NUM_THREADS "
                             f"when lower; here {default_threads()}); fewer than the cores when other jobs share the "
                             "machine (README: Threads)")


def oversubscription(threads: int, cores: int, load_average: float) -> str | None:
    """A one-line note when `threads` will compete for `cores`: more threads than cores, or other processes
    already keeping the cores busy (the 1-minute load average, which does not yet count this process)."""
    if threads > cores:
        return (f"--threads {threads} is more than the {cores} core(s) this process may use: the threads will "
                "wait for each other")
    if load_average + threads > cores + 0.5:
        free = max(1, int(cores - load_average + 0.5))
        advice = f"--threads {free} is likely faster" if free < threads else "expect it to run slower"
        return (f"the machine is oversubscribed: load average {load_average:.1f} from other processes on {cores} "
                f"core(s), and this run adds {threads} thread(s); {advice} (README: Threads)")
    return None


@contextmanager
def torch_threads(requested: int | None) -> Iterator[str | None]:
    """Run a command with `requested` torch threads (default: default_threads()), restoring the previous count
    afterwards (commands also run in-process: tests, the pytest plugin). Yields the oversubscription note."""
    cores = available_cores()
    threads = default_threads() if requested is None else requested
    if threads < 1:
        raise UsageError(f"--threads {threads}: must be at least 1")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield oversubscription(threads, cores, os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0)
    finally:
        torch.set_num_threads(before)
