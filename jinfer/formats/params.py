"""What every model format yields: named numpy arrays checked against the one parameter
declaration (the model family's `param_specs`) and assembled into the parameter pytree, and the
`LoadedModel` a loader returns. Format errors are `CheckpointError`s naming the file and tensor."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jinfer.config import ModelConfig
from jinfer.models import quantized
from jinfer.models.params import ParamTree, is_spec, param_specs
from jinfer.models.quantized import HostBlocks, HostStack, QuantizedWeight, StackedWeight
from jinfer.sharding import Placement
from jinfer.tokenizer import Tokenizer


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated, or does not match its config."""


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    params: ParamTree
    tokenizer: Tokenizer | None
    generation_defaults: dict[str, Any]  # from generation_config.json (temperature, top_p, ...)
    source: str

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """End-of-sequence ids from the config, the tokenizer and generation_config.json."""
        tokenizer_eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else ()
        eos = [*self.config.eos_token_ids, *tokenizer_eos, *self.generation_defaults.get("eos_token_ids", [])]
        return tuple(dict.fromkeys(eos))


def param_paths(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter path of `cfg` with its declared shape."""
    flat, _ = jax.tree_util.tree_flatten_with_path(param_specs(cfg), is_leaf=is_spec)
    return {path_name(path): spec.shape for path, spec in flat}


def path_name(path) -> str:
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.GetAttrKey):
            parts.append(key.name)
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        else:
            parts.append(str(getattr(key, "key", key)))
    return ".".join(parts)


def assemble_params(
    cfg: ModelConfig,
    arrays: dict[str, np.ndarray | HostBlocks | HostStack],
    dtype=jnp.float32,
    source: str = "checkpoint",
    quantization: str = "auto",
    placement: Placement | None = None,
) -> ParamTree:
    """Check named arrays against the declaration and place them on the device: float values as
    `dtype` (matrices quantized to int8 when `quantization` is "int8"), quantized blocks as they
    are (dequantized when it is "none"). With a `placement` (a mesh of several devices, which
    holds no quantized blocks) every weight goes straight onto its shards, as the placement's dtype."""
    expected = param_paths(cfg)
    missing = sorted(set(expected) - set(arrays))
    if missing:
        raise CheckpointError(
            f"{source}: missing tensors for {missing[:5]}{' ...' if len(missing) > 5 else ''}"
        )
    unexpected = sorted(set(arrays) - set(expected))
    if unexpected:
        raise CheckpointError(f"{source}: unexpected tensors {unexpected[:5]}")
    for name, shape in expected.items():
        if tuple(arrays[name].shape) != shape:
            raise CheckpointError(
                f"{source}: tensor {name} has shape {tuple(arrays[name].shape)}, config expects {shape}"
            )
    specs = param_specs(cfg)
    flat, treedef = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)
    if placement is not None:
        leaves = [placement.place(cfg, host_floats(arrays[path_name(p)]), spec) for p, spec in flat]
    else:
        leaves = [placed(arrays[path_name(p)], spec, dtype, quantization) for p, spec in flat]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def host_floats(array):
    """A weight's values in host memory: float arrays as they are, quantized blocks dequantized
    (one weight at a time on the default device, as ggml computes them)."""
    if isinstance(array, HostBlocks | HostStack):
        weight = (QuantizedWeight if isinstance(array, HostBlocks) else StackedWeight).from_host(array)
        return np.asarray(quantized.dequantize(weight, jnp.float32))
    return array


def placed(array, spec, dtype, quantization: str):
    """One loaded weight (declared by `spec`) on the device, as `quantization` asks."""
    if isinstance(array, HostBlocks | HostStack):
        weight = (QuantizedWeight if isinstance(array, HostBlocks) else StackedWeight).from_host(array)
        return quantized.dequantize(weight, dtype) if quantization == "none" else weight
    if quantization == "int8" and quantized.int8_quantizable(array.shape, spec.input_dims):
        return QuantizedWeight.from_host(quantized.quantize_int8(np.asarray(array), spec.input_dims))
    return jnp.asarray(np.asarray(array), dtype=dtype)


def check_vocab(cfg: ModelConfig, tokenizer: Tokenizer | None, source: str) -> None:
    if tokenizer is not None and tokenizer.vocab_size > cfg.vocab_size:
        raise CheckpointError(
            f"{source}: tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
            f"{cfg.vocab_size}: the tokenizer does not belong to this model"
        )
