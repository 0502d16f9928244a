"""What adapters cost on the embedded model: a decode step of 8 slots whose rows run 4 different
adapters (rank 16, every projection), against 8 slots of the base model on an engine without
adapters, and 8 base rows on the engine that holds them (what rows without an adapter pay), timed
alternately in rounds (`benchlib.alternate_decode_timings`'s way, each engine's own compiled
decode); then the train step of `jinfer.finetune` (LoRA rank 8 over the dequantized base, batches
of 8 x 64 tokens): tokens/s and MFU, counting 4 x params FLOPs per token (the forward's 2 and the
backward's 2 for the activations' gradient: the base weights get none) against the float32
matmul rate measured here.

    python scripts/bench_lora.py [--quantization auto|none] [--rounds 5] [--train-steps 6] [--out results]

Writes results/bench_lora.{json,md}.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
from benchlib import (
    markdown_table,
    matrix_params,
    measure_ceiling,
    paired_ratio,
    progress,
    time_decode_calls,
    write_results,
)

import jinfer
from jinfer import lora
from jinfer.finetune import Example, TrainConfig, Trainer
from jinfer.loading import default_model_path, load_model

SLOTS, ADAPTERS, RANK = 8, 4, 16
POSITION, CALLS = 100, 8


def random_adapter(cfg, seed: int) -> lora.Adapter:
    """Rank RANK on every projection, B not zero (so every delta is computed and matters)."""
    adapter = lora.init_adapter(cfg, lora.LoraConfig(rank=RANK), jax.random.key(seed))
    scale = lambda p: lora.LoraPair(p.a, 0.01 * np.ones_like(p.b))
    return lora.Adapter(
        tuple({k: scale(p) for k, p in layer.items()} for layer in adapter.layers), adapter.config
    )


def decode_rounds(rounds: int, quantization: str) -> dict:
    options = {"max_slots": SLOTS, "max_seq_len": 512, "kv_cache_tokens": SLOTS * 512}
    options["quantization"] = quantization
    plain = jinfer.LLM(**options).engine
    adapted = jinfer.LLM(**options, max_loras=ADAPTERS, max_lora_rank=RANK)
    for i in range(ADAPTERS):
        adapted.load_adapter(f"a{i}", random_adapter(adapted.engine.model_config, i))
    cases = {
        "base, no adapters held": (plain, None),
        f"{ADAPTERS} adapters over the rows": (adapted.engine, np.arange(SLOTS) % ADAPTERS),
        "base rows, adapters held": (adapted.engine, np.full(SLOTS, -1)),
    }
    reach = POSITION + CALLS * plain.layout.decode_steps + 1
    time_case = lambda engine, rows: time_decode_calls(engine, SLOTS, reach, CALLS, POSITION, rows)
    for engine, rows in cases.values():
        time_case(engine, rows)  # compiles, warms up
    times = {name: [] for name in cases}
    for round_ in range(rounds):
        for name, (engine, rows) in cases.items():
            times[name].append(time_case(engine, rows))
        progress(f"round {round_ + 1}: " + ", ".join(f"{n} {t[-1] * 1e3:.2f} ms" for n, t in times.items()))
    times = {name: np.array(t) for name, t in times.items()}
    base = times["base, no adapters held"]
    return {
        name: {
            "step_ms": float(np.median(t)) * 1e3,
            "tok_s": SLOTS / float(np.median(t)),
            "vs_base": paired_ratio(base, t),
        }
        for name, t in times.items()
    }


def train_rate(steps: int, ceiling_gflop_s: float) -> dict:
    loaded = load_model(default_model_path(), quantization="none")
    cfg = loaded.config
    rng = np.random.default_rng(0)
    examples = [Example(rng.integers(0, cfg.vocab_size, 64).tolist(), [True] * 64) for _ in range(64)]
    config = TrainConfig(steps=steps + 1, batch_size=8, log_every=1)
    adapter = lora.init_adapter(cfg, lora.LoraConfig(rank=8), jax.random.key(0))
    trainer = Trainer(cfg, loaded.params, config, adapter, cfg.vocab_size)
    trainer.run(examples, until=1)  # compiles
    start = time.perf_counter()
    trainer.run(examples, until=steps + 1)
    seconds = (time.perf_counter() - start) / steps
    layers, output = matrix_params(loaded.params)
    tokens = 8 * 64
    flops = 4 * (layers + output) * tokens
    return {"step_s": seconds, "tok_s": tokens / seconds, "mfu": flops / seconds / 1e9 / ceiling_gflop_s}


def main() -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--quantization", default="auto", help="the base: auto (Q4_1 blocks) or none (float32)"
    )
    parser.add_argument("--train-steps", type=int, default=6)
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    decode = decode_rounds(args.rounds, args.quantization)
    ceiling = measure_ceiling()
    train = train_rate(args.train_steps, ceiling["matmul_gflop_s"])
    rows = []
    for name, d in decode.items():
        ratio = d["vs_base"]
        spread = f"{ratio['lowest']:.3f}-{ratio['highest']:.3f}"
        rows.append([name, f"{d['step_ms']:.2f}", f"{d['tok_s']:.0f}", f"{ratio['median']:.3f}", spread])
    table = markdown_table(["8 slots", "step ms (median)", "tok/s", "x base (median)", "range"], rows)
    table += "\n\n" + markdown_table(
        ["train step (LoRA r8, 8 x 64 tokens)", "s", "tok/s", "MFU", "matmul GFLOP/s"],
        [
            [
                "SmolLM2",
                f"{train['step_s']:.2f}",
                f"{train['tok_s']:.0f}",
                f"{train['mfu']:.2f}",
                f"{ceiling['matmul_gflop_s']:.0f}",
            ]
        ],
    )
    write_results(args.out, "bench_lora", {"decode": decode, "train": train, "ceiling": ceiling}, table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
