"""What the paged KV pool buys on the embedded SmolLM2-135M-Instruct, measured side by side in one run.

  python scripts/bench_kv_pool.py [--rounds 3] [--out results]

chat       a second chat turn after a ~1,500-token system prompt: time to first token with the
           first turn in the prefix cache against prefix caching off (alternating engines, a
           new system prompt each round so nothing carries over between rounds)
shared     8 users with one system prompt arriving together: prompt tokens the engine computed
           (its dispatch counters), caching on against off
no-hit     16 distinct prompts: wall time with prefix caching on against off (what the
           bookkeeping costs when nothing is ever found), alternating rounds
capacity   a pool of 4 x 2,048 positions, 32 requests of 100-300 tokens at once: the most
           requests running at one time, and every output against the request alone
preempt    a pool of 2 x 512 positions, 8 generations of 450 tokens: preemptions, and every output
           against the request alone; slots and pages afterwards
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

import numpy as np
from benchlib import markdown_table, progress, write_results

import jinfer

GREEDY = jinfer.SamplingParams(temperature=0, max_tokens=32)
TOPICS = ("billing", "shipping", "returns", "warranty", "privacy", "accounts", "gift cards", "repairs")


def system_prompt(seed: int, sentences: int = 80) -> str:
    """A long, varied support-desk policy (~1,500 tokens at 80 sentences); `seed` makes it unique."""
    rng = np.random.RandomState(seed)
    lines = [f"You are the support assistant of store number {seed}. Follow these rules."]
    for i in range(sentences):
        topic = TOPICS[rng.randint(len(TOPICS))]
        days = rng.randint(2, 90)
        lines.append(f"Rule {i + 1}: questions about {topic} are answered within {days} days, politely.")
    return " ".join(lines)


def chat(system: str, *turns: str) -> list[dict]:
    messages = [{"role": "system", "content": system}]
    for i, text in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return messages


def computed_prompt_tokens(llm: jinfer.LLM) -> int:
    counts = llm.engine.dispatch_counts
    return counts.prefill_tokens


def _turns(engines: dict, round_: int) -> list:
    """The engines in the order they run in this round (alternating: neither always goes first)."""
    order = list(engines.items())
    return order if round_ % 2 == 0 else order[::-1]


def bench_chat(engines: dict, rounds: int) -> dict:
    ttft = {name: [] for name in engines}
    for r in range(rounds):
        system = system_prompt(1000 + r)
        for name, llm in _turns(engines, r):
            first = llm.chat([chat(system, "How long do returns take?")], GREEDY)[0]
            turn2 = chat(system, "How long do returns take?", first.text, "And for repairs?")
            second = llm.chat([turn2], dataclasses.replace(GREEDY, max_tokens=1))[0]
            ttft[name].append(second.metrics["ttft_s"])
            cached, sent = second.metrics["cached_prompt_tokens"], second.metrics["prompt_tokens"]
            ms = ttft[name][-1] * 1e3
            progress(f"chat round {r + 1}, caching {name}: turn 2 TTFT {ms:.0f} ms, {cached}/{sent} cached")
    ratios = np.array(ttft["off"]) / np.array(ttft["on"])
    return {
        "prompt_tokens": second.metrics["prompt_tokens"],
        "ttft_on_ms": float(np.median(ttft["on"])) * 1e3,
        "ttft_off_ms": float(np.median(ttft["off"])) * 1e3,
        "off_over_on": float(np.median(ratios)),
        "lowest": float(ratios.min()),
    }


def bench_shared(engines: dict) -> dict:
    system = system_prompt(2000)
    conversations = [chat(system, f"I have a question about {topic}.") for topic in TOPICS]
    computed = {}
    for name, llm in engines.items():
        before = computed_prompt_tokens(llm)
        results = llm.chat(conversations, GREEDY)
        computed[name] = computed_prompt_tokens(llm) - before
        sent = sum(r.metrics["prompt_tokens"] for r in results)
    return {
        "prompt_tokens_sent": sent,
        "computed_on": computed["on"],
        "computed_off": computed["off"],
        "drop": 1 - computed["on"] / computed["off"],
    }


def bench_no_hit(engines: dict, rounds: int) -> dict:
    wall = {name: [] for name in engines}
    for r in range(rounds):
        rng = np.random.RandomState(3000 + r)
        prompts = [rng.randint(100, 40000, int(rng.randint(100, 300))).tolist() for _ in range(16)]
        sampling = jinfer.SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
        for name, llm in _turns(engines, r):
            start = time.perf_counter()
            llm.generate(prompts, sampling)
            wall[name].append(time.perf_counter() - start)
    ratios = np.array(wall["off"]) / np.array(wall["on"])  # throughput on / off
    return {
        "wall_on_s": float(np.median(wall["on"])),
        "wall_off_s": float(np.median(wall["off"])),
        "on_over_off_throughput": float(np.median(ratios)),
        "lowest": float(ratios.min()),
        "highest": float(ratios.max()),
    }


def _alone(llm: jinfer.LLM, prompts, samplings) -> list[list[int]]:
    return [llm.generate([p], s)[0].token_ids for p, s in zip(prompts, samplings, strict=True)]


def bench_capacity(reference: jinfer.LLM) -> dict:
    llm = jinfer.LLM(max_slots=32, max_seq_len=2048, kv_cache_tokens=4 * 2048, decode_steps=1)
    rng = np.random.RandomState(4000)
    prompts, samplings = [], []
    for _ in range(32):
        prompt_len = int(rng.randint(50, 150))
        prompts.append(rng.randint(100, 40000, prompt_len).tolist())
        samplings.append(jinfer.SamplingParams(temperature=0, max_tokens=int(rng.randint(50, 150))))
    engine, outputs = llm.engine, [[] for _ in prompts]
    for i, (p, s) in enumerate(zip(prompts, samplings, strict=True)):
        engine.submit(engine.preparer.prepare(p, sampling=s), lambda e, i=i: outputs[i].extend(e.token_ids))
    most, start = 0, time.perf_counter()
    while engine.scheduler.has_work or engine._pending:
        engine.step()
        most = max(most, engine.stats()["running"])
    wall = time.perf_counter() - start
    progress(f"capacity: at most {most} running; checking every output against the request alone")
    alone = _alone(reference, prompts, samplings)
    return {
        "pool_tokens": llm.engine.layout.kv_cache_tokens,
        "requests": 32,
        "tokens_per_request": [len(p) + s.max_tokens for p, s in zip(prompts, samplings, strict=True)],
        "most_running": most,
        "identical_to_alone": sum(o == a for o, a in zip(outputs, alone, strict=True)),
        "wall_s": wall,
        "preemptions": engine.stats()["preemptions"],
    }


def bench_preempt(reference: jinfer.LLM) -> dict:
    llm = jinfer.LLM(max_slots=8, max_seq_len=512, kv_cache_tokens=2 * 512)
    rng = np.random.RandomState(5000)
    prompts = [rng.randint(100, 40000, 50).tolist() for _ in range(8)]
    samplings = [
        jinfer.SamplingParams(temperature=0.7, seed=i, max_tokens=400, ignore_eos=True) for i in range(8)
    ]
    start = time.perf_counter()
    results = llm.generate(prompts, samplings)
    wall = time.perf_counter() - start
    progress("preemption: checking every output against the request alone")
    alone = _alone(reference, prompts, samplings)
    stats = llm.engine.stats()
    return {
        "pool_tokens": llm.engine.layout.kv_cache_tokens,
        "completed": sum(r.finish_reason == "length" for r in results),
        "identical_to_alone": sum(r.token_ids == a for r, a in zip(results, alone, strict=True)),
        "preemptions": stats["preemptions"],
        "slots_in_use_after": stats["slots_in_use"],
        "pages_used_after": stats["kv_pages_used"],
        "wall_s": wall,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", default="chat,shared,no-hit,capacity,preempt")
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    only = set(args.only.split(","))
    progress("loading two engines: prefix caching on and off")
    engines = {name: jinfer.LLM(prefix_caching=name == "on") for name in ("on", "off")}
    for llm in engines.values():
        llm.engine.warmup()
    result = {}
    if "chat" in only:
        result["chat"] = bench_chat(engines, args.rounds)
    if "shared" in only:
        result["shared"] = bench_shared(engines)
    if "no-hit" in only:
        result["no_hit"] = bench_no_hit(engines, args.rounds)
    reference = engines["off"]
    if "capacity" in only:
        result["capacity"] = bench_capacity(reference)
    if "preempt" in only:
        result["preempt"] = bench_preempt(reference)
    rows = []
    if "chat" in result:
        c = result["chat"]
        figure = f"{c['ttft_on_ms']:.0f} ms cached, {c['ttft_off_ms']:.0f} ms off"
        rows.append(["turn 2 TTFT, ~1,500-token system prompt", f"{figure}: {c['off_over_on']:.1f}x"])
    if "shared" in result:
        s = result["shared"]
        figure = f"{s['computed_on']} against {s['computed_off']}: {s['drop']:.0%} fewer"
        rows.append(["8 users, one system prompt: prompt tokens computed", figure])
    if "no_hit" in result:
        n = result["no_hit"]
        figure = f"{n['on_over_off_throughput']:.3f} ({n['lowest']:.3f}-{n['highest']:.3f})"
        rows.append(["no-hit workload throughput, on / off", figure])
    if "capacity" in result:
        c = result["capacity"]
        figure = f"{c['most_running']} running at once; {c['identical_to_alone']}/32 identical to alone"
        rows.append([f"pool of {c['pool_tokens']} positions, 32 requests of 100-300 tokens", figure])
    if "preempt" in result:
        p = result["preempt"]
        figure = (
            f"{p['completed']}/8 complete, {p['identical_to_alone']}/8 identical to alone, "
            f"{p['preemptions']} preemptions; after: {p['slots_in_use_after']} slots, "
            f"{p['pages_used_after']} pages in use"
        )
        rows.append([f"pool of {p['pool_tokens']} positions, 8 generations of 450 tokens", figure])
    table = markdown_table(["measure", "figure"], rows)
    print(table)
    write_results(args.out, "bench_kv_pool", result, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
