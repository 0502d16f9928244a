"""Two jinfer replicas behind an existing router from PyPI (vLLM's, a Rust binary): the recipe of
docs/scale.md (`scripts/serve_replicas.py`), run on loopback with the official `openai` client."""

import contextlib
import os
import subprocess
import sys
import time

import httpx
import openai
import pytest
from test_server import _free_port, terminate

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "serve_replicas.py")
SERVE = [
    "--max-slots", "2",
    "--max-seq-len", "128",
    "--page-size", "16",
    "--max-num-batched-tokens", "128",
    "--served-model-name", "tiny",
]  # fmt: skip


@contextlib.contextmanager
def _process(cmd: list[str], log_path):
    log = open(log_path, "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield proc
    finally:
        terminate(proc)
        log.close()


def _wait(base: str, proc, log_path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, log_path.read_text()[-3000:]
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(base + "/v1/models", timeout=2).status_code == 200:
                return
        assert time.monotonic() < deadline, f"{base} did not come up"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def cache_aware(tiny_model, tmp_path_factory):
    """The recipe: two replicas and the router (cache-aware) in front of them, started by the
    script; yields (router URL, the replicas' URLs)."""
    model, log_path = tiny_model("llama_gqa_untied")[0], tmp_path_factory.mktemp("router") / "replicas.log"
    port = _free_port()
    cmd = [
        sys.executable,
        SCRIPT,
        "--port",
        str(port),
        "--policy",
        "cache_aware",
        "--",
        "--model",
        model,
        *SERVE,
    ]
    with _process(cmd, log_path) as proc:
        deadline = time.monotonic() + 400
        while not (announced := [ln for ln in log_path.read_text().splitlines() if ln.startswith("router ")]):
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.5)  # the script says "router URL (policy) -> replica URLs" once all answer
        yield f"http://127.0.0.1:{port}", announced[0].split(" -> ")[1].split()


def test_the_openai_client_is_served_through_the_router_streamed_or_not(cache_aware):
    base, replicas = cache_aware
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    assert [m.id for m in client.models.list()] == ["tiny"]
    knobs = {"model": "tiny", "max_tokens": 12, "temperature": 0}
    for question in ("Say something.", "Say something else."):
        messages = [{"role": "user", "content": question}]
        direct = httpx.post(replicas[0] + "/v1/chat/completions", json={"messages": messages, **knobs}).json()
        whole = client.chat.completions.create(messages=messages, **knobs).choices[0].message.content
        assert whole == direct["choices"][0]["message"]["content"]
        chunks = list(client.chat.completions.create(messages=messages, stream=True, **knobs))
        assert len(chunks) > 2 and "".join(c.choices[0].delta.content or "" for c in chunks) == whole
    text = client.completions.create(prompt="Once upon a time", **knobs).choices[0].text
    streamed = client.completions.create(prompt="Once upon a time", stream=True, **knobs)
    assert "".join(c.choices[0].text for c in streamed) == text


def _cached_tokens(base: str, prefixes: list[str], rounds: int) -> int:
    """Send each prefix's questions, the prefixes taking turns; the prompt tokens served from a
    replica's prefix cache, summed."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    cached = 0
    for question in range(rounds):
        for prefix in prefixes:
            messages = [
                {"role": "system", "content": prefix},
                {"role": "user", "content": f"Question {question}?"},
            ]
            answer = client.chat.completions.create(
                model="tiny", messages=messages, max_tokens=2, temperature=0
            )
            cached += answer.usage.prompt_tokens_details.cached_tokens
    return cached


def test_the_cache_aware_policy_finds_more_cached_prefixes_than_round_robin(cache_aware, tmp_path):
    base, replicas = cache_aware
    # Shared system prompts, a different set for each policy: neither finds the other's in a cache.
    prompts = lambda policy: [f"{policy} assistant {i}: " + "be brief. " * 5 for i in range(3)]
    port = _free_port()
    router = [sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1", "--port", str(port)]
    router += ["--worker-urls", *replicas, "--policy", "round_robin", "--prometheus-port", str(_free_port())]
    with _process(router, tmp_path / "router.log") as proc:
        _wait(f"http://127.0.0.1:{port}", proc, tmp_path / "router.log", timeout=60)
        round_robin = _cached_tokens(f"http://127.0.0.1:{port}", prompts("rr"), rounds=4)
    cache_aware = _cached_tokens(base, prompts("ca"), rounds=4)
    assert cache_aware > round_robin > 0, {"cache_aware": cache_aware, "round_robin": round_robin}
