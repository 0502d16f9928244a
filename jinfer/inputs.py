"""What one device dispatch carries, declared once: its per-row inputs, its program, its outputs.

`RowInputs` holds the host values a dispatch hands the jitted steps beside the weights, the cache,
the slot state and the block tables (a prompt chunk rides as `jinfer.state.PackedChunk`). `INPUTS`
declares each field once (the axes it spans, its dtype, the value of a row that does not use it),
and everything else follows from that declaration:

  * `input_shardings`: slot-indexed fields over the data axis, the rest replicated (host values
    enter replicated: several processes may hand numpy arrays to jit only so);
  * `neutral_inputs`: a dispatch where no row uses anything (warm-up, the engine's starting point);
  * the cluster's messages (`jinfer.cluster` encodes any `struct.dataclass` field by field).

Rows ("rows") are a decode dispatch's rows, slots 0..rows-1, or a prefill dispatch's prompt
pieces, one row each (`jinfer.state.PrefillChunk`), or a mixed dispatch's decode rows and then its
pieces (`decode_inputs` builds a decode or mixed dispatch's rows from their requests). A new
per-row feature (an adapter index, a steering row, a processor's parameters) is one field here
plus its use in the steps; rows that do not use it get its neutral value.

Per-row inputs of the engine's own features are fields here. A logits processor the engine is
built with (`RowProcessor`: `LLM(logits_processors=...)`) declares its input the same way, and its
values travel in `RowInputs.processors`, filled from each row's request (`row_inputs`).

`Program` names one compiled variant (kind and bucket sizes): `Steps.programs` is the one table of
them that warm-up, the engine, tests and scripts go by. `DispatchOutput` is what every program
returns (its parts None where the kind has none).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jinfer.config import PROMPT_PIECE
from jinfer.sampling import RequestError, StepOutput
from jinfer.sharding import DATA


class InputSpec(NamedTuple):
    """Declaration of one input array: the axes it spans (names, or fixed sizes), its dtype, the
    value of an unused row."""

    axes: tuple[str | int, ...]
    dtype: Any
    neutral: Any


class RowProcessor(NamedTuple):
    """A logits processor with parameters per request, registered by name when the engine is
    built (`jinfer.processors`): the declaration of its input (`spec`: an InputSpec, or a mapping
    of parameter names to InputSpecs, axes "rows" then fixed sizes), how a request's parameters
    become that input (`of_args`: the request's `SamplingParams.extra_args[name]` -> the value, or
    a mapping of values; taken and checked when the request is prepared; a request that does not
    name the processor gets the neutral value) and its one use (`apply`: logits [N, V], the rows'
    `sampling.TokenHistory`, their values [N, ...] -> logits [N, V], a pure JAX function applied in
    `sampling.process` after the logit bias, in every step that samples). A row whose values are
    all neutral must come out unchanged; a step where no row uses it skips it."""

    name: str
    spec: Any
    of_args: Callable[[Any], Any]
    apply: Callable[[Any, Any, Any], Any]

    def used(self, values) -> jax.Array:
        """Whether some row's values are not neutral (a traced bool)."""
        specs = jax.tree.leaves(self.spec, is_leaf=_is_spec)
        pairs = zip(jax.tree.leaves(values), specs, strict=True)
        return jnp.any(jnp.stack([jnp.any(v != s.neutral) for v, s in pairs]))


@struct.dataclass
class DraftPlan:
    """What a verify dispatch's steps go by (`Speculation.choose`)."""

    drafting: Any  # [rows] bool: the rows that may draft
    chances: Any  # [rows, kinds] float32: a row's chance that a draft of each kind is accepted
    costs: Any  # [lengths] float32: each of the program's draft lengths' cost over a decode step
    force: Any  # [] int32: -1, or the index of the length every step takes (measuring costs)


@struct.dataclass
class RowInputs:
    """The per-row inputs of one dispatch (host values; see the module docstring for the rows)."""

    steps: Any  # [rows] int32: the decode steps a row takes part in (0: idle; a piece's row: 1)
    deferred: Any  # [rows] bool: fed, not sampled; its logits wait in the state for `sample`
    want_logprobs: Any  # [] bool: some sampled row asks for log-probs
    allowed: Any  # [slots, W] int32 allowed-token bitmask by slot, or None: no row constrained
    plan: DraftPlan | None = None  # a verify dispatch's draft plan
    processors: Any = None  # {name: [rows, ...] (or {parameter: [rows, ...]})}: each RowProcessor's input
    adapter: Any = None  # [rows] int32: the row's slot in the adapter stack (`jinfer.lora`), -1: none

    @property
    def rows(self) -> int:
        return len(self.steps)

    def processing(self, processors: Sequence[RowProcessor], rows: slice = slice(None)) -> tuple:
        """(processor, the rows' values) of each registered one, for `sampling.process`."""
        return tuple((p, jax.tree.map(lambda v: v[rows], self.processors[p.name])) for p in processors)


INPUTS = RowInputs(
    steps=InputSpec(("rows",), np.int32, 0),
    deferred=InputSpec(("rows",), np.bool_, False),
    want_logprobs=InputSpec((), np.bool_, False),
    # Neutral: None, for which the device passes its resident all-bits-set mask (no upload).
    allowed=InputSpec(("slots", "words"), np.int32, None),
    plan=DraftPlan(
        drafting=InputSpec(("rows",), np.bool_, False),
        chances=InputSpec(("rows", "kinds"), np.float32, 0.5),
        costs=InputSpec(("lengths",), np.float32, 1.0),
        force=InputSpec((), np.int32, -1),
    ),
    adapter=InputSpec(("rows",), np.int32, -1),
)


def _is_spec(x) -> bool:
    return isinstance(x, InputSpec)


def _declared(plan: bool, processors: Sequence[RowProcessor]) -> RowInputs:
    return INPUTS.replace(plan=INPUTS.plan if plan else None, processors={p.name: p.spec for p in processors})


def input_shardings(mesh: Mesh, *, plan: bool, processors: Sequence[RowProcessor] = ()) -> RowInputs:
    """Slot-indexed fields over the data axis; every other field whole on every device."""
    by_slot, whole = PartitionSpec(DATA), PartitionSpec()
    place = lambda s: NamedSharding(mesh, by_slot if s.axes[:1] == ("slots",) else whole)
    return jax.tree.map(place, _declared(plan, processors), is_leaf=_is_spec)


def _array(spec: InputSpec, size: dict) -> np.ndarray:
    shape = tuple(a if isinstance(a, int) else size[a] for a in spec.axes)
    return np.full(shape, spec.neutral, spec.dtype)


def neutral_inputs(
    rows: int,
    *,
    kinds: int = 0,
    lengths: int = 0,
    plan: bool = False,
    processors: Sequence[RowProcessor] = (),
) -> RowInputs:
    """Inputs of `rows` rows that use nothing (numpy); with `plan`, a draft plan of `kinds` kinds
    and `lengths` draft lengths in which no row drafts."""
    size = {"rows": rows, "kinds": kinds, "lengths": lengths}
    make = lambda spec: None if spec.neutral is None else _array(spec, size)
    return jax.tree.map(make, _declared(plan, processors), is_leaf=_is_spec)


def processor_inputs(processors: Sequence[RowProcessor], extra_args) -> dict[str, Any]:
    """Each registered processor's value for a request's `extra_args` (`RowProcessor.of_args` of
    the entry under its name; neutral without one), checked against its declaration: a
    RequestError naming extra_args where one does not fit or names no registered processor, so
    that nothing wrong reaches a dispatch."""
    extra_args = extra_args or {}
    known = {p.name for p in processors}
    if unknown := sorted(set(extra_args) - known):
        registered = ", ".join(sorted(known)) or "none"
        message = f"extra_args name no registered logits processor: {unknown} (registered: {registered})"
        raise RequestError(message, "extra_args")
    out = {}
    for processor in processors:
        if processor.name not in extra_args:
            neutral = lambda spec: _array(spec, {"rows": 1})[0]
            out[processor.name] = jax.tree.map(neutral, processor.spec, is_leaf=_is_spec)
            continue
        try:
            given = processor.of_args(extra_args[processor.name])
            out[processor.name] = jax.tree.map(_fitted, processor.spec, given, is_leaf=_is_spec)
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise RequestError(f"extra_args for the {processor.name} processor: {e}", "extra_args") from None
    return out


def _fitted(spec: InputSpec, given) -> np.ndarray:
    """One row's value as its declaration says (dtype, shape after "rows"), or a ValueError."""
    value = np.asarray(given, spec.dtype)
    if value.shape != spec.axes[1:]:
        raise ValueError(f"shape {value.shape}, not {spec.axes[1:]}")
    return value


def row_inputs(owners: Sequence, processors: Sequence[RowProcessor], **fields) -> RowInputs:
    """The inputs of a dispatch of one row per owner (a request, or None for a row without one):
    the dispatch's own `fields` as given, each registered processor's values and each row's
    adapter from its rows' requests (`Request.processor_inputs`, `Request.adapter`), everything
    else neutral."""
    inputs = neutral_inputs(len(owners), processors=processors)
    for row, request in enumerate(owners):
        if request is not None:
            inputs.adapter[row] = request.adapter
    for processor in processors:
        columns = jax.tree.leaves(inputs.processors[processor.name])  # one array per parameter
        for row, request in enumerate(owners):
            if request is not None:
                values = jax.tree.leaves(request.processor_inputs[processor.name])
                for column, value in zip(columns, values, strict=True):
                    column[row] = value
    return inputs.replace(**fields)


def decode_inputs(owners: Sequence, steps: int, allowed, processors, pieces: Sequence = ()) -> RowInputs:
    """The inputs of a decode dispatch of `steps` steps over `owners`' rows (requests, or None),
    then, for a mixed dispatch, a row per prompt piece (its request in `pieces`): each request's
    steps (`Request.dispatch_tokens`), a constrained one's row deferred, log-probs when a sampled
    row's request asks."""
    row_steps = [0 if r is None else r.dispatch_tokens(steps) for r in owners]
    deferred = [r is not None and r.constraint is not None for r in owners]
    sampled = [r for r, d in zip(owners, deferred, strict=True) if r is not None and not d]
    sampled += [r for r in pieces if r is not None]
    return row_inputs(
        [*owners, *pieces],
        processors,
        steps=np.array(row_steps + [1] * len(pieces), np.int32),
        deferred=np.array(deferred + [False] * len(pieces)),
        want_logprobs=np.bool_(any(r.sampling.logprobs is not None for r in sampled)),
        allowed=allowed,
    )


class Program(NamedTuple):
    """One compiled variant of the steps: its kind and the bucket sizes it was built for."""

    kind: str  # "prefill" | "mixed" | "decode" | "verify" | "sample"
    rows: int  # decode rows (a slot bucket); a prefill's: its prompt pieces (a piece bucket)
    attn_len: int = 0  # the attention bucket of decode rows (0: none, or one kernel reads all)
    chunk: int = 0  # prompt tokens carried, padded (prefill, mixed: pieces x PROMPT_PIECE)
    drafts: int = 0  # verify: the longest draft length
    feeds_draft: bool = True  # with a draft model: whether the draft model's passes run too

    @property
    def input_rows(self) -> int:
        """Rows of its `RowInputs`: a mixed program's decode rows, then a row per piece."""
        return self.rows + (self.chunk // PROMPT_PIECE if self.kind == "mixed" else 0)


@struct.dataclass
class DispatchOutput:
    """What a program returns besides the cache and the state (device arrays, read one dispatch late)."""

    rows: StepOutput | None  # [steps (x (k + 1) verifying), rows]: the decode rows' tokens
    chunk: StepOutput | None = None  # [1, pieces]: the token after each prompt piece (prefill)
    checked: Any = None  # [steps, rows] int32: drafts checked per verify step and row
    kinds: Any = None  # [steps, rows] int32: their kind
