"""Deviceless TPU compiles (libtpu, no TPU) of the grouped expert matmul at Gemma 4 26B-A4B's layer shapes
(ModelConfig.preset("26b-a4b"): experts gate_up [E, 2F, D] and down [E, D, F]), stacks as the loaders make them
(w8a8 with its activation groups, w4a16; `in` padded to whole lanes), for v5e:1x1 and v6e:1x1, decode (4 and 16
tokens x top-k rows) and prefill (512 tokens x top-k): Mosaic's tiling and VMEM rules are checked as on the chip,
and the compiled temporaries must stay at activation size (a dequantized stack would be 0.5-1 GiB per projection).
Plain bf16 stacks go through ragged_dot there: no copy of the stack either. 3-20 s per test on two cores (the
float32 variant, 30-60 s, is in the slow tier)."""
import os

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import topologies

from gemmajax.config import ModelConfig
from gemmajax.quant import gmm
from gemmajax.quant.gmm import gmm_pallas
from gemmajax.quant.loading import make_quantizer

pytest.importorskip("libtpu", reason="libtpu is needed for deviceless TPU compiles")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # read when libtpu starts; other tests may hold its lock

pytestmark = pytest.mark.tpu_compile

CFG = ModelConfig.preset("26b-a4b")
E, D, F, TOP_K = CFG.num_experts, CFG.hidden_size, CFG.moe_dim, CFG.top_k_experts
STACKS = {"gate_up": ("layers.0.experts.gate_up_proj", (E, 2 * F, D)),
          "down": ("layers.0.experts.down_proj", (E, D, F))}
ROWS = (4 * TOP_K, 16 * TOP_K, 512 * TOP_K)  # decode 4 and 16 tokens, prefill 512 tokens


@pytest.fixture(scope="module", params=["v5e", "v6e"])
def tpu(request):
    """A device of a deviceless v5e / v6e topology. Only a missing libtpu skips (importorskip above): any error
    libtpu raises here is a failure to report, not a reason to pass quietly."""
    topo = topologies.get_topology_desc(f"{request.param}:1x1", platform="tpu")
    return jax.sharding.SingleDeviceSharding(topo.devices[0])


def _stack(mode: str, which: str, sharding):
    """The abstract stack the loader's quantizer makes (QuantArray of ShapeDtypeStructs, or the bf16 array)."""
    name, shape = STACKS[which]
    sds = jax.ShapeDtypeStruct(shape, jnp.bfloat16)
    q = sds if mode == "bf16" else jax.eval_shape(lambda w: make_quantizer(mode)(name, w), sds)
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), q)


def _compile(fn, x, w, gs):
    lowered = jax.jit(fn).lower(x, w, gs)
    return lowered, lowered.compile()


@pytest.mark.parametrize("m", ROWS, ids=["decode4", "decode16", "prefill512"])
@pytest.mark.parametrize("mode", ["w8a8", "w4a16"])
@pytest.mark.parametrize("which", list(STACKS))
def test_kernel_compiles_at_26b_shapes_without_a_stack_copy(tpu, which, mode, m):
    w = _stack(mode, which, tpu)
    assert w.padded_in % (128 if mode == "w8a8" else 256) == 0, w  # stacks as loaded: whole 128-byte lanes
    if mode == "w8a8":
        assert w.act_group == (128 if which == "gate_up" else 0), w  # the loaders' activation groups
    gs = jax.ShapeDtypeStruct((E,), jnp.int32, sharding=tpu)
    x = jax.ShapeDtypeStruct((m, w.in_features), jnp.bfloat16, sharding=tpu)
    lowered, compiled = _compile(gmm, x, w, gs)  # impl "auto": lowered for TPU, so the kernel
    assert "tpu_custom_call" in lowered.as_text(), (mode, which, m)
    temp = compiled.memory_analysis().temp_size_in_bytes
    act = m * (w.padded_in + w.padded_out) * 2  # the activations in and out, bf16
    # measured: 0.1-0.4 MiB at decode, 0.2-0.3 MiB at prefill; a relayout or dequantized copy of the stack
    # would be >= 126 MiB
    assert temp <= 2 * act + (1 << 20), (mode, which, m, temp)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    assert cost["flops"] >= 2 * m * w.out_features * w.in_features, (mode, which, m, cost["flops"])


@pytest.mark.slow
@pytest.mark.parametrize("m", (ROWS[0], ROWS[2]), ids=["decode4", "prefill512"])
def test_float32_activations_compile(tpu, m):
    """A float32 model's w4a16 experts keep float32 activations in the kernel too (gate_up). 30-60 s."""
    w = _stack("w4a16", "gate_up", tpu)
    gs = jax.ShapeDtypeStruct((E,), jnp.int32, sharding=tpu)
    x = jax.ShapeDtypeStruct((m, D), jnp.float32, sharding=tpu)
    _, compiled = _compile(gmm_pallas, x, w, gs)
    assert compiled.memory_analysis().temp_size_in_bytes <= 2 * m * (D + 2 * F) * 4 + (1 << 20)


@pytest.mark.parametrize("which", list(STACKS))
def test_plain_bf16_stack_is_not_copied(tpu, which):
    """Plain bf16 experts through ragged_dot: the stack is handed over in the layout XLA:TPU gives it, so no
    relayout copy (the other contraction copied 528 / 968 MiB)."""
    w = _stack("bf16", which, tpu)
    gs = jax.ShapeDtypeStruct((E,), jnp.int32, sharding=tpu)
    for m in (ROWS[1], ROWS[2]):
        x = jax.ShapeDtypeStruct((m, w.shape[2]), jnp.bfloat16, sharding=tpu)
        _, compiled = _compile(gmm, x, w, gs)
        assert compiled.memory_analysis().temp_size_in_bytes <= 4 << 20, (which, m)


def test_auto_takes_the_xla_loop_on_the_cpu():
    """The same call lowered for the CPU has no TPU kernel in it (impl "auto" is decided at lowering time)."""
    w = _stack("w4a16", "down", None)
    x = jax.ShapeDtypeStruct((ROWS[1], F), jnp.bfloat16)  # 128 rows: the loop over rows
    text = jax.jit(gmm).lower(x, w, jax.ShapeDtypeStruct((E,), jnp.int32)).as_text()
    assert "tpu_custom_call" not in text and "while" in text
