"""scripts/bench_decode.py run in this tree and in an earlier revision's, alternating, paired.

    python scripts/bench_decode_revisions.py --baseline 027854f --rounds 3 \
        -- --slots 1,8,32 --large-slots 1 --packed-slots 8 --context 1024 --rounds 1

Each round runs each tree's own bench_decode.py (the baseline checked out with `git worktree`
into a temporary folder and imported first through PYTHONPATH, so each side measures its own
engine with its own script) in an order that alternates round by round; the arguments after `--`
go to both. Every jinfer figure both runs report (decode tokens/s per model and slot count,
prefill tokens/s, packed-weight step time, long-context tokens/s) is paired round by round; the
report gives each one's median ratio, this tree over the baseline (above 1 is faster), with its
range. Writes results/bench_decode_revisions.{json,md}; each run's own output stays in
results/.revisions/.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np
from benchlib import git_worktree, markdown_table, progress, write_results

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def jinfer_rates(result: dict) -> dict[str, float]:
    """The jinfer figures of one bench_decode result, each as a rate (higher is faster)."""
    rates = {}
    for model in result["models"]:
        for row in model["decode"]:
            rates[f"{model['model']}: decode, {row['slots']} slots"] = row["jinfer_tokens_per_s"]
        if model.get("prefill"):
            rates[f"{model['model']}: prefill of {model['prefill']['tokens']}"] = model["prefill"][
                "tokens_per_s"
            ]
    for row in result.get("packed_weights") or []:
        rates[f"packed weights, {row['slots']} slots (steps/s)"] = 1e3 / row["packed_step_ms"]
    for row in result.get("long_context") or []:
        rates[f"at position {row['context']}, {row['slots']} slots"] = row["jinfer_tokens_per_s"]
    return rates


def run_once(tree: str, out: str, bench_args: list[str]) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": tree}  # the tree's jinfer before the installed one
    script = os.path.join(tree, "scripts", "bench_decode.py")
    subprocess.run([sys.executable, script, *bench_args, "--out", out], cwd=tree, env=env, check=True)
    with open(os.path.join(out, "bench_decode.json")) as f:
        return jinfer_rates(json.load(f))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline", required=True, help="the revision to compare against (git)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default="results")
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then bench_decode.py's options")
    args = parser.parse_args()
    bench_args = [a for a in args.bench_args if a != "--"]
    runs = os.path.abspath(os.path.join(args.out, ".revisions"))
    rates: dict[str, list[dict[str, float]]] = {"baseline": [], "this tree": []}
    with git_worktree(args.baseline) as baseline_tree:
        trees = {"baseline": baseline_tree, "this tree": HERE}
        for round_ in range(args.rounds):
            order = list(trees) if round_ % 2 == 0 else list(reversed(trees))
            for name in order:
                progress(f"round {round_ + 1}/{args.rounds}: bench_decode.py in {name}")
                out = os.path.join(runs, f"{name.replace(' ', '-')}-{round_ + 1}")
                rates[name].append(run_once(trees[name], out, bench_args))
    rows, result = [], {"baseline": args.baseline, "bench_args": bench_args, "figures": {}}
    for figure in rates["baseline"][0]:
        base = np.array([r[figure] for r in rates["baseline"]])
        this = np.array([r[figure] for r in rates["this tree"]])
        ratios = this / base
        entry = {
            "baseline": float(np.median(base)),
            "this_tree": float(np.median(this)),
            "ratio_median": float(np.median(ratios)),
            "ratios": ratios.tolist(),
        }
        result["figures"][figure] = entry
        spread = f"{entry['ratio_median']:.3f} ({ratios.min():.3f}-{ratios.max():.3f})"
        rows.append([figure, f"{entry['baseline']:.1f}", f"{entry['this_tree']:.1f}", spread])
    columns = ["figure", f"{args.baseline} (median)", "this tree (median)", "this / baseline (range)"]
    write_results(args.out, "bench_decode_revisions", result, markdown_table(columns, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
