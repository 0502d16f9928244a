"""Attention over the paged KV cache, and the backend that runs it, chosen once per compiled step.

    attention          causal GQA by XLA's einsums over contiguous keys (full sequences, and the
                       reference every kernel is tested against)
    filled_attention   a prompt chunk over its pages, blocks of keys up to its own end
    BACKENDS           how a `TokenGroup` attends over the cache, by the engine's kernel choice
                       (`Layout.attention_kernel`): XLA's einsums over gathered pages (None),
                       jinfer's C++ kernel reading pages in place ("cpu"), the Pallas paged decode
                       kernel for one-token groups ("gpu")

Shapes: q [B, K, G, T, H] (query heads grouped by kv head); each layer's pools [K, P, page_size, H];
a group's block tables [B, max_pages] (`kv_cache`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jinfer.kernels import cpu_attention, gpu_attention
from jinfer.kv_cache import gather_pages


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
    pool_k: jax.Array,
    pool_v: jax.Array,
    tables: jax.Array,
    q_pos: jax.Array,
    window: int,
) -> jax.Array:
    """Causal attention of prompt tokens over their pages, reading only the filled part.

    q [B, K, G, T, H] at positions q_pos [B, T] (contiguous per row, their K/V already written);
    pool_k, pool_v [K, P, page_size, H]; tables [B, max_pages] the rows' block tables. A loop over
    blocks of KEY_BLOCK keys (whole pages) runs only up to the furthest query position (and, with a
    sliding window, from the first block the window reaches), with an online softmax: a chunk at
    the start of a 2048-position sequence reads one block, not all of its pages. Returns
    [B, K, G, T, H], as `attention` does.
    """
    batch, kv_heads, groups, t, h = q.shape
    page_size = pool_k.shape[2]
    seq = tables.shape[1] * page_size
    block = min(max(KEY_BLOCK, page_size), seq)
    precision = full_precision(pool_v.dtype)
    first = jnp.maximum(jnp.min(q_pos) - window + 1, 0) // block if window else 0
    end = -(-(jnp.max(q_pos) + 1) // block)

    def read(pool, start):  # [B, K, block, H]: the block's pages of every row
        pages = jax.lax.dynamic_slice_in_dim(tables, start // page_size, block // page_size, axis=1)
        return gather_pages(pool, pages)

    def body(j, carry):
        running_max, denominator, acc = carry
        start = jnp.minimum(j * block, seq - block)
        keys, values = read(pool_k, start), read(pool_v, start)
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
    return (acc / denominator[..., None]).astype(pool_v.dtype)


class TokenGroup(NamedTuple):
    """Tokens that share one attention pattern within a forward pass.

    tokens and positions are [B, T]; batch entry b is the sequence of slot rows[b] (None: slots
    0..B-1), whose block table `tables` [B, max_pages] (set by `forward_groups` from the engine's
    tables) says where its positions live. `active` [B] (None: all) marks the rows whose outputs are
    used: the others write nothing and the attention kernels skip them (an idle decode slot keeps
    the position its last request reached). `valid` [B, T] (None: all) marks real tokens: a padded
    prompt chunk's padding writes nothing.
    A decode step is one group ([slots, 1]); a decode step carrying a prompt chunk is two (the
    slots, then the chunk [1, T] for its slot): every projection runs once over both groups'
    columns, so the step reads the weights once.
    """

    tokens: jax.Array
    positions: jax.Array
    rows: jax.Array | None = None
    active: jax.Array | None = None
    valid: jax.Array | None = None
    tables: jax.Array | None = None

    @classmethod
    def of_rows(cls, tokens: jax.Array, first: jax.Array, active: jax.Array | None = None) -> TokenGroup:
        """Slots 0..B-1, each feeding its tokens [B, T] at positions first [B] onward (a decode
        step's last tokens, a verify step's last token and drafts, a draft model's pass)."""
        offsets = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
        return cls(tokens, first[:, None] + offsets, active=active)

    @property
    def columns(self) -> int:
        return self.tokens.shape[0] * self.tokens.shape[1]

    @property
    def slots(self) -> jax.Array:
        """The slot of each batch entry, [B]: `rows`, or 0..B-1."""
        return jnp.arange(self.tokens.shape[0]) if self.rows is None else self.rows

    @property
    def writes(self) -> jax.Array | None:
        """Which tokens' K/V are written, [B, T] (None: all)."""
        if self.active is None:
            return self.valid
        active = jnp.broadcast_to(self.active[:, None], self.tokens.shape)
        return active if self.valid is None else active & self.valid


def kernel_positions(group: TokenGroup) -> jax.Array:
    """The group's positions [B, T] for an attention kernel: -1 on inactive rows, which then read no
    keys and attend to zeros."""
    if group.active is None:
        return group.positions
    return jnp.where(group.active[:, None], group.positions, -1)


# A backend: (q, (pool_k, pool_v), group, attn_len, window) -> [B, K, G, T, H].
Backend = Callable[[jax.Array, tuple[jax.Array, jax.Array], TokenGroup, int | None, int], jax.Array]


def xla_attention(q, cache_kv, group: TokenGroup, attn_len: int | None, window: int) -> jax.Array:
    """XLA's einsums: a prompt chunk of its own (no attn_len) reads its pages block by block up to
    its end; decode rows (and a chunk carried by a decode step) read the pages of the first
    attn_len positions, gathered."""
    b, t = group.tokens.shape
    if attn_len is None and t > 1:
        return filled_attention(q, *cache_kv, group.tables, group.positions, window)
    pool_k, pool_v = cache_kv
    page_size = pool_k.shape[2]
    pages = group.tables.shape[1] if attn_len is None else -(-attn_len // page_size)
    tables = group.tables[:, :pages]  # the caller knows no position past attn_len is in use
    keys, values = gather_pages(pool_k, tables), gather_pages(pool_v, tables)
    cache_positions = jnp.arange(keys.shape[2], dtype=jnp.int32)
    k_pos = jnp.broadcast_to(cache_positions, (b, cache_positions.shape[0]))
    return attention(q, keys, values, group.positions, k_pos, window)


@jax.named_scope("attention")
def cpu_kernel_attention(q, cache_kv, group: TokenGroup, attn_len: int | None, window: int) -> jax.Array:
    """jinfer's C++ kernel (one CPU device, float32): every group, each row's pages read in place up
    to its queries' positions."""
    return cpu_attention.attention(q, *cache_kv, group.tables, kernel_positions(group), window)


def gpu_kernel_attention(q, cache_kv, group: TokenGroup, attn_len: int | None, window: int) -> jax.Array:
    """The Pallas paged decode kernel (one GPU, 16-bit) for one-token groups without a sliding
    window (the kernel has none); others (a prompt chunk carried by a decode step, windowed layers)
    by XLA's einsums over attn_len."""
    if group.tokens.shape[1] == 1 and not window:
        return gpu_attention.attention(q, *cache_kv, group.tables, kernel_positions(group)[:, 0])
    return xla_attention(q, cache_kv, group, attn_len, window)


BACKENDS: dict[str | None, Backend] = {
    None: xla_attention,
    "cpu": cpu_kernel_attention,
    "gpu": gpu_kernel_attention,
}
