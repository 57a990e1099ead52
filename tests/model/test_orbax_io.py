"""Converted checkpoints (`gemmajax quantize`): written with orbax, restored without re-quantizing.

Checked against the on-the-fly load of the same source: identical leaves (bit for bit, QuantArray metadata
included) and identical logits; the CLI end to end, with the tokenizer and chat template beside the weights and
`LLM` serving the result; a GGUF source (the real 270M; a tiny one with an embedded template); the errors.
"""
import json
import os
import re
import shutil

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gemmajax
from gemmajax.model import gemma
from gemmajax.model.loader import CheckpointError
from gemmajax.model.orbax_io import META_FILE, load_converted, save_converted
from gemmajax.quant.array import QuantArray
from gemmajax.server.cli import main
from gemmajax.tools.chat_template import ChatTemplate
from gemmajax.tools.tokenizer import gguf_to_sp, load_tokenizer
from tests.golden.hf_models import save_text_checkpoint
from tests.model import gguf_fixtures
from tests.model.test_compressed_tensors import build, write_checkpoints

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>"
            "{% endfor %}{% if add_generation_prompt %}<model>{% endif %}")


def assert_same_tree(a, b):
    """Same structure (QuantArray kind / shape / group / dtype included) and bit-identical leaves."""
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb) > 0
    for x, y in zip(la, lb):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(x.view(np.uint8), y.view(np.uint8))


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """A tiny E2B-like HF checkpoint (PLE, KV sharing) with a tokenizer, chat template and generation config."""
    model, cfg = build("ple", seed=11)
    return save_text_checkpoint(model, cfg, str(tmp_path_factory.mktemp("src")))


@pytest.fixture(scope="module")
def ids():
    x = np.random.default_rng(0).integers(3, 512, size=(2, 16))
    x[:, 0] = 2
    return x


def test_round_trip_is_bit_for_bit(src, ids, tmp_path):
    """w4a16+emb4 here; w8a8 (float32) in the CLI test below."""
    quant = "w4a16+emb4"
    fly = gemmajax.load_model(src, dtype="bfloat16", quant=quant)
    out = save_converted(str(tmp_path / "conv"), fly, src)
    cfg, w, meta = load_converted(out)
    assert cfg.replace(name=fly.config.name) == fly.config
    assert (meta["format"], meta["quant"], meta["dtype"], meta["source_kind"]) == (1, quant, "bfloat16", "hf")
    assert_same_tree(w, fly.weights)
    kinds = {x.kind for x in jax.tree_util.tree_leaves(w, is_leaf=lambda x: isinstance(x, QuantArray))
             if isinstance(x, QuantArray)}
    assert kinds == {"int4"} and isinstance(w.embed, QuantArray) and isinstance(w.ple_table, QuantArray)
    assert isinstance(w.ple_model_proj, QuantArray) and isinstance(w.layers[0].ple_gate, QuantArray)
    # load_model reads the directory as is: its stored dtype and scheme, nothing re-quantized
    model = gemmajax.load_model(out)
    assert (model.dtype, model.quant) == (jnp.bfloat16, quant)
    assert_same_tree(model.weights, fly.weights)
    want = fly.logits(ids)
    got = np.asarray(gemma.full_logits(model.weights, fly.config, jnp.asarray(ids)))  # same config: no recompile
    np.testing.assert_array_equal(got, want)
    assert np.abs(want).max() > 1
    # asking for another scheme than the one stored is an error, not a silent re-quantization
    with pytest.raises(CheckpointError, match=re.escape(f"already quantized as '{quant}'")):
        gemmajax.load_model(out, quant="w8a8")


def test_cli_end_to_end_then_llm_serves_it(src, tmp_path, gemma4_tokenizer, capsys):
    ckpt = tmp_path / "src"
    shutil.copytree(src, ckpt)
    (ckpt / "tokenizer.model").write_bytes(gemma4_tokenizer._sp.serialized_model_proto())
    (ckpt / "chat_template.jinja").write_text(TEMPLATE)
    (ckpt / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<eos>"}))
    out = tmp_path / "out"
    rc = main(["quantize", "--ckpt", str(ckpt), "--quant", "w8a8", "--out", str(out), "--dtype", "float32"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "int8 (w8a8" in text and "unquantized" in text and "loads in" in text
    n_int8 = int(text.split("int8 (w8a8 / +emb8)")[1].split("tensors")[0])
    assert n_int8 == 4 * 7 - 2 * 2 + 4 * 2 + 1  # q,k,v,o,gate,up,down (no k/v on 2 shared layers), PLE x2, model proj
    for f in ("config.json", META_FILE, "tokenizer.model", "chat_template.jinja", "tokenizer_config.json",
              "generation_config.json", "weights"):
        assert (out / f).exists(), f
    # a second run into the same directory refuses instead of mixing two checkpoints
    assert main(["quantize", "--ckpt", str(ckpt), "--quant", "w8a8", "--out", str(out)]) == 1
    assert "not an empty directory" in capsys.readouterr().err

    llm = gemmajax.LLM(str(out), kv_dtype="float32", max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32,
                       page_size=8, kv_cache_memory=1 << 22)
    assert llm.model.quant == "w8a8" and llm.model.dtype == jnp.float32
    assert llm.tokenizer.vocab_size == gemma4_tokenizer.vocab_size
    assert llm.tokenizer.encode("Hello world", add_bos=True) == gemma4_tokenizer.encode("Hello world", add_bos=True)
    tpl = llm.chat_template()
    assert tpl.source.endswith("chat_template.jinja") and tpl.render(MESSAGES) == \
        "<bos><system>Be brief.</system><user>Hi there</user><model>"
    prompt = [2, 17, 300, 41, 9, 128]
    got = llm.generate([prompt], gemmajax.SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0].token_ids
    # reference: the cache-free forward of the same weights, teacher-forced over what the engine produced
    seq = jnp.asarray([prompt + got[:-1]])
    ref = np.asarray(gemma.full_logits(llm.model.weights, llm.model.config, seq))
    assert got == [int(t) for t in ref[0, len(prompt) - 1:].argmax(-1)]
    # and the directory holds what the on-the-fly load gives, bit for bit: same leaves, same logits
    fly = gemmajax.load_model(ckpt, dtype="float32", quant="w8a8")
    assert_same_tree(llm.model.weights, fly.weights)
    np.testing.assert_array_equal(np.asarray(gemma.full_logits(fly.weights, llm.model.config, seq)), ref)


def test_cli_qat_reports_the_repack(tmp_path, capsys):
    """qat-w4a16 of a checkpoint on a 4-bit grid: every projection packed, the repack report printed."""
    model_t, cfg = build("ple", seed=12)
    _, plain, encoded, _ = write_checkpoints(str(tmp_path), model_t, cfg, "w4a16", nested=False)
    out = str(tmp_path / "q")
    assert main(["quantize", "--ckpt", plain, "--quant", "qat-w4a16", "--out", out]) == 0
    cap = capsys.readouterr()
    assert f"QAT repack: {len(encoded)} tensors packed" in cap.err and ", 0 kept;" in cap.err, cap.err
    assert f"int4 (w4a16 / +emb4)   {len(encoded):5d} tensors" in cap.out, cap.out
    _, w, meta = load_converted(out)
    assert meta["quant"] == "qat-w4a16"
    q = [x for x in jax.tree_util.tree_leaves(w, is_leaf=lambda x: isinstance(x, QuantArray))
         if isinstance(x, QuantArray)]
    assert len(q) == len(encoded) == 33 and {x.kind for x in q} == {"int4"}


def test_real_gguf_converts_with_its_tokenizer(gguf_file, tmp_path):
    """The default model (Gemma 3 270M GGUF): weights as load_model(quant=) gives them, its vocabulary as
    tokenizer.model, the same chat template rendering (the file embeds none: the built-in Gemma 3 one)."""
    fly = gemmajax.load_model(gguf_file, dtype="bfloat16", quant="w8a8")
    out = save_converted(str(tmp_path / "g"), fly, gguf_file)
    cfg, w, meta = load_converted(out)
    assert meta["source_kind"] == "gguf" and cfg.replace(name=fly.config.name) == fly.config
    assert_same_tree(w, fly.weights)
    assert (tmp_path / "g" / "tokenizer.model").read_bytes() == gguf_to_sp(gguf_file)
    ours, theirs = load_tokenizer(out), load_tokenizer(gguf_file)
    text = "Der schnelle braune Fuchs <start_of_turn>user\n東京 🙂"
    assert (ours.vocab_size, ours.bos_id, ours.eos_id, ours.family) == (
        theirs.vocab_size, theirs.bos_id, theirs.eos_id, theirs.family) == (262144, 2, 1, "gemma3")
    assert ours.encode(text, add_bos=True) == theirs.encode(text, add_bos=True)
    a, b = ChatTemplate.from_checkpoint(out, "gemma3"), ChatTemplate.from_checkpoint(gguf_file, "gemma3")
    assert a.render(MESSAGES) == b.render(MESSAGES) and "<start_of_turn>user" in a.render(MESSAGES)


def test_gguf_embedded_template_is_written(tmp_path, monkeypatch):
    """A GGUF's embedded chat template becomes chat_template.jinja, rendering as the GGUF itself does."""
    import transformers

    class WithTemplate(gguf.GGUFWriter):
        def write_header_to_file(self, *args, **kwargs):
            self.add_chat_template(TEMPLATE)
            super().write_header_to_file(*args, **kwargs)

    monkeypatch.setattr(gguf_fixtures.gguf, "GGUFWriter", WithTemplate)
    cfg = transformers.Gemma3TextConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=16,
                                        max_position_embeddings=256)
    state = gguf_fixtures.randomize(transformers.Gemma3ForCausalLM(cfg).state_dict(), seed=1)
    path = str(tmp_path / "tiny.gguf")
    gguf_fixtures.write_gemma3(path, cfg, state)
    fly = gemmajax.load_model(path, dtype="float32")
    out = save_converted(str(tmp_path / "conv"), fly, path)
    assert (tmp_path / "conv" / "chat_template.jinja").read_text() == TEMPLATE
    a, b = ChatTemplate.from_checkpoint(out), ChatTemplate.from_checkpoint(path)
    assert a.render(MESSAGES) == b.render(MESSAGES) == "<bos><system>Be brief.</system><user>Hi there</user><model>"
    assert (tmp_path / "conv" / "tokenizer.model").read_bytes() == gguf_to_sp(path)
    _, w, meta = load_converted(out)
    assert meta["quant"] == "none" and meta["dtype"] == "float32"
    assert_same_tree(w, fly.weights)


def test_damaged_manifest_is_named(src, tmp_path):
    fly = gemmajax.load_model(src, dtype="float32")
    out = save_converted(str(tmp_path / "c"), fly, src)
    with pytest.raises(FileExistsError, match="not an empty directory"):
        save_converted(out, fly, src)
    meta_path = tmp_path / "c" / META_FILE
    meta = json.loads(meta_path.read_text())
    meta["tensors"]["layers.0.mlp.up_proj.weight"]["shape"] = [95, 64]
    del meta["tensors"]["norm.weight"]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError) as e:
        load_converted(out)
    msg = str(e.value)
    assert "wrong shape layers.0.mlp.up_proj.weight: expected (96, 64), found (95, 64)" in msg
    assert "missing tensor norm.weight: expected shape (64,)" in msg
    meta["format"] = 2
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="format 2, this gemmajax reads format 1"):
        gemmajax.load_model(out)
    os.remove(meta_path)
    with pytest.raises(CheckpointError, match="gemmajax.json missing"):
        load_converted(out)
