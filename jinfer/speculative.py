"""Speculative decoding: several tokens per pass over the weights, and exactly the tokens that
decoding one at a time would give.

A decode step reads every weight to make one token per row; a verify step feeds each row its last
token and k draft tokens (`DRAFT_SOURCES`: guessed from its own prompt and output by
`ngram_drafts`, the tokens that followed the latest earlier occurrence of the row's last 1-3
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

Host side, `Speculation` decides per decode dispatch whether to verify, and how many draft tokens:
a verify step costs more than a decode step, the more the more columns it feeds (measured per
variant at warm-up: on a 2-core CPU with quantized weights, twice a decode step for 5 columns),
and pays only while the rows' expected accepted tokens make up for it; otherwise the engine decodes
plainly (`Speculation`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jinfer.draft import model_drafts, run_model, target_of
from jinfer.models import llama
from jinfer.sampling import pick
from jinfer.state import SlotState, sample_rows, scan_rows

LONGEST_NGRAM = 3  # the longest suffix looked up; shorter ones only when it has no earlier match
RECORD_DECAY = 0.8  # weight of a request's earlier verify steps in its record, per verify step
RELAX = 0.99  # weight of a record against the prior, per plain decode step
# A request's record before its first verify step: accepted, rejected, steps with a draft, without
# (a draft token's chance 2/3, every step drafting).
PRIOR_RECORD = (2.0, 1.0, 1.0, 0.0)


def ngram_drafts(history: jax.Array, positions: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """Draft tokens [rows, k] and which are real [rows, k], from each row's token history
    [rows, L] up to its last token's position [rows]: the tokens that followed the latest earlier
    occurrence of its last n tokens (n = LONGEST_NGRAM, or shorter when that has none), as far as
    they are known."""
    rows, seq = history.shape
    known = positions + 1  # tokens 0 .. positions
    pad = max(k, LONGEST_NGRAM)
    padded = jnp.pad(history, ((0, 0), (0, pad)))
    start = jnp.arange(seq)[None, :]
    follow = jnp.full((rows,), -1, jnp.int32)  # where the draft starts
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
    offsets = jnp.arange(k)[None, :]
    drafts = jnp.take_along_axis(padded, jnp.clip(follow[:, None] + offsets, 0, seq + pad - 1), axis=1)
    real = (follow[:, None] >= 0) & (follow[:, None] + offsets < known[:, None])
    return jnp.where(real, drafts, 0), real


def _ngram_source(params, cache, state, tables, active, k, **_):
    return (*ngram_drafts(state.history, state.positions, k), cache)


# Where draft tokens come from, by `EngineConfig.speculative`: (weights, caches, slot state, block
# tables, active rows, k, **step options) -> drafts [rows, k], which are real [rows, k], and the
# caches. Trained heads (EAGLE / MTP) would be a source reading the target's hidden states.
DRAFT_SOURCES = {"ngram": _ngram_source, "draft": model_drafts}


def _later_positions(state: SlotState, logits: jax.Array, drafting_rows: jax.Array, want_logprobs):
    """Tokens [rows, k] for positions 1..k of a verify step (state already advanced past t_0), each
    sampled as decoding would sample it there. Rows that draft have no penalties and no grammar, so
    logit bias and the min_tokens ban are all that processing does for them (other rows' later
    tokens are never taken)."""
    rows, k, vocab = logits.shape
    processed = logits + state.bias[:, None, :]
    banning = (state.generated[:, None] + jnp.arange(k)[None, :]) < state.min_tokens[:, None]
    processed = jax.lax.cond(
        jnp.any(banning & drafting_rows[:, None]),
        lambda: jnp.where(state.stop_mask[:, None, :] & banning[:, :, None], -jnp.inf, processed),
        lambda: processed,
    )
    knobs = jax.tree.map(lambda a: jnp.repeat(a, k, axis=0), state.sampling)
    # Column c (1..k) samples the token at p + 1 + c; the state's position is p + 1 by now.
    positions = (state.positions[:, None] + 1 + jnp.arange(k)[None, :]).reshape(-1)
    flat = lambda a: a.reshape(rows * k, vocab)
    return pick(flat(logits), flat(processed), knobs, positions, want_logprobs)


def verify_step(
    params,
    cache,
    state,
    tables,
    active,
    drafting,
    deferred,
    want_logprobs,
    *,
    cfg,
    vocab,
    k,
    source,
    draft_cfg=None,
    **attention,
):
    """One verify step for the state's rows (active, drafting, deferred [rows] bool): the cache, the
    rows' state, their output [k + 1, rows] (tokens -1 where not emitted) and the drafts proposed
    [rows]. A deferred row (a grammar's) is fed and its position-0 logits kept, as a decode step
    does. With a draft model (`jinfer.draft`) params and cache are both models'."""
    rows = active.shape[0]
    options = {"draft_cfg": draft_cfg, "vocab": vocab, **attention}
    drafts, real, cache = DRAFT_SOURCES[source](params, cache, state, tables, active, k, **options)
    real &= (drafting & active & ~deferred)[:, None]
    tokens = jnp.concatenate([state.tokens[:, None], drafts], axis=1)
    positions = state.positions[:, None] + jnp.arange(k + 1)[None, :]
    group = llama.TokenGroup(tokens, positions, active=active)
    # The target's pass only: the draft model (if any) wrote its K/V while drafting.
    (hidden,), cache = run_model(params, (group,), cfg, cache, tables, **attention)
    logits = llama.logits(target_of(params), hidden)[..., :vocab]  # [rows, k + 1, V]
    first = logits[:, 0]
    kept = jax.lax.cond(
        jnp.any(deferred), lambda: jnp.where(deferred[:, None], first, state.logits), lambda: state.logits
    )
    sampled = active & ~deferred
    state, out0 = sample_rows(state.replace(logits=kept), first, None, sampled, want_logprobs)
    later, outs = _later_positions(state, logits[:, 1:], jnp.any(real, axis=1), want_logprobs)
    emitted = jnp.concatenate([state.tokens[:, None], later.reshape(rows, k)], axis=1)  # t_0 .. t_k
    accepted = jnp.sum(jnp.cumprod(real & (drafts == emitted[:, :-1]), axis=1), axis=1)
    accepted = jnp.where(sampled, accepted, 0)
    # Advance past t_1 .. t_accepted, as `accepted` more decode steps would have.
    step = jnp.arange(1, k + 1)[None, :]
    taken = step <= accepted[:, None]  # [rows, k]
    seq = state.history.shape[1]
    at = jnp.where(taken, state.positions[:, None] + step, seq)
    counts = state.counts
    for j in range(k):
        counts = counts.at[jnp.arange(rows), emitted[:, j + 1]].add(taken[:, j].astype(jnp.int32))
    state = state.replace(
        tokens=jnp.take_along_axis(emitted, accepted[:, None], axis=1)[:, 0],
        positions=state.positions + accepted,
        generated=state.generated + accepted,
        counts=counts,
        history=state.history.at[jnp.arange(rows)[:, None], at].set(emitted[:, 1:], mode="drop"),
    )
    # [k + 1, rows] outputs: position 0 as decoding gives it, later ones where taken.
    shown = jnp.concatenate([sampled[:, None], taken], axis=1).T
    later_out = jax.tree.map(lambda a: jnp.swapaxes(a.reshape(rows, k, *a.shape[1:]), 0, 1), outs)
    out = jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), out0, later_out)
    out = out.replace(tokens=jnp.where(shown, out.tokens, -1), bad=out.bad & shown)
    return cache, state, out, jnp.sum(real, axis=1)


def verify(params, cache, state, tables, row_steps, drafting, deferred, want_logprobs, *, steps, **options):
    """`steps` verify steps for slots 0..rows-1 (`state.scan_rows`), slot i in the first
    row_steps[i] (a deferred slot in the first only, unsampled): the cache, the state, the output
    [steps x (k + 1), rows] (tokens -1 where nothing was emitted) and the drafts proposed [steps,
    rows]."""

    def step(cache, part, active, deferred):
        cache, part, out, drafted = verify_step(
            params, cache, part, tables, active, drafting, deferred, want_logprobs, **options
        )
        return cache, part, (out, drafted)

    cache, state, (outs, drafted) = scan_rows(step, cache, state, row_steps, deferred, steps)
    return cache, state, jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), outs), drafted


def may_draft(sampling, constrained: bool) -> bool:
    """Whether a request's rows may draft: it did not opt out, and it has no penalty or grammar
    (those would have to follow each draft token inside the step)."""
    return sampling.speculative is not False and not sampling.penalised and not constrained


class Speculation:
    """The host's choice, per decode dispatch, between a plain decode step and a verify step of
    some draft length, from each request's record and each variant's measured cost.

    A request's record (`Request.draft_record`, decaying counts: accepted draft tokens, rejected
    ones, steps with a draft, steps without) gives the chance α that a draft token is accepted,
    given the ones before it were, and the chance β that a step has a draft at all. A verify step
    of k drafts is then expected to emit 1 + β (α + α² + ... + α^k) tokens for that row, 1 for
    rows that do not draft; the dispatch takes the variant (plain: 1 token a row, cost 1) with
    the most expected tokens per unit of cost. While it decodes plainly, the drafting requests'
    records drift back toward the prior (`PRIOR_RECORD`), so a request whose drafts failed for a
    while is tried again where trying can pay (never where even the prior would not).
    """

    def __init__(self, variants: tuple[tuple[int, int], ...]):
        self.lengths: dict[int, list[int]] = {}  # slot bucket -> its draft lengths
        for rows, k in variants:
            self.lengths.setdefault(rows, []).append(k)
        # A verify step's time over a decode step's (`Device.verify_cost` measures them at
        # warm-up; until then a guess that it costs as many columns as it feeds, past the first).
        self.cost = {(rows, k): 1.0 + 0.25 * k for rows, k in variants}

    def feeds_draft(self, holders: list, slot_bucket) -> bool:
        """Whether a dispatch that is not a verify step (prompt chunks, plain and mixed decode
        steps) feeds a draft model (`jinfer.draft`: its cache must hold every position for its
        drafts to be any good): only where a verify step could pay for the batch of every slot's
        holder (`slot_bucket`: the rows for the highest busy slot + 1) with every drafting request
        at the prior. Where none could (a batch this large), the dispatch skips the draft's passes,
        which cost a share of every token, and the requests that drafted stop drafting (the draft's
        cache now misses positions of theirs)."""
        rows = slot_bucket(max(slot for slot, r in enumerate(holders) if r is not None) + 1)
        owners = holders[:rows]
        speculating = [r for r in owners if r is not None and r.speculative]
        busy = sum(r is not None for r in owners)
        prior = [_chances(PRIOR_RECORD)] * len(speculating)
        if speculating and rows in self.lengths and self._best(rows, busy, prior)[1] > busy:
            return True
        for request in speculating:
            request.speculative = False
        return False

    def _best(self, rows: int, busy: int, chances: list[tuple[float, float]]) -> tuple[int, float]:
        """The draft length with the most expected tokens per unit of cost for `busy` rows, those
        drafting with chances (α, β), and its tokens per cost."""

        def tokens_per_cost(k):
            drafted = sum(b * sum(a**i for i in range(1, k + 1)) for a, b in chances)
            return (busy + drafted) / self.cost[rows, k]

        k = max(self.lengths[rows], key=tokens_per_cost)
        return k, tokens_per_cost(k)

    def choose(self, rows: int, owners: list, steps: int) -> tuple[int, np.ndarray] | None:
        """The draft length and the rows [rows] that draft in a dispatch of `steps` decode steps,
        or None for a plain decode dispatch."""
        drafting = np.array([r is not None and r.speculative for r in owners])
        if rows not in self.lengths or not drafting.any():
            return None
        busy = sum(r is not None for r in owners)
        speculating = [r for r, d in zip(owners, drafting, strict=True) if d]
        k, tokens_per_cost = self._best(
            rows, busy, [_chances(r.draft_record or PRIOR_RECORD) for r in speculating]
        )
        if tokens_per_cost > busy:
            return k, drafting
        relax = RELAX**steps
        for r in speculating:
            record = r.draft_record or PRIOR_RECORD
            r.draft_record = tuple(
                relax * old + (1 - relax) * p for old, p in zip(record, PRIOR_RECORD, strict=True)
            )
        return None

    @staticmethod
    def record(owners: list, tokens: np.ndarray, steps: int, drafted: np.ndarray, counts) -> None:
        """A verify dispatch's results (its tokens [steps x (k + 1), rows], -1 where none was
        emitted; the drafts proposed [steps, rows]) into each request's totals and record, and the
        engine's `DispatchCounts`. Rows that may not draft (opted out, penalised, constrained) take
        part without a record: their steps are plain ones to them."""
        emitted = (tokens.reshape(steps, -1, tokens.shape[-1]) >= 0).sum(axis=1)  # [steps, rows]
        for row, request in enumerate(owners):
            for step in (
                np.flatnonzero(emitted[:, row]) if request is not None and request.speculative else ()
            ):
                proposed, accepted = int(drafted[step, row]), int(emitted[step, row]) - 1
                request.drafted_tokens += proposed
                request.accepted_tokens += accepted
                request.verify_steps += 1
                seen = (accepted, accepted < proposed, proposed > 0, proposed == 0)
                record = request.draft_record or PRIOR_RECORD
                request.draft_record = tuple(
                    RECORD_DECAY * old + new for old, new in zip(record, seen, strict=True)
                )
                counts.draft_tokens += proposed
                counts.accepted_tokens += accepted


def _chances(record: tuple[float, ...]) -> tuple[float, float]:
    """(α, β) from a request's record: a draft token's chance of acceptance, a step's of a draft."""
    accepted, rejected, drafted, undrafted = record
    return accepted / (accepted + rejected), drafted / (drafted + undrafted)
