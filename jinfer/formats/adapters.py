"""Adapters on disk (`jinfer.lora.Adapter`): Hugging Face PEFT's LoRA directories, read, and
jinfer's own, written and read.

A PEFT directory holds `adapter_config.json` (peft_type LORA, r, lora_alpha, use_rslora) and
`adapter_model.safetensors`, whose tensors `...layers.{i}.{module}.lora_A.weight` [r, in] and
`lora_B.weight` [out, r] name the module they change (the family's `AdapterTarget.hf_module`). The
adapter's targets are the modules its tensors name; a layer without them gets zeros (PEFT's
layers_to_transform). What jinfer's adapters do not express is refused by name: DoRA, trained
biases, modules_to_save, per-module ranks or alphas, embedding or head adapters.

jinfer's directory: `jinfer_adapter.json` (the `LoraConfig` and the model's architecture) and the
arrays as an orbax checkpoint under `arrays/`.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np

from jinfer.config import ModelConfig
from jinfer.formats.params import CheckpointError
from jinfer.lora import Adapter, LoraConfig, LoraPair, check_adapter, targets_of

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
ADAPTER_MARKER = "jinfer_adapter.json"
ADAPTER_VERSION = 1
_PEFT_TENSOR = re.compile(r"(?:.*\.)?layers\.(\d+)\.(.+)\.lora_([AB])(?:\.default)?\.weight")


def read_adapter(path: str, cfg: ModelConfig) -> Adapter:
    """The adapter in `path` (a PEFT directory or jinfer's), checked against the model."""
    if os.path.isfile(os.path.join(path, ADAPTER_MARKER)):
        adapter = _read_jinfer(path)
    elif os.path.isfile(os.path.join(path, PEFT_CONFIG)):
        adapter = _read_peft(path, cfg)
    else:
        raise CheckpointError(
            f"{path}: neither a PEFT adapter ({PEFT_CONFIG}) nor jinfer's ({ADAPTER_MARKER})"
        )
    try:
        check_adapter(adapter, cfg)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from None
    return adapter


def _peft_config(path: str) -> dict:
    with open(os.path.join(path, PEFT_CONFIG), encoding="utf-8") as f:
        config = json.load(f)
    refusals = {
        "peft_type": lambda v: v not in (None, "LORA"),
        "use_dora": bool,
        "bias": lambda v: v not in (None, "none"),
        "modules_to_save": bool,
        "rank_pattern": bool,
        "alpha_pattern": bool,
        "fan_in_fan_out": bool,
    }
    for key, refused in refusals.items():
        if refused(config.get(key)):
            raise CheckpointError(f"{path}: {key}={config[key]!r} is not an adapter jinfer applies")
    return config


def _read_peft(path: str, cfg: ModelConfig) -> Adapter:
    from safetensors.numpy import load_file

    config = _peft_config(path)
    weights = os.path.join(path, PEFT_WEIGHTS)
    if not os.path.isfile(weights):
        raise CheckpointError(f"{path}: no {PEFT_WEIGHTS} (jinfer reads PEFT's safetensors file)")
    by_module = {target.hf_module: name for name, target in targets_of(cfg, _all_targets(cfg)).items()}
    found: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for tensor, array in load_file(weights).items():
        match = _PEFT_TENSOR.fullmatch(tensor)
        if match is None or match.group(2) not in by_module:
            raise CheckpointError(
                f"{path}: tensor {tensor!r} changes nothing this model's adapters can change"
            )
        layer, target, half = int(match.group(1)), by_module[match.group(2)], match.group(3).lower()
        found.setdefault((layer, target), {})[half] = array.astype(np.float32)
    if not found:
        raise CheckpointError(f"{path}: {PEFT_WEIGHTS} holds no LoRA tensors")
    names = tuple(name for name in _all_targets(cfg) if any(target == name for _, target in found))
    lora = LoraConfig(int(config["r"]), float(config["lora_alpha"]), names, bool(config.get("use_rslora")))
    bad = [layer for layer, _ in found if not 0 <= layer < cfg.num_layers]
    if bad:
        raise CheckpointError(f"{path}: layer {bad[0]} is not among the model's {cfg.num_layers}")
    targets = targets_of(cfg, names)
    layers = []
    for i in range(cfg.num_layers):
        layer = {}
        for name, target in targets.items():
            pair = found.get((i, name), {})
            if len(pair) == 1:
                raise CheckpointError(
                    f"{path}: layer {i} {target.hf_module} has lora_{'AB'['b' in pair]} only"
                )
            a = pair.get("a", np.zeros((lora.rank, target.in_features), np.float32))
            b = pair.get("b", np.zeros((int(np.prod(target.out_shape)), lora.rank), np.float32))
            layer[name] = LoraPair(a, b)
        layers.append(layer)
    return Adapter(tuple(layers), lora)


def _all_targets(cfg: ModelConfig) -> tuple[str, ...]:
    from jinfer.models.family import family_of

    return tuple(family_of(cfg).adapter_targets(cfg))


def save_adapter(directory: str, adapter: Adapter, cfg: ModelConfig) -> None:
    """Write `adapter` as jinfer's adapter directory (orbax arrays, JSON config)."""
    import orbax.checkpoint as ocp

    directory = os.path.abspath(directory)
    os.makedirs(directory, exist_ok=True)
    arrays = {
        str(i): {name: {"a": pair.a, "b": pair.b} for name, pair in layer.items()}
        for i, layer in enumerate(adapter.layers)
    }
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(os.path.join(directory, "arrays"), arrays, force=True)
        checkpointer.wait_until_finished()
    config = adapter.config
    meta = {
        "format": "jinfer-adapter",
        "version": ADAPTER_VERSION,
        "architecture": cfg.architecture,
        "layers": cfg.num_layers,
        "config": {
            "rank": config.rank,
            "alpha": config.alpha,
            "targets": list(config.targets),
            "rslora": config.rslora,
        },
    }
    with open(os.path.join(directory, ADAPTER_MARKER), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)


def _read_jinfer(path: str) -> Adapter:
    import orbax.checkpoint as ocp

    path = os.path.abspath(path)
    with open(os.path.join(path, ADAPTER_MARKER), encoding="utf-8") as f:
        meta = json.load(f)
    if meta.get("version") != ADAPTER_VERSION:
        raise CheckpointError(f"{path}: adapter format version {meta.get('version')!r}; this jinfer reads 1")
    raw = meta["config"]
    config = LoraConfig(raw["rank"], raw["alpha"], tuple(raw["targets"]), raw["rslora"])
    with ocp.StandardCheckpointer() as checkpointer:
        arrays = checkpointer.restore(os.path.join(path, "arrays"))
    layers = tuple(
        {
            name: LoraPair(np.asarray(pair["a"]), np.asarray(pair["b"]))
            for name, pair in arrays[str(i)].items()
        }
        for i in range(meta["layers"])
    )
    return Adapter(layers, config)
