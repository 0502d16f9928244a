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

Rows with penalties, a grammar or a reasoning budget never draft (their counts / allowed set would
change inside the step); such a row still emits t_0, as a decode step would.

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

The host's side, which requests verify and how many drafts a dispatch takes, is
`jinfer.speculation`: each request's record of its drafts' fate, sent with each verify dispatch as
the rows' chances and the lengths' costs (`DraftPlan`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jinfer.draft import model_drafts, run_model
from jinfer.inputs import DispatchOutput, DraftPlan
from jinfer.models.attention import TokenGroup
from jinfer.models.family import family_of
from jinfer.sampling import TokenHistory, pick, process
from jinfer.state import RowStep, SlotState, advance_rows, sample_rows, scan_rows

LONGEST_NGRAM = 6  # the longest suffix looked up; shorter ones only when it has no earlier match


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
    for n, suffix in enumerate(_suffixes(history, positions), start=1):  # longer ones override shorter
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


def _suffixes(history: jax.Array, positions: jax.Array) -> list[jax.Array]:
    """Each row's last n tokens [rows, n], for n = 1 .. LONGEST_NGRAM (clipped at position 0)."""
    seq, known = history.shape[1], positions + 1
    at = lambda n: jnp.clip(known[:, None] - n + jnp.arange(n), 0, seq - 1)
    return [jnp.take_along_axis(history, at(n), axis=1) for n in range(1, LONGEST_NGRAM + 1)]


def prediction_drafts(prediction, history, positions, generated, k: int) -> tuple[jax.Array, ...]:
    """Draft tokens [rows, k], which are real [rows, k] and the match's length n [rows] (0: none),
    from each row's predicted output [rows, L] (-1 past its end): the predicted tokens that follow
    an occurrence in it of the row's last n tokens (the longest n with one). Of several, the one
    whose continuation is nearest the output's own length (`generated`): an output that follows its
    prediction, edits and all, is about as far into it as it is long."""
    rows, seq = prediction.shape
    pad = max(k, LONGEST_NGRAM)
    padded = jnp.pad(prediction, ((0, 0), (0, pad)), constant_values=-1)
    start = jnp.arange(seq)[None, :]
    follow = jnp.full((rows,), -1, jnp.int32)
    matched = jnp.zeros((rows,), jnp.int32)
    for n, suffix in enumerate(_suffixes(history, positions), start=1):
        match = (padded[:, n : n + seq] >= 0) & (n <= positions[:, None] + 1)  # a known continuation
        for m in range(n):
            match &= padded[:, m : m + seq] == suffix[:, m : m + 1]
        distance = jnp.where(match, jnp.abs(start + n - generated[:, None]), 2 * seq)
        nearest = jnp.argmin(distance, axis=1)
        found = jnp.any(match, axis=1)
        follow = jnp.where(found, nearest + n, follow)
        matched = jnp.where(found, n, matched)
    at = jnp.clip(follow[:, None] + jnp.arange(k)[None, :], 0, seq + pad - 1)
    drafts = jnp.take_along_axis(padded, at, axis=1)
    real = (follow[:, None] >= 0) & (drafts >= 0)
    return jnp.where(real, drafts, 0), real, matched


def _ngram_source(params, cache, state, tables, active, k, **_):
    """Drafts from the row's predicted output where it matches at least as long a suffix as the
    row's own tokens do (kinds LONGEST_NGRAM + n - 1), else from its own tokens (kinds n - 1)."""
    drafts, real, matched = ngram_drafts(state.history, state.positions, k)
    guess, guess_real, guess_matched = prediction_drafts(
        state.prediction, state.history, state.positions, state.generated, k
    )
    use = (guess_matched > 0) & (guess_matched >= matched)
    kind = jnp.where(use, LONGEST_NGRAM + guess_matched - 1, jnp.maximum(matched - 1, 0))
    return jnp.where(use[:, None], guess, drafts), jnp.where(use[:, None], guess_real, real), kind, cache


def _model_source(params, cache, state, tables, active, k, **options):
    drafts, real, cache = model_drafts(params, cache, state, tables, active, k, **options)
    return drafts, real, jnp.zeros(active.shape, jnp.int32), cache


# Set, not measured: each request's evidence replaces them after a few drafts.
PREDICTION_PRIORS = (0.6, 0.8, 0.85, 0.9, 0.9, 0.95)


class DraftSource(NamedTuple):
    """Where draft tokens come from (`EngineConfig.speculative`)."""

    # (weights, caches, slot state, block tables, active rows, k, **step options) -> drafts [rows, k],
    # which are real [rows, k], each row's kind of draft [rows] and the caches.
    draft: Callable
    priors: tuple[float, ...]  # per kind: a draft token's chance of acceptance before any is checked
    per_step: bool  # the device picks each step's draft length; else the host, per dispatch
    predicted_kinds: range = range(0)  # the kinds drafted from a request's predicted output


# N-gram drafts' kinds are their match lengths, 1 .. LONGEST_NGRAM: over SmolLM2's greedy edits and
# chats (every position of 13 outputs), a draft token was accepted with chance 0.32 after a 1-token
# match, 0.65, 0.77, 0.85, 0.87 after 2-5 tokens and 0.92 after 6 or more. Drafts from a request's
# predicted output are kinds of their own, LONGEST_NGRAM + 1 .. 2 x LONGEST_NGRAM by match length
# (PREDICTION_PRIORS). A draft model's prior is
# optimistic: where its passes are dear only a draft that is nearly always right pays, and a lower
# prior would never try one; one that agrees less shows it in its first checked drafts (the
# engine's chances follow them). Trained heads (EAGLE / MTP) would read the target's hidden states.
DRAFT_SOURCES = {
    "ngram": DraftSource(
        _ngram_source,
        (0.32, 0.65, 0.77, 0.85, 0.87, 0.92, *PREDICTION_PRIORS),
        per_step=True,
        predicted_kinds=range(LONGEST_NGRAM, 2 * LONGEST_NGRAM),
    ),
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


def _later_positions(state: SlotState, logits: jax.Array, want_logprobs, processing, drafts):
    """Tokens [rows, k] for positions 1..k of a verify step (state already advanced past t_0), each
    processed and sampled as decoding would there (`sampling.process`; only rows without penalties,
    a grammar or a reasoning budget draft, so the counts a later position would have do not
    matter: other rows' later tokens are never taken). The processors see each position's
    history as if the drafts [rows, k] before it were taken: where they are not, its token is not."""
    rows, k, vocab = logits.shape
    banning = (state.generated[:, None] + jnp.arange(k)[None, :]) < state.min_tokens[:, None]
    knobs = (state.prompt_mask, state.counts, state.bias, state.stop_mask, banning, None, state.sampling)
    history = lambda: _drafted_history(state, drafts)
    processed = process(logits, *knobs, processing, None, history)  # [rows, k, V]
    repeated = jax.tree.map(lambda a: jnp.repeat(a, k, axis=0), state.sampling)
    # Column c (1..k) samples the token at p + 1 + c; the state's position is p + 1 by now.
    positions = (state.positions[:, None] + 1 + jnp.arange(k)[None, :]).reshape(-1)
    flat = lambda a: a.reshape(rows * k, vocab)
    return pick(flat(logits), flat(processed), repeated, positions, want_logprobs)


def _drafted_history(state: SlotState, drafts: jax.Array) -> TokenHistory:
    """The token history [rows, k, ...] a verify step's later position j (0..k-1) is chosen after:
    the state's (through t_0) with drafts 0..j in place from t_0's position on (draft 0 stands for
    t_0, draft i for t_i)."""
    k = drafts.shape[1]
    offset = jnp.arange(state.history.shape[1])[None, :] - state.positions[:, None]  # [rows, L]
    drafted = jnp.take_along_axis(drafts, jnp.clip(offset, 0, k - 1), axis=1)  # [rows, L]
    placed = (offset >= 0)[:, None, :] & (offset[:, None, :] <= jnp.arange(k)[None, :, None])
    tokens = jnp.where(placed, drafted[:, None, :], state.history[:, None, :])  # [rows, k, L]
    steps = jnp.arange(k)[None, :]
    widen = lambda a: jnp.broadcast_to(a[:, None], (a.shape[0], k, *a.shape[1:]))
    length, generated = state.positions[:, None] + 1 + steps, state.generated[:, None] + steps
    return TokenHistory.of(tokens, length, generated, widen(state.stop_mask))


def verify_step(
    params,
    cache,
    state,
    tables,
    step: RowStep,
    plan: DraftPlan,
    *,
    cfg,
    vocab,
    lengths,
    source,
    draft_cfg=None,
    **attention,
):
    """One verify step for the state's rows (`step`) at the draft length
    `best_length` picks of `lengths` (or the plan's forced one): the cache, the rows' state, their
    output [k + 1, rows] (k the longest length; tokens -1 where not emitted), the drafts checked
    [rows] and their kind [rows]. A deferred row (a grammar's) is fed and its position-0 logits
    kept, as a decode step does. params and cache are `jinfer.weights`' trees."""
    k, active = max(lengths), step.active
    options = {"draft_cfg": draft_cfg, "vocab": vocab, **attention}
    source = DRAFT_SOURCES[source].draft
    drafts, real, kind, cache = source(params, cache, state, tables, active, k, **options)
    real &= (plan.drafting & step.sampled)[:, None]
    best = best_length(lengths, plan.costs, plan.chances, kind, real, step.sampled)
    chosen = jnp.where(plan.force >= 0, plan.force, best)

    def at_length(n):
        def run(carry):
            cache, state, _, _ = carry
            one = (params, cache, state, tables, step, drafts[:, :n], real[:, :n])
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


def _check_drafts(params, cache, state, tables, step: RowStep, drafts, real, *, cfg, vocab, **attention):
    """The target's pass over each row's last token and its drafts [rows, k] (k may be 0: a plain
    decode step), then the tokens decoding would sample at those positions, the leading drafts
    they agree with accepted: the cache, the state, the output [k + 1, rows] and the drafts
    checked per row [rows]."""
    (rows, k), deferred, sampled = drafts.shape, step.deferred, step.sampled
    tokens = jnp.concatenate([state.tokens[:, None], drafts], axis=1)
    group = TokenGroup.of_rows(tokens, state.positions, step.active)
    # The target's pass only: the draft model (if any) wrote its K/V while drafting.
    (hidden,), cache = run_model(params, (group,), cfg, cache, tables, adapters=(step.adapters,), **attention)
    logits = family_of(cfg).logits(params.target, hidden)[..., :vocab]  # [rows, k + 1, V]
    first = logits[:, 0]
    kept = jax.lax.cond(
        jnp.any(deferred), lambda: jnp.where(deferred[:, None], first, state.logits), lambda: state.logits
    )
    kept_state = state.replace(logits=kept)
    state, out0 = sample_rows(kept_state, first, None, sampled, step.want_logprobs, step.processing)
    if k:
        later, outs = _later_positions(state, logits[:, 1:], step.want_logprobs, step.processing, drafts)
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
        rows = RowStep(active, deferred, inputs.want_logprobs, processing, inputs.adapter)
        cache, part, out, checked, kind = verify_step(
            params, cache, part, tables, rows, inputs.plan, **options
        )
        return cache, part, (out, checked, kind)

    cache, state, (outs, checked, kinds) = scan_rows(step, cache, state, inputs.steps, inputs.deferred, steps)
    outs = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), outs)
    return cache, state, DispatchOutput(rows=outs, checked=checked, kinds=kinds)
