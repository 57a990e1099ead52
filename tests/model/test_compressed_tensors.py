"""Compressed-tensors checkpoints served in their own scheme.

Tiny random Gemma 4 models are written here in the published layouts, from the spec (int4 words packed nibble by
nibble, int8 with per-channel scales), PLE projections and per-expert MoE projections included. Checked: every
QuantArray dequantizes to exactly the values the checkpoint encodes; logits equal those of a plain checkpoint
holding those values (bit for bit, through the exact on-the-fly paths); unsupported schemes are errors naming the
tensor and the scheme.
"""
import dataclasses
import json
import os
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

import gemmajax
from gemmajax.model import gemma
from gemmajax.model.compressed_tensors import CompressedTensorsError, unpack_int32_nibbles
from gemmajax.model.loader import open_checkpoint
from gemmajax.model.safetensors_io import save_file
from gemmajax.quant.array import QuantArray
from gemmajax.quant.quantize import dequantize
from tests.golden.hf_models import _g4_text, _period, _randomize, text_state_dict

BF16 = ml_dtypes.bfloat16
PREFIX_NESTED = "model.language_model."


# ------------------------------------------------------------------------------------------ the spec, by hand
def pack_words(levels: np.ndarray) -> np.ndarray:
    """compressed-tensors pack-quantized: levels [out, in] in -8..7 -> int32 [out, ceil(in / 8)]; nibble i of word j
    holds column 8j + i as level + 8 (padding nibbles 0)."""
    out, n = levels.shape
    words = -(-n // 8)
    u = np.zeros((out, words * 8), np.uint32)
    u[:, :n] = levels.astype(np.int64) + 8
    packed = np.zeros((out, words), np.uint32)
    for i in range(8):
        packed |= u[:, i::8] << np.uint32(4 * i)
    return packed.view(np.int32)


def encode_int4(w: np.ndarray):
    """w f32 [out, in] -> (levels int8 in -8..7, bf16 scale [out, in / 32], the encoded values as f32:
    bf16(level * scale), what a compressed-tensors reader computes in the scale's dtype)."""
    out, n = w.shape
    g = w.reshape(out, n // 32, 32)
    s = (np.abs(g).max(-1) / 8).astype(BF16)
    sf = s.astype(np.float32)[..., None]
    lv = np.clip(np.rint(g / sf), -8, 7).astype(np.int8)
    values = (lv.astype(np.float32) * sf).astype(BF16).astype(np.float32)
    return lv.reshape(out, n), s, values.reshape(out, n)


def encode_int8(w: np.ndarray):
    """w f32 [out, in] -> (levels int8, bf16 scale [out, 1], level * scale as f32 (exact)). Every row holds a
    level of magnitude 127, as a max-abs quantizer gives."""
    s = (np.abs(w).max(-1) / 127).astype(BF16)
    sf = s.astype(np.float32)[:, None]
    lv = np.clip(np.rint(w / sf), -127, 127).astype(np.int8)
    rows, cols = np.arange(w.shape[0]), np.abs(w).argmax(-1)
    lv[rows, cols] = np.where(w[rows, cols] < 0, -127, 127)
    return lv, s.reshape(-1, 1), lv.astype(np.float32) * sf


W4A16 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
         "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized", "input_activations": None,
                                       "output_activations": None,
                                       "weights": {"num_bits": 4, "type": "int", "symmetric": True,
                                                   "strategy": "group", "group_size": 32, "dynamic": False,
                                                   "actorder": None, "observer": "minmax"}}},
         "ignore": ["lm_head", "re:.*vision_tower.*", "re:.*router.*"], "kv_cache_scheme": None,
         "sparsity_config": {}, "transform_config": {}, "version": "0.12.2"}
W8A8 = {"quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "output_activations": None,
                                      "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                                                  "strategy": "channel", "group_size": None, "dynamic": False},
                                      "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                                            "strategy": "token", "dynamic": True}}},
        "ignore": ["lm_head"], "kv_cache_scheme": None}


def build(kind: str, seed: int):
    """A tiny random HF Gemma 4 (torch model, text config). "ple": E2B-like (PLE of width 32 so every projection
    holds whole groups of 32, KV sharing, double-wide MLP); "moe": 26B-A4B-like."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig
    if kind == "ple":
        kw = _g4_text(num_hidden_layers=4, layer_types=_period(4, 2), num_key_value_heads=1,
                      hidden_size_per_layer_input=32, num_kv_shared_layers=2, use_double_wide_mlp=True)
    else:
        kw = _g4_text(num_hidden_layers=3, layer_types=_period(3, 3), num_key_value_heads=2,
                      num_global_key_value_heads=1, attention_k_eq_v=True, enable_moe_block=True, num_experts=4,
                      top_k_experts=2, moe_intermediate_size=32)
    cfg = Gemma4TextConfig(**kw)
    model = Gemma4ForCausalLM(cfg)
    _randomize(model, seed)
    return model.eval(), json.loads(cfg.to_json_string())


def write_checkpoints(root, model, cfg: dict, scheme: str, nested: bool, split_experts: bool = False):
    """Write the compressed-tensors checkpoint of `model` (`root/ct`) and a plain checkpoint holding the values it
    encodes (`root/plain`, text-only, float32). Every Linear but lm_head and the router is quantized.

    Returns (ct dir, plain dir, {local name: encoded values f32}, {local name: levels})."""
    sd = text_state_dict(model)
    linear = {n + ".weight" for n, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) and n != "lm_head" and ".router." not in n}
    encode = encode_int4 if scheme == "w4a16" else encode_int8
    prefix = PREFIX_NESTED if nested else "model."
    ct, plain, encoded, levels = {}, {}, {}, {}

    def put(module: str, w: np.ndarray):  # module: "model.xxx" (without .weight); returns the encoded values
        lv, s, values = encode(w)
        name = prefix + module[len("model."):]
        if scheme == "w4a16":
            ct[name + ".weight_packed"] = pack_words(lv)
            ct[name + ".weight_scale"] = s
            ct[name + ".weight_shape"] = np.array(w.shape, np.int64)
        else:
            ct[name + ".weight"] = lv
            ct[name + ".weight_scale"] = s
        levels[module[len("model."):] + ".weight"] = lv
        return values

    for name, w in sd.items():
        local = name[len("model."):]
        if name in linear:
            plain[name] = encoded[local] = put(name[: -len(".weight")], w)
        elif split_experts and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            base = name.rsplit(".", 1)[0]
            f = w.shape[1] // 2
            rows = []
            for e in range(w.shape[0]):
                if name.endswith("gate_up_proj"):
                    rows.append(np.concatenate([put(f"{base}.{e}.gate_proj", w[e, :f]),
                                                put(f"{base}.{e}.up_proj", w[e, f:])]))
                else:
                    rows.append(put(f"{base}.{e}.down_proj", w[e]))
            plain[name] = encoded[local] = np.stack(rows)
        else:
            plain[name] = w
            ct[prefix + local] = w.astype(BF16) if w.ndim >= 2 else w
            plain[name] = ct[prefix + local].astype(np.float32)
    qc = W4A16 if scheme == "w4a16" else W8A8
    if nested:  # the released layout: a quantized vision tensor and an unused k_proj copy on a KV-shared layer
        rng = np.random.default_rng(0)
        shared = f"{prefix}layers.{cfg['num_hidden_layers'] - 1}.self_attn.k_proj"
        ct[shared + ".weight_packed"] = pack_words(rng.integers(-8, 8, (32, 64)).astype(np.int8))
        ct[shared + ".weight_scale"] = np.ones((32, 2), BF16)
        ct[shared + ".weight_shape"] = np.array([32, 64], np.int64)
        ct["model.vision_tower.encoder.layers.0.mlp.fc1.linear.weight_packed"] = rng.integers(
            -2**31, 2**31 - 1, (16, 8), dtype=np.int64).astype(np.int32)
        ct["model.vision_tower.encoder.layers.0.mlp.fc1.linear.weight_scale"] = np.ones((16, 1), BF16)
        ct["model.vision_tower.encoder.layers.0.mlp.fc1.linear.weight_shape"] = np.array([16, 64], np.int64)
        top = {"model_type": "gemma4", "architectures": ["Gemma4ForConditionalGeneration"], "text_config": cfg,
               "vision_config": {"model_type": "gemma4_vision", "hidden_size": 8}, "quantization_config": qc}
    else:
        top = {**cfg, "quantization_config": qc}
    ct_dir, plain_dir = os.path.join(root, "ct"), os.path.join(root, "plain")
    for d, tensors, config in ((ct_dir, ct, top), (plain_dir, plain, cfg)):
        os.makedirs(d)
        save_file(tensors, os.path.join(d, "model.safetensors"))
        with open(os.path.join(d, "config.json"), "w") as fh:
            json.dump(config, fh)
    return ct_dir, plain_dir, encoded, levels


def read_json(path: str) -> dict:
    with open(path) as fh:
        return json.load(fh)


def named_leaves(model):
    names = jax.tree_util.tree_leaves(gemma.build_weights(model.config, lambda n: n))
    leaves = jax.tree_util.tree_leaves(model.weights, is_leaf=lambda x: isinstance(x, QuantArray))
    assert len(names) == len(leaves)
    return dict(zip(names, leaves))


@pytest.fixture(scope="module")
def ids():
    x = np.random.default_rng(0).integers(3, 512, size=(2, 20))
    x[:, 0] = 2
    return x


# ------------------------------------------------------------------------------------------ layout
def test_pack_words_is_the_published_layout_and_unpacks():
    # levels -8..7 in columns 0..7 are nibbles 0..15 in order: word 0 = 0x76543210 + 8 per nibble = 0xFEDCBA98
    lv = np.arange(-8, 8, dtype=np.int8).reshape(2, 8)
    words = pack_words(lv).view(np.uint32)
    assert words.tolist() == [[0x76543210], [0xFEDCBA98]]
    rng = np.random.default_rng(1)
    for cols in (8, 20, 96):  # 20: a partly used last word
        lv = rng.integers(-8, 8, (5, cols)).astype(np.int8)
        assert np.array_equal(unpack_int32_nibbles(pack_words(lv), cols), lv)


# ------------------------------------------------------------------------------------------ w4a16
@pytest.fixture(scope="module")
def w4a16(tmp_path_factory):
    model, cfg = build("ple", seed=3)
    return write_checkpoints(str(tmp_path_factory.mktemp("w4a16")), model, cfg, "w4a16", nested=True)


def test_w4a16_pack_quantized_loads_exactly(w4a16, ids, tmp_path):
    ct_dir, plain_dir, encoded, _ = w4a16
    model = gemmajax.load_model(ct_dir, dtype="bfloat16")
    assert model.quant == "w4a16"
    leaves = named_leaves(model)
    quant = {n for n, x in leaves.items() if isinstance(x, QuantArray)}
    assert quant == set(encoded)  # every projection the model reads, nothing else
    assert {"per_layer_model_projection.weight", "layers.0.per_layer_input_gate.weight",
            "layers.3.per_layer_projection.weight", "layers.3.mlp.down_proj.weight"} <= quant
    assert not any(isinstance(leaves[n], QuantArray) for n in ("embed_tokens.weight", "embed_tokens_per_layer.weight"))
    for name in quant:  # (a) exactly the values the checkpoint encodes, bit for bit
        q = leaves[name]
        assert q.kind == "int4" and q.group == 32 and q.scale.dtype == BF16 and q.dtype == BF16
        got = np.asarray(dequantize(q))
        assert np.array_equal(got.view(np.uint16), encoded[name].astype(BF16).view(np.uint16)), name
    # (b) the plain checkpoint of those values, repacked exactly on the fly, gives the same logits bit for bit
    ref = gemmajax.load_model(plain_dir, dtype="bfloat16", quant="qat-w4a16")
    ref_leaves = named_leaves(ref)
    assert all(isinstance(ref_leaves[n], QuantArray) for n in quant)  # every tensor repacked, none kept dense
    out = model.logits(ids)
    np.testing.assert_array_equal(out, ref.logits(ids))
    assert np.abs(out).max() > 1

    # A converted copy (gemmajax quantize of a compressed-tensors source) keeps the checkpoint's own QuantArrays.
    from gemmajax.model.orbax_io import load_converted, save_converted
    conv = save_converted(str(tmp_path / "conv"), model, ct_dir)
    _, w, meta = load_converted(conv)
    assert meta["quant"] == "w4a16" and meta["source_kind"] == "compressed-tensors"
    assert "quantization_config" not in read_json(os.path.join(conv, "config.json"))
    assert jax.tree_util.tree_structure(w) == jax.tree_util.tree_structure(model.weights)
    for a, b in zip(jax.tree_util.tree_leaves(w), jax.tree_util.tree_leaves(model.weights)):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))


# ------------------------------------------------------------------------------------------ w8a8
@pytest.fixture(scope="module")
def w8a8(tmp_path_factory):
    model, cfg = build("ple", seed=4)
    return write_checkpoints(str(tmp_path_factory.mktemp("w8a8")), model, cfg, "w8a8", nested=False)


def test_w8a8_int_quantized_loads_exactly(w8a8, ids):
    ct_dir, plain_dir, encoded, levels = w8a8
    model = gemmajax.load_model(ct_dir, dtype="float32")
    assert model.quant == "w8a8"
    leaves = named_leaves(model)
    quant = {n for n, x in leaves.items() if isinstance(x, QuantArray)}
    assert quant == set(encoded) and "per_layer_model_projection.weight" in quant
    for name in quant:  # (a) level * scale exactly; the stored levels untouched
        q = leaves[name]
        assert q.kind == "int8" and q.scale.dtype == np.float32
        vals = np.asarray(q.values)[: q.shape[0]]
        assert q.padded_in == -(-q.shape[1] // 128) * 128, (name, q.padded_in)  # rows padded to 128 columns
        assert np.array_equal(vals[:, : q.shape[1]], levels[name]) and not np.any(vals[:, q.shape[1]:]), name
        assert np.array_equal(np.asarray(dequantize(q)), encoded[name]), name
    # (b) the plain checkpoint of those values quantized on the fly (w8a8: max-abs per row) is the same weights,
    # so the same integers and, with the checkpoint's per-token activation scales, the same logits, bit for bit
    ref = gemmajax.load_model(plain_dir, dtype="float32", quant="w8a8")
    ref_leaves = named_leaves(ref)
    for name in quant:
        a, b = leaves[name], ref_leaves[name]
        assert np.array_equal(np.asarray(a.values), np.asarray(b.values)), name
        assert np.array_equal(np.asarray(a.scale), np.asarray(b.scale)), name
        assert getattr(a, "act_group", 0) == 0  # compressed-tensors "token" strategy: one scale per token
    per_token = jax.tree_util.tree_map(
        lambda x: dataclasses.replace(x, act_group=0) if hasattr(x, "act_group") else x, ref.weights,
        is_leaf=lambda x: isinstance(x, QuantArray))
    want = np.asarray(gemma.full_logits(per_token, model.config, jnp.asarray(ids)))
    np.testing.assert_array_equal(model.logits(ids), want)


# ------------------------------------------------------------------------------------------ experts
def test_moe_experts_split_per_expert_are_fused(tmp_path, ids):
    model_t, cfg = build("moe", seed=5)
    ct_dir, plain_dir, encoded, _ = write_checkpoints(str(tmp_path), model_t, cfg, "w4a16", nested=False,
                                                      split_experts=True)
    c = open_checkpoint(ct_dir)
    assert "model.layers.0.experts.3.up_proj.weight" in c.compressed.tensors  # stored per expert
    assert "model.layers.0.experts.gate_up_proj" in c.names and c.shape_of("model.layers.0.experts.gate_up_proj") \
        == (4, 64, 64)
    model = gemmajax.load_model(ct_dir, dtype="bfloat16")
    leaves = named_leaves(model)
    gu = leaves["layers.0.experts.gate_up_proj"]
    assert isinstance(gu, QuantArray) and gu.shape == (4, 64, 64) and gu.kind == "int4"
    assert not isinstance(leaves["layers.0.router.proj.weight"], QuantArray)  # on the ignore list
    for name in ("layers.0.experts.gate_up_proj", "layers.2.experts.down_proj", "layers.1.self_attn.q_proj.weight"):
        got = np.asarray(dequantize(leaves[name]))
        assert np.array_equal(got.view(np.uint16), encoded[name].astype(BF16).view(np.uint16)), name
    ref = gemmajax.load_model(plain_dir, dtype="bfloat16", quant="qat-w4a16")
    assert isinstance(named_leaves(ref)["layers.0.experts.gate_up_proj"], QuantArray)
    np.testing.assert_array_equal(model.logits(ids), ref.logits(ids))


# ------------------------------------------------------------------------------------------ errors
def _variant(src_dir: str, dst, edit) -> str:
    """A copy of a checkpoint directory (weights linked) whose quantization_config `edit(qc)` changes."""
    os.makedirs(dst)
    for fn in os.listdir(src_dir):
        if fn.endswith(".safetensors"):
            os.symlink(os.path.join(src_dir, fn), os.path.join(dst, fn))
    cfg = read_json(os.path.join(src_dir, "config.json"))
    edit(cfg["quantization_config"])
    with open(os.path.join(dst, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    return str(dst)


def _set(path: str, value):
    def edit(qc):
        *keys, last = path.split("/")
        d = qc
        for k in keys:
            d = d[k]
        d[last] = value
    return edit


W = "config_groups/group_0/weights/"
A = "config_groups/group_0/input_activations"
UNSUPPORTED_W4 = [
    ("group 128", _set(W + "group_size", 128), "group_size 128"),
    ("channel", _set(W + "strategy", "channel"), "strategy 'channel'"),
    ("asymmetric", _set(W + "symmetric", False), "asymmetric weights"),
    ("fp8", lambda qc: (_set(W + "type", "float")(qc), _set(W + "num_bits", 8)(qc),
                        _set("config_groups/group_0/format", "float-quantized")(qc)), "format 'float-quantized'"),
    ("w4a8", _set(A, {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}), "16-bit activations"),
    ("8-bit packed", _set(W + "num_bits", 8), "8-bit weights must be int-quantized"),
    ("ignored", lambda qc: qc["ignore"].append("re:.*self_attn\\.q_proj"), "ignore lists its module"),
    ("untargeted", _set("config_groups/group_0/targets", ["re:.*mlp.*"]), "no config group targets"),
]
UNSUPPORTED_W8 = [
    ("w8a16", _set(A, None), "w8a16"),
    ("static activations", _set(A, {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False,
                                    "symmetric": True}), "int 8-bit tensor, symmetric, static"),
    ("fp8 activations", _set(A, {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}),
     "float 8-bit token"),
]


@pytest.mark.parametrize("case,edit,expect", UNSUPPORTED_W4, ids=[c[0] for c in UNSUPPORTED_W4])
def test_unsupported_int4_schemes_name_tensor_and_scheme(w4a16, tmp_path, case, edit, expect):
    path = _variant(w4a16[0], tmp_path / "v", edit)
    with pytest.raises(CompressedTensorsError) as e:
        open_checkpoint(path)
    msg = str(e.value)
    assert expect in msg, msg
    assert re.search(r"model\.language_model\.layers\.\d+\.\S+\.weight_packed", msg), msg
    assert "'group_0'" in msg or "ignore" in msg or "no config group" in msg, msg
    assert "more tensors" in msg  # all failing tensors are counted, the first named


@pytest.mark.parametrize("case,edit,expect", UNSUPPORTED_W8, ids=[c[0] for c in UNSUPPORTED_W8])
def test_unsupported_int8_schemes_name_tensor_and_scheme(w8a8, tmp_path, case, edit, expect):
    path = _variant(w8a8[0], tmp_path / "v", edit)
    with pytest.raises(CompressedTensorsError) as e:
        open_checkpoint(path)
    msg = str(e.value)
    assert expect in msg and "'group_0' (int-quantized" in msg, msg
    assert re.search(r"^model\.layers\.\d+\.\S+\.weight: ", msg), msg


@pytest.mark.parametrize("edit,expect", [
    (_set("quant_method", "gptq"), "quant_method is 'gptq'"),
    (_set("kv_cache_scheme", {"num_bits": 8, "type": "float", "strategy": "tensor"}), "kv_cache_scheme"),
    (_set("sparsity_config", {"format": "sparse-24-bitmask"}), "sparsity_config"),
])
def test_unsupported_checkpoint_wide_settings_are_named(w8a8, tmp_path, edit, expect):
    with pytest.raises(CompressedTensorsError, match=re.escape(expect)):
        open_checkpoint(_variant(w8a8[0], tmp_path / "v", edit))


def test_nonzero_zero_points_are_refused_on_read(w8a8, tmp_path):
    path = _variant(w8a8[0], tmp_path / "v", lambda qc: None)
    name = "model.layers.1.mlp.up_proj.weight_zero_point"
    save_file({name: np.ones((96, 1), np.int8)}, os.path.join(path, "zero_points.safetensors"))
    c = open_checkpoint(path)
    with pytest.raises(CompressedTensorsError, match=re.escape(name) + ": non-zero zero points"):
        c.read("model.layers.1.mlp.up_proj.weight")
    assert isinstance(c.read("model.layers.0.mlp.up_proj.weight"), QuantArray)  # the others still read
