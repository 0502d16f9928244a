"""The Llama family's parameter tree and its one declaration (`param_specs`), from which random
init, abstract shapes, shardings and the loaders' shape checks derive (`models.params`), and where
a low-rank adapter's projections lie in it (`adapter_targets`, in Hugging Face's module names).

Weights are stored output features first ([out..., in]), as Hugging Face stores them, with the
projections that read the same input stacked (`wqkv`, `w_gate_up`): see `models.llama` for why.
"""

from __future__ import annotations

import jax
from flax import struct

from jinfer.config import ModelConfig
from jinfer.models.family import AdapterTarget
from jinfer.models.params import ParamSpec


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
            wqkv=ParamSpec((k, g + 2, h, d), ("kv_heads", None, "head_dim", "embed"), "normal", 1),
            wo=ParamSpec((d, n, h), ("embed", "heads", "head_dim"), "normal", 2),
            mlp_norm=norm(),
            w_gate_up=ParamSpec((2, f, d), (None, "mlp", "embed"), "normal", 1),
            w_down=ParamSpec((d, f), ("embed", "mlp"), "normal", 1),
            bqkv=ParamSpec((k, g + 2, h), ("kv_heads", None, "head_dim"), "zeros") if cfg.qkv_bias else None,
            q_norm=ParamSpec((h,), ("head_dim",), "ones") if cfg.qk_norm else None,
            k_norm=ParamSpec((h,), ("head_dim",), "ones") if cfg.qk_norm else None,
        )

    return Params(
        embed=ParamSpec((v, d), ("vocab", "embed"), "normal", int(cfg.tie_word_embeddings)),
        layers=tuple(layer() for _ in range(cfg.num_layers)),
        final_norm=norm(),
        lm_head=None if cfg.tie_word_embeddings else ParamSpec((v, d), ("vocab", "embed"), "normal", 1),
    )


def adapter_targets(cfg: ModelConfig) -> dict[str, AdapterTarget]:
    """The projections an adapter may change: q, k, v (parts of `wqkv`, along its axis 1), o, gate
    and up (parts of `w_gate_up`, along axis 0) and down."""
    d, f = cfg.hidden_size, cfg.intermediate_size
    k, g, h = cfg.num_kv_heads, cfg.num_groups, cfg.head_dim
    return {
        "q": AdapterTarget("wqkv", (k, g, h), d, (1, 0), "self_attn.q_proj"),
        "k": AdapterTarget("wqkv", (k, 1, h), d, (1, g), "self_attn.k_proj"),
        "v": AdapterTarget("wqkv", (k, 1, h), d, (1, g + 1), "self_attn.v_proj"),
        "o": AdapterTarget("wo", (d,), cfg.num_heads * h, None, "self_attn.o_proj"),
        "gate": AdapterTarget("w_gate_up", (1, f), d, (0, 0), "mlp.gate_proj"),
        "up": AdapterTarget("w_gate_up", (1, f), d, (0, 1), "mlp.up_proj"),
        "down": AdapterTarget("w_down", (d,), f, None, "mlp.down_proj"),
    }
