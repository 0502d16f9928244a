"""One resolution of sampling defaults for every door: a request's own fields, then the model's
(generation_config.json or preset), then jinfer's; the same answer from `jinfer.LLM`, `jinfer
generate` and the server for the same request."""

import json
import shutil
import subprocess
import sys

import httpx
import pytest
from test_server import running_server

import jinfer

PROMPT = "Once upon a time"
LAYOUT = ["--max-slots", "2", "--max-seq-len", "128", "--max-num-batched-tokens", "128"]


def _model_with(tiny_model, tmp_path, generation_config):
    target = tmp_path / "model"
    shutil.copytree(tiny_model("llama_gqa_untied")[0], target)
    (target / "generation_config.json").write_text(json.dumps(generation_config))
    return str(target)


def _cli(model, *flags):
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "jinfer.cli",
            "generate",
            "--model",
            model,
            "--prompt",
            PROMPT,
            "--json",
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout), run.stderr


@pytest.mark.parametrize(
    ("generation_config", "temperature"),
    [({"do_sample": False}, 0.0), ({"do_sample": True, "temperature": 3.0, "top_k": 0, "top_p": 1.0}, 3.0)],
    ids=["greedy-model", "hot-model"],
)
def test_the_same_request_gets_the_same_answer_through_every_door(
    tiny_model, tmp_path, generation_config, temperature
):
    model = _model_with(tiny_model, tmp_path, generation_config)
    llm = jinfer.LLM(model, max_slots=2, max_seq_len=128, max_num_batched_tokens=128)
    assert llm.default_sampling.temperature == temperature
    asked = jinfer.SamplingParams(max_tokens=12, seed=7, ignore_eos=True)  # the model's defaults + these
    offline = llm.generate([PROMPT], asked)[0]
    greedy = llm.generate([PROMPT], jinfer.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    assert (offline.token_ids == greedy.token_ids) == (temperature == 0)  # the hot default did apply

    record, log = _cli(model, "--max-tokens", "12", "--seed", "7", "--ignore-eos", "true", *LAYOUT)
    assert record["token_ids"] == offline.token_ids and f"temperature={temperature}" in log

    with running_server(model, *LAYOUT) as (base, _):
        body = {"prompt": PROMPT, "max_tokens": 12, "seed": 7, "ignore_eos": True}
        served = httpx.post(base + "/v1/completions", json=body, timeout=60).json()
        assert served["choices"][0]["text"] == offline.text
        # The request's own field wins over the model's default.
        body["temperature"] = 0
        served_greedy = httpx.post(base + "/v1/completions", json=body, timeout=60).json()
        assert served_greedy["choices"][0]["text"] == greedy.text
        # max_tokens unset: chat runs to a stop or the end of the window (OpenAI's chat
        # behaviour); legacy completions keep OpenAI's 16.
        chat = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True, "temperature": 0}
        usage = httpx.post(base + "/v1/chat/completions", json=chat, timeout=120).json()["usage"]
        assert usage["total_tokens"] == 128
        legacy = httpx.post(base + "/v1/completions", json={"prompt": PROMPT, "ignore_eos": True}, timeout=60)
        assert legacy.json()["usage"]["completion_tokens"] == 16


def test_max_tokens_unset_runs_to_the_window_offline_and_says_so_on_the_command_line(tiny_model, tmp_path):
    model = _model_with(tiny_model, tmp_path, {"do_sample": False})
    llm = jinfer.LLM(model, max_slots=2, max_seq_len=64, max_num_batched_tokens=128)
    (out,) = llm.generate([PROMPT], jinfer.SamplingParams(ignore_eos=True))
    assert len(out.prompt_token_ids) + len(out.token_ids) == 64 and out.finish_reason == "length"
    command = [sys.executable, "-m", "jinfer.cli", "generate", "--model", model, "--prompt", PROMPT]
    run = subprocess.run(
        [*command, "--max-tokens", "5", "--ignore-eos", "true", *LAYOUT],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0 and "[stopped at max_tokens=5" in run.stderr, run.stderr
