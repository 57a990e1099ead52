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


# huge_pages. The smaps helper (run in child processes): the mapping of /proc/self/smaps that holds an address, as
# [start, end, AnonHugePages kB, VmFlags]; VmFlags holds "hg" on a range advised MADV_HUGEPAGE.
_SMAPS = """
def mapping(addr):
    found = None
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            if found is not None:
                break
            lo, hi = (int(v, 16) for v in head.split("-"))
            if lo <= addr < hi:
                found = [lo, hi, 0, ""]
        elif found is not None and line.startswith("AnonHugePages:"):
            found[2] = int(line.split()[1])
        elif found is not None and line.startswith("VmFlags:"):
            found[3] = line.split(":", 1)[1].strip()
    assert found is not None, hex(addr)
    return found
"""
# A fresh process makes a 24 MiB array, reads the mapping at its first whole 2 MiB page, calls huge_pages on it (and
# on an array too small to hold a huge page), and reads the mapping again, with the array's contents before and after.
_HUGE = _SMAPS + """
import json
import jax.numpy as jnp
import numpy as np
from gemmajax.engine import cpu_malloc
size = 2 << 20
x = jnp.asarray(np.random.default_rng(0).standard_normal(6 << 20, np.float32))
before = np.asarray(x).copy()
p, n = x.unsafe_buffer_pointer(), x.nbytes
start = -(-p // size) * size
m0 = mapping(start)
got = cpu_malloc.huge_pages({"x": x, "small": jnp.ones(3)})
print(json.dumps({"p": p, "n": n, "m0": m0, "m1": mapping(start), "got": got,
                  "same": bool(np.array_equal(np.asarray(x), before))}))
"""
_HUGE_PAGE = 2 << 20


def _collapse_works() -> bool:
    """Linux with 2 MiB transparent huge pages where this process may collapse a written 4 MiB anonymous mapping
    (MADV_COLLAPSE: Linux 6.1+, THP not off nor disabled for the process, a huge page free)."""
    import ctypes
    import mmap
    if not sys.platform.startswith("linux") or cpu_malloc._huge_page_size() != _HUGE_PAGE:  # 0: no THP, or off
        return False
    madvise = cpu_malloc._madvise()
    m = mmap.mmap(-1, 2 * _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # anonymous memory, not shmem
    m.write(b"\1" * len(m))
    ref = ctypes.c_char.from_buffer(m)
    try:
        start = -(-ctypes.addressof(ref) // _HUGE_PAGE) * _HUGE_PAGE
        return madvise is not None and madvise(start, _HUGE_PAGE, cpu_malloc.MADV_HUGEPAGE) == 0 \
            and madvise(start, _HUGE_PAGE, cpu_malloc.MADV_COLLAPSE) == 0
    finally:
        del ref
        m.close()


COLLAPSE = pytest.mark.skipif(not _collapse_works(), reason="this kernel / process cannot collapse 2 MiB huge pages "
                              "(needs Linux 6.1+ MADV_COLLAPSE, THP not off)")


def _child(script: str, setting: str) -> dict:
    import json
    env = {**os.environ, "GEMMAJAX_CPU_HUGE_PAGES": setting, "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, env=env,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@COLLAPSE
def test_huge_pages_back_exactly_the_whole_aligned_runs():
    """The bytes collapsed are the whole aligned huge pages inside the big array (computed here from its address and
    size; the 12-byte array holds none); the advised mapping is exactly that run (the advice stays inside the buffer),
    all of it in huge pages; the array reads the same numbers. MADV_COLLAPSE is best effort: when the kernel has no
    free huge page for one of the run's 2 MiB pages at that moment, the call fails and huge_pages counts nothing (seen
    once in a full `make test`, on a machine up 22 hours: 10 of 11 pages collapsed, 0 counted; the file alone then
    passed 3 of 3). So a fresh process tries again, up to 3 times, before the test fails."""
    for _ in range(3):
        r = _child(_HUGE, "on")
        p, n = r["p"], r["n"]
        start, end = -(-p // _HUGE_PAGE) * _HUGE_PAGE, (p + n) // _HUGE_PAGE * _HUGE_PAGE
        if r["got"] == end - start:
            break
    assert end - start >= 10 * _HUGE_PAGE  # 24 MiB holds 11 or 12 whole 2 MiB pages
    lo, hi, kb, flags = r["m1"]
    assert r["got"] == end - start and (lo, hi) == (start, end) and "hg" in flags.split(), r
    assert kb * 1024 == end - start, r
    if cpu_malloc._thp_mode() == "madvise":  # nothing else gives this process huge pages
        assert r["m0"][2] == 0, r
    assert r["same"], r


@COLLAPSE
def test_huge_pages_off_leaves_the_pages():
    r = _child(_HUGE, "off")
    assert r["got"] == 0 and r["m1"] == r["m0"] and "hg" not in r["m1"][3].split() and r["same"], r


def test_huge_runs_advise_only_inside_buffers(monkeypatch, caplog):
    """With a recording madvise (any OS): only the whole aligned runs of live CPU jax.Arrays are advised, each
    MADV_HUGEPAGE then MADV_COLLAPSE; numpy, None, deleted and too-small leaves are skipped; a refused collapse is
    not counted, is logged with its errno, and raises nothing."""
    import ctypes
    import errno
    import logging

    import jax.numpy as jnp
    size = 1 << 21
    big = jnp.zeros(6 << 20, jnp.uint8)
    dead = jnp.zeros(6 << 20, jnp.uint8)
    dead.delete()
    p, n = big.unsafe_buffer_pointer(), big.nbytes
    start, end = -(-p // size) * size, (p + n) // size * size
    assert end - start >= 2 * size
    tree = {"big": big, "np": np.ones(1 << 22), "none": None, "dead": dead, "small": jnp.ones(3)}
    calls = []

    def record(refuse=()):
        def madvise(addr, length, advice):
            calls.append((addr, length, advice))
            if advice in refuse:
                ctypes.set_errno(errno.EINVAL)
                return -1
            return 0
        return lambda: madvise

    monkeypatch.setenv("GEMMAJAX_CPU_HUGE_PAGES", "on")
    monkeypatch.setattr(cpu_malloc, "_huge_page_size", lambda: size)
    assert cpu_malloc.huge_runs(tree, size) == [(start, end)]
    monkeypatch.setattr(cpu_malloc, "_madvise", record())
    assert cpu_malloc.huge_pages(tree) == end - start
    assert calls == [(start, end - start, cpu_malloc.MADV_HUGEPAGE), (start, end - start, cpu_malloc.MADV_COLLAPSE)]
    calls.clear()
    monkeypatch.setattr(cpu_malloc, "_madvise", record(refuse=(cpu_malloc.MADV_COLLAPSE,)))
    with caplog.at_level(logging.INFO, logger=cpu_malloc.__name__):
        assert cpu_malloc.huge_pages(tree) == 0
    assert len(calls) == 2 and "refused (EINVAL" in caplog.text, (calls, caplog.text)


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


# The real Gemma 3 270M in an engine on the CPU: the mapping of its int8 vocabulary table and of its largest KV layer
# after the engine is built, and the KV layer's address after a generate (its step donates the KV cache).
_ENGINE = _SMAPS + """
import json
import gemmajax
from gemmajax.model.gguf import default_model_path
llm = gemmajax.LLM(default_model_path(), quant="w8a8+emb8", max_model_len=512, max_num_seqs=16,
                   kv_cache_memory=256 << 20)
runner = llm.engine.runner
t = runner.weights.embed.values
kv = max(range(len(runner.kv)), key=lambda i: runner.kv[i].nbytes)
size = 2 << 20
pt, pk = t.unsafe_buffer_pointer(), runner.kv[kv].unsafe_buffer_pointer()
out = {"n": t.nbytes, "table": mapping(-(-pt // size) * size), "kv_n": runner.kv[kv].nbytes,
       "kv": mapping(-(-pk // size) * size)}
llm.generate([[2, 100, 200]], gemmajax.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
out["kv_after"] = runner.kv[kv].unsafe_buffer_pointer() == pk
print(json.dumps(out))
"""


@COLLAPSE
def test_cpu_engine_puts_weights_and_kv_cache_in_huge_pages(gguf_file):
    """An engine on the CPU advises and collapses its weights and KV cache: the real Gemma 3 270M's int8 vocabulary
    table (168 MB, which every decode step reads) lies in huge pages but for its unaligned ends, and so does its
    largest KV layer, which stays in the same buffer after decode steps (each step donates it)."""
    r = _child(_ENGINE, "on")
    _, _, kb, flags = r["table"]
    assert r["n"] > 100 << 20 and "hg" in flags.split() and kb * 1024 >= r["n"] - 2 * _HUGE_PAGE, r
    _, _, kb, flags = r["kv"]
    assert r["kv_n"] >= 2 * _HUGE_PAGE and "hg" in flags.split() and kb > 0, r
    assert r["kv_after"], r
