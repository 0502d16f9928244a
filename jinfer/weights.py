"""What the steps carry per model, as one tree each: the weights and the KV caches of the target
model and, with speculative decoding by a draft model (`jinfer.draft`), of the draft model.

    Weights(target, draft=None, adapters=None)
                                  the models' parameter pytrees, as held (float, packed, quantized),
                                  and the target's stack of low-rank adapters (`jinfer.lora`)
    Caches(target, draft=None)    their paged KV caches (`jinfer.kv_cache.KVCache`), one page numbering

The trees always have this shape: a step reads `.target`, and `.draft` where a draft model runs
(None has no leaves, so shardings, donation and `jax.tree.map` over them need no case of their own).
`replacement` makes new weights for the target what the compiled steps take in place of the old.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import struct

from jinfer.kv_cache import KVCache
from jinfer.models import quantized
from jinfer.models.params import pack_weights, unpacked


@struct.dataclass
class Weights:
    target: Any  # the served model's parameters
    draft: Any = None  # a draft model's, or None
    adapters: Any = None  # the target's `lora.AdapterStack` (EngineConfig.max_loras > 0), or None


@struct.dataclass
class Caches:
    target: KVCache
    draft: KVCache | None = None  # a draft model's cache: the same pages, read through the same tables


def replacement(held: Any, params: Any, cfg, packed: bool) -> Any:
    """`params`, a model's weights as `LLM.params` gives them (matrices unpacked, quantized blocks
    as held), made what the steps take in place of `held` (the weights as the engine holds them):
    each leaf placed as the one it replaces (its sharding), and packed where the engine packs
    (`models.params.pack_weights`), so that no program compiles again. ValueError, naming the
    leaf, where the tree, a shape or a dtype differs: the steps were compiled for those."""
    current = unpacked(held)
    params = quantized.with_activations(params, quantized.activations_of(current))  # as the engine's
    if jax.tree.structure(params) != jax.tree.structure(current):
        raise ValueError(
            "update_weights takes a tree shaped as LLM.params gives it: "
            f"{jax.tree.structure(current)}, got {jax.tree.structure(params)}"
        )
    placed = []
    for (path, old), new in zip(
        jax.tree_util.tree_leaves_with_path(current), jax.tree.leaves(params), strict=True
    ):
        if tuple(np.shape(new)) != old.shape or np.result_type(new) != old.dtype:
            raise ValueError(
                f"update_weights: {jax.tree_util.keystr(path)} must be {old.dtype}{list(old.shape)}, "
                f"got {np.result_type(new)}{list(np.shape(new))}"
            )
        placed.append(jax.device_put(new, old.sharding))
    tree = jax.tree.unflatten(jax.tree.structure(current), placed)
    return pack_weights(tree, cfg) if packed else tree
