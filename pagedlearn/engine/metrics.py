"""Operator metrics: the distributions and windows a dashboard shows, over the engine's life.

:class:`~pagedlearn.engine.stats.StepStats` says how things stand after one step. An operator
also asks *how it has been going*: how long requests waited for their first token (p50 / p90 /
p99), how long prompts are, how many sequences a step runs, how often the prefix cache hit
lately. Every engine has one :class:`EngineMetrics` (``engine.metrics``), always on, fed::

    step ends (outputs.publish) ──> observe_step(stats)     concurrency, tokens per step, the
                                                            windows StepStats reads (as_of)
    a step gives tokens (_process) ──> observe_tokens(m)     TTFT, each inter-token gap
    a request ends (outputs.finish) ──> observe_request(req) prompt / output lengths, E2E,
                                                            queue time
    a block op (opt-in) ──> track_cache_residency()         a cached block's lifetime, idle time
                                                            before eviction, gaps between reuses

Rules worth knowing:

- **Bounded memory**: a server runs for days. Each quantity is a
  :class:`~pagedlearn.engine.distribution.Distribution`: a
  histogram with fixed buckets over the whole life (what Prometheus scrapes; vLLM's bounds) plus
  the last ``window`` values, exact, for the percentiles printed here (a ``deque``). Nothing
  grows with the number of requests.
- **Percentiles are recent**: p50 / p90 / p99 are over the last 1,000 requests (10,000
  inter-token gaps, 1,000 steps): exact for a demo, recent for a server (vLLM's log line
  keeps the last 1,000 requests for its prefix-cache hit rate, too).
- **The recent prefix-cache hit rate** is over the last 1,000 steps that queried the cache
  (admitted a prompt), token-weighted: hit tokens / queried tokens.
- **Cache residency is opt-in** (vLLM's ``--kv-cache-metrics`` is too): it needs a timestamp
  per cached block, taken from the block trace; a trace subscriber makes every block operation
  build an event, and the engine then records a frame per step. Off, it costs nothing.

>>> m = EngineMetrics()
>>> for ttft in (0.1, 0.2, 0.3, 0.4): m.ttft.observe(ttft)
>>> round(m.ttft.percentiles()[50], 3), m.ttft.count, m.ttft.cumulative()[-1]
(0.25, 4, ('+Inf', 4))
"""

from __future__ import annotations

import time
from collections import deque

from pagedlearn.engine.distribution import Distribution, one_two_five
from pagedlearn.errors import PagedLearnError

RECENT_REQUESTS = 1_000  # per-request distributions keep this many values for percentiles
RECENT_GAPS = 10_000  # inter-token gaps (many per request)
RECENT_STEPS = 1_000  # per-step distributions, and the prefix-cache window (steps that queried)

# vLLM's bucket bounds (vllm/v1/metrics/loggers.py), so that histograms compare bucket by bucket.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
RESIDENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30,
                     60, 120, 300, 600, 1200, 1800)  # fmt: skip
SEQS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # no vLLM counterpart


class EngineMetrics:
    """An engine's distributions and windows (see the module docstring). ``max_model_len``
    sizes the token-count buckets; ``trace``: the block trace residency tracking listens to."""

    def __init__(self, max_model_len: int = 2048, trace=None) -> None:
        tokens = one_two_five(max(max_model_len, 1))
        # per request, when it finishes
        self.prompt_tokens = Distribution(tokens, RECENT_REQUESTS)
        self.generation_tokens = Distribution(tokens, RECENT_REQUESTS)  # all its samples
        self.ttft = Distribution(TTFT_BUCKETS, RECENT_REQUESTS)
        self.itl = Distribution(ITL_BUCKETS, RECENT_GAPS)  # every gap between token times
        self.e2e = Distribution(REQUEST_LATENCY_BUCKETS, RECENT_REQUESTS)
        self.queue_time = Distribution(REQUEST_LATENCY_BUCKETS, RECENT_REQUESTS)
        self.finished_by_reason: dict[str, int] = {}  # "stop", "length", "abort", "error"
        # per step
        self.running_seqs = Distribution(SEQS_BUCKETS, RECENT_STEPS)  # concurrency
        self.iteration_tokens = Distribution(ITERATION_TOKENS_BUCKETS, RECENT_STEPS)
        # cache residency (opt-in: track_cache_residency)
        self.block_lifetime = Distribution(RESIDENCY_BUCKETS, RECENT_REQUESTS)
        self.block_idle_before_evict = Distribution(RESIDENCY_BUCKETS, RECENT_REQUESTS)
        self.block_reuse_gap = Distribution(RESIDENCY_BUCKETS, RECENT_REQUESTS)
        self._trace, self._untrack = trace, None
        self._cached_at: dict[int, list[float]] = {}  # block -> [cached at, last used]: <= pool
        # the windows StepStats reads (as_of), as of the last observed step
        self._min_free: int | None = None
        self._prefix_window: deque[tuple[int, int]] = deque(maxlen=RECENT_STEPS)
        self._recent_queries = self._recent_hits = 0
        self._last_queries = self._last_hits = self._last_recomputed = 0
        self._recompute_time = 0.0
        self._prefill_seconds, self._prefill_tokens = 0.0, 0  # forward time of prefill steps
        self._ttft_at: tuple[int, float | None, float | None] = (0, None, None)

    # --- steps --------------------------------------------------------------------------------
    def as_of(self, kv_stats: dict, recomputed_tokens: int, step: dict) -> dict:
        """StepStats' windowed fields now, counting what happened since the last observed step
        (``kv_stats``: the manager's ``stats()``; ``step``: the step's own numbers)::

            recompute_time += (recomputed_tokens - at the last step)
                              x forward_time / num_batched_tokens, summed over the steps
                                that prefilled (this one included)

        i.e. the tokens a recompute preemption dropped are priced at what a token of prefill
        has cost so far: they are computed again as a prefill. (Priced at the preempting step's
        own time per token, a decode step's, it would come out several times too high.)"""
        free = kv_stats["free_blocks"]
        _, _, queries, hits = self._prefix_delta(
            kv_stats["prefix_query_tokens"], kv_stats["prefix_hit_tokens"]
        )
        seconds, tokens = self._prefill_seconds, self._prefill_tokens
        if step.get("num_prefill_seqs"):
            seconds += step.get("forward_time", 0.0)
            tokens += step.get("num_batched_tokens", 0)
        per_token = seconds / tokens if tokens else 0.0
        p50, p99 = self._ttft_p50_p99()
        return {
            "min_free_blocks": free if self._min_free is None else min(self._min_free, free),
            "recent_query_tokens": queries,
            "recent_hit_tokens": hits,
            "recompute_time": self._recompute_time
            + (recomputed_tokens - self._last_recomputed) * per_token,
            "ttft_p50": p50,
            "ttft_p99": p99,
        }

    def observe_step(self, stats) -> None:
        """Take in a step's :class:`~pagedlearn.engine.stats.StepStats` (built with
        :meth:`as_of`): its windows become the new baseline; concurrency and tokens counted."""
        dq, dh, queries, hits = self._prefix_delta(
            stats.prefix_query_tokens, stats.prefix_hit_tokens
        )
        if dq > 0:
            self._prefix_window.append((dq, dh))  # the oldest drops out: _prefix_delta saw it
        self._recent_queries, self._recent_hits = queries, hits
        self._last_queries, self._last_hits = stats.prefix_query_tokens, stats.prefix_hit_tokens
        self._min_free = stats.min_free_blocks
        self._last_recomputed, self._recompute_time = stats.recomputed_tokens, stats.recompute_time
        if stats.num_prefill_seqs:
            self._prefill_seconds += stats.forward_time
            self._prefill_tokens += stats.num_batched_tokens
        self.running_seqs.observe(stats.num_running_seqs)
        if stats.num_batched_tokens:
            self.iteration_tokens.observe(stats.num_batched_tokens)

    def _prefix_delta(self, query_total: int, hit_total: int) -> tuple[int, int, int, int]:
        """Queried and hit tokens since the last step, and the window's totals with them."""
        dq, dh = query_total - self._last_queries, hit_total - self._last_hits
        queries, hits = self._recent_queries, self._recent_hits
        if dq > 0:
            w = self._prefix_window
            if len(w) == w.maxlen:  # appending (dq, dh) pushes the oldest step out
                queries, hits = queries - w[0][0], hits - w[0][1]
            queries, hits = queries + dq, hits + dh
        return dq, dh, queries, hits

    def _ttft_p50_p99(self) -> tuple[float | None, float | None]:
        """Recomputed only when a new TTFT came in (a sort of <= 1,000 floats), else cached."""
        seen, p50, p99 = self._ttft_at
        if seen != self.ttft.count:
            p = self.ttft.percentiles((50, 99))
            self._ttft_at = (self.ttft.count, p[50], p[99])
            _, p50, p99 = self._ttft_at
        return p50, p99

    # --- requests -----------------------------------------------------------------------------
    def observe_tokens(self, m) -> None:
        """A step gave a request tokens (``LLMEngine._process``, after it appended ``now`` to
        the request's ``RequestMetrics.token_times``): its TTFT if these are its first, else the
        gap since its last tokens -- when they happen, as vLLM records them, so that a long
        request shows before it ends."""
        times = m.token_times
        if len(times) > 1:  # (the usual case first: this runs for every request at every step)
            self.itl.observe(times[-1] - times[-2])
        elif len(times) == 1 and m.ttft is not None:
            self.ttft.observe(m.ttft)

    def observe_request(self, req) -> None:
        """A request finished (``outputs.finish``): every sequence is in ``req.done``."""
        m = req.metrics
        self.prompt_tokens.observe(len(req.prompt_token_ids))
        self.generation_tokens.observe(sum(len(s.output_token_ids) for s in req.done))
        first = min(req.done, key=lambda s: s.index, default=None)
        reason = (first.finish_reason if first else None) or ("error" if req.error else "abort")
        self.finished_by_reason[reason] = self.finished_by_reason.get(reason, 0) + 1
        if m.e2e is not None:
            self.e2e.observe(m.e2e)
        if m.first_scheduled_time is not None:
            self.queue_time.observe(m.first_scheduled_time - m.arrival_time)

    # --- cache residency (opt-in) -------------------------------------------------------------
    def track_cache_residency(self, enable: bool = True) -> None:
        """Start (or stop) timing cached blocks from the block trace: from ``cache_store`` to
        ``evict`` (``block_lifetime``), from the last store or hit to ``evict``
        (``block_idle_before_evict``), and between a block's store and hits (``block_reuse_gap``).
        Blocks cached before tracking started are not timed. Costs an event per block op."""
        if not enable:
            if self._untrack is not None:
                self._untrack()
            self._untrack = None
            self._cached_at.clear()
            return
        if self._trace is None:
            raise PagedLearnError("these metrics have no block trace to time cached blocks from")
        if self._untrack is None:
            self._untrack = self._trace.subscribe(self._on_block_event)

    @property
    def tracking_cache_residency(self) -> bool:
        return self._untrack is not None

    def _on_block_event(self, e) -> None:
        kind = e.kind
        if kind not in ("cache_store", "cache_hit", "evict", "cache_reset"):
            return
        now, at = time.perf_counter(), self._cached_at
        for b in e.blocks:
            if kind == "cache_store":
                at[b] = [now, now]
            elif kind == "cache_hit" and b in at:
                self.block_reuse_gap.observe(now - at[b][1])
                at[b][1] = now
            elif kind == "evict" and b in at:
                cached, used = at.pop(b)
                self.block_lifetime.observe(now - cached)
                self.block_idle_before_evict.observe(now - used)
            elif kind == "cache_reset":
                at.pop(b, None)

    # --- reading ------------------------------------------------------------------------------
    def summary(self) -> str:
        """Percentiles of the recent window, a few lines of text (the demo prints them)."""

        def row(name: str, d: Distribution, scale: float, unit: str) -> str:
            if not d.recent:
                return f"  {name:<22} (none yet)"
            p = d.percentiles()
            cells = " / ".join(f"{p[q] * scale:8.1f}" for q in (50, 90, 99))
            return f"  {name:<22} {cells} {unit}"

        n = len(self.e2e.recent)
        lines = [
            f"latency over the last {n:,} requests (p50 / p90 / p99):",
            row("time to first token", self.ttft, 1e3, "ms"),
            row("inter-token latency", self.itl, 1e3, "ms"),
            row("end to end", self.e2e, 1e3, "ms"),
            row("queue time", self.queue_time, 1e3, "ms"),
            "lengths and concurrency (p50 / p90 / p99):",
            row("prompt", self.prompt_tokens, 1, "tokens"),
            row("output (all samples)", self.generation_tokens, 1, "tokens"),
            row("running seqs per step", self.running_seqs, 1, "sequences"),
        ]
        if self.tracking_cache_residency or self.block_lifetime.count:
            lines += [
                "cached blocks (p50 / p90 / p99):",
                row("cached -> evicted", self.block_lifetime, 1e3, "ms"),
                row("idle before eviction", self.block_idle_before_evict, 1e3, "ms"),
                row("gap between reuses", self.block_reuse_gap, 1e3, "ms"),
            ]
        return "\n".join(lines)
