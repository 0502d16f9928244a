"""`jinfer.LLM`: the offline facade (generate, chat, score) over one engine.

All prompts of a call go through the engine's slots together (continuous batching): the caller's
thread drives the engine loop until every request has finished, admitting more prompts as the
bounded queue frees up. `iter_completions` yields each result as soon as it finishes, for batch
jobs that write results as they go. `score` runs the model over whole sequences (no cache).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Iterator, Sequence
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jinfer.config import EngineConfig
from jinfer.context import fit_conversation
from jinfer.engine import Engine, check_prompt_ids
from jinfer.models import llama
from jinfer.sampling import SamplingParams
from jinfer.scheduler import RequestOutput
from jinfer.weights import default_model_path, load_model

MIN_SCORE_BUCKET = 16


@dataclasses.dataclass
class Completion:
    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    logprobs: list[dict[str, Any]] | None = None  # per token: {"token_id", "logprob", "top": {id: logprob}}
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: str | None = None


class _Collector:
    """A request's sink that accumulates events into a Completion."""

    def __init__(self, index: int, want_logprobs: bool):
        self.index = index
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[dict] | None = [] if want_logprobs else None
        self.final: RequestOutput | None = None

    def __call__(self, event: RequestOutput) -> None:
        self.text.append(event.text)
        self.token_ids.extend(event.token_ids)
        if self.logprobs is not None and event.logprobs:
            self.logprobs.extend(event.logprobs)
        if event.finished:
            self.final = event

    def completion(self, prompt_ids: list[int]) -> Completion:
        final = self.final
        return Completion(
            "".join(self.text),
            self.token_ids,
            prompt_ids,
            final.finish_reason,
            self.logprobs,
            final.metrics,
            final.error,
        )


def _bucket(n: int) -> int:
    size = MIN_SCORE_BUCKET
    while size < n:
        size *= 2
    return size


class LLM:
    """Load a model, build an engine, and run offline generation, chat and scoring."""

    def __init__(self, model: str | os.PathLike | None = None, **engine_options):
        """`engine_options` are EngineConfig fields (max_slots, max_seq_len, dtype, mesh_data, ...)."""
        loaded = load_model(model if model is not None else default_model_path())
        if loaded.tokenizer is None:
            raise ValueError(f"{loaded.source} has no tokenizer files; jinfer.LLM needs one")
        self.config = loaded.config
        self.tokenizer = loaded.tokenizer
        # The model's generation_config.json decides what `sampling=None` means.
        defaults = loaded.generation_defaults
        knobs = ("temperature", "top_p", "top_k", "repetition_penalty")
        self.default_sampling = SamplingParams(**{k: defaults[k] for k in knobs if k in defaults})
        self.eos_token_ids = loaded.eos_token_ids
        self.engine = Engine(loaded, EngineConfig(**engine_options))
        self.max_seq_len = self.engine.config.max_seq_len
        self._score = jax.jit(partial(_score, cfg=self.engine.steps.model, vocab=self.config.vocab_size))

    @property
    def params(self):
        """The model's weights (without the engine's packed copies, if it keeps them)."""
        return llama.unpacked(self.engine.params)

    # ------------------------------------------------------------------------------ public
    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        context_policy: str | None = None,
    ) -> list[Completion]:
        """Complete each prompt (text, or token ids used as they are), batched through the slots."""
        if isinstance(prompts, str):
            raise TypeError("prompts must be a list of strings or of token-id lists, not a single string")
        items = [
            (self.encode_prompt(p), s)
            for p, s in zip(prompts, self._per_prompt(sampling, len(prompts)), strict=True)
        ]
        results: list[Completion | None] = [None] * len(items)
        for index, completion in self.iter_completions(items, context_policy):
            results[index] = completion
        return results

    def chat(
        self,
        conversations: Sequence[Sequence[dict[str, Any]]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        context_policy: str | None = None,
    ) -> list[Completion]:
        """Answer each conversation (a list of {"role", "content"} messages) via the chat template.

        With context_policy="drop_oldest", whole early non-system messages are dropped until the
        conversation fits; `metrics["dropped_messages"]` says how many.
        """
        per = self._per_prompt(sampling, len(conversations))
        policy = context_policy or self.engine.config.context_policy
        items, dropped = [], []
        for messages, sp in zip(conversations, per, strict=True):
            ids, _, n_dropped = fit_conversation(
                self.tokenizer, list(messages), sp.max_tokens, self.max_seq_len, policy
            )
            items.append((ids, sp))
            dropped.append(n_dropped)
        inner_policy = "error" if policy == "drop_oldest" else policy
        results: list[Completion | None] = [None] * len(items)
        for index, completion in self.iter_completions(items, inner_policy):
            completion.metrics["dropped_messages"] = dropped[index]
            results[index] = completion
        return results

    def iter_completions(
        self,
        items: Iterable[tuple[list[int], SamplingParams]],
        context_policy: str | None = None,
        invalid: str = "raise",
    ) -> Iterator[tuple[int, Completion]]:
        """Run (prompt ids, sampling) items through the engine; yield (index, Completion) as each finishes.

        Every item is validated before anything runs. With invalid="raise" a bad item raises without
        side effects; with invalid="report" it is yielded at once as a Completion with
        finish_reason "error" and the others run.
        """
        engine = self.engine
        pending = []
        for index, (ids, sp) in enumerate(items):
            collector = _Collector(index, sp.logprobs is not None)
            try:
                request = engine.make_request(ids, sp, collector, context_policy=context_policy)
            except ValueError as e:
                if invalid == "raise":
                    raise
                yield index, Completion("", [], list(ids), "error", error=str(e))
                continue
            pending.append((request, collector))
        pending.reverse()
        running: list[tuple[Any, _Collector]] = []
        while pending or running:
            while pending and engine.scheduler.queue_has_room:
                request, collector = pending.pop()
                engine.enqueue(request)
                running.append((request, collector))
            engine.step()
            still = []
            for request, collector in running:
                if collector.final is not None:
                    yield collector.index, collector.completion(request.prompt_ids)
                else:
                    still.append((request, collector))
            running = still

    def score(self, sequences: Sequence[str] | Sequence[Sequence[int]]) -> list[np.ndarray]:
        """log p(x_i | x_<i) for i >= 1 of each sequence, float32, length len - 1."""
        out = []
        for seq in sequences:
            ids = self.encode_prompt(seq)
            check_prompt_ids(ids, self.config.vocab_size)
            if len(ids) > self.max_seq_len:
                raise ValueError(f"sequence of {len(ids)} tokens exceeds max_seq_len={self.max_seq_len}")
            tokens = np.zeros((1, _bucket(len(ids))), np.int32)
            tokens[0, : len(ids)] = ids
            logp = self._score(self.params, jnp.asarray(tokens))
            out.append(np.asarray(logp[0, : len(ids) - 1], dtype=np.float32))
        return out

    # ----------------------------------------------------------------------------- internal
    def _per_prompt(self, sampling, n: int) -> list[SamplingParams]:
        if sampling is None:
            return [self.default_sampling] * n
        if isinstance(sampling, SamplingParams):
            return [sampling] * n
        if len(sampling) != n:
            raise ValueError(f"got {len(sampling)} SamplingParams for {n} prompts")
        return list(sampling)

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a text prompt, or the given ids as ints (validated where they are used)."""
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]


def _score(params, tokens, *, cfg, vocab):
    """log p(tokens[:, i+1] | tokens[:, :i+1]) for every i: [B, T-1] float32."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    hidden, _ = llama.forward(params, tokens, positions, cfg)
    logp = jax.nn.log_softmax(llama.logits(params, hidden[:, :-1])[..., :vocab], axis=-1)
    return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
