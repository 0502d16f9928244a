"""The paged key/value cache: one preallocated pool of pages per layer, shared by every sequence.

`KVCache` holds, per layer, K and V pools of shape [K, P, page_size, H] (kv heads, pages, positions
in a page, head dim): head-major, so each (head, page) is one contiguous [page_size, H] matrix that
attention reads in place, and the shape JAX's Pallas paged-attention kernels take. A sequence's
positions live in the pages its block table row lists in order ([max_pages] int32 per slot, the
host's to fill: `jinfer.paging`): position p is at page table[p // page_size], offset
p % page_size. Attention masks keys by comparing positions, so no per-sequence length is carried
on the device, and stale contents of a reused page are never read.

Arrays are allocated once at their final size; jitted steps take the pools donated and return the
updated ones. One array per layer (rather than one stacked [L, ...] array) keeps every update an
in-place scatter into that layer's buffer, with no slicing copies in the unrolled layer loop.
Writes that must not land anywhere (padding of a prompt chunk, rows not decoding, positions past
a table or mapped to no page) are dropped, so a page shared through the prefix cache is never
written by anyone but the sequence that filled it, and the sink page (`paging.SINK_PAGE`, what
unmapped table entries point at) stays zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jinfer.config import ModelConfig
from jinfer.paging import SINK_PAGE


@struct.dataclass
class KVCache:
    k: tuple[jax.Array, ...]  # per layer [K, P, page_size, H]
    v: tuple[jax.Array, ...]  # per layer [K, P, page_size, H]


def pool_shape(cfg: ModelConfig, num_pages: int, page_size: int) -> tuple[int, int, int, int]:
    return (cfg.num_kv_heads, num_pages, page_size, cfg.head_dim)


def bytes_per_token(cfg: ModelConfig, dtype=jnp.float32) -> int:
    """K and V of one position over every layer."""
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize


def init_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype=jnp.float32, sharding=None) -> KVCache:
    """Zeros of the final size, created directly with `sharding` (no host copy, no resharding)."""
    shape = pool_shape(cfg, num_pages, page_size)
    make = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    zeros = lambda: tuple(make() for _ in range(cfg.num_layers))
    return KVCache(k=zeros(), v=zeros())


def contiguous_tables(rows: int, max_len: int, page_size: int) -> np.ndarray:
    """Block tables [rows, pages] giving row r its own run of pages 1 + r * pages ..., for callers
    that want a cache per row without a page allocator (a pool of 1 + rows * pages pages)."""
    pages = -(-max_len // page_size)
    return 1 + np.arange(rows * pages, dtype=np.int32).reshape(rows, pages)


def write_kv(
    layer_kv: tuple[jax.Array, jax.Array],
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    tables: jax.Array,
    valid: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Write new k, v [B, K, T, H] into one layer's pools at positions [B, T], through each batch
    entry's block table tables [B, max_pages], in place. Entries where `valid` [B, T] is False,
    positions past the table and positions it maps to no page (the sink) are dropped. One scatter
    of B x K x T head vectors."""
    pool_k, pool_v = layer_kv
    heads, num_pages, page_size = pool_k.shape[:3]
    max_pages = tables.shape[1]
    inside = (positions >= 0) & (positions < max_pages * page_size)
    if valid is not None:
        inside &= valid
    page = jnp.take_along_axis(tables, jnp.clip(positions // page_size, 0, max_pages - 1), axis=1)
    page = jnp.where(inside & (page != SINK_PAGE), page, num_pages)  # out of range: dropped
    index = (jnp.arange(heads)[None, :, None], page[:, None, :], (positions % page_size)[:, None, :])
    write = lambda pool, new: pool.at[index].set(new.astype(pool.dtype), mode="drop")
    return write(pool_k, k), write(pool_v, v)


def gather_pages(pool: jax.Array, tables: jax.Array) -> jax.Array:
    """The positions of pages tables [B, n] as contiguous rows [B, K, n * page_size, H] (a copy:
    XLA's einsums read them this way; the kernels read the pool in place)."""
    heads, _, page_size, head_dim = pool.shape
    batch, n = tables.shape
    rows = pool[:, tables]  # [K, B, n, page_size, H]
    return rows.transpose(1, 0, 2, 3, 4).reshape(batch, heads, n * page_size, head_dim)
