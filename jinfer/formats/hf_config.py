"""What Hugging Face config.json fields mean whatever the family: the RoPE scaling rules (the
transformers 4 and 5 layouts), eos ids, required fields. Each family's reader (`models.family`)
builds its `ModelConfig` with these.
"""

from __future__ import annotations

import json
from typing import Any

from jinfer.config import SUPPORTED_ROPE_TYPES, RopeConfig, UnsupportedModelError


def require(hf: dict[str, Any], key: str):
    """hf[key], or an UnsupportedModelError naming the missing field."""
    if key not in hf:
        raise UnsupportedModelError(f"config.json lacks required field {key!r}")
    return hf[key]


def rope_from_hf(hf: dict[str, Any]) -> RopeConfig:
    """The rotary embedding a config.json describes; a scaling rule jinfer lacks is rejected."""
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


def eos_ids(value) -> tuple[int, ...]:
    """An eos_token_id field (absent, one id or a list) as a tuple of ids."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
