"""The load test's report: the numbers, the verdicts, and the series behind them.

:func:`build_report` reads what the driver (loadtest/driver.py) kept and computes

- **throughput**: output tokens (every sample's, cancelled requests' included) and completed
  requests (finished or cancelled) per second of the run's wall time (model load excluded).
  At a finite rate the arrivals set the pace (the summary says so): ``rate=inf`` measures the
  engine;
- **pool**: peak concurrency (running sequences after a step), the fewest free blocks after a
  step (cached free blocks count as free: the allocator hands them out), KV waste (mean over
  the steps that left blocks held, and max; the formula is in loadtest/checks.py),
  preemptions by mode;
- **prefix cache**: hit rate (prompt tokens served from the cache / prompt tokens admitted,
  re-admissions after a recompute included), per phase too, and the trace's tenant audit;
- **latency**, the client's view from each request's scheduled arrival: TTFT (to the first
  token) of every request that got one, ITL (every gap between two steps that gave a request
  tokens), E2E (to the end) of the requests that finished; p50 / p90 / p99 in seconds;
- **counts**: requests by outcome (``stuck``: still in the engine when its phase hit its bound
  on steps, aborted); ``kinds``: the prompt kinds and the squeeze *as sent*, and ``parallel``
  *as observed* (outputs that came back with more than one sample); tenants and model versions
  of the requests that were served;
- **checks** (:class:`~pagedlearn.loadtest.verdicts.Check`, loadtest/verdicts.py): correctness
  (nothing lost, every block back, the invariants, no cross-tenant hit, no hit after a reset
  or a new model version) and coverage (both preemption modes, a warm hit, same-tenant hits,
  the whole mix); ``ok``: the correctness checks passed, ``complete``: all of them;
- **engine**: the engine's own :class:`~pagedlearn.engine.stats.StepStats` at the end
  (``as_dict()``: the numbers its dashboard shows) and ``engine_metrics``, the percentiles of
  ``engine.metrics`` (over the engine's life: with an ``LLM`` that served before, not only
  this run).

``report.series`` holds one entry per step (time, phase, free / cached / used / swapped
blocks, running sequences, queues, KV waste) and ``report.requests`` one record per request
(its kinds, tenant, outcome, arrival and end in the series' time, TTFT, ITL gaps, E2E,
preemptions, cached tokens), so that a notebook can plot latency tails against the pool's free
blocks across runs (loadtest/tails.py).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from pagedlearn.engine.distribution import percentiles
from pagedlearn.loadtest.verdicts import CORRECTNESS, Check, percent, verdicts

QS = (50, 90, 99)
# The top-level keys of ``LoadTestReport.as_dict()`` (what ``--json`` writes).
JSON_KEYS = ("config", "wall_time", "ok", "complete", "checks", "counts", "throughput", "pool",
             "prefix_cache", "latency", "phases", "engine", "engine_metrics", "series",
             "requests", "prometheus")  # fmt: skip
MIX_KINDS = ("short", "near-limit", "shared", "unique", "parallel", "squeeze")
# engine.metrics' distributions copied into the report (p50 / p90 / p99 and count)
ENGINE_METRICS = ("ttft", "itl", "e2e", "queue_time", "prompt_tokens", "generation_tokens",
                  "running_seqs", "iteration_tokens")  # fmt: skip


class CheckedReport:
    """What a load test's report says from its ``checks`` (a list of :class:`Check`), shared by
    the in-process report and the one over HTTP (loadtest/http_report.py): whether it is
    ``ok`` and ``complete``, and ``as_dict()`` over the class's ``JSON_KEYS``."""

    JSON_KEYS: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """Every correctness check passed: nothing lost, leaked, broken or shared."""
        return all(c.ok for c in self.checks if c.kind == CORRECTNESS)

    @property
    def complete(self) -> bool:
        """Every check passed, the coverage checks too: the run exercised all it meant to."""
        return all(c.ok for c in self.checks)

    def as_dict(self) -> dict:
        """Every number, JSON-able (NaN -> None)."""
        keys = (k for k in self.JSON_KEYS if k not in ("ok", "complete", "checks"))
        d = {k: getattr(self, k) for k in keys}
        d["ok"], d["complete"] = self.ok, self.complete
        d["checks"] = [c.as_dict() for c in self.checks]
        return _json_safe(d)


@dataclass
class LoadTestReport(CheckedReport):
    """One run: ``config`` (model, pool, arguments), ``wall_time`` (seconds, model load
    excluded), the numbers by topic (dicts; see the module docstring), ``checks``, the
    per-step ``series`` and per-request ``requests``, the engine's own numbers (``engine``,
    ``engine_metrics``). ``summary()`` is what the command prints, ``as_dict()`` what
    ``--json`` writes (the keys: :data:`JSON_KEYS`)."""

    config: dict
    wall_time: float
    counts: dict
    throughput: dict
    pool: dict
    prefix_cache: dict
    latency: dict
    phases: dict
    checks: list[Check]
    series: dict = field(repr=False)
    requests: list[dict] = field(repr=False)
    prometheus: str | None = None  # where the Prometheus exposition was written, if it was
    engine: dict = field(default_factory=dict, repr=False)  # StepStats.as_dict() at the end
    engine_metrics: dict = field(default_factory=dict, repr=False)  # name -> p50 / p90 / p99

    JSON_KEYS = JSON_KEYS

    def summary(self) -> str:
        c, cnt, pool, pc = self.config, self.counts, self.pool, self.prefix_cache
        phase = pc["phase_hit_rate"]
        rate = "all at once" if c["rate"] == math.inf else f"Poisson arrivals at {c['rate']:g}/s"
        pace = (
            "all at once: the engine's pace"
            if c["rate"] == math.inf
            else f"paced by arrivals at {c['rate']:g}/s; --rate inf measures the engine"
        )
        kinds = cnt["kinds"]
        lines = [
            f"pagedlearn load test: {c['model']}, {c['num_requests']} requests (seed "
            f"{c['seed']}), {rate}",
            f"  pool {c['num_blocks']} blocks x {c['block_size']} tokens, swap pool "
            f"{c['swap_blocks']} blocks, context {c['max_model_len']} tokens",
            "phases: "
            + ", ".join(
                f"{k} {p['requests']} ({p['wall_time']:.2f} s)" for k, p in self.phases.items()
            ),
            "requests sent: "
            + ", ".join(f"{k} {kinds[k]}" for k in MIX_KINDS if k != "parallel")
            + f"; observed: parallel {kinds['parallel']} (n > 1 samples back), stopped early "
            f"{cnt['stopped_early']}, ran to max_tokens {cnt['to_max_tokens']}, cancelled "
            f"{cnt['cancelled']}, rejected {cnt['rejected']} (on purpose), stuck "
            f"{cnt['stuck']}; tenants {cnt['tenants']}, model versions {cnt['model_versions']}",
            f"throughput: {self.throughput['output_tokens']:,} output tokens in "
            f"{self.wall_time:.2f} s = {self.throughput['output_tokens_per_s']:,.0f} tokens/s, "
            f"{self.throughput['requests_per_s']:.1f} requests/s (finished or cancelled; "
            f"{pace})",
            f"pool: peak {pool['peak_running_seqs']} running sequences, min free blocks "
            f"{pool['min_free_blocks']} of {c['num_blocks']}, KV waste mean "
            f"{percent(pool['kv_waste_mean'])} max {percent(pool['kv_waste_max'])} "
            f"(1 - tokens held / (blocks held x {c['block_size']}))",
            f"preemptions: swap {pool['preemptions_swap']}, recompute "
            f"{pool['preemptions_recompute']} (blocks swapped out {pool['swap_out_blocks']}, "
            f"in {pool['swap_in_blocks']})",
            f"prefix cache: hit rate {percent(pc['hit_rate'])} (cold pass "
            f"{percent(phase['cold'])}, warm {percent(phase['warm'])}, new model version "
            f"{percent(phase['version'])}); "
            f"{pc['same_tenant_hit_blocks']} blocks hit, {pc['cross_tenant_hit_blocks']} "
            "across tenants",
            f"latency (ms)   {'p50':>8} {'p90':>8} {'p99':>8}   count",
        ]
        for name in ("ttft", "itl", "e2e"):
            d = self.latency[name]
            ms = " ".join(f"{1e3 * d[f'p{q}']:8.1f}" for q in QS)
            lines.append(f"  {name.upper():<12} {ms}   {d['count']}")
        lines.append("checks:")
        lines += [ch.line() for ch in self.checks]
        missed = sum(not ch.ok for ch in self.checks) if self.ok else 0
        verdict = (
            "SOME CHECKS FAILED"
            if not self.ok
            else "all checks passed"
            if self.complete
            else f"every correctness check passed; {missed} not exercised ([--]: the options "
            "could not show it)"
        )
        lines.append(
            f"{verdict}; wall time {self.wall_time:.2f} s (+ {c['load_time']:.2f} s loading "
            "the model)"
        )
        return "\n".join(lines)


def build_report(driver, config: dict) -> LoadTestReport:
    """The report of a finished run (``driver``: loadtest.Driver, closed)."""
    engine, end = driver.engine, driver.engine.stats()
    requests = [driver.record(rid) for rid in driver.specs]
    outcomes = Counter(r["outcome"] for r in requests)
    kinds = Counter(k for s in driver.specs.values() for k in s.kinds)  # as sent
    # Observed: outputs that came back with several samples (a parallel request that lost
    # its samples, or came back with one, does not count).
    kinds["parallel"] = sum(r["samples"] > 1 for r in requests)
    served = [r for r in requests if r["outcome"] in ("stopped", "length", "cancelled")]
    tenants = {tuple(r["tenant"]) for r in served}
    counts = {
        "sent": len(requests),
        "finished": outcomes["stopped"] + outcomes["length"],
        "stopped_early": outcomes["stopped"],
        "to_max_tokens": outcomes["length"],
        "cancelled": outcomes["cancelled"],
        "rejected": outcomes["rejected"],
        "failed": outcomes["error"],
        "lost": outcomes["lost"],
        "stuck": outcomes["stuck"],
        "kinds": {k: kinds[k] for k in MIX_KINDS},
        "samples": dict(Counter(f for r in requests for f in r["finish_reasons"])),
        "tenants": len({t[:2] for t in tenants}),
        "model_versions": len({t[2] for t in tenants}),
        "shared_across_tenants": _shared_across_tenants(driver),
    }
    wall = driver.end - driver.start
    out_tokens = sum(r["output_tokens"] for r in requests)
    waste = [w for w in driver.series["kv_waste"] if w is not None]
    pool = {
        "peak_running_seqs": max(driver.series["num_running_seqs"], default=0),
        "min_free_blocks": min(driver.series["free_blocks"], default=end.num_blocks),
        "kv_waste_mean": sum(waste) / len(waste) if waste else math.nan,
        "kv_waste_max": max(waste, default=math.nan),
        "preemptions_swap": end.preemptions_swap,
        "preemptions_recompute": end.preemptions_recompute,
        "swap_out_blocks": end.swap_out_blocks,
        "swap_in_blocks": end.swap_in_blocks,
        "cow_copies": end.cow_copies,
        "evictions": end.evictions,
        "steps": len(driver.series["t"]),
    }
    prefix_cache = {
        "hit_rate": _rate(end.prefix_hit_tokens, end.prefix_query_tokens),
        "phase_hit_rate": {
            k: _rate(p["prefix_hit_tokens"], p["prefix_query_tokens"])
            for k, p in driver.phases.items()
        },
        "hit_tokens": end.prefix_hit_tokens,
        "query_tokens": end.prefix_query_tokens,
        **driver.audit.as_dict(),
    }
    latency = {
        "ttft": _dist(r["ttft"] for r in requests if r["ttft"] is not None),
        "itl": _dist(g for r in requests for g in r["itl"]),
        "e2e": _dist(r["e2e"] for r in requests if r["e2e"] is not None),
    }
    report = LoadTestReport(
        config,
        wall,
        counts,
        {
            "output_tokens": out_tokens,
            "output_tokens_per_s": out_tokens / wall,
            "requests_per_s": (counts["finished"] + counts["cancelled"]) / wall,
        },
        pool,
        prefix_cache,
        latency,
        driver.phases,
        [],
        dict(driver.series),
        requests,
        engine=end.as_dict(),
        engine_metrics=_engine_metrics(engine),
    )
    report.checks = verdicts(driver, report, end, engine.kv)
    return report


def _shared_across_tenants(driver) -> int:
    """How many (phase, system prompt) pairs were sent by more than one tenant."""
    senders: dict[tuple, set] = {}
    for rid, spec in driver.specs.items():
        if spec.system_prompt is not None:
            senders.setdefault((spec.phase, spec.system_prompt), set()).add(driver.tenant[rid])
    return sum(len(t) > 1 for t in senders.values())


def _engine_metrics(engine) -> dict:
    """p50 / p90 / p99 and count of ``engine.metrics``' distributions (their recent windows),
    and the finish reasons counted; {} for an engine without metrics."""
    m = getattr(engine, "metrics", None)
    if m is None:
        return {}
    out = {}
    for name in ENGINE_METRICS:
        d = getattr(m, name, None)
        if d is not None:
            out[name] = {**{f"p{q}": v for q, v in d.percentiles(QS).items()}, "count": d.count}
    out["finished_by_reason"] = dict(getattr(m, "finished_by_reason", {}))
    return out


def _dist(values) -> dict:
    xs = list(values)
    return {**{f"p{q}": v for q, v in percentiles(xs, QS).items()}, "count": len(xs)}


def _rate(hits: int, queries: int) -> float:
    return hits / queries if queries else math.nan


def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else str(x)  # inf: the rate of "all at once"
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x
