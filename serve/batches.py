"""OpenAI's Files and Batch APIs: `/v1/files` (upload with purpose "batch", list, retrieve, content,
delete) and `/v1/batches` (create, retrieve, list, cancel), kept on disk under the batch directory
(`--batch-dir`) so that a restarted server resumes every batch where it stopped.

    <batch dir>/files/<file id>.json, .data      a file's object and its bytes
    <batch dir>/batches/<batch id>.json          a batch's object, rewritten as it moves on
    <batch dir>/batches/<batch id>.output.jsonl  its result lines, appended as each line finishes
    <batch dir>/batches/<batch id>.errors.jsonl  ... and its error lines

A batch's input lines ({"custom_id", "method": "POST", "url", "body"}) run on the ledger the offline
runner uses (`jinfer.batch`: what is already written is skipped on resume, a torn last line cut
off, a malformed line an error line and never a failed batch), each as the same request over HTTP
would (`JinferAPI.answer`), at `BATCH_PRIORITY`: below every interactive request, which takes a
slot from a batch line at once (`jinfer.scheduler`). At most `--batch-slots` lines (over every
batch) are in flight: batch work never fills the waiting queue interactive requests are admitted
through, and the dispatch a user's request arrives during, which it must wait out, carries few
batch rows, so it is short; a line turned away for a full queue or a warming / draining server
is tried again later, never written. `completion_window` is accepted as "24h" and not enforced.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from jinfer.batch import BatchLine, completed_ids, pending_lines

from .protocol import APIError

log = logging.getLogger("jinfer.serve")

BATCH_PRIORITY = 2**30  # lower runs first: batch lines after any request that does not ask for less
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}  # url -> request kind
RETRY_STATUSES = (429, 503)  # a full queue, a warming or draining server: the line runs later
RETRY_SECONDS = 0.5
SAVE_SECONDS = 1.0  # a running batch's object (its counts) is written at most this often


def _new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def _write_json(path: str, value: dict[str, Any]) -> None:
    """Atomically: a crash leaves the old object or the new one, never half of either."""
    partial = path + ".partial"
    with open(partial, "w", encoding="utf-8") as f:
        json.dump(value, f)
    os.replace(partial, path)


def _read_json(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _page(objects: list[dict[str, Any]], query) -> dict[str, Any]:
    """OpenAI's list shape, newest first, after the `after` id, at most `limit`."""
    try:
        limit = int(query.get("limit", 100))
    except ValueError:
        raise APIError(400, "'limit' must be an integer", param="limit") from None
    if not 1 <= limit <= 10_000:
        raise APIError(400, "'limit' must be in [1, 10000]", param="limit")
    objects = sorted(objects, key=lambda o: (o["created_at"], o["id"]), reverse=True)
    after = query.get("after")
    if after is not None:
        ids = [o["id"] for o in objects]
        objects = objects[ids.index(after) + 1 :] if after in ids else []
    page = objects[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(objects) > limit,
    }


class FileStore:
    """Files by id, on disk."""

    PURPOSES = ("batch", "batch_output")  # the second: what batches write, never uploaded

    def __init__(self, directory: str):
        self.directory = os.path.join(directory, "files")
        os.makedirs(self.directory, exist_ok=True)

    def _path(self, file_id: str, suffix: str) -> str:
        if not file_id.startswith("file-") or not file_id[5:].isalnum():
            raise APIError(404, f"no file {file_id[:80]!r}", param="file_id", code="file_not_found")
        return os.path.join(self.directory, file_id + suffix)

    def add(self, filename: str, purpose: str, source: str | bytes) -> dict[str, Any]:
        """A new file of `source` (bytes, or a path moved in), with its object."""
        file_id = _new_id("file-")
        data = self._path(file_id, ".data")
        if isinstance(source, bytes):
            with open(data, "wb") as f:
                f.write(source)
        else:
            os.replace(source, data)
        created = int(time.time())
        obj = {
            "id": file_id,
            "object": "file",
            "bytes": os.path.getsize(data),
            "created_at": created,
            "expires_at": None,
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "status_details": None,
        }
        _write_json(self._path(file_id, ".json"), obj)
        return obj

    def get(self, file_id: str) -> dict[str, Any]:
        path = self._path(file_id, ".json")
        if not os.path.exists(path):
            raise APIError(404, f"no file {file_id!r}", param="file_id", code="file_not_found")
        return _read_json(path)

    def data_path(self, file_id: str) -> str:
        self.get(file_id)
        return self._path(file_id, ".data")

    def list(self, query) -> dict[str, Any]:
        purpose = query.get("purpose")
        objects = [
            _read_json(os.path.join(self.directory, name))
            for name in os.listdir(self.directory)
            if name.endswith(".json")
        ]
        return _page([o for o in objects if purpose is None or o["purpose"] == purpose], query)

    def delete(self, file_id: str) -> dict[str, Any]:
        self.get(file_id)
        for suffix in (".data", ".json"):
            os.remove(self._path(file_id, suffix))
        return {"id": file_id, "object": "file", "deleted": True}


def _error_line(line: BatchLine, code: str, message: str) -> dict[str, Any]:
    record = {
        "id": _new_id("batch_req_"),
        "custom_id": line.item_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
    return record | ({"line": line.number} if line.item_id is None else {})


def line_problem(line: BatchLine, endpoint: str) -> str | None:
    """Why an input line cannot run (its own error line), or None."""
    if line.problem is not None:
        return line.problem
    entry = line.entry
    if not isinstance(entry.get("custom_id"), str) or not entry["custom_id"]:
        return f"line {line.number}: 'custom_id' must be a non-empty string"
    if entry.get("method", "POST") != "POST":
        return f"line {line.number}: 'method' must be POST"
    if entry.get("url") != endpoint:
        return f"line {line.number}: 'url' must be the batch's endpoint {endpoint}"
    if not isinstance(entry.get("body"), dict):
        return f"line {line.number}: 'body' must be a JSON object"
    return None


class Batch:
    """One batch: its object (saved as it changes) and the files its lines are written to."""

    def __init__(self, directory: str, obj: dict[str, Any]):
        self.obj = obj
        base = os.path.join(directory, obj["id"])
        self.path, self.output_path, self.errors_path = (
            base + ".json",
            base + ".output.jsonl",
            base + ".errors.jsonl",
        )
        self._saved = 0.0

    def save(self, force: bool = True) -> None:
        if force or time.monotonic() - self._saved >= SAVE_SECONDS:
            _write_json(self.path, self.obj)
            self._saved = time.monotonic()

    def move_to(self, status: str) -> None:
        self.obj["status"] = status
        self.obj[f"{status}_at"] = int(time.time())
        self.save()

    def record(self, record: dict[str, Any], ok: bool) -> None:
        """Append a line's result (flushed: the ledger of a resumed run) and count it."""
        with open(self.output_path if ok else self.errors_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.obj["request_counts"]["completed" if ok else "failed"] += 1
        self.save(force=False)


class BatchRunner:
    """Creates, runs, resumes and cancels batches over `answer(url, body, priority)` -> (status,
    body): the server's own handling of a request."""

    def __init__(
        self,
        directory: str,
        files: FileStore,
        answer: Callable[[str, dict, int], Awaitable[tuple[int, dict]]],
        concurrency: int,
    ):
        self.directory = os.path.join(directory, "batches")
        os.makedirs(self.directory, exist_ok=True)
        self.files, self.answer, self.concurrency = files, answer, concurrency
        # Lines in flight over every batch: each holds a slot of the engine while it runs.
        self.running = asyncio.Semaphore(concurrency)
        self.batches: dict[str, Batch] = {}
        self.tasks: dict[str, asyncio.Task] = {}
        for name in sorted(os.listdir(self.directory)):
            if name.endswith(".json"):
                obj = _read_json(os.path.join(self.directory, name))
                self.batches[obj["id"]] = Batch(self.directory, obj)

    # ---------------------------------------------------------------------------- requests
    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(body) - {"input_file_id", "endpoint", "completion_window", "metadata"})
        if unknown:
            raise APIError(400, f"'{unknown[0]}' is not a batch field", param=unknown[0])
        if body.get("endpoint") not in ENDPOINTS:
            raise APIError(400, f"'endpoint' must be one of {', '.join(ENDPOINTS)}", param="endpoint")
        if body.get("completion_window") != "24h":
            raise APIError(400, "'completion_window' must be 24h", param="completion_window")
        metadata = body.get("metadata")
        if metadata is not None and (
            not isinstance(metadata, dict)
            or len(metadata) > 16
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
        ):
            raise APIError(400, "'metadata' must be at most 16 string pairs", param="metadata")
        if not isinstance(body.get("input_file_id"), str):
            raise APIError(400, "'input_file_id' must be a file id", param="input_file_id")
        source = self.files.get(body["input_file_id"])
        if source["purpose"] != "batch":
            raise APIError(400, "the input file's purpose must be batch", param="input_file_id")
        now = int(time.time())
        obj = {
            "id": _new_id("batch_"),
            "object": "batch",
            "endpoint": body["endpoint"],
            "errors": None,
            "input_file_id": source["id"],
            "completion_window": "24h",
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": now,
            "expires_at": now + 24 * 3600,
            **dict.fromkeys(("in_progress_at", "finalizing_at", "completed_at", "failed_at"), None),
            **dict.fromkeys(("expired_at", "cancelling_at", "cancelled_at"), None),
            "request_counts": {"total": 0, "completed": 0, "failed": 0},
            "metadata": metadata,
        }
        batch = Batch(self.directory, obj)
        batch.save()
        self.batches[obj["id"]] = batch
        self.start(batch)
        return obj

    def get(self, batch_id: str) -> Batch:
        if batch_id not in self.batches:
            raise APIError(404, f"no batch {batch_id[:80]!r}", param="batch_id", code="batch_not_found")
        return self.batches[batch_id]

    def list(self, query) -> dict[str, Any]:
        return _page([b.obj for b in self.batches.values()], query)

    def cancel(self, batch_id: str) -> dict[str, Any]:
        batch = self.get(batch_id)
        if batch.obj["status"] in ("validating", "in_progress"):
            batch.move_to("cancelling")  # the runner stops taking lines and finishes as cancelled
            if batch_id not in self.tasks:
                self.start(batch)
        return batch.obj

    # ------------------------------------------------------------------------------ running
    def resume_all(self) -> None:
        """Start the runner of every batch a previous process left unfinished."""
        for batch in self.batches.values():
            if batch.obj["status"] in ("validating", "in_progress", "finalizing", "cancelling"):
                log.info("batch %s resumes (%s)", batch.obj["id"], batch.obj["status"])
                self.start(batch)

    def start(self, batch: Batch) -> None:
        self.tasks[batch.obj["id"]] = asyncio.create_task(self._run(batch))

    async def stop(self) -> None:
        for task in self.tasks.values():
            task.cancel()
        await asyncio.gather(*self.tasks.values(), return_exceptions=True)

    async def _run(self, batch: Batch) -> None:
        obj = batch.obj
        try:
            lines = await asyncio.to_thread(self._pending, batch)
            if obj["status"] == "validating":
                obj["request_counts"]["total"] = len(lines) + sum(obj["request_counts"].values())
                batch.move_to("in_progress")
            queue = asyncio.Queue()
            for line in lines:
                queue.put_nowait(line)
            workers = [self._work(batch, queue) for _ in range(min(self.concurrency, len(lines)) or 1)]
            await asyncio.gather(*workers)
            self._finish(batch)
        except asyncio.CancelledError:
            batch.save()
            raise
        except Exception as e:  # the input file gone, a disk full: the batch fails, the server serves on
            log.exception("batch %s failed", obj["id"])
            obj["errors"] = {"object": "list", "data": [{"code": "batch_failed", "message": str(e)}]}
            batch.move_to("failed")
        finally:
            self.tasks.pop(obj["id"], None)

    def _pending(self, batch: Batch) -> list[BatchLine]:
        """The lines still to run, the counts set from what the ledger holds (saved counts may lag
        it after a crash)."""
        done = completed_ids(batch.output_path, batch.errors_path, key_field="custom_id")
        counts = batch.obj["request_counts"]
        for path, name in ((batch.output_path, "completed"), (batch.errors_path, "failed")):
            if os.path.exists(path):
                with open(path, "rb") as f:
                    counts[name] = sum(1 for line in f if line.strip())
        return list(pending_lines(self.files.data_path(batch.obj["input_file_id"]), done, "custom_id"))

    async def _work(self, batch: Batch, queue: asyncio.Queue) -> None:
        """Run lines until none is left or the batch is cancelled."""
        while not queue.empty() and batch.obj["status"] == "in_progress":
            line = queue.get_nowait()
            problem = line_problem(line, batch.obj["endpoint"])
            if problem is not None:
                batch.record(_error_line(line, "invalid_request", problem), ok=False)
                continue
            while True:
                async with self.running:
                    status, body = await self.answer(
                        batch.obj["endpoint"], line.entry["body"], BATCH_PRIORITY
                    )
                if status not in RETRY_STATUSES:
                    break
                await asyncio.sleep(RETRY_SECONDS)
                if batch.obj["status"] != "in_progress":
                    return
            response = {"status_code": status, "request_id": body.get("id", _new_id("req_")), "body": body}
            record = {
                "id": _new_id("batch_req_"),
                "custom_id": line.item_id,
                "response": response,
                "error": None,
            }
            batch.record(record, ok=status == 200)

    def _finish(self, batch: Batch) -> None:
        """Output and error lines become files; the batch completed (or cancelled)."""
        obj = batch.obj
        cancelled = obj["status"] == "cancelling"
        if not cancelled:
            batch.move_to("finalizing")
        for path, field in ((batch.output_path, "output_file_id"), (batch.errors_path, "error_file_id")):
            if os.path.exists(path) and os.path.getsize(path) and obj[field] is None:
                obj[field] = self.files.add(os.path.basename(path), "batch_output", path)["id"]
                batch.save()
        batch.move_to("cancelled" if cancelled else "completed")
