"""Model configuration: one frozen, hashable description of a decoder-only transformer.

`ModelConfig` is static under `jax.jit` (it is hashed, never traced). It is built from a Hugging Face
`config.json` (`ModelConfig.from_hf`, transformers 4 and 5 layouts) or from GGUF metadata
(`ModelConfig.from_gguf`), and serialised to JSON for jinfer's own checkpoints (`to_dict` /
`from_dict`). Anything the forward pass does not implement is rejected here, with a message naming
the option, so that an unsupported checkpoint never loads into silently wrong numbers.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from jinfer.options import setting

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class UnsupportedModelError(ValueError):
    """The checkpoint describes a model or option jinfer does not implement."""


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding: base frequency plus an optional context-extension rule."""

    theta: float = 10000.0
    kind: str = "default"  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn; None = derived from factor / mscale
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn
    # Per-frequency divisors as GGUF stores llama3-style scaling (tensor `rope_freqs.weight`).
    freq_divisors: tuple[float, ...] | None = None


@dataclass(frozen=True)
class ModelConfig:
    """Shape and options of a Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM2)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2: biases on the q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    # Attention window per layer; 0 means full causal attention.
    sliding_windows: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architecture {self.architecture!r}; jinfer supports {SUPPORTED_ARCHITECTURES}"
            )
        if self.rope.kind not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"unsupported rope scaling type {self.rope.kind!r}; jinfer supports {SUPPORTED_ROPE_TYPES}"
            )
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if not self.sliding_windows:
            object.__setattr__(self, "sliding_windows", (0,) * self.num_layers)
        if len(self.sliding_windows) != self.num_layers:
            raise UnsupportedModelError(
                f"{len(self.sliding_windows)} layer attention types for {self.num_layers} layers"
            )

    @property
    def num_groups(self) -> int:
        """Query heads per kv head (grouped-query attention)."""
        return self.num_heads // self.num_kv_heads

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        rope = dict(d.pop("rope", {}))
        if rope.get("freq_divisors") is not None:
            rope["freq_divisors"] = tuple(rope["freq_divisors"])
        return cls(
            rope=RopeConfig(**rope),
            sliding_windows=tuple(d.pop("sliding_windows", ())),
            eos_token_ids=tuple(d.pop("eos_token_ids", ())),
            **d,
        )

    # ------------------------------------------------------------------ Hugging Face
    @classmethod
    def from_hf(cls, source: str | os.PathLike | dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face `config.json` (a path, a model directory, or the parsed dict)."""
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

    # ------------------------------------------------------------------ GGUF
    @classmethod
    def from_gguf(cls, meta: dict[str, Any], tensor_names: set[str], rope_freqs=None) -> ModelConfig:
        """Build from GGUF key/value metadata (`general.architecture` and `{arch}.*` keys)."""
        return _config_from_gguf(meta, tensor_names, rope_freqs)


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


def _eos_ids(value) -> tuple[int, ...]:
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
        eos_token_ids=_eos_ids(hf.get("eos_token_id")),
    )


_GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}


def _config_from_gguf(meta: dict[str, Any], tensor_names: set[str], rope_freqs) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported GGUF architecture {arch!r}; jinfer supports {tuple(_GGUF_ARCHITECTURES)}"
        )

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
        architecture=_GGUF_ARCHITECTURES[arch],
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
        eos_token_ids=_eos_ids(eos),
    )


CONTEXT_POLICIES = ("error", "truncate", "drop_oldest")


# Per-request entries the device state has room for (sizes of fixed arrays in each prompt chunk).
MAX_LOGIT_BIAS = 300  # logit_bias entries (OpenAI's limit)
MAX_STOP_IDS = 64  # stop_token_ids + eos ids

# Matrix kernels work in tiles of columns: XLA:CPU multiplied 9 columns no faster than 16. Token
# counts that the engine chooses (a mixed step's chunk, its lm_head columns) round up to this.
COLUMN_TILE = 8


@dataclass(frozen=True)
class EngineConfig:
    """How the engine is asked to lay out the device (each field is a `jinfer serve` / `jinfer
    generate` flag and a TOML key). What it runs with, resolved against the model and the devices,
    is the engine's `Layout` (jinfer.layout); this stays as asked."""

    max_slots: int = setting(8, "sequences decoded at once (slots)")
    max_seq_len: int = setting(2048, "tokens per slot, prompt + output (capped at the model's context)")
    max_queue: int = setting(256, "waiting requests; more are refused (HTTP 429)")
    prefill_buckets: tuple[int, ...] = setting(
        (32, 64, 128, 256, 512), "prompt lengths compiled for; longer prompts go in chunks of the largest"
    )
    prefill_token_budget: int = setting(
        512, "prompt tokens prefilled per engine iteration (at least one chunk)"
    )
    decode_steps: int = setting(4, "decode steps per device dispatch (lax.scan)")
    mixed_prefill_tokens: int = setting(
        0,
        "while requests decode, prefill prompts this many tokens at a time inside the decode steps "
        "(steadier streams, later first tokens); 0: prompts get dispatches of their own",
    )
    dtype: str = setting("float32", "float32 | bfloat16 | float16")
    decode_kernel: bool = setting(
        True,
        "decode attention by a kernel reading each slot's cache in place (CPU: jinfer's C++, float32; "
        "GPU: Pallas, 16-bit); false: XLA's einsums",
    )
    packed_weights: bool | None = setting(
        None,
        "a second, packed copy of each weight matrix for jinfer's CPU matmul kernel (one CPU device, "
        "float32); auto: on where the kernel runs and memory allows",
    )
    mesh_data: int = setting(1, "devices along the data axis (slots are split over it)")
    mesh_model: int = setting(1, "devices along the model axis (heads, MLP width, vocabulary)")
    context_policy: str = setting("error", "for requests that name none: error | truncate | drop_oldest")
    memory_fraction: float = setting(
        0.9, "refuse a layout whose weights + KV cache exceed this share of memory"
    )

    def __post_init__(self):
        positive = ("max_slots", "max_seq_len", "max_queue", "prefill_token_budget", "decode_steps")
        for name in positive:
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if isinstance(self.packed_weights, str) and self.packed_weights.lower() == "auto":
            object.__setattr__(self, "packed_weights", None)
        for name in ("decode_kernel", "packed_weights"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (name == "packed_weights" and value is None):
                raise ValueError(
                    f"{name} must be true or false{' or auto' * (name == 'packed_weights')}, got {value!r}"
                )
        if not isinstance(self.mixed_prefill_tokens, int) or self.mixed_prefill_tokens < 0:
            raise ValueError(
                f"mixed_prefill_tokens must be an integer >= 0, got {self.mixed_prefill_tokens!r}"
            )
        if isinstance(self.prefill_buckets, list):
            object.__setattr__(self, "prefill_buckets", tuple(self.prefill_buckets))
        buckets = self.prefill_buckets
        if (
            not isinstance(buckets, tuple)
            or not buckets
            or not all(isinstance(b, int) and b > 0 for b in buckets)
        ):
            raise ValueError(f"prefill_buckets must be a tuple of positive lengths, got {buckets!r}")
        if self.context_policy not in CONTEXT_POLICIES:
            raise ValueError(f"context_policy must be one of {CONTEXT_POLICIES}, got {self.context_policy!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.max_slots % self.mesh_data:
            raise ValueError(f"max_slots={self.max_slots} must be a multiple of mesh_data={self.mesh_data}")
