"""The OpenAI-compatible Starlette app: HTTP + SSE + WebSocket in, engine calls, events out.

    POST /v1/completions, /v1/chat/completions   (stream=true: Server-Sent Events)
    GET  /v1/models      POST /tokenize, /detokenize
    GET  /               the chat page (serve/webpage.py; off with --no-web-ui)
    GET  /health (liveness)   /ready (503 while warming up or draining)   /metrics (Prometheus)
    WS   /v1/ws          two-way streaming: send requests, receive token events, cancel any time

Every error is answered in OpenAI's shape with its status; nothing a client sends can raise past
the handlers. The app never touches a slot or a device array: it talks to the engine through
`EngineBridge`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import tempfile
from collections.abc import Callable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect

from jinfer.engine import Engine, EngineUnavailable
from jinfer.metrics import ServingMetrics
from jinfer.prepare import ContextLengthError, PreparedRequest, RequestError
from jinfer.sampling import SEED_LIMIT
from jinfer.scheduler import QueueFullError
from jinfer.structured import has_constraint

from .admin import admin_routes
from .anthropic_api import MessagesWriter, count_tokens, is_anthropic_path
from .anthropic_api import chat_body as messages_chat_body
from .anthropic_api import error_body as anthropic_error_body
from .batch_api import batch_routes
from .batches import ENDPOINTS, BatchRunner, FileStore
from .bridge import EngineBridge
from .protocol import APIError, GenerationRequest, Submission, api_param, parse_generation, parse_json_object
from .request_ids import RequestIdMiddleware
from .responses import ResponseWriter, WriterContext, now, usage
from .responses_api import ResponsesWriter, chat_body
from .settings import ServerConfig
from .tokens import detokenize, tokenize, tokenizer_info
from .webpage import PAGE_FILES, page_routes

log = logging.getLogger("jinfer.serve")


OPEN_PATHS = {b"/health", b"/ready"}  # exact raw paths that need no API key (and the chat page's)


class AuthMiddleware:
    """Bearer-key check on the raw request path, before routing: `//x` or `/a/../b` never bypass it."""

    def __init__(self, app, keys: tuple[str, ...], open_paths: set[bytes]):
        self.app, self.keys, self.open_paths = app, [k.encode() for k in keys], open_paths

    async def __call__(self, scope, receive, send):
        if not self.keys or scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        raw = scope.get("raw_path") or scope["path"].encode()
        if raw.split(b"?", 1)[0] in self.open_paths or self._authorized(scope):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": "invalid API key"})
            return
        error = APIError(401, "invalid or missing API key", code="invalid_api_key")
        response = _error_response(error, scope["path"])
        await response(scope, receive, send)

    def _authorized(self, scope) -> bool:
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"authorization", b"")
        token = given[7:].strip() if given[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
        # Compare against every key (constant time each), so timing reveals nothing.
        results = [hmac.compare_digest(token, key) for key in self.keys]
        return any(results)


def _event_stream(events) -> StreamingResponse:
    """Server-Sent Events, never cached or buffered on the way."""
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


def _error_response(error: APIError, path: str = "") -> JSONResponse:
    """The error in the shape of the API its route belongs to (Anthropic's or OpenAI's)."""
    body = anthropic_error_body(error) if is_anthropic_path(path) else error.body()
    return JSONResponse(body, status_code=error.status, headers=error.headers)


class JinferAPI:
    """Route handlers over one engine; responses are written by its writers (`serve/responses.py`,
    `serve/responses_api.py`), made at startup with the bridge."""

    def __init__(
        self,
        engine: Engine,
        settings: ServerConfig,
        model_name: str,
        api_keys: tuple[str, ...] = (),
        fingerprint: Callable[[], str] | None = None,
    ):
        self.engine = engine
        self.settings = settings
        self.model_name = model_name
        self._fingerprint = fingerprint  # computes system_fingerprint (serve/fingerprint.py) in the warm-up
        self.fingerprint: str | None = None  # on every response once ready
        # Choices one request may ask for: its choices enter the waiting queue together (the engine
        # admits them into slots afterwards), so as many as the queue holds.
        self._max_n = engine.layout.max_queue
        self.api_keys = api_keys
        self.tokenizer = engine.tokenizer
        self.preparer = engine.preparer
        self.bridge: EngineBridge | None = None  # created on the event loop at startup
        self.writer: ResponseWriter | None = None  # ... and the writers, which cancel through it
        self.responses_writer: ResponsesWriter | None = None
        self.messages_writer: MessagesWriter | None = None
        self.batch_runner: BatchRunner | None = None  # files and batches (serve/batches.py)
        self.metrics = ServingMetrics(engine.stats, lambda: engine.dispatch_counts)
        self.ready = False
        self.draining = False
        self.adapter_paths: dict[str, str] = {}  # where each adapter loaded by name came from

    # ------------------------------------------------------------------------ lifecycle
    async def startup(self) -> None:
        """Create the bridge and start the warm-up in the background: the server answers at once
        (/health 200, /ready and generation 503) and serves once every step is compiled."""
        self.bridge = EngineBridge(self.engine, self.metrics.observe_finished)
        context = WriterContext(
            self.engine, self.bridge, self.settings, self.model_name, lambda: self.fingerprint
        )
        self.writer = ResponseWriter(context)
        self.responses_writer = ResponsesWriter(context, self.writer)
        self.messages_writer = MessagesWriter(context, self.writer)
        directory = self.settings.batch_dir or tempfile.mkdtemp(prefix="jinfer-batches-")
        slots = self.settings.batch_slots or max(1, self.engine.layout.max_slots // 8)
        self.batch_runner = BatchRunner(directory, FileStore(directory), self.answer, slots)
        self._warmup = asyncio.create_task(self._warm_up())

    async def _warm_up(self) -> None:
        try:
            seconds = await asyncio.to_thread(self.engine.warmup)
            if self._fingerprint is not None:
                self.fingerprint = await asyncio.to_thread(self._fingerprint)
                log.info("system_fingerprint %s", self.fingerprint)
        except Exception:
            log.exception("warm-up failed; the server stays unready")
            return
        if self.draining:
            return
        self.engine.start()
        self.ready = True
        log.info("warm-up took %.1f s; %d compiled programs; ready", seconds, self.engine.compile_count())
        self.batch_runner.resume_all()

    async def shutdown(self) -> None:
        self.ready = False
        await self.batch_runner.stop()
        await asyncio.to_thread(self.engine.stop)

    async def drain(self) -> None:
        """Stop admitting, let running requests finish up to the timeout, then abort the rest."""
        self.draining = True
        log.info("draining: %d requests in flight", len(self.bridge.in_flight))
        if not await self.bridge.wait_idle(self.settings.drain_timeout):
            log.info("drain timeout: aborting %d requests", len(self.bridge.in_flight))
            self.bridge.cancel_all()
            await self.bridge.wait_idle(10.0)

    def _check_serving(self) -> None:
        if (unavailable := self._unavailable()) is not None:
            self.metrics.rejected.inc()
            raise unavailable

    def _unavailable(self) -> APIError | None:
        """Why generation cannot be served now (a 503), or None."""
        if self.engine.failure is not None:
            return APIError(503, f"the engine is unavailable: {self.engine.failure}", code="unavailable")
        if self.draining:
            return APIError(503, "the server is shutting down", code="draining")
        if not self.ready:
            return APIError(503, "the server is warming up", code="not_ready", headers={"Retry-After": "5"})
        if self.engine.asleep:
            return APIError(
                503, "the server is asleep until POST /wake_up", code="sleeping", headers={"Retry-After": "5"}
            )
        return None

    # ------------------------------------------------------------------------- helpers
    async def _body(self, request: Request) -> dict[str, Any]:
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"request body is larger than {limit} bytes", code="body_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(413, f"request body is larger than {limit} bytes", code="body_too_large")
            chunks.append(chunk)
        return parse_json_object(b"".join(chunks))

    def _check_model(self, model: str | None) -> str | None:
        """The adapter a request's `model` names (None: the base model); 404 for any other name."""
        if model is None or model == self.model_name:
            return None
        if model in self.engine.adapters.names:
            return model
        raise APIError(404, f"the model '{model}' does not exist", param="model", code="model_not_found")

    def _parsed(self, body: dict, kind: str) -> GenerationRequest:
        """A generation body parsed, with the adapter its model names."""
        req = parse_generation(body, kind, self._max_n)
        return dataclasses.replace(req, adapter=self._check_model(req.model))

    def _prepare(self, req: GenerationRequest) -> list[PreparedRequest]:
        """The request's prompts (or its chat) prepared, one each."""
        try:
            options = {
                "sampling": req.sampling,
                "context_policy": req.context_policy,
                "cache_salt": req.cache_salt,
                "adapter": req.adapter,
                "priority": req.priority,
                "prediction": req.prediction,
            }
            if req.kind == "chat":
                chat = {
                    n: getattr(req, n) for n in ("tools", "tool_choice", "parallel_tool_calls", "template")
                }
                return [self.preparer.prepare(messages=req.messages, **options, **chat)]
            return [self.preparer.prepare(prompt, **options) for prompt in req.prompts]
        except ContextLengthError as e:
            param = "messages" if req.kind == "chat" else "prompt"
            raise APIError(400, str(e), param=param, code="context_length_exceeded") from None
        except RequestError as e:
            raise APIError(400, str(e), param=api_param(e.param)) from None

    async def _prepared(self, req: GenerationRequest) -> list[PreparedRequest]:
        """The request prepared; off the event loop when it has a constraint to compile (bounded
        by the grammar library's limits, yet long enough to hold up every other connection)."""
        if not has_constraint(req.sampling) and req.tool_choice in (None, "none", "auto"):
            return self._prepare(req)
        return await asyncio.to_thread(self._prepare, req)

    def _open_all(
        self, req: GenerationRequest, prepared: list[PreparedRequest], queue: asyncio.Queue
    ) -> Submission:
        """Submit n choices per prompt; on any failure cancel the ones already submitted. Choice i
        gets the seed preparation chose (the request's, or a fresh one) + i, so n > 1 requests give
        n different answers, and the seed sent back reproduces them."""
        seed = prepared[0].sampling.seed
        opened: list[str] = []
        try:
            for index in range(req.choices):
                choice = prepared[index // req.n].with_seed((seed + index) % SEED_LIMIT)
                opened.append(self.bridge.open(choice, queue, index))
        except (QueueFullError, EngineUnavailable) as e:
            for request_id in opened:
                self.bridge.cancel(request_id)
            self.metrics.rejected.inc()
            if isinstance(e, EngineUnavailable):
                raise APIError(503, str(e), code="unavailable") from None
            raise APIError(
                429, str(e), code="queue_full", headers={"Retry-After": str(self.settings.retry_after_s)}
            ) from None
        except BaseException:
            for request_id in opened:
                self.bridge.cancel(request_id)
            raise
        log.info(
            "%s: %d choices of %s prompt tokens", req.kind, req.choices, [len(p.prompt_ids) for p in prepared]
        )
        return Submission(
            opened, [p.prompt_ids for p in prepared], seed, prepared[0].tools, prepared[0].reasoning
        )

    # ------------------------------------------------------------------------ handlers
    async def health(self, request: Request) -> Response:
        """200 while the engine can compute (on several processes: with each one's compile count)."""
        member, compiles = self.engine.cluster, self.engine.compile_count()
        body = {"status": "ok"} | ({"processes": member.status(compiles)} if member else {})
        if self.engine.failure is not None:
            return JSONResponse(body | {"status": "unavailable", "error": self.engine.failure}, 503)
        if self.engine.paused:  # requests are taken and wait for POST /resume
            body |= {"status": "paused", "mode": self.engine.paused}
        return JSONResponse(
            body | ({"status": "sleeping", "level": self.engine.asleep} if self.engine.asleep else {})
        )

    async def ready_check(self, request: Request) -> Response:
        if self.engine.failure is not None:
            return JSONResponse({"status": "unavailable", "error": self.engine.failure}, status_code=503)
        if self.draining or not self.ready:
            return JSONResponse({"status": "draining" if self.draining else "warming_up"}, status_code=503)
        if self.engine.asleep:
            return JSONResponse({"status": "sleeping"}, status_code=503)
        return JSONResponse({"status": "ready"})

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": now(),
            "owned_by": "jinfer",
            "max_model_len": self.preparer.max_seq_len,
            "weights_version": self.engine.weights_version,  # 0: as loaded; POST /v1/update_weights
        }

    def _adapter_card(self, name: str) -> dict[str, Any]:
        card = {"id": name, "object": "model", "created": now(), "owned_by": "jinfer"}
        return card | {"parent": self.model_name, "root": self.adapter_paths.get(name)}

    async def models(self, request: Request) -> Response:
        adapters = [self._adapter_card(name) for name in sorted(self.engine.adapters.names)]
        return JSONResponse({"object": "list", "data": [self._model_card(), *adapters]})

    async def model(self, request: Request) -> Response:
        adapter = self._check_model(request.path_params["model_id"])  # another id: 404 model_not_found
        return JSONResponse(self._model_card() if adapter is None else self._adapter_card(adapter))

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(self.metrics.exposition(), media_type="text/plain; version=0.0.4")

    async def tokenize(self, request: Request) -> Response:
        body = await self._body(request)
        self._check_model(body.get("model"))
        return JSONResponse(tokenize(self.preparer, body))

    async def detokenize(self, request: Request) -> Response:
        body = await self._body(request)
        self._check_model(body.get("model"))
        return JSONResponse(detokenize(self.tokenizer, self.engine.model_config.vocab_size, body))

    async def tokenizer_info(self, request: Request) -> Response:
        return JSONResponse(tokenizer_info(self.tokenizer, self.preparer.max_seq_len))

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def _generate(self, request: Request, kind: str) -> Response:
        self._check_serving()
        return await self._respond(request, self._parsed(await self._body(request), kind))

    async def answer(self, url: str, body: dict[str, Any], priority: int) -> tuple[int, dict[str, Any]]:
        """A request's whole answer as HTTP gives it, (status, body), at `priority`: a batch line's
        (serve/batches.py). 503 while the server cannot serve, as HTTP's."""
        kind = ENDPOINTS[url]
        try:
            if (unavailable := self._unavailable()) is not None:
                raise unavailable
            req = dataclasses.replace(self._parsed(body, kind), priority=priority)
            if req.stream:
                raise APIError(400, "a batch line is answered whole: drop 'stream'", param="stream")
            response = await self._respond(None, req)
        except APIError as e:
            return e.status, e.body()
        return response.status_code, json.loads(response.body)

    async def _respond(self, request: Request | None, req: GenerationRequest) -> Response:
        """The response to a parsed completions or chat request (`request` None: no client to
        watch for a disconnect)."""
        if req.score_only:
            return await self.writer.score_only(req, [p.prompt_ids for p in await self._prepared(req)])
        queue: asyncio.Queue = asyncio.Queue()
        submitted = self._open_all(req, await self._prepared(req), queue)
        if req.stream:
            return _event_stream(self.writer.sse(req, queue, submitted))
        return await self.writer.complete(request, req, queue, submitted)

    async def responses(self, request: Request) -> Response:
        """OpenAI's Responses API, as a chat (serve/responses_api.py)."""
        self._check_serving()
        body = await self._body(request)
        req = self._parsed(chat_body(body), "chat")
        queue: asyncio.Queue = asyncio.Queue()
        submitted = self._open_all(req, await self._prepared(req), queue)
        if req.stream:
            return _event_stream(self.responses_writer.response_events(req, body, queue, submitted))
        return await self.responses_writer.respond(request, req, body, queue, submitted)

    async def messages(self, request: Request) -> Response:
        """Anthropic's Messages API, as a chat (serve/anthropic_api.py)."""
        self._check_serving()
        req = self._parsed(messages_chat_body(await self._body(request)), "chat")
        queue: asyncio.Queue = asyncio.Queue()
        submitted = self._open_all(req, await self._prepared(req), queue)
        if req.stream:
            return _event_stream(self.messages_writer.events(req, queue, submitted))
        return await self.messages_writer.respond(request, req, queue, submitted)

    async def count_tokens(self, request: Request) -> Response:
        chat = messages_chat_body(await self._body(request), counting=True)
        return JSONResponse(count_tokens(self.preparer, self._parsed(chat, "chat")))

    # ----------------------------------------------------------------------- websocket
    async def websocket(self, ws: WebSocket) -> None:
        """Messages in: {"type": "completion"|"chat", "id": ..., ...body} and {"type": "cancel", "id": ...}.

        Messages out: {"type": "token", "id", "index", "text", "token_ids"}, {"type": "done", "id",
        "index", "finish_reason", "usage"} and {"type": "error", "id", "error": {...}}.
        """
        await ws.accept()
        running: dict[Any, tuple[list[str], asyncio.Task]] = {}
        try:
            while True:
                raw = await ws.receive_text()
                client_id = None
                try:
                    message = parse_json_object(raw.encode())
                    client_id = message.get("id")
                    if message.get("type") == "cancel":
                        for request_id in running.get(client_id, ([], None))[0]:
                            self.bridge.cancel(request_id)
                        continue
                    if message.get("type") not in ("completion", "chat"):
                        raise APIError(400, "'type' must be completion, chat or cancel", param="type")
                    if client_id in running:
                        raise APIError(400, f"id {client_id!r} is already running", param="id")
                    self._check_serving()
                    body = {k: v for k, v in message.items() if k not in ("type", "id")}
                    req = self._parsed(body, message["type"])
                    queue: asyncio.Queue = asyncio.Queue()
                    submitted = self._open_all(req, await self._prepared(req), queue)
                except APIError as e:
                    await ws.send_json({"type": "error", "id": client_id, "error": e.body()["error"]})
                    continue
                forward = self._ws_forward(ws, client_id, req, queue, submitted.prompt_ids, running)
                running[client_id] = (submitted.request_ids, asyncio.create_task(forward))
        except WebSocketDisconnect:
            pass
        finally:
            for request_ids, task in running.values():
                for request_id in request_ids:
                    self.bridge.cancel(request_id)
                task.cancel()

    async def _ws_forward(self, ws, client_id, req, queue, prompt_ids, running) -> None:
        remaining = req.choices
        try:
            while remaining:
                index, event = await queue.get()
                if event.token_ids or event.text:
                    message = {"type": "token", "id": client_id, "index": index, "text": event.text}
                    message["token_ids"] = event.token_ids
                    await ws.send_json(message)
                if event.finished:
                    remaining -= 1
                    completion = event.metrics["completion_tokens"] if event.metrics else 0
                    await ws.send_json(
                        {
                            "type": "done",
                            "id": client_id,
                            "index": index,
                            "finish_reason": event.finish_reason,
                            "error": event.error,
                            "usage": usage([event], [prompt_ids[index // req.n]], completion),
                        }
                    )
        except (WebSocketDisconnect, RuntimeError):
            pass  # the socket closed under us: the handler's cleanup cancels the requests
        finally:
            running.pop(client_id, None)


async def _api_error(request, exc: APIError):
    return _error_response(exc, request.url.path)


async def _http_error(request, exc: HTTPException):
    status = exc.status_code
    message = f"no route for {request.method} {request.url.path}" if status in (404, 405) else exc.detail
    error = APIError(status, message, code="not_found" if status == 404 else None)
    return _error_response(error, request.url.path)


async def _unexpected(request, exc: Exception):
    log.exception("unhandled error")
    return _error_response(APIError(500, f"internal error: {type(exc).__name__}"), request.url.path)


def _routes(api: JinferAPI) -> list:
    return [
        Route("/health", api.health),
        Route("/ready", api.ready_check),
        Route("/metrics", api.metrics_endpoint),
        Route("/v1/models", api.models),
        Route("/v1/models/{model_id:path}", api.model),
        Route("/tokenize", api.tokenize, methods=["POST"]),
        Route("/detokenize", api.detokenize, methods=["POST"]),
        Route("/tokenizer_info", api.tokenizer_info),
        Route("/v1/completions", api.completions, methods=["POST"]),
        Route("/v1/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/v1/responses", api.responses, methods=["POST"]),
        Route("/v1/messages", api.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", api.count_tokens, methods=["POST"]),
        *admin_routes(api),
        *batch_routes(api),
        # The same without /v1, as llama.cpp's server also answers them (and clients send them).
        Route("/models", api.models),
        Route("/completions", api.completions, methods=["POST"]),
        Route("/chat/completions", api.chat_completions, methods=["POST"]),
        Route("/responses", api.responses, methods=["POST"]),
        WebSocketRoute("/v1/ws", api.websocket),
    ]


def build_app(
    engine: Engine,
    settings: ServerConfig | None = None,
    model_name: str = "jinfer",
    api_keys: tuple[str, ...] = (),
    fingerprint: Callable[[], str] | None = None,
) -> tuple[Starlette, JinferAPI]:
    settings = settings or ServerConfig()
    api = JinferAPI(engine, settings, model_name, api_keys, fingerprint)

    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        await api.startup()
        yield
        await api.shutdown()

    routes = _routes(api)
    open_paths = set(OPEN_PATHS)
    if settings.web_ui:
        routes += page_routes()
        open_paths |= {path.encode() for path in PAGE_FILES}
    app = Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={APIError: _api_error, HTTPException: _http_error, Exception: _unexpected},
    )
    app.add_middleware(AuthMiddleware, keys=api_keys, open_paths=open_paths)
    app.add_middleware(RequestIdMiddleware)  # outside the key check: a refused request has an id too
    if settings.cors_origins:  # outside the key check: a browser's preflight carries no key
        origins = [o.strip() for o in settings.cors_origins.split(",") if o.strip()]
        methods, headers = ["GET", "POST", "OPTIONS"], ["Authorization", "Content-Type", "X-API-Key"]
        app.add_middleware(
            CORSMiddleware,
            allow_origins=origins,
            allow_methods=methods,
            allow_headers=[*headers, "X-Request-Id"],
            expose_headers=["X-Request-Id"],
        )
    return app, api
