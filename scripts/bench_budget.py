"""The token budget's curve: what one engine iteration costs as its prompt pieces grow, and what a
running stream waits for it.

For each piece bucket (1, 2, 4, ... pieces of 64 tokens, one request's whole prompt each, every
prompt in a slot of its own), the engine's compiled prefill program is timed on its own (best of
`--calls` calls), beside a one-step decode of `--decoding` busy slots. With `--position P` each
piece continues a prompt whose first P positions are cached (a shared prefix's hit): its queries
attend over them too. A stream running while
prompts wait gets its next token after one iteration: the prefill plus its decode step, or, where
the layout has it (`Layout.mixed_rows`: jinfer's CPU kernels), the one mixed program that
carries the pieces and the decode rows together, timed the same way (its pieces in the slots after
the decode rows, wrapping round when the rows take them all: the work is the same). Prints
prompt tokens/s and the prefill's MFU (useful FLOPs over the float32 matmul rate measured in the
same run) for each, which is what `max_num_batched_tokens` trades: more tokens an iteration run
closer to the FLOP ceiling and admit a burst sooner, and stretch every running stream's step.

    python scripts/bench_budget.py [--quantization none] [--decoding 8] [--position 0] [--calls 5]
        [--out results]

Writes results/bench_budget.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import numpy as np
from benchlib import markdown_table, measure_ceiling, prefill_flops, progress, write_results

import jinfer
from jinfer.config import PROMPT_PIECE
from jinfer.inputs import Program, neutral_inputs
from jinfer.kv_cache import contiguous_tables
from jinfer.sampling import SamplingArrays, SamplingParams
from jinfer.state import pack_piece, pack_pieces
from jinfer.steps import mixed_program, prefill_program

SLOTS = 32


def pieces_chunk(pieces: int, vocab: int, position: int, first_slot: int = 0):
    """`pieces` prompt pieces, piece i in slot first_slot + i (modulo the slots) from `position`
    (the last of its prompt), greedy."""
    greedy = SamplingArrays.from_params([SamplingParams(temperature=0.0).resolve()], [0])
    rng, rows = np.random.RandomState(0), []
    for piece in range(pieces):
        tokens = rng.randint(1000, vocab - 1, PROMPT_PIECE).astype(np.int32)
        slot = (first_slot + piece) % SLOTS
        flags = {"slot": slot, "start": position, "length": PROMPT_PIECE, "last": True, "generated": 0}
        rows.append(
            pack_piece(tokens, **flags, min_tokens=0, bias={}, stop_ids=(), sampling=greedy, vocab=vocab)
        )
    return pack_pieces(rows, pieces, PROMPT_PIECE, vocab)


def best_seconds(call, calls: int) -> float:
    jax.block_until_ready(call())  # compiled and warm
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(call())
        best = min(best, time.perf_counter() - start)
    return best


def time_prefill(device, pieces: int, vocab: int, position: int, calls: int) -> float:
    """Best seconds of the prefill program over `pieces` one-piece prompt ends at `position`."""
    program, chunk = prefill_program(pieces), pieces_chunk(pieces, vocab, position)
    inputs = neutral_inputs(pieces).replace(steps=np.ones(pieces, np.int32))
    return best_seconds(lambda: device.dispatch(program, inputs, chunk).chunk.tokens, calls)


def time_mixed(device, pieces: int, decoding: int, vocab: int, position: int, calls: int) -> float:
    """Best seconds of the mixed program over `pieces` pieces and `decoding` busy decode rows."""
    layout = device.steps.layout
    program = mixed_program(layout.mixed_bucket(decoding), pieces)
    chunk = pieces_chunk(pieces, vocab, position, first_slot=decoding)
    steps = np.concatenate([np.arange(program.rows) < decoding, np.ones(pieces, bool)]).astype(np.int32)
    inputs = neutral_inputs(program.input_rows).replace(steps=steps)
    return best_seconds(lambda: device.dispatch(program, inputs, chunk).chunk.tokens, calls)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quantization", default="none", help="the embedded model's weights: none or auto")
    parser.add_argument("--decoding", type=int, default=8, help="busy slots of the decode step beside")
    parser.add_argument("--position", type=int, default=0, help="cached positions before each piece")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    progress("measuring the float32 matmul rate")
    peak = measure_ceiling()["matmul_gflop_s"] * 1e9
    progress(f"the embedded model, quantization={args.quantization}: load and warm up")
    seq = max(1024, args.position + 2 * PROMPT_PIECE)  # the piece, and the decode step beside
    llm = jinfer.LLM(
        max_slots=SLOTS,
        max_seq_len=seq,
        kv_cache_tokens=SLOTS * seq,  # contiguous tables: every slot a whole sequence
        max_num_batched_tokens=SLOTS * PROMPT_PIECE,
        decode_steps=1,
        quantization=args.quantization,
    )
    engine, device = llm.engine, llm.engine.device
    layout, vocab = engine.layout, engine.steps.vocab_size
    device.set_tables(contiguous_tables(SLOTS, seq, layout.page_size))
    decode = Program("decode", layout.slot_bucket(args.decoding), layout.attention_buckets[-1])
    decoding = neutral_inputs(decode.rows).replace(
        steps=(np.arange(decode.rows) < args.decoding).astype(np.int32)
    )
    step_s = best_seconds(lambda: device.dispatch(decode, decoding).rows.tokens, args.calls)
    rows, result = [], {"decode_step_ms": step_s * 1e3, "decoding": args.decoding, "pieces": []}
    result["position"] = args.position
    for pieces in layout.piece_buckets:
        seconds = time_prefill(device, pieces, vocab, args.position, args.calls)
        tokens = pieces * PROMPT_PIECE
        flops = prefill_flops(engine.steps.model, engine.params, PROMPT_PIECE, args.position)
        mfu = pieces * flops / seconds / peak
        entry = {"pieces": pieces, "tokens": tokens, "prefill_ms": seconds * 1e3, "mfu": mfu}
        entry |= {"tokens_per_s": tokens / seconds, "stream_wait_ms": (seconds + step_s) * 1e3}
        mixed = "-"
        if layout.mixed_rows:
            mixed_s = time_mixed(device, pieces, args.decoding, vocab, args.position, args.calls)
            entry["mixed_ms"] = mixed = mixed_s * 1e3
        result["pieces"].append(entry)
        rows.append(
            [pieces, tokens, entry["prefill_ms"], entry["tokens_per_s"], mfu, entry["stream_wait_ms"], mixed]
        )
        progress(f"  {pieces} pieces: {entry['prefill_ms']:.0f} ms, MFU {mfu:.2f}, mixed {mixed} ms")
    columns = ["pieces", "prompt tokens", "prefill ms", "prompt tokens/s", "MFU", "a stream's step, ms"]
    columns.append("mixed (pieces + decode rows in one), ms")
    table = markdown_table(columns, rows) + (
        f"\n\nPieces from position {args.position}. "
        f"A decode step of {args.decoding} busy slots alone: {step_s * 1e3:.1f} ms. "
        f"float32 matmul {peak / 1e9:.0f} GFLOP/s measured in the same run; {layout.describe()}."
    )
    write_results(args.out, "bench_budget", result, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
