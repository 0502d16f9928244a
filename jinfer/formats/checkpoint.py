"""jinfer's own checkpoint directory: the parameter pytree as an orbax checkpoint (restored
straight into its target sharding), the model config and generation defaults as JSON beside it
(`jinfer_checkpoint.json`), and the tokenizer's files. A quantized weight is stored as its rows of
records (uint8: ggml's blocks, with K-quant scales and 5/6-bit integers as whole bytes; the same
on every CPU; `models.quantized`), its format and shape in the JSON."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from jinfer.config import ModelConfig
from jinfer.formats.hf import maybe_tokenizer
from jinfer.formats.params import CheckpointError, LoadedModel, check_vocab, path_name, placed
from jinfer.models import quantized
from jinfer.models.params import ParamTree, abstract_params, is_spec, param_specs
from jinfer.models.quantized import FORMATS, HostBlocks, HostStack, QuantizedWeight, StackedWeight
from jinfer.sharding import Placement, param_shardings

CHECKPOINT_MARKER = "jinfer_checkpoint.json"
# The parameter layout a checkpoint holds. 2: stacked `wqkv` and `w_gate_up`; 3: weights may be
# quantized blocks. Version 1 was written both before and after the stacking, so it is restored
# when its names match and refused otherwise.
CHECKPOINT_VERSION = 3
_CONVERT_AGAIN = "convert the source model again with this jinfer (`jinfer convert`)"


def save_checkpoint(directory: str, loaded: LoadedModel) -> None:
    """Write params (orbax), config and tokenizer as a jinfer checkpoint directory."""
    import orbax.checkpoint as ocp

    directory = os.path.abspath(directory)
    os.makedirs(directory, exist_ok=True)
    blocks = {}

    def rows(w: QuantizedWeight) -> tuple[dict, np.ndarray]:
        """The weight's records (regrouped once) and their entry in the JSON."""
        data = w.to_host().data
        return {"format": w.format, "shape": list(w.shape), "stored": list(data.shape)}, data

    def stored(path, w):
        if isinstance(w, StackedWeight):
            entries, data = zip(*(rows(p) for p in w.parts), strict=True)
            blocks[path_name(path)] = {"parts": list(entries), "axis": w.axis}
            return tuple(data)
        if isinstance(w, QuantizedWeight):
            blocks[path_name(path)], data = rows(w)
            return data
        return w

    params = jax.tree_util.tree_map_with_path(stored, loaded.params, is_leaf=quantized.is_quantized)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(os.path.join(directory, "params"), params, force=True)
        checkpointer.wait_until_finished()
    if loaded.tokenizer is not None:
        loaded.tokenizer.save(directory)
    meta = {
        "format": "jinfer-checkpoint",
        "version": CHECKPOINT_VERSION,
        "model": loaded.config.to_dict(),
        "generation_defaults": loaded.generation_defaults,
        "converted_from": loaded.source,
        "quantized": blocks,
    }
    with open(os.path.join(directory, CHECKPOINT_MARKER), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)


def _read_meta(directory: str) -> dict:
    """The checkpoint's metadata, once its format version is one this jinfer reads."""
    with open(os.path.join(directory, CHECKPOINT_MARKER), encoding="utf-8") as f:
        meta = json.load(f)
    version = meta.get("version")
    if not isinstance(version, int) or not 1 <= version <= CHECKPOINT_VERSION:
        raise CheckpointError(
            f"{directory}: checkpoint format version {version!r}; this jinfer reads versions 1 to "
            f"{CHECKPOINT_VERSION}: {_CONVERT_AGAIN}"
        )
    return meta


def load_checkpoint(
    directory: str,
    dtype=jnp.float32,
    shardings: ParamTree | None = None,
    quantization: str = "auto",
    placement: Placement | None = None,
) -> LoadedModel:
    """Restore a jinfer checkpoint straight into `shardings` (default: the first device; quantized
    blocks go to it whole), as `quantization` asks (see `formats.params.placed`). A `placement`
    whose mesh the model divides without padding, for a checkpoint of float weights, gives the
    shardings and the dtype (else the checkpoint is restored whole, to be placed afterwards)."""
    import orbax.checkpoint as ocp

    directory = os.path.abspath(directory)
    meta = _read_meta(directory)
    version, cfg = meta["version"], ModelConfig.from_dict(meta["model"])
    if shardings is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: device, param_specs(cfg), is_leaf=is_spec)
    blocks = meta.get("quantized", {})
    if placement is not None and not blocks and placement.fits(cfg):
        shardings, dtype = param_shardings(cfg, placement.mesh), placement.dtype
    first = jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def target_of(path, leaf):
        entry = blocks.get(path_name(path))
        stored = lambda e: jax.ShapeDtypeStruct(tuple(e["stored"]), jnp.uint8, sharding=first)
        if entry is None:
            return leaf
        return tuple(stored(part) for part in entry["parts"]) if "parts" in entry else stored(entry)

    target = jax.tree_util.tree_map_with_path(target_of, abstract_params(cfg, dtype, shardings))
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            params = checkpointer.restore(os.path.join(directory, "params"), target)
    except (FileNotFoundError, ValueError) as e:
        hint = (
            f" (a version 1 checkpoint may hold the unstacked q/k/v and gate/up layout: {_CONVERT_AGAIN})"
            if version < CHECKPOINT_VERSION
            else ""
        )
        raise CheckpointError(f"{directory}: cannot restore params: {e}{hint}") from None

    def weight(path, spec, w):
        entry = blocks.get(path_name(path))
        host = lambda e, data: HostBlocks(FORMATS[e["format"]], np.asarray(data), tuple(e["shape"]))
        if entry is not None and "parts" in entry:
            w = HostStack([host(e, data) for e, data in zip(entry["parts"], w, strict=True)], entry["axis"])
        elif entry is not None:
            w = host(entry, w)
        elif quantization != "int8" or not quantized.int8_quantizable(w.shape, spec.input_dims):
            return w  # restored in place (and sharding) as it is
        return placed(w, spec, dtype, quantization)

    params = jax.tree_util.tree_map_with_path(weight, param_specs(cfg), params, is_leaf=is_spec)
    tokenizer = maybe_tokenizer(directory)
    check_vocab(cfg, tokenizer, directory)
    return LoadedModel(cfg, params, tokenizer, meta.get("generation_defaults", {}), directory)
