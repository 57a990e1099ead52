"""The XLA flags the test suite compiles with, in this process and in the subprocesses it starts.

Most of the suite's time is XLA:CPU compiling tiny models' step programs, not running them (one spec-decode test:
57 compiles, 90 of its 110 s). At LLVM -O0 without LLVM's expensive passes, two compile-bound files
(tests/engine/test_last_rows.py and tests/model/test_real_gemma3.py) took 152 s against 197 s, and the whole suite
1321 s against 1455-1465 (2026-12-06, 2-core EPYC, two workers). Programs that run long are slower at -O0 (a warm
real-vocabulary `generate` 0.64-0.69 s against 0.39): the server tests take longer.

What changes is LLVM's code for XLA's fused loops (no vectorization, no FMA contraction), not the HLO passes: the
fusions, the YNNPACK dots and the buffer donation are those XLA builds at any level. Tests that compare two programs
bit for bit (speculation against plain decoding, TP=1 against TP=N) compare two -O0 builds; rounding at XLA's
default level can differ from -O0's, so `make test` does not exercise the machine code users run. To run the suite
at XLA's default level: GEMMAJAX_TEST_XLA_OPT=default make test. Speed figures are taken in bench/, at the default
level, never here."""
from __future__ import annotations

import os

FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")


def default_level_requested() -> bool:
    """GEMMAJAX_TEST_XLA_OPT=default: the suite adds nothing to XLA_FLAGS."""
    return os.environ.get("GEMMAJAX_TEST_XLA_OPT", "").lower() == "default"


def flag_names(flags: str) -> set[str]:
    """The flags named in an XLA_FLAGS string, without their values."""
    return {f.split("=", 1)[0] for f in flags.split()}


def suite_xla_flags(flags: str = "") -> str:
    """`flags` with the suite's compile flags appended (those not already named in it), unless
    GEMMAJAX_TEST_XLA_OPT=default."""
    if default_level_requested():
        return flags
    named = flag_names(flags)
    extra = [f for f in FAST_COMPILE if f.split("=", 1)[0] not in named]
    return " ".join([flags.strip(), *extra]).strip()


def subprocess_xla_flags(devices: int) -> str:
    """XLA_FLAGS for a subprocess with `devices` CPU devices: this process's flags (the caller's own and the suite's)
    with the device count set."""
    own = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
    return suite_xla_flags(" ".join([*own, f"--xla_force_host_platform_device_count={devices}"]))
