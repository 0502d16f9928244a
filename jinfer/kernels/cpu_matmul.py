"""The CPU packed-weight matmul kernel (`cpu_matmul.cc`) and the weight layout it reads.

A decode step multiplies every weight matrix by one column per busy slot, where XLA:CPU's GEMM runs
far below the memory bandwidth. The kernel reads a matrix packed as [ceil(out / R), in, R] (`pack`;
R = `block_rows()`, the floats of one vector register: 16 with AVX-512, 8 otherwise) and streams it
once for up to `MAX_COLUMNS` columns; a prompt's hundreds of columns it multiplies from cache, in
panels (as fast as XLA's GEMM on SmolLM2's matrices, which repacks the weights on every call).
Every product is one running sum over the input index in order, so a column's bits never depend
on how many columns share the call: a prompt token's products are a decode token's. The engine
keeps such a packed copy next to each matrix when asked to (`EngineConfig.packed_weights`, see
`models.params.PackedWeight`).

The same library holds the low-rank adapters' deltas of one weight in one call (`lora_deltas`,
see `jinfer.lora.FusedPairs`): each adapter's rows multiply only the columns on that adapter.

`available()` builds and registers it (see `jinfer.kernels`); if it cannot, it says why in a
warning and the engine multiplies with XLA's dot.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

from jinfer.config import COLUMN_TILE
from jinfer.kernels import register_cpu_kernel

log = logging.getLogger(__name__)

TARGET = "jinfer_cpu_matmul"
LORA_TARGET = "jinfer_cpu_lora_delta"
# The widest product that streams the weights from memory once for all its columns (a decode
# step's): SmolLM2's decode step, in alternating runs against XLA's dot, at 8 slots 29-35 against
# 41-48 ms, 16 slots 44-47 against 55-73, 32 slots 91 against 102-114, level at 1 slot. Wider
# products (prompts) take the kernel's cached panels.
MAX_COLUMNS = 4 * COLUMN_TILE


@functools.cache
def _library():
    unavailable = "CPU matmul kernel unavailable, decode multiplies with XLA's dot"
    return register_cpu_kernel("cpu_matmul", "JinferCpuMatmul", TARGET, log, unavailable)


def available() -> bool:
    """Whether the kernel is built and registered (builds it the first time)."""
    return _library() is not None


@functools.cache
def block_rows() -> int:
    """Rows per packed block, as the built kernel reads them: one vector register of floats."""
    return _library().JinferCpuMatmulBlockRows()


def pack(matrix: jax.Array) -> jax.Array:
    """matrix [M, K] -> [ceil(M / R), K, R]: block b holds rows Rb..Rb+R-1 (zeros past M), k-major."""
    return _pack(matrix, block_rows())


@functools.partial(jax.jit, static_argnums=1)
def _pack(matrix: jax.Array, block: int) -> jax.Array:
    rows, width = matrix.shape
    padded = jnp.pad(matrix, ((0, -rows % block), (0, 0)))
    return padded.reshape(-1, block, width).transpose(0, 2, 1)


@functools.cache
def _lora_library():
    if _library() is None:
        return None
    unavailable = "CPU LoRA delta kernel unavailable, adapters take the packed products one by one"
    return register_cpu_kernel("cpu_matmul", "JinferCpuLoraDelta", LORA_TARGET, log, unavailable)


def lora_deltas_available() -> bool:
    """Whether `lora_deltas` can run (builds and registers it the first time)."""
    return _lora_library() is not None


def lora_deltas(
    x: jax.Array,
    slots: jax.Array,
    scales: jax.Array,
    a: jax.Array,
    b: jax.Array,
    kept_at: tuple[int, ...],
    rows: int,
) -> jax.Array:
    """A weight's adapter deltas [rows, N] for columns x [K, N] on stack slots `slots` [N] (-1:
    none, whose deltas are 0) of scales `scales` [S] (see `LoraDelta` in cpu_matmul.cc): per slot,
    A packed [S, ., K, R] and B packed [S, ., r, R], with each B block's first row of A x in
    `kept_at`. Up to `JinferCpuLoraDeltaColumns()` columns a call."""
    width = _lora_library().JinferCpuLoraDeltaColumns()
    offsets = jnp.asarray(kept_at, jnp.int32)
    outs = []
    for at in range(0, x.shape[1], width):
        part = slots[at : at + width]
        shape = jax.ShapeDtypeStruct((part.shape[0], b.shape[1] * b.shape[3]), jnp.float32)
        by_slot = jax.ffi.ffi_call(LORA_TARGET, shape)(x[:, at : at + width], part, scales, a, b, offsets)
        # The kernel gives the columns in order of their slots (stably): back to their own order.
        place = jnp.argsort(jnp.argsort(part, stable=True), stable=True)
        outs.append(by_slot[place, :rows].T)
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)


def matmul(packed: jax.Array, x: jax.Array, rows: int) -> jax.Array:
    """The packed matrix's first `rows` rows times columns x [K, N] (float32) -> [rows, N]."""
    blocks, _, block = packed.shape
    out = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((blocks * block, x.shape[1]), jnp.float32))(packed, x)
    return out if rows == out.shape[0] else out[:rows]
