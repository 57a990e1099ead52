"""gemmajax.engine.cpu_malloc: glibc keeps freed memory once an engine runs on the CPU (fewer page faults a step)."""
import os
import subprocess
import sys

import pytest

from gemmajax.engine import cpu_malloc

# Allocates, touches and frees 12 blocks of growing size (8-30 MiB) through libc, as XLA:CPU's step temporaries
# come and go, and prints the minor page faults that took. glibc's defaults serve each larger block with fresh
# mmap'ed pages and give them back on free (every block faulted in anew); kept memory faults in only the growth.
_FAULTS = """
import ctypes, resource, sys
from gemmajax.engine import cpu_malloc
print(cpu_malloc.keep_freed_memory())
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
total = 0
for i in range(12):
    n = (8 + 2 * i) << 20
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)
    libc.free(p)
    total += n
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) * 4096 / total)
"""


def _faults(setting: str) -> tuple[str, float]:
    env = {**os.environ, "GEMMAJAX_CPU_MALLOC": setting}
    p = subprocess.run([sys.executable, "-c", _FAULTS], check=False, capture_output=True, text=True, env=env,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    applied, frac = p.stdout.split()
    return applied, float(frac)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_kept_memory_is_not_faulted_in_again():
    """Pages faulted in per byte allocated: with the defaults about every byte (each block mmap'ed afresh), kept:
    only the heap's growth (30 of the 228 MiB)."""
    applied, default = _faults("default")
    assert applied == "False" and default > 0.8, default
    applied, kept = _faults("keep")
    assert applied == "True" and kept < 0.3, kept


def test_bad_setting_is_named(monkeypatch):
    monkeypatch.setattr(cpu_malloc, "_applied", None)
    monkeypatch.setenv("GEMMAJAX_CPU_MALLOC", "off")
    with pytest.raises(ValueError, match="GEMMAJAX_CPU_MALLOC must be 'keep' or 'default', got 'off'"):
        cpu_malloc.keep_freed_memory()
