"""Structured output through the real server and the official `openai` client, on SmolLM2:
`response_format` (json_object, json_schema, `client.chat.completions.parse`), jinfer's `regex`
and `grammar` fields, their streaming, and their bad input."""

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pydantic
import pytest
from test_server import running_server
from test_tools import TOOLS

SCHEMAS = {
    "nested objects": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "location": {
                "type": "object",
                "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                "required": ["lat", "lon"],
                "additionalProperties": False,
            },
        },
        "required": ["city", "location"],
        "additionalProperties": False,
    },
    "array with bounds": {
        "type": "object",
        "properties": {
            "primes": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 5}
        },
        "required": ["primes"],
        "additionalProperties": False,
    },
    "enum, required and optional": {
        "type": "object",
        "properties": {
            "mood": {"enum": ["happy", "sad", "calm"]},
            "reason": {"type": "string", "maxLength": 30},
        },
        "required": ["mood"],
        "additionalProperties": False,
    },
    "numbers with ranges": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["age", "score"],
        "additionalProperties": False,
    },
    "string pattern": {
        "type": "object",
        "properties": {"phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"}},
        "required": ["phone"],
        "additionalProperties": False,
    },
    "anyOf": {
        "type": "object",
        "properties": {
            "value": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 10}, {"type": "null"}]}
        },
        "required": ["value"],
        "additionalProperties": False,
    },
}
ASK = [{"role": "user", "content": "Answer in JSON."}]


@pytest.fixture(scope="module")
def server(smollm2_path):
    options = [
        "--max-slots",
        "4",
        "--max-seq-len",
        "512",
        "--max-num-batched-tokens",
        "128",
        "--decode-steps",
        "2",
    ]
    with running_server(smollm2_path, *options, "--served-model-name", "smollm2") as (base, _):
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0)


def _json_schema(name, schema):
    return {
        "type": "json_schema",
        "json_schema": {"name": name.replace(" ", "_").replace(",", ""), "schema": schema},
    }


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_output_validates_against_its_schema(client, temperature):
    def ask(item):
        name, schema = item
        answer = client.chat.completions.create(
            model="smollm2",
            messages=ASK,
            response_format=_json_schema(name, schema),
            temperature=temperature,
            seed=7,
            max_tokens=200,
        )
        return name, schema, answer.choices[0]

    with ThreadPoolExecutor(4) as pool:
        for name, schema, choice in pool.map(ask, SCHEMAS.items()):
            assert choice.finish_reason == "stop", (name, choice.message.content)
            jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_output_parses_to_an_object_whenever_it_finishes(client):
    """A small model sampling at temperature 1 may write a string until max_tokens: that answer
    is cut ("length"), never presented as complete. Greedy, it finishes."""
    ask = [{"role": "user", "content": "Give me a JSON object with your name and age."}]
    for temperature, seed in ((0.0, 0), (1.0, 0), (1.0, 1), (1.0, 2)):
        answer = client.chat.completions.create(
            model="smollm2",
            messages=ask,
            response_format={"type": "json_object"},
            temperature=temperature,
            seed=seed,
            max_tokens=200,
        )
        choice = answer.choices[0]
        assert choice.finish_reason == "stop" or (temperature > 0 and choice.finish_reason == "length")
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    age: int
    languages: list[str] = pydantic.Field(max_length=3)


def test_parse_with_a_pydantic_model(client):
    completion = client.chat.completions.parse(
        model="smollm2",
        messages=[{"role": "user", "content": "Describe a programmer."}],
        response_format=Person,
        temperature=0,
        max_tokens=200,
    )
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and len(person.languages) <= 3


def test_regex_and_grammar_extras_on_both_endpoints(client):
    code = r"[A-Z]{2}-[0-9]{4}"
    for temperature in (0.0, 1.0):
        completion = client.completions.create(
            model="smollm2",
            prompt="Ticket:",
            extra_body={"regex": code},
            temperature=temperature,
            max_tokens=20,
        )
        assert (
            re.fullmatch(code, completion.choices[0].text) and completion.choices[0].finish_reason == "stop"
        )
    gbnf = 'root ::= "The answer is " ("yes" | "no") "."'
    answer = client.chat.completions.create(
        model="smollm2", messages=ASK, extra_body={"grammar": gbnf}, temperature=0, max_tokens=20
    )
    assert answer.choices[0].message.content in ("The answer is yes.", "The answer is no.")


def test_a_constrained_stream_reassembles_to_the_same_answer(client):
    options = {
        "model": "smollm2",
        "messages": ASK,
        "response_format": _json_schema("person", SCHEMAS["numbers with ranges"]),
        "temperature": 0,
        "max_tokens": 100,
    }
    whole = client.chat.completions.create(**options).choices[0]
    chunks = list(client.chat.completions.create(**options, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_json_cut_by_max_tokens_is_reported_as_length(client):
    answer = client.chat.completions.create(
        model="smollm2",
        messages=ASK,
        response_format=_json_schema("nested", SCHEMAS["nested objects"]),
        temperature=0,
        max_tokens=4,
    )
    assert answer.choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format"),
        ({"response_format": _json_schema("bad", {"type": "strin"})}, "response_format"),
        ({"response_format": _json_schema("refs", {"$ref": "#/$defs/nowhere"})}, "response_format"),
        (
            {"response_format": _json_schema("huge", {"enum": [f"v{i}" for i in range(200_000)]})},
            "response_format",
        ),
        ({"regex": "[0-9"}, "regex"),
        ({"grammar": "root ::= missing"}, "grammar"),
        ({"regex": "a+", "response_format": {"type": "json_object"}}, "response_format"),  # one, not two
    ],
)
def test_bad_constraints_are_400s_naming_the_field(server, extra, param):
    body = {"model": "smollm2", "messages": ASK, "max_tokens": 5, **extra}
    reply = httpx.post(server + "/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
    fine = httpx.post(server + "/v1/chat/completions", json={**body, **{k: None for k in extra}}, timeout=60)
    assert fine.status_code == 200


# ------------------------------------------------------------------------------------ tools
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]
NAMED = {"type": "function", "function": {"name": "add"}}


@pytest.mark.parametrize("tool_choice", ["required", NAMED])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_and_named_tool_choices_give_valid_calls(client, tool_choice, temperature):
    for seed in range(2):
        answer = client.chat.completions.create(
            model="smollm2",
            messages=WEATHER,
            tools=TOOLS,
            tool_choice=tool_choice,
            temperature=temperature,
            seed=seed,
            max_tokens=200,
        )
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        assert choice.message.tool_calls
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id
            assert tool_choice == "required" or call.function.name == "add"
            jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def test_streamed_tool_call_deltas_reassemble_to_the_whole_answer(client):
    options = {
        "model": "smollm2",
        "messages": WEATHER,
        "tools": TOOLS,
        "tool_choice": "required",
        "temperature": 0,
    }
    whole = client.chat.completions.create(**options, max_tokens=200).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**options, max_tokens=200, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        for part in delta.tool_calls or ():
            call = calls.setdefault(part.index, {"id": None, "name": "", "arguments": ""})
            if part.id:
                assert call["id"] is None and not call["arguments"]  # id and name come first, once
                call["id"], call["name"] = part.id, part.function.name
            call["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == expected
    assert all(c["id"] for c in calls.values())


def test_a_tool_round_trip_ends_in_an_answer(client):
    first = (
        client.chat.completions.create(
            model="smollm2",
            messages=WEATHER,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=0,
            max_tokens=200,
        )
        .choices[0]
        .message
    )
    assert len(first.tool_calls) == 1 and first.content is None
    call = first.tool_calls[0]
    conversation = [
        *WEATHER,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {
            "role": "tool",
            "tool_call_id": call.id,
            "content": json.dumps({"temperature_c": 18, "sky": "sunny"}),
        },
    ]
    final = client.chat.completions.create(
        model="smollm2", messages=conversation, tools=TOOLS, temperature=0, max_tokens=60
    ).choices[0]
    assert final.finish_reason in ("stop", "tool_calls", "length")
    assert final.message.content or final.message.tool_calls


def test_auto_answers_with_text_or_valid_calls(client):
    for question in ("Add 17 and 25 with the add tool.", "Tell me a joke."):
        choice = client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": question}],
            tools=TOOLS,
            temperature=0,
            max_tokens=100,
        ).choices[0]
        if choice.finish_reason == "tool_calls":
            for call in choice.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
        else:
            assert choice.message.content and not choice.message.tool_calls


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": "get_weather"}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nowhere"}}},
            "tool_choice",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        (  # set aside by the call, a response_format is still checked
            {
                "tools": TOOLS,
                "tool_choice": "required",
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "strin"}},
                },
            },
            "response_format",
        ),
        ({"functions": [TOOLS[0]["function"]]}, "functions"),
        ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(server, extra, param):
    body = {"model": "smollm2", "messages": WEATHER, "max_tokens": 5, **extra}
    reply = httpx.post(server + "/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


# ---------------------------------------------------------------------------- /v1/responses
def test_the_responses_api_answers_streams_and_reports_usage(client):
    ask = {
        "model": "smollm2",
        "input": "What is the capital of France?",
        "temperature": 0,
        "max_output_tokens": 40,
    }
    response = client.responses.create(**ask)
    assert response.status == "completed" and "Paris" in response.output_text
    assert response.usage.input_tokens > 0 and response.usage.output_tokens > 0
    events = list(client.responses.create(**ask, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == response.output_text == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    cut = client.responses.create(**{**ask, "max_output_tokens": 3})
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def test_the_responses_api_holds_output_to_a_schema_and_calls_tools(client):
    schema = SCHEMAS["numbers with ranges"]
    shaped = client.responses.create(
        model="smollm2",
        input="Answer in JSON.",
        text={"format": {"type": "json_schema", "name": "ranges", "schema": schema}},
        temperature=0,
        max_output_tokens=100,
    )
    jsonschema.validate(json.loads(shaped.output_text), schema)
    flat_tools = [{"type": "function", **t["function"]} for t in TOOLS]
    one_call = {
        "model": "smollm2",
        "input": WEATHER,
        "tools": flat_tools,
        "tool_choice": "required",
        "temperature": 0,
        "parallel_tool_calls": False,
        "max_output_tokens": 200,
    }
    called = client.responses.create(**one_call)
    (call,) = [item for item in called.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), PARAMETERS[call.name])
    follow_up = [
        *WEATHER,
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature_c": 18}'},
    ]
    final = client.responses.create(
        model="smollm2", input=follow_up, tools=flat_tools, temperature=0, max_output_tokens=60
    )
    assert final.status in ("completed", "incomplete") and final.output
    streamed = list(client.responses.create(**one_call, stream=True))
    done = [
        e.item for e in streamed if e.type == "response.output_item.done" and e.item.type == "function_call"
    ]
    assert [(i.name, i.arguments) for i in done] == [(call.name, call.arguments)]


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"type": "input_image"}]}, "input"),
        ({"truncation": "sometimes"}, "truncation"),
        ({"max_tool_calls": 2}, "max_tool_calls"),  # a field jinfer does not read is not ignored
    ],
)
def test_the_responses_api_refuses_what_it_does_not_do(server, extra, param):
    body = {"model": "smollm2", "input": "hi", "max_output_tokens": 2, **extra}
    reply = httpx.post(server + "/v1/responses", json=body, timeout=60)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param
