"""Host-overhead benchmark: the engine's decode step against a bare loop of its jitted decode.

For each model, with every slot busy:
  * engine: `LLM.generate` wall time per decode step once every slot decodes (scheduler,
    detokenizer, streaming events, reading tokens one dispatch late: everything a served request
    goes through);
  * bare: the same compiled decode function called back to back on the engine's own cache and
    state, blocking only at the end (the device never waits for the host).
Host overhead = (engine - bare) / engine, the median over alternating rounds of each round's pair
(these machines drift by 10-20% within a minute); the device is idle between steps for that
fraction of wall time, since both run identical device work. A near-zero-cost model (one small layer, the
real tokenizer and vocabulary) shows the overhead on its own; SmolLM2-135M shows what is left of
it when the device has real work.

    python scripts/bench_host.py [--slots 1,8] [--out results]

Writes results/bench_host.{json,md,png}.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
from benchlib import (
    PROMPT,
    export_hf_from_gguf,
    markdown_table,
    progress,
    pyplot,
    random_llama_dir,
    time_decode_calls,
    write_results,
)

import jinfer
from jinfer.loading import default_model_path

TOKENS = 96


def engine_step_s(llm: jinfer.LLM, slots: int) -> tuple[float, int]:
    """Wall seconds per decode step while every slot decodes: over the decode window of the request
    that got its first token last (the others' prompts are prefilled by then; slots that finish
    earlier keep their rows in the step), from its second token's dispatch to its last. Timing from
    the first request's first token instead counts the later prompts' prefills and the stagger
    of their starts as decode time (8 slots: ~4 ms a step too many)."""
    sampling = jinfer.SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    before = llm.engine.compile_count()
    results = llm.generate([PROMPT] * slots, sampling)
    last = max(results, key=lambda r: r.metrics["ttft_s"])
    # A dispatch's tokens are committed at one instant, so distinct times = dispatches (the first
    # token, from the prompt's dispatch, is left out).
    commits = np.unique(np.cumsum(last.metrics["inter_token_s"]))
    step = (commits[-1] - commits[0]) / (len(commits) - 1) / llm.engine.layout.decode_steps
    return float(step), llm.engine.compile_count() - before


def bare_step_s(llm: jinfer.LLM, slots: int, prompt_len: int) -> float:
    """Back-to-back calls of the decode the engine used, on its cache and state (left where the
    engine's requests ended; positions keep advancing inside the cache, which is long enough)."""
    steps = llm.engine.layout.decode_steps
    # The bucket the engine attended over for most of its run (its last requests' reach).
    reach = prompt_len + TOKENS + 2 * steps + 1
    time_decode_calls(llm.engine, slots, reach, 1)  # the first call after the engine's own waits
    return time_decode_calls(llm.engine, slots, reach, TOKENS // 2 // steps)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--slots", default="1,8")
    parser.add_argument("--rounds", type=int, default=7, help="alternating engine/bare rounds (medians kept)")
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    work = os.path.join(args.out, ".models")
    smol_hf = export_hf_from_gguf(default_model_path(), os.path.join(work, "smollm2-f32-hf"))
    tiny = random_llama_dir(
        os.path.join(work, "near-zero-llama"), smol_hf, hidden=64, layers=1, mlp=128, heads=4, kv_heads=2
    )
    rows = []
    for label, path in (("near-zero model", tiny), ("SmolLM2-135M", default_model_path())):
        for slots in (int(s) for s in args.slots.split(",")):
            progress(f"{label}, {slots} slots: build and warm up")
            llm = jinfer.LLM(path, max_slots=slots, max_seq_len=512, max_num_batched_tokens=64)
            llm.engine.warmup()
            prompt_len = len(llm.tokenizer.encode(PROMPT))
            engine, bare, compiles = [], [], 0
            for _ in range(args.rounds):  # paired rounds: machine drift hits both sides of a pair
                step, new_compiles = engine_step_s(llm, slots)
                engine.append(step)
                compiles += new_compiles
                bare.append(bare_step_s(llm, slots, prompt_len))
            fractions = sorted((e - b) / e for e, b in zip(engine, bare, strict=True))
            engine_s, bare_s = float(np.median(engine)), float(np.median(bare))
            rows.append(
                {
                    "model": label,
                    "slots": slots,
                    "engine_step_ms": engine_s * 1e3,
                    "bare_step_ms": bare_s * 1e3,
                    "host_overhead_ms": (engine_s - bare_s) * 1e3,
                    "host_overhead_fraction": float(np.median(fractions)),
                    "fraction_range": [fractions[0], fractions[-1]],
                    "compiles_in_measured_phase": compiles,
                }
            )
            progress(f"  engine {engine_s * 1e3:.2f} ms/step, bare {bare_s * 1e3:.2f} ms/step")
            del llm
    columns = [
        "model",
        "slots",
        "engine ms/step",
        "bare ms/step",
        "overhead ms",
        "overhead (= idle) fraction, median of pairs",
        "lowest / highest pair",
    ]
    columns.append("compiles")
    table = markdown_table(
        columns,
        [
            [
                r["model"],
                r["slots"],
                r["engine_step_ms"],
                r["bare_step_ms"],
                r["host_overhead_ms"],
                r["host_overhead_fraction"],
                "{:.2f} / {:.2f}".format(*r["fraction_range"]),
                r["compiles_in_measured_phase"],
            ]
            for r in rows
        ],
    )
    write_results(args.out, "bench_host", {"rows": rows, "tokens": TOKENS}, table)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['model']}\n{r['slots']} slots" for r in rows]
    ax.bar(labels, [r["bare_step_ms"] for r in rows], label="device (bare decode)")
    ax.bar(labels, [max(r["host_overhead_ms"], 0) for r in rows], bottom=[r["bare_step_ms"] for r in rows])
    ax.set_ylabel("ms per decode step")
    ax.set_yscale("log")
    ax.legend(["device (bare decode)", "host overhead"])
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "bench_host.png"), dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
