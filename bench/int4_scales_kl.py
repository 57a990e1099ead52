"""Model quality of the int4 scale search on the real Gemma 3 270M: teacher-forced over the test text
(tests/model/test_real_gemma3.py), top-1 agreement with the float32 model and mean KL(float32 || quantized), for
w4a16 and w4a16+emb4, with the searched 5-bit scales ("searched", quantize.int4_scales) or the former plain
bf16(max|g| / 7) scales ("former", patched in). One scheme per process (jit caches the quantizer):

    JAX_PLATFORMS=cpu .venv/bin/python bench/int4_scales_kl.py searched
    JAX_PLATFORMS=cpu .venv/bin/python bench/int4_scales_kl.py former
"""
import importlib
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gemmajax
from gemmajax.model.gguf import default_model_path
from tests.model.test_real_gemma3 import TEXT, _log_softmax

Q = importlib.import_module("gemmajax.quant.quantize")


def former_scales(g):
    """bf16(max|g| / 7); quantize() derives the levels from the stored scale when short_scales is off."""
    return jnp.max(jnp.abs(g), axis=-1) / 7, jnp.zeros_like(g)


def main(scheme: str) -> None:
    if scheme not in ("searched", "former"):
        raise SystemExit(f"scheme must be 'searched' or 'former', got {scheme!r}")
    path = default_model_path()
    ids = np.asarray([gemmajax.load_tokenizer(path).encode(TEXT, add_bos=True)])
    lr = _log_softmax(gemmajax.load_model(path, dtype="float32").logits(ids)[0])
    if scheme == "former":
        Q.int4_scales, Q.SHORT_SCALE_DTYPES = former_scales, ()
    for quant in ("w4a16", "w4a16+emb4"):
        lo = _log_softmax(gemmajax.load_model(path, dtype="float32", quant=quant).logits(ids)[0])
        kl = float((np.exp(lr) * (lr - lo)).sum(-1).mean())
        agree = float((lr.argmax(-1) == lo.argmax(-1)).mean())
        print(f"{scheme:9s} {quant:11s} top-1 agreement {agree:.3f}  mean KL {kl:.4f}  ({ids.shape[1]} tokens)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "searched")
