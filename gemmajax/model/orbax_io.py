"""Converted checkpoints (`gemmajax quantize`): the Weights pytree on disk, restored without re-quantizing.

Design choices: orbax writes the Weights pytree itself, QuantArray leaves included (their values / scale are the
pytree children); what a pytree cannot carry (each QuantArray's kind, logical shape, group and dtype, and every
leaf's stored shape and dtype) goes into gemmajax.json keyed by Hugging Face tensor name. Loading builds the
exact abstract tree from that manifest, checked against `gemma.abstract_weights`, and orbax restores straight
into it on the default device. The directory is a complete checkpoint: config.json (the source's HF config),
tokenizer.model and the chat-template files beside the weights.

Layout of DIR:
  config.json          the source's HF config (quantization_config removed): ModelConfig.from_hf rebuilds it
  gemmajax.json        {"format": 1, "quant", "dtype", "source", "source_kind", "tensors": {name: entry}}
  weights/             the orbax (OCDBT) checkpoint of the Weights pytree
  tokenizer.model ...  tokenizer, tokenizer_config.json, chat_template.jinja, generation_config.json if any
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gemmajax.config import ModelConfig
from gemmajax.model import gemma
from gemmajax.model.loader import CheckpointError, Model, open_checkpoint
from gemmajax.quant.array import QuantArray

FORMAT = 1
META_FILE = "gemmajax.json"
WEIGHTS_DIR = "weights"
# Files copied verbatim from a source checkpoint directory when present.
COPIED = ("tokenizer.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
          "chat_template.jinja", "generation_config.json")


def _is_quant(x) -> bool:
    return isinstance(x, QuantArray)


def weight_names(cfg: ModelConfig) -> gemma.Weights:
    """The Weights tree of `cfg` with each leaf replaced by its Hugging Face name (without the model prefix)."""
    return gemma.build_weights(cfg, lambda name: name)


def _named_leaves(cfg: ModelConfig, weights: gemma.Weights) -> list[tuple[str, Any]]:
    """[(HF name, leaf)] in tree order; QuantArrays are leaves. Raises if the tree does not match `cfg`."""
    names, ndef = jax.tree_util.tree_flatten(weight_names(cfg))
    leaves, wdef = jax.tree_util.tree_flatten(weights, is_leaf=_is_quant)
    if ndef != wdef:
        raise CheckpointError(f"weights do not have the structure of config {cfg.name or cfg.model_type}: "
                              f"{len(leaves)} leaves, expected {len(names)}")
    return list(zip(names, leaves))


def _spec(a) -> dict:
    return {"shape": [int(d) for d in a.shape], "dtype": jnp.dtype(a.dtype).name}


def _static_fields(q: QuantArray) -> dict[str, Any]:
    """Every static (non-pytree) field of a QuantArray as JSON values: kind, shape, group, dtype and whatever
    array.py adds later (e.g. act_group), so a converted checkpoint keeps all of them; not the ones that exist only
    while a sharded step is traced (metadata "runtime": tp, act_axis)."""
    out = {}
    for f in dataclasses.fields(q):
        if f.metadata.get("static") and not f.metadata.get("runtime"):
            v = getattr(q, f.name)
            out[f.name] = jnp.dtype(v).name if f.name == "dtype" else list(v) if isinstance(v, tuple) else v
    return out


def manifest(cfg: ModelConfig, weights: gemma.Weights) -> dict[str, dict]:
    """{HF name: entry}: plain leaves {"shape", "dtype"}; QuantArrays their static fields ("kind", "shape"
    (logical), "group", "dtype" (of the weight), ...) plus "values" / "scale": {"shape", "dtype"}."""
    out = {}
    for name, leaf in _named_leaves(cfg, weights):
        if _is_quant(leaf):
            out[name] = {**_static_fields(leaf), "values": _spec(leaf.values), "scale": _spec(leaf.scale)}
        else:
            out[name] = _spec(leaf)
    return out


def summarize(cfg: ModelConfig, weights: gemma.Weights) -> dict[str, dict[str, int]]:
    """{"int8" | "int4" | "plain": {"tensors", "bytes", "bytes_before"}}: bytes held now, and what the tensors
    would hold unquantized in the dtype each QuantArray records."""
    out: dict[str, dict[str, int]] = {}
    for _, leaf in _named_leaves(cfg, weights):
        key = leaf.kind if _is_quant(leaf) else "plain"
        d = out.setdefault(key, {"tensors": 0, "bytes": 0, "bytes_before": 0})
        d["tensors"] += 1
        if _is_quant(leaf):
            d["bytes"] += leaf.nbytes
            d["bytes_before"] += int(np.prod(leaf.shape)) * leaf.dtype.itemsize
        else:
            n = int(np.prod(leaf.shape)) * jnp.dtype(leaf.dtype).itemsize
            d["bytes"] += n
            d["bytes_before"] += n
    return out


# ------------------------------------------------------------------------------------------------ save
def _json_default(o):
    if hasattr(o, "tolist"):
        return o.tolist()
    raise TypeError(f"{type(o).__name__} is not JSON serializable")


def _strip_quantization(hf: dict) -> dict:
    hf = json.loads(json.dumps(hf, default=_json_default))  # deep copy, numpy values made plain
    hf.pop("quantization_config", None)
    if isinstance(hf.get("text_config"), dict):
        hf["text_config"].pop("quantization_config", None)
    return hf


def _write_tokenizer(out: Path, source: str | None) -> list[str]:
    """Copy or build the tokenizer and chat-template files of `source` into `out`; returns the files written."""
    if source is None:
        return []
    src = Path(source)
    written = []
    if src.is_file() and src.suffix == ".gguf":
        from gemmajax.tools.tokenizer import gguf_to_sp, read_gguf_metadata
        (out / "tokenizer.model").write_bytes(gguf_to_sp(src))  # what load_tokenizer(gguf) builds
        written.append("tokenizer.model")
        meta = read_gguf_metadata(src)
        tokens = meta.get("tokenizer.ggml.tokens") or []
        tok_cfg = {}
        for key in ("bos", "eos", "pad", "unk"):
            tid = meta.get(f"tokenizer.ggml.{key}_token_id")
            if tid is not None and 0 <= int(tid) < len(tokens):
                tok_cfg[f"{key}_token"] = tokens[int(tid)]
        (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=1))
        written.append("tokenizer_config.json")
        template = meta.get("tokenizer.chat_template")
        if isinstance(template, str) and template:
            (out / "chat_template.jinja").write_text(template, encoding="utf-8")
            written.append("chat_template.jinja")
        return written
    src_dir = src if src.is_dir() else src.parent
    for name in COPIED:
        if (src_dir / name).is_file():
            shutil.copyfile(src_dir / name, out / name)
            written.append(name)
    return written


def save_converted(out_dir: str | os.PathLike, model: Model, tokenizer_source: str | os.PathLike | None = None,
                   *, hf_config: dict | None = None, source: str | None = None) -> str:
    """Write `model` (a loaded, possibly quantized `Model`) as a converted checkpoint directory.

    Args:
      out_dir: the directory to create; it must not exist or be empty.
      model: from `load_model(src, dtype=..., quant=...)`; its weights are written as they are (bit for bit).
      tokenizer_source: the source checkpoint (directory or .gguf) whose tokenizer / chat template files go beside
        the weights (default: model.path). A GGUF's vocabulary becomes tokenizer.model, its embedded template
        chat_template.jinja.
      hf_config: the source's HF config dict (default: read again from model.path).
      source: recorded in gemmajax.json (default: model.path).
    Returns: out_dir.
    """
    import orbax.checkpoint as ocp

    out = Path(out_dir).absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out}: exists and is not an empty directory; choose a new output directory")
    src = model.path
    if hf_config is None:
        if src is None:
            raise ValueError("save_converted: the model has no source path; pass hf_config")
        hf_config = open_checkpoint(src).hf_config
    hf = _strip_quantization(hf_config)
    rebuilt = ModelConfig.from_hf(hf, name=model.config.name)
    if rebuilt != model.config:
        raise CheckpointError(f"{src}: its config.json does not rebuild the model's config "
                              f"({rebuilt} != {model.config}); pass the source's hf_config")
    entries = manifest(model.config, model.weights)
    out.mkdir(parents=True, exist_ok=True)
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(out / WEIGHTS_DIR, model.weights)
    ckptr.wait_until_finished()
    ckptr.close()
    (out / "config.json").write_text(json.dumps(hf, indent=1, default=_json_default))
    tok_src = tokenizer_source if tokenizer_source is not None else src
    files = _write_tokenizer(out, None if tok_src is None else os.fspath(tok_src))
    from gemmajax.model.compressed_tensors import quantization_config
    src_quant = quantization_config(hf_config)
    kind = "gguf" if str(src).endswith(".gguf") else "compressed-tensors" if src_quant else "hf"
    meta = {"format": FORMAT, "quant": model.quant, "dtype": jnp.dtype(model.dtype).name,
            "source": os.fspath(source or src) if (source or src) else None, "source_kind": kind,
            "source_quantization_config": src_quant, "files": files,
            "weights": WEIGHTS_DIR, "tensors": entries}
    (out / META_FILE).write_text(_dump_meta(meta))  # written last: its presence marks the directory complete
    return os.fspath(out_dir)


def _dump_meta(meta: dict) -> str:
    """gemmajax.json text: indented, one line per tensor entry."""
    head = json.dumps({k: v for k, v in meta.items() if k != "tensors"}, indent=1, default=_json_default)
    rows = [f" {json.dumps(k)}: {json.dumps(v, default=_json_default)}" for k, v in meta["tensors"].items()]
    return head[:-2] + ',\n "tensors": {\n' + ",\n".join(" " + r for r in rows) + "\n }\n}\n"


# ------------------------------------------------------------------------------------------------ load
def _abstract(entry: dict, name: str, sharding) -> jax.ShapeDtypeStruct | QuantArray:
    def sds(spec):
        return jax.ShapeDtypeStruct(tuple(spec["shape"]), jnp.dtype(spec["dtype"]), sharding=sharding)
    try:
        if "kind" in entry:
            static = {k: v for k, v in entry.items() if k not in ("values", "scale")}
            static["shape"], static["dtype"] = tuple(static["shape"]), jnp.dtype(static["dtype"])
            return QuantArray(sds(entry["values"]), sds(entry["scale"]), **static)
        return sds(entry)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{META_FILE}: bad entry for tensor {name}: {entry!r} ({e})") from e


def _scheme(quant: str) -> str:
    """A quant string in canonical form ("W8A8+EMB4 " -> "w8a8+emb4"); other strings (a compressed-tensors
    source's description) as they are."""
    from gemmajax.quant.quantize import parse_quant
    try:
        return parse_quant(quant).name
    except ValueError:
        return quant


def load_converted(path: str | os.PathLike, expect_quant: str | None = None
                   ) -> tuple[ModelConfig, gemma.Weights, dict]:
    """Restore a directory written by `save_converted`: (ModelConfig, Weights on the default device, meta).

    Nothing is re-quantized: the tree is restored with the QuantArrays it was saved with. `expect_quant`
    (e.g. the `quant` a caller asked for) must be "none" / None or the scheme the directory holds."""
    import orbax.checkpoint as ocp

    p = Path(path).absolute()
    try:
        meta = json.loads((p / META_FILE).read_text())
        hf = json.loads((p / "config.json").read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"{p}: not a converted checkpoint ({e.filename} missing)") from e
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{p / META_FILE}: format {meta.get('format')!r}, this gemmajax reads format {FORMAT}")
    stored = meta.get("quant", "none")
    if expect_quant not in (None, "", "none") and _scheme(expect_quant) != _scheme(stored):
        raise CheckpointError(f"{p}: holds weights already quantized as {stored!r}, but quant={expect_quant!r} was "
                              f"asked for; load it with quant='none' (or {stored!r}), or convert the source again")
    cfg = ModelConfig.from_hf(hf, name=p.name)
    dtype = jnp.dtype(meta.get("dtype", "bfloat16"))
    entries = meta.get("tensors") or {}
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    names, treedef = jax.tree_util.tree_flatten(weight_names(cfg))
    expected = jax.tree_util.tree_leaves(gemma.abstract_weights(cfg, dtype))
    problems, leaves = [], []
    for name, want in zip(names, expected):
        if name not in entries:
            problems.append(f"  missing tensor {name}: expected shape {tuple(want.shape)}")
            continue
        leaf = _abstract(entries[name], name, sharding)
        if tuple(leaf.shape) != tuple(want.shape):
            problems.append(f"  wrong shape {name}: expected {tuple(want.shape)}, found {tuple(leaf.shape)}")
        leaves.append(leaf)
    extra = sorted(set(entries) - set(names))
    problems += [f"  unexpected tensor {n}" for n in extra]
    if problems:
        raise CheckpointError(f"{p / META_FILE} does not match its config.json ({cfg.model_type}, "
                              f"{cfg.num_layers} layers):\n" + "\n".join(problems))
    target = jax.tree_util.tree_unflatten(treedef, leaves)
    ckptr = ocp.StandardCheckpointer()
    try:
        weights = ckptr.restore(p / meta.get("weights", WEIGHTS_DIR), target)
    finally:
        ckptr.close()
    return cfg, weights, meta


__all__ = ["FORMAT", "META_FILE", "load_converted", "manifest", "save_converted", "summarize", "weight_names"]
