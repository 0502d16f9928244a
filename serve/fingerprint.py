"""The `system_fingerprint` on every response: a hash of what decides a response's exact tokens.

That is the model's files (their bytes), the dtype and the way the weights are held (quantized
formats, packed copies), the products and attention the engine runs, the mesh, the CPU's
instruction set and the jinfer and jax versions. Slots, load and neighbours are left out: jinfer's
outputs do not depend on them. Two servers with the same fingerprint answer the same request, with
the same seed, with the same tokens (tests/test_openai_surface.py checks one server against itself).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from pathlib import Path

CHUNK = 8 * 2**20


def files_digest(path: str) -> str:
    """sha256 over a model file, or over every file under a model directory (names and bytes, in
    name order)."""
    digest = hashlib.sha256()
    root = Path(path)
    files = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    for file in files:
        digest.update(str(file.relative_to(root) if file != root else file.name).encode() + b"\0")
        with open(file, "rb") as f:
            while block := f.read(CHUNK):
                digest.update(block)
    return digest.hexdigest()


def system_fingerprint(engine, model_path: str) -> str:
    """ "fp_" and 16 hex digits of the hash of everything that decides outputs (see above)."""
    from jinfer.kernels import cpu_signature
    from jinfer.models import quantized

    layout = engine.layout
    decides = {
        "model": files_digest(os.fspath(model_path)),
        "dtype": engine.config.dtype,
        "weights": sorted(quantized.formats_held(engine.params)),
        "packed": layout.packed_weights,
        "attention": layout.attention_kernel,
        "mesh": [layout.mesh_data, layout.mesh_model],
        "cpu": cpu_signature(),
        "versions": [importlib.metadata.version(p) for p in ("jinfer", "jax", "jaxlib")],
    }
    return "fp_" + hashlib.sha256(json.dumps(decides, sort_keys=True, default=str).encode()).hexdigest()[:16]
