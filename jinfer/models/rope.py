"""Rotary position embeddings: inverse frequencies per scaling rule (default, linear, llama3,
yarn, GGUF's per-frequency divisors) and the rotate-half rotation of head vectors."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jinfer.config import ModelConfig, RopeConfig


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> tuple[np.ndarray, float]:
    """Inverse frequencies [head_dim // 2] (float32) and the cos/sin scale, per the scaling rule."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / head_dim
    pos_freqs = np.float32(rope.theta) ** exponents
    inv_freq = (1.0 / pos_freqs).astype(np.float32)
    scale = 1.0
    if rope.freq_divisors is not None:
        inv_freq = inv_freq / np.asarray(rope.freq_divisors, np.float32)
    elif rope.kind == "linear":
        inv_freq = inv_freq / np.float32(rope.factor)
    elif rope.kind == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = np.where(medium, smoothed, scaled).astype(np.float32)
    elif rope.kind == "yarn":
        inv_freq, scale = _yarn(rope, head_dim, pos_freqs)
    return inv_freq.astype(np.float32), float(scale)


def _yarn(rope: RopeConfig, dim: int, pos_freqs: np.ndarray) -> tuple[np.ndarray, float]:
    def mscale(factor, m=1.0):
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if rope.attention_factor is not None:
        attention_factor = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = mscale(rope.factor, rope.mscale) / mscale(rope.factor, rope.mscale_all_dim)
    else:
        attention_factor = mscale(rope.factor)

    def correction_dim(rotations):
        ratio = rope.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(ratio) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (rope.factor * pos_freqs)
    inv_freq = interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight
    return inv_freq, attention_factor


def rope_cos_sin(positions: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """cos, sin [..., head_dim] (float32) for integer positions [...]."""
    inv_freq, scale = rope_inv_freq(cfg.rope, cfg.head_dim)
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)  # [..., h/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [..., h]
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE (the Hugging Face layout) on head vectors x [..., h], cos and sin
    broadcasting to it. Applied with the head dim minor, a token's rotation is the same vector code
    however many tokens share the array (with tokens minor, XLA:CPU computed a decode token's
    differently alone than beside others: other bits)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    out = x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin
    return out.astype(x.dtype)
