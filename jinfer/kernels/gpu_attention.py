"""Decode attention on a GPU: JAX's Pallas (Triton) paged-attention kernel, on jinfer's pages as they lie.

`fits(max_pages)` says whether the kernel takes block tables of that width; `attention` runs it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_PAGES_PER_BLOCK = 8  # pages per compute block within a split


def _whole_blocks(max_pages: int, splits: int) -> bool:
    per_split, rest = divmod(max_pages, splits)
    return rest == 0 and per_split % min(per_split, _PAGES_PER_BLOCK) == 0


def _splits(max_pages: int) -> int:
    """The most splits (a power of two up to 16) that cut the table into whole compute blocks."""
    return next((s for s in (16, 8, 4, 2) if _whole_blocks(max_pages, s)), 1)


def fits(max_pages: int) -> bool:
    """Whether `attention` takes block tables of `max_pages` pages."""
    return _whole_blocks(max_pages, _splits(max_pages))


@jax.named_scope("attention")
def attention(
    q: jax.Array,
    pool_k: jax.Array,
    pool_v: jax.Array,
    tables: jax.Array,
    positions: jax.Array,
    interpret=False,
) -> jax.Array:
    """Decode attention with JAX's Pallas (Triton) paged kernel.

    q [B, K, G, 1, H] at positions [B]; pool_k, pool_v [K, P, page_size, H] are read in place
    through tables [B, max_pages], each sequence only up to its own position (so no attention
    bucket is needed and no page is gathered). Rows at position -1 (idle) get length 0: they cost
    nothing and attend to zeros. No sliding window: the kernel has none. `interpret` runs it on a
    CPU, slowly (tests). Returns [B, K, G, 1, H].
    """
    from jax.experimental.pallas.ops.gpu import paged_attention

    b, kv_heads, groups, _, h = q.shape
    out = paged_attention.paged_attention(
        q.reshape(b, kv_heads * groups, h) * jnp.asarray(h**-0.5, q.dtype),  # the kernel does not scale
        pool_k,
        pool_v,
        tables,
        (positions + 1).astype(jnp.int32),
        pages_per_compute_block=_PAGES_PER_BLOCK,
        k_splits=_splits(tables.shape[1]),
        interpret=interpret,
    )
    return out.astype(q.dtype).reshape(b, kv_heads, groups, 1, h)
