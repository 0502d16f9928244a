"""Decode benchmark: jinfer against this machine's memory-bandwidth ceiling and against peers.

Measured side by side in one run (the machines are shared and noisy, so only ratios mean much):

  * the ceiling: memory bandwidth (best of repeated 1 GiB float32 reductions and matrix-vector
    products) and float32 matmul FLOP/s;
  * jinfer decode tokens/s at several slot counts, with MBU = bytes read per step / step time /
    bandwidth, counting both the bytes a step must read (weights + the K/V of filled positions)
    and what it does read (weights + the K/V of its attention bucket);
  * Hugging Face transformers `generate()` on the same weights (CPU torch, float32, greedy, fixed
    output length) at batch 1 and 8, runs alternating with jinfer's;
  * llama.cpp through llama-cpp-python, when it is installed, on the same GGUF;
  * the compile count during the measured phases (must be zero).

    python scripts/bench_decode.py [--slots 1,2,4,8] [--tokens 64] [--out results/]

Writes results/bench_decode.json, a markdown table (also printed) and bench_decode.png.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

import jinfer
from jinfer.weights import default_model_path

PROMPT = "Once upon a time, there was a little"


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def measure_bandwidth(repeats: int = 5) -> dict[str, float]:
    """Best-of-N GB/s over 1 GiB float32, and float32 matmul GFLOP/s."""
    n = 2**28  # 1 GiB of float32
    x = jnp.ones((n,), jnp.float32)
    total = jax.jit(jnp.sum)
    side = 2**14
    matrix = x.reshape(side, side)
    vector = jnp.ones((side,), jnp.float32)
    matvec = jax.jit(jnp.dot)
    a = jnp.ones((2048, 2048), jnp.float32)
    matmul = jax.jit(jnp.matmul)
    best = {"reduction": 0.0, "matvec": 0.0, "matmul": 0.0}
    for fn, args, key in (
        (total, (x,), "reduction"),
        (matvec, (matrix, vector), "matvec"),
        (matmul, (a, a), "matmul"),
    ):
        jax.block_until_ready(fn(*args))
        for _ in range(repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            seconds = time.perf_counter() - start
            rate = (2 * 2048**3 / seconds / 1e9) if key == "matmul" else (n * 4 / seconds / 1e9)
            best[key] = max(best[key], rate)
    del x, matrix
    return {
        "bandwidth_gb_s": max(best["reduction"], best["matvec"]),
        "reduction_gb_s": best["reduction"],
        "matvec_gb_s": best["matvec"],
        "matmul_gflop_s": best["matmul"],
    }


def jinfer_decode(llm: jinfer.LLM, slots: int, tokens: int) -> dict[str, float]:
    """Decode tokens/s with every slot busy: from the first token to the last, all requests."""
    sampling = jinfer.SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    before = llm.engine.compile_count()
    start = time.perf_counter()
    results = llm.generate([PROMPT] * slots, sampling)
    wall = time.perf_counter() - start
    first = min(r.metrics["ttft_s"] for r in results)
    generated = sum(len(r.token_ids) for r in results)
    decode_time = wall - first  # all requests start together: TTFT marks the end of prefill
    return {
        "tokens_per_s": (generated - slots) / decode_time,
        "step_s": decode_time / (tokens - 1),
        "compiles": llm.engine.compile_count() - before,
    }


def bytes_per_step(llm: jinfer.LLM, slots: int, prompt_len: int, tokens: int) -> tuple[float, float]:
    """(bytes a step must read, bytes it reads), at the mid-point of the decode.

    A step must read the weights and the K/V of the filled positions; it reads the K/V of the
    attention bucket the engine picks (filled positions + margin, rounded up to a power of two).
    """
    weights = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(llm.params))
    cfg, engine = llm.engine.steps.model, llm.engine.config
    per_position = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # K and V, float32
    filled = prompt_len + tokens / 2
    reach = min(filled + 2 * engine.decode_steps + 1, engine.cache_len)
    bucket = next(b for b in engine.attention_buckets if b >= reach)
    return weights + slots * filled * per_position, weights + slots * bucket * per_position


def transformers_decode(model, input_ids, batch: int, tokens: int) -> float:
    import torch

    ids = input_ids.repeat(batch, 1)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, do_sample=False)  # warm
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        total = time.perf_counter() - start
    return batch * (tokens - 1) / (total - prefill)


def llama_cpp_decode(path: str, tokens: int) -> float | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=path, n_ctx=512, n_threads=os.cpu_count(), verbose=False)
    llm(PROMPT, max_tokens=4)
    start = time.perf_counter()
    out = llm(PROMPT, max_tokens=tokens, temperature=0)
    return out["usage"]["completion_tokens"] / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--slots", default="1,2,4,8", help="slot counts to measure")
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (best kept)")
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    slot_counts = [int(s) for s in args.slots.split(",")]
    os.makedirs(args.out, exist_ok=True)

    progress("measuring memory bandwidth and matmul FLOP/s")
    ceiling = measure_bandwidth()
    progress(
        f"bandwidth {ceiling['bandwidth_gb_s']:.1f} GB/s, matmul {ceiling['matmul_gflop_s']:.0f} GFLOP/s"
    )

    progress("loading transformers reference (same GGUF weights, float32)")
    import torch
    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(default_model_path())
    hf = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()

    rows = []
    for slots in slot_counts:
        progress(f"jinfer: {slots} slots (build + warm-up)")
        llm = jinfer.LLM(max_slots=slots, max_seq_len=256, prefill_buckets=(16, 32), decode_steps=4)
        llm.engine.warmup()
        input_ids = torch.tensor([llm.tokenizer.encode(PROMPT)])
        best = {"tokens_per_s": 0.0}
        peer = 0.0
        for round_ in range(args.rounds):
            progress(f"  round {round_ + 1}: jinfer then transformers")
            run = jinfer_decode(llm, slots, args.tokens)
            if run["tokens_per_s"] > best["tokens_per_s"]:
                best = run
            if slots in (1, 8):
                peer = max(peer, transformers_decode(hf, input_ids, slots, args.tokens))
        needed, read = bytes_per_step(llm, slots, input_ids.shape[1], args.tokens)
        bandwidth = ceiling["bandwidth_gb_s"] * 1e9
        rows.append(
            {
                "slots": slots,
                "jinfer_tokens_per_s": best["tokens_per_s"],
                "step_ms": best["step_s"] * 1e3,
                "ceiling_tokens_per_s": slots * bandwidth / needed,
                "mbu_needed_bytes": needed / best["step_s"] / bandwidth,
                "mbu_bytes_read": read / best["step_s"] / bandwidth,
                "transformers_tokens_per_s": peer or None,
                "vs_transformers": best["tokens_per_s"] / peer if peer else None,
                "compiles_in_measured_phase": best["compiles"],
            }
        )
        del llm

    cpp = llama_cpp_decode(default_model_path(), args.tokens)
    result = {"ceiling": ceiling, "decode": rows, "llama_cpp_q4_1_tokens_per_s": cpp, "tokens": args.tokens}
    with open(os.path.join(args.out, "bench_decode.json"), "w") as f:
        json.dump(result, f, indent=1)

    columns = ["slots", "jinfer tok/s", "step ms", "ceiling tok/s", "MBU (needed)", "MBU (read)"]
    columns += ["transformers tok/s", "x transformers", "compiles"]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    fmt = lambda v, spec: "n/a" if v is None else format(v, spec)
    for r in rows:
        cells = [
            str(r["slots"]),
            fmt(r["jinfer_tokens_per_s"], ".1f"),
            fmt(r["step_ms"], ".1f"),
            fmt(r["ceiling_tokens_per_s"], ".1f"),
            fmt(r["mbu_needed_bytes"], ".2f"),
            fmt(r["mbu_bytes_read"], ".2f"),
            fmt(r["transformers_tokens_per_s"], ".1f"),
            fmt(r["vs_transformers"], ".2f"),
            str(r["compiles_in_measured_phase"]),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(
        f"Bandwidth {ceiling['bandwidth_gb_s']:.1f} GB/s (reduction {ceiling['reduction_gb_s']:.1f}, "
        f"matvec {ceiling['matvec_gb_s']:.1f}); matmul {ceiling['matmul_gflop_s']:.0f} GFLOP/s; "
        f"llama.cpp (Q4_1 GGUF): {fmt(cpp, '.1f')} tok/s; {args.tokens} tokens per request."
    )
    table = "\n".join(lines)
    with open(os.path.join(args.out, "bench_decode.md"), "w") as f:
        f.write(table + "\n")
    print(table)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(slot_counts, [r["jinfer_tokens_per_s"] for r in rows], "o-", label="jinfer")
    ax.plot(slot_counts, [r["ceiling_tokens_per_s"] for r in rows], "--", label="bandwidth ceiling")
    peers = [(r["slots"], r["transformers_tokens_per_s"]) for r in rows if r["transformers_tokens_per_s"]]
    if peers:
        ax.plot(*zip(*peers, strict=True), "s", label="transformers")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("slots (batch)")
    ax.set_ylabel("decode tokens/s")
    ax.set_title("SmolLM2-135M float32 decode")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "bench_decode.png"), dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
