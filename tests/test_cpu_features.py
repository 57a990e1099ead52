"""cpu_features: the flags read from a cpuinfo file (x86 and aarch64 spellings), and the bf16-hardware answer with
its environment override."""
import pytest

from gemmajax import cpu_features
from gemmajax.cpu_features import cpu_flags, native_bf16_dot

X86_ZEN3 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu vme sse sse2 avx avx2 fma bmi2
bugs\t\t: sysret_ss_attrs

processor\t: 1
flags\t\t: fpu vme sse sse2 avx avx2 fma bmi2
"""
X86_ZEN4 = "processor\t: 0\nflags\t\t: avx2 avx512f avx512_vnni avx512_bf16\n"
ARM_GRAVITON3 = "processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd sve bf16 i8mm\nCPU implementer\t: 0x41\n"


@pytest.mark.parametrize("text,want_flags,bf16", [
    (X86_ZEN3, {"fpu", "vme", "sse", "sse2", "avx", "avx2", "fma", "bmi2"}, False),
    (X86_ZEN4, {"avx2", "avx512f", "avx512_vnni", "avx512_bf16"}, True),
    (ARM_GRAVITON3, {"fp", "asimd", "sve", "bf16", "i8mm"}, True),
    ("processor\t: 0\nmodel name\t: something\n", set(), False)])
def test_flags_from_cpuinfo_and_bf16_answer(tmp_path, monkeypatch, text, want_flags, bf16):
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    flags = cpu_flags(str(path))
    assert flags == frozenset(want_flags)
    monkeypatch.delenv("GEMMAJAX_CPU_BF16_DOT", raising=False)
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: flags)
    assert native_bf16_dot() is bf16


def test_unreadable_cpuinfo_has_no_flags(tmp_path):
    assert cpu_flags(str(tmp_path / "missing")) == frozenset()


def test_environment_overrides_the_flags(monkeypatch):
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx512_bf16"}))
    monkeypatch.setenv("GEMMAJAX_CPU_BF16_DOT", "0")
    assert native_bf16_dot() is False
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset())
    monkeypatch.setenv("GEMMAJAX_CPU_BF16_DOT", "1")
    assert native_bf16_dot() is True
    monkeypatch.setenv("GEMMAJAX_CPU_BF16_DOT", "yes")
    with pytest.raises(ValueError, match="GEMMAJAX_CPU_BF16_DOT must be 0 or 1.*'yes'"):
        native_bf16_dot()
