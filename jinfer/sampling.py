"""Sampling: the user-facing `SamplingParams` and pure per-row sampling functions.

Every knob reaches the device as a per-row array (`SamplingArrays`), never as a static argument,
so one compiled step serves any mix of settings. Per-request randomness comes from the request's
seed folded with the token position: a row's draw never depends on its neighbours or its row.

    logits [B, V] -> penalties (repetition / presence / frequency) -> + logit_bias
        -> the engine's registered processors (`jinfer.processors`), with each row's input and tokens
        -> rows short of min_tokens: -inf for stop tokens -> constrained rows: -inf outside the allowed tokens
        -> rows whose thinking ran out of budget (`jinfer.reasoning`): only the closing marker
        -> greedy rows: argmax | sampled rows: / temperature -> top-k -> top-p -> min-p -> categorical

`process` is that chain, the one every step that samples goes through (prefill, decode, `sample`,
a verify step's later positions); `choose` runs it and picks, giving what leaves the device per
step (`StepOutput`: tokens, a non-finite flag, and log-probs when some row asks for them: of the
raw logits, or, for a row whose `logprobs_mode` is "processed", of what its token is drawn from).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jinfer.numerics import log_softmax
from jinfer.options import setting


class RequestError(ValueError):
    """A request field has the wrong type or is out of range; `param` names the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


INT32_MAX = 2**31 - 1  # integer knobs reach the device as int32
TOP_LOGPROBS = 20  # alternatives computed when any request wants log-probs (OpenAI's maximum)
SEED_LIMIT = 2**64  # seeds are any 64-bit value; the device folds them to 32 bits
# What a row's log-probs are of: the model's distribution (log-softmax of its logits), or the one
# its token is drawn from (`logprobs_of`).
LOGPROBS_MODES = ("raw", "processed")

# The knobs a model's generation_config.json (or its preset) may set; unset (None) on a request,
# they take the model's value, else these (OpenAI's defaults: plain sampling at temperature 1).
MODEL_DEFAULTS = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0}


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one request; validated on construction (RequestError names the field).

    `temperature=0` is greedy. Knobs left at None take the model's defaults (its
    generation_config.json or preset), then jinfer's (`MODEL_DEFAULTS`): `resolve` does that, once,
    for every door. `max_tokens=None` generates until a stop condition or the context window ends.
    """

    max_tokens: int | None = setting(None, "most tokens to generate; unset: until a stop or the context ends")
    temperature: float | None = setting(None, "0: greedy; unset: the model's default, else 1")
    top_k: int | None = setting(None, "keep the k likeliest tokens (0: off); unset: the model's default")
    top_p: float | None = setting(None, "nucleus sampling mass in (0, 1]; unset: the model's default")
    min_p: float | None = setting(None, "drop tokens below min_p x the likeliest's probability")
    repetition_penalty: float | None = setting(None, "divide logits of seen tokens (> 1 discourages)")
    presence_penalty: float = setting(0.0, "subtract from logits of tokens already generated, in [-2, 2]")
    frequency_penalty: float = setting(0.0, "subtract per occurrence of a generated token, in [-2, 2]")
    logit_bias: dict[int, float] | None = None  # token id -> bias in [-100, 100], added to its logit
    seed: int | None = setting(None, "seed for reproducible sampling (unset: a fresh one per request)")
    stop: Sequence[str] | None = None  # strings that end the output (not included in it)
    stop_token_ids: Sequence[int] | None = None  # token ids that end the output, beside eos
    ignore_eos: bool = setting(False, "keep generating past end-of-sequence tokens")
    min_tokens: int = setting(0, "tokens to generate before a stop token may end the output")
    max_reasoning_tokens: int | None = setting(
        None,
        "a reasoning model's budget of thinking tokens: past it the thinking is closed and the answer "
        "follows (`jinfer.reasoning`); unset: none",
    )
    logprobs: int | None = None  # number of top alternatives to report per token (0: chosen only)
    logprobs_mode: str = setting(
        "raw", "log-probs of the model's distribution (raw) or of the one the token is drawn from (processed)"
    )
    speculative: bool | None = setting(
        None, "false: never verify draft tokens for this request (the output is the same either way)"
    )
    # Constrained output (at most one; `jinfer.structured`): JSON valid against a JSON schema (an
    # object, or its JSON text), text matching a regular expression (Rust regex syntax), or text
    # following a grammar (Lark, or llama.cpp's GBNF).
    json_schema: dict[str, Any] | str | None = None
    regex: str | None = None
    grammar: str | None = None
    # Arguments for the engine's registered processors (`jinfer.inputs.RowProcessor.of_request`
    # reads its own), as vLLM's extra_args: a mapping of names to JSON-like values.
    extra_args: dict[str, Any] | None = None

    def __post_init__(self):
        _validate(self)

    @property
    def penalised(self) -> bool:
        """Whether a repetition, presence or frequency penalty applies (tokens so far matter)."""
        return self.repetition_penalty not in (None, 1.0) or bool(
            self.presence_penalty or self.frequency_penalty
        )

    @property
    def resolved(self) -> bool:
        return all(getattr(self, name) is not None for name in MODEL_DEFAULTS)

    def resolve(self, model_defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        """Each unset knob from `model_defaults`, else from jinfer's defaults."""
        model_defaults = model_defaults or {}
        chosen = {}
        for name, fallback in MODEL_DEFAULTS.items():
            if getattr(self, name) is None:
                chosen[name] = model_defaults.get(name, fallback)
        return dataclasses.replace(self, **chosen) if chosen else self


def _validate(p: SamplingParams) -> None:
    def number(name, low=None, high=None, low_open=False):
        value = getattr(p, name)
        if value is None:
            return
        if not _finite_number(value):
            raise RequestError(f"{name} must be a finite number, got {_short(value)}", name)
        if low is not None and (value <= low if low_open else value < low):
            raise RequestError(f"{name} must be {'>' if low_open else '>='} {low}, got {value}", name)
        if high is not None and value > high:
            raise RequestError(f"{name} must be <= {high}, got {value}", name)

    integer = _check_integer
    number("temperature", low=0)
    number("top_p", low=0, low_open=True, high=1)
    number("min_p", low=0, high=1)
    number("repetition_penalty", low=0, low_open=True)
    number("presence_penalty", low=-2, high=2)
    number("frequency_penalty", low=-2, high=2)
    if p.max_tokens is not None:
        integer("max_tokens", p.max_tokens, 1)
    if p.top_k is not None:
        integer("top_k", p.top_k, 0)
    integer("min_tokens", p.min_tokens, 0)
    if p.max_reasoning_tokens is not None:
        integer("max_reasoning_tokens", p.max_reasoning_tokens, 0)
    if p.seed is not None:
        integer("seed", p.seed, 0, SEED_LIMIT - 1)
    if p.logprobs is not None:
        integer("logprobs", p.logprobs, 0, 20)
    if p.logprobs_mode not in LOGPROBS_MODES:
        modes = " or ".join(LOGPROBS_MODES)
        raise RequestError(f"logprobs_mode must be {modes}, got {_short(p.logprobs_mode)}", "logprobs_mode")
    if p.speculative is not None and not isinstance(p.speculative, bool):
        raise RequestError(f"speculative must be true or false, got {_short(p.speculative)}", "speculative")
    if not isinstance(p.ignore_eos, bool):
        raise RequestError(f"ignore_eos must be true or false, got {_short(p.ignore_eos)}", "ignore_eos")
    _validate_logit_bias(p.logit_bias)
    if isinstance(p.stop, str):
        object.__setattr__(p, "stop", (p.stop,))
    if p.stop is not None:
        if not isinstance(p.stop, Sequence) or not all(isinstance(s, str) and s for s in p.stop):
            raise RequestError(f"stop must be non-empty strings, got {_short(p.stop)}", "stop")
        object.__setattr__(p, "stop", tuple(p.stop))
    _validate_constraint(p)
    if p.extra_args is not None and (
        not isinstance(p.extra_args, Mapping) or not all(isinstance(k, str) for k in p.extra_args)
    ):
        raise RequestError("extra_args must map names to values", "extra_args")
    if p.stop_token_ids is not None:
        if not isinstance(p.stop_token_ids, Sequence) or isinstance(p.stop_token_ids, str):
            raise RequestError("stop_token_ids must be a list of token ids", "stop_token_ids")
        for token in p.stop_token_ids:
            integer("stop_token_ids entry", token, 0)
        object.__setattr__(p, "stop_token_ids", tuple(p.stop_token_ids))


def _check_integer(name: str, value, minimum: int, maximum: int = INT32_MAX) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value <= maximum:
        raise RequestError(f"{name} must be an integer in [{minimum}, {maximum}], got {_short(value)}", name)


def _validate_logit_bias(logit_bias) -> None:
    if logit_bias is None:
        return
    if not isinstance(logit_bias, Mapping):
        raise RequestError("logit_bias must map token ids to biases", "logit_bias")
    for token, bias in logit_bias.items():
        _check_integer("logit_bias token id", token, 0)
        if not _finite_number(bias):
            raise RequestError(
                f"logit_bias[{token}] must be a finite number, got {_short(bias)}", "logit_bias"
            )
        if abs(bias) > 100:
            raise RequestError(f"logit_bias[{token}] must be in [-100, 100], got {bias}", "logit_bias")


def _validate_constraint(p: SamplingParams) -> None:
    """Types only: whether a schema, expression or grammar compiles is for `jinfer.structured`."""
    given = [name for name in ("json_schema", "regex", "grammar") if getattr(p, name) is not None]
    if len(given) > 1:
        raise RequestError(f"give at most one of json_schema, regex and grammar, not {given}", given[1])
    for name in ("regex", "grammar"):
        value = getattr(p, name)
        if value is not None and (not isinstance(value, str) or not value):
            raise RequestError(f"{name} must be a non-empty string, got {_short(value)}", name)
    schema = p.json_schema
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise RequestError(f"json_schema is not valid JSON: {e}", "json_schema") from None
    if schema is not None and not isinstance(schema, dict | bool):
        raise RequestError(
            f"json_schema must be a JSON schema (an object), got {_short(schema)}", "json_schema"
        )


def _finite_number(value) -> bool:
    """An int or float a float32 can hold the meaning of (a 400-digit int is not one)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    return abs(value) <= 2**53 if isinstance(value, int) else math.isfinite(value)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


@struct.dataclass
class SamplingArrays:
    """Per-row sampling knobs as device arrays (rows are requests or slots)."""

    temperature: jax.Array  # [B] float32; 0 = greedy
    top_k: jax.Array  # [B] int32; 0 = off
    top_p: jax.Array  # [B] float32
    min_p: jax.Array  # [B] float32
    repetition_penalty: jax.Array  # [B] float32
    presence_penalty: jax.Array  # [B] float32
    frequency_penalty: jax.Array  # [B] float32
    seed: jax.Array  # [B] uint32
    logprobs_mode: jax.Array  # [B] int32: the index of the row's mode in LOGPROBS_MODES
    # A reasoning budget (`jinfer.reasoning.BudgetKnobs`): the thinking's opening marker (-1: the
    # prompt opened it), its closing one (-1: no budget), the output tokens before it is due.
    think_open: jax.Array  # [B] int32
    think_close: jax.Array  # [B] int32
    think_limit: jax.Array  # [B] int32

    @classmethod
    def from_params(
        cls, params: Sequence[SamplingParams], seeds: Sequence[int], budgets=None
    ) -> SamplingArrays:
        """Rows of resolved params (`SamplingParams.resolve`): an unset knob would become NaN;
        `budgets`: each row's reasoning budget knobs (open, close, limit), None: no budget."""
        if not all(p.resolved for p in params):
            raise ValueError("SamplingArrays needs resolved SamplingParams (SamplingParams.resolve)")
        col = lambda name, dtype: np.array([getattr(p, name) for p in params], dtype=dtype)
        budget = np.array(
            [(-1, -1, 0) if b is None else tuple(b) for b in budgets or [None] * len(params)], np.int32
        )
        return cls(
            temperature=col("temperature", np.float32),
            top_k=col("top_k", np.int32),
            top_p=col("top_p", np.float32),
            min_p=col("min_p", np.float32),
            repetition_penalty=col("repetition_penalty", np.float32),
            presence_penalty=col("presence_penalty", np.float32),
            frequency_penalty=col("frequency_penalty", np.float32),
            seed=np.array([seed % 2**32 for seed in seeds], dtype=np.uint32),
            logprobs_mode=np.array([LOGPROBS_MODES.index(p.logprobs_mode) for p in params], np.int32),
            think_open=budget[:, 0],
            think_close=budget[:, 1],
            think_limit=budget[:, 2],
        )


def _per_row(a: jax.Array, logits: jax.Array) -> jax.Array:
    """A per-row array [B, ...] spread over the positions axis of logits [B, T, V] (as is for [B, V])."""
    return a if logits.ndim == 2 else a[:, None]


def _knob(a: jax.Array, logits: jax.Array) -> jax.Array:
    """A per-row knob [B] shaped to broadcast against logits [B, V] or [B, T, V]."""
    return a.reshape(a.shape + (1,) * (logits.ndim - 1))


def apply_penalties(
    logits: jax.Array, prompt_mask: jax.Array, output_counts: jax.Array, s: SamplingArrays
) -> jax.Array:
    """Repetition penalty over prompt + output tokens; presence/frequency over output tokens.

    logits [B, V] (or [B, T, V]) float32; prompt_mask [B, V] bool; output_counts [B, V] int32. A
    batch without penalties skips the passes over the vocabulary (`lax.cond`): neutral ones change
    no bit.
    """

    def penalise():
        seen = _per_row(prompt_mask | (output_counts > 0), logits)
        rep = _knob(s.repetition_penalty, logits)
        penalised = jnp.where(logits > 0, logits / rep, logits * rep)
        counts = _per_row(output_counts, logits).astype(jnp.float32)
        out = jnp.where(seen, penalised, logits) - _knob(s.frequency_penalty, logits) * counts
        return out - _knob(s.presence_penalty, logits) * (counts > 0)

    neutral = (s.repetition_penalty == 1.0) & (s.frequency_penalty == 0.0) & (s.presence_penalty == 0.0)
    return jax.lax.cond(jnp.all(neutral), lambda: logits, penalise)


def mask_disallowed(logits: jax.Array, allowed: jax.Array) -> jax.Array:
    """-inf for the tokens each row may not take: allowed [B, ceil(V / 32)] int32 holds token t's
    permission in bit t % 32 of word t // 32 (`jinfer.structured`). A batch whose every bit is set
    (no row constrained) skips the unpacking (`lax.cond`)."""

    def apply():
        bits = (allowed[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [B, W, 32]
        permitted = bits.reshape(allowed.shape[0], -1)[:, : logits.shape[-1]] != 0
        return jnp.where(_per_row(permitted, logits), logits, -jnp.inf)

    return jax.lax.cond(jnp.all(allowed == -1), lambda: logits, apply)


def sample(logits: jax.Array, s: SamplingArrays, positions: jax.Array) -> jax.Array:
    """Pick one token per row from processed logits [B, V]; positions [B] index the randomness.

    Greedy rows take the argmax. Sampled rows draw from softmax(logits / temperature) restricted by
    top-k, top-p and min-p. The full-vocabulary sort that truncation needs, and the draw itself,
    run only when some row asks for them (`lax.cond`), so an all-greedy batch pays for neither.
    """
    greedy = argmax(logits)

    def draw():
        candidates = drawn_from(logits, s)
        keys = jax.vmap(lambda seed, pos: jax.random.fold_in(jax.random.key(seed), pos))(s.seed, positions)
        sampled = jax.vmap(jax.random.categorical)(keys, candidates).astype(jnp.int32)
        return jnp.where(s.temperature > 0, sampled, greedy)

    return jax.lax.cond(jnp.any(s.temperature > 0), draw, lambda: greedy)


def drawn_from(processed: jax.Array, s: SamplingArrays) -> jax.Array:
    """The logits a sampled row's token is drawn from: processed logits [B, V] over the row's
    temperature (1 for a greedy row), -inf outside its top-k / top-p / min-p set (the truncation's
    sort runs only when some row truncates)."""
    scaled = processed / jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]
    truncating = (s.top_k > 0) | (s.top_p < 1.0) | (s.min_p > 0.0)
    return jax.lax.cond(jnp.any(truncating), _truncate, lambda x, _: x, scaled, s)


def argmax(logits: jax.Array) -> jax.Array:
    """`jnp.argmax` over the last axis as int32 (the first index of the maximum; a NaN counts as
    the maximum), computed as a max and then a min over the indices that hit it: XLA:CPU runs
    argmax's paired (value, index) reduction about half as fast (8 x 49152 logits: 853 against
    431 us)."""
    top = jnp.max(logits, axis=-1, keepdims=True)  # NaN if the row has one
    hit = (logits == top) | jnp.isnan(logits)
    index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.min(jnp.where(hit, index, logits.shape[-1]), axis=-1)


def _truncate(scaled: jax.Array, s: SamplingArrays) -> jax.Array:
    """Set logits outside each row's top-k / top-p / min-p set to -inf (the best token always stays)."""
    vocab = scaled.shape[-1]
    order = jnp.argsort(-scaled, axis=-1)  # [B, V] best first
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(vocab)[None, :]
    keep = rank < jnp.where(s.top_k > 0, s.top_k, vocab)[:, None]
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # mass of strictly better tokens
    keep &= before < s.top_p[:, None]
    keep &= probs >= s.min_p[:, None] * probs[:, :1]
    keep = keep.at[:, 0].set(True)
    kept_sorted = jnp.where(keep, sorted_logits, -jnp.inf)
    # Scatter back to vocabulary order.
    return jnp.zeros_like(scaled).at[jnp.arange(scaled.shape[0])[:, None], order].set(kept_sorted)


def token_logprobs(
    logits: jax.Array, tokens: jax.Array, top_n: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Log-probs of the chosen tokens [B] and the top_n alternatives ([B, n] values, [B, n] ids).

    Of whatever distribution `logits` are (`logprobs_of`: the raw one, as OpenAI reports them, or
    the processed one a row asks for).
    """
    logp = log_softmax(logits)
    chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    top_values, top_ids = jax.lax.top_k(logp, top_n)
    return chosen, top_values, top_ids.astype(jnp.int32)


@struct.dataclass
class StepOutput:
    """What leaves the device per step: [steps, rows] arrays (rows = slots, or 1 for prefill)."""

    tokens: jax.Array  # int32
    bad: jax.Array  # bool: the logits were not all finite; the token must not be used
    logprobs: jax.Array  # float32 log p of the chosen token (zeros unless asked for)
    top_ids: jax.Array  # [..., TOP_LOGPROBS] int32
    top_logprobs: jax.Array  # [..., TOP_LOGPROBS] float32


@jax.named_scope("sampling")
def process(
    logits,
    prompt_mask,
    counts,
    bias,
    stop_mask,
    banning,
    allowed,
    sampling,
    processors=(),
    forced=None,
    history=None,
) -> jax.Array:
    """The one logits-processing chain, from raw logits [B, V] (or [B, T, V]: T positions of each
    row, a verify step's) to what `sample` draws from: penalties (prompt_mask, counts [B, V]),
    logit bias [B, V], the registered processors ((processor, each row's input [B, ...]) pairs,
    `jinfer.inputs.RowProcessor`; `history`: a function giving the `TokenHistory` they see, [B]
    or [B, T] rows, built only when some row uses a processor), stop tokens (stop_mask [B, V])
    banned where `banning` [B] (or [B, T]: short of min_tokens), the allowed-token bitmask
    (allowed [B, W], `jinfer.structured`; None: every row unconstrained), and last the token a row must take
    (`forced` [B] or [B, T], -1: none; `forced_tokens`). Every step that samples goes through it."""
    processed = apply_penalties(logits, prompt_mask, counts, sampling) + _per_row(bias, logits)
    for processor, values in processors:
        processed = _processed_by(processor, processed, values, history)
    processed = jax.lax.cond(
        jnp.any(banning),
        lambda: jnp.where(_per_row(stop_mask, logits) & banning[..., None], -jnp.inf, processed),
        lambda: processed,
    )
    processed = processed if allowed is None else mask_disallowed(processed, allowed)
    if forced is None:
        return processed
    only = lambda: jnp.where(
        forced[..., None] < 0,
        processed,
        jnp.where(jnp.arange(logits.shape[-1]) == forced[..., None], 0.0, -jnp.inf),
    )
    return jax.lax.cond(jnp.any(forced >= 0), only, lambda: processed)


def forced_tokens(counts, generated, sampling: SamplingArrays) -> jax.Array:
    """The token each row must take next [B] (or [B, T], for `generated` [B, T]: the output tokens
    before each position), -1 for none: a reasoning budget's closing marker, due once `think_limit`
    tokens are sampled with the thinking open and not closed (counts [B, V]: the output's tokens)."""
    rows = jnp.arange(counts.shape[0])
    seen = lambda token: (token >= 0) & (counts[rows, jnp.maximum(token, 0)] > 0)
    s = sampling
    running = (s.think_close >= 0) & ((s.think_open < 0) | seen(s.think_open)) & ~seen(s.think_close)
    widen = lambda a: a.reshape(a.shape + (1,) * (generated.ndim - 1))
    return jnp.where(widen(running) & (generated >= widen(s.think_limit)), widen(s.think_close), -1)


class TokenHistory(NamedTuple):
    """What a logits processor sees of each of its rows' tokens (`jinfer.inputs.RowProcessor`):
    the sequence (tokens [N, L] int32: prompt then output, -1 from `length` on), its length [N]
    (the position of the token being chosen), how many of its last tokens are output
    (generated [N]), and the row's stop tokens (stops [N, V] bool: eos and stop_token_ids)."""

    tokens: jax.Array
    length: jax.Array
    generated: jax.Array
    stops: jax.Array

    @classmethod
    def of(cls, tokens, length, generated, stops) -> TokenHistory:
        """From a token buffer whose positions past `length` may hold anything."""
        kept = jnp.arange(tokens.shape[-1]) < length[..., None]
        return cls(jnp.where(kept, tokens, -1), length, generated, stops)


def _processed_by(processor, logits: jax.Array, values, history) -> jax.Array:
    """`processor` applied to logits [B, V] (or each of T positions of [B, T, V]) when some row
    uses it (`RowProcessor.used`); otherwise the logits as they are, at no cost."""

    def run():
        seen = history()
        if logits.ndim == 2:
            return processor.apply(logits, seen, values)
        rows, positions, vocab = logits.shape
        flat = lambda a: a.reshape(rows * positions, *a.shape[2:])
        repeated = jax.tree.map(lambda v: jnp.repeat(v, positions, axis=0), values)
        out = processor.apply(flat(logits), jax.tree.map(flat, seen), repeated)
        return out.reshape(rows, positions, vocab)

    return jax.lax.cond(processor.used(values), run, lambda: logits)


def choose(
    logits,
    prompt_mask,
    counts,
    bias,
    stop_mask,
    banning,
    allowed,
    sampling,
    positions,
    want_logprobs,
    processors=(),
    generated=None,
    history=None,
):
    """Process raw logits [B, V] (`process`; a reasoning budget's token forced where due, from the
    output tokens so far, `generated` [B]; `history` what the processors see of the rows' tokens)
    and pick one token per row (`pick`). Log-probs are of the raw distribution."""
    forced = None if generated is None else forced_tokens(counts, generated, sampling)
    knobs = (prompt_mask, counts, bias, stop_mask, banning, allowed, sampling, processors, forced, history)
    return pick(logits, process(logits, *knobs), sampling, positions, want_logprobs)


def logprobs_of(logits: jax.Array, processed: jax.Array, s: SamplingArrays) -> jax.Array:
    """The logits each row's log-probs are taken from: the raw `logits` [B, V], or for a row whose
    logprobs_mode is "processed" the distribution its token is drawn from (`drawn_from`: penalties,
    bias, processors, bans and constraints, then temperature and truncation), computed only when
    some row asks for it."""
    processed_rows = s.logprobs_mode == LOGPROBS_MODES.index("processed")
    return jax.lax.cond(
        jnp.any(processed_rows),
        lambda: jnp.where(processed_rows[:, None], drawn_from(processed, s), logits),
        lambda: logits,
    )


def pick(logits, processed, sampling, positions, want_logprobs):
    """One token per row from `processed` logits [B, V] (`sample`), with what leaves the device
    about it: whether the raw `logits` were all finite, and (when asked) their log-probs, of the
    distribution each row's logprobs_mode names."""
    token = sample(processed, sampling, positions)
    bad = ~jnp.all(jnp.isfinite(logits), axis=-1)

    def skip(token):
        nothing = nothing_chosen(logits.shape[0])
        return nothing.logprobs, nothing.top_logprobs, nothing.top_ids

    def report(token):
        return token_logprobs(logprobs_of(logits, processed, sampling), token, TOP_LOGPROBS)

    chosen, top_values, top_ids = jax.lax.cond(want_logprobs, report, skip, token)
    return token, StepOutput(token, bad, chosen, top_ids, top_values)


def nothing_chosen(rows: int) -> StepOutput:
    """The output of rows nothing was sampled for (zeros)."""
    top = jnp.zeros((rows, TOP_LOGPROBS))
    return StepOutput(
        jnp.zeros((rows,), jnp.int32), jnp.zeros((rows,), bool), top[:, 0], top.astype(jnp.int32), top
    )


def check_model_defaults(values: Mapping[str, Any], where: str) -> dict[str, Any]:
    """A model's sampling defaults (a preset's or a config's `[sampling]` table), checked."""
    unknown = sorted(set(values) - set(MODEL_DEFAULTS))
    if unknown:
        raise ValueError(f"{where}: [sampling] may set {', '.join(MODEL_DEFAULTS)}; not {unknown}")
    try:
        SamplingParams(**values)
    except RequestError as e:
        raise ValueError(f"{where}: [sampling]: {e}") from None
    return dict(values)
