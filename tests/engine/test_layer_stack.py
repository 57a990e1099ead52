"""runner.stack_layers: the engine's CPU form of the weights (quantized projections and norms stacked over the
layers, so a step takes ~20 weight arguments instead of hundreds) must hold the same numbers and give the same
outputs. Cases are drawn at random (seeded) from every model variant x quantization x dtype; each is held to the
same engine with the layers left apart: every layer's leaves bit for bit, and the same greedy tokens, sampled tokens
and logprobs (the full logits' log-softmax) from a batch that mixes prefill chunks and decodes."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gemmajax
from gemmajax.engine.llm_engine import EngineConfig, LLMEngine
from gemmajax.engine.runner import LayerStack, stack_layers
from gemmajax.quant.array import QuantArray
from tests.engine.engine_run import assert_same_mixed_batch, small_engine_mixed_batch
from tests.golden.hf_models import GEMMA3, VARIANTS, build_hf_config, save_text_checkpoint

QUANTS = ("none", "w8a8", "w4a16", "w8a8+emb4", "w4a16+emb8", "w8a8+emb8")
SPACE = [(v, q, d) for v in (*sorted(VARIANTS), "gemma3") for q in QUANTS for d in ("float32", "bfloat16")]
CASES = [SPACE[i] for i in np.random.default_rng(20261205).choice(len(SPACE), size=4, replace=False)]
# the engine comparison draws from the cases whose layers have int8 projections (the ones stacked): w8a8*
INT8_SPACE = [c for c in SPACE if c[1].startswith("w8a8")]
ENGINE_CASE = INT8_SPACE[np.random.default_rng(20261206).integers(len(INT8_SPACE))]


def _model(tmp_path_factory, variant, quant, dtype):
    text = dict(GEMMA3, family="gemma3") if variant == "gemma3" else dict(VARIANTS[variant], family="gemma4")
    m, cfg = build_hf_config(text, seed=5)
    path = save_text_checkpoint(m, cfg, str(tmp_path_factory.mktemp(variant)))
    return gemmajax.load_model(path, dtype=dtype, quant=quant)


def _layer_leaves(lw):
    """(static description, arrays) of every leaf of one LayerWeights, QuantArrays with their metadata."""
    out = []
    for x in jax.tree.leaves(lw, is_leaf=lambda a: isinstance(a, QuantArray)):
        if isinstance(x, QuantArray):
            out.append((("q", x.kind, x.shape, x.group, x.dtype, x.act_group), (x.values, x.scale)))
        else:
            out.append(((tuple(x.shape), x.dtype), (x,)))
    return out


def _same_layers(a, b):
    assert len(a) == len(b)
    for i, (la, lb) in enumerate(zip(a, b)):
        assert jax.tree.structure(la, is_leaf=lambda x: isinstance(x, QuantArray)) == \
            jax.tree.structure(lb, is_leaf=lambda x: isinstance(x, QuantArray)), i
        for (ma, xa), (mb, xb) in zip(_layer_leaves(la), _layer_leaves(lb)):
            assert ma == mb, (i, ma, mb)
            for u, v in zip(xa, xb):
                assert u.dtype == v.dtype and np.array_equal(np.asarray(u), np.asarray(v)), (i, ma)


@pytest.mark.parametrize("variant,quant,dtype", CASES)
def test_stacked_layers_hold_the_same_weights(tmp_path_factory, variant, quant, dtype):
    model = _model(tmp_path_factory, variant, quant, dtype)
    w = model.weights
    for kinds in (("int8",), ("int8", "int4")):
        s = stack_layers(w, kinds)
        assert isinstance(s.layers, LayerStack) and len(s.layers) == len(w.layers)
        _same_layers(s.layers.layers(), w.layers)
        assert s.embed is w.embed and s.final_norm is w.final_norm
        # fewer leaves: every group of two or more alike layers keeps one copy of each norm vector
        assert len(jax.tree.leaves(s)) < len(jax.tree.leaves(w))
        # a stacked tree goes through jit as a pytree (flatten / unflatten keep the layers)
        back = jax.jit(lambda t: t)(s)
        _same_layers(back.layers.layers(), w.layers)
    assert stack_layers(s) is s


def test_stacking_with_a_parallel_plan_is_refused(tmp_path_factory, gemma4_tokenizer):
    model = _model(tmp_path_factory, "gemma3", "w8a8", "float32")
    with pytest.raises(ValueError, match="stack_layers=True with a parallel plan"):
        LLMEngine(model.config, model.weights, gemma4_tokenizer, EngineConfig(
            max_model_len=64, max_num_seqs=2, kv_cache_memory=1 << 22, stack_layers=True, parallel=object()))


def test_uniform_model_stacks_every_int8_leaf(tmp_path_factory):
    """Gemma 3's layers are all alike: in w8a8 every layer leaf is stacked (one group, nothing left per layer),
    so the tree has the top-level leaves plus one layer's worth; int4 projections stay one leaf per layer."""
    model = _model(tmp_path_factory, "gemma3", "w8a8", "float32")
    w, n = model.weights, len(model.weights.layers)
    per_layer = len(jax.tree.leaves(w.layers[0]))
    top = len(jax.tree.leaves(w)) - n * per_layer
    s = stack_layers(w)
    assert s.layers.loose == ((),) * n and len(s.layers.stacked) == 1
    assert len(jax.tree.leaves(s)) == top + per_layer
    q4 = _model(tmp_path_factory, "gemma3", "w4a16", "float32").weights
    s4 = stack_layers(q4)          # int8 only by default: the 7 int4 projections stay apart
    assert all(len(loose) == 7 and all(isinstance(x, QuantArray) and x.kind == "int4" for x in loose)
               for loose in s4.layers.loose)
    per_layer4 = len(jax.tree.leaves(q4.layers[0]))
    assert len(jax.tree.leaves(stack_layers(q4, ("int8", "int4")))) == len(jax.tree.leaves(q4)) - (n - 1) * per_layer4


def _run(model, tok, stack: bool):
    eng, out = small_engine_mixed_batch(model, tok, 7, stack_layers=stack)
    assert isinstance(eng.runner.weights.layers, LayerStack) == stack
    return out


@pytest.mark.parametrize("variant,quant,dtype", [ENGINE_CASE])
def test_engine_outputs_equal_with_layers_apart(tmp_path_factory, gemma4_tokenizer, variant, quant, dtype):
    model = _model(tmp_path_factory, variant, quant, dtype)
    stacked_leaves = [x for group in stack_layers(model.weights).layers.stacked for x in group]
    assert any(isinstance(x, QuantArray) and x.kind == "int8" for x in stacked_leaves)   # int8 projections stacked
    apart = _run(model, gemma4_tokenizer, False)
    stacked = _run(model, gemma4_tokenizer, True)
    assert_same_mixed_batch(apart, stacked, atol=1e-6)


def test_llm_stacks_by_default_on_cpu_and_shows_the_standard_tree(tmp_path_factory, gemma4_tokenizer):
    """On XLA:CPU `LLM` stacks by default (its engine holds the stacked tree) and `llm.model.weights` is still the
    standard tree: every leaf equal to a fresh load's, and `llm.model.logits` (which runs on that tree) equal to the
    fresh model's. (The stacked step's outputs are held to the unstacked engine's above.)"""
    assert jax.default_backend() == "cpu"
    text = dict(GEMMA3, family="gemma3")
    m, cfg = build_hf_config(text, seed=5)
    path = save_text_checkpoint(m, cfg, str(tmp_path_factory.mktemp("llm")))
    llm = gemmajax.LLM(path, quant="w8a8", dtype="bfloat16", tokenizer=gemma4_tokenizer, max_model_len=64,
                       max_num_seqs=2, kv_cache_memory=1 << 22)
    fresh = gemmajax.load_model(path, dtype="bfloat16", quant="w8a8")
    layers = llm.model.engine_weights.layers
    assert isinstance(layers, LayerStack)
    n = len(fresh.weights.layers)
    int8 = [x for x in layers.stacked[0] if isinstance(x, QuantArray)]
    # o and down, and q / k / v and gate / up each joined (gemma.fuse_projections, the CPU engine's form)
    assert len(int8) == 4 and all(x.kind == "int8" and x.shape[0] == n and x.values.dtype == jnp.int8 for x in int8)
    w = llm.model.weights
    assert isinstance(w.layers, tuple)
    _same_layers(w.layers, fresh.weights.layers)
    ids = np.arange(3, 15)[None]
    np.testing.assert_array_equal(llm.model.logits(ids), fresh.logits(ids))
