"""OpenAI's Responses API (`POST /v1/responses`) over the same engine and checks as chat completions.

A Responses body is translated into a chat-completions one (`chat_body`: `instructions` and
`input` become messages, function calls and their outputs in the input become assistant
`tool_calls` and `tool` messages, `max_output_tokens`, `text.format`, the flat function tools and
`truncation` their chat spellings), which `parse_generation` and the request-preparation path then
check and the engine runs like any chat. The result is written back as a Response object
(`ResponsesWriter.respond`) or as its stream of typed events (`response_events`).

Stateless: `previous_response_id`, `conversation` and `background` are refused with a 400 naming
them; `store` is accepted and changes nothing (no response is kept to be fetched later).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from starlette.responses import JSONResponse

from jinfer.reasoning import ReasoningStream, split_output, split_piece
from jinfer.tools import ToolStream, finish_output, streamed_content

from .protocol import NO_EFFECT_FIELDS, APIError, Submission
from .responses import SSE_KEEPALIVE, ResponseWriter, WriterContext, now

REFUSED = {
    "previous_response_id": "responses are not stored: send the whole conversation as input",
    "conversation": "conversations are not stored: send the whole conversation as input",
    "background": "background responses are not supported",
    "include": "no extra output to include is supported",
}
PASSED = (
    "temperature",
    "top_p",
    "stream",
    "user",
    "parallel_tool_calls",
    "seed",
    "top_k",
    "min_p",
    "priority",
)
TRANSLATED = (
    "model",
    "input",
    "instructions",
    "max_output_tokens",
    "truncation",
    "text",
    "reasoning",
    "tools",
    "tool_choice",
)
ECHOED = ("metadata", "store")  # returned as sent; nothing is stored


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where}.content must be a string or a list of text parts", param="input")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text"):
            raise APIError(400, f"{where}: only text content parts are supported", param="input")
        texts.append(part.get("text"))
    if not all(isinstance(t, str) for t in texts):
        raise APIError(400, f"{where}: a text part's 'text' must be a string", param="input")
    return "\n".join(texts)


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """`instructions` and `input` as chat messages."""
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise APIError(400, "'input' must be a string or a non-empty list of input items", param="input")
    messages = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise APIError(400, "'instructions' must be a string", param="instructions")
        messages.append({"role": "system", "content": instructions})
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            messages.append({"role": item.get("role"), "content": _text_of(item.get("content"), where)})
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
            }
            last = messages[-1] if messages else None
            if (
                last is not None
                and last["role"] == "assistant"
                and last.get("tool_calls")
                and not last["content"]
            ):
                last["tool_calls"].append(call)  # one turn's parallel calls
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else json.dumps(output)
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
        elif kind == "reasoning":
            continue  # earlier thinking, sent back: a reasoning model's template leaves it out anyway
        else:
            raise APIError(400, f"{where}: unsupported input item type {str(kind)[:40]!r}", param="input")
    return messages


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise APIError(400, "'tools' must be a list of function tools", param="tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise APIError(
                400, f"tools[{i}]: only function tools are supported, not {str(kind)[:40]!r}", param="tools"
            )
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": function})
    return out


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The chat-completions body a Responses body asks for (400 for what is not supported)."""
    for name, why in REFUSED.items():
        if body.get(name) not in (None, False, []):
            raise APIError(400, f"'{name}': {why}", param=name)
    known = {*REFUSED, *PASSED, *TRANSLATED, *ECHOED, *NO_EFFECT_FIELDS}
    unknown = sorted(set(body) - known)
    if unknown:
        raise APIError(
            400, f"'{unknown[0]}' is not supported by jinfer's responses endpoint", param=unknown[0]
        )
    chat = {name: body[name] for name in PASSED if body.get(name) is not None}
    chat["model"] = body.get("model")
    chat["messages"] = _messages(body)
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    truncation = body.get("truncation", "disabled")
    if truncation not in (None, "disabled", "auto"):
        raise APIError(400, "'truncation' must be disabled or auto", param="truncation")
    if truncation == "auto":
        chat["context_policy"] = "drop_oldest"
    text_format = (body.get("text") or {}).get("format") if isinstance(body.get("text") or {}, dict) else None
    if isinstance(text_format, dict) and text_format.get("type") == "json_schema":
        spec = {k: text_format[k] for k in ("name", "schema", "strict") if k in text_format}
        chat["response_format"] = {"type": "json_schema", "json_schema": spec}
    elif text_format is not None:
        chat["response_format"] = text_format
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function":
        choice = {"type": "function", "function": {"name": choice.get("name")}}
    if choice is not None and (chat.get("tools") or choice != "auto"):
        chat["tool_choice"] = choice
    return chat | _reasoning_fields(body)


def _reasoning_fields(body: dict[str, Any]) -> dict[str, Any]:
    """`reasoning.effort` and `text.verbosity` as the chat fields they are (checked there);
    `reasoning.summary` is accepted: a model that does not reason has nothing to summarise."""
    reasoning, text = body.get("reasoning"), body.get("text")
    if reasoning is not None and (
        not isinstance(reasoning, dict) or set(reasoning) - {"effort", "summary", "generate_summary"}
    ):
        raise APIError(400, "'reasoning' must be an object of effort and summary", param="reasoning")
    fields = {"reasoning_effort": (reasoning or {}).get("effort")}
    fields["verbosity"] = text.get("verbosity") if isinstance(text, dict) else None
    return {name: value for name, value in fields.items() if value is not None}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(text: str, status: str = "completed") -> dict[str, Any]:
    """A reasoning model's thinking as an output item (its text whole once completed)."""
    content = [{"type": "reasoning_text", "text": text}] if status == "completed" else []
    return {"type": "reasoning", "id": _new_id("rs"), "status": status, "summary": [], "content": content}


class ResponseEvents:
    """The numbered events of one streamed Response and the output items they build: a reasoning
    model's thinking (opened by its first text, closed by the answer's), a message (opened by its
    first text) and function calls. `message_item(text, status)` and `call_item(call, status)`
    make the items."""

    def __init__(self, message_item, call_item):
        self.message_item, self.call_item = message_item, call_item
        self.sequence, self.output = 0, []
        self.message, self.text = None, []
        self.thinking, self.thought = None, []

    def event(self, kind: str, **fields) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def _where(self, item: dict | None = None) -> dict[str, Any]:
        item = self.message if item is None else item
        return {"item_id": item["id"], "output_index": self.output.index(item), "content_index": 0}

    def thinking_delta(self, delta: str) -> list[str]:
        """The events of more thinking (its item opened first, if it is not yet)."""
        if not delta:
            return []
        lines = []
        if self.thinking is None:
            self.thinking = reasoning_item("", status="in_progress")
            self.output.append(self.thinking)
            part = {"type": "reasoning_text", "text": ""}
            index = len(self.output) - 1
            lines.append(self.event("response.output_item.added", output_index=index, item=self.thinking))
            lines.append(self.event("response.content_part.added", **self._where(self.thinking), part=part))
        self.thought.append(delta)
        return [
            *lines,
            self.event("response.reasoning_text.delta", **self._where(self.thinking), delta=delta),
        ]

    def _close_thinking(self) -> list[str]:
        """The events that close the thinking, if it is open."""
        if self.thinking is None or self.thinking["status"] == "completed":
            return []
        where, text = self._where(self.thinking), "".join(self.thought)
        part = {"type": "reasoning_text", "text": text}
        self.thinking.update(reasoning_item(text) | {"id": self.thinking["id"]})
        return [
            self.event("response.reasoning_text.done", **where, text=text),
            self.event("response.content_part.done", **where, part=part),
            self.event("response.output_item.done", output_index=where["output_index"], item=self.thinking),
        ]

    def _open_message(self) -> list[str]:
        self.message = self.message_item("", status="in_progress")
        self.output.append(self.message)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self.event("response.output_item.added", output_index=len(self.output) - 1, item=self.message),
            self.event("response.content_part.added", **self._where(), part=part),
        ]

    def text_delta(self, delta: str) -> list[str]:
        """The events of more text (the message opened first, if it is not yet)."""
        if not delta:
            return []
        lines = self._close_thinking()
        lines += self._open_message() if self.message is None else []
        self.text.append(delta)
        return [*lines, self.event("response.output_text.delta", **self._where(), delta=delta, logprobs=[])]

    def finish(self, calls: list) -> list[str]:
        """The events that close the message (opened empty if there is neither text nor a call)
        and add each function call."""
        lines = self._close_thinking()
        lines += self._open_message() if self.message is None and not calls else []
        if self.message is not None:
            where = self._where()
            part = {"type": "output_text", "text": "".join(self.text), "annotations": [], "logprobs": []}
            self.message.update(status="completed", content=[part])
            lines.append(self.event("response.output_text.done", **where, text=part["text"], logprobs=[]))
            lines.append(self.event("response.content_part.done", **where, part=part))
            index = where["output_index"]
            lines.append(self.event("response.output_item.done", output_index=index, item=self.message))
        for call in calls:
            item = self.call_item(call, status="in_progress")
            self.output.append(item)
            index = len(self.output) - 1
            where = {"item_id": item["id"], "output_index": index}
            lines.append(self.event("response.output_item.added", output_index=index, item=item))
            lines.append(self.event("response.function_call_arguments.delta", **where, delta=call.arguments))
            lines.append(
                self.event("response.function_call_arguments.done", **where, arguments=call.arguments)
            )
            item.update(arguments=call.arguments, status="completed")
            lines.append(self.event("response.output_item.done", output_index=index, item=item))
        return lines


class ResponsesWriter:
    """Response objects and their events, read from a request's events as `streams` (the
    completions writer) reads them."""

    def __init__(self, context: WriterContext, streams: ResponseWriter):
        self.context, self.streams, self.bridge = context, streams, context.bridge
        self.model_name = context.model_name

    @property
    def fingerprint(self) -> str | None:
        return self.context.fingerprint()

    def _output_items(self, submitted: Submission, text: str, reason: str) -> list[dict[str, Any]]:
        """A finished choice as output items: a reasoning model's thinking (if it thought), the
        message (if it has text), then its calls."""
        thinking, text = split_output(submitted.reasoning, text)
        content, calls, _ = finish_output(submitted.tool_use, text, reason)
        items = [reasoning_item(thinking)] if thinking else []
        items += [self._message_item(content)] if content or not calls else []
        return items + [self._call_item(call) for call in calls]

    @staticmethod
    def _message_item(text: str, status: str = "completed") -> dict[str, Any]:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        return {
            "type": "message",
            "id": _new_id("msg"),
            "status": status,
            "role": "assistant",
            "content": [part] if status == "completed" else [],
        }

    @staticmethod
    def _call_item(call, status: str = "completed") -> dict[str, Any]:
        arguments = call.arguments if status == "completed" else ""
        return {
            "type": "function_call",
            "id": _new_id("fc"),
            "call_id": call.id,
            "name": call.name,
            "arguments": arguments,
            "status": status,
        }

    def _response(self, req, body, seed, response_id, created, status, output, final=None) -> dict[str, Any]:
        metrics = (final.metrics or {}) if final is not None else {}
        prompt, completion = metrics.get("prompt_tokens", 0), metrics.get("completion_tokens", 0)
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        error = None
        if final is not None and final.finish_reason == "error":
            error = {"code": "server_error", "message": final.error or "generation failed"}
        return {
            "id": response_id,
            "object": "response",
            "created_at": created,
            "status": status,
            "error": error,
            "incomplete_details": incomplete,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "model": req.adapter or self.model_name,
            "output": output,
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": req.sampling.temperature,
            "top_p": req.sampling.top_p,
            "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools", []),
            "text": body.get("text") or {"format": {"type": "text"}},
            "truncation": body.get("truncation", "disabled"),
            "metadata": body.get("metadata") or {},
            "store": body.get("store", False),
            "usage": {
                "input_tokens": prompt,
                "input_tokens_details": {"cached_tokens": metrics.get("cached_prompt_tokens", 0)},
                "output_tokens": completion,
                "output_tokens_details": {"reasoning_tokens": metrics.get("reasoning_tokens", 0)},
                "total_tokens": prompt + completion,
            }
            if final is not None
            else None,
            "system_fingerprint": self.fingerprint,
            "jinfer": {"seed": seed},
        }

    @staticmethod
    def _status(final) -> str:
        return {"length": "incomplete", "error": "failed"}.get(final.finish_reason, "completed")

    async def respond(self, request, req, body, queue, submitted: Submission) -> JSONResponse:
        (choice,) = await self.streams.collect(request, req, queue, submitted.request_ids)
        final = choice["final"]
        output = self._output_items(submitted, "".join(choice["text"]), final.finish_reason)
        status = self._status(final)
        response = self._response(req, body, submitted.seed, _new_id("resp"), now(), status, output, final)
        return JSONResponse(response)

    async def response_events(self, req, body, queue, submitted: Submission):
        """The Response's typed events (`event:` and `data:` lines), created to completed."""
        stream = ResponseEvents(self._message_item, self._call_item)
        response_id, created = _new_id("resp"), now()
        tool_stream = ToolStream(submitted.tool_use) if submitted.tool_use is not None else None
        thinking = ReasoningStream(submitted.reasoning) if submitted.reasoning is not None else None
        try:
            start = self._response(req, body, submitted.seed, response_id, created, "in_progress", [])
            yield stream.event("response.created", response=start)
            yield stream.event("response.in_progress", response=start)
            final, calls = None, []
            while final is None:
                events = await self.streams.next_batch(queue)
                if events is None:
                    yield SSE_KEEPALIVE
                    continue
                for _, piece in events:
                    thought, piece = split_piece(thinking, piece)
                    for line in stream.thinking_delta(thought):
                        yield line
                    delta, ended_with = streamed_content(tool_stream, piece)
                    if piece.finished:
                        final, calls = piece, ended_with
                    for line in stream.text_delta(delta):
                        yield line
            for line in stream.finish(calls):
                yield line
            status = self._status(final)
            done = self._response(
                req, body, submitted.seed, response_id, created, status, stream.output, final
            )
            kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
                status, "response.failed"
            )
            yield stream.event(kind, response=done)
        finally:
            for request_id in submitted.request_ids:
                self.bridge.cancel(request_id)
