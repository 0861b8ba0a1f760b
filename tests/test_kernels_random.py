"""Property test: the kernels equal the references on random shapes hypothesis picks.

Odd block sizes (1 to 40), head dims that are not powers of two, empty sequences, prefixes of any
length and any split count. It lives apart from ``test_kernels.py`` so that a GPU machine with only
pytest installed can still run that file.
"""

import pytest
import torch
from paged_cases import DEVICE, assert_close, decode_both, make_case, make_queries

from kernels import paged_attention_prefill
from pagedlearn.attention import paged_attention_prefill_ref

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies


@hypothesis.settings(max_examples=25, deadline=None)
@hypothesis.given(
    lens=st.lists(st.integers(0, 80), min_size=1, max_size=3),
    block_size=st.integers(1, 40),
    group=st.sampled_from([(2, 2), (4, 1), (6, 2)]),
    head_dim=st.sampled_from([16, 24, 32]),
    num_splits=st.integers(1, 5),
    seed=st.integers(0, 2**16),
)
def test_decode_and_prefill_on_random_shapes(lens, block_size, group, head_dim, num_splits, seed):
    """Odd block sizes and head dims, empty sequences, any split count: all equal the reference."""
    heads, kv_heads = group
    out, ref = decode_both(lens, block_size, heads, kv_heads, head_dim, torch.float32,
                           num_splits=num_splits, seed=seed)  # fmt: skip
    assert_close(out, ref)
    case = make_case(lens, block_size, kv_heads, head_dim, seed=seed)
    q_lens = [min(n, 1 + seed % 7) for n in lens]  # a few new tokens after a cached prefix
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = make_queries(sum(q_lens), heads, head_dim, seed=seed)
    args = (q, case.key_cache, case.value_cache, case.block_tables, cu.to(DEVICE),
            case.context_lens)  # fmt: skip
    assert_close(paged_attention_prefill(*args), paged_attention_prefill_ref(*args))
