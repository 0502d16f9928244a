"""Host-side scheduling: the waiting queue, slots, admission, stop conditions, cancellation.

Plain Python, never a jax array. The engine asks for a `Plan` each iteration (which prompt chunks
to prefill into which slots, and which request owns each slot for the decode dispatch), runs it
on the device, and later hands the device's tokens back to `commit`, the one place that decides
a request is finished. Finishing frees the slot; the next plan may give it to a waiting request.

    submit -> waiting (bounded) -> plan: slot reserved, prompt prefilled chunk by chunk
           -> running: tokens committed one by one -> stop / length / abort / error -> slot freed

Each request reports to its `sink` (a callable) with `RequestOutput` events carrying text deltas.
The scheduler never calls a sink itself: `plan`, `commit` and `fail` return the events they made
(`Event`s: sink and output), which the engine delivers outside its lock. Text is produced by an
incremental detokenizer; text that could be the start of a stop string is held back until it is
known not to be one, and a matched stop string is never returned.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from jinfer.config import dispatch_steps
from jinfer.sampling import SamplingParams
from jinfer.tokenizer import IncrementalDetokenizer, Tokenizer


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the request was not accepted."""


@dataclasses.dataclass
class RequestOutput:
    """One event for a request's sink: new text and tokens, and the outcome once finished."""

    request_id: str
    text: str = ""
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    metrics: dict[str, Any] | None = None


class TextStream:
    """Token ids in, safe text deltas out: UTF-8-whole, stop strings matched across tokens."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stops: tuple[str, ...]):
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.stops = stops
        self.pending = ""  # decoded but not yet emitted (might begin a stop string)
        self.stopped = False  # a stop string matched: nothing after it is ever emitted

    def add(self, token_id: int) -> tuple[str, bool]:
        """Return (text safe to emit, whether a stop string was matched)."""
        self.pending += self.detok.add([token_id])
        return self._release(final=False)

    def finish(self) -> str:
        """The rest of the text once generation ends (nothing, after a stop string)."""
        if self.stopped:
            return ""
        self.pending += self.detok.flush()
        return self._release(final=True)[0]

    def _release(self, final: bool) -> tuple[str, bool]:
        hits = [i for s in self.stops if (i := self.pending.find(s)) >= 0]
        if hits:
            text, self.pending, self.stopped = self.pending[: min(hits)], "", True
            return text, True
        hold = 0 if final else self._stop_prefix_len()
        cut = len(self.pending) - hold
        text, self.pending = self.pending[:cut], self.pending[cut:]
        return text, False

    def _stop_prefix_len(self) -> int:
        """Length of the longest suffix of `pending` that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(self.pending)), best, -1):
                if self.pending.endswith(stop[:k]):
                    best = k
                    break
        return best


@dataclasses.dataclass
class Committed:
    """What `commit` made of a dispatch's tokens."""

    events: list[Event]
    poisoned_slots: list[int]  # slots whose cache may now hold NaN/inf: clear them before reuse


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
    slot: int | None = None
    prefilled: int = 0  # prompt tokens already in the cache
    in_flight: int = 0  # output tokens that dispatched, not yet committed work may still produce
    output_ids: list[int] = dataclasses.field(default_factory=list)
    finished: bool = False
    cancelled: bool = False
    submitted_at: float = dataclasses.field(default_factory=time.perf_counter)
    admitted_at: float | None = None
    token_times: list[float] = dataclasses.field(default_factory=list)

    @property
    def running(self) -> bool:
        """In a slot with its whole prompt prefilled: decoded by every decode dispatch."""
        return self.slot is not None and self.prefilled == len(self.prompt_ids) and not self.finished

    @property
    def wants_decode(self) -> bool:
        """Running, and the tokens already in flight do not reach max_tokens: a decode dispatch for
        a request that work on the device will surely finish would only compute discarded tokens."""
        return self.running and len(self.output_ids) + self.in_flight < self.max_tokens

    def metrics(self, now: float) -> dict[str, Any]:
        first = self.token_times[0] if self.token_times else None
        n = len(self.output_ids)
        decode_time = (self.token_times[-1] - first) if n > 1 else 0.0
        return {
            "prompt_tokens": len(self.prompt_ids),
            "completion_tokens": n,
            "dropped_prompt_tokens": self.dropped_prompt_tokens,
            "queue_s": (self.admitted_at or now) - self.submitted_at,
            "ttft_s": (first - self.submitted_at) if first is not None else None,
            "inter_token_s": list(np.diff(self.token_times)) if n > 1 else [],
            "total_s": now - self.submitted_at,
            "decode_tokens_per_s": (n - 1) / decode_time if decode_time > 0 else None,
        }


@dataclasses.dataclass
class PrefillWork:
    request: Request
    slot: int
    start: int  # position of the chunk's first token
    tokens: list[int]  # the chunk (unpadded)
    last: bool  # the final chunk: its sampled token is the request's first output token


class Event(NamedTuple):
    """An output for a request's sink, to be delivered by the caller (`deliver`)."""

    sink: Callable[[RequestOutput], None]
    output: RequestOutput


def deliver(events: list[Event]) -> None:
    for sink, output in events:
        sink(output)


@dataclasses.dataclass
class Plan:
    prefills: list[PrefillWork]  # chunks dispatched on their own, before the decode dispatch
    decode_owners: list[Request | None]  # per slot; None = inactive this dispatch
    fused: PrefillWork | None = None  # a chunk carried by the decode dispatch (mixed prefill)
    events: list[Event] = dataclasses.field(default_factory=list)  # cancelled requests' endings

    @property
    def decodes(self) -> bool:
        return any(r is not None for r in self.decode_owners)


class Scheduler:
    def __init__(
        self,
        tokenizer: Tokenizer,
        max_slots: int,
        max_queue: int,
        chunk_len: int,
        token_budget: int,
        mixed_chunk_len: Callable[[int], int] | None = None,
        decode_steps: int = 1,
    ):
        self.tokenizer = tokenizer
        self.decode_steps = decode_steps  # tokens a decode dispatch produces per slot
        self.max_queue = max_queue
        self.chunk_len = chunk_len
        self.token_budget = token_budget
        # Prompt tokens a decode dispatch can carry, given how many slots it decodes (the highest
        # busy slot + 1); None: prompts are never carried by decode dispatches.
        self.mixed_chunk_len = mixed_chunk_len
        self.waiting: collections.deque[Request] = collections.deque()
        self.slots: list[Request | None] = [None] * max_slots
        self.by_id: dict[str, Request] = {}
        self._events: list[Event] = []  # made since the last plan / commit / fail returned them
        self._poisoned: list[int] = []

    # ------------------------------------------------------------------------ inbox side
    def submit(self, request: Request) -> None:
        if len(self.waiting) >= self.max_queue:
            raise QueueFullError(f"the waiting queue is full ({self.max_queue} requests); try again later")
        if request.request_id in self.by_id:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.waiting.append(request)
        self.by_id[request.request_id] = request

    def cancel(self, request_id: str) -> bool:
        """Mark a request cancelled; the next plan ends it and frees its slot. False if unknown."""
        request = self.by_id.get(request_id)
        if request is None or request.finished:
            return False
        request.cancelled = True
        return True

    @property
    def has_work(self) -> bool:
        return bool(self.waiting) or any(r is not None for r in self.slots)

    @property
    def queue_has_room(self) -> bool:
        return len(self.waiting) < self.max_queue

    # ----------------------------------------------------------------------- engine side
    def plan(self) -> Plan:
        """Apply cancellations, schedule prompt chunks, list decoders.

        Prompt chunks go to requests part-way through a long prompt first, then to new admissions.
        With mixed prefill on and some request decoding, one chunk of at most `mixed_chunk_len(busy)`
        tokens rides along the decode dispatch; otherwise chunks of up to `chunk_len` are
        dispatched on their own, within the iteration's token budget.
        """
        for request in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(request)
            self._finish(request, "abort")
        for request in self.slots:
            if request is not None and request.cancelled and not request.finished:
                self._finish(request, "abort")

        owners = self._decode_owners() if self.mixed_chunk_len else []
        if any(owners):
            busy = max(slot for slot, r in enumerate(owners) if r is not None) + 1
            fused = next(self._needing_prefill(), None)
            plan = Plan([], owners, fused and self._next_chunk(fused, self.mixed_chunk_len(busy)))
            return self._in_flight(plan)
        prefills: list[PrefillWork] = []
        budget = self.token_budget
        for request in self._needing_prefill():
            prefills.append(self._next_chunk(request, self.chunk_len))
            budget -= len(prefills[-1].tokens)
            if budget <= 0:
                break
        # A request whose last chunk runs now is decoded by this iteration's decode dispatch too
        # (the device runs the prefill first).
        return self._in_flight(Plan(prefills, self._decode_owners()))

    def _decode_owners(self) -> list[Request | None]:
        """Per slot, the request the decode dispatch decodes there (None: the row is inactive)."""
        return [r if r is not None and r.wants_decode else None for r in self.slots]

    def _in_flight(self, plan: Plan) -> Plan:
        """Count the tokens the plan's decode dispatch will produce for each of its requests: one
        step when it carries a prompt chunk, `decode_steps` otherwise. Attach the plan's events."""
        tokens = dispatch_steps(self.decode_steps, mixed=plan.fused is not None)
        for request in plan.decode_owners:
            if request is not None:
                request.in_flight += tokens
        plan.events, self._events = self._events, []
        return plan

    def _needing_prefill(self):
        """Requests with prompt left to prefill: those part-way through first, then admissions
        (each admitted when its turn comes, into the lowest free slot)."""
        for request in self.slots:
            if request is not None and request.prefilled < len(request.prompt_ids):
                yield request
        while self.waiting and None in self.slots:
            request = self.waiting.popleft()
            slot = self.slots.index(None)
            self.slots[slot], request.slot = request, slot
            request.admitted_at = time.perf_counter()
            yield request

    def _next_chunk(self, request: Request, max_len: int) -> PrefillWork:
        start = request.prefilled
        chunk = request.prompt_ids[start : start + max_len]
        request.prefilled += len(chunk)
        last = request.prefilled == len(request.prompt_ids)
        request.in_flight += last  # the last chunk samples the first output token
        return PrefillWork(request, request.slot, start, chunk, last)

    def commit(
        self,
        owners: list[Request | None],
        tokens: np.ndarray,
        bad: np.ndarray,
        logprobs: dict[str, np.ndarray] | None = None,
    ) -> Committed:
        """Take device results: tokens and bad are [steps, rows]; rows[i] belongs to owners[i].

        Results for a request that finished meanwhile (the device ran ahead) are ignored.
        """
        now = time.perf_counter()
        tokens_by_row, bad_by_row = tokens.T.tolist(), bad.T.tolist()  # Python ints and bools at once
        for row, request in enumerate(owners):
            if request is None:
                continue
            request.in_flight -= len(tokens_by_row[row])
            for step, (token, is_bad) in enumerate(zip(tokens_by_row[row], bad_by_row[row], strict=True)):
                if request.finished:
                    break
                entry = None
                if logprobs is not None and request.sampling.logprobs is not None:
                    entry = _logprob_entry(logprobs, step, row, token, request.sampling.logprobs)
                self._accept(request, token, is_bad, entry, now)
        committed = Committed(self._events, self._poisoned)
        self._events, self._poisoned = [], []
        return committed

    def fail(self, requests: list[Request], message: str) -> list[Event]:
        for request in requests:
            if not request.finished:
                self._finish(request, "error", error=message)
        events, self._events = self._events, []
        return events

    def active_requests(self) -> list[Request]:
        return [r for r in self.slots if r is not None]

    # ----------------------------------------------------------------------------- internal
    def _accept(self, request: Request, token: int, bad: bool, logprob: dict | None, now: float) -> None:
        if bad:
            self._poisoned.append(request.slot)
            self._finish(request, "error", error="the model produced NaN or infinite logits for this request")
            return
        if token in request.stop_ids and len(request.output_ids) >= request.sampling.min_tokens:
            self._finish(request, "stop")
            return
        request.output_ids.append(token)
        request.token_times.append(now)
        text, stopped = request.stream.add(token)
        event = RequestOutput(request.request_id, text, [token], [logprob] if logprob is not None else None)
        if stopped:
            self._finish(request, "stop", event)
        elif len(request.output_ids) >= request.max_tokens:
            self._finish(request, "length", event)
        else:
            self._events.append(Event(request.sink, event))

    def _finish(
        self, request: Request, reason: str, event: RequestOutput | None = None, error: str | None = None
    ) -> None:
        event = event or RequestOutput(request.request_id)
        if reason != "error":
            event.text += request.stream.finish()
        request.finished = True
        event.finished, event.finish_reason, event.error = True, reason, error
        event.metrics = request.metrics(time.perf_counter())
        if request.slot is not None and self.slots[request.slot] is request:
            self.slots[request.slot] = None
        self.by_id.pop(request.request_id, None)
        self._events.append(Event(request.sink, event))


def _logprob_entry(logprobs: dict[str, np.ndarray], step: int, row: int, token: int, top_n: int) -> dict:
    ids = logprobs["top_ids"][step, row, :top_n]
    values = logprobs["top_logprobs"][step, row, :top_n]
    return {
        "token_id": token,
        "logprob": float(logprobs["logprobs"][step, row]),
        "top": {int(i): float(v) for i, v in zip(ids, values, strict=True)},
    }
