"""gemmajax: a Gemma 4 inference engine in pure JAX.

Public surface (../shared/API.md): `load_model`, `load_tokenizer`, `LLM`, `SamplingParams`, `ModelConfig`.
Heavy submodules load lazily so `import gemmajax` stays cheap.
"""
import os as _os


def _cpu_vector_width() -> None:
    """Let XLA:CPU emit 512-bit vectors on CPUs with AVX-512 (its default is 256 bits). Measured with
    bench/compare_cpu.py on a 2-core AVX-512 Xeon, Gemma 3 270M, 1 stream: w8a8+emb8 38.9 -> 54.7 tok/s,
    w4a16+emb4 20.8 -> 27.6, bf16 unchanged (its GEMMs are YNNPACK's, not XLA's loops). Set before any JAX backend
    exists (XLA reads XLA_FLAGS once): a program that ran JAX before importing gemmajax keeps its own flags. An
    XLA_FLAGS that names a vector width, or GEMMAJAX_CPU_VECTOR_WIDTH=256, leaves XLA's default."""
    flags = _os.environ.get("XLA_FLAGS", "")
    if "prefer_vector_width" in flags or _os.environ.get("GEMMAJAX_CPU_VECTOR_WIDTH", "512") != "512":
        return
    try:  # XLA aborts on a flag it does not know: only for the jaxlib releases it was measured with
        from importlib.metadata import version
        if tuple(int(p) for p in version("jaxlib").split(".")[:2]) != (0, 10):
            return
    except (ValueError, ImportError):
        return
    from gemmajax.cpu_features import cpu_flags
    if "avx512f" in cpu_flags():
        _os.environ["XLA_FLAGS"] = (flags + " --xla_cpu_prefer_vector_width=512").strip()


_cpu_vector_width()

from gemmajax.config import ConfigError, LayerSpec, ModelConfig

__version__ = "0.1.0"
__all__ = ["ModelConfig", "LayerSpec", "ConfigError", "load_model", "load_tokenizer", "LLM", "SamplingParams"]


def __getattr__(name):
    if name == "load_model":
        from gemmajax.model.loader import load_model
        return load_model
    if name == "load_tokenizer":
        from gemmajax.tools.tokenizer import load_tokenizer
        return load_tokenizer
    if name == "LLM":
        from gemmajax.engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from gemmajax.engine.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'gemmajax' has no attribute {name!r}")
