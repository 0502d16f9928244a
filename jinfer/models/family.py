"""Model families: what jinfer knows of one architecture, as one value, and where it is found.

A `Family` holds a decoder's parameter declaration, its pass over token groups, its logits and how
its checkpoints describe it (a Hugging Face `config.json` and tensor names, a GGUF's metadata and
tensor names). A family registers under the architecture names its checkpoints carry
(`register`); a format finds it by the name it reads (`for_hf`, `for_gguf`) and writes that name
into the `ModelConfig` it builds, from which everything after finds it again (`family_of`). The
engine, the steps, the device and the server never name a family.

Families outside jinfer: the modules named in the environment variable `JINFER_FAMILIES`
(comma-separated, importable) are imported before the first lookup, each registering what it
defines; processes a server starts inherit the variable, so they find the same families.

    param_specs(cfg)                                   -> the weights' declaration: a pytree of
                                                          `models.params.ParamSpec`
    forward_groups(params, groups, cfg, cache, tables, attn_len, attention_kernel)
                                                       -> hidden [B_i, T_i, D] per group, cache
    logits(params, hidden [..., D])                    -> float32 logits [..., V]
    hf_config(config.json's dict)                      -> ModelConfig (architecture = its model_type)
    hf_tensor(name)                                    -> (our weight's path, transform(array, cfg)),
                                                          or None for a name the family lacks
    stacked                                            -> stacked weight name -> (its parts' names,
                                                          the axis they join along): hf_tensor
                                                          names parts "<weight>.<part>"
    gguf_config(metadata, tensor names, rope_freqs)    -> ModelConfig
    gguf_tensor(name, array, cfg)                      -> (its Hugging Face name, the array in
                                                          Hugging Face's layout), or None
    adapter_targets(cfg)                               -> {target name: `AdapterTarget`}: the
                                                          projections a low-rank adapter may
                                                          change (`jinfer.lora`); None: none
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from jinfer.config import ModelConfig, UnsupportedModelError

ENVIRONMENT = "JINFER_FAMILIES"


class AdapterTarget(NamedTuple):
    """One projection of a layer that a low-rank adapter may change (`jinfer.lora`): the layer's
    weight holding it, and where its outputs lie among that weight's (a stacked weight holds
    several projections' outputs side by side along one axis)."""

    weight: str  # the layer's field ("wqkv")
    out_shape: tuple[int, ...]  # this projection's output dims in the weight's layout ((k, g, h))
    in_features: int  # its inputs, flattened as the weight's product reads them
    part: tuple[int, int] | None  # (axis, offset) of its outputs within a stacked weight's; None: all
    hf_module: str  # its module's name within a Hugging Face layer ("self_attn.q_proj")


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    param_specs: Callable[[ModelConfig], Any]
    forward_groups: Callable
    logits: Callable
    hf_config: Callable[[dict[str, Any]], ModelConfig]
    hf_tensor: Callable[[str], tuple[str, Callable] | None]
    stacked: Mapping[str, tuple[tuple[str, ...], int]] = dataclasses.field(default_factory=dict)
    gguf_config: Callable | None = None  # None: no GGUF carries this family
    gguf_tensor: Callable | None = None
    adapter_targets: Callable[[ModelConfig], Mapping[str, AdapterTarget]] | None = None


_BY_HF: dict[str, Family] = {}
_BY_GGUF: dict[str, Family] = {}
_imported: set[str] = set()


def register(family: Family, hf_model_types: Sequence[str], gguf_architectures: Sequence[str] = ()) -> None:
    """Make `family` the one that reads checkpoints of these names (a name registered twice is an
    error: two families cannot both read it)."""
    if gguf_architectures and family.gguf_config is None:
        raise ValueError(f"family {family.name!r} names GGUF architectures but reads no GGUF")
    for names, table in ((hf_model_types, _BY_HF), (gguf_architectures, _BY_GGUF)):
        for name in names:
            if table.get(name, family) is not family:
                raise ValueError(f"architecture {name!r} is already read by family {table[name].name!r}")
            table[name] = family


def _import_families() -> None:
    """The built-in families, and those named in JINFER_FAMILIES (each module imported once)."""
    modules = ["jinfer.models.llama", *filter(None, os.environ.get(ENVIRONMENT, "").split(","))]
    for module in modules:
        module = module.strip()
        if module in _imported:
            continue
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise UnsupportedModelError(f"{ENVIRONMENT} names {module!r}, which does not import: {e}") from e
        _imported.add(module)


def family_source_files() -> list[Path]:
    """The files of the family modules imported from outside jinfer (named in JINFER_FAMILIES)."""
    modules = [sys.modules[name] for name in sorted(_imported) if not name.startswith("jinfer.")]
    return [Path(module.__file__) for module in modules if getattr(module, "__file__", None)]


def _lookup(table: dict[str, Family], name: str | None, what: str) -> Family:
    _import_families()
    if name not in table:
        raise UnsupportedModelError(f"unsupported {what} {name!r}; jinfer supports {tuple(table)}")
    return table[name]


def for_hf(model_type: str | None) -> Family:
    """The family reading a Hugging Face config.json of this `model_type`."""
    return _lookup(_BY_HF, model_type, "model_type")


def for_gguf(architecture: str | None) -> Family:
    """The family reading a GGUF of this `general.architecture`."""
    return _lookup(_BY_GGUF, architecture, "GGUF architecture")


def family_of(cfg: ModelConfig) -> Family:
    """The family of a model its format described (its `architecture`: a Hugging Face model_type)."""
    return _lookup(_BY_HF, cfg.architecture, "architecture")
