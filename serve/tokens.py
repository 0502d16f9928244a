"""The bodies of POST /tokenize and /detokenize (vLLM's and llama.cpp's extra endpoints): a prompt
or a conversation to its token ids, token ids back to text; and of GET /tokenizer_info (vLLM's),
what a client needs to tokenize as the server does (lm-eval's remote tokenizer reads it). Bad
input raises `APIError` (400)."""

from __future__ import annotations

from typing import Any

from jinfer.prepare import ChatTemplate, RequestError, RequestPreparer, check_messages, check_text
from jinfer.tokenizer import Tokenizer

from .protocol import APIError


def tokenize(preparer: RequestPreparer, body: dict[str, Any]) -> dict[str, Any]:
    """{"prompt": text, "add_special_tokens"?} or {"messages", "add_generation_prompt"?,
    "continue_final_message"?, "chat_template_kwargs"?} -> {"tokens", "count", "max_model_len"}."""
    try:
        if "messages" in body:
            template = ChatTemplate(
                add_generation_prompt=body.get("add_generation_prompt", True),
                continue_final_message=body.get("continue_final_message", False),
                variables=body.get("chat_template_kwargs") or {},
            )
            ids = preparer.chat_ids(check_messages(body["messages"]), template)
        elif isinstance(body.get("prompt"), str):
            add_special = body.get("add_special_tokens", True)
            if not isinstance(add_special, bool):
                raise RequestError("add_special_tokens must be true or false", "add_special_tokens")
            ids = preparer.tokenizer.encode(
                check_text(body["prompt"], "prompt"), add_special_tokens=add_special
            )
        else:
            raise RequestError("give 'prompt' (a string) or 'messages'", "prompt")
    except RequestError as e:
        raise APIError(400, str(e), param=e.param) from None
    return {"tokens": ids, "count": len(ids), "max_model_len": preparer.max_seq_len}


def tokenizer_info(tokenizer: Tokenizer, max_seq_len: int) -> dict[str, Any]:
    """The tokenizer's special tokens, chat template and the model's context length, in the fields
    of a Hugging Face tokenizer config (as vLLM's /tokenizer_info gives them)."""
    return {
        "tokenizer_class": type(tokenizer.backend).__name__,
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "pad_token": None,
        "unk_token": None,
        "chat_template": tokenizer.chat_template,
        "model_max_length": max_seq_len,
        "eos_token_ids": list(tokenizer.eos_token_ids),
    }


def detokenize(tokenizer: Tokenizer, vocab: int, body: dict[str, Any]) -> dict[str, Any]:
    """{"tokens": [ids]} -> {"prompt": text} (special tokens kept)."""
    tokens = body.get("tokens")
    valid = lambda t: isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
    if not isinstance(tokens, list) or not all(valid(t) for t in tokens):
        raise APIError(400, f"'tokens' must be a list of token ids in [0, {vocab})", param="tokens")
    return {"prompt": tokenizer.decode(tokens, skip_special_tokens=False)}
