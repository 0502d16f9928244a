"""What OpenAI's Predicted Outputs (`prediction`) give: edit-style requests, each with its original
text as the prediction, against the same requests without one, on one engine with
`speculative="ngram"` (whose drafts then come from the prediction as well as the request's own
tokens), and against an engine without speculation, measured in one run, alternating.

Edits (greedy, batch 1): fix a paragraph's spelling (prediction: the paragraph as sent); add a
line to a function's docstring (prediction: the function as sent); rename a variable in the
function the assistant wrote a turn before (prediction: that function). Each request runs on the
three setups in turn, the lead rotating from one request to the next, so a slow spell of the
machine falls on every side of a ratio. Reported per setup: decode tokens/s (from each answer's
first token to its last, over all), its ratios to the others (median of the rounds' paired
ratios, lowest and highest), whether every answer is the text the engine without speculation
gives, draft tokens accepted / checked, and the prediction tokens accepted and rejected
(`usage.completion_tokens_details`).

    python scripts/bench_prediction.py [--rounds 5] [--tokens 160] [--weights q4_1|float32]
        [--out results]

Writes results/bench_prediction.{json,md}.
"""

from __future__ import annotations

import argparse

import numpy as np
from bench_speculative import CODE, EDITS, MISSPELT, decode_rate
from benchlib import markdown_table, paired_ratio, progress, write_results

import jinfer

PREDICTIONS = [MISSPELT, CODE, CODE]  # each edit's original text, as a client sends it
SETUPS = ("off", "ngram", "ngram + prediction")


def one_round(engines: dict, tokens: int, lead: int) -> dict[str, list]:
    """Each setup's completions of every edit, the setups taking turns (rotated by `lead`)."""
    sampling = jinfer.SamplingParams(max_tokens=tokens, temperature=0)
    outs = {setup: [] for setup in SETUPS}
    for index, (chat, predicted) in enumerate(zip(EDITS, PREDICTIONS, strict=True)):
        turn = (lead + index) % len(SETUPS)
        for setup in SETUPS[turn:] + SETUPS[:turn]:
            prediction = [predicted] if setup.endswith("prediction") else None
            engine = engines["off" if setup == "off" else "ngram"]
            outs[setup] += engine.chat([chat], sampling, prediction=prediction)
    return outs


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--weights", default="q4_1", choices=("q4_1", "float32"))
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    options = {"quantization": "none"} if args.weights == "float32" else {}
    engines = {}
    for name, settings in (("off", {}), ("ngram", {"speculative": "ngram"})):
        llm = jinfer.LLM(max_slots=1, max_seq_len=1024, **settings, **options)
        progress(f"{name}: {llm.engine.layout.describe()}; warm-up {llm.engine.warmup():.0f} s")
        engines[name] = llm
    compiled = {name: llm.engine.compile_count() for name, llm in engines.items()}
    rates = {setup: [] for setup in SETUPS}
    kept = {setup: [] for setup in SETUPS}
    for round_index in range(args.rounds):
        outs = one_round(engines, args.tokens, round_index)
        for setup, completions in outs.items():
            rates[setup].append(decode_rate(completions))
            kept[setup] += completions
        progress(f"round {round_index + 1}: " + ", ".join(f"{s} {rates[s][-1]:.1f} tok/s" for s in SETUPS))
    if any(llm.engine.compile_count() != compiled[name] for name, llm in engines.items()):
        raise RuntimeError("an engine compiled during the measured rounds")
    rates = {setup: np.array(values) for setup, values in rates.items()}
    rows = [summary(setup, rates, kept) for setup in SETUPS]
    columns = ["setup", "decode tok/s", "over off", "over ngram", "same text as off"]
    columns += ["accepted / checked drafts", "prediction tokens accepted", "rejected"]
    ratio = "{median:.2f}x ({lowest:.2f}-{highest:.2f})".format
    table = [
        [
            r["setup"],
            r["tokens_per_s"],
            ratio(**r["over_off"]),
            ratio(**r["over_ngram"]),
            "yes" if r["same_text"] else "NO",
            r["accepted_over_checked"],
            r["accepted_prediction_tokens"],
            r["rejected_prediction_tokens"],
        ]
        for r in rows
    ]
    header = (
        f"SmolLM2-135M-Instruct ({args.weights}), greedy edits at batch 1, up to {args.tokens} tokens, "
        f"{args.rounds} rounds\n\n"
    )
    result = {"rows": rows, "rounds": args.rounds, "tokens": args.tokens, "weights": args.weights}
    write_results(args.out, "bench_prediction", result, header + markdown_table(columns, table))
    return 0


def summary(setup: str, rates: dict, kept: dict) -> dict:
    """One setup's figures over every round."""
    outs = kept[setup]
    checked = sum(c.metrics["draft_tokens"] for c in outs)
    total = lambda name: sum(c.metrics[name] for c in outs)
    return {
        "setup": setup,
        "tokens_per_s": float(np.median(rates[setup])),
        "over_off": paired_ratio(rates[setup], rates["off"]),
        "over_ngram": paired_ratio(rates[setup], rates["ngram"]),
        "same_text": [c.text for c in outs] == [c.text for c in kept["off"]],
        "accepted_over_checked": total("accepted_tokens") / checked if checked else None,
        "accepted_prediction_tokens": total("accepted_prediction_tokens"),
        "rejected_prediction_tokens": total("rejected_prediction_tokens"),
    }


if __name__ == "__main__":
    raise SystemExit(main())
