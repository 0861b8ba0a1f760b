"""The paper simulations: workloads as documented, the real allocator underneath, small runs."""

import pytest

from pagedlearn.errors import PagedLearnError
from pagedlearn.sim import paper
from pagedlearn.sim.simulator import CATEGORIES, ContiguousMemory, PagedMemory, simulate
from pagedlearn.sim.workloads import (
    MAX_CONTEXT,
    PAPER_MEANS,
    Request,
    home_server_workload,
    mean_lengths,
    paper_workload,
)


@pytest.mark.parametrize("name", ["sharegpt", "alpaca"])
@pytest.mark.parametrize("spread", [0.5, 1.0, 1.5])
def test_workload_means_match_figure_11_after_the_context_cut(name, spread):
    requests = paper_workload(name, 20_000, spread=spread)
    mean_in, mean_out = mean_lengths(requests)
    assert mean_in == pytest.approx(PAPER_MEANS[name][0], rel=0.01)
    assert mean_out == pytest.approx(PAPER_MEANS[name][1], rel=0.01)
    assert all(1 <= r.output_len <= r.max_tokens for r in requests)
    assert all(r.prompt_len + r.max_tokens == MAX_CONTEXT for r in requests)


def test_poisson_arrivals_have_the_asked_rate_and_bad_arguments_are_refused():
    requests = paper_workload("alpaca", 5000, rate=30.0, seed=1)
    assert requests[-1].arrival == pytest.approx(5000 / 30.0, rel=0.05)
    for kwargs in ({"rate": 0}, {"spread": -1}, {"num_requests": 0}):
        with pytest.raises(ValueError):
            paper_workload("alpaca", **{"num_requests": 5, **kwargs})
    with pytest.raises(ValueError, match="unknown workload"):
        paper_workload("lmsys", 5)


def test_home_server_mixes_chats_documents_and_code_with_early_eos_and_shared_prompts():
    requests = home_server_workload(2000, seed=3)
    kinds = {r.tags["kind"] for r in requests}
    assert kinds == {"chat", "document", "code"}
    chats = [r for r in requests if r.tags["kind"] == "chat"]
    assert {r.prefix_id for r in chats} == {0, 1, 2} and all(r.prefix_len == 100 for r in chats)
    early = sum(r.output_len < r.max_tokens for r in chats) / len(chats)
    assert 0.7 < early < 0.9  # 80% stop at EOS before their limit
    assert all(r.output_len == r.max_tokens for r in requests if r.tags["kind"] == "code")


def test_max_batches_exactly_seven_on_the_papers_pool():
    """floor(15.7K / 2048) = 7: the paper's Max baseline, exactly."""
    assert paper.POOL_SLOTS == 15_728
    result = simulate(paper_workload("sharegpt", 60), ContiguousMemory(paper.POOL_SLOTS, "max"))
    assert max(s.running for s in result.snapshots) == 7
    assert result.mean_batch() == 7.0 and result.preemptions == 0


@pytest.mark.parametrize("system", paper.SYSTEMS)
def test_every_slot_is_accounted_for_at_every_step(system):
    memory = paper.make_memory(system, pool_slots=3000)
    result = simulate(paper_workload("sharegpt", 40, seed=2), memory)
    assert result.finished == 40
    for s in result.snapshots:
        assert sum(getattr(s, c) for c in CATEGORIES) == 3000
        assert min(getattr(s, c) for c in CATEGORIES) >= 0
    if system == "oracle":
        assert all(s.internal == 0 for s in result.snapshots)


def _recount(memory, running_lengths) -> dict:
    """Every slot counted afresh from the held reservations / block tables (slow and plain)."""
    out = dict.fromkeys(CATEGORIES, 0)
    if isinstance(memory, ContiguousMemory):
        for req, length in running_lengths:
            offset, size = memory.held[req.request_id]
            out["token_states"] += length
            out["reserved"] += req.final_len - length
            out["internal"] += size - req.final_len
            out["buddy_rounding"] += memory.buddy.allocated_size(offset) - size
        out["free"] = memory.buddy.num_free_slots
        return out
    filled, bs = {}, memory.block_size  # physical block -> slots holding tokens
    for req, length in running_lengths:
        for j, block in enumerate(memory.kv.block_table(req.request_id)):
            filled[block] = min(bs, length - j * bs)
    out["token_states"] = sum(filled.values())
    out["internal"] = len(filled) * bs - out["token_states"]
    out["free"] = memory.num_slots - len(filled) * bs
    return out


@pytest.mark.parametrize("system", ["max", "pow2", "oracle", "vllm+prefix"])
def test_the_breakdowns_running_totals_equal_a_recount(system, monkeypatch):
    """The simulator keeps totals (contiguous) or counts each shared block once (prefix
    caching) to be fast; every step they must equal a plain recount."""
    from pagedlearn.sim.workloads import attach_tokens

    if system == "vllm+prefix":
        memory, cls = PagedMemory(3000, enable_prefix_caching=True), PagedMemory
        requests = attach_tokens(home_server_workload(60, seed=3), seed=3)
    else:
        memory, cls = ContiguousMemory(3000, system), ContiguousMemory
        requests = paper_workload("sharegpt", 40, seed=2)
    fast, checked = cls.breakdown, []

    def breakdown(self, running_lengths):
        got = fast(self, running_lengths)
        assert {c: got[c] for c in CATEGORIES} == _recount(self, running_lengths)
        checked.append(1)
        return got

    monkeypatch.setattr(cls, "breakdown", breakdown)
    result = simulate(requests, memory)
    assert result.finished == len(requests) and len(checked) == len(result.snapshots)
    if system == "vllm+prefix":
        assert max(s.shared for s in result.snapshots) > 0  # blocks were shared, counted once


def test_paging_runs_the_real_kv_cache_manager_and_ends_with_every_block_free():
    memory = PagedMemory(num_slots=4096, block_size=16)  # the longest request (2048) fits
    result = simulate(paper_workload("sharegpt", 50, seed=4), memory)
    kv = memory.kv
    assert result.finished == 50 and result.preemptions > 0  # the small pool forces preemption
    assert kv.num_free_blocks == 256 and not kv.sequences()
    kv.check_invariants()


def test_a_request_larger_than_the_pool_is_refused_instead_of_looping():
    too_long = Request(0, 0.0, prompt_len=900, output_len=10, max_tokens=100)
    with pytest.raises(PagedLearnError, match="does not fit in an empty pool"):
        simulate([too_long], PagedMemory(num_slots=512))
    grows_too_long = Request(0, 0.0, prompt_len=100, output_len=500, max_tokens=500)
    with pytest.raises(PagedLearnError, match="needs more than the whole pool"):
        simulate([grows_too_long], PagedMemory(num_slots=512))
    with pytest.raises(PagedLearnError, match="larger than the pool of 512 slots"):
        simulate([too_long], ContiguousMemory(512, "oracle"))
    with pytest.raises(PagedLearnError, match="can never fit"):  # 1024 slots > arena of 512
        simulate([too_long], ContiguousMemory(1000, "oracle"))


def test_poisson_arrivals_with_a_step_time_leave_the_server_idle_at_times():
    requests = paper_workload("alpaca", 50, rate=1.0, seed=5)
    result = simulate(requests, PagedMemory(paper.POOL_SLOTS), step_seconds=0.05)
    assert result.finished == 50
    assert result.steps > max(s.step for s in result.snapshots) - 1
    assert min(s.running for s in result.snapshots) <= 2  # 1 req/s: rarely more than one or two


def test_experiments_run_small_and_put_the_papers_numbers_beside_ours():
    rows = paper.figure2("sharegpt", num_requests=300)  # enough to keep a queue for a while
    assert [r["system"] for r in rows] == list(paper.SYSTEMS)
    assert rows[0]["paper_internal"] == 57.3 and rows[-1]["paper_token_states"] == 96.3
    vllm, oracle = rows[-1], rows[2]
    assert vllm["token_states"] > oracle["token_states"]  # paging wastes less than even Oracle
    batches = {r["system"]: r["mean_batch"] for r in paper.figure13("alpaca", num_requests=800)}
    assert batches["max"] < batches["pow2"] < batches["oracle"] < batches["vllm"]
    sweep = paper.figure18b("alpaca", block_sizes=(16, 256), num_requests=800)
    assert sweep[0]["internal"] < sweep[1]["internal"]  # big blocks waste short requests' memory
    assert paper.spread_sensitivity("sharegpt", (0.5, 1.5), num_requests=30)
    by_step = paper.rate_sensitivity("alpaca", 30.0, (0.02, 0.08), num_requests=1500)
    vllm = [r["mean_batch"] for r in by_step if r["system"] == "vllm"]
    assert vllm[0] < vllm[1]  # longer steps: more requests arrive during each one's lifetime
    assert all(6.9 < r["mean_batch"] <= 7 for r in by_step if r["system"] == "max")  # full


def test_paper_command_prints_every_experiment_and_draws_it(tmp_path):
    lines = []
    paths = paper.report(quick=True, out=lines.append, figures_dir=tmp_path)
    text = "\n".join(lines)
    headings = ("Figure 2", "Figure 13", "Sensitivity", "Figure 18b", "Figure 15", "Prefix")
    for heading in (*headings, "Figure 19", "Figure 12"):
        assert heading in text
    assert len(paths) == 8 and all(p.stat().st_size > 10_000 for p in paths)


def test_sharing_saves_nothing_alone_and_more_as_beams_refork():
    from pagedlearn.sim import sharing

    assert sharing.savings("alpaca", "parallel", 1, num_requests=30) == 0.0
    prompt_only = sharing.savings("alpaca", "beam", 4, divergence=0.0, num_requests=30)
    reforking = sharing.savings("alpaca", "beam", 4, divergence=0.2, num_requests=30)
    parallel = sharing.savings("alpaca", "parallel", 4, num_requests=30)
    assert 0 < parallel < reforking and 0 < prompt_only < reforking
    with pytest.raises(ValueError, match="mode"):
        sharing.savings("alpaca", "speculative", 2)
    with pytest.raises(ValueError, match="width"):
        sharing.savings("alpaca", "beam", 0)


def test_a_beam_request_runs_on_the_real_manager_with_copy_on_write():
    import random

    from pagedlearn.sim import sharing

    req = Request(0, 0.0, prompt_len=20, output_len=30, max_tokens=100)
    used, unshared = sharing.run_request(req, "beam", 3, [30] * 3, 0.3, 16, random.Random(0))
    assert 0 < used < unshared  # sharing saved blocks (and run_request checked the invariants)


def test_figure15_puts_the_papers_numbers_beside_ours():
    from pagedlearn.sim import sharing

    rows = sharing.figure15(widths=(2,), num_requests=20)
    assert [(r["workload"], r["mode"]) for r in rows] == [
        ("alpaca", "parallel"), ("alpaca", "beam"), ("sharegpt", "parallel"), ("sharegpt", "beam")
    ]  # fmt: skip
    assert rows[1]["paper_saved_pct"] == 37.56 and rows[3]["paper_saved_pct"] == "44.3-66.3"


def test_prefix_caching_hits_shared_prompts_and_chat_histories():
    from pagedlearn.sim import prefix

    rows = {r["cache"]: r for r in prefix.prefix_caching("shared-prompt", 120)}
    assert rows["off"]["hit_rate_pct"] == 0 and rows["off"]["memory_saved_pct"] == 0
    assert rows["cold"]["hit_rate_pct"] > 10 and rows["cold"]["memory_saved_pct"] > 0
    few = {r["cache"]: r for r in prefix.prefix_caching("multi-turn", 60)}  # 10 chats
    many = {r["cache"]: r for r in prefix.prefix_caching("multi-turn", 300)}  # 50 chats
    assert few["cold"]["hit_rate_pct"] > 3 * many["cold"]["hit_rate_pct"]  # LRU pressure
    with pytest.raises(ValueError, match="stream"):
        prefix.prefix_caching("rag")


def test_a_chat_turn_waits_for_the_previous_one():
    from pagedlearn.sim.workloads import multi_turn_workload

    requests = multi_turn_workload(3, turns=2)
    second = requests[3]
    assert second.after == 0 and second.prompt_tokens[: requests[0].final_len] == (
        requests[0].prompt_tokens + requests[0].output_tokens
    )
    result = simulate(requests, PagedMemory(4096, enable_prefix_caching=True))
    assert result.finished == 6
    blocked = Request(7, 0.0, 4, 4, 4, after=99)  # waits for a request that does not exist
    with pytest.raises(PagedLearnError, match="never finish"):
        simulate([blocked], PagedMemory(256))
