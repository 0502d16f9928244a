"""What constrained decoding costs: time per token of JSON-schema streams against unconstrained
ones, and of unconstrained streams running beside constrained ones, on the engine `jinfer serve`
builds (SERVING_DEFAULTS) for the embedded model.

Each round runs three workloads, alternating: `plain` (every stream unconstrained), `constrained`
(every stream held to a JSON schema long enough never to complete: each runs to max_tokens) and
`mixed` (half of each). A stream's time per token is the mean of its inter-token latencies (the
decode phase, prefill left out); a workload's figure is the median over its streams. Ratios are
the median of per-round ratios against the same round's `plain`.

    python scripts/bench_structured.py [--streams 1,8] [--rounds 5] [--tokens 64] [--out results]

Writes results/bench_structured.{json,md}.
"""

from __future__ import annotations

import argparse

import numpy as np
from benchlib import markdown_table, paired_ratio, progress, write_results

import jinfer
from jinfer_serve.main import SERVING_DEFAULTS

# A list of records that never closes within the measured tokens: every constrained token goes
# through the JSON lexer and parser, the most common constraint in use.
SCHEMA = {
    "type": "array",
    "minItems": 1000,
    "items": {
        "type": "object",
        "properties": {"id": {"type": "integer"}, "name": {"type": "string"}, "tags": {"type": "array"}},
        "required": ["id", "name", "tags"],
    },
}
QUESTIONS = ["List the users as JSON.", "Give the inventory as JSON.", "Export the table as JSON."]


def run(llm, streams: int, constrained: list[bool], tokens: int, round_index: int) -> list[float]:
    """Per stream, seconds per token over its decode phase."""
    conversations = [
        [{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (batch {round_index}, {i})"}]
        for i in range(streams)
    ]
    sampling = [
        jinfer.SamplingParams(
            temperature=0, max_tokens=tokens, ignore_eos=True, json_schema=SCHEMA if held else None
        )
        for held in constrained
    ]
    completions = llm.chat(conversations, sampling)
    for c in completions:
        if len(c.token_ids) != tokens:
            raise RuntimeError(f"a stream ended after {len(c.token_ids)} tokens ({c.finish_reason})")
    return [float(np.mean(c.metrics["inter_token_s"])) for c in completions]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--streams", default="1,8")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    counts = [int(s) for s in args.streams.split(",")]
    llm = jinfer.LLM(max_slots=max(counts), max_seq_len=1024, **SERVING_DEFAULTS)
    progress(f"engine: {llm.engine.layout.describe()}")
    workloads_of = {}
    for streams in counts:
        workloads_of[streams] = {"plain": [False] * streams, "constrained": [True] * streams}
        if streams > 1:
            workloads_of[streams]["mixed"] = [i % 2 == 1 for i in range(streams)]
        for held in workloads_of[streams].values():  # warm-up: compiles, the grammar's tokenizer
            run(llm, streams, held, args.tokens, -1)
    compiled = llm.engine.compile_count()
    rows = []
    for streams in counts:
        workloads = workloads_of[streams]
        figures = {name: [] for name in workloads}  # per round: (median s/token of held, of free)
        for round_index in range(args.rounds):
            for name, held in workloads.items():
                per_stream = run(llm, streams, held, args.tokens, round_index)
                free = [t for t, h in zip(per_stream, held, strict=True) if not h]
                kept = [t for t, h in zip(per_stream, held, strict=True) if h]
                figures[name].append(
                    (np.median(kept) if kept else np.nan, np.median(free) if free else np.nan)
                )
            progress(f"{streams} streams: round {round_index + 1}/{args.rounds}")
        plain = np.array([free for _, free in figures["plain"]])
        held = np.array([kept for kept, _ in figures["constrained"]])
        row = {
            "streams": streams,
            "plain_ms_per_token": float(np.median(plain)) * 1e3,
            "constrained_ms_per_token": float(np.median(held)) * 1e3,
            "constrained_over_plain": paired_ratio(held, plain),
        }
        if "mixed" in figures:
            beside = np.array([free for _, free in figures["mixed"]])
            row["plain_beside_constrained_ms_per_token"] = float(np.median(beside)) * 1e3
            row["plain_beside_constrained_over_plain"] = paired_ratio(beside, plain)
        rows.append(row)
        progress(f"  {row}")
    result = {"rows": rows, "compiles_in_measured_phase": llm.engine.compile_count() - compiled}
    columns = [
        "streams",
        "plain ms/token",
        "constrained ms/token",
        "constrained / plain",
        "plain beside constrained / plain",
    ]
    table = [
        [
            r["streams"],
            r["plain_ms_per_token"],
            r["constrained_ms_per_token"],
            f"{r['constrained_over_plain']['median']:.3f}x",
            f"{r['plain_beside_constrained_over_plain']['median']:.3f}x" if r["streams"] > 1 else "n/a",
        ]
        for r in rows
    ]
    header = (
        f"JSON-schema streams against unconstrained ones, {args.rounds} alternating rounds of {args.tokens} "
        f"tokens; compiles during the rounds: {result['compiles_in_measured_phase']}\n\n"
    )
    write_results(args.out, "bench_structured", result, header + markdown_table(columns, table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
