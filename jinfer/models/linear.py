"""Linear layers, whatever a weight is held as: one protocol, `project(w, x, input_dims)`.

    w [out..., in...] (its last `input_dims` dims contracted) applied to columns x [in, N]
        -> [out..., N], in x's dtype

A float array is one matrix product by XLA's dot (the leading output dims merged: they are
contiguous, so no reshape crosses a sharded axis). Every other holding registers its own product
(`functools.singledispatch`): a `PackedWeight` (jinfer's packed-weight kernel, any column count),
quantized blocks and stacks of them (`models.quantized`). A family's
layers call `project` and never ask how a weight is held; a new holding (an adapted weight) is one
more registration here.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jinfer.kernels import cpu_matmul
from jinfer.models import quantized
from jinfer.models.attention import full_precision
from jinfer.models.params import PackedWeight


@functools.singledispatch
def project(w, x: jax.Array, input_dims: int = 1) -> jax.Array:
    """A float weight: XLA's dot, products in float32."""
    out_dims = w.shape[:-input_dims]
    w = w.reshape(*out_dims, -1)
    dims = (((w.ndim - 1,), (0,)), ((), ()))
    out = jax.lax.dot_general(w, x, dims, full_precision(x.dtype), preferred_element_type=jnp.float32)
    return out.astype(x.dtype)


def packed_product(w: PackedWeight, x: jax.Array, out_dims: tuple[int, ...]) -> jax.Array:
    """w's packed copy times columns x [in, N] -> [out..., N]: each column the same bits at any N."""
    return cpu_matmul.matmul(w.packed, x, math.prod(out_dims)).reshape(*out_dims, x.shape[1])


@project.register
def _packed(w: PackedWeight, x: jax.Array, input_dims: int = 1) -> jax.Array:
    return packed_product(w, x, w.matrix.shape[:-input_dims])


@project.register(quantized.QuantizedWeight)
@project.register(quantized.StackedWeight)
def _quantized(w, x: jax.Array, input_dims: int = 1) -> jax.Array:
    return quantized.project(w, x, w.shape[:-input_dims]).astype(x.dtype)
