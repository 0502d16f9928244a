"""Weight matrices held quantized: the formats, their one layout in memory, and their products.

    format   one block = 32 inputs of one row              bytes per weight
    q8_0     float16 d, int8 q[32]:        w = d q          34 / 32
    q4_0     float16 d, 4-bit q[32]:       w = d (q - 8)    18 / 32
    q4_1     float16 d, m, 4-bit q[32]:    w = d q + m      20 / 32

These are ggml's blocks (GGUF's Q8_0, Q4_0 and Q4_1 tensors). A loader hands them over as they are
in the file (`HostBlocks`: rows of ggml blocks, reshaped and stacked like any weight by row
permutations only); `QuantizedWeight.from_host` regroups the same bits for the CPU kernel
(`jinfer.kernels.cpu_quant_matmul`): per group of 32 inputs, R rows side by side (R =
`block_rows()`), their float16 scales (and offsets) first, then their integers input-major. Nothing
is dequantized on the way, so a weight holds about the file's bytes.

Products (`project`): up to `MAX_COLUMNS` columns (decode steps, short chunks) run the kernel,
which dequantizes in registers; more columns (prompt chunks) multiply the matrix dequantized by
XLA inside the step (`dequantize`), which the product of hundreds of columns outweighs. Without the
kernel every product takes that path. Embedding rows are gathered from the blocks (`take_rows`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jinfer.kernels import cpu_matmul, cpu_quant_matmul

GROUP = 32  # inputs per block
MAX_COLUMNS = cpu_matmul.MAX_COLUMNS


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    name: str
    offsets: bool  # a float16 offset m per block besides the scale d
    bits: int  # of each integer q
    signed: bool  # q8_0's integers are int8; q4's are unsigned nibbles

    @property
    def header_bytes(self) -> int:
        return 4 if self.offsets else 2

    @property
    def block_bytes(self) -> int:
        """Bytes of one block (32 inputs of one row), as ggml stores it."""
        return self.header_bytes + GROUP * self.bits // 8


FORMATS = {
    "q8_0": QuantFormat("q8_0", offsets=False, bits=8, signed=True),
    "q4_0": QuantFormat("q4_0", offsets=False, bits=4, signed=False),
    "q4_1": QuantFormat("q4_1", offsets=True, bits=4, signed=False),
}


def block_rows() -> int:
    return cpu_quant_matmul.block_rows()


@dataclasses.dataclass
class HostBlocks:
    """A quantized weight as a loader reads it: `data` [rows, (in / 32) x block bytes] (uint8, ggml's
    blocks of each row in order) with its logical `shape` [out..., in...]. Reshaping the output
    dims, `[None]` and `concatenate` along an output dim move whole rows, as they do for a float
    weight, so loaders treat both alike."""

    format: QuantFormat
    data: np.ndarray
    shape: tuple[int, ...]

    @property
    def in_features(self) -> int:
        return self.data.shape[1] // self.format.block_bytes * GROUP

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


def concatenate(parts: list[HostBlocks], axis: int) -> HostBlocks:
    """Stack quantized weights along an output axis: their rows interleave as a float's would."""
    first = parts[0]
    out_dims = len(first.output_shape)
    if axis >= out_dims or any(p.format != first.format or p.in_features != first.in_features for p in parts):
        raise ValueError("quantized weights stack only along an output dim, in one format and width")
    rows = [p.data.reshape(*p.output_shape, -1) for p in parts]
    data = np.concatenate(rows, axis=axis)
    shape = (*data.shape[:-1], *first.shape[out_dims:])
    return HostBlocks(first.format, data.reshape(-1, data.shape[-1]), shape)


@struct.dataclass
class QuantizedWeight:
    """A weight matrix [out..., in...] held as quantized blocks in the kernel's layout:
    `blocks` uint8 [ceil(out / R), in / 32, R x block bytes] (R = `block_rows()`; rows past `out`
    are zeros)."""

    blocks: jax.Array
    format: str = struct.field(pytree_node=False)
    shape: tuple[int, ...] = struct.field(pytree_node=False)

    @property
    def rows(self) -> int:
        return self.blocks.shape[0] * self.blocks.shape[2] // FORMATS[self.format].block_bytes

    @property
    def in_features(self) -> int:
        return self.blocks.shape[1] * GROUP

    @property
    def out_features(self) -> int:
        return math.prod(self.shape) // self.in_features

    @staticmethod
    def from_host(host: HostBlocks) -> QuantizedWeight:
        """Regroup a loader's rows of ggml blocks for the kernel (the same bits, reordered)."""
        fmt, r = host.format, block_rows()
        rows, groups = host.data.shape[0], host.in_features // GROUP
        padded = np.zeros((-(-rows // r) * r, groups, fmt.block_bytes), np.uint8)
        padded[:rows] = host.data.reshape(rows, groups, fmt.block_bytes)
        by_block = padded.reshape(-1, r, groups, fmt.block_bytes).transpose(0, 2, 1, 3)  # [B, G, R, bytes]
        header = by_block[..., : fmt.header_bytes].reshape(*by_block.shape[:3], -1, 2)  # [B, G, R, d|m, 2]
        header = header.transpose(0, 1, 3, 2, 4).reshape(*by_block.shape[:2], -1)  # all d, then all m
        ints = by_block[..., fmt.header_bytes :].transpose(0, 1, 3, 2).reshape(*by_block.shape[:2], -1)
        blocks = np.ascontiguousarray(np.concatenate([header, ints], axis=-1))
        return QuantizedWeight(jnp.asarray(blocks), fmt.name, host.shape)

    def to_host(self) -> HostBlocks:
        """The weight as rows of ggml blocks again (what `from_host` was given): the layout a
        checkpoint stores, independent of the kernel's R."""
        fmt, r = FORMATS[self.format], self.blocks.shape[2] // FORMATS[self.format].block_bytes
        blocks = np.asarray(self.blocks)
        nblocks, groups, _ = blocks.shape
        halves = fmt.header_bytes // 2
        header = blocks[..., : fmt.header_bytes * r].reshape(nblocks, groups, halves, r, 2)
        header = header.transpose(0, 3, 1, 2, 4).reshape(nblocks, r, groups, -1)  # [B, R, G, d|m bytes]
        ints = blocks[..., fmt.header_bytes * r :].reshape(nblocks, groups, -1, r).transpose(0, 3, 1, 2)
        rows = np.concatenate([header, ints], axis=-1).reshape(nblocks * r, -1)[: self.out_features]
        return HostBlocks(fmt, np.ascontiguousarray(rows), self.shape)


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
    groups = rows.shape[1] // GROUP
    blocks = np.empty((rows.shape[0], groups, FORMATS["q8_0"].block_bytes), np.uint8)
    blocks[..., :2] = scale.view(np.uint8).reshape(-1, 1, 2)
    blocks[..., 2:] = q.view(np.uint8).reshape(rows.shape[0], groups, GROUP)
    return HostBlocks(FORMATS["q8_0"], blocks.reshape(rows.shape[0], -1), shape)


def int8_quantizable(shape: tuple[int, ...], input_dims: int) -> bool:
    return input_dims > 0 and math.prod(shape[-input_dims:]) % GROUP == 0


def dequantize(w: QuantizedWeight, dtype=jnp.float32) -> jax.Array:
    """The weight's values [out..., in...] as `dtype` (computed as ggml dequantizes: d q, then + m)."""
    return _dequantize_blocks(w.blocks, w.format)[: w.out_features].reshape(w.shape).astype(dtype)


def _dequantize_blocks(blocks: jax.Array, format: str) -> jax.Array:
    """blocks [B, G, R x block bytes] -> float32 [B R, G 32]."""
    fmt = FORMATS[format]
    nblocks, groups, _ = blocks.shape
    r = block_rows()
    halves = lambda a: jax.lax.bitcast_convert_type(a.reshape(nblocks, groups, r, 2), jnp.float16)
    d = halves(blocks[..., : 2 * r]).astype(jnp.float32)[:, :, None, :]  # [B, G, 1, R]
    ints = blocks[..., fmt.header_bytes * r :].reshape(nblocks, groups, -1, r)  # [B, G, bytes, R]
    if fmt.bits == 8:
        values = d * jax.lax.bitcast_convert_type(ints, jnp.int8).astype(jnp.float32)
    else:
        q = jnp.concatenate([ints & 15, ints >> 4], axis=2).astype(jnp.float32)  # inputs j, then j + 16
        m = halves(blocks[..., 2 * r : 4 * r]).astype(jnp.float32)[:, :, None, :] if fmt.offsets else None
        values = d * q + m if m is not None else d * (q - 8.0)
    return values.transpose(0, 3, 1, 2).reshape(nblocks * r, groups * GROUP)


def take_rows(w: QuantizedWeight, ids: jax.Array, dtype=jnp.float32) -> jax.Array:
    """Rows `ids` [N] of the weight (an embedding's lookup) -> [N, in], dequantizing only their
    block rows."""
    r = block_rows()
    rows = _dequantize_blocks(w.blocks[ids // r], w.format).reshape(ids.shape[0], r, -1)
    return jnp.take_along_axis(rows, (ids % r)[:, None, None], axis=1)[:, 0].astype(dtype)


def project(w: QuantizedWeight, x: jax.Array, out_dims: tuple[int, ...]) -> jax.Array:
    """w times columns x [in, N] -> [out..., N] (float32): the kernel for up to MAX_COLUMNS
    columns, XLA's dot over the dequantized matrix for more (or without the kernel)."""
    if x.shape[1] <= MAX_COLUMNS and cpu_quant_matmul.available():
        out = cpu_quant_matmul.matmul(w.blocks, x, w.format, w.out_features)
    else:
        matrix = dequantize(w).reshape(w.out_features, w.in_features)
        out = jnp.dot(matrix, x.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    return out.reshape(*out_dims, x.shape[1])


def is_quantized(w) -> bool:
    return isinstance(w, QuantizedWeight)


def dequantized(params, dtype=jnp.float32):
    """`params` with every quantized weight replaced by its values (as `dtype`)."""
    values = lambda w: dequantize(w, dtype) if is_quantized(w) else w
    return jax.tree.map(values, params, is_leaf=is_quantized)


def floats(params):
    """`params` without its quantized weights."""
    return jax.tree.map(lambda w: None if is_quantized(w) else w, params, is_leaf=is_quantized)


def describe_held(params, packed: bool) -> str:
    """The weights' bytes as held, for the start-up log: quantized matrices per format, float ones
    (and their packed copies)."""
    held = lambda tree: sum(a.nbytes for a in jax.tree.leaves(tree))
    quantized = held(params) - held(floats(params))
    parts = [f"{held(params) / 2**20:.1f} MiB as held"]
    if quantized:
        counts = ", ".join(f"{n} {name}" for name, n in sorted(formats_held(params).items()))
        parts.append(f"{quantized / 2**20:.1f} MiB quantized ({counts} matrices, jinfer's quantized kernel)")
    if packed:
        parts.append("float matrices with packed copies")
    return "; ".join(parts)


def formats_held(params) -> dict[str, int]:
    """Quantized weights per format in `params` (for the start-up log)."""
    counts: dict[str, int] = {}
    for w in jax.tree.leaves(params, is_leaf=is_quantized):
        if is_quantized(w):
            counts[w.format] = counts.get(w.format, 0) + 1
    return counts
