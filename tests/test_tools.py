"""Tool calling (`jinfer.tools`) without a model: the three calling conventions' grammars and
parsers, the streaming hold-back, the conversation a template without tools is given, and the
request checks. The server's side is tested with the official client in test_structured_server.py."""

import json

import jsonschema
import pytest
from test_structured import random_walk

import jinfer
from jinfer.prepare import RequestPreparer
from jinfer.sampling import RequestError, SamplingParams
from jinfer.structured import Grammars, closed_objects
from jinfer.tools import Hermes, Llama3, Mistral, ToolStream, ToolUse, parse_tool_choice, parse_tools

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
                "additionalProperties": False,
            },
        },
    },
]
PLAN = {  # parameters with definitions of their own, referred to from their root (pydantic writes these)
    "type": "function",
    "function": {
        "name": "plan",
        "parameters": {
            "$defs": {"City": {"type": "object", "properties": {"name": {"enum": ["Rome", "Oslo"]}}}},
            "type": "object",
            "properties": {"stops": {"type": "array", "items": {"$ref": "#/$defs/City"}, "maxItems": 2}},
            "required": ["stops"],
        },
    },
}
SCHEMAS = {t["function"]["name"]: closed_objects(t["function"]["parameters"]) for t in [*TOOLS, PLAN]}


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return jinfer.load_tokenizer(smollm2_path)


@pytest.mark.parametrize("convention", [Hermes, Llama3, Mistral])
@pytest.mark.parametrize("parallel", [False, True])
def test_any_output_a_required_call_grammar_allows_parses_to_valid_calls(tokenizer, convention, parallel):
    conv = convention(tokenizer)
    tools = parse_tools([*TOOLS, PLAN])
    grammars = Grammars(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    for seed in range(4):
        ids = random_walk(grammars, SamplingParams(grammar=conv.grammar(tools, parallel)), seed)
        content, calls = conv.parse(tokenizer.decode(ids, skip_special_tokens=False))
        assert content == "" and calls and (parallel or len(calls) == 1)
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
            assert call.id.startswith("call_")


@pytest.mark.parametrize("convention", [Hermes, Llama3, Mistral])
def test_a_required_call_cut_anywhere_reads_as_the_calls_written_so_far(tokenizer, convention):
    conv = convention(tokenizer)
    tools = parse_tools(TOOLS)
    names = tuple(t.name for t in tools)
    grammars = Grammars(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    use = ToolUse(conv, "required", names)
    for seed in range(3):
        ids = random_walk(grammars, SamplingParams(grammar=conv.grammar(tools, True)), seed)
        text = tokenizer.decode(ids, skip_special_tokens=False)
        whole = conv.parse(text)[1]
        assert [(c.name, c.arguments) for c in conv.read_cut(text, names)] == [
            (c.name, c.arguments) for c in whole
        ]
        read = 0
        for end in range(len(text) + 1):
            content, calls = use.read(text[:end], "length")
            assert content == "" and read <= len(calls) <= len(whole)  # calls are only ever added
            read = len(calls)
            for call, complete in zip(calls[:-1], whole, strict=False):
                assert (call.name, call.arguments) == (complete.name, complete.arguments)
            if calls:
                assert calls[-1].name == whole[len(calls) - 1].name
                assert f'"{conv.arguments_key}":{calls[-1].arguments}' in text or calls[-1].arguments in (
                    "",
                    whole[len(calls) - 1].arguments,
                )
    cut = ToolStream(ToolUse(Hermes(tokenizer), "add", ("add",)))
    assert cut.add('<tool_call>\n{"name":"ad') == ""
    assert [(c.name, c.arguments) for c in cut.finish("length")[1]] == [("add", "")]
    assert ToolUse(Hermes(tokenizer), "required", names).read('<tool_call>\n{"na', "length") == ("", [])
    for early in ("", "<tool", '<tool_call>\n{"na'):  # cut before the name: the one function it may call
        (call,) = ToolUse(Hermes(tokenizer), "add", ("add",)).read(early, "length")[1]
        assert (call.name, call.arguments) == ("add", "")


@pytest.mark.parametrize(
    "convention, text, expected",
    [
        (
            Hermes,
            'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
            ("Sure.", 1),
        ),
        (
            Hermes,
            '<tool_call>{"name": "add", "arguments": {}}</tool_call>\n<tool_call>{"name": "f"}</tool_call>',
            ("", 2),
        ),
        (Hermes, '<tool_call>\n{"name": "add", "arguments": {"a": 1</tool_call>', None),
        (Hermes, "No tools needed.", None),
        (Llama3, '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}', ("", 1)),
        (Llama3, '{"name": "add", "parameters": {"a": 1}}; {"name": "add", "parameters": {"b": 2}}', ("", 2)),
        (Llama3, "{not json", None),
        (
            Mistral,
            '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, {"name": "f", "arguments": {}}]',
            ("", 2),
        ),
        (Mistral, '[TOOL_CALLS]{"name": "add"}', None),
    ],
)
def test_written_calls_are_read_back_and_malformed_ones_are_not(tokenizer, convention, text, expected):
    parsed = convention(tokenizer).parse(text)
    if expected is None:
        assert parsed is None
    else:
        assert (parsed[0], len(parsed[1])) == expected
        assert all(isinstance(json.loads(c.arguments), dict) for c in parsed[1])


def _stream(use, pieces):
    stream = ToolStream(use)
    sent = [stream.add(p) for p in pieces]
    rest, calls = stream.finish("stop")
    return "".join(sent) + rest, calls


def test_streaming_holds_back_only_what_may_be_a_call(tokenizer):
    auto = ToolUse(Hermes(tokenizer), "auto")
    text, calls = _stream(auto, ["The answer", " is <", "b>4</b>."])
    assert text == "The answer is <b>4</b>." and calls == []
    stream = ToolStream(auto)
    assert stream.add("Let me check. <tool") == "Let me check. "  # "<tool" may begin a call
    assert stream.add('_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>') == ""
    rest, calls = stream.finish("stop")
    assert rest == "" and [c.name for c in calls] == ["add"]
    text, calls = _stream(auto, ["<tool_call>\n{broken", "</tool_call>"])  # not a call after all: content
    assert text == "<tool_call>\n{broken</tool_call>" and calls == []
    text, calls = _stream(auto, ["\n", "<tool_", 'call>{"name": "add", "arguments": {}}</tool_call>'])
    assert text == "" and [c.name for c in calls] == ["add"]  # blanks before a call are not content
    text, calls = _stream(ToolUse(Llama3(tokenizer), "auto"), [' {"name": "add", ', '"parameters": {}}'])
    assert text == "" and [c.name for c in calls] == ["add"]


@pytest.fixture(scope="module")
def preparer(tokenizer):
    return RequestPreparer(
        tokenizer,
        vocab_size=tokenizer.vocab_size,
        max_seq_len=2048,
        eos_token_ids=tokenizer.eos_token_ids,
        sampling_defaults={},
        context_policy="error",
    )


def test_a_template_without_tools_is_told_of_them_and_of_earlier_calls(preparer, tokenizer):
    history = [
        {"role": "user", "content": "Add 1 and 2."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a":1,"b":2}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
        {
            "role": "assistant",
            "content": "Now the weather.",
            "tool_calls": [
                {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}},
                {"id": "c3", "type": "function", "function": {"name": "add", "arguments": '{"a":3}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c3", "content": "4"},
        {"role": "tool", "tool_call_id": "c2", "content": "sunny"},
    ]
    prepared = preparer.prepare(messages=history, tools=TOOLS)
    prompt = tokenizer.decode(prepared.prompt_ids, skip_special_tokens=False)
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt
    # Earlier calls and results in sentences: as markup, a small model copies them as its answer.
    assert 'assistant\nI called add with {"a": 1, "b": 2}.<|im_end|>' in prompt
    assert "user\nIt returned: 3<|im_end|>" in prompt
    assert 'Now the weather. I called get_weather with {}. I called add with {"a": 3}.' in prompt
    assert "add returned: 4<|im_end|>" in prompt and "get_weather returned: sunny<|im_end|>" in prompt
    told = Hermes(tokenizer).system_prompt(parse_tools(TOOLS))
    assert prompt.count("<tool_call>") == told.count("<tool_call>") and "<tool_response>" not in prompt
    assert prepared.tools.choice == "auto" and prepared.grammar is None
    silent = preparer.prepare(messages=history, tools=TOOLS, tool_choice="none")
    assert silent.tools is None and "<tools>" not in tokenizer.decode(silent.prompt_ids)
    named = preparer.prepare(
        messages=history[:1], tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}}
    )
    assert named.grammar is not None and '"const": "add"' in named.sampling.grammar


@pytest.mark.parametrize(
    "tools, choice, param",
    [
        ([], None, "tools"),
        ([{"type": "function", "function": {"name": "has space"}}], None, "tools"),
        ([{"type": "retrieval"}], None, "tools"),
        ([TOOLS[1], TOOLS[1]], None, "tools"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], None, "tools"),
        (TOOLS, {"type": "function", "function": {"name": "nowhere"}}, "tool_choice"),
        (TOOLS, "sometimes", "tool_choice"),
    ],
)
def test_bad_tools_and_tool_choices_name_the_field(tools, choice, param):
    with pytest.raises(RequestError) as caught:
        parse_tool_choice(choice, parse_tools(tools))
    assert caught.value.param == param


def test_a_required_call_decides_over_another_constraint_which_is_still_checked(preparer):
    ask = [{"role": "user", "content": "hi"}]
    alone = preparer.prepare(messages=ask, tools=TOOLS, tool_choice="required")
    both = preparer.prepare(
        messages=ask, tools=TOOLS, tool_choice="required", sampling=SamplingParams(regex="a+")
    )
    assert both.sampling.regex is None and both.sampling.grammar == alone.sampling.grammar
    with pytest.raises(RequestError) as caught:
        preparer.prepare(
            messages=ask, tools=TOOLS, tool_choice="required", sampling=SamplingParams(regex="(a")
        )
    assert caught.value.param == "regex"
    with pytest.raises(RequestError) as caught:
        preparer.prepare("a prompt", tools=TOOLS)
    assert caught.value.param == "tools"


def test_the_convention_and_whether_the_template_takes_tools_come_from_the_template(tokenizer):
    from jinfer.tokenizer import Tokenizer
    from jinfer.tools import convention_of

    def with_template(template):
        return Tokenizer(tokenizer.backend, eos_token_ids=tokenizer.eos_token_ids, chat_template=template)

    native = (
        "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}{% endif %}"
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.arguments.a }}</tool_call>{% endfor %}"
        "{% endfor %}"
    )
    cases = [
        (tokenizer.chat_template, Hermes, False),
        (native, Hermes, True),
        ("{{ '[TOOL_CALLS]' }}{% for m in messages %}{{ m.content }}{% endfor %}", Mistral, True),
        ("{{ '<|python_tag|>' }}{% for m in messages %}{{ m.content }}{% endfor %}", Llama3, True),
    ]
    for template, convention, takes_tools in cases:
        found, native_tools = convention_of(with_template(template))
        assert isinstance(found, convention) and native_tools == takes_tools
    preparer = RequestPreparer(
        with_template(native),
        vocab_size=tokenizer.vocab_size,
        max_seq_len=2048,
        eos_token_ids=tokenizer.eos_token_ids,
        sampling_defaults={},
        context_policy="error",
    )
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
    ]
    prompt = tokenizer.decode(preparer.prepare(messages=history, tools=TOOLS).prompt_ids)
    # The template itself lists the tools and reads the earlier call's arguments as an object.
    assert prompt.startswith("TOOLS:get_weather;add;") and "<tool_call>1</tool_call>" in prompt
