"""Speculative decoding's host policy, as values: when a decode dispatch verifies drafts, how many,
and what each request's drafts so far say of its next ones (`jinfer.speculative` is the device side).

    Speculation.choose(rows, records, steps)        -> a verify program's (k, DraftPlan) or None, records
    Speculation.feeds_draft(records, slot_bucket)    -> whether plain steps feed the draft model, records
    Speculation.record(records, tokens, steps, ...)  -> records, the drafts' tally
    measure_verify_costs(device)                     -> Speculation.cost (timed at warm-up)

Each request's part is a `DraftRecord` value (`Request.drafts`): the policy reads records and
returns new ones, and the scheduler stores them (`Scheduler.store_drafts`): nothing here writes to
a request. The engine-wide statistics (acceptance per kind seen so far, each slot bucket's share of
useful verify steps, each length's measured cost) are the policy's own.

A verify step costs more than a decode step, the more the more columns it feeds (measured per
draft length at warm-up: on a 2-core CPU, 1.3-1.5x a decode step for 4-8 drafts of float32
weights), and pays only while the drafts it checks are accepted often enough. Where the device
picks each step's length (n-gram drafts, `speculative.best_length`), the host sends each row's
chances and each length's cost with the dispatch; for a draft model, whose drafts cost a pass a
token, the host picks the length per dispatch. Either way the host dispatches plain decode steps
where no length could pay even for the rows' best drafts.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from jinfer.inputs import DraftPlan, Program
from jinfer.speculative import DRAFT_SOURCES, program_lengths

RECORD_DECAY = 0.8  # weight of a request's earlier evidence in its record, per verify step adding some
RELAX = 0.99  # weight of a request's evidence, per decode step without a draft checked
PRIOR_WEIGHT = 2.0  # draft tokens' worth of evidence that a request's estimates start from
HIGHEST_CHANCE = 0.99  # no kind's chance is taken as certain
# Below this share of recent verify steps that checked a draft, a slot bucket's dispatches decode
# plainly (the device chose plain steps anyway) until the share, relaxing toward 1, is back above.
USEFUL_FLOOR = 0.25
# Weight of earlier checked drafts of a kind in the engine's chances for requests without evidence
# of their own, per draft checked: a workload's requests start where its earlier ones ended.
ENGINE_DECAY = 0.98


@dataclasses.dataclass(frozen=True)
class DraftRecord:
    """One request's speculation so far (a value: the policy returns new ones)."""

    drafting: bool = False  # its decode rows may verify drafts (`may_draft`; off once a draft cache misses)
    # [kinds + 1, 2]: per kind, draft tokens accepted and rejected; then over all kinds, tokens
    # accepted and those the engine's chances expected of the same checks; decaying. None: none yet.
    evidence: np.ndarray | None = None
    drafted: int = 0  # draft tokens checked
    accepted: int = 0  # ... and accepted
    verify_steps: int = 0  # steps that checked some
    # Draft tokens from the request's predicted output (its source's `predicted_kinds`) accepted,
    # and checked and rejected: OpenAI's accepted / rejected_prediction_tokens.
    predicted_accepted: int = 0
    predicted_rejected: int = 0

    def faded(self, steps: int) -> DraftRecord:
        """After `steps` decode steps without a draft checked."""
        if self.evidence is None:
            return self
        return dataclasses.replace(self, evidence=self.evidence * RELAX**steps)


@dataclasses.dataclass
class DraftTally:
    """Draft tokens a verify dispatch checked and accepted, over its rows."""

    drafted: int = 0
    accepted: int = 0


def may_draft(sampling, constrained: bool) -> bool:
    """Whether a request's rows may draft: it did not opt out, and it has no penalty, grammar or
    reasoning budget (`constrained`; those would have to follow each draft token inside the step)."""
    return sampling.speculative is not False and not sampling.penalised and not constrained


def measure_verify_costs(device, rounds: int = 7) -> dict[tuple[int, int], float]:
    """`Speculation.cost`, measured through a device's dispatches (`jinfer.device`; on several
    processes the followers replay them too): per (slot bucket, draft tokens) verify variant, its
    step's time over a decode step's that feeds no draft model (the engine's step without
    speculation), every row busy, at the smallest attention bucket, the program made to take that
    length. Each round times a decode dispatch and then each length's in turn, so a slow spell of
    the machine slows both sides of a ratio; a length's cost is its median ratio over the rounds,
    at least a shorter length's and at least 1 (a verify step does a decode step's work and more:
    a cost measured below it would make drafts that are never accepted look free). The caller
    sets block tables that map nowhere first (the busy rows write) and runs it with no request in
    a slot (their state is left for the next prefill to set)."""
    layout, costs = device.steps.layout, {}
    attn_len, busy = layout.attention_buckets[0], layout.decode_steps

    def seconds(program, inputs):
        start = time.perf_counter()
        jax.block_until_ready(device.dispatch(program, inputs).rows.tokens)
        return time.perf_counter() - start

    for program in device.steps.of_kind("verify"):
        if program.attn_len != attn_len:
            continue
        rows, k = program.rows, program.drafts
        decode = Program("decode", rows, attn_len, feeds_draft=device.steps.draft_model is None)
        lengths = program_lengths(layout.speculative, layout.verify_variants, k)
        forced = {n: device.idle_inputs(program, index, busy) for index, n in enumerate(lengths) if n}
        ratios = {n: [] for n in forced}
        for _ in range(rounds):
            plain = seconds(decode, device.idle_inputs(decode, busy=busy))
            for n, inputs in forced.items():
                ratios[n].append(seconds(program, inputs) / plain)
        costs.update({(rows, n): float(np.median(r)) for n, r in ratios.items()})
    for rows, n in sorted(costs):  # shorter lengths first
        shorter = [costs[rows, m] for m in range(n) if (rows, m) in costs]
        costs[rows, n] = max(costs[rows, n], 1.0, *shorter)
    return costs


class Speculation:
    """The host's policy (see the module docstring): per decode dispatch, a verify program or plain
    decode steps, from each request's chances and each length's cost.

    α, the chance that a draft token is accepted given the ones before it were, is estimated per
    request and kind (`chances`): the engine's acceptance of the kind so far (`seen`), scaled by
    how the request's drafts of every kind fared against the engine's, moved toward its own drafts
    of the kind as they add up (`DraftRecord.evidence`, decaying). Pooled so, a chat's drafts
    rejected after one match length lower its chances after every length, and a copy's raise them.
    A verify step of k drafts is expected to emit 1 + α + ... + α^k tokens for the row, 1 for a
    row without a draft; the device per step (`speculative.best_length`) and the host per dispatch
    (`_best`) take the length with the most expected tokens per unit of cost. While a request's
    drafts go unchecked its evidence fades, so one whose drafts failed is tried again after a
    while. Where the device picks, each slot bucket also keeps the share of its recent verify
    steps that checked any draft (`useful`): a batch whose steps all decode plainly is spared the
    program, `USEFUL_FLOOR`. Records come as a list per row (None: a row without a request).

    Under the "always" policy (`config.speculative_policy`) every length costs what a decode step
    does and no bucket is spared: each step verifies the longest drafts its rows have.
    """

    def __init__(self, layout, policy: str = "measured"):
        self.policy = policy
        source, variants = self.source, self.variants = layout.speculative, layout.verify_variants
        self.lengths: dict[int, list[int]] = {}  # slot bucket -> its draft lengths
        for rows, k in variants:
            self.lengths.setdefault(rows, []).append(k)
        alphas = np.array(DRAFT_SOURCES[source].priors, np.float32)
        # [kinds, 2]: draft tokens accepted and rejected over all requests (priors: ~10 drafts' worth)
        self.seen = 10 * np.stack([alphas, 1 - alphas], axis=1)
        # A verify step's time over a decode step's (`measure_verify_costs` measures them at
        # warm-up; until then a guess that it costs as many columns as it feeds, past the first).
        self.cost = {(rows, k): 1.0 + 0.25 * k * (policy == "measured") for rows, k in variants}
        self.useful = dict.fromkeys(self.lengths, 1.0)

    def chances(self, evidence: np.ndarray | None, engine: np.ndarray | None = None) -> np.ndarray:
        """[kinds]: α per kind for a request with this evidence (None: none of its own), from the
        engine's chances (`chances(None)`, derived here unless given)."""
        engine = self.seen[:, 0] / self.seen.sum(axis=1) if engine is None else engine
        if evidence is None:
            return engine
        own, (accepted, expected) = evidence[:-1], evidence[-1]
        pooled = np.minimum(engine * (accepted + PRIOR_WEIGHT) / (expected + PRIOR_WEIGHT), HIGHEST_CHANCE)
        return (own[:, 0] + PRIOR_WEIGHT * pooled) / (own.sum(axis=1) + PRIOR_WEIGHT)

    def feeds_draft(self, records: list, slot_bucket) -> tuple[bool, list]:
        """Whether a dispatch that is not a verify step (prompt chunks, plain and mixed decode
        steps) feeds a draft model (`jinfer.draft`: its cache must hold every position for its
        drafts to be any good), with every slot's record: only where a verify step could pay for
        the batch of every slot's holder (`slot_bucket`: the rows for the highest busy slot + 1)
        with every drafting request at the engine's chances. Where none could (a batch this
        large), the dispatch skips the draft's passes, which cost a share of every token, and the
        requests that drafted stop drafting (the draft's cache now misses positions of theirs):
        the records returned say so."""
        rows = slot_bucket(max(slot for slot, r in enumerate(records) if r is not None) + 1)
        drafting = sum(r is not None and r.drafting for r in records)
        busy = sum(r is not None for r in records)
        alphas = [float(np.max(self.chances(None)))] * drafting
        if drafting and rows in self.lengths and self._best(rows, busy, alphas)[1] > busy:
            return True, records
        stopped = lambda r: r if r is None or not r.drafting else dataclasses.replace(r, drafting=False)
        return False, [stopped(r) for r in records]

    def _best(self, rows: int, busy: int, alphas: list[float]) -> tuple[int, float]:
        """The draft length with the most expected tokens per unit of cost for `busy` rows, those
        drafting with chances α, and its tokens per cost."""

        def tokens_per_cost(k):
            return (busy + sum(sum(a**i for i in range(1, k + 1)) for a in alphas)) / self.cost[rows, k]

        k = max(self.lengths[rows], key=tokens_per_cost)
        return k, tokens_per_cost(k)

    def choose(self, rows: int, records: list, steps: int) -> tuple[tuple[int, DraftPlan] | None, list]:
        """For a decode dispatch of `steps` steps over rows [rows] (their records): a verify
        program's draft length and its plan, or None for plain decode steps (the drafting rows'
        evidence faded in the records returned). Where the device picks lengths, verify whenever
        some length could pay with every drafting row at its best kind and the bucket's steps were
        of use lately; else the length that pays best, if one does."""
        drafting = np.array([r is not None and r.drafting for r in records])
        if rows not in self.lengths or not drafting.any():
            return None, records
        busy = sum(r is not None for r in records)
        engine, chances = self.chances(None), np.zeros((rows, len(self.seen)), np.float32)
        for row in np.flatnonzero(drafting):
            chances[row] = self.chances(records[row].evidence, engine)
        per_step = DRAFT_SOURCES[self.source].per_step
        alphas = [float(c.max() if per_step else c[0]) for c in chances[drafting]]
        k, tokens_per_cost = self._best(rows, busy, alphas)
        if per_step and self.useful[rows] < USEFUL_FLOOR and self.policy == "measured":
            self.useful[rows] += (1 - self.useful[rows]) * (1 - RELAX**steps)
        elif tokens_per_cost > busy:
            k = max(self.lengths[rows]) if per_step else k
            lengths = program_lengths(self.source, self.variants, k)
            costs = np.array([self.cost[rows, n] if n else 1.0 for n in lengths], np.float32)
            return (k, DraftPlan(drafting, chances, costs, np.int32(-1))), records
        return None, [r.faded(steps) if d else r for r, d in zip(records, drafting, strict=True)]

    def record(self, records: list, tokens, steps: int, checked, kinds) -> tuple[list, DraftTally]:
        """A verify dispatch's results (its tokens [steps x (k + 1), rows], -1 where none was
        emitted; the drafts checked and their kinds [steps, rows]) into the rows' records and the
        engine's statistics: the records and the dispatch's tally. Rows that may not draft (opted
        out, penalised, constrained) take part without a record: their steps are plain ones."""
        emitted = (tokens.reshape(steps, -1, tokens.shape[-1]) >= 0).sum(axis=1)  # [steps, rows]
        taken = emitted.any(axis=1)
        if taken.any():
            share = float((checked[taken] > 0).any(axis=1).mean())
            rows = checked.shape[1]
            self.useful[rows] = RECORD_DECAY * self.useful[rows] + (1 - RECORD_DECAY) * share
        tally, out = DraftTally(), list(records)
        for row, record in enumerate(records):
            if record is None or not record.drafting:
                continue
            for step in np.flatnonzero(emitted[:, row]):
                proposed, accepted = int(checked[step, row]), int(emitted[step, row]) - 1
                if proposed:
                    record = self._checked(record, int(kinds[step, row]), proposed, accepted)
                    tally.drafted, tally.accepted = tally.drafted + proposed, tally.accepted + accepted
                else:
                    record = record.faded(1)
            out[row] = record
        return out, tally

    def _checked(self, record: DraftRecord, kind: int, proposed: int, accepted: int) -> DraftRecord:
        """A record after one verify step checked `proposed` drafts of a kind, `accepted` of them
        (and the engine's acceptance of the kind after it)."""
        rejected, engine = accepted < proposed, self.chances(None)[kind]
        none = np.zeros((len(self.seen) + 1, 2), np.float32)
        evidence = none if record.evidence is None else record.evidence.copy()
        evidence[kind] = RECORD_DECAY * evidence[kind] + (accepted, rejected)
        evidence[-1] = RECORD_DECAY * evidence[-1] + (accepted, engine * (accepted + rejected))
        self.seen[kind] = ENGINE_DECAY * self.seen[kind] + (accepted, rejected)
        predicted = kind in DRAFT_SOURCES[self.source].predicted_kinds
        return dataclasses.replace(
            record,
            evidence=evidence,
            drafted=record.drafted + proposed,
            accepted=record.accepted + accepted,
            verify_steps=record.verify_steps + 1,
            predicted_accepted=record.predicted_accepted + accepted * predicted,
            predicted_rejected=record.predicted_rejected + (proposed - accepted) * predicted,
        )
