"""The ragged paged attention kernel lowers through Mosaic and compiles for real TPU topologies (v5e:1x1, v6e:1x1)
without a TPU, at Gemma 4 shapes (tpu-without-tpu.md section 2). Shapes only: no memory is allocated.

Page size 32: the sublane tile of fp8 (32 rows), so a page is whole (page_size, H) tiles for bf16 and fp8 alike
(no padding), one DMA per page and KV head moves 32 * H * 2 values (16-64 KiB), and Gemma 4's sliding window of
512 is 16 pages. One case uses 64: half the page-table entries, which live in 1 MiB of SMEM."""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Several processes on this machine may hold libtpu for deviceless compiles at the same time.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import jax.numpy as jnp
import pytest

pytestmark = pytest.mark.tpu_compile

try:
    import libtpu  # noqa: F401

    _LIBTPU_ERROR = None
except ImportError as e:  # pragma: no cover - depends on the environment
    _LIBTPU_ERROR = f"libtpu cannot be imported ({e}); pip install libtpu to run the TPU compile checks"

from gemmajax.kv import RaggedMeta, ragged_paged_attention

MAX_MODEL_LEN = 8192
NUM_PAGES = 4096


def _compile(
    chip: str,
    *,
    head_dim: int,
    window: int | None,
    dtype,
    page_size: int,
    t_pad: int,
    s_max: int,
    read_only: bool = False,
    max_model_len: int = MAX_MODEL_LEN,
):
    if _LIBTPU_ERROR:
        pytest.skip(_LIBTPU_ERROR)
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(f"{chip}:1x1", platform="tpu")
    dev = jax.sharding.SingleDeviceSharding(topo.devices[0])

    def sds(shape, dt):
        return jax.ShapeDtypeStruct(shape, dt, sharding=dev)

    n, nk = 8, 1  # Gemma 4 E2B/E4B: 8 query heads, 1 KV head (GQA 8)
    p_max = max_model_len // page_size
    meta = RaggedMeta(
        cu_q_lens=sds((s_max + 1,), jnp.int32),
        kv_lens=sds((s_max,), jnp.int32),
        page_indices=sds((s_max, p_max), jnp.int32),
        num_seqs=sds((1,), jnp.int32),
    )
    kv_new = None if read_only else sds((t_pad, nk, head_dim), jnp.bfloat16)
    pages = sds((NUM_PAGES, 2 * nk, page_size, head_dim), dtype)

    def step(q, k, v, pages, meta):
        return ragged_paged_attention(q, k, v, pages, meta, sliding_window=window, impl="pallas")

    compiled = (
        jax.jit(step, donate_argnums=(3,))
        .lower(sds((t_pad, n, head_dim), jnp.bfloat16), kv_new, kv_new, pages, meta)
        .compile()
    )
    mem = compiled.memory_analysis()
    page_bytes = NUM_PAGES * 2 * nk * page_size * head_dim * jnp.dtype(dtype).itemsize
    # The cache is updated in place (donated, aliased through the kernel), and nothing cache-sized is temporary.
    assert mem.alias_size_in_bytes == page_bytes, (mem.alias_size_in_bytes, page_bytes)
    assert mem.temp_size_in_bytes < 16 * 2**20, f"temporaries {mem.temp_size_in_bytes} bytes"
    return compiled


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_sliding_layer_bf16_mixed_batch(chip):
    """Sliding layer (H=256, W=512): a 256-token bucket for prefill chunks plus decodes, 32 sequences."""
    _compile(chip, head_dim=256, window=512, dtype=jnp.bfloat16, page_size=32, t_pad=256, s_max=32)


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_full_layer_fp8_e5m2_decode_bucket(chip):
    """Full layer (H=512), fp8_e5m2 pages of 64 tokens, a 64-sequence decode bucket."""
    _compile(chip, head_dim=512, window=None, dtype=jnp.float8_e5m2, page_size=64, t_pad=64, s_max=64)


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_kv_shared_layer_fp8_e4m3_read_only(chip):
    """A KV-shared (read-only) sliding layer over fp8_e4m3 pages."""
    _compile(chip, head_dim=256, window=512, dtype=jnp.float8_e4m3fn, page_size=32, t_pad=256, s_max=32, read_only=True)


def test_auto_lowers_to_the_kernel_for_tpu_and_the_reference_elsewhere(monkeypatch, caplog):
    """impl="auto" is a lowering-time choice (as gemmajax.quant's): the same traced call lowered for a TPU device
    contains the Mosaic kernel, lowered for the CPU it does not. Bit-stored pages (the CPU engine's layout) are a
    case the kernel cannot take: the reference on TPU too, said once in the log however often it is traced."""
    if _LIBTPU_ERROR:
        pytest.skip(_LIBTPU_ERROR)
    from jax.experimental import topologies

    from gemmajax.kv import attention

    dev = jax.sharding.SingleDeviceSharding(topologies.get_topology_desc("v5e:1x1", platform="tpu").devices[0])
    t, n, nk, h, ps, s_max, p_max = 16, 8, 1, 256, 32, 8, 64

    def lowered(page_dtype, sharding=None, kv_dtype=None):
        def sds(shape, dt):
            return jax.ShapeDtypeStruct(shape, dt, sharding=sharding)

        meta = RaggedMeta(cu_q_lens=sds((s_max + 1,), jnp.int32), kv_lens=sds((s_max,), jnp.int32),
                          page_indices=sds((s_max, p_max), jnp.int32), num_seqs=sds((1,), jnp.int32))
        kv = sds((t, nk, h), jnp.bfloat16)

        def step(q, k, v, pages, meta):
            return ragged_paged_attention(q, k, v, pages, meta, sliding_window=512, impl="auto", kv_dtype=kv_dtype)

        return jax.jit(step, donate_argnums=(3,)).lower(sds((t, n, h), jnp.bfloat16), kv, kv,
                                                        sds((64, 2 * nk, ps, h), page_dtype), meta)

    tpu = lowered(jnp.bfloat16, dev)
    assert "tpu_custom_call" in tpu.as_text()
    assert tpu.compile().memory_analysis().alias_size_in_bytes == 64 * 2 * nk * ps * h * 2  # pages updated in place
    assert "tpu_custom_call" not in lowered(jnp.bfloat16).as_text()
    monkeypatch.setattr(attention, "_FALLBACKS_LOGGED", set())
    with caplog.at_level("INFO", logger=attention.__name__):
        for _ in range(2):
            assert "tpu_custom_call" not in lowered(jnp.uint16, dev, kv_dtype="bf16").as_text()
    said = [r.getMessage() for r in caplog.records if r.name == attention.__name__]
    assert len(said) == 1 and "bit-stored" in said[0] and "reference" in said[0], said


def test_compile_check_can_fail(monkeypatch):
    """With the wrapper's guard switched off, a page table larger than SMEM (1 MiB) is refused by the TPU compiler:
    the same check that passes above does bite. (Any page size and head dim lower; the page table is the limit.)"""
    from gemmajax.kv import attention

    monkeypatch.setattr(attention, "kernel_supports", lambda kv_pages, q, meta: None)
    with pytest.raises(Exception, match="(?i)smem|exceed|resource"):
        _compile(
            "v5e", head_dim=256, window=None, dtype=jnp.bfloat16, page_size=16, t_pad=16, s_max=256, max_model_len=32768
        )
