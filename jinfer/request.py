"""What the host knows of one request while it runs: `Request` (its ids, settings, pages, progress
and timings, kept by the scheduler), the `RequestOutput` events its sink receives, and the
`PrefillWork` the scheduler plans for it (cut into pieces for the device by `PrefillWork.pieces`).

Plain Python: the scheduler (`jinfer.scheduler`) owns every change to a request; the engine and
the server read them.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from jinfer.paging import SequencePages
from jinfer.reasoning import BudgetKnobs, Reasoning
from jinfer.sampling import SamplingArrays, SamplingParams
from jinfer.speculation import DraftRecord
from jinfer.state import cut_pieces
from jinfer.structured import Constraint
from jinfer.tokenizer import TextStream

# A request's priority when it asks for none (vLLM's convention: lower runs first). Work less
# urgent than it is background work (`Request.background`).
DEFAULT_PRIORITY = 0


@dataclasses.dataclass
class RequestOutput:
    """One event for a request's sink: new text and tokens, and the outcome once finished."""

    request_id: str
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # what ended a "stop": the stop token's id or stop string (vLLM's)
    error: str | None = None
    metrics: dict[str, Any] | None = None


def positions_written(steps: int, drafts: int = 0) -> int:
    """Positions `steps` decode steps may write for one row: one a step, or, verifying up to
    `drafts` draft tokens a step, up to drafts + 1 a step. Pages (`Request.capacity`, the
    scheduler's reserve) and attention buckets (the engine) are sized by this one count."""
    return steps * (drafts + 1)


@dataclasses.dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams
    max_tokens: int  # resolved: never past the context window
    stop_ids: frozenset[int]  # eos (unless ignore_eos) + stop_token_ids
    seed: int
    sink: Callable[[RequestOutput], None]
    stream: TextStream
    dropped_prompt_tokens: int = 0
    kv: SequencePages = dataclasses.field(default_factory=SequencePages)
    constraint: Constraint | None = None  # its output's grammar: one token per dispatch, known first
    slot: int | None = None
    # What a slot's prefill computes: the prompt, or after a preemption the prompt and the output
    # so far (`generated_before` tokens of it); `prefilled` of them are in the cache.
    prefill_ids: list[int] = dataclasses.field(default_factory=list)
    generated_before: int = 0
    prefilled: int = 0
    first_chunk_start: int = 0  # where this admission's first computed chunk starts
    in_flight: int = 0  # output tokens that dispatched, not yet committed work may still produce
    output_ids: list[int] = dataclasses.field(default_factory=list)
    finished: bool = False
    cancelled: bool = False
    admissions: int = 0  # the scheduler's admission count when it last got a slot (latest: preempted first)
    cached_tokens: int | None = None  # prompt tokens found in the prefix cache at its first admission
    preemptions: int = 0
    # Its speculation: whether it drafts, its drafts' fate so far (`jinfer.speculation`'s value,
    # stored by the scheduler).
    drafts: DraftRecord = dataclasses.field(default_factory=DraftRecord)
    processor_inputs: dict[str, Any] = dataclasses.field(default_factory=dict)  # `inputs.processor_inputs`
    adapter: int = -1  # its slot in the engine's adapter stack (`jinfer.adapter_slots`), -1: none
    priority: int = DEFAULT_PRIORITY  # lower runs first (`jinfer.scheduler`)
    prediction_ids: tuple[int, ...] = ()  # the output it expects (drafts look there; `PreparedRequest`)
    reasoning: Reasoning | None = None  # a reasoning model's chat: how it thinks (`jinfer.reasoning`)
    weights_version: int = 0  # of the weights it started on (`Engine.update_weights`)
    submitted_at: float = dataclasses.field(default_factory=time.perf_counter)
    admitted_at: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)

    @property
    def running(self) -> bool:
        """In a slot with its whole prefill done: decoded by every decode dispatch."""
        return self.slot is not None and self.prefilled == len(self.prefill_ids) and not self.finished

    @property
    def wants_decode(self) -> bool:
        """Running, and the tokens already in flight do not reach max_tokens: a decode dispatch for
        a request that work on the device will surely finish would only compute discarded tokens.
        A constrained request runs at most one step ahead of what the host has read: the engine
        samples that step (deferred) once the token before it is read, as its allowed set needs."""
        if self.constraint is not None and self.in_flight > 1:
            return False
        return self.running and len(self.output_ids) + self.in_flight < self.max_tokens

    @property
    def budget(self) -> BudgetKnobs | None:
        """Its thinking's budget as the device reads it, None: no budget."""
        return None if self.reasoning is None or self.reasoning.budget is None else self.reasoning.knobs()

    @property
    def reasoning_tokens(self) -> int:
        """Output tokens of its thinking (through the closing marker)."""
        if self.reasoning is None:
            return 0
        close = self.reasoning.format.close_id
        return self.output_ids.index(close) + 1 if close in self.output_ids else len(self.output_ids)

    @property
    def background(self) -> bool:
        """Whether it is less urgent than a request that asks for no priority: background work, which
        makes way for such requests (`jinfer.scheduler`)."""
        return self.priority > DEFAULT_PRIORITY

    def dispatch_tokens(self, steps: int) -> int:
        """Tokens a decode dispatch of `steps` steps makes for it (one, when constrained)."""
        return 1 if self.constraint is not None else steps

    @property
    def written(self) -> int:
        """Positions whose K/V are written (or dispatched) from tokens the host knows: the prefill
        so far, then every token but the last one known (its K/V come with the next step)."""
        return max(self.prefilled, len(self.prompt_ids) + len(self.output_ids) - 1)

    def capacity(self, steps: int, drafts: int = 0) -> int:
        """Positions its pages must hold for a decode dispatch of `steps` steps: the device feeds
        the last token sampled (perhaps still in flight) and writes from there what those steps and
        the ones in flight may (`positions_written`), but never past the positions its last
        possible token needs."""
        known = len(self.prompt_ids) + len(self.output_ids)
        written = known + positions_written(self.in_flight + steps, drafts) - 1
        return written if not drafts else min(written, len(self.prompt_ids) + self.max_tokens)

    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def metrics(self, now: float) -> dict[str, Any]:
        first = self.token_times[0] if self.token_times else None
        n = len(self.output_ids)
        decode_time = (self.token_times[-1] - first) if n > 1 else 0.0
        return {
            "prompt_tokens": len(self.prompt_ids),
            "cached_prompt_tokens": self.cached_tokens or 0,
            "completion_tokens": n,
            "dropped_prompt_tokens": self.dropped_prompt_tokens,
            "preemptions": self.preemptions,
            "queue_s": (self.admitted_at or now) - self.submitted_at,
            "ttft_s": (first - self.submitted_at) if first is not None else None,
            "inter_token_s": list(np.diff(self.token_times)) if n > 1 else [],
            "total_s": now - self.submitted_at,
            "decode_tokens_per_s": (n - 1) / decode_time if decode_time > 0 else None,
            "draft_tokens": self.drafts.drafted,
            "accepted_tokens": self.drafts.accepted,
            "verify_steps": self.drafts.verify_steps,
            "reasoning_tokens": self.reasoning_tokens,
            "accepted_prediction_tokens": self.drafts.predicted_accepted,
            "rejected_prediction_tokens": self.drafts.predicted_rejected,
            "weights_version": self.weights_version,
        }


@dataclasses.dataclass
class PrefillWork:
    request: Request
    slot: int
    start: int  # position of the chunk's first token
    tokens: list[int]  # the chunk (unpadded)
    last: bool  # the final chunk: its sampled token is the request's next output token
    first: bool  # the first chunk this admission computes (the slot's penalty history is set then)

    def pieces(self, piece_len: int, vocab: int) -> list[tuple[np.ndarray, np.ndarray]]:
        """The chunk cut into pieces of `piece_len` tokens (the last padded), each packed with its
        request's settings for the device (`jinfer.state.pack_piece`); only the chunk's final piece
        may end the prompt."""
        request, sp = self.request, self.request.sampling
        return cut_pieces(
            self.tokens,
            start=self.start,
            last=self.last,
            piece_len=piece_len,
            slot=self.slot,
            generated=request.generated_before,
            min_tokens=sp.min_tokens,
            bias=sp.logit_bias or {},
            stop_ids=sorted(request.stop_ids),
            sampling=SamplingArrays.from_params([sp], [request.seed], [request.budget]),
            vocab=vocab,
        )

    def piece_count(self, piece_len: int) -> int:
        return -(-len(self.tokens) // piece_len)


class Event(NamedTuple):
    """An output for a request's sink, to be delivered by the caller (`deliver`)."""

    sink: Callable[[RequestOutput], None]
    output: RequestOutput


def deliver(events: list[Event]) -> None:
    for sink, output in events:
        sink(output)
