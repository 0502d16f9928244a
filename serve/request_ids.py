"""Request ids across the server: each HTTP request's `x-request-id` (the client's, when it sent a
usable one; else a fresh one) is answered back in the response's headers and tags every log
record written while the request is handled, so a client's id finds its lines in the logs.
"""

from __future__ import annotations

import contextvars
import logging
import re
import uuid

HEADER = b"x-request-id"
# What is taken from a client: printable ASCII without blanks, as ids and trace tokens are; a
# header that could split a log line or forge another is replaced by a fresh id.
_USABLE = re.compile(rb"[!-~]{1,128}")

current: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)


def request_id_of(headers) -> str:
    """The id of a request with these raw ASGI headers."""
    given = dict(headers or []).get(HEADER, b"")
    return given.decode("ascii") if _USABLE.fullmatch(given) else uuid.uuid4().hex


class RequestIdMiddleware:
    """Sets `current` for the request's handling and answers its id in `x-request-id`."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        request_id = request_id_of(scope.get("headers"))
        token = current.set(request_id)

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, request_id.encode("ascii"))]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            current.reset(token)


class RequestIdFilter(logging.Filter):
    """Gives each record a `request_tag`: " [<id>]" while a request is handled, else ""."""

    def filter(self, record: logging.LogRecord) -> bool:
        request_id = current.get()
        record.request_tag = f" [{request_id}]" if request_id else ""
        return True


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s%(request_tag)s: %(message)s"


def tag_log_records() -> None:
    """Add the request tag to every record the root logger's handlers write."""
    for handler in logging.getLogger().handlers:
        handler.addFilter(RequestIdFilter())
