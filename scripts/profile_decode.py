"""Per-op profile of jinfer's compiled decode step, next to the bare matrix-vector ceiling.

Traces a few calls of the engine's jitted decode (SmolLM2-135M as `make serve` runs it: its
GGUF's quantized blocks and the quantized kernel, float32 activations, all slots busy; with
`--quantization none` its float32 values, packed for the packed kernel unless told otherwise) with
`jax.profiler`, maps every executed XLA op to the model's named scopes (qkv_proj, attention,
kv_write, out_proj, mlp, logits, sampling; the rest is "other": norms, RoPE, residuals, loop
bookkeeping) and reports time per decode step for each, with the top ops. In the same run it
times the weight products alone (the same matrices back to back, computed as the step computes
them) and a 1 GiB reduction: what this CPU can do at best for the bytes a step must read.

    python scripts/profile_decode.py [--slots 1,8] [--quantization auto|none] [--packed-weights true|false]

Writes results/profile_decode.{json,md,png}. Profiling adds per-op overhead, so the shares are what
to read; the unprofiled step time is printed next to them.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import math
import os
import re
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from benchlib import (
    PROMPT,
    decode_weight_bytes,
    markdown_table,
    measure_ceiling,
    progress,
    pyplot,
    write_results,
)

import jinfer
from jinfer.inputs import Program, neutral_inputs
from jinfer.kv_cache import contiguous_tables
from jinfer.models.linear import project
from jinfer.models.params import unpacked

SCOPES = ("qkv_proj", "kv_write", "attention", "out_proj", "mlp", "logits", "sampling")
CALLS = 5


def op_scopes(compiled_text: str) -> dict[str, str]:
    """HLO op name -> the innermost named scope in its metadata, or "other".

    Ops that XLA created without metadata (on CPU, the matrix-vector products of a 1-slot step)
    take the named scope of an op that consumes them, or are counted as "unlabelled products".
    """
    scopes, users = {}, collections.defaultdict(list)
    for match in re.finditer(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*)$", compiled_text, re.MULTILINE):
        name, rest = match.groups()
        op_name = re.search(r'op_name="([^"]*)"', rest)
        parts = op_name.group(1).split("/") if op_name else []
        scopes[name] = next((p for p in reversed(parts) if p in SCOPES), "other" if op_name else None)
        for operand in re.findall(r"%([\w.\-]+)", rest.split("metadata=")[0]):
            users[operand].append(name)
    for name, scope in scopes.items():
        if scope is None:
            named = (scopes[u] for u in users[name] if scopes.get(u) in SCOPES)
            scopes[name] = next(named, "unlabelled products" if name.startswith("dot") else "other")
    return scopes


def weight_products_s(params, slots: int) -> float:
    """The decode step's weight products alone, computed as the step computes them
    (`models.linear.project`: the quantized kernel for quantized weights, the packed-weight kernel where
    the engine packed the weights, XLA's dot otherwise): every layer matrix and the vocabulary
    matrix."""
    weights = [params.embed if params.lm_head is None else params.lm_head]
    input_dims = [1]
    for layer in params.layers:
        weights += [layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down]
        input_dims += [1, 2, 1, 1]  # wo is [D, heads, head_dim]

    @jax.jit
    def products(weights, x):
        total = 0.0
        for w, dims in zip(weights, input_dims, strict=True):
            width = math.prod(unpacked(w).shape[-dims:])
            total += jnp.sum(project(w, jnp.ones((width, slots), jnp.float32) * x, dims))
        return total

    x = jnp.float32(1.0)
    products(weights, x).block_until_ready()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        products(weights, x).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return best


def profile(slots: int, packed_weights: bool, quantization: str) -> dict:
    options = dict(max_slots=slots, max_seq_len=512, max_num_batched_tokens=64, decode_steps=4)
    llm = jinfer.LLM(packed_weights=packed_weights, quantization=quantization, **options)
    llm.engine.warmup()
    sampling = jinfer.SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    llm.generate([PROMPT] * slots, sampling)  # fill the cache and state with real requests
    engine = llm.engine
    # The bucket holding every position the profiled calls reach: the requests' own, then
    # 2 + 2 * CALLS more dispatches of decode_steps positions each.
    reach = len(llm.tokenizer.encode(PROMPT)) + 32 + (2 + 2 * CALLS) * engine.layout.decode_steps
    bucket = engine.steps.attention_bucket(reach)
    decode = engine.steps.programs[Program("decode", slots, bucket)]
    layout = engine.layout
    every_step = np.full(slots, layout.decode_steps, np.int32)  # every slot, every step
    inputs = neutral_inputs(slots).replace(steps=every_step, allowed=engine.steps.unconstrained)
    tables = engine.steps.put_tables(contiguous_tables(slots, layout.max_seq_len, layout.page_size))
    cache, state = engine.device.cache, engine.device.state
    lowered = decode.lower(engine.device.weights, cache, state, tables, inputs, None)
    scopes = op_scopes(lowered.compile().as_text())

    def run(calls):
        nonlocal cache, state
        for _ in range(calls):
            cache, state, out = decode(engine.device.weights, cache, state, tables, inputs, None)
        out.rows.tokens.block_until_ready()

    run(2)
    start = time.perf_counter()
    run(CALLS)
    step_s = (time.perf_counter() - start) / (CALLS * engine.layout.decode_steps)
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            run(CALLS)
        (path,) = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
        with gzip.open(path) as f:
            events = json.load(f)["traceEvents"]
    engine.device.cache, engine.device.state = cache, state
    per_step = CALLS * engine.layout.decode_steps
    by_scope, by_op = collections.Counter(), collections.Counter()
    for event in events:
        if event.get("ph") == "X" and event["name"] in scopes:
            by_scope[scopes[event["name"]]] += event["dur"] / 1e3 / per_step
            by_op[event["name"]] += event["dur"] / 1e3 / per_step
    return {
        "slots": slots,
        "step_ms": step_s * 1e3,
        "profiled_op_ms": sum(by_scope.values()),
        "by_scope_ms": dict(by_scope.most_common()),
        "top_ops": [{"op": op, "scope": scopes[op], "ms": ms} for op, ms in by_op.most_common(12)],
        "weight_products_ms": weight_products_s(engine.params, slots) * 1e3,
        "weight_bytes": decode_weight_bytes(engine.params),
        "attention_bucket": bucket,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--slots", default="1,8")
    parser.add_argument(
        "--packed-weights",
        choices=("true", "false"),
        default="true",
        help="decode products by the packed-weight kernel, as `make serve` runs them (default true)",
    )
    parser.add_argument(
        "--quantization",
        choices=("auto", "none"),
        default="auto",
        help="auto: the GGUF's quantized blocks, as `make serve` holds them; none: float32 values",
    )
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    progress("measuring memory bandwidth")
    ceiling = measure_ceiling()
    runs = []
    for slots in (int(s) for s in args.slots.split(",")):
        progress(f"profiling the decode step with {slots} slots")
        runs.append(profile(slots, args.packed_weights == "true", args.quantization))
    parts = []
    for run in runs:
        total = run["profiled_op_ms"]
        floor_ms = run["weight_bytes"] / (ceiling["bandwidth_gb_s"] * 1e9) * 1e3
        parts.append(
            f"\n### {run['slots']} slots: decode step {run['step_ms']:.1f} ms unprofiled; weight products "
            f"alone {run['weight_products_ms']:.1f} ms; weights / bandwidth {floor_ms:.1f} ms "
            f"({run['weight_bytes'] / 1e6:.0f} MB at {ceiling['bandwidth_gb_s']:.1f} GB/s)\n"
        )
        rows = [[scope, ms, ms / total] for scope, ms in run["by_scope_ms"].items()]
        parts.append(markdown_table(["scope", "ms per step (profiled)", "share"], rows))
        parts.append("")
        parts.append(
            markdown_table(["top op", "scope", "ms per step"], [list(o.values()) for o in run["top_ops"]])
        )
    summary = {"ceiling": ceiling, "packed_weights": args.packed_weights == "true", "runs": runs}
    write_results(args.out, "profile_decode", summary, "\n".join(parts))

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = [f"{r['slots']} slots" for r in runs]
    bottom = [0.0] * len(runs)
    for scope in (*SCOPES, "unlabelled products", "other"):
        shares = [r["by_scope_ms"].get(scope, 0.0) / r["profiled_op_ms"] * r["step_ms"] for r in runs]
        ax.bar(labels, shares, bottom=bottom, label=scope)
        bottom = [b + s for b, s in zip(bottom, shares, strict=True)]
    ax.plot(
        labels, [r["weight_products_ms"] for r in runs], "k_", markersize=40, label="weight products alone"
    )
    ax.set_ylabel("ms per decode step (profile shares of the unprofiled time)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "profile_decode.png"), dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
