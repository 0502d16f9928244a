"""What serving one model from two processes costs (jinfer.cluster): tokens/s of a two-process
cluster (two CPU devices each) against one process over the same four devices, the size of the
leader's per-dispatch messages and the time it spends sending them; and the two ways a message can
travel, the coordination service's key-value store (what jinfer uses) and a device broadcast
(`multihost_utils.broadcast_one_to_all`), timed with messages of the measured size.

Both servers run the embedded model (mesh model 4, `jinfer serve`'s serving defaults, 8 slots) and
stay up; each round sends the same greedy requests to one, then the other (alternating which goes
first), 1 and 8 at once, each running to --tokens tokens. Tokens/s is all output tokens over the
wall time of the round's requests; ratios are the median of per-round ratios.

    python scripts/bench_cluster.py [--rounds 3] [--tokens 32] [--streams 1,8] [--out results]

Writes results/bench_cluster.{json,md}.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import subprocess
import sys
import time

import httpx
import numpy as np
from benchlib import markdown_table, paired_ratio, progress, write_results
from serve_replicas import free_port, wait_until

PROMPT = "Write a long story about a lighthouse keeper."
SERVE = ["--mesh-model", "4", "--max-slots", "8", "--max-seq-len", "512", "--log-level", "warning"]


def _spawn(args: list[str], devices: int, log) -> subprocess.Popen:
    env = os.environ | {"JAX_NUM_CPU_DEVICES": str(devices)}
    return subprocess.Popen([sys.executable, *args], env=env, stdout=log, stderr=subprocess.STDOUT)


@contextlib.contextmanager
def servers(out_dir: str):
    """{"one process": base URL, "two processes": base URL}, both ready."""
    ports = {"one process": free_port(), "two processes": free_port()}
    coordinator = f"127.0.0.1:{free_port()}"
    serve = ["-m", "jinfer.cli", "serve", *SERVE]
    procs = []
    with open(os.path.join(out_dir, "bench_cluster.log"), "w") as log:
        procs.append(_spawn([*serve, "--port", str(ports["one process"])], 4, log))
        for rank in (0, 1):
            cluster = ["--coordinator", coordinator, "--num-processes", "2", "--process-id", str(rank)]
            procs.append(_spawn([*serve, "--port", str(ports["two processes"]), *cluster], 2, log))
        bases = {name: f"http://127.0.0.1:{port}" for name, port in ports.items()}
        try:
            for base in bases.values():
                wait_until(base + "/ready", procs, timeout=1800)
            yield bases
        finally:
            for p in procs[:2]:
                p.terminate()
            for p in procs:
                p.wait(timeout=120)


def run_round(base: str, streams: int, tokens: int) -> float:
    """Output tokens/s of `streams` requests sent at once."""
    body = {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}

    def one(_):
        r = httpx.post(base + "/v1/completions", json=body, timeout=600)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"]

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        produced = sum(pool.map(one, range(streams)))
    return produced / (time.perf_counter() - start)


def leader(base: str) -> dict:
    return httpx.get(base + "/health").json()["processes"][0]


# ----------------------------------------------------------------------------- transports
def probe(rank: int, coordinator: str, size: int, messages: int) -> None:
    """One of two processes timing `messages` deliveries of `size` bytes by each transport."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator, 2, rank)
    from jax._src import distributed
    from jax.experimental import multihost_utils

    client = distributed.global_state.client
    payload = np.frombuffer(os.urandom(size), np.uint8)
    multihost_utils.broadcast_one_to_all(payload)  # compiled before the clock starts
    results = {}
    for transport in ("key-value store", "device broadcast"):
        client.wait_at_barrier(f"start {transport}", 60_000)
        start = time.perf_counter()
        for n in range(messages):
            if transport == "device broadcast":
                multihost_utils.broadcast_one_to_all(payload)  # returns the host copy: delivered
            elif rank == 0:
                client.key_value_set_bytes(f"probe/{n}", payload.tobytes())
            else:
                client.blocking_key_value_get_bytes(f"probe/{n}", 60_000)
                client.key_value_delete(f"probe/{n}")
        client.wait_at_barrier(f"end {transport}", 60_000)  # every message delivered
        results[transport] = (time.perf_counter() - start) / messages
    if rank == 0:
        print(json.dumps(results), flush=True)
    jax.distributed.shutdown()


def time_transports(size: int, messages: int) -> dict[str, float]:
    coordinator = f"127.0.0.1:{free_port()}"
    command = [__file__, "--probe", coordinator, "--size", str(size), "--messages", str(messages)]
    env = os.environ | {"JAX_NUM_CPU_DEVICES": "2"}
    procs = [
        subprocess.Popen(
            [sys.executable, *command, "--rank", str(rank)], env=env, stdout=subprocess.PIPE, text=True
        )
        for rank in (0, 1)
    ]
    out = procs[0].communicate(timeout=600)[0]
    procs[1].wait(timeout=60)
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--streams", default="1,8")
    parser.add_argument("--messages", type=int, default=300)
    parser.add_argument("--out", default="results")
    parser.add_argument("--probe", help=argparse.SUPPRESS)  # coordinator: run as a transport probe
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--size", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.probe:
        probe(args.rank, args.probe, args.size, args.messages)
        return 0
    os.makedirs(args.out, exist_ok=True)
    counts = [int(s) for s in args.streams.split(",")]
    rows = []
    with servers(args.out) as bases:
        names = list(bases)
        for streams in counts:
            for name in names:  # warm-up: a first request's one-off costs
                run_round(bases[name], streams, 4)
            before = leader(bases["two processes"])
            figures = {name: [] for name in names}
            for round_index in range(args.rounds):
                for name in names[round_index % 2 :] + names[: round_index % 2]:
                    figures[name].append(run_round(bases[name], streams, args.tokens))
                progress(f"{streams} streams, round {round_index + 1}: {figures}")
            after = leader(bases["two processes"])
            calls = after["calls"] - before["calls"]
            one, two = (np.array(figures[n]) for n in names)
            rows.append(
                {
                    "streams": streams,
                    "one_process_tokens_per_s": float(np.median(one)),
                    "two_processes_tokens_per_s": float(np.median(two)),
                    "two_over_one": paired_ratio(two, one),
                    "calls": calls,
                    "message_bytes": (after["published_bytes"] - before["published_bytes"]) / calls,
                    "publish_ms": (after["publish_s"] - before["publish_s"]) / calls * 1e3,
                }
            )
            progress(f"  {rows[-1]}")
    size = int(max(r["message_bytes"] for r in rows))
    transports = time_transports(size, args.messages)
    progress(f"transports, {size}-byte messages: {transports}")
    result = {"rows": rows, "transport_message_bytes": size, "transport_s_per_message": transports}
    columns = [
        "streams",
        "1 process tok/s",
        "2 processes tok/s",
        "2 / 1",
        "bytes/dispatch",
        "publish ms/dispatch",
    ]
    table = [
        [
            r["streams"],
            r["one_process_tokens_per_s"],
            r["two_processes_tokens_per_s"],
            f"{r['two_over_one']['median']:.3f}x",
            r["message_bytes"],
            r["publish_ms"],
        ]
        for r in rows
    ]
    footer = "\n\n" + ", ".join(
        f"{name}: {s * 1e3:.3f} ms per {size}-byte message" for name, s in transports.items()
    )
    header = (
        f"Two processes (2 CPU devices each) against one (4 devices), mesh model 4, {args.rounds} rounds\n\n"
    )
    write_results(args.out, "bench_cluster", result, header + markdown_table(columns, table) + footer)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
