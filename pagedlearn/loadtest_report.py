"""The load test's report: the numbers, the verdicts, and the series behind them.

:func:`build_report` reads what the driver (loadtest_driver.py) kept and computes

- **throughput**: output tokens (every sample's, cancelled requests' included) and completed
  requests (finished or cancelled) per second of the run's wall time (model load excluded);
- **pool**: peak concurrency (running sequences after a step), the fewest free blocks after a
  step (cached free blocks count as free: the allocator hands them out), KV waste (mean over
  the steps that left blocks held, and max; the formula is in loadtest_checks.py),
  preemptions by mode;
- **prefix cache**: hit rate (prompt tokens served from the cache / prompt tokens admitted,
  re-admissions after a recompute included), per phase too, and the trace's tenant audit;
- **latency**, the client's view from each request's scheduled arrival: TTFT (to the first
  token) of every request that got one, ITL (every gap between two steps that gave a request
  tokens), E2E (to the end) of the requests that finished; p50 / p90 / p99 in seconds;
- **checks** (:class:`~pagedlearn.loadtest_checks.Check`): nothing lost, every block back,
  the invariants after every step, no cross-tenant hit (and some same-tenant ones), both
  preemption modes, cold then warm, the whole mix.

``report.series`` holds one entry per step (time, phase, free / cached / used / swapped
blocks, running sequences, queues, KV waste) and ``report.requests`` one record per request
(its kinds, tenant, outcome, TTFT, ITL gaps, E2E, preemptions, cached tokens), so that a
notebook can plot latency tails against the pool's free blocks across runs.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass, field

from pagedlearn.engine.metrics import percentiles
from pagedlearn.loadtest_checks import Check, percent, verdicts

QS = (50, 90, 99)
# The top-level keys of ``LoadTestReport.as_dict()`` (what ``--json`` writes).
JSON_KEYS = ("config", "wall_time", "ok", "checks", "counts", "throughput", "pool",
             "prefix_cache", "latency", "phases", "series", "requests", "prometheus")  # fmt: skip
MIX_KINDS = ("short", "near-limit", "shared", "unique", "parallel", "squeeze")


@dataclass
class LoadTestReport:
    """One run: ``config`` (model, pool, arguments), ``wall_time`` (seconds, model load
    excluded), the numbers by topic (dicts; see the module docstring), ``checks``, the
    per-step ``series`` and per-request ``requests``. ``summary()`` is what the command prints,
    ``as_dict()`` what ``--json`` writes (the keys: :data:`JSON_KEYS`)."""

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

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def as_dict(self) -> dict:
        """Every number, JSON-able (NaN -> None)."""
        d = {k: getattr(self, k) for k in JSON_KEYS if k not in ("ok", "checks")}
        d["ok"], d["checks"] = self.ok, [c.as_dict() for c in self.checks]
        return _json_safe(d)

    def summary(self) -> str:
        c, cnt, pool, pc = self.config, self.counts, self.pool, self.prefix_cache
        phase = pc["phase_hit_rate"]
        rate = "all at once" if c["rate"] == math.inf else f"Poisson arrivals at {c['rate']:g}/s"
        lines = [
            f"pagedlearn load test: {c['model']}, {c['num_requests']} requests (seed "
            f"{c['seed']}), {rate}",
            f"  pool {c['num_blocks']} blocks x {c['block_size']} tokens, swap pool "
            f"{c['swap_blocks']} blocks, context {c['max_model_len']} tokens",
            "phases: "
            + ", ".join(
                f"{k} {p['requests']} ({p['wall_time']:.2f} s)" for k, p in self.phases.items()
            ),
            "requests: "
            + ", ".join(f"{k} {cnt['kinds'][k]}" for k in MIX_KINDS)
            + f"; stopped early {cnt['stopped_early']}, ran to max_tokens "
            f"{cnt['to_max_tokens']}, cancelled {cnt['cancelled']}, rejected {cnt['rejected']} "
            f"(on purpose); tenants {cnt['tenants']}, model versions {cnt['model_versions']}",
            f"throughput: {self.throughput['output_tokens']:,} output tokens in "
            f"{self.wall_time:.2f} s = {self.throughput['output_tokens_per_s']:,.0f} tokens/s, "
            f"{self.throughput['requests_per_s']:.1f} requests/s (finished or cancelled)",
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
        lines.append(
            f"{'all checks passed' if self.ok else 'SOME CHECKS FAILED'}; wall time "
            f"{self.wall_time:.2f} s (+ {c['load_time']:.2f} s loading the model)"
        )
        return "\n".join(lines)


def build_report(driver, config: dict) -> LoadTestReport:
    """The report of a finished run (``driver``: loadtest.Driver, closed)."""
    engine, end = driver.engine, driver.engine.stats()
    requests = [_request_record(driver, rid) for rid in driver.specs]
    outcomes = Counter(r["outcome"] for r in requests)
    kinds = Counter(k for s in driver.specs.values() for k in s.kinds)
    tenants = set(driver.tenant.values())
    counts = {
        "sent": len(requests),
        "finished": outcomes["stopped"] + outcomes["length"],
        "stopped_early": outcomes["stopped"],
        "to_max_tokens": outcomes["length"],
        "cancelled": outcomes["cancelled"],
        "rejected": outcomes["rejected"],
        "failed": outcomes["error"],
        "lost": outcomes["lost"],
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
    )
    report.checks = verdicts(driver, report, end, engine.kv)
    return report


def _request_record(driver, rid: str) -> dict:
    spec, out = driver.specs[rid], driver.final.get(rid)
    record = {
        "id": rid,
        "phase": spec.phase,
        "kinds": sorted(spec.kinds),
        "tenant": list(map(_plain, driver.tenant[rid])),
        "prompt_tokens": len(spec.prompt_token_ids),
        "n": spec.params.n,
        "max_tokens": spec.params.max_tokens,
        "cancel_after": spec.cancel_after,
        "finish_reasons": [],
        "output_tokens": 0,
        "ttft": None,
        "itl": [],
        "e2e": None,
        "num_preemptions": 0,
        "num_cached_tokens": 0,
    }
    if rid in driver.rejected:
        return {**record, "outcome": "rejected", "error": driver.rejected[rid]}
    if out is None:
        return {**record, "outcome": "lost"}
    reasons = [c.finish_reason for c in out.outputs]
    if rid in driver.cancelled:
        outcome = "cancelled"
    else:
        outcome = "error" if "error" in reasons else "stopped" if "stop" in reasons else "length"
    m, t0 = out.metrics, driver.arrival[rid]
    times = m.token_times
    return {
        **record,
        "outcome": outcome,
        "finish_reasons": reasons,
        "output_tokens": sum(len(c.token_ids) for c in out.outputs),
        "ttft": None if m.first_token_time is None else m.first_token_time - t0,
        "itl": [b - a for a, b in itertools.pairwise(times)],
        "e2e": m.finished_time - t0 if outcome in ("stopped", "length") else None,
        "num_preemptions": m.num_preemptions,
        "num_cached_tokens": out.num_cached_tokens,
    }


def _shared_across_tenants(driver) -> int:
    """How many (phase, system prompt) pairs were sent by more than one tenant."""
    senders: dict[tuple, set] = {}
    for rid, spec in driver.specs.items():
        if spec.system_prompt is not None:
            senders.setdefault((spec.phase, spec.system_prompt), set()).add(driver.tenant[rid])
    return sum(len(t) > 1 for t in senders.values())


def _dist(values) -> dict:
    xs = list(values)
    return {**{f"p{q}": v for q, v in percentiles(xs, QS).items()}, "count": len(xs)}


def _rate(hits: int, queries: int) -> float:
    return hits / queries if queries else math.nan


def _plain(x):
    return x if x is None or isinstance(x, (str, int, float)) else repr(x)


def _json_safe(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None if math.isnan(x) else str(x)  # inf: the rate of "all at once"
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x
