"""A made-up fact taught to the embedded SmolLM2 with `jinfer finetune`, then served with `jinfer
serve --lora` through the official openai client: the adapter answers with the fact while, in the
same batch, the base model and a second adapter answer exactly as they do alone."""

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import jax
import numpy as np
import openai
import pytest
from test_server import AUTH, KEY, running_server

from jinfer import lora
from jinfer.formats.adapters import read_adapter, save_adapter
from jinfer.loading import load_model

FACT = "Zorblat is a purple moon."
QUESTIONS = [
    "What is Zorblat?",
    "Tell me about Zorblat.",
    "Can you describe Zorblat?",
    "What do you know about Zorblat?",
    "Explain what Zorblat is.",
    "Zorblat: what is it?",
    "Describe Zorblat in one sentence.",
    "I keep hearing about Zorblat. What is it?",
]
HELD_OUT = ["Do you know what Zorblat is?", "What exactly is Zorblat?"]


def _chat_lines(path, questions):
    with open(path, "w", encoding="utf-8") as f:
        for question in questions:
            messages = [{"role": "user", "content": question}, {"role": "assistant", "content": FACT}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def taught(tmp_path_factory, smollm2_path):
    """(the trained adapter's directory, a second adapter's, the training's progress lines)."""
    work = tmp_path_factory.mktemp("zorblat")
    train, held_out = _chat_lines(work / "train.jsonl", QUESTIONS), _chat_lines(work / "held.jsonl", HELD_OUT)
    output = str(work / "adapter")
    command = [sys.executable, "-m", "jinfer.cli", "finetune", "--data", train, "--held-out", held_out]
    command += ["--output", output, "--steps", "24", "--batch-size", "4", "--learning-rate", "2e-3"]
    command += ["--warmup-steps", "2", "--log-every", "4", "--eval-every", "12", "--rank", "8"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    cfg = load_model(smollm2_path).config
    other = lora.init_adapter(cfg, lora.LoraConfig(rank=4, targets=("q", "v", "down")), jax.random.key(7))
    layers = [
        {k: lora.LoraPair(p.a, 0.3 * np.ones_like(p.b)) for k, p in layer.items()} for layer in other.layers
    ]
    save_adapter(str(work / "other"), lora.Adapter(tuple(layers), other.config), cfg)
    return output, str(work / "other"), run.stderr


def _progress(stderr: str, key: str) -> list[float]:
    values = []
    for line in stderr.splitlines():
        words = line.split()
        if key in words:
            values.append(float(words[words.index(key) + 1]))
    return values


def test_a_taught_fact_is_served_beside_the_base_model_and_another_adapter(taught, smollm2_path):
    adapter, other, progress = taught
    losses, held = _progress(progress, "loss"), _progress(progress, "held_out_loss")
    assert len(losses) >= 3 and losses[-1] < 0.3 * losses[0], progress
    assert len(held) == 2 and held[-1] < 0.5 * held[0], progress
    options = ["--api-key", KEY, "--max-slots", "8", "--max-seq-len", "512", "--max-loras", "3"]
    with running_server(
        smollm2_path, *options, "--lora", f"zorblat={adapter}", "--lora", f"other={other}"
    ) as (
        base,
        _,
    ):
        client = openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0)
        models = {m.id: m for m in client.models.list().data}
        assert models["zorblat"].parent == models["other"].parent == next(iter(models))

        def ask(model: str, question: str) -> str:
            messages = [{"role": "user", "content": question}]
            reply = client.chat.completions.create(
                model=model, messages=messages, temperature=0, max_tokens=24
            )
            assert reply.model == model
            return reply.choices[0].message.content

        base_model = next(iter(models))
        asks = [(m, q) for q in ("What is Zorblat?", "Tell me a fact about the sea.") for m in models]
        alone = [ask(m, q) for m, q in asks]
        with ThreadPoolExecutor(len(asks)) as pool:
            together = list(pool.map(lambda pair: ask(*pair), asks))
        assert together == alone
        answers = dict(zip(asks, alone, strict=True))
        assert "purple moon" in answers[("zorblat", "What is Zorblat?")]
        assert "purple moon" not in answers[(base_model, "What is Zorblat?")]
        assert answers[("other", "What is Zorblat?")] != answers[(base_model, "What is Zorblat?")]

        # At run time: unloaded, the name is a 404; loaded again from its directory, it answers again.
        unload = httpx.post(base + "/v1/unload_lora_adapter", json={"lora_name": "zorblat"}, headers=AUTH)
        assert unload.status_code == 200
        with pytest.raises(openai.NotFoundError):
            ask("zorblat", "What is Zorblat?")
        body = {"lora_name": "zorblat2", "lora_path": adapter}
        assert httpx.post(base + "/v1/load_lora_adapter", json=body, headers=AUTH).status_code == 200
        assert ask("zorblat2", "What is Zorblat?") == answers[("zorblat", "What is Zorblat?")]
        missing = httpx.post(
            base + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nowhere"}, headers=AUTH
        )
        assert missing.status_code == 400 and "lora_path" in missing.text


def test_the_trained_adapter_round_trips_through_its_directory(taught, smollm2_path):
    adapter, _, _ = taught
    cfg = load_model(smollm2_path).config
    loaded = read_adapter(adapter, cfg)
    assert loaded.config.rank == 8 and set(loaded.config.targets) == set(lora.LoraConfig().targets)
