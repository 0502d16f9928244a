"""Fine-tuning through the engine's forward (`jinfer.finetune`): only answer tokens are trained,
the loss falls, the trained adapter is served at once, and a killed run resumes to the same bits."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import jinfer
from jinfer import SamplingParams, lora
from jinfer.finetune import TrainConfig, Trainer, chat_example, every_weight, micro_batch, read_examples
from jinfer.formats.adapters import read_adapter
from jinfer.formats.hf import load_hf

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)


def _write_jsonl(path, records) -> str:
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record) + "\n")
    return str(path)


def _chats(pairs):
    return [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in pairs
    ]


def test_only_the_answers_are_trained(tiny_model, tmp_path):
    directory, _ = tiny_model("smollm2_like")
    tokenizer = load_hf(directory).tokenizer
    messages = [
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "The quick brown fox"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "jumps over"},
    ]
    example = chat_example(messages, tokenizer)
    assert example.ids == tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True)
    trained = [t for t, keep in zip(example.ids, example.trained, strict=True) if keep]
    text = tokenizer.decode(trained, skip_special_tokens=False)
    assert text.startswith("The quick brown fox<|im_end|>") and "jumps over<|im_end|>" in text
    assert "Hello" not in text and "again" not in text and "user" not in text
    pair = {"prompt": "The capital", "completion": " of France is Paris."}
    path = _write_jsonl(tmp_path / "data.jsonl", [pair, *_chats([("Q", "A")])])
    first = read_examples(path, tokenizer, max_length=512)[0]
    answer = [t for t, keep in zip(first.ids, first.trained, strict=True) if keep]
    assert tokenizer.decode(answer, skip_special_tokens=False) == " of France is Paris.<|im_end|>"
    bad = _write_jsonl(tmp_path / "bad.jsonl", [pair, {"text": "no answer"}])
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        read_examples(bad, tokenizer, max_length=512)
    examples = read_examples(path, tokenizer, 512)
    tokens, mask, real = micro_batch(examples, 4, seed=0, index=0)
    assert tokens.shape[0] == 4 and tokens.shape[1] % 32 == 0 and mask[2:].sum() == 0
    assert real == sum(len(e.ids) for e in examples)


def _finetune(directory, data, output, steps, every):
    command = [sys.executable, "-m", "jinfer.cli", "finetune", "--model", directory, "--data", data]
    command += ["--output", output, "--steps", str(steps), "--checkpoint-every", str(every)]
    command += ["--batch-size", "2", "--accumulation", "2", "--learning-rate", "1e-2", "--rank", "4"]
    log = open(output + ".log", "w")  # noqa: SIM115 - the process holds it; a pipe nobody reads would fill
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log, text=True)


def _log(output) -> str:
    with open(output + ".log", encoding="utf-8") as f:
        return f.read()


def test_a_run_killed_after_a_checkpoint_resumes_to_the_same_adapter_bits(tiny_model, tmp_path):
    directory, _ = tiny_model("smollm2_like")
    pairs = [(f"question {i}?", f"answer number {i} is {i * 7}.") for i in range(12)]
    data = _write_jsonl(tmp_path / "train.jsonl", _chats(pairs))
    whole, killed = str(tmp_path / "whole"), str(tmp_path / "killed")
    steps = 400
    assert _finetune(directory, data, whole, steps, 10).wait(timeout=600) == 0
    bar = _log(whole).replace("\r", "\n").splitlines()
    done = [line for line in bar if f"{steps}/{steps}" in line]  # the progress bar's last state
    assert done and "loss=" in done[-1] and "tokens_per_s=" in done[-1], bar[-5:]
    run = _finetune(directory, data, killed, steps, 10)
    checkpoints = os.path.join(killed, "checkpoints")
    deadline = time.monotonic() + 300
    while not (os.path.isdir(checkpoints) and any(n.isdigit() for n in os.listdir(checkpoints))):
        assert run.poll() is None and time.monotonic() < deadline, _log(killed)
        time.sleep(0.02)
    run.send_signal(signal.SIGKILL)
    run.wait()
    assert not os.path.exists(os.path.join(killed, "jinfer_adapter.json")), "the run ended before the kill"
    assert _finetune(directory, data, killed, steps, 10).wait(timeout=600) == 0
    cfg = load_hf(directory).config
    ours, theirs = read_adapter(killed, cfg), read_adapter(whole, cfg)
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert not all(np.all(np.asarray(p.b) == 0) for layer in ours.layers for p in layer.values())


def _written_since(moment: float, scratch: str) -> list[str]:
    """Files modified since `moment` where this process writes: jinfer's and JAX's caches, the
    working directory and `scratch` (pytest's temporary folder)."""
    from jinfer.kernels import cache_dir

    roots = {str(cache_dir()), os.getcwd(), scratch}
    roots |= {jax.config.jax_compilation_cache_dir} - {None, ""}
    written = []
    for root in roots:
        for folder, _, names in os.walk(root):
            for name in names:
                path = os.path.join(folder, name)
                with contextlib.suppress(OSError):  # a file another process removed meanwhile
                    if os.stat(path).st_mtime >= moment:
                        written.append(path)
    return written


def test_training_in_memory_serves_each_round_with_no_compile(tiny_model, tmp_path_factory):
    """A loop alternating train steps and generation with the fresh adapter, loaded from memory:
    nothing compiles and nothing is written to disk after the first round."""
    directory, _ = tiny_model("smollm2_like")
    loaded = load_hf(directory)
    cfg, tokenizer = loaded.config, loaded.tokenizer
    examples = [chat_example(c["messages"], tokenizer) for c in _chats([("ping", "pong pong pong")] * 4)]
    config = TrainConfig(steps=1000, batch_size=4, learning_rate=1e-2, warmup_steps=1, log_every=1)
    adapter = lora.init_adapter(cfg, lora.LoraConfig(rank=4), jax.random.key(0))
    trainer = Trainer(cfg, loaded.params, config, adapter, cfg.vocab_size)
    llm = jinfer.LLM(directory, max_seq_len=256, max_loras=1, max_lora_rank=4)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "ping"}], tokenize=True)
    answers, compiles = [], []
    for round in range(4):
        if round == 1:
            after_first = time.time()
            time.sleep(0.01)  # past the file system's timestamp resolution
        trainer.run(examples, until=10 * (round + 1))
        llm.load_adapter("live", trainer.trainable)
        answers.append(llm.generate([prompt], GREEDY, adapter="live")[0].text)
        compiles.append(llm.engine.compile_count())
    losses = [record["loss"] for record in trainer.history]
    assert losses[-1] < 0.5 * losses[0]
    assert "pong pong pong" in answers[-1]
    assert len(set(compiles)) == 1, compiles
    assert _written_since(after_first, str(tmp_path_factory.getbasetemp())) == []


def test_full_fine_tuning_takes_the_same_step_and_is_served_at_once(tiny_model):
    """Every weight trained (no adapter), then handed to a running engine with update_weights."""
    directory, _ = tiny_model("smollm2_like")
    loaded = load_hf(directory)
    cfg, tokenizer = loaded.config, loaded.tokenizer
    examples = [chat_example(c["messages"], tokenizer) for c in _chats([("ping", "pong pong pong")] * 4)]
    config = TrainConfig(steps=30, batch_size=4, learning_rate=3e-3, warmup_steps=1, log_every=5)
    start = jax.tree.map(np.array, loaded.params)  # the trainer donates what it is given
    trainer = Trainer(cfg, None, config, loaded.params, cfg.vocab_size, apply=every_weight)
    trained = trainer.run(examples)
    losses = [record["loss"] for record in trainer.history]
    assert losses[-1] < 0.5 * losses[0]
    llm = jinfer.LLM(directory, max_seq_len=256)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "ping"}], tokenize=True)
    before = llm.generate([prompt], GREEDY)[0].text
    compiles = llm.engine.compile_count()
    llm.update_weights(jax.tree.map(np.asarray, trained))
    assert "pong pong pong" in llm.generate([prompt], GREEDY)[0].text
    assert llm.engine.compile_count() == compiles
    llm.update_weights(start)
    assert llm.generate([prompt], GREEDY)[0].text == before
