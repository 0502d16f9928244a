"""The CPU attention kernel (`cpu_attention.cc`): built on first use, registered with XLA:CPU.

`available()` compiles the C++ source with the machine's C++ compiler against the XLA FFI headers
that jaxlib ships, loads it and registers it as an XLA:CPU custom call. The build takes a few
seconds once: the library is cached under ~/.cache/jinfer (or $JINFER_CACHE_DIR), keyed by the
source, jaxlib's version, the compiler and this CPU's instruction set (it is built for this CPU).
Without a compiler, or if the build fails, `available()` says why in a warning and returns False,
and the engine attends with XLA's einsums instead. `attention(...)` is the jax-level call.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

log = logging.getLogger(__name__)

TARGET = "jinfer_cpu_attention"
SOURCE = Path(__file__).with_name("cpu_attention.cc")


@functools.cache
def available() -> bool:
    """Whether the kernel is built and registered (builds it the first time)."""
    try:
        library = _build()
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", None) or error
        log.warning("CPU attention kernel unavailable, decode attends with XLA's einsums: %s", detail)
        return False
    handler = ctypes.CDLL(str(library)).JinferCpuAttention
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(handler), platform="cpu")
    return True


def attention(
    q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, rows: jax.Array, positions: jax.Array, window: int
) -> jax.Array:
    """Causal attention of q [B, K, G, T, H] at positions [B, T] over cache rows `rows` [B] of
    cache_k, cache_v [R, K, S, H] (float32, read in place up to each query's position; with a
    sliding window, from where it reaches). Returns [B, K, G, T, H] float32, like `llama.attention`."""
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    return call(
        q,
        cache_k,
        cache_v,
        rows.astype(jnp.int32),
        positions.astype(jnp.int32),
        window=np.int64(window),
        scale=np.float32(1.0 / math.sqrt(q.shape[-1])),
    )


def _cpu_signature() -> str:
    """This CPU's instruction-set flags: a library built with -march=native runs only where they hold."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _build() -> Path:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise OSError("no C++ compiler found (set CXX, or install g++)")
    source = SOURCE.read_bytes()
    identity = b"\0".join([source, jaxlib.__version__.encode(), compiler.encode(), _cpu_signature().encode()])
    key = hashlib.sha256(identity).hexdigest()[:16]
    default_cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jinfer"
    cache_dir = Path(os.environ.get("JINFER_CACHE_DIR", default_cache))
    library = cache_dir / f"cpu_attention-{key}.so"
    if library.exists():
        return library
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache_dir) as scratch:
        built = Path(scratch) / library.name
        command = [compiler, "-O3", "-march=native", "-ffp-contract=fast", "-std=c++17", "-shared", "-fPIC"]
        command += [f"-I{jax.ffi.include_dir()}", str(SOURCE), "-o", str(built)]
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=600)
        os.replace(built, library)  # atomic: a process building the same key at once lands the same file
    log.info("built the CPU attention kernel: %s", library)
    return library
