"""Serving benchmark: streaming clients against a real `jinfer serve` over loopback.

  * offline reference: `jinfer.LLM.generate` with the same engine settings, 8 prompts at once
    (output tokens / wall time, prefill included);
  * closed loop: N concurrent streaming clients (1..16), each sending requests back to back;
  * open loop: requests arriving as a Poisson process while others stream;
for each: TTFT, inter-token latency (ITL, gaps between streamed tokens) and TPOT (per request,
(last - first token) / (tokens - 1)) at p50/p90/p99, and output tokens/s; served / offline
throughput at concurrency 8. Clients are the official `openai` package with `ignore_eos` fixing the
output length and `stream_options.include_usage` giving the token counts. Clients and server
share this machine's cores, as any loopback benchmark does.

    python scripts/bench_serve.py [--configs 1:256,4:512] [--tokens 64] [--out results]

Each config is decode_steps:max_num_batched_tokens[:packed_weights] (packed weights 1 when left
out). The defaults compare `jinfer serve`'s own settings (one decode step per dispatch, so every
token is sent as it is sampled; 256 tokens an iteration) with the `throughput` preset (4 decode
steps per dispatch, tokens in bursts of 4; 512 tokens an iteration); both with packed weights.

Writes results/bench_serve.{json,md,png}.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import numpy as np
from benchlib import markdown_table, progress, pyplot, write_results

import jinfer

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "List some facts about the planet Mars.",
    "Describe a walk through a forest in autumn.",
]
ENGINE = {"max_slots": 8, "max_seq_len": 512}  # server and offline
SERVER_FLAGS = ["--max-slots", str(ENGINE["max_slots"]), "--max-seq-len", str(ENGINE["max_seq_len"])]
SETTING_NAMES = ("decode_steps", "max_num_batched_tokens", "packed_weights")


def parse_setting(text: str) -> dict:
    """ "decode_steps:max_num_batched_tokens[:packed_weights]" -> engine options."""
    values = [int(v) for v in text.split(":")]
    if not 2 <= len(values) <= 3:
        raise ValueError(f"bad config {text!r}: decode_steps:max_num_batched_tokens[:packed] expected")
    values += [1][len(values) - 2 :]
    return dict(zip(SETTING_NAMES, [*values[:2], bool(values[2])], strict=True))


def describe(setting: dict) -> str:
    return ", ".join(f"{name}={setting[name]}" for name in SETTING_NAMES)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, setting: dict) -> subprocess.Popen:
    command = [sys.executable, "-m", "jinfer.cli", "serve"]
    command += ["--port", str(port), *SERVER_FLAGS]
    for name, value in setting.items():
        command += ["--" + name.replace("_", "-"), str(value).lower()]
    # Its log goes to a file: a pipe nobody reads would block the server once it filled.
    log = tempfile.TemporaryFile("w+")  # noqa: SIM115 - lives as long as the server process
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, text=True)
    deadline = time.time() + 600
    while time.time() < deadline:
        if server.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"server exited: {log.read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(1)
    server.kill()
    raise RuntimeError("server did not come up in 10 minutes")


async def one_request(client, prompt: str, tokens: int) -> dict:
    sent = time.perf_counter()
    arrivals, usage = [], None
    stream = await client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "user", "content": prompt}],
        max_tokens=tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append(time.perf_counter())
        if chunk.usage:
            usage = chunk.usage
    return {"sent": sent, "arrivals": arrivals, "completion_tokens": usage.completion_tokens}


def summarize(results: list[dict], wall: float) -> dict:
    ttft = [r["arrivals"][0] - r["sent"] for r in results]
    itl = np.concatenate([np.diff(r["arrivals"]) for r in results])
    tpot = [(r["arrivals"][-1] - r["arrivals"][0]) / (r["completion_tokens"] - 1) for r in results]
    pct = lambda values: {f"p{q}": float(np.percentile(values, q)) * 1e3 for q in (50, 90, 99)}
    return {
        "requests": len(results),
        "output_tokens_per_s": sum(r["completion_tokens"] for r in results) / wall,
        "ttft_ms": pct(ttft),
        "itl_ms": pct(itl),
        "tpot_ms": pct(tpot),
        "itl_p99_over_p50": float(np.percentile(itl, 99) / np.percentile(itl, 50)),
    }


async def closed_loop(client, concurrency: int, per_client: int, tokens: int) -> dict:
    async def user(index):
        return [
            await one_request(client, PROMPTS[(index + i) % len(PROMPTS)], tokens) for i in range(per_client)
        ]

    start = time.perf_counter()
    done = await asyncio.gather(*(user(i) for i in range(concurrency)))
    return summarize([r for user_results in done for r in user_results], time.perf_counter() - start)


async def poisson(client, rate: float, count: int, tokens: int) -> dict:
    gaps = np.random.default_rng(0).exponential(1 / rate, count)
    start = time.perf_counter()
    tasks = []
    for i, gap in enumerate(gaps):
        await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(one_request(client, PROMPTS[i % len(PROMPTS)], tokens)))
    results = await asyncio.gather(*tasks)
    return summarize(results, time.perf_counter() - start)


def offline_tokens_per_s(setting: dict, tokens: int) -> float:
    llm = jinfer.LLM(**setting, **ENGINE)
    llm.engine.warmup()
    conversations = [[{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}] for i in range(8)]
    sampling = jinfer.SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    best = 0.0
    for _ in range(2):
        start = time.perf_counter()
        results = llm.chat(conversations, sampling)
        best = max(best, sum(len(r.token_ids) for r in results) / (time.perf_counter() - start))
    return best


async def serve_scenarios(port: int, args) -> list[dict]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
    await one_request(client, PROMPTS[0], 4)  # first-request costs (connection, template) off the clock
    rows = []
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        progress(f"  {concurrency} concurrent clients")
        rows.append({"scenario": f"{concurrency} clients", "concurrency": concurrency})
        rows[-1] |= await closed_loop(client, concurrency, args.per_client, args.tokens)
    progress(f"  Poisson arrivals at {args.rate}/s")
    rows.append({"scenario": f"Poisson {args.rate}/s", "concurrency": None})
    rows[-1] |= await poisson(client, args.rate, args.poisson_requests, args.tokens)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--configs",
        default="1:256,4:512",
        help="decode_steps:max_num_batched_tokens[:packed_weights]",
    )
    parser.add_argument("--concurrency", default="1,2,4,8,16")
    parser.add_argument("--per-client", type=int, default=4, help="requests each closed-loop client sends")
    parser.add_argument("--rate", type=float, default=1.5, help="Poisson arrivals per second")
    parser.add_argument("--poisson-requests", type=int, default=40)
    parser.add_argument("--tokens", type=int, default=64, help="output tokens per request (ignore_eos)")
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    runs = []
    for setting in [parse_setting(config) for config in args.configs.split(",")]:
        label = describe(setting)
        progress(f"{label}: offline reference (8 prompts at once)")
        offline = offline_tokens_per_s(setting, args.tokens)
        progress(f"{label}: starting jinfer serve")
        port = free_port()
        server = start_server(port, setting)
        try:
            rows = asyncio.run(serve_scenarios(port, args))
        finally:
            server.terminate()
            server.wait(60)
        at_8 = next((r for r in rows if r["concurrency"] == 8), None)
        runs.append(
            setting
            | {
                "offline_batch8_tokens_per_s": offline,
                "served_over_offline_at_8": at_8["output_tokens_per_s"] / offline if at_8 else None,
                "scenarios": rows,
            }
        )
    parts = []
    for run in runs:
        ratio = run["served_over_offline_at_8"]
        parts.append(
            f"\n### {describe(run)}: offline batch 8 "
            f"{run['offline_batch8_tokens_per_s']:.1f} tok/s; served / offline at 8 clients = "
            + (f"{ratio:.2f}\n" if ratio is not None else "(no 8-client run)\n")
        )
        columns = ["scenario", "tok/s", "TTFT p50/p90/p99 ms", "ITL p50/p90/p99 ms", "TPOT p50/p90/p99 ms"]
        columns.append("ITL p99/p50")
        triple = lambda d: "/".join(f"{d[k]:.0f}" for k in ("p50", "p90", "p99"))
        rows = [
            [
                r["scenario"],
                r["output_tokens_per_s"],
                triple(r["ttft_ms"]),
                triple(r["itl_ms"]),
                triple(r["tpot_ms"]),
                r["itl_p99_over_p50"],
            ]
            for r in run["scenarios"]
        ]
        parts.append(markdown_table(columns, rows))
    write_results(args.out, "bench_serve", {"tokens": args.tokens, "runs": runs}, "\n".join(parts))

    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        closed = [r for r in run["scenarios"] if r["concurrency"]]
        x = [r["concurrency"] for r in closed]
        label = "steps {decode_steps}, budget {max_num_batched_tokens}".format(**run) + (
            ", packed" if run["packed_weights"] else ""
        )
        left.plot(x, [r["output_tokens_per_s"] for r in closed], "o-", label=label)
        left.axhline(run["offline_batch8_tokens_per_s"], ls="--", lw=0.8, color=left.lines[-1].get_color())
        right.plot(x, [r["itl_ms"]["p50"] for r in closed], "o-", label=f"{label} ITL p50")
        right.plot(x, [r["itl_ms"]["p99"] for r in closed], "x--", label=f"{label} ITL p99")
    left.set_xlabel("concurrent streaming clients")
    left.set_ylabel("output tokens/s (dashed: offline batch 8)")
    right.set_xlabel("concurrent streaming clients")
    right.set_ylabel("inter-token latency (ms)")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "bench_serve.png"), dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
