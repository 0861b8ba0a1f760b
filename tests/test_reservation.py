"""``LLM(..., kv_reservation="max")``: the same engine as an Orca (Max)-style reservation baseline.

Every request sets aside the blocks of ``prompt + max_tokens`` per sequence when it is admitted.
Same tokens as paging; fewer requests at once; never a preemption; too-big requests rejected."""

from __future__ import annotations

import pytest
from engine_cases import assert_pool_clean, greedy, make_llm, tokens

from pagedlearn import BeamSearchParams, SamplingParams
from pagedlearn.engine import RequestRejectedError
from pagedlearn.errors import PagedLearnError

# 10 prompts of 10 tokens, 14 new tokens each: 24 tokens = 6 blocks of 4 per request.
PROMPTS = [[65 + i] * 5 + list(b"abcde") for i in range(10)]
POOL, PER_REQUEST = 24, 6


def run(llm, prompts, params):
    """Generate through the step API, recording every step's stats (and the unreserved blocks)."""
    engine = llm.engine
    seen, unreserved = [], []
    engine.subscribe_stats(seen.append)
    engine.subscribe_stats(lambda s: unreserved.append(engine.scheduler.unreserved_blocks()))
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, seen, unreserved


def test_same_greedy_tokens_fewer_at_once_and_never_a_preemption():
    params = greedy(14)
    paged, paged_steps, _ = run(make_llm(num_blocks=POOL, block_size=4), PROMPTS, params)
    llm = make_llm(num_blocks=POOL, block_size=4, kv_reservation="max")
    held, held_steps, unreserved = run(llm, PROMPTS, params)

    assert tokens(held) == tokens(paged)
    assert all(len(o.outputs[0].token_ids) == 14 for o in held)
    assert max(s.num_running for s in held_steps) == POOL // PER_REQUEST  # 4 reservations fit
    assert min(unreserved) >= 0  # never promised more than the pool holds
    last = llm.engine.stats()
    assert last.preemptions_recompute == last.preemptions_swap == 0
    # Paging takes blocks as tokens arrive: more requests at once, paid for with preemptions.
    assert max(s.num_running for s in paged_steps) > POOL // PER_REQUEST
    assert paged_steps[-1].preemptions_recompute > 0
    assert_pool_clean(llm)


def test_parallel_samples_reserve_for_every_sequence():
    """n=2: 2 x 6 blocks per request, no sharing assumed (as in Orca): 2 requests at a time."""
    llm = make_llm(num_blocks=POOL, block_size=4, kv_reservation="max")
    params = SamplingParams(max_tokens=14, n=2, temperature=0.8, seed=0, ignore_eos=True)
    outs, steps, unreserved = run(llm, PROMPTS[:5], params)
    assert all(len(c.token_ids) == 14 for o in outs for c in o.outputs)
    assert max(s.num_running for s in steps) == POOL // (2 * PER_REQUEST)
    assert max(s.num_running_seqs for s in steps) <= POOL // PER_REQUEST
    assert min(unreserved) >= 0
    assert steps[-1].preemptions_recompute == steps[-1].preemptions_swap == 0
    assert_pool_clean(llm)


def test_reservation_is_capped_at_the_model_length():
    llm = make_llm(num_blocks=POOL, block_size=4, kv_reservation="max")
    reserve = llm.engine.scheduler.reserved_blocks
    assert reserve(10, SamplingParams(max_tokens=14)) == 6
    assert reserve(10, SamplingParams(max_tokens=10_000)) == 512 // 4  # tiny-gpt2: 512 positions
    assert reserve(10, SamplingParams(max_tokens=14, n=3)) == 18  # every sample, no sharing
    assert reserve(10, BeamSearchParams(beam_width=3, max_tokens=14)) == 18  # every beam
    paged = make_llm(num_blocks=POOL, block_size=4).engine.scheduler
    assert paged.reserved_blocks(10, SamplingParams(max_tokens=10_000)) == 0  # paging reserves 0


def test_a_reservation_larger_than_the_pool_is_rejected_and_the_others_run():
    llm = make_llm(num_blocks=POOL, block_size=4, kv_reservation="max")
    too_big = SamplingParams(max_tokens=100, ignore_eos=True)  # 110 tokens: 28 blocks > 24
    with pytest.raises(RequestRejectedError, match=r"kv_reservation='max' reserves .*28 blocks"):
        llm.engine.add_request("big", PROMPTS[0], too_big)
    assert not llm.engine.has_unfinished_requests()  # nothing was queued
    outs = llm.generate(PROMPTS[:2], [too_big, greedy(14)], use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and "whole pool of 24" in outs[0].error
    assert len(outs[1].outputs[0].token_ids) == 14
    assert_pool_clean(llm)


def test_a_bad_option_value_is_named():
    with pytest.raises(PagedLearnError, match=r"kv_reservation must be one of .*'contiguous'"):
        make_llm(kv_reservation="contiguous")
