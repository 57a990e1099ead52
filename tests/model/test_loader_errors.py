"""A checkpoint that does not match its config fails with one error listing every offending tensor."""
import json
import os

import numpy as np
import pytest

import gemmajax
from gemmajax.model import CheckpointError
from gemmajax.model.safetensors_io import read_header, save_file
from tests.golden.hf_models import build_hf, save_text_checkpoint, text_state_dict


@pytest.fixture(scope="module")
def tiny():
    return build_hf("e2b")


def _write(tmp_path, cfg, sd):
    d = tmp_path / "bad"
    d.mkdir()
    save_file(sd, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def test_missing_tensor_is_named_with_shape(tiny, tmp_path):
    model_t, cfg = tiny
    sd = text_state_dict(model_t)
    del sd["model.layers.3.mlp.up_proj.weight"]
    del sd["model.layers.0.self_attn.k_norm.weight"]
    with pytest.raises(CheckpointError) as e:
        gemmajax.load_model(_write(tmp_path, cfg, sd))
    msg = str(e.value)
    assert "missing tensor model.layers.3.mlp.up_proj.weight: expected shape (96, 64)" in msg
    assert "missing tensor model.layers.0.self_attn.k_norm.weight: expected shape (32,)" in msg


def test_wrong_shape_is_named_with_both_shapes(tiny, tmp_path):
    model_t, cfg = tiny
    sd = text_state_dict(model_t)
    sd["model.layers.2.self_attn.q_proj.weight"] = np.zeros((100, 64), np.float32)
    sd["model.extra_thing.weight"] = np.zeros((3,), np.float32)
    with pytest.raises(CheckpointError) as e:
        gemmajax.load_model(_write(tmp_path, cfg, sd))
    msg = str(e.value)
    assert "wrong shape model.layers.2.self_attn.q_proj.weight: expected (128, 64), found (100, 64)" in msg
    assert "unexpected tensor model.extra_thing.weight" in msg


def test_shared_layer_kv_copies_ignored_but_own_kv_required(tiny, tmp_path):
    model_t, cfg = tiny
    path = save_text_checkpoint(model_t, cfg, str(tmp_path / "ok"))
    names, _ = read_header(os.path.join(path, "model.safetensors"))
    assert "model.layers.9.self_attn.k_proj.weight" not in names  # HF itself writes none for shared layers
    gemmajax.load_model(path)  # and that is accepted


def test_unsupported_config_names_the_field(tmp_path):
    from gemmajax.config import ConfigError
    with pytest.raises(ConfigError, match="model_type 'llama'"):
        gemmajax.ModelConfig.from_hf({"model_type": "llama"})
    with pytest.raises(ConfigError, match="'num_attention_heads'"):
        gemmajax.ModelConfig.from_hf({"model_type": "gemma4_text", "num_hidden_layers": 2, "hidden_size": 8,
                                      "num_key_value_heads": 1, "intermediate_size": 8, "vocab_size": 8})
    with pytest.raises(ConfigError, match="hidden_activation"):
        gemmajax.ModelConfig.from_hf({"model_type": "gemma4_text", "num_hidden_layers": 2, "hidden_size": 8,
                                      "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 8,
                                      "vocab_size": 8, "hidden_activation": "silu"})
