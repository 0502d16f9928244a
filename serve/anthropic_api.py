"""Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) over the same
engine and checks as chat completions.

A Messages body is translated into a chat-completions one (`chat_body`: `system` becomes a system
message, `tool_use` blocks assistant `tool_calls`, `tool_result` blocks `tool` messages, `tools`
with their `input_schema` function tools, `tool_choice` auto / any / tool / none its chat
spelling, `stop_sequences` the stop strings), which `parse_generation` and the request-preparation
path check and the engine runs like any chat. The answer is written back as a Message
(`MessagesWriter.respond`) or as Anthropic's event stream (`message_start`, content blocks with
their deltas, `message_delta`, `message_stop`). Errors on these routes have Anthropic's shape
(`error_body`). A reasoning model's thinking comes back as a `thinking` block before the answer
(with an empty `signature`: nothing is signed here), and `thinking` sets its budget
(`budget_tokens`; disabled: none at all); for a model that does not reason it changes nothing.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from starlette.responses import JSONResponse

from jinfer.prepare import RequestError, check_messages
from jinfer.reasoning import ReasoningStream, split_output, split_piece
from jinfer.tools import ToolCall, ToolStream, finish_output, parse_tools, streamed_content

from .protocol import APIError, Submission

ANTHROPIC_ERRORS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
PASSED = ("model", "temperature", "top_p", "top_k", "stream")
TRANSLATED = (
    "max_tokens",
    "messages",
    "system",
    "stop_sequences",
    "tools",
    "tool_choice",
    "metadata",
    "output_config",
    "thinking",
)
# Fields that change nothing here: tiers, speeds, places and accounts there are none of, and
# prompt-cache marks (jinfer's prefix cache finds every shared prefix by itself).
ACCEPTED = (
    "service_tier",
    "speed",
    "inference_geo",
    "cache_control",
    "user_profile_id",
    "workspace_id",
)
EFFORTS = ("low", "medium", "high", "xhigh", "max")


def is_anthropic_path(path: str) -> bool:
    return path.rstrip("/").startswith("/v1/messages")


def error_body(error: APIError) -> dict[str, Any]:
    """Anthropic's error shape for an APIError."""
    kind = ANTHROPIC_ERRORS.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def _fail(message: str, param: str) -> APIError:
    return APIError(400, message, param=param)


def _text_blocks(content: Any, where: str) -> str:
    """A string, or text blocks, as text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not all(
        isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str) for b in content
    ):
        raise _fail(f"{where} must be a string or a list of text blocks", "messages")
    return "\n".join(b["text"] for b in content)


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(block.get("tool_use_id"), str):
        raise _fail(f"{where}.tool_use_id must be a string", "messages")
    text = _text_blocks(block.get("content", ""), f"{where}.content")
    if block.get("is_error"):
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": text}


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
        raise _fail(f"{where} must have a string 'id' and 'name'", "messages")
    if not isinstance(block.get("input", {}), dict):
        raise _fail(f"{where}.input must be an object", "messages")
    arguments = json.dumps(block.get("input", {}), ensure_ascii=False)
    return {
        "id": block["id"],
        "type": "function",
        "function": {"name": block["name"], "arguments": arguments},
    }


def _message(message: Any, i: int) -> list[dict[str, Any]]:
    """One Messages message as chat messages: a user turn's tool results first (as `tool`
    messages), then its text; an assistant turn's text and tool calls as one message."""
    where = f"messages[{i}]"
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise _fail(f"{where} must be an object whose role is user or assistant", "messages")
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise _fail(f"{where}.content must be a string or a list of content blocks", "messages")
    texts, calls, results = [], [], []
    for j, block in enumerate(content):
        at, kind = f"{where}.content[{j}]", block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(block, at))
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(block, at))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # a client replaying earlier thinking: this model wrote none
        else:
            raise _fail(f"{at}: a {role} message takes no {str(kind)[:40]!r} block here", "messages")
    out = list(results)
    if role == "assistant":
        out.append(
            {"role": "assistant", "content": "\n".join(texts) or None}
            | ({"tool_calls": calls} if calls else {})
        )
    elif texts or not results:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise _fail("'tools' must be a list of tools", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise _fail(f"tools[{i}]: only custom tools are supported, not {str(kind)[:40]!r}", "tools")
        function = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
        if "description" in tool:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(choice: Any) -> dict[str, Any]:
    """Anthropic's tool_choice as chat fields (`tool_choice`, `parallel_tool_calls`)."""
    if choice is None:
        return {}
    kinds = {"auto": "auto", "any": "required", "none": "none", "tool": None}
    if not isinstance(choice, dict) or choice.get("type") not in kinds:
        raise _fail('\'tool_choice\' must be {"type": "auto" | "any" | "tool" | "none"}', "tool_choice")
    chosen = kinds[choice["type"]] or {"type": "function", "function": {"name": choice.get("name")}}
    fields: dict[str, Any] = {"tool_choice": chosen}
    if choice.get("disable_parallel_tool_use") is not None:
        fields["parallel_tool_calls"] = not choice["disable_parallel_tool_use"]
    return fields


def chat_body(body: dict[str, Any], *, counting: bool = False) -> dict[str, Any]:
    """The chat-completions body a Messages body asks for (400 for what is not supported);
    `counting`: a count_tokens body, which has no max_tokens."""
    known = {*PASSED, *TRANSLATED, *ACCEPTED}
    if unknown := sorted(set(body) - known):
        raise _fail(f"'{unknown[0]}' is not supported by jinfer's messages endpoint", unknown[0])
    if not counting and body.get("max_tokens") is None:
        raise _fail("'max_tokens' is required", "max_tokens")
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise _fail("'messages' must be a non-empty list", "messages")
    chat = {name: body[name] for name in PASSED if body.get(name) is not None}
    chat["max_tokens"] = body.get("max_tokens")
    messages = (
        []
        if body.get("system") is None
        else [{"role": "system", "content": _text_blocks(body["system"], "system")}]
    )
    for i, message in enumerate(body["messages"]):
        messages += _message(message, i)
    chat["messages"] = messages
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise _fail("'metadata' must be an object", "metadata")
    if (metadata or {}).get("user_id") is not None:
        chat["user"] = metadata["user_id"]
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    return (
        chat
        | _thinking(body.get("thinking"))
        | _output_config(body.get("output_config"))
        | _tool_choice(body.get("tool_choice") if body.get("tools") else None)
    )


def _thinking(config: Any) -> dict[str, Any]:
    """`thinking` as a reasoning model's budget: enabled with `budget_tokens`, disabled (none),
    adaptive (the model's own)."""
    if config is None:
        return {}
    kinds = ("enabled", "disabled", "adaptive")
    if not isinstance(config, dict) or config.get("type") not in kinds:
        raise _fail('\'thinking\' must be {"type": "enabled" | "disabled" | "adaptive"}', "thinking")
    if config["type"] == "disabled":
        return {"max_reasoning_tokens": 0}
    budget = config.get("budget_tokens")
    if config["type"] == "enabled" and (
        not isinstance(budget, int) or isinstance(budget, bool) or budget < 0
    ):
        raise _fail("'thinking.budget_tokens' must be a non-negative integer", "thinking")
    return {"max_reasoning_tokens": budget} if config["type"] == "enabled" else {}


def _output_config(config: Any) -> dict[str, Any]:
    """`output_config`: its `format` (a JSON schema the answer is held to) as a response_format;
    its `effort` checked (a model that does not reason answers the same at every effort)."""
    if config is None:
        return {}
    if not isinstance(config, dict) or set(config) - {"effort", "format"}:
        raise _fail("'output_config' must be an object of effort and format", "output_config")
    if config.get("effort") is not None and config["effort"] not in EFFORTS:
        raise _fail(f"'output_config.effort' must be one of {', '.join(EFFORTS)}", "output_config")
    spec = config.get("format")
    if spec is None:
        return {}
    if not isinstance(spec, dict) or spec.get("type") != "json_schema" or set(spec) - {"type", "schema"}:
        raise _fail(
            '\'output_config.format\' must be {"type": "json_schema", "schema": {...}}', "output_config"
        )
    return {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": spec.get("schema")},
        }
    }


def count_tokens(preparer, req) -> dict[str, int]:
    """count_tokens' answer for a parsed chat request: its prompt's tokens, tools included."""
    try:
        offered = parse_tools(req.tools) if req.tools and req.tool_choice != "none" else []
        ids = preparer.chat_ids(check_messages(req.messages), req.template, offered)
    except RequestError as e:
        raise APIError(400, str(e), param=e.param) from None
    return {"input_tokens": len(ids)}


def _stop(final, calls) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished answer."""
    if final.finish_reason == "length":
        return "max_tokens", None
    if calls:
        return "tool_use", None
    if isinstance(final.stop_reason, str):
        return "stop_sequence", final.stop_reason
    return "end_turn", None


def _tool_use_block(call: ToolCall, cut: bool) -> dict[str, Any]:
    try:
        arguments = json.loads(call.arguments) if not cut else {}
    except ValueError:
        arguments = {}
    return {
        "type": "tool_use",
        "id": "toolu_" + call.id.removeprefix("call_"),
        "name": call.name,
        "input": arguments,
    }


class MessagesWriter:
    """Message objects and their event streams, read from a request's events as `streams` (the
    completions writer) reads them."""

    def __init__(self, context, streams):
        self.context, self.streams, self.bridge = context, streams, context.bridge

    def _message(self, req, content, stop=(None, None), usage=None) -> dict[str, Any]:
        return {
            "id": f"msg_{uuid.uuid4().hex}",
            "type": "message",
            "role": "assistant",
            "model": req.adapter or self.context.model_name,
            "content": content,
            "stop_reason": stop[0],
            "stop_sequence": stop[1],
            "usage": usage,
        }

    @staticmethod
    def _usage(final, prompt_tokens: int) -> dict[str, Any]:
        metrics = (final.metrics or {}) if final is not None else {}
        return {
            "input_tokens": metrics.get("prompt_tokens", prompt_tokens),
            "output_tokens": metrics.get("completion_tokens", 0),
            "cache_read_input_tokens": metrics.get("cached_prompt_tokens", 0),
            "cache_creation_input_tokens": 0,
        }

    async def respond(self, request, req, queue, submitted: Submission) -> JSONResponse:
        (choice,) = await self.streams.collect(request, req, queue, submitted.request_ids)
        final = choice["final"]
        if final.finish_reason == "error":
            raise APIError(500, final.error or "generation failed")
        thinking, text = split_output(submitted.reasoning, "".join(choice["text"]))
        text, calls, _ = finish_output(submitted.tool_use, text, final.finish_reason)
        cut = final.finish_reason == "length"
        content = [_thinking_block(thinking)] if thinking else []
        content += [{"type": "text", "text": text}] if text or not calls else []
        content += [_tool_use_block(call, cut) for call in calls]
        usage = self._usage(final, len(submitted.prompt_ids[0]))
        return JSONResponse(self._message(req, content, _stop(final, calls), usage))

    async def events(self, req, queue, submitted: Submission):
        """Anthropic's event stream of one answer."""
        blocks = _Blocks()
        tool_stream = ToolStream(submitted.tool_use) if submitted.tool_use is not None else None
        reasoning = ReasoningStream(submitted.reasoning) if submitted.reasoning is not None else None
        usage = self._usage(None, len(submitted.prompt_ids[0]))
        try:
            yield blocks.event("message_start", message=self._message(req, [], usage=usage))
            yield blocks.event("ping")
            final, calls = None, []
            while final is None:
                events = await self.streams.next_batch(queue)
                if events is None:
                    yield blocks.event("ping")
                    continue
                for _, piece in events:
                    thought, piece = split_piece(reasoning, piece)
                    delta, ended_with = streamed_content(tool_stream, piece)
                    if piece.finished:
                        final, calls = piece, ended_with
                    for line in blocks.delta("thinking", thought) + blocks.delta("text", delta):
                        yield line
            if final.finish_reason == "error":
                yield blocks.event("error", error={"type": "api_error", "message": final.error or "failed"})
                return
            for line in blocks.finish(calls, final.finish_reason == "length"):
                yield line
            stop_reason, stop_sequence = _stop(final, calls)
            output = {"output_tokens": self._usage(final, 0)["output_tokens"]}
            delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
            yield blocks.event("message_delta", delta=delta, usage=output)
            yield blocks.event("message_stop")
        finally:
            for request_id in submitted.request_ids:
                self.bridge.cancel(request_id)


def _thinking_block(thinking: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": thinking, "signature": ""}


class _Blocks:
    """The content blocks of one streamed Message: a reasoning model's thinking block (opened by
    its first thinking), a text block (opened by its first text), then the tool_use blocks, each
    started, given its input JSON and stopped."""

    def __init__(self):
        self.count, self.open = 0, None  # blocks started; the kind of the one open

    @staticmethod
    def event(kind: str, **fields) -> str:
        data = json.dumps({"type": kind, **fields}, ensure_ascii=False)
        return f"event: {kind}\ndata: {data}\n\n"

    def _start(self, kind: str) -> list[str]:
        """Close the open block, if another, and start one of `kind` (if it is not the open one)."""
        if self.open == kind:
            return []
        lines = self._stop()
        block = _thinking_block("") if kind == "thinking" else {"type": "text", "text": ""}
        lines.append(self.event("content_block_start", index=self.count, content_block=block))
        self.open, self.count = kind, self.count + 1
        return lines

    def _stop(self) -> list[str]:
        if self.open is None:
            return []
        lines = []
        if self.open == "thinking":  # nothing is signed here; the SDKs expect the delta
            signed = {"type": "signature_delta", "signature": ""}
            lines.append(self.event("content_block_delta", index=self.count - 1, delta=signed))
        self.open = None
        return [*lines, self.event("content_block_stop", index=self.count - 1)]

    def delta(self, kind: str, delta: str) -> list[str]:
        """The events of more "thinking" or "text" (its block started first, if it is not open)."""
        if not delta:
            return []
        delta_block = {"type": f"{kind}_delta", kind: delta}
        return [
            *self._start(kind),
            self.event("content_block_delta", index=self.count - 1, delta=delta_block),
        ]

    def finish(self, calls: list[ToolCall], cut: bool) -> list[str]:
        """Close the open block (an answer with neither text nor calls gets a text block, empty)
        and add the calls. A call cut by max_tokens has no input, as in a whole Message."""
        lines = [] if calls else self._start("text")
        lines += self._stop()
        for call in calls:
            index, self.count = self.count, self.count + 1
            block = _tool_use_block(call, cut) | {"input": {}}
            lines.append(self.event("content_block_start", index=index, content_block=block))
            partial = {"type": "input_json_delta", "partial_json": "" if cut else call.arguments}
            lines.append(self.event("content_block_delta", index=index, delta=partial))
            lines.append(self.event("content_block_stop", index=index))
        return lines
