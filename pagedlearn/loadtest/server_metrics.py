"""Reading a server's ``GET /metrics``: vLLM's and pagedlearn's Prometheus names, one dict.

A vLLM server exports its engine's counters under the prefix ``vllm:``; pagedlearn's server
exports the same ones under ``pagedlearn_`` (engine/prometheus.py lists the pairs). The HTTP
load test (loadtest/http.py) reads the page before and after each phase, and a few times a
second during the run, and needs the same few numbers from either server:

=================  ==========================================  ================================
field              name after the prefix (both servers)        what it is
=================  ==========================================  ================================
kv_usage           ``kv_cache_usage_perc``                     GPU KV-cache usage, 0..1 (now)
prefix_queries     ``prefix_cache_queries_total``              prompt tokens looked up (total)
prefix_hits        ``prefix_cache_hits_total``                 of those, served from the cache
preemptions        ``num_preemptions_total``                   preemptions (pagedlearn: every
                                                               ``mode`` summed)
running, waiting   ``num_requests_running`` / ``_waiting``     the scheduler's queues (now)
aborts             ``request_success_total``                   requests that ended as "abort"
                   ``{finished_reason="abort"}``
block_size,        ``cache_config_info``'s labels              the pool's shape (an "info"
num_gpu_blocks,                                                gauge: always 1, the numbers
num_cpu_blocks                                                 are in its labels)
used_blocks,       pagedlearn only: ``kv_cache_blocks``        blocks held by sequences; 0 once
cpu_used_blocks    ``{pool="gpu"|"cpu",state="used"}``         the server is idle
=================  ==========================================  ================================

vLLM versions before 0.10 called two of them ``vllm:gpu_cache_usage_perc`` and
``vllm:gpu_prefix_cache_queries`` / ``_hits``: they are read too. A field the page does not have
is None (an SGLang server, say, exports ``sglang:*`` names: every field is None). Several
engines behind one server (vLLM's data parallelism: an ``engine`` label) are summed, the usage
is their maximum. The text is parsed by ``prometheus_client``'s own parser, never by hand.

>>> page = '''
... vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
... vllm:num_preemptions_total{engine="0",model_name="m"} 3.0
... vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1.0
... '''
>>> m = parse_metrics(page)
>>> m["source"], m["kv_usage"], m["preemptions"], m["block_size"], m["num_gpu_blocks"]
('vllm', 0.5, 3.0, 16, 100)
>>> m["prefix_hits"] is None  # not on this page
True
"""

from __future__ import annotations

import math

PREFIXES = {"vllm": "vllm:", "pagedlearn": "pagedlearn_"}
# field -> (names after the prefix, the labels a sample must have, how samples combine)
COUNTERS = {
    "kv_usage": (("kv_cache_usage_perc", "gpu_cache_usage_perc"), {}, max),
    "prefix_queries": (("prefix_cache_queries_total", "gpu_prefix_cache_queries_total"), {}, sum),
    "prefix_hits": (("prefix_cache_hits_total", "gpu_prefix_cache_hits_total"), {}, sum),
    "preemptions": (("num_preemptions_total",), {}, sum),
    "running": (("num_requests_running",), {}, sum),
    "waiting": (("num_requests_waiting",), {}, sum),
    "aborts": (("request_success_total",), {"finished_reason": "abort"}, sum),
    "used_blocks": (("kv_cache_blocks",), {"pool": "gpu", "state": "used"}, sum),
    "cpu_used_blocks": (("kv_cache_blocks",), {"pool": "cpu", "state": "used"}, sum),
}
INFO = ("block_size", "num_gpu_blocks", "num_cpu_blocks")  # labels of cache_config_info
FIELDS = ("source", *COUNTERS, *INFO)
METRICS_PATH = "/metrics"


class MetricsPageError(ValueError):
    """The page is not Prometheus' text format."""


def parse_metrics(text: str) -> dict:
    """The fields of the module docstring's table from a ``/metrics`` page (None where the page
    has none); ``source``: "vllm", "pagedlearn", or None for a page with neither prefix.
    Raises :class:`MetricsPageError` when ``prometheus_client`` cannot parse the text."""
    from prometheus_client.parser import text_string_to_metric_families

    samples = []  # (name, labels, value)
    try:
        for family in text_string_to_metric_families(text):
            samples += [(s.name, s.labels, s.value) for s in family.samples]
    except ValueError as e:  # the parser's own word for a malformed line
        raise MetricsPageError(f"not Prometheus' text format: {e}") from None
    names = {name for name, _, _ in samples}
    source = next((k for k, p in PREFIXES.items() if any(n.startswith(p) for n in names)), None)
    out: dict = dict.fromkeys(FIELDS)
    out["source"] = source
    if source is None:
        return out
    prefix = PREFIXES[source]
    for field, (bases, want, combine) in COUNTERS.items():
        for base in bases:  # the current name first, then an older one
            values = [
                v
                for name, labels, v in samples
                if name == prefix + base and all(labels.get(k) == x for k, x in want.items())
            ]
            if values:
                out[field] = combine(values)
                break
        if out[field] is None and field == "aborts":
            out[field] = 0.0  # both servers label request_success by reason: none aborted yet
    for name, labels, _ in samples:
        if name == prefix + "cache_config_info":
            for key in INFO:
                out[key] = _int_or_none(labels.get(key))
            break
    return out


def delta(before: dict | None, after: dict | None, field: str) -> float | None:
    """``after[field] - before[field]`` for a running total; None when either page lacks it.

    >>> delta({"prefix_hits": 10.0}, {"prefix_hits": 42.0}, "prefix_hits")
    32.0
    """
    if before is None or after is None or before.get(field) is None or after.get(field) is None:
        return None
    return after[field] - before[field]


async def scrape(client) -> dict | None:
    """GET ``/metrics`` with ``client`` (an ``httpx.AsyncClient`` with the server's base URL)
    and parse it; None when the server has no such page, answers with an error, cannot be
    reached, or the page does not parse (the load test then runs without the server's view)."""
    import httpx

    try:
        response = await client.get(METRICS_PATH)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    try:
        return parse_metrics(response.text)
    except MetricsPageError:
        return None


def _int_or_none(text: str | None) -> int | None:
    """A label's number (vLLM writes "None" for a size it has not set)."""
    try:
        x = float(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    return int(x) if math.isfinite(x) and x == int(x) else None
