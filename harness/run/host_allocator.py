"""Keep freed host memory in the process instead of handing it back to the kernel after every tensor (glibc).

glibc's malloc serves a block above its mmap threshold with a fresh `mmap` and returns it with `munmap` when it
is freed; the threshold starts at 128 KiB and rises only as far as the largest block freed so far, and the top of
the heap is trimmed back to the kernel past 128 KiB free. A CPU run makes and frees tensors of 0.1–30 MB at
every op, so each one's pages are faulted in anew: the demo took 3.2 million minor page faults and 13.8 s of system
time in 98.7 s (2-core machine). Raising the mmap threshold to glibc's ceiling for it (32 MiB on 64-bit: larger
values are refused) and the trim threshold to 256 MiB lets freed blocks be reused: on flash-mini's layer 2 at
9,216 + 32 tokens (base and all, one thread) minor faults fell from 551,000 to 195,000 and system time from 1.11
to 0.50 s, the peak resident memory 943 → 894 MB. Values do not change: only where the bytes come from.

Setting either threshold explicitly also turns off glibc's own adjustment of both (mallopt(3)), so both are set
(only the trim threshold made it worse: 13 million faults). Elsewhere than glibc (macOS, musl) nothing is done, nor
with DSV4_DRIFT_GLIBC_MALLOC_DEFAULTS=1 (KEEP_GLIBC_DEFAULTS).
"""

from __future__ import annotations

import ctypes
import functools
import os

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""mallopt(3) parameter numbers (glibc's malloc.h)."""

MMAP_THRESHOLD_BYTES = 32 * 2**20
"""glibc's largest accepted mmap threshold on 64-bit (HEAP_MAX_SIZE / 2): blocks above it still come from mmap."""
TRIM_THRESHOLD_BYTES = 256 * 2**20
"""Free memory at the top of the heap kept before trimming: above the largest block served from the heap, so a
freed working tensor is reused by the next op rather than returned and faulted in again. 1 GiB measured no better."""


KEEP_GLIBC_DEFAULTS = "DSV4_DRIFT_GLIBC_MALLOC_DEFAULTS"
"""Set this environment variable to 1 to leave glibc's thresholds as they are: the setting is process-wide, so it also
holds in a pytest session that runs dsv4-drift in-process (harness/cli/pytest_plugin.py), and the freed memory it keeps
(up to the trim threshold at the top of each malloc arena) is not in the run's memory prediction."""


@functools.lru_cache(maxsize=None)
def keep_freed_host_memory() -> bool:
    """Set glibc's mmap and trim thresholds for this process (once); whether they were set."""
    if os.environ.get(KEEP_GLIBC_DEFAULTS) == "1":
        return False
    try:
        libc = ctypes.CDLL(None)  # the symbols the process has loaded: the malloc actually in use
    except OSError:
        return False
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):  # glibc only: musl's mallopt is
        return False  # a stub, macOS has none
    libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) \
        and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
