"""The persistent compilation cache: compiled programs kept on disk, so a second start of the same
engine on the same machine loads them instead of compiling (seconds instead of a minute).

    use(setting) -> the folder in use, or None      each door, before it loads a model
    tally() -> Tally                                 programs loaded from it and compiled, so far
    count_kept(seconds)                              one more loaded (`jinfer.program_store`'s)
    with bypassed(): ...                             compile fresh, JAX's cache unread
    compile_fresh(lowered) -> (compiled, fresh)      fresh: built by XLA just now

The setting (`EngineConfig.compile_cache`, `--compile-cache`) is "auto", "off" or a folder. Auto
is the folder JAX was already given ($JAX_COMPILATION_CACHE_DIR, `jax_compilation_cache_dir`),
else `xla/<key>` under jinfer's cache folder (`jinfer.kernels.cache_dir()`, ~/.cache/jinfer), where
the least recently used programs go past MAX_BYTES. JAX keys each program by its HLO, its compile
options, the XLA flags and jax / jaxlib versions; the folder's key adds what JAX's leaves out and
an executable depends on: XLA:CPU compiles for this CPU's instruction set, so a cache copied to
another machine is not read there. A folder is trusted code (JAX loads executables from it): never
point it at one others can write.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import threading
from pathlib import Path

import jax
import jaxlib
from jax import monitoring
from jax.experimental.compilation_cache import compilation_cache

from jinfer.kernels import cache_dir, cpu_signature

log = logging.getLogger(__name__)

OFF = "off"
AUTO = "auto"
MAX_BYTES = 2 * 2**30


@dataclasses.dataclass(frozen=True)
class Tally:
    """Executables this process has built so far, how many of them it loaded from the cache, and
    the seconds it took (compiling or loading)."""

    programs: int = 0
    loaded: int = 0
    seconds: float = 0.0

    def since(self, before: Tally) -> Tally:
        programs, loaded = self.programs - before.programs, self.loaded - before.loaded
        return Tally(programs, loaded, self.seconds - before.seconds)

    def __str__(self) -> str:
        return (
            f"{self.programs} programs in {self.seconds:.1f} s ({self.loaded} loaded from the compile "
            f"cache, {self.programs - self.loaded} compiled)"
        )


_tally = Tally()
_tally_lock = threading.Lock()


def tally() -> Tally:
    return _tally


_this_thread = threading.local()  # XLA builds and JAX cache loads made by this thread


def _count(event: str, duration: float = 0.0, **_) -> None:
    global _tally
    with _tally_lock:
        if event == "/jax/compilation_cache/cache_hits":
            _tally = dataclasses.replace(_tally, loaded=_tally.loaded + 1)
            _this_thread.loaded = getattr(_this_thread, "loaded", 0) + 1
        elif event == "/jax/core/compile/backend_compile_duration":  # compiled or loaded
            _tally = Tally(_tally.programs + 1, _tally.loaded, _tally.seconds + duration)
            _this_thread.built = getattr(_this_thread, "built", 0) + 1


def compile_fresh(lowered: jax.stages.Lowered) -> tuple[jax.stages.Compiled, bool]:
    """`lowered` compiled, and whether XLA compiled it just now: neither loaded from JAX's cache
    nor an executable this process built before for the same computation (which may itself have
    come from the cache). Only a fresh one serializes whole (`bypassed`)."""
    seen = lambda: (getattr(_this_thread, "built", 0), getattr(_this_thread, "loaded", 0))
    built, loaded = seen()
    compiled = lowered.compile()
    return compiled, seen() == (built + 1, loaded)


@contextlib.contextmanager
def bypassed():
    """Meanwhile, in every thread, JAX's cache is neither read nor written: what compiles is
    compiled here. An executable JAX loaded from its cache serializes without some of its functions
    (jaxlib 0.10's XLA:CPU; loaded again it fails with "Function ... not found"), so what
    `jinfer.program_store` keeps must be compiled fresh."""
    with _bypass_lock:
        was = jax.config.jax_enable_compilation_cache
        jax.config.update("jax_enable_compilation_cache", False)
        compilation_cache.reset_cache()  # JAX decides once whether its cache is used: ask again
        try:
            yield
        finally:
            jax.config.update("jax_enable_compilation_cache", was)
            compilation_cache.reset_cache()


_bypass_lock = threading.Lock()


def count_kept(seconds: float) -> None:
    """One executable loaded whole from the program store (`jinfer.program_store`): JAX reports
    no event for it."""
    global _tally
    with _tally_lock:
        _tally = Tally(_tally.programs + 1, _tally.loaded + 1, _tally.seconds + seconds)


monitoring.register_event_listener(_count)
monitoring.register_event_duration_secs_listener(_count)


def folder_for(setting: str) -> Path | None:
    """The folder `setting` names (None: off)."""
    if setting == OFF:
        return None
    if setting != AUTO:
        return Path(setting).expanduser()
    if jax.config.jax_compilation_cache_dir:
        return Path(jax.config.jax_compilation_cache_dir)
    machine = f"{jax.__version__} {jaxlib.__version__} {cpu_signature()}"
    return cache_dir() / "xla" / hashlib.sha256(machine.encode()).hexdigest()[:16]


def use(setting: str) -> Path | None:
    """Compile through the cache folder `setting` names from now on in this process (or through
    none); the folder in use. Every program is kept, however quick its compile: a start compiles
    hundreds of small ones, and they add up."""
    folder = folder_for(setting)
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    wanted = str(folder) if folder is not None else None
    if jax.config.jax_compilation_cache_dir != wanted:
        if setting == AUTO and jax.config.jax_compilation_cache_max_size == -1:
            jax.config.update("jax_compilation_cache_max_size", MAX_BYTES)
        jax.config.update("jax_compilation_cache_dir", wanted)
        # JAX opens its cache once, at the first compile: a process that compiled before (under
        # another folder, or none) is pointed at this one from now on.
        compilation_cache.reset_cache()
    log.info("compiled programs are kept in %s", folder or "no folder (compile cache off)")
    return folder
