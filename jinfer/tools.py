"""Tool calling: the functions a chat offers the model, how its chat template hears of them, the
grammar that holds a required call to its function's parameters, and the model's calls parsed back
into OpenAI's shape (also while streaming).

The calling convention is the model's own, read from its chat template:

    hermes   <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, one block per call
             (Hermes, Qwen 2 / 2.5 / 3, and any template that takes `tools` without naming a format)
    llama3   {"name": ..., "parameters": {...}}, after <|python_tag|> or alone (Llama 3.1+ JSON calls;
             one call per turn)
    mistral  [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]

A template that knows no tools at all (SmolLM2's) gets them from jinfer in the hermes convention:
a system message lists the functions and says how to call them, and earlier calls and results in
the conversation are told in plain sentences (`conversation_for`). tool_choice "none" leaves the
tools out of the prompt; "auto" lets the model choose and parses what it wrote; "required" or a
named function constrains the output (`jinfer.structured`) to one call (or, with parallel_tool_calls, several)
whose arguments validate against the function's `parameters`, holding only the keys it declares
unless it allows more (`structured.closed_objects`). Such a call cut by max_tokens is still
returned as a call, its arguments as far as they went.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from typing import Any

from jinfer.sampling import RequestError
from jinfer.structured import closed_objects

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclasses.dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # a JSON schema of the arguments object

    def openai(self) -> dict[str, Any]:
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": function}


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's `function.arguments`)
    id: str = dataclasses.field(default_factory=lambda: "call_" + secrets.token_hex(12))

    def openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def parse_tools(tools: Any) -> list[Tool]:
    """OpenAI's `tools` list, checked: function tools with a name and an object schema."""
    if not isinstance(tools, list) or not tools:
        raise RequestError("tools must be a non-empty list of function tools", "tools")
    out, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(tool.get("function"), dict)
        ):
            raise RequestError(f'{where} must be {{"type": "function", "function": {{...}}}}', "tools")
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise RequestError(f"{where}.function.name must be 1-64 letters, digits, _ or -", "tools")
        if name in names:
            raise RequestError(f"{where}: the function name {name!r} is given twice", "tools")
        description = function.get("description", "")
        if not isinstance(description, str):
            raise RequestError(f"{where}.function.description must be a string", "tools")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise RequestError(f"{where}.function.parameters must be a JSON schema of an object", "tools")
        names.add(name)
        out.append(Tool(name, description, parameters))
    return out


def parse_tool_choice(choice: Any, tools: list[Tool]) -> str:
    """ "none", "auto", "required", or the name of the one function the model must call."""
    if choice is None:
        return "auto"
    if choice in ("none", "auto", "required"):
        return choice
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        shapes = '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}'
        raise RequestError(f"tool_choice must be {shapes}", "tool_choice")
    if name not in {t.name for t in tools}:
        raise RequestError(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    return name


def _arguments_object(text: Any, where: str) -> dict[str, Any]:
    """A conversation's tool-call arguments (a JSON object as text, or an object) as an object."""
    if isinstance(text, str):
        try:
            text = json.loads(text)
        except ValueError:
            raise RequestError(f"{where}.function.arguments must be a JSON object", "messages") from None
    if not isinstance(text, dict):
        raise RequestError(f"{where}.function.arguments must be a JSON object", "messages")
    return text


def check_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`, checked, with their arguments as objects (what chat
    templates read)."""
    if not isinstance(calls, list) or not calls:
        raise RequestError(f"{where}.tool_calls must be a non-empty list", "messages")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(
                f"{at} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}", "messages"
            )
        arguments = _arguments_object(function.get("arguments", "{}"), at)
        call_id = call.get("id")
        out.append(
            {
                "id": call_id if isinstance(call_id, str) else "",
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return out


# ------------------------------------------------------------------------------ conventions
class Convention:
    """One calling convention: how calls are written (`marker` first), the grammar that requires
    them, and how written calls are read back."""

    name = ""
    marker = ""  # text a call starts with
    end = ""  # text a call ends with, if any
    arguments_key = "arguments"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def _literal(self, text: str) -> str:
        """`text` in a Lark grammar: its token where it is one token of the vocabulary (a special
        token such as [TOOL_CALLS]), else the text."""
        token = self.tokenizer.token_to_id(text)
        return f"<[{token}]>" if token is not None else json.dumps(text)

    @staticmethod
    def _call_schema(tools: list[Tool], arguments_key: str) -> dict[str, Any]:
        definitions: dict[str, Any] = {}
        variants = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t.name},
                    arguments_key: _hoisted(closed_objects(t.parameters), t.name, definitions),
                },
                "required": ["name", arguments_key],
                "additionalProperties": False,
            }
            for t in tools
        ]
        schema = variants[0] if len(variants) == 1 else {"anyOf": variants}
        if definitions:
            schema["$defs"] = definitions
        return {**schema, "x-guidance": {"whitespace_flexible": False}}  # compact, as response_format's

    def grammar(self, tools: list[Tool], parallel: bool) -> str:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str, list[ToolCall]] | None:
        """(content before the calls, the calls), or None when `text` holds no well-formed call."""
        raise NotImplementedError

    def read_cut(self, text: str, names: tuple[str, ...]) -> list[ToolCall]:
        """The calls of a required-call output (this convention's grammar wrote it) cut short: those
        written whole, then the one cut, its arguments text as far as it went, when its name can
        be told (written whole, or the start of only one of `names`: an output cut before its first
        name is a call of the one function it may call, with no arguments yet)."""
        calls, at, decoder = [], 0, json.JSONDecoder()
        while True:
            at = self._past_separators(text, at)
            if not calls and self.marker.startswith(text[at:]):  # cut before its first call's object
                cut = self._cut_call("", names)
                return [cut] if cut is not None else []
            if at == len(text) or text[at] != "{":
                return calls
            try:
                value, at = decoder.raw_decode(text, at)
            except ValueError:
                cut = self._cut_call(text[at:], names)
                return calls + ([cut] if cut is not None else [])
            whole = _calls_of([value], self.arguments_key)
            if whole is None:
                return calls
            calls += whole

    def _past_separators(self, text: str, at: int) -> int:
        """Where the next call may start: past blanks, list punctuation and the call markers."""
        while at < len(text):
            if skip := next((m for m in (self.marker, self.end) if m and text.startswith(m, at)), ""):
                at += len(skip)
            elif text[at] in " \t\r\n,[]":
                at += 1
            else:
                break
        return at

    def _cut_call(self, text: str, names: tuple[str, ...]) -> ToolCall | None:
        arguments_start = f',"{self.arguments_key}":'
        head = re.match(r'\{"name":"((?:[^"\\]|\\.)*)(?:(")(?:' + arguments_start + r"(.*))?)?", text, re.S)
        written, closed, arguments = head.groups() if head else ("", None, None)
        if head is None and not '{"name":"'.startswith(text):
            return None
        try:
            name = json.loads(f'"{written}"')
        except ValueError:  # cut inside an escape
            return None
        if not closed:
            matching = [n for n in names if n.startswith(name)]
            if len(matching) != 1:
                return None
            name = matching[0]
        return ToolCall(name, arguments or "")


def _hoisted(parameters: dict[str, Any], name: str, definitions: dict[str, Any]) -> dict[str, Any]:
    """A function's `parameters` as part of a call schema, whose root is not theirs: their
    `$defs` / `definitions` move into `definitions` (the call schema's own `$defs`) as
    "<name>.<definition>", the parameters themselves as "<name>", and each `$ref` is pointed there
    ("#/$defs/X/..." -> "#/$defs/<name>.X/...", any other "#..." -> "#/$defs/<name>...")."""
    own = {
        k: v
        for key in ("definitions", "$defs")
        if isinstance(parameters.get(key), dict)
        for k, v in parameters[key].items()
    }
    if not own and not _has_ref(parameters):
        return parameters

    def point(value):
        if isinstance(value, list):
            return [point(v) for v in value]
        if not isinstance(value, dict):
            return value
        out = {key: point(v) for key, v in value.items() if key not in ("$defs", "definitions")}
        ref = value.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            inner = re.match(r"#/(?:\$defs|definitions)/([^/]+)(.*)", ref)
            out["$ref"] = f"#/$defs/{name}.{inner[1]}{inner[2]}" if inner else f"#/$defs/{name}{ref[1:]}"
        return out

    definitions.update({f"{name}.{key}": point(schema) for key, schema in own.items()})
    definitions[name] = point(parameters)
    return definitions[name]


def _has_ref(value: Any) -> bool:
    if isinstance(value, dict):
        return "$ref" in value or any(_has_ref(v) for v in value.values())
    return isinstance(value, list) and any(_has_ref(v) for v in value)


def _decode_objects(text: str) -> list[Any] | None:
    """JSON values written one after another (blank-separated), or None if any is malformed."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and text[at] in " \t\r\n;":
            at += 1
        if at == len(text):
            return values
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        values.append(value)


def _calls_of(objects: list[Any], arguments_key: str) -> list[ToolCall] | None:
    calls = []
    for value in objects:
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = value.get(arguments_key, {})
        if not isinstance(arguments, dict):
            return None
        calls.append(ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls or None


class Hermes(Convention):
    name, marker, end = "hermes", "<tool_call>", "</tool_call>"

    def grammar(self, tools, parallel):
        schema = json.dumps(self._call_schema(tools, "arguments"))
        repeat = ' ("\\n" call)*' if parallel else ""
        return (
            f"start: call{repeat}\n"
            f'call: {self._literal(self.marker)} "\\n" body "\\n" {self._literal(self.end)}\n'
            f"body: %json {schema}\n"
        )

    def parse(self, text):
        start = text.find(self.marker)
        if start < 0:
            return None
        blocks = re.findall(re.escape(self.marker) + r"(.*?)" + re.escape(self.end), text[start:], re.S)
        rest = re.sub(re.escape(self.marker) + r".*?" + re.escape(self.end), "", text[start:], flags=re.S)
        if not blocks or rest.strip():
            return None
        objects = [_decode_objects(b.strip()) for b in blocks]
        if any(o is None or len(o) != 1 for o in objects):
            return None
        calls = _calls_of([o[0] for o in objects], "arguments")
        return None if calls is None else (text[:start].strip(), calls)

    def system_prompt(self, tools: list[Tool]) -> str:
        """What a template without tools is told (jinfer's wording of the hermes convention)."""
        listing = "\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in tools)
        return (
            "You can call functions to help answer. The functions are listed as JSON between <tools> and "
            f"</tools>:\n<tools>\n{listing}\n</tools>\n\n"
            "To call a function, answer with a JSON object holding its name and arguments between "
            "<tool_call> and </tool_call>, one block per call:\n"
            '<tool_call>\n{"name": "function_name", "arguments": {"argument": "value"}}\n</tool_call>'
        )


class Llama3(Convention):
    name, marker, arguments_key = "llama3", "<|python_tag|>", "parameters"

    def grammar(self, tools, parallel):  # one call per turn in this convention
        return f"start: body\nbody: %json {json.dumps(self._call_schema(tools, 'parameters'))}\n"

    def parse(self, text):
        body = text.strip().removeprefix(self.marker).strip()
        if not body.startswith("{"):
            return None
        objects = _decode_objects(body)
        calls = _calls_of(objects, "parameters") if objects else None
        return None if calls is None else ("", calls)


class Mistral(Convention):
    name, marker = "mistral", "[TOOL_CALLS]"

    def grammar(self, tools, parallel):
        call = self._call_schema(tools, "arguments")
        schema = {"type": "array", "items": call, "minItems": 1, "x-guidance": call.pop("x-guidance")}
        if "$defs" in call:  # references are from the root
            schema["$defs"] = call.pop("$defs")
        if not parallel:
            schema["maxItems"] = 1
        return f"start: {self._literal(self.marker)} body\nbody: %json {json.dumps(schema)}\n"

    def parse(self, text):
        start = text.find(self.marker)
        if start < 0:
            return None
        objects = _decode_objects(text[start + len(self.marker) :].strip())
        if not objects or len(objects) != 1 or not isinstance(objects[0], list):
            return None
        calls = _calls_of(objects[0], "arguments")
        return None if calls is None else (text[:start].strip(), calls)


def convention_of(tokenizer) -> tuple[Convention, bool]:
    """The model's calling convention, and whether its chat template takes `tools` itself."""
    template = tokenizer.chat_template or ""
    if "[TOOL_CALLS]" in template:
        return Mistral(tokenizer), True
    if "<|python_tag|>" in template:
        return Llama3(tokenizer), True
    return Hermes(tokenizer), "tools" in template


# ------------------------------------------------------------------------------ per request
@dataclasses.dataclass
class ToolUse:
    """A chat request's tools as the output side needs them: how to read the calls, and whether
    the output can be anything but calls."""

    convention: Convention
    choice: str  # "auto", "required" or a function name ("none" makes no ToolUse)
    names: tuple[str, ...] = ()  # the functions it may call

    @property
    def calls_only(self) -> bool:
        return self.choice != "auto"

    def read(self, text: str, reason: str) -> tuple[str, list[ToolCall]]:
        """A finished output's content and calls: the calls of an output that stopped with
        well-formed ones; a required call cut by max_tokens as far as it went (its text is the
        call's markup, never content); else the text as it is."""
        if reason == "stop":
            return self.convention.parse(text) or (text, [])
        if reason == "length" and self.calls_only:
            return "", self.convention.read_cut(text, self.names)
        return text, []


def finish_reason(reason: str, calls) -> str:
    """A finished output's reason: "tool_calls" where an output that stopped holds calls."""
    return "tool_calls" if calls and reason == "stop" else reason


def finish_output(tool_use: ToolUse | None, text: str, reason: str) -> tuple[str, list[ToolCall], str]:
    """A finished output as its content, its tool calls (`ToolUse.read`) and its finish reason
    (`finish_reason`)."""
    content, calls = tool_use.read(text, reason) if tool_use is not None else (text, [])
    return content, calls, finish_reason(reason, calls)


def conversation_for(messages: list[dict[str, Any]], tools: list[Tool], convention: Convention, native: bool):
    """Messages (checked, with `tool_calls` and `tool_call_id` kept) as the template should see
    them: untouched for a template that takes tools, else with the tools in a system message and
    earlier calls and results told in plain sentences ("I called f with {...}.", "It returned:
    ..."). Written as call blocks and <tool_response> wrappers instead, a small model copies the
    wrapper or the call back as its answer."""
    if native:
        return messages
    out = []
    prompt = convention.system_prompt(tools) if tools else None
    if prompt is not None:
        if messages and messages[0]["role"] in ("system", "developer"):
            out.append({"role": "system", "content": messages[0]["content"] + "\n\n" + prompt})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": prompt})
    called: dict[str, str] = {}  # the last turn's calls: id -> function name
    for message in messages:
        if message["role"] == "assistant" and message.get("tool_calls"):
            calls = message["tool_calls"]
            called = {c["id"]: c["function"]["name"] for c in calls}
            said = [
                f"I called {c['function']['name']} with {json.dumps(c['function']['arguments'])}."
                for c in calls
            ]
            text = " ".join(([message["content"]] if message["content"] else []) + said)
            out.append({"role": "assistant", "content": text})
        elif message["role"] == "tool":
            name = "It" if len(called) <= 1 else called.get(message.get("tool_call_id"), "The function")
            out.append({"role": "user", "content": f"{name} returned: {message['content']}"})
        else:
            out.append({"role": message["role"], "content": message["content"]})
    return out


class ToolStream:
    """Streams one choice of a request with tools. Content passes through as it comes, except text
    that may begin a call (the convention's marker, or a prefix of it so far; for llama3, an
    output that opens with "{"), which is held back from there on and sent at the end as tool
    calls, or as content after all if it does not parse as calls. With only calls allowed,
    everything is held."""

    def __init__(self, use: ToolUse):
        self.use = use
        self.pending = ""
        self.mode = "calls" if use.calls_only else None  # None: nothing but blanks yet

    def add(self, text: str) -> str:
        """Content to send now, for a text delta."""
        self.pending += text
        if self.mode == "calls":
            return ""
        marker = self.use.convention.marker
        if self.mode is None:  # blanks so far, or the start of what may be a call: held
            start = self.pending.lstrip()
            if not start or marker.startswith(start):
                return ""
            if start.startswith(marker) or (
                isinstance(self.use.convention, Llama3) and start.startswith("{")
            ):
                self.mode, self.pending = "calls", start
                return ""
            self.mode = "content"
        at = self.pending.find(marker)
        if at >= 0:
            self.mode = "calls"
            text, self.pending = self.pending[:at], self.pending[at:]
            return text
        hold = next(
            (
                k
                for k in range(min(len(marker) - 1, len(self.pending)), 0, -1)
                if self.pending.endswith(marker[:k])
            ),
            0,
        )
        text, self.pending = (
            self.pending[: len(self.pending) - hold],
            self.pending[len(self.pending) - hold :],
        )
        return text

    def finish(self, reason: str) -> tuple[str, list[ToolCall]]:
        """At the end of an output that finished for `reason`: (content still to send, the calls)."""
        held, self.pending = self.pending, ""
        return self.use.read(held, reason) if self.mode == "calls" else (held, [])


def streamed_content(tool_stream: ToolStream | None, piece) -> tuple[str, list[ToolCall]]:
    """For one streamed piece of an output (a `RequestOutput`): the content to send now and, on its
    last piece, the calls the output ended with, through `tool_stream` where the request has tools."""
    if tool_stream is None:
        return piece.text, []
    content = tool_stream.add(piece.text)
    if not piece.finished:
        return content, []
    rest, calls = tool_stream.finish(piece.finish_reason)
    return content + rest, calls


ARGUMENT_FRAGMENT = 32  # characters of arguments per streamed delta


def tool_call_deltas(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """OpenAI's streamed form of calls: per call, its index, id, type and name with empty
    arguments first, then the arguments in fragments (concatenated, the whole JSON text)."""
    deltas = []
    for index, call in enumerate(calls):
        function = {"name": call.name, "arguments": ""}
        deltas.append({"index": index, "id": call.id, "type": "function", "function": function})
        for at in range(0, len(call.arguments), ARGUMENT_FRAGMENT):
            deltas.append(
                {"index": index, "function": {"arguments": call.arguments[at : at + ARGUMENT_FRAGMENT]}}
            )
    return deltas
