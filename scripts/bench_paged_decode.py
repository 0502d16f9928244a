"""Decode speed of this tree's paged KV pool against a revision before it (the slot-per-sequence
cache it replaced), paired, at each page size asked for.

    python scripts/bench_paged_decode.py --baseline bd7b873 --page-sizes 16,64 --rounds 3
    python scripts/bench_paged_decode.py --baseline 027854f --page-sizes 64 \
        --baseline-options '{"page_size": 64, "quantization": "none"}'   # a paged revision: same engine

Each variant (the baseline revision, checked out with `git worktree` into a temporary folder, and
this tree at each page size) runs in a process of its own that loads the embedded SmolLM2-135M
once and, when told, decodes a case through `LLM.generate` (greedy, as a user's requests do: the
engine's loop and host work included): by default 1 sequence after a 100-token prompt, 8 after
100, 8 after 1,024 (`--cases`; the engines hold at least 8 slots, more when a case asks). A
case's step time is taken over the window in which every sequence decodes (from the last first
token to the first last token). The processes take turns case by case, in an order that
alternates round by round; the report gives, per case, each variant's median step time, its MBU
(weights plus each sequence's K/V, over the memory bandwidth measured in the same run) and the
median of its paired ratios against the baseline (tokens/s, so above 1 is faster). Then each
process times its CPU attention kernel alone (8 sequences at position 1,023, one layer), with the
pages in order, interleaved and shuffled.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np
from benchlib import git_worktree, markdown_table, measure_ceiling, progress, write_results

CASES = "1x100,8x100,8x1024"  # sequences x prompt tokens
TOKENS = 96  # generated per sequence


def worker(options: dict) -> None:
    """In the variant's own process: load, say what a step reads, then for each case named on stdin
    print its step seconds (one line of JSON each)."""
    from benchlib import decode_weight_bytes

    import jinfer

    llm = jinfer.LLM(**{"max_slots": 8, "max_seq_len": 2048, **options})
    cfg = llm.engine.model_config
    sampling = jinfer.SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    per_position = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    print(json.dumps({"weight_bytes": decode_weight_bytes(llm.engine.params), "kv_bytes": per_position}))
    prompts = {}
    for line in sys.stdin:
        if line.strip() == "kernel":
            paged = hasattr(llm.engine.layout, "page_size")  # the baseline's cache has a row per slot
            print(json.dumps(_kernel_s(llm.engine.layout.page_size if paged else None)), flush=True)
            continue
        slots, context = map(int, line.split())
        if (slots, context) not in prompts:
            rng = np.random.RandomState(context)
            prompts[slots, context] = [rng.randint(100, 40000, context).tolist() for _ in range(slots)]
            llm.generate(prompts[slots, context], sampling)  # compiles what the case needs
        print(json.dumps(_window_step_s(llm.generate(prompts[slots, context], sampling))), flush=True)


def _kernel_s(page_size: int | None) -> dict[str, float]:
    """Seconds per call of the tree's CPU attention kernel alone: 8 sequences decoding at position
    1,023 (SmolLM2's 3 kv heads of 3 queries, head_dim 64), best of 7 x 30 calls. With pages: laid
    out in order, interleaved (8 sequences grown together) and shuffled; without (the slot cache it
    replaced): each sequence's row of a [slots, K, S, H] cache."""
    import jax
    import jax.numpy as jnp

    from jinfer.kernels import cpu_attention

    batch, heads, groups, head_dim, seq = 8, 3, 3, 64, 1024
    rng = np.random.RandomState(0)
    q = jnp.asarray(rng.randn(batch, heads, groups, 1, head_dim), jnp.float32)
    positions = jnp.full((batch, 1), seq - 1, jnp.int32)
    call = jax.jit(lambda q, k, v, rows, positions: cpu_attention.attention(q, k, v, rows, positions, 0))

    def best(*args) -> float:
        call(*args).block_until_ready()
        times = []
        for _ in range(7):
            start = time.perf_counter()
            for _ in range(30):
                out = call(*args)
            out.block_until_ready()
            times.append((time.perf_counter() - start) / 30)
        return min(times)

    if page_size is None:
        cache = jnp.asarray(rng.randn(batch, heads, 2 * seq, head_dim), jnp.float32)
        return {"contiguous": best(q, cache, cache, jnp.arange(batch, dtype=jnp.int32), positions)}
    pages = 2 * seq // page_size
    pool = jnp.asarray(rng.randn(heads, 1 + batch * pages, page_size, head_dim), jnp.float32)
    layouts = {
        "in order": np.arange(batch * pages).reshape(batch, pages),
        "interleaved": np.arange(batch * pages).reshape(pages, batch).T,
        "shuffled": rng.permutation(batch * pages).reshape(batch, pages),
    }
    return {
        name: best(q, pool, pool, jnp.asarray(1 + t, jnp.int32), positions) for name, t in layouts.items()
    }


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


class Variant:
    """A worker process of one tree and engine options."""

    def __init__(self, tree: str, options: dict):
        env = {**os.environ, "PYTHONPATH": tree}  # the tree's jinfer before the installed one
        command = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(options)]
        self.process = subprocess.Popen(
            command, cwd=tree, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.sizes = self._read()

    def measure(self, slots: int, context: int) -> float:
        return self._ask(f"{slots} {context}")

    def kernel(self) -> dict[str, float]:
        return self._ask("kernel")

    def _ask(self, line: str):
        self.process.stdin.write(line + "\n")
        self.process.stdin.flush()
        return self._read()

    def _read(self):
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"a worker ended (exit code {self.process.wait()})")
        return json.loads(line)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline", required=False, help="the revision to compare against (git)")
    parser.add_argument(
        "--baseline-options",
        default="{}",
        help="the baseline's engine options, JSON (for a paged one: the page size, float weights)",
    )
    parser.add_argument("--page-sizes", default="16")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--cases", default=CASES, help="sequences x prompt tokens, comma-separated")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    if not args.baseline:
        parser.error("--baseline is required")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    progress("measuring the memory bandwidth")
    bandwidth = measure_ceiling()["bandwidth_gb_s"] * 1e9
    cases = [tuple(map(int, case.split("x"))) for case in args.cases.split(",")]
    most = {"max_slots": max(8, *(slots for slots, _ in cases))}
    with git_worktree(args.baseline) as baseline_tree:
        progress("starting the variants' processes (each loads the model)")
        variants = {"baseline": Variant(baseline_tree, {**most, **json.loads(args.baseline_options)})}
        for size in args.page_sizes.split(","):
            # Float weights, as the slot-layout baseline holds them: this compares the KV layouts.
            variants[f"page {size}"] = Variant(here, {**most, "page_size": int(size), "quantization": "none"})
        times = {(name, case): [] for name in variants for case in cases}
        for round_ in range(args.rounds):
            order = list(variants) if round_ % 2 == 0 else list(reversed(variants))
            for case in cases:
                for name in order:
                    times[name, case].append(variants[name].measure(*case))
            progress(f"round {round_ + 1}/{args.rounds}: " + ", ".join(
                f"{n} {1e3 * times[n, c][-1]:.1f}" for c in cases for n in variants
            ))  # fmt: skip
        progress("the attention kernel alone, in each variant's process")
        kernels = {name: v.kernel() for name, v in variants.items()}
        sizes = {name: v.sizes for name, v in variants.items()}
        for v in variants.values():
            v.close()
    rows, result = [], {"bandwidth_gb_s": bandwidth / 1e9, "baseline": args.baseline, "cases": {}}
    for slots, context in cases:
        case = f"{slots}x{context}"
        base = np.array(times["baseline", (slots, context)])
        for name in variants:
            steps = np.array(times[name, (slots, context)])
            read = sizes[name]["weight_bytes"] + slots * (context + TOKENS / 2) * sizes[name]["kv_bytes"]
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
    result["kernel_us"] = {name: {k: v * 1e6 for k, v in t.items()} for name, t in kernels.items()}
    kernel_rows = [[name, layout, f"{t * 1e6:.0f}"] for name, k in kernels.items() for layout, t in k.items()]
    table += "\n\nThe CPU attention kernel alone, 8 sequences at position 1,023, one layer:\n\n"
    table += markdown_table(["variant", "pages", "us per call"], kernel_rows)
    print(table)
    write_results(args.out, "bench_paged_decode", result, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
