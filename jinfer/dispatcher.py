"""How one iteration's plan becomes device calls: the prompt chunks cut into pieces and padded to a
piece bucket (one prefill dispatch), the decode rows in a slot bucket (plain or verify steps), or
both as one mixed dispatch where the layout allows (`Layout.mixed_rows`); and what each dispatch
will have produced (`Pending`), for the engine to read one iteration later.

    dispatcher.dispatch(plan) -> [Pending]     dispatcher.take_deferred() -> rows to `sample`

A constrained request's decode row is deferred (fed, not sampled): the dispatcher keeps those
rows until the engine, once the token before is read, samples them under their allowed sets. A
failing device call is handed to `recover` with the requests it touched, and adds nothing
pending. The engine's loop (`jinfer.engine`) owns when to dispatch and how results are read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from jinfer.config import PROMPT_PIECE
from jinfer.inputs import Program, RowInputs, decode_inputs, row_inputs
from jinfer.metrics import DispatchCounts
from jinfer.request import PrefillWork, Request, positions_written
from jinfer.sampling import StepOutput
from jinfer.scheduler import Plan
from jinfer.state import pack_history, pack_pieces
from jinfer.steps import mixed_program, prefill_program
from jinfer.structured import allowed_bitmask


class Pending(NamedTuple):
    """A dispatch's output not yet read: the owner of each of its rows (None: a row whose tokens
    are not a request's to take), for a verify dispatch (steps, drafts checked, their kinds), and
    for a decode or verify dispatch the steps it ran (its output holds the program's
    `decode_steps`; None: every entry is the dispatch's)."""

    owners: list[Request | None]
    out: StepOutput
    verified: tuple | None = None
    steps: int | None = None

    def ran(self, array: np.ndarray, program_steps: int) -> np.ndarray:
        """`array` [entries, ...] (the program's steps, each of one or several entries) cut to the
        entries of the steps this dispatch ran."""
        if self.steps is None:
            return array
        return array[: self.steps * (array.shape[0] // program_steps)]


def drafts_of(owners: list[Request | None]) -> list:
    """The rows' speculation records (None: a row without a request)."""
    return [None if r is None else r.drafts for r in owners]


class Dispatcher:
    """Turns plans into the device's dispatches (the engine's loop thread only)."""

    def __init__(self, engine, recover: Callable[[list[Request], Exception], None]):
        self.engine = engine
        self.layout, self.steps = engine.layout, engine.steps
        self.kv, self.scheduler, self.speculation = engine.kv, engine.scheduler, engine.speculation
        self.counts: DispatchCounts = engine.dispatch_counts
        self.recover = recover
        self.tables_version = self.kv.version  # of the device's block tables
        self.deferred: list[Request | None] | None = None  # per slot: decoded, waiting for `sample`
        self.predicted_slots: set[int] = set()  # slots whose device state holds a predicted output

    @property
    def device(self):
        """The engine's device, read at each call: a host-side test stands a fake in its place."""
        return self.engine.device

    def take_deferred(self) -> list[Request | None] | None:
        """The rows the last decode deferred (None: none), handed over once."""
        deferred, self.deferred = self.deferred, None
        return deferred

    def dispatch(self, plan: Plan) -> list[Pending]:
        """Queue the plan's prompt chunks (one prefill dispatch) and its decode dispatch; what they
        will have produced."""
        if self.tables_version != self.kv.version:
            # A copy: on a CPU the device array may share the host buffer, which the next plan changes.
            self.device.set_tables(self.kv.tables.copy())
            self.tables_version = self.kv.version
        sampled = [w.request for w in plan.prefills if w.last]
        allowed = allowed_bitmask(sampled, self.layout.max_slots, self.steps.vocab_size)
        if plan.prefills and plan.decodes and self.layout.mixed_rows:
            return self._mixed(plan, allowed)
        pending = self._prefill(plan.prefills, allowed) if plan.prefills else []
        if plan.decodes:
            pending += self._decode(plan, allowed)
        return pending

    def sample(self, owners: list[Request | None]) -> list[Pending]:
        """Dispatch `sample` for deferred rows whose tokens before are read, under their allowed sets."""
        want_logprobs = np.bool_(any(r.sampling.logprobs is not None for r in owners if r is not None))
        try:
            allowed = allowed_bitmask(owners, self.layout.max_slots, self.steps.vocab_size)
            deferred = np.array([r is not None for r in owners])
            inputs = self._inputs(owners, deferred=deferred, want_logprobs=want_logprobs, allowed=allowed)
            out = self.device.dispatch(Program("sample", len(owners)), inputs)
        except Exception as e:
            self.recover([r for r in owners if r is not None], e)
            return []
        self.counts.sample_dispatches += 1
        return [Pending(owners, out.rows)]

    def _pieces(self, works: list[PrefillWork]) -> tuple:
        """The chunks cut into pieces, padded to a piece bucket: the packed pieces, each piece's
        request and the request it ends (None: none, or padding)."""
        vocab = self.steps.vocab_size
        pieces, owners, ending = [], [], []
        for work in works:
            rows = work.pieces(PROMPT_PIECE, vocab)
            pieces += rows
            owners += [work.request] * len(rows)
            ending += [None] * (len(rows) - 1) + [work.request if work.last else None]
        bucket = self.layout.piece_bucket(len(pieces))
        padding = [None] * (bucket - len(pieces))
        return pack_pieces(pieces, bucket, PROMPT_PIECE, vocab), owners + padding, ending + padding

    def _prefill(self, works: list[PrefillWork], allowed) -> list[Pending]:
        """The plan's prompt chunks, cut into pieces, as one prefill dispatch (a piece bucket);
        the pending record of the pieces that end a prompt."""
        chunk, owners, ending = self._pieces(works)
        bucket = len(owners)
        wants = np.bool_(any(w.request.sampling.logprobs is not None for w in works if w.last))
        inputs = self._inputs(owners, steps=np.ones(bucket, np.int32), want_logprobs=wants, allowed=allowed)
        try:
            for work in works:
                self._set_history(work)
            # A drafting request's draft cache must be fed; others' pages take the draft's K/V too.
            feeds = any(w.request.drafts.drafting for w in works) and self.feeds_draft()
            program = prefill_program(bucket, feeds or self.steps.draft_model is None)
            out = self.device.dispatch(program, inputs, chunk)
        except Exception as e:  # a device failure must not kill the engine
            self.recover([w.request for w in works], e)
            return []
        return self._pieces_pending(works, ending, out, program)

    def _pieces_pending(self, works: list[PrefillWork], ending: list, out, program: Program) -> list[Pending]:
        """Count a dispatch's prompt pieces; the pending record of those that end a prompt."""
        self.counts.count_prefill(sum(len(w.tokens) for w in works), program.chunk)
        return [Pending(ending, out.chunk)] if any(ending) else []

    def _mixed(self, plan: Plan, allowed) -> list[Pending]:
        """The plan's prompt pieces and one decode step of its rows as one mixed dispatch; the
        pending records of the pieces that end a prompt and of the rows."""
        works = plan.prefills
        chunk, piece_owners, ending = self._pieces(works)
        owners = plan.decode_owners[: self.layout.mixed_bucket(plan.decode_span)]
        inputs = decode_inputs(owners, plan.decode_steps, allowed, self.steps.processors, pieces=piece_owners)
        try:
            for work in works:
                self._set_history(work)
            program = mixed_program(len(owners), len(piece_owners))
            out = self.device.dispatch(program, inputs, chunk)
        except Exception as e:
            self.recover([w.request for w in works] + [r for r in owners if r is not None], e)
            return []
        self.counts.count_decode(program.kind, inputs.steps[: len(owners)])
        self.counts.mixed_dispatches += 1
        return self._pieces_pending(works, ending, out, program) + self._decode_pending(owners, inputs, out)

    def _decode(self, plan: Plan, allowed) -> list[Pending]:
        """The decode dispatch over the plan's rows: plain steps or verify steps; the pending record
        of its rows."""
        rows = self.layout.slot_bucket(plan.decode_span)
        owners, steps = plan.decode_owners[:rows], plan.decode_steps
        inputs = decode_inputs(owners, steps, allowed, self.steps.processors)
        attn_len = self._attention_length(owners)
        verifying = None
        if self.speculation:
            verifying, records = self.speculation.choose(rows, drafts_of(owners), steps)
            self.scheduler.store_drafts(owners, records)
        if verifying is not None:  # (the program's draft length, the draft plan)
            program = Program("verify", rows, attn_len, drafts=verifying[0])
            inputs = inputs.replace(plan=verifying[1])
        else:
            program = Program("decode", rows, attn_len, feeds_draft=self.feeds_draft())
        try:
            out = self.device.dispatch(program, inputs)
        except Exception as e:
            self.recover([r for r in owners if r is not None], e)
            return []
        self.counts.count_decode(program.kind, inputs.steps[:rows])
        verified = (steps, out.checked, out.kinds) if verifying is not None else None
        return self._decode_pending(owners, inputs, out, verified, steps)

    def _decode_pending(
        self, owners: list, inputs: RowInputs, out, verified=None, steps: int | None = None
    ) -> list[Pending]:
        """The pending record of a dispatch's decode rows (`owners`; `steps`: those it ran of a
        decode program's, None for a mixed one's single step); its deferred rows are sampled next
        iteration."""
        deferred = inputs.deferred[: len(owners)]
        taking = [None if d else r for r, d in zip(owners, deferred, strict=True)]
        if deferred.any():
            self.deferred = [r if d else None for r, d in zip(owners, deferred, strict=True)]
        return [Pending(taking, out.rows, verified, steps)]

    def _inputs(self, owners: list, **fields) -> RowInputs:
        """A dispatch's inputs, a row per owner (`jinfer.inputs.row_inputs`)."""
        return row_inputs(owners, self.steps.processors, **fields)

    def _attention_length(self, owners: list) -> int:
        """The attention bucket of a decode dispatch. The device may be one dispatch ahead of what
        the host has read, and this dispatch adds up to decode_steps x (draft tokens + 1)
        positions: a bucket that surely holds them all."""
        per_dispatch = positions_written(self.layout.decode_steps, self.layout.draft_tokens)
        furthest = max(len(r.prompt_ids) + len(r.output_ids) for r in owners if r is not None)
        return self.layout.attention_bucket(furthest + 2 * per_dispatch + 1)

    def feeds_draft(self) -> bool:
        """Whether this dispatch feeds the draft model (`Speculation.feeds_draft`; always without one)."""
        if self.steps.draft_model is None:
            return True
        slots = self.scheduler.slots
        feeds, records = self.speculation.feeds_draft(drafts_of(slots), self.layout.slot_bucket)
        self.scheduler.store_drafts(slots, records)
        return feeds

    def _set_history(self, work: PrefillWork) -> None:
        """Before the first chunk of a request that reads them (penalised, speculative, predicting
        or with a thinking budget): its slot's prompt mask, output counts, token history and
        predicted output, from its tokens (the prefix cache may spare it computing some, a
        preemption makes it prefill its output again). Other requests never read them, except a
        predicted output, which drafts would: it is cleared when its slot is taken."""
        request = work.request
        # A speculative request's chunks write its token history themselves unless the first
        # starts past cached positions.
        spared = request.drafts.drafting and work.start > 0
        prediction = request.prediction_ids if request.drafts.drafting else ()
        stale = work.slot in self.predicted_slots
        # A reasoning budget reads the output's counts too.
        counted = request.sampling.penalised or request.budget is not None
        if work.first and (counted or spared or prediction or stale):
            packed = pack_history(
                work.slot, request.prefill_ids, len(request.prompt_ids), self.layout.max_seq_len, prediction
            )
            self.device.history(packed)
            (self.predicted_slots.add if prediction else self.predicted_slots.discard)(work.slot)
