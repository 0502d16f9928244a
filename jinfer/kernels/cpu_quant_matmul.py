"""The CPU quantized matmul kernel (`cpu_quant_matmul.cc`): a few columns times a weight matrix
held as Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K blocks, dequantized in registers, or
for the 32-input formats optionally as integer products over the columns rounded to 8 bits (as
llama.cpp multiplies them).

The blocks' layout (R rows side by side per group of 32 inputs, R = `block_rows()`) is made by
`jinfer.models.quantized`, which also owns the formats; this module only calls the kernel.
`available()` builds and registers it (see `jinfer.kernels`); if it cannot, it says why in a
warning, and quantized weights are multiplied by XLA's dot on their dequantized values instead.
"""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from jinfer.kernels import register_cpu_kernel

log = logging.getLogger(__name__)

TARGET = "jinfer_cpu_quant_matmul"
# q5_0's record is q8_0's (its integers - 16 as int8), so the same code multiplies it.
FORMAT_CODES = {
    "q8_0": 0,
    "q5_0": 0,
    "q4_0": 1,
    "q4_1": 2,
    "q4_k": 3,
    "q6_k": 4,
    "q5_1": 5,
    "q5_k": 6,
}  # the kernel's `format` attribute


@functools.cache
def _library():
    unavailable = "CPU quantized matmul kernel unavailable, quantized weights are multiplied by XLA's dot"
    return register_cpu_kernel("cpu_quant_matmul", "JinferCpuQuantMatmul", TARGET, log, unavailable)


def available() -> bool:
    """Whether the kernel is built and registered (builds it the first time)."""
    return _library() is not None


@functools.cache
def block_rows() -> int:
    """Rows side by side in a group of blocks, as the built kernel reads them (8, or 16 with
    AVX-512); 8 where the kernel is not built."""
    return _library().JinferCpuQuantMatmulBlockRows() if available() else 8


def matmul(
    blocks: jax.Array, x: jax.Array, format: str, rows: int, int8_activations: bool = False
) -> jax.Array:
    """The first `rows` rows of the matrix held in `blocks` [ceil(M / R), K / group, R x record
    bytes] (uint8) times columns x [K, N] (float32) -> [rows, N]; with `int8_activations` (the
    32-input formats), integer products over x rounded to 8 bits per 32 inputs."""
    out_rows = blocks.shape[0] * block_rows()
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((out_rows, x.shape[1]), jnp.float32))
    codes = dict(format=np.int32(FORMAT_CODES[format]), int8_activations=np.int32(int8_activations))
    out = call(blocks, x.astype(jnp.float32), **codes)
    return out if rows == out_rows else out[:rows]
