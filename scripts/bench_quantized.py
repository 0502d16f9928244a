"""Quantized decode: jinfer multiplying a GGUF's quantized blocks against llama.cpp on the same file.

Measured side by side in one run, alternating rounds (the machines are shared and noisy, so only
ratios mean much):

  * batch-1 greedy decode tokens/s on the embedded SmolLM2-135M Q4_1 GGUF (Q4_1 layers, a Q8_0
    embedding): jinfer (`quantization` auto: its quantized kernel), jinfer on the same file
    dequantized to float32 (`quantization=none`), and llama.cpp (llama-cpp-python);
  * the same on a Q8_0 GGUF written by llama.cpp's own quantizer from its F32 conversion, and on a
    Q4_K_M GGUF (Q4_K and Q6_K blocks) of a random-weight Llama-shaped model of 230M weights whose
    widths are whole 256-input blocks, and SmolLM2's Q4_K_M (its width 576 is not: llama.cpp falls
    back to Q5_0 and Q8_0 there);
  * 8 sequences decoding at once: jinfer's 8 slots against llama.cpp decoding 8 sequences in one
    `llama_decode` batch per step (its low-level API, greedy on each sequence's logits);
  * greedy tokens of jinfer quantized and dequantized, compared: how many of the first agree (the
    integer-product formats round activations to 8 bits, so they part where the top two logits are
    close);
  * MBU: the bytes a step reads (the quantized blocks as held, plus K/V) / step time / the memory
    bandwidth measured in the same run; and the compiles during the measured rounds (must be 0).

    python scripts/bench_quantized.py [--rounds 5] [--tokens 64] [--files q4_1,...] [--out results]

llama.cpp: `pip install llama-cpp-python==0.3.36` (compiles it, ~10 minutes on 2 cores); without
it only jinfer's figures are printed. Writes results/bench_quantized.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np
from bench_decode import LlamaCpp, bytes_per_step
from benchlib import (
    PROMPT,
    export_hf_from_gguf,
    llama_cpp_available,
    llama_cpp_f32_gguf,
    markdown_table,
    measure_ceiling,
    paired_ratio,
    progress,
    random_llama_dir,
    write_results,
)

import jinfer
from jinfer.loading import default_model_path

BATCH = 8


def jinfer_decode(llm: jinfer.LLM, slots: int, tokens: int) -> float:
    """Greedy decode tokens/s of `slots` sequences at once: a `tokens`-token generation less a
    1-token one (their prefills), as llama.cpp's figures below are taken after its prefill."""

    def generate(new_tokens: int) -> float:
        sampling = jinfer.SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([PROMPT] * slots, sampling)
        return time.perf_counter() - start

    prefill = generate(1)
    return slots * (tokens - 1) / (generate(tokens) - prefill)


class LlamaCppBatch(LlamaCpp):
    """llama.cpp decoding `BATCH` sequences in one batch per step, in a process of its own:
    decode tokens/s summed over the sequences (None once its process has died)."""

    def __init__(self, path: str, prompt_ids: list[int], context: int = 512):
        self._start(_batch_worker, path, prompt_ids, context)

    def decode(self, tokens: int) -> float | None:
        return self._ask(tokens)


def _batch_worker(conn, path: str, prompt_ids: list[int], context: int) -> None:
    import llama_cpp as cpp

    cpp.llama_backend_init()
    model = cpp.llama_model_load_from_file(path.encode(), cpp.llama_model_default_params())
    params = cpp.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_seq_max = BATCH * context, BATCH * context, BATCH
    params.n_threads = params.n_threads_batch = os.cpu_count()
    ctx = cpp.llama_init_from_model(model, params)
    vocab_size = cpp.llama_vocab_n_tokens(cpp.llama_model_get_vocab(model))
    batch = cpp.llama_batch_init(BATCH * context, 0, BATCH)

    def run(entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """One llama_decode of (token, position, sequence, wants logits); greedy next tokens."""
        batch.n_tokens = len(entries)
        for i, (token, position, sequence, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, position, 1
            batch.seq_id[i][0], batch.logits[i] = sequence, logits
        if cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        outputs = [i for i, entry in enumerate(entries) if entry[3]]
        return [
            int(np.argmax(np.ctypeslib.as_array(cpp.llama_get_logits_ith(ctx, i), (vocab_size,))))
            for i in outputs
        ]

    def generate(tokens: int) -> float:
        cpp.llama_memory_clear(cpp.llama_get_memory(ctx), True)
        last = len(prompt_ids) - 1
        prefill = [(t, p, s, p == last) for s in range(BATCH) for p, t in enumerate(prompt_ids)]
        next_tokens = run(prefill)
        start = time.perf_counter()
        for step in range(tokens - 1):
            next_tokens = run([(t, last + 1 + step, s, True) for s, t in enumerate(next_tokens)])
        return BATCH * (tokens - 1) / (time.perf_counter() - start)

    generate(4)
    conn.send("ready")
    while True:
        try:
            tokens = conn.recv()
        except EOFError:
            return
        conn.send(generate(tokens))


def quantized_gguf(hf_dir: str, directory: str, name: str) -> str | None:
    """A Hugging Face model as a GGUF of llama.cpp's type `name` (Q8_0, Q4_K_M): converted to F32 by
    llama.cpp's converter, quantized by llama.cpp's own quantizer."""
    import llama_cpp as cpp

    f32 = os.path.join(directory, os.path.basename(hf_dir) + "-f32.gguf")
    if not os.path.exists(f32):
        llama_cpp_f32_gguf(hf_dir, f32, directory)
    out = os.path.join(directory, f"{os.path.basename(hf_dir)}-{name}.gguf")
    params = cpp.llama_model_quantize_default_params()
    params.ftype = getattr(cpp, f"LLAMA_FTYPE_MOSTLY_{name}")
    if cpp.llama_model_quantize(f32.encode(), out.encode(), params) != 0:
        progress(f"llama.cpp's quantizer failed: no {name} figures")
        return None
    return out


def bench_file(label: str, path: str, args, bandwidth: float, cpp_peers: bool) -> dict:
    """Alternating rounds on one GGUF: jinfer quantized, jinfer dequantized, llama.cpp (1 and 8)."""
    progress(f"{label}: loading")
    options = dict(max_slots=BATCH, max_seq_len=512)
    engines = {
        "jinfer": jinfer.LLM(path, **options),
        "jinfer_f32": jinfer.LLM(path, quantization="none", **options),
    }
    prompt_ids = engines["jinfer"].tokenizer.encode(PROMPT)
    peers = {}
    if cpp_peers:
        peers["llama.cpp"] = LlamaCpp(path)
        peers["llama.cpp_batch"] = LlamaCppBatch(path, prompt_ids)
    for llm in engines.values():
        for slots in (1, BATCH):
            jinfer_decode(llm, slots, 8)  # compiles, warms up
    compiles_before = sum(llm.engine.compile_count() for llm in engines.values())
    rates: dict[str, dict[int, list[float]]] = {}
    for round_ in range(args.rounds):
        progress(f"{label}: round {round_ + 1}/{args.rounds}")
        for slots in (1, BATCH):
            for name, llm in engines.items():
                rates.setdefault(name, {}).setdefault(slots, []).append(
                    jinfer_decode(llm, slots, args.tokens)
                )
            peer = peers.get("llama.cpp" if slots == 1 else "llama.cpp_batch")
            rate = peer.decode(args.tokens) if peer else None
            if rate:
                rates.setdefault("llama.cpp", {}).setdefault(slots, []).append(rate)
    compiles = sum(llm.engine.compile_count() for llm in engines.values()) - compiles_before
    greedy = jinfer.SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    tokens = [llm.generate([PROMPT], greedy)[0].token_ids for llm in engines.values()]
    parted = [i for i, pair in enumerate(zip(*tokens, strict=False)) if len(set(pair)) > 1]
    agreeing = parted[0] if parted else len(tokens[0])
    rows = {}
    for slots in (1, BATCH):
        mine = np.array(rates["jinfer"][slots])
        step_bytes = bytes_per_step(engines["jinfer"], slots, len(prompt_ids), args.tokens)[1]
        row = {
            "jinfer_tokens_per_s": float(np.median(mine)),
            "jinfer_f32_tokens_per_s": float(np.median(rates["jinfer_f32"][slots])),
            "vs_dequantized": paired_ratio(mine, np.array(rates["jinfer_f32"][slots])),
            "mbu": float(np.median(mine)) / slots * step_bytes / bandwidth,
            "step_bytes": step_bytes,
        }
        theirs = rates.get("llama.cpp", {}).get(slots)
        if theirs and len(theirs) == len(mine):
            row["llama_cpp_tokens_per_s"] = float(np.median(theirs))
            row["vs_llama_cpp"] = paired_ratio(mine, np.array(theirs))
        rows[slots] = row
    return {"label": label, "path": path, "by_slots": rows, "compiles": compiles, "greedy_agreeing": agreeing}


def report(result: dict) -> str:
    lines = [
        f"bandwidth {result['ceiling']['reduction_gb_s']:.1f} GB/s, {result['rounds']} alternating rounds of "
        f"{result['tokens']} tokens; ratios: median of paired rounds (lowest-highest)",
        "",
    ]
    columns = ["file", "sequences", "jinfer tok/s", "MBU", "vs dequantized f32", "llama.cpp tok/s"]
    columns.append("vs llama.cpp")
    rows = []
    ratio = lambda r: f"{r['median']:.2f}x ({r['lowest']:.2f}-{r['highest']:.2f})"
    for entry in result["files"]:
        for slots, row in entry["by_slots"].items():
            rows.append(
                [
                    entry["label"],
                    slots,
                    f"{row['jinfer_tokens_per_s']:.1f}",
                    f"{row['mbu']:.2f}",
                    ratio(row["vs_dequantized"]),
                    f"{row['llama_cpp_tokens_per_s']:.1f}" if "llama_cpp_tokens_per_s" in row else "-",
                    ratio(row["vs_llama_cpp"]) if "vs_llama_cpp" in row else "-",
                ]
            )
        lines.append(
            f"{entry['label']}: compiles during the rounds {entry['compiles']}; the first "
            f"{entry['greedy_agreeing']} of {result['tokens']} greedy tokens the dequantized model's"
        )
    return "\n".join([*lines, "", markdown_table(columns, rows)])


def main() -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument(
        "--files",
        default="q4_1,q8_0,q4_k_m,smollm2_q4_k_m",
        help="which of q4_1, q8_0, q4_k_m, smollm2_q4_k_m",
    )
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    ceiling = measure_ceiling()
    bandwidth = ceiling["reduction_gb_s"] * 1e9
    cpp = llama_cpp_available()
    if not cpp:
        progress("llama-cpp-python is not installed: jinfer's figures only")
    wanted = args.files.split(",")
    files = []
    if "q4_1" in wanted:
        files.append(bench_file("SmolLM2 Q4_1 (embedded)", default_model_path(), args, bandwidth, cpp))
    with tempfile.TemporaryDirectory() as scratch:
        smollm2 = export_hf_from_gguf(default_model_path(), os.path.join(scratch, "smollm2"))
        if cpp and "q8_0" in wanted and (path := quantized_gguf(smollm2, scratch, "Q8_0")):
            files.append(bench_file("SmolLM2 Q8_0 (llama.cpp's quantizer)", path, args, bandwidth, cpp))
        if cpp and "smollm2_q4_k_m" in wanted and (path := quantized_gguf(smollm2, scratch, "Q4_K_M")):
            label = "SmolLM2 Q4_K_M (llama.cpp's quantizer; width 576: Q5_0 / Q8_0 fallbacks)"
            files.append(bench_file(label, path, args, bandwidth, cpp))
        if cpp and "q4_k_m" in wanted:
            llama = random_llama_dir(os.path.join(scratch, "random-llama"), smollm2)
            if path := quantized_gguf(llama, scratch, "Q4_K_M"):
                label = "random Llama 230M Q4_K_M (llama.cpp's quantizer)"
                files.append(bench_file(label, path, args, bandwidth, cpp))
    result = {"ceiling": ceiling, "rounds": args.rounds, "tokens": args.tokens, "files": files}
    table = report(result)
    write_results(args.out, "bench_quantized", result, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
