"""The crossing between the engine's thread and the server's event loop.

`EngineBridge.open` submits one request and returns an asyncio.Queue of its `RequestOutput`
events: the engine thread hands each event to the loop with `call_soon_threadsafe`, so the server
awaits tokens without polling. The bridge also keeps the set of requests in flight, which the
drain on shutdown waits for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from jinfer.engine import Engine
from jinfer.prepare import PreparedRequest
from jinfer.request import RequestOutput


class EngineBridge:
    def __init__(self, engine: Engine, on_finished: Callable[[str, dict[str, Any] | None], None]):
        self.engine = engine
        self.on_finished = on_finished  # (finish_reason, metrics): every outcome, aborts included
        self.in_flight: set[str] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    def open(self, prepared: PreparedRequest, queue: asyncio.Queue, tag: object = None) -> str:
        """Submit; events arrive on `queue` as (tag, RequestOutput). Raises QueueFullError."""
        loop = asyncio.get_running_loop()

        def sink(event: RequestOutput) -> None:
            loop.call_soon_threadsafe(self._deliver, queue, tag, event)

        request = self.engine.submit(prepared, sink)
        self.in_flight.add(request.request_id)
        self._idle.clear()
        return request.request_id

    def _deliver(self, queue: asyncio.Queue, tag: object, event: RequestOutput) -> None:
        if event.finished:
            self.on_finished(event.finish_reason, event.metrics)
            self.in_flight.discard(event.request_id)
            if not self.in_flight:
                self._idle.set()
        queue.put_nowait((tag, event))

    def cancel(self, request_id: str) -> None:
        self.engine.cancel(request_id)

    def cancel_all(self) -> None:
        for request_id in list(self.in_flight):
            self.engine.cancel(request_id)

    async def wait_idle(self, timeout: float) -> bool:
        """True once no request is in flight, False if `timeout` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True
