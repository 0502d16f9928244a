"""Weight matrices held quantized: their layout in memory, and their products (the formats and
their records: `jinfer.models.quant_formats`).

The weights are ggml's blocks (`FORMATS`); int8 weights made at load from float ones
(`quantize_int8`) are q8_0 blocks whose rows repeat one scale. A loader hands them over as records
per row (`quant_formats.records_from_ggml`) in
`HostBlocks`, which reshape and stack like any weight by row permutations only (parts of a stacked
weight in different formats stay apart: `HostStack` -> `StackedWeight`).
`QuantizedWeight.from_host` regroups the records for the CPU kernel
(`jinfer.kernels.cpu_quant_matmul`): per group of inputs, R rows side by side (R =
`block_rows()`), field by field, float16 scales first, integers input-major (4 inputs of a row
together for the integer products). Nothing is dequantized on the way, so a weight holds about the
file's bytes.

Products (`project`) run the kernel over `MAX_COLUMNS` columns at a time: a prompt's hundreds of
columns in slices of them. Two arithmetics, which a weight's `activations` chooses (the engine's
`quantized_activations`, set by `with_activations`): "float32" (every format) dequantizes in
registers and multiplies float32 columns, the dequantized model's numbers; "int8" (the formats in
INTEGER_FORMATS: q8_0, q5_0, q4_0, q4_1, q5_1, and int8 weights) makes integer products as
llama.cpp computes them: each column rounded to 8 bits per 32 inputs (scale max |x| / 127), a
block's integer dot product exact, and the scales applied in float32 block after block (the
kernel's source says the exact order; tests/test_quantized.py holds it in numpy). Those results are
the dequantized matrix's times the rounded columns: faster, and they differ from the float ones by
that rounding (SmolLM2's Q4_1 file: perplexity of a test text within 1%, yet its greedy answer to
"What is the capital of France?" loses Paris, as llama.cpp's does). Either way a column's bits are
the kernel's whatever the product's count, decode's and prompt's alike. (Dequantizing the whole
matrix in the step for XLA's dot cost SmolLM2's Q4_1 file ~210 ms a prefill dispatch on a 2-core
EPYC.) Without the kernel the engine dequantizes at load (`layout.why_dequantized`); `project` then
multiplies the dequantized matrix by XLA's dot. Embedding rows are gathered from the blocks
(`take_rows`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jinfer.kernels import cpu_matmul, cpu_quant_matmul
from jinfer.models.params import PackedWeight
from jinfer.models.quant_formats import FORMATS, INTEGER_FORMATS, QuantFormat, flip_signs, layout_fields

MAX_COLUMNS = cpu_matmul.MAX_COLUMNS


def block_rows() -> int:
    return cpu_quant_matmul.block_rows()


@dataclasses.dataclass
class HostBlocks:
    """A quantized weight as a loader reads it: `data` [rows, (in / group) x record bytes] (uint8,
    each row's records in order) with its logical `shape` [out..., in...]. Reshaping the output
    dims, `[None]` and `concatenate` along an output dim move whole rows, as they do for a float
    weight, so loaders treat both alike."""

    format: QuantFormat
    data: np.ndarray
    shape: tuple[int, ...]

    @property
    def in_features(self) -> int:
        return self.data.shape[1] // self.format.record_bytes * self.format.group

    def reshape(self, *shape: int) -> HostBlocks:
        if math.prod(shape) != math.prod(self.shape) or _input_dims(shape, self.in_features) is None:
            raise ValueError(f"cannot reshape a quantized weight {self.shape} to {shape}")
        return HostBlocks(self.format, self.data, tuple(shape))

    def __getitem__(self, index) -> HostBlocks:
        if index is not None:
            raise TypeError("a quantized weight supports only [None]")
        return HostBlocks(self.format, self.data, (1, *self.shape))

    @property
    def output_shape(self) -> tuple[int, ...]:
        return self.shape[: len(self.shape) - _input_dims(self.shape, self.in_features)]


def _input_dims(shape: tuple[int, ...], in_features: int) -> int | None:
    """How many trailing dims of `shape` the inputs fill (the shortest suffix multiplying to them)."""
    for dims in range(1, len(shape) + 1):
        if math.prod(shape[-dims:]) == in_features:
            return dims
    return None


@dataclasses.dataclass
class HostStack:
    """Quantized weights a loader stacks (q/k/v, gate/up) that the file holds in different formats
    (a Q4_K_M file's Q6_K values beside Q4_K queries and keys): kept apart, stacked at product
    time (`StackedWeight`)."""

    parts: list[HostBlocks]
    axis: int

    @property
    def shape(self) -> tuple[int, ...]:
        return _stacked_shape([p.shape for p in self.parts], self.axis)


def _stacked_shape(shapes: list[tuple[int, ...]], axis: int) -> tuple[int, ...]:
    return (*shapes[0][:axis], sum(s[axis] for s in shapes), *shapes[0][axis + 1 :])


def concatenate(parts: list, axis: int) -> HostBlocks | HostStack | np.ndarray:
    """Stack quantized weights along an output axis: their rows interleave as a float's would
    (parts in different formats stay apart, as a `HostStack`; beside a float part, which no block
    format holds, every part is stacked as its float values)."""
    if not all(isinstance(p, HostBlocks) for p in parts):
        values = lambda p: (
            np.asarray(dequantize(QuantizedWeight.from_host(p))) if isinstance(p, HostBlocks) else p
        )
        return np.concatenate([values(p) for p in parts], axis=axis)
    first = parts[0]
    out_dims = len(first.output_shape)
    if axis >= out_dims or any(p.in_features != first.in_features for p in parts):
        raise ValueError("quantized weights stack only along an output dim, of one width")
    if any(p.format != first.format for p in parts):
        return HostStack(list(parts), axis)
    rows = [p.data.reshape(*p.output_shape, -1) for p in parts]
    data = np.concatenate(rows, axis=axis)
    shape = (*data.shape[:-1], *first.shape[out_dims:])
    return HostBlocks(first.format, data.reshape(-1, data.shape[-1]), shape)


@struct.dataclass
class QuantizedWeight:
    """A weight matrix [out..., in...] held as quantized blocks in the kernel's layout: `blocks`
    uint8 [ceil(out / R), in / group, R x record bytes] (R = `block_rows()`): for each block of R
    rows and `group` inputs, each field of their records in turn, R side by side (rows past `out`
    are zeros)."""

    blocks: jax.Array
    format: str = struct.field(pytree_node=False)
    shape: tuple[int, ...] = struct.field(pytree_node=False)
    activations: str = struct.field(pytree_node=False, default="float32")  # or "int8" (INTEGER_FORMATS)

    @property
    def in_features(self) -> int:
        return self.blocks.shape[1] * FORMATS[self.format].group

    @property
    def out_features(self) -> int:
        return math.prod(self.shape) // self.in_features

    @staticmethod
    def from_host(host: HostBlocks, activations: str = "float32") -> QuantizedWeight:
        """Regroup a loader's rows of records for the kernel's `activations` (the same bytes,
        reordered; `layout_fields`)."""
        fmt, r = host.format, block_rows()
        activations = activations if fmt.name in INTEGER_FORMATS else "float32"
        rows, groups = host.data.shape[0], host.in_features // fmt.group
        padded = np.zeros((-(-rows // r) * r, groups, fmt.record_bytes), np.uint8)
        records = host.data.reshape(rows, groups, fmt.record_bytes)
        padded[:rows] = flip_signs(fmt, records) if activations == "int8" else records
        by_block = padded.reshape(-1, r, groups, fmt.record_bytes)  # [B, R, G, record]
        fields, at = [], 0
        for _, count, size in layout_fields(fmt, activations):
            field = by_block[..., at : at + count * size].reshape(*by_block.shape[:3], count, size)
            fields.append(
                field.transpose(0, 2, 3, 1, 4).reshape(*field.shape[:1], groups, -1)
            )  # [B, G, count R size]
            at += count * size
        blocks = np.ascontiguousarray(np.concatenate(fields, axis=-1))
        return QuantizedWeight(jnp.asarray(blocks), fmt.name, host.shape, activations)

    def to_host(self) -> HostBlocks:
        """The weight as rows of records again (what `from_host` was given): the layout a
        checkpoint stores, independent of the kernel's R."""
        fmt = FORMATS[self.format]
        blocks = np.asarray(self.blocks)
        nblocks, groups, _ = blocks.shape
        r = _rows_per_block(blocks, fmt)
        fields = [
            field.reshape(nblocks, groups, count, r, size)
            .transpose(0, 3, 1, 2, 4)
            .reshape(nblocks, r, groups, -1)
            for field, (_, count, size) in zip(
                _split_fields(blocks, fmt, r), layout_fields(fmt, self.activations), strict=True
            )
        ]
        rows = np.concatenate(fields, axis=-1).reshape(nblocks * r, groups, -1)[: self.out_features]
        rows = flip_signs(fmt, rows) if self.activations == "int8" else rows
        return HostBlocks(fmt, np.ascontiguousarray(rows.reshape(rows.shape[0], -1)), self.shape)


def _rows_per_block(blocks, fmt: QuantFormat) -> int:
    """R of a kernel-layout array [B, G, R x record]: what it was regrouped with."""
    return blocks.shape[2] // fmt.record_bytes


def _split_fields(blocks, fmt: QuantFormat, r: int) -> list:
    """The kernel-layout bytes [B, G, R x record] split into each field's [B, G, count R size]."""
    out, at = [], 0
    for _, count, size in fmt.fields:
        out.append(blocks[..., at : at + count * r * size])
        at += count * r * size
    return out


def quantize_int8(values: np.ndarray, input_dims: int) -> HostBlocks:
    """Float weights [out..., in...] (the last `input_dims` dims contracted) as symmetric int8 per
    output channel: q = round(w / s), s = max |w| of the row / 127, rounded to float16. Held in
    Q8_0's blocks (the row's scale in each of its blocks of 32), so the Q8_0 kernel multiplies it;
    `in` must be a multiple of 32 (`int8_quantizable`)."""
    shape = values.shape
    rows = values.reshape(math.prod(shape[:-input_dims]), -1).astype(np.float32)
    scale = (np.abs(rows).max(axis=1) / 127).astype(np.float16)
    safe = np.where(scale > 0, scale.astype(np.float32), 1.0)[:, None]
    q = np.clip(np.rint(rows / safe), -127, 127).astype(np.int8)
    groups = rows.shape[1] // 32
    blocks = np.empty((rows.shape[0], groups, FORMATS["q8_0"].record_bytes), np.uint8)
    blocks[..., :2] = scale.view(np.uint8).reshape(-1, 1, 2)
    blocks[..., 2:] = q.view(np.uint8).reshape(rows.shape[0], groups, 32)
    return HostBlocks(FORMATS["q8_0"], blocks.reshape(rows.shape[0], -1), shape)


def int8_quantizable(shape: tuple[int, ...], input_dims: int) -> bool:
    return input_dims > 0 and math.prod(shape[-input_dims:]) % 32 == 0


@struct.dataclass
class StackedWeight:
    """A stacked weight whose parts are held in different formats (`HostStack`): each part's
    product, stacked along `axis` of the output dims (a shuffle of activations, not weights)."""

    parts: tuple[QuantizedWeight, ...]
    axis: int = struct.field(pytree_node=False)

    @staticmethod
    def from_host(host: HostStack) -> StackedWeight:
        return StackedWeight(tuple(QuantizedWeight.from_host(p) for p in host.parts), host.axis)

    @property
    def shape(self) -> tuple[int, ...]:
        return _stacked_shape([p.shape for p in self.parts], self.axis)


def dequantize(w: QuantizedWeight | StackedWeight, dtype=jnp.float32) -> jax.Array:
    """The weight's values [out..., in...] as `dtype` (computed as ggml dequantizes them)."""
    if isinstance(w, StackedWeight):
        return jnp.concatenate([dequantize(p, dtype) for p in w.parts], axis=w.axis)
    values = _dequantize_blocks(w.blocks, w.format, w.activations)
    return values[: w.out_features].reshape(w.shape).astype(dtype)


def _dequantize_blocks(blocks: jax.Array, format: str, activations: str) -> jax.Array:
    """blocks [B, G, R x record] (the layout for `activations`) -> float32 [B R, G group]."""
    fmt = FORMATS[format]
    nblocks, groups, _ = blocks.shape
    r = _rows_per_block(blocks, fmt)
    field = dict(zip((name for name, _, _ in fmt.fields), _split_fields(blocks, fmt, r), strict=True))
    sizes = {name: (count, size) for name, count, size in layout_fields(fmt, activations)}

    def each(name: str, dtype) -> jax.Array:  # [B, G, count x size, R]: a field's bytes in order
        count, size = sizes[name]
        items = field[name].reshape(nblocks, groups, count, r, size).transpose(0, 1, 2, 4, 3)
        return jax.lax.bitcast_convert_type(items.reshape(nblocks, groups, -1, r), dtype)

    halves = lambda name: jax.lax.bitcast_convert_type(
        field[name].reshape(nblocks, groups, 1, r, 2), jnp.float16
    ).astype(jnp.float32)  # [B, G, 1, R]

    def nibbles(name: str) -> jax.Array:  # [B, G, n x 32, R]: per 32 inputs, byte j = inputs j, j + 16
        q = each(name, jnp.uint8).reshape(nblocks, groups, -1, 16, r)
        return jnp.concatenate([q & 15, q >> 4], axis=3).reshape(nblocks, groups, -1, r).astype(jnp.float32)

    if format in ("q8_0", "q5_0") and activations == "int8":  # held as q + 128
        values = halves("d") * (each("q", jnp.uint8).astype(jnp.float32) - 128.0)
    elif format in ("q8_0", "q5_0"):
        values = halves("d") * each("q", jnp.int8).astype(jnp.float32)
    elif format == "q5_1":
        values = halves("d") * each("q", jnp.uint8).astype(jnp.float32) + halves("m")
    elif format == "q4_0":
        values = halves("d") * (nibbles("q") - 8.0)
    elif format == "q4_1":
        values = halves("d") * nibbles("q") + halves("m")
    elif format in ("q4_k", "q5_k"):
        scale = (halves("d") * each("sc", jnp.uint8).astype(jnp.float32))[:, :, :, None]  # [B, G, 8, 1, R]
        offset = (halves("dmin") * each("m", jnp.uint8).astype(jnp.float32))[:, :, :, None]
        q = nibbles("q") if format == "q4_k" else each("q", jnp.uint8).astype(jnp.float32)
        q = q.reshape(nblocks, groups, 8, 32, r)
        values = (scale * q - offset).reshape(nblocks, groups, -1, r)
    else:  # q6_k
        scale = (halves("d") * each("sc", jnp.int8).astype(jnp.float32))[:, :, :, None]  # [B, G, 16, 1, R]
        q = each("q", jnp.int8).astype(jnp.float32).reshape(nblocks, groups, 16, 16, r)
        values = (scale * q).reshape(nblocks, groups, -1, r)
    return values.transpose(0, 3, 1, 2).reshape(nblocks * r, groups * fmt.group)


def take_rows(w: QuantizedWeight, ids: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Rows `ids` [N] of the weight (an embedding's lookup) -> [N, in], dequantizing only their
    block rows."""
    r = _rows_per_block(w.blocks, FORMATS[w.format])
    rows = _dequantize_blocks(w.blocks[ids // r], w.format, w.activations).reshape(ids.shape[0], r, -1)
    return jnp.take_along_axis(rows, (ids % r)[:, None, None], axis=1)[:, 0].astype(dtype)


def project(w: QuantizedWeight | StackedWeight, x: jax.Array, out_dims: tuple[int, ...]) -> jax.Array:
    """w times columns x [in, N] -> [out..., N] (float32): the kernel over MAX_COLUMNS columns at
    a time, or XLA's dot over the dequantized matrix without the kernel."""
    if isinstance(w, StackedWeight):
        dims = len(out_dims)
        outs = [project(p, x, p.shape[:dims]) for p in w.parts]
        return jnp.concatenate(outs, axis=w.axis)
    integer = w.activations == "int8"
    if cpu_quant_matmul.available():
        slices = [x[:, at : at + MAX_COLUMNS] for at in range(0, x.shape[1], MAX_COLUMNS)]
        outs = [cpu_quant_matmul.matmul(w.blocks, part, w.format, w.out_features, integer) for part in slices]
        out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
    else:
        matrix = dequantize(w).reshape(w.out_features, w.in_features)
        x = rounded_to_8_bits(x) if integer else x.astype(jnp.float32)
        out = jnp.dot(matrix, x, precision=jax.lax.Precision.HIGHEST)
    return out.reshape(*out_dims, x.shape[1])


def rounded_to_8_bits(x: jax.Array) -> jax.Array:
    """Columns x [in, N] as the integer products see them: per 32 inputs, d = max |x| / 127 and
    x / d rounded to nearest even, times d again."""
    blocks = x.astype(jnp.float32).reshape(x.shape[0] // 32, 32, -1)
    d = jnp.abs(blocks).max(axis=1, keepdims=True) / 127
    return (jnp.round(blocks / jnp.where(d > 0, d, 1)) * d).reshape(x.shape)


def with_activations(params, activations: str):
    """`params` with every weight of INTEGER_FORMATS multiplied with `activations` ("float32" or
    "int8"; the others have float products only): regrouped, on the host, for that layout."""
    relaid = lambda w: (
        QuantizedWeight.from_host(w.to_host(), activations)
        if isinstance(w, QuantizedWeight) and w.format in INTEGER_FORMATS and w.activations != activations
        else w
    )
    return jax.tree.map(relaid, params, is_leaf=lambda w: isinstance(w, QuantizedWeight))


def activations_of(params) -> str:
    """The activations `params`' quantized weights multiply with ("float32" where none is int8)."""
    blocks = jax.tree.leaves(params, is_leaf=lambda w: isinstance(w, QuantizedWeight))
    return "int8" if any(getattr(w, "activations", None) == "int8" for w in blocks) else "float32"


def is_packed(w) -> bool:
    return isinstance(w, PackedWeight)


def is_quantized(w) -> bool:
    return isinstance(w, QuantizedWeight | StackedWeight)


def dequantized(params, dtype=jnp.float32):
    """`params` with every quantized weight replaced by its values (as `dtype`)."""
    values = lambda w: dequantize(w, dtype) if is_quantized(w) else w
    return jax.tree.map(values, params, is_leaf=is_quantized)


def floats(params):
    """`params` without its quantized weights."""
    return jax.tree.map(lambda w: None if is_quantized(w) else w, params, is_leaf=is_quantized)


def describe_held(params) -> str:
    """The weights' bytes as held, for the start-up log: quantized matrices per format, float ones
    (and their packed copies)."""
    held = lambda tree: sum(a.nbytes for a in jax.tree.leaves(tree))
    quantized = held(params) - held(floats(params))
    parts = [f"{held(params) / 2**20:.1f} MiB as held"]
    if quantized:
        counts = ", ".join(f"{n} {name}" for name, n in sorted(formats_held(params).items()))
        parts.append(f"{quantized / 2**20:.1f} MiB quantized ({counts} matrices)")
        if INTEGER_FORMATS & formats_held(params).keys():
            parts.append(f"{activations_of(params)} activations")
    packed = [w for w in jax.tree.leaves(params, is_leaf=is_packed) if is_packed(w)]
    if packed:
        parts.append(f"{len(packed)} float matrices with packed copies")
    return "; ".join(parts)


def formats_held(params) -> dict[str, int]:
    """Quantized weights per format in `params` (for the start-up log)."""
    counts: dict[str, int] = {}
    for w in jax.tree.leaves(params, is_leaf=lambda w: isinstance(w, QuantizedWeight)):
        if isinstance(w, QuantizedWeight):  # each part of a StackedWeight
            counts[w.format] = counts.get(w.format, 0) + 1
    return counts
