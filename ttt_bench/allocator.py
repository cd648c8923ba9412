"""The CPU memory allocator, tuned for training loops (glibc's malloc, Linux).

By default glibc gives large freed blocks back to the operating system (munmap, heap trimming), so the
next step's tensors of the same sizes fault their pages in again: on a 2-core machine those page faults
took about a quarter of a training benchmark's CPU time (docs/speed.md). `retain_freed_memory()` makes
malloc keep what it frees for reuse (as jemalloc and tcmalloc do, which PyTorch's CPU performance guide
recommends): no heap trimming, large blocks from the heap instead of fresh mappings. The resident memory
then stays at its peak until the process ends. Every `ttt-bench` command applies it on start;
TTT_BENCH_RETAIN_MEMORY=0 turns it off. `release_free_memory()` hands the kept memory back at once (the
benchmarks do before measuring a peak).
"""

import ctypes
import ctypes.util
import os

# mallopt(3) parameters
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_MAX = -1, -2, -4
INT_MAX = 2**31 - 1


def _libc():
    """glibc, or None (macOS, musl, Windows)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


def retain_freed_memory() -> bool:
    """Tune glibc's malloc to keep freed memory; False where it is off or there is no glibc."""
    libc = _libc()
    if os.environ.get("TTT_BENCH_RETAIN_MEMORY", "1") == "0" or libc is None:
        return False
    return all(
        libc.mallopt(param, value) == 1
        for param, value in ((M_TRIM_THRESHOLD, INT_MAX), (M_TOP_PAD, 64 << 20), (M_MMAP_MAX, 0))
    )


def release_free_memory() -> None:
    """Return what malloc keeps to the OS now (malloc_trim), so that a measurement's growth is its own."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
