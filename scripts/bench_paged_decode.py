"""Decode speed of this tree's paged KV pool against a revision before it (the slot-per-sequence
cache it replaced), paired, at each page size asked for.

    python scripts/bench_paged_decode.py --baseline bd7b873 --page-sizes 16,64 --rounds 3

Each variant (the baseline revision, checked out with `git worktree` into a temporary folder, and
this tree at each page size) runs in a process of its own that loads the embedded SmolLM2-135M
once and decodes every case through `LLM.generate` (greedy, as a user's requests do: the engine's
loop and host work included): 1 sequence after a 100-token prompt, 8 after 100, 8 after 1,024.
A case's step time is taken over the window in which every sequence decodes (from the last first
token to the first last token). Variants alternate round by round; the report gives, per case, each
variant's median step time, its MBU (weights plus each sequence's K/V, over the memory bandwidth
measured in the same run) and the median of its paired ratios against the baseline (tokens/s, so
above 1 is faster).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np
from benchlib import markdown_table, measure_ceiling, progress, write_results

CASES = ((1, 100), (8, 100), (8, 1024))  # (sequences, prompt tokens)
TOKENS = 96  # generated per sequence


def worker(options: dict) -> dict:
    """In the variant's own process: every case's step seconds (best of `repeats`), weight bytes
    per step and K/V bytes per position."""
    from benchlib import decode_weight_bytes

    import jinfer

    llm = jinfer.LLM(max_slots=8, max_seq_len=2048, prefill_buckets=(64, 512), **options["engine"])
    cfg = llm.engine.model_config
    sampling = jinfer.SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    out = {
        "weight_bytes": decode_weight_bytes(llm.engine.params),
        "kv_bytes_per_position": 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4,
        "cases": {},
    }
    rng = np.random.RandomState(0)
    for slots, context in CASES:
        prompts = [rng.randint(100, 40000, context).tolist() for _ in range(slots)]
        llm.generate(prompts, sampling)  # compiles what the case needs
        out["cases"][f"{slots}x{context}"] = min(
            _window_step_s(llm.generate(prompts, sampling)) for _ in range(options["repeats"])
        )
    return out


def _window_step_s(results) -> float:
    """Seconds per decode step while every sequence decodes: from the last first token to the first
    last token, over the mean number of tokens each sequence produced in that window."""
    times = []
    for r in results:
        first = r.metrics["ttft_s"]
        times.append(first + np.concatenate([[0.0], np.cumsum(r.metrics["inter_token_s"])]))
    start, end = max(t[0] for t in times), min(t[-1] for t in times)
    produced = np.mean([np.sum((t > start) & (t <= end)) for t in times])
    return (end - start) / produced


def _run_variant(tree: str, options: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": tree}  # the tree's jinfer before the installed one
    script = os.path.abspath(__file__)
    command = [sys.executable, script, "--worker", json.dumps(options)]
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"variant {options} in {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def _worktree(revision: str):
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    folder = tempfile.mkdtemp(prefix="jinfer-baseline-")
    subprocess.run(["git", "-C", here, "worktree", "add", "--detach", folder, revision], check=True)
    try:
        yield folder
    finally:
        subprocess.run(["git", "-C", here, "worktree", "remove", "--force", folder], check=False)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline", required=False, help="the revision to compare against (git)")
    parser.add_argument("--page-sizes", default="16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2, help="timings per case within a process (best)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    if not args.baseline:
        parser.error("--baseline is required")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    progress("measuring the memory bandwidth")
    bandwidth = measure_ceiling()["bandwidth_gb_s"] * 1e9
    with _worktree(args.baseline) as baseline_tree:
        variants = {"baseline": (baseline_tree, {"engine": {}, "repeats": args.repeats})}
        for size in args.page_sizes.split(","):
            variants[f"page {size}"] = (here, {"engine": {"page_size": int(size)}, "repeats": args.repeats})
        runs = {name: [] for name in variants}
        for round_ in range(args.rounds):
            for name, (tree, options) in variants.items():
                progress(f"round {round_ + 1}/{args.rounds}: {name}")
                start = time.perf_counter()
                runs[name].append(_run_variant(tree, options))
                progress(f"  {time.perf_counter() - start:.0f} s: {runs[name][-1]['cases']}")
    rows, result = [], {"bandwidth_gb_s": bandwidth / 1e9, "baseline": args.baseline, "cases": {}}
    for slots, context in CASES:
        case = f"{slots}x{context}"
        base = np.array([r["cases"][case] for r in runs["baseline"]])
        for name, measured in runs.items():
            steps = np.array([r["cases"][case] for r in measured])
            read = (
                measured[0]["weight_bytes"]
                + slots * (context + TOKENS / 2) * measured[0]["kv_bytes_per_position"]
            )
            ratios = base / steps
            entry = {
                "step_ms": float(np.median(steps)) * 1e3,
                "tokens_per_s": slots / float(np.median(steps)),
                "mbu": read / float(np.median(steps)) / bandwidth,
                "over_baseline": float(np.median(ratios)),
                "lowest": float(ratios.min()),
                "highest": float(ratios.max()),
            }
            result["cases"].setdefault(case, {})[name] = entry
            rows.append(
                [
                    f"{slots} x {context}",
                    name,
                    f"{entry['step_ms']:.1f}",
                    f"{entry['tokens_per_s']:.1f}",
                    f"{entry['mbu']:.2f}",
                    f"{entry['over_baseline']:.3f} ({entry['lowest']:.3f}-{entry['highest']:.3f})",
                ]
            )
    table = markdown_table(
        ["sequences x prompt", "variant", "step ms", "tok/s", "MBU", "tok/s / baseline (range)"], rows
    )
    print(table)
    write_results(args.out, "bench_paged_decode", result, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
