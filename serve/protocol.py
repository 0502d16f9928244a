"""OpenAI request bodies in, validated jinfer requests out (the bodies out: serve/responses.py).

Bodies are checked here for what is HTTP's own (JSON that parses, depth, text strings, field types
and OpenAI's spellings); `SamplingParams` and the request-preparation path (`jinfer.prepare`) check
the rest as they do for every door. A failure is an `APIError` carrying the HTTP status and
OpenAI's error shape.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, NamedTuple

from jinfer.prepare import ChatTemplate
from jinfer.reasoning import EFFORT_BUDGETS
from jinfer.request import DEFAULT_PRIORITY
from jinfer.sampling import RequestError, SamplingParams


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
        named = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}
        if self.status in named:
            return named[self.status]
        if self.status == 503:
            return "service_unavailable"
        return "invalid_request_error" if self.status < 500 else "server_error"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _reject_constant(name: str):
    raise APIError(400, f"invalid JSON: {name} is not a number JSON allows", code="invalid_json")


MAX_JSON_DEPTH = 64  # deeper bodies are refused: no OpenAI field nests anywhere near this


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """Strict JSON (no NaN / Infinity) that must be an object, at most MAX_JSON_DEPTH deep, whose
    strings are all text (no lone UTF-16 surrogates): anything else is a 400."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise APIError(
            400, f"invalid JSON body: nested deeper than {MAX_JSON_DEPTH}", code="invalid_json"
        ) from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, and integers past 4300 digits
        raise APIError(400, f"invalid JSON body: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(
            400, f"the request body must be a JSON object, not {type(body).__name__}", code="invalid_body"
        )
    _check_values(body)
    return body


def _check_values(body: dict[str, Any]) -> None:
    stack = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise APIError(
                400, f"invalid JSON body: nested deeper than {MAX_JSON_DEPTH}", code="invalid_json"
            )
        if isinstance(value, dict):
            for key, item in value.items():
                _check_string(key)
                stack.append((item, depth + 1))
        elif isinstance(value, list):
            stack.extend((item, depth + 1) for item in value)
        elif isinstance(value, str):
            _check_string(value)


def _check_string(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(
            400,
            "the body holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not text",
            code="invalid_json",
        ) from None


# ------------------------------------------------------------------------------ field checks
def _integer(body, name, default, *, low, high):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise APIError(400, f"'{name}' must be an integer in [{low}, {high}]", param=name)
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


def _logit_bias(body) -> dict[int, Any] | None:
    """Token-id keys (JSON object keys are strings) -> biases, checked by SamplingParams."""
    value = body.get("logit_bias")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise APIError(400, "'logit_bias' must be an object of token id -> bias", param="logit_bias")
    out = {}
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit()) or len(key) > 10:
            raise APIError(400, f"'logit_bias' key {key[:20]!r} is not a token id", param="logit_bias")
        out[int(key)] = bias
    return out


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """A completions or chat request, its fields checked for type; the request-preparation path
    (`jinfer.prepare`) checks the rest (messages, ranges, the model's limits)."""

    kind: str  # "completion" | "chat"
    model: str | None
    prompts: list[str | list[int]]  # completions: one or more (text or token ids); chat: none
    messages: Any  # chat
    sampling: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    echo: bool
    top_logprobs: int | None  # None: no logprobs
    context_policy: str | None
    user: str | None
    cache_salt: str | None = None  # prompts cached under a salt are found only by requests with the same
    tools: Any = None  # chat: OpenAI's tools, tool_choice and parallel_tool_calls (checked by jinfer.tools)
    tool_choice: Any = None
    parallel_tool_calls: Any = True
    score_only: bool = False  # completions: echo with max_tokens 0, the prompt scored, nothing generated
    adapter: str | None = None  # the loaded adapter its `model` names (the server resolves it), or None
    template: ChatTemplate = dataclasses.field(default_factory=ChatTemplate)  # chat: how it renders
    priority: int = DEFAULT_PRIORITY  # lower runs first (vLLM's; checked where it is prepared)
    prediction: str | None = None  # OpenAI's Predicted Outputs: the text the output is expected to be

    @property
    def choices(self) -> int:
        """Choices in the response: n per prompt (choice p * n + j: prompt p's j-th)."""
        return max(len(self.prompts), 1) * self.n


class Submission(NamedTuple):
    """What the server decided for a request once it prepared and submitted it: what its
    responses are written from, beside the parsed request."""

    request_ids: list[str]  # the engine's requests, one per choice
    prompt_ids: list[list[int]]  # each prompt's token ids
    seed: int  # choice 0's seed (choice i's is seed + i): sent back, it reproduces the answers
    tool_use: Any = None  # a chat's tools: how to read calls in the output (jinfer.tools.ToolUse)
    reasoning: Any = None  # a reasoning model's chat: how its output thinks (jinfer.reasoning.Reasoning)


# SamplingParams fields a body carries under their own names, passed as they are (SamplingParams
# checks their types and ranges). The others come from fields of other names or shapes
# (max_tokens, top_k's -1, logit_bias's string keys, stop, logprobs, response_format, extra_args or
# vLLM's vllm_xargs).
_MAPPED = {
    "max_tokens",
    "top_k",
    "logit_bias",
    "stop",
    "logprobs",
    "json_schema",
    "regex",
    "grammar",
    "extra_args",
}
_SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.name not in _MAPPED)


def _constraint(body) -> dict[str, Any]:
    """SamplingParams' constraint fields from OpenAI's `response_format`, jinfer's own `regex` and
    `grammar` (Lark or GBNF) fields, or vLLM's spellings (`_vllm_constraint`): one of them."""
    given = {name: {name: body[name]} for name in ("regex", "grammar") if body.get(name) is not None}
    if fields := _response_format(body.get("response_format")):
        given["response_format"] = fields
    given |= _vllm_constraint(body)
    if len(given) > 1:
        names = ", ".join(repr(name) for name in given)
        raise APIError(400, f"give one output constraint, not {names}", param=list(given)[1])
    return next(iter(given.values()), {})


def _response_format(value) -> dict[str, Any] | None:
    """OpenAI's `response_format`: {"type": "text"}, {"type": "json_object"}: any JSON object,
    {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}: JSON valid
    against the schema, which is always enforced. Keys a type does not have are a 400."""
    if value is None:
        return None
    fail = lambda message: APIError(400, f"'response_format{message}", param="response_format")
    if not isinstance(value, dict):
        raise fail("' must be an object with a 'type'")
    kind = value.get("type")
    keys = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}.get(kind)
    if keys is None:
        raise fail(f".type' must be text, json_object or json_schema, got {str(kind)[:40]!r}")
    if unknown := sorted(set(value) - keys):
        raise fail(f"' of type {kind} has no field {unknown[0][:40]!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_schema": {"type": "object"}}
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise fail(".json_schema' must be an object with a 'name' and a 'schema'")
    if unknown := sorted(set(spec) - {"name", "schema", "strict", "description"}):
        raise fail(f".json_schema' has no field {unknown[0][:40]!r}")
    if not isinstance(spec.get("strict", False), bool | None) or not isinstance(
        spec.get("description", ""), str
    ):
        raise fail(".json_schema': 'strict' must be a boolean and 'description' a string")
    schema = spec.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise fail(".json_schema.schema' must be an object")
    return {"json_schema": schema}


_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
_STRUCTURED_OUTPUTS = {"json", "regex", "choice", "grammar", "json_object"}


def _vllm_constraint(body) -> dict[str, dict[str, Any]]:
    """vLLM's constraint fields, by the field that gave one: `guided_json` / `guided_regex` /
    `guided_choice` / `guided_grammar`, and `structured_outputs` {"json" | "regex" | "choice" |
    "grammar" | "json_object"}, as SamplingParams' fields. A choice is a grammar of its strings."""
    given = {name: (name[7:], body[name]) for name in _GUIDED if body.get(name) is not None}
    outputs = body.get("structured_outputs")
    if outputs is not None:
        if not isinstance(outputs, dict) or set(outputs) - _STRUCTURED_OUTPUTS:
            keys = ", ".join(sorted(_STRUCTURED_OUTPUTS))
            raise APIError(
                400, f"'structured_outputs' must be an object of {keys}", param="structured_outputs"
            )
        chosen = [(kind, v) for kind, v in outputs.items() if v is not None and v is not False]
        if len(chosen) > 1:
            raise APIError(400, "'structured_outputs' takes one constraint", param="structured_outputs")
        given |= {"structured_outputs": chosen[0]} if chosen else {}
    return {name: _vllm_fields(name, kind, value) for name, (kind, value) in given.items()}


def _vllm_fields(name: str, kind: str, value) -> dict[str, Any]:
    fail = lambda shape: APIError(400, f"'{name}' ({kind}) must be {shape}", param=name)
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise fail("a JSON schema (an object, or its JSON text)") from None
        if not isinstance(value, dict):
            raise fail("a JSON schema (an object, or its JSON text)")
        return {"json_schema": value}
    if kind == "json_object":
        if value is not True:
            raise fail("true")
        return {"json_schema": {"type": "object"}}
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise fail("a non-empty list of non-empty strings")
        return {"grammar": "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in value)}
    if not isinstance(value, str):
        raise fail("a string")
    return {kind: value}


# Every body field a door reads; anything else is a 400 naming it (never silently ignored).
_COMMON_FIELDS = {
    "model", "max_tokens", "n", "stop", "stream", "stream_options", "logit_bias", "logprobs", "user",
    "response_format", "prediction",
    # jinfer's own
    "top_k", "regex", "grammar", "context_policy", "truncate_prompt_tokens", "cache_salt", "priority",
    # vLLM's constraint spellings (`_vllm_constraint`)
    *_GUIDED, "structured_outputs",
    "extra_args", "vllm_xargs",  # parameters of the server's logits processors (`jinfer.processors`)
    *_SAMPLING_FIELDS,
}  # fmt: skip
_FIELDS = {
    "completion": _COMMON_FIELDS | {"prompt", "echo", "suffix", "best_of"},
    "chat": _COMMON_FIELDS
    | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls"}
    | {"reasoning_effort", "verbosity"}  # checked; a budget for a reasoning model, else no effect
    | {"chat_template_kwargs", "add_generation_prompt", "continue_final_message"}  # vLLM's
    | {"functions", "function_call"},  # refused with a pointer to tools
}
# OpenAI fields that change nothing in jinfer: accepted (nothing is stored, there is one tier).
NO_EFFECT_FIELDS = {"metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"}
# Fields accepted at the value that asks for what jinfer does anyway: OpenAI's `modalities`, and
# the SGLang / vLLM extras their routers (sglang-router, vllm-router) add to every body they forward.
NEUTRAL_VALUES = {
    "modalities": ["text"],
    "no_stop_trim": False,
    "return_hidden_states": False,
    "skip_special_tokens": True,
    "separate_reasoning": True,  # a reasoning model's thinking is always apart (`jinfer.reasoning`)
    "stream_reasoning": True,
    "include_reasoning": True,
}


def _check_fields(body: dict[str, Any], kind: str) -> None:
    unknown = sorted(set(body) - _FIELDS[kind] - NO_EFFECT_FIELDS)
    neutral = lambda name: name in NEUTRAL_VALUES and body[name] in (NEUTRAL_VALUES[name], None)
    unknown = [name for name in unknown if not neutral(name)]
    if unknown:
        others = f" (nor {', '.join(repr(u) for u in unknown[1:4])})" if len(unknown) > 1 else ""
        raise APIError(
            400, f"'{unknown[0]}' is not supported by jinfer's {kind} endpoint{others}", param=unknown[0]
        )


# OpenAI's legacy completions endpoint defines max_tokens=16 when a request leaves it out; chat
# (and every other door of jinfer) runs to a stop or the end of the context window.
LEGACY_COMPLETIONS_MAX_TOKENS = 16


def api_param(param: str | None) -> str | None:
    """The request body's name for a SamplingParams field (a schema comes in `response_format`)."""
    return "response_format" if param == "json_schema" else param


def parse_generation(body: dict[str, Any], kind: str, max_n: int) -> GenerationRequest:
    """A completions or chat body, its fields checked for type; `max_n`: the most choices (n) a
    request may ask for (the engine's waiting queue)."""
    _check_fields(body, kind)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError(400, "'model' must be a string", param="model")
    prompts = _completion_prompts(body) if kind == "completion" else []
    max_tokens, score_only = _max_tokens(body, kind)
    n = _integer(body, "n", 1, low=1, high=max_n)
    if len(prompts) * n > max_n:
        raise APIError(
            400, f"{len(prompts)} prompts x n={n} choices: at most {max_n} at once", param="prompt"
        )
    logprobs = _completion_logprobs(body, n) if kind == "completion" else _chat_logprobs(body)
    stream = _bool(body, "stream")
    stream_options = body.get("stream_options")
    if stream_options is not None and not stream:
        raise APIError(400, "'stream_options' is only allowed when 'stream' is true", param="stream_options")
    if not isinstance(stream_options or {}, dict):
        raise APIError(400, "'stream_options' must be an object", param="stream_options")
    session = _session_fields(body)
    _check_tool_fields(body, kind)
    _check_reasoning_fields(body)
    sampling = _sampling(body, max_tokens, logprobs)
    if body.get("reasoning_effort") is not None and sampling.max_reasoning_tokens is None:
        budget = EFFORT_BUDGETS[body["reasoning_effort"]]
        sampling = dataclasses.replace(sampling, max_reasoning_tokens=budget)
    return GenerationRequest(
        kind=kind,
        model=model,
        prompts=prompts,
        messages=body.get("messages") if kind == "chat" else None,
        sampling=sampling,
        n=n,
        stream=stream,
        include_usage=_bool(stream_options or {}, "include_usage"),
        echo=_bool(body, "echo") if kind == "completion" else False,
        score_only=score_only,
        top_logprobs=logprobs,
        tools=body.get("tools"),
        tool_choice=body.get("tool_choice"),
        parallel_tool_calls=body.get("parallel_tool_calls", True),
        template=_chat_template(body) if kind == "chat" else ChatTemplate(),
        priority=DEFAULT_PRIORITY if body.get("priority") is None else body["priority"],
        prediction=_prediction(body),
        **session,
    )


def _completion_prompts(body: dict[str, Any]) -> list:
    """A completions body's prompts: one string or token-id list, or a list of those."""
    prompt = body.get("prompt")
    several = isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt)
    prompts = list(prompt) if several else [prompt]
    for one in prompts:
        ids = (
            isinstance(one, list) and one and all(isinstance(t, int) and not isinstance(t, bool) for t in one)
        )
        if not (isinstance(one, str) or ids):
            raise APIError(
                400, "'prompt' must be a string, a list of token ids, or a list of either", param="prompt"
            )
    return prompts


def _max_tokens(body: dict[str, Any], kind: str) -> tuple[int | None, bool]:
    """(max_tokens, whether the request only scores its echoed prompt)."""
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None and kind == "completion":
        max_tokens = LEGACY_COMPLETIONS_MAX_TOKENS
    # max_tokens 0 with echo scores the prompt and generates nothing (how evaluation harnesses ask
    # for a text's log-likelihood).
    score_only = kind == "completion" and max_tokens == 0 and _bool(body, "echo")
    if score_only and _bool(body, "stream"):
        raise APIError(400, "max_tokens 0 (scoring the echoed prompt) is not streamed", param="stream")
    return (None, True) if score_only else (max_tokens, False)


def _completion_logprobs(body: dict[str, Any], n: int) -> int | None:
    """A completions body's `logprobs` (alternatives per token), once its other legacy fields pass."""
    logprobs = _integer(body, "logprobs", None, low=0, high=20)
    if body.get("suffix") not in (None, ""):
        raise APIError(400, "'suffix' (text after the insertion) is not supported", param="suffix")
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise APIError(400, "'best_of' other than n is not supported", param="best_of")
    return logprobs


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    """A chat body's `logprobs` / `top_logprobs` as alternatives per token (None: not asked)."""
    want = _bool(body, "logprobs")
    top = _integer(body, "top_logprobs", None, low=0, high=20)
    if top is not None and not want:
        raise APIError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return (top or 0) if want else None


def _session_fields(body: dict[str, Any]) -> dict[str, Any]:
    """context_policy, user and cache_salt, checked."""
    policy = body.get("context_policy", "truncate" if body.get("truncate_prompt_tokens") else None)
    if policy not in (None, "error", "truncate", "drop_oldest"):
        raise APIError(400, "'context_policy' must be error, truncate or drop_oldest", param="context_policy")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise APIError(400, "'user' must be a string", param="user")
    cache_salt = body.get("cache_salt")
    if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
        raise APIError(400, "'cache_salt' must be a non-empty string", param="cache_salt")
    return {"context_policy": policy, "user": user, "cache_salt": cache_salt}


def _check_tool_fields(body: dict[str, Any], kind: str) -> None:
    for legacy in ("functions", "function_call"):
        if body.get(legacy) is not None:
            raise APIError(
                400, f"'{legacy}' is OpenAI's deprecated form: send 'tools' / 'tool_choice'", param=legacy
            )
    tool_fields = ("tools", "tool_choice", "parallel_tool_calls")
    if kind == "completion" and any(body.get(name) is not None for name in tool_fields):
        raise APIError(400, "tools are for /v1/chat/completions", param="tools")


REASONING_EFFORTS = tuple(EFFORT_BUDGETS)
VERBOSITIES = ("low", "medium", "high")


def _prediction(body: dict[str, Any]) -> str | None:
    """OpenAI's `prediction`: {"type": "content", "content": text or text parts} -> the text."""
    prediction = body.get("prediction")
    if prediction is None:
        return None
    if (
        not isinstance(prediction, dict)
        or prediction.get("type") != "content"
        or set(prediction) - {"type", "content"}
    ):
        raise APIError(400, '\'prediction\' must be {"type": "content", "content": ...}', param="prediction")
    content = prediction.get("content")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        content = [p.get("text") for p in content]
        if all(isinstance(t, str) for t in content):
            return "".join(content)
    if not isinstance(content, str):
        raise APIError(
            400, "'prediction.content' must be a string or a list of text parts", param="prediction"
        )
    return content


def _check_reasoning_fields(body: dict[str, Any]) -> None:
    """OpenAI's `reasoning_effort` (a reasoning model's budget of thinking tokens unless
    `max_reasoning_tokens` sets one: `jinfer.reasoning.EFFORT_BUDGETS`) and `verbosity`, checked (a
    model that does not reason, and writes as it writes, does the same at every value)."""
    for name, values in (("reasoning_effort", REASONING_EFFORTS), ("verbosity", VERBOSITIES)):
        if body.get(name) is not None and body[name] not in values:
            raise APIError(400, f"'{name}' must be one of {', '.join(values)}", param=name)


def _chat_template(body: dict[str, Any]) -> ChatTemplate:
    """vLLM's rendering fields (checked, with the messages, by `ChatTemplate.check`)."""
    given = {
        "add_generation_prompt": body.get("add_generation_prompt"),
        "continue_final_message": body.get("continue_final_message"),
        "variables": body.get("chat_template_kwargs"),
    }
    if given["continue_final_message"] and given["add_generation_prompt"] is None:
        given["add_generation_prompt"] = False  # vLLM's users send only continue_final_message
    return ChatTemplate(**{name: value for name, value in given.items() if value is not None})


def _extra_args(body) -> dict[str, Any] | None:
    """The parameters of the server's logits processors, by name: `extra_args`, or vLLM's
    spelling `vllm_xargs` (SamplingParams checks the shape, the processors the values)."""
    given = [name for name in ("extra_args", "vllm_xargs") if body.get(name) is not None]
    if len(given) > 1:
        raise APIError(400, "give extra_args or vllm_xargs, not both", param="vllm_xargs")
    return body[given[0]] if given else None


def _sampling(body: dict[str, Any], max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """The body's sampling fields as SamplingParams (a 400 naming the field that is wrong)."""
    top_k = body.get("top_k")
    fields = {name: body[name] for name in _SAMPLING_FIELDS if body.get(name) is not None}
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            top_k=0 if top_k == -1 else top_k,  # -1 means off, as in vLLM
            logit_bias=_logit_bias(body),
            stop=_string_list(body, "stop"),
            logprobs=logprobs,
            extra_args=_extra_args(body),
            **fields,
            **_constraint(body),
        )
    except RequestError as e:
        raise APIError(400, str(e), param=api_param(e.param)) from None
