"""The endpoints that change what the engine holds between requests (`jinfer.residency`,
`jinfer.adapter_slots`), for research loops and servers that lend their memory: POST
/v1/update_weights, /sleep, /wake_up, /pause, /resume, /v1/load_lora_adapter and
/v1/unload_lora_adapter (vLLM's names and bodies). Only on a server started with an API key (a
403 otherwise: they would let anyone swap the model); a 409 while requests run (weights) or hold
every adapter slot."""

from __future__ import annotations

import asyncio
import logging

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from jinfer.adapter_slots import NoFreeSlot
from jinfer.formats.adapters import read_adapter
from jinfer.loading import CheckpointError, load_model, placement_for
from jinfer.residency import PAUSE_MODES

from .protocol import APIError

log = logging.getLogger("jinfer.serve")


class Admin:
    """The handlers, over a server's `JinferAPI` (its engine, keys and body reader)."""

    def __init__(self, api):
        self.api = api

    async def sleep(self, request: Request) -> Response:
        """`{"level": 1 | 2}` (1 if no body): the engine's sleep (`jinfer.residency`); generation is a 503
        until POST /wake_up."""
        self._check_admin()
        body = await self._optional_body(request)
        level = body.get("level", 1)
        if set(body) - {"level"} or level not in (1, 2) or isinstance(level, bool):
            raise APIError(400, 'the body must be {"level": 1 or 2}', param="level")
        await self._residency(self.api.engine.sleep, level)
        return JSONResponse({"status": "sleeping", "level": level})

    async def wake_up(self, request: Request) -> Response:
        """Serve again, with no recompile (after level 2 once POST /v1/update_weights brought weights)."""
        self._check_admin()
        await self._residency(self.api.engine.wake_up)
        return JSONResponse({"status": "ready"})

    async def pause(self, request: Request) -> Response:
        """`{"mode": "finish" | "abort" | "keep"}` ("finish" if no body): no request is admitted
        until POST /resume (new ones wait in the queue); answered once the requests in flight have
        finished, were aborted, or are held with their KV (`jinfer.residency.pause`)."""
        self._check_admin()
        body = await self._optional_body(request)
        mode = body.get("mode", "finish")
        if set(body) - {"mode"} or mode not in PAUSE_MODES:
            raise APIError(400, 'the body must be {"mode": "finish", "abort" or "keep"}', param="mode")
        await self._residency(self.api.engine.pause, mode)
        return JSONResponse({"status": "paused", "mode": mode})

    async def resume(self, request: Request) -> Response:
        """Admit requests again; held ones go on."""
        self._check_admin()
        await self._residency(self.api.engine.resume)
        return JSONResponse({"status": "ready"})

    async def _optional_body(self, request: Request) -> dict:
        """The JSON body, or {} for a request without one (these endpoints have defaults)."""
        return await self.api._body(request) if int(request.headers.get("content-length") or 0) else {}

    def _check_admin(self) -> None:
        if not self.api.api_keys:
            raise APIError(403, "this endpoint needs a server started with --api-key", code="forbidden")

    async def _residency(self, change, *args):
        """Run a change of what the engine holds (`jinfer.residency`), its refusals as HTTP errors."""
        try:
            return await asyncio.to_thread(change, *args)
        except RuntimeError as e:
            raise APIError(409, str(e), code="busy") from None

    async def update_weights(self, request: Request) -> Response:
        """`{"path": DIR}`: the model's weights read from DIR (a Hugging Face directory of the same
        model, a GGUF file or a jinfer checkpoint) served from the next step on (`Engine.
        update_weights`); `{"weights_version"}` back; a 400 for weights that do not fit the model."""
        self._check_admin()
        body = await self.api._body(request)
        if set(body) - {"path"} or not isinstance(body.get("path"), str) or not body["path"]:
            raise APIError(400, 'the body must be {"path": a directory or file of weights}', param="path")
        config = self.api.engine.config
        try:
            loaded = await asyncio.to_thread(
                load_model, body["path"], quantization=config.quantization, placement=placement_for(config)
            )
        except (CheckpointError, ValueError, OSError) as e:
            raise APIError(400, f"cannot read weights there: {e}", param="path") from None
        try:
            version = await self._residency(self.api.engine.update_weights, loaded.params)
        except ValueError as e:
            raise APIError(400, f"cannot serve those weights: {e}", param="path") from None
        log.info("weights from %s: version %d", body["path"], version)
        return JSONResponse({"weights_version": version})

    async def load_lora_adapter(self, request: Request) -> Response:
        """`{"lora_name", "lora_path"}`: the adapter in that directory (PEFT or jinfer's) served
        under that name, for requests whose `model` names it; a name loaded again swaps its
        adapter for requests from now on (those running finish on theirs)."""
        self._check_admin()
        body = await self.api._body(request)
        name, path = body.get("lora_name"), body.get("lora_path")
        if set(body) - {"lora_name", "lora_path"} or not all(isinstance(v, str) and v for v in (name, path)):
            raise APIError(
                400, 'the body must be {"lora_name": a name, "lora_path": a directory}', param="lora_path"
            )
        if name == self.api.model_name:
            raise APIError(400, f"'{name}' is the base model's name", param="lora_name")
        engine = self.api.engine
        try:
            adapter = await asyncio.to_thread(read_adapter, path, engine.model_config)
        except (CheckpointError, ValueError, OSError) as e:
            raise APIError(400, f"cannot read an adapter there: {e}", param="lora_path") from None
        try:
            await asyncio.to_thread(engine.load_adapter, name, adapter)
        except NoFreeSlot as e:
            raise APIError(409, str(e), param="lora_name", code="busy") from None
        except (RuntimeError, ValueError) as e:
            raise APIError(400, str(e), param="lora_path") from None
        self.api.adapter_paths[name] = path
        log.info("adapter '%s' loaded from %s", name, path)
        return JSONResponse({"status": "loaded", "lora_name": name})

    async def unload_lora_adapter(self, request: Request) -> Response:
        """`{"lora_name"}`: new requests naming it get a 404; running ones finish on it."""
        self._check_admin()
        body = await self.api._body(request)
        name = body.get("lora_name")
        if set(body) - {"lora_name"} or not isinstance(name, str):
            raise APIError(400, 'the body must be {"lora_name": a loaded adapter\'s name}', param="lora_name")
        try:
            await asyncio.to_thread(self.api.engine.unload_adapter, name)
        except KeyError:
            raise APIError(
                404, f"no adapter named '{name}' is loaded", param="lora_name", code="model_not_found"
            ) from None
        self.api.adapter_paths.pop(name, None)
        return JSONResponse({"status": "unloaded", "lora_name": name})


def admin_routes(api) -> list[Route]:
    admin = Admin(api)
    return [
        Route("/v1/update_weights", admin.update_weights, methods=["POST"]),
        Route("/sleep", admin.sleep, methods=["POST"]),
        Route("/wake_up", admin.wake_up, methods=["POST"]),
        Route("/pause", admin.pause, methods=["POST"]),
        Route("/resume", admin.resume, methods=["POST"]),
        Route("/v1/load_lora_adapter", admin.load_lora_adapter, methods=["POST"]),
        Route("/v1/unload_lora_adapter", admin.unload_lora_adapter, methods=["POST"]),
    ]
