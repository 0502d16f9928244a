"""One model served by several processes (multi-controller JAX): a leader and followers that
replay its device calls.

Every process runs the same program over one global mesh (`jax.distributed`; `--mesh-data` and
`--mesh-model` span every process's devices). Process 0, the leader, owns HTTP, tokenization, the
scheduler and detokenization; the others, followers, run no server. The engine's device calls
(`jinfer.device`) take host values only, so the leader publishes each one (a verb and its
arguments, `encode`d as one message) before making it, and every follower makes the same call in
the same order on its own shards (`follow`). Only the leader reads tokens.

    leader:    Device.<verb>(host args) -> publish: key jinfer/call/<follower>/<n> -> the jitted step
    follower:  blocking get of jinfer/call/<me>/<n>, delete it -> Device.replay -> the jitted step

Messages go through the coordination service's key-value store: no device program of its own, any
size, no compile (`scripts/bench_cluster.py` measures it against a device broadcast).

Failure. Followers write a heartbeat key every `HEARTBEAT_S`; the leader's watchdog declares the
cluster failed when one stays silent for `follower_timeout_s`, and a device call that fails (a
collective whose peer died errors at once) does the same: running requests end with an error,
new ones are refused (`Engine.failure`; the server answers 503, /health and /ready too). A leader
that dies takes the coordination service with it: JAX ends each follower (non-zero status) as soon
as its next call to the service fails. Starting every process again restores service.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable

import jax
import numpy as np

from jinfer.inputs import DraftPlan, Program, RowInputs
from jinfer.state import PackedChunk

# The typed arguments of device calls, sent field by field and rebuilt by name.
STRUCTS = {cls.__name__: cls for cls in (RowInputs, DraftPlan, PackedChunk)}

log = logging.getLogger("jinfer.cluster")

HEARTBEAT_S = 1.0
# A follower's first heartbeat comes once it has loaded the model and built its engine, which may
# take it longer than the leader (another host, a slower disk): until then it is given JAX's own
# start-up allowance, not follower_timeout_s.
_FIRST_HEARTBEAT_S = 300.0
_RECEIVE_MS = 1000  # a follower's wait for the next call, between checks that it should go on
_STOP = "stop"

_current: Cluster | None = None


def wanted(coordinator: str | None, num_processes: int | None, process_id: int | None) -> bool:
    """Whether this process is one of several: any setting given, or JAX's own variable set."""
    given = (coordinator, num_processes, process_id)
    return any(v is not None for v in given) or "JAX_COORDINATOR_ADDRESS" in os.environ


def join_cluster(config) -> Cluster | None:
    """Join the cluster `config` (an EngineConfig) names, once per process and before anything
    touches a device; None for a process on its own. Unset settings come from JAX's environment
    variables (JAX_COORDINATOR_ADDRESS, ...) or a cluster it detects (SLURM, Open MPI, ...)."""
    global _current
    if _current is not None or not wanted(config.coordinator, config.num_processes, config.process_id):
        return _current
    if jax.distributed.is_initialized():
        raise RuntimeError("jax.distributed was initialized outside jinfer: give jinfer the settings instead")
    # CPU devices of several processes reach each other through gloo; a process that dies must not
    # take the others down with it (the leader reports the failure instead), and SIGTERM stays the
    # server's own (drain, then exit).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_enable_recoverability", True)
    jax.config.update("jax_enable_preemption_service", False)
    timeout = max(1, int(config.follower_timeout_s))
    jax.distributed.initialize(
        config.coordinator, config.num_processes, config.process_id, heartbeat_timeout_seconds=timeout
    )
    from jax._src import distributed  # the coordination service's client: jax has no public name

    _current = Cluster(distributed.global_state.client, jax.process_index(), jax.process_count(), config)
    log.info("process %d of %d, %d devices in all", _current.rank, _current.size, jax.device_count())
    return _current


def current_cluster() -> Cluster | None:
    return _current


class ClusterFailure(RuntimeError):
    """The processes of a cluster cannot serve together (they laid the engine out differently)."""


# ------------------------------------------------------------------------------- messages
def encode(verb: str, args: tuple) -> bytes:
    """One call as bytes: a JSON header (the verb, then each argument's description) and the
    arrays' raw bytes. An argument is None, a `Program`, one of `STRUCTS` or a dict (described
    field by field, entry by entry) or a numpy array or scalar."""
    blobs = []

    def describe(arg):
        if arg is None:
            return None
        if isinstance(arg, dict):
            return ["dict", {key: describe(value) for key, value in arg.items()}]
        if isinstance(arg, Program):
            return ["program", list(arg)]
        if type(arg) in STRUCTS.values():
            fields = {f.name: describe(getattr(arg, f.name)) for f in dataclasses.fields(arg)}
            return ["struct", type(arg).__name__, fields]
        array = np.asarray(arg, order="C")  # (np.ascontiguousarray makes a scalar 1-d)
        blobs.append(array.tobytes())
        return ["array", array.dtype.str, list(array.shape)]

    head = json.dumps([verb, *(describe(arg) for arg in args)]).encode()
    return len(head).to_bytes(4, "little") + head + b"".join(blobs)


def decode(message: bytes) -> tuple[str, tuple]:
    """`encode`'s inverse; a 0-d array comes back as a numpy scalar (usable as a dict key)."""
    size = int.from_bytes(message[:4], "little")
    verb, *described = json.loads(message[4 : 4 + size])
    at = 4 + size

    def rebuild(entry):
        nonlocal at
        if entry is None:
            return None
        if entry[0] == "dict":
            return {key: rebuild(value) for key, value in entry[1].items()}
        if entry[0] == "program":
            return Program(*entry[1])
        if entry[0] == "struct":
            return STRUCTS[entry[1]](**{name: rebuild(field) for name, field in entry[2].items()})
        dtype, shape = np.dtype(entry[1]), tuple(entry[2])
        count = int(np.prod(shape))
        array = np.frombuffer(message, dtype, count, at).reshape(shape)
        at += count * dtype.itemsize
        return array[()]

    return verb, tuple(rebuild(entry) for entry in described)


# -------------------------------------------------------------------------------- cluster
class Cluster:
    """This process's place in the cluster and its channels to the others."""

    def __init__(self, client, rank: int, size: int, config):
        self.client, self.rank, self.size = client, rank, size
        self.follower_timeout_s = config.follower_timeout_s
        self.leader = rank == 0
        self.sent = 0  # calls published (leader) or replayed (follower)
        self.sent_bytes = 0
        self.publish_s = 0.0  # the leader's time spent publishing
        self._stopped = threading.Event()

    # ----------------------------------------------------------------------------- leader
    def publish(self, verb: str, args: tuple) -> None:
        start = time.perf_counter()
        message = encode(verb, args)
        for follower in range(1, self.size):
            self.client.key_value_set_bytes(f"jinfer/call/{follower}/{self.sent}", message)
        self.sent += 1
        self.sent_bytes += len(message)
        self.publish_s += time.perf_counter() - start

    def lead(self, layout: str, on_failure: Callable[[str], None]) -> None:
        """Tell the followers the layout to check theirs against, then watch their heartbeats."""
        self.client.key_value_set("jinfer/layout", layout)
        atexit.register(self.stop)
        threading.Thread(target=self._watch, args=(on_failure,), name="jinfer-watchdog", daemon=True).start()

    def _watch(self, on_failure: Callable[[str], None]) -> None:
        beats = {f: (None, time.monotonic()) for f in range(1, self.size)}
        while not self._stopped.wait(HEARTBEAT_S / 2):
            now = time.monotonic()
            for follower, (last, since) in beats.items():
                try:
                    beat = self.client.key_value_try_get(f"jinfer/alive/{follower}")
                except Exception:  # no heartbeat written yet
                    beat = None
                allowed = self.follower_timeout_s if last is not None else _FIRST_HEARTBEAT_S
                if beat != last:
                    beats[follower] = (beat, now)
                elif now - since > allowed:
                    on_failure(f"process {follower} sent no heartbeat for {allowed:g} s")
                    return

    def stop(self) -> None:
        """Tell the followers to exit (at the leader's exit), and wait until they have left the
        coordination service (or are known dead): it lives in this process, and a follower that
        still needs it when it goes is ended by JAX."""
        if self._stopped.is_set():
            return
        self.publish(_STOP, ())
        self._stopped.set()
        try:
            self.client.get_live_nodes(list(range(self.size)))  # returns once every other has left
        except Exception as e:
            log.warning("waiting for the followers to stop: %s", e)

    def status(self, compiles: int) -> list[dict]:
        """Each process's compiled programs and calls made, as of its last heartbeat (leader)."""
        processes = [
            {
                "process": 0,
                "compiled_programs": compiles,
                "calls": self.sent,
                "published_bytes": self.sent_bytes,
                "publish_s": self.publish_s,
            }
        ]
        for follower in range(1, self.size):
            try:
                beat = json.loads(self.client.key_value_try_get(f"jinfer/alive/{follower}"))
            except Exception:  # no heartbeat yet
                beat = {"compiles": None, "replayed": None}
            processes.append(
                {"process": follower, "compiled_programs": beat["compiles"], "calls": beat["replayed"]}
            )
        return processes

    # --------------------------------------------------------------------------- follower
    def follow(self, layout: str, replay: Callable[[str, tuple], None], compiles: Callable[[], int]) -> int:
        """Make the leader's calls until it says stop: the exit status (0)."""
        theirs = self.client.blocking_key_value_get("jinfer/layout", 600_000)
        if theirs != layout:
            raise ClusterFailure(f"process {self.rank} laid the engine out as {layout}; the leader: {theirs}")
        beat = threading.Thread(target=self._beat, args=(compiles,), name="jinfer-heartbeat", daemon=True)
        beat.start()
        try:
            status = self._replay_until_stopped(replay)
        finally:
            self._stopped.set()
            beat.join()
        jax.distributed.shutdown()  # leave the service while the leader, which runs it, waits
        return status

    def _replay_until_stopped(self, replay: Callable[[str, tuple], None]) -> int:
        while True:
            key = f"jinfer/call/{self.rank}/{self.sent}"
            try:
                message = self.client.blocking_key_value_get_bytes(key, _RECEIVE_MS)
            except Exception as e:
                if "DEADLINE_EXCEEDED" in str(e):
                    continue  # the leader is idle
                raise
            self.client.key_value_delete(key)
            verb, args = decode(message)
            if verb == _STOP:
                log.info("the leader stopped; %d calls replayed", self.sent)
                return 0
            replay(verb, args)
            self.sent += 1  # after the call: a heartbeat's count includes what it compiled

    def _beat(self, compiles: Callable[[], int]) -> None:
        beat = 0
        while True:
            beat += 1
            value = json.dumps({"beat": beat, "compiles": compiles(), "replayed": self.sent})
            self.client.key_value_set(f"jinfer/alive/{self.rank}", value, allow_overwrite=True)
            if self._stopped.wait(HEARTBEAT_S):
                return
