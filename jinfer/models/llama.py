"""The Llama-family decoder as pure functions over a typed parameter pytree.

One implementation covers Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3 and SmolLM2: they differ only by
flags in `ModelConfig` (q/k/v biases, per-head q/k RMSNorm, sliding windows, tied embeddings, RoPE
scaling), never by code paths chosen from strings at run time.

Data flow:  tokens [B, T] -> embed -> num_layers x (RMSNorm, GQA attention with RoPE, RMSNorm,
SwiGLU MLP) -> final RMSNorm -> hidden [B, T, D];  `logits(params, hidden)` -> [B, T, V].
`forward_groups` runs several token groups (decoding slots, a prompt chunk) through one pass of
the weights, each with its own attention by the backend the engine chose (`models.attention`:
XLA's einsums, jinfer's C++ kernel on a CPU, the Pallas decode kernel on a GPU). The parameter
tree and its declaration live in `models.llama_params`, how checkpoints name it in
`models.llama_checkpoints`, RoPE in `models.rope`; `FAMILY` gathers them (`models.family`).

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
  * A matrix may instead be held quantized (`models.quantized`: a GGUF's blocks, or int8 made at
    load), multiplied by jinfer's quantized kernel (32 columns at a time); the embedding's rows
    are then gathered from its blocks.
  * Every product goes through `models.linear.project`, which knows how each holding (float,
    packed, quantized) multiplies; the layers never ask.
  * `jax.named_scope`s (qkv_proj, kv_write, attention, out_proj, mlp, logits) label the compiled
    ops so a profile can be read per part of the model.

Layers are unrolled Python loops over a tuple of per-layer params: on XLA:CPU `lax.scan` over
stacked layers measured ~2x slower than unrolled layers for decode.

Einsum letters: b batch, t query, s key, d model, k kv-head, g group, h head_dim, n head, f mlp, v vocab.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from jinfer.config import ModelConfig
from jinfer.kv_cache import KVCache, write_kv
from jinfer.models import llama_checkpoints, quantized
from jinfer.models.attention import BACKENDS, Backend, TokenGroup, attention, full_precision
from jinfer.models.family import Family, register
from jinfer.models.linear import packed_product, project
from jinfer.models.llama_params import LayerParams, Params, adapter_targets, param_specs
from jinfer.models.params import (
    PackedWeight,
    abstract_params,
    init_params,
    is_spec,
    matrix,
    pack_weights,
    unpacked,
)
from jinfer.models.rope import apply_rope, rope_cos_sin
from jinfer.numerics import fixed_order_sum

__all__ = [
    "FAMILY",
    "PackedWeight",
    "Params",
    "TokenGroup",
    "abstract_params",
    "forward",
    "forward_groups",
    "init_params",
    "is_spec",
    "logits",
    "pack_weights",
    "param_specs",
    "project",
    "unpacked",
]


# ----------------------------------------------------------------------------------- blocks
def rms_norm(x: jax.Array, weight: jax.Array, eps: float, axis: int = 0, divide: bool = False) -> jax.Array:
    """RMSNorm of x over `axis` (features; axis 0 for decoder columns [D, N]), scaled by weight.
    Each column's bits do not depend on the other columns: the sum has a fixed order
    (`fixed_order_sum`) and no product feeds an add in the same fused loop, because XLA:CPU lets
    LLVM contract a * b + c into one FMA and whether it does depends on the loop's shape (on an
    AVX2 CPU a one-token step's scalar code contracted other pairs than a two-token step's). So the
    squares are stored before they are summed, and eps joins the sum before the division.
    `divide`: by a square root both correctly rounded, where XLA:CPU would fuse rsqrt into code
    whose shape depends on the step's token count (the q/k norms, fused into the cache write)."""
    xf = x.astype(jnp.float32)
    squares = jax.lax.optimization_barrier(xf * xf)
    mean_square = (fixed_order_sum(squares, axis) + eps * x.shape[axis]) / x.shape[axis]
    if divide:  # the barrier keeps XLA from rewriting x / sqrt(y) as x * rsqrt(y)
        xf = xf / jax.lax.optimization_barrier(jnp.sqrt(mean_square))
    else:
        xf = xf * jax.lax.rsqrt(mean_square)
    shape = [1] * x.ndim
    shape[axis] = -1
    return weight.reshape(shape) * xf.astype(x.dtype)


def _rotated_groups(q, k, v, cos, sin, groups: Sequence[TokenGroup]) -> list[tuple]:
    """Heads-major columns (q [K, G, h, N], k and v [K, h, N]) to each group's attention inputs
    (q [B, K, G, T, H], k and v [B, K, T, H]): small transposes of this step's tokens, rotated
    there (`apply_rope`: the head dim minor). cos, sin: [N, H]."""
    kv_heads, groups_per_kv, h = q.shape[0], q.shape[1], q.shape[2]
    per_group, start = [], 0
    for group in groups:
        b, t = group.tokens.shape
        cols = slice(start, start + b * t)
        start += b * t
        # Queries and keys rotated as one array: the keys' rotation then lands in the loop the
        # queries need anyway, never fused into the cache write (XLA:CPU made scalar code there
        # for a one-token step: other bits than a longer step's vector code).
        gqk = jnp.concatenate([q[..., cols], k[..., cols][:, None]], axis=1)  # [K, G + 1, h, b * t]
        gqk = gqk.reshape(kv_heads, groups_per_kv + 1, h, b, t).transpose(3, 0, 1, 4, 2)
        gqk = apply_rope(gqk, *(c[cols].reshape(b, 1, 1, t, h) for c in (cos, sin)))
        v_group = v[..., cols].reshape(kv_heads, h, b, t).transpose(2, 0, 3, 1)
        per_group.append((gqk[:, :, :groups_per_kv], gqk[:, :, groups_per_kv], v_group))
    return per_group


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
    attend: Backend,
):
    """x [D, N] columns (the groups' tokens in order; cos, sin [N, H]) -> attention output [D, N],
    updated cache."""
    groups_per_kv = cfg.num_groups
    with jax.named_scope("qkv_proj"):
        qkv = project(p.wqkv, x)  # [K, G + 2, h, N]
    if cfg.qkv_bias:
        qkv = qkv + p.bqkv[..., None]
    q, k, v = qkv[:, :groups_per_kv], qkv[:, groups_per_kv], qkv[:, groups_per_kv + 1]
    if cfg.qk_norm:
        q = rms_norm(q, p.q_norm, cfg.rms_norm_eps, axis=-2, divide=True)
        k = rms_norm(k, p.k_norm, cfg.rms_norm_eps, axis=-2, divide=True)
    per_group = _rotated_groups(q, k, v, cos, sin, groups)
    if cache_kv is not None:
        # Every group writes before any group reads (a slot being prefilled is an inactive row of
        # the decode group: it writes nothing).
        with jax.named_scope("kv_write"):
            for group, (_, gk, gv) in zip(groups, per_group, strict=True):
                cache_kv = write_kv(cache_kv, gk, gv, group.positions, group.tables, group.writes)
    outs = []
    for group, (gq, gk, gv) in zip(groups, per_group, strict=True):
        b, t = group.tokens.shape
        if cache_kv is None:
            out = attention(gq, gk, gv, group.positions, group.positions, window)
        else:
            out = attend(gq, cache_kv, group, attn_len, window)
        outs.append(out.transpose(1, 2, 4, 0, 3).reshape(-1, b * t))  # [n * h, cols], Hugging Face order
    heads_out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)
    with jax.named_scope("out_proj"):
        return project(p.wo, heads_out, input_dims=2), cache_kv


@jax.named_scope("mlp")
def swiglu_mlp(p: LayerParams, x: jax.Array) -> jax.Array:
    """The MLP block: columns x [D, N] -> [D, N]."""
    gate, up = project(p.w_gate_up, x)
    return project(p.w_down, jax.nn.silu(gate) * up)


def forward(
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    cfg: ModelConfig,
    cache: KVCache | None = None,
    tables: jax.Array | None = None,
    rows: jax.Array | None = None,
    attn_len: int | None = None,
) -> tuple[jax.Array, KVCache | None]:
    """Run the decoder over tokens [B, T] at positions [B, T].

    Without a cache the tokens attend to each other causally (full-sequence scoring). With a cache
    and block tables [slots, max_pages] (`kv_cache`), their K/V are written at `positions`
    (contiguous per row) and they attend to everything cached at positions <= their own. Batch
    entry b is slot b (the tables may have more rows than the batch), or slot rows[b] when `rows`
    [B] is given. With `attn_len` (static) attention reads only the first attn_len positions:
    decode cost then follows the filled part of the cache, not its size. Without it, several tokens
    per row (a prompt chunk) read their pages up to their own end (`filled_attention`), one token
    all of its pages. Returns final-normed hidden states [B, T, D] and the cache.
    """
    group = TokenGroup(tokens, positions, rows)
    (hidden,), cache = forward_groups(params, (group,), cfg, cache, tables, attn_len)
    return hidden, cache


def forward_groups(
    params: Params,
    groups: Sequence[TokenGroup],
    cfg: ModelConfig,
    cache: KVCache | None = None,
    tables: jax.Array | None = None,
    attn_len: int | None = None,
    attention_kernel: str | None = None,
    mlp: Callable[[LayerParams, jax.Array], jax.Array] = swiglu_mlp,
) -> tuple[tuple[jax.Array, ...], KVCache | None]:
    """`forward` over several token groups at once: one pass of every weight over all their columns,
    attention per group (each attends only to its own sequences' pages). Returns hidden
    [B_i, T_i, D] per group.

    `attention_kernel` (static) replaces XLA's einsums over gathered pages: "gpu" (one device)
    attends one-token groups with the Pallas paged kernel (`attn_len` then applies to the others);
    "cpu" (one device, float32) attends every group with the C++ kernel of
    `jinfer.kernels.cpu_attention`, which reads each row's pages in place up to its queries'
    positions. (Without a kernel, a decode step carrying a prompt chunk passes `attn_len`: there
    the chunk is a few tokens, and XLA:CPU ran the block loop of `filled_attention` slower than one
    product over the bucket.) `mlp`: the MLP block (a variant family may bring its own)."""
    if cache is not None and tables is None:
        raise ValueError("a forward pass over a KV cache needs its block tables")
    attend = BACKENDS[attention_kernel]
    as_int = lambda a: jnp.asarray(a, jnp.int32)
    groups = [
        g._replace(positions=as_int(g.positions), tables=None if cache is None else as_int(tables)[g.slots])
        for g in groups
    ]
    ids = jnp.concatenate([g.tokens.reshape(-1) for g in groups])
    if quantized.is_quantized(params.embed):
        x = quantized.take_rows(params.embed, ids).T  # [D, N] columns
    else:
        x = matrix(params.embed)[ids].T
    cos, sin = rope_cos_sin(jnp.concatenate([g.positions.reshape(-1) for g in groups]), cfg)
    new_layers = []
    for i, layer in enumerate(params.layers):
        layer_cache = None if cache is None else (cache.k[i], cache.v[i])
        h = rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)
        window = cfg.sliding_windows[i]
        attn, kv = _attention_block(layer, h, cos, sin, groups, layer_cache, attn_len, window, cfg, attend)
        x = x + attn
        x = x + mlp(layer, rms_norm(x, layer.mlp_norm, cfg.rms_norm_eps))
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
    if quantized.is_quantized(weight):
        out = quantized.project(weight, columns.astype(jnp.float32), (weight.shape[0],))
        return out.T.reshape(*hidden.shape[:-1], weight.shape[0])
    vocab = matrix(weight).shape[0]
    if isinstance(weight, PackedWeight):
        out = packed_product(weight, columns, (vocab,))
    else:
        out = jnp.dot(
            weight, columns, precision=full_precision(weight.dtype), preferred_element_type=jnp.float32
        )
        # The barrier stops XLA from folding the transpose into the product: for 2-4 columns the
        # folded form picks a kernel ~15x slower than this one plus a small transpose.
        out = jax.lax.optimization_barrier(out)
    return out.T.reshape(*hidden.shape[:-1], vocab)


FAMILY = Family(
    name="llama",
    param_specs=param_specs,
    forward_groups=forward_groups,
    logits=logits,
    hf_config=llama_checkpoints.hf_config,
    hf_tensor=llama_checkpoints.hf_tensor,
    stacked=llama_checkpoints.STACKED,
    gguf_config=llama_checkpoints.gguf_config,
    gguf_tensor=llama_checkpoints.gguf_tensor,
    adapter_targets=adapter_targets,
)
register(FAMILY, llama_checkpoints.ARCHITECTURES, llama_checkpoints.ARCHITECTURES)
