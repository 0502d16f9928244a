"""Malformed and hostile requests on a live server: every one a 4xx in its API's error shape, the
streams running beside them unaffected, the server serving afterwards; and the start-up order
(port first, /ready 503 while warming up)."""

import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from test_server import AUTH, TINY_OPTIONS, _free_port

DEEP = b'{"prompt": "x", "extra": ' + b"[" * 5000 + b"]" * 5000 + b"}"
BIG = "9" * 400  # an integer of 400 digits, where a float belongs
HUGE = "9" * 5000  # past Python's 4300-digit limit for int()


def _chat(content, **extra):
    return json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 2, **extra})


def _message(content: str, max_tokens=2, **extra) -> bytes:
    """An Anthropic Messages body whose one user message has `content` (raw JSON text)."""
    fields = "".join(f', "{k}": {v if isinstance(v, str) else json.dumps(v)}' for k, v in extra.items())
    limit = "" if max_tokens is None else f'"max_tokens": {max_tokens}, '
    return f'{{{limit}"messages": [{{"role": "user", "content": {content}}}]{fields}}}'.encode()


# (method, path, raw body or None) for each class of bad request.
HOSTILE = {
    "surrogate in prompt": ("POST", "/v1/completions", b'{"prompt": "caf\\udce9", "max_tokens": 2}'),
    "surrogate in message": ("POST", "/v1/chat/completions", _chat("x").replace('"x"', '"\\ud800"').encode()),
    "surrogate in tokenize": ("POST", "/tokenize", b'{"prompt": "\\udfff"}'),
    "surrogate in a key": ("POST", "/v1/completions", b'{"prompt": "x", "\\ud800": 1}'),
    "deep nesting": ("POST", "/v1/completions", DEEP),
    "5000-digit integer": ("POST", "/v1/completions", f'{{"prompt": "x", "max_tokens": {HUGE}}}'.encode()),
    "400 digits as temperature": (
        "POST",
        "/v1/completions",
        f'{{"prompt": "x", "temperature": {BIG}}}'.encode(),
    ),
    "400 digits as presence_penalty": (
        "POST",
        "/v1/completions",
        f'{{"prompt": "x", "presence_penalty": {BIG}}}'.encode(),
    ),
    "400 digits as repetition_penalty": (
        "POST",
        "/v1/completions",
        f'{{"prompt": "x", "repetition_penalty": {BIG}}}'.encode(),
    ),
    "400 digits as a logit_bias value": (
        "POST",
        "/v1/completions",
        f'{{"prompt": "x", "logit_bias": {{"5": {BIG}}}}}'.encode(),
    ),
    "top_k past int32": ("POST", "/v1/completions", b'{"prompt": "x", "top_k": 2147483648}'),
    "min_tokens past int32": ("POST", "/v1/completions", b'{"prompt": "x", "min_tokens": 1099511627776}'),
    "max_tokens past int32": ("POST", "/v1/completions", b'{"prompt": "x", "max_tokens": 4294967296}'),
    "seed past 64 bits": ("POST", "/v1/completions", b'{"prompt": "x", "seed": 18446744073709551616}'),
    "negative seed": ("POST", "/v1/completions", b'{"prompt": "x", "seed": -1}'),
    "text part that is not a string": (
        "POST",
        "/v1/chat/completions",
        _chat([{"type": "text", "text": 5}]).encode(),
    ),
    "image part": ("POST", "/v1/chat/completions", _chat([{"type": "image_url", "image_url": "x"}]).encode()),
    "tokenize with a non-string role": ("POST", "/tokenize", b'{"messages": [{"role": 5, "content": "hi"}]}'),
    "tokenize with messages not a list": ("POST", "/tokenize", b'{"messages": "hi"}'),
    "stream_options without stream": (
        "POST",
        "/v1/completions",
        b'{"prompt": "x", "stream_options": {"include_usage": true}}',
    ),
    "unknown role": ("POST", "/v1/chat/completions", b'{"messages": [{"role": "wizard", "content": "hi"}]}'),
    "empty role": ("POST", "/v1/chat/completions", b'{"messages": [{"role": "", "content": "hi"}]}'),
    "message without content": ("POST", "/v1/chat/completions", b'{"messages": [{"role": "user"}]}'),
    "empty messages": ("POST", "/v1/chat/completions", b'{"messages": []}'),
    "messages an object": ("POST", "/v1/chat/completions", b'{"messages": {"role": "user"}}'),
    "max_tokens a float": ("POST", "/v1/completions", b'{"prompt": "x", "max_tokens": 3.5}'),
    "n a string": ("POST", "/v1/completions", b'{"prompt": "x", "n": "2"}'),
    "logprobs past 20": ("POST", "/v1/completions", b'{"prompt": "x", "logprobs": 21}'),
    "17 stop strings": ("POST", "/v1/completions", json.dumps({"prompt": "x", "stop": ["a"] * 17}).encode()),
    "negative logit_bias key": ("POST", "/v1/completions", b'{"prompt": "x", "logit_bias": {"-1": 1}}'),
    "huge logit_bias key": ("POST", "/v1/completions", b'{"prompt": "x", "logit_bias": {"99999999999": 1}}'),
    "logit_bias past 100": ("POST", "/v1/completions", b'{"prompt": "x", "logit_bias": {"5": 101}}'),
    "stop_token_ids with a string": ("POST", "/v1/completions", b'{"prompt": "x", "stop_token_ids": ["a"]}'),
    "ignore_eos a string": ("POST", "/v1/completions", b'{"prompt": "x", "ignore_eos": "yes"}'),
    "prompt ids with a bool": ("POST", "/v1/completions", b'{"prompt": [1, true, 3]}'),
    "model an integer": ("POST", "/v1/completions", b'{"prompt": "x", "model": 5}'),
    "unknown context_policy": ("POST", "/v1/completions", b'{"prompt": "x", "context_policy": "shrink"}'),
    "cache_salt a number": ("POST", "/v1/completions", b'{"prompt": "x", "cache_salt": 7}'),
    "cache_salt empty": (
        "POST",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "x"}], "cache_salt": ""}',
    ),
    "invalid UTF-8": ("POST", "/v1/completions", b'{"prompt": "\xff\xfe"}'),
    "detokenize past int32": ("POST", "/detokenize", b'{"tokens": [99999999999999999999]}'),
    "tokenize add_special_tokens a string": (
        "POST",
        "/tokenize",
        b'{"prompt": "x", "add_special_tokens": "no"}',
    ),
    "GET on a POST route": ("GET", "/v1/completions", None),
    "prediction not content": (
        "POST",
        "/v1/chat/completions",
        _chat("x", prediction={"type": "text"}).encode(),
    ),
    "prediction parts not text": (
        "POST",
        "/v1/chat/completions",
        _chat("x", prediction={"type": "content", "content": [{"type": "text", "text": 5}]}).encode(),
    ),
    "prediction with a surrogate": (
        "POST",
        "/v1/completions",
        b'{"prompt": "x", "prediction": {"type": "content", "content": "\\ud800"}}',
    ),
    # Anthropic's Messages routes: the same checks, answered in Anthropic's error shape.
    "messages: surrogate in text": ("POST", "/v1/messages", _message('"\\ud800"')),
    "messages: deep nesting": (
        "POST",
        "/v1/messages",
        DEEP.replace(b'"prompt"', b'"max_tokens": 2, "messages"'),
    ),
    "messages: max_tokens past int32": ("POST", "/v1/messages", _message('"x"', max_tokens=4294967296)),
    "messages: no max_tokens": ("POST", "/v1/messages", _message('"x"', max_tokens=None)),
    "messages: a system role": (
        "POST",
        "/v1/messages",
        b'{"max_tokens": 2, "messages": [{"role": "system", "content": "x"}]}',
    ),
    "messages: an unknown block": ("POST", "/v1/messages", _message('[{"type": "video"}]')),
    "messages: a tool_result without its id": (
        "POST",
        "/v1/messages",
        _message('[{"type": "tool_result", "tool_use_id": 5, "content": "x"}]'),
    ),
    "messages: thinking of no known type": ("POST", "/v1/messages", _message('"x"', thinking={"type": "on"})),
    "messages: a negative thinking budget": (
        "POST",
        "/v1/messages",
        _message('"x"', thinking={"type": "enabled", "budget_tokens": -1}),
    ),
    "negative max_reasoning_tokens": (
        "POST",
        "/v1/chat/completions",
        _chat("x", max_reasoning_tokens=-1).encode(),
    ),
    "messages: tool input not an object": (
        "POST",
        "/v1/messages",
        b'{"max_tokens": 2, "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content":'
        b' [{"type": "tool_use", "id": "a", "name": "f", "input": [1]}]}]}',
    ),
    "messages: a server tool": (
        "POST",
        "/v1/messages",
        _message('"x"', tools=[{"type": "bash_20250124", "name": "bash"}]),
    ),
    "messages: 400 digits as temperature": ("POST", "/v1/messages", _message('"x"', temperature=BIG)),
    "count_tokens: messages not a list": ("POST", "/v1/messages/count_tokens", b'{"messages": "hi"}'),
    "GET on the messages route": ("GET", "/v1/messages", None),
    # Files and batches.
    "files: an upload that is not a form": ("POST", "/v1/files", b'{"file": "x", "purpose": "batch"}'),
    "files: an unknown id": ("GET", "/v1/files/file-0123abc", None),
    "files: an id that is a path": ("GET", "/v1/files/file-..%2F..%2Fetc%2Fpasswd/content", None),
    "files: a limit of 0": ("GET", "/v1/files?limit=0", None),
    "batches: an unknown endpoint": (
        "POST",
        "/v1/batches",
        b'{"input_file_id": "file-1", "endpoint": "/v1/embeddings", "completion_window": "24h"}',
    ),
    "batches: metadata of numbers": (
        "POST",
        "/v1/batches",
        b'{"input_file_id": "file-1", "endpoint": "/v1/completions", "completion_window": "24h",'
        b' "metadata": {"a": 1}}',
    ),
    "batches: an unknown field": ("POST", "/v1/batches", b'{"input_file_id": "file-1", "priority": 1}'),
    "batches: not JSON": ("POST", "/v1/batches", b"{input_file_id"),
    "batches: cancel an unknown one": ("POST", "/v1/batches/batch_0123/cancel", None),
}


def _send(base, method, path, body):
    headers = {**AUTH, "Content-Type": "application/json"}
    return httpx.request(method, base + path, content=body, headers=headers, timeout=60)


@pytest.fixture(scope="module")
def started(tiny_model, tmp_path_factory):
    """A server started here, watched from its first answer: (base URL, the /ready answers seen
    while it warmed up, generation statuses seen meanwhile, its log once ready)."""
    port = _free_port()
    cmd = [sys.executable, "-m", "jinfer.cli", "serve", "--model", tiny_model("llama_gqa_untied")[0]]
    log_path = tmp_path_factory.mktemp("server") / "log.txt"
    log = open(log_path, "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([*cmd, "--port", str(port), *TINY_OPTIONS], stdout=subprocess.DEVNULL, stderr=log)
    base, seen, generation = f"http://127.0.0.1:{port}", [], []
    try:
        deadline = time.monotonic() + 300
        while not seen or seen[-1][0] != 200:
            assert proc.poll() is None and time.monotonic() < deadline
            try:
                ready = httpx.get(base + "/ready", timeout=5)
            except httpx.HTTPError:
                time.sleep(0.05)
                continue
            seen.append((ready.status_code, ready.json()["status"]))
            if ready.status_code == 503:
                assert httpx.get(base + "/health", timeout=5).status_code == 200  # alive meanwhile
                r = httpx.post(base + "/v1/completions", json={"prompt": "x"}, headers=AUTH, timeout=5)
                generation.append(
                    (r.status_code, r.json().get("error", {}).get("code"), r.headers.get("Retry-After"))
                )
        while "warm-up took" not in log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        yield base, seen, generation, log_path.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        log.close()


@pytest.fixture(scope="module")
def server(started):
    return started[0]


def _stream(base, prompt):
    body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200
        return "".join(
            json.loads(line[6:])["choices"][0]["text"]
            for line in r.iter_lines()
            if line.startswith("data: {")
        )


def test_every_hostile_request_is_a_4xx_and_streams_beside_it_are_unaffected(server):
    prompts = ["Once upon a time", "The weather today"]
    solo = [_stream(server, p) for p in prompts]
    beside = {}
    threads = [
        threading.Thread(target=lambda i=i: beside.update({i: _stream(server, prompts[i])})) for i in (0, 1)
    ]
    for t in threads:
        t.start()
    answers = {name: _send(server, *request) for name, request in HOSTILE.items()}
    for t in threads:
        t.join()
    for name, r in answers.items():
        assert 400 <= r.status_code < 500, (name, r.status_code, r.text)
        body = r.json()
        if HOSTILE[name][1].startswith("/v1/messages"):  # Anthropic's shape
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, (name, body)
            assert body["error"]["type"] != "api_error" and body["error"]["message"], (name, body)
            continue
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}, name
        assert error["type"] != "server_error" and error["message"], (name, error)
    assert answers["GET on a POST route"].status_code == 405
    assert answers["deep nesting"].json()["error"]["code"] == "invalid_json"
    assert answers["top_k past int32"].json()["error"]["param"] == "top_k"
    assert answers["unknown role"].json()["error"]["param"] == "messages"
    assert answers["GET on the messages route"].status_code == 405
    assert answers["messages: deep nesting"].json()["error"]["type"] == "invalid_request_error"
    assert beside == {0: solo[0], 1: solo[1]}  # the streams beside the barrage: token for token
    metrics = httpx.get(server + "/metrics", headers=AUTH).text
    assert (
        'jinfer_requests_finished_total{finish_reason="error"}' not in metrics
    )  # nothing reached the device
    ok = _send(server, "POST", "/v1/completions", b'{"prompt": "x", "max_tokens": 2}')
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_hostile_websocket_messages_get_error_messages_and_the_socket_serves_on(server):
    import websockets.sync.client as ws_client

    with ws_client.connect(server.replace("http", "ws") + "/v1/ws", additional_headers=AUTH) as ws:
        for raw in (
            "not json",
            '{"type": "completion", "id": 1, "prompt": "\\ud800"}',
            "[1]",
            '{"type": "x"}',
        ):
            ws.send(raw)
            message = json.loads(ws.recv(timeout=30))
            assert message["type"] == "error" and message["error"]["type"] == "invalid_request_error", raw
        ws.send(
            json.dumps({"type": "completion", "id": 2, "prompt": "x", "max_tokens": 2, "ignore_eos": True})
        )
        while (message := json.loads(ws.recv(timeout=30)))["type"] != "done":
            assert message["type"] == "token"
        assert message["finish_reason"] == "length"


def test_the_port_opens_first_and_ready_says_503_while_warming_up(started):
    _, seen, generation, log = started
    assert seen[0] == (503, "warming_up") and seen[-1] == (200, "ready")
    # 200 only if the warm-up ended between a /ready answer and the request after it.
    assert (503, "not_ready", "5") in generation
    assert {status for status, _, _ in generation} <= {200, 503}
    assert log.index("listening on") < log.index("warm-up took")  # said when it was true, not after


def test_a_port_in_use_fails_before_the_model_loads(tiny_model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [sys.executable, "-m", "jinfer.cli", "serve", "--model", tiny_model("llama_gqa_untied")[0]]
        run = subprocess.run([*cmd, "--port", str(port)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in run.stderr and "loaded in" not in run.stderr
