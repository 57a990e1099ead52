"""Tiny random Hugging Face Gemma 4 multimodal reference models (vision / audio towers), and HF's processors.

Variants (text decoders kept to two layers; the towers are what is compared):
  "e2b"  Gemma4ForConditionalGeneration with an E2B-like vision tower (clipped linears, GQA) and audio tower
         (the published attention chunk / context, clipped linears), PLE text;
  "31b"  a 26B / 31B-like vision tower (standardize, no clipping), bidirectional vision attention in the text;
  "12b"  Gemma4UnifiedForConditionalGeneration: the encoder-free vision and audio embedders.
Weights are randomized beyond HF's init: norms, clip bounds (finite, and tight enough that they clip), std buffers
(torch.empty in HF), per_dim_scale (zeros in HF) and position tables (ones / zeros in HF) all get random values.
"""
from __future__ import annotations

import math
import sys
import types

import numpy as np
import torch

VOCAB = 512
IMAGE, BOI, EOI, AUDIO, BOA, EOA, VIDEO = 500, 501, 502, 503, 504, 505, 506  # placeholder ids inside VOCAB
MM_IDS = {"image_token_id": IMAGE, "boi_token_id": BOI, "eoi_token_id": EOI, "audio_token_id": AUDIO, "boa_token_id": BOA,
              "eoa_token_index": EOA, "video_token_id": VIDEO}


def _text(**kw) -> dict:
    base = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 32, "global_head_dim": 64, "sliding_window": 8,
                "layer_types": ["sliding_attention", "full_attention"], "final_logit_softcapping": 30.0,
                "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": VOCAB, "pad_token_id": 0, "eos_token_id": 1,
                "bos_token_id": 2}
    base.update(kw)
    return base


VISION = {
    "e2b": {"hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 2, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16, "position_embedding_size": 256, "use_clipped_linears": True},
    "31b": {"hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 2, "num_attention_heads": 3,
                "num_key_value_heads": 3, "head_dim": 24, "position_embedding_size": 256, "standardize": True},
}
AUDIO_CFG = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "subsampling_conv_channels": [128, 8],
                 "output_proj_dims": 24}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)

    def uni(shape, lo, hi):
        return torch.rand(shape, generator=g) * (hi - lo) + lo

    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in name or "inv_timescales" in name or name.endswith(("embed_scale", "softcap")):
                continue
            s = p.shape
            if name.endswith(("input_min", "output_min")):
                p.copy_(uni(s, -2.2, -0.9))          # activations are ~unit scale: these clip a few percent
            elif name.endswith(("input_max", "output_max")):
                p.copy_(uni(s, 0.9, 2.2))
            elif name.endswith("layer_scalar"):
                p.copy_(uni(s, 0.5, 1.5))
            elif name.endswith("std_bias"):
                p.copy_(torch.randn(s, generator=g) * 2.0)
            elif name.endswith("std_scale"):
                p.copy_(uni(s, 0.2, 0.6))
            elif name.endswith("per_dim_scale"):
                p.copy_(torch.randn(s, generator=g) * 0.5)
            elif "norm" in name or "patch_ln" in name:
                p.copy_(uni(s, 0.5, 1.5) if name.endswith("weight") else torch.randn(s, generator=g) * 0.2)
            elif "position_embedding_table" in name or "pos_embedding" in name:
                p.copy_(torch.randn(s, generator=g) * 0.5)
            elif "embed_tokens" in name:
                p.copy_(torch.randn(s, generator=g))
            elif p.ndim >= 2:
                fan_in = math.prod(s[1:])
                p.copy_(torch.randn(s, generator=g) / math.sqrt(fan_in))
            else:
                p.copy_(torch.randn(s, generator=g) * 0.1)


REAL_VOCAB = 262144
REAL_MM_IDS = {"image_token_id": 258880, "boi_token_id": 255999, "eoi_token_id": 258882, "audio_token_id": 258881,
               "boa_token_id": 256000, "eoa_token_index": 258883, "video_token_id": 258884}


def build_mm(variant: str, seed: int = 0, dtype=torch.float32, audio: dict | None = None, real_vocab: bool = False):
    """(torch model, config dict) for "e2b", "31b" or "12b" (see the module docstring); eager attention.
    audio: overrides of the e2b audio config (e.g. another attention chunk / context). real_vocab: the real
    262,144-token vocabulary and Gemma 4's own placeholder ids, so the real tokenizer and chat template drive it."""
    if real_vocab:
        return _build_mm(variant, seed, dtype, audio, {"vocab_size": REAL_VOCAB,
                                                        "vocab_size_per_layer_input": REAL_VOCAB}, REAL_MM_IDS)
    return _build_mm(variant, seed, dtype, audio, {}, MM_IDS)


def _build_mm(variant, seed, dtype, audio, vocab, ids):
    if variant == "12b":
        from transformers.models.gemma4_unified import Gemma4UnifiedConfig, Gemma4UnifiedForConditionalGeneration
        cfg = Gemma4UnifiedConfig(
            text_config=_text(attention_k_eq_v=True, num_global_key_value_heads=1, use_bidirectional_attention="vision",
                              **vocab),
            vision_config={"mm_embed_dim": 40, "output_proj_dims": 40, "mm_posemb_size": 24},
            audio_config={"audio_embed_dim": 640}, **ids)
        cls = Gemma4UnifiedForConditionalGeneration
    else:
        from transformers import Gemma4Config, Gemma4ForConditionalGeneration
        text = _text(hidden_size_per_layer_input=16, **vocab) if variant == "e2b" else \
            _text(attention_k_eq_v=True, num_global_key_value_heads=1, use_bidirectional_attention="vision", **vocab)
        cfg = Gemma4Config(text_config=text, vision_config=VISION[variant],
                           audio_config={**AUDIO_CFG, **(audio or {})} if variant == "e2b" else None, **ids)
        cls = Gemma4ForConditionalGeneration
    cfg._attn_implementation = "eager"
    for sub in ("text_config", "vision_config", "audio_config"):
        if getattr(cfg, sub, None) is not None:
            getattr(cfg, sub)._attn_implementation = "eager"
    model = cls(cfg)
    _randomize(model, seed)
    return model.to(dtype).eval(), cfg.to_dict()


def hf_image_embeds(model, pixel_values: np.ndarray, position_ids: np.ndarray) -> list[np.ndarray]:
    """HF's soft tokens per image after embed_vision: list of [N_i, D_text] float32."""
    with torch.no_grad():
        out = model.model.get_image_features(torch.as_tensor(pixel_values), torch.as_tensor(position_ids),
                                             return_dict=True)
    return [t.float().numpy() for t in out.pooler_output]


def hf_audio_embeds(model, features: np.ndarray, mask: np.ndarray) -> list[np.ndarray]:
    """HF's soft tokens per clip after embed_audio, padding stripped: list of [N_i, D_text] float32."""
    with torch.no_grad():
        out = model.model.get_audio_features(torch.as_tensor(features), torch.as_tensor(mask), return_dict=True)
    emb, valid = out.pooler_output.float().numpy(), out.attention_mask.numpy().astype(bool)
    return [emb[i][valid[i]] for i in range(len(emb))]


def stub_torchvision() -> None:
    """HF's unified image processor module imports torchvision at the top only for its resize; its `patches_merge`
    is plain torch. Without torchvision installed, a stand-in module lets us import and call that function."""
    try:
        import torchvision  # noqa: F401
        return
    except ImportError:
        pass
    tv = types.ModuleType("torchvision")
    tr = types.ModuleType("torchvision.transforms")
    v2 = types.ModuleType("torchvision.transforms.v2")
    fn = types.ModuleType("torchvision.transforms.v2.functional")
    tv.transforms, tr.v2, v2.functional = tr, v2, fn
    fn.InterpolationMode = type("InterpolationMode", (), {})  # referenced in an annotation at import time
    sys.modules.update({"torchvision": tv, "torchvision.transforms": tr, "torchvision.transforms.v2": v2,
                        "torchvision.transforms.v2.functional": fn})


def hf_processor(tokenizer, max_soft_tokens: int = 280, unified: bool = False):
    """HF's Gemma4Processor (PIL image backend, the one transformers picks without torchvision) around `tokenizer`;
    the video processor, which needs torchvision, is left out. unified: Gemma4UnifiedProcessor's audio handling."""
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
    if unified:
        from transformers.models.gemma4_unified.feature_extraction_gemma4_unified import (
            Gemma4UnifiedAudioFeatureExtractor as FE,
        )
        from transformers.models.gemma4_unified.processing_gemma4_unified import Gemma4UnifiedProcessor as Base
    else:
        FE = Gemma4AudioFeatureExtractor
        from transformers.models.gemma4.processing_gemma4 import Gemma4Processor as Base

    class NoVideo(Base):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor":
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return NoVideo(feature_extractor=FE(), image_processor=Gemma4ImageProcessorPil(max_soft_tokens=max_soft_tokens),
                   tokenizer=tokenizer, video_processor=None)


GEMMA4_SPECIAL = {"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>",
                  "audio_token": "<|audio|>", "boa_token": "<|audio>", "eoa_token": "<audio|>"}


def hf_gemma4_tokenizer(sp_dir: str):
    """HF's GemmaTokenizer on a Gemma 4 tokenizer.model, with the multimodal tokens the processor looks up."""
    import transformers
    return transformers.GemmaTokenizer.from_pretrained(sp_dir, extra_special_tokens=GEMMA4_SPECIAL)
