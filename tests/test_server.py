"""The real server on a real port, used with the official `openai` client, httpx and WebSockets."""

import asyncio
import contextlib
import http.client
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import openai
import pytest

KEY = "test-key-123"
AUTH = {"Authorization": f"Bearer {KEY}"}


def _free_port() -> int:
    """A port free now, for a process started later to listen on: below the ephemeral range, which
    outgoing connections (a cluster's processes connecting to each other) take from meanwhile."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    for port in random.sample(range(10000, ephemeral), 200):
        with socket.socket() as s, contextlib.suppress(OSError):
            s.bind(("127.0.0.1", port))
            return port
    raise RuntimeError("no free port below the ephemeral range")


@contextlib.contextmanager
def running_server(model: str, *extra: str, timeout: float = 300, until: str = "/ready"):
    """A `jinfer serve` process, yielded (base URL, process) once `until` answers 200 (/health: as
    soon as it serves, still warming up). Its log (stderr) goes to a file, `proc.log_path`: a pipe
    nobody reads would fill, and the server would stop at its next log line."""
    port = _free_port()
    cmd = [sys.executable, "-m", "jinfer.cli", "serve", "--model", model, "--port", str(port), *extra]
    out = open(os.devnull, "w")  # noqa: SIM115 - closed below
    log = tempfile.NamedTemporaryFile("w+", prefix="jinfer-serve-", suffix=".log")  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=out, stderr=log, text=True)
    proc.log_path = log.name
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    try:
        while True:
            if proc.poll() is not None:
                log.seek(0)
                raise RuntimeError("server exited: " + log.read())
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base + until, timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError("server did not become ready")
            time.sleep(0.3)
        yield base, proc
    finally:
        terminate(proc)
        out.close()
        log.close()


def terminate(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM (a server drains, then exits), then SIGKILL if it is still there after `timeout`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


TINY_OPTIONS = [
    "--api-key", KEY,
    "--max-slots", "2",
    "--max-queue", "3",
    "--max-seq-len", "128",
    "--page-size", "16",
    "--max-num-batched-tokens", "128",
    "--decode-steps", "2",
    "--max-body-bytes", "20000",
    "--served-model-name", "tiny",
]  # fmt: skip


@pytest.fixture(scope="module")
def server(tiny_model):
    with running_server(tiny_model("llama_gqa_untied")[0], *TINY_OPTIONS) as (base, _):
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


def _metric(base: str, name: str) -> float:
    text = httpx.get(base + "/metrics", headers=AUTH).text
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def _wait_metric(base, name, value, timeout=30):
    deadline = time.monotonic() + timeout
    while _metric(base, name) != value:
        assert time.monotonic() < deadline, f"{name} stayed at {_metric(base, name)}"
        time.sleep(0.05)


# ------------------------------------------------------------------------------ openai client
def test_completions_stream_and_non_stream_agree(client):
    kwargs = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
    whole = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 12 and whole.usage.prompt_tokens > 0
    chunks = list(
        client.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].choices == []
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_stream_and_non_stream_agree(client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True
    )
    chunks = list(stream)
    # The first chunk is the first token, the role with it: nothing comes before the prefill.
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason


def test_n_choices_seed_reproducibility_and_logprobs(client):
    kwargs = {"model": "tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 1.0, "seed": 42, "n": 3}
    first = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    second = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    assert len({c.text for c in first.choices}) > 1  # seed + index per choice
    lp = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0, logprobs=2)
    logprobs = lp.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 4
    assert all(len(top) == 2 for top in logprobs.top_logprobs)
    assert "".join(logprobs.tokens) == lp.choices[0].text
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) >= 1 and all(len(t.top_logprobs) == 2 for t in content)
    assert max(t.logprob for t in content[0].top_logprobs) == pytest.approx(content[0].logprob)


def test_echo_and_token_id_prompts(client):
    out = client.completions.create(model="tiny", prompt="Once", max_tokens=3, temperature=0, echo=True)
    assert out.choices[0].text.startswith("Once")
    ids = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3, temperature=0)
    assert ids.usage.prompt_tokens == 3


def test_concurrent_streams_match_solo_greedy(client):
    prompts = [f"Story number {i}:" for i in range(4)]
    solo = [
        client.completions.create(
            model="tiny", prompt=p, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
        )
        .choices[0]
        .text
        for p in prompts
    ]
    results = [None] * 4

    def run(i):
        stream = client.completions.create(
            model="tiny",
            prompt=prompts[i],
            max_tokens=10,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        results[i] = "".join(c.choices[0].text for c in stream if c.choices)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(3)]  # queue bound: 2 slots + 3 waiting
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results[:3] == solo[:3]


# ---------------------------------------------------------------------------------- raw SSE
def _sse_events(base, body):
    events, comments = [], 0
    with httpx.stream("POST", base + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        buffer = ""
        for piece in r.iter_text():
            buffer += piece
            while "\n\n" in buffer:
                frame, buffer = buffer.split("\n\n", 1)
                if frame.startswith(":"):
                    comments += 1
                    continue
                assert frame.startswith("data: ") and "\n" not in frame, repr(frame)
                events.append(frame[len("data: ") :])
        assert buffer == ""
    return events, comments


def test_sse_framing_survives_newlines_and_data_prefixes(server):
    tokenizer_probe = httpx.post(server + "/tokenize", json={"prompt": "\n"}, headers=AUTH).json()
    newline = tokenizer_probe["tokens"][-1]
    body = {
        "prompt": "data: [DONE]\n\ndata: {}\n",
        "echo": True,
        "max_tokens": 6,
        "temperature": 0,
        "logit_bias": {str(newline): 100},
        "stream": True,
        "ignore_eos": True,
    }
    events, _ = _sse_events(server, body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == "data: [DONE]\n\ndata: {}\n" + "\n" * 6


def test_sse_events_stay_whole_for_clients_that_split_at_unicode_line_breaks(server):
    # httpx's iter_lines splits like str.splitlines: at U+0085, U+2028 and U+2029 as well.
    prompt = "a\x85b\u2028c\u2029d"
    body = {"prompt": prompt, "echo": True, "max_tokens": 2, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert chunks[0]["choices"][0]["text"] == prompt


# ------------------------------------------------------------------------------ errors
def _post(base, path, content=None, json_body=None, headers=AUTH):
    return httpx.post(base + path, content=content, json=json_body, headers=headers, timeout=60)


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        (b"{not json", 400, "invalid JSON"),
        (b"[1, 2]", 400, "must be a JSON object"),
        (b'{"prompt": "x", "temperature": NaN}', 400, "NaN"),
        (b'{"prompt": 5}', 400, "'prompt' must be"),
        (b'{"prompt": "x", "temperature": -1}', 400, "temperature"),
        (b'{"prompt": "x", "temperature": "hot"}', 400, "temperature"),
        (b'{"prompt": "x", "top_p": 0}', 400, "top_p"),
        (b'{"prompt": "x", "top_p": 1.5}', 400, "top_p"),
        (b'{"prompt": "x", "n": 6}', 400, "'n'"),
        (b'{"prompt": "x", "n": 0}', 400, "'n'"),
        (b'{"prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
        (b'{"prompt": "x", "stop": 7}', 400, "stop"),
        (b'{"prompt": "x", "logit_bias": {"abc": 1}}', 400, "logit_bias"),
        (b'{"prompt": [1, 99999]}', 400, "outside the vocabulary"),
        (b'{"prompt": "x", "model": "gpt-4"}', 404, "does not exist"),
    ],
)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, body, status, fragment):
    r = _post(server, "/v1/completions", content=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and fragment in error["message"]
    ok = _post(server, "/v1/completions", json_body={"prompt": "x", "max_tokens": 2})
    assert ok.status_code == 200


def test_context_length_exceeded_and_truncation(server):
    long_prompt = list(range(1, 121))
    r = _post(server, "/v1/completions", json_body={"prompt": long_prompt, "max_tokens": 20})
    assert r.status_code == 400
    error = r.json()["error"]
    assert (
        error["code"] == "context_length_exceeded" and "128" in error["message"] and "120" in error["message"]
    )
    r = _post(
        server,
        "/v1/completions",
        json_body={"prompt": long_prompt, "max_tokens": 20, "context_policy": "truncate"},
    )
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 108


def test_auth_on_the_raw_path(server):
    for path in ("/v1/models", "//v1/models", "/v1/../v1/models", "/metrics", "/health/../v1/models"):
        r = httpx.get(server + path, headers={"Host": "localhost"})
        assert r.status_code == 401, path
        assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(server + "/health").status_code == 200  # liveness needs no key
    models = httpx.get(server + "/v1/models", headers=AUTH).json()
    assert models["data"][0]["id"] == "tiny"


def test_unknown_route_and_big_body(server):
    r = httpx.get(server + "/v2/nothing", headers=AUTH)
    assert r.status_code == 404 and "error" in r.json()
    r = _post(server, "/v1/completions", content=b'{"prompt": "' + b"a" * 30000 + b'"}')
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


def test_an_idle_connection_outlives_the_openai_clients_reuse_window(server):
    # The official client reuses an idle connection for up to 5 s; the server must not close it first.
    host, port = server.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        for pause in (0, 6):
            time.sleep(pause)
            connection.request("GET", "/health")  # on a connection the server closed: RemoteDisconnected
            response = connection.getresponse()
            assert response.status == 200
            response.read()
            if pause == 0:
                first_socket = connection.sock
        assert connection.sock is first_socket  # the same connection, not a silent reconnect
    finally:
        connection.close()


def test_tokenize_and_detokenize(server):
    ids = _post(server, "/tokenize", json_body={"prompt": "Hello world"}).json()["tokens"]
    assert _post(server, "/detokenize", json_body={"tokens": ids}).json()["prompt"] == "Hello world"
    chat = _post(server, "/tokenize", json_body={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] == len(chat["tokens"]) > 3
    assert _post(server, "/detokenize", json_body={"tokens": [-1]}).status_code == 400


def test_metrics_count_the_engines_dispatches(client, server):
    names = (
        "jinfer_prefill_dispatches_total",
        'jinfer_prefill_tokens_total{kind="prompt"}',
        "jinfer_decode_steps_total",
        'jinfer_decode_row_steps_total{state="active"}',
    )
    before = [_metric(server, name) for name in names]
    client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=9, temperature=0, extra_body={"ignore_eos": True}
    )
    prompt_tokens = len(_post(server, "/tokenize", json_body={"prompt": "Once upon a time"}).json()["tokens"])
    grown = [_metric(server, name) - b for name, b in zip(names, before, strict=True)]
    # The prefill samples the first token; decode steps the other 8 (more if others ran meanwhile).
    assert grown[0] >= 1 and grown[1] >= prompt_tokens and grown[2] >= 8 and grown[3] >= 8, grown


def test_a_prompt_seen_before_reports_its_cached_tokens_and_the_cache_metrics(client, server):
    """The second chat with the same system prompt finds it in the prefix cache: usage says how many
    prompt tokens were cached (streaming with include_usage too); a salted request finds nothing;
    /metrics shows the lookups, the pages and the gauges inference gateways read."""
    system = "You answer every question about the weather in Köln in one short sentence, politely."
    chat = lambda user, **kw: client.chat.completions.create(
        model="tiny",
        messages=[{"role": "system", "content": system}, {"role": "user", "content": user}],
        max_tokens=4,
        temperature=0,
        **kw,
    )
    queries, hits = (_metric(server, f"jinfer_prefix_cache_{n}_total") for n in ("queries", "hits"))
    first = chat("Is it raining?")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = chat("Is it sunny?")
    cached = second.usage.prompt_tokens_details.cached_tokens
    page = int(TINY_OPTIONS[TINY_OPTIONS.index("--page-size") + 1])
    assert page <= cached < second.usage.prompt_tokens and cached % page == 0
    streamed = list(chat("Is it sunny?", stream=True, stream_options={"include_usage": True}))
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens >= cached
    salted = chat("Is it sunny?", extra_body={"cache_salt": "another tenant"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0
    prompts = first.usage.prompt_tokens + 3 * second.usage.prompt_tokens
    assert _metric(server, "jinfer_prefix_cache_queries_total") - queries >= prompts
    assert _metric(server, "jinfer_prefix_cache_hits_total") - hits >= 2 * cached
    assert _metric(server, "jinfer_kv_pages_total") == 2 * 128 // page  # auto: max_slots x max_seq_len
    _wait_metric(server, "jinfer_kv_pages_used", 0)
    for gauge in ("jinfer_requests_waiting", "jinfer_kv_cache_usage_ratio", "jinfer_preemptions_total"):
        assert _metric(server, gauge) == 0


# --------------------------------------------------------------- overload and disconnects
def test_queue_overload_gives_429_and_accepted_requests_complete(server):
    async def one(http, i):
        body = {"prompt": f"p{i}", "max_tokens": 60, "temperature": 0, "ignore_eos": True}
        return await http.post(server + "/v1/completions", json=body, headers=AUTH, timeout=120)

    async def burst():
        async with httpx.AsyncClient() as http:
            return await asyncio.gather(*(one(http, i) for i in range(20)))  # 2 slots + 3 queued

    responses = asyncio.run(burst())
    codes = [r.status_code for r in responses]
    assert 429 in codes and 200 in codes and set(codes) <= {200, 429}
    for r in responses:
        if r.status_code == 429:
            assert r.headers["Retry-After"] and r.json()["error"]["code"] == "queue_full"
        else:
            assert (
                r.json()["choices"][0]["finish_reason"] == "length"
                and r.json()["usage"]["completion_tokens"] == 60
            )
    assert _metric(server, "jinfer_requests_rejected_total") >= codes.count(429)


def test_disconnect_frees_the_slot_and_neighbours_do_not_notice(server, client):
    expected = client.completions.create(
        model="tiny", prompt="steady", max_tokens=20, temperature=0, extra_body={"ignore_eos": True}
    )
    result = {}

    def neighbour():
        stream = client.completions.create(
            model="tiny",
            prompt="steady",
            max_tokens=20,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        result["text"] = "".join(c.choices[0].text for c in stream if c.choices)

    thread = threading.Thread(target=neighbour)
    thread.start()
    body = {"prompt": "long", "max_tokens": 100, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        data = 0
        for line in r.iter_lines():
            data += line.startswith("data:")
            if data >= 3:
                break  # leave mid-stream: closing the connection is the disconnect
    thread.join()
    assert result["text"] == expected.choices[0].text
    _wait_metric(server, "jinfer_slots_in_use", 0.0)
    assert (
        _metric(
            server,
            "jinfer_requests_finished_total",
        )
        >= 1
    )
    text = httpx.get(server + "/metrics", headers=AUTH).text
    assert 'jinfer_requests_finished_total{finish_reason="abort"}' in text


def test_many_cancel_cycles_leave_no_trace(server):
    import websockets.sync.client as ws_client

    with ws_client.connect(server.replace("http", "ws") + "/v1/ws", additional_headers=AUTH) as ws:
        for i in range(1000):
            ws.send(
                json.dumps(
                    {"type": "completion", "id": i, "prompt": "x", "max_tokens": 50, "ignore_eos": True}
                )
            )
            ws.send(json.dumps({"type": "cancel", "id": i}))
        done = 0
        while done < 1000:
            message = json.loads(ws.recv(timeout=60))
            if message["type"] == "error":
                assert message["error"]["code"] == "queue_full"  # a burst may overrun the queue
                done += 1
            elif message["type"] == "done":
                assert message["finish_reason"] in ("abort", "length")
                done += 1
    for _ in range(20):  # and HTTP streams dropped after their first token
        with httpx.stream(
            "POST",
            server + "/v1/completions",
            json={"prompt": "x", "stream": True, "max_tokens": 50},
            headers=AUTH,
        ) as r:
            next(line for line in r.iter_lines() if line.startswith("data:"))
    _wait_metric(server, "jinfer_slots_in_use", 0.0)
    assert _metric(server, "jinfer_requests_waiting") == 0.0
    assert _metric(server, "jinfer_requests_running") == 0.0


def test_websocket_two_way_streaming(server):
    import websockets.sync.client as ws_client

    with ws_client.connect(server.replace("http", "ws") + "/v1/ws", additional_headers=AUTH) as ws:
        ws.send(
            json.dumps(
                {
                    "type": "chat",
                    "id": "a",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 5,
                    "temperature": 0,
                }
            )
        )
        ws.send(
            json.dumps(
                {"type": "completion", "id": "b", "prompt": "x", "max_tokens": 100, "ignore_eos": True}
            )
        )
        ws.send(json.dumps({"type": "completion", "id": "c", "prompt": "x", "temperature": -3}))
        finished, tokens = {}, {"a": 0, "b": 0}
        while len(finished) < 3:
            message = json.loads(ws.recv(timeout=60))
            if message["type"] == "token":
                tokens[message["id"]] += len(message["token_ids"])
                if message["id"] == "b" and tokens["b"] == 3:
                    ws.send(json.dumps({"type": "cancel", "id": "b"}))
            elif message["type"] == "done":
                finished[message["id"]] = message["finish_reason"]
            elif message["type"] == "error":
                finished[message["id"]] = message["error"]["message"]
    assert finished["a"] in ("stop", "length") and tokens["a"] >= 1
    assert finished["b"] == "abort" and 3 <= tokens["b"] < 100
    assert "temperature" in finished["c"]
    from websockets.exceptions import InvalidStatus

    with pytest.raises(InvalidStatus):  # the key is required for the WebSocket too
        ws_client.connect(server.replace("http", "ws") + "/v1/ws")


def test_a_crowd_fills_every_slot_at_once_from_a_pool_of_four_sequences(tiny_model):
    """32 requests sent at once to 32 slots whose pool holds 4 full-length sequences: all run at
    once (a slot costs a row of state; their short sequences share the pool), each answer the
    one it gets alone, though the crowd's decode rows shared dispatches with prompt pieces."""
    options = ["--max-slots", "32", "--max-seq-len", "512", "--kv-cache-tokens", "2048"]
    # One decode step a dispatch: the tiny model's early requests must still be running when the
    # last of the 32 arrive (at 4 steps a dispatch they could finish 40 tokens first).
    options += ["--page-size", "16", "--max-num-batched-tokens", "512", "--decode-steps", "1"]
    bodies = [
        {"prompt": f"Member {i} of the crowd says", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        for i in range(32)
    ]
    with running_server(tiny_model("llama_gqa_untied")[0], *options) as (base, _):
        peak, done = [0.0], threading.Event()

        def watch():
            while not done.is_set():
                peak[0] = max(peak[0], _metric(base, "jinfer_requests_running"))
                time.sleep(0.01)

        async def crowd():
            async with httpx.AsyncClient(timeout=120) as http:
                answers = await asyncio.gather(*(http.post(base + "/v1/completions", json=b) for b in bodies))
            return [a.json()["choices"][0]["text"] for a in answers]

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            together = asyncio.run(crowd())
        finally:
            done.set()
            watcher.join()
        mixed = _metric(base, "jinfer_mixed_dispatches_total")
        solo = lambda body: httpx.post(base + "/v1/completions", json=body, timeout=60).json()
        alone = [solo(body)["choices"][0]["text"] for body in bodies]
    assert peak[0] == 32 and mixed > 0
    assert together == alone


# ------------------------------------------------------------------------------- lifecycle
def test_sigterm_drains_then_aborts_and_exits_cleanly(tiny_model, tmp_path):
    # A long window so one request outlasts the 3 s drain while a short one finishes inside it
    # (the tiny model with its position limit raised: default RoPE does not depend on it).
    model = tmp_path / "long-window"
    shutil.copytree(tiny_model("llama_gqa_untied")[0], model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 32768}))
    options = [
        "--max-slots",
        "2",
        "--max-seq-len",
        "32768",
        "--max-num-batched-tokens",
        "128",
        "--drain-timeout",
        "3",
    ]
    # and the buffering policy: up to 4 tokens per event, from dispatches of 4 steps
    options += ["--stream-max-tokens", "4", "--decode-steps", "4"]
    with running_server(str(model), *options) as (base, proc):
        short = {"prompt": "a", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        endless = {"prompt": "b", "max_tokens": 30000, "stream": True, "ignore_eos": True, "logprobs": 0}
        results = {"sizes": []}

        def stream_endless():
            reasons = []
            with httpx.stream("POST", base + "/v1/completions", json=endless, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        choice = json.loads(line[6:])["choices"][0]
                        reasons.append(choice["finish_reason"])
                        results["sizes"].append(len((choice["logprobs"] or {"tokens": []})["tokens"]))
            results["endless"] = reasons[-1]

        def finishing():  # short enough to finish inside the drain window on a loaded machine
            body = {"prompt": "c", "max_tokens": 24, "ignore_eos": True}
            results["finishing"] = httpx.post(base + "/v1/completions", json=body, timeout=60).json()

        endless_thread, finishing_thread = (
            threading.Thread(target=stream_endless),
            threading.Thread(target=finishing),
        )
        endless_thread.start()
        time.sleep(1.0)
        finishing_thread.start()
        # The short request must be admitted before the signal, however slow the machine is (it may
        # even have finished already: it only has to end with "length").
        deadline = time.monotonic() + 30
        while "finishing" not in results and _metric(base, "jinfer_slots_in_use") < 2:
            assert time.monotonic() < deadline, "the short request was never admitted"
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while httpx.get(base + "/ready").status_code != 503:
            assert time.monotonic() < deadline, "the server never reported draining"
            time.sleep(0.02)
        refused = httpx.post(base + "/v1/completions", json=short)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        endless_thread.join(timeout=60)
        finishing_thread.join(timeout=60)
        assert results["finishing"]["choices"][0]["finish_reason"] == "length"
        assert results["endless"] == "abort"
        assert max(results["sizes"]) > 1 and all(n <= 4 for n in results["sizes"])
        assert proc.wait(timeout=60) == 0
