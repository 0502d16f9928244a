"""The engine's device side: the weights, the KV cache, the slot state and the block tables the
jitted steps carry from call to call, and every call made on them.

Each call takes host values only (numpy arrays, packed prompt chunks, ints, bools); the device
values it reads and rebinds stay here. So a call is also a message: on several processes
(`jinfer.cluster`) the leader's `Device` hands each call to its `publish` hook before making it,
and every follower's `Device` makes the same call on its own shards, in the same order, through
`replay`. The lock keeps the order of calls and the order of messages the same when two threads
call (the engine's loop and a server scoring a text).

    dispatch(program, inputs, chunk=None) -> DispatchOutput   (`jinfer.inputs`, `Steps.programs`)
    history(packed)   clear_pages(pages)   set_tables(tables)   reset()   score(tokens) -> arrays

An input's `allowed` bitmask is None when no row is constrained: the device passes its resident
all-bits-set mask instead of uploading one. `warm_up` builds every program's executable (kept
whole from an earlier start, `jinfer.program_store`, or compiled all at once on every core), then
dispatches each it compiled once; a dispatch runs its program's executable without tracing;
`idle_inputs` are a program's inputs with no row busy (warm-up; timing verify steps,
`speculation.measure_verify_costs`).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import jax
import numpy as np

from jinfer.compile_cache import bypassed, compile_fresh, count_kept
from jinfer.config import PROMPT_PIECE
from jinfer.inputs import DispatchOutput, Program, RowInputs, neutral_inputs
from jinfer.program_store import ProgramStore
from jinfer.sampling import SamplingArrays, SamplingParams
from jinfer.scoring import score_program
from jinfer.speculative import DRAFT_SOURCES, program_lengths
from jinfer.state import PackedChunk, pack_history, pack_piece, pack_pieces
from jinfer.steps import Steps
from jinfer.weights import Weights

VERBS = ("dispatch", "history", "clear_pages", "set_tables", "reset", "score")


class Device:
    """The device values of one engine and the verbs over them (see the module docstring)."""

    def __init__(self, steps: Steps, weights: Weights, dtype, tables: np.ndarray):
        self.steps, self.weights, self.dtype = steps, weights, dtype
        self.publish: Callable[[str, tuple], None] | None = None  # the leader's, on several processes
        self._lock = threading.Lock()
        layout = steps.layout
        scoring = {"page_size": layout.page_size, "attention_kernel": layout.attention_kernel}
        self._score = jax.jit(
            partial(score_program, cfg=steps.model, vocab=steps.vocab_size, cache_dtype=dtype, **scoring)
        )
        self.weights_dropped = False  # by a level-2 sleep, until set_target
        self.cache = steps.new_cache(dtype)
        self.state = steps.new_state()
        self.tables = steps.put_tables(tables)
        # Each program's executable, built by the warm-up: calls go straight to it (no trace).
        self.executables: dict[Program, jax.stages.Compiled] = {}

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

    # -------------------------------------------------------------------------------- verbs
    def dispatch(
        self, program: Program, inputs: RowInputs, chunk: PackedChunk | None = None
    ) -> DispatchOutput:
        """Run one of the steps' programs over the device's values (`Steps.programs`)."""

        def run():
            built = self.executables.get(program)
            call = self.steps.programs[program] if built is None else built
            if program.kind == "sample":
                self.state, out = call(*self._program_args(program, inputs, chunk))
                return out
            self.cache, self.state, out = call(*self._program_args(program, inputs, chunk))
            return out

        return self._call("dispatch", (program, inputs, chunk), run)

    def _program_args(self, program: Program, inputs: RowInputs, chunk: PackedChunk | None) -> tuple:
        """What `program` is called with: the device's values it carries, the inputs placed."""
        # No row constrained: the resident all-bits-set mask, no upload.
        allowed = inputs.allowed
        allowed = self.steps.unconstrained if allowed is None else self.steps.put_allowed(allowed)
        placed = inputs.replace(allowed=allowed)
        if program.kind == "sample":
            return (self.state, placed)
        return (self.weights, self.cache, self.state, self.tables, placed, chunk)

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

    def set_target(self, target) -> None:
        """Serve the served model's weights `target` (`weights.replacement`; a draft model's kept)
        from the next call on."""
        with self._lock:
            self.weights = self.weights.replace(target=target)
            self.weights_dropped = False

    def sleep(self, drop_weights: bool) -> None:
        """Free the KV cache and the slot state; with `drop_weights` the served model's weights too,
        their shapes and shardings kept for `set_target` (`jinfer.residency`)."""
        with self._lock:
            self.cache = self.state = None
            if drop_weights:
                abstract = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
                self.weights = self.weights.replace(target=jax.tree.map(abstract, self.weights.target))
                self.weights_dropped = True

    def wake_up(self) -> None:
        """A fresh KV cache and slot state (the programs take them as before)."""
        with self._lock:
            self.cache = self.steps.new_cache(self.dtype)
            self.state = self.steps.new_state()

    def set_adapters(self, adapters) -> None:
        """Serve this adapter stack (`jinfer.lora.AdapterStack`, shaped as the one the programs were
        built with) from the next call on."""
        with self._lock:
            self.weights = self.weights.replace(adapters=adapters)

    def score(self, tokens, adapter: int = -1):
        """`jinfer.scoring`'s program over tokens [1, T] (through the adapter in this slot of the
        stack; -1: none): (chosen, top ids, top log-probs) on device."""
        if self.weights_dropped:
            raise RuntimeError("the weights were dropped (sleep level 2): wake_up or update_weights first")
        stack = None if adapter < 0 else self.weights.adapters
        run = lambda: self._score(self.weights.target, tokens, stack, np.int32(adapter))
        return self._call("score", (tokens, adapter), run)

    # ---------------------------------------------------------------------------- warm-up
    def page_list(self, pages: list[int]) -> np.ndarray:
        """Pages for `clear_pages`, padded with the pool size (dropped)."""
        layout = self.steps.layout
        padded = np.full(layout.max_pages, layout.num_pages, np.int32)
        padded[: len(pages)] = pages
        return padded

    def warm_up(self) -> None:
        """Compile every program (`Steps.programs`) and the small verbs, then call once each
        program this process built: a kept executable (`jinfer.program_store`) ran on this machine
        when an earlier start built it, and its first call costs what any call costs (a prompt
        program's is its whole chunk's compute: seconds of a restart, spent for nothing). The
        caller sets block tables that map nowhere first: the warm-up chunks write."""
        idle = {p: (self.idle_inputs(p), self._idle_chunk(p)) for p in self.steps.programs}
        for program in self._compile_programs(idle):
            self.dispatch(program, *idle[program])
        self.history(pack_history(0, [], 0, self.steps.layout.max_seq_len))
        self.clear_pages(self.page_list([]))
        jax.block_until_ready((self.cache, self.state))

    def _compile_programs(self, idle: dict[Program, tuple[RowInputs, PackedChunk | None]]) -> list[Program]:
        """Build every program's executable for its `idle` inputs and chunk before its first call:
        the one kept whole from an earlier start (`jinfer.program_store`) where there is one, else
        traced (Python's work, one at a time), compiled on every core at once and kept (JAX's
        compile cache may serve them only where nothing is kept: `bypassed` says why). Calls with
        the same arguments' shapes run it. The programs built here, not loaded kept."""
        store = ProgramStore.for_steps(self.steps)
        args = {program: self._program_args(program, *idle[program]) for program in idle}
        with ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:
            if store is not None:
                unbuilt = [program for program in idle if program not in self.executables]
                kept = pool.map(lambda p: (p, self._load_kept(store, p, args[p])), unbuilt)
                self.executables.update((p, built) for p, built in kept if built is not None)
            missing = [program for program in idle if program not in self.executables]
            lowered = [self.steps.programs[program].lower(*args[program]) for program in missing]
            with bypassed() if store is not None else contextlib.nullcontext():
                compiled = dict(zip(missing, pool.map(compile_fresh, lowered), strict=True))
            self.executables.update({program: built for program, (built, _) in compiled.items()})
            if store is not None:  # what this process had built before may not serialize whole
                fresh = [program for program, (_, new) in compiled.items() if new]
                list(pool.map(lambda p: store.save(p, args[p], self.executables[p]), fresh))
        return missing

    @staticmethod
    def _load_kept(store: ProgramStore, program: Program, args: tuple) -> jax.stages.Compiled | None:
        start = time.perf_counter()
        built = store.load(program, args)
        if built is not None:
            count_kept(time.perf_counter() - start)
        return built

    def _idle_chunk(self, program: Program) -> PackedChunk | None:
        """A prefill or mixed program's pieces: one greedy one-token prompt into slot 0, the rest
        padding (None for other kinds)."""
        if not program.chunk:
            return None
        greedy = SamplingArrays.from_params([SamplingParams(temperature=0.0).resolve()], [0])
        tokens, vocab = np.zeros(PROMPT_PIECE, np.int32), self.steps.vocab_size
        flags = {"slot": 0, "start": 0, "length": 1, "last": True, "generated": 0, "min_tokens": 0}
        piece = pack_piece(tokens, **flags, bias={}, stop_ids=(), sampling=greedy, vocab=vocab)
        return pack_pieces([piece], program.chunk // PROMPT_PIECE, PROMPT_PIECE, vocab)

    def idle_inputs(self, program: Program, force: int = -1, busy: int = 0) -> RowInputs:
        """A program's inputs with no row busy (`busy`: every row `busy` steps); a verify program's
        plan has every row drafting, made to take the length of index `force` (-1: its choice)."""
        layout = self.steps.layout
        rows = program.input_rows
        if program.kind != "verify":
            return neutral_inputs(rows, processors=self.steps.processors).replace(
                steps=np.full(rows, busy, np.int32)
            )
        kinds = len(DRAFT_SOURCES[layout.speculative].priors)
        lengths = len(program_lengths(layout.speculative, layout.verify_variants, program.drafts))
        inputs = neutral_inputs(
            rows, kinds=kinds, lengths=lengths, plan=True, processors=self.steps.processors
        )
        plan = inputs.plan.replace(drafting=np.ones(rows, bool), force=np.int32(force))
        return inputs.replace(steps=np.full(rows, busy, np.int32), plan=plan)

    def consumed(self) -> bool:
        """Whether a failed call took the donated cache or state with it."""
        return any(a.is_deleted() for a in jax.tree.leaves(self.cache)) or self.state.tokens.is_deleted()
