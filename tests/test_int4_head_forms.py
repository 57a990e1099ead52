"""bench/int4_head_forms.py: the one-row int4 LM-head forms whose times the README quotes compute the product they
stand for (each against int4_matmul_ref on a seeded random table), and its check rejects a form that does not."""
import jax.numpy as jnp
import numpy as np
import pytest

from gemmajax.quant.quantize import quantize_table
from tests.bench_scripts import load_bench

forms_mod = load_bench("int4_head_forms")


@pytest.mark.parametrize("seed, vocab", [(0, 16384), (1, 8192)])
def test_every_int4_head_form_matches_the_reference(seed, vocab):
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.standard_normal((vocab, 640)) * rng.uniform(0.01, 0.2), jnp.bfloat16)
    q4, q8 = quantize_table(w, 4), quantize_table(w, 8)
    x = jnp.asarray(rng.standard_normal((1, 640)) * rng.uniform(0.5, 4.0), jnp.bfloat16)
    forms = forms_mod.forms_for(q4, q8, w)
    checked = [name for name, (_, _, check) in forms.items() if check]
    assert {"rows (today)", "interleaved", "complex", "reduce", "tiled 8192", "int4-dtype"} <= set(checked)
    jitted = forms_mod.checked(forms, x, q4)  # raises ValueError on any int4 form off the reference
    assert set(jitted) == set(forms)
    # the check can fail: the low nibbles' pass alone (half the columns, no scales) claimed as the product
    f, args, _ = forms["lo pass, no scale"]
    with pytest.raises(ValueError, match="against int4_matmul_ref"):
        forms_mod.checked({"lo pass, no scale": (f, args, True)}, x, q4)
