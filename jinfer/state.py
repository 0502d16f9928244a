"""The device state the steps carry between calls, declared once like the parameters.

`STATE` declares every per-slot array of `SlotState` (the axes it spans, its dtype, the value of an
empty slot); the zeros of a fresh engine (`new_state`) and the shardings (`state_shardings`: slots
over the data axis) are derived from it. A prompt chunk crosses to the device as one int32 and one
float32 array (`PackedChunk`), a row per piece: their fields, in order, are declared in
`_INT_FIELDS` / `_FLOAT_FIELDS`, and both the host's packing (`pack_piece`) and the device's
unpacking (`PackedChunk.unpack`) take their offsets from that declaration.

The transitions every decoding verb shares live here too: a decode over slots 0..rows-1 works on
their rows (`rows_of`, `put_rows`; `scan_rows` runs several steps of it), and `sample_rows`
samples them and advances the sampled ones (token, position, counts, token history);
`set_history` sets a slot's prompt mask, output counts and token history from the tokens the
request really has, and its predicted output.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jinfer.config import MAX_LOGIT_BIAS, MAX_STOP_IDS
from jinfer.sampling import SamplingArrays, SamplingParams, TokenHistory, choose, nothing_chosen
from jinfer.sharding import DATA


@struct.dataclass
class SlotState:
    """Per-slot decoding state, resident on device between steps. S slots, V vocabulary."""

    tokens: jax.Array  # [S] int32: last sampled token (the next decode input)
    positions: jax.Array  # [S] int32: the position that token occupies
    generated: jax.Array  # [S] int32: tokens sampled so far
    min_tokens: jax.Array  # [S] int32: stop tokens are banned while generated < min_tokens
    counts: jax.Array  # [S, V] int32: output-token counts (presence / frequency penalties)
    prompt_mask: jax.Array  # [S, V] bool: tokens of the prompt (repetition penalty; set by `history`)
    bias: jax.Array  # [S, V] float32: logit bias
    stop_mask: jax.Array  # [S, V] bool: eos + stop_token_ids
    logits: jax.Array  # [S, V] float32: a deferred decode row's logits, until `sample` takes them
    history: jax.Array  # [S, L] int32: the token at each position (speculative drafts look there)
    # [S, L] int32: the text the request expects its output to be (`prediction`, drafts look there
    # too), -1 past its end; set by `history`.
    prediction: jax.Array
    sampling: SamplingArrays  # [S] knobs


class StateSpec(NamedTuple):
    """Declaration of one state array: the axes it spans ("slots", "vocab"), dtype, empty value."""

    axes: tuple[str, ...]
    dtype: Any
    empty: Any


# An empty slot samples greedily (so an idle row never makes a step draw random numbers).
_EMPTY_KNOBS = SamplingArrays.from_params([SamplingParams(temperature=0.0).resolve()], [0])

STATE = SlotState(
    tokens=StateSpec(("slots",), jnp.int32, 0),
    positions=StateSpec(("slots",), jnp.int32, 0),
    generated=StateSpec(("slots",), jnp.int32, 0),
    min_tokens=StateSpec(("slots",), jnp.int32, 0),
    counts=StateSpec(("slots", "vocab"), jnp.int32, 0),
    prompt_mask=StateSpec(("slots", "vocab"), jnp.bool_, False),
    bias=StateSpec(("slots", "vocab"), jnp.float32, 0.0),
    stop_mask=StateSpec(("slots", "vocab"), jnp.bool_, False),
    logits=StateSpec(("slots", "vocab"), jnp.float32, 0.0),
    history=StateSpec(("slots", "seq"), jnp.int32, 0),
    prediction=StateSpec(("slots", "seq"), jnp.int32, -1),
    sampling=jax.tree.map(lambda a: StateSpec(("slots",), a.dtype, a[0]), _EMPTY_KNOBS),
)


def _is_spec(x) -> bool:
    return isinstance(x, StateSpec)


def state_shardings(mesh: Mesh) -> SlotState:
    """Slots over the data axis; the vocabulary and positions whole on every device."""
    axis = {"slots": DATA, "vocab": None, "seq": None}
    return jax.tree.map(
        lambda s: NamedSharding(mesh, PartitionSpec(*(axis[a] for a in s.axes))), STATE, is_leaf=_is_spec
    )


def new_state(slots: int, vocab: int, seq: int, shardings: SlotState) -> SlotState:
    """Every slot empty (positions up to `seq`), created directly with its sharding."""
    size = {"slots": slots, "vocab": vocab, "seq": seq}

    def make():
        fill = lambda s: jnp.full(tuple(size[a] for a in s.axes), s.empty, s.dtype)
        return jax.tree.map(fill, STATE, is_leaf=_is_spec)

    return jax.jit(make, out_shardings=shardings)()


def rows_of(state: SlotState, rows: int) -> SlotState:
    """Slots 0..rows-1 take part in a decode; the state of the others is left alone."""
    return jax.tree.map(lambda a: a[:rows], state)


# The fields a step that emits tokens changes in its rows (`advance_rows`); a decode step also
# keeps a deferred row's logits. The others are a request's settings, written when it starts.
ADVANCED = ("tokens", "positions", "generated", "counts", "history")
STEPPED = (*ADVANCED, "logits")


def put_rows(full: SlotState, part: SlotState, fields: tuple[str, ...] = STEPPED) -> SlotState:
    """`full` with its rows 0..rows-1 from `part`, for `fields` only. Writing back a field a step
    left unchanged is not free on a CPU: XLA copied the settings' bias and masks whole, twice a
    decode step (~15 MB at 32 slots: a millisecond of every step)."""
    put = lambda name: jax.lax.dynamic_update_slice_in_dim(getattr(full, name), getattr(part, name), 0, 0)
    return full.replace(**{name: put(name) for name in fields})


class RowStep(NamedTuple):
    """What one step of a decode or verify program knows of its rows: which take part (active
    [rows] bool), which are fed but not sampled (deferred [rows] bool, a grammar's), whether
    log-probs are wanted, the registered processors' (function, values) pairs
    (`RowInputs.processing`), and each row's adapter."""

    active: jax.Array
    deferred: jax.Array
    want_logprobs: jax.Array
    processing: tuple = ()
    adapters: jax.Array | None = None  # [rows] int32: each row's slot in the adapter stack (-1: none)

    @property
    def sampled(self) -> jax.Array:
        return self.active & ~self.deferred


def scan_rows(step, cache, state: SlotState, row_steps, deferred, steps: int):
    """Up to `steps` steps for slots 0..rows-1 (rows = len(row_steps)): `step(cache, rows_state,
    active, deferred) -> cache, rows_state, output`, slot i active in the first row_steps[i]
    steps, a deferred slot deferred in the first only. Returns the cache, the whole state and the
    outputs stacked [steps, ...]. Only as many steps run as the busiest row asks (a loop whose
    count is an input): one compiled program serves a dispatch of one step as well as of
    `steps`, and the outputs of the steps not run are zeros, which no row reads. Only the fields
    a step changes (`STEPPED`) are carried from step to step: the settings are read where they
    lie."""
    part = rows_of(state, row_steps.shape[0])
    fields = {name: getattr(part, name) for name in STEPPED}

    def one_step(index, cache, fields):
        active, first = row_steps > index, deferred & (index == 0)
        cache, stepped, out = step(cache, part.replace(**fields), active, first)
        return cache, {name: getattr(stepped, name) for name in STEPPED}, out

    shapes = jax.eval_shape(one_step, jnp.int32(0), cache, fields)[2]
    outs = jax.tree.map(lambda s: jnp.zeros((steps, *s.shape), s.dtype), shapes)

    def body(index, carry):
        cache, fields, outs = carry
        cache, fields, out = one_step(index, cache, fields)
        put = lambda all_, one: jax.lax.dynamic_update_index_in_dim(all_, one, index, 0)
        return cache, fields, jax.tree.map(put, outs, out)

    run = jnp.minimum(jnp.max(row_steps), steps)
    cache, fields, outs = jax.lax.fori_loop(0, run, body, (cache, fields, outs))
    return cache, put_rows(state, part.replace(**fields)), outs


def sample_rows(state: SlotState, logits, allowed, sampled, want_logprobs, processors=()):
    """Sample the state's rows from their logits [rows, V] (allowed [rows, W] or None; the
    registered processors' (function, values) pairs) and advance the `sampled` [rows] ones: their
    token becomes the next decode input. With none sampled (a decode of deferred rows only) the
    passes over the vocabulary are skipped (`lax.cond`)."""
    rows = sampled.shape[0]

    knobs = (state.bias, state.stop_mask, state.generated < state.min_tokens, allowed, state.sampling)
    chosen = lambda: choose(
        logits,
        state.prompt_mask,
        state.counts,
        *knobs,
        state.positions + 1,
        want_logprobs,
        processors,
        state.generated,
        lambda: TokenHistory.of(state.history, state.positions + 1, state.generated, state.stop_mask),
    )
    nothing = lambda: (jnp.zeros((rows,), jnp.int32), nothing_chosen(rows))
    token, out = jax.lax.cond(jnp.any(sampled), chosen, nothing)
    return advance_rows(state, token[:, None], sampled[:, None]), out


def advance_rows(state: SlotState, tokens: jax.Array, taken: jax.Array) -> SlotState:
    """The state's rows past the tokens [rows, n] they take (taken [rows, n], a prefix of each
    row's): the last taken becomes the next decode input, and positions, output counts and token
    history follow. Every step that emits tokens (decode, verify) advances its rows here."""
    rows, n = tokens.shape
    count = jnp.sum(taken, axis=1, dtype=jnp.int32)
    seq = state.history.shape[1]
    at = jnp.where(taken, state.positions[:, None] + 1 + jnp.arange(n)[None, :], seq)  # untaken: dropped
    counts = state.counts
    for j in range(n):
        counts = counts.at[jnp.arange(rows), tokens[:, j]].add(taken[:, j].astype(jnp.int32))
    last = jnp.take_along_axis(
        jnp.concatenate([state.tokens[:, None], tokens], axis=1), count[:, None], axis=1
    )
    return state.replace(
        tokens=last[:, 0],
        positions=state.positions + count,
        generated=state.generated + count,
        counts=counts,
        history=state.history.at[jnp.arange(rows)[:, None], at].set(tokens, mode="drop"),
    )


# ------------------------------------------------------------------------------- prompt pieces
@struct.dataclass
class PrefillChunk:
    """A dispatch's prompt pieces and their requests' settings, as the steps see them
    (`PackedChunk.unpack`): P pieces of T tokens, each a run of one request's prompt (a request's
    chunk may span several consecutive pieces; a padding piece has length 0)."""

    tokens: jax.Array  # [P, T] int32
    slot: jax.Array  # [P] int32
    start: jax.Array  # [P] int32: position of each piece's first token
    length: jax.Array  # [P] int32: real tokens in each piece (0: a padding piece)
    last: jax.Array  # [P] bool: the piece ends its request's prompt (only its logits are used)
    generated: jax.Array  # [P] int32: output tokens the request had before this prefill (preemption)
    min_tokens: jax.Array  # [P] int32
    bias_ids: jax.Array  # [P, MAX_LOGIT_BIAS] int32, padded with V (dropped)
    bias_values: jax.Array  # [P, MAX_LOGIT_BIAS] float32
    stop_ids: jax.Array  # [P, MAX_STOP_IDS] int32, padded with V (dropped)
    sampling: SamplingArrays  # [P]


_KNOBS = tuple(f.name for f in dataclasses.fields(SamplingArrays))
# Knobs that travel in the int32 array: top_k, and the uint32 seed carried bit for bit.
_INT_KNOBS = tuple(n for n in _KNOBS if not np.issubdtype(getattr(_EMPTY_KNOBS, n).dtype, np.floating))
_FLOAT_KNOBS = tuple(n for n in _KNOBS if n not in _INT_KNOBS)
_SCALARS = ("slot", "start", "length", "last", "generated", "min_tokens")
_BOOLS = ("last",)
# (field, length) in a piece's row order; the int32 row ends with the piece's tokens.
_INT_FIELDS = (
    *((n, 1) for n in _SCALARS),
    ("bias_ids", MAX_LOGIT_BIAS),
    ("stop_ids", MAX_STOP_IDS),
    *((n, 1) for n in _INT_KNOBS),
)
_FLOAT_FIELDS = (("bias_values", MAX_LOGIT_BIAS), *((n, 1) for n in _FLOAT_KNOBS))


def _offsets(fields) -> dict[str, tuple[int, int]]:
    out, at = {}, 0
    for name, length in fields:
        out[name] = (at, at + length)
        at += length
    return out


_INT_AT, _FLOAT_AT = _offsets(_INT_FIELDS), _offsets(_FLOAT_FIELDS)
_TOKENS = sum(length for _, length in _INT_FIELDS)  # where a row's tokens begin
_INT_WIDTH, _FLOAT_WIDTH = _TOKENS, sum(length for _, length in _FLOAT_FIELDS)


@struct.dataclass
class PackedChunk:
    """A PrefillChunk as it crosses to the device: one int32 array [P, fields + T] and one float32
    array [P, fields], a row per piece. Each array handed to a jitted call is a host->device copy
    of its own (as seventeen arrays, a chunk cost a dispatch 4.6 ms of host time on a 2-core CPU;
    packed, 0.3 ms); the steps unpack it."""

    ints: jax.Array
    floats: jax.Array

    # Host-side reads, per piece (what the engine scheduled; tests look at them).
    slot = property(lambda self: self._column("slot"))
    start = property(lambda self: self._column("start"))
    length = property(lambda self: self._column("length"))
    last = property(lambda self: self._column("last").astype(bool))
    pieces = property(lambda self: self.ints.shape[0])
    piece_len = property(lambda self: self.ints.shape[1] - _TOKENS)  # tokens per piece, with padding

    def _column(self, name: str) -> np.ndarray:
        return np.asarray(self.ints)[:, _INT_AT[name][0]]

    def unpack(self) -> PrefillChunk:
        ints = {name: self.ints[:, a:b] for name, (a, b) in _INT_AT.items()}
        floats = {name: self.floats[:, a:b] for name, (a, b) in _FLOAT_AT.items()}
        scalars = {n: ints[n][:, 0] != 0 if n in _BOOLS else ints[n][:, 0] for n in _SCALARS}
        knobs = {n: ints[n][:, 0] for n in _INT_KNOBS} | {n: floats[n][:, 0] for n in _FLOAT_KNOBS}
        knobs["seed"] = jax.lax.bitcast_convert_type(knobs["seed"], jnp.uint32)
        return PrefillChunk(
            tokens=self.ints[:, _TOKENS:],
            bias_ids=ints["bias_ids"],
            bias_values=floats["bias_values"],
            stop_ids=ints["stop_ids"],
            sampling=SamplingArrays(**knobs),
            **scalars,
        )


def pack_piece(
    tokens: np.ndarray,
    *,
    slot: int,
    start: int,
    length: int,
    last: bool,
    generated: int,
    min_tokens: int,
    bias,
    stop_ids,
    sampling: SamplingArrays,
    vocab: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Host-side construction of one piece's rows (int32, float32): the sparse lists padded to fixed
    sizes, id V = dropped; `sampling` the request's knobs [1]."""
    items = list(bias.items())
    bias_ids = np.full(MAX_LOGIT_BIAS, vocab, np.int32)
    bias_ids[: len(items)] = [i for i, _ in items]
    bias_values = np.zeros(MAX_LOGIT_BIAS, np.float32)
    bias_values[: len(items)] = [v for _, v in items]
    stops = np.full(MAX_STOP_IDS, vocab, np.int32)
    stops[: len(stop_ids)] = list(stop_ids)
    knob = lambda name: np.asarray(getattr(sampling, name)).reshape(1)
    ints = {"slot": slot, "start": start, "length": length, "last": last, "generated": generated}
    ints |= {"min_tokens": min_tokens}
    ints |= {"bias_ids": bias_ids, "stop_ids": stops}
    ints |= {n: knob(n).view(np.int32) if n == "seed" else knob(n).astype(np.int32) for n in _INT_KNOBS}
    floats = {"bias_values": bias_values} | {n: knob(n).astype(np.float32) for n in _FLOAT_KNOBS}
    as_array = lambda value, dtype: np.asarray(value, dtype).reshape(-1)
    packed_ints = [as_array(ints[name], np.int32) for name, _ in _INT_FIELDS]
    packed_floats = [as_array(floats[name], np.float32) for name, _ in _FLOAT_FIELDS]
    return np.concatenate([*packed_ints, np.asarray(tokens, np.int32)]), np.concatenate(packed_floats)


def cut_pieces(
    tokens, *, start: int, last: bool, piece_len: int, **settings
) -> list[tuple[np.ndarray, np.ndarray]]:
    """A run of one prompt's tokens from position `start` cut into pieces of `piece_len` (the last
    padded), each packed by `pack_piece` with `settings`; only the final piece ends the prompt, if
    the run does (`last`)."""
    rows = []
    for at in range(0, len(tokens), piece_len):
        length = min(piece_len, len(tokens) - at)
        part = np.zeros(piece_len, np.int32)
        part[:length] = tokens[at : at + length]
        final = at + piece_len >= len(tokens)
        rows.append(pack_piece(part, start=start + at, length=length, last=last and final, **settings))
    return rows


def pack_pieces(
    rows: list[tuple[np.ndarray, np.ndarray]], pieces: int, piece_len: int, vocab: int
) -> PackedChunk:
    """`pack_piece` rows stacked into a chunk of `pieces` pieces of `piece_len` tokens, the rows
    past them padding pieces (length 0, greedy: they write nothing and their token is never read)."""
    padding = pack_piece(
        np.zeros(piece_len, np.int32),
        slot=0,
        start=0,
        length=0,
        last=False,
        generated=0,
        min_tokens=0,
        bias={},
        stop_ids=(),
        sampling=_EMPTY_KNOBS,
        vocab=vocab,
    )
    ints = np.tile(padding[0], (pieces, 1))
    floats = np.tile(padding[1], (pieces, 1))
    for i, (piece_ints, piece_floats) in enumerate(rows):
        ints[i], floats[i] = piece_ints, piece_floats
    return PackedChunk(ints=ints, floats=floats)


def set_history(state: SlotState, packed: jax.Array, *, vocab: int) -> SlotState:
    """Set one slot's prompt mask, output counts, token history and predicted output: packed =
    [slot, prompt length, length, tokens (padded to L)..., prediction (-1 past its end, L)...]
    int32; tokens before the prompt length are the prompt's, the rest up to length outputs."""
    seq = state.history.shape[1]
    slot, prompt_len, length = packed[0], packed[1], packed[2]
    tokens, prediction = packed[3 : 3 + seq], packed[3 + seq :]
    index = jnp.arange(tokens.shape[0])
    prompt_ids = jnp.where(index < prompt_len, tokens, vocab)
    output_ids = jnp.where((index >= prompt_len) & (index < length), tokens, vocab)
    mask = jnp.zeros((vocab,), bool).at[prompt_ids].set(True, mode="drop")
    counts = jnp.zeros((vocab,), jnp.int32).at[output_ids].add(1, mode="drop")
    return state.replace(
        prompt_mask=state.prompt_mask.at[slot].set(mask),
        counts=state.counts.at[slot].set(counts),
        history=state.history.at[slot].set(tokens),
        prediction=state.prediction.at[slot].set(prediction),
    )


def pack_history(
    slot: int, tokens: list[int], prompt_len: int, max_seq_len: int, prediction: tuple[int, ...] = ()
) -> np.ndarray:
    """The `history` verb's argument: [slot, prompt length, length, tokens padded to max_seq_len,
    the predicted output's tokens (at most max_seq_len) padded with -1]."""
    packed = np.zeros(3 + 2 * max_seq_len, np.int32)
    packed[:3] = slot, prompt_len, len(tokens)
    packed[3 : 3 + len(tokens)] = tokens
    predicted = packed[3 + max_seq_len :]
    predicted[:] = -1
    predicted[: len(prediction)] = prediction[:max_seq_len]
    return packed
