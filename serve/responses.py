"""Engine events in, OpenAI response bodies out: the whole body of a non-streaming request
(`complete`, which cancels the request if the client goes away), and the Server-Sent Events of a
streaming one (`sse`) with its buffering policy (`next_batch`: up to --stream-max-tokens tokens
or --stream-max-delay-ms per event, keep-alive comments after --keepalive-s of silence).

`ResponseWriter` writes them from what a `WriterContext` names (the engine, the bridge, the
settings, the served name, the fingerprint); `JinferAPI` holds one. The pieces every body shares
(ids, timestamps, log-probs, usage, timings) come first.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from jinfer.reasoning import ReasoningStream, split_output, split_piece
from jinfer.tools import ToolStream, finish_output, finish_reason, tool_call_deltas

from .protocol import APIError, GenerationRequest, Submission


def new_id(kind: str) -> str:
    return ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex


def now() -> int:
    return int(time.time())


def token_text(data: bytes) -> str:
    """A token's text in log-probs: its bytes as text, or, for part of a character, "bytes:" and
    the bytes escaped (as OpenAI writes them), so that distinct tokens never share a text."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


def format_logprobs(
    kind: str, token_bytes, entries: list[dict], text_offset: int = 0
) -> dict[str, Any] | None:
    """OpenAI logprobs objects from jinfer's per-token entries; `token_bytes(id)`: the bytes a
    token stands for (`jinfer.structured.Grammars.token_bytes`): concatenated, the text's."""
    if not entries:
        return None
    if kind == "chat":

        def entry(i, v):
            data = token_bytes(i)
            return {"token": token_text(data), "logprob": v, "bytes": list(data)}

        content = []
        for e in entries:
            top = [entry(i, v) for i, v in e["top"].items()]
            content.append({**entry(e["token_id"], e["logprob"]), "top_logprobs": top})
        return {"content": content}
    tokens, offsets, written = [], [], b""
    for e in entries:
        data = token_bytes(e["token_id"])
        tokens.append(token_text(data))
        offsets.append(text_offset + len(written.decode("utf-8", errors="ignore")))  # whole characters before
        written += data
    return {
        "tokens": tokens,
        "token_logprobs": [e["logprob"] for e in entries],  # None: an echoed prompt's first token
        "top_logprobs": [
            None if e["top"] is None else {token_text(token_bytes(i)): v for i, v in e["top"].items()}
            for e in entries
        ],
        "text_offset": offsets,
    }


def usage(finals: list, prompt_ids: list[list[int]], completion_tokens: int, n: int = 1) -> dict[str, Any]:
    """OpenAI's usage object, from each choice's final event (`finals`, n per prompt, None where
    none finished). The prompts' figures come from a choice of each: the prompt tokens the engine
    used (fewer than sent when it truncated) and how many of them it found in the prefix cache."""
    prompt_tokens = cached = 0
    for final, ids in zip(finals[::n], prompt_ids, strict=True):
        metrics = final.metrics if final is not None and final.metrics else {}
        prompt_tokens += metrics.get("prompt_tokens", len(ids))
        cached += metrics.get("cached_prompt_tokens", 0)
    summed = lambda name: sum(f.metrics.get(name, 0) for f in finals if f is not None and f.metrics)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
        "completion_tokens_details": {
            "reasoning_tokens": summed("reasoning_tokens"),
            "accepted_prediction_tokens": summed("accepted_prediction_tokens"),
            "rejected_prediction_tokens": summed("rejected_prediction_tokens"),
        },
    }


def timings(metrics: dict[str, Any] | None) -> dict[str, Any] | None:
    """jinfer's extra per-request timings (not part of OpenAI's schema), and the version of the
    weights the request started on."""
    if not metrics:
        return None
    names = ("queue_s", "ttft_s", "total_s", "decode_tokens_per_s", "draft_tokens", "accepted_tokens")
    return {k: metrics.get(k) for k in (*names, "verify_steps", "weights_version")}


# SSE splits lines only at CR and LF, but clients that split with str.splitlines (httpx's
# iter_lines among them) also break at these, which JSON leaves raw inside strings: a token
# decoding to one of them would cut its event in two.
_UNICODE_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})

# What silence sends: a blank line, which every SSE parser ignores (no field, no event). A comment
# (`: keep-alive`) would say more, but clients that strip each network read before splitting it
# at blank lines (vLLM's benchmark client among them) glue a lone comment to the next event and drop
# that event with it.
SSE_KEEPALIVE = "\n\n"


def sse_data(body: dict) -> str:
    """One Server-Sent Event carrying `body` as JSON on a single line, whoever splits the lines."""
    return f"data: {json.dumps(body, ensure_ascii=False).translate(_UNICODE_LINE_BREAKS)}\n\n"


class ChunkWriter:
    """The `data:` chunks of one streamed completions or chat response."""

    def __init__(self, req: GenerationRequest, seed: int, model_name: str, fingerprint: str, token_bytes):
        self.req, self.seed, self.token_bytes = req, seed, token_bytes
        self.opened: set[int] = set()  # the chat choices whose role has been sent
        self.head = {
            "id": new_id(req.kind),
            "object": "chat.completion.chunk" if req.kind == "chat" else "text_completion",
            "created": now(),
            "model": model_name,
            "system_fingerprint": fingerprint,
        }

    def chunk(self, index, text=None, finish_reason=None, entries=None, calls=None, thinking=None) -> str:
        """One choice's chunk: text (a chat delta's content), log-prob entries, a finish reason,
        tool-call deltas, or a reasoning model's thinking (vLLM's `reasoning_content` and newer
        `reasoning`). A chat choice's first chunk carries the role with what it has to say, so the
        first chunk a client sees is the first token (nothing is sent before the prompt is
        prefilled but keep-alives)."""
        req = self.req
        logprobs = format_logprobs(req.kind, self.token_bytes, entries) if entries else None
        choice = {"index": index}
        if req.kind == "chat":
            delta = {} if index in self.opened else {"role": "assistant"}
            self.opened.add(index)
            if calls is not None:
                delta["tool_calls"] = calls
            elif thinking is not None:
                delta |= {"reasoning_content": thinking, "reasoning": thinking}
            elif text is not None or "role" in delta:
                delta["content"] = text or ""
            choice["delta"] = delta
        else:
            choice["text"] = text or ""
        choice |= {"logprobs": logprobs, "finish_reason": finish_reason}
        body = {**self.head, "choices": [choice]}
        if req.include_usage:
            body["usage"] = None
        return sse_data(body)

    def usage(self, choices: list[StreamedChoice], prompt_ids) -> str:
        """The last chunk when `include_usage`: no choices, the usage, jinfer's seed and timings."""
        req, finals = self.req, [choice.final for choice in choices]
        completion_tokens = sum(f.metrics["completion_tokens"] for f in finals if f.metrics)
        body = {**self.head, "choices": [], "usage": usage(finals, prompt_ids, completion_tokens, req.n)}
        body["jinfer"] = {"seed": self.seed, "timings": [timings(f.metrics) for f in finals]}
        return sse_data(body)


class StreamedChoice:
    """One choice of a streamed response: the thinking, text and log-prob entries not yet sent
    (a reasoning model's thinking told apart as it comes), its tool calls (parsed out of the
    answer as it comes, when the request has tools), its final event."""

    def __init__(self, tool_use, reasoning=None):
        self.text, self.entries, self.thinking = [], [], []
        self.tools = ToolStream(tool_use) if tool_use else None
        self.reasoning = ReasoningStream(reasoning) if reasoning is not None else None
        self.final = None

    def add(self, index: int, event, writer: ChunkWriter) -> list[str]:
        """Buffer an event; the chunks that finish the choice if it is the last."""
        thinking, event = split_piece(self.reasoning, event)
        self.thinking.append(thinking)
        self.text.append(event.text if self.tools is None else self.tools.add(event.text))
        self.entries.extend(event.logprobs or ())
        if not event.finished:
            return []
        self.final, reason, lines = event, event.finish_reason, []
        if self.tools is not None:
            rest, calls = self.tools.finish(reason)
            self.text.append(rest)
            reason = finish_reason(reason, calls)
            if calls:
                lines += self.flush(index, writer)
                lines += [writer.chunk(index, calls=[delta]) for delta in tool_call_deltas(calls)]
        lines += self.flush(index, writer)
        if reason == "error":  # what went wrong, as an event (OpenAI clients raise it)
            lines.append(sse_data(APIError(500, event.error, code="engine_error").body()))
        return [*lines, writer.chunk(index, None, reason)]  # the finish: an empty delta, as OpenAI's

    def flush(self, index: int, writer: ChunkWriter) -> list[str]:
        """A chunk of what is buffered, if anything is (the thinking's first)."""
        thinking, text, entries = "".join(self.thinking), "".join(self.text), self.entries
        self.thinking, self.text, self.entries = [], [], []
        lines = (
            [writer.chunk(index, entries=entries if not text else None, thinking=thinking)]
            if thinking
            else []
        )
        if text or (entries and not thinking):
            lines.append(writer.chunk(index, text, None, entries))
        return lines


@dataclasses.dataclass
class WriterContext:
    """What the response writers read, named: the engine (its tokenizer and preparer, scoring,
    failure), the bridge (cancelling), the streaming settings, the served name, and the
    system fingerprint (computed during the warm-up, so read when a response is written)."""

    engine: Any
    bridge: Any
    settings: Any
    model_name: str
    fingerprint: Any  # () -> str | None


class ResponseWriter:
    """Completions and chat responses: whole bodies and their Server-Sent Events, and the buffering
    policy every stream of the server reads events by (`next_batch`)."""

    def __init__(self, context: WriterContext):
        self.context, self.engine, self.bridge = context, context.engine, context.bridge
        self.settings, self.model_name = context.settings, context.model_name
        self.tokenizer, self.preparer = context.engine.tokenizer, context.engine.preparer

    @property
    def fingerprint(self) -> str | None:
        return self.context.fingerprint()

    async def _prompt_entries(self, req, prompt_ids: list[list[int]]) -> list[list[dict]]:
        """Log-prob entries of each prompt (scored once, whatever its n), for echo with logprobs;
        the first token has none: nothing comes before it. Choice i's are [i // n]."""
        out = []
        for ids in prompt_ids:
            adapter = self.engine.adapters.resolve(req.adapter, None)[0]
            scored = await asyncio.to_thread(self.engine.scorer, ids, adapter)
            entries = [{"token_id": ids[0], "logprob": None, "top": None}]
            for i, token in enumerate(ids[1:]):
                top = zip(
                    scored.top_ids[i, : req.top_logprobs].tolist(),
                    scored.top_logprobs[i, : req.top_logprobs].tolist(),
                    strict=True,
                )
                entries.append({"token_id": token, "logprob": float(scored.chosen[i]), "top": dict(top)})
            out.append(entries)
        return out

    async def score_only(self, req, prompt_ids) -> Response:
        """echo with max_tokens 0: each prompt back with its log-probs, nothing generated."""
        body_choices = []
        scored = await self._prompt_entries(req, prompt_ids) if req.top_logprobs is not None else None
        for index in range(req.choices):
            entries = scored[index // req.n] if scored is not None else []
            logprobs = format_logprobs(req.kind, self.preparer.grammars.token_bytes, entries)
            text = self._prompt_text(req, index)
            body_choices.append(
                {"index": index, "text": text, "logprobs": logprobs, "finish_reason": "length"}
            )
        body = {
            "id": new_id(req.kind),
            "object": "text_completion",
            "created": now(),
            "model": req.adapter or self.model_name,
            "choices": body_choices,
            "usage": usage([None] * len(prompt_ids), prompt_ids, 0),
            "system_fingerprint": self.fingerprint,
        }
        return JSONResponse(body)

    async def complete(self, request, req, queue, submitted: Submission) -> Response:
        """The whole response body of a completions or chat request."""
        choices = await self.collect(request, req, queue, submitted.request_ids)
        prompt_ids = submitted.prompt_ids
        failed = [c["final"] for c in choices if c["final"].finish_reason == "error"]
        if failed and self.engine.failure is not None:  # not this request's fault: it may be retried
            raise APIError(503, failed[0].error, code="unavailable")
        echoed = req.echo and req.top_logprobs is not None
        scored = await self._prompt_entries(req, prompt_ids) if echoed else None
        body_choices, completion_tokens = [], 0
        for index, choice in enumerate(choices):
            final = choice["final"]
            text = "".join(choice["text"])
            completion_tokens += final.metrics["completion_tokens"] if final.metrics else 0
            logprobs = None
            if req.top_logprobs is not None:
                entries = choice["entries"]
                if scored is not None:
                    entries = scored[index // req.n] + entries
                logprobs = format_logprobs(req.kind, self.preparer.grammars.token_bytes, entries)
            if req.kind == "chat":
                thinking, text = split_output(submitted.reasoning, text)
                content, calls, reason = finish_output(submitted.tool_use, text, final.finish_reason)
                message = {"role": "assistant", "content": content}
                if thinking is not None:
                    message |= {"reasoning_content": thinking, "reasoning": thinking}
                if calls:  # OpenAI's: no text beside the calls is null
                    message |= {"content": content or None, "tool_calls": [call.openai() for call in calls]}
                body_choices.append(
                    {"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason}
                )
            else:
                body_choices.append(
                    {
                        "index": index,
                        "text": (self._prompt_text(req, index) if req.echo else "") + text,
                        "logprobs": logprobs,
                        "finish_reason": final.finish_reason,
                    }
                )
        body = {
            "id": new_id(req.kind),
            "object": "chat.completion" if req.kind == "chat" else "text_completion",
            "created": now(),
            "model": req.adapter or self.model_name,
            "choices": body_choices,
            "usage": usage([c["final"] for c in choices], prompt_ids, completion_tokens, req.n),
            "system_fingerprint": self.fingerprint,
            "jinfer": {"seed": submitted.seed, "timings": [timings(c["final"].metrics) for c in choices]},
        }
        return JSONResponse(body)

    async def collect(self, request, req, queue, request_ids) -> list[dict]:
        """Wait for every choice (its text pieces, log-prob entries and final event); a client
        that goes away cancels them."""
        choices = [{"text": [], "entries": [], "final": None} for _ in range(req.choices)]
        disconnect = asyncio.ensure_future(wait_disconnect(request))
        try:
            remaining = req.choices
            while remaining:
                get = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({get, disconnect}, return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                    raise asyncio.CancelledError
                index, event = get.result()
                choice = choices[index]
                choice["text"].append(event.text)
                choice["entries"].extend(event.logprobs or ())
                if event.finished:
                    choice["final"] = event
                    remaining -= 1
        finally:
            disconnect.cancel()
            for request_id in request_ids:
                self.bridge.cancel(request_id)  # no-op for finished requests
        return choices

    def _prompt_text(self, req: GenerationRequest, index: int) -> str:
        """Choice `index`'s prompt as text (for echo)."""
        if req.kind != "completion":
            return ""
        prompt = req.prompts[index // req.n]
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)

    async def sse(self, req, queue, submitted: Submission):
        """Server-Sent Events: one JSON chunk per `data:` line, keep-alives, `data: [DONE]` last."""
        token_bytes = lambda token: self.preparer.grammars.token_bytes(token)
        writer = ChunkWriter(
            req, submitted.seed, req.adapter or self.model_name, self.fingerprint, token_bytes
        )
        choices = [StreamedChoice(submitted.tool_use, submitted.reasoning) for _ in range(req.choices)]
        prompt_ids = submitted.prompt_ids
        try:
            echoes = req.echo and req.kind != "chat"  # a completion's prompt comes back first
            scored = None
            if echoes and req.top_logprobs is not None:
                scored = await self._prompt_entries(req, prompt_ids)
            for index in range(req.choices if echoes else 0):
                entries = scored[index // req.n] if scored is not None else None
                yield writer.chunk(index, text=self._prompt_text(req, index), entries=entries)
            while not all(choice.final for choice in choices):
                events = await self.next_batch(queue)
                if events is None:
                    yield SSE_KEEPALIVE
                    continue
                for index, event in events:
                    for line in choices[index].add(index, event, writer):
                        yield line
                for index, choice in enumerate(choices):
                    for line in choice.flush(index, writer):
                        yield line
            if req.include_usage:
                yield writer.usage(choices, prompt_ids)
            yield "data: [DONE]\n\n"
        finally:  # client gone (generator closed) or done: cancel whatever still runs
            for request_id in submitted.request_ids:
                self.bridge.cancel(request_id)

    async def next_batch(self, queue: asyncio.Queue):
        """Events to send in one SSE write, per the buffering policy; None after keep-alive silence."""
        settings = self.settings
        try:
            first = await asyncio.wait_for(queue.get(), settings.keepalive_s)
        except TimeoutError:
            return None
        events = [first]
        tokens = len(first[1].token_ids)
        deadline = time.monotonic() + settings.stream_max_delay_ms / 1000
        while tokens < settings.stream_max_tokens and not first[1].finished:
            try:
                if settings.stream_max_delay_ms > 0:
                    item = await asyncio.wait_for(queue.get(), max(0.0, deadline - time.monotonic()))
                else:
                    item = queue.get_nowait()  # whatever already arrived, without waiting
            except (TimeoutError, asyncio.QueueEmpty):
                break
            events.append(item)
            tokens += len(item[1].token_ids)
            if item[1].finished:
                break
        return events


async def wait_disconnect(request: Request | None) -> None:
    """Returns once the client has disconnected (Starlette delivers http.disconnect); never, for
    no client (a batch line's request)."""
    if request is None:
        await asyncio.Event().wait()
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
