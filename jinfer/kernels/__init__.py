"""Native kernels for what XLA compiles poorly on a platform, each called from jitted code.

The CPU kernels are C++ sources in this package (`<name>.cc`, sharing `cpu_common.h`), built on
first use by `register_cpu_kernel` with the machine's C++ compiler against the XLA FFI headers that
jaxlib ships, and registered as XLA:CPU custom calls. A build takes a few seconds once: the library
is cached in `cache_dir()` (~/.cache/jinfer), keyed by the sources, jaxlib's version, the
compiler, this CPU's instruction set (it is built for this CPU, -march=native) and any extra flags
in $JINFER_KERNEL_CXXFLAGS (e.g. `-mno-avx512f` for the kernels' 8-lane build). A kernel that
cannot be built is a warning saying why; its module's `available()` is then False and the engine
uses XLA's own ops instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jaxlib

log = logging.getLogger(__name__)

SOURCES = Path(__file__).parent


def register_cpu_kernel(
    name: str, symbol: str, target: str, logger: logging.Logger, unavailable: str
) -> ctypes.CDLL | None:
    """Build `<name>.cc` (or take it from the cache), register its FFI handler `symbol` as the
    XLA:CPU custom call `target` and return the loaded library. If it cannot, warn on `logger` with
    the `unavailable` message (what is used instead) and why, and return None."""
    try:
        library = ctypes.CDLL(str(_build(name)))
        handler = getattr(library, symbol)
    except (OSError, AttributeError, subprocess.SubprocessError) as error:
        logger.warning("%s: %s", unavailable, getattr(error, "stderr", None) or error)
        return None
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
    return library


def cache_dir() -> Path:
    """jinfer's cache folder: $JINFER_CACHE_DIR, else jinfer under $XDG_CACHE_HOME or ~/.cache."""
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jinfer"
    return Path(os.environ.get("JINFER_CACHE_DIR", default))


def cpu_signature() -> str:
    """This CPU's instruction-set flags: a library built with -march=native runs only where they hold."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _build(name: str) -> Path:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise OSError("no C++ compiler found (set CXX, or install g++)")
    source = SOURCES / f"{name}.cc"
    texts = [path.read_bytes() for path in (source, *sorted(SOURCES.glob("*.h")))]
    extra_flags = shlex.split(os.environ.get("JINFER_KERNEL_CXXFLAGS", ""))
    identity = b"\0".join(
        [
            *texts,
            jaxlib.__version__.encode(),
            compiler.encode(),
            cpu_signature().encode(),
            *map(str.encode, extra_flags),
        ]
    )
    key = hashlib.sha256(identity).hexdigest()[:16]
    folder = cache_dir()
    library = folder / f"{name}-{key}.so"
    if library.exists():
        return library
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        built = Path(scratch) / library.name
        command = [compiler, "-O3", "-march=native", "-ffp-contract=fast", "-std=c++17", "-shared", "-fPIC"]
        command += [*extra_flags, f"-I{jax.ffi.include_dir()}", str(source), "-o", str(built)]
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=600)
        os.replace(built, library)  # atomic: a process building the same key at once lands the same file
    log.info("built %s", library)
    return library
