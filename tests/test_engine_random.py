"""Random workloads through the engine: whatever the pool size, block size, preemption mode,
step budget (small budgets prefill prompts in chunks) and abort, every step keeps the pool's
invariants, every request that was not aborted gets the same tokens as on a pool large enough
for all of them, and the pool ends all-free."""

from __future__ import annotations

import functools

import pytest

pytest.importorskip("hypothesis")  # a bare GPU box may lack it; the dev install has it

from engine_cases import assert_pool_clean, make_llm
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedlearn import BeamSearchParams, SamplingParams


@st.composite
def workloads(draw):
    requests = []
    for i in range(draw(st.integers(2, 5))):
        prompt = draw(st.lists(st.integers(0, 255), min_size=1, max_size=40))
        max_tokens = draw(st.integers(1, 12))
        kind = draw(st.sampled_from(["greedy", "sample", "beam"]))
        if kind == "greedy":
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=draw(st.booleans()))
        elif kind == "sample":
            params = SamplingParams(
                max_tokens=max_tokens, temperature=1.0, seed=i, n=draw(st.integers(1, 3))
            )
        else:
            params = BeamSearchParams(beam_width=draw(st.integers(1, 3)), max_tokens=max_tokens)
        requests.append((f"r{i}", tuple(prompt), params))
    abort = draw(
        st.one_of(st.none(), st.tuples(st.integers(0, len(requests) - 1), st.integers(1, 6)))
    )
    return requests, abort


def run(requests, abort=None, check=False, **kw):
    llm = make_llm(**kw)
    engine, outs = llm.engine, {}
    for rid, prompt, params in requests:
        engine.add_request(rid, list(prompt), params)
    step = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
        step += 1
        if check:
            engine.kv.check_invariants()
        if abort and step == abort[1]:
            rid = requests[abort[0]][0]
            if engine.abort_request(rid) is not None:
                outs.pop(rid, None)
    assert_pool_clean(llm)
    return {rid: [o.token_ids for o in out.outputs] for rid, out in outs.items()}, engine


@functools.cache
def reference(requests):
    return run(requests, num_blocks=1024, block_size=16)[0]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    workload=workloads(),
    block_size=st.sampled_from([1, 2, 4, 16]),
    mode=st.sampled_from(["recompute", "swap"]),
    caching=st.booleans(),
    tight=st.floats(0.0, 1.0),
    step_tokens=st.sampled_from([9, 16, 2048]),  # small budgets: prompts go in chunks
)
def test_random_workloads_give_the_same_tokens_on_any_pool(
    workload, block_size, mode, caching, tight, step_tokens
):
    requests, abort = workload
    requests = tuple(requests)
    # The pool: from what the largest request needs alone (every sample or beam at full length)
    # up to what all of them need together, so preemption happens in many examples.
    need = [p.n * -(-(len(prompt) + p.max_tokens) // block_size) for _, prompt, p in requests]
    low, high = max(need) + 1, sum(need) + 1
    num_blocks = int(low + tight * (high - low))
    got, engine = run(
        requests,
        abort,
        check=True,
        num_blocks=num_blocks,
        block_size=block_size,
        preemption_mode=mode,
        enable_prefix_caching=caching,
        max_num_batched_tokens=step_tokens,
        max_num_seqs=9,
    )
    want = reference(requests)
    aborted = requests[abort[0]][0] if abort else None
    for rid, tokens in want.items():
        if rid != aborted:
            assert got[rid] == tokens, (rid, engine.last_stats)
