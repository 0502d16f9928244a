"""Accelerator decode benchmark: a random Llama-3-8B-shaped model, bf16, batch 1 and 64, with MBU.

Meant for the rare session with an accelerator (an H200 here); nothing else depends on it. It
builds the model with random weights directly on the device (no files), then times jinfer's own
compiled decode (all slots busy, `decode_steps` steps per call, called back to back) and
reports tokens/s and MBU = (weight bytes + K/V bytes of the attention bucket) / step time /
bandwidth, with the bandwidth measured in the same run (benchlib.measure_ceiling).

    python scripts/bench_gpu.py [--shape llama3-8b] [--slots 1,64] [--out results]

`--shape tiny` runs the same code on a CPU in seconds (to check the script, not the hardware).
Writes results/bench_gpu.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial

import jax
import jax.numpy as jnp
from benchlib import decode_weight_bytes, markdown_table, measure_ceiling, progress, write_results

from jinfer.config import EngineConfig, ModelConfig
from jinfer.models import llama
from jinfer.sharding import make_mesh, param_shardings
from jinfer.steps import build_steps

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


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    parser.add_argument("--slots", default="1,64")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--context", type=int, default=1024, help="positions filled before timing")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    dtype = jnp.dtype(args.dtype)
    hf = {"model_type": "llama", "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, **SHAPES[args.shape]}
    cfg = ModelConfig.from_hf(hf)
    progress(f"device {jax.devices()[0].device_kind}; measuring bandwidth")
    ceiling = measure_ceiling()
    mesh = make_mesh()
    shardings = param_shardings(cfg, mesh)
    progress(f"random {args.shape} weights in {args.dtype}, on device")
    params = jax.jit(partial(llama.init_params, cfg, dtype=dtype), out_shardings=shardings)(jax.random.key(0))
    weights = decode_weight_bytes(params)
    per_position = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
    rows = []
    for slots in (int(s) for s in args.slots.split(",")):
        engine = EngineConfig(max_slots=slots, max_seq_len=2 * args.context, dtype=args.dtype)
        steps = build_steps(cfg, engine, mesh, shardings, cfg.vocab_size)
        bucket = next(
            b for b in engine.attention_buckets if b >= args.context + args.calls * engine.decode_steps
        )
        decode = steps.decode[slots, bucket]
        cache, state = steps.new_cache(dtype), steps.new_state()
        state = state.replace(positions=jnp.full_like(state.positions, args.context))
        active = jnp.ones((slots,), bool)
        progress(f"{slots} slots: compiling, then {args.calls} calls of {engine.decode_steps} steps")
        cache, state, out = decode(params, cache, state, active, False)
        out.tokens.block_until_ready()
        start = time.perf_counter()
        for _ in range(args.calls):
            cache, state, out = decode(params, cache, state, active, False)
        out.tokens.block_until_ready()
        step_s = (time.perf_counter() - start) / (args.calls * engine.decode_steps)
        read = weights + slots * bucket * per_position
        rows.append(
            {
                "slots": slots,
                "step_ms": step_s * 1e3,
                "tokens_per_s": slots / step_s,
                "mbu": read / step_s / (ceiling["bandwidth_gb_s"] * 1e9),
                "attention_bucket": bucket,
            }
        )
        del cache, state
    table = markdown_table(
        ["slots", "step ms", "tokens/s", "MBU", "attention bucket"],
        [[r["slots"], r["step_ms"], r["tokens_per_s"], r["mbu"], r["attention_bucket"]] for r in rows],
    )
    table += (
        f"\n\n{jax.devices()[0].device_kind}, {args.shape} ({weights / 1e9:.1f} GB of {args.dtype} weights), "
        f"bandwidth {ceiling['bandwidth_gb_s']:.0f} GB/s measured in the same run."
    )
    result = {"device": jax.devices()[0].device_kind, "shape": args.shape, "ceiling": ceiling, "rows": rows}
    write_results(args.out, "bench_gpu", result, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
