"""Serving metrics in Prometheus form: latency histograms, load gauges, token and outcome counters.

Per-request numbers (queue time, time to first token, inter-token latencies, end-to-end time) come
from the `metrics` dict of each finished request; load gauges (running and waiting requests, slots
in use, KV pages in use: what inference gateways read to route), the prefix cache's and
preemptions' counters, and the engine's dispatch counters (how full its prefill and decode batches
ran) are read from the engine when scraped. Each `ServingMetrics` owns its own
registry, so several servers (or tests) in one process do not collide.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


@dataclasses.dataclass
class DispatchCounts:
    """What the device was asked to compute since the engine started: how full its batches ran.

    Decode row-steps are slot rows times decode steps; `active` rows belong to a request, `idle`
    ones pad the dispatch to its slot bucket. active / steps is the mean decode batch.
    """

    prefill_dispatches: int = 0  # dispatches of prompt pieces
    prefill_tokens: int = 0  # their prompt tokens...
    prefill_padding: int = 0  # ... and the padding up to whole pieces and a piece bucket
    mixed_dispatches: int = 0  # prefill dispatches that carried a decode step too (counted as both)
    decode_dispatches: int = 0  # decode dispatches, verify ones included
    decode_steps: int = 0
    decode_active_row_steps: int = 0
    decode_idle_row_steps: int = 0
    sample_dispatches: int = 0  # deferred (constrained) rows sampled on their own
    verify_dispatches: int = 0  # decode dispatches whose steps verified draft tokens
    draft_tokens: int = 0  # draft tokens proposed to those steps...
    accepted_tokens: int = 0  # ... and accepted (each beside the token the step makes anyway)

    def count_prefill(self, tokens: int, size: int) -> None:
        """A prefill dispatch of `tokens` prompt tokens, padded to `size`."""
        self.prefill_dispatches += 1
        self.prefill_tokens += tokens
        self.prefill_padding += size - tokens

    def count_decode(self, kind: str, row_steps) -> None:
        """A decode dispatch of `kind` ("decode", "verify") over rows that take part in row_steps
        [rows] of its steps: it runs as many as the busiest row takes."""
        steps, active = int(max(row_steps, default=0)), int(sum(row_steps))
        self.decode_dispatches += 1
        self.decode_steps += steps
        self.decode_active_row_steps += active
        self.decode_idle_row_steps += len(row_steps) * steps - active
        self.verify_dispatches += kind == "verify"


class _DispatchCollector:
    """The engine's `DispatchCounts` as Prometheus counters, read at each scrape."""

    def __init__(self, counts: Callable[[], DispatchCounts]):
        self._counts = counts

    def collect(self):
        c = self._counts()
        prefill_tokens = CounterMetricFamily(
            "jinfer_prefill_tokens", "Tokens computed by prefill dispatches", labels=["kind"]
        )
        prefill_tokens.add_metric(["prompt"], c.prefill_tokens)
        prefill_tokens.add_metric(["padding"], c.prefill_padding)
        row_steps = CounterMetricFamily(
            "jinfer_decode_row_steps",
            "Slot rows computed by decode steps: active (a request's) or idle (bucket padding)",
            labels=["state"],
        )
        row_steps.add_metric(["active"], c.decode_active_row_steps)
        row_steps.add_metric(["idle"], c.decode_idle_row_steps)
        yield from (
            CounterMetricFamily(
                "jinfer_prefill_dispatches", "Dispatches of prompt pieces", c.prefill_dispatches
            ),
            prefill_tokens,
            CounterMetricFamily(
                "jinfer_mixed_dispatches",
                "Dispatches of prompt pieces that carried a decode step too (counted in both)",
                c.mixed_dispatches,
            ),
            CounterMetricFamily("jinfer_decode_dispatches", "Decode dispatches", c.decode_dispatches),
            CounterMetricFamily("jinfer_decode_steps", "Decode steps run on the device", c.decode_steps),
            row_steps,
            CounterMetricFamily(
                "jinfer_sample_dispatches",
                "Dispatches sampling constrained rows under their allowed sets",
                c.sample_dispatches,
            ),
            CounterMetricFamily(
                "jinfer_verify_dispatches", "Decode dispatches verifying draft tokens", c.verify_dispatches
            ),
            CounterMetricFamily(
                "jinfer_draft_tokens", "Draft tokens proposed to verify steps", c.draft_tokens
            ),
            CounterMetricFamily(
                "jinfer_accepted_draft_tokens", "Draft tokens accepted by verify steps", c.accepted_tokens
            ),
        )


class _CacheCollector:
    """The engine's prefix-cache lookups and preemptions as Prometheus counters, read at each scrape."""

    def __init__(self, stats: Callable[[], dict[str, float]]):
        self._stats = stats

    def collect(self):
        stats = self._stats()
        yield from (
            CounterMetricFamily(
                "jinfer_prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache",
                stats["prefix_cache_queries"],
            ),
            CounterMetricFamily(
                "jinfer_prefix_cache_hits",
                "Prompt tokens found in the prefix cache",
                stats["prefix_cache_hits"],
            ),
            CounterMetricFamily(
                "jinfer_preemptions",
                "Running requests preempted for pages (resumed later with the same output)",
                stats["preemptions"],
            ),
        )


class ServingMetrics:
    def __init__(
        self, engine_stats: Callable[[], dict[str, float]], dispatch_counts: Callable[[], DispatchCounts]
    ):
        self.registry = CollectorRegistry()
        self._engine_stats = engine_stats
        r = self.registry
        r.register(_DispatchCollector(dispatch_counts))
        r.register(_CacheCollector(engine_stats))
        self.ttft = Histogram(
            "jinfer_time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "jinfer_inter_token_latency_seconds", "Time between tokens", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "jinfer_e2e_request_latency_seconds", "Request latency", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.queue = Histogram(
            "jinfer_request_queue_time_seconds",
            "Time waiting for a slot",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("jinfer_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("jinfer_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter(
            "jinfer_requests_finished", "Finished requests", ["finish_reason"], registry=r
        )
        self.rejected = Counter(
            "jinfer_requests_rejected", "Requests rejected (queue full, not ready)", registry=r
        )
        self.running = Gauge("jinfer_requests_running", "Requests holding a slot", registry=r)
        self.waiting = Gauge("jinfer_requests_waiting", "Requests waiting for a slot", registry=r)
        self.slots = Gauge("jinfer_slots_in_use", "Slots in use", registry=r)
        self.kv_usage = Gauge(
            "jinfer_kv_cache_usage_ratio", "Share of the KV pool's pages held by requests", registry=r
        )
        self.kv_pages_total = Gauge("jinfer_kv_pages_total", "Pages in the KV pool", registry=r)
        self.kv_pages_used = Gauge("jinfer_kv_pages_used", "KV pages held by requests", registry=r)

    def observe_finished(self, reason: str, metrics: dict[str, Any] | None) -> None:
        self.finished.labels(finish_reason=reason).inc()
        if not metrics:
            return
        self.prompt_tokens.inc(metrics.get("prompt_tokens", 0))
        self.generation_tokens.inc(metrics.get("completion_tokens", 0))
        for histogram, key in ((self.ttft, "ttft_s"), (self.e2e, "total_s"), (self.queue, "queue_s")):
            if metrics.get(key) is not None:
                histogram.observe(metrics[key])
        for gap in metrics.get("inter_token_s", ()):
            self.itl.observe(gap)

    def exposition(self) -> bytes:
        stats = self._engine_stats()
        self.running.set(stats["running"])
        self.waiting.set(stats["waiting"])
        self.slots.set(stats["slots_in_use"])
        self.kv_usage.set(stats["kv_cache_usage"])
        self.kv_pages_total.set(stats["kv_pages_total"])
        self.kv_pages_used.set(stats["kv_pages_used"])
        return generate_latest(self.registry)
