"""OpenAI request bodies in, validated jinfer requests out; jinfer results in, OpenAI bodies out.

Everything a client sends is checked here before it reaches the engine: types, ranges, NaN, the
model name. A failure is an `APIError` carrying the HTTP status and OpenAI's error shape.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
import uuid
from typing import Any

from jinfer.sampling import SamplingParams

MAX_N = 4


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with an HTTP status."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None, headers=None
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return {
            400: "invalid_request_error",
            401: "authentication_error",
            404: "not_found_error",
            413: "invalid_request_error",
            429: "rate_limit_error",
            503: "service_unavailable",
        }.get(self.status, "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _reject_constant(name: str):
    raise APIError(400, f"invalid JSON: {name} is not a number JSON allows", code="invalid_json")


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """Strict JSON (no NaN / Infinity) that must be an object."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"invalid JSON body: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(
            400, f"the request body must be a JSON object, not {type(body).__name__}", code="invalid_body"
        )
    return body


# ------------------------------------------------------------------------------ field checks
def _number(body, name, default, *, low=None, high=None, low_open=False, integer=False):
    value = body.get(name, default)
    if value is None:
        return default
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind):
        raise APIError(400, f"'{name}' must be {'an integer' if integer else 'a number'}", param=name)
    if not math.isfinite(value):
        raise APIError(400, f"'{name}' must be finite", param=name)
    if low is not None and (value <= low if low_open else value < low):
        raise APIError(400, f"'{name}' must be {'>' if low_open else '>='} {low}, got {value}", param=name)
    if high is not None and value > high:
        raise APIError(400, f"'{name}' must be <= {high}, got {value}", param=name)
    return value


def _bool(body, name, default=False):
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise APIError(400, f"'{name}' must be a boolean", param=name)
    return value


def _string_list(body, name) -> list[str] | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value) or len(value) > 16:
        raise APIError(400, f"'{name}' must be a string or a list of at most 16 strings", param=name)
    return [s for s in value if s]


def _int_list(body, name) -> list[int] | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    ):
        raise APIError(400, f"'{name}' must be a list of non-negative integers", param=name)
    return value


def _logit_bias(body) -> dict[int, float] | None:
    value = body.get("logit_bias")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise APIError(400, "'logit_bias' must be an object of token id -> bias", param="logit_bias")
    out = {}
    for key, bias in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise APIError(400, f"'logit_bias' key {key!r} is not a token id", param="logit_bias") from None
        if (
            token < 0
            or isinstance(bias, bool)
            or not isinstance(bias, int | float)
            or not math.isfinite(bias)
        ):
            raise APIError(400, f"'logit_bias' entry {key!r}: {bias!r} is invalid", param="logit_bias")
        out[token] = float(max(-100.0, min(100.0, bias)))
    return out


@dataclasses.dataclass
class GenerationRequest:
    """A validated completions or chat request."""

    kind: str  # "completion" | "chat"
    model: str | None
    prompt: str | list[int] | None  # completions
    messages: list[dict[str, Any]] | None  # chat
    sampling: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    echo: bool
    top_logprobs: int | None  # None: no logprobs
    context_policy: str | None
    user: str | None


def parse_generation(body: dict[str, Any], kind: str) -> GenerationRequest:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError(400, "'model' must be a string", param="model")
    prompt = messages = None
    if kind == "completion":
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, list):
            if not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise APIError(400, "'prompt' must be a string or a list of token ids", param="prompt")
        elif not isinstance(prompt, str):
            raise APIError(400, "'prompt' must be a string or a list of token ids", param="prompt")
    else:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise APIError(400, "'messages' must be a non-empty list", param="messages")
        for m in messages:
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise APIError(400, "each message needs a string 'role'", param="messages")
            content = m.get("content")
            if isinstance(content, list):  # content parts: only text is supported
                if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                    raise APIError(400, "only text content parts are supported", param="messages")
                m["content"] = "".join(p.get("text", "") for p in content)
            elif not isinstance(m.get("content"), str):
                raise APIError(400, "each message needs string 'content'", param="messages")

    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = _number({"max_tokens": max_tokens}, "max_tokens", None, low=1, integer=True)
    n = _number(body, "n", 1, low=1, high=MAX_N, integer=True)
    if kind == "completion":
        logprobs = _number(body, "logprobs", None, low=0, high=20, integer=True)
    else:
        want = _bool(body, "logprobs")
        top = _number(body, "top_logprobs", 0, low=0, high=20, integer=True)
        logprobs = top if want else None
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise APIError(400, "'stream_options' must be an object", param="stream_options")
    policy = body.get("context_policy", "truncate" if body.get("truncate_prompt_tokens") else None)
    if policy not in (None, "error", "truncate", "drop_oldest"):
        raise APIError(400, "'context_policy' must be error, truncate or drop_oldest", param="context_policy")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise APIError(400, "'user' must be a string", param="user")
    try:
        sampling = SamplingParams(
            max_tokens=max_tokens,
            temperature=_number(body, "temperature", 1.0, low=0),
            top_p=_number(body, "top_p", 1.0, low=0, low_open=True, high=1),
            top_k=max(0, _number(body, "top_k", 0, low=-1, integer=True)),  # -1 means off, as in vLLM
            min_p=_number(body, "min_p", 0.0, low=0, high=1),
            presence_penalty=_number(body, "presence_penalty", 0.0, low=-2, high=2),
            frequency_penalty=_number(body, "frequency_penalty", 0.0, low=-2, high=2),
            repetition_penalty=_number(body, "repetition_penalty", 1.0, low=0, low_open=True),
            logit_bias=_logit_bias(body),
            seed=_number(body, "seed", None, low=0, integer=True),
            stop=_string_list(body, "stop"),
            stop_token_ids=_int_list(body, "stop_token_ids"),
            ignore_eos=_bool(body, "ignore_eos"),
            min_tokens=_number(body, "min_tokens", 0, low=0, integer=True),
            logprobs=logprobs,
        )
    except ValueError as e:
        raise APIError(400, str(e)) from None
    return GenerationRequest(
        kind=kind,
        model=model,
        prompt=prompt,
        messages=messages,
        sampling=sampling,
        n=n,
        stream=_bool(body, "stream"),
        include_usage=_bool(stream_options, "include_usage"),
        echo=_bool(body, "echo") if kind == "completion" else False,
        top_logprobs=logprobs,
        context_policy=policy,
        user=user,
    )


def choice_sampling(req: GenerationRequest, index: int) -> SamplingParams:
    """Choice i of n gets seed + i, so seeded n > 1 requests give n different, reproducible answers."""
    if req.sampling.seed is None or index == 0:
        return req.sampling
    return dataclasses.replace(req.sampling, seed=req.sampling.seed + index)


# ------------------------------------------------------------------------------ responses
def new_id(kind: str) -> str:
    return ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex


def now() -> int:
    return int(time.time())


def format_logprobs(kind: str, tokenizer, entries: list[dict], text_offset: int = 0) -> dict[str, Any] | None:
    """OpenAI logprobs objects from jinfer's per-token entries."""
    if not entries:
        return None
    piece = lambda i: tokenizer.decode([i], skip_special_tokens=False)
    if kind == "chat":
        content = []
        for e in entries:
            token = piece(e["token_id"])
            content.append(
                {
                    "token": token,
                    "logprob": e["logprob"],
                    "bytes": list(token.encode()),
                    "top_logprobs": [
                        {"token": piece(i), "logprob": v, "bytes": list(piece(i).encode())}
                        for i, v in e["top"].items()
                    ],
                }
            )
        return {"content": content}
    tokens, offsets, offset = [], [], text_offset
    for e in entries:
        token = piece(e["token_id"])
        tokens.append(token)
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [{piece(i): v for i, v in e["top"].items()} for e in entries],
        "text_offset": offsets,
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def timings(metrics: dict[str, Any] | None) -> dict[str, Any] | None:
    """jinfer's extra per-request timings (not part of OpenAI's schema)."""
    if not metrics:
        return None
    return {k: metrics.get(k) for k in ("queue_s", "ttft_s", "total_s", "decode_tokens_per_s")}
