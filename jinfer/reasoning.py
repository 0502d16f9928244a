"""Reasoning models: the thinking a model writes between markers before its answer (Qwen3's and
DeepSeek-R1's `<think>` ... `</think>`), told apart from the answer, and held to a budget.

    reasoning_format_of(tokenizer)   -> the model's markers, or None: it does not reason
    Reasoning (a request's)          -> split(text): (thinking or None, answer); a stream's
                                        `ReasoningStream`; its budget's device knobs
    ReasoningConstraint              -> a request's constraint (JSON schema, tool call, ...) held
                                        back until the thinking ends: it applies to the answer

A model reasons when its vocabulary has both markers as single tokens and its chat template writes
the closing one (so it knows the convention). Where the thinking starts is read from the prompt:
a template that opens it (DeepSeek-R1's, Qwen3's with some settings) leaves the output inside it;
one that closes an empty block (Qwen3's `enable_thinking: false`) leaves nothing to split; else the
thinking is what the output opens with `<think>`, if it does.

The thinking and the answer are each stripped of the blank space next to the markers, the same
whether the output is split whole or as it streams. A budget (`max_reasoning_tokens`, or the
`reasoning_effort` mapped to one, `EFFORT_BUDGETS`) is kept on the device, so the output streams
at full speed: once a request has thought that many tokens without closing, its next token is the
closing marker (`sampling.process`), and the answer follows.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

OPEN, CLOSE = "<think>", "</think>"
# OpenAI's reasoning_effort as a budget of thinking tokens (None: up to the window).
EFFORT_BUDGETS = {"none": 0, "minimal": 256, "low": 1024, "medium": 4096, "high": None, "xhigh": None}


class ReasoningFormat(NamedTuple):
    """A reasoning model's markers."""

    open_id: int
    close_id: int
    special: bool  # the markers are special tokens: text keeps them only if asked to


def reasoning_format_of(tokenizer) -> ReasoningFormat | None:
    """The model's thinking markers, or None where it does not reason (see the module docstring)."""
    open_id, close_id = tokenizer.token_to_id(OPEN), tokenizer.token_to_id(CLOSE)
    if open_id is None or close_id is None or CLOSE not in (tokenizer.chat_template or ""):
        return None
    special = tokenizer.decode([close_id], skip_special_tokens=True) != CLOSE
    return ReasoningFormat(open_id, close_id, special)


class BudgetKnobs(NamedTuple):
    """A budget as the device reads it (`SamplingArrays`): once `limit` output tokens are sampled
    with the thinking open (`open_id` among them, or -1: opened by the prompt) and `close_id` not
    yet, the next token is `close_id` (-1: no budget)."""

    open_id: int = -1
    close_id: int = -1
    limit: int = 0


@dataclasses.dataclass(frozen=True)
class Reasoning:
    """How a request's output reasons: its model's markers, whether the prompt opened the
    thinking, and its budget of thinking tokens (None: none)."""

    format: ReasoningFormat
    opened: bool
    budget: int | None = None

    @classmethod
    def of_prompt(cls, format: ReasoningFormat, prompt_ids, budget: int | None) -> Reasoning | None:
        """A chat's reasoning from its prompt's tokens: None where the prompt closed the thinking
        after its last opening (the model answers straight away)."""
        last = lambda token: max((i for i, t in enumerate(prompt_ids) if t == token), default=-1)
        opened, closed = last(format.open_id), last(format.close_id)
        if closed > opened >= 0 and closed >= len(prompt_ids) - 4:  # an empty block: no thinking
            return None
        return cls(format, opened > closed, budget)

    def knobs(self) -> BudgetKnobs:
        if self.budget is None:
            return BudgetKnobs()
        # An output that opens the thinking itself spends its first token on the marker.
        return BudgetKnobs(
            -1 if self.opened else self.format.open_id, self.format.close_id, self.budget + (not self.opened)
        )

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole output as (its thinking, or None where it did not think; its answer)."""
        stream = ReasoningStream(self)
        thinking, answer = stream.add(text)
        more_thinking, more_answer = stream.finish()
        return (thinking + more_thinking if stream.thought else None), answer + more_answer


def split_output(reasoning: Reasoning | None, text: str) -> tuple[str | None, str]:
    """A whole output as (its thinking, None where there is none; its answer)."""
    return (None, text) if reasoning is None else reasoning.split(text)


def split_piece(stream: ReasoningStream | None, piece):
    """One streamed piece of an output (a `RequestOutput`) as (the thinking to send now, the piece
    with its answer's text only), through `stream` where the request reasons."""
    if stream is None:
        return "", piece
    thinking, answer = stream.add(piece.text)
    if piece.finished:
        more_thinking, more_answer = stream.finish()
        thinking, answer = thinking + more_thinking, answer + more_answer
    return thinking, dataclasses.replace(piece, text=answer)


class ReasoningStream:
    """Splits one output's text deltas into thinking and answer deltas as they come: text that may
    be a marker is held until it is known, as is blank space that may end the thinking."""

    def __init__(self, reasoning: Reasoning):
        self.state = "thinking" if reasoning.opened else "start"
        self.thought = reasoning.opened  # the output has thinking (possibly empty)
        self.pending = ""
        self.said = False  # thinking text sent: blank space is kept from there on

    def add(self, text: str) -> tuple[str, str]:
        """(thinking, answer) to send now for a text delta."""
        self.pending += text
        thinking = ""
        if self.state == "start":
            start = self.pending.lstrip()
            if not start or (OPEN.startswith(start) and start != OPEN):
                return "", ""
            if not start.startswith(OPEN):
                self.state = "answer"
                answer, self.pending = self.pending, ""
                return "", answer
            self.state, self.thought, self.pending = "thinking", True, start[len(OPEN) :]
        if self.state == "thinking":
            at = self.pending.find(CLOSE)
            if at < 0:
                return self._thinking(held=True), ""
            thinking = self._thinking(held=False, upto=at)  # leaves CLOSE and what follows
            self.state, self.pending = "answer start", self.pending[len(CLOSE) :]
        if self.state == "answer start":
            self.pending = self.pending.lstrip()
            if not self.pending:
                return thinking, ""
            self.state = "answer"
        answer, self.pending = self.pending, ""
        return thinking, answer

    def _thinking(self, held: bool, upto: int | None = None) -> str:
        """Thinking text from `pending` (up to `upto`, the rest kept), less leading blank space
        before any is said, less trailing blank space and (held) a tail that may begin CLOSE."""
        body = self.pending if upto is None else self.pending[:upto]
        rest = "" if upto is None else self.pending[upto:]
        if not self.said:
            body = body.lstrip()
        marker = next((k for k in range(len(CLOSE) - 1, 0, -1) if body.endswith(CLOSE[:k])), 0) if held else 0
        before = body[: len(body) - marker]
        keep = marker + len(before) - len(before.rstrip())
        out = body[: len(body) - keep]
        self.pending = body[len(body) - keep :] + rest if held else rest
        self.said |= bool(out)
        return out

    def finish(self) -> tuple[str, str]:
        """(thinking, answer) still held when the output ends."""
        held, self.pending = self.pending, ""
        if self.state == "thinking":
            return held.strip() if not self.said else held.rstrip(), ""
        if self.state == "start":
            return "", held
        return "", held if self.state == "answer" else ""
