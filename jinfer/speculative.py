"""Speculative decoding: several tokens per pass over the weights, and exactly the tokens that
decoding one at a time would give.

A decode step reads every weight to make one token per row; a verify step feeds each row its last
token and k draft tokens (`DRAFT_SOURCES`: guessed from its own prompt and output by
`ngram_drafts`, the tokens that followed the latest earlier occurrence of the row's last 1-6
tokens; or a small draft model's greedy continuation, `jinfer.draft`) through one pass, and so
gets the logits of k + 1 positions for the price of about one while the batch is small:

    tokens [rows, k + 1] = last token, d_1 .. d_k  ->  logits at positions p .. p + k
    t_0 = the token decoding would sample at p + 1 (the decode step's own sampling, bit for bit)
    t_j = the token it would sample at p + 1 + j, were d_1 .. d_j the tokens before it
    accepted = the leading j with d_j == t_{j - 1}; the row emits t_0 .. t_accepted

Every t_j is drawn as decoding draws it (the request's seed folded with the position, after the
same temperature, top-k, top-p, min-p and logit bias), and the kernels give a column the same bits
however many share its pass (`jinfer.kernels`), so a row emits exactly what decoding would: with
a point-mass draft d, taking t when t == d is the standard rejection rule (accept d with
probability p(d), else a token from p without d), drawn with the normal sampler's own randomness.
Greedy and seeded outputs are therefore identical with speculation on or off, alone or in any
crowd. K/V written for rejected positions lie past the row's position and are overwritten before
any query can see them (attention masks keys by position).

Rows with penalties or a grammar never draft (their counts / allowed set would change inside the
step); such a row still emits t_0, as a decode step would.

A verify step costs more than a decode step, the more the more columns it feeds (measured per
draft length at warm-up: on a 2-core CPU, 1.3-1.5x a decode step for 4-8 drafts of float32
weights), and pays only while the drafts it checks are accepted often enough. Who judges that:

  * n-gram drafts cost nothing to make, and how likely one is right shows in its own match: the
    tokens after a 6-token match are usually what a copy goes on with, after a 1-token match
    seldom. So each step picks its own draft length, 0 (a plain decode step) included, on the
    device (`best_length`), from each row's draft, the chance per match length (`kind`) that the
    row's drafts of that kind are accepted, and each length's measured cost: a request copying its
    prompt verifies 8 drafts where its match is long and decodes plainly where it has none.
  * a draft model's drafts cost a pass per token, so the host picks their number per dispatch,
    before they are made.

Host side, `Speculation` keeps each request's record of its drafts' fate, sends the rows' chances
and the lengths' costs with each verify dispatch, and dispatches plain decode steps where no
length could pay even for the rows' best drafts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jinfer.draft import model_drafts, run_model
from jinfer.inputs import DispatchOutput, DraftPlan, Program
from jinfer.models import llama
from jinfer.sampling import pick, process
from jinfer.state import SlotState, advance_rows, sample_rows, scan_rows

LONGEST_NGRAM = 6  # the longest suffix looked up; shorter ones only when it has no earlier match
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


def ngram_drafts(history: jax.Array, positions: jax.Array, k: int) -> tuple[jax.Array, ...]:
    """Draft tokens [rows, k], which are real [rows, k] and the match's length n [rows] (0: none),
    from each row's token history [rows, L] up to its last token's position [rows]: the tokens that
    followed the latest earlier occurrence of its last n tokens (n = LONGEST_NGRAM, or shorter when
    that has none), as far as they are known."""
    rows, seq = history.shape
    known = positions + 1  # tokens 0 .. positions
    pad = max(k, LONGEST_NGRAM)
    padded = jnp.pad(history, ((0, 0), (0, pad)))
    start = jnp.arange(seq)[None, :]
    follow = jnp.full((rows,), -1, jnp.int32)  # where the draft starts
    matched = jnp.zeros((rows,), jnp.int32)
    for n in range(1, LONGEST_NGRAM + 1):  # longer matches override shorter ones
        suffix = jnp.take_along_axis(
            history, jnp.clip(known[:, None] - n + jnp.arange(n), 0, seq - 1), axis=1
        )
        # An earlier occurrence: it ends before the last token, so its continuation is known.
        match = start + n < known[:, None]
        for m in range(n):
            match &= padded[:, m : m + seq] == suffix[:, m : m + 1]
        latest = jnp.max(jnp.where(match, start, -1), axis=1)
        follow = jnp.where(latest >= 0, latest + n, follow)
        matched = jnp.where(latest >= 0, n, matched)
    offsets = jnp.arange(k)[None, :]
    drafts = jnp.take_along_axis(padded, jnp.clip(follow[:, None] + offsets, 0, seq + pad - 1), axis=1)
    real = (follow[:, None] >= 0) & (follow[:, None] + offsets < known[:, None])
    return jnp.where(real, drafts, 0), real, matched


def _ngram_source(params, cache, state, tables, active, k, **_):
    drafts, real, matched = ngram_drafts(state.history, state.positions, k)
    return drafts, real, jnp.maximum(matched - 1, 0), cache


def _model_source(params, cache, state, tables, active, k, **options):
    drafts, real, cache = model_drafts(params, cache, state, tables, active, k, **options)
    return drafts, real, jnp.zeros(active.shape, jnp.int32), cache


class DraftSource(NamedTuple):
    """Where draft tokens come from (`EngineConfig.speculative`)."""

    # (weights, caches, slot state, block tables, active rows, k, **step options) -> drafts [rows, k],
    # which are real [rows, k], each row's kind of draft [rows] and the caches.
    draft: Callable
    priors: tuple[float, ...]  # per kind: a draft token's chance of acceptance before any is checked
    per_step: bool  # the device picks each step's draft length; else the host, per dispatch


# N-gram drafts' kinds are their match lengths, 1 .. LONGEST_NGRAM: over SmolLM2's greedy edits and
# chats (every position of 13 outputs), a draft token was accepted with chance 0.32 after a 1-token
# match, 0.65, 0.77, 0.85, 0.87 after 2-5 tokens and 0.92 after 6 or more. A draft model's prior is
# optimistic: where its passes are dear only a draft that is nearly always right pays, and a lower
# prior would never try one; one that agrees less shows it in its first checked drafts (the
# engine's chances follow them). Trained heads (EAGLE / MTP) would read the target's hidden states.
DRAFT_SOURCES = {
    "ngram": DraftSource(_ngram_source, (0.32, 0.65, 0.77, 0.85, 0.87, 0.92), per_step=True),
    "draft": DraftSource(_model_source, (0.9,), per_step=False),
}


def program_lengths(source: str, variants, k: int) -> tuple[int, ...]:
    """The draft lengths a verify program of `k` drafts takes (`variants`: the (slot bucket,
    length) pairs compiled): where the device picks, every length up to k and 0, else k."""
    if not DRAFT_SOURCES[source].per_step:
        return (k,)
    return (0, *sorted({n for _, n in variants if n <= k}))


def verify_programs(source: str, variants) -> tuple[tuple[int, int], ...]:
    """The (slot bucket, k) verify programs compiled for the (slot bucket, length) `variants`: one
    per slot bucket, of its longest length, where the device picks (its branches hold the rest),
    else one per variant."""
    if not variants or not DRAFT_SOURCES[source].per_step:
        return tuple(variants)
    longest = {}
    for rows, k in variants:
        longest[rows] = max(k, longest.get(rows, 0))
    return tuple(longest.items())


def best_length(lengths, costs, chances, kind, real, counted) -> jax.Array:
    """The index of the draft length (of `lengths`, their costs [len(lengths)] over a decode
    step's) with the most expected tokens per unit of cost: each counted row [rows] makes one
    token, and a row with real drafts [rows, k] (a prefix) of a kind [rows] whose drafts are
    accepted with chance chances[row, kind] one more per draft accepted, each accepted only after
    the ones before it: α + α² + ... over the drafts checked."""
    rows, k = real.shape
    alpha = jnp.take_along_axis(chances, kind[:, None], axis=1)  # [rows, 1]
    gains = jnp.cumsum(jnp.where(real, jnp.cumprod(jnp.broadcast_to(alpha, (rows, k)), axis=1), 0.0), axis=1)
    gains = jnp.concatenate([jnp.zeros((rows, 1)), gains], axis=1)  # [rows, k + 1]: with 0..k drafts
    expected = jnp.sum(counted) + jnp.sum(gains[:, jnp.asarray(lengths)], axis=0)
    return jnp.argmax(expected / costs)


def _later_positions(state: SlotState, logits: jax.Array, want_logprobs, processing):
    """Tokens [rows, k] for positions 1..k of a verify step (state already advanced past t_0), each
    processed and sampled as decoding would there (`sampling.process`; only rows without penalties
    or a grammar draft, so the counts a later position would have do not matter: other rows'
    later tokens are never taken)."""
    rows, k, vocab = logits.shape
    banning = (state.generated[:, None] + jnp.arange(k)[None, :]) < state.min_tokens[:, None]
    knobs = (state.prompt_mask, state.counts, state.bias, state.stop_mask, banning, None, state.sampling)
    processed = process(logits, *knobs, processing)  # [rows, k, V]
    repeated = jax.tree.map(lambda a: jnp.repeat(a, k, axis=0), state.sampling)
    # Column c (1..k) samples the token at p + 1 + c; the state's position is p + 1 by now.
    positions = (state.positions[:, None] + 1 + jnp.arange(k)[None, :]).reshape(-1)
    flat = lambda a: a.reshape(rows * k, vocab)
    return pick(flat(logits), flat(processed), repeated, positions, want_logprobs)


def verify_step(
    params,
    cache,
    state,
    tables,
    active,
    plan: DraftPlan,
    deferred,
    want_logprobs,
    processing,
    *,
    cfg,
    vocab,
    lengths,
    source,
    draft_cfg=None,
    **attention,
):
    """One verify step for the state's rows (active, deferred [rows] bool) at the draft length
    `best_length` picks of `lengths` (or the plan's forced one): the cache, the rows' state, their
    output [k + 1, rows] (k the longest length; tokens -1 where not emitted), the drafts checked
    [rows] and their kind [rows]. A deferred row (a grammar's) is fed and its position-0 logits
    kept, as a decode step does. params and cache are `jinfer.weights`' trees; `processing`: the
    rows' registered processors (`RowInputs.processing`)."""
    k = max(lengths)
    options = {"draft_cfg": draft_cfg, "vocab": vocab, **attention}
    source = DRAFT_SOURCES[source].draft
    drafts, real, kind, cache = source(params, cache, state, tables, active, k, **options)
    real &= (plan.drafting & active & ~deferred)[:, None]
    best = best_length(lengths, plan.costs, plan.chances, kind, real, active & ~deferred)
    chosen = jnp.where(plan.force >= 0, plan.force, best)

    def at_length(n):
        def run(carry):
            cache, state, _, _ = carry
            rows = (active, deferred, want_logprobs, processing, drafts[:, :n], real[:, :n])
            one = (params, cache, state, tables, *rows)
            cache, state, out, checked = _check_drafts(*one, cfg=cfg, vocab=vocab, **attention)
            pad = lambda a, fill: jnp.concatenate([a, jnp.full((k - n, *a.shape[1:]), fill, a.dtype)])
            out = jax.tree.map(lambda a: pad(a, 0), out).replace(tokens=pad(out.tokens, -1))
            return cache, state, out, checked

        return run

    # Each length's pass runs inside a loop of 0 or 1 trips: XLA:CPU copies the whole KV cache
    # into and out of a conditional's branches, never a loop's carry.
    carry = jax.eval_shape(at_length(k), (cache, state, None, None))
    carry = (cache, state, *jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), carry[2:]))
    for index, n in enumerate(lengths):
        trips = (chosen == index).astype(jnp.int32)
        carry = jax.lax.fori_loop(0, trips, lambda _, c, n=n: at_length(n)(c), carry)
    cache, state, out, checked = carry
    return cache, state, out, checked, kind


def _check_drafts(
    params,
    cache,
    state,
    tables,
    active,
    deferred,
    want_logprobs,
    processing,
    drafts,
    real,
    *,
    cfg,
    vocab,
    **attention,
):
    """The target's pass over each row's last token and its drafts [rows, k] (k may be 0: a plain
    decode step), then the tokens decoding would sample at those positions, the leading drafts
    they agree with accepted: the cache, the state, the output [k + 1, rows] and the drafts
    checked per row [rows]."""
    rows, k = drafts.shape
    tokens = jnp.concatenate([state.tokens[:, None], drafts], axis=1)
    group = llama.TokenGroup.of_rows(tokens, state.positions, active)
    # The target's pass only: the draft model (if any) wrote its K/V while drafting.
    (hidden,), cache = run_model(params, (group,), cfg, cache, tables, **attention)
    logits = llama.logits(params.target, hidden)[..., :vocab]  # [rows, k + 1, V]
    first = logits[:, 0]
    kept = jax.lax.cond(
        jnp.any(deferred), lambda: jnp.where(deferred[:, None], first, state.logits), lambda: state.logits
    )
    sampled = active & ~deferred
    state, out0 = sample_rows(state.replace(logits=kept), first, None, sampled, want_logprobs, processing)
    if k:
        later, outs = _later_positions(state, logits[:, 1:], want_logprobs, processing)
        state, taken = _advance(state, drafts, real, later.reshape(rows, k), sampled)
        later_out = jax.tree.map(lambda a: jnp.swapaxes(a.reshape(rows, k, *a.shape[1:]), 0, 1), outs)
        out = jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), out0, later_out)
    else:
        taken, out = jnp.zeros((rows, 0), bool), jax.tree.map(lambda a: a[None], out0)
    # [k + 1, rows] outputs: position 0 as decoding gives it, later ones where taken.
    shown = jnp.concatenate([sampled[:, None], taken], axis=1).T
    out = out.replace(tokens=jnp.where(shown, out.tokens, -1), bad=out.bad & shown)
    return cache, state, out, jnp.where(sampled, jnp.sum(real, axis=1), 0)


def _advance(state: SlotState, drafts, real, later, sampled) -> tuple[SlotState, jax.Array]:
    """The state past t_1 .. t_accepted (later [rows, k]: t_1 .. t_k, state already past t_0), as
    `accepted` more decode steps would have left it, and which of t_1 .. t_k were taken [rows, k]."""
    k = drafts.shape[1]
    emitted = jnp.concatenate([state.tokens[:, None], later], axis=1)  # t_0 .. t_k
    accepted = jnp.sum(jnp.cumprod(real & (drafts == emitted[:, :-1]), axis=1), axis=1)
    accepted = jnp.where(sampled, accepted, 0)
    taken = jnp.arange(1, k + 1)[None, :] <= accepted[:, None]  # [rows, k]
    return advance_rows(state, later, taken), taken


def verify(params, cache, state, tables, inputs, chunk: None, *, steps, processors, **options):
    """`steps` verify steps for slots 0..rows-1 (`state.scan_rows`), slot i in the first
    inputs.steps[i] (a deferred slot in the first only, unsampled), by the inputs' `DraftPlan`:
    the cache, the state and a `DispatchOutput` of the rows' output [steps x (k + 1), rows]
    (tokens -1 where nothing was emitted), the drafts checked [steps, rows] and their kinds."""

    processing = inputs.processing(processors)

    def step(cache, part, active, deferred):
        rows = (active, inputs.plan, deferred, inputs.want_logprobs, processing)
        cache, part, out, checked, kind = verify_step(params, cache, part, tables, *rows, **options)
        return cache, part, (out, checked, kind)

    cache, state, (outs, checked, kinds) = scan_rows(step, cache, state, inputs.steps, inputs.deferred, steps)
    outs = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), outs)
    return cache, state, DispatchOutput(rows=outs, checked=checked, kinds=kinds)


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


def may_draft(sampling, constrained: bool) -> bool:
    """Whether a request's rows may draft: it did not opt out, and it has no penalty or grammar
    (those would have to follow each draft token inside the step)."""
    return sampling.speculative is not False and not sampling.penalised and not constrained


class Speculation:
    """The host's side of speculative decoding (see the module docstring): per decode dispatch, a
    verify program or plain decode steps, from each request's chances and each length's cost.

    α, the chance that a draft token is accepted given the ones before it were, is estimated per
    request and kind (`chances`): the engine's acceptance of the kind so far (`seen`), scaled by
    how the request's drafts of every kind fared against the engine's, moved toward its own drafts
    of the kind as they add up (`Request.draft_record`, decaying). Pooled so, a chat's drafts
    rejected after one match length lower its chances after every length, and a copy's raise them.
    A verify step of k drafts is expected to emit 1 + α + ... + α^k tokens for the row, 1 for a
    row without a draft; the device per step (`best_length`) and the host per dispatch (`_best`)
    take the length with the most expected tokens per unit of cost. While a request's drafts go
    unchecked its evidence fades, so one whose drafts failed is tried again after a while. Where
    the device picks, each slot bucket also keeps the share of its recent verify steps that checked
    any draft (`useful`): a batch whose steps all decode plainly is spared the program, `USEFUL_FLOOR`.
    """

    def __init__(self, layout):
        source, variants = self.source, self.variants = layout.speculative, layout.verify_variants
        self.lengths: dict[int, list[int]] = {}  # slot bucket -> its draft lengths
        for rows, k in variants:
            self.lengths.setdefault(rows, []).append(k)
        alphas = np.array(DRAFT_SOURCES[source].priors, np.float32)
        # [kinds, 2]: draft tokens accepted and rejected over all requests (priors: ~10 drafts' worth)
        self.seen = 10 * np.stack([alphas, 1 - alphas], axis=1)
        # A verify step's time over a decode step's (`measure_verify_costs` measures them at
        # warm-up; until then a guess that it costs as many columns as it feeds, past the first).
        self.cost = {(rows, k): 1.0 + 0.25 * k for rows, k in variants}
        self.useful = dict.fromkeys(self.lengths, 1.0)

    def chances(self, record: np.ndarray | None, engine: np.ndarray | None = None) -> np.ndarray:
        """[kinds]: α per kind for a request with this record (None: no evidence of its own), from
        the engine's chances (`chances(None)`, derived here unless given)."""
        engine = self.seen[:, 0] / self.seen.sum(axis=1) if engine is None else engine
        if record is None:
            return engine
        own, (accepted, expected) = record[:-1], record[-1]
        pooled = np.minimum(engine * (accepted + PRIOR_WEIGHT) / (expected + PRIOR_WEIGHT), HIGHEST_CHANCE)
        return (own[:, 0] + PRIOR_WEIGHT * pooled) / (own.sum(axis=1) + PRIOR_WEIGHT)

    def feeds_draft(self, holders: list, slot_bucket) -> bool:
        """Whether a dispatch that is not a verify step (prompt chunks, plain and mixed decode
        steps) feeds a draft model (`jinfer.draft`: its cache must hold every position for its
        drafts to be any good): only where a verify step could pay for the batch of every slot's
        holder (`slot_bucket`: the rows for the highest busy slot + 1) with every drafting request
        at the engine's chances. Where none could (a batch this large), the dispatch skips the
        draft's passes, which cost a share of every token, and the requests that drafted stop
        drafting (the draft's cache now misses positions of theirs)."""
        rows = slot_bucket(max(slot for slot, r in enumerate(holders) if r is not None) + 1)
        owners = holders[:rows]
        speculating = [r for r in owners if r is not None and r.speculative]
        busy = sum(r is not None for r in owners)
        alphas = [float(np.max(self.chances(None)))] * len(speculating)
        if speculating and rows in self.lengths and self._best(rows, busy, alphas)[1] > busy:
            return True
        for request in speculating:
            request.speculative = request.kv.drafted = False
        return False

    def _best(self, rows: int, busy: int, alphas: list[float]) -> tuple[int, float]:
        """The draft length with the most expected tokens per unit of cost for `busy` rows, those
        drafting with chances α, and its tokens per cost."""

        def tokens_per_cost(k):
            return (busy + sum(sum(a**i for i in range(1, k + 1)) for a in alphas)) / self.cost[rows, k]

        k = max(self.lengths[rows], key=tokens_per_cost)
        return k, tokens_per_cost(k)

    def choose(self, rows: int, owners: list, steps: int) -> tuple[int, DraftPlan] | None:
        """A verify dispatch of `steps` steps for the rows [rows] (their owners): its program's
        draft length and its plan; or None for a plain decode dispatch. Where the device picks
        lengths, whenever some length could pay with every drafting row at its best kind and the
        bucket's steps were of use lately; else the length that pays best, if one does."""
        drafting = np.array([r is not None and r.speculative for r in owners])
        if rows not in self.lengths or not drafting.any():
            return None
        busy = sum(r is not None for r in owners)
        speculating = [r for r, d in zip(owners, drafting, strict=True) if d]
        engine, chances = self.chances(None), np.zeros((rows, len(self.seen)), np.float32)
        for row in np.flatnonzero(drafting):
            chances[row] = self.chances(owners[row].draft_record, engine)
        per_step = DRAFT_SOURCES[self.source].per_step
        alphas = [float(c.max() if per_step else c[0]) for c in chances[drafting]]
        k, tokens_per_cost = self._best(rows, busy, alphas)
        if per_step and self.useful[rows] < USEFUL_FLOOR:
            self.useful[rows] += (1 - self.useful[rows]) * (1 - RELAX**steps)
        elif tokens_per_cost > busy:
            k = max(self.lengths[rows]) if per_step else k
            lengths = program_lengths(self.source, self.variants, k)
            costs = np.array([self.cost[rows, n] if n else 1.0 for n in lengths], np.float32)
            return k, DraftPlan(drafting, chances, costs, np.int32(-1))
        for request in speculating:
            _fade(request, steps)
        return None

    def record(self, owners: list, tokens: np.ndarray, steps: int, checked, kinds, counts) -> None:
        """A verify dispatch's results (its tokens [steps x (k + 1), rows], -1 where none was
        emitted; the drafts checked and their kinds [steps, rows]) into each request's totals and
        record, and the engine's `DispatchCounts`. Rows that may not draft (opted out, penalised,
        constrained) take part without a record: their steps are plain ones to them."""
        emitted = (tokens.reshape(steps, -1, tokens.shape[-1]) >= 0).sum(axis=1)  # [steps, rows]
        taken = emitted.any(axis=1)
        if taken.any():
            share = float((checked[taken] > 0).any(axis=1).mean())
            rows = checked.shape[1]
            self.useful[rows] = RECORD_DECAY * self.useful[rows] + (1 - RECORD_DECAY) * share
        for row, request in enumerate(owners):
            if request is None or not request.speculative:
                continue
            for step in np.flatnonzero(emitted[:, row]):
                proposed, accepted = int(checked[step, row]), int(emitted[step, row]) - 1
                if not proposed:
                    _fade(request, 1)
                    continue
                request.drafted_tokens += proposed
                request.accepted_tokens += accepted
                request.verify_steps += 1
                kind, rejected = kinds[step, row], accepted < proposed
                engine, record = self.chances(None)[kind], request.draft_record
                record = np.zeros((len(self.seen) + 1, 2), np.float32) if record is None else record
                record[kind] = RECORD_DECAY * record[kind] + (accepted, rejected)
                record[-1] = RECORD_DECAY * record[-1] + (accepted, engine * (accepted + rejected))
                request.draft_record = record
                self.seen[kind] = ENGINE_DECAY * self.seen[kind] + (accepted, rejected)
                counts.draft_tokens += proposed
                counts.accepted_tokens += accepted


def _fade(request, steps: int) -> None:
    """A request's evidence after `steps` decode steps without a draft checked."""
    if request.draft_record is not None:
        request.draft_record = request.draft_record * RELAX**steps
