"""What the research loop's in-memory changes cost on the embedded model: `llm.update_weights` (a
weight tree as `llm.params` gives it, placed and packed as the engine holds it), `llm.sleep(1)` and
`llm.sleep(2)` with the process's resident memory before, asleep and after waking, and each
`llm.wake_up()` (after level 2 it reads the weights from the model's file again). Best of `--calls`
for each time; the greedy answer after each change is checked against the first.

    python scripts/bench_residency.py [--quantization none] [--calls 3] [--out results]

Writes results/bench_residency.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import time

import jax
import numpy as np
from benchlib import markdown_table, progress, write_results

import jinfer

PROMPT = "What is the capital of France?"
GREEDY = jinfer.SamplingParams(max_tokens=16, temperature=0)


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def main() -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--quantization", default="auto", help="the embedded model's weights: auto or none")
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    llm = jinfer.LLM(quantization=args.quantization, max_slots=8, max_seq_len=2048)
    answer = lambda: llm.chat([[{"role": "user", "content": PROMPT}]], GREEDY)[0].text
    first = answer()
    params = jax.tree.map(np.asarray, llm.params)  # as a trainer would hand them over: host arrays
    rows, figures = [], {"cache_mb": llm.engine.cache_bytes / 1e6}
    figures["update_weights_s"] = min(timed(lambda: llm.update_weights(params)) for _ in range(args.calls))
    assert answer() == first
    for level in (1, 2):
        awake, asleep, woken, seconds = [], [], [], []
        for _ in range(args.calls):
            awake.append(rss_mb())
            llm.sleep(level)
            asleep.append(rss_mb())
            seconds.append(timed(llm.wake_up))
            woken.append(rss_mb())
            assert answer() == first
        mb = [f"{min(values):.0f}" for values in (awake, asleep, woken)]
        figures[f"level_{level}"] = {"rss_mb": mb, "wake_up_s": min(seconds)}  # awake, asleep, woken
        rows.append([level, *mb, f"{min(seconds):.2f}"])
        progress(f"level {level}: {figures[f'level_{level}']}")
    table = markdown_table(["sleep level", "RSS awake MB", "asleep MB", "woken MB", "wake_up s"], rows)
    cache, update = figures["cache_mb"], figures["update_weights_s"]
    table += f"\n\nKV cache {cache:.0f} MB; update_weights {update:.2f} s\n"
    write_results(args.out, "bench_residency", {"args": vars(args), **figures}, table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
