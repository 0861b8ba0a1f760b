"""The PyTorch references: each one equals the one before it, and the first equals torch's SDPA."""

import re

import pytest
import torch
from paged_cases import assert_close, context_lens_for, make_case, make_queries

from pagedlearn.attention import (
    contiguous_attention,
    gather_kv,
    paged_attention_batched,
    paged_attention_online_softmax_ref,
    paged_attention_prefill_ref,
    paged_attention_ref,
    write_kv_ref,
)
from pagedlearn.errors import AttentionInputError, PagedLearnError

sdpa = torch.nn.functional.scaled_dot_product_attention


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2)])
def test_contiguous_attention_is_sdpa(heads, kv_heads):
    q, k, v = (torch.randn(n, h, 16) for n, h in ((6, heads), (6, kv_heads), (6, kv_heads)))
    group = heads // kv_heads
    expected = sdpa(  # q_len == kv_len: top-left and bottom-right causal alignment agree
        q.transpose(0, 1),
        k.repeat_interleave(group, 1).transpose(0, 1),
        v.repeat_interleave(group, 1).transpose(0, 1),
        is_causal=True,
    ).transpose(0, 1)
    torch.testing.assert_close(contiguous_attention(q, k, v), expected)


def test_causal_mask_is_bottom_right_aligned():
    # 2 new queries after 3 cached keys: query 0 sees keys 0..3, query 1 sees keys 0..4.
    q = torch.zeros(2, 1, 4)
    v = torch.arange(5.0)[:, None, None].expand(5, 1, 4)
    out = contiguous_attention(q, torch.zeros(5, 1, 4), v)  # equal scores: mean of visible values
    assert out[:, 0, 0].tolist() == [1.5, 2.0]


def test_no_keys_gives_zeros():
    q = torch.randn(1, 2, 4)
    assert torch.equal(contiguous_attention(q, torch.zeros(0, 2, 4), torch.zeros(0, 2, 4)), q * 0)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(12, 12), (8, 2)])
def test_paged_reference_equals_attention_on_the_gathered_sequence(block_size, heads, kv_heads):
    lens = context_lens_for(block_size)
    case = make_case(lens, block_size, kv_heads, 32)
    q = make_queries(len(lens), heads, 32)
    out = paged_attention_ref(q, case.key_cache, case.value_cache, case.block_tables,
                              case.context_lens)  # fmt: skip
    for i in range(len(lens)):
        k, v = gather_kv(case.key_cache, case.value_cache, case.block_tables[i], lens[i])
        assert torch.equal(k, case.keys[i]) and torch.equal(v, case.values[i])
        assert_close(out[i], contiguous_attention(q[i : i + 1], k, v)[0])
    assert not out.isnan().any()  # no poison (unused slots are NaN) was read


@pytest.mark.parametrize("num_splits", [1, 2, 3, 64])  # 64 > blocks: most splits are empty
def test_online_softmax_loop_equals_the_paged_reference(num_splits):
    lens = [1, 15, 17, 100, 0]
    case = make_case(lens, 16, 2, 32)
    q = make_queries(len(lens), 4, 32)
    args = (q, case.key_cache, case.value_cache, case.block_tables, case.context_lens)
    out = paged_attention_online_softmax_ref(*args, num_splits=num_splits)
    assert_close(out, paged_attention_ref(*args))
    assert torch.equal(out[-1], torch.zeros_like(out[-1]))  # no keys -> zeros, not NaN


def test_prefill_reference_sees_the_cached_prefix_and_is_causal():
    lens, q_lens = [1, 20, 40], [1, 20, 5]  # no prefix, no prefix, 35 cached tokens
    case = make_case(lens, 16, 2, 32)
    q = make_queries(sum(q_lens), 4, 32)
    cu = torch.tensor([0, 1, 21, 26], dtype=torch.int32)
    out = paged_attention_prefill_ref(
        q, case.key_cache, case.value_cache, case.block_tables, cu, case.context_lens
    )
    for i in range(3):
        expected = contiguous_attention(q[cu[i] : cu[i + 1]], case.keys[i], case.values[i])
        assert_close(out[cu[i] : cu[i + 1]], expected)
    # Each sequence's last query is a decode step over the whole context.
    last = cu[1:] - 1
    decode = paged_attention_ref(
        q[last], case.key_cache, case.value_cache, case.block_tables, case.context_lens
    )
    assert_close(out[last], decode)


def test_write_kv_reference_fills_slots_and_skips_negative_ones():
    key_cache, value_cache = torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 8)
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    write_kv_ref(key, value, key_cache, value_cache, torch.tensor([9, -1, 0]))
    assert torch.equal(key_cache[2, 1], key[0]) and torch.equal(value_cache[0, 0], value[2])
    assert int((key_cache != 0).any(-1).any(-1).sum()) == 2  # only two slots written


def _decode_args():
    case = make_case([5, 9], 4, 2, 8)
    return [make_queries(2, 4, 8), case.key_cache, case.value_cache, case.block_tables,
            case.context_lens]  # fmt: skip


@pytest.mark.parametrize(
    ("position", "bad", "message"),
    [
        (0, torch.randn(2, 4), "q must have 3 dimensions"),
        (0, torch.randn(2, 3, 8), "not a multiple of the cache's 2 KV heads"),
        (0, torch.randn(2, 4, 16), "q has head_dim 16"),
        (0, torch.randn(2, 4, 8, dtype=torch.float64), "q must be one of"),
        (1, torch.randn(8, 4, 2, 8, dtype=torch.float16), "share one dtype"),
        (2, torch.randn(8, 4, 2, 9), "value_cache has shape"),
        (3, torch.zeros(2, 3), "block_tables must be one of"),
        (3, torch.zeros(3, 3, dtype=torch.int32), "block_tables has 3 rows"),
        (3, torch.tensor([[0, 1, 2], [3, 99, 4]], dtype=torch.int32), "uses block 99"),
        (4, torch.tensor([5, 13], dtype=torch.int32), "context_lens[1] = 13"),
        (4, torch.tensor([5, -1], dtype=torch.int32), "context_lens[1] = -1"),
    ],
)
def test_references_name_the_bad_argument(position, bad, message):
    args = _decode_args()
    args[position] = bad
    for fn in (paged_attention_ref, paged_attention_online_softmax_ref):
        with pytest.raises(AttentionInputError, match=re.escape(message)) as info:
            fn(*args)
        assert isinstance(info.value, ValueError) and isinstance(info.value, PagedLearnError)


def test_bad_scale_and_splits_are_refused():
    with pytest.raises(ValueError, match="scale must be a positive number"):
        paged_attention_ref(*_decode_args(), scale=-1.0)
    with pytest.raises(ValueError, match="num_splits must be a positive int"):
        paged_attention_online_softmax_ref(*_decode_args(), num_splits=0)


def test_prefill_reference_refuses_queries_longer_than_their_context():
    case = make_case([3], 4, 1, 8)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(AttentionInputError, match="5 query tokens but context_lens"):
        paged_attention_prefill_ref(
            make_queries(5, 1, 8), case.key_cache, case.value_cache, case.block_tables, cu,
            case.context_lens,
        )  # fmt: skip


def test_write_kv_reference_refuses_duplicate_or_out_of_range_slots_and_writes_nothing():
    key_cache, value_cache = torch.zeros(2, 4, 1, 8), torch.zeros(2, 4, 1, 8)
    key = torch.randn(2, 1, 8)
    for slots, message in (([3, 3], "same slot"), ([1, 8], "past the cache's 8 slots")):
        with pytest.raises(AttentionInputError, match=message):
            write_kv_ref(key, key, key_cache, value_cache, torch.tensor(slots))
        assert not key_cache.any() and not value_cache.any()


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2)])
def test_batched_decode_equals_the_per_sequence_reference(num_heads, num_kv_heads):
    """One gather for all sequences, masked: equal to the loop, NaN in unused slots ignored,
    padding of -1 in the tables ignored, an empty sequence gives zeros."""
    case = make_case([5, 1, 37, 16, 0], block_size=4, num_kv_heads=num_kv_heads, head_dim=16)
    q = make_queries(5, num_heads, 16)
    tables = case.block_tables.clone()  # padded with out-of-range ids ...
    tables[1, 1:] = -1  # ... or with -1, as the engine pads them
    want = paged_attention_ref(q, case.key_cache, case.value_cache, tables, case.context_lens)
    got = paged_attention_batched(q, case.key_cache, case.value_cache, tables, case.context_lens)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not got[4].any()
