"""The OpenAI surface beyond generation itself, through the real server and the official client:
model lookup, usage details, the stream's finish chunk, fields jinfer refuses rather than ignores,
content parts, CORS, and the reproducibility record (system_fingerprint, and the seed an unseeded
request was given)."""

import json

import httpx
import numpy as np
import openai
import pytest
from test_server import AUTH, KEY, TINY_OPTIONS, running_server

ORIGIN = "http://app.example"


@pytest.fixture(scope="module")
def servers(tiny_model):
    """Two servers of the same model and settings, the second also allowing ORIGIN (CORS), and the
    first one's log file."""
    path = tiny_model("llama_gqa_untied")[0]
    options = [*TINY_OPTIONS, "--max-queue", "8"]  # room for a request's choices past the 2 slots
    with (
        running_server(path, *options) as (first, process),
        running_server(path, *options, "--cors-origins", ORIGIN) as (second, _),
    ):
        yield first, second, process.log_path


@pytest.fixture(scope="module")
def client(servers):
    return openai.OpenAI(base_url=servers[0] + "/v1", api_key=KEY, max_retries=0)


def test_a_model_is_found_by_its_id_and_another_is_a_404(client):
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-4o")
    assert caught.value.body["code"] == "model_not_found"


def test_an_unseeded_answer_is_reproduced_from_its_fingerprint_and_reported_seed(servers, client):
    ask = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 1.0, "n": 2}
    first = client.completions.create(**ask)
    seed = first.model_extra["jinfer"]["seed"]
    assert first.system_fingerprint.startswith("fp_") and isinstance(seed, int)
    other = openai.OpenAI(base_url=servers[1] + "/v1", api_key=KEY, max_retries=0)
    again = other.completions.create(**ask, seed=seed)  # another server, the same fingerprint
    assert again.system_fingerprint == first.system_fingerprint
    assert [c.text for c in again.choices] == [c.text for c in first.choices]
    assert first.choices[0].text != first.choices[1].text  # choice i has seed + i
    chunks = list(client.completions.create(**ask, seed=seed, stream=True))
    assert {c.system_fingerprint for c in chunks} == {first.system_fingerprint}


def test_usage_details_and_the_empty_finish_delta(client):
    messages = [{"role": "user", "content": "Hello"}]
    answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0)
    assert answer.usage.completion_tokens_details.reasoning_tokens == 0
    assert answer.usage.prompt_tokens_details.cached_tokens >= 0
    chunks = [
        c
        for c in client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=6, temperature=0, stream=True
        )
        if c.choices
    ]
    last = chunks[-1].choices[0]
    assert last.finish_reason == "length" and last.delta.content is None and last.delta.tool_calls is None
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == answer.choices[0].message.content
    texts = [
        c.choices[0]
        for c in client.completions.create(
            model="tiny", prompt="Hi", max_tokens=4, stream=True, extra_body={"ignore_eos": True}
        )
    ]
    assert texts[-1].text == "" and texts[-1].finish_reason == "length"


@pytest.mark.parametrize(
    "path, body, param",
    [
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
            "top_logprobs",
        ),
        ("/v1/completions", {"prompt": "x", "suffix": " the end"}, "suffix"),
        ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
        ("/v1/completions", {"prompt": "x", "tools": []}, "tools"),
    ],
)
def test_fields_jinfer_does_not_implement_are_400s_not_silence(servers, path, body, param):
    reply = httpx.post(servers[0] + path, json={"model": "tiny", "max_tokens": 2, **body}, headers=AUTH)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param


def test_best_of_equal_to_n_and_n_past_the_slots_are_fine(client):
    answer = client.completions.create(model="tiny", prompt="x", max_tokens=2, n=3, best_of=3, temperature=0)
    assert len(answer.choices) == 3  # 2 slots: the third choice waits for one


def test_text_parts_are_separate_pieces_of_text(servers):
    def ids(content):
        body = {"messages": [{"role": "user", "content": content}]}
        return httpx.post(servers[0] + "/tokenize", json=body, headers=AUTH).json()["tokens"]

    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "the best"}]
    assert ids(parts) == ids("What is\nthe best")


def test_cors_is_off_unless_origins_are_allowed_and_preflights_need_no_key(servers):
    preflight = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    allowed = httpx.options(servers[1] + "/v1/chat/completions", headers=preflight)
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
    models = httpx.get(servers[1] + "/v1/models", headers={**AUTH, "Origin": ORIGIN})
    assert models.headers["access-control-allow-origin"] == ORIGIN
    stranger = httpx.options(
        servers[1] + "/v1/chat/completions", headers={**preflight, "Origin": "http://evil.example"}
    )
    assert "access-control-allow-origin" not in stranger.headers
    assert (
        "access-control-allow-origin"
        not in httpx.get(servers[0] + "/v1/models", headers={**AUTH, "Origin": ORIGIN}).headers
    )
    assert (
        httpx.options(servers[0] + "/v1/chat/completions", headers=preflight).status_code == 401
    )  # no CORS there


def test_logprob_bytes_rebuild_the_text_and_parts_of_characters_keep_distinct_names(client):
    """The tiny model's vocabulary has a token per byte: sampled, its output is full of parts of
    characters, whose bytes must still add up to the text."""
    answer = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Grüße, 東京"}],
        max_tokens=40,
        temperature=1.0,
        seed=3,
        logprobs=True,
        top_logprobs=5,
    ).choices[0]
    entries = answer.logprobs.content
    rebuilt = b"".join(bytes(e.bytes) for e in entries)
    assert rebuilt.decode("utf-8", errors="replace") == answer.message.content
    assert any(e.token.startswith("bytes:") for e in entries)  # the test saw parts of characters
    assert all(len({t.token for t in e.top_logprobs}) == 5 for e in entries)
    legacy = client.completions.create(
        model="tiny", prompt="Grüße", max_tokens=40, temperature=1.0, seed=3, logprobs=5
    )
    assert all(len(top) == 5 for top in legacy.choices[0].logprobs.top_logprobs)


def test_processed_logprobs_over_http_list_only_the_tokens_a_draw_could_take(servers, client):
    """`logprobs_mode` (a jinfer extra, per request): "processed" log-probs are of the tempered,
    top-k-cut distribution the token was drawn from, so two alternatives at most where top_k is 2,
    and the tokens are those of raw mode; anything else is a 400 naming the field."""
    ask = {"model": "tiny", "prompt": "Grüße", "max_tokens": 12, "temperature": 0.8, "seed": 5, "logprobs": 5}
    raw = client.completions.create(**ask, extra_body={"top_k": 2}).choices[0]
    processed = client.completions.create(**ask, extra_body={"top_k": 2, "logprobs_mode": "processed"})
    choice = processed.choices[0]
    assert choice.text == raw.text
    assert all(1 <= len(top) <= 2 for top in choice.logprobs.top_logprobs)
    assert all(len(top) == 5 for top in raw.logprobs.top_logprobs)
    for top, chosen in zip(choice.logprobs.top_logprobs, choice.logprobs.token_logprobs, strict=True):
        assert chosen in top.values() and abs(np.logaddexp.reduce(list(top.values()))) < 1e-5
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2, "logprobs_mode": "processed_logits"}
    reply = httpx.post(servers[0] + "/v1/completions", json=body, headers=AUTH)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "logprobs_mode"


def test_update_weights_over_http_swaps_the_weights_a_request_runs_on(servers, client, tiny_model, tmp_path):
    """POST /v1/update_weights `{"path"}` (behind the API key) serves the weights read there from
    the next request on, reported in the model card; the first weights back give the first answers
    again. A path that holds no model, or another model's weights, is a 400 and changes nothing."""
    import tiny

    first = servers[0]
    other = str(tmp_path / "other")
    tiny.build_hf_model("llama_gqa_untied", other, seed=1)  # the same shapes, other values
    ask = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0}
    post = lambda body, headers=AUTH: httpx.post(first + "/v1/update_weights", json=body, headers=headers)
    before = client.completions.create(**ask).choices[0].text
    assert post({"path": other}, headers={}).status_code == 401
    version = client.models.retrieve("tiny").model_extra["weights_version"]
    reply = post({"path": other})
    assert reply.status_code == 200 and reply.json()["weights_version"] == version + 1
    assert client.models.retrieve("tiny").model_extra["weights_version"] == version + 1
    answer = client.completions.create(**ask)
    after = answer.choices[0].text
    assert after != before and answer.model_extra["jinfer"]["timings"][0]["weights_version"] == version + 1
    another_model = tiny_model("llama3_rope_tied")[0]  # tied embeddings: another tree
    for bad in ({"path": str(tmp_path / "nothing")}, {"path": another_model}, {"model": "tiny"}):
        reply = post(bad)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "path", reply.text
    assert client.completions.create(**ask).choices[0].text == after
    assert post({"path": tiny_model("llama_gqa_untied")[0]}).status_code == 200
    assert client.completions.create(**ask).choices[0].text == before


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_up_over_http(servers, client, tiny_model, level):
    """POST /sleep (behind the API key): generation is a 503 with Retry-After, /health says it
    sleeps and /ready is a 503; POST /wake_up serves the same answer again. After level 2 the
    weights come back through POST /v1/update_weights: waking before that is a 409."""
    first = servers[0]
    post = lambda path, body=None: httpx.post(first + path, json=body, headers=AUTH)
    ask = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    before = client.completions.create(**ask).choices[0].text
    assert httpx.post(first + "/sleep", json={"level": level}).status_code == 401
    assert post("/sleep", {"level": 3}).status_code == 400
    assert post("/sleep", {"level": level}).json() == {"status": "sleeping", "level": level}
    refused = httpx.post(first + "/v1/completions", json=ask, headers=AUTH)
    assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
    assert refused.json()["error"]["code"] == "sleeping"
    assert httpx.get(first + "/health").json()["status"] == "sleeping"
    assert httpx.get(first + "/ready").status_code == 503
    if level == 2:
        assert post("/wake_up").status_code == 409
        assert post("/v1/update_weights", {"path": tiny_model("llama_gqa_untied")[0]}).status_code == 200
    assert post("/wake_up").json() == {"status": "ready"}
    assert httpx.get(first + "/ready").status_code == 200
    assert client.completions.create(**ask).choices[0].text == before


def test_a_list_of_prompts_gets_n_choices_each_in_order(client):
    prompts = ["Once upon a time", [5, 6, 7, 8]]
    ask = {"model": "tiny", "max_tokens": 6, "temperature": 0}
    alone = [client.completions.create(prompt=p, **ask) for p in prompts]
    both = client.completions.create(prompt=prompts, n=2, echo=True, **ask)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    for p, solo in enumerate(alone):
        echoed = prompts[p] if isinstance(prompts[p], str) else None
        for choice in both.choices[2 * p : 2 * p + 2]:
            assert choice.text.endswith(solo.choices[0].text)
            assert echoed is None or choice.text == echoed + solo.choices[0].text
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(prompt=prompts, stream=True, **ask):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == {0: alone[0].choices[0].text, 1: alone[1].choices[0].text}


@pytest.mark.parametrize(
    "path, extra, status",
    [
        ("/v1/chat/completions", {"temprature": 0.5}, 400),  # a typo is not silently ignored
        ("/v1/chat/completions", {"audio": {"voice": "alloy"}}, 400),
        ("/v1/chat/completions", {"modalities": ["text", "audio"]}, 400),
        ("/v1/completions", {"top_logprobs": 2}, 400),  # a chat field on the legacy endpoint
        ("/v1/chat/completions", {"modalities": ["text"], "metadata": {"k": "v"}, "store": True}, 200),
        ("/v1/completions", {"service_tier": "auto", "user": "u1"}, 200),
        ("/v1/chat/completions", {"reasoning_effort": "low", "verbosity": "high"}, 200),
        ("/v1/chat/completions", {"reasoning_effort": "max"}, 400),
        ("/v1/chat/completions", {"verbosity": 3}, 400),
        ("/v1/chat/completions", {"chat_template_kwargs": {"enable_thinking": False}}, 200),
        ("/v1/chat/completions", {"chat_template_kwargs": {"messages": []}}, 400),
        ("/v1/chat/completions", {"add_generation_prompt": "yes"}, 400),
        ("/v1/chat/completions", {"continue_final_message": True}, 400),  # the last message is the user's
        ("/v1/completions", {"chat_template_kwargs": {}}, 400),  # chats only
        ("/v1/chat/completions", {"response_format": {"type": "json_object", "schema": 123}}, 400),
        ("/v1/chat/completions", {"response_format": {"type": "text", "json_schema": {}}}, 400),
        (
            "/v1/chat/completions",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {}, "strict": 1},
                }
            },
            400,
        ),
        ("/v1/chat/completions", {"guided_choice": []}, 400),
        ("/v1/chat/completions", {"guided_json": "{not json"}, 400),
        ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["b"]}}, 400),
        ("/v1/completions", {"structured_outputs": {"shape": "a"}}, 400),
        ("/v1/completions", {"regex": "a+", "guided_regex": "b+"}, 400),  # two constraints
        ("/v1/completions", {"priority": -3}, 200),
        ("/v1/chat/completions", {"priority": 2**31}, 400),
        ("/v1/completions", {"priority": "high"}, 400),
    ],
)
def test_unknown_fields_are_400s_and_no_effect_fields_are_accepted(servers, path, extra, status):
    base = {"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"}
    reply = httpx.post(
        servers[0] + path, json={"model": "tiny", "max_tokens": 2, **base, **extra}, headers=AUTH
    )
    assert reply.status_code == status, reply.text
    if status == 400:
        assert reply.json()["error"]["param"] == list(extra)[-1]


def test_vllm_constraint_fields_hold_the_output_as_their_jinfer_spellings_do(servers, client):
    ask = {"model": "tiny", "prompt": "Pick", "max_tokens": 12, "temperature": 1.0}
    choices = ["red", 'say "hi"', "é\\n"]
    for seed in range(6):
        for extra in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
            text = client.completions.create(**ask, seed=seed, extra_body=extra).choices[0].text
            assert text in choices
        regex = client.completions.create(**ask, seed=seed, extra_body={"guided_regex": "[ab]{3}"}).choices[0]
        own = client.completions.create(**ask, seed=seed, extra_body={"regex": "[ab]{3}"}).choices[0]
        assert regex.text == own.text and len(regex.text) == 3
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        for extra in ({"guided_json": schema}, {"structured_outputs": {"json": json.dumps(schema)}}):
            answer = client.completions.create(**ask | {"max_tokens": 40}, seed=seed, extra_body=extra)
            if answer.choices[0].finish_reason == "stop":
                assert set(json.loads(answer.choices[0].text)) == {"n"}  # closed: no other key


def test_a_request_id_is_answered_and_tags_the_logs(servers):
    base, log_path = servers[0], servers[2]
    body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
    given = httpx.post(base + "/v1/completions", json=body, headers=AUTH | {"X-Request-Id": "trace-42"})
    assert given.headers["x-request-id"] == "trace-42"
    fresh = httpx.post(base + "/v1/completions", json=body, headers=AUTH)
    made = fresh.headers["x-request-id"]
    assert len(made) == 32 and made != "trace-42"
    forged = httpx.post(base + "/v1/completions", json=body, headers=AUTH | {"X-Request-Id": "a b\tc"})
    assert forged.headers["x-request-id"] not in ("a b\tc", made)  # blanks could forge a log line
    refused = httpx.post(base + "/v1/completions", json=body, headers={"X-Request-Id": "no-key"})
    assert refused.status_code == 401 and refused.headers["x-request-id"] == "no-key"
    with open(log_path) as log:
        logged = log.read()
    assert "[trace-42]: completion: 1 choices" in logged and f"[{made}]: completion" in logged


def test_echo_with_logprobs_scores_the_prompt_as_llm_score_does(servers, client, tiny_model):
    """What evaluation harnesses send for a text's log-likelihood: echo, logprobs, max_tokens 0."""
    import numpy as np

    import jinfer

    prompt = [5, 17, 42, 99, 7, 250]
    scored = client.completions.create(model="tiny", prompt=prompt, echo=True, logprobs=3, max_tokens=0)
    logprobs = scored.choices[0].logprobs
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert scored.usage.completion_tokens == 0 and scored.choices[0].finish_reason == "length"
    llm = jinfer.LLM(tiny_model("llama_gqa_untied")[0], max_slots=1, max_seq_len=128)
    np.testing.assert_allclose(logprobs.token_logprobs[1:], llm.score([prompt])[0], atol=1e-4)
    assert all(len(top) == 3 for top in logprobs.top_logprobs[1:])
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0
    generated = client.completions.create(
        model="tiny", prompt=prompt, echo=True, logprobs=2, max_tokens=4, temperature=0
    )
    both = generated.choices[0].logprobs
    assert len(both.tokens) == len(prompt) + 4 and both.token_logprobs[1:6] == pytest.approx(
        logprobs.token_logprobs[1:]
    )
    streamed = [
        c.choices[0]
        for c in client.completions.create(
            model="tiny", prompt=prompt, echo=True, logprobs=2, max_tokens=4, temperature=0, stream=True
        )
    ]
    assert streamed[0].logprobs.token_logprobs[1:] == pytest.approx(logprobs.token_logprobs[1:])


def test_the_token_that_ends_an_answer_is_scored_as_evaluation_harnesses_expect(servers, client):
    """lm-eval's local-completions sends echo, logprobs 1, max_tokens 1 and sums token_logprobs
    from the context's end to the last entry but one: the last must be the generated token, an end
    of sequence too. Its remote tokenizer reads /tokenizer_info and encodes with /tokenize."""
    info = httpx.get(servers[0] + "/tokenizer_info", headers=AUTH).json()
    assert info["model_max_length"] == 128 and info["eos_token"] and info["chat_template"]
    assert httpx.get(servers[0] + "/tokenizer_info").status_code == 401  # behind the API key
    encoded = httpx.post(
        servers[0] + "/tokenize",
        json={"prompt": info["eos_token"], "add_special_tokens": False},
        headers=AUTH,
    ).json()["tokens"]
    assert encoded == info["eos_token_ids"][:1]
    prompt, ends = [5, 17, 42, 99, 7, 250], {str(encoded[0]): 100}
    ask = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0, "logit_bias": ends}
    echoed = client.completions.create(**ask, echo=True, logprobs=1)
    choice, scored = (
        echoed.choices[0],
        client.completions.create(**{**ask, "max_tokens": 0}, echo=True, logprobs=1),
    )
    assert choice.finish_reason == "stop" and echoed.usage.completion_tokens == 1
    assert choice.logprobs.tokens[-1] == info["eos_token"] and len(choice.logprobs.tokens) == len(prompt) + 1
    assert choice.text == scored.choices[0].text  # the prompt, the end adding no text
    alone = client.completions.create(**ask, logprobs=1).choices[0].logprobs
    assert alone.token_logprobs == choice.logprobs.token_logprobs[-1:] and alone.tokens == [info["eos_token"]]
    quiet = client.completions.create(**ask, echo=True)  # echo without logprobs: the text, nothing counted
    assert quiet.choices[0].text == choice.text and quiet.choices[0].logprobs is None
    assert quiet.usage.completion_tokens == 0


def test_the_openai_routes_answer_without_the_v1_prefix_too(servers):
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    for path, body in (
        ("/chat/completions", chat),
        ("/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2}),
    ):
        assert httpx.post(servers[0] + path, json=body, headers=AUTH).status_code == 200
    assert httpx.get(servers[0] + "/models", headers=AUTH).json()["data"][0]["id"] == "tiny"
