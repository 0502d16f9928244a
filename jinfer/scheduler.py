"""Host-side scheduling: the waiting queue, slots, admission, stop conditions, cancellation.

Plain Python, never a jax array. The engine asks for a `Plan` each iteration (which prompt chunks
to prefill into which slots, and which request owns each slot for the decode dispatch), runs it
on the device (the chunks, cut into pieces, in one prefill dispatch; then the decode dispatch),
and later hands the device's tokens back to `commit`, the one place that decides a request is
finished. Finishing frees the slot; the next plan may give it to a waiting request.

    submit -> waiting (bounded) -> plan: a slot and the pages of its prompt (a cached prefix
              shared, `jinfer.paging`), the rest prefilled chunk by chunk, as the token budget of
              each iteration allows (decode tokens first, then prompt chunks of every request
              part-way through its prompt and of as many admissions as fit)
           -> running: pages added as it grows; tokens committed one by one
           -> stop / length / abort / error -> slot and pages freed (full pages stay cached)
    running, and the pool out of pages -> the latest admitted is preempted: back to the head of
           the queue, its pages freed; readmitted, it prefills its prompt and output so far
           (mostly from the prefix cache) and continues with the same tokens it would have made

Priorities (`Request.priority`, vLLM's: lower runs first, 0 by default): the queue is in priority
order, first come first served within one; the running request preempted for pages is the one of
the lowest priority (the latest admitted among those); and a waiting request that finds no slot or
too few pages, while a running one of lower priority holds them, preempts it (the lowest, latest
admitted first). A preempted request resumes exactly, as any preemption does. Background work
(less urgent than the default priority, as Batch API lines are) is kept from holding up what a
request of the default priority arriving would wait for: its prompts take one piece a dispatch
and never ride beside a more urgent prompt, and while it runs alone its decode dispatches run one
step each, one in flight at a time (`background_only`). Its tokens are those it makes at any
priority.

Pages are taken and freed on the host ahead of the device: a dispatch in flight still writes into
pages the host already freed, but the device runs dispatches in order, so whoever gets a page
next writes it later; pages enter the prefix index only once the dispatches writing them are
queued, and no dispatch ever writes into a full page.

Each request reports to its `sink` (a callable) with `RequestOutput` events carrying text deltas
(its `TextStream`: UTF-8-whole, stop strings held back and cut). The scheduler never calls a sink
itself: `plan`, `commit` and `fail` return the events they made (`Event`s: sink and output), which
the engine delivers outside its lock.
"""

from __future__ import annotations

import collections
import dataclasses
import time

import numpy as np

from jinfer.config import PROMPT_PIECE
from jinfer.paging import KVPages
from jinfer.request import Event, PrefillWork, Request, RequestOutput, deliver, positions_written
from jinfer.tokenizer import Tokenizer

__all__ = ["Plan", "QueueFullError", "Request", "RequestOutput", "Scheduler", "deliver"]


def _first_served(request: Request) -> tuple[int, int]:
    """The order requests keep their place by: priority (lower first), then admission."""
    return request.priority, request.admissions


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound; the request was not accepted."""


@dataclasses.dataclass
class Committed:
    """What `commit` made of a dispatch's tokens."""

    events: list[Event]
    poisoned_pages: list[int]  # pages that may now hold NaN/inf: zero them before anyone reuses them


@dataclasses.dataclass
class Plan:
    prefills: list[PrefillWork]  # chunks of one prefill dispatch, before the decode dispatch
    decode_owners: list[Request | None]  # per slot; None = inactive this dispatch
    decode_steps: int = 1  # tokens each decode row's dispatch makes (one, riding with prompt pieces)
    events: list[Event] = dataclasses.field(default_factory=list)  # cancelled requests' endings

    @property
    def decodes(self) -> bool:
        return any(r is not None for r in self.decode_owners)

    @property
    def decode_span(self) -> int:
        """The decode rows a dispatch must cover: the highest busy slot + 1 (0: none)."""
        return max((slot + 1 for slot, r in enumerate(self.decode_owners) if r is not None), default=0)


class Scheduler:
    def __init__(
        self,
        tokenizer: Tokenizer,
        max_slots: int,
        max_queue: int,
        token_budget: int,
        kv: KVPages,
        decode_steps: int = 1,
        draft_tokens: int = 0,
        piece_len: int = PROMPT_PIECE,
        piece_buckets: tuple[int, ...] | None = None,
        decode_with_prompts: bool = False,
    ):
        self.tokenizer = tokenizer
        self.decode_steps = decode_steps  # tokens a decode dispatch of its own produces per slot
        self.draft_tokens = draft_tokens  # draft tokens a verify step takes per speculative slot
        self.max_queue = max_queue
        self.token_budget = token_budget  # tokens an iteration computes, decode tokens first
        self.piece_len = piece_len  # prompt chunks take whole pieces of the budget
        # The piece counts a prefill dispatch is compiled for (None: any count).
        self.piece_buckets = piece_buckets
        # Decode rows ride in the prompt pieces' dispatch (`Layout.mixed_rows`), one step each: a
        # request whose prompt ends there decodes from the next iteration on, not in the same one.
        self.decode_with_prompts = decode_with_prompts
        self.kv = kv
        self.waiting: collections.deque[Request] = collections.deque()
        self.slots: list[Request | None] = [None] * max_slots
        self.by_id: dict[str, Request] = {}
        self.admissions = 0
        self.preemptions = 0
        # A pause (`jinfer.residency.pause`): no admission; holding, no running request steps either.
        self.admitting, self.holding = True, False
        self._events: list[Event] = []  # made since the last plan / commit / fail returned them
        self._chunked: set[Request] = set()  # requests the plan being made prefills a chunk of
        self._poisoned: list[int] = []

    # ------------------------------------------------------------------------ inbox side
    def submit(self, request: Request) -> None:
        if len(self.waiting) >= self.max_queue:
            raise QueueFullError(f"the waiting queue is full ({self.max_queue} requests); try again later")
        if request.request_id in self.by_id:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self._enqueue(request, ahead=False)
        self.by_id[request.request_id] = request

    def _enqueue(self, request: Request, ahead: bool) -> None:
        """Into the waiting queue by priority: after every request of its priority (a new one), or
        before them (`ahead`: a preempted one, first in line to resume)."""
        place = next(
            (
                i
                for i, other in enumerate(self.waiting)
                if other.priority > request.priority or (ahead and other.priority == request.priority)
            ),
            len(self.waiting),
        )
        self.waiting.insert(place, request)

    def cancel(self, request_id: str) -> bool:
        """Mark a request cancelled; the next plan ends it and frees its slot. False if unknown."""
        request = self.by_id.get(request_id)
        if request is None or request.finished:
            return False
        request.cancelled = True
        return True

    @property
    def has_work(self) -> bool:
        """Whether a plan would do anything: requests to admit (unless admission is paused), or
        running (unless they are held where they are)."""
        admissions = self.admitting and bool(self.waiting)
        return admissions or (not self.holding and any(r is not None for r in self.slots))

    @property
    def queue_has_room(self) -> bool:
        return len(self.waiting) < self.max_queue

    # ----------------------------------------------------------------------- engine side
    def plan(self) -> Plan:
        """Apply cancellations, give running requests the pages their next tokens need (preempting
        the latest admitted when the pool runs out), schedule prompt chunks, list decoders.

        The iteration's token budget goes to the decode tokens first; what is left, in whole pieces
        (at least one, rounded up to the dispatch's piece bucket), to prompt chunks: requests
        part-way through a prompt first, then as many admissions as a slot, the pool and the budget
        allow, each chunk as long as its prompt's rest or the pieces left; background work's
        prompts (less urgent than the default priority) one piece, in a dispatch of no other's.
        """
        for request in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(request)
            self._finish(request, "abort")
        for request in self.slots:
            if request is not None and request.cancelled and not request.finished:
                self._finish(request, "abort")
        if self.holding:
            return self._in_flight(Plan([], [None] * len(self.slots)))
        self._chunked = set()
        self._grow_running()

        # Decode rows riding with prompt pieces take one step; prompts get what the rows leave.
        steps = 1 if self.background_only else self.decode_steps
        beside_prompts = 1 if self.decode_with_prompts else steps
        decoding = sum(r.dispatch_tokens(beside_prompts) for r in self._decode_owners() if r is not None)
        prefills = self._prompt_chunks(
            self._piece_room(max(1, (self.token_budget - decoding) // self.piece_len))
        )
        # A request whose last chunk runs now is decoded by this iteration's decode dispatch too
        # (the device runs the prefill first; its admission gave it pages for that), unless the
        # two share one forward.
        owners = self._decode_owners()
        if self.decode_with_prompts and prefills:
            prefilling = {id(w.request) for w in prefills}
            owners = [None if r is not None and id(r) in prefilling else r for r in owners]
        return self._in_flight(Plan(prefills, owners, beside_prompts if prefills else steps))

    def _prompt_chunks(self, pieces: int) -> list[PrefillWork]:
        """Prompt chunks filling up to `pieces` pieces: requests part-way through a prompt first, then
        admissions. Background work's (less urgent than the default priority) take one piece a
        dispatch, and none beside a more urgent prompt's, whose first token they would delay."""
        prefills: list[PrefillWork] = []
        for request in self._needing_prefill(background=False):
            prefills.append(self._next_chunk(request, pieces * self.piece_len))
            pieces -= prefills[-1].piece_count(self.piece_len)
            if pieces <= 0:
                return prefills
        if not prefills and (request := next(self._needing_prefill(background=True), None)) is not None:
            prefills.append(self._next_chunk(request, self.piece_len))
        return prefills

    @property
    def background_only(self) -> bool:
        """Whether every request running or first in line is less urgent than the default priority:
        their decode dispatches then run one step and the engine keeps no more than one in flight,
        so that a request of the default priority arriving meanwhile waits for at most one step of
        their work, not two dispatches of `decode_steps` (the decode program runs the steps its
        rows ask: one program for both). What it costs them is the host's share of the dispatches
        they take more, no longer hidden behind the device's work."""
        if self.waiting and not self.waiting[0].background:
            return False
        return all(r is None or r.background for r in self.slots)

    def _piece_room(self, pieces: int) -> int:
        """Pieces a dispatch may fill: `pieces`, up to the bucket it would be padded to anyway (a
        padding piece costs what a real one does)."""
        if self.piece_buckets is None:
            return pieces
        return next((b for b in self.piece_buckets if b >= pieces), self.piece_buckets[-1])

    def _decode_owners(self) -> list[Request | None]:
        """Per slot, the request the decode dispatch decodes there (None: the row is inactive)."""
        return [r if r is not None and r.wants_decode else None for r in self.slots]

    def _in_flight(self, plan: Plan) -> Plan:
        """Count the tokens the plan's decode dispatch will produce for each of its requests (the
        plan's `decode_steps`). Attach the plan's events."""
        for request in plan.decode_owners:
            if request is not None:
                request.in_flight += request.dispatch_tokens(plan.decode_steps)
        plan.events, self._events = self._events, []
        return plan

    # ------------------------------------------------------------------------------ pages
    def _grow_running(self) -> None:
        """Pages for the next decode dispatch of every running request, oldest admission first;
        when the pool has too few, the latest admitted requests are preempted until it has."""
        for request in sorted((r for r in self.slots if r is not None), key=_first_served):
            if not request.wants_decode:
                continue
            capacity = request.capacity(self.decode_steps, self._drafts(request))
            while request.slot is not None and not self.kv.grow(request.kv, request.slot, capacity):
                self._preempt(max((r for r in self.slots if r is not None), key=_first_served))

    def _preempt(self, request: Request) -> None:
        """Take a request out of its slot, its computed pages left in the prefix cache, and put it
        first in line: when it gets a slot again it prefills its prompt and output so far (mostly
        from the cache) and continues exactly where it was. Tokens still in flight for it are
        committed as usual meanwhile."""
        self.kv.register(request.kv, request.tokens, request.written)
        self.kv.remove(request.kv, request.slot)
        self.slots[request.slot], request.slot = None, None
        request.prefilled = 0
        request.preemptions += 1
        self.preemptions += 1
        self._enqueue(request, ahead=True)

    def _drafts(self, request: Request) -> int:
        """Draft tokens its decode steps may verify (0: it decodes one token a step)."""
        return self.draft_tokens if request.drafts.drafting else 0

    def _dispatch_positions(self, request: Request) -> int:
        """Positions one decode dispatch may write for it."""
        return positions_written(self.decode_steps, self._drafts(request))

    def _reserve(self) -> int:
        """Pages kept free at admission for the running requests' next dispatch: admitting into
        them would only preempt the newcomer again."""
        running = (r for r in self.slots if r is not None and r.running)
        return sum(-(-self._dispatch_positions(r) // self.kv.page_size) for r in running)

    def _admit(self, background: bool) -> Request | None:
        """The first waiting request if it is of background work or not as asked, in the lowest
        free slot, if the pool holds its prefill and first decode steps (beside the reserve),
        running requests of lower priority preempted until it does; None otherwise (it keeps its
        turn)."""
        if not self.admitting or not self.waiting:
            return None
        request = self.waiting[0]
        if request.background != background:
            return None
        if request.in_flight:  # preempted with tokens in flight: resumes once they are committed
            return None
        prefill_ids = request.tokens()
        capacity = len(prefill_ids) + self._dispatch_positions(request)
        while True:
            hits = self.kv.cached_prefix(request.kv, prefill_ids)  # a preemption may have cached more
            if (
                None in self.slots
                and self.kv.cost(hits, capacity) + self._reserve() <= self.kv.pool.available
            ):
                break
            # Only requests no chunk of this plan prefills: their slot is the plan's.
            below = [
                r
                for r in self.slots
                if r is not None and r.priority > request.priority and r.running and r not in self._chunked
            ]
            if not below:
                return None
            self._preempt(max(below, key=_first_served))
        self.waiting.remove(request)
        slot = self.slots.index(None)
        self.slots[slot], request.slot = request, slot
        request.prefill_ids, request.generated_before = prefill_ids, len(request.output_ids)
        request.prefilled = request.first_chunk_start = self.kv.place(request.kv, slot, prefill_ids, capacity)
        if request.cached_tokens is None:
            request.cached_tokens = request.prefilled
        self.admissions += 1
        request.admissions = self.admissions
        request.admitted_at = request.admitted_at or time.perf_counter()
        return request

    def _needing_prefill(self, background: bool):
        """Requests of background work (less urgent than the default priority) or of the rest, as
        asked, with prompt left to prefill: those part-way through first, then admissions (each
        admitted when its turn comes and the pool has room)."""
        for request in self.slots:
            part_way = request is not None and request.prefilled < len(request.prefill_ids)
            if part_way and request.background == background:
                yield request
        while (request := self._admit(background)) is not None:
            yield request

    def _next_chunk(self, request: Request, max_len: int) -> PrefillWork:
        if request.prefilled > request.first_chunk_start:  # others may have cached more since
            request.prefilled = self.kv.catch_up(
                request.kv, request.slot, request.prefill_ids, request.prefilled
            )
        start = request.prefilled
        chunk = request.prefill_ids[start : start + max_len]
        request.prefilled += len(chunk)
        self._chunked.add(request)
        last = request.prefilled == len(request.prefill_ids)
        request.in_flight += last  # the last chunk samples the next output token
        self.kv.register(request.kv, request.tokens, request.prefilled)
        return PrefillWork(
            request, request.slot, start, chunk, last, first=start == request.first_chunk_start
        )

    def commit(
        self,
        owners: list[Request | None],
        tokens: np.ndarray,
        bad: np.ndarray,
        logprobs: dict[str, np.ndarray] | None = None,
        steps: int | None = None,
    ) -> Committed:
        """Take device results: tokens and bad are [entries, rows]; rows[i] belongs to owners[i].
        Each entry is one decode step's token, or with `steps` (a verify dispatch's decode steps)
        one of its steps' positions, -1 where the step emitted no token there.

        Results for a request that finished meanwhile (the device ran ahead) are ignored.
        """
        now = time.perf_counter()
        tokens_by_row, bad_by_row = tokens.T.tolist(), bad.T.tolist()  # Python ints and bools at once
        for row, request in enumerate(owners):
            if request is None:
                continue
            taken = request.dispatch_tokens(steps or len(tokens_by_row[row]))
            request.in_flight -= taken
            entries = len(tokens_by_row[row]) if steps else taken
            for step, (token, is_bad) in enumerate(
                zip(tokens_by_row[row][:entries], bad_by_row[row][:entries], strict=True)
            ):
                if request.finished:
                    break
                if token < 0:  # a verify step's position that emitted nothing
                    continue
                entry = None
                if logprobs is not None and request.sampling.logprobs is not None:
                    entry = _logprob_entry(logprobs, step, row, token, request.sampling.logprobs)
                self._accept(request, token, is_bad, entry, now)
            if not request.finished and request.slot is not None:
                self.kv.register(request.kv, request.tokens, request.written)
        committed = Committed(self._events, self._poisoned)
        self._events, self._poisoned = [], []
        return committed

    def fail(self, requests: list[Request], message: str) -> list[Event]:
        """End requests a device failure touched. What the failed call was to write cannot be
        trusted, so nothing computed so far stays findable in the prefix cache."""
        self.kv.pool.forget()
        for request in requests:
            if not request.finished:
                self._finish(request, "error", error=message)
        events, self._events = self._events, []
        return events

    def store_drafts(self, owners: list[Request | None], records: list) -> None:
        """Each owner's speculation as the policy left it (`jinfer.speculation.DraftRecord`); a
        request that stopped drafting no longer finds or caches pages as holding a draft model's K/V."""
        for request, record in zip(owners, records, strict=True):
            if request is not None and record is not request.drafts:
                request.drafts = record
                request.kv.drafted = request.kv.drafted and record.drafting

    def active_requests(self) -> list[Request]:
        return [r for r in self.slots if r is not None]

    # ----------------------------------------------------------------------------- internal
    def _accept(self, request: Request, token: int, bad: bool, logprob: dict | None, now: float) -> None:
        if bad:
            message = "the model produced NaN or infinite logits for this request"
            self._finish(request, "error", error=message, poisoned=True)
            return
        if token in request.stop_ids and len(request.output_ids) >= request.sampling.min_tokens:
            self._finish(request, "stop", self._ending(request, token, logprob, now), stop_token=token)
            return
        if request.constraint is not None and not request.constraint.accept(token):
            message = f"constrained decoding: token {token} is outside the {request.constraint.kind}"
            self._finish(request, "error", error=f"{message}: {request.constraint.error}")
            return
        request.output_ids.append(token)
        request.token_times.append(now)
        text, stopped = request.stream.add(token)
        event = RequestOutput(request.request_id, text, [token], [logprob] if logprob is not None else None)
        if stopped or (request.constraint is not None and request.constraint.complete):
            self._finish(request, "stop", event)
        elif len(request.output_ids) >= request.max_tokens:
            self._finish(request, "length", event)
        else:
            self._events.append(Event(request.sink, event))

    @staticmethod
    def _ending(request: Request, token: int, logprob: dict | None, now: float) -> RequestOutput | None:
        """Where log-probs are asked, the stop token that ends the output is one of its tokens,
        with its entry and counted, adding no text (an evaluation harness sums every generated
        token's log-prob, the end of sequence's too); otherwise it is left out."""
        if logprob is None:
            return None
        request.output_ids.append(token)
        request.token_times.append(now)
        return RequestOutput(request.request_id, "", [token], [logprob])

    def _finish(
        self,
        request: Request,
        reason: str,
        event: RequestOutput | None = None,
        error: str | None = None,
        poisoned: bool = False,
        stop_token: int | None = None,
    ) -> None:
        event = event or RequestOutput(request.request_id)
        if reason != "error":
            event.text += request.stream.finish()
        request.finished = True
        event.finished, event.finish_reason, event.error = True, reason, error
        if reason == "stop":
            event.stop_reason = stop_token if stop_token is not None else request.stream.matched
        event.metrics = request.metrics(time.perf_counter())
        if request.slot is not None:
            if reason != "error":
                self.kv.register(request.kv, request.tokens, request.written)
            # NaN in its pages: none stays cached, and those it frees are zeroed before reuse.
            self._poisoned += self.kv.remove(request.kv, request.slot, poisoned)
            self.slots[request.slot], request.slot = None, None
        elif request in self.waiting:  # preempted, then finished by tokens that were in flight
            self.waiting.remove(request)
        self.by_id.pop(request.request_id, None)
        self._events.append(Event(request.sink, event))


def _logprob_entry(logprobs: dict[str, np.ndarray], step: int, row: int, token: int, top_n: int) -> dict:
    ids = logprobs["top_ids"][step, row, :top_n]
    values = logprobs["top_logprobs"][step, row, :top_n]
    # A token outside a processed distribution (-inf: a top-k cut, a ban) is no alternative.
    return {
        "token_id": token,
        "logprob": float(logprobs["logprobs"][step, row]),
        "top": {int(i): float(v) for i, v in zip(ids, values, strict=True) if v > -np.inf},
    }
