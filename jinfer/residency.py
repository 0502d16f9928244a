"""What an engine holds on its device between requests, changed while nothing is in flight: new
weights (`update_weights`), and sleep and wake (`sleep`, `wake_up`), for research loops that train
and sample in one process and servers that lend their memory to something else for a while.

    update_weights(engine, params)  the model's weights (shaped as `LLM.params`) swapped in
    sleep(engine, level)            level 1: the KV pool freed (the weights stay: on a CPU they
                                    are host memory already); level 2: the weights dropped too
    wake_up(engine)                 the pool back; after level 2, once weights came back through
                                    `update_weights`
    pause(engine, mode)             no admission; the requests in flight finished, aborted, or
    resume(engine)                  kept in their slots ("keep"), until resume

None recompiles: every program takes the weights and the pool as arguments of the same shapes.
update_weights and sleep empty the prefix cache (its pages' K/V are gone or were computed by
other weights) and refuse an engine with requests in flight (update_weights takes those a "keep"
pause holds), or one of several processes. A research loop's weight sync is pause, update_weights,
resume. They are the `Engine`'s methods of those names, kept here beside each other (so they use
its lock and loop).
"""

from __future__ import annotations

import time

from jinfer.weights import replacement

SETTLE_SECONDS = 5.0  # how long a server's loop is given to read its last dispatch


def _settle(engine) -> None:
    """Once no request is left, the last dispatch of a finished one may still be on the device,
    unread: offline it is read here; a server's loop is given SETTLE_SECONDS to read it."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while True:
        with engine._lock:
            if engine._idle() or engine.scheduler.has_work:
                return
        if engine._thread is None:
            engine.step()
        elif time.monotonic() > deadline:
            return
        else:
            time.sleep(0.01)


def _check_idle(engine, what: str, held_may_stay: bool = False) -> None:
    """(Under the engine's lock, after `_settle`.) Requests held in their slots by a "keep" pause
    may stay where `held_may_stay`."""
    held = engine.scheduler.active_requests() and not (held_may_stay and engine.scheduler.holding)
    if engine.cluster is not None or not engine._idle() or held:
        raise RuntimeError(f"{what} needs an idle engine of one process: requests are in flight")


def update_weights(engine, params) -> int:
    """Serve `params` from the next step on (`weights.replacement` says what they must be); the new
    weights version."""
    target = replacement(engine.params, params, engine.steps.model, engine.layout.packed_weights)
    _settle(engine)
    with engine._lock:
        _check_idle(engine, "update_weights", held_may_stay=True)
        engine.device.set_target(target)
        engine.kv.pool.forget()
        engine.weights_version += 1
        return engine.weights_version


def sleep(engine, level: int = 1) -> None:
    """Free the KV pool (and at level 2 the served model's weights); requests are refused until
    `wake_up`."""
    if level not in (1, 2):
        raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
    _settle(engine)
    with engine._lock:
        _check_idle(engine, "sleep")
        engine.device.sleep(drop_weights=level == 2)
        engine.kv.pool.forget()
        engine.asleep = max(engine.asleep, level)


def wake_up(engine) -> None:
    """A fresh KV pool; the engine serves again (an awake engine is left as it is). RuntimeError
    after a level-2 sleep until weights came back (`update_weights`)."""
    with engine._lock:
        if not engine.asleep:
            return
        if engine.device.weights_dropped:
            raise RuntimeError("the weights were dropped (sleep level 2): update_weights brings them back")
        engine.device.wake_up()
        engine.asleep = 0


PAUSE_MODES = ("finish", "abort", "keep")


def pause(engine, mode: str = "finish") -> None:
    """Admit no request until `resume` (new ones wait in the queue), and return once the requests
    in flight are: "finish", finished; "abort", ended (finish_reason "abort"); "keep", held in
    their slots with their KV after the step in flight, to go on after `resume` (update_weights
    may come between: they go on with the new weights over the K/V the old ones computed)."""
    if mode not in PAUSE_MODES:
        raise ValueError(f"a pause's mode is one of {', '.join(PAUSE_MODES)}; got {mode!r}")
    with engine._lock:
        if engine.cluster is not None:
            raise RuntimeError("pause is not served by a cluster of processes yet")
        scheduler = engine.scheduler
        scheduler.admitting, scheduler.holding = False, mode == "keep"
        if mode == "abort":
            for request in scheduler.active_requests():
                request.cancelled = True
        engine.paused = mode
        engine._lock.notify_all()
    while True:  # the engine's loop (or, offline, this one) steps until nothing is left to do
        with engine._lock:
            if engine._idle():
                return
        if engine._thread is None:
            engine.step()
        else:
            time.sleep(0.005)


def resume(engine) -> None:
    """Admit requests again, and step the held ones (a running engine is left as it is)."""
    with engine._lock:
        engine.scheduler.admitting, engine.scheduler.holding = True, False
        engine.paused = None
        engine._lock.notify_all()
