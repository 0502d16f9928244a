"""The preallocated key/value cache and the one function that writes into it.

`KVCache` holds, per layer, K and V arrays of shape [B, K, S, H] (batch rows, kv heads, cache
positions, head dim). A row's position p lives at index p, so attention masks by comparing
positions and no per-row length needs to be carried on device. With (row, kv head) outermost,
each head's keys are one contiguous [S, H] matrix: attention's products read the cache where it
lies, with batch dimensions leading as matrix-product kernels want them. (A [B, S, K, H] layout
cost a transposed copy of every layer's keys and values per step; in a microbenchmark of
attention alone it was 2.8x slower at 64 slots on an H200 and 1.5x at 8 slots on XLA:CPU.)
Arrays are allocated once at their final size; jitted steps take the cache donated and return
the updated one.

One array per layer (rather than one stacked [L, ...] array) keeps every update an in-place
dynamic-update-slice of that layer's buffer, with no slicing copies in the unrolled layer loop.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jinfer.config import ModelConfig


@struct.dataclass
class KVCache:
    k: tuple[jax.Array, ...]  # per layer [B, K, S, H]
    v: tuple[jax.Array, ...]  # per layer [B, K, S, H]


def cache_shape(cfg: ModelConfig, batch: int, max_len: int) -> tuple[int, int, int, int]:
    return (batch, cfg.num_kv_heads, max_len, cfg.head_dim)


def cache_bytes(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32) -> int:
    per_layer = int(np.prod(cache_shape(cfg, batch, max_len))) * jnp.dtype(dtype).itemsize
    return 2 * cfg.num_layers * per_layer


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32, sharding=None) -> KVCache:
    """Zeros of the final size, created directly with `sharding` (no host copy, no resharding)."""
    shape = cache_shape(cfg, batch, max_len)
    make = jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)
    zeros = lambda: tuple(make() for _ in range(cfg.num_layers))
    return KVCache(k=zeros(), v=zeros())


def write_kv(
    layer_kv: tuple[jax.Array, jax.Array],
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    rows: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Write new k, v [B, K, T, H] into one layer's cache at positions [B, T], in place.

    Batch entry b goes to cache row rows[b] (rows=None: row b, as decode over the first B slots
    does). One scatter of B x K x T head vectors; positions past the cache are dropped, so a padded
    prompt chunk may run past the end of a slot (its padding is never read: a position becomes
    visible only once a real token has been written there).
    """
    cache_k, cache_v = layer_kv
    batch, heads = k.shape[:2]
    rows = jnp.arange(batch) if rows is None else rows
    index = (rows[:, None, None], jnp.arange(heads)[None, :, None], positions[:, None, :])
    write = lambda cache, new: cache.at[index].set(new.astype(cache.dtype), mode="drop")
    return write(cache_k, k), write(cache_v, v)
