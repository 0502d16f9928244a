"""Presets shipped inside the package: TOML files of settings (any `jinfer serve` key) that
`--config NAME` selects by name. A preset naming `model_file` is that model's own: it applies
whenever a model file of that name is loaded (served name, and `[sampling]`: the model's sampling
defaults, used where it ships no generation_config.json of its own).
"""

from __future__ import annotations

import os
from typing import Any

from jinfer.options import preset_names, read_toml


def model_preset(path: str | os.PathLike) -> dict[str, Any]:
    """The preset whose `model_file` is the file name of `path`, or {}."""
    name = os.path.basename(os.path.normpath(os.fspath(path)))
    for preset in preset_names():
        values = read_toml(preset)
        if values.get("model_file") == name:
            return values
    return {}
