"""ModelConfig: presets, both config.json dialects, derived geometry against HF's own config class."""
import json
import math
import os

import jax
import jax.numpy as jnp
import pytest

from gemmajax.config import ModelConfig, PRESETS
from gemmajax.model import gemma

SHARED_JSON = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "reference", "gemma4-text-configs.json")

# Text parameter counts (tied embeddings) from shared/reference/gemma4-architecture.md section 1.
PUBLISHED_B = {"e2b": 4.63, "e4b": 7.46, "12b": 11.9, "26b-a4b": 25.2, "31b": 30.7}


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_eval_shape_param_count(name):
    cfg = ModelConfig.preset(name)
    assert hash(cfg) == hash(ModelConfig.preset(name))  # frozen and hashable
    tree = jax.eval_shape(lambda: gemma.abstract_weights(cfg))
    n = sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(tree))
    assert n == cfg.num_params()
    print(f"{name}: {n:,} parameters ({n / 1e9:.2f} B)")
    assert abs(n / 1e9 - PUBLISHED_B[name]) <= 0.006 * PUBLISHED_B[name], n
    # every leaf's shape is the HF tensor's shape
    shapes = cfg.param_shapes()
    assert tree.embed.shape == shapes["embed_tokens.weight"] == (262144, cfg.hidden_size)
    for s, lw in zip(cfg.layers, tree.layers):
        assert lw.attn.q_proj.shape == (cfg.num_heads * s.head_dim, cfg.hidden_size)
        assert (lw.attn.k_proj is None) == (not s.owns_kv)
        assert (lw.attn.v_proj is None) == (not s.owns_kv or s.k_eq_v)
        assert lw.mlp.gate_proj.shape == (s.mlp_dim, cfg.hidden_size)


def test_preset_geometry_by_hand():
    e2b = ModelConfig.preset("e2b")
    assert [s.index for s in e2b.layers if s.kind == "full"] == [4, 9, 14, 19, 24, 29, 34]
    assert e2b.kv_layers == tuple(range(15))
    assert {s.kv_source for s in e2b.layers[15:] if s.kind == "sliding"} == {13}
    assert {s.kv_source for s in e2b.layers[15:] if s.kind == "full"} == {14}
    assert [s.mlp_dim for s in e2b.layers] == [6144] * 15 + [12288] * 20
    full = e2b.layers[4]
    assert (full.head_dim, full.num_kv_heads, full.rope_dims, full.rope_denominator, full.window) == (512, 1, 64, 512, None)
    sl = e2b.layers[0]
    assert (sl.head_dim, sl.num_kv_heads, sl.rope_dims, sl.window, sl.rope_theta) == (256, 1, 128, 512, 1e4)
    c12 = ModelConfig.preset("12b")
    assert c12.ple_dim == 0 and c12.layers[5].k_eq_v and c12.layers[5].num_kv_heads == 1
    assert c12.layers[0].num_kv_heads == 8 and c12.layers[0].window == 1024
    # KV bytes per token, bf16: 12 sliding x 256 + 3 full x 512, one KV head, K and V (anchors: 18 KiB)
    assert e2b.kv_bytes_per_token(2) == 2 * (12 * 256 + 3 * 512) * 2 == 18 * 1024


@pytest.mark.skipif(not os.path.exists(SHARED_JSON), reason="shared/reference not beside the checkout")
def test_presets_match_published_configs_and_hf_derivation():
    from transformers import Gemma4TextConfig
    from transformers.models.gemma4_unified import Gemma4UnifiedTextConfig
    published = json.load(open(SHARED_JSON))
    names = {"gemma-4-E2B-it": "e2b", "gemma-4-E4B-it": "e4b", "gemma-4-26B-A4B-it": "26b-a4b",
             "gemma-4-31B-it": "31b", "gemma-4-12B-it (gemma4_unified)": "12b"}
    for key, preset in names.items():
        raw = published[key]
        ours = ModelConfig.from_hf(raw)
        assert ours.layers == ModelConfig.preset(preset).layers, key
        assert ours.num_params() == ModelConfig.preset(preset).num_params()
        kw = {k: v for k, v in raw.items() if k != "model_type"}
        unified = raw["model_type"].startswith("gemma4_unified")
        if unified:
            for k in ("vocab_size_per_layer_input", "hidden_size_per_layer_input", "enable_moe_block"):
                kw.pop(k, None)
        hf = (Gemma4UnifiedTextConfig if unified else Gemma4TextConfig)(**kw)
        modes = getattr(hf, "kv_sharing_modes", [None] * hf.num_hidden_layers)
        for s in ours.layers:
            lc = hf.per_layer_config[s.index]
            assert s.head_dim == lc.head_dim and s.num_kv_heads == lc.num_key_value_heads, (key, s.index)
            assert s.owns_kv == (modes[s.index] != "reuse"), (key, s.index)


def test_per_layer_config_dialect():
    """transformers 5.2x saves `per_layer_config` instead of global_head_dim / num_global_key_value_heads."""
    base = dict(model_type="gemma4_text", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, attention_k_eq_v=True,
                hidden_size_per_layer_input=0)
    a = ModelConfig.from_hf(dict(base, global_head_dim=32, num_global_key_value_heads=1))
    b = ModelConfig.from_hf(dict(base, per_layer_config={"5": {"head_dim": 32, "num_key_value_heads": 1}}))
    assert a.layers == b.layers
    assert a.layers[5].head_dim == 32 and a.layers[5].num_kv_heads == 1 and a.layers[0].head_dim == 16


def test_nested_config_and_eos_ids():
    nested = {"model_type": "gemma4", "eos_token_id": [1, 106], "text_config": dict(PRESETS["e2b"])}
    nested["text_config"].pop("eos_token_id")
    c = ModelConfig.from_hf(nested)
    assert c.eos_token_ids == (1, 106) and c.ple_dim == 256
