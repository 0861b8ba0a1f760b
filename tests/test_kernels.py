"""The Triton kernels against the PyTorch references, over the matrix the issue asks for.

Without a GPU these run in Triton's CPU interpreter (``conftest.py`` sets ``TRITON_INTERPRET=1``);
with one they compile and run on it. The interpreter is slow, so shapes stay small and the long
cases are marked ``slow`` (``make test-all`` runs them).
"""

import pytest
import torch
from paged_cases import (
    DEVICE,
    assert_close,
    context_lens_for,
    decode_both,
    make_case,
    make_queries,
)

from kernels import paged_attention_decode, paged_attention_prefill, write_kv
from pagedlearn import KVCacheManager
from pagedlearn.attention import (
    contiguous_attention,
    paged_attention_prefill_ref,
    paged_attention_ref,
    write_kv_ref,
)

HEADS = [(12, 12), (8, 2)]  # GPT-2/OPT-style multi-head, and grouped-query (4 heads per KV head)
DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads"), HEADS)
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_decode_matches_reference(block_size, heads, kv_heads, dtype):
    out, ref = decode_both(context_lens_for(block_size), block_size, heads, kv_heads, 64, dtype)
    assert out.dtype == dtype and out.shape == ref.shape
    assert_close(out, ref)  # NaN poison in unused slots would fail this


@pytest.mark.parametrize(
    ("block_size", "head_dim", "dtype"),
    [
        (16, 128, torch.float16),  # the larger head_dim of many models
        (5, 80, torch.float32),  # neither a power of two: tiles span blocks, head_dim is padded
        (16, 64, torch.bfloat16),  # interpreter: upcast to float32; GPU: native bf16
    ],
)
def test_decode_matches_reference_for_other_shapes(block_size, head_dim, dtype):
    out, ref = decode_both([1, 7, 40], block_size, 8, 2, head_dim, dtype)
    assert_close(out, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [2, 3, 8])
def test_split_kv_equals_single_pass(num_splits, dtype):
    lens = [1, 15, 17, 300]  # with 8 splits, the short sequences leave most splits empty
    single, ref = decode_both(lens, 16, 8, 2, 64, dtype, num_splits=1)
    split, _ = decode_both(lens, 16, 8, 2, 64, dtype, num_splits=num_splits)
    atol = 1e-6 if dtype == torch.float32 else 2e-3  # only the summation order differs
    torch.testing.assert_close(split.float(), single.float(), atol=atol, rtol=atol)
    assert_close(split, ref)


def test_decode_of_a_sequence_without_keys_is_zeros():
    for num_splits in (1, 4):
        out, _ = decode_both([0, 3], 4, 2, 2, 16, torch.float32, num_splits=num_splits)
        assert torch.equal(out[0], torch.zeros_like(out[0])) and not out.isnan().any()


def prefill_case(prefix_and_query, block_size, heads, kv_heads, dtype, seed=0):
    """Sequences given as (cached prefix length, new query tokens); returns both results."""
    lens = [p + n for p, n in prefix_and_query]
    case = make_case(lens, block_size, kv_heads, 64, dtype, seed=seed)
    q_lens = torch.tensor([n for _, n in prefix_and_query])
    cu = torch.cat([torch.zeros(1), q_lens.cumsum(0)]).to(torch.int32).to(DEVICE)
    q = make_queries(int(q_lens.sum()), heads, 64, dtype, seed=seed + 1)
    args = (q, case.key_cache, case.value_cache, case.block_tables, cu, case.context_lens)
    return paged_attention_prefill(*args), paged_attention_prefill_ref(*args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads"), HEADS)
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_prefill_matches_reference(block_size, heads, kv_heads, dtype):
    sequences = [
        (0, 1),  # a one-token prompt
        (0, block_size + 1),  # a prompt with nothing cached
        (35, 5),  # a prefix-cache hit: 35 cached tokens, 5 new ones
        (60, 70),  # more new tokens than one tile of queries (32)
        (299, 1),  # a decode step, through the prefill kernel
    ]
    out, ref = prefill_case(sequences, block_size, heads, kv_heads, dtype)
    assert out.dtype == dtype
    assert_close(out, ref)


def test_prefill_in_bfloat16():
    out, ref = prefill_case([(0, 9), (20, 3)], 16, 8, 2, torch.bfloat16)
    assert_close(out, ref)


def test_prefill_last_query_equals_decode():
    out, _ = prefill_case([(10, 6), (33, 2)], 16, 8, 2, torch.float32, seed=3)
    case = make_case([16, 35], 16, 2, 64, seed=3)
    q = make_queries(8, 8, 64, seed=4)[[5, 7]]
    decode = paged_attention_decode(
        q, case.key_cache, case.value_cache, case.block_tables, case.context_lens
    )
    assert_close(out[[5, 7]], decode)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_write_kv_equals_the_reference_and_skips_padding(dtype):
    num_blocks, block_size, kv_heads, head_dim = 6, 16, 2, 64
    caches = [torch.randn(num_blocks, block_size, kv_heads, head_dim).to(dtype) for _ in range(2)]
    qkv = torch.randn(10, 3, kv_heads, head_dim).to(dtype)  # K and V are strided views of this
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.randperm(num_blocks * block_size)[:10]
    slots[[2, 7]] = -1  # padding
    k_ref, v_ref = (c.clone() for c in caches)
    write_kv_ref(key, value, k_ref, v_ref, slots)
    k_out, v_out = (c.clone().to(DEVICE) for c in caches)
    write_kv(key.to(DEVICE), value.to(DEVICE), k_out, v_out, slots.to(DEVICE))
    assert torch.equal(k_out.cpu(), k_ref) and torch.equal(v_out.cpu(), v_ref)
    assert not torch.equal(k_ref, caches[0])  # something was written


@pytest.mark.parametrize(("heads", "kv_heads"), HEADS)
def test_write_kv_then_decode_over_a_managers_blocks(heads, kv_heads):
    """The whole path: the KVCacheManager picks blocks, write_kv fills them, decode reads them."""
    block_size, head_dim, prompts = 16, 64, [40, 3, 17]
    kv = KVCacheManager(num_blocks=12, block_size=block_size)
    for seq_id, n in enumerate(prompts):
        kv.add_sequence(seq_id, list(range(n)))
    shape = (12, block_size, kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), device=DEVICE)
    value_cache = torch.full(shape, float("nan"), device=DEVICE)
    keys = [torch.randn(n, kv_heads, head_dim, device=DEVICE) for n in prompts]
    values = [torch.randn(n, kv_heads, head_dim, device=DEVICE) for n in prompts]
    slots = torch.tensor([slot for s in range(3) for slot in kv.slot_mapping(s)], device=DEVICE)
    write_kv(torch.cat(keys), torch.cat(values), key_cache, value_cache, slots)

    width = max(len(kv.block_table(s)) for s in range(3))
    tables = [kv.block_table(s) + [-1] * (width - len(kv.block_table(s))) for s in range(3)]
    block_tables = torch.tensor(tables, dtype=torch.int32, device=DEVICE)
    context_lens = torch.tensor(prompts, dtype=torch.int32, device=DEVICE)
    q = make_queries(3, heads, head_dim)
    out = paged_attention_decode(q, key_cache, value_cache, block_tables, context_lens)
    for s in range(3):
        assert_close(out[s], contiguous_attention(q[s : s + 1], keys[s], values[s])[0])


@pytest.mark.slow
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_long_contexts_and_head_dim_128(block_size):
    for heads, kv_heads in HEADS:
        out, ref = decode_both([1000, 2049], block_size, heads, kv_heads, 128, torch.float16)
        assert_close(out, ref)
        split, _ = decode_both([1000, 2049], block_size, heads, kv_heads, 128, torch.float16, 4)
        assert_close(split, ref)


def test_offsets_past_2_to_the_31_elements():
    """A block id times the block stride passes 2**31 here: int32 offsets would wrap around.

    Cache: 1,048,600 blocks x 16 slots x 1 head x 128 = 2**31 + a bit elements per cache (4 GiB in
    fp16). The sequence's blocks are the last ones, past the wrap-around point. On a CPU the
    memory is only reserved (torch.empty; the interpreter touches just the pages it reads), so
    this is cheap. A kernel that multiplies in int32 reads far outside the cache and crashes.
    """
    num_blocks, block_size, head_dim = 1_048_600, 16, 128
    assert (num_blocks - 1) * block_size * head_dim > 2**31
    shape = (num_blocks, block_size, 1, head_dim)
    key_cache = torch.empty(shape, dtype=torch.float16, device=DEVICE)
    value_cache = torch.empty(shape, dtype=torch.float16, device=DEVICE)
    n = 40  # three blocks: the last three of the cache, in reverse order
    key, value = (torch.randn(n, 1, head_dim, dtype=torch.float16, device=DEVICE) for _ in "kv")
    table = [num_blocks - 1, num_blocks - 2, num_blocks - 3]
    slots = torch.tensor([table[t // block_size] * block_size + t % block_size for t in range(n)])
    write_kv(key, value, key_cache, value_cache, slots.to(DEVICE))
    q = make_queries(1, 2, head_dim, torch.float16)
    block_tables = torch.tensor([table], dtype=torch.int32, device=DEVICE)
    context_lens = torch.tensor([n], dtype=torch.int32, device=DEVICE)
    out = paged_attention_decode(q, key_cache, value_cache, block_tables, context_lens)
    assert_close(out[0], contiguous_attention(q, key, value)[0])
    cu = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    prefill = paged_attention_prefill(q, key_cache, value_cache, block_tables, cu, context_lens)
    assert_close(prefill[0], out[0])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_matches_the_cpu_reference(dtype):
    """On a real GPU: bf16 natively, and fp32 with input_precision="ieee" (not TF32) to 1e-5."""
    out, _ = decode_both([1, 17, 300], 16, 8, 2, 64, dtype)
    case = make_case([1, 17, 300], 16, 2, 64, dtype)
    q = make_queries(3, 8, 64, dtype)
    cpu = paged_attention_ref(
        *(t.cpu() for t in (q, case.key_cache, case.value_cache, case.block_tables)),
        case.context_lens.cpu(),
    )
    assert_close(out.cpu(), cpu)


def test_strided_views_of_the_inputs_give_the_same_result():
    """Views taken out of bigger tensors (as an engine does) must not be read as if dense."""
    lens = [5, 40, 17]
    case = make_case(lens, 16, 2, 64)
    q = make_queries(3, 8, 64)
    expected = paged_attention_decode(
        q, case.key_cache, case.value_cache, case.block_tables, case.context_lens
    )
    wide = torch.stack([case.block_tables, case.block_tables * 0 - 5], dim=-1)  # interleaved junk
    lens_2d = torch.stack([case.context_lens, case.context_lens * 0], dim=-1)
    q_wide = torch.cat([q, q * 0], dim=-1)[..., :64]  # last dim still stride 1, rows strided
    out = paged_attention_decode(
        q_wide, case.key_cache, case.value_cache, wide[..., 0], lens_2d[:, 0]
    )
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    cu = torch.tensor([[0, 9], [1, 9], [3, 9], [4, 9]], dtype=torch.int32, device=DEVICE)[:, 0]
    prefill = paged_attention_prefill(
        torch.cat([q_wide, q_wide])[[0, 3, 4, 5]], case.key_cache, case.value_cache,
        wide[..., 0], cu, lens_2d[:, 0],
    )  # fmt: skip
    assert_close(prefill[[0, 2, 3]], expected)


def test_sharp_softmax_in_the_test_data():
    """The queries are scaled so one key dominates: a masking slip moves the output visibly."""
    case = make_case([300], 16, 1, 64)
    q = make_queries(1, 1, 64)
    scores = (q[0, 0] @ case.keys[0][:, 0].T) / 8  # (300,) with the default scale 1/sqrt(64)
    assert torch.softmax(scores.float(), dim=0).max() > 30 / 300  # 30x the uniform weight
