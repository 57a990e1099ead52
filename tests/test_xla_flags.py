"""tests/xla_flags.py: the suite's compile flags are added once, never over a setting the caller named, and not at
all when asked for XLA's default level; this process (conftest) compiles with them."""
import os

from tests.xla_flags import FAST_COMPILE, suite_xla_flags


def test_flags_are_appended_once_and_respect_the_callers(monkeypatch):
    monkeypatch.delenv("GEMMAJAX_TEST_XLA_OPT", raising=False)
    assert suite_xla_flags("") == " ".join(FAST_COMPILE)
    two = suite_xla_flags("--xla_force_host_platform_device_count=2")
    assert two == "--xla_force_host_platform_device_count=2 " + " ".join(FAST_COMPILE)
    assert suite_xla_flags(two) == two                                   # idempotent
    mine = suite_xla_flags("--xla_backend_optimization_level=2")
    assert mine.split().count("--xla_backend_optimization_level=2") == 1 and "=0" not in mine
    monkeypatch.setenv("GEMMAJAX_TEST_XLA_OPT", "default")
    assert suite_xla_flags("--a=1") == "--a=1"


def test_this_process_compiles_with_them():
    named = {f.split("=", 1)[0] for f in os.environ["XLA_FLAGS"].split()}
    if os.environ.get("GEMMAJAX_TEST_XLA_OPT", "").lower() != "default":
        assert all(f.split("=", 1)[0] in named for f in FAST_COMPILE), named
