"""The operator's metrics in Prometheus' text format, written by the official ``prometheus_client``.

A vLLM server answers ``GET /metrics`` with its ``vllm:*`` metrics; this module gives an engine
the same page, with the same names under the prefix ``pagedlearn_``, so that one dashboard (or
one PromQL query) can read both and compare::

    from pagedlearn.engine.prometheus import prometheus_text, metrics_registry
    print(prometheus_text(llm.engine))        # the page a scrape would get
    registry = metrics_registry(llm.engine)   # to mount: prometheus_client.make_wsgi_app(registry)

Nothing is counted twice: a custom collector (:class:`EngineCollector`) reads
``engine.stats()`` and ``engine.metrics`` at scrape time and turns them into metric families.
Call it from the thread that steps the engine (or hold the engine's lock): it reads live state.
``prometheus_client`` is imported only here, when a page is asked for; without it a clear error
says ``pip install "pagedlearn[metrics]"``.

Counters get ``_total`` appended in the text (Prometheus' rule; vLLM's do too). Every metric has
a ``model_name`` label, as vLLM's do (vLLM's ``engine`` label is left out: one engine here).
Gauges and the pool's counters come from ``engine.stats()`` (a StepStats); the per-request
counters and every histogram from ``engine.metrics`` (metrics.py, vLLM's bucket bounds).
"none": vLLM exports no such metric.

>>> from pagedlearn import LLM
>>> engine = LLM("tiny-gpt2", num_blocks=8, verbose=False).engine
>>> [line for line in prometheus_text(engine).splitlines() if "kv_cache_usage_perc{" in line]
['pagedlearn_kv_cache_usage_perc{model_name="tiny-gpt2"} 0.0']

Gauges (now)
=================================================  ============================================
pagedlearn name                                    vLLM name
=================================================  ============================================
``pagedlearn_num_requests_running``                ``vllm:num_requests_running``
``pagedlearn_num_requests_waiting``                ``vllm:num_requests_waiting``
``pagedlearn_num_requests_swapped``                ``vllm:num_requests_swapped`` (V0)
``pagedlearn_kv_cache_usage_perc`` (0..1)          ``vllm:kv_cache_usage_perc``
``pagedlearn_cpu_cache_usage_perc`` (0..1)         ``vllm:cpu_cache_usage_perc`` (V0)
``pagedlearn_cache_config_info`` (labels; 1)       ``vllm:cache_config_info``
``pagedlearn_num_running_seqs``                    none (samples and beams of running requests)
``pagedlearn_kv_cache_num_blocks{pool}``           none (vLLM's cache_config_info has them)
``pagedlearn_kv_cache_blocks{pool,state}``         none: used / free / cached blocks
``pagedlearn_kv_cache_token_capacity``             none (vLLM logs it when it starts)
``pagedlearn_kv_cache_min_free_blocks``            none
``pagedlearn_kv_cache_blocks_per_request``         none
``pagedlearn_kv_cache_group_blocks{group}``        none (only models with KV-cache groups)
``pagedlearn_prefix_cache_hit_rate_recent``        none (vLLM's log line prints it)
=================================================  ============================================

Counters (running totals)
=================================================  ============================================
pagedlearn name                                    vLLM name
=================================================  ============================================
``pagedlearn_prefix_cache_queries`` (tokens)       ``vllm:prefix_cache_queries``
``pagedlearn_prefix_cache_hits`` (tokens)          ``vllm:prefix_cache_hits``
``pagedlearn_num_preemptions{mode}``               ``vllm:num_preemptions`` (no mode label)
``pagedlearn_request_success{finished_reason}``    ``vllm:request_success``
``pagedlearn_prompt_tokens`` [1]                   ``vllm:prompt_tokens``
``pagedlearn_generation_tokens`` [1]               ``vllm:generation_tokens``
``pagedlearn_kv_cache_evictions``                  none
``pagedlearn_swapped_blocks{direction}``           none
``pagedlearn_recomputed_tokens``                   none
``pagedlearn_preemption_seconds{mode}``            none (swap: measured; recompute: estimated)
``pagedlearn_cow_copies``                          none
``pagedlearn_allocation_failures``                 none
``pagedlearn_window_freed_blocks``                 none (sliding-window KV-cache groups)
=================================================  ============================================

Histograms (over the engine's life)
=================================================  ============================================
pagedlearn name                                    vLLM name
=================================================  ============================================
``pagedlearn_time_to_first_token_seconds``         ``vllm:time_to_first_token_seconds``
``pagedlearn_inter_token_latency_seconds``         ``vllm:inter_token_latency_seconds``
``pagedlearn_e2e_request_latency_seconds``         ``vllm:e2e_request_latency_seconds``
``pagedlearn_request_queue_time_seconds``          ``vllm:request_queue_time_seconds``
``pagedlearn_request_prompt_tokens``               ``vllm:request_prompt_tokens``
``pagedlearn_request_generation_tokens``           ``vllm:request_generation_tokens``
``pagedlearn_iteration_tokens_total``              ``vllm:iteration_tokens_total``
``pagedlearn_kv_block_lifetime_seconds`` [2]       ``vllm:kv_block_lifetime_seconds``
``pagedlearn_kv_block_idle_before_evict_seconds``  ``vllm:kv_block_idle_before_evict_seconds``
``pagedlearn_kv_block_reuse_gap_seconds`` [2]      ``vllm:kv_block_reuse_gap_seconds``
``pagedlearn_running_seqs_per_step``               none (concurrency: sequences per step)
=================================================  ============================================

[1] counted when a request finishes (vLLM counts them as they are computed): the same totals
once the requests are done. [2] the three ``kv_block_*`` histograms appear once
``engine.metrics.track_cache_residency()`` is on (vLLM's: with ``--kv-cache-metrics``);
pagedlearn times a block from its caching, vLLM from its allocation.
"""

from __future__ import annotations

import importlib

from pagedlearn.errors import PagedLearnError

PREFIX = "pagedlearn_"


class MetricsUnavailableError(PagedLearnError, ImportError):
    """``prometheus_client`` is not installed (only the export needs it)."""


def prometheus_text(engine, model_name: str | None = None) -> str:
    """The engine's metrics as a Prometheus scrape would get them (text format 0.0.4).
    ``engine``: an ``LLMEngine`` (or an ``LLM``); ``model_name``: the ``model_name`` label
    (default: the model's name in the engine's block hashes)."""
    client = _client()
    return client.generate_latest(metrics_registry(engine, model_name)).decode("utf-8")


def metrics_registry(engine, model_name: str | None = None):
    """A ``prometheus_client.CollectorRegistry`` of its own holding an :class:`EngineCollector`
    for ``engine``: what a server mounts (``make_wsgi_app(registry)``). Nothing is registered in
    prometheus_client's global registry, so several engines in one process do not collide."""
    client = _client()
    registry = client.CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine, model_name))
    return registry


class EngineCollector:
    """A prometheus_client custom collector: ``collect()`` yields the engine's metric families,
    read at scrape time (see the module docstring for the list)."""

    def __init__(self, engine, model_name: str | None = None) -> None:
        engine = getattr(engine, "engine", engine)  # an LLM: its engine
        if not (hasattr(engine, "stats") and hasattr(engine, "metrics")):
            raise PagedLearnError(
                f"metrics come from an LLMEngine (or an LLM), got {type(engine).__name__}"
            )
        self.engine = engine
        name = getattr(engine, "model_name", None) if model_name is None else model_name
        self.model_name = "" if name is None else str(name)

    def collect(self):
        core = _client().core
        s, m, model = self.engine.stats(), self.engine.metrics, self.model_name

        def family(kind, name, doc, value, **labels):
            fam = kind(PREFIX + name, doc, labels=["model_name", *labels])
            if labels:  # one sample per position: each label and ``value`` are lists
                for *values, v in zip(*labels.values(), value, strict=True):
                    fam.add_metric([model, *values], v)
            else:
                fam.add_metric([model], value)
            return fam

        def gauge(name, doc, value, **labels):
            return family(core.GaugeMetricFamily, name, doc, value, **labels)

        def counter(name, doc, value, **labels):
            return family(core.CounterMetricFamily, name, doc, value, **labels)

        def histogram(name, doc, dist):
            fam = core.HistogramMetricFamily(PREFIX + name, doc, labels=["model_name"])
            fam.add_metric([model], dist.cumulative(), dist.sum)
            return fam

        # --- the queues and the pool, now (StepStats) --------------------------------------------
        yield gauge(
            "num_requests_running", "Requests running (in the step's batch).", s.num_running
        )
        yield gauge("num_requests_waiting", "Requests waiting to be admitted.", s.num_waiting)
        yield gauge("num_requests_swapped", "Requests swapped out to the CPU pool.", s.num_swapped)
        yield gauge("num_running_seqs", "Sequences running (n samples, beams).", s.num_running_seqs)
        yield gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent.", s.kv_cache_usage)
        cpu_usage = s.cpu_used_blocks / s.num_cpu_blocks if s.num_cpu_blocks else 0.0
        yield gauge("cpu_cache_usage_perc", "CPU swap pool usage. 1 means 100 percent.", cpu_usage)
        info = core.GaugeMetricFamily(
            PREFIX + "cache_config_info",
            "The KV cache's configuration (labels); always 1.",
            labels=["model_name", "block_size", "num_gpu_blocks", "num_cpu_blocks",
                    "enable_prefix_caching"],
        )  # fmt: skip
        caching = str(getattr(self.engine.kv, "prefix_cache", None) is not None)
        shape = (s.block_size, s.num_blocks, s.num_cpu_blocks)
        info.add_metric([model, *map(str, shape), caching], 1)
        yield info
        yield gauge(
            "kv_cache_num_blocks", "Blocks in each pool.",
            [s.num_blocks, s.num_cpu_blocks], pool=["gpu", "cpu"],
        )  # fmt: skip
        yield gauge(
            "kv_cache_blocks",
            "Blocks by state: used (held by a sequence), free (cached ones included), cached.",
            [s.used_blocks, s.free_blocks, s.cached_blocks, s.cpu_used_blocks, s.cpu_free_blocks],
            pool=["gpu", "gpu", "gpu", "cpu", "cpu"],
            state=["used", "free", "cached", "used", "free"],
        )
        yield gauge(
            "kv_cache_token_capacity",
            "Tokens the pool holds: blocks x block size / KV-cache groups.",
            s.token_capacity,
        )
        yield gauge(
            "kv_cache_min_free_blocks", "Fewest free GPU blocks at the end of a step, so far.",
            s.min_free_blocks,
        )  # fmt: skip
        yield gauge(
            "kv_cache_blocks_per_request", "GPU blocks held per running request.",
            s.blocks_per_request,
        )  # fmt: skip
        if s.group_blocks:
            groups = list(s.group_blocks)
            yield gauge(
                "kv_cache_group_blocks", "GPU blocks held per KV-cache group.",
                [s.group_blocks[g] for g in groups], group=groups,
            )  # fmt: skip
        yield gauge(
            "prefix_cache_hit_rate_recent",
            "Prefix-cache hit rate (hit / queried tokens) over the last 1,000 steps that queried.",
            s.prefix_hit_rate_recent / 100,
        )
        # --- running totals (StepStats) ---------------------------------------------------------
        yield counter(
            "prefix_cache_queries", "Prefix-cache queries, in tokens.", s.prefix_query_tokens
        )
        yield counter("prefix_cache_hits", "Prefix-cache hits, in tokens.", s.prefix_hit_tokens)
        yield counter(
            "num_preemptions", "Preemptions, by mode.",
            [s.preemptions_recompute, s.preemptions_swap], mode=["recompute", "swap"],
        )  # fmt: skip
        yield counter("kv_cache_evictions", "Cached blocks evicted for new data.", s.evictions)
        yield counter(
            "swapped_blocks", "Blocks copied between the GPU and the CPU pool.",
            [s.swap_out_blocks, s.swap_in_blocks], direction=["out", "in"],
        )  # fmt: skip
        yield counter(
            "recomputed_tokens",
            "Tokens computed again after a recompute preemption dropped their K/V.",
            s.recomputed_tokens,
        )  # fmt: skip
        yield counter(
            "preemption_seconds", "Time preemptions cost: swap copies (measured), recompute "
            "(estimated: recomputed tokens x prefill seconds per token).",
            [s.recompute_time, s.swap_time], mode=["recompute", "swap"],
        )  # fmt: skip
        yield counter("cow_copies", "Copy-on-write block copies.", s.cow_copies)
        yield counter("allocation_failures", "Block allocations refused.", s.allocation_failures)
        yield counter(
            "window_freed_blocks", "Blocks sliding windows handed back.", s.window_freed_blocks
        )
        # --- per request and per step, over the engine's life (engine.metrics) -------------------
        reasons = sorted(m.finished_by_reason)
        yield counter(
            "request_success", "Finished requests, by finish reason.",
            [m.finished_by_reason[r] for r in reasons], finished_reason=reasons,
        )  # fmt: skip
        yield counter("prompt_tokens", "Prompt tokens of finished requests.", m.prompt_tokens.sum)
        yield counter(
            "generation_tokens", "Tokens generated by finished requests.", m.generation_tokens.sum
        )
        yield histogram("time_to_first_token_seconds", "Time to first token.", m.ttft)
        yield histogram("inter_token_latency_seconds", "Inter-token latency.", m.itl)
        yield histogram("e2e_request_latency_seconds", "End-to-end request latency.", m.e2e)
        yield histogram("request_queue_time_seconds", "Time waiting to be scheduled.", m.queue_time)
        yield histogram("request_prompt_tokens", "Prompt tokens per request.", m.prompt_tokens)
        yield histogram(
            "request_generation_tokens", "Generated tokens per request.", m.generation_tokens
        )
        yield histogram("iteration_tokens_total", "Tokens per engine step.", m.iteration_tokens)
        yield histogram("running_seqs_per_step", "Sequences running per step.", m.running_seqs)
        if m.tracking_cache_residency or m.block_lifetime.count:
            yield histogram(
                "kv_block_lifetime_seconds", "Cached block: from its caching to its eviction.",
                m.block_lifetime,
            )  # fmt: skip
            yield histogram(
                "kv_block_idle_before_evict_seconds",
                "Cached block: from its last use to its eviction.",
                m.block_idle_before_evict,
            )
            yield histogram(
                "kv_block_reuse_gap_seconds", "Cached block: time between uses.",
                m.block_reuse_gap,
            )  # fmt: skip


def _client():
    """``prometheus_client`` (its ``core`` loaded too), imported on first use."""
    try:
        importlib.import_module("prometheus_client.core")  # sets prometheus_client.core
        return importlib.import_module("prometheus_client")
    except ImportError as e:
        raise MetricsUnavailableError(
            'the Prometheus export needs prometheus_client: pip install "pagedlearn[metrics]"'
        ) from e
