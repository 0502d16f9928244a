"""The parameter tree of the Llama-family decoder and its one declaration.

`param_specs(cfg)` declares every weight once (shape, logical axes, init); random init, abstract
shapes (restore and jit targets), shardings and the loaders' shape checks derive from it. Weights
are stored output features first ([out..., in]), as Hugging Face stores them, with the projections
that read the same input stacked (`wqkv`, `w_gate_up`): see `models.llama` for why.

On a CPU the engine may hold each matrix as a `PackedWeight` (`pack_weights`): the matrix plus a
copy packed for jinfer's few-column kernel (`jinfer.kernels.cpu_matmul`).
"""

from __future__ import annotations

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from jinfer.config import ModelConfig
from jinfer.kernels import cpu_matmul


class ParamSpec(NamedTuple):
    """Declaration of one weight: its shape, a logical axis name per dimension, and for a matrix how
    many trailing dims a product contracts (0: not a matrix). What a product reads can be held in
    another storage format (a packed copy, quantized blocks: `models.quantized`); these decide which."""

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    init: str  # "ones" for norm scales, "normal" for matrices, "zeros" for biases
    input_dims: int = 0


@struct.dataclass
class LayerParams:
    attn_norm: jax.Array  # [d]
    wqkv: jax.Array  # [k, g + 2, h, d]: per kv head, its g query heads, then its key and value heads
    wo: jax.Array  # [d, n, h]
    mlp_norm: jax.Array  # [d]
    w_gate_up: jax.Array  # [2, f, d]: gate and up projections stacked (one product per step)
    w_down: jax.Array  # [d, f]
    bqkv: jax.Array | None = None  # [k, g + 2, h]  (qwen2)
    q_norm: jax.Array | None = None  # [h]  (qwen3)
    k_norm: jax.Array | None = None  # [h]


@struct.dataclass
class Params:
    embed: jax.Array  # [v, d]
    layers: tuple[LayerParams, ...]
    final_norm: jax.Array  # [d]
    lm_head: jax.Array | None = None  # [v, d]; None when tied to `embed`


def param_specs(cfg: ModelConfig) -> Params:
    """The one declaration of every weight, as a `Params` tree whose leaves are `ParamSpec`."""
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    n, k, g, h = cfg.num_heads, cfg.num_kv_heads, cfg.num_groups, cfg.head_dim
    norm = lambda: ParamSpec((d,), ("embed",), "ones")

    def layer() -> LayerParams:
        return LayerParams(
            attn_norm=norm(),
            wqkv=ParamSpec((k, g + 2, h, d), ("kv_heads", None, "head_dim", "embed"), "normal", 1),
            wo=ParamSpec((d, n, h), ("embed", "heads", "head_dim"), "normal", 2),
            mlp_norm=norm(),
            w_gate_up=ParamSpec((2, f, d), (None, "mlp", "embed"), "normal", 1),
            w_down=ParamSpec((d, f), ("embed", "mlp"), "normal", 1),
            bqkv=ParamSpec((k, g + 2, h), ("kv_heads", None, "head_dim"), "zeros") if cfg.qkv_bias else None,
            q_norm=ParamSpec((h,), ("head_dim",), "ones") if cfg.qk_norm else None,
            k_norm=ParamSpec((h,), ("head_dim",), "ones") if cfg.qk_norm else None,
        )

    return Params(
        embed=ParamSpec((v, d), ("vocab", "embed"), "normal", int(cfg.tie_word_embeddings)),
        layers=tuple(layer() for _ in range(cfg.num_layers)),
        final_norm=norm(),
        lm_head=None if cfg.tie_word_embeddings else ParamSpec((v, d), ("vocab", "embed"), "normal", 1),
    )


def is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def abstract_params(cfg: ModelConfig, dtype=jnp.float32, shardings=None) -> Params:
    """ShapeDtypeStructs for every weight (optionally with shardings): targets for restore and jit."""
    specs = param_specs(cfg)
    if shardings is None:
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), specs, is_leaf=is_spec)
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, dtype, sharding=sh), specs, shardings, is_leaf=is_spec
    )


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, scale: float = 0.02) -> Params:
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
    """A weight matrix [out..., in...] with a second copy packed for the CPU few-column kernel
    (`jinfer.kernels.cpu_matmul`): products of up to `cpu_matmul.MAX_COLUMNS` columns (decode steps)
    read `packed`, longer ones (prompts) `matrix` with XLA's dot, which is faster there."""

    matrix: jax.Array
    packed: jax.Array  # [ceil(out / R), in, R] (R = cpu_matmul.block_rows()), out and in flattened


def pack_weights(params: Params, cfg: ModelConfig) -> Params:
    """`params` with every matrix a product reads (the declaration's `input_dims`) as a
    `PackedWeight`; quantized weights are already in their kernel's layout and stay as they are.
    Costs one more copy of those matrices."""

    def pack(spec: ParamSpec, w):
        if not spec.input_dims or not isinstance(w, jax.Array):
            return w
        return PackedWeight(w, cpu_matmul.pack(w.reshape(math.prod(w.shape[: -spec.input_dims]), -1)))

    return jax.tree.map(pack, param_specs(cfg), params, is_leaf=is_spec)


def unpacked(params: Params) -> Params:
    """`params` without packed copies: what `pack_weights` was given."""
    return jax.tree.map(matrix, params, is_leaf=lambda w: isinstance(w, PackedWeight))


def matrix(w: jax.Array | PackedWeight) -> jax.Array:
    return w.matrix if isinstance(w, PackedWeight) else w
