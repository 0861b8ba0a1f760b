"""The operator's numbers: StepStats' new fields, engine.metrics' distributions and windows, the
opt-in cache-residency times, and bounded memory over a long life (engine/metrics.py, stats.py)."""

from __future__ import annotations

import json
import math
from itertools import pairwise
from types import SimpleNamespace

import pytest
from engine_cases import PROMPTS, greedy, make_llm

from pagedlearn import SamplingParams
from pagedlearn.engine import metrics as metrics_module
from pagedlearn.engine.distribution import Distribution, one_two_five, percentiles
from pagedlearn.engine.metrics import EngineMetrics
from pagedlearn.engine.request import Request, RequestMetrics, Sequence
from pagedlearn.errors import PagedLearnError
from pagedlearn.trace.events import EventLog
from pagedlearn.viz.panels import stats_html
from pagedlearn.viz.state import pool_state


def run(mode: str, residency: bool = False, **kw):
    """PROMPTS twice on a 20-block pool (preempts), every StepStats and output kept."""
    llm = make_llm(num_blocks=20, preemption_mode=mode, **kw)
    engine, steps = llm.engine, []
    if residency:
        engine.metrics.track_cache_residency()
    log = engine.record()
    engine.subscribe_stats(steps.append)
    outs = llm.generate(PROMPTS + PROMPTS, greedy(20), use_tqdm=False)
    return SimpleNamespace(llm=llm, engine=engine, steps=steps, outs=outs, log=log)


@pytest.fixture(scope="module")
def recompute():
    return run("recompute", residency=True)


@pytest.fixture(scope="module")
def swap():
    return run("swap")


# --- StepStats ------------------------------------------------------------------------------------
def test_min_free_blocks_is_the_fewest_free_at_the_end_of_any_step(recompute):
    steps = recompute.steps
    for i, s in enumerate(steps):
        assert s.min_free_blocks == min(t.free_blocks for t in steps[: i + 1])
    assert recompute.engine.stats().min_free_blocks == steps[-1].min_free_blocks


def test_pool_shape_usage_and_capacity(recompute, swap):
    s = swap.steps[len(swap.steps) // 2]
    assert s.token_capacity == 20 * 4 and s.block_size == 4
    assert s.num_cpu_blocks == 20 and s.cpu_free_blocks == 20 - s.cpu_used_blocks
    assert recompute.steps[-1].num_cpu_blocks == 0
    for st in recompute.steps:
        assert st.kv_cache_usage == pytest.approx(st.usage / 100)
        want = st.used_blocks / st.num_running if st.num_running else 0.0
        assert st.blocks_per_request == pytest.approx(want)


def test_recompute_preemptions_count_their_tokens_and_an_estimated_time(recompute):
    last, sched = recompute.steps[-1], recompute.engine.scheduler
    assert last.preemptions_recompute > 0 and last.preemptions_swap == 0
    assert last.recomputed_tokens == sched.num_recomputed_tokens > 0
    assert last.swap_time == 0.0
    # the docstring's formula, step by step: new tokens x prefill seconds per token so far
    want, seconds, tokens, before = 0.0, 0.0, 0, 0
    for s in recompute.steps:
        if s.num_prefill_seqs:
            seconds, tokens = seconds + s.forward_time, tokens + s.num_batched_tokens
        want += (s.recomputed_tokens - before) * seconds / tokens
        before = s.recomputed_tokens
        assert s.recompute_time == pytest.approx(want)
    assert last.preemption_time == last.recompute_time > 0


def test_swap_time_is_measured_in_the_swap_copies(monkeypatch):
    """A fake clock in kv_cache.py that moves one second per reading: each copy costs 1 s."""
    import pagedlearn.attention.kv_cache as kv_cache_module

    clock = iter(range(10**6))
    monkeypatch.setattr(kv_cache_module, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    r = run("swap")
    copies = r.engine.kv_cache.copy_seconds
    swaps_out = sum(1 for e in r.log.events if e.kind == "swap_out")
    last = r.steps[-1]
    assert last.preemptions_swap > 0 and last.swap_out_blocks > 0
    # one copy per step that swaps (several sequences' blocks in one gather), each 1 "second"
    assert 0 < copies["swap_out"] <= swaps_out and copies["swap_in"] > 0
    assert last.swap_time == copies["swap_out"] + copies["swap_in"]
    assert last.preemption_time == last.swap_time + last.recompute_time


def test_recent_prefix_hit_rate_is_over_the_last_steps_that_queried(monkeypatch):
    monkeypatch.setattr(metrics_module, "RECENT_STEPS", 3)
    m, queries, hits = EngineMetrics(), 0, 0
    history = []
    for i, (dq, dh) in enumerate([(10, 0), (0, 0), (8, 4), (6, 6), (0, 0), (4, 0), (12, 3)]):
        queries, hits = queries + dq, hits + dh
        if dq:
            history.append((dq, dh))
        kv = {"free_blocks": 5, "prefix_query_tokens": queries, "prefix_hit_tokens": hits}
        view = m.as_of(kv, 0, {})
        window = history[-3:]
        assert view["recent_query_tokens"] == sum(q for q, _ in window), i
        assert view["recent_hit_tokens"] == sum(h for _, h in window), i
        m.observe_step(fake_step(queries, hits, **view))
        assert m.as_of(kv, 0, {}) == view  # nothing new since: the same window


def test_recent_prefix_hit_rate_equals_the_cumulative_one_early_on(recompute):
    last = recompute.steps[-1]
    assert last.prefix_query_tokens > 0  # hits: new prompts' only, what the outputs report
    assert last.prefix_hit_tokens == sum(o.num_cached_tokens for o in recompute.outs)
    assert last.recent_query_tokens == last.prefix_query_tokens
    assert last.prefix_hit_rate_recent == pytest.approx(last.prefix_hit_rate)


def test_ttft_percentiles_are_the_finished_requests(recompute):
    ttfts = [o.metrics.ttft for o in recompute.outs]
    p = percentiles(ttfts, (50, 99))
    last = recompute.engine.stats()
    assert (last.ttft_p50, last.ttft_p99) == (p[50], p[99])
    # Recorded in the step that gives a request its first token, not when it finishes.
    assert recompute.steps[0].ttft_p50 is not None  # the first prefill gave tokens
    fresh = make_llm().engine.stats()  # no token yet: no percentile, and not in the frame
    assert fresh.ttft_p50 is None and "ttft_p50" not in fresh.as_dict()


def test_stats_go_into_a_trace_file_that_loads_back(recompute):
    """Every number of as_dict is JSON and finite: the frames of a recording stay loadable."""
    d = recompute.engine.stats().as_dict()
    for key in ("kv_cache_usage", "min_free_blocks", "prefix_hit_rate_recent", "ttft_p99"):
        assert key in d
    assert all(isinstance(v, (int, float, dict)) for v in d.values())
    log = EventLog.from_json(recompute.log.to_json())
    assert log.events[-1].info["stats"]["min_free_blocks"] == recompute.steps[-1].min_free_blocks
    json.dumps(d)


def test_summary_names_the_new_numbers(recompute, swap):
    text = recompute.engine.stats().summary()
    for words in ("fewest free", "capacity", "recent", "tokens recomputed", "fewest free"):
        assert words in text
    assert "finished 8, failed 0" in text and "CPU swap pool" not in text
    assert " ms" not in text  # the counts only: the same on every machine (chapters print it)
    times = recompute.engine.stats().timing_summary()
    assert "preemption time" in times and "time to first token: p50" in times
    assert "CPU swap pool: used 0/20" in swap.engine.stats().summary()


def test_the_stats_line_shows_usage_recent_hits_and_ttft(recompute):
    line = stats_html(pool_state(recompute.engine))
    for words in ("KV usage: 0%", "fewest free", "(recent", "prefix hit rate"):
        assert words in line
    assert " ms" not in line  # no timing: the same picture on every run
    old = {k: v for k, v in recompute.engine.stats().as_dict().items() if "ttft" not in k}
    old.pop("kv_cache_usage")
    state = pool_state(recompute.engine)
    state.stats.clear()
    state.stats.update(old)  # a frame recorded before these numbers existed
    assert "TTFT" not in stats_html(state) and "KV usage" not in stats_html(state)


# --- per request ----------------------------------------------------------------------------------
def test_finished_requests_feed_lengths_latencies_and_reasons():
    llm = make_llm(num_blocks=64)
    engine = llm.engine
    engine.add_request("a", PROMPTS[0], greedy(5))
    engine.add_request("b", PROMPTS[1], SamplingParams(n=2, max_tokens=4, temperature=1.0, seed=1))
    engine.add_request("c", PROMPTS[3], greedy(30))
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = o
        if "a" in outs and "c" not in outs:
            outs["c"] = engine.abort_request("c")
    m = engine.metrics
    assert m.finished_by_reason == {"length": 2, "abort": 1}
    assert m.prompt_tokens.sum == sum(len(p) for p in (PROMPTS[0], PROMPTS[1], PROMPTS[3]))
    assert m.generation_tokens.sum == 5 + 2 * 4 + len(outs["c"].outputs[0].token_ids)
    assert m.ttft.count == 3 and m.e2e.count == 3 and m.queue_time.count == 3
    assert m.itl.count == sum(len(o.metrics.token_times) - 1 for o in outs.values())
    gaps = [b - a for o in outs.values() for a, b in pairwise(o.metrics.token_times)]
    assert sorted(m.itl.recent) == sorted(gaps)
    assert m.running_seqs.count == engine.num_steps
    assert max(m.running_seqs.recent) == 4  # a, b's two samples, c


def test_summary_prints_percentiles_once_known():
    m = EngineMetrics()
    assert "(none yet)" in m.summary() and "cached blocks" not in m.summary()
    for r in fake_requests(10):
        observe_whole(m, r)
    text = m.summary()
    assert "last 10 requests" in text and "(none yet)" not in text.split("lengths")[0]


# --- distributions and bounded memory -------------------------------------------------------------
def test_a_value_counts_in_the_first_bucket_whose_bound_holds_it():
    d = Distribution((1, 2, 5), window=2)
    for x in (0.5, 1, 1.5, 2, 7):
        d.observe(x)
    assert d.counts == [2, 2, 0, 1]  # <=1, <=2, <=5, above
    assert d.cumulative() == [("1.0", 2), ("2.0", 4), ("5.0", 4), ("+Inf", 5)]
    assert list(d.recent) == [2, 7] and d.sum == 12 and d.count == 5
    assert one_two_five(1000)[-3:] == (200, 500, 1000)
    assert math.isnan(Distribution((1,), 3).percentiles()[50])


def test_memory_stays_bounded_over_a_long_life():
    m = EngineMetrics(max_model_len=4096)
    for r in fake_requests(100_000):
        observe_whole(m, r)
    for i in range(20_000):
        m.observe_step(fake_step(10 * i, 3 * i, running=i % 300, batched=1 + i % 500))
    assert m.ttft.count == m.e2e.count == 100_000 and m.itl.count == 400_000
    limits = {"ttft": 1_000, "e2e": 1_000, "prompt_tokens": 1_000, "itl": 10_000}
    for name, limit in {**limits, "running_seqs": 1_000, "iteration_tokens": 1_000}.items():
        d = getattr(m, name)
        assert len(d.recent) == limit, name
        assert len(d.counts) == len(d.bounds) + 1
    assert len(m._prefix_window) == 1_000 and len(m.finished_by_reason) == 1


# --- cache residency (opt-in) ---------------------------------------------------------------------
def test_cached_blocks_are_timed_per_eviction_and_reuse(recompute):
    """Replaying the recorded trace gives how many evictions and reuses should have been timed:
    those of blocks whose caching the tracker saw (all of them: it started first)."""
    timed, evicted, reused = set(), 0, 0
    for e in recompute.log.events:
        for b in e.blocks:
            if e.kind == "cache_store":
                timed.add(b)
            elif e.kind == "cache_hit" and b in timed:
                reused += 1
            elif e.kind == "evict" and b in timed:
                timed.discard(b)
                evicted += 1
    m = recompute.engine.metrics
    assert evicted > 0 and reused > 0
    assert m.block_lifetime.count == m.block_idle_before_evict.count == evicted
    assert m.block_reuse_gap.count == reused
    assert len(m._cached_at) == len(timed) <= 20  # at most one entry per block of the pool
    for life, idle in zip(m.block_lifetime.recent, m.block_idle_before_evict.recent, strict=True):
        assert 0 <= idle <= life
    assert min(m.block_reuse_gap.recent) >= 0
    assert "cached blocks" in m.summary()


def test_cache_residency_is_opt_in_and_can_stop():
    llm = make_llm()
    trace, m = llm.engine.kv.trace, llm.engine.metrics
    assert not trace.listening and not m.tracking_cache_residency  # off: no trace subscriber
    m.track_cache_residency()
    m.track_cache_residency()  # twice: still one subscriber
    assert trace.listening and len(trace._subscribers) == 1
    m.track_cache_residency(False)
    assert not trace.listening and not m.tracking_cache_residency
    with pytest.raises(PagedLearnError, match="no block trace"):
        EngineMetrics().track_cache_residency()


# --- fakes ----------------------------------------------------------------------------------------
def fake_step(queries=0, hits=0, running=1, batched=1, **view):
    """What observe_step reads of a StepStats."""
    return SimpleNamespace(
        prefix_query_tokens=queries,
        prefix_hit_tokens=hits,
        min_free_blocks=view.get("min_free_blocks", 0),
        recomputed_tokens=0,
        recompute_time=view.get("recompute_time", 0.0),
        num_prefill_seqs=1,
        forward_time=0.01,
        num_batched_tokens=batched,
        num_running_seqs=running,
    )


def observe_whole(m: EngineMetrics, req) -> None:
    """Feed ``m`` as the engine does: each step's tokens as they come, then the finished request."""
    times = list(req.metrics.token_times)
    req.metrics.token_times.clear()
    for t in times:
        req.metrics.token_times.append(t)
        m.observe_tokens(req.metrics)
    m.observe_request(req)


def fake_requests(n: int):
    """``n`` finished requests of 5 output tokens each, a step of 20 ms apart."""
    params = SamplingParams(max_tokens=5)
    for i in range(n):
        t = float(i)
        metrics = RequestMetrics(
            t, t + 0.01, t + 0.05, t + 0.13, [t + 0.05 + k / 50 for k in range(5)]
        )
        seq = Sequence(f"{i}.0", [1] * (10 + i % 7) + [2] * 5, 10 + i % 7, finish_reason="length")
        prompt = seq.token_ids[: seq.num_prompt_tokens]
        yield Request(str(i), None, prompt, params, metrics, i, done=[seq])


def test_ttft_and_gaps_are_recorded_while_a_request_runs():
    """As vLLM records them: a long request shows in the latencies before it ends."""
    engine = make_llm().engine
    engine.add_request("long", PROMPTS[1], greedy(50))
    for _ in range(5):
        engine.step()
    assert "long" in engine.requests  # still running
    assert engine.metrics.ttft.count == 1 and engine.metrics.itl.count == 4
    assert engine.stats().ttft_p50 == pytest.approx(engine.requests["long"].metrics.ttft)
    assert engine.metrics.e2e.count == 0  # only when it ends
