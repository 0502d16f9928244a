"""Device meshes and the logical-axis table: the only module that names mesh axes.

Model code labels each weight dimension with a logical name ("vocab", "heads", "mlp", ...) in
`models.llama.param_specs`. `RULES` maps logical names to mesh axes; everything not listed is
replicated. `param_shardings` turns the declaration into a `NamedSharding` per weight, for jit
and for restoring checkpoints straight into place.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jinfer.config import ModelConfig
from jinfer.models.llama import Params, is_spec, param_specs
from jinfer.models.quantized import is_quantized

DATA, MODEL = "data", "model"

# Tensor parallelism over heads and the MLP width; the vocabulary is split the same way.
RULES: dict[str, str | None] = {
    "vocab": MODEL,
    "embed": None,
    "heads": MODEL,
    "kv_heads": MODEL,
    "head_dim": None,
    "mlp": MODEL,
}


def make_mesh(data: int = 1, model: int = 1, devices=None) -> Mesh:
    """A (data, model) mesh over the first data * model devices, with auto (not explicit) axis types."""
    devices = devices if devices is not None else jax.devices()
    if data * model > len(devices):
        raise ValueError(f"mesh {data}x{model} needs {data * model} devices, only {len(devices)} available")
    grid = np.asarray(devices[: data * model]).reshape(data, model)
    return Mesh(grid, (DATA, MODEL), axis_types=(AxisType.Auto, AxisType.Auto))


def partition_spec(axes: tuple[str, ...], rules: dict[str, str | None] = RULES) -> PartitionSpec:
    return PartitionSpec(*(rules.get(a) for a in axes))


def param_shardings(cfg: ModelConfig, mesh: Mesh, rules: dict[str, str | None] = RULES) -> Params:
    """A NamedSharding per weight; every sharded dimension must divide its mesh axis."""

    def sharding(spec):
        pspec = partition_spec(spec.axes, rules)
        for size, axis, name in zip(spec.shape, pspec, spec.axes, strict=True):
            if axis is not None and size % mesh.shape[axis]:
                raise ValueError(
                    f"logical axis {name!r} of size {size} does not divide mesh axis {axis!r} "
                    f"of size {mesh.shape[axis]}"
                )
        return NamedSharding(mesh, pspec)

    return jax.tree.map(sharding, param_specs(cfg), is_leaf=is_spec)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pad_for_mesh(cfg: ModelConfig, params: Params, model_axis: int) -> tuple[ModelConfig, Params]:
    """Zero-pad kv heads (and their query groups), MLP width and vocabulary to divide `model_axis`.

    Padded heads have zero projections, so they attend uniformly to zero values and add nothing
    through their zero output rows; padded MLP units output silu(0) * 0 = 0; padded vocabulary
    entries are sliced off the logits by the steps. The padded model computes the same function.
    """
    kv = _round_up(cfg.num_kv_heads, model_axis)
    heads = kv * cfg.num_groups  # query head n belongs to kv head n // groups: pad whole groups
    mlp = _round_up(cfg.intermediate_size, model_axis)
    vocab = _round_up(cfg.vocab_size, model_axis)
    if (kv, mlp, vocab) == (cfg.num_kv_heads, cfg.intermediate_size, cfg.vocab_size):
        return cfg, params
    padded = dataclasses.replace(
        cfg, num_heads=heads, num_kv_heads=kv, intermediate_size=mlp, vocab_size=vocab
    )
    targets = {"heads": heads, "kv_heads": kv, "mlp": mlp, "vocab": vocab}

    def pad(spec, array):
        if array is None:
            return None
        widths = [
            (0, targets.get(axis, size) - size) for axis, size in zip(spec.axes, array.shape, strict=True)
        ]
        return jnp.pad(array, widths) if any(w for _, w in widths) else array

    return padded, jax.tree.map(pad, param_specs(cfg), params, is_leaf=is_spec)


def place_params(cfg: ModelConfig, params: Params, mesh: Mesh, dtype) -> tuple[ModelConfig, Params]:
    """The weights on the mesh: padded for its model axis (`pad_for_mesh`), float values cast to
    `dtype`, each weight placed by its declared sharding. Quantized blocks (one device only: they
    have no sharding rule) are placed as they are. Returns the padded config and the weights."""
    padded_cfg, params = pad_for_mesh(cfg, params, mesh.shape[MODEL])
    whole = NamedSharding(mesh, PartitionSpec())

    def placed(sharding, w):
        return jax.device_put(w, whole) if is_quantized(w) else jax.device_put(w.astype(dtype), sharding)

    return padded_cfg, jax.tree.map(placed, param_shardings(padded_cfg, mesh), params)
