"""``python -m pagedlearn loadtest``: on the mix, every check passes and every kind of request
really happened; with isolation broken on purpose, the tenant check fails; the JSON holds every
number; bad arguments are refused before anything runs. No timing is asserted: the machine's
load decides those.
"""

from __future__ import annotations

import json
import math

import pytest

from pagedlearn.__main__ import main
from pagedlearn.errors import PagedLearnError
from pagedlearn.loadtest import LoadTestOptionError, default_pool, run_loadtest
from pagedlearn.loadtest_checks import TenantAudit, kv_waste
from pagedlearn.loadtest_mix import MIN_REQUESTS, build_mix
from pagedlearn.loadtest_report import JSON_KEYS
from pagedlearn.trace import Event

CHECKS = (
    "every request finished or was cancelled",
    "every block came back",
    "the invariants held after every step",
    "no request hit another tenant's cache entry",
    "preemptions by swap and by recompute",
    "prefix cache cold, then warm",
    "the whole mix happened",
)
ISOLATION = CHECKS[3]


@pytest.fixture(scope="module")
def report():
    return run_loadtest("tiny-gpt2", num_requests=40, rate=200.0, seed=0)


def test_every_check_passes(report):
    assert [c.name for c in report.checks] == list(CHECKS)
    assert [c.line() for c in report.checks if not c.ok] == []
    assert report.ok and "all checks passed" in report.summary()


def test_the_whole_mix_happened(report):
    cnt = report.counts
    assert cnt["sent"] == 40 and all(n > 0 for n in cnt["kinds"].values()), cnt["kinds"]
    assert cnt["stopped_early"] > 0 and cnt["to_max_tokens"] > 0 and cnt["cancelled"] > 0
    assert cnt["rejected"] == 1 and cnt["failed"] == 0 and cnt["lost"] == 0
    assert cnt["finished"] + cnt["cancelled"] + cnt["rejected"] == cnt["sent"]
    assert cnt["tenants"] == 4 and cnt["model_versions"] == 2 and cnt["shared_across_tenants"]
    assert report.pool["preemptions_swap"] > 0 and report.pool["preemptions_recompute"] > 0
    pc = report.prefix_cache
    assert pc["same_tenant_hit_blocks"] > 0 and pc["cross_tenant_hit_blocks"] == 0
    rates = pc["phase_hit_rate"]  # one prompt per (system prompt, tenant): nothing to share
    assert rates["cold"] == 0 and rates["version"] == 0 and rates["warm"] > 0.5
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


@pytest.mark.parametrize("broken", ["cache salt and adapter", "model version"])
def test_a_cache_shared_across_tenants_fails_the_check(broken, monkeypatch):
    if broken == "model version":  # the version is announced, but never reaches the hashes
        from pagedlearn.engine.llm_engine import LLMEngine

        def set_version(self, version):
            self._model_version = version

        prop = property(LLMEngine.model_version.fget, set_version)
        monkeypatch.setattr(LLMEngine, "model_version", prop)
    else:  # the block hashes forget who sent the prompt
        import pagedlearn.kv_cache_manager as manager

        real = manager.make_extra_keys
        monkeypatch.setattr(manager, "make_extra_keys", lambda model_id=None, *_: real(model_id))
    r = run_loadtest("tiny-gpt2", num_requests=MIN_REQUESTS, rate=math.inf, seed=1)
    check = next(c for c in r.checks if c.name == ISOLATION)
    assert not check.ok and not r.ok
    pc = r.prefix_cache
    assert pc["cross_tenant_hit_blocks"] > 0 and pc["violations"]
    first = pc["violations"][0]
    assert first["kind"] == "cache_hit" and first["owner"] != first["tenant"]
    if broken == "model version":
        assert r.prefix_cache["phase_hit_rate"]["version"] > 0
        assert all("+loadtest'" in v["tenant"] for v in pc["violations"])


def test_the_command_writes_every_number_and_its_checks(tmp_path, capsys):
    path, page = tmp_path / "out" / "loadtest.json", tmp_path / "metrics" / "loadtest.prom"
    argv = ["loadtest", "--num-requests", str(MIN_REQUESTS), "--rate", "inf", "--seed", "2"]
    assert main([*argv, "--json", str(path), "--prometheus", str(page)]) == 0
    out = capsys.readouterr().out
    assert out.count("[OK]") == len(CHECKS) and "[FAIL]" not in out
    for phrase in ("throughput:", "min free blocks", "KV waste", "preemptions: swap", "TTFT"):
        assert phrase in out
    d = json.loads(path.read_text())
    assert set(d) == set(JSON_KEYS) and d["ok"] is True
    assert [c["name"] for c in d["checks"]] == list(CHECKS)
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
    import pagedlearn.loadtest

    def boom(*args, **kwargs):
        raise AssertionError("the load test started before refusing a bad option")

    monkeypatch.setattr(pagedlearn.loadtest, "run_loadtest", boom)


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


def test_a_pool_smaller_than_the_context_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:  # the model loads, the pool is never built
        main(["loadtest", "--num-blocks", "8"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "argument --num-blocks: the mix has prompts near tiny-gpt2's context of 512" in err


def test_the_api_refuses_bad_arguments_before_loading_a_model():
    for kwargs in ({"num_requests": 0}, {"rate": -1.0}, {"rate": math.nan}, {"seed": -1},
                   {"block_size": 0}, {"num_blocks": 0}, {"swap_blocks": 1.5}):  # fmt: skip
        with pytest.raises(LoadTestOptionError) as e:
            run_loadtest("no-such-model-is-loaded", **kwargs)
        assert e.value.option in kwargs


def test_a_given_llm_is_driven_as_it_is_and_must_be_idle():
    from pagedlearn import LLM, SamplingParams

    llm = LLM("tiny-gpt2", num_blocks=40, verbose=False)  # recompute only, no swap pool
    with pytest.raises(LoadTestOptionError, match="its pool is already built"):
        run_loadtest(llm, num_blocks=64)
    llm.engine.add_request("busy", [1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(PagedLearnError, match="idle engine"):
        run_loadtest(llm)
    llm.engine.abort_request("busy")
    r = run_loadtest(llm, num_requests=MIN_REQUESTS, rate=math.inf)
    failed = {c.name for c in r.checks if not c.ok}
    assert failed == {"preemptions by swap and by recompute"}  # no swap pool: never by swap
    assert r.pool["preemptions_swap"] == 0 and r.config["num_blocks"] == 40
    assert llm.engine.model_version is None  # put back


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
