"""The CPU word layout of int4 weights (quant/array.py: values uint32, nibble i of word d = column 8d + i), which the
engine gives a CPU's dense int4 weights: the same numbers as the half-split bytes, every matmul path gives the
reference's bits on exact data, the compiled CPU forms keep the structure their speed depends on, and the engine's
outputs equal those of the half-split layout."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemmajax.quant import QuantArray, dequantize, int4_matmul, int4_matmul_ref, quantize
from gemmajax.quant.array import (
    int4_halves_tree,
    int4_to_halves,
    int4_to_words,
    int4_words_tree,
    pack_int4,
    unpack_int4,
)
from gemmajax.quant.int4_matmul import int4_matmul_gpu, int4_matmul_pallas, int4_matmul_xla
from gemmajax.quant.quantize import dequantize_rows, quantize_table
from tests.quant.test_int4_matmul import INTERPRET, _exact_case


def _random_weights(seed: int, count: int):
    """int4 QuantArrays drawn from the space: leading dims, out, in (not a multiple of anything), group, a vocabulary
    table's padding, bf16 or float32 scales."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        lead = [(), (2,), (3, 2)][rng.integers(3)]
        n, k = int(rng.integers(1, 300)), int(rng.integers(1, 700))
        w = jnp.asarray(rng.standard_normal((*lead, n, k)) * 0.1, jnp.float32)
        if not lead and rng.integers(2):
            out.append(quantize_table(w.astype(jnp.bfloat16), 4))
        else:
            group = int(rng.choice([8, 32, 64, 128]))
            out.append(quantize(w, "int4", group, scale_dtype=[jnp.bfloat16, jnp.float32][rng.integers(2)]))
    return out


def test_word_bit_order_by_hand():
    """Row 0's levels -8..7 over columns 0..15 (biased 0..15): word 0 holds nibbles 0..7 from its low bits up, word 1
    8..15; the hexadecimal digits read from the top are the columns from 7 (15) down to 0 (8)."""
    levels = jnp.asarray(np.tile(np.arange(-8, 8), (2, 4)), jnp.int8)  # [2, 64]
    q = QuantArray(pack_int4(levels), jnp.ones((2, 2), jnp.bfloat16), "int4", (2, 64), 32, jnp.bfloat16)
    w = int4_to_words(q)
    assert w.words and w.values.dtype == jnp.uint32 and w.values.shape == (2, 8) and w.padded_in == 64
    assert [int(v) for v in w.values[0, :2]] == [0x76543210, 0xFEDCBA98]
    assert np.array_equal(np.asarray(unpack_int4(w.values)), np.asarray(levels))


@pytest.mark.parametrize("seed", [0])
def test_words_hold_the_same_numbers(seed):
    for q in _random_weights(seed, 12):
        w = int4_to_words(q)
        assert w.words and not q.words and w.values.dtype == jnp.uint32
        assert w.values.shape == (*q.values.shape[:-1], q.padded_in // 8) and w.padded_in == q.padded_in
        assert (w.shape, w.group, w.short_scales, w.nbytes) == (q.shape, q.group, q.short_scales, q.nbytes)
        assert np.array_equal(np.asarray(dequantize(w, jnp.float32)), np.asarray(dequantize(q, jnp.float32)))
        assert np.array_equal(np.asarray(int4_to_halves(w).values), np.asarray(q.values))
        assert int4_to_words(w) is w and int4_to_halves(q) is q
        if q.ndim == 2:
            ids = jnp.asarray([0, q.shape[0] - 1, q.shape[0] // 2])
            assert np.array_equal(np.asarray(dequantize_rows(w, ids)), np.asarray(dequantize_rows(q, ids)))


def test_words_refuse_what_they_cannot_hold():
    """A group of 4 columns would put two scales in one word: the weight stays in bytes. int4 values of another
    dtype are refused with the dtypes named."""
    levels = jnp.zeros((3, 16), jnp.int8)
    q = QuantArray(pack_int4(levels), jnp.ones((3, 4), jnp.bfloat16), "int4", (3, 16), 4, jnp.bfloat16)
    assert int4_to_words(q) is q
    with pytest.raises(ValueError, match="uint8.*uint32.*got int32"):
        QuantArray(jnp.zeros((3, 8), jnp.int32), jnp.ones((3, 2), jnp.bfloat16), "int4", (3, 64), 32)
    with pytest.raises(ValueError, match="word layout.*multiple of 8, got 4"):
        QuantArray(jnp.zeros((3, 2), jnp.uint32), jnp.ones((3, 4), jnp.bfloat16), "int4", (3, 16), 4)
    with pytest.raises(ValueError, match=r"in / 8 \(uint32\)"):
        QuantArray(jnp.zeros((3, 2), jnp.uint32), jnp.ones((3, 2), jnp.bfloat16), "int4", (3, 64), 32)


def test_repacking_a_table_in_row_chunks(monkeypatch):
    """Outside a trace the repack goes by chunks of rows (a bounded temporary); the chunks, the last one partial, put
    together give the whole table's words and bytes back."""
    import gemmajax.quant.array as qa
    monkeypatch.setattr(qa, "_REPACK_ROWS", 64)
    q = quantize_table(jnp.asarray(np.random.default_rng(4).standard_normal((300, 96)), jnp.bfloat16), 4)
    w = int4_to_words(q)
    assert np.array_equal(np.asarray(unpack_int4(w.values)), np.asarray(unpack_int4(q.values)))
    assert np.array_equal(np.asarray(int4_to_halves(w).values), np.asarray(q.values))


FORMS = ("rows", "tiles", "auto")  # "dense" is another name of "tiles"


@pytest.mark.parametrize("m", [1, 16, 129])
def test_every_path_gives_the_reference_bits_on_exact_data(m):
    """Integer activations and power-of-two scales (every product and sum exact): each CPU form, with and without bf16
    hardware (the tile the GEMM's left operand up to 128 rows, its right one above), bf16 and float32 x, a weight of
    one tile and one with the tile loop and its tail; and the dispatcher, the GPU form and the Pallas kernel
    (interpreted; both repack the words into bytes): the reference's bits."""
    for n in (1000, 2 * 8192 + 2048 + 300):
        xe0, qe = _exact_case(m, 256, n, seed=90 + m)
        we = int4_to_words(qe)
        for xd in (jnp.bfloat16, jnp.float32):
            xe = xe0.astype(xd)
            exact = np.asarray(int4_matmul_ref(xe, qe).astype(jnp.float32))
            paths = {(f, b): (lambda x, q, f=f, b=b: int4_matmul_xla(x, q, form=f, bf16_dot=b))
                     for f in FORMS for b in (False, True) if f != "rows" or (n == 1000 and m <= 16)}
            paths["dispatch"] = lambda x, q: int4_matmul(x, q, "auto")
            if n == 1000:
                paths["gpu"] = int4_matmul_gpu
                if m <= 16:
                    paths["pallas"] = lambda x, q: int4_matmul_pallas(x, q, interpret=INTERPRET)
            for name, f in paths.items():
                y = jax.jit(f)(xe, we)
                assert y.dtype == xd and np.array_equal(np.asarray(y.astype(jnp.float32)), exact), (n, xd, name)


@pytest.mark.parametrize("group,k", [(8, 200), (64, 200), (128, 300), (32, 16)])
def test_exact_bits_with_other_groups_and_a_partial_group(group, k):
    """Groups of 8, 64 and 128 columns and inputs that end inside a group (zero levels after k): every form gives the
    reference's bits on exact data (a fixed 4 words per group, or live columns rounded down, fails)."""
    rng = np.random.default_rng(group + k)
    in_p, n = -(-k // (2 * group)) * 2 * group, 1000
    lv = np.zeros((n, in_p), np.int8)
    lv[:, :k] = rng.integers(-8, 8, (n, k))
    q = QuantArray(pack_int4(jnp.asarray(lv)), jnp.asarray(2.0 ** rng.integers(-6, 0, (n, in_p // group)),
                   jnp.bfloat16), "int4", (n, k), group, jnp.bfloat16)
    w = int4_to_words(q)
    for m in (1, 16):
        x = jnp.asarray(rng.integers(-4, 5, (m, k)), jnp.bfloat16)
        exact = np.asarray(int4_matmul_ref(x, q).astype(jnp.float32))
        for f in FORMS:
            y = jax.jit(lambda x, w, f=f: int4_matmul_xla(x, w, form=f, bf16_dot=False))(x, w)
            assert np.array_equal(np.asarray(y.astype(jnp.float32)), exact), (group, k, m, f)


@pytest.mark.parametrize("form", ["rows", "tiles"])
def test_table_padding_is_never_read(form):
    """A vocabulary table padded from in 640 to 768: its padding groups' scales set to NaN; the word forms skip
    them (a NaN in any output means they were multiplied)."""
    rng = np.random.default_rng(5)
    q = quantize_table(jnp.asarray(rng.standard_normal((300, 640)) * 0.05, jnp.bfloat16), 4)
    q = dataclasses.replace(q, scale=q.scale.at[:, 640 // 32:].set(jnp.nan))
    w = int4_to_words(q)
    for m in (1, 3):
        x = jnp.asarray(rng.standard_normal((m, 640)), jnp.bfloat16)
        y = jax.jit(lambda x, w: int4_matmul_xla(x, w, form=form, bf16_dot=False))(x, w)
        ref = int4_matmul_ref(x, q)
        assert bool(jnp.all(jnp.isfinite(ref))) and bool(jnp.all(jnp.isfinite(y))), m
        np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(ref, np.float32), rtol=2**-7, atol=2**-7)


def _compiled(f, *args) -> str:
    return jax.jit(f).lower(*args).compile().as_text()


def test_compiled_forms_keep_their_structure():
    """What the word forms' speed depends on, in the optimized CPU program:
    - one row: a single dot (one pass over the words, no byte widening);
    - the tiles loop without bf16 hardware: every GEMM puts the dequantized tile first (W . x^T, f32[2048,16]; XLA
      folds the transpose back into x . W^T without the barrier, and YNNPACK then repacks every tile), and the lane
      shifts stay inside the loop's dequantization (hoisted, they become a u32[8] array read per element in scalar
      code: the 16-row LM head 2.5x slower)."""
    rng = np.random.default_rng(3)
    w = int4_to_words(quantize(jnp.asarray(rng.standard_normal((16384, 640)) * 0.05, jnp.float32), "int4"))
    x1 = jnp.asarray(rng.standard_normal((1, 640)), jnp.bfloat16)
    one = _compiled(lambda x, w: int4_matmul_xla(x, w, bf16_dot=False), x1, w)
    assert one.count(" dot(") == 1 and "u8[" not in one, one
    x16 = jnp.asarray(rng.standard_normal((16, 640)), jnp.bfloat16)
    tiles = _compiled(lambda x, w: int4_matmul_xla(x, w, bf16_dot=False), x16, w)
    dots = [ln.split("=")[1].split()[0] for ln in tiles.splitlines() if " dot(" in ln]
    assert dots and all(d.startswith("f32[2048,16]") for d in dots), dots
    assert "u32[8]" not in tiles and "u8[" not in tiles, "hoisted shifts, or a fall back to bytes"
    from gemmajax.quant.ops import linear
    for x in (x1, x16):  # the engine's entry points keep the words too
        for f in (lambda x, w: int4_matmul(x, w), linear):
            assert "u8[" not in _compiled(f, x, w)


def test_weight_trees_convert_only_dense_int4():
    rng = np.random.default_rng(8)
    dense = quantize(jnp.asarray(rng.standard_normal((64, 96)), jnp.float32), "int4")
    experts = quantize(jnp.asarray(rng.standard_normal((3, 64, 96)), jnp.float32), "int4")
    int8 = quantize(jnp.asarray(rng.standard_normal((64, 96)), jnp.float32), "int8")
    plain = jnp.ones((4,))
    tree = {"a": dense, "b": [experts, int8], "c": plain}
    got = int4_words_tree(tree)
    assert got["a"].words and not got["b"][0].words and got["b"][1] is int8 and got["c"] is plain
    back = int4_halves_tree(got)
    assert not back["a"].words and np.array_equal(np.asarray(back["a"].values), np.asarray(dense.values))



def test_engine_gives_cpu_int4_weights_words_and_the_same_outputs(tmp_path_factory, gemma4_tokenizer, monkeypatch):
    """On XLA:CPU the engine holds every dense int4 weight in words (and the LM head of +emb4); its greedy tokens,
    seeded samples and logprobs equal those of the same engine kept in half-split bytes (float32 model: only the
    order of the float32 sums differs). The variant is drawn (seeded) from the model space."""
    import gemmajax.engine.llm_engine as le
    from tests.engine.test_layer_stack import _model, _run
    from tests.golden.hf_models import VARIANTS
    space = [*sorted(VARIANTS), "gemma3"]
    variant = space[np.random.default_rng(20261206).integers(len(space))]
    model = _model(tmp_path_factory, variant, "w4a16+emb4", "float32")
    held, runner = [], le.ModelRunner
    monkeypatch.setattr(le, "ModelRunner", lambda w, spec: held.append(w) or runner(w, spec))
    words = _run(model, gemma4_tokenizer, True)
    leaves = jax.tree.leaves(dataclasses.replace(held[0], ple_table=None), is_leaf=lambda x: isinstance(x, QuantArray))
    int4 = [x for x in leaves if isinstance(x, QuantArray) and x.kind == "int4" and x.ndim == 2]
    assert len(held) == 1 and held[0].embed.words and all(x.words for x in int4), [x for x in int4 if not x.words]
    assert held[0].ple_table is None or not held[0].ple_table.words  # gathered only: stays in bytes
    monkeypatch.setattr(le, "int4_words_tree", lambda tree: tree)
    halves = _run(model, gemma4_tokenizer, True)
    for (ta, la), (tb, lb) in zip(words, halves):
        assert ta == tb and len(ta) == 8, variant
        assert [a["token_id"] for a in la] == [b["token_id"] for b in lb]
        np.testing.assert_allclose([a["logprob"] for a in la], [b["logprob"] for b in lb], rtol=0, atol=1e-4)


def test_llm_model_weights_show_half_split_bytes(tmp_path_factory, gemma4_tokenizer):
    """LLM.model.weights is the standard tree: the engine holds words, the property gives every int4 leaf back in the
    bytes of a fresh load, bit for bit."""
    import gemmajax
    from tests.engine.test_layer_stack import _same_layers
    from tests.golden.hf_models import GEMMA3, build_hf_config, save_text_checkpoint
    m, cfg = build_hf_config(dict(GEMMA3, family="gemma3"), seed=5)
    path = save_text_checkpoint(m, cfg, str(tmp_path_factory.mktemp("llm4")))
    llm = gemmajax.LLM(path, quant="w4a16+emb4", dtype="float32", tokenizer=gemma4_tokenizer, max_model_len=64,
                       max_num_seqs=2, kv_cache_memory=1 << 22)
    assert llm.model.engine_weights.embed.words
    fresh = gemmajax.load_model(path, dtype="float32", quant="w4a16+emb4")
    w = llm.model.weights
    assert w.embed.values.dtype == jnp.uint8
    assert np.array_equal(np.asarray(w.embed.values), np.asarray(fresh.weights.embed.values))
    _same_layers(w.layers, fresh.weights.layers)
