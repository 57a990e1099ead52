"""glibc malloc settings for the CPU backend: keep freed memory instead of giving it back to the kernel every step.

XLA:CPU allocates each step's temporaries (an int4 tile's dequantized weights, attention scratch, ...) with malloc
and frees them after the step. glibc serves blocks above its mmap threshold (128 KiB, raised as freed blocks show
larger sizes) with fresh mmap'ed pages and gives them back on free, and trims the heap's top when more than its trim
threshold is free, so the next step page-faults the same memory in again. Measured on a 2-core AMD EPYC
(bench/compare_cpu.py's paired child, Gemma 3 270M, 16 streams, 64 new tokens, 6 interleaved rounds, 2026-12-05):
w4a16 at 16 streams swung between 214 and 276 tok/s (bf16 241-257) with the defaults, and held 255-272 (bf16
240-256) with an mmap threshold of 32 MiB and trimming off. Blocks of 32 MiB and more (the weights) are still
mmap'ed and given back when freed.

keep_freed_memory() applies that, once, when an engine is built on the CPU backend. It changes the whole process's
malloc; GEMMAJAX_CPU_MALLOC=default leaves glibc's defaults. No-op off glibc.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # glibc's largest (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit)
TRIM_THRESHOLD = 2**31 - 1  # never trim the heap's top

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Set glibc's mmap threshold to 32 MiB and turn heap trimming off, once per process. Returns whether the
    settings are in force (False: GEMMAJAX_CPU_MALLOC=default, not glibc, or mallopt refused)."""
    global _applied
    if _applied is not None:
        return _applied
    setting = os.environ.get("GEMMAJAX_CPU_MALLOC", "keep")
    if setting not in ("keep", "default"):
        raise ValueError(f"GEMMAJAX_CPU_MALLOC must be 'keep' or 'default', got {setting!r}")
    _applied = False
    if setting == "keep":
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            libc.gnu_get_libc_version  # noqa: B018 -- glibc only: AttributeError elsewhere (musl, macOS)
        except (OSError, AttributeError):
            return _applied
        _applied = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
            libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _applied
