"""The Prometheus export (engine/prometheus.py): parses as the text format, vLLM's names under
``pagedlearn_``, numbers that agree with engine.stats() and engine.metrics, a clear error
without prometheus_client."""

from __future__ import annotations

import sys

import pytest
from engine_cases import PROMPTS, greedy, make_llm

from pagedlearn.engine.prometheus import (
    EngineCollector,
    MetricsUnavailableError,
    metrics_registry,
    prometheus_text,
)
from pagedlearn.errors import PagedLearnError

parser = pytest.importorskip("prometheus_client.parser")

VLLM_NAMES = [  # vllm:<name> exists; pagedlearn_<name> must too (counters without _total)
    "num_requests_running",
    "num_requests_waiting",
    "num_requests_swapped",
    "kv_cache_usage_perc",
    "cpu_cache_usage_perc",
    "cache_config_info",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "num_preemptions",
    "request_success",
    "prompt_tokens",
    "generation_tokens",
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prompt_tokens",
    "request_generation_tokens",
    "iteration_tokens_total",
]


def families(engine) -> dict:
    return {f.name: f for f in parser.text_string_to_metric_families(prometheus_text(engine))}


def value(fams: dict, name: str, sample: str = "", **labels) -> float:
    """The one sample of family ``name`` with these labels: its value (a counter: ``_total``),
    or its ``sample`` (a histogram's ``"_count"``, ``"_sum"``)."""
    fam = fams["pagedlearn_" + name]
    wanted = "pagedlearn_" + name + (sample or ("_total" if fam.type == "counter" else ""))
    hits = [s.value for s in fam.samples if s.name == wanted and labels.items() <= s.labels.items()]
    assert len(hits) == 1, (name, labels, hits)
    return hits[0]


@pytest.fixture(scope="module")
def served():
    """Recompute preemptions on a small pool, one aborted request, residency tracked."""
    llm = make_llm(num_blocks=20)
    engine = llm.engine
    engine.metrics.track_cache_residency()
    for i, p in enumerate(PROMPTS + PROMPTS):
        engine.add_request(f"r{i}", p, greedy(20))
    engine.add_request("gone", PROMPTS[1], greedy(50))
    engine.finished = []  # the final outputs, for the tests
    while engine.has_unfinished_requests():
        engine.finished += [o for o in engine.step() if o.finished]
        if engine.num_steps == 3:
            engine.finished.append(engine.abort_request("gone"))
    return engine


def test_the_page_parses_with_vllms_names_under_our_prefix(served):
    fams = families(served)
    assert all(name.startswith("pagedlearn_") for name in fams)
    missing = [n for n in VLLM_NAMES if "pagedlearn_" + n not in fams]
    assert not missing
    for name in ("kv_block_lifetime_seconds", "kv_block_reuse_gap_seconds"):
        assert "pagedlearn_" + name in fams  # tracked here
    assert {s.labels["model_name"] for f in fams.values() for s in f.samples} == {"tiny-gpt2"}


def test_counters_and_gauges_agree_with_engine_stats(served):
    fams, s = families(served), served.stats()
    assert value(fams, "prefix_cache_queries") == s.prefix_query_tokens > 0
    # New prompts' hits only, as vLLM counts them: what the requests' outputs report.
    hits = sum(o.num_cached_tokens for o in served.finished)
    assert value(fams, "prefix_cache_hits") == s.prefix_hit_tokens == hits
    assert value(fams, "num_preemptions", mode="recompute") == s.preemptions_recompute > 0
    assert value(fams, "num_preemptions", mode="swap") == s.preemptions_swap == 0
    assert value(fams, "kv_cache_evictions") == s.evictions
    assert value(fams, "recomputed_tokens") == s.recomputed_tokens > 0
    assert value(fams, "preemption_seconds", mode="recompute") == pytest.approx(s.recompute_time)
    assert value(fams, "allocation_failures") == s.allocation_failures
    assert value(fams, "kv_cache_min_free_blocks") == s.min_free_blocks
    assert value(fams, "kv_cache_token_capacity") == 20 * 4
    assert value(fams, "kv_cache_blocks", pool="gpu", state="cached") == s.cached_blocks
    assert value(fams, "kv_cache_blocks", pool="gpu", state="free") == s.free_blocks == 20
    assert value(fams, "kv_cache_num_blocks", pool="cpu") == 0
    assert value(fams, "prefix_cache_hit_rate_recent") == pytest.approx(
        s.prefix_hit_rate_recent / 100
    )
    assert value(fams, "cache_config_info", block_size="4", num_gpu_blocks="20") == 1


def test_per_request_numbers_agree_with_engine_metrics(served):
    fams, m = families(served), served.metrics
    assert value(fams, "request_success", finished_reason="length") == 8
    assert value(fams, "request_success", finished_reason="abort") == 1
    assert value(fams, "prompt_tokens") == 2 * sum(map(len, PROMPTS)) + len(PROMPTS[1])
    assert value(fams, "generation_tokens") == m.generation_tokens.sum
    ttft = fams["pagedlearn_time_to_first_token_seconds"]
    buckets = [s for s in ttft.samples if s.name.endswith("_bucket")]
    counts = [s.value for s in buckets]
    assert counts == sorted(counts) and buckets[-1].labels["le"] == "+Inf"
    ttfts = [o.metrics.ttft for o in served.finished if o.metrics.ttft is not None]
    assert counts[-1] == value(fams, "time_to_first_token_seconds", "_count") == len(ttfts)
    assert len(ttfts) >= 8 and len(served.finished) == 9
    assert value(fams, "time_to_first_token_seconds", "_sum") == pytest.approx(sum(ttfts))
    assert value(fams, "inter_token_latency_seconds", "_count") == m.itl.count
    assert value(fams, "running_seqs_per_step", "_count") == served.num_steps


def test_gauges_read_the_engine_now_not_the_last_step():
    engine = make_llm().engine
    engine.add_request("a", PROMPTS[0], greedy(3))  # no step yet
    fams = families(engine)
    assert value(fams, "num_requests_waiting") == 1
    assert "pagedlearn_kv_block_lifetime_seconds" not in fams  # residency is opt-in
    assert not fams["pagedlearn_request_success"].samples  # no request has finished


def test_each_engine_has_its_own_registry():
    import prometheus_client

    a, b = make_llm().engine, make_llm(num_blocks=32).engine
    ra, rb = metrics_registry(a), metrics_registry(b, model_name="other")
    gpu = {"model_name": "tiny-gpt2", "pool": "gpu"}
    assert ra.get_sample_value("pagedlearn_kv_cache_num_blocks", gpu) == 64
    assert rb.get_sample_value("pagedlearn_kv_cache_num_blocks", {**gpu, "model_name": "other"})
    assert metrics_registry(a) is not ra  # a fresh one each time: nothing global to collide
    assert (
        prometheus_client.REGISTRY.get_sample_value("pagedlearn_kv_cache_num_blocks", gpu) is None
    )


def test_the_model_name_label_is_the_name_without_its_version():
    engine = make_llm().engine
    engine.model_version = "v2"  # the block hashes change; the served model's name does not
    gpu = {"model_name": "tiny-gpt2", "pool": "gpu"}
    assert metrics_registry(engine).get_sample_value("pagedlearn_kv_cache_num_blocks", gpu) == 64


def test_an_llm_works_too_and_anything_else_is_refused():
    llm = make_llm()
    assert "pagedlearn_num_requests_running" in prometheus_text(llm)
    with pytest.raises(PagedLearnError, match="LLMEngine"):
        EngineCollector(object())


def test_without_prometheus_client_a_clear_error(monkeypatch):
    engine = make_llm().engine
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import raises ImportError
    monkeypatch.setitem(sys.modules, "prometheus_client.core", None)
    with pytest.raises(MetricsUnavailableError, match=r'pip install "pagedlearn\[metrics\]"') as e:
        prometheus_text(engine)
    assert isinstance(e.value, PagedLearnError) and isinstance(e.value, ImportError)
