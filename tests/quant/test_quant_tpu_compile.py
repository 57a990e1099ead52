"""Deviceless TPU compiles (libtpu, no TPU) of the w8a8 and w4a16 Pallas kernels at Gemma 4 E2B and 12B layer shapes,
decode (M = 1) and prefill (M = 512), for v5e:1x1 and v6e:1x1: Mosaic's tiling and VMEM rules are checked exactly as
on the chip. w8a8 twice: per-token activation scales and the loaders' default, per token per 128 columns. The 12B
shapes are in the slow tier (`make test-slow`)."""
import os

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import topologies

from gemmajax.quant import QuantArray, linear
from gemmajax.quant.int4_matmul import int4_matmul_pallas
from gemmajax.quant.int8_matmul import int8_matmul_pallas
from gemmajax.quant.quantize import default_act_group

pytest.importorskip("libtpu", reason="libtpu is needed for deviceless TPU compiles")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # read when libtpu starts; other tests may hold its lock

pytestmark = pytest.mark.tpu_compile

SHAPES = [(1536, 6144), (6144, 1536), (1536, 2048),  # E2B: MLP up / down, q_proj (in x out)
          (3840, 15360), (15360, 3840)]  # 12B: MLP up / down
KERNELS = {"int8": int8_matmul_pallas, "int4": int4_matmul_pallas}


@pytest.fixture(scope="module", params=["v5e", "v6e"])
def tpu(request):
    """A device of a deviceless v5e / v6e topology. Only a missing libtpu skips (importorskip above): any error
    libtpu raises here is a failure to report, not a reason to pass quietly."""
    topo = topologies.get_topology_desc(f"{request.param}:1x1", platform="tpu")
    return jax.sharding.SingleDeviceSharding(topo.devices[0])


def _compile_at(tpu, kind, shapes):
    groups = kind == "int8-groups"
    kind = kind.removesuffix("-groups")
    for k, n in shapes:
        ag = default_act_group(k) if groups else 0
        assert ag == (128 if groups else 0), (k, ag)  # every E2B / 12B width is a multiple of 128
        q = QuantArray.abstract((n, k), kind, sharding=tpu, act_group=ag)
        for m in (1, 512):
            x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16, sharding=tpu)
            compiled = jax.jit(KERNELS[kind]).lower(x, q).compile()
            # no dequantized copy of the weight in HBM: the kernel reads it packed (measured temps: 0-32 KiB)
            assert compiled.memory_analysis().temp_size_in_bytes < (1 << 20), (kind, k, n, m)
            # the kernel's cost estimate reaches XLA's analysis (the AOT roofline reads it)
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, (list, tuple)) else cost
            assert cost["flops"] >= 2 * m * k * n, (kind, k, n, m, cost["flops"])


@pytest.mark.parametrize("kind", ["int8", "int4", "int8-groups"])
def test_kernels_compile_at_layer_shapes(tpu, kind):
    """E2B's layer shapes in every run."""
    _compile_at(tpu, kind, SHAPES[:3])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["int8", "int4", "int8-groups"])
def test_kernels_compile_at_12b_layer_shapes(tpu, kind):
    """12B's MLP shapes (K or N of 15,360): `make test-slow`."""
    _compile_at(tpu, kind, SHAPES[3:])


def _int4_float32_compiles(tpu, shapes):
    for k, n in shapes:
        q = QuantArray.abstract((n, k), "int4", sharding=tpu)
        for m in (1, 512):
            x = jax.ShapeDtypeStruct((m, k), jnp.float32, sharding=tpu)
            lowered = jax.jit(int4_matmul_pallas).lower(x, q)
            assert "tpu_custom_call" in lowered.as_text()
            assert lowered.compile().memory_analysis().temp_size_in_bytes < (1 << 20), (k, n, m)


def test_int4_kernel_compiles_with_float32_activations(tpu):
    """A float32 model's w4a16 keeps float32 activations (x and the dequantized tile in float32, HIGHEST precision):
    that kernel variant lowers through Mosaic too, decode and prefill, at E2B's MLP up shape."""
    _int4_float32_compiles(tpu, SHAPES[:1])


@pytest.mark.slow
def test_int4_kernel_compiles_with_float32_activations_down_shape(tpu):
    """The same at E2B's MLP down shape (K 6,144): `make test-slow`."""
    _int4_float32_compiles(tpu, SHAPES[1:2])


@pytest.mark.parametrize("kind,ag", [("int8", 0), ("int4", 0), ("int8", 128)])
def test_auto_dispatch_picks_the_kernel_when_lowering_for_tpu(tpu, kind, ag):
    """impl="auto" decides at lowering time: the TPU program calls the Pallas kernel, the CPU one does not."""
    q = QuantArray.abstract((2048, 1536), kind, sharding=tpu, act_group=ag)
    x = jax.ShapeDtypeStruct((4, 1536), jnp.bfloat16, sharding=tpu)
    tpu_text = jax.jit(lambda x, q: linear(x, q)).lower(x, q).as_text()
    assert "tpu_custom_call" in tpu_text
    cpu_text = jax.jit(lambda x, q: linear(x, q)).lower(
        jax.ShapeDtypeStruct((4, 1536), jnp.bfloat16), QuantArray.abstract((2048, 1536), kind, act_group=ag)).as_text()
    assert "tpu_custom_call" not in cpu_text
