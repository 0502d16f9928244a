"""The Hugging Face model directory: `config.json` -> ModelConfig, `*.safetensors` (memory-mapped,
sharded with an index; never pickle) -> named arrays in jinfer's layout, `generation_config.json`
-> the model's sampling defaults, `tokenizer.json` / `tokenizer.model` (+ `tokenizer_config.json`,
`chat_template.jinja`) -> Tokenizer.

Our layout is Hugging Face's ([out, in]) with the head dimensions split out: reshapes only, and
the projections that read the same input stacked (`wqkv`, `w_gate_up`).
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jinfer.config import (
    SUPPORTED_ARCHITECTURES,
    SUPPORTED_ROPE_TYPES,
    ModelConfig,
    RopeConfig,
    UnsupportedModelError,
)
from jinfer.formats.params import CheckpointError, LoadedModel, assemble_params, check_vocab
from jinfer.models import quantized
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
    return _config_from_hf_dict(hf)


def _require(hf: dict[str, Any], key: str):
    if key not in hf:
        raise UnsupportedModelError(f"config.json lacks required field {key!r}")
    return hf[key]


def _rope_from_hf(hf: dict[str, Any]) -> RopeConfig:
    # transformers 5 nests everything under `rope_parameters`; 4.x has `rope_theta` + `rope_scaling`.
    params = dict(hf.get("rope_parameters") or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        kinds = {json.dumps(v, sort_keys=True) for v in params.values()}
        if len(kinds) > 1:
            raise UnsupportedModelError("per-layer-type rope_parameters that differ are not supported")
        params = dict(next(iter(params.values())))
    scaling = dict(hf.get("rope_scaling") or {})
    params = {**scaling, **params}
    theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"unsupported rope scaling type {kind!r}; jinfer supports {SUPPORTED_ROPE_TYPES}"
        )
    if params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedModelError("partial_rotary_factor != 1.0 is not supported")
    original = 0  # only the llama3 and yarn rules use the pre-extension context length
    if kind in ("llama3", "yarn"):
        original = params.get("original_max_position_embeddings") or hf.get("max_position_embeddings", 0)
    factor = params.get("factor")
    if kind == "yarn" and factor is None:
        factor = hf["max_position_embeddings"] / original
    return RopeConfig(
        theta=float(theta),
        kind=kind,
        factor=float(factor if factor is not None else 1.0),
        original_max_position_embeddings=int(original),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=params.get("attention_factor"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)),
    )


def eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _config_from_hf_dict(hf: dict[str, Any]) -> ModelConfig:
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES:
        archs = hf.get("architectures")
        raise UnsupportedModelError(
            f"unsupported model_type {model_type!r} (architectures={archs}); "
            f"jinfer supports {SUPPORTED_ARCHITECTURES}"
        )
    act = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
    if act != "silu":
        raise UnsupportedModelError(f"unsupported hidden_act {act!r}; only 'silu' is implemented")
    if hf.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias=true is not supported")
    if model_type in ("llama", "mistral") and hf.get("attention_bias"):
        raise UnsupportedModelError(
            "attention_bias=true on llama/mistral (output-projection bias) is not supported"
        )
    if model_type == "qwen3" and hf.get("attention_bias"):
        raise UnsupportedModelError("attention_bias=true on qwen3 is not supported")

    num_layers = int(_require(hf, "num_hidden_layers"))
    hidden = int(_require(hf, "hidden_size"))
    heads = int(_require(hf, "num_attention_heads"))
    head_dim = hf.get("head_dim") or hidden // heads

    window = hf.get("sliding_window") or 0
    if model_type == "mistral":
        windows = (int(window),) * num_layers
    elif model_type in ("qwen2", "qwen3") and hf.get("use_sliding_window") and window:
        types = hf.get("layer_types")
        if types is None:  # transformers 4: layers at or beyond max_window_layers slide
            first = int(hf.get("max_window_layers", num_layers))
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
        windows = tuple(int(window) if t == "sliding_attention" else 0 for t in types)
    else:
        windows = (0,) * num_layers

    return ModelConfig(
        architecture=model_type,
        vocab_size=int(_require(hf, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(_require(hf, "intermediate_size")),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope=_rope_from_hf(hf),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2",
        qk_norm=model_type == "qwen3",
        sliding_windows=windows,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids(hf.get("eos_token_id")),
    )


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
