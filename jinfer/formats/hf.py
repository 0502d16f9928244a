"""The Hugging Face model directory: `config.json` -> ModelConfig, `*.safetensors` (memory-mapped,
sharded with an index; never pickle) -> named arrays in jinfer's layout, `generation_config.json`
-> the model's sampling defaults, `tokenizer.json` / `tokenizer.model` (+ `tokenizer_config.json`,
`chat_template.jinja`) -> Tokenizer.

What a config.json and the tensor names mean is the model family's (`models.family`, found by the
config's `model_type`); this module reads the files and hands their contents to it.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jinfer.config import ModelConfig
from jinfer.formats.params import CheckpointError, LoadedModel, assemble_params, check_vocab
from jinfer.models import quantized
from jinfer.models.family import family_of, for_hf
from jinfer.sampling import MODEL_DEFAULTS
from jinfer.tokenizer import Backend, HFBackend, SentencePieceBackend, Tokenizer, TokenizerError


def model_config(source: str | os.PathLike | dict[str, Any]) -> ModelConfig:
    """A ModelConfig from a Hugging Face `config.json` (a path, a model directory, or the parsed
    dict; transformers 4 and 5 layouts). Options the forward pass does not implement are rejected
    with a message naming them."""
    if isinstance(source, dict):
        hf = source
    else:
        path = os.fspath(source)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path, encoding="utf-8") as f:
                hf = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"no config.json at {path}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from None
    return for_hf(hf.get("model_type")).hf_config(hf)


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


def _fuse_parts(arrays: dict[str, np.ndarray], stacked_weights) -> dict[str, np.ndarray]:
    """Concatenate each layer's parts into its stacked weight (`Family.stacked`). An incomplete set
    stays under the parts' names, so assemble_params reports the stacked weight missing and the
    parts unexpected."""
    for name in list(arrays):
        stacked, _, part = name.rpartition(".")
        fused = stacked_weights.get(stacked.rpartition(".")[2])
        if fused is None or part != fused[0][0]:
            continue
        names = [f"{stacked}.{p}" for p in fused[0]]
        if all(n in arrays for n in names):
            parts = [arrays.pop(n) for n in names]
            blocks = any(isinstance(p, quantized.HostBlocks) for p in parts)
            arrays[stacked] = quantized.concatenate(parts, fused[1]) if blocks else Stacked(parts, fused[1])
    return arrays


class Stacked:
    """Float parts of one stacked weight, concatenated only where they are read: a placement
    (`jinfer.sharding.Placement`) reads one device's slice at a time, so no whole copy is made."""

    def __init__(self, parts: list[np.ndarray], axis: int):
        self.parts, self.axis, self.dtype = parts, axis, parts[0].dtype
        sizes = [p.shape[axis] for p in parts]
        self.shape = (*parts[0].shape[:axis], sum(sizes), *parts[0].shape[axis + 1 :])

    def __getitem__(self, index: tuple[slice, ...]) -> np.ndarray:
        start, stop, _ = index[self.axis].indices(self.shape[self.axis])
        pieces, offset = [], 0
        for part in self.parts:
            size = part.shape[self.axis]
            low, high = max(start - offset, 0), min(stop - offset, size)
            if low < high:
                pieces.append(part[(*index[: self.axis], slice(low, high), *index[self.axis + 1 :])])
            offset += size
        if not pieces:  # an empty range: a slice lying wholly in the mesh's padding
            return self.parts[0][(*index[: self.axis], slice(0, 0), *index[self.axis + 1 :])]
        return np.concatenate(pieces, axis=self.axis)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        whole = np.concatenate(self.parts, axis=self.axis)
        return whole if dtype is None else whole.astype(dtype)


def named_arrays(cfg: ModelConfig, tensors: Iterator[tuple[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Tensors under their Hugging Face names -> arrays under our weights' paths, in our layout
    (the family's `hf_tensor`), stacked weights joined."""
    family = family_of(cfg)
    out: dict[str, np.ndarray] = {}
    for name, array in tensors:
        if name.endswith("rotary_emb.inv_freq"):
            continue  # a buffer some exporters keep; recomputed from the config
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: some exporters still write a copy of the embedding
        entry = family.hf_tensor(name)
        if entry is None:
            out[name] = array  # reported by assemble_params as unexpected
        else:
            ours, transform = entry
            out[ours] = transform(array, cfg)
    return _fuse_parts(out, family.stacked)


def load_hf(directory: str, dtype=jnp.float32, quantization: str = "auto", placement=None) -> LoadedModel:
    """A Hugging Face model directory; with `quantization` "int8" its matrices are quantized as
    they are read (`assemble_params`); with a `placement` each weight is read slice by slice from
    the memory-mapped files straight onto its shards."""
    cfg = model_config(directory)
    files = _hf_weight_files(directory)

    def tensors():
        for path in files:
            yield from read_safetensors(path).items()

    arrays = named_arrays(cfg, tensors())
    params = assemble_params(cfg, arrays, dtype, directory, quantization, placement)
    tokenizer = maybe_tokenizer(directory)
    check_vocab(cfg, tokenizer, directory)
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


def maybe_tokenizer(directory: str) -> Tokenizer | None:
    names = ("tokenizer.json", "tokenizer.model")
    if any(os.path.exists(os.path.join(directory, n)) for n in names):
        return load_tokenizer_dir(directory)
    return None


# ------------------------------------------------------------------------------ tokenizer
def load_tokenizer_dir(path: str) -> Tokenizer:
    """A tokenizer from a directory: tokenizer.json or tokenizer.model, with tokenizer_config.json
    (special tokens, chat template) or chat_template.jinja."""
    config = _read_json(os.path.join(path, "tokenizer_config.json"))
    template = _chat_template(path, config)
    bos, eos = _token_str(config.get("bos_token")), _token_str(config.get("eos_token"))
    extra_eos = tuple(config.get("jinfer_eos_token_ids", ()))
    tokenizer_json = os.path.join(path, "tokenizer.json")
    sp_model = os.path.join(path, "tokenizer.model")
    if os.path.exists(tokenizer_json):
        from tokenizers import Tokenizer as HFTokenizer

        try:
            tok = HFTokenizer.from_file(tokenizer_json)
        except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
            raise TokenizerError(f"{tokenizer_json} is not a valid tokenizer.json: {e}") from None
        backend: Backend = HFBackend(tok)
    elif os.path.exists(sp_model):
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor()
        try:
            sp.load(sp_model)
        except (OSError, RuntimeError) as e:
            raise TokenizerError(f"{sp_model} is not a valid SentencePiece model: {e}") from None
        backend = SentencePieceBackend(
            sp, config.get("add_bos_token", True), config.get("add_eos_token", False)
        )
        bos = bos or sp.id_to_piece(sp.bos_id()) if sp.bos_id() >= 0 else bos
        eos = eos or sp.id_to_piece(sp.eos_id()) if sp.eos_id() >= 0 else eos
    else:
        raise TokenizerError(f"no tokenizer.json or tokenizer.model in {path}")
    return Tokenizer(backend, bos_token=bos, eos_token=eos, eos_token_ids=extra_eos, chat_template=template)


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path} is not valid JSON: {e}") from None


def _token_str(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _chat_template(directory: str, config: dict[str, Any]) -> str | None:
    jinja = os.path.join(directory, "chat_template.jinja")
    if os.path.exists(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default") or next(iter(named.values()), None)
    return template
