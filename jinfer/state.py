"""The device state the steps carry between calls, declared once like the parameters.

`STATE` declares every per-slot array of `SlotState` (the axes it spans, its dtype, the value of an
empty slot); the zeros of a fresh engine (`new_state`) and the shardings (`state_shardings`: slots
over the data axis) are derived from it. A prompt chunk crosses to the device as one int32 and one
float32 array (`PackedChunk`): their fields, in order, are declared in `_INT_FIELDS` /
`_FLOAT_FIELDS`, and both the host's packing (`pack_chunk`) and the device's unpacking
(`PackedChunk.unpack`) take their offsets from that declaration.
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
from jinfer.sampling import SamplingArrays, SamplingParams
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
    sampling=jax.tree.map(lambda a: StateSpec(("slots",), a.dtype, a[0]), _EMPTY_KNOBS),
)


def _is_spec(x) -> bool:
    return isinstance(x, StateSpec)


def state_shardings(mesh: Mesh) -> SlotState:
    """Slots over the data axis; the vocabulary whole on every device."""
    axis = {"slots": DATA, "vocab": None}
    return jax.tree.map(
        lambda s: NamedSharding(mesh, PartitionSpec(*(axis[a] for a in s.axes))), STATE, is_leaf=_is_spec
    )


def new_state(slots: int, vocab: int, shardings: SlotState) -> SlotState:
    """Every slot empty, created directly with its sharding."""
    size = {"slots": slots, "vocab": vocab}

    def make():
        fill = lambda s: jnp.full(tuple(size[a] for a in s.axes), s.empty, s.dtype)
        return jax.tree.map(fill, STATE, is_leaf=_is_spec)

    return jax.jit(make, out_shardings=shardings)()


# ------------------------------------------------------------------------------- prompt chunks
@struct.dataclass
class PrefillChunk:
    """One request's prompt chunk and its settings, as the steps see it (`PackedChunk.unpack`)."""

    tokens: jax.Array  # [1, T] int32, padded to a bucket
    slot: jax.Array  # [] int32
    start: jax.Array  # [] int32: position of tokens[0, 0]
    length: jax.Array  # [] int32: real tokens in this chunk
    last: jax.Array  # [] bool: the prompt's final chunk (only its logits are used)
    generated: jax.Array  # [] int32: output tokens the request had before this prefill (preemption)
    min_tokens: jax.Array  # [] int32
    bias_ids: jax.Array  # [MAX_LOGIT_BIAS] int32, padded with V (dropped)
    bias_values: jax.Array  # [MAX_LOGIT_BIAS] float32
    stop_ids: jax.Array  # [MAX_STOP_IDS] int32, padded with V (dropped)
    want_logprobs: jax.Array  # [] bool
    sampling: SamplingArrays  # [1]


_KNOBS = tuple(f.name for f in dataclasses.fields(SamplingArrays))
# Knobs that travel in the int32 array: top_k, and the uint32 seed carried bit for bit.
_INT_KNOBS = tuple(n for n in _KNOBS if not np.issubdtype(getattr(_EMPTY_KNOBS, n).dtype, np.floating))
_FLOAT_KNOBS = tuple(n for n in _KNOBS if n not in _INT_KNOBS)
_SCALARS = ("slot", "start", "length", "last", "generated", "min_tokens", "want_logprobs")
_BOOLS = ("last", "want_logprobs")
# (field, length) in array order; the int32 array ends with the tokens, of the chunk's bucket size.
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
_TOKENS = sum(length for _, length in _INT_FIELDS)  # where the tokens begin


@struct.dataclass
class PackedChunk:
    """A PrefillChunk as it crosses to the device: one int32 and one float32 array. Each array
    handed to a jitted call is a host->device copy of its own (as seventeen arrays, a chunk cost
    a mixed dispatch 4.6 ms of host time on a 2-core CPU; packed, 0.3 ms); the steps unpack it."""

    ints: jax.Array
    floats: jax.Array

    # Host-side reads (what the engine scheduled; tests look at them).
    slot = property(lambda self: int(self.ints[_INT_AT["slot"][0]]))
    start = property(lambda self: int(self.ints[_INT_AT["start"][0]]))
    length = property(lambda self: int(self.ints[_INT_AT["length"][0]]))
    last = property(lambda self: bool(self.ints[_INT_AT["last"][0]]))
    size = property(lambda self: self.ints.shape[0] - _TOKENS)  # tokens, with padding

    def unpack(self) -> PrefillChunk:
        ints = {name: self.ints[a:b] for name, (a, b) in _INT_AT.items()}
        floats = {name: self.floats[a:b] for name, (a, b) in _FLOAT_AT.items()}
        scalars = {n: ints[n][0] != 0 if n in _BOOLS else ints[n][0] for n in _SCALARS}
        knobs = {n: ints[n] for n in _INT_KNOBS} | {n: floats[n] for n in _FLOAT_KNOBS}
        knobs["seed"] = jax.lax.bitcast_convert_type(knobs["seed"], jnp.uint32)
        return PrefillChunk(
            tokens=self.ints[_TOKENS:][None, :],
            bias_ids=ints["bias_ids"],
            bias_values=floats["bias_values"],
            stop_ids=ints["stop_ids"],
            sampling=SamplingArrays(**knobs),
            **scalars,
        )


def pack_chunk(
    tokens: np.ndarray,
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
    want_logprobs: bool,
) -> PackedChunk:
    """Host-side construction of a chunk (the sparse lists padded to fixed sizes, id V = dropped)."""
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
    ints |= {"want_logprobs": want_logprobs, "bias_ids": bias_ids, "stop_ids": stops}
    ints |= {n: knob(n).view(np.int32) if n == "seed" else knob(n).astype(np.int32) for n in _INT_KNOBS}
    floats = {"bias_values": bias_values} | {n: knob(n).astype(np.float32) for n in _FLOAT_KNOBS}
    as_array = lambda value, dtype: np.asarray(value, dtype).reshape(-1)
    packed_ints = [as_array(ints[name], np.int32) for name, _ in _INT_FIELDS]
    packed_floats = [as_array(floats[name], np.float32) for name, _ in _FLOAT_FIELDS]
    return PackedChunk(
        ints=np.concatenate([*packed_ints, np.asarray(tokens, np.int32)]),
        floats=np.concatenate(packed_floats),
    )


def pack_history(slot: int, tokens: list[int], prompt_len: int, max_seq_len: int) -> np.ndarray:
    """The `history` verb's argument: [slot, prompt length, length, tokens padded to max_seq_len]."""
    packed = np.zeros(3 + max_seq_len, np.int32)
    packed[:3] = slot, prompt_len, len(tokens)
    packed[3 : 3 + len(tokens)] = tokens
    return packed
