"""The engine's device side: the weights, the KV cache, the slot state and the block tables the
jitted steps carry from call to call, and every call made on them.

Each call takes host values only (numpy arrays, packed prompt chunks, ints, bools); the device
values it reads and rebinds stay here. So a call is also a message: on several processes
(`jinfer.cluster`) the leader's `Device` hands each call to its `publish` hook before making it,
and every follower's `Device` makes the same call on its own shards, in the same order, through
`replay`. The lock keeps the order of calls and the order of messages the same when two threads
call (the engine's loop and a server scoring a text).

    prefill(allowed, chunk) -> out                     decode(rows, attn_len, row_steps, deferred,
    mixed(rows, attn_len, allowed, row_steps, deferred,       want_logprobs) -> out
          want_logprobs, chunk) -> out, chunk_out      sample(allowed, deferred, want_logprobs) -> out
    history(packed)   clear_pages(pages)   set_tables(tables)   reset()   score(tokens) -> arrays

`allowed` is the [slots, W] bitmask of a dispatch with constrained rows, None without.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial

import jax
import numpy as np

from jinfer.scoring import score_program
from jinfer.steps import Steps

VERBS = ("prefill", "decode", "mixed", "sample", "history", "clear_pages", "set_tables", "reset", "score")


class Device:
    """The device values of one engine and the verbs over them (see the module docstring)."""

    def __init__(self, steps: Steps, params, dtype, tables: np.ndarray, score_params):
        self.steps, self.params, self.dtype = steps, params, dtype
        self.publish: Callable[[str, tuple], None] | None = None  # the leader's, on several processes
        self._lock = threading.Lock()
        self._score = jax.jit(partial(score_program, cfg=steps.model, vocab=steps.vocab_size))
        self._score_params = score_params
        self.cache = steps.new_cache(dtype)
        self.state = steps.new_state()
        self.tables = steps.put_tables(tables)

    def _call(self, verb: str, args: tuple, run: Callable[[], object]):
        with self._lock:
            if self.publish is not None:
                self.publish(verb, args)
            return run()

    def replay(self, verb: str, args: tuple) -> None:
        """Make a call the leader published (a follower's side; its results are the leader's to read)."""
        if verb not in VERBS:
            raise ValueError(f"unknown device verb {verb!r}")
        getattr(self, verb)(*args)

    def _allowed(self, allowed: np.ndarray | None):
        return self.steps.unconstrained if allowed is None else self.steps.put_allowed(allowed)

    # -------------------------------------------------------------------------------- verbs
    def prefill(self, allowed, chunk):
        def run():
            carried = (self.params, self.cache, self.state, self.tables)
            self.cache, self.state, out = self.steps.prefill(*carried, self._allowed(allowed), chunk)
            return out

        return self._call("prefill", (allowed, chunk), run)

    def decode(self, rows, attn_len, row_steps, deferred, want_logprobs):
        def run():
            carried = (self.params, self.cache, self.state, self.tables)
            decode = self.steps.decode[rows, attn_len]
            self.cache, self.state, out = decode(*carried, row_steps, deferred, want_logprobs)
            return out

        return self._call("decode", (rows, attn_len, row_steps, deferred, want_logprobs), run)

    def mixed(self, rows, attn_len, allowed, row_steps, deferred, want_logprobs, chunk):
        def run():
            carried = (self.params, self.cache, self.state, self.tables)
            mixed = self.steps.mixed[rows, attn_len]
            self.cache, self.state, out, chunk_out = mixed(
                *carried, self._allowed(allowed), row_steps, deferred, want_logprobs, chunk
            )
            return out, chunk_out

        return self._call("mixed", (rows, attn_len, allowed, row_steps, deferred, want_logprobs, chunk), run)

    def sample(self, allowed, deferred, want_logprobs):
        def run():
            self.state, out = self.steps.sample(self.state, self._allowed(allowed), deferred, want_logprobs)
            return out

        return self._call("sample", (allowed, deferred, want_logprobs), run)

    def history(self, packed) -> None:
        def run():
            self.state = self.steps.history(self.state, packed)

        self._call("history", (packed,), run)

    def clear_pages(self, pages) -> None:
        def run():
            self.cache = self.steps.clear_pages(self.cache, pages)

        self._call("clear_pages", (pages,), run)

    def set_tables(self, tables) -> None:
        """The host's block tables [slots, max_pages]; the host must not change them afterwards
        (on a CPU the device array may share their buffer)."""

        def run():
            self.tables = self.steps.put_tables(tables)

        self._call("set_tables", (tables,), run)

    def reset(self) -> None:
        """A fresh cache and slot state (after a failed call consumed them)."""

        def run():
            self.cache = self.steps.new_cache(self.dtype)
            self.state = self.steps.new_state()

        self._call("reset", (), run)

    def score(self, tokens):
        """`jinfer.scoring`'s program over tokens [1, T]: (chosen, top ids, top log-probs) on device."""
        return self._call("score", (tokens,), lambda: self._score(self._score_params, tokens))

    def consumed(self) -> bool:
        """Whether a failed call took the donated cache or state with it."""
        cache = self.cache
        return any(a.is_deleted() for a in (*cache.k, *cache.v)) or self.state.tokens.is_deleted()
