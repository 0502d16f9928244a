"""The CPU attention kernel alone, on SmolLM2-135M's shapes (3 kv heads of 3 query heads, 64 wide,
pages of 64): what one layer's attention costs in the cases a serving step meets.

    prompt pieces   4 pieces of 64 tokens continuing a cached 1,024-token prefix (shared pages)
    decode rows     32 rows, one token each at position 1,100, over the same shared prefix
    verify rows     8 rows of 4 tokens at position 1,100
    a first piece   1 piece of 64 tokens at position 0 (causal within itself)

Each case is timed as a step meets it: one call per layer, each layer's pages its own (30 layers,
as SmolLM2-135M has), so a layer's keys come from memory rather than a cache the previous call
warmed; the figure is the best of `--calls` passes over the layers, per layer. GFLOP/s counts q.k
and p.v for every (query, key) pair a query sees. Pass `--save FILE.npz` to keep the outputs: two
builds of the kernel that must agree bit for bit can be compared with them.

    python scripts/bench_attention.py [--calls 15] [--layers 30] [--save FILE.npz]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jinfer.kernels import cpu_attention

KV_HEADS, GROUPS, HEAD_DIM, PAGE = 3, 3, 64, 64
PREFIX_PAGES, TABLE_PAGES, POOL_PAGES = 17, 24, 300
CASES = {  # name: (rows, tokens per row, first position)
    "prompt pieces": (4, 64, 1024),
    "decode rows": (32, 1, 1100),
    "verify rows": (8, 4, 1100),
    "a first piece": (1, 64, 0),
}


def shared_tables(rows: int) -> np.ndarray:
    """Every row's first PREFIX_PAGES pages the same (a cached prefix), its later pages its own."""
    tables = np.tile(np.arange(TABLE_PAGES, dtype=np.int32), (rows, 1))
    own = TABLE_PAGES - PREFIX_PAGES
    tables[:, PREFIX_PAGES:] = PREFIX_PAGES + np.arange(rows)[:, None] * own + np.arange(own)
    return tables


def main() -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--calls", type=int, default=15)
    parser.add_argument("--layers", type=int, default=30, help="calls per pass, each its own pages")
    parser.add_argument("--save", help="an .npz file for the outputs")
    args = parser.parse_args()
    if not cpu_attention.available():
        raise SystemExit("the CPU attention kernel could not be built")
    rng = np.random.RandomState(0)
    shape = (KV_HEADS, POOL_PAGES, PAGE, HEAD_DIM)
    layers = [[jnp.asarray(rng.randn(*shape), jnp.float32) for _ in "kv"] for _ in range(args.layers)]
    call = jax.jit(lambda q, k, v, tables, positions: cpu_attention.attention(q, k, v, tables, positions, 0))
    outputs = {}
    for name, (rows, tokens, first) in CASES.items():
        q = jnp.asarray(rng.randn(rows, KV_HEADS, GROUPS, tokens, HEAD_DIM), jnp.float32)
        positions = jnp.asarray(np.tile(first + np.arange(tokens, dtype=np.int32), (rows, 1)))
        tables = jnp.asarray(shared_tables(rows))
        outputs[name] = np.asarray(call(q, *layers[0], tables, positions))
        best = float("inf")
        for _ in range(args.calls):
            start = time.perf_counter()
            for pools in layers:
                out = call(q, *pools, tables, positions)
            out.block_until_ready()
            best = min(best, (time.perf_counter() - start) / len(layers))
        pairs = rows * KV_HEADS * GROUPS * tokens * (first + (tokens + 1) / 2)
        rate = 4 * HEAD_DIM * pairs / best / 1e9
        print(f"{name:14s} {rows} x {tokens} from {first}: {best * 1e3:.2f} ms, {rate:.0f} GFLOP/s")
    if args.save:
        np.savez(args.save, **{name.replace(" ", "_"): out for name, out in outputs.items()})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
