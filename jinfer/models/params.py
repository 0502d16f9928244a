"""What follows from a model family's parameter declaration, whatever the family.

A family declares every weight once (`param_specs(cfg)`: shape, logical axes, init, how many dims a
product contracts); random init, abstract shapes (restore and jit targets), shardings and the
loaders' shape checks derive from it here and in `jinfer.sharding` / `jinfer.formats`.

On a CPU the engine may hold each matrix as a `PackedWeight` (`pack_weights`): the matrix plus a
copy packed for jinfer's few-column kernel (`jinfer.kernels.cpu_matmul`).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from jinfer.config import ModelConfig
from jinfer.kernels import cpu_matmul
from jinfer.models.family import family_of


class ParamSpec(NamedTuple):
    """Declaration of one weight: its shape, a logical axis name per dimension, and for a matrix how
    many trailing dims a product contracts (0: not a matrix). What a product reads can be held in
    another storage format (a packed copy, quantized blocks: `models.quantized`); these decide which."""

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    init: str  # "ones" for norm scales, "normal" for matrices, "zeros" for biases
    input_dims: int = 0


# A family's parameter pytree (`models.llama_params.Params` for the Llama family): a flax struct
# whose leaves are weights, declared by the family's `param_specs`.
ParamTree = Any


def param_specs(cfg: ModelConfig) -> ParamTree:
    """The declaration of every weight of `cfg`'s model: its family's (`models.family`), as a tree
    whose leaves are `ParamSpec`."""
    return family_of(cfg).param_specs(cfg)


def is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def abstract_params(cfg: ModelConfig, dtype=jnp.float32, shardings=None) -> ParamTree:
    """ShapeDtypeStructs for every weight (optionally with shardings): targets for restore and jit."""
    specs = param_specs(cfg)
    if shardings is None:
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), specs, is_leaf=is_spec)
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, dtype, sharding=sh), specs, shardings, is_leaf=is_spec
    )


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, scale: float = 0.02) -> ParamTree:
    """Random weights (normal * scale, norms at 1): for tests, benchmarks and training from scratch.

    Called eagerly, each distinct weight shape is one small compiled program: one program for the
    whole tree took two minutes to compile for a Llama-3-8B shape on an H200."""
    leaves, treedef = jax.tree.flatten(param_specs(cfg), is_leaf=is_spec)
    keys = jax.random.split(key, len(leaves))
    dtype = jnp.dtype(dtype)
    made = [
        _random_leaf(k, spec.shape, spec.init, dtype, scale) for spec, k in zip(leaves, keys, strict=True)
    ]
    return jax.tree.unflatten(treedef, made)


@partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _random_leaf(key: jax.Array, shape: tuple[int, ...], init: str, dtype, scale: float) -> jax.Array:
    if init == "ones":
        return jnp.ones(shape, dtype)
    if init == "zeros":
        return jnp.zeros(shape, dtype)
    return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


@struct.dataclass
class PackedWeight:
    """A weight matrix [out..., in...] with a second copy packed for the CPU packed-weight kernel
    (`jinfer.kernels.cpu_matmul`): every product reads `packed` (decode steps and prompts alike, so
    a column's bits never depend on the others); `matrix` is what unpacking gives back."""

    matrix: jax.Array
    packed: jax.Array  # [ceil(out / R), in, R] (R = cpu_matmul.block_rows()), out and in flattened


def pack_weights(params: ParamTree, cfg: ModelConfig) -> ParamTree:
    """`params` with every matrix a product reads (the declaration's `input_dims`) as a
    `PackedWeight`; quantized weights are already in their kernel's layout and stay as they are.
    Costs one more copy of those matrices."""

    def pack(spec: ParamSpec, w):
        if not spec.input_dims or not isinstance(w, jax.Array):
            return w
        return PackedWeight(w, cpu_matmul.pack(w.reshape(math.prod(w.shape[: -spec.input_dims]), -1)))

    return jax.tree.map(pack, param_specs(cfg), params, is_leaf=is_spec)


def unpacked(params: ParamTree) -> ParamTree:
    """`params` without packed copies: what `pack_weights` was given."""
    return jax.tree.map(matrix, params, is_leaf=lambda w: isinstance(w, PackedWeight))


def matrix(w: jax.Array | PackedWeight) -> jax.Array:
    return w.matrix if isinstance(w, PackedWeight) else w
