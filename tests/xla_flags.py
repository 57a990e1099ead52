"""The XLA flags the test suite compiles with, in this process and in the subprocesses it starts.

Most of the suite's time is XLA:CPU compiling tiny models' step programs, not running them. At LLVM -O0 without
its expensive passes the backend compiles about a quarter faster (tests/engine/test_last_rows.py and
tests/model/test_real_gemma3.py: 152 s against 197 s, 2026-12-06, 2-core EPYC). The HLO passes, and so the
programs' structure (fusions, YNNPACK dots, donation), are the same at every level: what changes is the machine
code of the fused loops. Tests compare a program against another compiled the same way, against numpy / HF
references with tolerances, or against hand-computed values, so they hold at any level; the speed figures are
taken in bench/, at XLA's default level, never here.

GEMMAJAX_TEST_XLA_OPT=default runs the suite at XLA's default level instead (nothing is added to XLA_FLAGS)."""
from __future__ import annotations

import os

FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")


def suite_xla_flags(flags: str = "") -> str:
    """`flags` with the suite's compile flags appended (those not already named in it), unless
    GEMMAJAX_TEST_XLA_OPT=default."""
    if os.environ.get("GEMMAJAX_TEST_XLA_OPT", "").lower() == "default":
        return flags
    named = {f.split("=", 1)[0] for f in flags.split()}
    extra = [f for f in FAST_COMPILE if f.split("=", 1)[0] not in named]
    return " ".join([flags.strip(), *extra]).strip()
