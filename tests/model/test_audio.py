"""Audio towers against HF transformers 5.24 (tiny random Gemma4ForConditionalGeneration / Gemma4Unified models
saved as released checkpoints): soft tokens after embed_audio within 2e-4 of HF's largest |value| in float32, for
the published attention band and another one with right context, an ablation showing the clip bounds are live,
and eval_shape at the published sizes against HF's parameter counts."""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gemmajax.model import audio as au
from gemmajax.model import multimodal as mm
from gemmajax.model import vision as vi
from gemmajax.tools import media
from tests.golden import hf_multimodal as hm

TOL = 2e-4
RNG = np.random.default_rng(5)
CLIPS = [RNG.standard_normal(24000).astype(np.float32) * 0.3, RNG.standard_normal(6500).astype(np.float32) * 0.3]


def _load(tmp_path, variant, **kw):
    model, _ = hm.build_mm(variant, **kw)
    model.save_pretrained(tmp_path)
    cfg, w = mm.load_multimodal(tmp_path, dtype="float32")
    return model, cfg, w


def _hf(model, clips, unified=False):
    """HF's feature extractor on the batch (padded to the longest clip), then HF's audio tower + embed_audio."""
    if unified:
        from transformers.models.gemma4_unified.feature_extraction_gemma4_unified import (
            Gemma4UnifiedAudioFeatureExtractor as FE,
        )
    else:
        from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor as FE
    f = FE()(clips, return_tensors="np")
    return hm.hf_audio_embeds(model, f["input_features"], f["input_features_mask"])


def _err(ours, ref):
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return float(np.abs(np.asarray(ours, np.float32) - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("band", [None, {"attention_chunk_size": 5, "attention_context_left": 4,
                                         "attention_context_right": 3}])
def test_audio_soft_tokens_match_hf(tmp_path, band):
    """Two clips (1.5 s: several attention chunks; 0.4 s), each run alone with our frame bucketing, against HF's
    padded batch. band None: the published chunk 12 / left 13 / right 0; the other band sees 2 keys ahead."""
    model, cfg, w = _load(tmp_path, "e2b", audio=band)
    ref = _hf(model, CLIPS)
    proc = [media.audio_features(c) for c in CLIPS]
    ours = mm.embed_multimodal(w, cfg, proc)
    for o, r, p in zip(ours, ref, proc):
        assert o.shape[0] == p.num_soft_tokens == r.shape[0]
        assert _err(o, r) < TOL
    if band is None:  # the clip bounds are live: without them the outputs move far outside TOL
        layers = tuple(dataclasses.replace(lw, **{f: au.ClippedLinear(c.weight) for f, c in vars(lw).items()
                                                  if isinstance(c, au.ClippedLinear)},
                                           ff1=_unclip_ff(lw.ff1), ff2=_unclip_ff(lw.ff2)) for lw in w.audio.layers)
        w2 = mm.MultimodalWeights(audio=dataclasses.replace(w.audio, layers=layers))
        cfg2 = mm.MultimodalConfig(audio=dataclasses.replace(cfg.audio, use_clipped_linears=False))
        assert _err(mm.embed_multimodal(w2, cfg2, proc[:1])[0], ref[0]) > 100 * TOL


def _unclip_ff(ff):
    return dataclasses.replace(ff, up=au.ClippedLinear(ff.up.weight), down=au.ClippedLinear(ff.down.weight))


def test_unified_audio_matches_hf(tmp_path):
    model, cfg, w = _load(tmp_path, "12b")
    ref = _hf(model, CLIPS, unified=True)
    ours = mm.embed_multimodal(w, cfg, [media.audio_features(c, unified=True) for c in CLIPS])
    for o, r in zip(ours, ref):
        assert _err(o, r) < TOL


def test_relative_position_band_is_hfs_shift():
    """The published band: keys 0..11 back (HF masks the 13th its chunk context holds), relative position = distance."""
    d, pos, has = au.relative_position_band(au.AudioConfig())
    np.testing.assert_array_equal(d, np.arange(12))
    np.testing.assert_array_equal(pos, np.arange(12))
    assert has.all()


@pytest.mark.parametrize("size", ["e2b", "e4b"])
def test_eval_shape_published_audio_towers(size):
    from transformers.models.gemma4.configuration_gemma4 import Gemma4AudioConfig
    from transformers.models.gemma4.modeling_gemma4 import Gemma4AudioModel
    cfg = au.AudioConfig.preset(size)
    with torch.device("meta"):
        m = Gemma4AudioModel(Gemma4AudioConfig())
    hf = sum(p.numel() for p in m.parameters()) + sum(b.numel() for n, b in m.named_buffers()
                                                      if n.endswith(("_min", "_max")))
    assert cfg.num_params() == hf + cfg.text_hidden_size * cfg.output_proj_dims
    w = au.abstract_audio_weights(cfg)
    assert sum(math.prod(x.shape) for x in jax.tree.leaves(w)) == cfg.num_params()
    emb, valid = jax.eval_shape(lambda w, f, m: au.encode_audio(w, cfg, f, m), w,
                                jax.ShapeDtypeStruct((1, 2999, 128), jnp.float32),
                                jax.ShapeDtypeStruct((1, 2999), jnp.bool_))
    assert emb.shape == (1, 750, cfg.text_hidden_size) and emb.dtype == jnp.bfloat16 and valid.shape == (1, 750)


def test_published_12b_and_config_parsing():
    cfg = mm.MultimodalConfig.from_hf({"model_type": "gemma4_unified", "text_config": {"hidden_size": 3840},
                                       "vision_config": {}, "audio_config": {}, "eoa_token_index": 258883})
    assert cfg.vision == vi.UNIFIED_VISION_PRESETS["12b"] and cfg.audio == au.UnifiedAudioConfig()
    assert cfg.bidirectional_vision and cfg.unified and cfg.eoa_token_id == 258883
    assert cfg.num_params() == 6912 * 2 + 3840 * 6912 + 3840 * 5 + 1120 * 2 * 3840 + 3840 * 3840 + 3840 * 640
    e2b = mm.MultimodalConfig.from_hf({"model_type": "gemma4", "text_config": {"hidden_size": 1536},
                                       "vision_config": {"use_clipped_linears": True}, "audio_config": {}})
    assert e2b.vision == vi.VisionConfig.preset("e2b") and e2b.audio == au.AudioConfig.preset("e2b")
    assert not e2b.bidirectional_vision
    with pytest.raises(au.AudioConfigError, match=r"subsampling_conv_channels\[0\]=64: .* must be 128"):
        au.AudioConfig.from_hf({"subsampling_conv_channels": [64, 32]}, 1536)
    with pytest.raises(vi.VisionConfigError, match="head_dim=18: must be a multiple of 4"):
        vi.VisionConfig.from_hf({"head_dim": 18}, 1536)
