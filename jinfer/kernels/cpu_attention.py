"""The CPU attention kernel (`cpu_attention.cc`): built on first use, registered with XLA:CPU.

`available()` builds and registers it (see `jinfer.kernels`). Without a compiler, or if the build
fails, it says why in a warning and returns False, and the engine attends with XLA's einsums
instead. `attention(...)` is the jax-level call.
"""

from __future__ import annotations

import functools
import logging
import math

import jax
import jax.numpy as jnp
import numpy as np

from jinfer.kernels import register_cpu_kernel

log = logging.getLogger(__name__)

TARGET = "jinfer_cpu_attention"


@functools.cache
def available() -> bool:
    """Whether the kernel is built and registered (builds it the first time)."""
    unavailable = "CPU attention kernel unavailable, decode attends with XLA's einsums"
    return register_cpu_kernel("cpu_attention", "JinferCpuAttention", TARGET, log, unavailable) is not None


def attention(
    q: jax.Array, pool_k: jax.Array, pool_v: jax.Array, tables: jax.Array, positions: jax.Array, window: int
) -> jax.Array:
    """Causal attention of q [B, K, G, T, H] at positions [B, T] over the pages of pool_k, pool_v
    [K, P, page_size, H] that each batch entry's block table tables [B, max_pages] lists (float32,
    read in place up to each query's position; with a sliding window, from where it reaches).
    Returns [B, K, G, T, H] float32, as XLA's attention (`models.attention.attention`) does."""
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(
        q,
        pool_k,
        pool_v,
        tables.astype(jnp.int32),
        positions.astype(jnp.int32),
        window=np.int64(window),
        scale=np.float32(1.0 / math.sqrt(q.shape[-1])),
    )
