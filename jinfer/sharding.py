"""Device meshes and the logical-axis table: the only module that names mesh axes.

Model code labels each weight dimension with a logical name ("vocab", "heads", "mlp", ...) in
its family's `param_specs` (`models.family`). `RULES` maps logical names to mesh axes; everything
not listed is replicated. `param_shardings` turns the declaration into a `NamedSharding` per weight, for jit
and for restoring checkpoints straight into place.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from jinfer.config import ModelConfig
from jinfer.models.params import ParamTree, is_spec, param_specs
from jinfer.models.quantized import is_quantized

DATA, MODEL = "data", "model"
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}  # EngineConfig.dtype

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


def param_shardings(cfg: ModelConfig, mesh: Mesh, rules: dict[str, str | None] = RULES) -> ParamTree:
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


def padded_for_mesh(cfg: ModelConfig, model_axis: int) -> tuple[ModelConfig, dict[str, int]]:
    """The config with kv heads (and their query groups), MLP width and vocabulary rounded up to
    divide `model_axis`, and those logical axes' padded sizes."""
    kv = _round_up(cfg.num_kv_heads, model_axis)
    heads = kv * cfg.num_groups  # query head n belongs to kv head n // groups: pad whole groups
    mlp = _round_up(cfg.intermediate_size, model_axis)
    vocab = _round_up(cfg.vocab_size, model_axis)
    padded = dataclasses.replace(
        cfg, num_heads=heads, num_kv_heads=kv, intermediate_size=mlp, vocab_size=vocab
    )
    return padded, {"heads": heads, "kv_heads": kv, "mlp": mlp, "vocab": vocab}


def pad_for_mesh(cfg: ModelConfig, params: ParamTree, model_axis: int) -> tuple[ModelConfig, ParamTree]:
    """Zero-pad kv heads (and their query groups), MLP width and vocabulary to divide `model_axis`.

    Padded heads have zero projections, so they attend uniformly to zero values and add nothing
    through their zero output rows; padded MLP units output silu(0) * 0 = 0; padded vocabulary
    entries are sliced off the logits by the steps. The padded model computes the same function.
    Weights already padded (loaded into place: `Placement`) are left as they are.
    """
    padded, targets = padded_for_mesh(cfg, model_axis)
    if padded == cfg:
        return cfg, params

    def pad(spec, array):
        if array is None:
            return None
        widths = [
            (0, targets.get(axis, size) - size) for axis, size in zip(spec.axes, array.shape, strict=True)
        ]
        return jnp.pad(array, widths) if any(w for _, w in widths) else array

    return padded, jax.tree.map(pad, param_specs(cfg), params, is_leaf=is_spec)


def place_params(cfg: ModelConfig, params: ParamTree, mesh: Mesh, dtype) -> tuple[ModelConfig, ParamTree]:
    """The weights on the mesh: padded for its model axis (`pad_for_mesh`), float values cast to
    `dtype`, each weight placed by its declared sharding. Quantized blocks (one device only: they
    have no sharding rule) are placed as they are. Returns the padded config and the weights."""
    padded_cfg, params = pad_for_mesh(cfg, params, mesh.shape[MODEL])
    whole = NamedSharding(mesh, PartitionSpec())

    def placed(sharding, w):
        return jax.device_put(w, whole) if is_quantized(w) else jax.device_put(w.astype(dtype), sharding)

    return padded_cfg, jax.tree.map(placed, param_shardings(padded_cfg, mesh), params)


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where and how a loader puts each weight: straight onto its shards of `mesh`, padded for the
    mesh's model axis and cast to `dtype` one device's slice at a time, so that no device (and no
    host buffer beyond the file's own mapping) ever holds a whole float copy of the model."""

    mesh: Mesh
    dtype: object

    def fits(self, cfg: ModelConfig) -> bool:
        """Whether the model's dimensions divide the mesh as they are (no padding)."""
        return padded_for_mesh(cfg, self.mesh.shape[MODEL])[0] == cfg

    def place(self, cfg: ModelConfig, array, spec) -> jax.Array:
        """`array` (host memory, or a memory-mapped file; declared by `spec` of the unpadded `cfg`)
        as a global array sharded as `param_shardings` declares it for the padded model."""
        _, targets = padded_for_mesh(cfg, self.mesh.shape[MODEL])
        shape = tuple(targets.get(axis, size) for axis, size in zip(spec.axes, array.shape, strict=True))
        sharding = NamedSharding(self.mesh, partition_spec(spec.axes))
        dtype = np.dtype(self.dtype)

        def piece(index: tuple[slice, ...]) -> np.ndarray:
            bounds = [s.indices(n)[:2] for s, n in zip(index, shape, strict=True)]
            out = np.zeros([stop - start for start, stop in bounds], dtype)  # zero: padding
            real = tuple(
                slice(start, min(stop, n)) for (start, stop), n in zip(bounds, array.shape, strict=True)
            )
            values = np.asarray(array[real], dtype)  # only this slice is read from a mapped file
            out[tuple(slice(0, n) for n in values.shape)] = values
            return out

        return jax.make_array_from_callback(shape, sharding, piece)
