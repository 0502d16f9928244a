"""Decode attention on a GPU: JAX's Pallas (Triton) kernel, called on jinfer's cache as it lies.

`fits(max_seq_len)` says whether the kernel takes a cache of that length; `attention` runs it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

_KERNEL_SPLITS, _KERNEL_BLOCK = 16, 128  # the kernel splits each row's keys, in blocks of 128


def fits(max_seq_len: int) -> bool:
    """Whether `attention` takes a cache of this length: 16 equal splits of at least
    16 keys, each a whole number of blocks (a split shorter than a block is one block)."""
    split, rest = divmod(max_seq_len, _KERNEL_SPLITS)
    return rest == 0 and split >= 16 and (split < _KERNEL_BLOCK or split % _KERNEL_BLOCK == 0)


@jax.named_scope("attention")
def attention(
    q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, positions: jax.Array, window: int, interpret=False
) -> jax.Array:
    """Decode attention for cache rows 0..B-1 with JAX's Pallas (Triton) GPU kernel.

    q [B, K, G, 1, H] at positions [B]; cache_k, cache_v [slots, K, S, H] are read in place, each
    row only up to its own position (so no attention bucket is needed, and no slice of the cache
    is copied: on an H200 XLA's einsum path spent 5.2 ms of a 13.9 ms 64-slot step materializing
    those slices). Rows past B, and rows at position -1 (idle), get length 0: they cost nothing and
    attend to zeros. `interpret` runs it on a CPU, slowly (tests). Returns [B, K, G, 1, H].
    """
    from jax.experimental.pallas.ops.gpu import decode_attention

    b, kv_heads, groups, _, h = q.shape
    slots = cache_k.shape[0]
    q_rows = jnp.zeros((slots, kv_heads * groups, h), q.dtype).at[:b].set(q.reshape(b, -1, h))
    length = jnp.zeros((slots,), jnp.int32).at[:b].set(positions + 1)
    start = jnp.maximum(length - window, 0) if window else None
    out = decode_attention.gqa(
        q_rows,
        jnp.swapaxes(cache_k, 1, 2),  # gqa takes [B, S, K, H] and swaps back: XLA cancels the pair
        jnp.swapaxes(cache_v, 1, 2),
        start_idx=start,
        kv_seq_len=length,
        sm_scale=1.0 / math.sqrt(h),
        block_k=_KERNEL_BLOCK,
        k_splits=_KERNEL_SPLITS,
        interpret=interpret,
    )
    # (gqa's normalization adds a NumPy float32 epsilon, which promotes a bf16 result to float32.)
    return out[:b].astype(q.dtype).reshape(b, kv_heads, groups, 1, h)
