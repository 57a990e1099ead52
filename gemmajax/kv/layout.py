"""Paged KV cache layout: one array per KV-owning layer, `kv_pages[num_pages, 2*K, page_size, H]`.

K and V are interleaved on axis 1 (row 2k = K head k, row 2k+1 = V head k), so one DMA of `[2, page_size, H]`
fetches both for a KV head. The two minor axes are (page_size, H): whole (sublane, lane) tiles for any number of KV
heads (K=1 included) when page_size is a multiple of the dtype's sublane tile (8 f32, 16 bf16, 32 fp8) and H of 128;
a token-major page `[page_size, 2K, H]` would pad 2K=2 rows to a whole tile. fp8 pages use a per-tensor scale:
stored = clip(x / scale).astype(fp8), read = stored.astype(f32) * scale.
Pages may also be *bit-stored* (uint16 / uint8 holding bf16 / fp8 bit patterns, `bits=True`) for the XLA:CPU path:
XLA:CPU has no bf16 / fp8 scatter and converts the whole pool to f32 and back on every write of a float pool.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

# Accepted `kv_dtype` spellings (API.md uses "bf16", "fp8_e5m2", "fp8_e4m3").
_DTYPE_NAMES = {
    "bf16": jnp.bfloat16,
    "bfloat16": jnp.bfloat16,
    "fp32": jnp.float32,
    "f32": jnp.float32,
    "float32": jnp.float32,
    "fp8_e5m2": jnp.float8_e5m2,
    "float8_e5m2": jnp.float8_e5m2,
    "fp8_e4m3": jnp.float8_e4m3fn,
    "fp8_e4m3fn": jnp.float8_e4m3fn,
    "float8_e4m3fn": jnp.float8_e4m3fn,
}
FP8_DTYPES = (jnp.dtype(jnp.float8_e5m2), jnp.dtype(jnp.float8_e4m3fn))
_BITS = {1: jnp.dtype(jnp.uint8), 2: jnp.dtype(jnp.uint16), 4: jnp.dtype(jnp.uint32)}


def resolve_auto(kv: str, model_dtype) -> str:
    """The KV page dtype name for a requested `kv` and the model's activation dtype: "auto" is the model's own
    dtype (vLLM's `--kv-cache-dtype auto`: a float32 model gets float32 pages, a bf16 one bf16); any other name
    is checked and returned as given."""
    if kv != "auto":
        kv_dtype(kv)
        return kv
    dt = jnp.dtype(model_dtype)
    names = {jnp.dtype(jnp.float32): "float32", jnp.dtype(jnp.bfloat16): "bf16"}
    if dt not in names:
        raise ValueError(f"kv_dtype 'auto' follows the model's dtype, but KV pages cannot be {dt}; "
                         f"pass kv_dtype= one of 'bf16', 'float32', 'fp8_e5m2', 'fp8_e4m3'")
    return names[dt]


def kv_dtype(dtype: str | jnp.dtype | type) -> jnp.dtype:
    """Resolves a KV page dtype given as a name ("bf16", "fp8_e5m2", "fp8_e4m3", "float32") or a dtype."""
    if isinstance(dtype, str):
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"kv dtype {dtype!r} is not supported; expected one of {sorted(_DTYPE_NAMES)}")
        return jnp.dtype(_DTYPE_NAMES[dtype])
    dt = jnp.dtype(dtype)
    if dt not in {jnp.dtype(v) for v in _DTYPE_NAMES.values()}:
        raise ValueError(f"kv dtype {dt} is not supported; expected bfloat16, float32, float8_e5m2 or float8_e4m3fn")
    return dt


def sublane_tile(dtype: jnp.dtype) -> int:
    """Rows of one TPU (sublane, lane) tile for `dtype`: 8 for 32-bit, 16 for 16-bit, 32 for 8-bit."""
    return 32 // jnp.dtype(dtype).itemsize


def page_shape(page_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, int, int]:
    """Shape of one page: [2*K, page_size, H]."""
    return (2 * num_kv_heads, page_size, head_dim)


def storage_dtype(dtype, bits: bool = False) -> jnp.dtype:
    """The array dtype of a page pool: the KV dtype itself, or the unsigned int of its width for bit storage."""
    dt = kv_dtype(dtype)
    return _BITS[dt.itemsize] if bits else dt


def page_dtype(kv_pages: jax.Array, dtype=None) -> jnp.dtype:
    """The KV dtype a pool holds. Float pools carry it; a bit-stored pool of uint16 / uint32 holds bf16 / f32 unless
    told otherwise, and one of uint8 needs it given (fp8_e5m2 or fp8_e4m3)."""
    stored = jnp.dtype(kv_pages.dtype)
    if jnp.issubdtype(stored, jnp.floating):
        if dtype is not None and kv_dtype(dtype) != stored:
            raise ValueError(f"kv_dtype {kv_dtype(dtype)} given for pages of dtype {stored}")
        return kv_dtype(stored)
    if dtype is None:
        if stored in (_BITS[2], _BITS[4]):
            return jnp.dtype(jnp.bfloat16 if stored == _BITS[2] else jnp.float32)
        raise ValueError(f"pages of dtype {stored} are bit-stored: pass kv_dtype= ('fp8_e5m2' or 'fp8_e4m3')")
    dt = kv_dtype(dtype)
    if _BITS[dt.itemsize] != stored:
        raise ValueError(f"kv_dtype {dt} is stored as {_BITS[dt.itemsize]}, but the pages are {stored}")
    return dt


def alloc_pages(
    num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, dtype="bf16", *, bits: bool = False
) -> jax.Array:
    """Allocates a zeroed page pool for one layer.

    Args:
      bits: store the bit patterns in an unsigned int array (for the XLA:CPU path; pass kv_dtype= to the ops).
    Returns:
      kv_pages: [num_pages, 2*K, page_size, H]; row 2k of axis 1 is K head k, row 2k+1 is V head k.
    """
    return jnp.zeros((num_pages, *page_shape(page_size, num_kv_heads, head_dim)), storage_dtype(dtype, bits))


def bytes_per_page(page_size: int, num_kv_heads: int, head_dim: int, dtype="bf16") -> int:
    """Bytes of one page (K and V of all KV heads of one layer for `page_size` tokens)."""
    return 2 * num_kv_heads * page_size * head_dim * kv_dtype(dtype).itemsize


def quantize_kv(x: jax.Array, dtype: jnp.dtype, scale: float | jax.Array = 1.0) -> jax.Array:
    """Converts K or V values to the page dtype: clip(x / scale) cast to `dtype` (clip only for fp8, to its max).

    Clipping keeps an outlier from becoming inf (e5m2) or NaN (e4m3fn has no inf) in the cache.
    """
    dtype = jnp.dtype(dtype)
    y = x.astype(jnp.float32) / jnp.asarray(scale, jnp.float32)
    if dtype in FP8_DTYPES:
        fmax = float(jnp.finfo(dtype).max)
        y = jnp.clip(y, -fmax, fmax)
    return y.astype(dtype)


def dequantize_kv(x: jax.Array, scale: float | jax.Array = 1.0) -> jax.Array:
    """Page values back to float32: x.astype(f32) * scale."""
    return x.astype(jnp.float32) * jnp.asarray(scale, jnp.float32)


def as_bits(x: jax.Array) -> jax.Array:
    """Same-width unsigned-integer view of x."""
    return lax.bitcast_convert_type(x, _BITS[jnp.dtype(x.dtype).itemsize])


def from_bits(x: jax.Array, dtype) -> jax.Array:
    """Inverse of as_bits (identity when x already has `dtype`)."""
    return x if jnp.dtype(x.dtype) == jnp.dtype(dtype) else lax.bitcast_convert_type(x, jnp.dtype(dtype))


def interleave_kv(k: jax.Array, v: jax.Array) -> jax.Array:
    """[T, K, H] K and V -> [T, 2*K, H] with row 2k = K head k, row 2k+1 = V head k."""
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape [T, K, H]; got k {k.shape} and v {v.shape}")
    t, nk, h = k.shape
    return jnp.stack([k, v], axis=2).reshape(t, 2 * nk, h)


def gather_pages(kv_pages: jax.Array, page_ids: jax.Array, dtype=None) -> jax.Array:
    """Pages by id, in the KV dtype: [..., 2K, page_size, H] for page_ids [...] (ids clipped into the pool).

    A gather from a bf16 / fp8 pool is fine on XLA:CPU (the conversion fuses into it); a bit-stored pool is read as
    integers and only the gathered block is bitcast.
    """
    return from_bits(jnp.take(kv_pages, page_ids, axis=0, mode="clip"), page_dtype(kv_pages, dtype))


def write_kv(
    kv_pages: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    *,
    k_scale: float | jax.Array = 1.0,
    v_scale: float | jax.Array = 1.0,
    kv_dtype: str | jnp.dtype | None = None,
) -> jax.Array:
    """Reference scatter of new tokens into the pages (in place when the caller donates the pages).

    Cost: O(T * 2K * H) for f32 pools, bit-stored pools and on GPU / TPU. A bf16 / fp8 float pool on XLA:CPU is
    written through a bitcast view, which XLA:CPU materializes: two copies of the pool per call (still half the
    traffic of XLA:CPU's own f32 round trip); allocate with bits=True to avoid them.

    Args:
      kv_pages: [num_pages, 2*K, page_size, H], float or bit-stored (then kv_dtype is required).
      k, v: [T, K, H] new keys / values in any float dtype.
      slot_mapping: int32 [T], slot = page * page_size + offset; a negative slot (or one past the pool) skips the token.
    Returns:
      kv_pages (same dtype as given) with the tokens written, quantized with k_scale / v_scale.
    """
    num_pages, two_k, page_size, head_dim = kv_pages.shape
    dt = page_dtype(kv_pages, kv_dtype)
    if k.shape[1:] != (two_k // 2, head_dim):
        raise ValueError(f"k/v must be [T, {two_k // 2}, {head_dim}] for pages {kv_pages.shape}; got {k.shape}")
    kv = interleave_kv(quantize_kv(k, dt, k_scale), quantize_kv(v, dt, v_scale))  # [T, 2K, H]
    slot = jnp.asarray(slot_mapping, jnp.int32)
    # Negative indices would wrap around in a scatter: send skipped tokens past the end and drop them.
    page = jnp.where(slot >= 0, slot // page_size, num_pages)
    off = jnp.where(slot >= 0, slot % page_size, 0)
    idx = (page[:, None], jnp.arange(two_k)[None, :], off[:, None])
    if not jnp.issubdtype(kv_pages.dtype, jnp.floating):
        return kv_pages.at[idx].set(as_bits(kv), mode="drop")
    if jax.default_backend() == "cpu" and dt.itemsize < 4:
        return from_bits(as_bits(kv_pages).at[idx].set(as_bits(kv), mode="drop"), dt)
    return kv_pages.at[idx].set(kv, mode="drop")


def read_kv(
    kv_pages: jax.Array,
    slots: jax.Array,
    *,
    k_scale: float | jax.Array = 1.0,
    v_scale: float | jax.Array = 1.0,
    kv_dtype: str | jnp.dtype | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Gathers tokens back out of the pages (for tests and debugging).

    Args:
      kv_pages: [num_pages, 2*K, page_size, H].
      slots: int32 [L], slot = page * page_size + offset.
    Returns:
      (k, v): float32 [L, K, H] each, dequantized.
    """
    page_size = kv_pages.shape[2]
    slots = jnp.asarray(slots, jnp.int32)
    rows = from_bits(kv_pages[slots // page_size, :, slots % page_size], page_dtype(kv_pages, kv_dtype))  # [L, 2K, H]
    return dequantize_kv(rows[:, 0::2], k_scale), dequantize_kv(rows[:, 1::2], v_scale)


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """The page geometry of one layer's cache: a frozen, hashable description (usable as a static jit argument)."""

    page_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bf16"
    bits: bool = False  # bit-stored pool (the XLA:CPU path; see the module docstring)

    @property
    def jnp_dtype(self) -> jnp.dtype:
        """The KV dtype (bfloat16, float32, float8_*), whatever the storage."""
        return kv_dtype(self.dtype)

    @property
    def storage_dtype(self) -> jnp.dtype:
        return storage_dtype(self.dtype, self.bits)

    def shape(self, num_pages: int) -> tuple[int, int, int, int]:
        """[num_pages, 2*K, page_size, H]."""
        return (num_pages, *page_shape(self.page_size, self.num_kv_heads, self.head_dim))

    def abstract(self, num_pages: int, sharding=None) -> jax.ShapeDtypeStruct:
        """Shapes only, for jax.eval_shape and TPU AOT compiles."""
        return jax.ShapeDtypeStruct(self.shape(num_pages), self.storage_dtype, sharding=sharding)

    def alloc_pages(self, num_pages: int) -> jax.Array:
        return alloc_pages(num_pages, self.page_size, self.num_kv_heads, self.head_dim, self.dtype, bits=self.bits)

    def bytes_per_page(self) -> int:
        return bytes_per_page(self.page_size, self.num_kv_heads, self.head_dim, self.dtype)

    def tile_aligned(self) -> bool:
        """True when a page is whole TPU (sublane, lane) tiles: no padding in HBM or VMEM (see module docstring)."""
        return self.page_size % sublane_tile(self.jnp_dtype) == 0 and self.head_dim % 128 == 0

    @staticmethod
    def slots(page_table: np.ndarray, positions: np.ndarray, page_size: int) -> np.ndarray:
        """Host helper: slot ids (page * page_size + offset) of `positions` [L] of one sequence's `page_table`."""
        positions = np.asarray(positions)
        return np.asarray(page_table)[positions // page_size] * page_size + positions % page_size
