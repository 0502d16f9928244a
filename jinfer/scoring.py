"""Log-probabilities of given token sequences: no sampling, one forward pass over the sequence
padded to a power-of-two length bucket (one compiled program per bucket, built on first use).
`LLM.score` and the server's `echo` with `logprobs` (what evaluation harnesses send to score a
text) read them.

The pass is the engine's own prefill of the sequence as one chunk: the served weights as the steps
hold them (packed, quantized), the sequence's keys and values written into a scratch paged cache
of the engine's page size and dtype, and attention by the engine's backend; the log-softmax is
`numerics.log_softmax`, the one the steps report. Where that backend gives each query the same
bits whatever else is in the call (jinfer's CPU kernel, the default on a CPU), the log-prob of a
token a decode step sampled equals its score here bit for bit.

    ids [T] -> log p(ids[i] | ids[:i]) for i >= 1  [T - 1]
             + the TOP_LOGPROBS likeliest tokens at each of those positions, and their log-probs
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import jinfer.lora as lora
from jinfer.kv_cache import KVCache, contiguous_tables, pool_shape
from jinfer.models.attention import TokenGroup
from jinfer.models.family import family_of
from jinfer.numerics import log_softmax
from jinfer.sampling import TOP_LOGPROBS

MIN_BUCKET = 16


class SequenceLogprobs(NamedTuple):
    """For positions 1..T-1 of a sequence: the token's log-prob and the likeliest alternatives."""

    chosen: np.ndarray  # [T - 1] float32
    top_ids: np.ndarray  # [T - 1, TOP_LOGPROBS] int32
    top_logprobs: np.ndarray  # [T - 1, TOP_LOGPROBS] float32


def next_token_logprobs(
    params, tokens, adapters=None, slot=None, *, cfg, vocab, page_size, cache_dtype, attention_kernel
):
    """log p(v | tokens[b, :i+1]) [B, T-1, V] for every row b, position i and token v: each row
    prefilled as one chunk into a scratch paged cache (see the module docstring); with `adapters`
    (a `lora.AdapterStack`), through the adapter in its `slot`. tokens [B, T]."""
    rows, length = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), tokens.shape)
    family = family_of(cfg)
    if adapters is not None:
        params = lora.adapted(params, cfg, adapters, jnp.full(tokens.size, slot, jnp.int32))
    tables = jnp.asarray(contiguous_tables(rows, length, page_size))
    pool = pool_shape(cfg, 1 + tables.size, page_size)
    scratch = lambda: tuple(jnp.zeros(pool, cache_dtype) for _ in range(cfg.num_layers))
    (hidden,), _ = family.forward_groups(
        params,
        (TokenGroup(tokens, positions),),
        cfg,
        KVCache(k=scratch(), v=scratch()),
        tables,
        attention_kernel=attention_kernel,
    )
    columns = hidden[:, :-1].reshape(rows * (length - 1), -1)  # the steps' logits take [columns, D]
    return log_softmax(family.logits(params, columns)[:, :vocab]).reshape(rows, length - 1, -1)


def score_program(params, tokens, adapters=None, slot=None, **options):
    """log p(tokens[0, i+1] | tokens[0, :i+1]) for every i, and the top alternatives there
    (`next_token_logprobs`' options). tokens [1, T]."""
    logp = next_token_logprobs(params, tokens, adapters, slot, **options)
    chosen = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    top_logprobs, top_ids = jax.lax.top_k(logp, TOP_LOGPROBS)
    return chosen, top_ids.astype(jnp.int32), top_logprobs


class Scorer:
    """Scores sequences through `run` (`Device.score`: the program above, on the engine's weights)."""

    def __init__(self, run: Callable[[np.ndarray], tuple], max_seq_len: int):
        self._run = run
        self.max_seq_len = max_seq_len

    def __call__(self, ids: list[int], adapter: int = -1) -> SequenceLogprobs:
        if not 1 <= len(ids) <= self.max_seq_len:
            raise ValueError(f"a sequence of {len(ids)} tokens; scoring takes 1 to {self.max_seq_len}")
        size = MIN_BUCKET
        while size < len(ids):
            size *= 2
        tokens = np.zeros((1, size), np.int32)
        tokens[0, : len(ids)] = ids
        out = self._run(tokens, adapter)
        chosen, top_ids, top_logprobs = (np.asarray(a[0, : len(ids) - 1]) for a in out)
        return SequenceLogprobs(chosen.astype(np.float32), top_ids, top_logprobs.astype(np.float32))
