"""``python -m pagedlearn loadtest``: on the mix, every check passes and every kind of request
really happened; with isolation broken on purpose, the tenant checks fail; a request the
scheduler never admits is reported stuck instead of hanging the run; options that cannot
exercise something say so ([--]) without failing; the JSON holds every number; bad arguments
are refused before anything runs (or loads). No timing is asserted: the machine's load decides
those.
"""

from __future__ import annotations

import json
import math

import pytest

from pagedlearn.__main__ import main
from pagedlearn.errors import PagedLearnError
from pagedlearn.loadtest.checks import TenantAudit, kv_waste
from pagedlearn.loadtest.driver import step_bound
from pagedlearn.loadtest.in_process import LoadTestOptionError, default_pool, run_loadtest
from pagedlearn.loadtest.mix import MIN_REQUESTS, build_mix
from pagedlearn.loadtest.report import JSON_KEYS
from pagedlearn.trace.events import Event

CHECKS = {  # name -> kind, in the order the report lists them
    "every request finished or was cancelled": "correctness",
    "every block came back": "correctness",
    "the invariants held after every step": "correctness",
    "no request hit another tenant's cache entry": "correctness",
    "nothing was hit after a reset or a new model version": "correctness",
    "preemptions by swap and by recompute": "coverage",
    "the warm pass hit the cache": "coverage",
    "cache hits within a tenant": "coverage",
    "the whole mix happened": "coverage",
}
FINISHED, BLOCKS, INVARIANTS, ISOLATION, NO_STALE_HIT, PREEMPTION, WARM, SAME_TENANT, MIX = CHECKS


@pytest.fixture(scope="module")
def report():
    return run_loadtest("tiny-gpt2", num_requests=40, rate=200.0, seed=0)


def test_every_check_passes(report):
    assert {c.name: c.kind for c in report.checks} == CHECKS
    assert [c.name for c in report.checks] == list(CHECKS)
    assert [c.line() for c in report.checks if not c.ok] == []
    assert report.ok and report.complete and "all checks passed" in report.summary()
    assert all(c.line().startswith("  [OK] ") for c in report.checks)
    # At a finite rate the arrivals set the pace, and the summary says so.
    assert "paced by arrivals at 200/s; --rate inf measures the engine" in report.summary()


def test_the_whole_mix_happened(report):
    cnt = report.counts
    assert cnt["sent"] == 40 and all(n > 0 for n in cnt["kinds"].values()), cnt["kinds"]
    assert cnt["stopped_early"] > 0 and cnt["to_max_tokens"] > 0 and cnt["cancelled"] > 0
    assert cnt["rejected"] == 1 and cnt["failed"] == 0 and cnt["lost"] == cnt["stuck"] == 0
    # "parallel" is observed, not sent: outputs that came back with n > 1 samples.
    assert cnt["kinds"]["parallel"] == sum(r["samples"] > 1 for r in report.requests)
    assert all(r["samples"] == r["n"] for r in report.requests if r["outcome"] != "rejected")
    assert cnt["finished"] + cnt["cancelled"] + cnt["rejected"] == cnt["sent"]
    assert cnt["tenants"] == 4 and cnt["model_versions"] == 2 and cnt["shared_across_tenants"]
    assert report.pool["preemptions_swap"] > 0 and report.pool["preemptions_recompute"] > 0
    pc = report.prefix_cache
    assert pc["same_tenant_hit_blocks"] > 0 and pc["cross_tenant_hit_blocks"] == 0
    rates = pc["phase_hit_rate"]  # one prompt per (system prompt, tenant): nothing to share
    assert rates["cold"] == 0 and rates["version"] == 0 and rates["warm"] > 0.5
    cached = {p: sum(r["num_cached_tokens"] for r in report.requests if r["phase"] == p)
              for p in ("cold", "warm", "version")}  # fmt: skip
    assert cached["cold"] == cached["version"] == 0 < cached["warm"]
    for r in report.requests:
        if r["outcome"] == "cancelled":  # aborted as soon as it had its tokens
            assert r["finish_reasons"] == ["abort"] and r["output_tokens"] == r["cancel_after"]
        elif r["outcome"] == "stopped":  # a stop token or string before max_tokens
            assert "stop" in r["finish_reasons"] and r["output_tokens"] < r["n"] * r["max_tokens"]
        elif r["outcome"] == "length":
            assert r["output_tokens"] == r["n"] * r["max_tokens"]


def test_the_numbers_come_from_the_series(report):
    s, pool = report.series, report.pool
    assert len(s["t"]) == len(s["free_blocks"]) == pool["steps"] > 0
    assert pool["min_free_blocks"] == min(s["free_blocks"])
    assert pool["peak_running_seqs"] == max(s["num_running_seqs"]) > 1
    waste = [w for w in s["kv_waste"] if w is not None]
    assert waste and all(0 <= w < 1 for w in waste)  # every block held holds a token
    assert pool["kv_waste_max"] == max(waste)
    lat = report.latency
    assert lat["ttft"]["count"] == sum(r["ttft"] is not None for r in report.requests)
    assert lat["e2e"]["count"] == report.counts["finished"]
    assert lat["itl"]["count"] == sum(len(r["itl"]) for r in report.requests) > 0
    for d in lat.values():
        assert d["p50"] <= d["p90"] <= d["p99"]
    assert report.throughput["output_tokens"] == sum(r["output_tokens"] for r in report.requests)
    json.dumps(report.as_dict(), allow_nan=False)  # strict JSON: no NaN


def test_the_engine_reports_its_own_numbers(report):
    engine, pool = report.engine, report.pool  # StepStats.as_dict() at the end of the run
    assert engine["num_blocks"] == report.config["num_blocks"] == engine["free_blocks"]
    assert engine["preemptions_swap"] == pool["preemptions_swap"] > 0
    assert engine["prefix_hit_tokens"] == report.prefix_cache["hit_tokens"]
    assert engine["min_free_blocks"] == pool["min_free_blocks"]
    m = report.engine_metrics  # engine.metrics: the engine's own TTFT, counted per request
    assert m["ttft"]["count"] == report.latency["ttft"]["count"]
    assert m["finished_by_reason"]["abort"] == report.counts["cancelled"]
    for d in m.values():
        assert "count" not in d or not d["count"] or d["p50"] <= d["p90"] <= d["p99"]


@pytest.mark.parametrize("broken", ["cache salt and adapter", "model version"])
def test_a_cache_shared_across_tenants_fails_the_check(broken, monkeypatch):
    if broken == "model version":  # the version is announced, but never reaches the hashes
        from pagedlearn.engine.llm_engine import LLMEngine

        def set_version(self, version):
            self._model_version = version

        prop = property(LLMEngine.model_version.fget, set_version)
        monkeypatch.setattr(LLMEngine, "model_version", prop)
    else:  # the block hashes forget who sent the prompt
        import pagedlearn.core.kv_cache_manager as manager

        real = manager.make_extra_keys
        monkeypatch.setattr(manager, "make_extra_keys", lambda model_id=None, *_: real(model_id))
    r = run_loadtest("tiny-gpt2", num_requests=MIN_REQUESTS, rate=math.inf, seed=1)
    failed = {c.name for c in r.checks if not c.ok}
    # The trace audit sees the shared blocks; the cold or version pass hits what it must not.
    assert failed == {ISOLATION, NO_STALE_HIT} and not r.ok
    pc = r.prefix_cache
    assert pc["cross_tenant_hit_blocks"] > 0 and pc["violations"]
    first = pc["violations"][0]
    assert first["kind"] == "cache_hit" and first["owner"] != first["tenant"]
    pass_hits = {p: sum(q["num_cached_tokens"] for q in r.requests if q["phase"] == p)
                 for p in ("cold", "version")}  # fmt: skip
    if broken == "model version":
        assert r.prefix_cache["phase_hit_rate"]["version"] > 0 and pass_hits["version"] > 0
        assert all("+loadtest'" in v["tenant"] for v in pc["violations"])
    else:  # the cold pass sends one system prompt as several tenants: they hit each other
        assert pass_hits["cold"] > 0


def test_a_request_never_scheduled_is_reported_stuck_not_waited_for(monkeypatch):
    from pagedlearn.engine.scheduler import Scheduler

    real = Scheduler.schedule

    def schedule(self, *args, **kwargs):  # the scheduler never sees "cold-0" in its queue
        held = [r for r in self.waiting if r.request_id == "cold-0"]
        self.waiting[:] = [r for r in self.waiting if r not in held]
        try:
            return real(self, *args, **kwargs)
        finally:
            self.waiting[:0] = held

    monkeypatch.setattr(Scheduler, "schedule", schedule)
    r = run_loadtest("tiny-gpt2", num_requests=MIN_REQUESTS, rate=math.inf, seed=3)
    failed = [c for c in r.checks if not c.ok]
    assert [c.name for c in failed] == [FINISHED] and not r.ok
    assert failed[0].detail.endswith("1 stuck; stuck: cold-0") and "[FAIL]" in failed[0].line()
    stuck = [q for q in r.requests if q["outcome"] == "stuck"]
    assert [q["id"] for q in stuck] == ["cold-0"] and r.counts["stuck"] == 1
    assert "not finished in the" in stuck[0]["error"]
    # The cold phase ran to its bound (nothing preempted there: the bound is the static one),
    # was given up, and the later phases ran as usual.
    cold = r.phases["cold"]
    specs = build_mix(MIN_REQUESTS, 3, math.inf, 512, 16, 64, 16)
    assert cold["steps"] == cold["max_steps"] == step_bound([s for s in specs if s.phase == "cold"])
    assert cold["stuck"] == 1 and r.phases["warm"]["stuck"] == r.phases["version"]["stuck"] == 0
    assert all(q["outcome"] == "length" for q in r.requests if q["phase"] in ("warm", "version"))


def test_the_command_writes_every_number_and_its_checks(tmp_path, capsys):
    path, page = tmp_path / "out" / "loadtest.json", tmp_path / "metrics" / "loadtest.prom"
    argv = ["loadtest", "--num-requests", str(MIN_REQUESTS), "--rate", "inf", "--seed", "2"]
    assert main([*argv, "--json", str(path), "--prometheus", str(page)]) == 0
    out = capsys.readouterr().out
    assert out.count("[OK]") == len(CHECKS) and "[FAIL]" not in out and "[--]" not in out
    for phrase in ("throughput:", "min free blocks", "KV waste", "preemptions: swap", "TTFT",
                   "all at once: the engine's pace"):  # fmt: skip
        assert phrase in out
    d = json.loads(path.read_text())
    assert set(d) == set(JSON_KEYS) and d["ok"] is True and d["complete"] is True
    assert {c["name"]: c["kind"] for c in d["checks"]} == CHECKS
    assert all(set(c) == {"name", "kind", "ok", "detail", "hint"} for c in d["checks"])
    assert d["engine"]["num_blocks"] == d["config"]["num_blocks"]
    assert d["engine_metrics"]["ttft"]["count"] == d["latency"]["ttft"]["count"]
    assert d["config"]["rate"] == "inf" and d["config"]["num_requests"] == MIN_REQUESTS
    assert set(d["latency"]) == {"ttft", "itl", "e2e"}
    assert set(d["latency"]["ttft"]) == {"p50", "p90", "p99", "count"}
    assert len(d["requests"]) == MIN_REQUESTS and len(d["series"]["free_blocks"]) > 0
    assert d["prometheus"] == str(page)  # the engine's own page, after the run
    swaps = d["pool"]["preemptions_swap"]
    assert f'pagedlearn_num_preemptions_total{{mode="swap",model_name="tiny-gpt2"}} {swaps}' in (
        page.read_text()
    )


@pytest.fixture
def no_run(monkeypatch):
    import pagedlearn.loadtest.in_process

    def boom(*args, **kwargs):
        raise AssertionError("the load test started before refusing a bad option")

    monkeypatch.setattr(pagedlearn.loadtest.in_process, "run_loadtest", boom)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--rate", "-1"], "argument --rate: must be > 0 (or inf: all at once), got -1"),
        (["--rate", "0"], "argument --rate: must be > 0"),
        (["--rate", "nan"], "argument --rate: must be > 0"),
        (["--rate", "fast"], "argument --rate: must be a number or inf, got 'fast'"),
        (["--num-requests", "0"], f"argument --num-requests: must be at least {MIN_REQUESTS}"),
        (["--num-requests", "-3"], "argument --num-requests: must be at least"),
        (["--seed", "-1"], "argument --seed: must be at least 0, got -1"),
        (["--num-blocks", "0"], "argument --num-blocks: must be a positive integer, got 0"),
        (["--swap-blocks", "x"], "argument --swap-blocks: must be an integer, got 'x'"),
        # Known before the model loads: the span of the arrivals, the offline model's context.
        (
            ["--rate", "0.05"],
            "argument --rate: at a rate of 0.05 requests/s, 200 requests "
            "arrive over about 4000 s, more than 3600 s",
        ),
        (
            ["--block-size", "128"],
            "argument --block-size: a context of 512 tokens is too short "
            "for the mix with blocks of 128 tokens",
        ),
        (["--block-size", "81"], "the largest block size that fits is 80"),
        (
            ["--num-blocks", "8"],
            "argument --num-blocks: the mix has prompts near tiny-gpt2's context of 512",
        ),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(argv, message, no_run, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["loadtest", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m pagedlearn loadtest") and message in err
    assert "Traceback" not in err


@pytest.mark.parametrize("option", ["--json", "--prometheus"])
def test_an_output_path_that_is_a_directory_is_refused(option, tmp_path, no_run, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["loadtest", option, str(tmp_path)])
    assert exc.value.code == 2 and f"argument {option}: {tmp_path} is a directory" in (
        capsys.readouterr().err
    )


def test_a_hub_model_too_short_for_the_block_size_is_a_usage_error(monkeypatch, capsys):
    # A hub model's context is known only once it has loaded: still a usage error (exit 2).
    import pagedlearn.models as models

    real = models.load
    monkeypatch.setattr(models, "load", lambda name: real("tiny-gpt2") if name == "hub/x" else 0)
    with pytest.raises(SystemExit) as exc:
        main(["loadtest", "--model", "hub/x", "--block-size", "96"])
    assert exc.value.code == 2
    assert "argument --block-size: a context of 512 tokens is too short" in capsys.readouterr().err


def test_the_api_refuses_bad_arguments_before_loading_a_model():
    for kwargs in ({"num_requests": 0}, {"rate": -1.0}, {"rate": math.nan}, {"seed": -1},
                   {"block_size": 0}, {"num_blocks": 0}, {"swap_blocks": 1.5},
                   {"rate": 0.01}):  # fmt: skip
        with pytest.raises(LoadTestOptionError) as e:
            run_loadtest("no-such-model-is-loaded", **kwargs)
        assert e.value.option in kwargs
    for kwargs in ({"block_size": 128}, {"num_blocks": 32}):  # the offline model's context
        with pytest.raises(LoadTestOptionError) as e:
            run_loadtest("tiny-gpt2", **kwargs)
        assert e.value.option in kwargs


def test_without_prometheus_client_the_page_is_refused_before_the_model_loads(
    monkeypatch, tmp_path, capsys
):
    import sys

    import pagedlearn.models as models
    from pagedlearn.engine.prometheus import MetricsUnavailableError

    def load(*args, **kwargs):
        raise AssertionError("the model loaded before the missing prometheus_client was found")

    monkeypatch.setattr(models, "load", load)
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails
    with pytest.raises(MetricsUnavailableError, match="pagedlearn\\[metrics\\]"):
        run_loadtest("tiny-gpt2", prometheus=tmp_path / "page.prom")
    assert main(["loadtest", "--prometheus", str(tmp_path / "page.prom")]) == 1
    out, err = capsys.readouterr()
    assert "loadtest stopped: the Prometheus export needs prometheus_client" in err
    assert "loading" not in out


def test_block_size_one_runs_the_mix(capsys):  # short prompts are under two blocks: one token
    specs = build_mix(MIN_REQUESTS, 0, math.inf, 512, 1, 1024, 256)
    short = [s for s in specs if "short" in s.kinds]
    assert short and all(len(s.prompt_token_ids) == 1 for s in short)
    # The draw is the same for every other block size: a seed keeps its requests (these
    # lengths are the ones the mix drew before blocks of one token were allowed).
    mix = build_mix(60, 0, 10.0, 512, 16, 64, 16)
    lengths = [len(s.prompt_token_ids) for s in mix if "short" in s.kinds]
    assert lengths[:6] == [15, 14, 7, 10, 28, 19]
    argv = ["loadtest", "--block-size", "1", "--num-requests", str(MIN_REQUESTS), "--rate", "inf"]
    assert main(argv) == 0 and "all checks passed" in capsys.readouterr().out


def test_a_given_llm_is_driven_as_it_is_and_must_be_idle():
    from pagedlearn import LLM, SamplingParams

    # Recompute only (no swap pool), and no prefix caching: the engine is right, but the run
    # cannot show swapping or a cache hit -- coverage, not correctness.
    llm = LLM("tiny-gpt2", num_blocks=40, enable_prefix_caching=False, verbose=False)
    with pytest.raises(LoadTestOptionError, match="its pool is already built"):
        run_loadtest(llm, num_blocks=64)
    llm.engine.add_request("busy", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(PagedLearnError, match="idle engine"):
        run_loadtest(llm)
    llm.engine.abort_request("busy")
    r = run_loadtest(llm, num_requests=MIN_REQUESTS, rate=math.inf)
    missed = {c.name: c for c in r.checks if not c.ok}
    assert set(missed) == {PREEMPTION, WARM, SAME_TENANT}
    assert all(c.kind == "coverage" for c in missed.values()) and r.ok and not r.complete
    assert missed[PREEMPTION].hint == "the engine preempts by recompute only (preemption_mode)"
    assert missed[WARM].hint.startswith("prefix caching is off")
    assert missed[WARM].line().startswith("  [--] not exercised: the warm pass hit the cache: ")
    assert "every correctness check passed; 3 not exercised" in r.summary()
    assert r.pool["preemptions_swap"] == 0 and r.config["num_blocks"] == 40
    assert llm.engine.model_version is None  # put back


@pytest.mark.parametrize(
    "options, missed, hint",
    [
        (
            ["--num-blocks", "1000"],
            PREEMPTION,
            "a pool of 1000 blocks never ran short: try --num-blocks 64",
        ),
        (["--swap-blocks", "200"], PREEMPTION, "try --swap-blocks 16"),
    ],
)
def test_options_that_cannot_exercise_a_check_say_so_and_exit_0(
    options, missed, hint, tmp_path, capsys
):
    path = tmp_path / "loadtest.json"
    argv = ["loadtest", *options, "--num-requests", str(MIN_REQUESTS), "--rate", "inf"]
    assert main([*argv, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"[--] not exercised: {missed}: " in out and hint in out and "[FAIL]" not in out
    d = json.loads(path.read_text())
    assert d["ok"] is True and d["complete"] is False
    (check,) = [c for c in d["checks"] if not c["ok"]]
    assert check["name"] == missed and check["kind"] == "coverage" and hint in check["hint"]


def test_the_mix_is_seeded_and_sized_to_the_pool():
    a = build_mix(60, 3, 10.0, 512, 16, 64, 16)
    assert a == build_mix(60, 3, 10.0, 512, 16, 64, 16) != build_mix(60, 4, 10.0, 512, 16, 64, 16)
    squeeze = [s for s in a if s.phase == "squeeze"]
    # Just over half the swap pool (9 blocks of 16), growing to all of it (16 blocks).
    assert all(128 < len(s.prompt_token_ids) <= 144 for s in squeeze)
    assert all(s.params.max_tokens == 7 * 16 for s in squeeze)
    assert default_pool(512, 16) == (64, 16) and default_pool(1024, 16) == (128, 32)
    mix_times = [s.arrival for s in a if s.phase == "mix"]
    assert mix_times == sorted(mix_times) and mix_times[0] > 0  # Poisson: gaps from 0
    assert {s.arrival for s in build_mix(60, 3, math.inf, 512, 16, 64, 16)} == {0.0}


def test_the_audit_follows_each_block_through_the_trace():
    tenants = {"a": "A", "b": "B"}
    audit = TenantAudit(tenants.get)
    events = [
        ("cache_store", (1,), ("a.0",)),
        ("cache_hit", (1,), ("a.1",)),  # same tenant
        ("free", (1,), ("a.0",)),  # freed, still findable: still A's
        ("swap_in", (1,), ("a.2",)),  # a sibling's swap-in names the shared block: still A's
        ("cache_hit", (1,), ("a.3",)),  # same tenant
        ("evict", (1,), ("b.0",)),
        ("cache_store", (1,), ("b.0|full",)),  # a model with KV-cache groups names them
        ("cache_hit", (1,), ("b.1|full",)),  # same tenant
        ("cache_hit", (1,), ("a.4",)),  # violation: B's block
        ("cache_reset", (1,), ()),
        ("cache_hit", (1,), ("b.2",)),  # violation: nobody vouches for it
        ("incref", (2, 3), ("a.0", "b.0")),  # violation x 2: a fork across tenants
    ]
    for i, (kind, blocks, seqs) in enumerate(events):
        audit(Event(i, kind, blocks, seqs))
    assert audit.same_tenant_hits == 3 and audit.cross_tenant_hits == 4
    assert [v["event"] for v in audit.violations] == [8, 10, 11, 11]
    assert audit.violations[1]["owner"] == "'nobody'"


def test_kv_waste_counts_a_shared_block_once():
    from pagedlearn import KVCacheManager

    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    assert kv_waste(kv) == (0, 0)
    kv.add_sequence("a", list(range(9)))  # 3 blocks: 4 + 4 + 1 tokens
    kv.add_sequence("b", [*range(8), 50, 51])  # hits a's 2 full blocks, 1 of its own
    assert kv_waste(kv) == (9 + 2, 4 * 4)


def test_tails_group_every_request_by_the_fewest_free_blocks_it_lived_through(report):
    from pagedlearn.loadtest.tails import EDGES, fewest_free_blocks, tails_by_headroom

    rows = tails_by_headroom([report])
    assert [r["label"] for r in rows] == ["0", "1-3", "4-15", "16-63", "64+"] and len(EDGES) == 5
    served = [r for r in report.requests if r["ttft"] is not None]
    assert sum(r["requests"] for r in rows) == len(served)
    for r in served:  # its life is a window of the series: the minimum is one of its values
        x = fewest_free_blocks(report.series, r)
        assert x in report.series["free_blocks"] and r["arrival"] <= r["end"]
    # The squeeze empties the pool, and the requests preempted there lived through it.
    assert rows[0]["requests"] > 0 and rows[0]["preempted"] > 0
    assert sum(r["preempted"] for r in rows) == sum(r["num_preemptions"] > 0 for r in served)
    assert all(r["ttft_p50"] <= r["ttft_p99"] for r in rows if r["requests"])
    assert tails_by_headroom([report, report])[0]["requests"] == 2 * rows[0]["requests"]


@pytest.mark.parametrize(
    "option, value", [("--block-size", "16"), ("--num-blocks", "64"), ("--swap-blocks", "8")]
)
def test_in_process_pool_options_are_refused_with_an_endpoint(option, value, capsys):
    # The server's pool is its own: an option that would size a pool here is a usage error
    # there, before anything is sent (nothing listens at this URL: it is never reached).
    with pytest.raises(SystemExit) as exc:
        main(["loadtest", "--endpoint", "http://127.0.0.1:9", option, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: not with --endpoint" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "option, value", [("--api-key", "k"), ("--timeout", "5"), ("--max-model-len", "512")]
)
def test_http_options_are_refused_without_an_endpoint(option, value, no_run, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["loadtest", option, value])
    assert exc.value.code == 2
    assert f"argument {option}: only with --endpoint" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf", "soon"])
def test_a_timeout_must_be_seconds(value, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["loadtest", "--endpoint", "http://127.0.0.1:9", "--timeout", value])
    assert exc.value.code == 2 and "argument --timeout: must be" in capsys.readouterr().err
