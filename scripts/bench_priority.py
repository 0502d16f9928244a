"""Interactive time to first token beside a running batch: one `jinfer serve` of the embedded
model, a user sending streaming chat requests one after another, alone and while a Batch API job
of `--lines` lines (created through the official `openai` client) runs below interactive priority,
in alternating rounds (a fresh batch each time, cancelled once the user is done).

Per phase: TTFT p50 / p99 of the user's requests (the first chunk carrying text), and for the batch
phase the lines the batch finished meanwhile; the ratio of the p50s and p99s is the figure (goal:
within 1.5x). Before the user starts, the batch runs alone for `--batch-alone-s` seconds: the
lines it finishes a second then are its pace with nobody to make way for.

    python scripts/bench_priority.py [--requests 20] [--lines 200] [--rounds 2] [--batch-alone-s 20]
        [--batch-slots default,32] [--server-options "..."] [--out results]

`--batch-slots`: the server's setting (the most batch lines running at once), a server per value
in turn ("default": the server's own).

Writes results/bench_priority.{json,md}.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time

import numpy as np
from bench_crowd import server
from benchlib import markdown_table, progress, write_results

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUESTIONS = ["What is the capital of France?", "Name three colours.", "What is 12 times 3?", "Say hello."]


def user_ttfts(client, requests: int) -> list[float]:
    """TTFT of `requests` streaming chat requests sent one after another."""
    out = []
    for i in range(requests):
        sent, first = time.perf_counter(), None
        stream = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
            max_tokens=16,
            temperature=0,
            stream=True,
        )
        for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter()
        out.append(first - sent)
        time.sleep(0.1)
    return out


def start_batch(client, lines: int):
    body = lambda i: {
        "model": "smollm2",
        "messages": [{"role": "user", "content": f"Write a short story about a robot named R{i}."}],
        "max_tokens": 96,
        "temperature": 0,
        "ignore_eos": True,
    }
    text = "\n".join(
        json.dumps({"custom_id": f"s{i}", "method": "POST", "url": "/v1/chat/completions", "body": body(i)})
        for i in range(lines)
    )
    uploaded = client.files.create(file=("stories.jsonl", io.BytesIO(text.encode())), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    while client.batches.retrieve(batch.id).request_counts.completed < 1:  # the slots are full by now
        time.sleep(0.2)
    return batch


def percentiles(values: list[float]) -> dict[str, float]:
    return {
        "p50_ms": float(np.percentile(values, 50)) * 1e3,
        "p99_ms": float(np.percentile(values, 99)) * 1e3,
    }


def measure(args, batch_slots: int | None) -> dict:
    """One server (`--batch-slots`: `batch_slots`, None: its default): the user's TTFTs alone and
    beside a batch, rounds alternating, and the batch lines finished meanwhile."""
    import openai

    alone, beside, finished, seconds, batch_alone = [], [], [], [], []
    with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as batches:
        options = ["--served-model-name", "smollm2", "--batch-dir", batches]
        options += [] if batch_slots is None else ["--batch-slots", str(batch_slots)]
        options += args.server_options.split()
        with server(HERE, options, cache) as base:
            client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)
            user_ttfts(client, 4)  # first calls of each program size
            for round_ in range(args.rounds):
                progress(f"batch slots {batch_slots or 'default'}, round {round_ + 1}: alone")
                alone += user_ttfts(client, args.requests)
                progress(f"round {round_ + 1}: beside a batch of {args.lines} lines")
                batch = start_batch(client, args.lines)
                before = client.batches.retrieve(batch.id).request_counts.completed
                time.sleep(args.batch_alone_s)  # the batch alone: its pace without users
                done = client.batches.retrieve(batch.id).request_counts.completed
                batch_alone.append((done - before) / args.batch_alone_s)
                before = done
                started = time.perf_counter()
                beside += user_ttfts(client, args.requests)
                after = client.batches.retrieve(batch.id)
                assert after.status == "in_progress", "the batch finished before the user did: add lines"
                finished.append(after.request_counts.completed - before)
                seconds.append(time.perf_counter() - started)
                client.batches.cancel(batch.id)
                while client.batches.retrieve(batch.id).status != "cancelled":
                    time.sleep(0.2)
    result = {
        "batch_slots": batch_slots or "default",
        "alone": percentiles(alone),
        "beside_batch": percentiles(beside),
        "batch_lines_meanwhile": finished,
        "batch_lines_per_s_meanwhile": sum(finished) / sum(seconds),
        "batch_lines_per_s_alone": float(np.mean(batch_alone)),
    }
    result["ratio_p50"] = result["beside_batch"]["p50_ms"] / result["alone"]["p50_ms"]
    result["ratio_p99"] = result["beside_batch"]["p99_ms"] / result["alone"]["p99_ms"]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--lines", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch-alone-s", type=float, default=20.0, help="seconds the batch runs alone")
    parser.add_argument("--batch-slots", default="default", help="comma-separated; 'default': the server's")
    parser.add_argument("--server-options", default="", help="more `jinfer serve` options, space-separated")
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    values = [None if v == "default" else int(v) for v in args.batch_slots.split(",")]
    results = [measure(args, value) for value in values]
    rows = []
    for r in results:
        ttft = lambda phase, r=r: [f"{r[phase]['p50_ms']:.0f}", f"{r[phase]['p99_ms']:.0f}"]
        rows.append([r["batch_slots"], "alone", *ttft("alone"), "-"])
        done = f"{sum(r['batch_lines_meanwhile'])} ({r['batch_lines_per_s_meanwhile']:.2f}/s)"
        rows.append([r["batch_slots"], f"beside a {args.lines}-line batch", *ttft("beside_batch"), done])
        rows.append([r["batch_slots"], "ratio", f"{r['ratio_p50']:.2f}x", f"{r['ratio_p99']:.2f}x", ""])
        alone = f"({r['batch_lines_per_s_alone']:.2f}/s)"
        rows.append([r["batch_slots"], "none: the batch alone", "-", "-", alone])
    columns = ["batch slots", "user's requests", "TTFT p50 ms", "TTFT p99 ms", "batch lines done meanwhile"]
    write_results(args.out, "bench_priority", {"runs": results}, markdown_table(columns, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
