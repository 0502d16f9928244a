"""jinfer's own checkpoint directory: the parameter pytree as an orbax checkpoint (restored
straight into its target sharding), the model config and generation defaults as JSON beside it
(`jinfer_checkpoint.json`), and the tokenizer's files."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp

from jinfer.config import ModelConfig
from jinfer.formats.hf import maybe_tokenizer
from jinfer.formats.params import CheckpointError, LoadedModel, check_vocab
from jinfer.models.llama import Params, abstract_params, is_spec, param_specs

CHECKPOINT_MARKER = "jinfer_checkpoint.json"
# The parameter layout a checkpoint holds. 2: stacked `wqkv` and `w_gate_up`. Version 1 was written
# both before and after that change, so it is restored when its names match and refused otherwise.
CHECKPOINT_VERSION = 2
_CONVERT_AGAIN = "convert the source model again with this jinfer (`jinfer convert`)"


def save_checkpoint(directory: str, loaded: LoadedModel) -> None:
    """Write params (orbax), config and tokenizer as a jinfer checkpoint directory."""
    import orbax.checkpoint as ocp

    directory = os.path.abspath(directory)
    os.makedirs(directory, exist_ok=True)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(os.path.join(directory, "params"), loaded.params, force=True)
        checkpointer.wait_until_finished()
    if loaded.tokenizer is not None:
        loaded.tokenizer.save(directory)
    meta = {
        "format": "jinfer-checkpoint",
        "version": CHECKPOINT_VERSION,
        "model": loaded.config.to_dict(),
        "generation_defaults": loaded.generation_defaults,
        "converted_from": loaded.source,
    }
    with open(os.path.join(directory, CHECKPOINT_MARKER), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)


def load_checkpoint(directory: str, dtype=jnp.float32, shardings: Params | None = None) -> LoadedModel:
    """Restore a jinfer checkpoint straight into `shardings` (default: the first device)."""
    import orbax.checkpoint as ocp

    directory = os.path.abspath(directory)
    with open(os.path.join(directory, CHECKPOINT_MARKER), encoding="utf-8") as f:
        meta = json.load(f)
    version = meta.get("version")
    if not isinstance(version, int) or not 1 <= version <= CHECKPOINT_VERSION:
        raise CheckpointError(
            f"{directory}: checkpoint format version {version!r}; this jinfer reads versions 1 to "
            f"{CHECKPOINT_VERSION}: {_CONVERT_AGAIN}"
        )
    cfg = ModelConfig.from_dict(meta["model"])
    if shardings is None:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: device, param_specs(cfg), is_leaf=is_spec)
    target = abstract_params(cfg, dtype, shardings)
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
    tokenizer = maybe_tokenizer(directory)
    check_vocab(cfg, tokenizer, directory)
    return LoadedModel(cfg, params, tokenizer, meta.get("generation_defaults", {}), directory)
