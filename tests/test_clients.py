"""The client libraries people build on, against a real `jinfer serve` of the embedded model:
LangChain (langchain-openai, on Chat Completions and the Responses API), instructor and the
`anthropic` SDK (Anthropic's Messages API), each used as its documentation shows, plus the OpenAI
shapes those libraries lean on (forced tool calls holding only declared keys, a forced call cut by
max_tokens still a call, response_format beside a forced tool_choice).

instructor's JSON mode is asked by example (SmolLM2-135M copies the schema it is shown otherwise);
its MD_JSON and PARALLEL_TOOLS modes are not here: they depend on the model following the prompt
alone (a fenced block, a call it may skip), which this model does not."""

import json
import time
from collections.abc import Iterable

import anthropic
import httpx
import instructor
import openai
import pytest
from langchain_core.messages import HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field
from test_server import running_server

KEY = "client-key"
EXAMPLE = 'Reply with JSON like {"name": "Ann", "age": 30}.'
BY_KEYS = 'Return a JSON object with the keys "name" and "age" for Bob, 25.'


class Person(BaseModel):
    name: str
    age: int


class City(BaseModel):
    name: str = Field(max_length=12)


@tool
def get_weather(city: str) -> str:
    """Current weather in a city."""
    return f"Sunny and 18 C in {city}"


@pytest.fixture(scope="module")
def server(smollm2_path):
    options = ["--api-key", KEY, "--max-slots", "4", "--max-seq-len", "1024", "--decode-steps", "2"]
    with running_server(smollm2_path, *options, "--served-model-name", "smollm2") as (base, _):
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


def _chat_model(server, responses: bool, **options) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=server + "/v1",
        api_key=KEY,
        model="smollm2",
        temperature=0,
        max_tokens=120,
        use_responses_api=responses,
        **options,
    )


def _text(message) -> str:
    """A LangChain message's text (the Responses API gives content blocks)."""
    content = message.content if hasattr(message, "content") else message
    if isinstance(content, str):
        return content
    return "".join(block.get("text", "") for block in content if isinstance(block, dict))


# ------------------------------------------------------------------------------------ LangChain
@pytest.mark.parametrize("responses", [False, True], ids=["chat", "responses"])
def test_langchain_invoke_stream_and_batch_agree(server, responses):
    llm = _chat_model(server, responses)
    whole = _text(llm.invoke("Say hello to Ann."))
    assert whole.strip()
    streamed = [chunk for chunk in llm.stream("Say hello to Ann.")]
    assert len(streamed) > 2 and "".join(_text(c) for c in streamed) == whole
    batch = llm.batch(["Say hello to Ann.", "Name a colour."])
    assert _text(batch[0]) == whole and _text(batch[1]).strip()


@pytest.mark.parametrize("responses", [False, True], ids=["chat", "responses"])
@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_langchain_structured_output_in_each_method(server, responses, method):
    structured = _chat_model(server, responses).with_structured_output(Person, method=method)
    person = structured.invoke(BY_KEYS)
    assert isinstance(person, Person) and person.name


@pytest.mark.parametrize("responses", [False, True], ids=["chat", "responses"])
def test_langchain_forced_tool_call_and_tool_message_round_trip(server, responses):
    llm = _chat_model(server, responses)
    messages = [HumanMessage("What is the weather in Paris?")]
    asked = llm.bind_tools([get_weather], tool_choice="any").invoke(messages)
    assert asked.tool_calls
    messages.append(asked)
    for call in asked.tool_calls:
        assert call["name"] == "get_weather" and set(call["args"]) == {"city"}  # only the declared key
        messages.append(ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"]))
    answer = _text(llm.bind_tools([get_weather]).invoke(messages))
    assert answer.strip() and "<tool" not in answer  # an answer, not the wrapper it was shown


# ------------------------------------------------------------------------------------ instructor
@pytest.mark.parametrize("mode", ["TOOLS", "TOOLS_STRICT", "FUNCTIONS", "JSON_SCHEMA", "JSON_O1", "JSON"])
def test_instructor_modes_give_a_valid_object(client, mode):
    patched = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    asked = [{"role": "user", "content": EXAMPLE if mode == "JSON" else BY_KEYS}]
    person = patched.chat.completions.create(
        model="smollm2", response_model=Person, messages=asked, max_tokens=150, temperature=0, max_retries=0
    )
    assert isinstance(person, Person) and person.name


def test_instructor_responses_tools_sends_response_format_beside_the_forced_tool(client):
    patched = instructor.from_openai(client, mode=instructor.Mode.RESPONSES_TOOLS)
    asked = [{"role": "user", "content": BY_KEYS}]
    person = patched.responses.create(
        model="smollm2",
        response_model=Person,
        input=asked,
        max_output_tokens=150,
        temperature=0,
        max_retries=0,
    )
    assert isinstance(person, Person) and person.name


@pytest.mark.parametrize("mode", ["TOOLS", "RESPONSES_TOOLS"])
def test_instructor_create_iterable_gives_objects(client, mode):
    patched = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    asked = [{"role": "user", "content": "Name three cities in France."}]
    cities = list(
        patched.chat.completions.create_iterable(
            model="smollm2", response_model=City, messages=asked, max_tokens=150, temperature=0
        )
    )
    assert cities and all(isinstance(c, City) and c.name for c in cities)


def test_instructor_iterable_type_in_tools_mode(client):
    patched = instructor.from_openai(client, mode=instructor.Mode.TOOLS)
    asked = [{"role": "user", "content": "Name two cities in Italy."}]
    cities = patched.chat.completions.create(
        model="smollm2", response_model=Iterable[City], messages=asked, max_tokens=150, temperature=0
    )
    assert list(cities)


# ------------------------------------------------------------------------------------ OpenAI shapes
OPEN_TOOL = {  # parameters saying nothing of other keys, as most tools' schemas are written
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def test_a_forced_call_holds_only_the_declared_keys(client):
    for seed in range(3):
        choice = client.chat.completions.create(
            model="smollm2",
            messages=WEATHER,
            tools=[OPEN_TOOL],
            tool_choice="required",
            parallel_tool_calls=False,
            temperature=1.0,
            seed=seed,
            max_tokens=100,
        ).choices[0]
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            assert set(json.loads(call.function.arguments)) <= {"city"}


def _streamed_calls(chunks) -> tuple[dict, str | None, str]:
    calls, finish, content = {}, None, ""
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or ():
            call = calls.setdefault(part.index, {"name": "", "arguments": ""})
            call["name"] += (part.function.name or "") if part.id else ""
            call["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return calls, finish, content


@pytest.mark.parametrize("max_tokens", [3, 9])
def test_a_forced_call_cut_by_max_tokens_is_a_call_not_markup(client, max_tokens):
    ask = {"model": "smollm2", "messages": WEATHER, "tools": [OPEN_TOOL], "temperature": 0}
    whole = client.chat.completions.create(**ask, tool_choice="required", max_tokens=100).choices[0]
    complete = whole.message.tool_calls[0].function.arguments
    cut = client.chat.completions.create(**ask, tool_choice="required", max_tokens=max_tokens).choices[0]
    assert cut.finish_reason == "length" and cut.message.content is None
    (call,) = cut.message.tool_calls
    assert call.function.name == "get_weather" and call.id
    assert complete.replace(" ", "").startswith(call.function.arguments)  # as far as it went
    calls, finish, content = _streamed_calls(
        client.chat.completions.create(**ask, tool_choice="required", max_tokens=max_tokens, stream=True)
    )
    assert finish == "length" and content == ""
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", call.function.arguments)]


def test_response_format_beside_a_forced_tool_choice_lets_the_call_decide(client):
    schema = {"type": "json_schema", "json_schema": {"name": "p", "schema": Person.model_json_schema()}}
    choice = client.chat.completions.create(
        model="smollm2",
        messages=WEATHER,
        tools=[OPEN_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        response_format=schema,
        temperature=0,
        max_tokens=100,
    ).choices[0]
    assert (
        choice.finish_reason == "tool_calls" and choice.message.tool_calls[0].function.name == "get_weather"
    )


# ------------------------------------------------------------------------------------ anthropic SDK
GREEDY = {"extra_body": {"temperature": 0}}  # the SDK no longer names sampling knobs; the API takes them
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Current weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0)  # sends x-api-key


def test_anthropic_messages_answer_as_chat_completions_does(claude, client):
    system = "You answer in one sentence."
    turns = [
        *FRANCE,
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy?"},
    ]
    message = claude.messages.create(model="smollm2", max_tokens=40, system=system, messages=turns, **GREEDY)
    chat = client.chat.completions.create(
        model="smollm2",
        max_tokens=40,
        temperature=0,
        messages=[{"role": "system", "content": system}, *turns],
    ).choices[0]
    (block,) = message.content
    assert block.type == "text" and block.text == chat.message.content
    assert message.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[chat.finish_reason]
    assert message.usage.output_tokens > 0 and message.id.startswith("msg_") and message.model == "smollm2"
    counted = claude.messages.count_tokens(model="smollm2", system=system, messages=turns)
    assert counted.input_tokens == message.usage.input_tokens


def test_anthropic_stream_events_build_the_same_message(claude):
    whole = claude.messages.create(model="smollm2", max_tokens=40, messages=FRANCE, **GREEDY)
    kinds = []
    with claude.messages.stream(model="smollm2", max_tokens=40, messages=FRANCE, **GREEDY) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert (
        kinds.index("content_block_start")
        < kinds.index("content_block_delta")
        < kinds.index("content_block_stop")
    )


def test_anthropic_stop_sequences_and_max_tokens(claude):
    count = [{"role": "user", "content": "Count: one, two, three,"}]
    stopped = claude.messages.create(
        model="smollm2", max_tokens=30, messages=count, stop_sequences=["three"], **GREEDY
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "three"
    assert "three" not in stopped.content[0].text
    cut = claude.messages.create(model="smollm2", max_tokens=3, messages=count, **GREEDY)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_tool_use_and_tool_result_round_trip(claude, stream):
    ask = {"model": "smollm2", "max_tokens": 100, "tools": [WEATHER_TOOL], **GREEDY}
    choice = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    if stream:
        with claude.messages.stream(**ask, messages=asked, tool_choice=choice) as events:
            message = events.get_final_message()
    else:
        message = claude.messages.create(**ask, messages=asked, tool_choice=choice)
    (use,) = message.content
    assert message.stop_reason == "tool_use" and use.type == "tool_use" and use.name == "get_weather"
    assert set(use.input) == {"city"} and use.id.startswith("toolu_")
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 18 C"}
    turns = [*asked, {"role": "assistant", "content": message.content}, {"role": "user", "content": [result]}]
    answer = claude.messages.create(**ask, messages=turns)
    assert answer.stop_reason == "end_turn" and "<tool" not in answer.content[0].text
    assert claude.messages.count_tokens(
        model="smollm2", messages=turns, tools=[WEATHER_TOOL]
    ).input_tokens == (answer.usage.input_tokens)


def test_anthropic_output_config_holds_the_answer_to_a_schema(claude):
    schema = Person.model_json_schema()
    message = claude.messages.create(
        model="smollm2",
        max_tokens=60,
        messages=[{"role": "user", "content": BY_KEYS}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
        **GREEDY,
    )
    assert Person.model_validate_json(message.content[0].text).name


@pytest.mark.parametrize(
    "body",
    [
        {"messages": FRANCE},  # no max_tokens
        {"max_tokens": 5, "messages": []},
        {"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]},
        {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        {
            "max_tokens": 5,
            "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "f"}]}],
        },
        {
            "max_tokens": 5,
            "messages": FRANCE,
            "tools": [{"type": "web_search_20250305", "name": "web_search"}],
        },
        {"max_tokens": 5, "messages": FRANCE, "tools": [WEATHER_TOOL], "tool_choice": {"type": "sometimes"}},
        {
            "max_tokens": 5,
            "messages": FRANCE,
            "tools": [WEATHER_TOOL],
            "tool_choice": {"type": "tool", "name": "no"},
        },
        {"max_tokens": 5, "messages": FRANCE, "output_config": {"format": {"type": "xml"}}},
        {"max_tokens": 5, "messages": FRANCE, "container": "c1"},
        {"max_tokens": 5, "messages": FRANCE, "temperature": "hot"},
        {"max_tokens": 5, "messages": FRANCE, "stop_sequences": 3},
    ],
)
def test_anthropic_bad_requests_are_400s_in_anthropic_shape(server, body):
    reply = httpx.post(server + "/v1/messages", json={"model": "smollm2", **body}, headers={"x-api-key": KEY})
    assert reply.status_code == 400, reply.text
    error = reply.json()
    assert (
        error["type"] == "error"
        and error["error"]["type"] == "invalid_request_error"
        and error["error"]["message"]
    )


def test_anthropic_routes_need_the_key_and_answer_errors_in_their_shape(server):
    body = {"model": "smollm2", "max_tokens": 5, "messages": FRANCE}
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        refused = httpx.post(server + path, json=body, headers={"x-api-key": "wrong"})
        assert refused.status_code == 401 and refused.json()["error"]["type"] == "authentication_error"
    missing = httpx.post(
        server + "/v1/messages", json=body | {"model": "claude-opus"}, headers={"x-api-key": KEY}
    )
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    bearer = httpx.post(
        server + "/v1/messages/count_tokens", json=body, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert bearer.status_code == 200 and bearer.json()["input_tokens"] > 0


# ------------------------------------------------------------------------------------ agent frameworks
ASK_FRANCE = "What is the capital of France?"


def test_openai_agents_answer_stream_call_a_tool_and_give_structured_output(server):
    import asyncio

    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    model = OpenAIChatCompletionsModel(
        model="smollm2", openai_client=openai.AsyncOpenAI(base_url=server + "/v1", api_key=KEY)
    )
    settings = ModelSettings(temperature=0, max_tokens=120)
    called = []

    @function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        called.append(city)
        return f"Sunny and 18 C in {city}"

    plain = Runner.run_sync(Agent(name="a", model=model, model_settings=settings), ASK_FRANCE).final_output
    assert "Paris" in plain

    async def streamed():
        run = Runner.run_streamed(Agent(name="a", model=model, model_settings=settings), ASK_FRANCE)
        deltas = [
            e.data.delta
            async for e in run.stream_events()
            if e.type == "raw_response_event" and getattr(e.data, "type", "") == "response.output_text.delta"
        ]
        return "".join(deltas), run.final_output

    assert asyncio.run(streamed()) == (plain, plain)
    forced = ModelSettings(temperature=0, max_tokens=120, tool_choice="required", parallel_tool_calls=False)
    agent = Agent(name="a", model=model, tools=[get_weather], model_settings=forced)
    answer = Runner.run_sync(agent, "What is the weather in Paris?").final_output
    assert called and answer.strip() and "<tool" not in answer
    person = Runner.run_sync(
        Agent(name="a", model=model, output_type=Person, model_settings=settings), BY_KEYS
    )
    assert isinstance(person.final_output, Person)


def test_pydantic_ai_answers_streams_calls_a_tool_and_gives_structured_output(server):
    import asyncio

    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel("smollm2", provider=OpenAIProvider(base_url=server + "/v1", api_key=KEY))
    settings = {"temperature": 0, "max_tokens": 120}
    plain = Agent(model, model_settings=settings).run_sync(ASK_FRANCE).output
    assert "Paris" in plain

    async def streamed():
        async with Agent(model, model_settings=settings).run_stream(ASK_FRANCE) as run:
            return "".join([text async for text in run.stream_text(delta=True)])

    assert asyncio.run(streamed()) == plain
    person = Agent(model, output_type=Person, model_settings=settings).run_sync(BY_KEYS)  # a forced call
    assert isinstance(person.output, Person)
    called = []

    def weather(city: str) -> str:
        """Current weather in a city."""
        called.append(city)
        return f"Sunny and 18 C in {city}"

    # A tool the agent runs, as its output function: offered beside the output tool instead,
    # SmolLM2 calls it again after every result until the request limit.
    answer = Agent(model, output_type=weather, model_settings=settings).run_sync(
        "What is the weather in Paris?"
    )
    assert called == ["Paris"] and answer.output == "Sunny and 18 C in Paris"


def test_litellm_completion_stream_and_tools(server):
    import litellm

    ask = {
        "model": "openai/smollm2",
        "api_base": server + "/v1",
        "api_key": KEY,
        "temperature": 0,
        "max_tokens": 60,
    }
    question = [{"role": "user", "content": ASK_FRANCE}]
    whole = litellm.completion(messages=question, **ask).choices[0].message.content
    assert "Paris" in whole
    streamed = "".join(
        c.choices[0].delta.content or "" for c in litellm.completion(messages=question, stream=True, **ask)
    )
    assert streamed == whole
    weather = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    calls = (
        litellm.completion(messages=weather, tools=[OPEN_TOOL], tool_choice="required", **ask)
        .choices[0]
        .message.tool_calls
    )
    assert calls and all(set(json.loads(c.function.arguments)) <= {"city"} for c in calls)


# ------------------------------------------------------------------------------------ files and batches
def test_openai_files_and_batches_answer_each_line_as_the_request_alone(client):
    """The embedded model through the Batch API (a restart mid-batch: test_batch_api.py)."""
    questions = ["What is the capital of France?", "Name a colour.", "What is 2 + 2?"]
    lines = [
        {
            "custom_id": f"q{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "smollm2",
                "messages": [{"role": "user", "content": q}],
                "max_tokens": 30,
                "temperature": 0,
            },
        }
        for i, q in enumerate(questions)
    ]
    text = "\n".join(json.dumps(line) for line in lines)
    uploaded = client.files.create(file=("questions.jsonl", text.encode()), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    while batch.status not in ("completed", "failed", "cancelled"):
        time.sleep(0.1)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 3 and batch.error_file_id is None
    records = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    for record in records:
        line = lines[int(record["custom_id"][1:])]
        alone = client.chat.completions.create(**line["body"]).choices[0].message.content
        assert record["response"]["body"]["choices"][0]["message"]["content"] == alone
