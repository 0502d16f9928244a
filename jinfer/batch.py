"""Offline batch generation over JSONL files, resumable.

Input lines: {"id": ..., "prompt": "text" | [token ids]} or {"id": ..., "messages": [...]}, with an
optional "sampling" object of SamplingParams fields overriding the job's defaults. Output lines:
{"id", "text", "finish_reason", "prompt_tokens", "completion_tokens", "error"?}, written and flushed
as each request finishes (in completion order). Ids already present in the output are skipped, so
a job killed half-way resumes where it stopped; a torn last line from the kill is discarded first.
A bad input line becomes an error record for its id and never stops the others.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Any, TextIO

from jinfer.context import fit_conversation
from jinfer.llm import LLM, Completion
from jinfer.sampling import SamplingParams


def completed_ids(output_path: str) -> set[Any]:
    """Ids already written; truncates a torn (newline-less) last line left by a killed run."""
    if not os.path.exists(output_path):
        return set()
    with open(output_path, "rb+") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if end != len(data):
            f.truncate(end)
    ids = set()
    for line in data[:end].splitlines():
        if line.strip():
            ids.add(json.loads(line)["id"])
    return ids


class _Progress:
    def __init__(self, total: int, stream: TextIO):
        self.total, self.stream, self.done, self.tokens = total, stream, 0, 0
        self.start = self.last_print = time.perf_counter()

    def update(self, tokens: int) -> None:
        self.done += 1
        self.tokens += tokens
        now = time.perf_counter()
        if now - self.last_print >= 0.5 or self.done == self.total:
            self.last_print = now
            rate = self.tokens / max(now - self.start, 1e-9)
            percent = 100 * self.done / max(self.total, 1)
            line = (
                f"\r[{self.done}/{self.total}] {percent:3.0f}% | {self.tokens} tokens | {rate:.1f} tokens/s"
            )
            self.stream.write(line)
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


def _error_record(item_id, message: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "text": "",
        "finish_reason": "error",
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "error": message,
    }


def run_jsonl(
    llm: LLM,
    input_path: str,
    output_path: str,
    defaults: SamplingParams,
    context_policy: str | None = None,
    progress: TextIO | None = sys.stderr,
) -> int:
    """Generate for every input line not yet in the output; return how many records were written."""
    done = completed_ids(output_path)
    policy = context_policy or llm.engine.config.context_policy
    items, ids, errors = [], [], []
    with open(input_path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
                item_id = entry["id"]
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(
                    f"{input_path}:{number}: each line must be a JSON object with an 'id'"
                ) from None
            if item_id in done:
                continue
            done.add(item_id)
            try:
                sampling = SamplingParams(**{**dataclasses.asdict(defaults), **entry.get("sampling", {})})
                if "messages" in entry:
                    prompt_ids, _, _ = fit_conversation(
                        llm.tokenizer, entry["messages"], sampling.max_tokens, llm.max_seq_len, policy
                    )
                else:
                    prompt_ids = llm.encode_prompt(entry["prompt"])
            except (ValueError, TypeError, KeyError) as e:
                errors.append(_error_record(item_id, f"{type(e).__name__}: {e}"))
                continue
            items.append((prompt_ids, sampling))
            ids.append(item_id)

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
        inner_policy = "error" if policy == "drop_oldest" else policy
        for index, completion in llm.iter_completions(items, inner_policy, invalid="report"):
            write(_record(ids[index], completion))
    if bar:
        bar.close()
    return written
