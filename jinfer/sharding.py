"""Device meshes and the logical-axis table: the only module that names mesh axes.

Model code labels each weight dimension with a logical name ("vocab", "heads", "mlp", ...) in
`models.llama.param_specs`. `RULES` maps logical names to mesh axes; everything not listed is
replicated. `param_shardings` turns the declaration into a `NamedSharding` per weight, for jit
and for restoring checkpoints straight into place.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jinfer.config import ModelConfig
from jinfer.models.llama import Params, is_spec, param_specs

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
