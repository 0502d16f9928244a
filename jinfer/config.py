"""Model configuration: one frozen, hashable description of a decoder-only transformer.

`ModelConfig` is static under `jax.jit` (it is hashed, never traced). The formats build it
(`jinfer.formats.hf.model_config` from a `config.json`, `jinfer.formats.gguf.model_config` from GGUF
metadata) and jinfer's own checkpoints serialise it (`to_dict` / `from_dict`). Anything the forward
pass does not implement is rejected, with a message naming the option, so that an unsupported
checkpoint never loads into silently wrong numbers. `EngineConfig` is how an engine is asked to lay
out the device (`jinfer.layout` resolves it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from jinfer.options import setting

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
    """Shape and options of a decoder. `architecture` names its family (`jinfer.models.family`: the
    Hugging Face model_type it registered under); the options are the Llama family's (Llama 2/3,
    Mistral, Qwen2/2.5, Qwen3, SmolLM2), which a variant family may share."""

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


CONTEXT_POLICIES = ("error", "truncate", "drop_oldest")
QUANTIZATIONS = ("auto", "int8", "none")
QUANTIZED_ACTIVATIONS = ("float32", "int8")  # how quantized weights multiply (`models.quantized`)


# Per-request entries the device state has room for (sizes of fixed arrays in each prompt chunk).
MAX_LOGIT_BIAS = 300  # logit_bias entries (OpenAI's limit)
MAX_STOP_IDS = 64  # stop_token_ids + eos ids


SPECULATIVE = ("off", "ngram", "draft")  # where draft tokens come from (`speculative.DRAFT_SOURCES`)
SPECULATIVE_POLICIES = ("measured", "always")  # when drafts are verified (`speculation.Speculation`)


# EngineConfig's settings that take one of a few values, and those values.
CHOICES = {
    "speculative": SPECULATIVE,
    "speculative_policy": SPECULATIVE_POLICIES,
    "quantization": QUANTIZATIONS,
    "draft_quantization": QUANTIZATIONS,
    "quantized_activations": QUANTIZED_ACTIVATIONS,
    "context_policy": CONTEXT_POLICIES,
    "dtype": ("float32", "bfloat16", "float16"),
}


# Matrix kernels work in tiles of columns: XLA:CPU multiplied 9 columns no faster than 16. The
# few-column kernels take whole tiles (`cpu_matmul.MAX_COLUMNS`).
COLUMN_TILE = 8

# Prompt tokens go to the device in pieces of this many (`jinfer.state.PrefillChunk`): a dispatch
# carries whole pieces of as many requests' prompts as fit the iteration's token budget. Its
# products then always have a multiple of 64 columns. jinfer's CPU kernels give a column the same
# bits at any count; where XLA's GEMM multiplies (packed weights off), it did at multiples of 64 on
# the AVX-512 EPYC measured (at other counts its tiling changed a column's sums), so a prompt
# token's K/V do not depend on what else its dispatch carried.
PROMPT_PIECE = 64


@dataclass(frozen=True)
class EngineConfig:
    """How the engine is asked to lay out the device (each field is a `jinfer serve` / `jinfer
    generate` flag and a TOML key). What it runs with, resolved against the model and the devices,
    is the engine's `Layout` (jinfer.layout); this stays as asked."""

    max_slots: int | None = setting(
        None,
        "sequences decoded at once (slots: a row of state each, their K/V in the shared page pool); "
        "auto: 32 on a CPU (8 per data shard with mesh_data > 1), 256 on an accelerator",
    )
    max_seq_len: int = setting(
        2048, "the longest one sequence may grow, prompt + output (capped at the model's context)"
    )
    kv_cache_tokens: int | None = setting(
        None,
        "positions the shared KV page pool holds, rounded up to whole pages; auto: max_seq_len x "
        "max_slots, at most 8, on a CPU, memory_fraction of free memory on an accelerator (at least "
        "max_seq_len)",
    )
    page_size: int | None = setting(
        None, "positions per KV page (a power of two, 8 to 512); auto: 64 on a CPU, 16 on an accelerator"
    )
    prefix_caching: bool = setting(
        True, "reuse the KV pages of prompt prefixes computed before (shared system prompts, chat turns)"
    )
    max_queue: int = setting(256, "waiting requests; more are refused (HTTP 429)")
    max_num_batched_tokens: int = setting(
        512,
        "tokens one engine iteration computes: every running request's decode tokens first, then "
        f"prompt pieces of {PROMPT_PIECE} tokens from as many waiting and partly-prefilled requests as "
        "fit (at least one piece)",
    )
    decode_steps: int = setting(
        4,
        "decode steps per decode dispatch; a row riding with prompt pieces takes one, and so does "
        "background work (priority above 0) running alone",
    )
    speculative: str = setting(
        "off",
        "ngram: decode steps verify draft tokens looked up in each request's own prompt and output; "
        "draft: guessed by draft_model (exact either way: the same tokens as without; used only where "
        "it pays); off (draft when draft_model is set)",
    )
    speculative_policy: str = setting(
        "measured",
        "measured: verify drafts only where their expected gain pays for a verify step's measured "
        "cost; always: verify every draft there is, whatever it costs (to study acceptance, or on "
        "a machine too noisy to time)",
    )
    num_draft_tokens: int = setting(8, "the most draft tokens a speculative decode step verifies per request")
    draft_model: str | None = setting(
        None,
        "a smaller model of the same vocabulary that drafts for speculative decoding (any path jinfer "
        "loads; its own KV cache beside the model's)",
    )
    draft_quantization: str = setting(
        "auto", "how the draft model's weights are held (as quantization; e.g. a Q4 draft of a float model)"
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
    quantization: str = setting(
        "auto",
        "auto: weights held as the file holds them (a GGUF's Q8_0 / Q4_x / Q5_x / Q4_K / Q5_K / "
        "Q6_K matrices stay quantized, multiplied by jinfer's CPU kernel: one CPU device, float32); "
        "int8: float matrices quantized at load (weight-only, per output channel); none: all "
        "dequantized",
    )
    quantized_activations: str = setting(
        "float32",
        "how Q8_0 / Q5_0 / Q4_0 / Q4_1 / Q5_1 (and int8) weights multiply: float32: dequantized in "
        "registers, the dequantized model's numbers; int8: activations rounded to 8 bits per 32 "
        "inputs and integer dot products, llama.cpp's arithmetic (faster; greedy text may part from "
        "the float model's where two tokens are close)",
    )
    max_loras: int = setting(
        0,
        "low-rank adapters held at once (jinfer.lora), each request on one of them or on none: a "
        "stack of this many beside the weights, read only by steps where some row has an adapter; "
        "0: none",
    )
    max_lora_rank: int = setting(
        16, "the highest rank an adapter may have (each held adapter takes this many rows)"
    )
    mesh_data: int = setting(1, "devices along the data axis (slots are split over it)")
    mesh_model: int = setting(1, "devices along the model axis (heads, MLP width, vocabulary)")
    context_policy: str = setting("error", "for requests that name none: error | truncate | drop_oldest")
    memory_fraction: float = setting(
        0.9, "refuse a layout whose packed weights + KV cache exceed this share of free memory"
    )
    coordinator: str | None = setting(
        None,
        "HOST:PORT where process 0 runs the coordination service, to serve one model from several "
        "processes (jinfer.cluster; unset: JAX_COORDINATOR_ADDRESS, else one process)",
    )
    num_processes: int | None = setting(None, "processes serving the model together (with coordinator)")
    process_id: int | None = setting(
        None, "this process's rank: 0 leads (HTTP, scheduler), the others follow its device calls"
    )
    follower_timeout_s: float = setting(
        10.0, "a follower silent this long is taken for dead: requests fail, the server answers 503"
    )
    compile_cache: str = setting(
        "auto",
        "a folder where compiled programs are kept, so the next start loads them instead of "
        "compiling; auto: one per machine under ~/.cache/jinfer/xla (or JAX's own, when set); off",
    )

    def __post_init__(self):
        for name in ("max_slots", "kv_cache_tokens", "page_size", "packed_weights"):  # auto: None
            if isinstance(getattr(self, name), str) and getattr(self, name).lower() == "auto":
                object.__setattr__(self, name, None)
        positive = ("max_slots", "max_seq_len", "max_queue", "max_num_batched_tokens", "decode_steps")
        positive += ("num_draft_tokens", "max_lora_rank")
        for name in positive:
            if name == "max_slots" and self.max_slots is None:  # auto
                continue
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if not isinstance(self.max_loras, int) or self.max_loras < 0:
            raise ValueError(f"max_loras must be a non-negative integer, got {self.max_loras!r}")
        if self.kv_cache_tokens is not None and (
            not isinstance(self.kv_cache_tokens, int) or self.kv_cache_tokens < 1
        ):
            raise ValueError(f"kv_cache_tokens must be a positive integer, got {self.kv_cache_tokens!r}")
        page = self.page_size
        if page is not None and (not isinstance(page, int) or not 8 <= page <= 512 or page & (page - 1)):
            raise ValueError(f"page_size must be a power of two from 8 to 512, got {page!r}")
        for name in ("decode_kernel", "packed_weights", "prefix_caching"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (name == "packed_weights" and value is None):
                raise ValueError(
                    f"{name} must be true or false{' or auto' * (name == 'packed_weights')}, got {value!r}"
                )
        for name, choices in CHOICES.items():
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}, got {getattr(self, name)!r}")
        if self.draft_model is not None and self.speculative == "off":
            object.__setattr__(self, "speculative", "draft")
        if (self.speculative == "draft") != (self.draft_model is not None):
            raise ValueError(
                f"speculative={self.speculative} with draft_model={self.draft_model!r}: a draft model "
                "drafts with speculative=draft, and speculative=draft needs one"
            )
        self._check_process_settings()
        if self.max_slots is not None and self.max_slots % self.mesh_data:
            raise ValueError(f"max_slots={self.max_slots} must be a multiple of mesh_data={self.mesh_data}")

    def _check_process_settings(self):
        """How this process starts: the cluster it joins, its follower timeout, its compile cache."""
        if self.coordinator is not None and (
            not isinstance(self.coordinator, str) or not self.coordinator.rpartition(":")[2].isdigit()
        ):
            raise ValueError(f"coordinator must be HOST:PORT, got {self.coordinator!r}")
        processes = self.num_processes
        if processes is not None and (not isinstance(processes, int) or processes < 1):
            raise ValueError(f"num_processes must be a positive integer, got {self.num_processes!r}")
        if self.process_id is not None and (
            not isinstance(self.process_id, int)
            or not 0 <= self.process_id < (self.num_processes or self.process_id + 1)
        ):
            raise ValueError(f"process_id must be 0 to num_processes - 1, got {self.process_id!r}")
        if not isinstance(self.compile_cache, str) or not self.compile_cache:
            raise ValueError(f"compile_cache must be auto, off or a folder, got {self.compile_cache!r}")
        if not isinstance(self.follower_timeout_s, int | float) or self.follower_timeout_s < 1:
            raise ValueError(f"follower_timeout_s must be at least 1, got {self.follower_timeout_s!r}")
