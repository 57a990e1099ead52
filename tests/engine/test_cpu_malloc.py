"""gemmajax.engine.cpu_malloc: glibc keeps freed memory once an engine runs on the CPU (fewer page faults a step),
and the engine's weights and KV cache lie in transparent huge pages (fewer page walks)."""
import os
import subprocess
import sys

import numpy as np
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


# huge_pages: a fresh process makes a 24 MiB array, reads the AnonHugePages of the mapping that holds its first whole
# 2 MiB run (from /proc/self/smaps), calls huge_pages on it (and on an array too small to hold a huge page), and
# reads them again, with the array's contents before and after.
_SMAPS = """
def huge_kb(addr):
    hit = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            hit = lo <= addr < hi
        elif hit and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
"""
_HUGE = _SMAPS + """
import json
import jax.numpy as jnp
import numpy as np
from gemmajax.engine import cpu_malloc
size = cpu_malloc._huge_page_size()
x = jnp.asarray(np.random.default_rng(0).standard_normal(6 << 20, np.float32))
before = np.asarray(x).copy()
p, n = x.unsafe_buffer_pointer(), x.nbytes
start = -(-p // size) * size
kb0 = huge_kb(start)
got = cpu_malloc.huge_pages({"x": x, "small": jnp.ones(3)})
print(json.dumps({"p": p, "n": n, "size": size, "kb0": kb0, "kb1": huge_kb(start), "got": got,
                  "same": bool(np.array_equal(np.asarray(x), before))}))
"""


def _thp_mode() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def _collapse_supported() -> bool:
    """Linux 6.1 or later (MADV_COLLAPSE) with transparent huge pages not off."""
    if not sys.platform.startswith("linux") or _thp_mode() in (None, "never"):
        return False
    major, minor = (int(v) for v in os.uname().release.split(".")[:2])
    return (major, minor) >= (6, 1)


def _huge_run(setting: str) -> dict:
    import json
    env = {**os.environ, "GEMMAJAX_CPU_HUGE_PAGES": setting, "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([sys.executable, "-c", _HUGE], check=False, capture_output=True, text=True, env=env,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not _collapse_supported(), reason="needs Linux 6.1+ (MADV_COLLAPSE) with transparent huge pages")
def test_huge_pages_back_the_whole_aligned_runs_and_keep_contents():
    """The bytes collapsed are exactly the whole aligned huge pages inside the big array (computed here from its
    address and size; the 12-byte array holds none), the mapping that holds them then has at least that many bytes
    in huge pages, and the array reads the same numbers."""
    r = _huge_run("on")
    size, p, n = r["size"], r["p"], r["n"]
    whole = ((p + n) // size - -(-p // size)) * size
    assert whole >= 10 * size  # 24 MiB holds 11 or 12 whole 2 MiB pages
    assert r["got"] == whole, r
    assert r["kb1"] * 1024 >= whole, r
    assert r["same"], r


@pytest.mark.skipif(not _collapse_supported(), reason="needs Linux 6.1+ (MADV_COLLAPSE) with transparent huge pages")
def test_huge_pages_off_leaves_the_pages():
    r = _huge_run("off")
    assert r["got"] == 0 and r["kb1"] == r["kb0"] and r["same"], r
    if _thp_mode() == "madvise":  # nothing else gives this process huge pages
        assert r["kb1"] == 0, r


def test_huge_pages_setting_and_thp_modes(monkeypatch, tmp_path):
    """A bad setting is named; the kernel's 'never' mode (or no THP at all) is a no-op; the page size is read from
    the kernel."""
    monkeypatch.setenv("GEMMAJAX_CPU_HUGE_PAGES", "yes")
    with pytest.raises(ValueError, match="GEMMAJAX_CPU_HUGE_PAGES must be 'on' or 'off', got 'yes'"):
        cpu_malloc.huge_pages([])
    (tmp_path / "enabled").write_text("always madvise [never]\n")
    (tmp_path / "hpage_pmd_size").write_text("2097152\n")
    monkeypatch.setattr(cpu_malloc, "_THP", str(tmp_path))
    assert cpu_malloc._huge_page_size() == 0
    (tmp_path / "enabled").write_text("always [madvise] never\n")
    assert cpu_malloc._huge_page_size() == 2097152
    monkeypatch.setattr(cpu_malloc, "_THP", str(tmp_path / "absent"))
    assert cpu_malloc._huge_page_size() == 0
    monkeypatch.setenv("GEMMAJAX_CPU_HUGE_PAGES", "on")
    assert cpu_malloc.huge_pages([np.ones(1 << 22)]) == 0  # no THP: nothing is advised


_ENGINE = _SMAPS + """
import json
import gemmajax
from gemmajax.model.gguf import default_model_path
llm = gemmajax.LLM(default_model_path(), quant="w8a8+emb8", max_model_len=64, max_num_seqs=1, kv_cache_memory=1 << 22)
t = llm.engine.runner.weights.embed.values
size = 2 << 20
p = t.unsafe_buffer_pointer()
print(json.dumps({"kb": huge_kb(-(-p // size) * size), "n": t.nbytes}))
"""


@pytest.mark.skipif(not _collapse_supported(), reason="needs Linux 6.1+ (MADV_COLLAPSE) with transparent huge pages")
def test_cpu_engine_puts_its_weights_in_huge_pages(gguf_file):
    """An engine on the CPU backs its weights with huge pages: the real Gemma 3 270M's int8 vocabulary table (168 MB,
    which every decode step reads) lies in huge pages but for its unaligned ends."""
    import json
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "GEMMAJAX_CPU_HUGE_PAGES": "on"}
    p = subprocess.run([sys.executable, "-c", _ENGINE], check=False, capture_output=True, text=True, env=env,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["n"] > 100 << 20 and r["kb"] * 1024 >= r["n"] - (4 << 20), r
