"""Reductions whose bits for one row (a slot, a token) never depend on what else the array holds.

XLA picks a reduction's order from the whole shape: on a CPU, an RMSNorm over SmolLM2's 576
features gave a column other bits beside 7 others than alone, and a log-softmax over the vocabulary
gave a row's log-probs other bits beside 31 other rows. Batch invariance (a request's tokens and
log-probs the same alone and in any crowd) rests on these instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def fixed_order_sum(x: jax.Array, axis: int) -> jax.Array:
    """The sum of x over `axis` (kept, of size 1) as a pairwise tree of elementwise adds over the
    axis zero-padded to a power of two: the same order, so the same bits, for a row whatever else
    the array holds."""
    axis %= x.ndim
    size = x.shape[axis]
    width = 1 << (size - 1).bit_length()
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, width - size)
    x = jnp.pad(x, pad)
    while width > 1:
        width //= 2
        x = jax.lax.slice_in_dim(x, 0, width, axis=axis) + jax.lax.slice_in_dim(
            x, width, 2 * width, axis=axis
        )
    return x


def log_softmax(logits: jax.Array) -> jax.Array:
    """log softmax over the last axis, each row's normalizer a `fixed_order_sum` (a maximum is
    exact in any order)."""
    shifted = logits - jnp.max(logits, axis=-1, keepdims=True)
    return shifted - jnp.log(fixed_order_sum(jnp.exp(shifted), axis=-1))
