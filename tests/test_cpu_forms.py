"""The CPU-only forms chosen for speed compute what the plain forms compute: `dense_matmul_cpu` (one-row fusion and
native bf16 GEMM behind `quant.linear`), w4a16's "bf16" chunked GEMM, the decode attention defaults, and the engine's
in-step greedy argmax (against the sampler on the full logits)."""
import dataclasses
import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gemmajax
from gemmajax.engine.llm_engine import EngineConfig, LLMEngine
from gemmajax.engine.sample_batch import plain_greedy
from gemmajax.engine.sampling_params import SamplingParams
from gemmajax.quant import dequantize, linear, quantize
from gemmajax.quant.int4_matmul import int4_matmul_ref, int4_matmul_xla
from gemmajax.quant.ops import dense_matmul, dense_matmul_cpu, dense_matmul_cpu_f32

bf16, f32 = jnp.bfloat16, jnp.float32


def _rand(shape, dtype, seed, scale=1.0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape) * scale, dtype)


def _temp_and_out(fn, *args):
    """(temporary bytes XLA assigns to jit(fn) for args, its output as float32 numpy): one compile, one call."""
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled.memory_analysis().temp_size_in_bytes, np.asarray(compiled(*args).astype(f32))


def _ref(x, w) -> np.ndarray:
    """x @ w.T in float64 from the (already rounded) operands."""
    return np.asarray(x.astype(f32), np.float64) @ np.asarray(w.astype(f32), np.float64).T


def _close(y, ref, rtol):
    y = np.asarray(y.astype(f32), np.float64)
    err = np.abs(y - ref)
    bound = rtol * np.abs(ref) + rtol * 1e-2 * np.abs(ref).max()
    assert (err <= bound).all(), f"max error {err.max():.3g}, worst ratio {(err / bound).max():.3g}"


# ------------------------------------------------------------------------------------------------ plain weights
@pytest.mark.parametrize("dtype,rtol", [(bf16, 2.0 ** -8), (f32, 1e-5)])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("form", ["auto", "vector", "gemm", "tiles"])
def test_dense_cpu_forms_match_reference(dtype, rtol, m, form):
    x, w = _rand((m, 96), dtype, 0), _rand((200, 96), dtype, 1, 0.1)
    y = jax.jit(dense_matmul_cpu, static_argnames="form")(x, w, form=form)
    assert y.shape == (m, 200) and y.dtype == dtype
    _close(y, _ref(x, w), rtol)  # one rounding of a float32 sum: within one ulp of the exact product
    _close(jax.jit(dense_matmul)(x, w), _ref(x, w), rtol)  # the accelerators' form agrees with the same reference


def test_linear_takes_the_cpu_form_with_leading_dims():
    """bf16 x [2, 3, 64] through `linear` (the lowering-time CPU dispatch, reshaping the leading dims to 6 rows)
    against the float64 product of the same bf16 operands: within the one bf16 rounding of the output. A transposed
    weight, lost rows or a second rounding fail (out 48 != in 64, so a transposition cannot even run)."""
    x, w = _rand((2, 3, 64), bf16, 2), _rand((48, 64), bf16, 3, 0.1)
    y = jax.jit(linear)(x, w)
    assert y.shape == (2, 3, 48) and y.dtype == bf16
    want = _ref(x.reshape(6, 64), w).reshape(2, 3, 48)
    _close(y, want, 2.0 ** -8)
    assert np.abs(np.asarray(y.astype(f32)) - want).max() > 0  # bf16 output: the comparison is not vacuous
    with pytest.raises(ValueError, match="form must be"):
        dense_matmul_cpu(x, w, form="rows")


def _entry(fn, *args) -> str:
    """The ENTRY computation of fn's compiled CPU program (fusion bodies and branches are listed before it)."""
    txt = jax.jit(fn).lower(*args).compile().as_text()
    return txt[txt.index("ENTRY"):]


@pytest.mark.parametrize("m", [1, 16])
def test_cpu_forms_make_no_float32_copy_of_a_bf16_weight(m):
    """The point of the forms: XLA:CPU turns `jnp.dot(x_bf16, w.T)` into a float32 copy of the whole weight per call
    (the old code: 10-40x slower); the chosen forms read the bf16 weight directly ("vector", "gemm") or widen it
    one 2,048-row tile at a time ("tiles", taken at 16 rows on a CPU without bf16 hardware)."""
    x, w = _rand((1, m, 256), bf16, 4), _rand((4096, 256), bf16, 5, 0.1)
    copy = re.compile(r"= f32\[4096,256\]")
    assert not copy.search(_entry(linear, x, w)), "linear materialized a float32 copy of the weight"
    if m > 1:  # the check can fail: the plain form at several rows does copy
        assert copy.search(_entry(dense_matmul, x, w))


def _dot_shapes(f, *args) -> list[tuple]:
    """The output shapes of every dot_general in f's jaxpr."""
    out = []
    for e in jax.make_jaxpr(f)(*args).jaxpr.eqns:
        if e.primitive.name == "dot_general":
            out.append(tuple(e.outvars[0].aval.shape))
    return out


@pytest.mark.parametrize("out", [300, 2 * 2048, 2 * 2048 + 2048 + 100])  # one tile, two chains, three and a tail
@pytest.mark.parametrize("m", [1, 8, 16, 129])
def test_dense_tiles_are_exact_sums(out, m):
    """"tiles" (float32 tiles of the weight, each the left operand of its GEMM, in two chains): on integers small
    enough that every product and float32 sum is exact, exactly numpy's product, every output column in its place
    (a tile written to the wrong columns, lost, or a tail dropped fails); its dots are [tile, m] (W . x^T)."""
    from gemmajax.quant.ops import TILE_ROWS
    rng = np.random.default_rng(out + m)
    w = jnp.asarray(rng.integers(-8, 8, (out, 64)), bf16)
    x = jnp.asarray(rng.integers(-8, 8, (m, 64)), bf16)
    want = np.asarray(x, np.float32) @ np.asarray(w, np.float32).T
    f = lambda x, w: dense_matmul_cpu_f32(x, w, form="tiles")
    y = np.asarray(jax.jit(f)(x, w))
    assert y.shape == (m, out)
    np.testing.assert_array_equal(y, want)
    tiles = [min(TILE_ROWS, out - r0) for r0 in range(0, out, TILE_ROWS)]
    assert _dot_shapes(f, x, w) == [(t, m) for t in tiles]


@pytest.mark.parametrize("flag", ["0", "1"])
@pytest.mark.parametrize("m,shape,tiles", [
    (1, (6144, 640), False), (7, (6144, 640), False), (8, (6144, 640), True), (128, (6144, 640), True),
    (129, (6144, 640), False),  # rows outside TILES_MIN_M..LHS_MAX_M
    (16, (4097, 256), True),  # 2**20 elements and more than two tiles (the last of one row)
    (16, (4096, 256), False),  # exactly two tiles (Gemma 3 270M's gate and up joined): the GEMM
    (16, (8192, 96), False),  # four tiles, under 2**20 elements
    (16, (2048, 640), False), (16, (640, 2048), False),  # one tile: the GEMM (measured in the whole chain)
    (16, (6144, 640, f32), False)])  # a float32 weight: "gemm"
def test_dense_auto_form_by_hardware_rows_and_size(monkeypatch, flag, m, shape, tiles):
    """"auto" takes "tiles" only on a CPU without bf16 hardware (GEMMAJAX_CPU_BF16_DOT=0), for 8 to 128 rows of a
    16-bit weight of at least 2**20 elements in more than two tiles; else "vector" at one row and the bf16 GEMM. Told
    apart by their dots: tiles [2048, m] (W . x^T), the GEMM and the vector form [m, out]."""
    from gemmajax.quant.ops import LHS_MAX_M, TILES_MIN_M, TILES_MIN_OUT, TILES_MIN_SIZE
    assert (TILES_MIN_M, LHS_MAX_M, TILES_MIN_SIZE, TILES_MIN_OUT) == (8, 128, 1 << 20, 4097)  # the cases' premises
    monkeypatch.setenv("GEMMAJAX_CPU_BF16_DOT", flag)
    shape, wdt = shape[:2], (shape[2:] or (bf16,))[0]
    x, w = _rand((m, shape[1]), bf16, 40), _rand(shape, wdt, 41, 0.1)
    f = lambda x, w: dense_matmul_cpu_f32(x, w)
    dots = _dot_shapes(f, x, w)
    if tiles and flag == "0":
        assert dots == [(min(2048, shape[0] - r0), m) for r0 in range(0, shape[0], 2048)], dots
    else:
        assert dots == [(m, shape[0])], dots
    if m <= 16:  # float32 sums: within 1e-5 of the sum of |terms| (an error relative to the terms, not the result)
        err = np.abs(np.asarray(jax.jit(f)(x, w), np.float64) - _ref(x, w.astype(bf16)))  # "gemm" rounds w to bf16
        size = np.abs(np.asarray(x.astype(f32), np.float64)) @ np.abs(np.asarray(w.astype(f32), np.float64)).T
        assert (err <= 1e-5 * size).all(), (err / size).max()


def test_dense_tiles_keep_the_weight_on_the_left_when_compiled():
    """XLA folds a lone transposed product W . x^T back into x . W^T (YNNPACK then repacks every tile); the barrier
    stops it: the compiled program keeps float32 [2048, 16] products."""
    x, w = _rand((16, 256), bf16, 42), _rand((3 * 2048, 256), bf16, 43, 0.1)
    txt = _entry(lambda x, w: dense_matmul_cpu_f32(x, w, form="tiles"), x, w)
    assert len(re.findall(r"= f32\[2048,16\]\S* (?:dot|fusion)\(", txt)) == 3, txt


def test_dense_tiles_are_widened_one_chain_step_at_a_time(monkeypatch):
    """Each tile's float32 copy is ordered after the previous product of its chain (`after`): the temporary buffer
    holds about one tile per chain, where without the ordering XLA widens every tile at the program's start (the
    640 x 262,144 LM head: 635 MiB of temporaries against 21). Checked against the identity in place of `after`, which
    must hold them all (else this test proves nothing); the outputs are the same bits."""
    ops = importlib.import_module("gemmajax.quant.ops")
    x, w = _rand((16, 256), bf16, 44), _rand((8 * 2048, 256), bf16, 45, 0.1)
    tile_f32 = 2048 * 256 * 4

    tied, y = _temp_and_out(lambda x, w: ops._dense_tiles(x, w), x, w)
    monkeypatch.setattr(ops, "after", lambda x, w: w)
    hoisted, y_plain = _temp_and_out(lambda x, w: ops._dense_tiles(x, w), x, w)
    assert tied <= 3 * tile_f32, (tied, tile_f32)
    assert hoisted >= 6 * tile_f32, (hoisted, tile_f32)
    np.testing.assert_array_equal(y, y_plain)


# ------------------------------------------------------------------------------------------------ w4a16
def _int4_ref(x, w) -> np.ndarray:
    """x @ dequantize(w).T in float64 from x as given (its bf16 values for bf16 x)."""
    return _ref(x, dequantize(w, f32))


def _int4_close(y, x, w):
    """y within float32 accumulation (1e-5 of sum |x w|: a float32 sum's error is relative to its terms, not to a
    result that cancels) plus, for bf16 y, the one rounding of the output (2**-8 of |x w.T|) of the float64 oracle."""
    xd, wd = np.asarray(x.astype(f32), np.float64), np.asarray(dequantize(w, f32), np.float64)
    want, size = xd @ wd.T, np.abs(xd) @ np.abs(wd).T
    err = np.abs(np.asarray(y.astype(f32), np.float64) - want)
    bound = 1e-5 * size + (2.0 ** -8 * np.abs(want) if y.dtype == bf16 else 0)
    assert (err <= bound).all(), f"max error {err.max():.3g}, worst ratio {(err / bound).max():.3g}"


@pytest.mark.parametrize("dtype", [bf16, f32])
@pytest.mark.parametrize("n", [200, 2 * 2048 + 128])  # one tile / a loop over two 2,048-row tiles and a tail
def test_int4_tiles_form_matches_reference(n, dtype):
    """The dequantized tiles' GEMMs ("tiles"; "bf16" is its old name, bf16 x only): x [5, 128] times the exactly
    dequantized weight (native bf16 products for bf16 x, float32 for float32 x), against float64: within the one
    rounding of the output (the products are exact, the sum is float32)."""
    w = quantize(_rand((n, 128), bf16, 6, 0.05), "int4")
    x = _rand((5, 128), dtype, 7)
    for form in ("tiles", "bf16") if dtype == bf16 else ("tiles",):
        y = jax.jit(lambda x, w, f=form: int4_matmul_xla(x, w, form=f))(x, w)
        assert y.shape == (5, n) and y.dtype == dtype
        _int4_close(y, x, w)
    _int4_close(jax.jit(int4_matmul_ref)(x, w), x, w)


@pytest.mark.parametrize("dtype", [bf16, f32])
def test_int4_auto_form_by_rows(dtype):
    """"auto" takes "rows" for one row and the dequantized tiles' GEMMs from two rows on (bench/kernels.py: from
    M = 2 the tiles cost what the plain bf16 GEMM costs, two one-row passes twice a one-row pass): it equals the named
    form bit for bit and float64 within the output's rounding. With float32 outputs the two forms' sums differ in
    order, so the equality tells them apart (checked)."""
    w = quantize(_rand((256, 640), bf16, 8, 0.05), "int4")
    for m, form in ((1, "rows"), (2, "tiles"), (16, "tiles")):
        x = _rand((m, 640), dtype, 9)
        auto = np.asarray(jax.jit(lambda x, w: int4_matmul_xla(x, w))(x, w).astype(f32))
        forms = {f: np.asarray(jax.jit(lambda x, w, f=f: int4_matmul_xla(x, w, form=f))(x, w).astype(f32))
                 for f in ("rows", "tiles")}
        np.testing.assert_array_equal(auto, forms[form])
        if dtype == f32:
            assert not np.array_equal(forms["rows"], forms["tiles"]), m
        _int4_close(jnp.asarray(auto, dtype), x, w)


def test_int4_tiles_make_no_float32_copy_of_the_scales():
    """The tile loop slices bf16 scales as uint16: XLA:CPU otherwise widens the whole scale array to float32 outside
    the loop (measured: the LM head at 16 rows 1.3x slower)."""
    w = quantize(_rand((8192, 256), bf16, 10, 0.05), "int4")
    x = _rand((16, 256), bf16, 11)
    assert w.scale.shape == (8192, 8)
    assert not re.search(r"= f32\[8192,8\]", _entry(lambda x, w: int4_matmul_xla(x, w, form="tiles"), x, w))


def _chain_temp_bytes(kind, layers, width, rows, monkeypatch, plain_after):
    """Temporary bytes XLA:CPU assigns to `layers` chained CPU matmuls (x <- linear(x, w_i), bf16 x of `rows` rows,
    `kind` weights width x width), and the chain's output; plain_after: `after` replaced by the identity."""
    i4 = importlib.import_module("gemmajax.quant.int4_matmul")  # the package exports functions of these names
    i8 = importlib.import_module("gemmajax.quant.int8_matmul")
    if plain_after:
        for mod in (i4, i8):
            monkeypatch.setattr(mod, "after", lambda x, w: w)
    ws = [quantize(_rand((width, width), bf16, 30 + i, 0.05), kind, **({"act_group": 128} if kind == "int8" else {}))
          for i in range(layers)]
    form = {"int8": "wide", "int4": "tiles"}[kind]
    mm = {"int8": i8.int8_matmul_xla, "int4": i4.int4_matmul_xla}[kind]

    def chain(x, ws):
        for w in ws:
            x = mm(x, w, form=form)
        return x
    return _temp_and_out(chain, _rand((rows, width), bf16, 29), ws)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_weight_conversions_stay_beside_their_matmuls(kind, monkeypatch):
    """int8 "wide" converts each weight to bf16 and int4 "tiles" dequantizes it, per call. Those conversions do not
    depend on the activations, so XLA hoisted them all to the program's start and kept every layer's copy live at
    once (Gemma 3 270M: 200-235 MB of temporary buffer, page-faulted in every step). `after` ties each to its
    matmul's input: the temporary buffer holds about one layer's copy, whatever the depth, and the output is the
    same bits. Checked against the identity in place of `after`, which must hoist (else this test proves nothing)."""
    layers, width, rows = 8, 1024, 16
    one_copy = width * width * 2  # one weight in bf16
    tied, y = _chain_temp_bytes(kind, layers, width, rows, monkeypatch, plain_after=False)
    hoisted, y_plain = _chain_temp_bytes(kind, layers, width, rows, monkeypatch, plain_after=True)
    assert tied <= 3 * one_copy, (tied, one_copy)
    assert hoisted >= (layers - 1) * one_copy, (hoisted, one_copy)
    np.testing.assert_array_equal(y, y_plain)


def _loop_chain_temp(case: str, layers: int, monkeypatch, plain: bool):
    """(temporary bytes XLA:CPU assigns to `layers` chained ops whose loop updates an initial carry in place, the
    chain's output, one carry's bytes). case "int4": int4 "tiles" over a weight of two tiles (the loop form; a
    384 x 4096 carry, as a joined gate / up at prefill); "attention": the reference ragged attention of a 256-row
    prefill (its output scattered into a zeroed [T, N, H]). plain: `after_init` replaced by the identity (the
    carry's zeros shared by every layer's loop)."""
    if plain:
        for name in ("gemmajax.quant.int4_matmul", "gemmajax.kv.attention"):
            monkeypatch.setattr(importlib.import_module(name), "after_init", lambda x, init: init)
    if case == "int4":
        i4 = importlib.import_module("gemmajax.quant.int4_matmul")
        width, rows = 64, 384
        ws = [quantize(_rand((2 * i4._TILE, width), bf16, 60 + i, 0.05), "int4", 32) for i in range(layers)]

        def chain(x, ws):
            for w in ws:
                x = x + i4.int4_matmul_xla(x, w, form="tiles")[:, :width]
            return x
        args = (_rand((rows, width), bf16, 59), ws)
        carry = rows * 2 * i4._TILE * 2   # the loop's bf16 output, carried as uint16
    else:
        from gemmajax.kv.attention import ragged_paged_attention_ref
        from tests.kv.test_attention import make_case
        c = make_case([(0, 200), (8, 56)], n=4, nk=1, h=128, ps=16, dtype=f32, t_pad=256, seed=3)

        def chain(q, pages):
            for _ in range(layers):
                q = q + ragged_paged_attention_ref(q, None, None, pages, c.meta)[0]
            return q
        args = (c.q, c.kv_pages)
        carry = int(np.prod(c.q.shape)) * 4
    return (*_temp_and_out(chain, *args), carry)


@pytest.mark.parametrize("case", ["int4", "attention"])
def test_loop_carries_are_made_where_their_loops_run(case, monkeypatch):
    """A loop that fills a zeroed carry in place (int4 "tiles" over a weight of more than one tile, the attention's
    output scatter) gets its own copy of the zeros, and XLA:CPU scheduled every layer's copy at the program's start:
    Gemma 3 270M's 384-row w4a16 prefill kept 93 MB of temporary buffer (a fresh mmap, page-faulted every call).
    `after_init` ties each carry to its op's input: about one carry live, whatever the depth, and the same bits.
    Measured against the identity in place of `after_init` (the carries hoisted)."""
    layers = 8
    tied, y, carry = _loop_chain_temp(case, layers, monkeypatch, plain=False)
    hoisted, y_plain, _ = _loop_chain_temp(case, layers, monkeypatch, plain=True)
    # hoisted, all but about one layer's carry are live at once beside that layer's own working set (measured: int4
    # 31.7 against 9.7 MB, attention 5.7 against 2.6 MB); tied, one carry at a time
    assert hoisted - tied >= (layers - 2) * carry, (hoisted, tied, carry)
    np.testing.assert_array_equal(y, y_plain)


def test_after_init_keeps_values_and_dtypes():
    from gemmajax.quant.int8_matmul import after_init
    init = (jnp.zeros((3, 2), f32), jnp.full((4,), -7, jnp.int32), jnp.zeros((2,), jnp.uint16))
    for first in (np.nan, -np.inf, np.inf, 0.0):
        x = jnp.full((2, 3), 1.0, bf16).at[0, 0].set(first)
        got = jax.jit(after_init)(x, init)
        for g, want in zip(got, init):
            assert g.dtype == want.dtype and g.shape == want.shape
            np.testing.assert_array_equal(np.asarray(g), np.asarray(want))


def test_after_is_the_identity_even_for_nan_activations():
    from gemmajax.quant.int8_matmul import after
    w = jnp.arange(-8, 8, dtype=jnp.int8).reshape(4, 4)
    for first in (np.nan, -np.inf, np.inf, 0.0):
        x = jnp.full((2, 3), 1.0, bf16).at[0, 0].set(first)
        got = jax.jit(after)(x, w)
        assert got.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(w))
    np.testing.assert_array_equal(np.asarray(after(jnp.zeros((0, 3), bf16), w)), np.asarray(w))  # no rows


# ------------------------------------------------------------------------------------------------ decode attention
@pytest.mark.parametrize("impl", ["ref", "auto"])
@pytest.mark.parametrize("decode_only", [True, False])
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("h,s_max,dt,bits", [(32, 5, f32, False), (256, 8, bf16, True)])
def test_decode_attention_default_blocks_match_the_naive_oracle(h, s_max, dt, bits, window, decode_only, impl):
    """Decode rows with the default KV blocks (`_decode_block_kv`: 128 tokens for h 32 at 5 rows, 64 for h 256 at 8
    rows), as the all-decode form (decode_only) and as a mixed step's decode rows, against dense float64 attention
    over what the cache holds (tests/kv/test_attention.naive_attention). KV lengths end inside, at and past block
    edges, so a lost or doubled block, a wrong window edge or a prefill branch that runs anyway fails; unused pages
    are NaN. f32 pages and the engine's bf16 bit-stored pages; impl "auto" lowers to the reference on the CPU
    (platform_dependent's default branch for float pages, the logged fallback for bit-stored ones)."""
    from gemmajax.kv import attention
    from tests.kv.test_attention import make_case, naive_attention, run

    seqs = [(299, 1), (4, 1), (128, 1), (191, 1)]  # (cached, q_len): kv lengths 300, 5, 129, 192
    case = make_case(seqs, n=4, nk=1, h=h, ps=8, dtype=dt, window=window, t_pad=s_max, s_max=s_max, bits=bits,
                     q_dtype=f32, seed=h + s_max)
    if decode_only:
        case = dataclasses.replace(case, meta=dataclasses.replace(case.meta, decode_only=True))
    block = attention._decode_block_kv(s_max, case.kv_pages.shape)
    assert block == (128 if h == 32 else 64) and max(case.kv_lens) > 2 * block  # several default blocks
    out, _ = run(case, impl, sm_scale=h ** -0.5, sliding_window=window)
    out = np.asarray(out)
    want = naive_attention(case, sm_scale=h ** -0.5, window=window)
    np.testing.assert_allclose(out[:4], want, rtol=2e-4, atol=2e-4)
    np.testing.assert_array_equal(out[4:], 0.0)  # padding rows


# ------------------------------------------------------------------------------------------------ greedy in the step
@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory):
    from tests.golden.hf_models import build_hf, save_text_checkpoint
    m, cfg = build_hf("gemma3", seed=5)
    return gemmajax.load_model(save_text_checkpoint(m, cfg, str(tmp_path_factory.mktemp("g3"))), dtype="float32")


def _generate(model, tok, prompts, params):
    eng = LLMEngine(model.config, model.weights, tok, EngineConfig(
        max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, page_size=8, kv_dtype="float32",
        token_buckets=(8, 32), seq_buckets=(4,), kv_cache_memory=1 << 22))
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params)
    done = {}
    while len(done) < len(prompts):
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    return [done[f"r{i}"].token_ids for i in range(len(prompts))]


def test_in_step_greedy_equals_the_sampler(tiny_gemma3, gemma4_tokenizer):
    """Plain greedy requests take the in-step argmax; asking for logprobs sends the same step through the sampler.
    Both must pick the same tokens."""
    rng = np.random.default_rng(13)
    v = tiny_gemma3.config.vocab_size
    prompts = [rng.integers(3, v, size=n).tolist() for n in (5, 11, 3)]
    fast = _generate(tiny_gemma3, gemma4_tokenizer, prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    slow = _generate(tiny_gemma3, gemma4_tokenizer, prompts, SamplingParams(max_tokens=6, ignore_eos=True,
                                                                             logprobs=0))
    assert fast == slow
    assert all(len(t) == 6 for t in fast) and len({tuple(t) for t in fast}) > 1


def test_plain_greedy_rule():
    class Seq:
        def __init__(self, banned=(), **kw):
            self.params = SamplingParams(**kw)
            self._banned = list(banned)

        def banned_token_ids(self, eos):
            return self._banned

    assert plain_greedy([Seq(), Seq(max_tokens=3)], [None, None])
    assert plain_greedy([], [])
    assert not plain_greedy([Seq(), Seq(temperature=0.7)], [None, None])
    assert not plain_greedy([Seq(logprobs=0)], [None])
    assert not plain_greedy([Seq(repetition_penalty=1.2)], [None])
    assert not plain_greedy([Seq()], [object()])  # a grammar
    assert not plain_greedy([Seq(banned=[1])], [None])  # stop ids below min_tokens


def _near_tie_table(h: np.ndarray, v: int, dtype, rng) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """A [v, d] table (values exact in `dtype`) where row r of h has its best logit at slot a_r and a copy of that
    table row one `dtype` ulp larger in one column at a later slot b_r, chosen so that the float32 sums differ
    (b_r's is the float32 maximum) but round to the same `dtype` logit: the first-maximum rule must pick a_r.
    Returns the table and [(a_r, b_r)]."""
    d = h.shape[1]
    e = np.array(jnp.asarray(rng.standard_normal((v, d)) * 0.05, dtype).astype(f32))
    slots = rng.choice(v, 2 * len(h), replace=False).reshape(-1, 2)
    pairs = []
    for r, (a, b) in enumerate(np.sort(slots, axis=1)):
        e[a] = np.asarray(jnp.asarray(h[r] / np.linalg.norm(h[r]) * 0.6, dtype).astype(f32))  # row r's clear best
        for j in np.argsort(-np.abs(h[r])):
            up = np.asarray(jnp.asarray(e[a, j], dtype).astype(f32))
            step = np.float32(np.sign(h[r, j]) or 1.0)
            nxt = np.asarray(jnp.nextafter(jnp.asarray(e[a, j], dtype), jnp.asarray(step * np.inf, dtype)).astype(f32))
            cand = e[a].copy()
            cand[j] = nxt
            la, lb = (np.float32(np.dot(h[r].astype(np.float64), row)) for row in (e[a], cand))
            same = np.asarray(jnp.asarray([la, lb], f32).astype(dtype).astype(f32))
            if lb > la and same[0] == same[1] and up != nxt:
                e[b] = cand
                pairs.append((int(a), int(b)))
                break
        else:
            raise AssertionError(f"row {r}: no one-ulp change of its best table row ties once rounded")
    return e, pairs


@pytest.mark.parametrize("dtype,softcap,table", [(bf16, None, "plain"), (bf16, 30.0, "plain"), (bf16, None, "int8"),
                                                  (jnp.float16, None, "plain"), (f32, None, "plain")])
@pytest.mark.parametrize("rows", [1, 5])
def test_greedy_tokens_are_the_first_maximum_of_the_lm_heads_logits(dtype, softcap, table, rows):
    """runner.greedy_tokens (the in-step greedy head: for a plain 16-bit table with no softcap on the CPU, float32
    sums rounded inside the argmax) against numpy's first argmax of `gemma.lm_head`'s logits. For 16-bit plain
    tables each row's best table row has a later copy one ulp larger (`_near_tie_table`): its float32 sum is the
    largest but rounds to the same logit, so a head that took the float32 maximum picks another token."""
    from types import SimpleNamespace

    from gemmajax.engine.runner import greedy_tokens
    from gemmajax.model import gemma
    rng = np.random.default_rng(3)
    v, d = 1536, 64
    h = _rand((rows, d), dtype, 4)
    hf = np.asarray(h.astype(f32))
    if dtype != f32:
        e, pairs = _near_tie_table(hf, v, dtype, rng)
    else:
        e, pairs = rng.standard_normal((v, d)).astype(np.float32) * 0.05, []
    emb = jnp.asarray(e, dtype)
    table_w = quantize(emb, "int8") if table == "int8" else emb
    cfg = SimpleNamespace(final_logit_softcap=softcap)
    got = np.asarray(jax.jit(lambda t, h: greedy_tokens(SimpleNamespace(embed=t), cfg, h))(table_w, h))
    want_logits = np.asarray(jax.jit(lambda t, h: gemma.lm_head(SimpleNamespace(embed=t), cfg, h))(table_w, h)
                             .astype(f32))
    np.testing.assert_array_equal(got, want_logits.argmax(-1))
    if table == "plain" and softcap is None and dtype != f32:  # the construction holds: first, not largest
        raw = (hf.astype(np.float64) @ e.T.astype(np.float64)).astype(np.float32)
        for r, (a, b) in enumerate(pairs):
            assert raw[r].argmax() == b and got[r] == a, (r, a, b, raw[r].argmax(), got[r])


@pytest.mark.parametrize("dtype", [bf16, jnp.float16])
@pytest.mark.parametrize("rows", [8, 16])
def test_greedy_tokens_by_tiles_are_the_first_maximum(monkeypatch, dtype, rows):
    """On a CPU without bf16 hardware, 8 to 128 rows of a table of two 2,048-row tiles or more: greedy_tokens takes
    each tile's rounded maxima and their first indices as the tile's product is made (ops.dense_argmax_cpu), never
    the [R, V] logits. The same tokens as numpy's first argmax of `gemma.lm_head`'s logits, on `_near_tie_table`s
    (a later copy of each row's best one ulp larger: the larger float32 sum, the same rounded logit), over three
    tiles and a tail; and the compiled head is made of [2048, R] tile products."""
    from types import SimpleNamespace

    from gemmajax.engine.runner import greedy_tokens
    from gemmajax.model import gemma
    monkeypatch.setenv("GEMMAJAX_CPU_BF16_DOT", "0")
    rng = np.random.default_rng(rows)
    v, d = 3 * 2048 + 300, 256
    h = _rand((rows, d), dtype, 5)
    hf = np.asarray(h.astype(f32))
    e, pairs = _near_tie_table(hf, v, dtype, rng)
    emb = jnp.asarray(e, dtype)
    cfg = SimpleNamespace(final_logit_softcap=None)
    fn = lambda t, h: greedy_tokens(SimpleNamespace(embed=t), cfg, h)
    got = np.asarray(jax.jit(fn)(emb, h))
    want_logits = np.asarray(jax.jit(lambda t, h: gemma.lm_head(SimpleNamespace(embed=t), cfg, h))(emb, h)
                             .astype(f32))
    np.testing.assert_array_equal(got, want_logits.argmax(-1))
    raw = (hf.astype(np.float64) @ e.T.astype(np.float64)).astype(np.float32)
    for r, (a, b) in enumerate(pairs):
        assert raw[r].argmax() == b and got[r] == a, (r, a, b, raw[r].argmax(), got[r])
    assert len({a // 2048 for a, _ in pairs}) > 1, pairs  # winners in more than one tile
    txt = _entry(fn, emb, h)
    assert len(re.findall(rf"= f32\[2048,{rows}\]\S* (?:dot|fusion)\(", txt)) == 3, txt
    shapes = [tuple(int(n) for n in s.split(",")) for s in re.findall(r"f32\[([\d,]+)\]", txt)]
    big = [s for s in shapes if rows in s and np.prod(s) >= rows * v]
    assert not big, f"the whole logits were made: {big}"   # [R, V], or padded to blocks of 512


def test_dense_argmax_by_tiles_ties_nans_and_its_temporaries():
    """ops.dense_argmax_cpu against numpy's argmax of the exact float32 sums (integers: every product and sum
    exact): ties between tiles and inside one go to the first index, a tail tile's indices are offset right, rounding
    first (round_to) breaks a float32 order into a tie, and NaN logits still give tokens in the vocabulary. Its
    temporary buffer holds a few tiles, not the [M, V] sums that `dense_matmul_cpu_f32(form="tiles")` and an argmax
    hold."""
    from gemmajax.quant import ops
    rng = np.random.default_rng(11)
    v, d, m = 5 * 2048 + 77, 64, 16
    w = rng.integers(-2, 3, (v, d)).astype(np.float32)
    x = rng.integers(-2, 3, (m, d)).astype(np.float32)
    w[[100, 900, 2048 + 5, 4 * 2048 + 70]] = 2.0   # equal best rows, two in tile 0, one in tiles 1 and 4 ...
    x[:4] = 2.0                                     # ... for rows 0-3 (256): the first, slot 100, must win
    x[4] = np.where(np.arange(d) % 2, 1.0, -1.0)
    w[3 * 2048 + 9] = 2 * x[4]                 # row 4's best (128) is alone in tile 3; rows 0-3 get 0 from it
    x[5] = -1.0
    w[5 * 2048 + 50] = -3.0                    # row 5's best (192) is in the tail tile
    x[6] = np.where(np.arange(d) < d // 2, 2.0, -2.0)
    w[2048 + 500] = 2 * x[6]                   # row 6: 512 here, 513 later (sum of 2 x 4 and one 2 x 4.5) ...
    w[3 * 2048 + 100] = 2 * x[6]
    w[3 * 2048 + 100, 0] = 4.5                 # ... the float32 maximum, 512 once rounded to bf16: a tie
    wb, xb = jnp.asarray(w, bf16), jnp.asarray(x, bf16)
    sums = x @ w.T
    got = np.asarray(jax.jit(lambda x, w: ops.dense_argmax_cpu(x, w))(xb, wb))
    np.testing.assert_array_equal(got, sums.argmax(-1))
    assert list(got[:7]) == [100, 100, 100, 100, 3 * 2048 + 9, 5 * 2048 + 50, 3 * 2048 + 100], got[:7]
    wn = w.copy()
    wn[[2 * 2048 + 1, 4 * 2048 + 3]] = np.nan   # NaN logits in every row: XLA:CPU's max may or may not see them,
    got = np.asarray(jax.jit(lambda x, w: ops.dense_argmax_cpu(x, w))(xb, jnp.asarray(wn, bf16)))
    assert ((got >= 0) & (got < v)).all(), got  # but every token is a real one
    wide = np.asarray(jax.jit(lambda x, w: ops.dense_argmax_cpu(x, w, round_to=bf16))(xb, wb))
    np.testing.assert_array_equal(wide, np.asarray(jnp.asarray(sums, bf16).astype(f32)).argmax(-1))
    assert wide[6] == 2048 + 500, wide[6]      # rounded, the first of the tie

    x2, w2 = _rand((m, 64), bf16, 12), _rand((32 * 2048, 64), bf16, 13, 0.1)   # sums 4 MiB, a float32 tile 0.5
    logits = m * w2.shape[0] * 4

    def temp(fn):
        return jax.jit(fn).lower(x2, w2).compile().memory_analysis().temp_size_in_bytes
    by_tiles = temp(lambda x, w: ops.dense_argmax_cpu(x, w))
    whole = temp(lambda x, w: jnp.argmax(ops.dense_matmul_cpu_f32(x, w, form="tiles"), axis=-1))
    assert whole >= logits, (whole, logits)       # else the comparison proves nothing
    assert by_tiles < logits // 2, (by_tiles, logits)
