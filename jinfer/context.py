"""Context-window policies: what to do when a prompt plus its output would not fit a slot.

    error        reject, with both numbers (the default)
    truncate     keep the most recent prompt tokens; report how many were dropped
    drop_oldest  (chat) drop whole earliest non-system messages until it fits

`max_tokens=None` means "up to the window": whatever the prompt leaves free.
"""

from __future__ import annotations

from typing import Any

from jinfer.config import CONTEXT_POLICIES
from jinfer.tokenizer import Tokenizer


class ContextLengthError(ValueError):
    """The prompt and the requested output do not fit the context window."""

    def __init__(self, prompt_tokens: int, max_tokens: int | None, max_seq_len: int):
        self.prompt_tokens, self.max_tokens, self.max_seq_len = prompt_tokens, max_tokens, max_seq_len
        wanted = "at least one output token" if max_tokens is None else f"max_tokens={max_tokens}"
        super().__init__(
            f"this model's context window is {max_seq_len} tokens, but the prompt has {prompt_tokens} tokens "
            f"and {wanted} was requested; shorten the prompt, lower max_tokens, or ask for truncation"
        )


def _check_policy(policy: str) -> None:
    if policy not in CONTEXT_POLICIES:
        raise ValueError(f"context policy must be one of {CONTEXT_POLICIES}, got {policy!r}")


def fit_prompt(
    prompt_ids: list[int], max_tokens: int | None, max_seq_len: int, policy: str
) -> tuple[list[int], int, int]:
    """Return (prompt ids, resolved max_tokens, number of prompt tokens dropped)."""
    _check_policy(policy)
    n = len(prompt_ids)
    wanted = max_tokens if max_tokens is not None else 1
    if n + wanted <= max_seq_len:
        return prompt_ids, (max_tokens if max_tokens is not None else max_seq_len - n), 0
    if policy != "truncate" or wanted >= max_seq_len:
        raise ContextLengthError(n, max_tokens, max_seq_len)
    keep = max_seq_len - wanted
    return prompt_ids[n - keep :], wanted, n - keep


def fit_conversation(
    tokenizer: Tokenizer,
    messages: list[dict[str, Any]],
    max_tokens: int | None,
    max_seq_len: int,
    policy: str,
) -> tuple[list[int], int, int]:
    """Render a chat and fit it; `drop_oldest` removes whole messages (never system ones).

    Returns (prompt ids, resolved max_tokens, number of messages dropped).
    """
    _check_policy(policy)
    messages = list(messages)
    dropped = 0
    while True:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if policy != "drop_oldest":
            ids, resolved, _ = fit_prompt(ids, max_tokens, max_seq_len, policy)
            return ids, resolved, 0
        if len(ids) + (max_tokens or 1) <= max_seq_len:
            return ids, (max_tokens if max_tokens is not None else max_seq_len - len(ids)), dropped
        droppable = [i for i, m in enumerate(messages) if m.get("role") != "system"]
        if len(droppable) <= 1:  # never drop the last message: it is the question
            raise ContextLengthError(len(ids), max_tokens, max_seq_len)
        del messages[droppable[0]]
        dropped += 1
