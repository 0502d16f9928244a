"""How Llama-family checkpoints describe the model (`models.family`): a Hugging Face config.json
and tensor names, a GGUF's metadata and tensor names, read into `ModelConfig` and the weight paths
of `models.params.param_specs`.

Our layout is Hugging Face's ([out, in]) with the head dimensions split out: reshapes only, and
the projections that read the same input stacked (`STACKED`). A GGUF names the same tensors its own
way and keeps their orientation; llama.cpp interleaves the Q/K rows of llama and mistral, undone
here.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from jinfer.config import ModelConfig, RopeConfig, UnsupportedModelError
from jinfer.formats.hf_config import eos_ids, require, rope_from_hf
from jinfer.models.quantized import HostBlocks

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")  # Hugging Face model_type = GGUF architecture

# Stacked weights: their parts, in order, and the axis they are concatenated along.
STACKED = {"wqkv": (("q", "k", "v"), 1), "bqkv": (("q", "k", "v"), 1), "w_gate_up": (("gate", "up"), 0)}


def hf_config(hf: dict[str, Any]) -> ModelConfig:
    """A config.json's dict (its model_type one of `ARCHITECTURES`) -> ModelConfig; options the
    forward pass does not implement are rejected, named."""
    model_type = hf["model_type"]
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

    num_layers = int(require(hf, "num_hidden_layers"))
    hidden = int(require(hf, "hidden_size"))
    heads = int(require(hf, "num_attention_heads"))
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
        vocab_size=int(require(hf, "vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(require(hf, "intermediate_size")),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope=rope_from_hf(hf),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=model_type == "qwen2",
        qk_norm=model_type == "qwen3",
        sliding_windows=windows,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids(hf.get("eos_token_id")),
    )


_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_HF_TOP = {
    "model.embed_tokens.weight": "embed",
    "model.norm.weight": "final_norm",
    "lm_head.weight": "lm_head",
}


def hf_tensor(name: str) -> tuple[str, Callable[[np.ndarray, ModelConfig], np.ndarray]] | None:
    """A Hugging Face tensor name -> (our weight's path, transform(array, cfg)); None for a name
    this family has no weight for."""
    if name in _HF_TOP:
        return _HF_TOP[name], lambda w, c: w
    if (m := _HF_LAYER.fullmatch(name)) and (entry := _hf_layer_tensor(m.group(2))):
        ours, transform = entry
        return f"layers.{m.group(1)}.{ours}", transform
    return None


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


def gguf_config(meta: dict[str, Any], tensor_names: set[str], rope_freqs) -> ModelConfig:
    """GGUF key/value metadata (`general.architecture` one of `ARCHITECTURES`, and its `{arch}.*`
    keys), the file's tensor names and its `rope_freqs` tensor (or None) -> ModelConfig."""
    arch = meta["general.architecture"]

    def get(key, default=None):
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise UnsupportedModelError(f"GGUF metadata lacks {arch}.{key}")
        return value

    num_layers = int(get("block_count"))
    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or hidden // heads)
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    theta = float(get("rope.freq_base", 10000.0))
    if rope_freqs is not None:
        rope = RopeConfig(theta=theta, freq_divisors=tuple(float(x) for x in rope_freqs))
    elif scaling in ("none", None):
        rope = RopeConfig(theta=theta)
    elif scaling in ("linear", "yarn"):
        rope = RopeConfig(
            theta=theta,
            kind=scaling,
            factor=float(get("rope.scaling.factor")),
            original_max_position_embeddings=int(meta.get(f"{arch}.rope.scaling.original_context_length", 0)),
        )
    else:
        raise UnsupportedModelError(f"unsupported GGUF rope scaling type {scaling!r}")
    window = int(meta.get(f"{arch}.attention.sliding_window", 0) or 0)
    eos = meta.get("tokenizer.ggml.eos_token_id")
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens", ()))
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope=rope,
        max_position_embeddings=int(get("context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        sliding_windows=(window,) * num_layers,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_ids(eos),
    )


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


def _unpermute_qk(w: np.ndarray | HostBlocks, heads: int) -> np.ndarray | HostBlocks:
    """Undo llama.cpp's interleaving of Q/K rows (its RoPE pairs adjacent dims; HF's pairs halves)."""
    out_dim = w.shape[0]
    order = np.arange(out_dim).reshape(heads, out_dim // heads // 2, 2).swapaxes(1, 2).reshape(-1)
    if isinstance(w, HostBlocks):
        return dataclasses.replace(w, data=w.data[order])
    return w[order]


_GGUF_TOP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def gguf_tensor(name: str, w, cfg: ModelConfig):
    """A GGUF tensor -> (its Hugging Face name, the array in Hugging Face's layout: GGUF keeps
    [out, in], llama.cpp's Q/K row interleaving undone for llama and mistral), or None for a name
    this family has no weight for."""
    if name in _GGUF_TOP:
        return _GGUF_TOP[name], w
    m = _GGUF_LAYER.fullmatch(name)
    if not m or m.group(2) not in _GGUF_TO_HF:
        return None
    suffix = m.group(2)
    if cfg.architecture in ("llama", "mistral"):
        if suffix.startswith("attn_q."):
            w = _unpermute_qk(w, cfg.num_heads)
        elif suffix.startswith("attn_k."):
            w = _unpermute_qk(w, cfg.num_kv_heads)
    return f"model.layers.{m.group(1)}.{_GGUF_TO_HF[suffix]}", w
