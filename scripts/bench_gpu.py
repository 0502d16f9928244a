"""Accelerator benchmark: a random Llama-3-8B-shaped model, bf16, decode at batch 1 and 64 with
MBU and MFU, prefill MFU, and transformers on the same device as the peer.

Meant for the rare session with an accelerator (an H200 here); nothing else depends on it.
scripts/gpu_check.sh runs it, then a GPU smoke test. It builds the model with random weights
directly on the device (no files), then times jinfer's own compiled steps:
  * decode: all slots busy at `--context` positions (each slot's pages its own), `decode_steps`
    steps per call, called back to back, with XLA's einsum attention over gathered pages (over the
    attention bucket) and, where it applies, the Pallas paged decode kernel at each of
    `--page-sizes`; MBU = (weight bytes + K/V bytes of the filled positions) / step time /
    bandwidth, and MFU = the step's matrix FLOPs / step time / the matmul rate;
  * prefill: one `--prefill-tokens` prompt in one dispatch (its 64-token pieces); MFU as above;
  * speculative decoding at batch 1: verify steps of 1, 2, 4 and 8 draft tokens against a decode
    step, and the speed-up that implies at draft acceptance rates 0.5 / 0.7 / 0.9 (random weights
    make no text worth drafting from, so the rate is assumed, the cost measured).
Bandwidth (1 GiB reductions and matrix-vector products) and the matmul rate (8192^3 in the
model's dtype) are measured in the same run. The peer, transformers `generate()` (greedy, eager,
the same shape and dtype, its own random weights), runs first in a child process, so that JAX
has not yet taken the device's memory.

    python scripts/bench_gpu.py [--shape llama3-8b] [--slots 1,64] [--out results]

`--shape tiny` runs the same code on a CPU in seconds (to check the script, not the hardware).
Writes results/bench_gpu.{json,md}.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from benchlib import (
    attention_flops,
    decode_weight_bytes,
    markdown_table,
    matrix_params,
    measure_ceiling,
    prefill_flops,
    progress,
    transformers_decode,
    write_results,
)

from jinfer.config import PROMPT_PIECE, EngineConfig, ModelConfig
from jinfer.formats.hf import model_config as hf_config
from jinfer.inputs import DraftPlan, Program, neutral_inputs
from jinfer.kv_cache import bytes_per_token, contiguous_tables
from jinfer.layout import resolve_layout
from jinfer.models.params import init_params
from jinfer.sampling import SamplingArrays, SamplingParams
from jinfer.sharding import make_mesh, param_shardings
from jinfer.speculative import LONGEST_NGRAM, program_lengths, verify_programs
from jinfer.state import cut_pieces, pack_pieces
from jinfer.steps import build_steps, prefill_program
from jinfer.weights import Weights

SHAPES = {
    "llama3-8b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "rope_theta": 500000.0,
    },
    "tiny": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 256,
        "rope_theta": 10000.0,
    },
}


def transformers_peer(hf: dict, dtype: str, slot_counts: list[int], context: int, tokens: int) -> dict:
    """transformers decode tokens/s per slot count on the accelerator (or the CPU without one)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_default_dtype(getattr(torch, dtype))
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(**hf)).eval()
    ids = torch.randint(0, hf["vocab_size"], (1, context), device=device)
    return {slots: transformers_decode(model, ids, slots, tokens) for slots in slot_counts}


def prompt_pieces(cfg, tokens: int, pieces: int):
    """A random greedy prompt of `tokens` tokens into slot 0, in `pieces` pieces (a bucket)."""
    greedy = SamplingArrays.from_params([SamplingParams(temperature=0.0).resolve()], [0])
    prompt = np.random.RandomState(0).randint(0, cfg.vocab_size, tokens)
    flags = {"slot": 0, "start": 0, "last": True, "generated": 0, "min_tokens": 0, "bias": {}, "stop_ids": ()}
    rows = cut_pieces(prompt, piece_len=PROMPT_PIECE, **flags, sampling=greedy, vocab=cfg.vocab_size)
    return pack_pieces(rows, pieces, PROMPT_PIECE, cfg.vocab_size)


def inputs_for(steps, program: Program, busy: int = 0, plan=None):
    """A program's inputs: its rows `busy` steps each, no row constrained, `plan` for a verify
    program."""
    rows = program.rows
    row_steps = np.full(rows, busy, np.int32)
    inputs = neutral_inputs(rows).replace(steps=row_steps, allowed=steps.unconstrained)
    return inputs if plan is None else inputs.replace(plan=plan)


def best_time(call, carried, calls: int) -> float:
    """Best wall time of `calls` calls (after one that compiles); call(carried) -> (carried, out)."""
    best = float("inf")
    for _ in range(calls + 1):
        start = time.perf_counter()
        carried, out = call(carried)
        (out.chunk if out.rows is None else out.rows).tokens.block_until_ready()
        best = min(best, time.perf_counter() - start)
    return best


def fresh(steps, dtype):
    return steps.new_cache(dtype), steps.new_state()


def tables_of(steps):
    """Block tables giving every slot pages of its own for a full-length sequence."""
    layout = steps.layout
    return steps.put_tables(contiguous_tables(layout.max_slots, layout.max_seq_len, layout.page_size))


def bench_prefill(cfg, steps, params, dtype, tokens: int, calls: int, peak_flop_s: float) -> dict:
    program = prefill_program(steps.layout.piece_bucket(-(-tokens // PROMPT_PIECE)))
    chunk, tables = prompt_pieces(cfg, tokens, program.rows), tables_of(steps)
    prefill, inputs = steps.programs[program], inputs_for(steps, program, 1)

    def call(carried):
        cache, state, out = prefill(Weights(params), *carried, tables, inputs, chunk)
        return (cache, state), out

    best = best_time(call, fresh(steps, dtype), calls)
    flops = prefill_flops(cfg, params, tokens)
    return {
        "tokens": tokens,
        "ms": best * 1e3,
        "tokens_per_s": tokens / best,
        "mfu": flops / best / peak_flop_s,
    }


def busy_state(steps, dtype, context: int):
    """A fresh cache and every slot's state as if decoding at position `context`."""
    cache, state = fresh(steps, dtype)
    return cache, state.replace(positions=jnp.full_like(state.positions, context))


def time_decode(program: Program, steps, params, dtype, args) -> float:
    """Seconds per decode step: `args.calls` back-to-back calls after one that compiles."""
    decode, tables = steps.programs[program], tables_of(steps)
    inputs = inputs_for(steps, program, steps.layout.decode_steps)
    cache, state = busy_state(steps, dtype, args.context)
    cache, state, out = decode(Weights(params), cache, state, tables, inputs, None)
    out.rows.tokens.block_until_ready()
    start = time.perf_counter()
    for _ in range(args.calls):
        cache, state, out = decode(Weights(params), cache, state, tables, inputs, None)
    out.rows.tokens.block_until_ready()
    return (time.perf_counter() - start) / (args.calls * steps.layout.decode_steps)


def layout_of(engine: EngineConfig, cfg: ModelConfig):
    """The layout the engine would run on one device, with the weights as they are (not packed)."""
    engine = dataclasses.replace(engine, packed_weights=False)
    return resolve_layout(engine, cfg, 1, cache_bytes_per_token=0, weight_bytes=0, available_bytes=0)


def bench_speculative(cfg, base, mesh, shardings, params, dtype, args) -> dict:
    """Batch 1: a decode step against verify steps of 1, 2, 4 and 8 draft tokens (every draft
    proposed; per step), and the batch-1 speed-up that implies at draft acceptance rates a (each
    draft token accepted with chance a given the ones before): (1 + a + ... + a^k) / cost."""
    engine = layout_of(dataclasses.replace(base, max_slots=1, speculative="ngram", num_draft_tokens=8), cfg)
    steps = build_steps(cfg, engine, mesh, Weights(shardings), cfg.vocab_size)
    bucket = steps.attention_bucket(args.context + args.calls * engine.decode_steps * 9 + 1)
    tables = tables_of(steps)
    progress("speculative: batch-1 decode against verify steps of 1, 2, 4, 8 draft tokens")
    ((_, longest),) = verify_programs(engine.speculative, engine.verify_variants)
    lengths = program_lengths(engine.speculative, engine.verify_variants, longest)

    plain = Program("decode", 1, bucket)
    decode_inputs = inputs_for(steps, plain, engine.decode_steps)

    def decode(carried):
        cache, state, out = steps.programs[plain](Weights(params), *carried, tables, decode_inputs, None)
        return (cache, state), out

    def verify(k):
        # The program of every length, made to take k (each step would pick; here every one drafts).
        chances, costs = np.full((1, LONGEST_NGRAM), 0.5, np.float32), np.ones(len(lengths), np.float32)
        plan = DraftPlan(np.ones(1, bool), chances, costs, np.int32(lengths.index(k)))
        program = Program("verify", 1, bucket, drafts=longest)
        inputs = inputs_for(steps, program, engine.decode_steps, plan)

        def call(carried):
            cache, state, out = steps.programs[program](Weights(params), *carried, tables, inputs, None)
            return (cache, state), out

        return call

    calls = max(args.calls // 5, 1)
    plain = best_time(decode, busy_state(steps, dtype, args.context), calls)
    cost = {
        k: best_time(verify(k), busy_state(steps, dtype, args.context), calls) / plain
        for _, k in engine.verify_variants
    }
    implied = {a: max(sum(a**i for i in range(k + 1)) / c for k, c in cost.items()) for a in (0.5, 0.7, 0.9)}
    return {
        "decode_step_ms": plain / engine.decode_steps * 1e3,
        "verify_cost": cost,
        "implied_speedup": implied,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--slots", default="1,64")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--context", type=int, default=900, help="decode: positions filled before timing")
    parser.add_argument("--prefill-tokens", type=int, default=2048)
    parser.add_argument("--calls", type=int, default=25)
    parser.add_argument("--page-sizes", default="16,64", help="KV page sizes the paged kernel runs at")
    parser.add_argument("--peer-tokens", type=int, default=32, help="tokens per transformers generate()")
    parser.add_argument("--no-peer", action="store_true", help="skip transformers")
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    dtype = jnp.dtype(args.dtype)
    slot_counts = [int(s) for s in args.slots.split(",")]
    page_sizes = [int(p) for p in args.page_sizes.split(",")]
    hf = {"max_position_embeddings": 8192, "rms_norm_eps": 1e-5, **SHAPES[args.shape]}
    peer = {}
    if not args.no_peer:
        progress(f"transformers generate() on the same shape: {slot_counts} slots, {args.peer_tokens} tokens")
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            peer = pool.apply(
                transformers_peer, (hf, args.dtype, slot_counts, args.context, args.peer_tokens)
            )
    cfg = hf_config({"model_type": "llama", **hf})
    device = jax.devices()[0].device_kind
    progress(f"device {device}; measuring bandwidth and the {args.dtype} matmul rate")
    ceiling = measure_ceiling(
        matmul_dtype=dtype, matmul_side=8192 if jax.default_backend() != "cpu" else 1024
    )
    bandwidth, peak_flop_s = ceiling["bandwidth_gb_s"] * 1e9, ceiling["matmul_gflop_s"] * 1e9
    mesh = make_mesh()
    shardings = param_shardings(cfg, mesh)
    progress(f"random {args.shape} weights in {args.dtype}, on device")
    params = jax.device_put(init_params(cfg, jax.random.key(0), dtype), shardings)
    weights = decode_weight_bytes(params)
    layers, output = matrix_params(params)
    per_position = bytes_per_token(cfg, dtype)  # K and V of one position
    rows, prefill, speculative = [], None, None
    for slots in slot_counts:
        base = EngineConfig(
            max_slots=slots,
            max_seq_len=max(4096, 2 * args.context),
            dtype=args.dtype,
            max_num_batched_tokens=-(-args.prefill_tokens // PROMPT_PIECE) * PROMPT_PIECE,
        )
        variants = {"einsum": dataclasses.replace(base, decode_kernel=False)}
        if layout_of(base, cfg).attention_kernel:  # the paged kernel at each page size asked for
            kernels = {f"kernel, pages of {p}": dataclasses.replace(base, page_size=p) for p in page_sizes}
            variants = {**kernels, **variants}
        for attention, asked in variants.items():
            engine = layout_of(asked, cfg)
            steps = build_steps(cfg, engine, mesh, Weights(shardings), cfg.vocab_size)
            if prefill is None:
                progress(f"prefill: one {args.prefill_tokens}-token prompt, best of {args.calls // 5}")
                prefill = bench_prefill(
                    cfg, steps, params, dtype, args.prefill_tokens, args.calls // 5, peak_flop_s
                )
            progress(f"{slots} slots, {attention} attention: compiling, then {args.calls} calls")
            reach = args.context + args.calls * engine.decode_steps
            bucket = steps.attention_bucket(reach)
            try:
                step_s = time_decode(Program("decode", slots, bucket), steps, params, dtype, args)
            except Exception as error:  # a kernel that does not build here must not cost the rest
                progress(f"  failed: {type(error).__name__}: {str(error)[:2000]}")
                continue
            # What a step must read: the weights and each slot's filled positions (on average
            # halfway through the timed calls); the einsum path reads its whole bucket.
            filled = (args.context + reach) // 2
            read = weights + slots * filled * per_position
            flops = slots * (2 * (layers + output) + attention_flops(cfg, 1, filled))
            rows.append(
                {
                    "slots": slots,
                    "attention": attention,
                    "step_ms": step_s * 1e3,
                    "tokens_per_s": slots / step_s,
                    "mbu": read / step_s / bandwidth,
                    "mfu": flops / step_s / peak_flop_s,
                    "attention_bucket": bucket,
                    "transformers_tokens_per_s": peer.get(slots),
                }
            )
        if slots == 1:
            speculative = bench_speculative(cfg, base, mesh, shardings, params, dtype, args)
    table = markdown_table(
        [
            "slots",
            "attention",
            "step ms",
            "tokens/s",
            "MBU",
            "MFU",
            "attention bucket",
            "transformers tok/s",
            "x transformers",
        ],
        [
            [
                r["slots"],
                r["attention"],
                r["step_ms"],
                r["tokens_per_s"],
                r["mbu"],
                r["mfu"],
                r["attention_bucket"],
                r["transformers_tokens_per_s"] or "-",
                r["tokens_per_s"] / r["transformers_tokens_per_s"] if r["transformers_tokens_per_s"] else "-",
            ]
            for r in rows
        ],
    )
    if speculative:
        costs = ", ".join(f"{k} drafts {c:.2f}x" for k, c in speculative["verify_cost"].items())
        implied = ", ".join(f"a={a}: {r:.2f}x" for a, r in speculative["implied_speedup"].items())
        table += (
            f"\n\nSpeculative decoding at batch 1: a decode step {speculative['decode_step_ms']:.2f} ms; "
            f"a verify step costs {costs} of it; batch-1 speed-up implied at draft acceptance a: {implied}."
        )
    table += (
        f"\n\nPrefill of {prefill['tokens']} tokens: {prefill['ms']:.1f} ms, "
        f"{prefill['tokens_per_s']:.0f} tokens/s, MFU {prefill['mfu']:.2f}.\n\n"
        f"{device}, {args.shape} ({weights / 1e9:.1f} GB of {args.dtype} weights), "
        f"bandwidth {ceiling['bandwidth_gb_s']:.0f} GB/s and {args.dtype} matmul "
        f"{ceiling['matmul_gflop_s'] / 1e3:.0f} TFLOP/s measured in the same run; transformers "
        f"{'not run' if args.no_peer else 'generate() (eager, greedy) on the same device'}."
    )
    result = {
        "device": device,
        "shape": args.shape,
        "ceiling": ceiling,
        "rows": rows,
        "prefill": prefill,
        "speculative": speculative,
    }
    write_results(args.out, "bench_gpu", result, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
