"""What the steps carry per model, as one tree each: the weights and the KV caches of the target
model and, with speculative decoding by a draft model (`jinfer.draft`), of the draft model.

    Weights(target, draft=None)   the models' parameter pytrees, as held (float, packed, quantized)
    Caches(target, draft=None)    their paged KV caches (`jinfer.kv_cache.KVCache`), one page numbering

The trees always have this shape: a step reads `.target`, and `.draft` where a draft model runs
(None has no leaves, so shardings, donation and `jax.tree.map` over them need no case of their own).
"""

from __future__ import annotations

from typing import Any

from flax import struct

from jinfer.kv_cache import KVCache


@struct.dataclass
class Weights:
    target: Any  # the served model's parameters
    draft: Any = None  # a draft model's, or None


@struct.dataclass
class Caches:
    target: KVCache
    draft: KVCache | None = None  # a draft model's cache: the same pages, read through the same tables
