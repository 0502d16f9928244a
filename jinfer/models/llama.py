"""The Llama-family decoder as pure functions over a typed parameter pytree.

One implementation covers Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3 and SmolLM2: they differ only by
flags in `ModelConfig` (q/k/v biases, per-head q/k RMSNorm, sliding windows, tied embeddings, RoPE
scaling), never by code paths chosen from strings at run time.

Data flow:  tokens [B, T] -> embed -> num_layers x (RMSNorm, GQA attention with RoPE, RMSNorm,
SwiGLU MLP) -> final RMSNorm -> hidden [B, T, D];  `logits(params, hidden)` -> [B, T, V].

`param_specs(cfg)` is the single declaration of every weight (shape + logical axes). Random init,
abstract shapes, shardings and loader shape checks are all derived from it (DESIGN rule 2).

Layers are unrolled Python loops over a tuple of per-layer params: on XLA:CPU `lax.scan` over
stacked layers measured ~2x slower than unrolled layers for decode.

Einsum letters: b batch, t query, s key, d model, k kv-head, g group, h head_dim, n head, f mlp, v vocab.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jinfer.config import ModelConfig, RopeConfig
from jinfer.kv_cache import KVCache, write_kv


class ParamSpec(NamedTuple):
    """Declaration of one weight: its shape and a logical axis name per dimension."""

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    init: str  # "ones" for norm scales, "normal" for matrices, "zeros" for biases


@struct.dataclass
class LayerParams:
    attn_norm: jax.Array  # [d]
    wq: jax.Array  # [d, n, h]
    wk: jax.Array  # [d, k, h]
    wv: jax.Array  # [d, k, h]
    wo: jax.Array  # [n, h, d]
    mlp_norm: jax.Array  # [d]
    w_gate: jax.Array  # [d, f]
    w_up: jax.Array  # [d, f]
    w_down: jax.Array  # [f, d]
    bq: jax.Array | None = None  # [n, h]  (qwen2)
    bk: jax.Array | None = None  # [k, h]
    bv: jax.Array | None = None  # [k, h]
    q_norm: jax.Array | None = None  # [h]  (qwen3)
    k_norm: jax.Array | None = None  # [h]


@struct.dataclass
class Params:
    embed: jax.Array  # [v, d]
    layers: tuple[LayerParams, ...]
    final_norm: jax.Array  # [d]
    lm_head: jax.Array | None = None  # [d, v]; None when tied to `embed`


def param_specs(cfg: ModelConfig) -> Params:
    """The one declaration of every weight, as a `Params` tree whose leaves are `ParamSpec`."""
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    norm = lambda: ParamSpec((d,), ("embed",), "ones")

    def layer() -> LayerParams:
        return LayerParams(
            attn_norm=norm(),
            wq=ParamSpec((d, n, h), ("embed", "heads", "head_dim"), "normal"),
            wk=ParamSpec((d, k, h), ("embed", "kv_heads", "head_dim"), "normal"),
            wv=ParamSpec((d, k, h), ("embed", "kv_heads", "head_dim"), "normal"),
            wo=ParamSpec((n, h, d), ("heads", "head_dim", "embed"), "normal"),
            mlp_norm=norm(),
            w_gate=ParamSpec((d, f), ("embed", "mlp"), "normal"),
            w_up=ParamSpec((d, f), ("embed", "mlp"), "normal"),
            w_down=ParamSpec((f, d), ("mlp", "embed"), "normal"),
            bq=ParamSpec((n, h), ("heads", "head_dim"), "zeros") if cfg.qkv_bias else None,
            bk=ParamSpec((k, h), ("kv_heads", "head_dim"), "zeros") if cfg.qkv_bias else None,
            bv=ParamSpec((k, h), ("kv_heads", "head_dim"), "zeros") if cfg.qkv_bias else None,
            q_norm=ParamSpec((h,), ("head_dim",), "ones") if cfg.qk_norm else None,
            k_norm=ParamSpec((h,), ("head_dim",), "ones") if cfg.qk_norm else None,
        )

    return Params(
        embed=ParamSpec((v, d), ("vocab", "embed"), "normal"),
        layers=tuple(layer() for _ in range(cfg.num_layers)),
        final_norm=norm(),
        lm_head=None if cfg.tie_word_embeddings else ParamSpec((d, v), ("embed", "vocab"), "normal"),
    )


def is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def abstract_params(cfg: ModelConfig, dtype=jnp.float32, shardings=None) -> Params:
    """ShapeDtypeStructs for every weight (optionally with shardings): targets for restore and jit."""
    specs = param_specs(cfg)
    if shardings is None:
        return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, dtype), specs, is_leaf=is_spec)
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, dtype, sharding=sh), specs, shardings, is_leaf=is_spec
    )


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, scale: float = 0.02) -> Params:
    """Random weights (normal * scale, norms at 1): for tests, benchmarks and training from scratch."""
    specs = param_specs(cfg)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=is_spec)
    keys = jax.random.split(key, len(leaves))

    def make(spec: ParamSpec, k):
        if spec.init == "ones":
            return jnp.ones(spec.shape, dtype)
        if spec.init == "zeros":
            return jnp.zeros(spec.shape, dtype)
        return (scale * jax.random.normal(k, spec.shape, jnp.float32)).astype(dtype)

    return jax.tree.unflatten(treedef, [make(s, k) for s, k in zip(leaves, keys, strict=True)])


# ---------------------------------------------------------------------------------------- RoPE
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
    """cos, sin [B, T, head_dim] (float32) for the given integer positions [B, T]."""
    inv_freq, scale = rope_inv_freq(cfg.rope, cfg.head_dim)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, h/2]
    angles = jnp.concatenate([angles, angles], axis=-1)  # [B, T, h]
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE (the Hugging Face layout) on x [B, T, heads, h]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    xf = x.astype(jnp.float32)
    out = xf * cos[:, :, None, :] + rotated.astype(jnp.float32) * sin[:, :, None, :]
    return out.astype(x.dtype)


# ----------------------------------------------------------------------------------- blocks
def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def attention(
    q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array, window: int
) -> jax.Array:
    """Causal grouped-query attention.

    q [B, T, N, H]; k, v [B, S, K, H]; q_pos [B, T] and k_pos [B, S] are absolute positions
    (k_pos < 0 marks an empty key slot). A key is visible when k_pos <= q_pos, and also
    q_pos - k_pos < window when the layer has a sliding window. Returns [B, T, N, H].
    """
    b, t, n, h = q.shape
    kv_heads = k.shape[2]
    q = q.reshape(b, t, kv_heads, n // kv_heads, h)
    scores = jnp.einsum("btkgh,bskh->bkgts", q, k, preferred_element_type=jnp.float32)
    scores = scores * (1.0 / math.sqrt(h))
    visible = (k_pos[:, None, :] <= q_pos[:, :, None]) & (k_pos[:, None, :] >= 0)  # [B, T, S]
    if window:
        visible &= q_pos[:, :, None] - k_pos[:, None, :] < window
    scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v)
    return out.reshape(b, t, n, h)


def _attention_block(
    p: LayerParams,
    x: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    positions: jax.Array,
    cache_kv: tuple[jax.Array, jax.Array] | None,
    rows: jax.Array | None,
    attn_len: int | None,
    window: int,
    cfg: ModelConfig,
):
    q = jnp.einsum("btd,dnh->btnh", x, p.wq)
    k = jnp.einsum("btd,dkh->btkh", x, p.wk)
    v = jnp.einsum("btd,dkh->btkh", x, p.wv)
    if cfg.qkv_bias:
        q, k, v = q + p.bq, k + p.bk, v + p.bv
    if cfg.qk_norm:
        q = rms_norm(q, p.q_norm, cfg.rms_norm_eps)
        k = rms_norm(k, p.k_norm, cfg.rms_norm_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if cache_kv is None:
        out = attention(q, k, v, positions, positions, window)
        new_kv = None
    else:
        cache_k, cache_v = write_kv(cache_kv, k, v, positions, rows)
        keys, values = (cache_k, cache_v) if rows is None else (cache_k[rows], cache_v[rows])
        if attn_len is not None:  # the caller knows no position at or past attn_len is in use
            keys, values = keys[:, :attn_len], values[:, :attn_len]
        cache_positions = jnp.arange(keys.shape[1], dtype=positions.dtype)
        k_pos = jnp.broadcast_to(cache_positions, (x.shape[0], cache_positions.shape[0]))
        out = attention(q, keys, values, positions, k_pos, window)
        new_kv = (cache_k, cache_v)
    return jnp.einsum("btnh,nhd->btd", out, p.wo), new_kv


def _mlp_block(p: LayerParams, x: jax.Array) -> jax.Array:
    gate = jnp.einsum("btd,df->btf", x, p.w_gate)
    up = jnp.einsum("btd,df->btf", x, p.w_up)
    return jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, p.w_down)


def forward(
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    cfg: ModelConfig,
    cache: KVCache | None = None,
    rows: jax.Array | None = None,
    attn_len: int | None = None,
) -> tuple[jax.Array, KVCache | None]:
    """Run the decoder over tokens [B, T] at positions [B, T].

    Without a cache the tokens attend to each other causally (full-sequence scoring). With a cache,
    their K/V are written at `positions` (contiguous per row) and they attend to everything cached
    at positions <= their own. Batch entry b uses cache row b, or cache row rows[b] when `rows` [B]
    is given (prefill into chosen slots). With `attn_len` (static) attention reads only the first
    attn_len cache positions: decode cost then follows the filled part of the cache, not its size.
    Returns final-normed hidden states [B, T, D] and the cache.
    """
    positions = jnp.asarray(positions, jnp.int32)
    x = params.embed[tokens]  # [B, T, D]
    cos, sin = rope_cos_sin(positions, cfg)
    new_layers = []
    for i, layer in enumerate(params.layers):
        layer_cache = None if cache is None else (cache.k[i], cache.v[i])
        h = rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)
        window = cfg.sliding_windows[i]
        attn, kv = _attention_block(layer, h, cos, sin, positions, layer_cache, rows, attn_len, window, cfg)
        x = x + attn
        x = x + _mlp_block(layer, rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps))
        new_layers.append(kv)
    hidden = rms_norm(x, params.final_norm, cfg.rms_norm_eps)
    if cache is None:
        return hidden, None
    return hidden, KVCache(k=tuple(kv[0] for kv in new_layers), v=tuple(kv[1] for kv in new_layers))


def logits(params: Params, hidden: jax.Array) -> jax.Array:
    """Project hidden states [..., D] to float32 vocabulary logits [..., V]."""
    if params.lm_head is None:
        return jnp.einsum("...d,vd->...v", hidden, params.embed, preferred_element_type=jnp.float32)
    return jnp.einsum("...d,dv->...v", hidden, params.lm_head, preferred_element_type=jnp.float32)
