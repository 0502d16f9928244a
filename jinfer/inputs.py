"""What one device dispatch carries, declared once: its per-row inputs, its program, its outputs.

`RowInputs` holds the host values a dispatch hands the jitted steps beside the weights, the cache,
the slot state and the block tables (a prompt chunk rides as `jinfer.state.PackedChunk`). `INPUTS`
declares each field once (the axes it spans, its dtype, the value of a row that does not use it),
and everything else follows from that declaration:

  * `input_shardings`: slot-indexed fields over the data axis, the rest replicated (host values
    enter replicated: several processes may hand numpy arrays to jit only so);
  * `neutral_inputs`: a dispatch where no row uses anything (warm-up, the engine's starting point);
  * the cluster's messages (`jinfer.cluster` encodes any `struct.dataclass` field by field).

Rows ("rows") are the dispatch's decode rows, slots 0..rows-1, then one row per prompt chunk it
carries (prefill: the chunk's row alone; a mixed dispatch: rows + 1). A new per-row feature (an
adapter index, a steering row, a processor's parameters) is one field here plus its use in the
steps; rows that do not use it get its neutral value.

`Program` names one compiled variant (kind and bucket sizes): `Steps.programs` is the one table of
them that warm-up, the engine, tests and scripts go by. `DispatchOutput` is what every program
returns (its parts None where the kind has none).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jinfer.sampling import StepOutput
from jinfer.sharding import DATA


class InputSpec(NamedTuple):
    """Declaration of one input array: the axes it spans, its dtype, the value of an unused row."""

    axes: tuple[str, ...]
    dtype: Any
    neutral: Any


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

    steps: Any  # [rows] int32: the decode steps a row takes part in (0: idle; a chunk's row: 1)
    deferred: Any  # [rows] bool: fed, not sampled; its logits wait in the state for `sample`
    want_logprobs: Any  # [] bool: some sampled row asks for log-probs
    allowed: Any  # [slots, W] int32 allowed-token bitmask by slot, or None: no row constrained
    plan: DraftPlan | None = None  # a verify dispatch's draft plan

    @property
    def rows(self) -> int:
        return len(self.steps)


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
)


def _is_spec(x) -> bool:
    return isinstance(x, InputSpec)


def _declared(plan: bool) -> RowInputs:
    return INPUTS if plan else INPUTS.replace(plan=None)


def input_shardings(mesh: Mesh, *, plan: bool) -> RowInputs:
    """Slot-indexed fields over the data axis; every other field whole on every device."""
    by_slot, whole = PartitionSpec(DATA), PartitionSpec()
    place = lambda s: NamedSharding(mesh, by_slot if s.axes[:1] == ("slots",) else whole)
    return jax.tree.map(place, _declared(plan), is_leaf=_is_spec)


def neutral_inputs(rows: int, *, kinds: int = 0, lengths: int = 0, plan: bool = False) -> RowInputs:
    """Inputs of `rows` rows that use nothing (numpy); with `plan`, a draft plan of `kinds` kinds
    and `lengths` draft lengths in which no row drafts."""
    size = {"rows": rows, "kinds": kinds, "lengths": lengths}

    def make(spec: InputSpec):
        if spec.neutral is None:
            return None
        return np.full(tuple(size[a] for a in spec.axes), spec.neutral, spec.dtype)

    return jax.tree.map(make, _declared(plan), is_leaf=_is_spec)


class Program(NamedTuple):
    """One compiled variant of the steps: its kind and the bucket sizes it was built for."""

    kind: str  # "prefill" | "decode" | "mixed" | "verify" | "sample"
    rows: int  # decode rows (a slot bucket); a prefill's: 1 (its chunk's)
    attn_len: int = 0  # the attention bucket of decode rows (0: a prefill's or sample's none)
    chunk: int = 0  # prompt tokens carried, padded (prefill, mixed)
    drafts: int = 0  # verify: the longest draft length
    feeds_draft: bool = True  # with a draft model: whether the draft model's passes run too


@struct.dataclass
class DispatchOutput:
    """What a program returns besides the cache and the state (device arrays, read one dispatch late)."""

    rows: StepOutput | None  # [steps (x (k + 1) verifying), rows]: the decode rows' tokens
    chunk: StepOutput | None = None  # [1, 1]: the token after a prompt chunk (prefill, mixed)
    checked: Any = None  # [steps, rows] int32: drafts checked per verify step and row
    kinds: Any = None  # [steps, rows] int32: their kind
