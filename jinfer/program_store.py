"""Programs kept whole: the warm-up's executables saved beside the compile cache, so the next
start of the same engine loads them without tracing its Python again. JAX's own cache
(`jinfer.compile_cache`) is keyed by a program's HLO, which only tracing gives: on the embedded
model tracing the 30-layer programs costs more than loading every executable, and a restart
within seconds needs it gone.

    ProgramStore.for_steps(steps) -> ProgramStore | None
    store.load(program, args) -> jax.stages.Compiled | None
    store.save(program, args, compiled)

An executable is found by a key of everything its trace reads: jinfer's Python (every module of the
package, and the family modules $JINFER_FAMILIES adds; not the kernels' C++, which an executable
calls by its registered name, and whose build sets no shape the arguments' signature misses), jax's
and jaxlib's versions, this CPU's instruction set, the kernels' build flags, XLA's flags, the
devices, the model's configuration, the layout, the mesh, the program, and its arguments'
structure, shapes, dtypes and shardings. Where the key cannot see everything, there is no store:
logits processors (user code the key does not read) and several processes; and with
$JINFER_KEEP_EXECUTABLES=0, for those who edit jinfer itself: each edit changes every key, and what
the store keeps is compiled anew rather than loaded from JAX's cache (`compile_cache.bypassed`),
and only if this process had not built it before (`compile_cache.compile_fresh`). The files live in
`programs/` under the compile cache's folder (no store when that is off), are written whole (a
temporary file renamed) and go, least recently used first, past `compile_cache.MAX_BYTES`. Like
JAX's cache, the folder is trusted code: loading an executable runs what it holds.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import pickle
import tempfile
from pathlib import Path

import jax
import jaxlib
from jax.experimental.serialize_executable import deserialize_and_load, serialize

from jinfer.compile_cache import MAX_BYTES
from jinfer.inputs import Program
from jinfer.kernels import cpu_signature
from jinfer.models.family import family_source_files

log = logging.getLogger(__name__)

SUBFOLDER = "programs"
KEEP = "JINFER_KEEP_EXECUTABLES"
SOURCE_SUFFIXES = (".py",)


@functools.cache
def sources_digest() -> str:
    """A digest of jinfer's own Python and of the family modules it imported from elsewhere."""
    package = Path(__file__).parent
    files = sorted(path for path in package.rglob("*") if path.suffix in SOURCE_SUFFIXES)
    digest = hashlib.sha256()
    for path in [*files, *family_source_files()]:
        digest.update(str(path.relative_to(package) if path.is_relative_to(package) else path).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _machine() -> list[str]:
    """What an executable depends on beyond its program: the software, the CPU, the devices."""
    devices = [(d.platform, d.device_kind, d.id, d.process_index) for d in jax.devices()]
    return [
        sources_digest(),
        jax.__version__,
        jaxlib.__version__,
        cpu_signature(),
        os.environ.get("JINFER_KERNEL_CXXFLAGS", ""),
        os.environ.get("XLA_FLAGS", ""),
        str(jax.config.jax_enable_x64),
        str(jax.config.jax_default_matmul_precision),
        repr(devices),
    ]


def arguments_signature(args) -> str:
    """The arguments' tree (with its static fields) and each leaf's shape, dtype and placement."""
    leaves, tree = jax.tree.flatten(args)
    described = [
        (getattr(x, "shape", None), str(getattr(x, "dtype", type(x).__name__)), getattr(x, "weak_type", None),
         str(getattr(x, "sharding", None)))
        for x in leaves
    ]  # fmt: skip
    return repr((str(tree), described))


class ProgramStore:
    """The executables of one engine's programs (`Steps.programs`), on disk."""

    def __init__(self, folder: Path, engine_key: str):
        self.folder = folder
        self.engine_key = engine_key

    @classmethod
    def for_steps(cls, steps) -> ProgramStore | None:
        """The store for `steps`' programs, or None: no compile cache folder in use, logits
        processors, or several processes."""
        cache = jax.config.jax_compilation_cache_dir
        unkept = (
            "JINFER_KEEP_EXECUTABLES=0" if os.environ.get(KEEP, "1") == "0"
            else "no compile cache folder" if not cache
            else "logits processors are registered" if steps.processors
            else "several processes" if jax.process_count() > 1
            else None
        )  # fmt: skip
        if unkept is not None:
            log.info("executables are not kept (%s): each start traces every program", unkept)
            return None
        model = [repr(steps.model), repr(steps.draft_model), repr(steps.layout), str(steps.vocab_size)]
        engine_key = "\0".join([*_machine(), *model, repr(steps.mesh)])
        return cls(Path(cache) / SUBFOLDER, engine_key)

    def path(self, program: Program, args) -> Path:
        key = "\0".join([self.engine_key, repr(program), arguments_signature(args)])
        return self.folder / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.executable"

    def load(self, program: Program, args) -> jax.stages.Compiled | None:
        """The executable kept for `program` over `args`, or None (none kept, or one that does not
        load: it is then built and kept anew)."""
        path = self.path(program, args)
        try:
            (payload, in_tree, out_tree), device_ids = pickle.loads(path.read_bytes())
            devices = {device.id: device for device in jax.devices()}
            runs_on = [devices[i] for i in device_ids]  # its own, not every device the process has
            compiled = deserialize_and_load(payload, in_tree, out_tree, execution_devices=runs_on)
        except FileNotFoundError:
            return None
        except Exception as error:  # a file cut short, or one an older jaxlib wrote
            log.warning("the kept executable %s does not load (%s); compiling the program", path.name, error)
            return None
        os.utime(path)  # recently used: the last to go
        return compiled

    def save(self, program: Program, args, compiled: jax.stages.Compiled) -> None:
        """Keep `compiled` for `program` over `args` (written whole, then renamed into place), or
        say why it cannot be: XLA:CPU serializes no executable with a sort by a custom comparison
        (jaxlib 0.10: "`LessThan` is not serializable"), so such a program is traced every start."""
        self.folder.mkdir(parents=True, exist_ok=True)
        device_ids = [device.id for device in compiled.runtime_executable().local_devices()]
        try:
            serialized = serialize(compiled)
        except jax.errors.JaxRuntimeError as error:  # XLA's refusal: the program runs, unkept
            log.info("%s is not kept (%s): the next start traces it", program, error)
            return
        blob = pickle.dumps((serialized, device_ids))
        with tempfile.NamedTemporaryFile(dir=self.folder, suffix=".partial", delete=False) as file:
            file.write(blob)
        os.replace(file.name, self.path(program, args))
        self._evict()

    def _evict(self) -> None:
        """The least recently used executables go while the folder holds more than MAX_BYTES."""
        with contextlib.suppress(FileNotFoundError):  # another process evicting at once
            kept = sorted(self.folder.glob("*.executable"), key=lambda path: path.stat().st_mtime)
            total = sum(path.stat().st_size for path in kept)
            for path in kept:
                if total <= MAX_BYTES:
                    break
                total -= path.stat().st_size
                path.unlink(missing_ok=True)
