"""Dispatch for weight matmuls and row gathers (dense path; QuantArray support is added beside it)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """y = x @ w.T. x: [..., in]; w: [out, in] (Hugging Face layout). Returns [..., out] in x.dtype."""
    return jnp.dot(x, w.T.astype(x.dtype))


def take_rows(table: jax.Array, ids: jax.Array, dtype=None) -> jax.Array:
    """table: [V, D]; ids: int [...]. Returns table[ids]: [..., D] (cast to dtype if given)."""
    rows = jnp.take(table, ids, axis=0)
    return rows if dtype is None else rows.astype(dtype)
