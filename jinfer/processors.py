"""Logits processors registered by name: checking one when the engine is built, finding one a
server names (`module:attribute`), and the two jinfer ships as examples.

A processor (`jinfer.inputs.RowProcessor`) is a pure JAX function of a step's logits, the rows'
token histories (`jinfer.sampling.TokenHistory`) and their per-request parameters, compiled into
every step that samples (prompt, decode, a verify step's later positions, a constrained row's
`sample`). It is registered when the engine is built (`LLM(logits_processors={name: processor})`,
`jinfer serve --logits-processor [NAME=]module:attribute`) and a request selects it by name with
its parameters (`SamplingParams.extra_args`, over HTTP the body's `extra_args`):

    llm = jinfer.LLM(logits_processors={"no_repeat_ngram": no_repeat_ngram(), "ban": ban_tokens()})
    llm.generate(prompt, SamplingParams(extra_args={"no_repeat_ngram": 3, "ban": {"tokens": [42]}}))

`registered` traces each one with the engine's shapes (abstractly, nothing runs), so a function that
raises or returns the wrong shape is refused then, never in the middle of a step.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jinfer.inputs import InputSpec, RowProcessor, neutral_inputs
from jinfer.sampling import TokenHistory

# The rows a processor is traced with when it is registered.
_TRACED_ROWS = 2


def registered(
    processors: Mapping[str, RowProcessor] | Sequence[RowProcessor], *, vocab: int, seq: int
) -> tuple[RowProcessor, ...]:
    """The processors an engine is built with, each under its name (a mapping's key, else its
    own), each traced over logits [rows, vocab] and histories of `seq` tokens: a ValueError
    naming the one that raises, or returns anything but float32 logits of the same shape."""
    if isinstance(processors, Mapping):
        processors = [p._replace(name=name) for name, p in processors.items()]
    names = [p.name for p in processors]
    if len(set(names)) != len(names):
        raise ValueError(f"logits processors need distinct names, got {names}")
    for processor in processors:
        _check(processor, vocab, seq)
    return tuple(processors)


def _check(processor: RowProcessor, vocab: int, seq: int) -> None:
    if not isinstance(processor, RowProcessor):
        kind = type(processor).__name__
        raise ValueError(f"a logits processor is a jinfer.inputs.RowProcessor, got {kind}")
    rows = _TRACED_ROWS
    logits = jax.ShapeDtypeStruct((rows, vocab), jnp.float32)
    history = TokenHistory(
        jax.ShapeDtypeStruct((rows, seq), jnp.int32),
        jax.ShapeDtypeStruct((rows,), jnp.int32),
        jax.ShapeDtypeStruct((rows,), jnp.int32),
        jax.ShapeDtypeStruct((rows, vocab), jnp.bool_),
    )
    try:
        values = neutral_inputs(rows, processors=[processor]).processors[processor.name]
        out = jax.eval_shape(processor.apply, logits, history, values)
    except Exception as e:  # anything user code raises while traced: refused here, by name
        failure = f"{type(e).__name__}: {e}"
        raise ValueError(f"logits processor {processor.name!r} fails when traced: {failure}") from e
    fits = isinstance(out, jax.ShapeDtypeStruct) and (out.shape, out.dtype) == (logits.shape, logits.dtype)
    if not fits:
        got = f"{out.shape} {out.dtype}" if isinstance(out, jax.ShapeDtypeStruct) else type(out).__name__
        raise ValueError(
            f"logits processor {processor.name!r} returns {got}, not the logits' shape {logits.shape} float32"
        )


def load(flag: str) -> RowProcessor:
    """The processor a `[NAME=]module:attribute` flag names: a RowProcessor, or a function of no
    arguments returning one (such as `jinfer.processors:no_repeat_ngram`); NAME renames it."""
    name, _, where = flag.rpartition("=")
    module_name, _, attribute = where.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"{flag!r}: give [NAME=]module:attribute")
    try:
        found = getattr(importlib.import_module(module_name), attribute)
        processor = found if isinstance(found, RowProcessor) else found() if callable(found) else found
    except Exception as e:  # importing or calling user code: refused at start-up, by flag
        raise ValueError(f"{flag!r}: {type(e).__name__}: {e}") from None
    if not isinstance(processor, RowProcessor):
        raise ValueError(f"{flag!r} is not a jinfer.inputs.RowProcessor (nor a function returning one)")
    return processor._replace(name=name) if name else processor


def _whole(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    return int(value)


# --- no-repeat-n-gram -----------------------------------------------------------------------------


def no_repeat_ngram(max_size: int = 8) -> RowProcessor:
    """Never repeat an n-gram of the sequence (prompt and output), as transformers'
    `no_repeat_ngram_size`: a token that would complete an n-gram already there is banned.
    Parameters: n (an integer in 1..max_size; 0: off), given as `{"no_repeat_ngram": n}` or
    `{"no_repeat_ngram": {"n": n}}`."""

    def of_args(args):
        n = _whole(args.get("n") if isinstance(args, Mapping) else args, "n")
        if not 0 <= n <= max_size:
            raise ValueError(f"n must be in 0..{max_size}, got {n}")
        return n

    def apply(logits, history: TokenHistory, n):
        return jnp.where(_repeating(history, n, max_size, logits.shape[1]), -jnp.inf, logits)

    return RowProcessor("no_repeat_ngram", InputSpec(("rows",), np.int32, 0), of_args, apply)


def _repeating(history: TokenHistory, n, max_size: int, vocab: int) -> jax.Array:
    """[N, V] bool: the tokens that would complete an n-gram (n [N]) already in each row's tokens:
    those after each earlier occurrence of the row's last n - 1 tokens."""
    tokens, length = history.tokens, history.length
    rows, seq = tokens.shape
    padded = jnp.concatenate([tokens, jnp.full((rows, max_size), -1, tokens.dtype)], axis=1)
    starts = jnp.arange(seq)[None, :]
    match = (n[:, None] >= 1) & (starts + n[:, None] <= length[:, None])  # whole n-grams only
    for j in range(max_size - 1):  # the n-gram's first n - 1 tokens against the last n - 1
        tail = jnp.take_along_axis(padded, jnp.clip(length - n + 1 + j, 0)[:, None], axis=1)
        match &= (j >= n[:, None] - 1) | (padded[:, j : j + seq] == tail)
    following = jnp.take_along_axis(padded, starts + jnp.maximum(n[:, None] - 1, 0), axis=1)
    banned = jnp.where(match, following, vocab)  # vocab: out of range, dropped
    return jnp.zeros((rows, vocab), bool).at[jnp.arange(rows)[:, None], banned].set(True, mode="drop")


# --- a ban list and a length penalty --------------------------------------------------------------


def ban_tokens(max_banned: int = 64) -> RowProcessor:
    """Never emit the tokens of a per-request list, and make ending likelier as the output grows:
    parameters `{"tokens": [ids...], "length_penalty": [start, factor]}` (either may be left out).
    The penalty is transformers' `exponential_decay_length_penalty`: once `start` tokens are
    generated, each stop token's logit grows by |logit| x (factor ** (generated - start) - 1).
    Token ids past the vocabulary ban nothing."""
    spec = {
        "tokens": InputSpec(("rows", max_banned), np.int32, -1),
        "start": InputSpec(("rows",), np.int32, 0),
        "factor": InputSpec(("rows",), np.float32, 1.0),
    }

    def of_args(args):
        if not isinstance(args, Mapping) or not set(args) <= {"tokens", "length_penalty"}:
            raise ValueError('give {"tokens": [ids], "length_penalty": [start, factor]}')
        ids = [_whole(t, "a banned token") for t in args.get("tokens", ())]
        if len(ids) > max_banned or any(t < 0 for t in ids):
            raise ValueError(f"tokens: at most {max_banned} non-negative ids")
        start, factor = args.get("length_penalty", (0, 1.0))
        start = _whole(start, "length_penalty's start")
        if start < 0 or not (isinstance(factor, int | float) and 0 < factor < 1e3):
            raise ValueError("length_penalty: [start >= 0, factor > 0]")
        return {"tokens": ids + [-1] * (max_banned - len(ids)), "start": start, "factor": factor}

    def apply(logits, history: TokenHistory, values):
        rows = jnp.arange(logits.shape[0])[:, None]
        past = history.generated - values["start"]
        grow = jnp.where(past > 0, values["factor"] ** past.astype(jnp.float32) - 1.0, 0.0)
        penalised = history.stops & (grow[:, None] != 0) & jnp.isfinite(logits)
        logits = jnp.where(penalised, logits + jnp.abs(logits) * grow[:, None], logits)
        banned = jnp.where(values["tokens"] >= 0, values["tokens"], logits.shape[1])
        return logits.at[rows, banned].set(-jnp.inf, mode="drop")

    return RowProcessor("ban_tokens", spec, of_args, apply)
