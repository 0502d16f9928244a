"""Decode and prefill benchmark: jinfer against this machine's roofline and against peers.

Measured side by side in one run (the machines are shared and noisy, so only ratios mean much):

  * the ceiling: memory bandwidth and float32 matmul FLOP/s (see benchlib.measure_ceiling);
  * SmolLM2-135M on float32 weights: the embedded GGUF dequantized, written as a Hugging Face
    directory (read by transformers) and, when llama-cpp-python is installed, as an F32 GGUF by
    llama.cpp's own converter (read by jinfer and llama.cpp; otherwise jinfer reads the embedded
    GGUF, the same numbers);
  * jinfer decode tokens/s at 1..32 slots with MBU = bytes read per step / step time / bandwidth
    (bytes a step must read: weights + K/V of filled positions; bytes it reads: weights + K/V of
    the attention bucket it picks), and prefill MFU on a 256-token prompt;
  * transformers `generate()` (CPU torch, float32, greedy, fixed output length) at batch 1 and 8,
    and llama.cpp at batch 1 on the F32 GGUF and on the embedded Q4_1 GGUF, runs alternating with
    jinfer's; time to load each;
  * the same for a random-weight Llama-shaped model of ~0.9 GB (jinfer and transformers);
  * jinfer runs with packed weights as every door does on a CPU (`packed_weights`: decode products of up
    to 32 columns through its C++ kernel); its compiled decode with them against an engine of the
    same settings on XLA's products alone, alternating, at --packed-slots;
  * decode at a long context (SmolLM2, 1 and 8 slots at position --context): jinfer's compiled
    decode with its attention kernel against the same engine on XLA's einsums (decode_kernel=False),
    against transformers and (batch 1) llama.cpp decoding after a prompt of that length; MBU counts
    the K/V of the filled positions, which at 8 slots x 1024 positions weigh as much as the weights;
  * the compile count during every measured phase (must be zero).

    python scripts/bench_decode.py [--slots 1,2,4,8,16,32] [--tokens 64] [--context 1024] [--out results]

Writes results/bench_decode.{json,md,png}. llama.cpp: `pip install llama-cpp-python==0.3.36`
(compiles llama.cpp, ~10 minutes on 2 cores); its converter is fetched from PyPI's source archive.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import sys
import time

import numpy as np
from benchlib import (
    PROMPT,
    alternate_decode_timings,
    decode_weight_bytes,
    export_hf_from_gguf,
    llama_cpp_available,
    llama_cpp_f32_gguf,
    markdown_table,
    measure_ceiling,
    paired_ratio,
    prefill_flops,
    progress,
    pyplot,
    random_llama_dir,
    time_decode_calls,
    transformers_decode,
    write_results,
)

import jinfer
from jinfer.kv_cache import bytes_per_token
from jinfer.loading import default_model_path

PREFILL_TOKENS = 256
# As every door runs float weights on a CPU by default: a packed copy for the decode kernel. The
# embedded GGUF's blocks are dequantized: this benchmark compares float32 engines (bench_quantized
# compares the quantized ones).
JINFER_OPTIONS = {"packed_weights": True, "quantization": "none"}


def jinfer_decode(llm: jinfer.LLM, slots: int, tokens: int) -> dict[str, float]:
    """Decode tokens/s with every slot busy, from the first token to the last of all requests."""
    sampling = jinfer.SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    before = llm.engine.compile_count()
    start = time.perf_counter()
    results = llm.generate([PROMPT] * slots, sampling)
    wall = time.perf_counter() - start
    decode_time = wall - min(r.metrics["ttft_s"] for r in results)  # all start together
    generated = sum(len(r.token_ids) for r in results)
    return {
        "tokens_per_s": (generated - slots) / decode_time,
        "step_s": decode_time / (tokens - 1),
        "compiles": llm.engine.compile_count() - before,
    }


def jinfer_prefill_s(llm: jinfer.LLM, ids: list[int]) -> tuple[float, int]:
    """Best-of-3 time to first token for one prompt (prefill + the first sample), and compiles."""
    sampling = jinfer.SamplingParams(max_tokens=1, temperature=0)
    before = llm.engine.compile_count()
    best = min(llm.generate([ids], sampling)[0].metrics["ttft_s"] for _ in range(3))
    return best, llm.engine.compile_count() - before


def bytes_per_step(llm: jinfer.LLM, slots: int, prompt_len: int, tokens: int) -> tuple[float, float]:
    """(bytes a step must read, bytes it reads) at the mid-point of the decode."""
    params = llm.engine.params
    weights = decode_weight_bytes(params)
    per_position = bytes_per_token(llm.engine.steps.model, params.final_norm.dtype)  # K and V
    layout = llm.engine.layout
    filled = prompt_len + tokens / 2
    # A kernel reads each slot up to its own position; the einsums read the whole attention bucket.
    read = (
        filled
        if llm.engine.steps.attention_kernel
        else layout.attention_bucket(filled + 2 * layout.decode_steps + 1)
    )
    return weights + slots * filled * per_position, weights + slots * read * per_position


class LlamaCpp:
    """llama.cpp through llama-cpp-python, in a process of its own: batch-1 greedy decode tokens/s
    on one GGUF. A crash there (a build for another CPU dies with SIGILL) ends this peer's figures,
    not the benchmark: `decode` returns None from then on and `failure` says why."""

    def __init__(self, path: str, context: int = 512):
        self.load_s = self._start(_llama_cpp_worker, path, context)

    def decode(self, tokens: int, prompt: str | list[int] = PROMPT) -> float | None:
        return self._ask((tokens, prompt))

    def _start(self, worker, *args):
        """Start `worker(conn, *args)` in a process of its own; return its first message."""
        spawn = multiprocessing.get_context("spawn")  # no fork of a process running XLA's threads
        self._conn, child_end = spawn.Pipe()
        self._process = spawn.Process(target=worker, args=(child_end, *args), daemon=True)
        self._process.start()
        child_end.close()
        self.failure: str | None = None
        return self._receive()

    def _ask(self, message):
        if self.failure:
            return None
        with contextlib.suppress(OSError):  # the worker is gone: _receive says how it ended
            self._conn.send(message)
        return self._receive()

    def _receive(self) -> float | None:
        try:
            return self._conn.recv()
        except (EOFError, OSError):
            self._process.join()
            self.failure = f"llama.cpp's process ended (exit code {self._process.exitcode})"
            progress(f"{self.failure}: its figures are left out")
            return None


def _llama_cpp_worker(conn, path: str, context: int) -> None:
    """Load the GGUF, send the load time, then answer (tokens, prompt) with decode tokens/s."""
    from llama_cpp import Llama

    start = time.perf_counter()
    model = Llama(model_path=path, n_ctx=context, n_threads=os.cpu_count(), verbose=False)
    load_s = time.perf_counter() - start
    model(PROMPT, max_tokens=4)
    conn.send(load_s)
    no_eos = {model.token_eos(): -1e9}  # a fixed output length, like ignore_eos
    while True:
        try:
            tokens, prompt = conn.recv()
        except EOFError:
            return
        model(prompt, max_tokens=1, temperature=0)
        start = time.perf_counter()
        model(prompt, max_tokens=1, temperature=0)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        out = model(prompt, max_tokens=tokens, temperature=0, logit_bias=no_eos)
        conn.send((out["usage"]["completion_tokens"] - 1) / (time.perf_counter() - start - prefill))


def bench_model(label, jinfer_path, hf_dir, slot_counts, peers_cpp, args, ceiling) -> dict:
    """One model: jinfer at each slot count (alternating with the peers), prefill MFU, load times."""
    import torch
    from transformers import AutoModelForCausalLM

    progress(f"{label}: loading transformers")
    start = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    hf_load_s = time.perf_counter() - start
    bandwidth = ceiling["bandwidth_gb_s"] * 1e9
    rows, loads, prefill = [], {"transformers_s": hf_load_s}, None
    peer_cpp = {name: 0.0 for name in peers_cpp}
    for slots in slot_counts:
        progress(f"{label}: jinfer with {slots} slots (load, build, warm up)")
        start = time.perf_counter()
        llm = jinfer.LLM(
            jinfer_path,
            max_slots=slots,
            max_seq_len=512,
            decode_steps=4,
            **JINFER_OPTIONS,
        )
        loads.setdefault("jinfer_s", time.perf_counter() - start)
        llm.engine.warmup()
        input_ids = torch.tensor([llm.tokenizer.encode(PROMPT)])
        best, peer = {"tokens_per_s": 0.0}, 0.0
        for round_ in range(args.rounds):
            progress(f"  round {round_ + 1}: jinfer, then peers")
            run = jinfer_decode(llm, slots, args.tokens)
            best = max(best, run, key=lambda r: r["tokens_per_s"])
            if slots in (1, 8):
                peer = max(peer, transformers_decode(hf, input_ids, slots, args.tokens))
            if slots == 1:
                for name, cpp in peers_cpp.items():
                    peer_cpp[name] = max(peer_cpp[name], cpp.decode(args.tokens) or 0.0)
        needed, read = bytes_per_step(llm, slots, input_ids.shape[1], args.tokens)
        row = {
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
        if slots == 1:
            for name, rate in peer_cpp.items():
                if rate:
                    row[f"{name}_tokens_per_s"] = rate
                    row[f"vs_{name}"] = best["tokens_per_s"] / rate
            ids = (llm.tokenizer.encode(PROMPT * 64))[:PREFILL_TOKENS]
            seconds, compiles = jinfer_prefill_s(llm, ids)
            flops = prefill_flops(llm.engine.steps.model, llm.engine.params, len(ids))
            prefill = {
                "tokens": len(ids),
                "seconds": seconds,
                "tokens_per_s": len(ids) / seconds,
                "mfu": flops / seconds / (ceiling["matmul_gflop_s"] * 1e9),
                "compiles_in_measured_phase": compiles,
            }
        rows.append(row)
        del llm
    loads |= {f"{name}_s": cpp.load_s for name, cpp in peers_cpp.items() if cpp.load_s is not None}
    failures = {name: cpp.failure for name, cpp in peers_cpp.items() if cpp.failure}
    weights = sum(
        os.path.getsize(os.path.join(hf_dir, f)) for f in os.listdir(hf_dir) if f.endswith(".safetensors")
    )
    return {
        "model": label,
        "weights_bytes": weights,
        "decode": rows,
        "prefill": prefill,
        "load": loads,
        "peer_failures": failures,
    }


def jinfer_step_at(path: str, slots: int, context: int, calls: int, kernel: bool) -> dict[str, float]:
    """jinfer's compiled decode (4 steps a call) for `slots` busy slots from position `context` on:
    best of three timings of `calls` back-to-back calls on the engine's own cache and state."""
    llm = jinfer.LLM(
        path,
        max_slots=slots,
        max_seq_len=2 * context,
        max_num_batched_tokens=64,
        decode_kernel=kernel,
        **JINFER_OPTIONS,
    )
    engine = llm.engine
    steps_per_call = engine.layout.decode_steps
    reach = context + calls * steps_per_call + 1
    time_decode_calls(engine, slots, reach, calls, position=context)  # compiles and warms up
    before = engine.compile_count()
    best = min(time_decode_calls(engine, slots, reach, calls, position=context) for _ in range(3))
    compiles = engine.compile_count() - before
    weights = decode_weight_bytes(engine.params)
    per_position = bytes_per_token(engine.steps.model, engine.params.final_norm.dtype)
    filled = context + calls * steps_per_call / 2
    return {"step_s": best, "needed_bytes": weights + slots * filled * per_position, "compiles": compiles}


def bench_packed_weights(path: str, slot_counts: list[int], rounds: int = 5) -> list[dict]:
    """jinfer's compiled decode (4 steps a call, at position 100) with packed weights against an
    engine of the same settings on XLA's products alone: `rounds` alternating timings, the median
    of the pairs."""
    rows = []
    for slots in slot_counts:
        progress(f"packed weights: {slots} slots, packed and XLA engines (load, build, warm up)")
        options = {"max_slots": slots, "max_seq_len": 512, "max_num_batched_tokens": 64, "decode_steps": 4}
        options["quantization"] = "none"  # float matrices: the packed kernel's and XLA's products
        engines = {
            packed: jinfer.LLM(path, packed_weights=packed, **options).engine for packed in (True, False)
        }
        times, compiles = alternate_decode_timings(engines, slots, rounds)
        packed_s, xla_s = times[True], times[False]
        ratio = paired_ratio(xla_s, packed_s)
        rows.append(
            {
                "slots": slots,
                "packed_step_ms": float(np.median(packed_s)) * 1e3,
                "xla_step_ms": float(np.median(xla_s)) * 1e3,
                "xla_over_packed": ratio["median"],
                "lowest_pair": ratio["lowest"],
                "highest_pair": ratio["highest"],
                "compiles_in_measured_phase": compiles,
            }
        )
        del engines
    return rows


def bench_long_context(jinfer_path, hf_dir, cpp_path, args, ceiling) -> list[dict]:
    """Decode after `args.context` positions: jinfer with its kernel and on XLA's einsums, the peers."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    prompt = jinfer.load_tokenizer(jinfer_path).encode(PROMPT * args.context)[: args.context]
    cpp = LlamaCpp(cpp_path, context=2 * args.context) if cpp_path else None
    calls = max(1, args.tokens // 4)
    rows = []
    for slots in (1, 8):
        progress(f"long context: {slots} slots at position {args.context}, kernel then einsums")
        kernel = jinfer_step_at(jinfer_path, slots, args.context, calls, kernel=True)
        einsum = jinfer_step_at(jinfer_path, slots, args.context, calls, kernel=False)
        progress(f"long context: transformers, batch {slots}")
        peer = transformers_decode(hf, torch.tensor([prompt]), slots, args.tokens)
        row = {
            "slots": slots,
            "context": args.context,
            "jinfer_tokens_per_s": slots / kernel["step_s"],
            "step_ms": kernel["step_s"] * 1e3,
            "mbu": kernel["needed_bytes"] / kernel["step_s"] / (ceiling["bandwidth_gb_s"] * 1e9),
            "einsum_tokens_per_s": slots / einsum["step_s"],
            "vs_einsum": einsum["step_s"] / kernel["step_s"],
            "transformers_tokens_per_s": peer,
            "vs_transformers": slots / kernel["step_s"] / peer,
            "compiles_in_measured_phase": kernel["compiles"] + einsum["compiles"],
        }
        if cpp and slots == 1:
            progress("long context: llama.cpp, batch 1")
            if rate := cpp.decode(args.tokens, prompt):
                row["llama_cpp_f32_tokens_per_s"] = rate
                row["vs_llama_cpp_f32"] = row["jinfer_tokens_per_s"] / rate
        rows.append(row)
    return rows


def report(result: dict) -> str:
    ceiling = result["ceiling"]
    parts = [
        f"Bandwidth {ceiling['bandwidth_gb_s']:.1f} GB/s (reduction {ceiling['reduction_gb_s']:.1f}, "
        f"matvec {ceiling['matvec_gb_s']:.1f}); matmul {ceiling['matmul_gflop_s']:.0f} GFLOP/s; "
        f"{result['tokens']} tokens per request, greedy, float32."
    ]
    for model in result["models"]:
        columns = ["slots", "jinfer tok/s", "step ms", "ceiling tok/s", "MBU (needed)", "MBU (read)"]
        columns += ["transformers tok/s", "x transformers", "compiles"]
        rows = [
            [
                r["slots"],
                r["jinfer_tokens_per_s"],
                r["step_ms"],
                r["ceiling_tokens_per_s"],
                r["mbu_needed_bytes"],
                r["mbu_bytes_read"],
                r["transformers_tokens_per_s"],
                r["vs_transformers"],
                r["compiles_in_measured_phase"],
            ]
            for r in model["decode"]
        ]
        parts.append(f"\n### {model['model']} ({model['weights_bytes'] / 1e9:.2f} GB of weights)\n")
        parts.append(markdown_table(columns, rows))
        first = model["decode"][0]
        for name in ("llama_cpp_f32", "llama_cpp_q4_1"):
            if f"{name}_tokens_per_s" in first:
                parts.append(
                    f"\n{name}: {first[f'{name}_tokens_per_s']:.1f} tok/s at batch 1; jinfer / it = "
                    f"{first[f'vs_{name}']:.2f}"
                )
        for name, failure in model.get("peer_failures", {}).items():
            parts.append(f"\n{name}: no figures ({failure}).")
        p = model["prefill"]
        parts.append(
            f"\nPrefill of {p['tokens']} tokens: {p['seconds'] * 1e3:.0f} ms "
            f"({p['tokens_per_s']:.0f} tok/s), "
            f"MFU {p['mfu']:.2f}, compiles {p['compiles_in_measured_phase']}. "
            "Load: " + ", ".join(f"{k[:-2]} {v:.1f} s" for k, v in model["load"].items())
        )
    if result.get("packed_weights"):
        parts.append("\n### SmolLM2-135M decode: packed weights against XLA's products (same settings)\n")
        columns = ["slots", "packed ms/step", "XLA ms/step", "XLA / packed, median", "lowest pair"]
        columns += ["highest pair", "compiles"]
        keys = ["slots", "packed_step_ms", "xla_step_ms", "xla_over_packed", "lowest_pair", "highest_pair"]
        keys += ["compiles_in_measured_phase"]
        parts.append(markdown_table(columns, [[r[k] for k in keys] for r in result["packed_weights"]]))
    if result.get("long_context"):
        rows = result["long_context"]
        parts.append(f"\n### SmolLM2-135M decoding at position {rows[0]['context']}\n")
        columns = ["slots", "jinfer tok/s", "step ms", "MBU", "einsum tok/s", "x einsum"]
        columns += ["transformers tok/s", "x transformers", "llama.cpp tok/s", "x llama.cpp", "compiles"]
        keys = ["slots", "jinfer_tokens_per_s", "step_ms", "mbu", "einsum_tokens_per_s", "vs_einsum"]
        keys += ["transformers_tokens_per_s", "vs_transformers", "llama_cpp_f32_tokens_per_s"]
        keys += ["vs_llama_cpp_f32", "compiles_in_measured_phase"]
        parts.append(markdown_table(columns, [[r.get(k) for k in keys] for r in rows]))
    return "\n".join(parts)


def plot(result: dict, path: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(result["models"]), figsize=(6 * len(result["models"]), 4), squeeze=False)
    for ax, model in zip(axes[0], result["models"], strict=True):
        rows = model["decode"]
        slots = [r["slots"] for r in rows]
        ax.plot(slots, [r["jinfer_tokens_per_s"] for r in rows], "o-", label="jinfer")
        ax.plot(slots, [r["ceiling_tokens_per_s"] for r in rows], "--", label="bandwidth ceiling")
        peers = [(r["slots"], r["transformers_tokens_per_s"]) for r in rows if r["transformers_tokens_per_s"]]
        ax.plot(*zip(*peers, strict=True), "s", label="transformers")
        for name, marker in (("llama_cpp_f32", "^"), ("llama_cpp_q4_1", "v")):
            if f"{name}_tokens_per_s" in rows[0]:
                ax.plot([1], [rows[0][f"{name}_tokens_per_s"]], marker, label=name.replace("_", " "))
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("slots (batch)")
        ax.set_ylabel("decode tokens/s")
        ax.set_title(model["model"])
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--slots", default="1,2,4,8,16,32", help="slot counts for SmolLM2")
    parser.add_argument("--large-slots", default="1,8", help="slot counts for the ~0.9 GB random model")
    parser.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (best kept)")
    parser.add_argument(
        "--context", type=int, default=1024, help="position of the long-context rows (0: none)"
    )
    parser.add_argument(
        "--packed-slots", default="1,2,4,8,16,32", help="slot counts for packed weights vs XLA ('': none)"
    )
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    work = os.path.join(args.out, ".models")

    progress("measuring memory bandwidth and matmul FLOP/s")
    ceiling = measure_ceiling()
    progress(
        f"bandwidth {ceiling['bandwidth_gb_s']:.1f} GB/s, matmul {ceiling['matmul_gflop_s']:.0f} GFLOP/s"
    )

    progress("writing SmolLM2's float32 weights as a Hugging Face directory")
    embedded = default_model_path()
    smol_hf = export_hf_from_gguf(embedded, os.path.join(work, "smollm2-f32-hf"))
    smol_jinfer, cpp = embedded, {}
    if llama_cpp_available():
        progress("llama.cpp: converting to an F32 GGUF with its convert_hf_to_gguf.py")
        smol_jinfer = llama_cpp_f32_gguf(
            smol_hf, os.path.join(work, "smollm2-f32.gguf"), os.path.join(work, "src")
        )
        progress("llama.cpp: loading the F32 and Q4_1 GGUFs")
        cpp = {"llama_cpp_f32": LlamaCpp(smol_jinfer), "llama_cpp_q4_1": LlamaCpp(embedded)}
    else:
        progress("llama-cpp-python is not installed: llama.cpp columns are skipped")

    models = [
        bench_model(
            "SmolLM2-135M", smol_jinfer, smol_hf, [int(s) for s in args.slots.split(",")], cpp, args, ceiling
        )
    ]
    del cpp
    packed = None
    if args.packed_slots:
        packed = bench_packed_weights(smol_jinfer, [int(s) for s in args.packed_slots.split(",")])
    long_context = None
    if args.context:
        cpp_path = smol_jinfer if llama_cpp_available() else None
        long_context = bench_long_context(smol_jinfer, smol_hf, cpp_path, args, ceiling)
    if args.large_slots:
        progress("writing a random ~0.9 GB Llama-shaped model")
        large = random_llama_dir(os.path.join(work, "random-llama-0.9gb"), smol_hf)
        slots = [int(s) for s in args.large_slots.split(",")]
        models.append(bench_model("random Llama 0.9 GB", large, large, slots, {}, args, ceiling))

    result = {"ceiling": ceiling, "models": models, "tokens": args.tokens}
    result |= {"packed_weights": packed, "long_context": long_context}
    write_results(args.out, "bench_decode", result, report(result))
    plot(result, os.path.join(args.out, "bench_decode.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
