"""Attention over the KV cache, and the backend that runs it, chosen once per compiled step.

    attention          causal GQA by XLA's einsums (full sequences; decode over a bucket of the cache)
    filled_attention   a prompt chunk over its cache rows, blocks of keys up to its own end
    BACKENDS           how a `TokenGroup` attends over the cache, by the engine's kernel choice
                       (`Layout.attention_kernel`): XLA's einsums (None), jinfer's C++ kernel
                       ("cpu"), the Pallas decode kernel for one-token groups ("gpu")

Shapes: q [B, K, G, T, H] (query heads grouped by kv head); the cache [slots, K, S, H].
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jinfer.kernels import cpu_attention, gpu_attention


def full_precision(dtype) -> jax.lax.Precision:
    """float32 operands get float32 products. Without this, XLA on NVIDIA GPUs rounds them to TF32
    (an H200 put logits 6e-3 off where the parity tests allow 7e-4); 16-bit operands are unaffected."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


@jax.named_scope("attention")
def attention(
    q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array, window: int
) -> jax.Array:
    """Causal grouped-query attention.

    q [B, K, G, T, H] (query heads grouped by kv head); k, v [B, K, S, H] (the cache's layout);
    q_pos [B, T] and k_pos [B, S] are absolute positions (k_pos < 0 marks an empty key slot). A key
    is visible when k_pos <= q_pos, and also q_pos - k_pos < window when the layer has a sliding
    window. Both products keep (b, k) as leading batch dimensions and contract over a trailing
    dimension of the cache, so they read K and V in place. Returns [B, K, G, T, H].
    """
    scores = jnp.where(_visible(q_pos, k_pos, window), _scores(q, k), jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgts,bksh->bkgth", probs, v, precision=full_precision(v.dtype))


def _scores(q: jax.Array, k: jax.Array) -> jax.Array:
    """Scaled float32 scores [B, K, G, T, S] of q [B, K, G, T, H] against keys k [B, K, S, H]."""
    precision = full_precision(k.dtype)
    scores = jnp.einsum("bkgth,bksh->bkgts", q, k, precision=precision, preferred_element_type=jnp.float32)
    return scores * (1.0 / math.sqrt(q.shape[-1]))


def _visible(q_pos: jax.Array, k_pos: jax.Array, window: int) -> jax.Array:
    """Which keys each query sees, [B, 1, 1, T, S] (broadcasting over K and G): k_pos [B, S] at or
    before q_pos [B, T], not empty (k_pos < 0), and within the sliding window when there is one."""
    visible = (k_pos[:, None, :] <= q_pos[:, :, None]) & (k_pos[:, None, :] >= 0)
    if window:
        visible &= q_pos[:, :, None] - k_pos[:, None, :] < window
    return visible[:, None, None]


KEY_BLOCK = 256  # keys per iteration of `filled_attention`


@jax.named_scope("attention")
def filled_attention(
    q: jax.Array,
    cache_k: jax.Array,
    cache_v: jax.Array,
    rows: jax.Array,
    q_pos: jax.Array,
    window: int,
) -> jax.Array:
    """Causal attention of prompt tokens over their cache rows, reading only the filled part.

    q [B, K, G, T, H] at positions q_pos [B, T] (contiguous per row, their K/V already written);
    cache_k, cache_v [slots, K, S, H]; rows [B] the cache rows. A loop over blocks of KEY_BLOCK keys
    runs only up to the furthest query position (and, with a sliding window, from the first block
    the window reaches), with an online softmax: a chunk at the start of a 2048-position slot
    reads one block, not the whole row. Returns [B, K, G, T, H], as `attention` does.
    """
    batch, kv_heads, groups, t, h = q.shape
    seq = cache_k.shape[2]
    block = min(KEY_BLOCK, seq)
    precision = full_precision(cache_v.dtype)
    first = jnp.maximum(jnp.min(q_pos) - window + 1, 0) // block if window else 0
    end = -(-(jnp.max(q_pos) + 1) // block)

    def read(cache, start):  # [B, K, block, H]: each row's block, sliced in place (no row copy)
        size = (1, kv_heads, block, h)
        return jnp.concatenate([jax.lax.dynamic_slice(cache, (r, 0, start, 0), size) for r in rows])

    def body(j, carry):
        running_max, denominator, acc = carry
        start = jnp.minimum(j * block, seq - block)
        keys, values = read(cache_k, start), read(cache_v, start)
        k_pos = start + jnp.arange(block)
        scores = _scores(q, keys)
        # Keys below j * block are ones a clamped last block repeats: already counted.
        visible = _visible(q_pos, jnp.broadcast_to(k_pos, (batch, block)), window) & (k_pos >= j * block)
        new_max = jnp.maximum(running_max, jnp.max(jnp.where(visible, scores, -jnp.inf), axis=-1))
        probs = jnp.where(visible, jnp.exp(scores - new_max[..., None]), 0.0)
        rescale = jnp.exp(running_max - new_max)
        denominator = denominator * rescale + jnp.sum(probs, axis=-1)
        update = jnp.einsum(
            "bkgts,bksh->bkgth",
            probs.astype(values.dtype),
            values,
            precision=precision,
            preferred_element_type=jnp.float32,
        )
        return new_max, denominator, acc * rescale[..., None] + update

    shape = (batch, kv_heads, groups, t)
    # A finite "no key yet" maximum: a query whose keys all lie in later blocks rescales by 1, not NaN.
    init = (jnp.full(shape, jnp.finfo(jnp.float32).min), jnp.zeros(shape), jnp.zeros((*shape, h)))
    _, denominator, acc = jax.lax.fori_loop(first, end, body, init)
    return (acc / denominator[..., None]).astype(cache_v.dtype)


class TokenGroup(NamedTuple):
    """Tokens that share one attention pattern within a forward pass.

    tokens and positions are [B, T]; their K/V go to cache rows `rows` [B] (None: rows 0..B-1).
    `active` [B] (None: all) marks the rows whose outputs are used: the attention kernels skip the
    others (idle decode slots keep the position their last request reached, however far).
    A decode step is one group ([slots, 1]); a decode step carrying a prompt chunk is two (the
    slots, then the chunk [1, T] for its slot): every projection runs once over both groups'
    columns, so the step reads the weights once.
    """

    tokens: jax.Array
    positions: jax.Array
    rows: jax.Array | None = None
    active: jax.Array | None = None

    @property
    def columns(self) -> int:
        return self.tokens.shape[0] * self.tokens.shape[1]

    @property
    def cache_rows(self) -> jax.Array:
        """The cache row of each batch entry, [B]: `rows`, or 0..B-1."""
        return jnp.arange(self.tokens.shape[0]) if self.rows is None else self.rows


def kernel_positions(group: TokenGroup) -> jax.Array:
    """The group's positions [B, T] for an attention kernel: -1 on inactive rows, which then read no
    keys and attend to zeros (finite: their K/V, written at their stale positions, stay finite)."""
    if group.active is None:
        return group.positions
    return jnp.where(group.active[:, None], group.positions, -1)


# A backend: (q, (cache_k, cache_v), group, attn_len, window) -> [B, K, G, T, H].
Backend = Callable[[jax.Array, tuple[jax.Array, jax.Array], TokenGroup, int | None, int], jax.Array]


def xla_attention(q, cache_kv, group: TokenGroup, attn_len: int | None, window: int) -> jax.Array:
    """XLA's einsums: a prompt chunk of its own (no attn_len) reads its rows block by block up to
    its end; decode rows (and a chunk carried by a decode step) read the first attn_len positions."""
    b, t = group.tokens.shape
    if attn_len is None and t > 1:
        return filled_attention(q, *cache_kv, group.cache_rows, group.positions, window)
    cache_k, cache_v = cache_kv
    rows = group.rows
    keys, values = (cache_k[:b], cache_v[:b]) if rows is None else (cache_k[rows], cache_v[rows])
    if attn_len is not None:  # the caller knows no position at or past attn_len is in use
        keys, values = keys[:, :, :attn_len], values[:, :, :attn_len]
    cache_positions = jnp.arange(keys.shape[2], dtype=jnp.int32)
    k_pos = jnp.broadcast_to(cache_positions, (b, cache_positions.shape[0]))
    return attention(q, keys, values, group.positions, k_pos, window)


@jax.named_scope("attention")
def cpu_kernel_attention(q, cache_kv, group: TokenGroup, attn_len: int | None, window: int) -> jax.Array:
    """jinfer's C++ kernel (one CPU device, float32): every group, each row read in place up to its
    queries' positions."""
    return cpu_attention.attention(q, *cache_kv, group.cache_rows, kernel_positions(group), window)


def gpu_kernel_attention(q, cache_kv, group: TokenGroup, attn_len: int | None, window: int) -> jax.Array:
    """The Pallas decode kernel (one GPU, 16-bit) for one-token groups of rows 0..B-1; others (a
    prompt chunk carried by a decode step) by XLA's einsums over attn_len."""
    if group.rows is None and group.tokens.shape[1] == 1:
        return gpu_attention.attention(q, *cache_kv, kernel_positions(group)[:, 0], window)
    return xla_attention(q, cache_kv, group, attn_len, window)


BACKENDS: dict[str | None, Backend] = {
    None: xla_attention,
    "cpu": cpu_kernel_attention,
    "gpu": gpu_kernel_attention,
}
