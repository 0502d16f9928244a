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
        "--prefill-buckets",
        "64,128",
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
        ({"regex": "a+", "response_format": {"type": "json_object"}}, "regex"),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(server, extra, param):
    body = {"model": "smollm2", "messages": ASK, "max_tokens": 5, **extra}
    reply = httpx.post(server + "/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
    fine = httpx.post(server + "/v1/chat/completions", json={**body, **{k: None for k in extra}}, timeout=60)
    assert fine.status_code == 200
