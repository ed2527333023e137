"""`--threads N`: how many CPU threads torch uses, and a note when other processes compete for the same cores.

torch defaults to one thread per core of the machine. On a machine shared with other jobs those threads wait
for each other at every parallel region (tiny-smoke on two cores with a load average near 6: 111-147 s with 2
threads, 11 s with 1), so the default here is the cores this process may run on (`os.sched_getaffinity`; fewer
when OMP_NUM_THREADS says so), and a run that starts on a loaded machine says so once, with the thread count
likely to be faster.

A narrow model is the exception: at hidden size 64 (flash-mini, the CPU demo) every op is too small for torch's
intra-op threads to pay for their hand-offs, and a second thread only adds waiting (the demo on two idle cores:
180 s with 2 threads, 140 s with 1; 31 s of the 2-thread run is system time). Without `--threads`, a CPU run of
such a model takes one thread (`narrow_model_threads`).
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


NARROW_HIDDEN = 512
"""Below this hidden size a CPU run defaults to one thread. Measured at 64 (flash-mini: 1 thread 22% faster on two
idle cores); Flash (4096) keeps every core. Between the two nothing was measured: 512 keeps the rule to models
whose largest GEMM rows (hidden × a few hundred) stay far below the ~10⁶ elements where threads start to pay."""


def narrow_model_threads(requested: int | None, hidden_size: int, device: str) -> str | None:
    """Without an explicit --threads, a CPU run of a model narrower than NARROW_HIDDEN uses one thread (see the
    module docstring). Returns a note saying so, or None when the count is left alone."""
    if requested is not None or device != "cpu" or hidden_size >= NARROW_HIDDEN or torch.get_num_threads() == 1:
        return None
    torch.set_num_threads(1)
    return (f"1 thread: at hidden size {hidden_size} ops are too small for several threads to pay "
            "(give --threads N to override; README: Threads)")


SHARD_MIN_TOKEN_LAYERS = 100_000
"""A narrow CPU run shards its stacks over processes only from this many tokens × layers. A rank costs ~2 s to
start (measured on the 2-core machine: its imports 1.2–1.6 s, the spec rebuilt from the manifest 0.05 s, then the
process spawn and the group's handshake) and each layer a broadcast of the reference's taps; the demo (43 layers ×
8,034 tokens ≈ 345K) runs ~205 s of layers in one process, ~0.6 ms per token-layer, so at 100K (~60 s) the start is
~3% of the run and the second core pays. tiny-smoke (5 × ~600) is 3K: 10.5 s either way."""


def narrow_model_processes(requested_devices: int | None, requested_threads: int | None, hidden_size: int,
                           device: str, token_layers: int, n_stacks: int) -> tuple[int, str | None]:
    """How many processes a run without --devices shards its stacks over, and a note when it is more than one.

    A narrow model runs one thread per process (narrow_model_threads): its ops are too small for intra-op threads,
    so in one process every core but one idles. Processes do not wait for each other inside an op, so a long CPU run
    of a narrow model deals its (stack, mode) pairs over min(cores, pairs) processes of one thread each (the demo on
    two cores: 125 s wall against 218 s in one process). The numbers are a one-process run's (harness.run.distributed).
    Anything asked for explicitly (--devices, --threads), a GPU, a wide model or a short run keeps what it had."""
    if (requested_devices is not None or requested_threads is not None or device != "cpu"
            or hidden_size >= NARROW_HIDDEN or token_layers < SHARD_MIN_TOKEN_LAYERS):
        return requested_devices or 1, None
    world = min(default_threads(), n_stacks)
    if world < 2:
        return 1, None
    return world, (f"{world} processes of 1 thread: at hidden size {hidden_size} one process keeps one core busy, so "
                   f"the stacks are dealt over {world} cores (give --devices 1 to keep one process; README: Threads)")


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=int, metavar="N",
                        help=f"CPU threads for torch (default: the cores this process may use, or OMP_NUM_THREADS "
                             f"when lower; here {default_threads()}); fewer than the cores when other jobs share the "
                             "machine (README: Threads)")


def oversubscription(threads: int, cores: int, load_average: float, processes: int = 1) -> str | None:
    """A one-line note when `threads` (in each of `processes`) will compete for `cores`: more threads than cores, or
    other processes already keeping the cores busy (the 1-minute load average, which does not yet count this run)."""
    total = threads * processes
    if total > cores:
        asked = f"--threads {threads}" if processes == 1 else f"{processes} processes × {threads} thread(s)"
        return f"{asked} is more than the {cores} core(s) this process may use: they will wait for each other"
    # half a core of slack: a load average is a decaying mean that an idle machine's daemons (and a job that just
    # ended) keep at a few tenths; the free cores round to the nearest whole one. Processes of one thread get a whole
    # core of slack: they time-slice a core another job uses (losing its share, no more), where threads of one
    # parallel region wait at every barrier for the one that lost its core.
    slack = 1.0 if processes > 1 and threads == 1 else 0.5
    if load_average + total > cores + slack:
        free = max(1, int(cores - load_average + 0.5))
        # ranks meet at every layer, so a rank that shares its core sets the pace; still, with one outside job on
        # two cores, two ranks get 2/3 of a core each for half the work where one process gets one core for all of it
        if free >= total or (processes > 1 and threads == 1):
            advice = "expect it to run slower"
        else:
            advice = f"--threads {max(1, free // processes)} is likely faster"
        return (f"the machine is oversubscribed: load average {load_average:.1f} from other processes on {cores} "
                f"core(s), and this run adds {total} thread(s); {advice} (README: Threads)")
    return None


def host_processes(device: str, ranks: int) -> int:
    """How many of a run's ranks compete for the host's cores: all of them on the CPU; on GPUs their host threads
    mostly wait for the device (their ops are GPU kernels), so the note counts one process's threads."""
    if device != "cpu":
        return 1
    return int(os.environ.get("LOCAL_WORLD_SIZE", ranks))  # under torchrun, the ranks on this host


def oversubscription_note(threads: int, processes: int = 1) -> str | None:
    """oversubscription() for this run: this process's cores and the machine's 1-minute load average."""
    return oversubscription(threads, available_cores(), os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0,
                            processes)


@contextmanager
def torch_threads(requested: int | None) -> Iterator[str | None]:
    """Run a command with `requested` torch threads (default: default_threads()), restoring the previous count
    afterwards (commands also run in-process: tests, the pytest plugin). Yields the oversubscription note."""
    threads = default_threads() if requested is None else requested
    if threads < 1:
        raise UsageError(f"--threads {threads}: must be at least 1")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield oversubscription_note(threads)
    finally:
        torch.set_num_threads(before)
