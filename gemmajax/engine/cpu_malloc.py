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

huge_pages(tree) backs the buffers of an engine's weights and KV cache with transparent huge pages (2 MiB on
x86-64): madvise(MADV_HUGEPAGE), then MADV_COLLAPSE (Linux 6.1+) to move the pages already written into huge ones
at once. In the "madvise" THP mode (what Debian and Ubuntu ship, and these machines run) nothing else gets huge
pages, so a decode step that streams 270 MB of weights walked the page tables for 66,000 4 KiB pages. Measured on a
2-core AMD EPYC Zen 4 (Gemma 3 270M, 24-token prompts, 64 new tokens, fresh processes alternating off / on, best of
3 generates per process, load 0.7-1.7 from the runs themselves, 2026-12-07), tok/s with 4 KiB pages against huge
pages:
  w8a8+emb8, 1 stream: 103.9 / 111.1 / 95.6 / 100.3 / 100.7 / 100.6 against 117.2 / 112.7 / 97.1 / 104.9 / 106.7 /
  102.5 (every pair faster, 1.01-1.13x);
  w4a16+emb4, 1 stream: 77.5 / 78.0 / 67.6 against 79.7 / 77.9 / 77.4;
  w8a8+emb8, 16 streams: 300.7 / 310.5 / 314.1 against 310.0 / 314.0 / 297.9 (no change; presumably because the GEMMs
  there are bound by YNNPACK's kernels and packing, not by memory: not profiled).
Only whole aligned huge pages inside a live buffer are advised, so the buffers' contents and size do not change. The
advice stays on those addresses after a buffer is freed (a later allocation there may get huge pages too). Where
the kernel refuses the collapse (before 6.1, THP disabled for the process, no free huge page) the advice stays and
the kernel's khugepaged may collapse the pages later; this is logged, never an error. GEMMAJAX_CPU_HUGE_PAGES=off
leaves the pages as they are. Nothing happens where the kernel has no transparent huge pages.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os

logger = logging.getLogger(__name__)

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


MADV_HUGEPAGE, MADV_COLLAPSE = 14, 25  # linux/mman.h
_THP = "/sys/kernel/mm/transparent_hugepage"


def _thp_mode() -> str | None:
    """The kernel's transparent huge page mode ("always", "madvise" or "never"), or None where it has none."""
    try:
        with open(f"{_THP}/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def _huge_page_size() -> int:
    """The transparent huge page size in bytes (2 MiB on x86-64), or 0 where the kernel has none (or they are off)."""
    if _thp_mode() in (None, "never"):
        return 0
    try:
        with open(f"{_THP}/hpage_pmd_size") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0


def _madvise():
    """libc's madvise(addr, length, advice) -> 0, or -1 with errno set; None without a libc that has it."""
    try:
        f = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    f.argtypes, f.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return f


def huge_runs(tree, size: int) -> list[tuple[int, int]]:
    """[start, end) addresses of the whole aligned `size`-byte runs inside the CPU buffers of the jax.Arrays in
    `tree` (each addressable shard's buffer as XLA holds it: on_device_size_in_bytes); other leaves are skipped."""
    import jax
    runs = []
    for leaf in jax.tree.leaves(tree):
        if not isinstance(leaf, jax.Array) or leaf.is_deleted():
            continue
        for shard in leaf.addressable_shards:
            if shard.device.platform != "cpu":
                continue
            p, n = shard.data.unsafe_buffer_pointer(), shard.data.on_device_size_in_bytes()
            start, end = -(-p // size) * size, (p + n) // size * size
            if end > start:
                runs.append((start, end))
    return runs


def huge_pages(tree) -> int:
    """Advise huge pages for the CPU buffers of every jax.Array in `tree` and collapse the pages already in them
    (module docstring). Returns the bytes the kernel collapsed into huge pages (0: off, not Linux, no THP, or no
    whole aligned huge page in any buffer). A run the kernel refuses is not counted; the first refusal's errno is
    logged."""
    setting = os.environ.get("GEMMAJAX_CPU_HUGE_PAGES", "on")
    if setting not in ("on", "off"):
        raise ValueError(f"GEMMAJAX_CPU_HUGE_PAGES must be 'on' or 'off', got {setting!r}")
    size = _huge_page_size() if setting == "on" else 0
    madvise = _madvise() if size else None
    if madvise is None:
        return 0
    collapsed, refused, first = 0, 0, None
    for start, end in huge_runs(tree, size):
        if madvise(start, end - start, MADV_HUGEPAGE) == 0 and madvise(start, end - start, MADV_COLLAPSE) == 0:
            collapsed += end - start
            continue
        refused += end - start
        first = first or errno.errorcode.get(ctypes.get_errno(), str(ctypes.get_errno()))
    if refused:
        logger.info("huge pages: %d MiB collapsed, %d MiB refused (%s; advised, the kernel may collapse them later)",
                    collapsed >> 20, refused >> 20, first)
    else:
        logger.info("huge pages: %d MiB of weights and KV cache collapsed", collapsed >> 20)
    return collapsed
