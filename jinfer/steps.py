"""The jitted device steps, built once per (model config, layout, mesh).

Three verbs touch the paged KV cache, all with the cache and slot state donated, all reading the
host's block tables [slots, max_pages] (not donated: the host re-uploads them when they change):

  prefill(params, cache, state, tables, allowed, chunk) -> cache, state, out
      One prompt chunk (padded to a length bucket) is run with its K/V written straight into its
      sequence's pages, at positions start.. (so a long prompt is just several chunks, each
      attending to the ones before it, and a prompt whose first pages came from the prefix cache
      starts past them). The last real position's logits give the request's first token, sampled
      on device; the slot's state row is (re)initialised from the request (sampling knobs, logit
      bias, stop ids, how many tokens it generated before a preemption).
  decode[rows, attn_len](params, cache, state, tables, row_steps, deferred, want_logprobs)
      -> cache, state, out
      `steps` decode steps for slots 0..rows-1 at once (`lax.scan`): each step feeds every such
      slot's last token, samples the next one per slot and keeps it on device for the following
      step. Slot i takes part in the first row_steps[i] steps (0: inactive); a slot not taking
      part computes too (shapes are fixed) but neither writes nor advances. A deferred slot (a
      constrained request: one step) is fed and written but not sampled: its logits wait in the
      state for `sample`.
  mixed[rows, attn_len](params, cache, state, tables, allowed, row_steps, deferred, want_logprobs,
        chunk) -> ..., out, chunk_out
      One decode step that also prefills a prompt chunk (padded to `mixed_chunk_len(rows)`) into
      another slot: every weight is read once for both (`llama.forward_groups`), so a prompt
      arriving while others stream stretches their next step a little instead of inserting a
      whole prefill dispatch between two of their tokens.
  verify[rows, attn_len, k](..., tables, row_steps, plan, deferred, want_logprobs) -> ..., checked, kinds
      Decode steps that each verify up to k draft tokens a row (`jinfer.speculative`; n-gram
      drafts: each step picks its length, plain included, `speculative.verify_programs`).

With a draft model (`jinfer.draft`) the weights and the cache are both models' (`WithDraft`), every
pass over tokens writes the draft's K/V too, and prefill, decode and mixed also come without the
draft's passes (`Steps.program`), for batches no verify step could pay for.

Two small verbs keep the rest exact: `history` sets a slot's prompt-token mask, output-token
counts (what the penalties read) and token history (where drafts are looked up) from the tokens
the request really has, whatever the prefix cache spared it from computing or a preemption made
it recompute; `clear_pages` zeroes pages that may hold NaN or infinities before they are reused
(0 * NaN would leak through masking).

One compiled decode per (rows, attn_len) bucket pair: `rows` (a slot-count bucket covering the
highest busy slot; the scheduler fills the lowest free slot first) keeps a lightly loaded engine
from paying for every slot, and `attn_len` keeps attention to the filled part of the cache (with
an attention kernel, which reads only each row's filled part itself, there is one `attn_len`).
Log-probs are computed under `lax.cond` when some request asks for them: no variant of their own.

A constrained request's allowed tokens (`jinfer.structured`) follow from its token before, which
the host reads one dispatch late; so its decode row is deferred, and a small verb samples it once
the host has its bitmask (dispatched while the decode before still runs, ahead of the next one):

  sample(state, allowed, deferred, want_logprobs) -> state, out
      Sample the deferred slots among 0..rows-1 (rows = len(deferred)) from their waiting logits
      and advance them as a decode step would.

Prefill and the mixed chunk sample their request's first token under `allowed` [slots,
ceil(V / 32)] int32 too (each slot's allowed-token bitmask; all bits set for a slot without a
constraint), applied only when some row is constrained (`lax.cond`). Only int32 tokens, per-slot
flags and (when asked) log-probs leave the device; the engine reads them one iteration late so the
host overlaps the device.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jinfer.config import COLUMN_TILE, ModelConfig, dispatch_steps
from jinfer.draft import WithDraft, run_model, target_of
from jinfer.kv_cache import KVCache, init_cache
from jinfer.layout import Layout
from jinfer.models import llama
from jinfer.sampling import choose
from jinfer.sharding import DATA, MODEL
from jinfer.speculative import program_lengths, verify, verify_programs
from jinfer.state import (
    PackedChunk,
    PrefillChunk,
    SlotState,
    new_state,
    put_rows,
    rows_of,
    sample_rows,
    scan_rows,
    set_history,
)
from jinfer.state import state_shardings as slot_state_shardings
from jinfer.structured import ALL_ALLOWED, mask_words


def _chunk_group(chunk: PrefillChunk) -> llama.TokenGroup:
    offsets = jnp.arange(chunk.tokens.shape[1], dtype=jnp.int32)[None, :]
    return llama.TokenGroup(
        chunk.tokens, chunk.start + offsets, chunk.slot[None], valid=offsets < chunk.length
    )


def _last_real(hidden: jax.Array, chunk: PrefillChunk) -> jax.Array:
    """The hidden state [1, D] of the chunk's last real token (its logits give the next token)."""
    return jax.lax.dynamic_index_in_dim(hidden, chunk.length - 1, axis=1, keepdims=False)


def _no_logits(vocab: int) -> jax.Array:
    """Stand-in logits [1, V] for a chunk before a prompt's last: its sampled token is discarded,
    so its lm_head product is skipped (`lax.cond` on `chunk.last`)."""
    return jnp.zeros((1, vocab), jnp.float32)


def _start_slot(state: SlotState, chunk: PrefillChunk, logits: jax.Array, allowed: jax.Array, vocab: int):
    """Sample a token from a prompt chunk's last logits [1, V] and (re)initialise the slot's state row.

    The token sampled after a prompt's last chunk is the request's next output token (the first,
    unless a preemption made it prefill its earlier output again); earlier chunks' are discarded.
    The penalties read the row's prompt mask and output counts as `history` left them (a fresh
    request's counts start at zero).
    """
    slot = chunk.slot
    bias_row = jnp.zeros((vocab,), jnp.float32).at[chunk.bias_ids].set(chunk.bias_values, mode="drop")
    stop_row = jnp.zeros((vocab,), bool).at[chunk.stop_ids].set(True, mode="drop")
    counts_row = jnp.where(chunk.generated > 0, state.counts[slot], 0)
    position = chunk.start + chunk.length  # where the sampled token goes
    token, out = choose(
        logits,
        state.prompt_mask[slot][None],
        counts_row[None],
        bias_row[None],
        stop_row[None],
        (chunk.generated < chunk.min_tokens)[None],
        allowed[slot][None],
        chunk.sampling,
        position[None],
        chunk.want_logprobs,
    )
    set_row = lambda array, value: array.at[slot].set(value)
    # The chunk's tokens (and the token sampled after a prompt's last) where speculative drafts
    # look them up; padding and an earlier chunk's discarded token are dropped.
    offsets = jnp.arange(chunk.tokens.shape[1])
    seq = state.history.shape[1]
    at = jnp.where(offsets < chunk.length, chunk.start + offsets, seq)
    history = state.history.at[slot, at].set(chunk.tokens[0], mode="drop")
    history = history.at[slot, jnp.where(chunk.last, position, seq)].set(token[0], mode="drop")
    state = state.replace(
        history=history,
        tokens=set_row(state.tokens, token[0]),
        positions=set_row(state.positions, position),
        generated=set_row(state.generated, chunk.generated + 1),
        min_tokens=set_row(state.min_tokens, chunk.min_tokens),
        # An earlier chunk's token is discarded: it must not count (a resumed row's counts carry on).
        counts=set_row(
            state.counts, jnp.where(chunk.last, counts_row.at[token[0]].add(1), state.counts[slot])
        ),
        bias=set_row(state.bias, bias_row),
        stop_mask=set_row(state.stop_mask, stop_row),
        sampling=jax.tree.map(lambda a, r: a.at[slot].set(r[0]), state.sampling, chunk.sampling),
    )
    return state, jax.tree.map(lambda x: x[None], out)  # [1 step, 1 row]


def _prefill(params, cache, state: SlotState, tables, allowed, packed: PackedChunk, *, cfg, vocab, draft_cfg):
    chunk = packed.unpack()
    (hidden,), cache = run_model(params, (_chunk_group(chunk),), cfg, cache, tables, draft_cfg=draft_cfg)
    logits = jax.lax.cond(
        chunk.last,
        lambda: llama.logits(target_of(params), _last_real(hidden, chunk))[:, :vocab],
        lambda: _no_logits(vocab),
    )  # [1, V]
    state, out = _start_slot(state, chunk, logits, allowed, vocab)
    return cache, state, out


def _decode_step(
    params,
    cache,
    state,
    tables,
    active,
    deferred,
    want_logprobs,
    chunk,
    *,
    cfg,
    vocab,
    draft_cfg,
    **attention,
):
    """One decode step for the state's rows (slots 0..rows-1; active and deferred [rows] bool),
    carrying a prompt chunk when there is one: every weight is read once for both. Deferred rows
    keep their logits in the state (written only when some row is deferred) instead of sampling.
    Returns the cache, the rows' state, their output [rows] and the chunk's last logits [1, V]
    (None without a chunk). `attention`: attn_len and attention_kernel."""
    rows = active.shape[0]
    groups = [llama.TokenGroup(state.tokens[:, None], state.positions[:, None], active=active)]
    if chunk is not None:
        groups.append(_chunk_group(chunk))
    hidden, cache = run_model(params, groups, cfg, cache, tables, draft_cfg=draft_cfg, **attention)
    last = hidden[0][:, 0]  # [rows, D]
    target = target_of(params)
    if chunk is None:
        logits, chunk_logits = llama.logits(target, last)[:, :vocab], None
    else:
        rows_only = lambda: (llama.logits(target, last)[:, :vocab], _no_logits(vocab))

        def with_chunk():
            # The chunk's last position joins the rows in one lm_head product, padded to whole
            # column tiles (XLA:CPU took 13.5 ms for SmolLM2's with 9 columns, 10 ms with 16).
            both = jnp.concatenate([last, _last_real(hidden[1], chunk)])
            both = llama.logits(target, jnp.pad(both, ((0, -both.shape[0] % COLUMN_TILE), (0, 0))))
            return both[:rows, :vocab], both[rows : rows + 1, :vocab]

        # Chunks before a prompt's last skip that column (8 slots: an 8- instead of a 16-column
        # product, 7.9 against 12.5 ms of a 75 ms step on SmolLM2, XLA:CPU).
        logits, chunk_logits = jax.lax.cond(chunk.last, with_chunk, rows_only)
    kept = jax.lax.cond(
        jnp.any(deferred),
        lambda: jnp.where(deferred[:, None], logits, state.logits),
        lambda: state.logits,
    )
    state, out = sample_rows(state.replace(logits=kept), logits, None, active & ~deferred, want_logprobs)
    return cache, state, out, chunk_logits


def _decode(params, cache, state, tables, row_steps, deferred, want_logprobs, *, steps, **step_options):
    """`steps` decode steps for slots 0..rows-1 (`state.scan_rows`), slot i in the first
    row_steps[i] of them (a deferred slot in the first only, unsampled): the cache, the state and
    the output [steps, rows]."""

    def step(cache, part, active, deferred):
        cache, part, out, _ = _decode_step(
            params, cache, part, tables, active, deferred, want_logprobs, None, **step_options
        )
        return cache, part, out

    return scan_rows(step, cache, state, row_steps, deferred, steps)


def _mixed(
    params,
    cache,
    state,
    tables,
    allowed,
    row_steps,
    deferred,
    want_logprobs,
    packed: PackedChunk,
    *,
    vocab,
    **options,
):
    """One decode step for slots 0..rows-1 (those with row_steps > 0; deferred ones unsampled) that
    also prefills a prompt chunk into another slot, its token sampled under `allowed`: the cache,
    the state, the decode output [1, rows] and the chunk's output [1, 1]."""
    chunk = packed.unpack()
    part = rows_of(state, row_steps.shape[0])
    cache, part, out, chunk_logits = _decode_step(
        params, cache, part, tables, row_steps > 0, deferred, want_logprobs, chunk, vocab=vocab, **options
    )
    state = put_rows(state, part)  # before the chunk's slot starts: it is not among the rows
    state, chunk_out = _start_slot(state, chunk, chunk_logits, allowed, vocab)
    return cache, state, jax.tree.map(lambda x: x[None], out), chunk_out


def _sample(state: SlotState, allowed, deferred, want_logprobs):
    """Sample the deferred slots among 0..rows-1 under their allowed-token bitmasks: the state and
    the output [1, rows]."""
    rows = deferred.shape[0]
    part = rows_of(state, rows)
    part, out = sample_rows(part, part.logits, allowed[:rows], deferred, want_logprobs)
    # Only the fields sampling changes are written back: on a CPU each is a pass of its own.
    put = lambda name: jax.lax.dynamic_update_slice_in_dim(getattr(state, name), getattr(part, name), 0, 0)
    state = state.replace(
        **{name: put(name) for name in ("tokens", "positions", "generated", "counts", "history")}
    )
    return state, jax.tree.map(lambda x: x[None], out)


def _clear_pages(cache, pages: jax.Array):
    """Zero pages [n] of every pool, a draft model's too (entries past the pool are padding)."""
    return jax.tree.map(lambda pool: pool.at[:, pages].set(0, mode="drop"), cache)


@dataclasses.dataclass
class Steps:
    """The compiled verbs and the device layout they were built for."""

    model: ModelConfig  # padded for the mesh
    draft_model: ModelConfig | None  # the draft model's, padded (`jinfer.draft`), or None
    layout: Layout
    vocab_size: int  # the real vocabulary (logits beyond it are padding)
    mesh: Mesh
    prefill: callable  # jitted prefill (one compiled executable per prefill bucket)
    decode: dict[tuple[int, int], callable]  # (slot bucket, attention bucket) -> jitted decode
    mixed: dict[tuple[int, int], callable]  # the same, for one decode step carrying a prompt chunk
    # With a draft model, "prefill", "decode" and "mixed" again with its passes skipped; else empty.
    without_draft: dict[str, object]
    verify: dict[tuple[int, int, int], callable]  # (rows, attn_len, k): `speculative.verify_programs`
    sample: callable  # (state, allowed, deferred [rows], want_logprobs) -> state, out: deferred rows
    history: callable  # (state, [slot, prompt length, length, tokens...]) -> state
    clear_pages: callable  # (cache, pages [max_pages]) -> cache
    cache_sharding: NamedSharding
    state_shardings: SlotState
    tables_sharding: NamedSharding
    allowed_sharding: NamedSharding
    unconstrained: jax.Array  # [slots, W] int32, every bit set: the bitmask when no slot is constrained

    attention_kernel = property(lambda self: self.layout.attention_kernel)
    attention_buckets = property(lambda self: self.layout.attention_buckets)
    attention_bucket = property(lambda self: self.layout.attention_bucket)

    def program(self, verb: str, feed_draft: bool = True):
        """The jitted `verb` ("prefill", "decode", "mixed"), skipping a draft model's passes
        unless `feed_draft` (`Speculation.feeds_draft`)."""
        return getattr(self, verb) if feed_draft or self.draft_model is None else self.without_draft[verb]

    def compile_count(self) -> int:
        """Compiled executables so far, over every verb (a warm engine must keep this constant)."""
        verbs = (self.prefill, self.decode, self.mixed, self.verify, *self.without_draft.values())
        verbs += (self.sample, self.history, self.clear_pages)
        # A dict of bucket variants shares one jitted function between keys: count each once.
        jitted = dict.fromkeys(
            f for verb in verbs for f in (verb.values() if isinstance(verb, dict) else [verb])
        )
        return sum(f._cache_size() for f in jitted)

    def new_cache(self, dtype):
        """The KV cache (`WithDraft` both models' with a draft model)."""
        layout = self.layout
        new = lambda cfg: init_cache(cfg, layout.num_pages, layout.page_size, dtype, self.cache_sharding)
        return (
            new(self.model) if self.draft_model is None else WithDraft(new(self.model), new(self.draft_model))
        )

    def new_state(self) -> SlotState:
        return new_state(
            self.layout.max_slots, self.vocab_size, self.layout.max_seq_len, self.state_shardings
        )

    def put_tables(self, tables) -> jax.Array:
        """The host's block tables [slots, max_pages] on the device."""
        return jax.device_put(tables, self.tables_sharding)

    def put_allowed(self, allowed: np.ndarray) -> jax.Array:
        """The host's allowed-token bitmask [slots, W] on the device (the host must not change
        `allowed` afterwards: on a CPU the device array may share its buffer)."""
        return jax.device_put(allowed, self.allowed_sharding)


def build_steps(
    model: ModelConfig,
    layout: Layout,
    mesh: Mesh,
    param_shardings,
    vocab_size: int,
    draft: ModelConfig | None = None,
) -> Steps:
    """Jit prefill and decode once, with explicit shardings and the cache and state donated. With a
    `draft` model (`jinfer.draft`), param_shardings are both models' (`WithDraft`)."""
    replicated = NamedSharding(mesh, PartitionSpec())
    by_slot = NamedSharding(mesh, PartitionSpec(DATA))
    # [K, P, page_size, H]: heads over the model axis, pages over the data axis.
    cache_sharding = NamedSharding(mesh, PartitionSpec(MODEL, DATA, None, None))
    pools = lambda cfg: KVCache(k=(cache_sharding,) * cfg.num_layers, v=(cache_sharding,) * cfg.num_layers)
    cache_shardings = pools(model) if draft is None else WithDraft(pools(model), pools(draft))
    state_shardings = slot_state_shardings(mesh)
    # The models every verb runs: the draft model only where it is fed.
    model_options = lambda feed: {"cfg": model, "vocab": vocab_size, "draft_cfg": draft if feed else None}
    kernel = layout.attention_kernel
    carried = (cache_shardings, state_shardings)

    def jit_decode(attn_len, kind, k=0, feed_draft=True):
        """kind: "decode" | "mixed" (a prompt chunk rides along) | "verify" (up to k draft tokens a
        row, `jinfer.speculative`); feed_draft=False: a draft model's passes skipped."""
        options = {"attn_len": attn_len, "attention_kernel": kernel, **model_options(feed_draft)}
        steps = dispatch_steps(layout.decode_steps, mixed=kind == "mixed")
        if kind == "verify":
            lengths = program_lengths(layout.speculative, layout.verify_variants, k)
            fn = partial(verify, steps=steps, lengths=lengths, source=layout.speculative, **options)
        else:
            fn = partial(_decode, steps=steps, **options) if kind == "decode" else partial(_mixed, **options)
        # Host values enter replicated: several processes may pass numpy arrays to jit only so.
        # decode: row_steps, deferred, want_logprobs; mixed: + allowed (the chunk's first token;
        # decode rows are deferred) before them and the chunk after; verify: + the draft plan.
        host = {"decode": 3, "mixed": 3, "verify": 4}[kind]
        allowed, chunk = ((by_slot,), (replicated,)) if kind == "mixed" else ((), ())
        # The chunk's output, or the drafts checked and their kinds.
        extra_out = {"decode": (), "mixed": (replicated,), "verify": (replicated,) * 2}[kind]
        return jax.jit(
            fn,
            in_shardings=(param_shardings, *carried, replicated, *allowed, *(replicated,) * host, *chunk),
            out_shardings=(*carried, replicated, *extra_out),
            donate_argnums=(1, 2),
        )

    def by_bucket_pair(kind, feed_draft=True):
        # One jitted function per attention bucket serves every slot bucket (the active mask's
        # length); the dict names each compiled pair so the engine and warm-up agree on them.
        by_len = {n: jit_decode(n, kind, feed_draft=feed_draft) for n in layout.attention_buckets}
        return {(rows, n): by_len[n] for n in layout.attention_buckets for rows in layout.slot_buckets}

    def token_verbs(feed_draft=True):
        """prefill, decode and mixed, with a draft model's passes or without them."""
        prefill = jax.jit(
            partial(_prefill, **model_options(feed_draft)),
            in_shardings=(param_shardings, *carried, replicated, by_slot, replicated),
            out_shardings=(*carried, replicated),
            donate_argnums=(1, 2),
        )
        mixed = by_bucket_pair("mixed", feed_draft) if layout.mixed_prefill_tokens else {}
        return {"prefill": prefill, "decode": by_bucket_pair("decode", feed_draft), "mixed": mixed}

    def verify_variants():
        # One jitted function per (attention bucket, draft length) serves every slot bucket.
        programs = verify_programs(layout.speculative, layout.verify_variants)
        longest = sorted({k for _, k in programs})
        by_len = {(n, k): jit_decode(n, "verify", k) for n in layout.attention_buckets for k in longest}
        return {(rows, n, k): by_len[n, k] for n in layout.attention_buckets for rows, k in programs}

    return Steps(
        model=model,
        draft_model=draft,
        layout=layout,
        vocab_size=vocab_size,
        mesh=mesh,
        **token_verbs(),
        without_draft=token_verbs(feed_draft=False) if draft else {},
        verify=verify_variants(),
        sample=jax.jit(
            _sample,
            in_shardings=(state_shardings, by_slot, replicated, replicated),
            out_shardings=(state_shardings, replicated),
            donate_argnums=0,
        ),
        history=jax.jit(
            partial(set_history, vocab=vocab_size),
            in_shardings=(state_shardings, replicated),
            out_shardings=state_shardings,
            donate_argnums=0,
        ),
        clear_pages=jax.jit(
            _clear_pages,
            in_shardings=(cache_shardings, replicated),
            out_shardings=cache_shardings,
            donate_argnums=0,
        ),
        cache_sharding=cache_sharding,
        state_shardings=state_shardings,
        tables_sharding=replicated,
        allowed_sharding=by_slot,
        unconstrained=jax.device_put(
            np.full((layout.max_slots, mask_words(vocab_size)), ALL_ALLOWED, np.int32), by_slot
        ),
    )
