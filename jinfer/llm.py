"""`jinfer.LLM`: the offline facade (generate, chat, score) over one engine.

All prompts of a call go through the engine's slots together (continuous batching): the caller's
thread drives the engine loop until every request has finished, admitting more prompts as the
bounded queue frees up. `iter_completions` yields each result as soon as it finishes, for batch
jobs that write results as they go. `score` runs the model over whole sequences (no cache).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

import jinfer.lora as lora
from jinfer.cluster import join_cluster
from jinfer.compile_cache import use as use_compile_cache
from jinfer.config import EngineConfig
from jinfer.engine import Engine
from jinfer.formats.adapters import read_adapter
from jinfer.inputs import RowProcessor
from jinfer.loading import default_model_path, engine_weights, load_model, placement_for
from jinfer.models.params import unpacked
from jinfer.prepare import PreparedRequest
from jinfer.reasoning import split_output
from jinfer.request import RequestOutput
from jinfer.sampling import SamplingParams
from jinfer.tools import ToolCall, finish_output


@dataclasses.dataclass
class Completion:
    """One prompt's answer. With log-probs asked, a stop token (end of sequence, `stop_token_ids`)
    that ended it is its last token id and entry, adding no text; otherwise it is left out."""

    text: str
    token_ids: list[int]
    prompt_token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    logprobs: list[dict[str, Any]] | None = None  # per token: {"token_id", "logprob", "top": {id: logprob}}
    metrics: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: str | None = None
    tool_calls: list[ToolCall] = dataclasses.field(default_factory=list)  # chat with tools: text = the rest
    # (finish_reason "tool_calls" when the output is calls)
    reasoning: str | None = None  # a reasoning model's thinking (text = the answer); None: it did not think


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


class LLM:
    """Load a model, build an engine, and run offline generation, chat and scoring."""

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        logits_processors: Mapping[str, RowProcessor] | Sequence[RowProcessor] = (),
        **engine_options,
    ):
        """`engine_options` are EngineConfig fields (max_slots, max_seq_len, dtype, mesh_data, ...);
        `logits_processors` (by name, or each under its own) are applied in every sampling step,
        each with the parameters a request gives under its name in `SamplingParams.extra_args`
        (`jinfer.processors`; checked here: one that fails when traced is a ValueError).

        With `coordinator`, `num_processes` and `process_id` (or JAX's environment variables) every
        process of a cluster runs the same script (`jinfer.cluster`): on process 0 this returns and
        generates as usual; on the others it does not return: it makes process 0's device calls
        until that one ends, then exits the process."""
        config = EngineConfig(**engine_options)
        use_compile_cache(config.compile_cache)  # before anything compiles
        member = join_cluster(config)  # before anything touches a device
        path = model if model is not None else default_model_path()
        loaded = load_model(path, quantization=config.quantization, placement=placement_for(config))
        if loaded.tokenizer is None:
            raise ValueError(f"{loaded.source} has no tokenizer files; jinfer.LLM needs one")
        self.config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = loaded.eos_token_ids
        self.engine = Engine(loaded, config, logits_processors)
        self._path = path  # read again by wake_up after a level-2 sleep
        if member is not None and not member.leader:
            raise SystemExit(self.engine.follow())
        self.preparer = self.engine.preparer
        self.max_seq_len = self.preparer.max_seq_len

    @property
    def default_sampling(self) -> SamplingParams:
        """What `sampling=None` means: the model's defaults (generation_config.json or its preset),
        then jinfer's; a SamplingParams with some knobs set keeps the model's for the others."""
        return self.preparer.sampling(None)

    @property
    def params(self):
        """The model's weights (without the engine's packed copies, if it keeps them; quantized
        matrices as `models.quantized.QuantizedWeight`)."""
        return unpacked(self.engine.params)

    def update_weights(self, params) -> int:
        """Generate, chat and score with `params` from now on: the model's weights shaped as
        `self.params` gives them (the same tree, shapes and dtypes; e.g. a trainer's update of
        them), swapped in memory with no recompile and no disk. Call it between generate calls
        (RuntimeError while requests run); the prefix cache is emptied. Returns the weights version
        that every request started from now on reports in `metrics["weights_version"]` (0: as loaded)."""
        return self.engine.update_weights(params)

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache's memory (level 1), and the weights' too (level 2), until `wake_up`;
        generate raises meanwhile. Call it between generate calls. On a CPU the weights are host
        memory already: level 1 frees the cache alone."""
        self.engine.sleep(level)

    def pause(self, mode: str = "finish") -> None:
        """For a caller that generates from other threads: admit no request until `resume` (new
        ones wait), and return once those in flight have finished ("finish"), ended with
        finish_reason "abort" ("abort"), or are held in their slots with their KV ("keep"; they go
        on after `resume`, with the weights an `update_weights` in between brought). Generating
        on this thread while paused raises."""
        self.engine.pause(mode)

    def resume(self) -> None:
        self.engine.resume()

    def wake_up(self) -> None:
        """Serve again, with no recompile. After a level-2 sleep the weights come back from the
        model's file, unless `update_weights` brought others while asleep."""
        if self.engine.device.weights_dropped:
            self.engine.update_weights(self._reloaded_params())
        self.engine.wake_up()

    def _reloaded_params(self):
        """The model's weights read again from its file, as the engine was built with them."""
        config = self.engine.config
        loaded = load_model(self._path, quantization=config.quantization, placement=placement_for(config))
        return engine_weights(loaded, config, self.engine.mesh, self.engine.dtype)[1]

    def load_adapter(self, name: str, adapter) -> None:
        """Hold a low-rank adapter under `name` (`jinfer.lora.Adapter`, a pytree in memory, or a
        PEFT or jinfer adapter directory) for `adapter=name` in generate, chat and score: no
        recompile. The LLM needs `max_loras` > 0. Call it between generate calls (the requests of a
        generate call name their adapters' slots when the call starts)."""
        if not isinstance(adapter, lora.Adapter):
            adapter = read_adapter(os.fspath(adapter), self.engine.model_config)
        self.engine.load_adapter(name, adapter)

    def unload_adapter(self, name: str) -> None:
        """Forget the adapter `name` (KeyError if none is loaded under it)."""
        self.engine.unload_adapter(name)

    # ------------------------------------------------------------------------------ public
    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        context_policy: str | None = None,
        adapter: str | Sequence[str | None] | None = None,
        prediction: str | Sequence[str | Sequence[int] | None] | None = None,
    ) -> list[Completion]:
        """Complete each prompt (text, or token ids used as they are), batched through the slots;
        `adapter`: a loaded adapter's name for all of them, or one (or None) per prompt;
        `prediction`: the text (or token ids) each output is expected to be (much like), which
        speculative decoding drafts from (`metrics["accepted_prediction_tokens"]`), one per prompt
        (a text alone: the same for all)."""
        if isinstance(prompts, str):
            raise TypeError("prompts must be a list of strings or of token-id lists, not a single string")
        n = len(prompts)
        per = zip(
            prompts,
            self._per_prompt(sampling, n),
            _per_item(adapter, n),
            _per_item(prediction, n),
            strict=True,
        )
        items = [
            self.preparer.prepare(p, sampling=s, context_policy=context_policy, adapter=a, prediction=guess)
            for p, s, a, guess in per
        ]
        return self._run_all(items)

    def chat(
        self,
        conversations: Sequence[Sequence[dict[str, Any]]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        context_policy: str | None = None,
        *,
        adapter: str | Sequence[str | None] | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        parallel_tool_calls: bool = True,
        prediction: str | Sequence[str | None] | None = None,
    ) -> list[Completion]:
        """Answer each conversation (a list of {"role", "content"} messages) via the chat template.

        With context_policy="drop_oldest", whole early non-system messages are dropped until the
        conversation fits; `metrics["dropped_messages"]` says how many. `tools`, `tool_choice`
        and `parallel_tool_calls` are OpenAI's (`jinfer.tools`); calls the model makes come back
        parsed in `Completion.tool_calls`, with finish_reason "tool_calls". `adapter` and
        `prediction` as for generate.
        """
        n = len(conversations)
        per = self._per_prompt(sampling, n)
        options = {"tools": tools, "tool_choice": tool_choice, "parallel_tool_calls": parallel_tool_calls}
        options["context_policy"] = context_policy
        items = [
            self.preparer.prepare(messages=list(m), sampling=s, adapter=a, prediction=guess, **options)
            for m, s, a, guess in zip(
                conversations, per, _per_item(adapter, n), _per_item(prediction, n), strict=True
            )
        ]
        return self._run_all(items)

    def _run_all(self, items: list[PreparedRequest]) -> list[Completion]:
        results: list[Completion | None] = [None] * len(items)
        for index, completion in self.iter_completions(items):
            results[index] = completion
        return results

    def iter_completions(self, items: Iterable[PreparedRequest]) -> Iterator[tuple[int, Completion]]:
        """Run prepared requests (`llm.preparer.prepare`) through the engine; yield (index,
        Completion) as each finishes, admitting more as the bounded queue frees up."""
        engine = self.engine
        if engine.paused:
            raise RuntimeError(f"the engine is paused ({engine.paused}): resume() first")
        pending = []
        for index, prepared in enumerate(items):
            collector = _Collector(index, prepared.sampling.logprobs is not None)
            pending.append((engine.make_request(prepared, collector), collector, prepared))
        pending.reverse()
        running: list[tuple[Any, _Collector, PreparedRequest]] = []
        while pending or running:
            while pending and engine.scheduler.queue_has_room:
                entry = pending.pop()
                engine.enqueue(entry[0])
                running.append(entry)
            engine.step()
            still = []
            for request, collector, prepared in running:
                if collector.final is not None:
                    completion = collector.completion(request.prompt_ids)
                    completion.metrics["dropped_messages"] = prepared.dropped_messages
                    completion.reasoning, completion.text = split_output(prepared.reasoning, completion.text)
                    text, calls, reason = finish_output(
                        prepared.tools, completion.text, completion.finish_reason
                    )
                    if calls:
                        completion.text, completion.tool_calls, completion.finish_reason = text, calls, reason
                    yield collector.index, completion
                else:
                    still.append((request, collector, prepared))
            running = still

    def score(
        self, sequences: Sequence[str] | Sequence[Sequence[int]], adapter: str | None = None
    ) -> list[np.ndarray]:
        """log p(x_i | x_<i) for i >= 1 of each sequence, float32, length len - 1 (through the
        loaded adapter of that name)."""
        slot = self.engine.adapters.resolve(adapter, None)[0]
        return [self.engine.scorer(self.preparer.prompt_ids(seq), slot).chosen for seq in sequences]

    # ----------------------------------------------------------------------------- internal
    def _per_prompt(self, sampling, n: int) -> list[SamplingParams | None]:
        if sampling is None or isinstance(sampling, SamplingParams):
            return [sampling] * n
        if len(sampling) != n:
            raise ValueError(f"got {len(sampling)} SamplingParams for {n} prompts")
        return list(sampling)


def _per_item(value, n: int) -> list:
    """One value for n items, or a sequence of n of them."""
    if value is None or isinstance(value, str):
        return [value] * n
    if len(value) != n:
        raise ValueError(f"got {len(value)} values for {n} items")
    return list(value)
