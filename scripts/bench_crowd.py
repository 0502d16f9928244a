"""A crowd at once: N streaming requests sent together to a real `jinfer serve`, as many users
arriving in the same second, against this tree and (`--baseline REV`) a commit before it, in
alternating rounds, each server on its own compile cache warmed before timing.

Each request is a random prompt of `--input-tokens` token ids and `--output-tokens` tokens out
(`ignore_eos`, greedy) through the official `openai` client's streaming `/v1/completions`; per
request: time to first token (the first chunk carrying text) and time per output token after it;
per run: output tokens/s over the whole burst, TTFT p50/p99, TPOT p50, the most requests the
server's `jinfer_requests_running` gauge showed (polled every 0.2 s) and how many requests
completed. Clients and server share the machine's cores.

    python scripts/bench_crowd.py [--users 32] [--input-tokens 256] [--output-tokens 128]
        [--baseline REV] [--rounds 2] [--serve-options "--max-slots 32"] [--out results]

Writes results/bench_crowd.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np
from benchlib import git_worktree, markdown_table, progress, write_results
from serve_replicas import free_port, wait_until

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def server(tree: str, options: list[str], cache: str):
    """`jinfer serve` from `tree` (its code first on the path) until /ready; yields its URL."""
    port = free_port()
    command = [sys.executable, "-m", "jinfer.cli", "serve", "--port", str(port), "--compile-cache", cache]
    env = {**os.environ, "PYTHONPATH": tree + os.pathsep + os.environ.get("PYTHONPATH", "")}
    log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([*command, *options], cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_until(base + "/ready", [proc], timeout=900)
        except RuntimeError:
            log.seek(0)
            raise RuntimeError("server exited:\n" + log.read()[-3000:]) from None
        yield base
    finally:
        proc.terminate()
        proc.wait(60)
        log.close()


async def one_request(client, model: str, prompt: list[int], tokens: int, sent: float) -> dict:
    first, count = None, 0
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            first = first or time.perf_counter()
            count += 1
    end = time.perf_counter()
    return {"ttft": first - sent, "tpot": (end - first) / max(tokens - 1, 1), "end": end, "chunks": count}


async def watch_running(base: str, stop: asyncio.Event) -> int:
    """The most requests the server's running gauge showed until `stop`."""
    most = 0
    async with httpx.AsyncClient() as http:
        while not stop.is_set():
            text = (await http.get(base + "/metrics")).text
            for line in text.splitlines():
                if line.startswith("jinfer_requests_running "):
                    most = max(most, int(float(line.split()[1])))
            await asyncio.sleep(0.2)
    return most


async def burst(base: str, prompts: list[list[int]], tokens: int) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=3600)
    model = (await client.models.list()).data[0].id
    stop = asyncio.Event()
    watcher = asyncio.create_task(watch_running(base, stop))
    sent = time.perf_counter()
    results = await asyncio.gather(
        *(one_request(client, model, p, tokens, sent) for p in prompts), return_exceptions=True
    )
    stop.set()
    most = await watcher
    await client.close()
    done = [r for r in results if isinstance(r, dict)]
    ttft = np.array([r["ttft"] for r in done])
    wall = max(r["end"] for r in done) - sent
    return {
        "completed": len(done),
        "output_tokens_per_s": len(done) * tokens / wall,
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p99_s": float(np.percentile(ttft, 99)),
        "tpot_p50_ms": float(np.percentile([r["tpot"] for r in done], 50)) * 1e3,
        "most_running": most,
        "errors": [repr(r) for r in results if not isinstance(r, dict)][:3],
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--users", type=int, default=32)
    parser.add_argument("--input-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--baseline", help="a commit to run beside this tree, alternating")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--serve-options", default="--max-slots 32", help="flags for both servers")
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    rng = np.random.RandomState(0)
    prompts = [rng.randint(1000, 40000, args.input_tokens).tolist() for _ in range(args.users)]
    options = shlex.split(args.serve_options)
    with contextlib.ExitStack() as stack:
        trees = {"this tree": HERE}
        if args.baseline:
            trees[args.baseline] = stack.enter_context(git_worktree(args.baseline))
        caches = {name: stack.enter_context(tempfile.TemporaryDirectory()) for name in trees}
        runs = {name: [] for name in trees}
        for round_ in range(args.rounds):
            for name, tree in trees.items():
                progress(f"round {round_ + 1}: {name}: {args.users} users at once")
                with server(tree, options, caches[name]) as base:
                    asyncio.run(burst(base, prompts[:2], 4))  # first calls' host-side costs, untimed
                    runs[name].append(asyncio.run(burst(base, prompts, args.output_tokens)))
                progress(f"  {runs[name][-1]}")
    keys = ("output_tokens_per_s", "ttft_p50_s", "ttft_p99_s", "tpot_p50_ms", "most_running", "completed")
    rows = [[name, i + 1, *(run[k] for k in keys)] for name, rs in runs.items() for i, run in enumerate(rs)]
    table = markdown_table(["tree", "round", *keys], rows)
    table += (
        f"\n\n{args.users} users at once, {args.input_tokens} tokens in / {args.output_tokens} out, "
        f"`jinfer serve {args.serve_options}`."
    )
    write_results(args.out, "bench_crowd", {"args": vars(args), "runs": runs}, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
