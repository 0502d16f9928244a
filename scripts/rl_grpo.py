"""A GRPO-style RL loop in one process: the engine samples a group of answers per prompt through a
LoRA adapter, a reward scores them, one optax update of the adapter follows (the policy-gradient
loss on the group-normalized rewards, through `jinfer.policy.PolicyLogprobs`), and the engine
serves the new adapter from memory, nothing written, nothing compiled after the first round.

Each round reports the mean reward and the largest difference, over every sampled token, between
the log-prob the sampler reported and the trainer's recomputation in the update's forward: 0,
since both are the engine's arithmetic (the update's importance weights are then exactly 1).

Rewards: `brevity` (the embedded model's default): 1 - tokens / max_tokens for an answer that
ends before max_tokens and has a word in it, 0 for one cut off or empty; `even` (for random test
models): the share of an answer's tokens with an even id.

    python scripts/rl_grpo.py [--rounds 12] [--group 4] [--out results]

Writes results/rl_grpo.{json,md} (and .png with matplotlib: `pip install -e .[bench]`).
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from benchlib import markdown_table, progress, pyplot, write_results

import jinfer
from jinfer import lora
from jinfer.finetune import LENGTH_MULTIPLE
from jinfer.policy import PolicyLogprobs

QUESTIONS = [
    "What is the capital of France?",
    "Name a fruit.",
    "What color is the sky?",
    "What is two plus two?",
]
ADAPTER = "policy"


def brevity(completion, max_tokens: int) -> float:
    if completion.finish_reason == "length" or not any(c.isalpha() for c in completion.text):
        return 0.0
    return 1.0 - len(completion.token_ids) / max_tokens


def even(completion, max_tokens: int) -> float:
    return float(np.mean([token % 2 == 0 for token in completion.token_ids])) if completion.token_ids else 0.0


REWARDS = {"brevity": brevity, "even": even}


def prompts_of(llm, args) -> list[list[int]]:
    """Token ids of each prompt: a chat turn for a model with a template, else its plain text."""
    if llm.preparer.tokenizer.chat_template and not args.plain:
        template = llm.preparer.tokenizer.apply_chat_template
        return [template([{"role": "user", "content": q}], tokenize=True) for q in QUESTIONS[: args.prompts]]
    return [llm.preparer.prompt_ids(q) for q in QUESTIONS[: args.prompts]]


def sample(llm, prompts: list[list[int]], args, round_: int):
    """`group` answers per prompt (seeded, temperature 1: the raw log-probs are of the distribution
    sampled from), with the adapter's raw log-probs."""
    params = [
        jinfer.SamplingParams(temperature=1.0, max_tokens=args.max_tokens, seed=round_ * 1000 + i, logprobs=0)
        for i in range(len(prompts) * args.group)
    ]
    repeated = [p for p in prompts for _ in range(args.group)]
    return repeated, llm.generate(repeated, params, adapter=ADAPTER)


def batch(prompts: list[list[int]], completions):
    """tokens [B, T] (T a multiple of LENGTH_MULTIPLE), and over next-token positions [B, T-1]:
    the answer mask and the sampler's log-probs."""
    lengths = [len(p) + len(c.token_ids) for p, c in zip(prompts, completions, strict=True)]
    length = -(-max(lengths) // LENGTH_MULTIPLE) * LENGTH_MULTIPLE
    tokens = np.zeros((len(prompts), length), np.int32)
    mask = np.zeros((len(prompts), length - 1), np.float32)
    sampled = np.zeros((len(prompts), length - 1), np.float32)
    for row, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        answer = slice(len(prompt) - 1, len(prompt) - 1 + len(completion.token_ids))
        tokens[row, : lengths[row]] = prompt + completion.token_ids
        mask[row, answer] = 1.0
        sampled[row, answer] = [entry["logprob"] for entry in completion.logprobs]
    return tokens, mask, sampled


def advantages(rewards: np.ndarray, group: int) -> np.ndarray:
    """Each reward less its group's mean, over the group's standard deviation (0 for a group whose
    answers all scored the same)."""
    grouped = rewards.reshape(-1, group)
    centered = grouped - grouped.mean(axis=1, keepdims=True)
    return (centered / (grouped.std(axis=1, keepdims=True) + 1e-6)).reshape(-1).astype(np.float32)


def grpo_loss(adapter, weights, tokens, mask, sampled, advantage, *, policy, clip: float):
    """The clipped policy-gradient loss per answer token; and the largest |trainer - sampler|
    log-prob difference over the answer tokens."""
    new = policy(adapter, weights, tokens)
    ratio = jnp.exp(new - sampled)
    gain = jnp.minimum(ratio * advantage[:, None], jnp.clip(ratio, 1 - clip, 1 + clip) * advantage[:, None])
    drift = jnp.max(jnp.where(mask > 0, jnp.abs(new - sampled), 0.0))
    return -(gain * mask).sum() / mask.sum(), drift


def make_update(policy: PolicyLogprobs, optimizer, clip: float):
    loss = functools.partial(grpo_loss, policy=policy, clip=clip)

    @jax.jit
    def update(adapter, opt_state, weights, tokens, mask, sampled, advantage):
        (value, drift), grads = jax.value_and_grad(loss, has_aux=True)(
            adapter, weights, tokens, mask, sampled, advantage
        )
        updates, opt_state = optimizer.update(grads, opt_state, adapter)
        return optax.apply_updates(adapter, updates), opt_state, value, drift

    return update


def run(args) -> list[dict]:
    options = {"max_slots": args.prompts * args.group, "max_seq_len": 256}
    options |= {"max_loras": 1, "max_lora_rank": args.rank, "quantization": "none"}
    llm = jinfer.LLM(args.model, **options)
    llm.engine.warmup()  # every program a round may take (answers ending early take smaller ones)
    cfg = llm.engine.model_config
    policy = PolicyLogprobs(llm.engine, llm.params)
    adapter = lora.init_adapter(cfg, lora.LoraConfig(rank=args.rank), jax.random.key(args.seed))
    optimizer = optax.adamw(args.learning_rate)
    opt_state = optimizer.init(adapter)
    update = make_update(policy, optimizer, args.clip)
    prompts, reward, history = prompts_of(llm, args), REWARDS[args.reward], []
    for round_ in range(args.rounds):
        start = time.perf_counter()
        llm.load_adapter(ADAPTER, adapter)
        repeated, completions = sample(llm, prompts, args, round_)
        rewards = np.array([reward(c, args.max_tokens) for c in completions], np.float32)
        tokens, mask, sampled = batch(repeated, completions)
        adapter, opt_state, loss, drift = update(
            adapter, opt_state, policy.weights, tokens, mask, sampled, advantages(rewards, args.group)
        )
        record = {"round": round_ + 1, "reward": float(rewards.mean()), "loss": float(loss)}
        record |= {"max_logprob_difference": float(drift), "seconds": time.perf_counter() - start}
        record["compiles"] = llm.engine.compile_count()
        record["answer"] = completions[0].text  # the first question's first answer
        history.append(record)
        progress(", ".join(f"{k} {_shown(v)}" for k, v in record.items()))
    return history


def _shown(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else repr(value)


def plot(history: list[dict], path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["round"] for r in history], [r["reward"] for r in history], "o-")
    ax.set_xlabel("round")
    ax.set_ylabel("mean reward")
    ax.set_title("GRPO on the embedded SmolLM2 (LoRA, one process)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--model", default=None, help="a model directory or file (default: the embedded one)")
    parser.add_argument("--reward", choices=sorted(REWARDS), default="brevity")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=4, help="answers sampled per prompt")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--clip", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plain", action="store_true", help="prompts as plain text, not chat turns")
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    history = run(args)
    columns = ["round", "mean reward", "loss", "max sampler-trainer log-prob difference", "s", "compiles"]
    columns.append("an answer to the first question")
    keys = ["round", "reward", "loss", "max_logprob_difference", "seconds", "compiles", "answer"]
    cell = lambda v: v.replace("\n", " ").replace("|", "/") if isinstance(v, str) else v
    table = markdown_table(columns, [[cell(r[k]) for k in keys] for r in history])
    write_results(args.out, "rl_grpo", {"args": vars(args), "history": history}, table)
    try:
        plot(history, os.path.join(args.out, "rl_grpo.png"))
    except ImportError:
        progress("no matplotlib: no plot (pip install -e .[bench])")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
