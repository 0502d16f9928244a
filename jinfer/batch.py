"""Batch generation over JSONL files, resumable: the ledger both batch doors share, and the
offline runner.

The ledger (`completed_ids`, `pending_lines`): a job's results are appended to output files, one
record a line, flushed as each finishes; a record names its input line by a key field ("id" here,
"custom_id" in OpenAI's batch files, `serve/batches.py`), or by its line number ("line") when the
input line has none. Keys already written are skipped, so a job killed half-way resumes where it
stopped (a torn last line from the kill is cut off first); an input line that is not JSON, has no
key or repeats one is a problem for its own record, never a failed job.

The offline runner (`run_jsonl`, `jinfer batch`), on the ledger. Input lines: {"id": ...,
"prompt": "text" | [token ids]} or {"id": ..., "messages": [...]}, with an optional "sampling"
object of SamplingParams fields overriding the job's defaults. Output lines: {"id", "text",
"finish_reason", "prompt_tokens", "completion_tokens", "error"?}, in completion order. A bad input
line (not JSON, no id, a bad field) becomes an error record for its id (or its line number).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any, NamedTuple, TextIO

from jinfer.llm import LLM, Completion
from jinfer.prepare import PreparedRequest
from jinfer.sampling import RequestError, SamplingParams
from jinfer.tokenizer import TokenizerError

SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def completed_ids(*output_paths: str, key_field: str = "id") -> set[Any]:
    """Keys already written (`_key`) in any of the output files; truncates a torn (newline-less)
    last line left by a killed run."""
    keys = set()
    for path in output_paths:
        if not os.path.exists(path):
            continue
        with open(path, "rb+") as f:
            data = f.read()
            end = data.rfind(b"\n") + 1
            if end != len(data):
                f.truncate(end)
        for line in data[:end].splitlines():
            if line.strip():
                record = json.loads(line)
                keys.add(_key(record.get(key_field), record.get("line")))
    return keys


def _key(item_id, line: int | None):
    """What identifies an input line in the output: its id, or its line number when it has none."""
    return ("line", line) if item_id is None else ("id", json.dumps(item_id, sort_keys=True))


class BatchLine(NamedTuple):
    """An input line still to run: its number, its key's value (None: it has none), and either
    its entry (a JSON object) or the problem that makes it an error record."""

    number: int
    item_id: Any
    entry: dict[str, Any] | None
    problem: str | None


def pending_lines(input_path: str, done: set[Any], key_field: str = "id") -> Iterator[BatchLine]:
    """The input lines whose keys are not in `done` (blank lines skipped), each key once: a line
    repeating an earlier line's key is a problem keyed by its line number."""
    seen = set()
    with open(input_path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                entry, problem = json.loads(line), None
            except (json.JSONDecodeError, ValueError, RecursionError) as e:
                entry, problem = None, f"line {number} is not JSON: {e}"
            if problem is None and not isinstance(entry, dict):
                entry, problem = None, f"line {number} is not a JSON object"
            item_id = entry.get(key_field) if entry is not None else None
            key = _key(item_id, number)
            if item_id is not None and key in seen:
                item_id, key, problem = (
                    None,
                    _key(None, number),
                    f"line {number} repeats {key_field} {item_id!r}",
                )
            seen.add(key)
            if key not in done:
                yield BatchLine(number, item_id, entry if problem is None else None, problem)


class _Progress:
    """One status line: results written, tokens, and the rate since the job's first result (so the
    rate is the engine's, not its compiles')."""

    def __init__(self, total: int, stream: TextIO):
        self.total, self.stream, self.done, self.tokens = total, stream, 0, 0
        self.first: float | None = None
        self.last_print = 0.0

    def update(self, tokens: int) -> None:
        self.done += 1
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        else:
            self.tokens += tokens
        if now - self.last_print >= 0.5 or self.done == self.total:
            self.last_print = now
            rate = f"{self.tokens / (now - self.first):.1f} tokens/s" if now > self.first else "- tokens/s"
            percent = 100 * self.done / max(self.total, 1)
            self.stream.write(f"\r[{self.done}/{self.total}] {percent:3.0f}% | {self.tokens} tokens | {rate}")
            self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")


def _record(item_id, completion: Completion) -> dict[str, Any]:
    record = {
        "id": item_id,
        "text": completion.text,
        "finish_reason": completion.finish_reason,
        "prompt_tokens": len(completion.prompt_token_ids),
        "completion_tokens": len(completion.token_ids),
    }
    if completion.error:
        record["error"] = completion.error
    return record


def _error_record(item_id, line: int, message: str) -> dict[str, Any]:
    record = {"id": item_id, "text": "", "finish_reason": "error", "prompt_tokens": 0, "completion_tokens": 0}
    if item_id is None:
        record["line"] = line
    record["error"] = message
    return record


def _prepare_line(llm: LLM, entry: Any, defaults: SamplingParams, policy: str | None) -> PreparedRequest:
    """One input line through the request-preparation path (RequestError when it is bad)."""
    if not isinstance(entry, dict):
        raise RequestError("each line must be a JSON object with an 'id'")
    if "id" not in entry:
        raise RequestError("the line has no 'id'", "id")
    overrides = entry.get("sampling", {})
    if not isinstance(overrides, dict):
        raise RequestError("'sampling' must be an object of SamplingParams fields", "sampling")
    unknown = sorted(set(overrides) - SAMPLING_FIELDS)
    if unknown:
        raise RequestError(f"unknown sampling fields {unknown}", "sampling")
    given = {k: v for k, v in dataclasses.asdict(defaults).items() if v is not None}
    sampling = SamplingParams(**{**given, **overrides})
    if ("messages" in entry) == ("prompt" in entry):
        raise RequestError("give either 'prompt' or 'messages'", "prompt")
    policy = entry.get("context_policy", policy)
    if "messages" in entry:
        return llm.preparer.prepare(messages=entry["messages"], sampling=sampling, context_policy=policy)
    return llm.preparer.prepare(entry["prompt"], sampling=sampling, context_policy=policy)


def run_jsonl(
    llm: LLM,
    input_path: str,
    output_path: str,
    defaults: SamplingParams,
    context_policy: str | None = None,
    progress: TextIO | None = sys.stderr,
) -> int:
    """Generate for every input line not yet in the output; return how many records were written.

    `defaults`: the job's sampling; a line's "sampling" object overrides its fields, and knobs
    neither sets take the model's defaults.
    """
    items, ids, errors = [], [], []
    for line in pending_lines(input_path, completed_ids(output_path)):
        problem = line.problem
        if problem is None:
            try:
                items.append(_prepare_line(llm, line.entry, defaults, context_policy))
                ids.append(line.item_id)
                continue
            except (RequestError, TokenizerError) as e:
                problem = str(e)
        errors.append(_error_record(line.item_id, line.number, problem))

    bar = _Progress(len(items) + len(errors), progress) if progress else None
    written = 0
    with open(output_path, "a", encoding="utf-8") as out:

        def write(record):
            nonlocal written
            out.write(json.dumps(record, ensure_ascii=False) + "\n")
            out.flush()
            written += 1
            if bar:
                bar.update(record["completion_tokens"])

        for record in errors:
            write(record)
        for index, completion in llm.iter_completions(items):
            write(_record(ids[index], completion))
    if bar:
        bar.close()
    return written
