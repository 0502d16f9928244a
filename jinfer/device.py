"""The engine's device side: the weights, the KV cache, the slot state and the block tables the
jitted steps carry from call to call, and every call made on them.

Each call takes host values only (numpy arrays, packed prompt chunks, ints, bools); the device
values it reads and rebinds stay here. So a call is also a message: on several processes
(`jinfer.cluster`) the leader's `Device` hands each call to its `publish` hook before making it,
and every follower's `Device` makes the same call on its own shards, in the same order, through
`replay`. The lock keeps the order of calls and the order of messages the same when two threads
call (the engine's loop and a server scoring a text).

    prefill(allowed, chunk, feed_draft) -> out
    decode(rows, attn_len, row_steps, deferred, want_logprobs, feed_draft) -> out
    mixed(rows, attn_len, allowed, row_steps, deferred, want_logprobs, chunk, feed_draft) -> out, chunk_out
    verify(rows, attn_len, k, plan, row_steps, deferred, want_logprobs) -> out, checked, kinds
    sample(allowed, deferred, want_logprobs) -> out
    history(packed)   clear_pages(pages)   set_tables(tables)   reset()   score(tokens) -> arrays

`allowed` is the [slots, W] bitmask of a dispatch with constrained rows, None without.
`warm_up` makes each verb compile every variant; `verify_cost` times verify against decode steps
(through those same verbs, so followers replay them too).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import partial

import jax
import numpy as np

from jinfer.sampling import SamplingArrays, SamplingParams
from jinfer.scoring import score_program
from jinfer.speculative import DRAFT_SOURCES, DraftPlan, program_lengths, verify_programs
from jinfer.state import pack_chunk, pack_history
from jinfer.steps import Steps

VERBS = (
    "prefill",
    "decode",
    "mixed",
    "verify",
    "sample",
    "history",
    "clear_pages",
    "set_tables",
    "reset",
    "score",
)


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
    def prefill(self, allowed, chunk, feed_draft=True):
        def run():
            carried = (self.params, self.cache, self.state, self.tables)
            prefill = self.steps.program("prefill", feed_draft)
            self.cache, self.state, out = prefill(*carried, self._allowed(allowed), chunk)
            return out

        return self._call("prefill", (allowed, chunk, feed_draft), run)

    def decode(self, rows, attn_len, row_steps, deferred, want_logprobs, feed_draft=True):
        def run():
            carried = (self.params, self.cache, self.state, self.tables)
            decode = self.steps.program("decode", feed_draft)[rows, attn_len]
            self.cache, self.state, out = decode(*carried, row_steps, deferred, want_logprobs)
            return out

        args = (rows, attn_len, row_steps, deferred, want_logprobs, feed_draft)
        return self._call("decode", args, run)

    def mixed(self, rows, attn_len, allowed, row_steps, deferred, want_logprobs, chunk, feed_draft=True):
        def run():
            carried = (self.params, self.cache, self.state, self.tables)
            mixed = self.steps.program("mixed", feed_draft)[rows, attn_len]
            self.cache, self.state, out, chunk_out = mixed(
                *carried, self._allowed(allowed), row_steps, deferred, want_logprobs, chunk
            )
            return out, chunk_out

        args = (rows, attn_len, allowed, row_steps, deferred, want_logprobs, chunk, feed_draft)
        return self._call("mixed", args, run)

    def verify(self, rows, attn_len, k, plan, row_steps, deferred, want_logprobs):
        def run():
            carried = (self.params, self.cache, self.state, self.tables)
            verify = self.steps.verify[rows, attn_len, k]
            self.cache, self.state, out, checked, kinds = verify(
                *carried, row_steps, plan, deferred, want_logprobs
            )
            return out, checked, kinds

        args = (rows, attn_len, k, plan, row_steps, deferred, want_logprobs)
        return self._call("verify", args, run)

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

    # ---------------------------------------------------------------------------- warm-up
    def page_list(self, pages: list[int]) -> np.ndarray:
        """Pages for `clear_pages`, padded with the pool size (dropped)."""
        layout = self.steps.layout
        padded = np.full(layout.max_pages, layout.num_pages, np.int32)
        padded[: len(pages)] = pages
        return padded

    def warm_up(self) -> None:
        """Compile every prefill bucket, every (mixed, verify) decode bucket pair and the small
        verbs. The caller sets block tables that map nowhere first: the warm-up chunks write."""
        layout, vocab = self.steps.layout, self.steps.vocab_size
        greedy = SamplingArrays.from_params([SamplingParams(temperature=0.0).resolve()], [0])
        chunk = lambda size: pack_chunk(
            np.zeros(size, np.int32), 0, 0, 1, True, 0, 0, {}, (), greedy, vocab, False
        )
        idle = lambda rows: (np.zeros(rows, np.int32), np.zeros(rows, bool), np.False_)
        for feed_draft in (True, False) if self.steps.draft_model else (True,):
            for size in layout.prefill_buckets:
                out = self.prefill(None, chunk(size), feed_draft)
            for rows, attn_len in self.steps.decode:
                out = self.decode(rows, attn_len, *idle(rows), feed_draft)
            for rows, attn_len in self.steps.mixed:
                mixed_chunk = chunk(layout.mixed_chunk_len(rows))
                out, _ = self.mixed(rows, attn_len, None, *idle(rows), mixed_chunk, feed_draft)
        for rows in layout.slot_buckets:  # one sample program per slot bucket
            out = self.sample(None, np.zeros(rows, bool), np.False_)
        for rows, attn_len, k in self.steps.verify:
            row_steps, deferred, logprobs = idle(rows)
            out, *_ = self.verify(rows, attn_len, k, self._plan(rows, k, -1), row_steps, deferred, logprobs)
        self.history(pack_history(0, [], 0, layout.max_seq_len))
        self.clear_pages(self.page_list([]))
        jax.block_until_ready((out, self.cache, self.state))

    def _plan(self, rows: int, k: int, force: int) -> DraftPlan:
        """A draft plan for warm-up and timing of a program of `k` drafts: every row drafting,
        `force` (-1: none)."""
        layout = self.steps.layout
        kinds = len(DRAFT_SOURCES[layout.speculative].priors)
        lengths = program_lengths(layout.speculative, layout.verify_variants, k)
        chances, costs = np.full((rows, kinds), 0.5, np.float32), np.ones(len(lengths), np.float32)
        return DraftPlan(np.ones(rows, bool), chances, costs, np.int32(force))

    def verify_cost(self, rounds: int = 7) -> dict[tuple[int, int], float]:
        """Per (slot bucket, draft tokens) verify variant, its step's time over a decode step's
        that feeds no draft model (the engine's step without speculation), every row busy, at the
        smallest attention bucket, the program made to take that length. Each round times a
        decode dispatch and then each length's in turn, so a slow spell of the machine slows both
        sides of a ratio; a length's cost is its median ratio over the rounds, at least a shorter
        length's and at least 1 (a verify step does a decode step's work and more: a cost measured
        below it would make drafts that are never accepted look free). The caller sets block
        tables that map nowhere first (the busy rows write) and runs it with no request in a slot
        (their state is left for the next prefill to set)."""
        layout, costs = self.steps.layout, {}
        attn_len = layout.attention_buckets[0]

        def seconds(call):
            start = time.perf_counter()
            jax.block_until_ready(call().tokens)
            return time.perf_counter() - start

        for rows, k in verify_programs(layout.speculative, layout.verify_variants):
            busy, none = np.full(rows, layout.decode_steps, np.int32), np.zeros(rows, bool)
            decode = partial(self.decode, rows, attn_len, busy, none, np.False_, False)
            lengths = program_lengths(layout.speculative, layout.verify_variants, k)
            verifies = {
                n: partial(self.verify, rows, attn_len, k, self._plan(rows, k, index), busy, none, np.False_)
                for index, n in enumerate(lengths)
                if n
            }
            ratios = {n: [] for n in verifies}
            for _ in range(rounds):
                plain = seconds(decode)
                for n, verify in verifies.items():
                    ratios[n].append(seconds(lambda verify=verify: verify()[0]) / plain)
            costs.update({(rows, n): float(np.median(r)) for n, r in ratios.items()})
        for rows, n in sorted(costs):  # shorter lengths first
            shorter = [costs[rows, m] for m in range(n) if (rows, m) in costs]
            costs[rows, n] = max(costs[rows, n], 1.0, *shorter)
        return costs

    def consumed(self) -> bool:
        """Whether a failed call took the donated cache or state with it."""
        return any(a.is_deleted() for a in jax.tree.leaves(self.cache)) or self.state.tokens.is_deleted()
