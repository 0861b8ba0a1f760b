"""The load test's driver: requests in at their arrival times, steps, cancellations, samples.

::

    specs ──> arrivals (wall clock) ──> engine.add_request ──> engine.step() ──> outputs
                                                                   │   └──> abort after k tokens
    after every step: check_invariants(), StepStats, KV waste      │
    every block event: TenantAudit (loadtest/checks.py) <── trace ─┘

:meth:`Driver.run_phase` adds the requests whose arrival time has passed, runs one step, aborts
the requests due for cancelling, checks the pool's invariants, and sleeps only when the engine
is idle and the next arrival is in the future. A request's *scheduled* arrival is kept, so that
latencies are the client's: a step that delays an admission is part of its time to first
token. What it keeps is what loadtest/report.py reads.

A phase ends when the engine is idle -- or when it has taken more steps than a correct engine
can need for the phase's requests (:func:`step_bound`): then the requests still in the engine
are aborted and kept as *stuck* (``driver.stuck``), so that a request the scheduler never admits
fails the run by name instead of hanging it. After a step that changed nothing (no token
computed, no request preempted, finished or failed) the driver waits for the next arrival, if
one is due, instead of spinning: only a new request can change what the scheduler decides.
``progress`` (optional) hears of each request that ends, phase by phase, as the HTTP load
test's does (the command prints it on stderr: a long phase is not silent).

>>> from pagedlearn.loadtest.mix import build_mix
>>> mix = build_mix(40, 0, 10.0, 512, 16, 64, 16)
>>> cold = [s for s in mix if s.phase == "cold"]
>>> [(len(s.prompt_token_ids), s.params.n, s.params.max_tokens) for s in cold]
[(68, 1, 4), (73, 1, 4)]
>>> step_bound(cold)  # (68 + 1 x 4 + 1) + (73 + 1 x 4 + 1)
151
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Hashable

from pagedlearn.errors import PagedLearnError
from pagedlearn.loadtest.checks import TenantAudit, kv_waste
from pagedlearn.loadtest.mix import RequestSpec

# StepStats fields sampled after every step (besides the time, the phase and the KV waste).
SERIES = ("free_blocks", "cached_blocks", "used_blocks", "cpu_used_blocks", "num_running_seqs",
          "num_waiting", "num_swapped", "num_batched_tokens")  # fmt: skip
# The allowance for recomputation (step_bound) is capped at this many times the phase's own
# tokens, so that even a livelock of preemptions ends. The default run's squeeze recomputes
# about a fifth of them.
MAX_RECOMPUTE = 3


def step_bound(specs: list[RequestSpec]) -> int:
    """The most steps a correct engine takes for a phase of ``specs``, before recomputation.

    Every step that has work computes at least one token -- a prefill chunk or a decode -- or
    preempts a request to make room; a request needs its prompt computed once and at most
    ``n x max_tokens`` output tokens, and a recompute preemption adds the tokens it dropped.
    So a phase takes at most::

        steps <= sum over its requests of (prompt + n x max_tokens + 1)    this function
               + tokens recomputed + preemptions during the phase          read as it runs

    (the second line counted up to ``MAX_RECOMPUTE x`` the first).

    The ``+ 1`` per request pays for one step that computes nothing for it: the step that fails
    it, or, while a request is stuck, the one step per arrival before the driver waits for the
    next. A prefix-cache hit, a chunk of several tokens, a batch of several requests only make
    the steps fewer."""
    return sum(len(s.prompt_token_ids) + s.params.n * s.params.max_tokens + 1 for s in specs)


class Driver:
    """Sends the specs, steps the engine, and keeps what the report reads: every request's
    final output (or why it has none), the per-step series, the invariant checks, the audit."""

    def __init__(self, engine, progress=None) -> None:
        self.engine = engine
        # None, or progress(phase, done, total): a phase starts (0), one of its requests ended
        self.progress, self._phase, self._ended = progress, None, 0
        self.specs: dict[str, RequestSpec] = {}
        self.tenant: dict[str, Hashable] = {}  # request id -> (salt, adapter, model version)
        self.arrival: dict[str, float] = {}  # request id -> scheduled arrival (perf_counter)
        self.final: dict = {}  # request id -> its final RequestOutput
        self.rejected: dict[str, str] = {}  # request id -> why the door refused it
        self.cancelled: set[str] = set()
        self.stuck: dict[str, str] = {}  # request id -> why it was given up (phase's bound)
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
        """Send ``specs`` at their arrival times (from now) and step until the engine is idle,
        or until the phase's bound on steps (:func:`step_bound`): then abort what is left."""
        engine = self.engine
        queue = sorted(specs, key=lambda s: s.arrival)  # stable: ties keep the mix's order
        before = engine.stats()
        bound = step_bound(specs)
        start, i, steps, max_steps = time.perf_counter(), 0, 0, bound
        self._phase, self._ended = (phase, len(specs)), 0
        if self.progress is not None:
            self.progress(phase, 0, len(specs))
        while i < len(queue) or engine.has_unfinished_requests():
            now = time.perf_counter()
            while i < len(queue) and start + queue[i].arrival <= now:
                self._submit(queue[i], start + queue[i].arrival)
                i += 1
            if engine.has_unfinished_requests():
                last = engine.last_stats or before
                extra = last.recomputed_tokens - before.recomputed_tokens
                extra += _preemptions(last) - _preemptions(before)
                max_steps = bound + min(extra, MAX_RECOMPUTE * bound)
                if steps >= max_steps:
                    self._give_up(phase, queue[i:], start, max_steps)
                    break
                changed = self._step(phase)
                steps += 1
                if not changed and i < len(queue):  # only an arrival can change the schedule
                    time.sleep(max(0.0, start + queue[i].arrival - time.perf_counter()))
            elif i < len(queue):  # idle until the next arrival
                time.sleep(max(0.0, start + queue[i].arrival - time.perf_counter()))
        if self._ended < len(specs) and self.progress is not None:  # stuck ones ended too
            self.progress(phase, len(specs), len(specs))
        after = engine.stats()
        self.phases[phase] = {
            "requests": len(specs),
            "wall_time": time.perf_counter() - start,
            "steps": steps,
            "max_steps": max_steps,
            "stuck": sum(s.request_id in self.stuck for s in specs),
            "prefix_query_tokens": after.prefix_query_tokens - before.prefix_query_tokens,
            "prefix_hit_tokens": after.prefix_hit_tokens - before.prefix_hit_tokens,
            "preemptions_swap": after.preemptions_swap - before.preemptions_swap,
            "preemptions_recompute": after.preemptions_recompute - before.preemptions_recompute,
        }

    def record(self, rid: str) -> dict:
        """What happened to request ``rid``, JSON-able (``report.requests`` holds one per
        request): its spec's numbers and tenant, its ``outcome`` ("stopped", "length",
        "cancelled", "rejected", "error", "stuck", "lost"), its samples and output tokens, and
        the client's times -- ``arrival`` and ``end`` in seconds into the run (as the series'
        ``"t"``), TTFT, every ITL gap, E2E (finished requests only) -- with its preemptions
        and the prompt tokens the cache served at its first admission."""
        spec, out = self.specs[rid], self.final.get(rid)
        record = {
            "id": rid,
            "phase": spec.phase,
            "kinds": sorted(spec.kinds),
            "tenant": list(map(_plain, self.tenant[rid])),
            "prompt_tokens": len(spec.prompt_token_ids),
            "n": spec.params.n,
            "max_tokens": spec.params.max_tokens,
            "cancel_after": spec.cancel_after,
            "finish_reasons": [],
            "output_tokens": 0,
            "samples": 0,
            "arrival": None,
            "end": None,
            "ttft": None,
            "itl": [],
            "e2e": None,
            "num_preemptions": 0,
            "num_cached_tokens": 0,
        }
        if rid in self.rejected:
            return {**record, "outcome": "rejected", "error": self.rejected[rid]}
        if rid in self.stuck:  # aborted at its phase's bound: its numbers would mislead
            return {**record, "outcome": "stuck", "error": self.stuck[rid]}
        if out is None:
            return {**record, "outcome": "lost"}
        reasons = [c.finish_reason for c in out.outputs]
        if rid in self.cancelled:
            outcome = "cancelled"
        else:
            ended = "stopped" if "stop" in reasons else "length"
            outcome = "error" if "error" in reasons else ended
        m, t0 = out.metrics, self.arrival[rid]
        times = m.token_times
        return {
            **record,
            "outcome": outcome,
            "finish_reasons": reasons,
            "output_tokens": sum(len(c.token_ids) for c in out.outputs),
            "samples": len(out.outputs),
            "arrival": t0 - self.start,  # seconds into the run, as the series' "t"
            "end": (m.finished_time or times[-1] if times else t0) - self.start,
            "ttft": None if m.first_token_time is None else m.first_token_time - t0,
            "itl": [b - a for a, b in itertools.pairwise(times)],
            "e2e": m.finished_time - t0 if outcome in ("stopped", "length") else None,
            "num_preemptions": m.num_preemptions,
            "num_cached_tokens": out.num_cached_tokens,
        }

    def _give_up(self, phase: str, unsent: list[RequestSpec], start: float, bound: int) -> None:
        """The phase took ``bound`` steps: abort its requests still in the engine, and keep them
        (and those it never got to send) as stuck."""
        why = f"not finished in the {bound} steps its phase may take ({phase})"
        for spec in unsent:
            self._register(spec, start + spec.arrival)
            self.stuck[spec.request_id] = f"never sent: its phase ({phase}) stopped first"
        for rid in [r for r in self.engine.requests if r in self.specs and r not in self.final]:
            out = self.engine.abort_request(rid)
            if out is not None:  # still unfinished in the engine: the scheduler left it there
                self.final[rid], self.stuck[rid] = out, why
        self._check_invariants()

    def _register(self, spec: RequestSpec, arrival: float) -> None:
        rid = spec.request_id
        self.specs[rid], self.arrival[rid] = spec, arrival
        self.tenant[rid] = (spec.salt, spec.adapter, self.engine.model_version)

    def _submit(self, spec: RequestSpec, arrival: float) -> None:
        from pagedlearn.engine.llm_engine import RequestRejectedError

        rid = spec.request_id
        self._register(spec, arrival)
        prompt = {"prompt_token_ids": list(spec.prompt_token_ids)}
        if spec.salt is not None:
            prompt["cache_salt"] = spec.salt  # vLLM's shape; add_request(cache_salt=) works too
        try:
            self.engine.add_request(rid, prompt, spec.params, lora_request=spec.adapter)
        except RequestRejectedError as e:
            self.rejected[rid] = str(e)
            self._one_ended()

    def _step(self, phase: str) -> bool:
        """One engine step; False if it changed nothing the scheduler reads (no token, no
        preemption, no request finished or failed)."""
        engine = self.engine
        before = engine.last_stats
        outputs = engine.step()
        stats = engine.last_stats
        self._sample(phase, stats)  # the pool as the step left it
        self._check_invariants()
        changed = (
            bool(outputs or stats.num_batched_tokens)
            or before is None
            or (
                _preemptions(stats) != _preemptions(before) or stats.num_failed != before.num_failed
            )
        )
        for out in outputs:
            rid, spec = out.request_id, self.specs.get(out.request_id)
            if out.finished:
                self.final[rid] = out
                if spec is not None:
                    self._one_ended()
            elif spec and spec.cancel_after and len(out.outputs[0].token_ids) >= spec.cancel_after:
                self.final[rid] = engine.abort_request(rid)  # mid-way: its blocks come back now
                self.cancelled.add(rid)
                self._check_invariants()
                self._one_ended()
        return changed

    def _one_ended(self) -> None:
        """A request of the running phase ended (finished, cancelled, rejected): tell
        ``progress``."""
        self._ended += 1
        if self.progress is not None:
            (phase, total) = self._phase
            self.progress(phase, self._ended, total)

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


def _preemptions(stats) -> int:
    return stats.preemptions_swap + stats.preemptions_recompute


def _plain(x):
    return x if x is None or isinstance(x, (str, int, float)) else repr(x)
