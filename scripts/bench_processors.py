"""What logits processors cost: time per token of streams using the two shipped processors
(`jinfer.processors`) against streams using none, on one engine built with both registered (the
engine `jinfer serve --logits-processor ...` builds for the embedded model).

Each round runs three workloads, alternating: `plain` (no stream names a processor: the steps skip
them), `no_repeat` (every stream with `no_repeat_ngram` n=3: each step matches the rows' last two
tokens against their whole history) and `ban` (every stream with a 64-token ban list and a length
penalty). A stream's time per token is the mean of its inter-token latencies (the decode phase); a
workload's figure is the median over its streams; ratios are the median of per-round ratios
against the same round's `plain`.

    python scripts/bench_processors.py [--streams 1,8] [--rounds 5] [--tokens 64] [--out results]

Writes results/bench_processors.{json,md}.
"""

from __future__ import annotations

import argparse

import numpy as np
from benchlib import markdown_table, paired_ratio, progress, write_results

import jinfer
from jinfer.processors import ban_tokens, no_repeat_ngram
from jinfer_serve.main import SERVING_DEFAULTS

WORKLOADS = {
    "plain": None,
    "no_repeat": {"no_repeat_ngram": 3},
    # Ids far from the answers' tokens: the ban costs its work without changing the text much.
    "ban": {"ban_tokens": {"tokens": list(range(40000, 40064)), "length_penalty": [1000, 1.1]}},
}
QUESTIONS = ["Tell me about the sea.", "Describe a city at night.", "Explain how bread is made."]


def run(llm, streams: int, args, tokens: int, round_index: int) -> list[float]:
    """Per stream, seconds per token over its decode phase."""
    conversations = [
        [{"role": "user", "content": f"{QUESTIONS[i % len(QUESTIONS)]} (round {round_index}, {i})"}]
        for i in range(streams)
    ]
    sampling = jinfer.SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, extra_args=args)
    completions = llm.chat(conversations, sampling)
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
    processors = {"no_repeat_ngram": no_repeat_ngram(), "ban_tokens": ban_tokens()}
    llm = jinfer.LLM(
        max_slots=max(counts), max_seq_len=1024, logits_processors=processors, **SERVING_DEFAULTS
    )
    progress(f"engine: {llm.engine.layout.describe()}")
    for streams in counts:
        for extra in WORKLOADS.values():  # warm-up
            run(llm, streams, extra, args.tokens, -1)
    compiled = llm.engine.compile_count()
    rows = []
    for streams in counts:
        figures = {name: [] for name in WORKLOADS}
        for round_index in range(args.rounds):
            for name, extra in WORKLOADS.items():
                figures[name].append(np.median(run(llm, streams, extra, args.tokens, round_index)))
            progress(f"{streams} streams: round {round_index + 1}/{args.rounds}")
        plain = np.array(figures["plain"])
        row = {"streams": streams, "plain_ms_per_token": float(np.median(plain)) * 1e3}
        for name in ("no_repeat", "ban"):
            row[f"{name}_ms_per_token"] = float(np.median(figures[name])) * 1e3
            row[f"{name}_over_plain"] = paired_ratio(np.array(figures[name]), plain)
        rows.append(row)
        progress(f"  {row}")
    result = {"rows": rows, "compiles_in_measured_phase": llm.engine.compile_count() - compiled}
    columns = [
        "streams",
        "plain ms/token",
        "no_repeat ms/token",
        "no_repeat / plain",
        "ban ms/token",
        "ban / plain",
    ]
    table = [
        [
            r["streams"],
            r["plain_ms_per_token"],
            r["no_repeat_ms_per_token"],
            f"{r['no_repeat_over_plain']['median']:.3f}x",
            r["ban_ms_per_token"],
            f"{r['ban_over_plain']['median']:.3f}x",
        ]
        for r in rows
    ]
    header = (
        f"Streams using a logits processor against streams using none, {args.rounds} alternating rounds of "
        f"{args.tokens} tokens; compiles during the rounds: {result['compiles_in_measured_phase']}\n\n"
    )
    write_results(args.out, "bench_processors", result, header + markdown_table(columns, table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
