"""A stand-in for `jinfer.device.Device` whose model is arithmetic, so that the engine's host side
(dispatch, commit, deferred rows, preemption, the prefix cache, recovery) runs in milliseconds and
its tokens can be worked out by hand.

The fake model reads a sequence through its pages, as the real steps do: each position's "K/V" is a
running hash of the sequence up to it (`fold`), written into the page the block tables give for
that position, and the token after a position is a function of the hash there (`next_token`). A
chunk that starts past cached positions reads the hash its first page holds; a host that feeds a
wrong token, position or page makes every later token differ. `expected` computes a request's
tokens without any of it.
"""

from __future__ import annotations

import numpy as np

from jinfer.inputs import DispatchOutput, Program, RowInputs
from jinfer.sampling import TOP_LOGPROBS, StepOutput
from jinfer.state import PackedChunk

EMPTY = -1  # a pool entry nothing was written to


def fold(previous: int, token: int) -> int:
    """The hash of a sequence one token longer."""
    return (previous * 1_000_003 + token + 1) % 2_147_483_647


def next_token(hashed: int, vocab: int) -> int:
    return hashed % vocab


def expected(prompt: list[int], max_tokens: int, vocab: int) -> list[int]:
    """The tokens the fake model gives after `prompt`: greedy, no stop."""
    hashed, out = 0, []
    for token in prompt:
        hashed = fold(hashed, token)
    for _ in range(max_tokens):
        out.append(next_token(hashed, vocab))
        hashed = fold(hashed, out[-1])
    return out


def _output(tokens: np.ndarray) -> StepOutput:
    """What leaves the device for tokens [steps, rows] (no log-probs)."""
    top = np.zeros((*tokens.shape, TOP_LOGPROBS), np.float32)
    return StepOutput(
        tokens.astype(np.int32), np.zeros(tokens.shape, bool), top[..., 0], top.astype(np.int32), top
    )


class FakeDevice:
    """The host-value verbs of `jinfer.device.Device` over the fake model (see the module docstring).
    `fail(kind, nth, consumed=False)` makes the nth dispatch of a kind raise (and, with `consumed`,
    report the cache gone, as a failed donated call does)."""

    def __init__(self, engine):
        self.layout, self.vocab = engine.layout, engine.steps.vocab_size
        self.steps = engine.steps
        self.weights = None
        self.tables = engine.kv.tables.copy()
        self.calls: list[Program] = []
        self.resets = 0
        self._failing: tuple[str, int, bool] | None = None
        self._consumed = False
        self.reset()
        self.resets = 0

    # ------------------------------------------------------------------------- the fake model
    def _read(self, slot: int, position: int) -> int:
        """The hash at a position of a slot's sequence (0 before its first token)."""
        if position < 0:
            return 0
        size = self.layout.page_size
        value = self.pool[self.tables[slot, position // size], position % size]
        assert value != EMPTY, f"slot {slot} reads position {position}, which nothing wrote"
        return int(value)

    def _write(self, slot: int, position: int, token: int) -> int:
        size = self.layout.page_size
        hashed = fold(self._read(slot, position - 1), token)
        self.pool[self.tables[slot, position // size], position % size] = hashed
        return hashed

    def _advance(self, slot: int, hashed: int, allowed=None) -> int:
        """Sample after a position's hash (the first allowed token from the model's on) and make
        it the slot's next input."""
        token = next_token(hashed, self.vocab)
        if allowed is not None:
            bits = np.unpackbits(allowed[slot].view(np.uint8), bitorder="little")[: self.vocab]
            token = next(t for t in (*range(token, self.vocab), *range(token)) if bits[t])
        self.token[slot], self.position[slot] = token, self.position[slot] + 1
        return token

    def _prefill(self, chunk: PackedChunk, allowed) -> np.ndarray:
        """Each piece in order (a prompt's later pieces read what its earlier ones wrote): the
        token after each piece, 0 after one that does not end its prompt."""
        out = np.zeros(chunk.pieces, np.int32)
        tokens = np.asarray(chunk.ints)[:, -chunk.piece_len :]
        for piece, (slot, start, length, last) in enumerate(
            zip(chunk.slot, chunk.start, chunk.length, chunk.last, strict=True)
        ):
            for offset in range(length):
                hashed = self._write(int(slot), int(start) + offset, int(tokens[piece, offset]))
            if last:
                self.position[slot] = start + length - 1
                out[piece] = self._advance(int(slot), hashed, allowed)
        return out

    def _decode_rows(self, inputs: RowInputs, rows: int, steps: int, per_step: int) -> np.ndarray:
        """`steps` steps over slots 0..rows-1: tokens [steps x per_step, rows], -1 where none."""
        out = np.full((steps * per_step, rows), -1, np.int32)
        for step in range(steps):
            for slot in range(rows):
                if inputs.steps[slot] <= step:
                    continue
                hashed = self._write(slot, int(self.position[slot]), int(self.token[slot]))
                if inputs.deferred[slot]:
                    self.waiting[slot] = hashed
                else:
                    out[step * per_step, slot] = self._advance(slot, hashed)
        return out

    # ----------------------------------------------------------------------------- verbs
    def dispatch(self, program: Program, inputs: RowInputs, chunk: PackedChunk | None = None):
        self.calls.append(program)
        if self._failing is not None and self._failing[0] == program.kind:
            kind, left, consumed = self._failing
            self._failing = (kind, left - 1, consumed) if left > 1 else None
            if left == 1:
                self._consumed = consumed
                raise RuntimeError("simulated device fault")
        if program.kind == "sample":
            rows = inputs.rows
            tokens = np.full((1, rows), -1, np.int32)
            for slot in np.flatnonzero(inputs.deferred):
                tokens[0, slot] = self._advance(slot, int(self.waiting[slot]), inputs.allowed)
            return DispatchOutput(rows=_output(tokens))
        if program.kind == "prefill":
            return DispatchOutput(rows=None, chunk=_output(self._prefill(chunk, inputs.allowed)[None]))
        if program.kind == "mixed":  # one decode step of its rows, and the pieces (other slots)
            rows = self._decode_rows(inputs, program.rows, 1, 1)
            return DispatchOutput(
                rows=_output(rows), chunk=_output(self._prefill(chunk, inputs.allowed)[None])
            )
        steps = self.layout.decode_steps
        per_step = program.drafts + 1 if program.kind == "verify" else 1
        tokens = self._decode_rows(inputs, program.rows, steps, per_step)
        if program.kind != "verify":
            return DispatchOutput(rows=_output(tokens))
        none = np.zeros((steps, program.rows), np.int32)  # no draft checked
        return DispatchOutput(rows=_output(tokens), checked=none, kinds=none)

    def history(self, packed) -> None:
        pass  # the fake model has no penalties

    def clear_pages(self, pages) -> None:
        pages = np.asarray(pages)
        self.pool[pages[pages < self.layout.num_pages]] = EMPTY

    def set_tables(self, tables) -> None:
        self.tables = np.array(tables)

    def reset(self) -> None:
        layout = self.layout
        self.pool = np.full((layout.num_pages, layout.page_size), EMPTY, np.int64)
        self.token = np.zeros(layout.max_slots, np.int64)
        self.position = np.zeros(layout.max_slots, np.int64)
        self.waiting = np.zeros(layout.max_slots, np.int64)
        self._consumed = False
        self.resets += 1

    def score(self, tokens):
        raise NotImplementedError("the fake model scores nothing")

    def page_list(self, pages: list[int]) -> np.ndarray:
        padded = np.full(self.layout.max_pages, self.layout.num_pages, np.int32)
        padded[: len(pages)] = pages
        return padded

    def consumed(self) -> bool:
        return self._consumed

    def fail(self, kind: str, nth: int, consumed: bool = False) -> None:
        self._failing = (kind, nth, consumed)
