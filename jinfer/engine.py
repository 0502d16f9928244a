"""The engine: one loop that ties the host scheduler to the jitted device steps.

    submit / cancel (any thread) --inbox, under a lock--> Scheduler
    loop thread:  plan -> dispatch (`jinfer.dispatcher`) the prompt chunks the token budget took
                  (one prefill dispatch of pieces) + one multi-step decode (async, cache
                  donated), or, speculating, decode steps that verify draft tokens
                  (`jinfer.speculative`), or, where the layout allows (`Layout.mixed_rows`), the
                  pieces and one decode step as one
                  -> read the previous iteration's tokens (one iteration late) -> scheduler.commit
                  -> the events it returns go to the sinks, outside the lock

The loop sleeps on a condition variable when there is nothing to do (no polling). Tokens of the
iteration just dispatched are read only after the next one is queued, so the host's detokenizing
and bookkeeping overlap the device's work. A constrained request (`jinfer.structured`) keeps that
overlap: its decode row is deferred (fed, not sampled), and the next iteration, once the token
before is read, dispatches `sample` under its allowed set before queueing the next decode behind
it. Every device call goes through `self.device` (`jinfer.device`), which a cluster's leader
also publishes to its followers (`jinfer.cluster`). A failing device call fails only the requests
it touched (all running ones, for decode) with a clear error; the cache is rebuilt and the engine
keeps serving. In a cluster it fails the engine instead (`fail_all`): a process is gone.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence

import numpy as np

import jinfer.adapter_slots as adapter_slots
import jinfer.residency as residency
from jinfer.assembly import assemble
from jinfer.cluster import current_cluster
from jinfer.compile_cache import tally
from jinfer.config import EngineConfig
from jinfer.dispatcher import Dispatcher, Pending, drafts_of
from jinfer.inputs import RowProcessor
from jinfer.loading import LoadedModel
from jinfer.metrics import DispatchCounts
from jinfer.paging import SINK_PAGE, SequencePages
from jinfer.prepare import PreparedRequest
from jinfer.request import Request, RequestOutput, deliver
from jinfer.scheduler import QueueFullError
from jinfer.scoring import Scorer
from jinfer.speculation import DraftRecord, may_draft, measure_verify_costs
from jinfer.tokenizer import TextStream

log = logging.getLogger("jinfer.engine")

__all__ = ["DispatchCounts", "Engine", "EngineUnavailable", "QueueFullError", "RequestOutput"]


class EngineUnavailable(RuntimeError):
    """The engine can no longer compute (a process of its cluster is gone); nothing is accepted."""


class Engine:
    """Continuous batching over `max_slots` fixed slots of one preallocated KV cache."""

    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig | None = None,
        processors: Mapping[str, RowProcessor] | Sequence[RowProcessor] = (),
    ):
        """`processors`: logits processors every sampling step applies, each with its input per
        row (`jinfer.inputs.RowProcessor`)."""
        self.config = config = config or EngineConfig()  # as asked; self.layout is what runs
        parts = assemble(loaded, config, processors)
        self.model_config, self.tokenizer = loaded.config, loaded.tokenizer
        self.eos_token_ids = loaded.eos_token_ids
        self.mesh, self.dtype, self.layout, self.steps = parts.mesh, parts.dtype, parts.layout, parts.steps
        self.device, self.kv, self.scheduler = parts.device, parts.kv, parts.scheduler
        self.preparer, self.speculation = parts.preparer, parts.speculation
        self.cache_bytes, self.adapters = parts.cache_bytes, parts.adapters
        self.weights_version = 0  # how many times update_weights replaced the loaded weights
        self.asleep = 0  # the level of the sleep it is in (`jinfer.residency`); 0: awake
        self.paused: str | None = None  # the mode of the pause it is in (`jinfer.residency`)
        # Sequences scored whole, outside the slots (LLM.score, the server's echo with logprobs).
        self.scorer = Scorer(self.device.score, self.layout.max_seq_len)
        self._pending: list[Pending] = []  # dispatched, not yet read
        self.dispatch_counts = DispatchCounts()  # written by the loop thread only
        self.dispatcher = Dispatcher(self, self._recover)  # plans into device calls (`jinfer.dispatcher`)
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.failure: str | None = None  # why the engine can no longer serve (`fail_all`)
        self.cluster = current_cluster()
        if self.cluster is not None and self.cluster.leader:
            self.device.publish = self.cluster.publish
            self.cluster.lead(repr(self.layout), self.fail_all)

    @property
    def params(self):
        """The weights the steps run with (the device's: one copy, wherever it is read), the
        target model's where there is a draft model."""
        return self.device.weights.target

    # What the device holds between requests (`jinfer.residency`).
    update_weights, sleep, wake_up = residency.update_weights, residency.sleep, residency.wake_up
    pause, resume = residency.pause, residency.resume
    load_adapter, unload_adapter = adapter_slots.load_adapter, adapter_slots.unload_adapter

    def warmup(self) -> float:
        """Compile every verb's variants (`Device.warm_up`) and time verify against decode steps
        for the speculation policy; the seconds. Call it with no request running: its calls write
        (a warm-up chunk, the timed rows), through block tables that map nowhere meanwhile."""
        start, built = time.perf_counter(), tally()
        self.device.set_tables(np.full_like(self.kv.tables, SINK_PAGE))
        self.device.warm_up()
        if self.speculation is not None and self.speculation.policy == "measured":
            self.speculation.cost = measure_verify_costs(self.device)
        self.device.set_tables(self.kv.tables.copy())
        seconds = time.perf_counter() - start
        log.info("warm-up: %.1f s; %s", seconds, tally().since(built))
        return seconds

    def compile_count(self) -> int:
        """Executables built so far: the warm-up's (`Device.executables`) and any a jitted call
        compiled (a warm engine must keep this constant)."""
        return self.steps.compile_count() + len(self.device.executables)

    def follow(self) -> int:
        """A follower's life (`jinfer.cluster`): make the leader's device calls until it stops; the
        exit status."""
        return self.cluster.follow(repr(self.layout), self.device.replay, self.compile_count)

    def fail_all(self, reason: str) -> None:
        """The engine can no longer compute (a process of its cluster is gone): every request ends
        with an error, and new ones are refused (`EngineUnavailable`)."""
        with self._lock:
            if self.failure is not None:
                return
            log.error("engine unavailable: %s", reason)
            self.failure = reason
            doomed = self.scheduler.active_requests() + list(self.scheduler.waiting)
            events = self.scheduler.fail(doomed, f"engine unavailable: {reason}")
            self._lock.notify_all()
        deliver(events)

    def stats(self) -> dict[str, float]:
        """Load figures for monitoring: requests running / waiting, slots and KV pages in use, the
        prefix cache's lookups and preemptions so far."""
        with self._lock:
            active = self.scheduler.active_requests()
            pool = self.kv.pool
            return {
                "running": sum(r.running for r in active),
                "waiting": len(self.scheduler.waiting),
                "slots_in_use": len(active),
                "kv_pages_total": pool.usable,
                "kv_pages_used": pool.used,
                "kv_cache_usage": pool.used / pool.usable,
                "prefix_cache_queries": self.kv.queries,
                "prefix_cache_hits": self.kv.hits,
                "preemptions": self.scheduler.preemptions,
            }

    # ----------------------------------------------------------------------------- inbox
    def make_request(
        self,
        prepared: PreparedRequest,
        sink: Callable[[RequestOutput], None],
        *,
        request_id: str | None = None,
    ) -> Request:
        """A scheduler request for a prepared one (`self.preparer.prepare`): nothing left to check."""
        sampling = prepared.sampling
        reasoning = prepared.reasoning
        held = prepared.grammar is not None or (reasoning is not None and reasoning.budget is not None)
        drafting = self.speculation is not None and may_draft(sampling, held)
        adapter, salt = self.adapters.resolve(prepared.adapter, prepared.cache_salt)
        if self.weights_version:  # a request kept through an update leaves pages of the old weights
            salt = f"{salt or ''}\x00weights {self.weights_version}"
        return Request(
            request_id=request_id or uuid.uuid4().hex,
            prompt_ids=prepared.prompt_ids,
            sampling=sampling,
            max_tokens=prepared.max_tokens,
            stop_ids=prepared.stop_ids,
            seed=sampling.seed,
            sink=sink,
            # With tools, special tokens stay in the text: some conventions mark calls with one; so do
            # a reasoning model's markers where they are special.
            stream=TextStream(
                self.tokenizer,
                prepared.prompt_ids,
                tuple(sampling.stop or ()),
                prepared.tools is None and not (reasoning is not None and reasoning.format.special),
            ),
            dropped_prompt_tokens=prepared.dropped_prompt_tokens,
            kv=SequencePages(salt, drafted=drafting and self.steps.draft_model is not None),
            constraint=prepared.grammar.start() if prepared.grammar is not None else None,
            drafts=DraftRecord(drafting=drafting),
            processor_inputs=prepared.processor_inputs,
            adapter=adapter,
            weights_version=self.weights_version,
            priority=prepared.priority,
            prediction_ids=prepared.prediction_ids,
            reasoning=reasoning,
        )

    def enqueue(self, request: Request, block: bool = False) -> None:
        """Hand a request to the scheduler; QueueFullError when the queue is full (unless block)."""
        with self._lock:
            while block and not self.scheduler.queue_has_room and not self._stopping and not self.failure:
                self._lock.wait()
            if self.failure is not None:
                raise EngineUnavailable(f"the engine is unavailable: {self.failure}")
            if self.asleep:
                raise EngineUnavailable("the engine is asleep until wake_up")
            self.scheduler.submit(request)
            self._lock.notify_all()

    def submit(self, prepared: PreparedRequest, sink, *, request_id=None, block=False) -> Request:
        """make_request + enqueue, both under the lock: an adapter swap (`load_adapter`) comes before
        the request names its adapter's slot or after the slot is held."""
        with self._lock:
            request = self.make_request(prepared, sink, request_id=request_id)
            self.enqueue(request, block)
        return request

    def cancel(self, request_id: str) -> bool:
        with self._lock:
            found = self.scheduler.cancel(request_id)
            self._lock.notify_all()
        return found

    # ------------------------------------------------------------------------------ loop
    def start(self) -> None:
        """Run the loop in a background thread (for servers; offline callers may call `step`)."""
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name="jinfer-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        while self._thread is not None and self._thread.is_alive() and self.failure is None:
            self._thread.join(1.0)  # a failed engine's thread may wait forever on a dead process
        self._thread = None

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._stopping and self._idle():
                    self._lock.wait()
                if self._stopping:
                    return
            self.step()

    def _idle(self) -> bool:
        """Nothing to plan, nothing on the device left to read or sample (call under the lock)."""
        if self.failure is not None:  # what is on the device will not be read
            self._pending, self.dispatcher.deferred = [], None
        return not self.scheduler.has_work and not self._pending and self.dispatcher.deferred is None

    def step(self) -> None:
        """One iteration: sample the rows the last decode deferred, plan, dispatch, then commit what
        the previous iteration produced (background work alone: commit it first, so the device is
        never more than one dispatch ahead of a request that arrives; `Scheduler.background_only`)."""
        if self.dispatcher.deferred is not None:
            self._sample_deferred()
        with self._lock:
            background_only = self.scheduler.background_only
        if background_only:
            previous, self._pending = self._pending, []
            for entry in previous:
                self._commit(entry)
        with self._lock:
            plan = self.scheduler.plan()
            self._lock.notify_all()  # the queue may have room now
        deliver(plan.events)
        dispatched = self.dispatcher.dispatch(plan)
        previous, self._pending = self._pending, dispatched
        for entry in previous:
            self._commit(entry)

    def run_until_idle(self) -> None:
        while True:
            with self._lock:
                idle = self._idle()
            if idle:
                return
            self.step()

    def _sample_deferred(self) -> None:
        """Dispatch `sample` for the rows the last decode deferred, under their allowed sets. Those
        follow from every token before, so the outputs holding constrained requests' tokens are read
        first (they were dispatched before the decode now running: ready, or nearly)."""
        owners = self.dispatcher.take_deferred()
        constrained = lambda entry: any(r is not None and r.constraint is not None for r in entry.owners)
        first = [entry for entry in self._pending if constrained(entry)]
        self._pending = [entry for entry in self._pending if not constrained(entry)]
        for entry in first:
            self._commit(entry)
        owners = [r if r is not None and not r.finished else None for r in owners]
        if any(owners):
            self._pending += self.dispatcher.sample(owners)

    def _commit(self, pending: Pending) -> None:
        """Hand a dispatch's tokens to the scheduler (a verify dispatch's drafts' acceptance first)."""
        if self.failure is not None:  # read nothing more: a collective with a dead process may never end
            return
        owners, out = pending.owners, pending.out
        want_logprobs = any(r is not None and r.sampling.logprobs is not None for r in owners)
        # Only what the requests use crosses to the host: each array fetched costs host time.
        wanted = [out.tokens, out.bad] + (
            [out.logprobs, out.top_ids, out.top_logprobs] if want_logprobs else []
        )
        # np.asarray per array, not jax.device_get: on a CPU it is a zero-copy view (3 µs against
        # device_get's ~85 µs for two small arrays, once per dispatch).
        read = lambda a: pending.ran(np.asarray(a), self.layout.decode_steps)
        try:
            tokens, bad, *extra = (read(a) for a in wanted)
        except Exception as e:  # an asynchronous device failure surfaces here
            self._recover([r for r in owners if r is not None], e)
            return
        logprobs = dict(zip(("logprobs", "top_ids", "top_logprobs"), extra, strict=True)) if extra else None
        steps = None if pending.verified is None else pending.verified[0]
        if pending.verified is not None:  # its requests' acceptance first: their final metrics include it
            checked, kinds = (read(a) for a in pending.verified[1:])
            records, tally = self.speculation.record(drafts_of(owners), tokens, steps, checked, kinds)
            self.scheduler.store_drafts(owners, records)
            self.dispatch_counts.draft_tokens += tally.drafted
            self.dispatch_counts.accepted_tokens += tally.accepted
        with self._lock:
            committed = self.scheduler.commit(owners, tokens, bad, logprobs, steps)
            self._lock.notify_all()
        poisoned = committed.poisoned_pages  # zeroed before the next plan can give them to someone
        for start in range(0, len(poisoned), self.layout.max_pages):
            self.device.clear_pages(self.device.page_list(poisoned[start : start + self.layout.max_pages]))
        deliver(committed.events)

    def _recover(self, touched: list[Request], error: Exception) -> None:
        """Fail the touched requests; rebuild the cache if the failed call consumed it."""
        log.exception("device step failed: %s", error)
        message = f"engine error: {type(error).__name__}: {error}"
        if self.cluster is not None:  # another process's part of the computation failed
            self.fail_all(message)
            return
        with self._lock:
            if self.device.consumed():
                touched = touched + self.scheduler.active_requests()  # their pages are gone
                self.device.reset()
            events = self.scheduler.fail(touched, message)
            self._lock.notify_all()
        deliver(events)
