"""Checkpoint loading into the `Weights` pytree, and `load_model`.

Every source (HF safetensors directory, GGUF file, gemmajax-converted directory) is reduced to "a config dict
plus a getter of Hugging Face-named tensors"; one function checks names and shapes against the config, then
streams tensors one at a time to the device, cast (and optionally quantized) on the way. All problems are
collected first so one error lists every missing, unexpected or misshapen tensor.
"""
from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import dataclass
from typing import Callable, Iterable

import jax.numpy as jnp
import numpy as np

from gemmajax.config import ModelConfig
from gemmajax.model import gemma
from gemmajax.model.safetensors_io import index_checkpoint, load_tensor

# Prefixes under which the text decoder lives, most specific first.
TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.text_model.", "model.")
# Tensors outside the text decoder that released multimodal checkpoints carry; skipped silently.
NON_TEXT = re.compile(r"(^|\.)(vision_tower|vision_embedder|embed_vision|audio_tower|embed_audio|"
                      r"multi_modal_projector|vision_model)\.")
# KV-shared layers: HF ignores these copies on load (Google's QAT exports omit them entirely).
KV_SHARED_EXTRAS = ("self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.k_norm.weight",
                    "self_attn.v_norm.weight")


class CheckpointError(ValueError):
    """A checkpoint that does not match its config; the message lists every offending tensor."""


def _dtype(d) -> jnp.dtype:
    return jnp.dtype({"bf16": "bfloat16", "fp32": "float32", "f32": "float32", "fp16": "float16"}.get(d, d))


def text_prefix(names: Iterable[str]) -> str:
    names = set(names)
    for p in TEXT_PREFIXES:
        if p + "embed_tokens.weight" in names:
            return p
    raise CheckpointError("checkpoint: no embedding table found; looked for "
                          + ", ".join(p + "embed_tokens.weight" for p in TEXT_PREFIXES))


def plan_tensors(cfg: ModelConfig, names: Iterable[str], shape_of: Callable[[str], tuple[int, ...]]) -> str:
    """Check a checkpoint's tensor names and shapes against `cfg`. Returns the text prefix; raises
    CheckpointError listing every missing, unexpected and misshapen tensor."""
    names = list(names)
    prefix = text_prefix(names)
    expected = cfg.param_shapes()
    shared = {s.index for s in cfg.layers if not s.owns_kv}
    present, unexpected = set(), []
    for n in names:
        if not n.startswith(prefix):
            if NON_TEXT.search(n) or n in ("lm_head.weight", "model.lm_head.weight"):
                continue
            if prefix == "model." or not n.startswith("model."):
                unexpected.append(n)
            continue
        local = n[len(prefix):]
        if NON_TEXT.search(local):
            continue
        if local in expected:
            present.add(local)
            continue
        m = re.match(r"layers\.(\d+)\.(.*)$", local)
        if m and int(m.group(1)) in shared and m.group(2) in KV_SHARED_EXTRAS:
            continue
        if local == "lm_head.weight":
            continue
        unexpected.append(n)
    missing = [k for k in expected if k not in present]
    wrong = [(k, expected[k], tuple(shape_of(prefix + k))) for k in present
             if tuple(shape_of(prefix + k)) != expected[k]]
    if missing or unexpected or wrong:
        lines = [f"checkpoint does not match its config ({cfg.model_type}, {cfg.num_layers} layers, "
                 f"hidden {cfg.hidden_size}):"]
        for k in missing:
            lines.append(f"  missing tensor {prefix + k}: expected shape {expected[k]}")
        for k, e, a in wrong:
            lines.append(f"  wrong shape {prefix + k}: expected {e}, found {a}")
        for k in unexpected:
            lines.append(f"  unexpected tensor {k}: {tuple(shape_of(k))}")
        raise CheckpointError("\n".join(lines))
    return prefix


def build_from_getter(cfg: ModelConfig, read: Callable[[str], np.ndarray], prefix: str, dtype,
                      quantize: Callable | None = None, progress: bool | None = None,
                      total_bytes: int = 0) -> gemma.Weights:
    """Stream tensors (read(prefix + name) -> numpy) to the device as the Weights tree.

    Norm weights become float32 (with Gemma 3's `1 + w` folded in after rounding w to `dtype`, as HF computes
    it); everything else is cast to `dtype`. `quantize(name, array) -> leaf` may quantize projections."""
    dtype = _dtype(dtype)
    bar = None
    if progress is None:
        progress = total_bytes > (1 << 30) and sys.stderr.isatty()
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="loading weights")

    def get(name: str):
        a = np.asarray(read(prefix + name))
        if bar is not None:
            bar.update(a.nbytes)
        if gemma.is_norm(name):
            w = a.astype(np.float32)
            if dtype != jnp.float32:  # HF keeps the stored value in the model dtype before upcasting
                w = np.asarray(jnp.asarray(w).astype(dtype).astype(jnp.float32))
            return jnp.asarray(w + np.float32(cfg.norm_offset))
        return jnp.asarray(a).astype(dtype) if a.dtype != dtype else jnp.asarray(a)

    w = gemma.build_weights(cfg, get, quantize=quantize)
    if bar is not None:
        bar.close()
    return w


@dataclass
class Checkpoint:
    """A resolved checkpoint source: its config, its tensors and where its tokenizer lives."""

    config: ModelConfig
    hf_config: dict
    names: list[str]
    shape_of: Callable[[str], tuple[int, ...]]
    read: Callable[[str], np.ndarray]
    total_bytes: int
    path: str
    kind: str             # "hf" | "gguf" | "gemmajax"


def open_checkpoint(ckpt: str | os.PathLike) -> Checkpoint:
    """Resolve `ckpt` (HF directory, .gguf file, or converted directory) without reading any weights."""
    ckpt = os.fspath(ckpt)
    if ckpt.endswith(".gguf"):
        from gemmajax.model.gguf import read_gguf
        g = read_gguf(ckpt)
        cfg = ModelConfig.from_hf(g.config, name=os.path.basename(ckpt))
        shapes = g.shapes
        return Checkpoint(cfg, g.config, list(shapes), lambda n: shapes[n], g.tensor, g.nbytes, ckpt, "gguf")
    if not os.path.isdir(ckpt):
        raise FileNotFoundError(f"checkpoint {ckpt!r}: not a directory or a .gguf file")
    cfg_path = os.path.join(ckpt, "config.json")
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"checkpoint {ckpt!r}: no config.json")
    with open(cfg_path) as f:
        hf = json.load(f)
    if os.path.exists(os.path.join(ckpt, "gemmajax.json")):
        return Checkpoint(ModelConfig.from_hf(hf, name=os.path.basename(ckpt.rstrip("/"))), hf, [], None, None, 0,
                          ckpt, "gemmajax")
    if hf.get("quantization_config") or (hf.get("text_config") or {}).get("quantization_config"):
        from gemmajax.model.compressed_tensors import open_compressed  # served in its own scheme
        return open_compressed(ckpt, hf)
    cfg = ModelConfig.from_hf(hf, name=os.path.basename(ckpt.rstrip("/")))
    infos = index_checkpoint(ckpt)
    return Checkpoint(cfg, hf, list(infos), lambda n: infos[n].shape, lambda n: load_tensor(infos[n]),
                      sum(i.nbytes for i in infos.values()), ckpt, "hf")


class Model:
    """A loaded model: `.config`, `.weights`, and `.logits(token_ids)` (one full causal forward, no cache)."""

    def __init__(self, config: ModelConfig, weights: gemma.Weights, dtype, path: str | None = None,
                 quant: str = "none"):
        self.config = config
        self.weights = weights
        self.dtype = _dtype(dtype)
        self.path = path
        self.quant = quant

    def logits(self, token_ids) -> np.ndarray:
        """token_ids: int array [B, T] (or [T]) -> float32 logits [B, T, V] (positions 0..T-1, causal)."""
        ids = np.asarray(token_ids)
        squeeze = ids.ndim == 1
        if squeeze:
            ids = ids[None]
        if ids.ndim != 2:
            raise ValueError(f"token_ids: expected an int array [B, T], got shape {ids.shape}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            raise ValueError(f"token_ids: ids must be in [0, {self.config.vocab_size}), "
                             f"got min {ids.min()} max {ids.max()}")
        out = np.asarray(gemma.full_logits(self.weights, self.config, jnp.asarray(ids, jnp.int32)))
        return out[0] if squeeze else out

    def __repr__(self) -> str:
        return f"Model({self.config.name or self.config.model_type}, {self.config.num_layers} layers, {self.dtype})"


def load_model(ckpt: str | os.PathLike | None = None, dtype="float32", quant: str = "none",
               progress: bool | None = None) -> Model:
    """Load a checkpoint (HF directory, .gguf, or converted directory) as a `Model`. ckpt=None: the default
    Gemma 3 270M GGUF."""
    if ckpt is None:
        from gemmajax.model.gguf import default_model_path
        ckpt = default_model_path()
    if quant not in (None, "none"):
        from gemmajax.quant.loading import make_quantizer  # per-weight quantization at load time
        qfn = make_quantizer(quant)
    else:
        qfn = None
    c = open_checkpoint(ckpt)
    if c.kind == "gemmajax":
        from gemmajax.model.orbax_io import load_converted
        cfg, w, meta = load_converted(c.path, expect_quant=quant)
        return Model(cfg, w, meta.get("dtype", dtype), path=c.path, quant=meta.get("quant", "none"))
    prefix = plan_tensors(c.config, c.names, c.shape_of)
    if c.kind == "compressed-tensors":  # QuantArrays as stored; `quant` applies to the unquantized tensors only
        from gemmajax.model.compressed_tensors import build_compressed, quant_name
        w = build_compressed(c, prefix, dtype, quantize=qfn, progress=progress)
        quant = quant_name(c, quant)
    else:
        w = build_from_getter(c.config, c.read, prefix, dtype, quantize=qfn, progress=progress,
                              total_bytes=c.total_bytes)
    if qfn is not None:
        from gemmajax.quant.loading import print_report
        print_report(qfn)
    return Model(c.config, w, dtype, path=os.fspath(ckpt), quant=quant or "none")
