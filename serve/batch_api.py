"""The HTTP side of the Files and Batch APIs (`serve/batches.py` keeps and runs them): uploads as
multipart forms, bounded by `--max-file-bytes`, and OpenAI's objects and lists as answers."""

from __future__ import annotations

import os
import tempfile

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Route

from .protocol import APIError


class BatchAPI:
    """The handlers, over a server's `JinferAPI` (its batch runner, file store and body reader)."""

    def __init__(self, api):
        self.api = api

    @property
    def runner(self):
        return self.api.batch_runner

    async def upload(self, request: Request) -> Response:
        """multipart/form-data with `file` and `purpose` ("batch") -> the file's object."""
        limit = self.api.settings.max_file_bytes
        declared = request.headers.get("content-length")
        if declared is None or not declared.isdigit():
            raise APIError(411, "an upload must declare its Content-Length", code="length_required")
        if int(declared) > limit:
            raise APIError(413, f"the upload is larger than {limit} bytes", code="file_too_large")
        if not request.headers.get("content-type", "").startswith("multipart/form-data"):
            raise APIError(400, "upload the file as multipart/form-data", param="file")
        async with request.form(max_files=1, max_fields=8) as form:
            upload, purpose = form.get("file"), form.get("purpose")
            if purpose != "batch":
                raise APIError(400, "'purpose' must be batch", param="purpose")
            if upload is None or isinstance(upload, str):
                raise APIError(400, "'file' must be a file", param="file")
            path = await self._spool(upload, limit)
        return JSONResponse(self.runner.files.add(upload.filename or "upload.jsonl", purpose, path))

    async def _spool(self, upload, limit: int) -> str:
        """The upload's bytes in a file beside the store's (moved in by `FileStore.add`)."""
        handle, path = tempfile.mkstemp(dir=self.runner.files.directory, suffix=".upload")
        size = 0
        with os.fdopen(handle, "wb") as out:
            while chunk := await upload.read(2**20):
                size += len(chunk)
                if size > limit:
                    out.close()
                    os.remove(path)
                    raise APIError(413, f"the upload is larger than {limit} bytes", code="file_too_large")
                out.write(chunk)
        return path

    async def list_files(self, request: Request) -> Response:
        return JSONResponse(self.runner.files.list(request.query_params))

    async def file(self, request: Request) -> Response:
        return JSONResponse(self.runner.files.get(request.path_params["file_id"]))

    async def content(self, request: Request) -> Response:
        path = self.runner.files.data_path(request.path_params["file_id"])
        return FileResponse(path, media_type="application/octet-stream")

    async def delete_file(self, request: Request) -> Response:
        return JSONResponse(self.runner.files.delete(request.path_params["file_id"]))

    async def create_batch(self, request: Request) -> Response:
        return JSONResponse(self.runner.create(await self.api._body(request)))

    async def list_batches(self, request: Request) -> Response:
        return JSONResponse(self.runner.list(request.query_params))

    async def batch(self, request: Request) -> Response:
        return JSONResponse(self.runner.get(request.path_params["batch_id"]).obj)

    async def cancel(self, request: Request) -> Response:
        return JSONResponse(self.runner.cancel(request.path_params["batch_id"]))


def batch_routes(api) -> list[Route]:
    handlers = BatchAPI(api)
    return [
        Route("/v1/files", handlers.upload, methods=["POST"]),
        Route("/v1/files", handlers.list_files, methods=["GET"]),
        Route("/v1/files/{file_id}", handlers.file, methods=["GET"]),
        Route("/v1/files/{file_id}", handlers.delete_file, methods=["DELETE"]),
        Route("/v1/files/{file_id}/content", handlers.content, methods=["GET"]),
        Route("/v1/batches", handlers.create_batch, methods=["POST"]),
        Route("/v1/batches", handlers.list_batches, methods=["GET"]),
        Route("/v1/batches/{batch_id}", handlers.batch, methods=["GET"]),
        Route("/v1/batches/{batch_id}/cancel", handlers.cancel, methods=["POST"]),
    ]
