"""The engine's torch backend (attention/sdpa.py) against the readable references
(attention/references.py).

Random paged caches from ``paged_cases`` (shuffled blocks, NaN in every unused slot, padding
table entries out of range or -1): decode, prefill with and without a cached prefix, chunked
prefill next to decodes, GQA, sliding windows, empty sequences; and the whole engine run twice,
once per backend, step by step.
"""

from __future__ import annotations

import copy

import pytest
import torch
from paged_cases import TOL, assert_close, make_case, make_queries

from pagedlearn.attention import (
    paged_attention_batched,
    paged_attention_prefill_ref,
    paged_attention_ref,
    write_kv_ref,
)
from pagedlearn.attention.inputs import first_visible_key
from pagedlearn.attention.sdpa import (
    attend,
    paged_attention_decode_sdpa,
    paged_attention_prefill_sdpa,
    plan_attention,
    write_kv_flat,
    write_kv_planned,
)
from pagedlearn.errors import AttentionInputError

WINDOWS = [None, 1, 5, 19]
HEADS = [(4, 4), (8, 2), (3, 1)]  # (num_heads, num_kv_heads): MHA, GQA, MQA


def free_before_window(case, query_lens, window):
    """Set to -1 the table entries a sliding window freed: blocks before the earliest query's
    first visible key, as the KV-cache manager leaves them."""
    bs = case.key_cache.shape[1]
    for i, (n, q) in enumerate(zip(case.context_lens.tolist(), query_lens, strict=True)):
        first = first_visible_key(n - q, window) // bs
        case.block_tables[i, :first] = -1


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize(("heads", "kv_heads"), HEADS)
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_decode_matches_the_references(block_size, heads, kv_heads, window):
    lens = [1, 3, block_size + 1, 37, 80, 2 * block_size]
    case = make_case(lens, block_size, kv_heads, 8, seed=block_size + heads)
    free_before_window(case, [1] * len(lens), window)
    q = make_queries(len(lens), heads, 8, seed=3)
    args = (q, case.key_cache, case.value_cache, case.block_tables, case.context_lens)
    got = paged_attention_decode_sdpa(*args, sliding_window=window)
    assert_close(got, paged_attention_ref(*args, sliding_window=window))
    assert_close(got, paged_attention_batched(*args, sliding_window=window))
    assert not got.isnan().any()


def prefill_case(context_lens, query_lens, block_size, heads, kv_heads, window, dtype, seed=0):
    case = make_case(context_lens, block_size, kv_heads, 16, dtype, seed=seed)
    free_before_window(case, query_lens, window)
    q = make_queries(sum(query_lens), heads, 16, dtype, seed=seed + 1)
    cu = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, case.key_cache, case.value_cache, case.block_tables, cu, case.context_lens


PREFILLS = {  # (context_lens, query_lens)
    "whole prompts": ([5, 17, 40], [5, 17, 40]),
    "cached prefixes": ([20, 33, 64], [4, 1 + 16, 48]),
    "chunked next to decodes": ([50, 9, 130, 7, 71], [1, 9, 16, 1, 1]),
    "one prompt, one token": ([1], [1]),
    "a sequence without queries": ([12, 30], [0, 6]),
    "many lengths, many batches": ([3, 40, 9, 70, 33, 2, 21], [3, 5, 9, 17, 33, 2, 1]),
}


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize(("heads", "kv_heads"), HEADS)
@pytest.mark.parametrize("which", PREFILLS)
def test_prefill_matches_the_reference(which, heads, kv_heads, window):
    args = prefill_case(*PREFILLS[which], 4, heads, kv_heads, window, torch.float32)
    got = paged_attention_prefill_sdpa(*args, sliding_window=window)
    assert_close(got, paged_attention_prefill_ref(*args, sliding_window=window))
    assert not got.isnan().any()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_computes_in_float32_like_the_references(dtype):
    args = prefill_case([20, 33, 9], [4, 17, 1], 4, 8, 2, None, dtype)
    got = paged_attention_prefill_sdpa(*args)
    assert got.dtype == dtype
    assert_close(got, paged_attention_prefill_ref(*args))


def test_a_sequence_without_keys_gets_zeros_whatever_the_cache_holds():
    case = make_case([0, 6, 0], 4, 2, 8)  # every unused slot holds NaN
    q = make_queries(3, 4, 8)
    args = (q, case.key_cache, case.value_cache, case.block_tables, case.context_lens)
    got = paged_attention_decode_sdpa(*args)
    assert_close(got, paged_attention_ref(*args))
    assert got[0].eq(0).all() and got[2].eq(0).all()


def test_sequences_without_keys_read_nothing_even_when_every_slot_is_nan():
    case = make_case([0, 0], 4, 2, 8)  # no sequence holds a block: every slot is NaN
    args = (make_queries(2, 4, 8), case.key_cache, case.value_cache, case.block_tables)
    assert paged_attention_decode_sdpa(*args, case.context_lens).eq(0).all()


@pytest.mark.parametrize("window", [3, 6])
def test_keys_before_the_window_are_never_read(window):
    """The first visible block also holds keys before the window: poisoned, they must not leak."""
    lens, bs = [9, 23, 40], 4
    case = make_case(lens, bs, 2, 8)
    for i, n in enumerate(lens):
        first = first_visible_key(n - 1, window)
        block = case.block_tables[i, first // bs]
        case.key_cache[block, : first % bs] = float("nan")
        case.value_cache[block, : first % bs] = float("nan")
    q = make_queries(len(lens), 4, 8)
    args = (q, case.key_cache, case.value_cache, case.block_tables, case.context_lens)
    got = paged_attention_decode_sdpa(*args, sliding_window=window)
    assert_close(got, paged_attention_ref(*args, sliding_window=window))


def test_no_sequences_at_all():
    case = make_case([3], 4, 2, 8)
    q = torch.empty(0, 4, 8)
    tables, lens = case.block_tables[:0], case.context_lens[:0]
    args = (q, case.key_cache, case.value_cache, tables, lens)
    assert paged_attention_decode_sdpa(*args).shape == (0, 4, 8)
    cu = torch.zeros(1, dtype=torch.int32)
    args = (q, case.key_cache, case.value_cache, tables, cu, lens)
    assert paged_attention_prefill_sdpa(*args).shape == (0, 4, 8)


def test_one_plan_serves_every_layer():
    """The engine plans once per step and passes the plan to each layer's caches."""
    q, kc, vc, tables, cu, lens = prefill_case([50, 9, 40], [1, 9, 16], 4, 4, 2, 5, torch.float32)
    plan = plan_attention(tables, lens, cu, 4, 5)
    assert [b.mask.shape[2] for b in plan.batches] == [1, 16]  # decodes; 9 and 16 padded to 16
    for layer in range(3):
        k2, v2 = kc * (layer + 1), vc.flip(-1)  # another layer's caches, same tables
        got = attend(q, k2, v2, plan)
        assert_close(
            got, paged_attention_prefill_ref(q, k2, v2, tables, cu, lens, sliding_window=5)
        )


@pytest.mark.parametrize("slots", [[5, 0, 17, 9], [3, -1, 12, -1], [-1, -1, -1, -1], []])
def test_write_matches_the_reference(slots):
    caches = [torch.full((6, 4, 2, 8), float("nan")) for _ in range(4)]
    key, value = torch.randn(len(slots), 2, 8), torch.randn(len(slots), 2, 8)
    mapping = torch.tensor(slots, dtype=torch.int64)
    write_kv_flat(key, value, caches[0], caches[1], mapping)
    write_kv_ref(key, value, caches[2], caches[3], mapping)
    torch.testing.assert_close(caches[0], caches[2], equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(caches[1], caches[3], equal_nan=True, atol=0, rtol=0)


@pytest.mark.parametrize("slots", [[5, 0, 17, 9], [3, -1, 12, -1], [-1, -1, -1, -1]])
def test_the_planned_write_skips_the_same_slots(slots):
    """The engine plans its slots once per step (negative ones dropped), then writes per layer."""
    caches = [torch.full((6, 4, 2, 8), float("nan")) for _ in range(4)]
    key, value = torch.randn(len(slots), 2, 8), torch.randn(len(slots), 2, 8)
    mapping = torch.tensor(slots, dtype=torch.int64)
    one = torch.ones(1, 1, dtype=torch.int32)
    plan = plan_attention(one, one[0], torch.tensor([0, 1]), 4, slot_mapping=mapping)
    write_kv_planned(key, value, caches[0], caches[1], plan)
    write_kv_ref(key, value, caches[2], caches[3], mapping)
    torch.testing.assert_close(caches[0], caches[2], equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(caches[1], caches[3], equal_nan=True, atol=0, rtol=0)


@pytest.mark.parametrize("slots", [[0, 24], [3, 3]])
def test_bad_writes_are_refused_like_the_reference_and_change_nothing(slots):
    caches = [torch.zeros(6, 4, 2, 8) for _ in range(2)]
    key = torch.randn(2, 2, 8)
    mapping = torch.tensor(slots)
    with pytest.raises(AttentionInputError) as ref_error:
        write_kv_ref(key, key, *caches, mapping)
    with pytest.raises(AttentionInputError) as error:
        write_kv_flat(key, key, *caches, mapping)
    assert str(error.value) == str(ref_error.value)
    assert caches[0].eq(0).all() and caches[1].eq(0).all()


def test_a_non_contiguous_cache_is_refused_rather_than_copied():
    cache = torch.zeros(4, 6, 2, 8).transpose(0, 1)  # (6, 4, 2, 8), not contiguous
    with pytest.raises(AttentionInputError, match="contiguous"):
        write_kv_flat(torch.ones(1, 2, 8), torch.ones(1, 2, 8), cache, cache, torch.tensor([0]))


def test_bad_inputs_are_refused_with_the_references_messages():
    q, kc, vc, tables, cu, lens = prefill_case([10, 20], [4, 5], 4, 4, 2, None, torch.float32)
    bad_cu = torch.tensor([0, 4, 8], dtype=torch.int32)  # 8 rows, but q has 9
    bad_lens = torch.tensor([3, 20], dtype=torch.int32)  # 4 queries, only 3 keys
    for args in [(q, kc, vc, tables, bad_cu, lens), (q, kc, vc, tables, cu, bad_lens)]:
        with pytest.raises(AttentionInputError) as ref_error:
            paged_attention_prefill_ref(*args)
        with pytest.raises(AttentionInputError) as error:
            paged_attention_prefill_sdpa(*args)
        assert str(error.value) == str(ref_error.value)


# --- the whole engine, both backends, step by step ------------------------------------------


def twin_checked(llm):
    """Make every step also run on the "reference" backend, on a copy of the KV cache taken
    before the step; the logits and the caches written must agree. Returns the step count."""
    from pagedlearn.models.runner import ModelRunner

    runner = llm.engine.runner
    execute, steps = runner.execute, []

    def both(seqs):
        twin = copy.copy(runner.kv_cache)
        twin.slab = runner.kv_cache.slab.clone()
        want = ModelRunner(runner.model, twin, backend="reference").execute(seqs)
        got = execute(seqs)
        atol, rtol = TOL[torch.float32]
        torch.testing.assert_close(got, want, atol=atol * 10, rtol=rtol * 10)
        torch.testing.assert_close(runner.kv_cache.slab, twin.slab, atol=1e-5, rtol=1e-5)
        steps.append(max(len(s.new_tokens) for s in seqs))
        return got

    runner.execute = both
    return steps


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-opt", "tiny-mistral", "tiny-gemma3"])
def test_the_engine_computes_the_same_logits_on_both_backends(name):
    from engine_cases import PROMPTS, SYSTEM, greedy, make_llm

    llm = make_llm(name, attention_backend="torch", max_num_batched_tokens=24, max_num_seqs=8)
    steps = twin_checked(llm)
    prompts = [SYSTEM + p for p in PROMPTS] + PROMPTS  # shared prefixes: prefix-cache hits
    llm.generate(prompts, greedy(30), use_tqdm=False)  # 30 tokens: past tiny windows of 24
    assert max(steps) > 1 and 1 in steps  # prefill steps (chunked: 24 tokens) and decode steps


def test_llm_runs_the_references_as_the_reference_backend():
    """``LLM(attention_backend="reference")`` serves a model on pagedlearn.attention's readable
    functions (the ones to step through), and greedy tokens agree with the default backend."""
    from pagedlearn import LLM, SamplingParams

    params = SamplingParams(max_tokens=6)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17]]
    outs = {}
    for backend in ("reference", "torch"):
        llm = LLM("tiny-gpt2", block_size=4, attention_backend=backend, verbose=False)
        assert llm.attention_backend == backend
        got = llm.generate(prompts, params, use_tqdm=False)
        outs[backend] = [list(o.outputs[0].token_ids) for o in got]
    assert outs["reference"] == outs["torch"]
