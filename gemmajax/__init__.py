"""gemmajax: a Gemma 4 inference engine in pure JAX.

Public surface (../shared/API.md): `load_model`, `load_tokenizer`, `LLM`, `SamplingParams`, `ModelConfig`.
Heavy submodules load lazily so `import gemmajax` stays cheap.
"""
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
