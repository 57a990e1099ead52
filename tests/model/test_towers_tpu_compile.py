"""Deviceless TPU compiles (libtpu, no TPU) of the vision and audio encoders at the published sizes, for v5e:1x1
and v6e:1x1: one 280-token image for E2B's and 31B's towers and the 12B's embedder, one 30 s clip (750 soft tokens)
for E2B's audio tower, bf16 weights, batch 1. Mosaic / XLA's TPU compiler decides the program and its HBM use:
the weights plus temporaries fit a v5e's 16 GiB with room for the text model, and the compiled program is the
encoder (its cost analysis counts at least its matmul FLOPs). The byte figures are printed (pytest -s); measured
2026-12-01 (weights / temporaries, v5e and v6e): E2B vision 322 MiB / 29 and 23 MiB, 31B vision 1098 / 63 and
127 MiB, 12B embedder 95 / 0 and 17 MiB, E2B audio 586 / 79 and 66 MiB."""
import os

import jax
import jax.numpy as jnp
import pytest

from gemmajax.model import audio as au
from gemmajax.model import vision as vi

pytest.importorskip("libtpu", reason="libtpu is needed for deviceless TPU compiles")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
from jax.experimental import topologies  # noqa: E402

pytestmark = [pytest.mark.tpu_compile, pytest.mark.slow]   # about 10 min on 2 loaded cores: make test-slow
GiB = 1 << 30


@pytest.fixture(scope="module", params=["v5e", "v6e"])
def tpu(request):
    topo = topologies.get_topology_desc(f"{request.param}:1x1", platform="tpu")   # a libtpu failure fails
    return request.param, jax.sharding.SingleDeviceSharding(topo.devices[0])


def _abstract(tree, sharding):
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)


def _compile(fn, args, sharding):
    return jax.jit(fn).lower(*[_abstract(a, sharding) for a in args]).compile()


def _check(name, chip, compiled, weights, flops_at_least):
    mem = compiled.memory_analysis()
    w = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(weights))
    print(f"{name} on {chip}: weights {w / 2**20:.0f} MiB, temporaries {mem.temp_size_in_bytes / 2**20:.0f} MiB")
    assert w + mem.temp_size_in_bytes < 4 * GiB, (name, w, mem.temp_size_in_bytes)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    assert cost["flops"] >= flops_at_least, (name, cost["flops"], flops_at_least)


@pytest.mark.parametrize("size", ["e2b", "31b"])
def test_vision_towers_compile(tpu, size):
    chip, sh = tpu
    cfg = vi.VisionConfig.preset(size)
    w = vi.abstract_vision_weights(cfg, jnp.bfloat16)
    T = 280 * cfg.pooling_kernel_size ** 2
    x = jax.ShapeDtypeStruct((1, T, cfg.patch_dim), jnp.float32)
    p = jax.ShapeDtypeStruct((1, T, 2), jnp.int32)
    compiled = _compile(lambda w, x, p: vi.encode_images(w, cfg, x, p), (w, x, p), sh)
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    _check(f"vision {size}", chip, compiled, w, 2 * T * cfg.num_layers * mlp)


def test_unified_embedder_compiles(tpu):
    chip, sh = tpu
    cfg = vi.UNIFIED_VISION_PRESETS["12b"]
    w = vi.abstract_unified_vision_weights(cfg)
    x = jax.ShapeDtypeStruct((1, 280, cfg.patch_dim), jnp.float32)
    p = jax.ShapeDtypeStruct((1, 280, 2), jnp.int32)
    compiled = _compile(lambda w, x, p: vi.encode_images_unified(w, cfg, x, p), (w, x, p), sh)
    _check("unified vision 12b", chip, compiled, w, 2 * 280 * cfg.patch_dim * cfg.embed_dim)


def test_audio_tower_compiles(tpu):
    chip, sh = tpu
    cfg = au.AudioConfig.preset("e2b")
    w = au.abstract_audio_weights(cfg)
    f = jax.ShapeDtypeStruct((1, 3072, 128), jnp.float32)
    m = jax.ShapeDtypeStruct((1, 3072), jnp.bool_)
    compiled = _compile(lambda w, f, m: au.encode_audio(w, cfg, f, m), (w, f, m), sh)
    _check("audio e2b", chip, compiled, w, 2 * 768 * cfg.text_hidden_size * cfg.output_proj_dims)
