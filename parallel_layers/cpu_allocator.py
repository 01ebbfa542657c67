"""Keep freed host memory in the process, so the next microbatch reuses it instead of faulting it back in.

Training on CPU allocates and frees the same activation-sized blocks every microbatch. glibc's malloc
hands large blocks back to the kernel (``munmap``, or trimming the top of the heap once more than a few
MB is free there), and the next allocation of that size faults every page back in, zero-filled by the
kernel. Measured on the 2-core benchmark machine (``getrusage`` around each step, steps after the
first; ``tests/test_cpu_allocator.py`` checks the page-fault effect in fresh processes):

* a pipeline rank of the pipeline benchmark's GPT (d 256, seq 128, 4 layers, 1F1B, 8 microbatches):
  3,700-7,800 minor page faults and 8-28 ms of system time per step with glibc's defaults; 0-256
  faults and 4-16 ms after :func:`retain_freed_memory`;
* the data-parallel benchmark's 51M-parameter GPT at 2 ranks: forward + backward alone 606 -> 575 ms,
  a synced step 738 -> 706-715 ms (medians of 8 reps).

The faults land inside forward and backward at random points, so on a pipeline they are also jitter
that a neighbour stage waits for.

This is what PyTorch's CPU performance guide gets from swapping in jemalloc or tcmalloc; here it is
done with glibc's own settings (``mallopt``), so nothing extra is installed:

* blocks up to 32 MiB (glibc's largest allowed threshold) come from the heap instead of ``mmap``;
* up to ``trim_threshold_mb`` of free memory at the top of the heap is kept instead of trimmed;
* the heap grows by ``top_pad_mb`` extra at a time (fewer ``brk`` calls).

The process's resident memory then stays near its peak instead of following live memory, which is
what a training process wants and what a memory benchmark does not (those set
``MALLOC_MMAP_THRESHOLD_=65536`` for the opposite reason). It is a setting of the whole process, so
it is never applied behind the caller's back: the demo's CPU ranks call it at start-up, and the timing
benchmarks start their ranks with :data:`RETAIN_ENV` in the environment (glibc reads it at start-up); a
user's own CPU script calls it once, or does the same for the processes it launches. A no-op returning
False where the C library is not glibc (macOS, musl).
"""
from __future__ import annotations

import ctypes
import ctypes.util
from typing import Dict

# mallopt parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
# glibc refuses an mmap threshold above HEAP_MAX_SIZE / 2: 32 MiB on 64-bit
MAX_MMAP_THRESHOLD = 32 << 20

# The same settings as environment variables, for processes not yet started.
RETAIN_ENV: Dict[str, str] = {
    "MALLOC_MMAP_THRESHOLD_": str(MAX_MMAP_THRESHOLD),
    "MALLOC_TRIM_THRESHOLD_": str(1 << 30),
    "MALLOC_TOP_PAD_": str(64 << 20),
}


def _glibc():
    """The process's C library if it is glibc (it has ``mallopt`` and ``gnu_get_libc_version``)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not (hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version")):
        return None
    return libc


def retain_freed_memory(trim_threshold_mb: int = 1024, top_pad_mb: int = 64) -> bool:
    """Make this process's malloc keep freed memory for reuse (see the module docstring). Returns True
    if every setting took, False where the C library is not glibc. Affects the whole process, from
    now on; call it once at start-up, before the model is built."""
    if trim_threshold_mb < 0 or top_pad_mb < 0:
        raise ValueError(f"retain_freed_memory: trim_threshold_mb={trim_threshold_mb} and top_pad_mb={top_pad_mb} "
                         f"must be >= 0")
    libc = _glibc()
    if libc is None:
        return False
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    settings = ((_M_MMAP_THRESHOLD, MAX_MMAP_THRESHOLD),
                (_M_TRIM_THRESHOLD, min(trim_threshold_mb << 20, 2**31 - 1)),
                (_M_TOP_PAD, min(top_pad_mb << 20, 2**31 - 1)))
    applied = [libc.mallopt(param, value) for param, value in settings]   # every one, even after a refusal
    return all(ok == 1 for ok in applied)


__all__ = ["retain_freed_memory", "RETAIN_ENV", "MAX_MMAP_THRESHOLD"]
