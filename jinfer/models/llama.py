"""The Llama-family decoder as pure functions over a typed parameter pytree.

One implementation covers Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3 and SmolLM2: they differ only by
flags in `ModelConfig` (q/k/v biases, per-head q/k RMSNorm, sliding windows, tied embeddings, RoPE
scaling), never by code paths chosen from strings at run time.

Data flow:  tokens [B, T] -> embed -> num_layers x (RMSNorm, GQA attention with RoPE, RMSNorm,
SwiGLU MLP) -> final RMSNorm -> hidden [B, T, D];  `logits(params, hidden)` -> [B, T, V].
`forward_groups` runs several token groups (decoding slots, a prompt chunk) through one pass of
the weights, each with its own attention; on a GPU one-token groups may attend with a Pallas kernel,
on a CPU every group that reads the cache with a C++ one (`jinfer.kernels.cpu_attention`).

Layouts, chosen from XLA:CPU profiles of the decode step (scripts/profile_decode.py):
  * Weights are stored as Hugging Face stores them, output features first ([out..., in]), so each
    projection is one plain 2-D matrix product W[out, in] @ x[in, N] whose reshapes are free
    bitcasts. (A [heads, head_dim, d] weight contracted over two dims made XLA re-lay-out the whole
    matrix on every step, which cost more than the product itself.) Projections that read the same
    input are stacked so a step reads them in one product: `wqkv` [k, g + 2, h, d] (each kv head's
    query group, key and value: split over kv heads, a tensor-parallel shard holds whole groups) and
    `w_gate_up` [2, f, d]. Bigger products run closer to the bandwidth (on an H200 a batch-1
    [28672, 4096] product ran at 0.79 of it, each [14336, 4096] half at 0.57).
  * Inside the decoder, activations are feature-major columns x[D, N] (N = B * T tokens):
    XLA:CPU multiplies W @ x ~1.6x faster than x @ W^T when N is a handful of decode slots.
  * On a CPU the engine may keep each matrix as a `PackedWeight` (`pack_weights`): the matrix plus
    a copy packed for jinfer's few-column kernel, which products of up to 32 columns use (decode
    steps, short prompt chunks; XLA:CPU's GEMM runs 2-16 columns below the bandwidth); longer
    prompt chunks keep XLA's dot.
  * `jax.named_scope`s (qkv_proj, kv_write, attention, out_proj, mlp, logits) label the compiled
    ops so a profile can be read per part of the model.

`param_specs(cfg)` is the single declaration of every weight (shape + logical axes). Random init,
abstract shapes, shardings and loader shape checks are all derived from it (DESIGN rule 2).

Layers are unrolled Python loops over a tuple of per-layer params: on XLA:CPU `lax.scan` over
stacked layers measured ~2x slower than unrolled layers for decode.

Einsum letters: b batch, t query, s key, d model, k kv-head, g group, h head_dim, n head, f mlp, v vocab.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jinfer.config import ModelConfig, RopeConfig
from jinfer.kernels import cpu_attention, cpu_matmul
from jinfer.kv_cache import KVCache, write_kv


class ParamSpec(NamedTuple):
    """Declaration of one weight: its shape and a logical axis name per dimension."""

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    init: str  # "ones" for norm scales, "normal" for matrices, "zeros" for biases


@struct.dataclass
class LayerParams:
    attn_norm: jax.Array  # [d]
    wqkv: jax.Array  # [k, g + 2, h, d]: per kv head, its g query heads, then its key and value heads
    wo: jax.Array  # [d, n, h]
    mlp_norm: jax.Array  # [d]
    w_gate_up: jax.Array  # [2, f, d]: gate and up projections stacked (one product per step)
    w_down: jax.Array  # [d, f]
    bqkv: jax.Array | None = None  # [k, g + 2, h]  (qwen2)
    q_norm: jax.Array | None = None  # [h]  (qwen3)
    k_norm: jax.Array | None = None  # [h]


@struct.dataclass
class Params:
    embed: jax.Array  # [v, d]
    layers: tuple[LayerParams, ...]
    final_norm: jax.Array  # [d]
    lm_head: jax.Array | None = None  # [v, d]; None when tied to `embed`


def param_specs(cfg: ModelConfig) -> Params:
    """The one declaration of every weight, as a `Params` tree whose leaves are `ParamSpec`."""
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    n, k, g, h = cfg.num_heads, cfg.num_kv_heads, cfg.num_groups, cfg.head_dim
    norm = lambda: ParamSpec((d,), ("embed",), "ones")

    def layer() -> LayerParams:
        return LayerParams(
            attn_norm=norm(),
            wqkv=ParamSpec((k, g + 2, h, d), ("kv_heads", None, "head_dim", "embed"), "normal"),
            wo=ParamSpec((d, n, h), ("embed", "heads", "head_dim"), "normal"),
            mlp_norm=norm(),
            w_gate_up=ParamSpec((2, f, d), (None, "mlp", "embed"), "normal"),
            w_down=ParamSpec((d, f), ("embed", "mlp"), "normal"),
            bqkv=ParamSpec((k, g + 2, h), ("kv_heads", None, "head_dim"), "zeros") if cfg.qkv_bias else None,
            q_norm=ParamSpec((h,), ("head_dim",), "ones") if cfg.qk_norm else None,
            k_norm=ParamSpec((h,), ("head_dim",), "ones") if cfg.qk_norm else None,
        )

    return Params(
        embed=ParamSpec((v, d), ("vocab", "embed"), "normal"),
        layers=tuple(layer() for _ in range(cfg.num_layers)),
        final_norm=norm(),
        lm_head=None if cfg.tie_word_embeddings else ParamSpec((v, d), ("vocab", "embed"), "normal"),
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
    """Random weights (normal * scale, norms at 1): for tests, benchmarks and training from scratch.

    Called eagerly, each distinct weight shape is one small compiled program: one program for the
    whole tree took two minutes to compile for a Llama-3-8B shape on an H200."""
    leaves, treedef = jax.tree.flatten(param_specs(cfg), is_leaf=is_spec)
    keys = jax.random.split(key, len(leaves))
    dtype = jnp.dtype(dtype)
    made = [
        _random_leaf(k, spec.shape, spec.init, dtype, scale) for spec, k in zip(leaves, keys, strict=True)
    ]
    return jax.tree.unflatten(treedef, made)


@partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _random_leaf(key: jax.Array, shape: tuple[int, ...], init: str, dtype, scale: float) -> jax.Array:
    if init == "ones":
        return jnp.ones(shape, dtype)
    if init == "zeros":
        return jnp.zeros(shape, dtype)
    return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


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
    """cos, sin [head_dim, N] (float32) for integer positions [B, T], columns in token order."""
    inv_freq, scale = rope_inv_freq(cfg.rope, cfg.head_dim)
    angles = jnp.asarray(inv_freq)[:, None] * positions.reshape(1, -1).astype(jnp.float32)  # [h/2, N]
    angles = jnp.concatenate([angles, angles], axis=0)  # [h, N]
    return jnp.cos(angles) * scale, jnp.sin(angles) * scale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE (the Hugging Face layout) on columns x [..., h, N]."""
    half = x.shape[-2] // 2
    rotated = jnp.concatenate([-x[..., half:, :], x[..., :half, :]], axis=-2)
    out = x.astype(jnp.float32) * cos + rotated.astype(jnp.float32) * sin
    return out.astype(x.dtype)


# ----------------------------------------------------------------------------------- blocks
def rms_norm(x: jax.Array, weight: jax.Array, eps: float, axis: int = 0) -> jax.Array:
    """RMSNorm of x over `axis` (features; axis 0 for decoder columns [D, N]), scaled by weight."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=axis, keepdims=True) + eps)
    shape = [1] * x.ndim
    shape[axis] = -1
    return weight.reshape(shape) * xf.astype(x.dtype)


def full_precision(dtype) -> jax.lax.Precision:
    """float32 operands get float32 products. Without this, XLA on NVIDIA GPUs rounds them to TF32
    (an H200 put logits 6e-3 off where the parity tests allow 7e-4); 16-bit operands are unaffected."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


@struct.dataclass
class PackedWeight:
    """A weight matrix [out..., in...] with a second copy packed for the CPU few-column kernel
    (`jinfer.kernels.cpu_matmul`): products of up to `cpu_matmul.MAX_COLUMNS` columns (decode steps)
    read `packed`, longer ones (prompts) `matrix` with XLA's dot, which is faster there."""

    matrix: jax.Array
    packed: jax.Array  # [ceil(out / R), in, R] (R = cpu_matmul.block_rows()), out and in flattened


def pack_weights(params: Params) -> Params:
    """`params` with every matrix a decode step multiplies as a `PackedWeight` (an untied input
    embedding is only gathered from: it stays as it is). Costs one more copy of those matrices."""

    def packed(w: jax.Array, input_dims: int = 1) -> PackedWeight:
        return PackedWeight(w, cpu_matmul.pack(w.reshape(math.prod(w.shape[:-input_dims]), -1)))

    layers = tuple(
        layer.replace(
            wqkv=packed(layer.wqkv),
            wo=packed(layer.wo, input_dims=2),
            w_gate_up=packed(layer.w_gate_up),
            w_down=packed(layer.w_down),
        )
        for layer in params.layers
    )
    if params.lm_head is None:
        return params.replace(embed=packed(params.embed), layers=layers)
    return params.replace(layers=layers, lm_head=packed(params.lm_head))


def unpacked(params: Params) -> Params:
    """`params` without packed copies: what `pack_weights` was given."""
    return jax.tree.map(_matrix, params, is_leaf=lambda w: isinstance(w, PackedWeight))


def _matrix(w: jax.Array | PackedWeight) -> jax.Array:
    return w.matrix if isinstance(w, PackedWeight) else w


def _packed_product(w: jax.Array | PackedWeight, x: jax.Array, out_dims: tuple[int, ...]) -> jax.Array | None:
    """w's packed copy times columns x [in, N] -> [out..., N], when w has one and N is few enough."""
    if not isinstance(w, PackedWeight) or x.shape[1] > cpu_matmul.MAX_COLUMNS:
        return None
    return cpu_matmul.matmul(w.packed, x, math.prod(out_dims)).reshape(*out_dims, x.shape[1])


def project(w: jax.Array | PackedWeight, x: jax.Array, input_dims: int = 1) -> jax.Array:
    """w [out..., in...] (its last `input_dims` dims contracted) applied to columns x [in, N] ->
    [out..., N]: one matrix product (XLA merges the leading output dims, which are contiguous), with
    no reshape that would cross a sharded axis."""
    out_dims = _matrix(w).shape[:-input_dims]
    packed = _packed_product(w, x, out_dims)
    if packed is not None:
        return packed
    w = _matrix(w).reshape(*out_dims, -1)
    dims = (((w.ndim - 1,), (0,)), ((), ()))
    out = jax.lax.dot_general(w, x, dims, full_precision(x.dtype), preferred_element_type=jnp.float32)
    return out.astype(x.dtype)


@jax.named_scope("attention")
def attention(
    q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array, window: int
) -> jax.Array:
    """Causal grouped-query attention.

    q [B, K, G, T, H] (query heads grouped by kv head); k, v [B, K, S, H] (the cache's layout);
    q_pos [B, T] and k_pos [B, S] are absolute positions (k_pos < 0 marks an empty key slot). A key
    is visible when k_pos <= q_pos, and also q_pos - k_pos < window when the layer has a sliding
    window. Both products keep (b, k) as leading batch dimensions and contract over a trailing
    dimension of the cache, so they read K and V in place. Returns [B, K, G, T, H].
    """
    scores = jnp.where(_visible(q_pos, k_pos, window), _scores(q, k), jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgts,bksh->bkgth", probs, v, precision=full_precision(v.dtype))


def _scores(q: jax.Array, k: jax.Array) -> jax.Array:
    """Scaled float32 scores [B, K, G, T, S] of q [B, K, G, T, H] against keys k [B, K, S, H]."""
    precision = full_precision(k.dtype)
    scores = jnp.einsum("bkgth,bksh->bkgts", q, k, precision=precision, preferred_element_type=jnp.float32)
    return scores * (1.0 / math.sqrt(q.shape[-1]))


def _visible(q_pos: jax.Array, k_pos: jax.Array, window: int) -> jax.Array:
    """Which keys each query sees, [B, 1, 1, T, S] (broadcasting over K and G): k_pos [B, S] at or
    before q_pos [B, T], not empty (k_pos < 0), and within the sliding window when there is one."""
    visible = (k_pos[:, None, :] <= q_pos[:, :, None]) & (k_pos[:, None, :] >= 0)
    if window:
        visible &= q_pos[:, :, None] - k_pos[:, None, :] < window
    return visible[:, None, None]


KEY_BLOCK = 256  # keys per iteration of `filled_attention`


@jax.named_scope("attention")
def filled_attention(
    q: jax.Array,
    cache_k: jax.Array,
    cache_v: jax.Array,
    rows: jax.Array,
    q_pos: jax.Array,
    window: int,
) -> jax.Array:
    """Causal attention of prompt tokens over their cache rows, reading only the filled part.

    q [B, K, G, T, H] at positions q_pos [B, T] (contiguous per row, their K/V already written);
    cache_k, cache_v [slots, K, S, H]; rows [B] the cache rows. A loop over blocks of KEY_BLOCK keys
    runs only up to the furthest query position (and, with a sliding window, from the first block
    the window reaches), with an online softmax: a chunk at the start of a 2048-position slot
    reads one block, not the whole row. Returns [B, K, G, T, H], as `attention` does.
    """
    batch, kv_heads, groups, t, h = q.shape
    seq = cache_k.shape[2]
    block = min(KEY_BLOCK, seq)
    precision = full_precision(cache_v.dtype)
    first = jnp.maximum(jnp.min(q_pos) - window + 1, 0) // block if window else 0
    end = -(-(jnp.max(q_pos) + 1) // block)

    def read(cache, start):  # [B, K, block, H]: each row's block, sliced in place (no row copy)
        size = (1, kv_heads, block, h)
        return jnp.concatenate([jax.lax.dynamic_slice(cache, (r, 0, start, 0), size) for r in rows])

    def body(j, carry):
        running_max, denominator, acc = carry
        start = jnp.minimum(j * block, seq - block)
        keys, values = read(cache_k, start), read(cache_v, start)
        k_pos = start + jnp.arange(block)
        scores = _scores(q, keys)
        # Keys below j * block are ones a clamped last block repeats: already counted.
        visible = _visible(q_pos, jnp.broadcast_to(k_pos, (batch, block)), window) & (k_pos >= j * block)
        new_max = jnp.maximum(running_max, jnp.max(jnp.where(visible, scores, -jnp.inf), axis=-1))
        probs = jnp.where(visible, jnp.exp(scores - new_max[..., None]), 0.0)
        rescale = jnp.exp(running_max - new_max)
        denominator = denominator * rescale + jnp.sum(probs, axis=-1)
        update = jnp.einsum(
            "bkgts,bksh->bkgth",
            probs.astype(values.dtype),
            values,
            precision=precision,
            preferred_element_type=jnp.float32,
        )
        return new_max, denominator, acc * rescale[..., None] + update

    shape = (batch, kv_heads, groups, t)
    # A finite "no key yet" maximum: a query whose keys all lie in later blocks rescales by 1, not NaN.
    init = (jnp.full(shape, jnp.finfo(jnp.float32).min), jnp.zeros(shape), jnp.zeros((*shape, h)))
    _, denominator, acc = jax.lax.fori_loop(first, end, body, init)
    return (acc / denominator[..., None]).astype(cache_v.dtype)


class TokenGroup(NamedTuple):
    """Tokens that share one attention pattern within a forward pass.

    tokens and positions are [B, T]; their K/V go to cache rows `rows` [B] (None: rows 0..B-1).
    `active` [B] (None: all) marks the rows whose outputs are used: the attention kernels skip the
    others (idle decode slots keep the position their last request reached, however far).
    A decode step is one group ([slots, 1]); a decode step carrying a prompt chunk is two (the
    slots, then the chunk [1, T] for its slot): every projection runs once over both groups'
    columns, so the step reads the weights once.
    """

    tokens: jax.Array
    positions: jax.Array
    rows: jax.Array | None = None
    active: jax.Array | None = None

    @property
    def columns(self) -> int:
        return self.tokens.shape[0] * self.tokens.shape[1]

    @property
    def cache_rows(self) -> jax.Array:
        """The cache row of each batch entry, [B]: `rows`, or 0..B-1."""
        return jnp.arange(self.tokens.shape[0]) if self.rows is None else self.rows


_KERNEL_SPLITS, _KERNEL_BLOCK = 16, 128  # the kernel splits each row's keys, in blocks of 128


def decode_kernel_fits(max_seq_len: int) -> bool:
    """Whether `decode_attention_kernel` takes a cache of this length: 16 equal splits of at least
    16 keys, each a whole number of blocks (a split shorter than a block is one block)."""
    split, rest = divmod(max_seq_len, _KERNEL_SPLITS)
    return rest == 0 and split >= 16 and (split < _KERNEL_BLOCK or split % _KERNEL_BLOCK == 0)


@jax.named_scope("attention")
def decode_attention_kernel(
    q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, positions: jax.Array, window: int, interpret=False
) -> jax.Array:
    """Decode attention for cache rows 0..B-1 with JAX's Pallas (Triton) GPU kernel.

    q [B, K, G, 1, H] at positions [B]; cache_k, cache_v [slots, K, S, H] are read in place, each
    row only up to its own position (so no attention bucket is needed, and no slice of the cache
    is copied: on an H200 XLA's einsum path spent 5.2 ms of a 13.9 ms 64-slot step materializing
    those slices). Rows past B, and rows at position -1 (idle), get length 0: they cost nothing and
    attend to zeros. `interpret` runs it on a CPU, slowly (tests). Returns [B, K, G, 1, H].
    """
    from jax.experimental.pallas.ops.gpu import decode_attention

    b, kv_heads, groups, _, h = q.shape
    slots = cache_k.shape[0]
    q_rows = jnp.zeros((slots, kv_heads * groups, h), q.dtype).at[:b].set(q.reshape(b, -1, h))
    length = jnp.zeros((slots,), jnp.int32).at[:b].set(positions + 1)
    start = jnp.maximum(length - window, 0) if window else None
    out = decode_attention.gqa(
        q_rows,
        jnp.swapaxes(cache_k, 1, 2),  # gqa takes [B, S, K, H] and swaps back: XLA cancels the pair
        jnp.swapaxes(cache_v, 1, 2),
        start_idx=start,
        kv_seq_len=length,
        sm_scale=1.0 / math.sqrt(h),
        block_k=_KERNEL_BLOCK,
        k_splits=_KERNEL_SPLITS,
        interpret=interpret,
    )
    # (gqa's normalization adds a NumPy float32 epsilon, which promotes a bf16 result to float32.)
    return out[:b].astype(q.dtype).reshape(b, kv_heads, groups, 1, h)


def _attention_block(
    p: LayerParams,
    x: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    groups: Sequence[TokenGroup],
    cache_kv: tuple[jax.Array, jax.Array] | None,
    attn_len: int | None,
    window: int,
    cfg: ModelConfig,
    attention_kernel: str | None,
):
    """x [D, N] columns (the groups' tokens in order) -> attention output [D, N], updated cache."""
    groups_per_kv = cfg.num_groups
    with jax.named_scope("qkv_proj"):
        qkv = project(p.wqkv, x)  # [K, G + 2, h, N]
    if cfg.qkv_bias:
        qkv = qkv + p.bqkv[..., None]
    q, k, v = qkv[:, :groups_per_kv], qkv[:, groups_per_kv], qkv[:, groups_per_kv + 1]
    if cfg.qk_norm:
        q = rms_norm(q, p.q_norm, cfg.rms_norm_eps, axis=-2)
        k = rms_norm(k, p.k_norm, cfg.rms_norm_eps, axis=-2)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    kv_heads, h = k.shape[0], k.shape[1]

    # Heads-major columns to attention's [B, K, (G,) T, H]: small transposes of this step's tokens.
    per_group, start = [], 0
    for group in groups:
        b, t = group.tokens.shape
        cols = slice(start, start + b * t)
        start += b * t
        per_group.append(
            (
                q[..., cols].reshape(kv_heads, groups_per_kv, h, b, t).transpose(3, 0, 1, 4, 2),
                k[..., cols].reshape(kv_heads, h, b, t).transpose(2, 0, 3, 1),
                v[..., cols].reshape(kv_heads, h, b, t).transpose(2, 0, 3, 1),
            )
        )
    if cache_kv is not None:
        # Every group writes before any group reads. A slot being prefilled is an inactive row of
        # the decode group, whose write lands where the chunk then writes or beyond what is visible.
        with jax.named_scope("kv_write"):
            for group, (_, gk, gv) in zip(groups, per_group, strict=True):
                cache_kv = write_kv(cache_kv, gk, gv, group.positions, group.rows)
    outs = []
    for group, (gq, gk, gv) in zip(groups, per_group, strict=True):
        b, t = group.tokens.shape
        if cache_kv is None:
            out = attention(gq, gk, gv, group.positions, group.positions, window)
        elif attention_kernel == "gpu" and group.rows is None and t == 1:
            out = decode_attention_kernel(gq, *cache_kv, _kernel_positions(group)[:, 0], window)
        elif attention_kernel == "cpu":
            with jax.named_scope("attention"):
                out = cpu_attention.attention(
                    gq, *cache_kv, group.cache_rows, _kernel_positions(group), window
                )
        elif attn_len is None and t > 1:  # a prompt chunk of its own: blocks up to its end
            out = filled_attention(gq, *cache_kv, group.cache_rows, group.positions, window)
        else:
            cache_k, cache_v = cache_kv
            rows = group.rows
            keys, values = (cache_k[:b], cache_v[:b]) if rows is None else (cache_k[rows], cache_v[rows])
            if attn_len is not None:  # the caller knows no position at or past attn_len is in use
                keys, values = keys[:, :, :attn_len], values[:, :, :attn_len]
            cache_positions = jnp.arange(keys.shape[2], dtype=jnp.int32)
            k_pos = jnp.broadcast_to(cache_positions, (b, cache_positions.shape[0]))
            out = attention(gq, keys, values, group.positions, k_pos, window)
        outs.append(out.transpose(1, 2, 4, 0, 3).reshape(-1, b * t))  # [n * h, cols], Hugging Face order
    heads_out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
    with jax.named_scope("out_proj"):
        return project(p.wo, heads_out, input_dims=2), cache_kv


def _kernel_positions(group: TokenGroup) -> jax.Array:
    """The group's positions [B, T] for an attention kernel: -1 on inactive rows, which then read no
    keys and attend to zeros (finite: their K/V, written at their stale positions, stay finite)."""
    if group.active is None:
        return group.positions
    return jnp.where(group.active[:, None], group.positions, -1)


@jax.named_scope("mlp")
def _mlp_block(p: LayerParams, x: jax.Array) -> jax.Array:
    gate, up = project(p.w_gate_up, x)
    return project(p.w_down, jax.nn.silu(gate) * up)


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
    at positions <= their own. Batch entry b uses cache row b (the cache may have more rows than
    the batch), or cache row rows[b] when `rows` [B] is given (prefill into chosen slots). With
    `attn_len` (static) attention reads only the first attn_len cache positions: decode cost then
    follows the filled part of the cache, not its size. Without it, several tokens per row (a
    prompt chunk) read their rows up to their own end (`filled_attention`), one token the whole row.
    Returns final-normed hidden states [B, T, D] and the cache.
    """
    (hidden,), cache = forward_groups(params, (TokenGroup(tokens, positions, rows),), cfg, cache, attn_len)
    return hidden, cache


def forward_groups(
    params: Params,
    groups: Sequence[TokenGroup],
    cfg: ModelConfig,
    cache: KVCache | None = None,
    attn_len: int | None = None,
    attention_kernel: str | None = None,
) -> tuple[tuple[jax.Array, ...], KVCache | None]:
    """`forward` over several token groups at once: one pass of every weight over all their columns,
    attention per group (each attends only to its own rows). Returns hidden [B_i, T_i, D] per group.

    `attention_kernel` (static) replaces XLA's einsums over the cache: "gpu" (one device) attends
    one-token groups of cache rows 0..B-1 with `decode_attention_kernel` (`attn_len` then applies
    to the others); "cpu" (one device, float32) attends every group with the C++ kernel of
    `jinfer.kernels.cpu_attention`, which reads each row in place up to its queries' positions.
    (Without a kernel, a decode step carrying a prompt chunk passes `attn_len`: there the chunk is a
    few tokens, and XLA:CPU ran the block loop of `filled_attention` slower than one product over
    the bucket.)"""
    groups = [g._replace(positions=jnp.asarray(g.positions, jnp.int32)) for g in groups]
    ids = jnp.concatenate([g.tokens.reshape(-1) for g in groups])
    x = _matrix(params.embed)[ids].T  # [D, N] columns
    cos, sin = rope_cos_sin(jnp.concatenate([g.positions.reshape(-1) for g in groups]), cfg)
    new_layers = []
    for i, layer in enumerate(params.layers):
        layer_cache = None if cache is None else (cache.k[i], cache.v[i])
        h = rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)
        window = cfg.sliding_windows[i]
        attn, kv = _attention_block(
            layer, h, cos, sin, groups, layer_cache, attn_len, window, cfg, attention_kernel
        )
        x = x + attn
        x = x + _mlp_block(layer, rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps))
        new_layers.append(kv)
    hidden = rms_norm(x, params.final_norm, cfg.rms_norm_eps).T  # [N, D]
    per_group, start = [], 0
    for g in groups:
        per_group.append(hidden[start : start + g.columns].reshape(*g.tokens.shape, -1))
        start += g.columns
    if cache is None:
        return tuple(per_group), None
    return tuple(per_group), KVCache(k=tuple(kv[0] for kv in new_layers), v=tuple(kv[1] for kv in new_layers))


@jax.named_scope("logits")
def logits(params: Params, hidden: jax.Array) -> jax.Array:
    """Project hidden states [..., D] to float32 vocabulary logits [..., V].

    Computed as W[V, D] @ columns (see the module notes); XLA cancels the transposes against the
    ones at the end of `forward`.
    """
    weight = params.embed if params.lm_head is None else params.lm_head
    columns = hidden.reshape(-1, hidden.shape[-1]).T
    vocab = _matrix(weight).shape[0]
    out = _packed_product(weight, columns, (vocab,))
    if out is None:
        weight = _matrix(weight)
        out = jnp.dot(
            weight, columns, precision=full_precision(weight.dtype), preferred_element_type=jnp.float32
        )
        # The barrier stops XLA from folding the transpose into the product: for 2-4 columns the
        # folded form picks a kernel ~15x slower than this one plus a small transpose.
        out = jax.lax.optimization_barrier(out)
    return out.T.reshape(*hidden.shape[:-1], vocab)
