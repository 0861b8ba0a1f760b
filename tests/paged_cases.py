"""Random paged KV caches for the attention tests (imported as ``from paged_cases import ...``).

The caches are built to make mistakes loud:

- physical blocks are handed out in a shuffled order, so a kernel that ignores the block table
  (or reads block ``i`` for logical block ``i``) reads someone else's K/V;
- every slot no sequence uses -- the empty tail of a last block, the spare blocks -- holds NaN,
  so a kernel that reads one token past a sequence's end (even if it then masks the score)
  returns NaN instead of a slightly wrong number;
- block-table entries past a sequence's length hold ids outside the cache, so a kernel that loads
  them reads out of bounds (and the reference's value checks would refuse them if it looked);
- the queries are scaled up so the softmax is far from uniform: a masking or rescaling mistake
  cannot hide in an average.
"""

import os
from dataclasses import dataclass

import torch

from kernels import paged_attention_decode
from pagedlearn.attention import paged_attention_ref

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRETED else "cpu"
TOL = {  # (atol, rtol) against the float32 references; fp16/bf16 round their outputs
    torch.float32: (1e-5, 1e-5),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (2e-2, 2e-2),
}


@dataclass
class PagedCase:
    key_cache: torch.Tensor  # (num_blocks, block_size, num_kv_heads, head_dim)
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # (num_seqs, max_blocks) int32, padded with out-of-range ids
    context_lens: torch.Tensor  # (num_seqs,) int32
    keys: list  # per sequence, the contiguous (context_len, num_kv_heads, head_dim) keys
    values: list


def make_case(
    context_lens, block_size, num_kv_heads, head_dim, dtype=torch.float32, seed=0, spare=3
) -> PagedCase:
    """Scatter random K/V for sequences of ``context_lens`` tokens over shuffled physical blocks."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + spare
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"))  # poison in every slot no sequence uses
    value_cache = torch.full(shape, float("nan"))
    order = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(context_lens), max([*blocks_per_seq, 1])), num_blocks + 7)
    keys, values, next_block = [], [], 0
    for i, n in enumerate(context_lens):
        ids = order[next_block : next_block + blocks_per_seq[i]]
        next_block += blocks_per_seq[i]
        tables[i, : len(ids)] = ids
        k = torch.randn(n, num_kv_heads, head_dim, generator=g)
        v = torch.randn(n, num_kv_heads, head_dim, generator=g)
        for t in range(n):
            key_cache[ids[t // block_size], t % block_size] = k[t]
            value_cache[ids[t // block_size], t % block_size] = v[t]
        keys.append(k.to(dtype))
        values.append(v.to(dtype))
    return PagedCase(
        key_cache.to(dtype).to(DEVICE),
        value_cache.to(dtype).to(DEVICE),
        tables.to(torch.int32).to(DEVICE),
        torch.tensor(context_lens, dtype=torch.int32, device=DEVICE),
        [k.to(DEVICE) for k in keys],
        [v.to(DEVICE) for v in values],
    )


def make_queries(num_tokens, num_heads, head_dim, dtype=torch.float32, seed=1, sharpness=4.0):
    """Random queries; ``sharpness`` scales them so the softmax concentrates on a few keys."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=g) * sharpness
    return q.to(dtype).to(DEVICE)


def context_lens_for(block_size: int) -> list[int]:
    """The lengths that catch off-by-ones: 1, a block minus one, a block plus one, long, odd."""
    return sorted({1, max(block_size - 1, 1), block_size + 1, 300, 37})


def assert_close(actual, expected):
    atol, rtol = TOL[expected.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


def decode_both(lens, block_size, heads, kv_heads, head_dim, dtype, num_splits=1, seed=0):
    """(kernel output, reference output) for decode over a fresh random case."""
    case = make_case(lens, block_size, kv_heads, head_dim, dtype, seed=seed)
    q = make_queries(len(lens), heads, head_dim, dtype, seed=seed + 1)
    args = (q, case.key_cache, case.value_cache, case.block_tables, case.context_lens)
    return paged_attention_decode(*args, num_splits=num_splits), paged_attention_ref(*args)
