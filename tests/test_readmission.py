"""Re-admission after a recompute preemption (engine/readmission.py): the samples and beams of a
request share their prompt's blocks again, so a preemption does not multiply its memory."""

import pytest
from engine_cases import assert_pool_clean, make_llm

from pagedlearn import SamplingParams
from pagedlearn.core.kv_cache_manager import KVCacheManager
from pagedlearn.engine.readmission import readmission_blocks, share_plan
from pagedlearn.engine.sampling_params import BeamSearchParams
from pagedlearn.engine.scheduler import SchedulerOutput
from pagedlearn.errors import PagedLearnError

PROMPT = list(b"abcdefghijklmnop" * 3)  # 48 tokens: 12 blocks of 4
PARAMS = {
    "samples": SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=12, ignore_eos=True),
    "beams": BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True),
}


def _run(params, caching: bool, preempt_at: int | None, model: str = "tiny-gpt2"):
    """Used blocks after every step, the outputs' tokens, and the tables right after the
    re-admission step, for one request preempted by recompute after step ``preempt_at``."""
    llm = make_llm(model, num_blocks=300, enable_prefix_caching=caching)
    e = llm.engine
    e.add_request("r", PROMPT, params)
    used, tables, out = [], None, None
    while e.has_unfinished_requests():
        for o in e.step():
            out = o
        used.append(e.stats().used_blocks)
        e.kv.check_invariants()
        if e.num_steps == preempt_at:
            e.scheduler._preempt(e.requests["r"], SchedulerOutput())  # as a full pool would
            assert e.stats().used_blocks == 0  # recompute: every block given back
        elif preempt_at is not None and e.num_steps == preempt_at + 1:
            tables = [e.kv.block_table(s) for s in e.requests["r"].seq_ids]
    assert_pool_clean(llm)
    return used, [c.token_ids for c in out.outputs], tables, e.scheduler


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("kind", PARAMS)
def test_a_forked_request_shares_its_prompt_again_after_recompute(kind, caching):
    plain_used, plain_tokens, _, _ = _run(PARAMS[kind], caching, preempt_at=None)
    used, toks, tables, sched = _run(PARAMS[kind], caching, preempt_at=4)
    assert sched.num_preemptions["recompute"] == 1 and sched.num_recomputed_tokens > 0
    assert toks == plain_tokens
    # The step that re-admits it ends holding what the step without preemption held: the
    # prompt's 12 blocks once, shared by every sequence, plus one tail per sequence.
    assert used == plain_used
    assert len(tables) > 1 and all(t[:12] == tables[0][:12] for t in tables)
    assert max(used[4:]) < len(tables) * 12  # independent prefills: a prompt copy per sequence


@pytest.mark.parametrize("kind", PARAMS)
def test_a_hybrid_models_samples_share_again_in_every_group(kind):
    """tiny-gemma3: a full and a sliding-window group; fork_prefix shares in both."""
    plain_used, plain_tokens, _, _ = _run(PARAMS[kind], False, None, "tiny-gemma3")
    used, toks, tables, _ = _run(PARAMS[kind], False, 4, "tiny-gemma3")
    assert toks == plain_tokens
    assert all(t[:12] == tables[0][:12] for t in tables)  # group 0's table: full attention
    # The re-admission prefills every token at once, so a sliding group holds its whole
    # prompt for that step (as a first prefill does): at most a block more per sequence.
    assert max(used) <= max(plain_used) + len(tables)


def test_the_share_plan_keeps_whole_blocks_and_a_last_token_to_compute():
    class S:
        def __init__(self, token_ids):
            self.token_ids = token_ids

    same = [S([1, 2, 3, 4, 5, 6, 7, 8])] * 3
    # identical sequences: share all but the block holding the last token
    assert share_plan(same, 4) == [(None, 0), (0, 4), (0, 4)]
    beams = [S([1, 2, 3, 4, 5, 6]), S([9, 9, 9, 9, 9]), S([9, 9, 9, 9, 1, 2]), S([1, 2, 3])]
    assert share_plan(beams, 2) == [(None, 0), (None, 0), (1, 4), (0, 2)]
    kv = KVCacheManager(num_blocks=16, block_size=2)
    # 3 + 3 + (3 - 2) + (2 - 1) blocks
    assert readmission_blocks(kv, beams) == 3 + 3 + 1 + 1


def test_fork_prefix_refuses_a_partial_block_and_changes_nothing():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.add_sequence("a", list(range(10)))
    before = kv.stats()
    for n in (5, 12, -4, 4.0):
        with pytest.raises(PagedLearnError, match="multiple of block_size 4"):
            kv.fork_prefix("a", "b", n)
    with pytest.raises(PagedLearnError):
        kv.fork_prefix("a", "a", 4)  # the child exists
    assert kv.stats() == before and "b" not in kv
    kv.fork_prefix("a", "b", 8)
    assert kv.block_table("b") == kv.block_table("a")[:2] and kv.num_tokens("b") == 8
    kv.check_invariants()


@pytest.mark.parametrize("caching", [False, True])
def test_recomputed_tokens_are_those_computed_again_and_lookups_stay_apart(caching):
    """A recompute preemption drops 51 tokens' K/V (48 of prompt, 3 sampled and fed). Back, the
    request computes again what the prefix cache does not give back: all 51 without caching,
    3 with it (the prompt's 12 full blocks are found). Its lookup is not a new prompt's: the
    hit rate's counters leave it out, as vLLM's prefix_cache_queries / _hits do."""
    e = make_llm(num_blocks=300, enable_prefix_caching=caching).engine
    e.add_request("r", PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))
    for _ in range(4):
        e.step()
    assert e.kv.num_tokens("r.0") == 51
    e.scheduler._preempt(e.requests["r"], SchedulerOutput())
    e.step()  # re-admitted
    s = e.stats()
    assert s.recomputed_tokens == (3 if caching else 51)
    assert (s.prefix_query_tokens, s.prefix_hit_tokens) == ((48, 0) if caching else (0, 0))
    assert e.kv.stats()["prefix_query_tokens"] == (48 + 52 if caching else 0)  # every lookup
    while e.has_unfinished_requests():
        e.step()
    assert e.stats().recomputed_tokens == s.recomputed_tokens  # counted once


def test_a_window_refuses_to_share_a_prefix_whose_kv_it_freed():
    """fork_prefix would hand the child null entries that its next query still reads."""
    from pagedlearn.hybrid.sliding_window_manager import SlidingWindowManager

    kv = SlidingWindowManager(num_blocks=16, block_size=4, sliding_window=6)
    kv.add_sequence("a", list(range(20)))
    assert kv.remove_skipped_blocks("a", 20) == 3  # blocks 0-2 left the window of position 20
    before = kv.stats()
    with pytest.raises(PagedLearnError, match="still reads"):
        kv.fork_prefix("a", "b", 8)  # a query at 8 reads positions 3..8: blocks 0 and 1
    assert kv.stats() == before and "b" not in kv
    with pytest.raises(PagedLearnError, match="still reads"):
        kv.fork_prefix("a", "b", 16)  # a query at 16 reads 11..16: block 2 too
    kv.fork_prefix("a", "b", 20)  # a query at 20 reads 15..20: the nulls are not needed
    kv.check_invariants()


def test_a_fault_before_the_forward_recomputes_nothing_it_never_computed():
    """Recovery marks only the K/V that existed: a first admission that raised mid-schedule
    had none, so its next admission counts no recomputed token."""
    e = make_llm(num_blocks=300, enable_prefix_caching=False).engine
    e.add_request("a", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))
    e.add_request("b", PROMPT, SamplingParams(max_tokens=3, ignore_eos=True))
    real, calls = e.kv.add_sequence, []

    def add(*args, **kw):
        calls.append(args[0])
        if len(calls) == 2:
            raise RuntimeError("injected")  # b's admission, after a's
        return real(*args, **kw)

    e.kv.add_sequence = add
    with pytest.raises(RuntimeError, match="injected"):
        e.step()
    del e.kv.add_sequence
    while e.has_unfinished_requests():
        e.step()
    assert e.stats().preemptions_recompute == 1 and e.stats().recomputed_tokens == 0
