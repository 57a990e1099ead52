"""The host CPU's instruction-set flags, for choosing XLA:CPU forms (read once from /proc/cpuinfo: x86 "flags",
aarch64 "Features"; elsewhere, or unreadable, no flags). Imports no JAX: gemmajax/__init__ reads it before a backend
exists."""
from __future__ import annotations

import functools
import os

BF16_DOT_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})  # x86 AVX-512 bf16 / AMX; aarch64 BF16 (BFDOT)


@functools.cache
def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first processor's flags as /proc/cpuinfo lists them (all processors of one machine share them)."""
    try:
        with open(path, errors="replace") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def native_bf16_dot() -> bool:
    """Whether the CPU multiplies bf16 in hardware (BF16_DOT_FLAGS). Without it XLA:CPU's bf16 GEMM is slow (timed,
    not profiled): on a 2-core AMD EPYC Zen 3 (AVX2, 2026-12-06) the w8a8 "wide" GEMM over bf16 levels took 2.8-2.9
    ms at 16 rows for 640 x 2048 / 2048 x 640 where float32 levels took 0.8-0.9 (int8_matmul.py). Measured there
    and on AVX-512 bf16 CPUs only: AMX and aarch64 bf16 are taken as bf16 hardware, and an AVX-512 CPU without bf16
    (e.g. Cascade Lake) as none, unmeasured. GEMMAJAX_CPU_BF16_DOT=1 or 0 overrides the flags (tests, or a CPU
    whose flags are wrong); it is read when a matmul is traced, so set it before the first."""
    env = os.environ.get("GEMMAJAX_CPU_BF16_DOT", "")
    if env in ("0", "1"):
        return env == "1"
    if env:
        raise ValueError(f"GEMMAJAX_CPU_BF16_DOT must be 0 or 1 (or unset: read the CPU's flags), got {env!r}")
    return bool(BF16_DOT_FLAGS & cpu_flags())
