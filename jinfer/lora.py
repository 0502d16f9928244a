"""Low-rank adapters (LoRA): their declaration, their pytree, and how a forward pass applies them.

An adapter changes some of each layer's projections (its `LoraConfig.targets`, among the family's
`adapter_targets`: q, k, v, o, gate, up, down for the Llama family) by a low-rank product, as
PEFT's LoRA does: for inputs x, W x + scale * B (A x), A [rank, in], B [out, rank], scale
alpha / rank (alpha / sqrt(rank) with rsLoRA). `Adapter` is that pytree (its arrays the leaves,
its config static): what a trainer differentiates, what `jinfer.formats.adapters` reads from a
PEFT directory and saves with orbax.

A forward pass meets adapters as one more holding of a weight (`AdaptedWeight`, a `project`
registration): the base weight as held (float, packed, quantized) and the stack's pairs for the
projections it holds (`AdapterStack`: S adapters, each padded to R rows; the A of every
projection of one weight stacked, so one product serves q, k and v), with each column's slot in
the stack (-1: none). Per column, its adapter's rows of A x are kept (scaled) and every other row
zeroed, then each projection's B multiplies its rows: zeros add nothing, so a column's delta is
the same bits whichever other adapters share the stack or the call (with products whose bits do
not depend on the column or row count: jinfer's CPU kernels). The projections' deltas, side by
side as the weight holds its outputs, are added to the base product once. A column without an
adapter takes the base product's bits unchanged, and a call with no adapted column skips the
deltas (`lax.cond`).

Where the engine packs its weights for jinfer's CPU kernel, the stack is laid out slot by slot
instead (`fused`, `FusedPairs`) and a weight's deltas are one kernel call (`FusedAdaptedWeight`):
each adapter's rows multiply only its own columns, so a step reads each adapter once and makes no
product that a zero scale would discard (4 adapters over 8 rows: a quarter of the arithmetic).
The values are the stacked products' (each a running sum in the same order, the other adapters'
zero terms left out), and a call with no adapted column reads no adapter byte.

    adapted(params, cfg, stack, slots) -> params whose targeted weights are `AdaptedWeight`s
                                          (`FusedAdaptedWeight`s over a fused stack)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jinfer.config import ModelConfig
from jinfer.kernels import cpu_matmul
from jinfer.models.family import AdapterTarget, family_of
from jinfer.models.linear import project
from jinfer.options import setting


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """What an adapter is: its rank, its alpha and the projections it changes (names of the
    family's `adapter_targets`)."""

    rank: int = setting(8, "the adapter's rank")
    alpha: float = setting(16.0, "its scale is alpha / rank")
    targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
    rslora: bool = setting(False, "scale by alpha / sqrt(rank) instead (PEFT's use_rslora)")

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"an adapter's rank must be at least 1, got {self.rank}")
        if not self.targets or len(set(self.targets)) != len(self.targets):
            raise ValueError(f"an adapter's targets must be distinct and not empty, got {self.targets}")

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


@struct.dataclass
class LoraPair:
    a: jax.Array  # [rank, in]
    b: jax.Array  # [out, rank], out flattened in Hugging Face's order


@struct.dataclass
class Adapter:
    """One adapter: per layer, a `LoraPair` per target."""

    layers: tuple[dict[str, LoraPair], ...]
    config: LoraConfig = struct.field(pytree_node=False)


def targets_of(cfg: ModelConfig, names: Sequence[str]) -> dict[str, AdapterTarget]:
    """The family's targets of these names (a clear error for a name it lacks)."""
    family = family_of(cfg)
    if family.adapter_targets is None:
        raise ValueError(f"the {family.name} family declares no adapter targets")
    available = family.adapter_targets(cfg)
    unknown = [name for name in names if name not in available]
    if unknown:
        raise ValueError(f"adapter targets {unknown} are not among this model's: {sorted(available)}")
    return {name: available[name] for name in names}


def init_adapter(cfg: ModelConfig, config: LoraConfig, key: jax.Array) -> Adapter:
    """A fresh adapter as PEFT makes one: A uniform in +-1/sqrt(in) (Kaiming's with a = sqrt(5)),
    B zeros (so it starts as the base model)."""
    targets = targets_of(cfg, config.targets)
    keys = iter(jax.random.split(key, cfg.num_layers * len(targets)))
    layers = []
    for _ in range(cfg.num_layers):
        layer = {}
        for name, target in targets.items():
            bound = 1 / math.sqrt(target.in_features)
            a = jax.random.uniform(next(keys), (config.rank, target.in_features), jnp.float32, -bound, bound)
            layer[name] = LoraPair(a, jnp.zeros((math.prod(target.out_shape), config.rank), jnp.float32))
        layers.append(layer)
    return Adapter(tuple(layers), config)


def check_adapter(adapter: Adapter, cfg: ModelConfig) -> None:
    """Raise ValueError unless every array of the adapter has the shape its config and the model
    give it."""
    targets = targets_of(cfg, adapter.config.targets)
    if len(adapter.layers) != cfg.num_layers:
        raise ValueError(f"the adapter has {len(adapter.layers)} layers; the model has {cfg.num_layers}")
    rank = adapter.config.rank
    for i, layer in enumerate(adapter.layers):
        if set(layer) != set(targets):
            raise ValueError(
                f"layer {i} of the adapter holds {sorted(layer)}; its config names {sorted(targets)}"
            )
        for name, target in targets.items():
            want = {"a": (rank, target.in_features), "b": (math.prod(target.out_shape), rank)}
            for field, shape in want.items():
                got = tuple(np.shape(getattr(layer[name], field)))
                if got != shape:
                    raise ValueError(f"layer {i} {name}.{field} has shape {got}; expected {shape}")


@struct.dataclass
class WeightPairs:
    """A stack's pairs for the projections one weight holds (its targets, in `targets_of` order):
    their A stacked [T * S * rank, in] (one product for all of them) and each one's B
    [out, S * rank]."""

    a: Any
    bs: tuple


@struct.dataclass
class AdapterStack:
    """S adapters side by side, each padded to `rank` rows: per layer and weight, the `WeightPairs`
    of its targets, each target's A [S * rank, in] and B [out, S * rank] (zeros where an adapter
    has no such target or fewer rows, and in an empty slot), and each slot's scale (0 for an
    empty slot)."""

    layers: tuple[dict[str, WeightPairs], ...]
    scales: jax.Array  # [S] float32
    rank: int = struct.field(pytree_node=False)
    targets: tuple[str, ...] = struct.field(pytree_node=False)


def stack(
    adapters: Sequence[Adapter | None], cfg: ModelConfig, rank: int, targets: Sequence[str]
) -> AdapterStack:
    """`adapters` as a stack of len(adapters) slots (None: an empty one) of `rank` rows each, over
    `targets` (each adapter's targets must be among them and its rank at most `rank`)."""
    by_name = targets_of(cfg, targets)
    for adapter in adapters:
        if adapter is None:
            continue
        if adapter.config.rank > rank:
            raise ValueError(f"an adapter of rank {adapter.config.rank} in a stack of rank {rank}")
        if extra := set(adapter.config.targets) - set(by_name):
            raise ValueError(f"the adapter changes {sorted(extra)}, which the stack does not hold")
    layers = []
    for i in range(cfg.num_layers):
        a_rows, b_stacks = {}, {}  # per weight: its targets' A rows, and B per target
        for name, target in by_name.items():
            padded = [_padded(None if a is None else a.layers[i].get(name), target, rank) for a in adapters]
            a_rows.setdefault(target.weight, []).extend(a for a, _ in padded)
            b_stacks.setdefault(target.weight, []).append(jnp.concatenate([b for _, b in padded], 1))
        layers.append({w: WeightPairs(jnp.concatenate(a_rows[w], 0), tuple(b_stacks[w])) for w in a_rows})
    scales = [0.0 if adapter is None else adapter.config.scale for adapter in adapters]
    return AdapterStack(tuple(layers), jnp.asarray(scales, jnp.float32), rank, tuple(targets))


def _padded(pair: LoraPair | None, target: AdapterTarget, rank: int) -> tuple[jax.Array, jax.Array]:
    if pair is None:
        return jnp.zeros((rank, target.in_features)), jnp.zeros((math.prod(target.out_shape), rank))
    extra = rank - pair.a.shape[0]
    return jnp.pad(pair.a, ((0, extra), (0, 0))), jnp.pad(pair.b, ((0, 0), (0, extra)))


def column_scales(stack: AdapterStack, slots: jax.Array) -> jax.Array:
    """[S * rank, N]: for column n, its slot's scale on that slot's rows, 0 on every other row (and
    on all rows for slot -1)."""
    slot_of_row = jnp.arange(stack.scales.shape[0] * stack.rank) // stack.rank
    scale = stack.scales[jnp.clip(slots, 0)]
    return jnp.where(slot_of_row[:, None] == slots[None, :], scale[None, :], 0.0).astype(jnp.float32)


@struct.dataclass
class AdaptedWeight:
    """A weight as held (`base`) with the stack's pairs for the projections it holds (`pairs`, in
    `targets`' order) and the call's columns: `scales` [T * S * rank, N], `adapted` [N] bool (None:
    every column, as in a trainer's forward)."""

    base: Any
    pairs: WeightPairs
    scales: jax.Array
    adapted: jax.Array | None
    targets: tuple[AdapterTarget, ...] = struct.field(pytree_node=False)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.base.shape


@struct.dataclass
class FusedPairs:
    """A stack's pairs for one weight laid out slot by slot, as jinfer's CPU kernel adds their
    deltas in one call beside the weight's product (`cpu_matmul.lora_deltas`): per slot, the A of
    the weight's projections in turn [T * rank, in] and one B [M, rank] whose row m is the B row of
    the projection output m belongs to (zeros where none does), each packed; and per packed block
    of B's rows, where its projection's rows of A x start (-1: no projection)."""

    a: jax.Array  # [S, blocks, in, R]
    b: jax.Array  # [S, blocks, rank, R]
    kept_at: tuple[int, ...] = struct.field(pytree_node=False)


@struct.dataclass
class FusedAdaptedWeight:
    """A weight as held (`base`) with the stack's `FusedPairs` for it, each slot's scale (`scales`
    [S]) and the call's columns' slots (`slots` [N], -1: none; None: every column slot 0, as in a
    trainer's forward)."""

    base: Any
    pairs: FusedPairs
    scales: jax.Array
    slots: jax.Array | None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.base.shape


def _outputs(cfg: ModelConfig, weight: str) -> int:
    spec = getattr(family_of(cfg).param_specs(cfg).layers[0], weight)
    return math.prod(spec.shape[: -spec.input_dims])


def output_rows(cfg: ModelConfig, target: AdapterTarget) -> np.ndarray:
    """The rows of its weight's flattened outputs that `target`'s outputs are, in its B's order."""
    everything = np.arange(_outputs(cfg, target.weight))
    if target.part is None:
        return everything
    axis, offset = target.part
    shape = list(target.out_shape)
    shape[axis] = everything.size // (math.prod(shape) // shape[axis])
    return np.take(
        everything.reshape(shape), np.arange(offset, offset + target.out_shape[axis]), axis
    ).ravel()


def fused(stack: AdapterStack, cfg: ModelConfig, pack, block: int) -> AdapterStack | None:
    """The stack as `FusedPairs` for a kernel of `block` rows a packed block (`pack` packs a
    matrix), or None where a block would hold rows of two projections."""
    by_name = targets_of(cfg, stack.targets)
    slots, rank = stack.scales.shape[0], stack.rank
    layouts = {}
    for weight in stack.layers[0]:
        rows = [output_rows(cfg, t) for t in by_name.values() if t.weight == weight]
        owner = np.full(_outputs(cfg, weight), -1)  # per output row: its projection's first row of A
        for i, r in enumerate(rows):
            owner[r] = i * rank
        blocks = [owner[at : at + block] for at in range(0, owner.size, block)]
        if any((part != part[0]).any() for part in blocks):
            return None
        layouts[weight] = (rows, tuple(int(part[0]) for part in blocks), owner.size)

    def fuse(weight: str, pairs: WeightPairs) -> FusedPairs:
        rows, kept_at, outputs = layouts[weight]
        a = pairs.a.reshape(len(rows), slots, rank, -1).transpose(1, 0, 2, 3)  # [S, T, rank, in]
        b = jnp.zeros((outputs, slots * rank), jnp.float32)
        for r, part in zip(rows, pairs.bs, strict=True):
            b = b.at[r].set(part)
        b = b.reshape(outputs, slots, rank).transpose(1, 0, 2)  # [S, M, rank]
        per_slot = lambda matrices: jnp.stack([pack(m) for m in matrices])
        return FusedPairs(per_slot(a.reshape(slots, len(rows) * rank, -1)), per_slot(b), kept_at)

    layers = tuple({w: fuse(w, pairs) for w, pairs in layer.items()} for layer in stack.layers)
    return stack.replace(layers=layers)


@project.register
def _adapted_product(w: AdaptedWeight, x: jax.Array, input_dims: int = 1) -> jax.Array:
    out = project(w.base, x, input_dims)

    def with_deltas():
        kept = project(w.pairs.a, x) * w.scales.astype(x.dtype)  # [T * S * rank, N]
        rows = kept.shape[0] // len(w.targets)
        deltas = [
            project(b, kept[i * rows : (i + 1) * rows]).reshape(*target.out_shape, -1)
            for i, (b, target) in enumerate(zip(w.pairs.bs, w.targets, strict=True))
        ]
        summed = out + _side_by_side(deltas, w.targets, out.shape)
        return summed if w.adapted is None else jnp.where(w.adapted, summed, out)

    if w.adapted is None:
        return with_deltas()
    return jax.lax.cond(jnp.any(w.adapted), with_deltas, lambda: out)


@project.register
def _plus_fused_deltas(w: FusedAdaptedWeight, x: jax.Array, input_dims: int = 1) -> jax.Array:
    """The base product plus the deltas of one kernel call, which reads nothing when no column
    has an adapter (so no `lax.cond`)."""
    out = project(w.base, x, input_dims)
    columns = x.shape[-1]
    slots = jnp.zeros(columns, jnp.int32) if w.slots is None else w.slots
    rows = math.prod(out.shape[:-1])
    deltas = cpu_matmul.lora_deltas(x, slots, w.scales, w.pairs.a, w.pairs.b, w.pairs.kept_at, rows)
    summed = out + deltas.reshape(out.shape).astype(out.dtype)
    return summed if w.slots is None else jnp.where(w.slots >= 0, summed, out)


def _side_by_side(deltas: list[jax.Array], targets: tuple[AdapterTarget, ...], shape) -> jax.Array:
    """The projections' deltas where the weight holds their outputs: one target's as it is, the
    parts of a stacked weight's concatenated along their axis in their order (zeros for a part no
    target covers), so each output takes one addition."""
    if targets[0].part is None:
        return deltas[0]
    axis = targets[0].part[0]
    parts, at = [], 0
    for delta, target in sorted(zip(deltas, targets, strict=True), key=lambda pair: pair[1].part[1]):
        if target.part[1] > at:  # a part no target covers
            parts.append(jnp.zeros((*shape[:axis], target.part[1] - at, *shape[axis + 1 :]), delta.dtype))
        parts.append(delta)
        at = target.part[1] + target.out_shape[axis]
    if at < shape[axis]:
        parts.append(jnp.zeros((*shape[:axis], shape[axis] - at, *shape[axis + 1 :]), deltas[0].dtype))
    return jnp.concatenate(parts, axis)


def adapted(params, cfg: ModelConfig, stack: AdapterStack, slots: jax.Array | None = None):
    """`params` with each weight the stack changes as an `AdaptedWeight` for a call over columns of
    these stack slots (`slots` [N], -1: no adapter; None: every column slot 0, no column left out,
    as for one adapter in a trainer's forward); a stack of `FusedPairs` gives `FusedAdaptedWeight`s."""
    if isinstance(next(iter(stack.layers[0].values())), FusedPairs):
        slots = None if slots is None else jnp.asarray(slots, jnp.int32)
        layers = [
            layer.replace(
                **{w: FusedAdaptedWeight(getattr(layer, w), p, stack.scales, slots) for w, p in pairs.items()}
            )
            for layer, pairs in zip(params.layers, stack.layers, strict=True)
        ]
        return params.replace(layers=tuple(layers))
    if slots is None:
        adapted_columns = None
        scales = jnp.full((stack.rank, 1), stack.scales[0], jnp.float32)  # broadcasts over columns
    else:
        slots = jnp.asarray(slots, jnp.int32)
        adapted_columns, scales = slots >= 0, column_scales(stack, slots)
    by_name = targets_of(cfg, stack.targets)
    targets = {w: tuple(t for t in by_name.values() if t.weight == w) for w in stack.layers[0]}
    # A weight's A rows are its targets' in turn: the column scales repeated once per target.
    tiled = {w: jnp.tile(scales, (len(held), 1)) for w, held in targets.items()}
    layers = []
    for layer, pairs in zip(params.layers, stack.layers, strict=True):
        changed = {
            w: AdaptedWeight(getattr(layer, w), held, tiled[w], adapted_columns, targets[w])
            for w, held in pairs.items()
        }
        layers.append(layer.replace(**changed))
    return params.replace(layers=tuple(layers))


def single(adapter: Adapter, cfg: ModelConfig) -> AdapterStack:
    """One adapter as a stack of one slot (what `adapted(params, cfg, single(a, cfg))` applies to
    every column)."""
    return stack([adapter], cfg, adapter.config.rank, adapter.config.targets)
