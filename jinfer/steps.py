"""The jitted device programs, built once per (model config, layout, mesh).

Every program that touches the paged KV cache has one signature, the cache and slot state donated,
the host's block tables [slots, max_pages] read (not donated: the host re-uploads them when they
change), its per-row inputs typed (`jinfer.inputs.RowInputs`), a prompt chunk where it carries one:

    program(weights, cache, state, tables, inputs, chunk) -> cache, state, DispatchOutput

`Steps.programs` maps each compiled variant's key (`jinfer.inputs.Program`) to its jitted function:

  prefill[pieces]
      Prompt pieces (`config.PROMPT_PIECE` tokens each, a bucket of them) of as many requests as
      the scheduler fit into the iteration's token budget, one forward over them all: each piece
      is a row in its request's slot, its K/V written straight into the sequence's pages at
      positions start.. (so a long prompt is several pieces, in one dispatch or over several, each
      attending to the ones before it, and a prompt whose first pages came from the prefix cache
      starts past them). The last real position of a prompt's last piece gives the request's
      first token, sampled on device; its slot's state row is (re)initialised from the request
      (sampling knobs, logit bias, stop ids, how many tokens it generated before a preemption).
      Decode tokens run in a dispatch of their own beside it, or, where the layout allows
      (`Layout.mixed_rows`), in the same forward:
  mixed[rows, pieces]
      One decode step for slots 0..rows-1 and prompt pieces (as prefill's) in one forward over
      both groups' columns, so every weight is read once for both. Its inputs have a row per decode
      row, then one per piece. Only where every product and the attention are jinfer's CPU kernels,
      which give a column the same bits whatever shares the call: a decode row's token is the one
      its own dispatch would give. A request whose prompt ends in the dispatch decodes from the
      next one on (its first token is not known inside the forward).
  decode[rows, attn_len]
      up to `steps` decode steps for slots 0..rows-1 at once (`state.scan_rows`): each step feeds
      every such slot's last token, samples the next one per slot and keeps it on device for the
      following step. Slot i takes part in the first inputs.steps[i] steps (0: inactive); the
      program runs as many steps as its busiest slot takes; a slot not taking part in a step that
      runs computes too (shapes are fixed) but neither writes nor advances. A deferred slot (a
      constrained request: one step) is fed and written but not sampled: its logits wait in the
      state for `sample`.
  verify[rows, attn_len, drafts]
      Decode steps that each verify up to `drafts` draft tokens a row (`jinfer.speculative`;
      n-gram drafts: each step picks its length, plain included, `speculative.verify_programs`).
  sample[rows]: (state, inputs) -> state, DispatchOutput
      A constrained request's allowed tokens (`jinfer.structured`) follow from its token before,
      which the host reads one dispatch late; so its decode row is deferred, and this program
      samples the deferred rows under their bitmasks once the host has them (dispatched while the
      decode before still runs, ahead of the next one), advancing them as a decode step would.

The weights and the caches are `jinfer.weights`' trees: with a draft model (`jinfer.draft`) every
pass over tokens writes the draft's K/V too, and prefill and decode also come without the
draft's passes (`Program.feeds_draft` False), for batches no verify step could pay for.

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
Prefill samples each request's first token under the inputs' `allowed`
bitmask [slots, ceil(V / 32)] (all bits set for a slot without a constraint), applied only when
some row is constrained (`lax.cond`). Only int32 tokens, per-slot flags and (when asked) log-probs
leave the device; the engine reads them one iteration late so the host overlaps the device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jinfer.config import PROMPT_PIECE, ModelConfig
from jinfer.draft import run_model
from jinfer.inputs import DispatchOutput, Program, RowInputs, RowProcessor, input_shardings
from jinfer.kv_cache import KVCache, init_cache
from jinfer.layout import Layout
from jinfer.models.attention import TokenGroup
from jinfer.models.family import family_of
from jinfer.sampling import TokenHistory, choose
from jinfer.sharding import DATA, MODEL
from jinfer.speculative import program_lengths, verify, verify_programs
from jinfer.state import (
    ADVANCED,
    PackedChunk,
    PrefillChunk,
    RowStep,
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
from jinfer.weights import Caches


def _chunk_group(chunk: PrefillChunk) -> TokenGroup:
    """The pieces as one token group: a row per piece, in its request's slot (several rows may
    share a slot: consecutive pieces of one prompt, every row's K/V written before any attends);
    a padding piece is an inactive row."""
    offsets = jnp.arange(chunk.tokens.shape[1], dtype=jnp.int32)[None, :]
    return TokenGroup(
        chunk.tokens,
        chunk.start[:, None] + offsets,
        chunk.slot,
        active=chunk.length > 0,
        valid=offsets < chunk.length[:, None],
    )


def _last_real(hidden: jax.Array, chunk: PrefillChunk) -> jax.Array:
    """The hidden state [P, D] of each piece's last real token (a last piece's gives the next token)."""
    last = jnp.maximum(chunk.length - 1, 0)
    return hidden[jnp.arange(hidden.shape[0]), last]


def _start_slots(
    state: SlotState, chunk: PrefillChunk, logits, allowed, vocab: int, want_logprobs, processors
):
    """Sample a token from each piece's last logits [P, V] and (re)initialise the slot's state row
    of every piece that ends its request's prompt; other pieces' tokens are discarded.

    A last piece's token is its request's next output token (the first, unless a preemption made
    it prefill its earlier output again). The penalties read the row's prompt mask and output counts
    as `history` left them (a fresh request's counts start at zero). Every piece writes its tokens
    into its slot's token history (where speculative drafts look them up).
    """
    pieces, slots = chunk.slot.shape[0], chunk.slot
    every = jnp.arange(pieces)[:, None]
    bias_rows = (
        jnp.zeros((pieces, vocab), jnp.float32).at[every, chunk.bias_ids].set(chunk.bias_values, mode="drop")
    )
    stop_rows = jnp.zeros((pieces, vocab), bool).at[every, chunk.stop_ids].set(True, mode="drop")
    counts_rows = jnp.where(chunk.generated[:, None] > 0, state.counts[slots], 0)
    position = chunk.start + chunk.length  # where each sampled token goes
    seq, empty = state.history.shape[1], state.tokens.shape[0]
    offsets = jnp.arange(chunk.tokens.shape[1])[None, :]
    at = jnp.where(offsets < chunk.length[:, None], chunk.start[:, None] + offsets, seq)  # padding: dropped
    history = state.history.at[slots[:, None], at].set(chunk.tokens, mode="drop")
    token, out = choose(
        logits,
        state.prompt_mask[slots],
        counts_rows,
        bias_rows,
        stop_rows,
        chunk.generated < chunk.min_tokens,
        allowed[slots],
        chunk.sampling,
        position,
        want_logprobs,
        processors,
        chunk.generated,
        lambda: TokenHistory.of(history[slots], position, chunk.generated, stop_rows),
    )
    history = history.at[slots, jnp.where(chunk.last, position, seq)].set(token, mode="drop")
    starting = jnp.where(chunk.last, slots, empty)  # only a prompt's last piece starts its slot
    set_rows = lambda array, values: array.at[starting].set(values, mode="drop")
    state = state.replace(
        history=history,
        tokens=set_rows(state.tokens, token),
        positions=set_rows(state.positions, position),
        generated=set_rows(state.generated, chunk.generated + 1),
        min_tokens=set_rows(state.min_tokens, chunk.min_tokens),
        counts=set_rows(state.counts, counts_rows.at[jnp.arange(pieces), token].add(1)),
        bias=set_rows(state.bias, bias_rows),
        stop_mask=set_rows(state.stop_mask, stop_rows),
        sampling=jax.tree.map(set_rows, state.sampling, chunk.sampling),
    )
    return state, jax.tree.map(lambda x: x[None], out)  # [1 step, P pieces]


def _prefill(
    params,
    cache,
    state: SlotState,
    tables,
    inputs: RowInputs,
    packed: PackedChunk,
    *,
    cfg,
    vocab,
    draft_cfg,
    processors,
    attention_kernel=None,
):
    """Prompt pieces into their slots (a row of `inputs` per piece); the token after each piece
    sampled under its slot's allowed set. The last tokens' logits are one product of P columns,
    skipped when no piece ends a prompt."""
    chunk = packed.unpack()
    group = _chunk_group(chunk)
    attention = {"attention_kernel": attention_kernel}
    (hidden,), cache = run_model(
        params, (group,), cfg, cache, tables, adapters=(inputs.adapter,), draft_cfg=draft_cfg, **attention
    )
    pieces = chunk.slot.shape[0]
    logits = jax.lax.cond(
        jnp.any(chunk.last),
        lambda: family_of(cfg).logits(params.target, _last_real(hidden, chunk))[:, :vocab],
        lambda: jnp.zeros((pieces, vocab), jnp.float32),
    )  # [P, V]
    pairs = inputs.processing(processors)
    state, out = _start_slots(state, chunk, logits, inputs.allowed, vocab, inputs.want_logprobs, pairs)
    return cache, state, DispatchOutput(rows=None, chunk=out)


def _decode_step(params, cache, state, tables, step: RowStep, *, cfg, vocab, draft_cfg, **attention):
    """One decode step for the state's rows (slots 0..rows-1, `step`). Returns the cache, the rows'
    state and their output [rows]. `attention`: attn_len and attention_kernel."""
    group = TokenGroup.of_rows(state.tokens[:, None], state.positions, step.active)
    (hidden,), cache = run_model(
        params, (group,), cfg, cache, tables, adapters=(step.adapters,), draft_cfg=draft_cfg, **attention
    )
    logits = family_of(cfg).logits(params.target, hidden[:, 0])[:, :vocab]
    state, out = _sample_step(state, logits, step)
    return cache, state, out


def _sample_step(state: SlotState, logits, step: RowStep):
    """A decode step's sampling over its rows' logits [rows, V]: deferred rows keep their logits
    in the state (written only when some row is deferred) instead of sampling."""
    kept = jax.lax.cond(
        jnp.any(step.deferred),
        lambda: jnp.where(step.deferred[:, None], logits, state.logits),
        lambda: state.logits,
    )
    return sample_rows(
        state.replace(logits=kept), logits, None, step.sampled, step.want_logprobs, step.processing
    )


def _mixed(
    params,
    cache,
    state,
    tables,
    inputs: RowInputs,
    packed: PackedChunk,
    *,
    cfg,
    vocab,
    draft_cfg,
    processors,
    attention_kernel,
):
    """One decode step for slots 0..rows-1 (the first `rows` rows of `inputs`) and the prompt
    pieces (the rest) in one forward; each piece's token as `_prefill` samples it. The rows' output
    [1, rows] and the pieces' [1, P]."""
    chunk = packed.unpack()
    rows = inputs.steps.shape[0] - chunk.slot.shape[0]
    part = rows_of(state, rows)
    processing = inputs.processing(processors, slice(0, rows))
    adapters = (inputs.adapter[:rows], inputs.adapter[rows:])
    step = RowStep(
        inputs.steps[:rows] > 0, inputs.deferred[:rows], inputs.want_logprobs, processing, adapters[0]
    )
    decoding = TokenGroup.of_rows(part.tokens[:, None], part.positions, step.active)
    groups = (decoding, _chunk_group(chunk))
    attention = {"attention_kernel": attention_kernel}
    (row_hidden, piece_hidden), cache = run_model(
        params, groups, cfg, cache, tables, adapters=adapters, draft_cfg=draft_cfg, **attention
    )
    last = jnp.concatenate([row_hidden[:, 0], _last_real(piece_hidden, chunk)])
    logits = family_of(cfg).logits(params.target, last)[:, :vocab]  # one product: [rows + P, V]
    part, out = _sample_step(part, logits[:rows], step)
    pairs = inputs.processing(processors, slice(rows, None))
    state, pieces_out = _start_slots(
        put_rows(state, part), chunk, logits[rows:], inputs.allowed, vocab, inputs.want_logprobs, pairs
    )
    return cache, state, DispatchOutput(rows=jax.tree.map(lambda x: x[None], out), chunk=pieces_out)


def _decode(
    params, cache, state, tables, inputs: RowInputs, chunk: None, *, steps, processors, **step_options
):
    """`steps` decode steps for slots 0..rows-1 (`state.scan_rows`), slot i in the first
    inputs.steps[i] of them (a deferred slot in the first only, unsampled): the cache, the state
    and the rows' output [steps, rows]."""
    processing = inputs.processing(processors)

    def step(cache, part, active, deferred):
        rows = RowStep(active, deferred, inputs.want_logprobs, processing, inputs.adapter)
        return _decode_step(params, cache, part, tables, rows, **step_options)

    cache, state, outs = scan_rows(step, cache, state, inputs.steps, inputs.deferred, steps)
    return cache, state, DispatchOutput(rows=outs)


def _sample(state: SlotState, inputs: RowInputs, *, processors):
    """Sample the deferred slots among 0..rows-1 under their allowed-token bitmasks: the state and
    the rows' output [1, rows]."""
    rows = inputs.rows
    part = rows_of(state, rows)
    allowed = inputs.allowed[:rows]
    processing = inputs.processing(processors)
    part, out = sample_rows(part, part.logits, allowed, inputs.deferred, inputs.want_logprobs, processing)
    state = put_rows(state, part, ADVANCED)  # sampling reads the kept logits, and changes them not
    return state, DispatchOutput(rows=jax.tree.map(lambda x: x[None], out))


def _clear_pages(cache, pages: jax.Array):
    """Zero pages [n] of every pool, a draft model's too (entries past the pool are padding)."""
    return jax.tree.map(lambda pool: pool.at[:, pages].set(0, mode="drop"), cache)


@dataclasses.dataclass
class Steps:
    """The compiled programs and the device layout they were built for."""

    model: ModelConfig  # padded for the mesh
    draft_model: ModelConfig | None  # the draft model's, padded (`jinfer.draft`), or None
    layout: Layout
    vocab_size: int  # the real vocabulary (logits beyond it are padding)
    mesh: Mesh
    processors: tuple[RowProcessor, ...]  # the logits processors every sampling step applies
    # Every compiled variant: prefill, decode and verify are (weights, cache, state, tables,
    # inputs, chunk) -> cache, state, DispatchOutput; sample is (state, inputs) -> state, output.
    programs: dict[Program, Callable]
    history: Callable  # (state, [slot, prompt length, length, tokens...]) -> state
    clear_pages: Callable  # (cache, pages [max_pages]) -> cache
    cache_sharding: NamedSharding
    state_shardings: SlotState
    tables_sharding: NamedSharding
    allowed_sharding: NamedSharding
    unconstrained: jax.Array  # [slots, W] int32, every bit set: the bitmask when no slot is constrained

    attention_kernel = property(lambda self: self.layout.attention_kernel)
    attention_buckets = property(lambda self: self.layout.attention_buckets)
    attention_bucket = property(lambda self: self.layout.attention_bucket)

    def of_kind(self, kind: str) -> list[Program]:
        return [program for program in self.programs if program.kind == kind]

    def compile_count(self) -> int:
        """Compiled executables so far, over every program (a warm engine must keep this constant)."""
        # Several keys share one jitted function (it compiles per shape): count each once.
        jitted = dict.fromkeys([*self.programs.values(), self.history, self.clear_pages])
        return sum(f._cache_size() for f in jitted)

    def new_cache(self, dtype):
        """The KV caches: the target model's, and a draft model's where there is one."""
        layout = self.layout
        new = lambda cfg: init_cache(cfg, layout.num_pages, layout.page_size, dtype, self.cache_sharding)
        return Caches(new(self.model), self.draft_model and new(self.draft_model))

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


def program_keys(layout: Layout, draft: bool) -> list[Program]:
    """Every program the engine may dispatch for `layout` (with a `draft` model, prefill, decode
    also without its passes)."""
    keys = []
    for feeds_draft in (True, False) if draft else (True,):
        keys += [prefill_program(pieces, feeds_draft) for pieces in layout.piece_buckets]
        keys += [mixed_program(rows, pieces) for rows in layout.mixed_rows for pieces in layout.piece_buckets]
        for attn_len in layout.attention_buckets:
            for rows in layout.slot_buckets:
                keys.append(Program("decode", rows, attn_len, feeds_draft=feeds_draft))
    for attn_len in layout.attention_buckets:
        for rows, k in verify_programs(layout.speculative, layout.verify_variants):
            keys.append(Program("verify", rows, attn_len, drafts=k))
    return keys + [Program("sample", rows) for rows in layout.slot_buckets]


def prefill_program(pieces: int, feeds_draft: bool = True) -> Program:
    """The key of the prefill program carrying `pieces` prompt pieces (a bucket)."""
    return Program("prefill", pieces, chunk=pieces * PROMPT_PIECE, feeds_draft=feeds_draft)


def mixed_program(rows: int, pieces: int) -> Program:
    """The key of the program carrying `rows` decode rows and `pieces` prompt pieces (buckets)."""
    return Program("mixed", rows, chunk=pieces * PROMPT_PIECE)


def _program_function(key: Program, layout: Layout, model_options: dict) -> Callable:
    """The function a program jits (before jit: several keys share one jitted function)."""
    if key.kind == "sample":
        return partial(_sample, processors=model_options["processors"])
    if key.kind in ("prefill", "mixed"):
        function = _prefill if key.kind == "prefill" else _mixed
        return partial(function, attention_kernel=layout.attention_kernel, **model_options)
    options = {"attn_len": key.attn_len, "attention_kernel": layout.attention_kernel, **model_options}
    steps = layout.decode_steps
    if key.kind == "verify":
        lengths = program_lengths(layout.speculative, layout.verify_variants, key.drafts)
        return partial(verify, steps=steps, lengths=lengths, source=layout.speculative, **options)
    return partial(_decode, steps=steps, **options)


class _Placement(NamedTuple):
    """The shardings of what the programs carry and take."""

    mesh: Mesh
    params: object
    pool: NamedSharding  # each layer's K or V pool
    cache: object
    state: SlotState
    replicated: NamedSharding
    by_slot: NamedSharding


def _placement(mesh: Mesh, param_shardings, model: ModelConfig, draft: ModelConfig | None) -> _Placement:
    # [K, P, page_size, H]: heads over the model axis, pages over the data axis.
    pool = NamedSharding(mesh, PartitionSpec(MODEL, DATA, None, None))
    pools = lambda cfg: KVCache(k=(pool,) * cfg.num_layers, v=(pool,) * cfg.num_layers)
    cache = Caches(pools(model), draft and pools(draft))
    replicated, by_slot = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec(DATA))
    return _Placement(mesh, param_shardings, pool, cache, slot_state_shardings(mesh), replicated, by_slot)


def _jit_program(function: Callable, key: Program, place: _Placement, processors) -> Callable:
    """`function` jitted with explicit shardings and the cache and state donated."""
    inputs = input_shardings(place.mesh, plan=key.kind == "verify", processors=processors)
    if key.kind == "sample":
        return jax.jit(
            function,
            in_shardings=(place.state, inputs),
            out_shardings=(place.state, place.replicated),
            donate_argnums=0,
        )
    carried = (place.cache, place.state)
    return jax.jit(
        function,
        in_shardings=(place.params, *carried, place.replicated, inputs, place.replicated),
        out_shardings=(*carried, place.replicated),
        donate_argnums=(1, 2),
    )


def build_steps(
    model: ModelConfig,
    layout: Layout,
    mesh: Mesh,
    param_shardings,
    vocab_size: int,
    draft: ModelConfig | None = None,
    processors: Sequence[RowProcessor] = (),
) -> Steps:
    """Jit every program once, with explicit shardings and the cache and state donated. With a
    `draft` model (`jinfer.draft`), param_shardings are a `Weights` of both models'; `processors`:
    the logits processors every sampling step applies (`jinfer.inputs.RowProcessor`)."""
    place = _placement(mesh, param_shardings, model, draft)
    jitted = {}  # one jitted function per (kind, attention bucket, drafts, feeding): it compiles per shape

    def jit_program(key: Program) -> Callable:
        shared = key._replace(rows=0, chunk=0)
        if shared not in jitted:
            options = {"cfg": model, "vocab": vocab_size, "draft_cfg": draft if key.feeds_draft else None}
            options["processors"] = processors
            jitted[shared] = _jit_program(_program_function(key, layout, options), key, place, processors)
        return jitted[shared]

    small = lambda f, carried: jax.jit(
        f, in_shardings=(carried, place.replicated), out_shardings=carried, donate_argnums=0
    )
    return Steps(
        model=model,
        draft_model=draft,
        layout=layout,
        vocab_size=vocab_size,
        mesh=mesh,
        processors=tuple(processors),
        programs={key: jit_program(key) for key in program_keys(layout, draft is not None)},
        history=small(partial(set_history, vocab=vocab_size), place.state),
        clear_pages=small(_clear_pages, place.cache),
        cache_sharding=place.pool,
        state_shardings=place.state,
        tables_sharding=place.replicated,
        allowed_sharding=place.by_slot,
        unconstrained=jax.device_put(
            np.full((layout.max_slots, mask_words(vocab_size)), ALL_ALLOWED, np.int32), place.by_slot
        ),
    )
