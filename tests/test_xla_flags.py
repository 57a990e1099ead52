"""tests/xla_flags.py: the suite's compile flags are added once, never over a setting the caller named, not at all
when asked for XLA's default level, and subprocesses get the caller's flags with their device count; the compile
options JAX builds in this process carry them (conftest set them before anything compiled)."""
import os

from tests.xla_flags import FAST_COMPILE, default_level_requested, flag_names, subprocess_xla_flags, suite_xla_flags


def test_flags_are_appended_once_and_respect_the_callers(monkeypatch):
    monkeypatch.delenv("GEMMAJAX_TEST_XLA_OPT", raising=False)
    assert suite_xla_flags("") == " ".join(FAST_COMPILE)
    two = suite_xla_flags("--xla_force_host_platform_device_count=2")
    assert two == "--xla_force_host_platform_device_count=2 " + " ".join(FAST_COMPILE)
    assert suite_xla_flags(two) == two                                   # idempotent
    mine = suite_xla_flags("--xla_backend_optimization_level=2")
    assert mine.split().count("--xla_backend_optimization_level=2") == 1 and "=0" not in mine
    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=2 --xla_force_host_platform_device_count=8")
    sub = subprocess_xla_flags(4).split()
    assert "--xla_backend_optimization_level=2" in sub and "--xla_backend_optimization_level=0" not in sub
    assert [f for f in sub if "device_count" in f] == ["--xla_force_host_platform_device_count=4"]
    assert "--xla_llvm_disable_expensive_passes=true" in sub
    monkeypatch.setenv("GEMMAJAX_TEST_XLA_OPT", "default")
    assert suite_xla_flags("--a=1") == "--a=1"
    assert subprocess_xla_flags(2) == ("--xla_backend_optimization_level=2 "
                                       "--xla_force_host_platform_device_count=2")


def test_this_process_compiles_with_them():
    """What XLA will compile with here, read from the compile options JAX builds (not from the environment)."""
    from jax._src import compiler
    if default_level_requested() or "--xla_backend_optimization_level" in flag_names(os.environ["XLA_FLAGS"]):
        return   # the suite added no level (a caller's own level is kept over the suite's)
    debug = compiler.get_compile_options(1, 1).executable_build_options.debug_options
    assert debug.xla_backend_optimization_level == 0 and debug.xla_llvm_disable_expensive_passes
