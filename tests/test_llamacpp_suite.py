"""llama.cpp's own server tests, the OpenAI-shaped ones, ported to jinfer.

The nine files of `tools/server/tests/unit/` in the llama-cpp-python 0.3.36 source archive that the
structured-output issue names hold 86 test functions under 85 names (`test_logit_bias` is in two:
the /completion one is llama.cpp's own API, the chat one is ported). `LLAMACPP` says of each name
where jinfer checks the same property: a test here (named after it), a test of another module, or
why it does not apply. Their expectations of text and token counts are those of llama.cpp's stories260K model;
here the same properties are checked on a tiny random model without its words: shapes, the
OpenAI contract, and outputs agreeing with each other (stream and not, same seed, a stop
string). Conventions where jinfer follows OpenAI and llama.cpp does not:

- an unknown model name is a 404 `model_not_found` (llama.cpp answers any name);
- the first stream chunk carries `content: ""` beside the role (llama.cpp: null);
- `system_fingerprint` is "fp_" and a hash of what decides outputs (llama.cpp: its build, "b...");
- a context overflow is `context_length_exceeded` (llama.cpp: `exceed_context_size_error`).
"""

import ast
import json
import pathlib

import httpx
import openai
import pytest
from test_server import AUTH, KEY, TINY_OPTIONS, _post, running_server

ORIGIN = "http://web.example"
BOOK = [{"role": "system", "content": "Book"}, {"role": "user", "content": "What is the best book"}]
PARTS = [{"type": "text", "text": "What is"}, {"type": "text", "text": "the best book"}]
DOWNLOADS = (
    "not ported: downloads real models from Hugging Face; jinfer's tool calls are tested on SmolLM2 in "
)
NATIVE = "not ported: llama.cpp's own /completion API (n_predict, content, slots, timings), not OpenAI's"
HERE = "here"

LLAMACPP = {
    # unit/test_chat_completion.py
    "test_chat_completion": HERE,
    "test_chat_completion_cached_tokens": (
        "test_server.py::test_a_prompt_seen_before_reports_its_cached_tokens_and_the_cache_metrics"
    ),
    "test_chat_completion_stream": HERE,
    "test_chat_completion_with_openai_library": HERE,
    "test_chat_template": "not ported: llama.cpp's --chat-template flag and its debug __verbose prompt echo",
    "test_chat_template_assistant_prefill": "not ported: reads the prompt from llama.cpp's __verbose",
    "test_chat_template_continue_final_message_vllm_compat": "not ported: continue_final_message is "
    "a vLLM extension jinfer does not implement (a 400 naming the field)",
    "test_chat_template_continue_final_message_mutual_exclusion": HERE,
    "test_apply_chat_template": "not ported: llama.cpp's /apply-template endpoint",
    "test_completion_with_response_format": HERE,
    "test_completion_with_json_schema": "not ported: a top-level json_schema field is llama.cpp's; "
    "OpenAI's response_format is tested here (test_completion_with_response_format)",
    "test_completion_with_grammar": HERE,
    "test_completion_with_invalid_grammar": HERE,
    "test_invalid_chat_completion_req": HERE,
    "test_chat_completion_with_timings_per_token": "not ported: llama.cpp's timings_per_token and "
    "timings fields (the usage chunk of stream_options is tested in test_chat_completion_stream)",
    "test_logprobs": HERE,
    "test_logprobs_stream": HERE,
    "test_logit_bias": HERE,
    "test_context_size_exceeded": HERE,
    "test_context_size_exceeded_stream": HERE,
    "test_return_progress": "not ported: llama.cpp's return_progress / prompt_progress stream fields",
    "test_chat_completions_multiple_choices": HERE,
    "test_chat_completions_token_count": "not ported: llama.cpp's /chat/completions/input_tokens",
    "test_verbose_debug": "not ported: llama.cpp's verbose / __verbose debug field",
    # unit/test_completion.py
    "test_completion": NATIVE,
    "test_completion_stream": NATIVE,
    "test_completion_stream_vs_non_stream": "test_server.py::test_completions_stream_and_non_stream_agree",
    "test_completion_with_openai_library": HERE,
    "test_completion_stream_with_openai_library": HERE,
    "test_completion_stream_with_openai_library_stops": HERE,
    "test_consistent_result_same_seed": HERE,
    "test_different_result_different_seed": HERE,
    "test_consistent_result_different_batch_size": "test_smollm2.py::test_batch_invariance_on_smollm2",
    "test_cache_vs_nocache_prompt": (
        "test_paged_engine.py::test_prefix_hits_give_the_tokens_computed_from_scratch"
    ),
    "test_nocache_long_input_prompt": NATIVE,
    "test_json_prompt_no_mtmd": "not ported: llama.cpp's multimodal JSON prompts",
    "test_json_prompt_mtm_error_when_not_supported": "not ported: llama.cpp's multimodal JSON prompts",
    "test_completion_with_tokens_input": "test_server.py::test_echo_and_token_id_prompts",
    "test_completion_parallel_slots": "not ported: llama.cpp's /slots endpoint",
    "test_completion_unified": "not ported: llama.cpp's --kv-unified flag and /completion",
    "test_completion_response_fields": NATIVE,
    "test_n_probs": NATIVE,
    "test_n_probs_stream": NATIVE,
    "test_n_probs_post_sampling": NATIVE,
    "test_n_probs_post_backend_sampling": NATIVE,
    "test_cancel_request": "test_server.py::test_disconnect_frees_the_slot_and_neighbours_do_not_notice",
    "test_completion_prompt_cache": NATIVE,
    # unit/test_basic.py
    "test_server_start_simple": "test_llamacpp_suite.py::test_access_public_endpoint",
    "test_server_multiple_addresses": "not ported: llama.cpp's several --host addresses",
    "test_server_props": "not ported: llama.cpp's /props endpoint",
    "test_server_models": HERE,
    "test_server_slots": "not ported: llama.cpp's /slots endpoint",
    "test_load_split_model": "not ported: downloads a split model from Hugging Face",
    "test_no_ui": "not ported: jinfer has no web page yet (the playground issue)",
    "test_server_model_aliases_and_tags": "not ported: llama.cpp's model aliases and tags",
    # unit/test_compat_oai_responses.py
    "test_responses_with_openai_library": HERE,
    "test_responses_stream_with_openai_library": HERE,
    "test_responses_stream_with_llama_telemetry": "not ported: llama.cpp's telemetry stream fields",
    # unit/test_stream.py: llama.cpp's multi-model router and its resumable streams
    "test_stream_resume_and_stop_with_slashed_model_name": "not ported: llama.cpp's router /v1/stream",
    "test_stream_stop_during_model_load": "not ported: llama.cpp's router, models loaded on demand",
    "test_stream_resumes_after_reload_during_model_load": "not ported: llama.cpp's router",
    # unit/test_ignore_eos.py
    "test_ignore_eos_populates_logit_bias": "not ported: llama.cpp's generation_settings echo",
    "test_ignore_eos_false_no_logit_bias": "not ported: llama.cpp's generation_settings echo",
    # unit/test_security.py
    "test_access_public_endpoint": HERE,
    "test_access_static_assets_without_api_key": "not ported: jinfer has no web page yet",
    "test_incorrect_api_key": HERE,
    "test_correct_api_key": HERE,
    "test_correct_api_key_anthropic_header": "not ported: Anthropic's X-Api-Key header",
    "test_openai_library_correct_api_key": HERE,
    "test_cors_options": HERE,
    "test_cors_origins_localhost_reflects": "not ported: llama.cpp's 'localhost' origin keyword "
    "(listed origins are reflected: test_cors_options)",
    "test_cors_origins_localhost_rejects": HERE,
    "test_cors_origins_defaults_to_localhost_with_tools_enabled": "not ported: llama.cpp's built-in tools",
    "test_cors_proxy_only_forwards_explicit_proxy_headers": "not ported: llama.cpp's /cors-proxy",
    "test_local_media_file": "not ported: llama.cpp's multimodal media files",
    # unit/test_tokenize.py: llama.cpp's /tokenize takes `content`; jinfer's is vLLM's shape
    "test_tokenize_detokenize": "test_server.py::test_tokenize_and_detokenize",
    "test_tokenize_with_bos": "not ported: llama.cpp's /tokenize shape (with_pieces, content)",
    "test_tokenize_with_pieces": "not ported: llama.cpp's /tokenize shape (with_pieces, content)",
    # unit/test_tool_call.py
    "test_completion_with_required_tool_real_model": DOWNLOADS
    + "test_structured_server.py::test_required_and_named_tool_choices_give_valid_calls",
    "test_completion_without_tool_call_fast": HERE,
    "test_completion_without_tool_call_slow": DOWNLOADS + "test_completion_without_tool_call_fast",
    "test_weather": DOWNLOADS + "test_structured_server.py::test_a_tool_round_trip_ends_in_an_answer",
    "test_calc_result": DOWNLOADS + "test_structured_server.py::test_a_tool_round_trip_ends_in_an_answer",
    "test_thoughts": "not ported: downloads a reasoning model; jinfer has no reasoning_content parser",
    "test_hello_world": DOWNLOADS + "test_structured_server.py::test_auto_answers_with_text_or_valid_calls",
}


def test_every_mapped_test_exists():
    """Each llama.cpp test is accounted for, and every test it points at is one that exists."""
    assert len(LLAMACPP) == 85
    here = pathlib.Path(__file__).parent
    defined = {}
    for path in here.glob("test_*.py"):
        tree = ast.parse(path.read_text())
        defined[path.name] = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    for name, where in LLAMACPP.items():
        for target in [word for word in where.split() if "::" in word]:
            module, function = target.split("::")
            assert function in defined[module], (name, target)
        if where == HERE:
            assert name in defined[pathlib.Path(__file__).name], name
        else:
            assert "::" in where or where.startswith("not ported: "), (name, where)


@pytest.fixture(scope="module")
def server(tiny_model):
    path = tiny_model("llama_gqa_untied")[0]
    options = [*TINY_OPTIONS, "--max-queue", "8", "--cors-origins", ORIGIN]
    with running_server(path, *options) as (base, _):
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


def chat(server: str, **body) -> httpx.Response:
    return _post(server, "/v1/chat/completions", json_body={"model": "tiny", "messages": BOOK, **body})


# ------------------------------------------------------------------------ unit/test_chat_completion.py
@pytest.mark.parametrize("user", ["What is the best book", PARTS])
def test_chat_completion(server, user):
    messages = [BOOK[0], {"role": "user", "content": user}]
    body = {"model": "tiny", "max_tokens": 8, "temperature": 0, "messages": messages}  # fixed: no early eos
    reply = _post(server, "/v1/chat/completions", json_body=body)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["id"].startswith("chatcmpl-") and body["system_fingerprint"].startswith("fp_")
    prompt = _post(server, "/tokenize", json_body={"model": "tiny", "messages": messages}).json()["tokens"]
    assert body["usage"]["prompt_tokens"] == len(prompt)
    assert body["usage"]["completion_tokens"] == 8
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"


def test_chat_completion_stream(server, client):
    whole = client.chat.completions.create(model="tiny", messages=BOOK, max_tokens=8, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=BOOK,
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert len({c.id for c in chunks}) == 1 and all(c.model == "tiny" for c in chunks)
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in with_choices[1:])
    finish = with_choices[-1].choices[0]
    assert finish.finish_reason == "length" and not finish.delta.content
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == whole.choices[0].message.content
    usage = chunks[-1].usage
    assert not chunks[-1].choices and usage.completion_tokens == 8
    assert usage.prompt_tokens == whole.usage.prompt_tokens


def test_chat_completion_with_openai_library(client):
    asked = dict(model="tiny", messages=BOOK, max_tokens=8, seed=42, temperature=0.8)
    first, again = (client.chat.completions.create(**asked) for _ in range(2))
    assert first.system_fingerprint.startswith("fp_") and first.choices[0].finish_reason == "length"
    assert first.choices[0].message.content is not None
    assert again.choices[0].message.content == first.choices[0].message.content
    with pytest.raises(openai.NotFoundError):  # OpenAI's answer to a model the server does not serve
        client.chat.completions.create(**{**asked, "model": "gpt-3.5-turbo-instruct"})


def test_chat_template_continue_final_message_mutual_exclusion(server):
    reply = chat(server, max_tokens=8, add_generation_prompt=True, continue_final_message=True)
    assert reply.status_code == 400 and "error" in reply.json()


@pytest.mark.parametrize(
    "response_format, content",
    [
        ({"type": "json_schema", "json_schema": {"name": "c", "schema": {"const": "foooooo"}}}, '"foooooo"'),
        ({"type": "json_schema", "json_schema": {"name": "c", "schema": {"const": "42"}}}, '"42"'),
        ({"type": "json_object"}, "{"),  # an object begins, whatever this model writes in it
        ({"type": "sound"}, None),
        ({"type": "json_schema", "json_schema": {"name": "c", "schema": 123}}, None),
        ({"type": "json_schema", "json_schema": {"name": "c", "schema": {"type": 123}}}, None),
        ({"type": "json_schema", "json_schema": {"name": "c", "schema": {"type": "hiccup"}}}, None),
    ],
)
def test_completion_with_response_format(server, response_format, content):
    reply = chat(server, max_tokens=10, response_format=response_format)
    if content is None:
        assert reply.status_code == 400 and "error" in reply.json(), reply.text
        return
    assert reply.status_code == 200, reply.text
    text = reply.json()["choices"][0]["message"]["content"]
    assert text == content if content != "{" else text.startswith("{"), text


def test_completion_with_grammar(server):
    reply = chat(server, max_tokens=6, grammar='root ::= "a"{5,5}')
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["message"]["content"] == "aaaaa" and choice["finish_reason"] == "stop"


def test_completion_with_invalid_grammar(server):
    reply = chat(server, max_tokens=8, grammar="root ::= this is (not valid GBNF")
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "grammar", reply.text


@pytest.mark.parametrize(
    "messages",
    [
        None,
        "string",
        [123],
        [{}],
        [{"role": 123}],
        [{"role": "system", "content": 123}],
        [{"role": "system", "content": "test"}, {}],
    ],
)  # llama.cpp also refuses two assistant messages in a row; jinfer, like OpenAI, takes them
def test_invalid_chat_completion_req(server, messages):
    reply = _post(server, "/v1/chat/completions", json_body={"model": "tiny", "messages": messages})
    assert reply.status_code == 400 and "error" in reply.json(), reply.text


def _logprob_bytes(tokens) -> bytes:
    """The tokens' bytes (a random model writes parts of characters: their `token` is "bytes:\\x..",
    as OpenAI names them, so the text is rebuilt from the bytes, not the names)."""
    for token in tokens:
        assert token.logprob <= 0.0 and token.bytes is not None and len(token.top_logprobs) == 10
    return b"".join(bytes(t.bytes) for t in tokens)


def test_logprobs(client):
    res = client.chat.completions.create(
        model="tiny", messages=BOOK, max_tokens=5, temperature=0, logprobs=True, top_logprobs=10
    )
    rebuilt = _logprob_bytes(res.choices[0].logprobs.content).decode(errors="replace")
    assert rebuilt == res.choices[0].message.content


def test_logprobs_stream(client):
    stream = client.chat.completions.create(
        model="tiny", messages=BOOK, max_tokens=5, temperature=0, logprobs=True, top_logprobs=10, stream=True
    )
    text, from_logprobs = "", b""
    for chunk in stream:
        choice = chunk.choices[0]
        text += choice.delta.content or ""
        if choice.logprobs is not None:
            from_logprobs += _logprob_bytes(choice.logprobs.content)
    assert text and from_logprobs.decode(errors="replace") == text


def test_logit_bias(server, client):
    """A bias of +100 from the client makes one token the only one drawn; -100 on it forbids it."""
    token = _post(
        server, "/tokenize", json_body={"model": "tiny", "prompt": "book", "add_special_tokens": False}
    )
    token = token.json()["tokens"][0]
    word = _post(server, "/detokenize", json_body={"model": "tiny", "tokens": [token]}).json()["prompt"]
    forced = client.chat.completions.create(
        model="tiny", messages=BOOK, max_tokens=6, temperature=0, logit_bias={str(token): 100}
    )
    assert forced.choices[0].message.content == word * 6
    banned = client.chat.completions.create(
        model="tiny",
        messages=BOOK,
        max_tokens=32,
        temperature=1.0,
        seed=1,
        logprobs=True,
        logit_bias={str(token): -100},
    )
    drawn = [bytes(t.bytes) for t in banned.choices[0].logprobs.content]
    assert len(drawn) == 32 and word.encode() not in drawn  # no other token has the same bytes


def test_context_size_exceeded(server):
    reply = chat(server, messages=BOOK * 100)
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "context_length_exceeded", reply.text


def test_context_size_exceeded_stream(client):
    with pytest.raises(openai.BadRequestError) as refused:
        list(client.chat.completions.create(model="tiny", messages=BOOK * 100, stream=True))
    assert refused.value.code == "context_length_exceeded"


def test_chat_completions_multiple_choices(server):
    for _ in range(2):
        reply = chat(server, max_tokens=8, n=2, seed=7)  # seeded: the same tokens every run
        assert reply.status_code == 200, reply.text
        choices = reply.json()["choices"]
        assert [c["index"] for c in choices] == [0, 1]
        assert all(c["message"]["role"] == "assistant" and c["finish_reason"] == "length" for c in choices)


# ------------------------------------------------------------------------- unit/test_completion.py
PROMPT = "I believe the meaning of life is"


def test_completion_with_openai_library(client):
    res = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, seed=42)
    assert res.system_fingerprint.startswith("fp_") and res.choices[0].finish_reason == "length"
    assert res.choices[0].text is not None and res.usage.completion_tokens == 8


def test_completion_stream_with_openai_library(client):
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == whole.choices[0].text


def test_completion_stream_with_openai_library_stops(client):
    """A stop string from the middle of the greedy answer ends the stream just before it."""
    whole = (
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    )
    stop = whole[len(whole) // 2 : len(whole) // 2 + 3]
    stream = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop], stream=True
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks)
    assert text == whole[: whole.index(stop)] and chunks[-1].choices[0].finish_reason == "stop"


def test_consistent_result_same_seed(client):
    texts = {
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=1.0, seed=42)
        .choices[0]
        .text
        for _ in range(3)
    }
    assert len(texts) == 1


def test_different_result_different_seed(client):
    texts = {
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=1.0, seed=seed)
        .choices[0]
        .text
        for seed in (42, 43, 44)
    }
    assert len(texts) == 3


# ------------------------------------------------------------------------------ unit/test_basic.py
def test_server_models(server):
    for path in ("/v1/models", "/models"):
        models = httpx.get(server + path, headers=AUTH).json()["data"]
        assert [m["id"] for m in models] == ["tiny"]


# ---------------------------------------------------------------- unit/test_compat_oai_responses.py
def test_responses_with_openai_library(client):
    res = client.responses.create(model="tiny", input=BOOK, max_output_tokens=8, temperature=0)
    assert res.id.startswith("resp_") and res.output[0].id.startswith("msg_")
    assert res.output_text and res.status == "incomplete"  # max_output_tokens ran out


def test_responses_stream_with_openai_library(client):
    stream = client.responses.create(
        model="tiny", input=BOOK, max_output_tokens=8, temperature=0, stream=True
    )
    gathered, response_id, message_id, completed = "", None, None, None
    for event in stream:
        if event.type == "response.created":
            response_id = event.response.id
        elif event.type == "response.in_progress":
            assert event.response.id == response_id
        elif event.type in ("response.output_item.added", "response.output_item.done"):
            message_id = message_id or event.item.id
            assert event.item.id == message_id
        elif event.type.startswith(("response.content_part.", "response.output_text.")):
            assert event.item_id == message_id
            gathered += event.delta if event.type == "response.output_text.delta" else ""
        elif event.type in ("response.completed", "response.incomplete"):
            completed = event.response
    assert response_id.startswith("resp_") and message_id.startswith("msg_")
    assert completed.id == response_id and completed.output[0].id == message_id
    assert gathered and gathered == completed.output_text


# ---------------------------------------------------------------------------- unit/test_security.py
def test_access_public_endpoint(server):
    reply = httpx.get(server + "/health")  # no key
    assert reply.status_code == 200


@pytest.mark.parametrize("key", [None, "invalid-key"])
def test_incorrect_api_key(server, key):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    reply = _post(server, "/completions", json_body={"model": "tiny", "prompt": PROMPT}, headers=headers)
    assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"


def test_correct_api_key(server):
    reply = _post(server, "/completions", json_body={"model": "tiny", "prompt": PROMPT})
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] is not None


def test_openai_library_correct_api_key(server):
    client = openai.OpenAI(api_key=KEY, base_url=server, max_retries=0)  # the routes without /v1
    res = client.chat.completions.create(model="tiny", messages=BOOK, max_tokens=4)
    assert len(res.choices) == 1


def _preflight(server: str, origin: str) -> httpx.Response:
    headers = {"Origin": origin, "Access-Control-Request-Method": "POST"}
    return httpx.options(
        server + "/completions", headers={**headers, "Access-Control-Request-Headers": "Authorization"}
    )


def test_cors_options(server):
    reply = _preflight(server, ORIGIN)
    assert reply.status_code == 200 and reply.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "POST" in reply.headers["Access-Control-Allow-Methods"]
    assert "authorization" in reply.headers["Access-Control-Allow-Headers"].lower()


@pytest.mark.parametrize("origin", ["http://evil.com", "http://web.example.evil.com", "http://localhost"])
def test_cors_origins_localhost_rejects(server, origin):
    assert "Access-Control-Allow-Origin" not in _preflight(server, origin).headers


# --------------------------------------------------------------------------- unit/test_tool_call.py
TEST_TOOL = {
    "type": "function",
    "function": {
        "name": "test",
        "description": "",
        "parameters": {
            "type": "object",
            "properties": {"success": {"type": "boolean", "const": True}},
            "required": ["success"],
        },
    },
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tools, tool_choice", [([], None), ([TEST_TOOL], "none")])
def test_completion_without_tool_call_fast(server, tools, tool_choice, stream):
    body = {"max_tokens": 16, "messages": [{"role": "user", "content": "say hello world with python"}]}
    body |= {"tools": tools} if tools else {}
    body |= {"tool_choice": tool_choice} if tool_choice else {}
    reply = _post(server, "/v1/chat/completions", json_body={"model": "tiny", "stream": stream, **body})
    assert reply.status_code == 200, reply.text
    if not stream:
        message = reply.json()["choices"][0]["message"]
        assert message.get("tool_calls") is None
        return
    events = [json.loads(line[6:]) for line in reply.text.splitlines() if line.startswith("data: {")]
    assert events and all("tool_calls" not in e["choices"][0]["delta"] for e in events if e["choices"])
