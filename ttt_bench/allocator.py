"""The CPU memory allocator, tuned for training loops (glibc's malloc, Linux).

By default glibc gives large freed blocks back to the operating system (munmap, heap trimming), so the
next step's tensors of the same sizes fault their pages in again: on a 2-core machine those page faults
took about a quarter of a training benchmark's CPU time (docs/speed.md). `retain_freed_memory()` makes
malloc keep what it frees for reuse (as jemalloc and tcmalloc do, which PyTorch's CPU performance guide
recommends): no heap trimming, large blocks from the heap instead of fresh mappings. The resident memory
then stays at its peak until the process ends. Every `ttt-bench` command applies it on start;
TTT_BENCH_RETAIN_MEMORY=0 turns it off.
"""

import ctypes
import ctypes.util
import os

# mallopt(3) parameters
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4
INT_MAX = 2**31 - 1


def retain_freed_memory() -> bool:
    """Tune glibc's malloc to keep freed memory; False where it is off or there is no glibc."""
    if os.environ.get("TTT_BENCH_RETAIN_MEMORY", "1") == "0":
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc (macOS, musl, Windows)
        return False
    return all(
        mallopt(param, value) == 1
        for param, value in ((M_TRIM_THRESHOLD, INT_MAX), (M_TOP_PAD, 64 << 20), (M_MMAP_MAX, 0))
    )
