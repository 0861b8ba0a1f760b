"""The HTTP load test's report: what a client measured, what /metrics said, and the verdicts.

:func:`build_http_report` reads the records loadtest/http.py kept (one per request) and
computes, as the in-process report (loadtest/report.py) does where HTTP lets it:

- **throughput**: output tokens (cancelled requests' included) and answered requests (finished
  or cancelled) per second of the run's wall time; at a finite rate the arrivals set the pace;
- **latency**, the client's clock from each request's send: TTFT, ITL (every gap between two
  chunks that brought tokens), E2E (finished requests); p50 / p90 / p99 in seconds;
- **counts** by outcome ("stopped", "length", "cancelled", "rejected", "error", "timeout",
  "lost") and the kinds of the mix sent (``parallel``: observed, responses with several samples);
- **prefix cache**, per phase: prompt tokens served from the cache, from the responses'
  ``usage.prompt_tokens_details.cached_tokens`` when every answered request of the phase had
  it, else from /metrics (``source`` says which, None when neither could tell);
- **server** (when /metrics has vLLM's or pagedlearn's names, server_metrics.py): KV-cache
  usage before, at its peak (polled during the run) and after, the prefix-cache hit rate (prompt
  tokens hit / looked up) and the preemptions over the run, and the aborts;
- **checks** (loadtest_verdicts.Check): correctness -- every request answered in time, the
  over-long prompt refused (4xx) and nothing else, no error, no hit in the cold pass nor under
  the new version's salt, and on a pagedlearn server every block back and every cancelled
  stream aborted -- and coverage: the warm pass hit, a preemption happened, the whole mix.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from pagedlearn.engine.distribution import percentiles
from pagedlearn.loadtest.report import MIX_KINDS, QS, CheckedReport
from pagedlearn.loadtest.server_metrics import delta
from pagedlearn.loadtest.verdicts import CORRECTNESS, COVERAGE, Check, percent

JSON_KEYS = (
    "config",
    "wall_time",
    "ok",
    "complete",
    "checks",
    "counts",
    "throughput",
    "latency",
    "prefix_cache",
    "server",
    "phases",
    "samples",
    "requests",
)
OUTCOMES = ("stopped", "length", "cancelled", "rejected", "error", "timeout", "lost")
MAX_LISTED = 5  # requests named in a check's detail


@dataclass
class HTTPLoadTestReport(CheckedReport):
    """One run over HTTP: ``config`` (endpoint, model, the pool as /metrics said, the options),
    ``wall_time``, the numbers by topic (dicts, see the module docstring), ``checks``, the
    per-request ``requests`` and the /metrics ``samples``. ``summary()`` is what the command
    prints (each derived number beside its rule), ``as_dict()`` what ``--json`` writes (the
    keys: :data:`JSON_KEYS`)."""

    config: dict
    wall_time: float
    counts: dict
    throughput: dict
    latency: dict
    prefix_cache: dict
    server: dict
    phases: dict
    checks: list[Check]
    requests: list[dict] = field(repr=False)
    samples: dict = field(repr=False)

    JSON_KEYS = JSON_KEYS

    def summary(self) -> str:
        c, cnt, s, pc, t = self.config, self.counts, self.server, self.prefix_cache, self.throughput
        inf = c["rate"] == math.inf
        rate = "all at once" if inf else f"Poisson arrivals at {c['rate']:g}/s"
        pace = "all at once: the server's pace" if inf else f"paced by arrivals at {c['rate']:g}/s"
        pool = c["num_gpu_blocks"] or f"unknown (squeeze sized to {c['squeeze_pool']})"
        kinds = cnt["kinds"]
        lines = [
            f"pagedlearn load test over HTTP: {c['endpoint']}, model {c['model']}, "
            f"{c['num_requests']} requests (seed {c['seed']}), {rate}",
            f"  context {c['max_model_len']} tokens, blocks of {c['block_size']} tokens "
            f"({c['block_size_from']}), GPU pool {pool} blocks; /metrics: "
            f"{c['server_metrics'] or 'none readable'}; run id {c['run_id']} (salt prefix)",
            "phases: "
            + ", ".join(
                f"{k} {p['requests']}"
                + (f" of up to {c['squeeze_tokens']:,} tokens" if k == "squeeze" else "")
                + f" ({p['wall_time']:.2f} s)"
                for k, p in self.phases.items()
            ),
            f"requests: {cnt['sent']} sent: "
            + ", ".join(f"{k} {cnt[k]}" for k in OUTCOMES)
            + f"; parallel {kinds['parallel']} (n > 1 samples back)",
            f"throughput: {t['output_tokens']:,} output tokens / {self.wall_time:.2f} s wall = "
            f"{t['output_tokens_per_s']:,.0f} tokens/s; {t['answered']} answered (finished or "
            f"cancelled) / {self.wall_time:.2f} s = {t['requests_per_s']:.1f} requests/s "
            f"({pace})",
            f"latency (ms, client) {'p50':>8} {'p90':>8} {'p99':>8}   count",
        ]
        for name in ("ttft", "itl", "e2e"):
            d = self.latency[name]
            ms = " ".join(f"{1e3 * d[f'p{q}']:8.1f}" for q in QS)
            lines.append(f"  {name.upper():<18} {ms}   {d['count']}")
        by_phase = ", ".join(f"{k} {_num(p['hit_tokens'])}" for k, p in pc["phases"].items())
        source = pc["source"] or "n/a"
        lines.append(f"prefix cache: prompt tokens hit, by phase (from {source}): {by_phase}")
        if c["server_metrics"]:
            before, after = s["before"] or {}, s["after"] or {}
            lines.append(
                f"server (/metrics): KV usage {percent(before.get('kv_usage'))} before, peak "
                f"{percent(s['peak_kv_usage'])}, {percent(after.get('kv_usage'))} after; "
                f"prefix-cache hit rate {percent(s['hit_rate'])} ({_num(s['hit_tokens'])} hit / "
                f"{_num(s['query_tokens'])} prompt tokens looked up); preemptions "
                f"{_num(s['preemptions'])}; aborts {_num(s['aborts'])}"
            )
        lines.append("checks:")
        lines += [ch.line() for ch in self.checks]
        missed = sum(not ch.ok for ch in self.checks)
        verdict = (
            "SOME CHECKS FAILED"
            if not self.ok
            else "all checks passed"
            if self.complete
            else f"every correctness check passed; {missed} not exercised"
        )
        lines.append(f"{verdict}; wall time {self.wall_time:.2f} s")
        return "\n".join(lines)


def build_http_report(config, records, phases, server, samples, wall, run_error):
    """The report of a finished run (the arguments: what loadtest_http._Run kept)."""
    requests = list(records.values())
    outcomes = Counter(r["outcome"] for r in requests)
    kinds = Counter(k for r in requests for k in r["kinds"])
    kinds["parallel"] = sum(r["samples"] > 1 for r in requests)
    counts = {
        "sent": len(requests),
        **{k: outcomes[k] for k in OUTCOMES},
        "kinds": {k: kinds[k] for k in MIX_KINDS},
        "samples": dict(Counter(f for r in requests for f in r["finish_reasons"])),
    }
    tokens = sum(r["output_tokens"] for r in requests)
    answered = outcomes["stopped"] + outcomes["length"] + outcomes["cancelled"]
    wall = max(wall, 1e-9)
    throughput = {
        "output_tokens": tokens,
        "answered": answered,
        "output_tokens_per_s": tokens / wall,
        "requests_per_s": answered / wall,
    }
    latency = {
        "ttft": _dist(r["ttft"] for r in requests if r["ttft"] is not None),
        "itl": _dist(g for r in requests for g in r["itl"]),
        "e2e": _dist(r["e2e"] for r in requests if r["e2e"] is not None),
    }
    prefix_cache = _prefix_cache(requests, phases)
    before, after = server["before"], server["after"]
    hits, queries = delta(before, after, "prefix_hits"), delta(before, after, "prefix_queries")
    server = {
        **server,
        "hit_tokens": hits,
        "query_tokens": queries,
        "hit_rate": hits / queries if hits is not None and queries else math.nan,
        "preemptions": delta(before, after, "preemptions"),
        "aborts": delta(before, after, "aborts"),
    }
    report = HTTPLoadTestReport(config, wall, counts, throughput, latency, prefix_cache,
                                server, phases, [], requests, samples)  # fmt: skip
    report.checks = _checks(report, run_error)
    return report


def _prefix_cache(requests: list[dict], phases: dict) -> dict:
    """Prompt tokens hit per phase, from the responses' usage if every answered request of the
    phase said, else from the phase's /metrics delta (None: neither told)."""
    out = {}
    for phase, p in phases.items():
        answered = [
            r for r in requests if r["phase"] == phase and r["outcome"] in ("stopped", "length")
        ]
        said = [r["cached_tokens"] for r in answered]
        if answered and None not in said:
            hit, source, queried = sum(said), "usage", sum(r["prompt_tokens"] for r in answered)
        else:
            hit, source, queried = p.get("prefix_hits"), "metrics", p.get("prefix_queries")
            source = source if hit is not None else None
        rate = hit / queried if hit is not None and queried else math.nan
        out[phase] = {"hit_tokens": hit, "query_tokens": queried, "hit_rate": rate,
                      "source": source}  # fmt: skip
    passes = {out[k]["source"] for k in ("cold", "warm", "version") if k in out}
    source = passes.pop() if len(passes) == 1 else "/".join(sorted(map(str, passes))) or None
    return {"source": source, "phases": out}


def _checks(report: HTTPLoadTestReport, run_error: str | None) -> list[Check]:
    cnt, reqs, c, s = report.counts, report.requests, report.config, report.server
    by = {k: [r for r in reqs if r["outcome"] == k] for k in OUTCOMES}
    expected = {r["id"] for r in reqs if r["expect_reject"]}
    hit = {k: p["hit_tokens"] for k, p in report.prefix_cache["phases"].items()}
    told = hit.get("cold") is not None and hit.get("version") is not None
    untold = ("the server says neither usage.prompt_tokens_details.cached_tokens (vLLM: "
              "--enable-prompt-tokens-details) nor prefix-cache counters at /metrics")  # fmt: skip
    checks = [
        Check(
            "every request was answered in time",
            not by["timeout"] and not by["lost"] and not run_error,
            f"{cnt['sent']} sent: {cnt['stopped'] + cnt['length']} finished ({cnt['stopped']} "
            f"stopped early, {cnt['length']} ran to max_tokens), {cnt['cancelled']} cancelled "
            f"by the client, {cnt['rejected']} refused, {cnt['error']} errors, "
            f"{cnt['timeout']} timed out (> {c['timeout']:g} s), {cnt['lost']} lost"
            + _named(by["timeout"] + by["lost"]) + (f"; {run_error}" if run_error else ""),
        ),
        Check(
            "the over-long prompt was refused (4xx), and nothing else",
            {r["id"] for r in by["rejected"]} == expected,
            f"refused: {_named(by['rejected'], status=True)[2:] or 'none'}; meant: "
            f"{', '.join(sorted(expected))}",
        ),
        Check("no request failed", not by["error"],
              f"{cnt['error']} errors" + _named(by["error"], status=True)),
        Check(  # a coverage miss when the server does not tell: nothing to judge
            "nothing was hit in the cold pass or under the new version's salt",
            told and hit["cold"] == 0 and hit["version"] == 0,
            f"prompt tokens served from the cache: cold pass {_num(hit.get('cold'))}, new "
            f"version {_num(hit.get('version'))} (from {report.prefix_cache['source']})",
            CORRECTNESS if told else COVERAGE, "" if told else untold,
        ),
    ]  # fmt: skip
    if c["server_metrics"] == "pagedlearn":  # its /metrics counts held blocks
        after = s["after"] or {}
        used, cpu = after.get("used_blocks"), after.get("cpu_used_blocks")
        checks += [
            Check("every block came back", used == 0 and cpu in (0, None),
                  f"GPU blocks used {_num(used)}, swap pool used {_num(cpu)}, "
                  f"{s['settle_time']:.2f} s after the run"),
            Check("the server aborted every cancelled stream",
                  s["aborts"] is not None and s["aborts"] >= cnt["cancelled"],
                  f"{cnt['cancelled']} streams closed by the client, {_num(s['aborts'])} "
                  'requests aborted (/metrics request_success{finished_reason="abort"})'),
        ]  # fmt: skip
    missing = [k for k in ("stopped", "length", "cancelled") if not cnt[k]]
    missing += ["parallel"] * (not cnt["kinds"]["parallel"])
    pool = c["num_gpu_blocks"] or "?"
    checks += [
        Check("the warm pass hit the cache", bool(hit.get("warm")),
              f"{_num(hit.get('warm'))} prompt tokens served from the cache", COVERAGE,
              untold if hit.get("warm") is None else "prefix caching off on the server "
              "(vLLM: --enable-prefix-caching), or its pool too small to keep the pass's prompts"),
        Check("a preemption happened", bool(s["preemptions"]),
              f"{_num(s['preemptions'])} preemptions over the run (/metrics)", COVERAGE,
              "no preemption counter at /metrics" if s["preemptions"] is None else
              f"a pool of {pool} blocks never ran short: the squeeze sent {c['squeeze_requests']} "
              f"requests of up to {c['squeeze_tokens']:,} tokens at once, its count bounded by "
              "--num-requests / 10, their length by the context (--max-model-len caps it); "
              "serve with fewer blocks (pagedlearn: --num-blocks; vLLM: "
              "--num-gpu-blocks-override)"),
        Check("the whole mix happened", not missing,
              ("missing: " + ", ".join(missing) + "; " if missing else "")
              + f"stopped early {cnt['stopped']}, ran to max_tokens {cnt['length']}, cancelled "
              f"{cnt['cancelled']}, parallel {cnt['kinds']['parallel']}",
              COVERAGE, "try a larger --num-requests"),
    ]  # fmt: skip
    return checks


def _named(records: list[dict], status: bool = False) -> str:
    """ "; id (status: error), ..." for the first few records."""
    if not records:
        return ""
    shown = [r["id"] + (f" ({r['status']}: {r['error'][:160]})" if status else "")
             for r in records[:MAX_LISTED]]  # fmt: skip
    more = f" and {len(records) - MAX_LISTED} more" if len(records) > MAX_LISTED else ""
    return "; " + ", ".join(shown) + more


def _num(x) -> str:
    return "n/a" if x is None else f"{x:,.0f}"


def _dist(values) -> dict:
    xs = list(values)
    return {**{f"p{q}": v for q, v in percentiles(xs, QS).items()}, "count": len(xs)}
