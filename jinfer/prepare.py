"""Request preparation: the one way in for every door (server, WebSocket, `LLM`, batch jobs, CLI).

    prompt (text | token ids) or messages (chat template)  -> token ids
    sampling (SamplingParams, knobs maybe unset)            -> resolved against the model's defaults
    context policy (request's, else the engine's)            -> ids and max_tokens fitted to the window
    device limits (vocabulary, logit-bias and stop-id slots) -> checked here, before the engine
    constraint (json_schema / regex / grammar)               -> compiled once per distinct one
    tools and tool_choice (chat)                             -> in the prompt; a required call's grammar
    a reasoning model's chat (`jinfer.reasoning`)            -> where its thinking starts; its budget

A `PreparedRequest` is what the engine accepts; everything wrong with a request is a
`RequestError` (a ValueError naming the field) or a `ContextLengthError` raised here, so nothing
invalid reaches the device. Context policies:

    error        reject, with both numbers (the default)
    truncate     keep the most recent prompt tokens; report how many were dropped
    drop_oldest  (chat) drop whole earliest non-system messages until it fits

`max_tokens=None` means "up to the window": whatever the prompt leaves free.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from jinfer.config import CONTEXT_POLICIES, MAX_LOGIT_BIAS, MAX_STOP_IDS
from jinfer.inputs import RowProcessor, processor_inputs
from jinfer.reasoning import Reasoning, reasoning_format_of
from jinfer.request import DEFAULT_PRIORITY
from jinfer.sampling import RequestError, SamplingParams
from jinfer.structured import CompiledGrammar, Grammars
from jinfer.tokenizer import Tokenizer, TokenizerError
from jinfer.tools import (
    Tool,
    ToolUse,
    check_tool_calls,
    convention_of,
    conversation_for,
    parse_tool_choice,
    parse_tools,
)

MESSAGE_ROLES = ("system", "developer", "user", "assistant", "tool")


class ContextLengthError(RequestError):
    """The prompt and the requested output do not fit the context window."""

    def __init__(self, prompt_tokens: int, max_tokens: int | None, max_seq_len: int):
        self.prompt_tokens, self.max_tokens, self.max_seq_len = prompt_tokens, max_tokens, max_seq_len
        wanted = "at least one output token" if max_tokens is None else f"max_tokens={max_tokens}"
        super().__init__(
            f"this model's context window is {max_seq_len} tokens, but the prompt has {prompt_tokens} tokens "
            f"and {wanted} was requested; shorten the prompt, lower max_tokens, or ask for truncation"
        )


@dataclasses.dataclass(frozen=True)
class PreparedRequest:
    """A request the engine can run as it is."""

    prompt_ids: list[int]
    sampling: SamplingParams  # resolved: every knob set, the seed too
    max_tokens: int  # never past the context window
    stop_ids: frozenset[int]  # eos (unless ignore_eos) + stop_token_ids
    dropped_prompt_tokens: int = 0  # context_policy="truncate"
    dropped_messages: int = 0  # context_policy="drop_oldest"
    cache_salt: str | None = None  # the prefix cache finds its prompt only for requests with the same
    grammar: CompiledGrammar | None = None  # the sampling's constraint, compiled (`jinfer.structured`)
    tools: ToolUse | None = None  # how to read tool calls in the output (`jinfer.tools`)
    adapter: str | None = None  # the name of the adapter it runs through (`jinfer.adapter_slots`)
    priority: int = DEFAULT_PRIORITY  # lower runs first (`jinfer.scheduler`)
    # The output's expected tokens (OpenAI's Predicted Outputs): speculative decoding's drafts look
    # there too, so a right guess is verified several tokens a pass; the output is the same either way.
    prediction_ids: tuple[int, ...] = ()
    reasoning: Reasoning | None = None  # a reasoning model's chat: how its output thinks (`jinfer.reasoning`)
    # Its input to each registered logits processor, from its extra_args (`inputs.processor_inputs`).
    processor_inputs: dict[str, Any] = dataclasses.field(default_factory=dict)

    def with_seed(self, seed: int | None) -> PreparedRequest:
        return dataclasses.replace(self, sampling=dataclasses.replace(self.sampling, seed=seed))


# Names the chat template is given by jinfer itself (`Tokenizer.apply_chat_template`).
_TEMPLATE_OWN = {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "raise_exception"}


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """How a chat renders beyond its messages (vLLM's fields): the assistant's turn opened after
    them (`add_generation_prompt`), or the final assistant message continued from its last
    character (`continue_final_message`), and variables the template reads (`variables`, vLLM's
    `chat_template_kwargs`, such as Qwen3's `enable_thinking`)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    variables: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def check(self, messages: list[dict[str, Any]]) -> None:
        """RequestError naming the field, for options that contradict each other or the chat."""
        for name in ("add_generation_prompt", "continue_final_message"):
            if not isinstance(getattr(self, name), bool):
                raise RequestError(f"{name} must be true or false", name)
        if not isinstance(self.variables, Mapping) or not all(isinstance(k, str) for k in self.variables):
            raise RequestError("chat_template_kwargs must be an object", "chat_template_kwargs")
        if taken := sorted(_TEMPLATE_OWN & set(self.variables)):
            raise RequestError(f"chat_template_kwargs may not set {taken[0]!r}", "chat_template_kwargs")
        if self.continue_final_message and self.add_generation_prompt:
            raise RequestError(
                "continue_final_message continues the last message: set add_generation_prompt to false",
                "continue_final_message",
            )
        if self.continue_final_message and (not messages or messages[-1]["role"] != "assistant"):
            raise RequestError(
                "continue_final_message needs an assistant message last", "continue_final_message"
            )


def check_text(value: Any, name: str) -> str:
    """A str that encodes as UTF-8 (JSON can carry lone surrogates, which no tokenizer takes)."""
    if not isinstance(value, str):
        raise RequestError(f"{name} must be a string, got {type(value).__name__}", name)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(f"{name} holds a lone UTF-16 surrogate, which is not text", name) from None
    return value


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """Validated copies of chat messages: a known role, text content (string or text parts)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", "messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where} must be an object with 'role' and 'content'", "messages")
        role = message.get("role")
        if role not in MESSAGE_ROLES:
            raise RequestError(
                f"{where}.role must be one of {', '.join(MESSAGE_ROLES)}, got {role!r}", "messages"
            )
        content = message.get("content")
        if content is None and role == "assistant":  # e.g. a turn that only called tools
            content = ""
        elif isinstance(content, list):  # content parts: only text is supported
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise RequestError(f"{where}: only text content parts are supported", "messages")
                texts.append(check_text(part.get("text"), f"{where}.content[].text"))
            content = "\n".join(texts)  # parts are separate pieces of text, not one cut in two
        else:
            content = check_text(content, f"{where}.content")
        clean = {"role": role, "content": content}
        if message.get("name") is not None:
            clean["name"] = check_text(message["name"], f"{where}.name")
        if role == "assistant" and message.get("tool_calls") is not None:
            clean["tool_calls"] = check_tool_calls(message["tool_calls"], where)
        if role == "tool":
            clean["tool_call_id"] = check_text(message.get("tool_call_id", ""), f"{where}.tool_call_id")
        out.append(clean)
    return out


class RequestPreparer:
    """Turns what a caller asks for into a `PreparedRequest` for one engine's limits."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        vocab_size: int,
        max_seq_len: int,
        eos_token_ids: Sequence[int],
        sampling_defaults: Mapping[str, Any],
        context_policy: str,
        processors: Sequence[RowProcessor] = (),
    ):
        """`processors`: the engine's registered logits processors, whose parameters a request's
        extra_args give (`jinfer.processors`)."""
        self.tokenizer = tokenizer
        self.processors = tuple(processors)
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.sampling_defaults = dict(sampling_defaults)
        self.context_policy = context_policy
        self.grammars = Grammars(tokenizer, vocab_size, eos_token_ids)
        # How this model calls tools, and whether its chat template takes them (jinfer.tools).
        self.tool_convention, self.template_takes_tools = convention_of(tokenizer)
        self.reasoning_format = reasoning_format_of(tokenizer)  # None: the model does not reason

    # ------------------------------------------------------------------------------ parts
    def sampling(self, sampling: SamplingParams | None) -> SamplingParams:
        """Resolve unset knobs (request > model defaults > jinfer's) and check the device limits."""
        sampling = (sampling or SamplingParams()).resolve(self.sampling_defaults)
        if sampling.logit_bias and len(sampling.logit_bias) > MAX_LOGIT_BIAS:
            raise RequestError(
                f"logit_bias has {len(sampling.logit_bias)} entries; at most {MAX_LOGIT_BIAS}", "logit_bias"
            )
        for name, ids in (
            ("logit_bias", sampling.logit_bias or ()),
            ("stop_token_ids", sampling.stop_token_ids or ()),
        ):
            if any(t >= self.vocab_size for t in ids):
                raise RequestError(
                    f"{name} names token ids outside the vocabulary [0, {self.vocab_size})", name
                )
        return sampling

    def prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a text prompt, or given ids checked against the vocabulary."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(check_text(prompt, "prompt"))
        elif isinstance(prompt, Sequence) and all(_is_int(t) for t in prompt):
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(
                    f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})", "prompt"
                )
        else:
            raise RequestError("prompt must be a string or a list of token ids", "prompt")
        if not ids:
            raise RequestError("prompt is empty (it encodes to no tokens)", "prompt")
        return ids

    def chat_ids(
        self, messages: list[dict[str, Any]], template: ChatTemplate = ChatTemplate(), tools: list[Tool] = ()
    ) -> list[int]:
        """Token ids of validated messages (and the tools offered) through the model's chat
        template, rendered as `template` says (checked); a template that knows no tools hears of
        them and of earlier calls from jinfer (`jinfer.tools.conversation_for`)."""
        if not self.tokenizer.chat_template:
            raise RequestError("this model has no chat template; send a plain prompt instead", "messages")
        template.check(messages)
        native = self.template_takes_tools
        extra = {"tools": [t.openai() for t in tools]} if native and tools else {}
        messages = conversation_for(messages, list(tools), self.tool_convention, native)
        try:
            text = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=template.add_generation_prompt, **extra, **template.variables
            )
        except TokenizerError as e:
            raise RequestError(str(e), "messages") from None
        if template.continue_final_message:  # the text stops where the last message's content does
            final = messages[-1]["content"]
            end = text.rfind(final) if final else -1
            if end < 0:
                raise RequestError(
                    "the template does not write the final message's text", "continue_final_message"
                )
            text = text[: end + len(final)]
        return self.tokenizer.encode(text, add_special_tokens=False)  # the template wrote BOS where wanted

    def policy(self, context_policy: str | None) -> str:
        policy = context_policy or self.context_policy
        if policy not in CONTEXT_POLICIES:
            raise RequestError(
                f"context_policy must be one of {', '.join(CONTEXT_POLICIES)}, got {policy!r}",
                "context_policy",
            )
        return policy

    # ------------------------------------------------------------------------------ whole
    def prepare(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        messages: Any = None,
        sampling: SamplingParams | None = None,
        context_policy: str | None = None,
        cache_salt: str | None = None,
        tools: Any = None,
        tool_choice: Any = None,
        parallel_tool_calls: bool = True,
        adapter: str | None = None,
        template: ChatTemplate = ChatTemplate(),
        priority: int = DEFAULT_PRIORITY,
        prediction: str | Sequence[int] | None = None,
    ) -> PreparedRequest:
        """Exactly one of `prompt` (text or ids) and `messages` (a chat). `cache_salt`: prompts
        cached under it are found only by requests with the same salt (tenants that must not
        share the prefix cache, or measure each other's hits, use different salts). `tools`,
        `tool_choice`, `parallel_tool_calls`: OpenAI's, for a chat (`jinfer.tools`). `adapter`:
        the name of a loaded adapter (the engine resolves it). `template`: how a chat renders.
        `priority`: lower runs first (vLLM's), 0 by default. `prediction`: the text (or token ids) the
        output is expected to be (or to be much like), for speculative decoding to draft from."""
        _check_request_fields(prompt, messages, priority, adapter, cache_salt)
        sampling = self.sampling(sampling)
        if sampling.seed is None:  # decided here, for every door: reported back, it reproduces the output
            sampling = dataclasses.replace(sampling, seed=secrets.randbits(32))
        offered, use, sampling = self._tools(messages, tools, tool_choice, parallel_tool_calls, sampling)
        policy = self.policy(context_policy)
        dropped_messages = 0
        if messages is None:
            ids, max_tokens, dropped_tokens = self._fit(self.prompt_ids(prompt), sampling.max_tokens, policy)
        else:
            ids, max_tokens, dropped_tokens, dropped_messages = self._fit_chat(
                check_messages(messages), sampling.max_tokens, policy, offered, template
            )
        eos = frozenset() if sampling.ignore_eos else self.eos_token_ids
        stop_ids = frozenset(sampling.stop_token_ids or ()) | eos
        if len(stop_ids) > MAX_STOP_IDS:
            raise RequestError(f"{len(stop_ids)} stop token ids; at most {MAX_STOP_IDS}", "stop_token_ids")
        reasoning = self._reasoning(messages is not None, ids, sampling)
        grammar = self.grammars.compile(sampling)
        if reasoning is not None and grammar is not None:  # it holds the answer, not the thinking
            grammar = grammar.after_thinking(reasoning)
        return PreparedRequest(
            ids,
            sampling,
            max_tokens,
            stop_ids,
            dropped_tokens,
            dropped_messages,
            cache_salt,
            grammar,
            use,
            adapter,
            priority,
            self._prediction_ids(prediction),
            reasoning,
            processor_inputs(self.processors, sampling.extra_args),
        )

    def _reasoning(self, chat: bool, ids: list[int], sampling: SamplingParams) -> Reasoning | None:
        """How a chat's output thinks, for a reasoning model (`jinfer.reasoning`); None otherwise."""
        if not chat or self.reasoning_format is None:
            return None
        return Reasoning.of_prompt(self.reasoning_format, ids, sampling.max_reasoning_tokens)

    def _prediction_ids(self, prediction: str | Sequence[int] | None) -> tuple[int, ...]:
        """A predicted output's tokens: a text's as the model would write it (no special tokens
        added), or ids checked as a prompt's are; at most a window's worth."""
        if prediction is None:
            return ()
        if isinstance(prediction, str):
            ids = self.tokenizer.encode(check_text(prediction, "prediction"), add_special_tokens=False)
        else:
            try:
                ids = self.prompt_ids(prediction)
            except RequestError as e:
                raise RequestError(str(e).replace("prompt", "prediction"), "prediction") from None
        return tuple(ids[: self.max_seq_len])

    def _tools(self, messages, tools, tool_choice, parallel: bool, sampling: SamplingParams):
        """(the tools the prompt offers, how to read the calls, the sampling with a required call's
        grammar): a chat's tools and tool_choice, checked."""
        if tools is None and tool_choice is None:
            return [], None, sampling
        if messages is None:
            raise RequestError("tools are for chats: give messages", "tools")
        if tools is None:
            raise RequestError("tool_choice needs tools", "tool_choice")
        if not isinstance(parallel, bool):
            raise RequestError("parallel_tool_calls must be true or false", "parallel_tool_calls")
        offered = parse_tools(tools)
        choice = parse_tool_choice(tool_choice, offered)
        if choice == "none":
            return [], None, sampling
        convention = self.tool_convention
        called = offered if choice in ("auto", "required") else [t for t in offered if t.name == choice]
        if choice != "auto":  # the call decides the output's form, over any response_format (OpenAI's rule)
            self.grammars.compile(sampling)  # the constraint set aside is still checked
            grammar = convention.grammar(called, parallel and choice == "required")
            sampling = dataclasses.replace(sampling, json_schema=None, regex=None, grammar=grammar)
        return offered, ToolUse(convention, choice, tuple(t.name for t in called)), sampling

    def _fit(self, ids: list[int], max_tokens: int | None, policy: str) -> tuple[list[int], int, int]:
        """(prompt ids, max_tokens within the window, prompt tokens dropped)."""
        n, limit = len(ids), self.max_seq_len
        wanted = max_tokens if max_tokens is not None else 1
        if n + wanted <= limit:
            return ids, (max_tokens if max_tokens is not None else limit - n), 0
        if policy != "truncate" or wanted >= limit:
            raise ContextLengthError(n, max_tokens, limit)
        keep = limit - wanted
        return ids[n - keep :], wanted, n - keep

    def _fit_chat(self, messages, max_tokens, policy, tools, template) -> tuple[list[int], int, int, int]:
        """`drop_oldest` removes whole messages (never system ones, never the last) until it fits."""
        dropped = 0
        while True:
            ids = self.chat_ids(messages, template, tools)
            if policy != "drop_oldest":
                return (*self._fit(ids, max_tokens, policy), 0)
            if len(ids) + (max_tokens or 1) <= self.max_seq_len:
                return (*self._fit(ids, max_tokens, "error"), dropped)
            droppable = [i for i, m in enumerate(messages) if m["role"] not in ("system", "developer")]
            if len(droppable) <= 1:  # the last message is the question
                raise ContextLengthError(len(ids), max_tokens, self.max_seq_len)
            messages = [m for i, m in enumerate(messages) if i != droppable[0]]
            dropped += 1


def _check_request_fields(prompt, messages, priority, adapter, cache_salt) -> None:
    """The request's fields beside its sampling, checked in this order."""
    if not _is_int(priority) or not -(2**31) <= priority < 2**31:
        raise RequestError("priority must be an integer in [-2**31, 2**31)", "priority")
    if adapter is not None:
        check_text(adapter, "adapter")
    if (prompt is None) == (messages is None):
        raise RequestError("give either a prompt or messages", "prompt")
    if cache_salt is not None and (not check_text(cache_salt, "cache_salt") or len(cache_salt) > 1024):
        raise RequestError("cache_salt must be a non-empty string of at most 1024 characters", "cache_salt")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
