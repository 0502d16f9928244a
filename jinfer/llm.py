"""`jinfer.LLM`: the offline facade (generate, chat, score) over one loaded model.

This first version runs requests one at a time: a jitted prefill fills a KV cache for the prompt
(padded to a power-of-two bucket), then a jitted decode step appends one token at a time to that
cache and picks the next token on device. Stop conditions are checked on the host. The batched
engine with slots and continuous batching replaces the loop, not this interface.

    prompt ids -> prefill (bucketed, cache donated) -> logits -> choose (penalties, bias, sampling)
       -> token -> stop checks -> decode step (cache donated) -> logits -> ...
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import time
from collections.abc import Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jinfer.kv_cache import KVCache, init_cache
from jinfer.models import llama
from jinfer.sampling import SamplingArrays, SamplingParams, apply_penalties, sample, token_logprobs
from jinfer.tokenizer import IncrementalDetokenizer
from jinfer.weights import default_model_path, load_model

TOP_LOGPROBS_MAX = 20  # OpenAI's limit; computed once per step and sliced on the host
MIN_BUCKET = 16


@dataclasses.dataclass
class Completion:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort"
    logprobs: list[dict[str, Any]] | None = None  # per token: {"token_id", "logprob", "top": {id: logprob}}
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)


def bucket(n: int, cap: int) -> int:
    """The smallest power of two >= n (at least MIN_BUCKET), capped at `cap`."""
    size = MIN_BUCKET
    while size < n:
        size *= 2
    return min(size, cap)


_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class LLM:
    """Load a model and run offline generation, chat and scoring on it."""

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        *,
        dtype: str = "float32",
        max_seq_len: int | None = None,
    ):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        loaded = load_model(model if model is not None else default_model_path(), _DTYPES[dtype])
        if loaded.tokenizer is None:
            raise ValueError(f"{loaded.source} has no tokenizer files; jinfer.LLM needs one")
        self.config = loaded.config
        self.params = loaded.params
        self.tokenizer = loaded.tokenizer
        # The model's generation_config.json decides what `sampling=None` means.
        defaults = loaded.generation_defaults
        knobs = ("temperature", "top_p", "top_k", "repetition_penalty")
        self.default_sampling = SamplingParams(**{k: defaults[k] for k in knobs if k in defaults})
        self.max_seq_len = min(max_seq_len or 4096, self.config.max_position_embeddings)
        eos = [*self.config.eos_token_ids, *self.tokenizer.eos_token_ids, *defaults.get("eos_token_ids", [])]
        self.eos_token_ids = tuple(dict.fromkeys(eos))
        cfg = self.config
        self._prefill = jax.jit(partial(_prefill, cfg=cfg), donate_argnames="cache")
        self._decode = jax.jit(partial(_decode, cfg=cfg), donate_argnames="cache")
        self._choose = jax.jit(_choose)
        self._token_logprobs = jax.jit(partial(token_logprobs, top_n=TOP_LOGPROBS_MAX))
        self._score = jax.jit(partial(_score, cfg=cfg))

    # ------------------------------------------------------------------------------ public
    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Complete each prompt (text, or token ids used as they are)."""
        if isinstance(prompts, str):
            raise TypeError("prompts must be a list of strings or of token-id lists, not a single string")
        per_prompt = self._per_prompt_sampling(sampling, len(prompts))
        return [self._generate_one(self._prompt_ids(p), s) for p, s in zip(prompts, per_prompt, strict=True)]

    def chat(
        self,
        conversations: Sequence[Sequence[dict[str, Any]]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Answer each conversation (a list of {"role", "content"} messages) via the chat template."""
        prompts = [
            self.tokenizer.apply_chat_template(list(c), add_generation_prompt=True, tokenize=True)
            for c in conversations
        ]
        return self.generate(prompts, sampling)

    def score(self, sequences: Sequence[str] | Sequence[Sequence[int]]) -> list[np.ndarray]:
        """log p(x_i | x_<i) for i >= 1 of each sequence, float32, length len - 1."""
        out = []
        for seq in sequences:
            ids = self._prompt_ids(seq)
            if len(ids) > self.max_seq_len:
                raise ValueError(f"sequence of {len(ids)} tokens exceeds max_seq_len={self.max_seq_len}")
            size = bucket(len(ids), self.max_seq_len)
            tokens = np.zeros((1, size), np.int32)
            tokens[0, : len(ids)] = ids
            logp = self._score(self.params, jnp.asarray(tokens))
            out.append(np.asarray(logp[0, : len(ids) - 1], dtype=np.float32))
        return out

    # ----------------------------------------------------------------------------- internal
    def _per_prompt_sampling(self, sampling, n: int) -> list[SamplingParams]:
        if sampling is None:
            return [self.default_sampling] * n
        if isinstance(sampling, SamplingParams):
            return [sampling] * n
        if len(sampling) != n:
            raise ValueError(f"got {len(sampling)} SamplingParams for {n} prompts")
        return list(sampling)

    def _prompt_ids(self, prompt) -> list[int]:
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt is empty (it encodes to no tokens)")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.config.vocab_size})")
        return ids

    def _generate_one(self, prompt_ids: list[int], sp: SamplingParams) -> Completion:
        start = time.perf_counter()
        n_prompt = len(prompt_ids)
        max_tokens = sp.max_tokens if sp.max_tokens is not None else self.max_seq_len - n_prompt
        if n_prompt + max_tokens > self.max_seq_len or max_tokens < 1:
            raise ValueError(
                f"prompt of {n_prompt} tokens plus max_tokens={max_tokens} exceeds the context window "
                f"max_seq_len={self.max_seq_len}"
            )
        vocab = self.config.vocab_size
        seed = sp.seed if sp.seed is not None else secrets.randbits(31)
        arrays = SamplingArrays.from_params([sp], [seed])
        bias = np.zeros((1, vocab), np.float32)
        for token, value in (sp.logit_bias or {}).items():
            if token < vocab:
                bias[0, token] = value
        stop_ids = set(sp.stop_token_ids or ()) | (set() if sp.ignore_eos else set(self.eos_token_ids))
        banned = np.zeros((1, vocab), bool)  # stop tokens are banned until min_tokens are out
        banned[0, [t for t in stop_ids if t < vocab]] = True
        banned_early, nothing_banned = jnp.asarray(banned), jnp.zeros((1, vocab), bool)
        prompt_mask = np.zeros((1, vocab), bool)
        prompt_mask[0, prompt_ids] = True
        prompt_mask, bias = jnp.asarray(prompt_mask), jnp.asarray(bias)
        counts = jnp.zeros((1, vocab), jnp.int32)

        cache_len = bucket(n_prompt + max_tokens, self.max_seq_len)
        cache = init_cache(self.config, 1, cache_len, self.params.embed.dtype)
        tokens = np.zeros((1, bucket(n_prompt, cache_len)), np.int32)
        tokens[0, :n_prompt] = prompt_ids
        logits, cache = self._prefill(self.params, jnp.asarray(tokens), jnp.int32(n_prompt), cache)
        first_token_time = None

        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids)
        out_ids: list[int] = []
        logprobs: list[dict[str, Any]] | None = [] if sp.logprobs is not None else None
        text, finish = "", "length"
        stops = tuple(sp.stop or ())
        for i in range(max_tokens):
            position = n_prompt + i
            ban = banned_early if i < sp.min_tokens else nothing_banned
            token, counts, bad = self._choose(
                logits, arrays, prompt_mask, counts, bias, ban, jnp.int32(position)
            )
            if bool(bad):
                raise FloatingPointError("the model produced NaN/inf logits")
            token_id = int(token[0])
            if first_token_time is None:
                first_token_time = time.perf_counter()
            if logprobs is not None:
                logprobs.append(self._logprob_entry(logits, token, sp.logprobs))
            if token_id in stop_ids:
                finish = "stop"
                break
            out_ids.append(token_id)
            text += detok.add([token_id])
            if stops and (cut := _find_stop(text, stops)) is not None:
                text, finish = text[:cut], "stop"
                break
            if i + 1 < max_tokens:
                logits, cache = self._decode(self.params, token, jnp.int32(position), cache)
        else:
            text += detok.flush()
        end = time.perf_counter()
        n_out = len(out_ids)
        metrics = {
            "ttft_s": (first_token_time or end) - start,
            "total_s": end - start,
            "decode_tokens_per_s": (n_out - 1) / (end - first_token_time)
            if n_out > 1 and first_token_time
            else 0.0,
        }
        return Completion(text, out_ids, list(prompt_ids), finish, logprobs, metrics)

    def _logprob_entry(self, logits, token, top_n: int) -> dict[str, Any]:
        chosen, top_values, top_ids = self._token_logprobs(logits, token)
        top_values, top_ids = np.asarray(top_values[0, :top_n]), np.asarray(top_ids[0, :top_n])
        return {
            "token_id": int(token[0]),
            "logprob": float(chosen[0]),
            "top": {int(t): float(v) for t, v in zip(top_ids, top_values, strict=True)},
        }


def _find_stop(text: str, stops: tuple[str, ...]) -> int | None:
    hits = [i for s in stops if (i := text.find(s)) >= 0]
    return min(hits) if hits else None


# ------------------------------------------------------------------------- jitted functions
def _prefill(params, tokens, length, cache: KVCache, *, cfg):
    """Fill the cache with a padded prompt [1, T]; return next-token logits [1, V] and the cache."""
    positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
    hidden, cache = llama.forward(params, tokens, positions, cfg, cache)
    last = jax.lax.dynamic_index_in_dim(hidden, length - 1, axis=1, keepdims=False)  # [1, D]
    return llama.logits(params, last), cache


def _decode(params, token, position, cache: KVCache, *, cfg):
    """Append one token [1] at `position`; return next-token logits [1, V] and the cache."""
    hidden, cache = llama.forward(params, token[:, None], jnp.full((1, 1), position, jnp.int32), cfg, cache)
    return llama.logits(params, hidden[:, 0]), cache


def _choose(logits, arrays: SamplingArrays, prompt_mask, counts, bias, banned, position):
    """Penalties, bias and bans, then sampling. Returns (token [1], updated counts, logits-not-finite)."""
    bad = ~jnp.all(jnp.isfinite(logits))
    processed = apply_penalties(logits, prompt_mask, counts, arrays) + bias
    processed = jnp.where(banned, -jnp.inf, processed)
    token = sample(processed, arrays, jnp.full((logits.shape[0],), position, jnp.int32))
    counts = counts.at[jnp.arange(logits.shape[0]), token].add(1)
    return token, counts, bad


def _score(params, tokens, *, cfg):
    """log p(tokens[:, i+1] | tokens[:, :i+1]) for every i: [B, T-1] float32."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    hidden, _ = llama.forward(params, tokens, positions, cfg)
    logp = jax.nn.log_softmax(llama.logits(params, hidden[:, :-1]), axis=-1)
    return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
