"""Log-probabilities of given token sequences: no cache, no sampling, one forward pass over the
sequence padded to a power-of-two length bucket (one compiled program per bucket, built on first
use). `LLM.score` and the server's `echo` with `logprobs` (what evaluation harnesses send to score a
text) read them.

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
from jinfer.models.attention import TokenGroup
from jinfer.models.family import family_of
from jinfer.sampling import TOP_LOGPROBS

MIN_BUCKET = 16


class SequenceLogprobs(NamedTuple):
    """For positions 1..T-1 of a sequence: the token's log-prob and the likeliest alternatives."""

    chosen: np.ndarray  # [T - 1] float32
    top_ids: np.ndarray  # [T - 1, TOP_LOGPROBS] int32
    top_logprobs: np.ndarray  # [T - 1, TOP_LOGPROBS] float32


def score_program(params, tokens, adapters=None, slot=None, *, cfg, vocab):
    """log p(tokens[:, i+1] | tokens[:, :i+1]) for every i, and the top alternatives there; with
    `adapters` (a `lora.AdapterStack`), through the adapter in its `slot`."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    family = family_of(cfg)
    if adapters is not None:
        params = lora.adapted(params, cfg, adapters, jnp.full(tokens.size, slot, jnp.int32))
    (hidden,), _ = family.forward_groups(params, (TokenGroup(tokens, positions),), cfg)
    logp = jax.nn.log_softmax(family.logits(params, hidden[:, :-1])[..., :vocab], axis=-1)  # [B, T-1, V]
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
