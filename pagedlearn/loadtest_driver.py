"""The load test's driver: requests in at their arrival times, steps, cancellations, samples.

::

    specs ──> arrivals (wall clock) ──> engine.add_request ──> engine.step() ──> outputs
                                                                   │   └──> abort after k tokens
    after every step: check_invariants(), StepStats, KV waste      │
    every block event: TenantAudit (loadtest_checks.py) <── trace ─┘

:meth:`Driver.run_phase` adds the requests whose arrival time has passed, runs one step, aborts
the requests due for cancelling, checks the pool's invariants, and sleeps only when the engine
is idle and the next arrival is in the future. A request's *scheduled* arrival is kept, so that
latencies are the client's: a step that delays an admission is part of its time to first
token. What it keeps is what loadtest_report.py reads.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Hashable

from pagedlearn.errors import PagedLearnError
from pagedlearn.loadtest_checks import TenantAudit, kv_waste
from pagedlearn.loadtest_mix import RequestSpec

# StepStats fields sampled after every step (besides the time, the phase and the KV waste).
SERIES = ("free_blocks", "cached_blocks", "used_blocks", "cpu_used_blocks", "num_running_seqs",
          "num_waiting", "num_swapped", "num_batched_tokens")  # fmt: skip


class Driver:
    """Sends the specs, steps the engine, and keeps what the report reads: every request's
    final output (or why it has none), the per-step series, the invariant checks, the audit."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.specs: dict[str, RequestSpec] = {}
        self.tenant: dict[str, Hashable] = {}  # request id -> (salt, adapter, model version)
        self.arrival: dict[str, float] = {}  # request id -> scheduled arrival (perf_counter)
        self.final: dict = {}  # request id -> its final RequestOutput
        self.rejected: dict[str, str] = {}  # request id -> why the door refused it
        self.cancelled: set[str] = set()
        self.series: dict[str, list] = {"t": [], "phase": [], "kv_waste": []}
        self.series.update({k: [] for k in SERIES})
        self.invariant_checks, self.invariant_errors = 0, []
        self.phases: dict[str, dict] = {}
        self.audit = TenantAudit(self.tenant.get)
        self._unsubscribe = engine.kv.trace.subscribe(self.audit)
        self.start = time.perf_counter()
        self.end = self.start

    def close(self) -> None:
        """Stop listening; abort what it sent and is not done (a run that raised), so that the
        engine is left idle, as ``LLM.generate`` leaves it."""
        self.end = time.perf_counter()
        self._unsubscribe()
        for rid in [r for r in self.engine.requests if r in self.specs]:
            with contextlib.suppress(Exception):  # a broken engine: the first error matters
                self.engine.abort_request(rid)

    def run_phase(self, phase: str, specs: list[RequestSpec]) -> None:
        """Send ``specs`` at their arrival times (from now) and step until the engine is idle."""
        engine = self.engine
        queue = sorted(specs, key=lambda s: s.arrival)  # stable: ties keep the mix's order
        before = engine.stats()
        start, i = time.perf_counter(), 0
        while i < len(queue) or engine.has_unfinished_requests():
            now = time.perf_counter()
            while i < len(queue) and start + queue[i].arrival <= now:
                self._submit(queue[i], start + queue[i].arrival)
                i += 1
            if engine.has_unfinished_requests():
                self._step(phase)
            elif i < len(queue):  # idle until the next arrival
                time.sleep(max(0.0, start + queue[i].arrival - time.perf_counter()))
        after = engine.stats()
        self.phases[phase] = {
            "requests": len(specs),
            "wall_time": time.perf_counter() - start,
            "prefix_query_tokens": after.prefix_query_tokens - before.prefix_query_tokens,
            "prefix_hit_tokens": after.prefix_hit_tokens - before.prefix_hit_tokens,
            "preemptions_swap": after.preemptions_swap - before.preemptions_swap,
            "preemptions_recompute": after.preemptions_recompute - before.preemptions_recompute,
        }

    def _submit(self, spec: RequestSpec, arrival: float) -> None:
        from pagedlearn.engine.llm_engine import RequestRejectedError

        rid = spec.request_id
        self.specs[rid], self.arrival[rid] = spec, arrival
        self.tenant[rid] = (spec.salt, spec.adapter, self.engine.model_version)
        prompt = {"prompt_token_ids": list(spec.prompt_token_ids)}
        if spec.salt is not None:
            prompt["cache_salt"] = spec.salt  # vLLM's shape; add_request(cache_salt=) works too
        try:
            self.engine.add_request(rid, prompt, spec.params, lora_request=spec.adapter)
        except RequestRejectedError as e:
            self.rejected[rid] = str(e)

    def _step(self, phase: str) -> None:
        engine = self.engine
        outputs = engine.step()
        self._sample(phase, engine.last_stats)  # the pool as the step left it
        self._check_invariants()
        for out in outputs:
            rid, spec = out.request_id, self.specs.get(out.request_id)
            if out.finished:
                self.final[rid] = out
            elif spec and spec.cancel_after and len(out.outputs[0].token_ids) >= spec.cancel_after:
                self.final[rid] = engine.abort_request(rid)  # mid-way: its blocks come back now
                self.cancelled.add(rid)
                self._check_invariants()

    def _sample(self, phase: str, stats) -> None:
        s = self.series
        tokens, slots = kv_waste(self.engine.kv)
        s["t"].append(time.perf_counter() - self.start)
        s["phase"].append(phase)
        s["kv_waste"].append(1 - tokens / slots if slots else None)
        for k in SERIES:
            s[k].append(getattr(stats, k))

    def _check_invariants(self) -> None:
        self.invariant_checks += 1
        try:
            self.engine.kv.check_invariants()
        except PagedLearnError as e:
            self.invariant_errors.append(f"step {self.engine.num_steps}: {e}")
