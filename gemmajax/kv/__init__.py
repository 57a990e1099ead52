"""Paged KV cache: page layout (`layout`) and ragged paged attention (`attention`: jnp reference + Pallas kernel)."""

from gemmajax.kv.attention import (
    RaggedMeta,
    make_ragged_meta,
    ragged_paged_attention,
    ragged_paged_attention_pallas,
    ragged_paged_attention_ref,
)
from gemmajax.kv.layout import (
    KVLayout,
    alloc_pages,
    bytes_per_page,
    dequantize_kv,
    kv_dtype,
    quantize_kv,
    read_kv,
    write_kv,
)

__all__ = [
    "KVLayout",
    "RaggedMeta",
    "alloc_pages",
    "bytes_per_page",
    "dequantize_kv",
    "kv_dtype",
    "make_ragged_meta",
    "quantize_kv",
    "ragged_paged_attention",
    "ragged_paged_attention_pallas",
    "ragged_paged_attention_ref",
    "read_kv",
    "write_kv",
]
